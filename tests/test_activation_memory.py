"""Activation memory of the course's decoder in training, measured with saved-tensor hooks on the
CPU, against the closed form for this decoder; recomputation; the counter itself."""

from __future__ import annotations

import pytest
import torch

from kernels import activation_memory as AM
from kernels import decoder as dec
from kernels import device
from kernels import perfmodel as pm

# (s, b, h, heads, kv heads, d_ff, dtype): odd sequence lengths, GQA and MHA, bf16 and fp32.
CASES = [
    (24, 2, 128, 2, 1, 320, torch.bfloat16),
    (17, 3, 128, 4, 2, 352, torch.bfloat16),
    (40, 1, 64, 1, 1, 160, torch.float32),
]


def _model(h, a, g, f, dtype, layers=3):
    cfg = pm.TransformerConfig(
        "t", d_model=h, n_layers=layers, n_heads=a, n_kv_heads=g, d_ff=f, vocab=64
    )
    return cfg, dec.Decoder(cfg, dtype=dtype, device="cpu")


@pytest.mark.parametrize("s, b, h, a, g, f, dtype", CASES)
def test_measured_bytes_match_the_closed_form(s, b, h, a, g, f, dtype):
    cfg, model = _model(h, a, g, f, dtype)
    tokens = torch.randint(cfg.vocab, (b, s), generator=torch.Generator().manual_seed(s))
    got = {rc: AM.measure(model, tokens, rc) for rc in AM.RECOMPUTE}
    for rc, m in got.items():
        closed = AM.decoder_layer_bytes(cfg, s, b, dtype, rc)
        assert len(m.per_layer) == cfg.n_layers
        for i, measured in enumerate(m.per_layer):
            # The first layer to rotate q and k also holds the batch's rotary rows (shared).
            extra = AM.rope_table_bytes(cfg, s, b, dtype) if i == 0 and rc != "full" else 0
            assert measured == closed + extra, (rc, i, measured, closed)  # exact on the CPU
    none, sel, full = (got[rc].per_layer[1] for rc in AM.RECOMPUTE)
    e = torch.empty((), dtype=dtype).element_size()
    # Selective recomputation of a FlashAttention-style core saves only its fp32 log-sum-exp;
    # full recomputation keeps exactly each layer's input.
    assert none - sel == 4 * s * b * a
    assert full == e * s * b * h
    # Recomputation changes nothing outside the layers (the embedding's indices, the head's input).
    assert got["none"].head == got["full"].head > 0 and got["none"].embed == b * s * 8


def test_paper_reference_point():
    # The paper's GPT layer (2-byte activations, LayerNorm, GELU 4h, dropout, materialised
    # scores) is the reference point: the planner's formula, by hand.
    cfg = pm.TransformerConfig(
        "t", d_model=8, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=32, vocab=8
    )
    assert AM.paper_layer_bytes(cfg, 4, 1) == 4 * 8 * (34 + 5 * 2 * 4 / 8)
    assert AM.paper_layer_bytes(cfg, 4, 1, "selective") == 34 * 4 * 8
    assert AM.paper_layer_bytes(cfg, 4, 1, "full") == 2 * 4 * 8


def test_closed_form_by_hand_and_fused_norm():
    cfg = pm.TransformerConfig(
        "t", d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=16, vocab=8
    )
    s, b, e = 3, 1, 2  # bf16; head dim 4
    norm = (8 + e) * s * b * 8 + 4 * s * b
    attn = e * s * 4 * 3 + e * s * 4 * 4 + e * s * 8 + 4 * s * 2
    assert AM.decoder_layer_bytes(cfg, s, b) == 2 * norm + attn + 4 * e * s * 16
    fused = AM.decoder_layer_bytes(cfg, s, b, norm="fused")
    assert AM.decoder_layer_bytes(cfg, s, b) - fused == 2 * (8 + e - 2 * e) * s * b * 8
    with pytest.raises(ValueError, match="recompute must be one of"):
        AM.decoder_layer_bytes(cfg, s, b, recompute="some")
    with pytest.raises(ValueError, match="norm must be one of"):
        AM.decoder_layer_bytes(cfg, s, b, norm="layer")


def test_counter_dedupes_storage_and_skips_parameters():
    w = torch.nn.Parameter(torch.randn(6, 6))
    x = torch.randn(5, 6, requires_grad=True)
    counter = AM.SavedTensorCounter(exclude=[w])
    with counter:
        counter.label = "a"
        y = x @ w  # saves x and w: w is excluded
        z = y[:, :3].exp() * y[:, 3:].sigmoid()  # exp and sigmoid save their outputs; mul both
        counter.label = "b"
        u = (y * y).sum()  # saves y (first seen under "b")
    (z.sum() + u).backward()
    assert counter.bytes["a"] == 5 * 6 * 4 + 2 * (5 * 3 * 4)  # x; exp and sigmoid outputs
    assert counter.bytes["b"] == 5 * 6 * 4 and counter.total == sum(counter.bytes.values())
    assert counter.by_producer == {"input": 5 * 6 * 4, "Exp": 60, "Sigmoid": 60, "Mm": 120}
    # A view saved keeps its whole base: counted at the base's size, once.
    base = torch.randn(10, 4, requires_grad=True) * 1.0
    c2 = AM.SavedTensorCounter()
    with c2:
        (base[:2] * base[2:4]).sum()
    assert c2.total == 10 * 4 * 4


def test_forward_train_matches_the_inference_path_and_bad_input():
    cfg, model = _model(64, 1, 1, 96, torch.float32, layers=2)
    tokens = torch.randint(cfg.vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    ref = model.forward_full(tokens)
    AM.trainable(model)
    for rc in AM.RECOMPUTE:
        torch.testing.assert_close(AM.forward_train(model, tokens, rc).detach(), ref)
    with pytest.raises(ValueError, match="recompute must be one of"):
        AM.forward_train(model, tokens, "everything")
    with pytest.raises(ValueError, match="tokens must be an int64"):
        AM.forward_train(model, tokens.float())


def test_recompute_gives_the_same_gradients():
    cfg, model = _model(64, 2, 1, 96, torch.float32, layers=2)
    AM.trainable(model)
    tokens = torch.randint(cfg.vocab, (1, 7), generator=torch.Generator().manual_seed(1))
    grads = {}
    for rc in AM.RECOMPUTE:
        model.zero_grad()
        AM.forward_train(model, tokens, rc).logsumexp(-1).mean().backward()
        grads[rc] = [p.grad.clone() for p in model.parameters()]
    for rc in ("selective", "full"):
        for g, r in zip(grads[rc], grads["none"]):
            torch.testing.assert_close(g, r)


def test_planner_decoder_form_with_tp_and_sp():
    from kernels import planner as P

    f = P.decoder_activation_bytes_per_layer
    s, b, h, a, g, ffn = 16, 2, 64, 8, 4, 176
    one = f(s, b, h, a, g, ffn)
    norms = 2 * (2 * 2 * s * b * h + 4 * s * b)  # fused RMSNorm: input, output, rstd
    # TP divides everything but the norms; SP the norms too.
    assert f(s, b, h, a, g, ffn, t=4) == pytest.approx(norms + (one - norms) / 4)
    assert f(s, b, h, a, g, ffn, t=4, sp=True) == pytest.approx(one / 4)
    assert f(s, b, h, a, g, ffn, t=4, sp=True, recompute="full") == 2 * s * b * h / 4
    assert one - f(s, b, h, a, g, ffn, recompute="selective") == 4 * s * b * a
    # The planner uses it for Model(activations="decoder"): layers x per layer + the logits.
    model = P.Model("m", 3, h, a, g, ffn, 100, s, activations="decoder")
    mem = P.memory(model, P.Parallel(tp=2, sp=True, micro_batch=b), 1, recompute="selective")
    per_layer = f(s, b, h, a, g, ffn, t=2, sp=True, recompute="selective")
    assert mem["activations"] == pytest.approx(3 * per_layer + b * s * 100 / 2 * (2 + 4))
    paper = P.memory(P.Model("m", 3, h, a, g, ffn, 100, s), P.Parallel(micro_batch=b), 1)
    assert paper["activations"] != P.memory(model, P.Parallel(micro_batch=b), 1)["activations"]
    with pytest.raises(ValueError, match="model.activations must be one of"):
        P.Model("m", 3, h, a, g, ffn, 100, s, activations="measured")
    with pytest.raises(ValueError, match="norm must be 'fused' or 'composite'"):
        f(s, b, h, a, g, ffn, norm="layer")


@pytest.mark.parametrize("norm", AM.NORMS)
def test_layer_terms_add_up_to_the_closed_form(norm):
    cfg = pm.TransformerConfig(
        "t", d_model=96, n_layers=1, n_heads=6, n_kv_heads=2, d_ff=200, vocab=8
    )
    s, b, e = 13, 3, 2
    for rc in AM.RECOMPUTE:
        terms = AM.decoder_layer_terms(cfg, s, b, torch.bfloat16, rc, norm)
        assert sum(terms.values()) == AM.decoder_layer_bytes(cfg, s, b, torch.bfloat16, rc, norm)
        if rc == "full":
            assert terms == {"layer input": e * s * b * 96}
        else:
            assert list(terms) == ["norms", "attention", "log-sum-exp", "MLP"]
            assert terms["log-sum-exp"] == (4 * s * b * 6 if rc == "none" else 0)
            assert terms["MLP"] == 4 * e * s * b * 200
    # The planner's terms, with tensor and sequence parallelism, add up to its total too.
    from kernels import planner as P

    for t, sp in ((1, False), (2, False), (2, True), (3, True)):
        got = P.decoder_activation_terms(s, b, 96, 6, 2, 200, t, sp, norm=norm)
        total = P.decoder_activation_bytes_per_layer(s, b, 96, 6, 2, 200, t, sp, norm=norm)
        assert sum(got.values()) == pytest.approx(total, rel=1e-12)
        assert got["norms"] == pytest.approx(
            P.decoder_activation_terms(s, b, 96, 6, 2, 200, norm=norm)["norms"] / (t if sp else 1)
        )
    with pytest.raises(ValueError, match="norm must be one of"):
        AM.decoder_layer_terms(cfg, s, b, norm="layer")


def test_profile_step_on_the_cpu():
    cfg, model = _model(64, 2, 1, 96, torch.bfloat16, layers=3)
    tokens = torch.randint(cfg.vocab, (2, 11), generator=torch.Generator().manual_seed(2))
    for rc in AM.RECOMPUTE:
        row = AM.profile_step(model, tokens, rc, time_step=rc == "none")
        m = AM.measure(model, tokens, rc)
        assert row["recompute"] == rc and row["saved_per_layer"] == m.per_layer
        assert (row["saved_embed"], row["saved_head"]) == (m.embed, m.head)
        closed = AM.decoder_layer_bytes(cfg, 11, 2, torch.bfloat16, rc, "composite")
        assert row["closed_composite"] == closed == row["saved_per_layer"][-1]  # exact on a CPU
        assert row["closed_fused"] == AM.decoder_layer_bytes(
            cfg, 11, 2, torch.bfloat16, rc, "fused"
        )
        assert row["paper"] == AM.paper_layer_bytes(cfg, 11, 2, rc)
        assert row["rope_tables"] == AM.rope_table_bytes(cfg, 11, 2)
        assert "allocated_per_layer" not in row  # the allocator's view needs CUDA tensors
        assert ("step_ms" in row) == (rc == "none")
    assert row["closed_composite"] == 2 * 11 * 2 * 64  # full: the layer input, bf16
    assert AM.profile_step(model, tokens, "none")["step_ms"] > 0
    assert all(p.grad is None for p in model.parameters())  # the timed steps' gradients dropped


@pytest.mark.gpu
@pytest.mark.skipif(not device.GPU_MODE, reason="needs a GPU")
def test_profile_step_allocator_on_a_gpu():
    # Layers past the first leave allocated what they save (their output replaces their input):
    # within 10% of the closed form the counter matches, and never less than the counter.
    cfg = pm.TransformerConfig(
        "t", d_model=512, n_layers=3, n_heads=4, n_kv_heads=1, d_ff=1376, vocab=512
    )
    model = AM.trainable(dec.Decoder(cfg, dtype=torch.bfloat16, device="cuda", max_position=1024))
    tokens = torch.randint(cfg.vocab, (1, 1024), device="cuda")
    for rc in AM.RECOMPUTE:
        row = AM.profile_step(model, tokens, rc, time_step=False)
        saved = row["saved_per_layer"][-1]
        closed = min((row["closed_composite"], row["closed_fused"]), key=lambda c: abs(c - saved))
        assert saved == pytest.approx(closed, rel=0.10), (rc, saved, closed)
        for alloc, peak in zip(row["allocated_per_layer"][1:], row["peak_per_layer"][1:]):
            assert alloc == pytest.approx(closed, rel=0.10), (rc, alloc, closed)
            assert peak >= alloc
        assert row["step_peak_bytes"] >= row["fwd_peak_bytes"] >= row["fwd_held_bytes"] > 0
