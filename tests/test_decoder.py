import dataclasses

import pytest
import torch

from kernels import decoder as dec
from kernels import device
from kernels import perfmodel as pm

SMALL = dataclasses.replace(dec.TINY, name="small", n_layers=3)
# Logits of a forward with a cache against the forward without one, relative to the logits' size:
# fp32 differs only in summation order; fp16 rounds K, V, P and every activation.
TOL = {torch.float32: 1e-5, torch.float16: 2e-2}


def _model(dtype=torch.float32, cfg=SMALL, **kw):
    return dec.Decoder(cfg, dtype=dtype, device=device.DEVICE, **kw)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _tokens(b, t, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(vocab, (b, t), generator=g).to(device.DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("attention", ["triton", "torch"])
def test_cache_matches_full_forward(dtype, attention):
    """Prefill 10 tokens, extend by 5 (a chunked prefill), then decode 6 one at a time, for two
    sequences in swapped cache slots with 8-token blocks: every logit equals the cache-free
    forward's."""
    m = _model(dtype)
    m.decode_attention = attention
    toks = _tokens(2, 21, SMALL.vocab)
    full = m.forward_full(toks)
    cache = m.new_cache(3, 32, block_size=8)
    slots = torch.tensor([2, 0], device=device.DEVICE)

    def run(lo, hi):
        start = torch.full((2,), lo, device=device.DEVICE)
        return m(toks[:, lo:hi], cache, slots, start, all_logits=True)

    got = [run(0, 10), run(10, 15)] + [run(i, i + 1) for i in range(15, 21)]
    assert _rel(torch.cat(got, 1), full) < TOL[dtype]


def test_sequences_of_different_lengths_in_one_decode_step():
    m = _model()
    a, b = _tokens(1, 9, SMALL.vocab, 1), _tokens(1, 4, SMALL.vocab, 2)
    cache = m.new_cache(2, 16, block_size=4)
    zero = torch.zeros(1, dtype=torch.long, device=device.DEVICE)
    m(a[:, :-1], cache, zero, zero)
    m(b[:, :-1], cache, zero + 1, zero)
    # One step for both: sequence 0 has 8 cached tokens, sequence 1 has 3.
    step = m(
        torch.cat([a[:, -1:], b[:, -1:]]),
        cache,
        torch.tensor([0, 1], device=device.DEVICE),
        torch.tensor([8, 3], device=device.DEVICE),
    )
    assert _rel(step[0], m.forward_full(a)[0, -1]) < 1e-5
    assert _rel(step[1], m.forward_full(b)[0, -1]) < 1e-5


def test_generate_is_greedy():
    m = _model()
    prompt = _tokens(2, 6, SMALL.vocab, 3)
    out = m.generate(prompt, 7)
    # Teacher forcing: each generated token is the argmax of the full forward at its position.
    logits = m.forward_full(torch.cat([prompt, out], 1))
    assert torch.equal(logits[:, 5:-1].argmax(-1), out)


def test_graphed_step_matches_eager():
    m = _model()
    cache = m.new_cache(2, 16)
    slots = torch.arange(2, device=device.DEVICE)
    step = dec.GraphedDecodeStep(m, cache, slots)
    tokens = torch.tensor([3, 5], device=device.DEVICE)
    start = torch.tensor([0, 0], device=device.DEVICE)
    got = step(tokens, start).clone()
    want = m(tokens[:, None], cache, slots, start).argmax(-1)
    assert torch.equal(got, want)


def test_truncated_draft_shares_weights_and_tail_scale():
    cfg = dataclasses.replace(SMALL, n_layers=4)
    target = _model(cfg=cfg, tail_from=2, tail_scale=0.0)
    draft = target.truncated(2)
    assert draft.cfg.n_layers == 2 and draft.layers[1] is target.layers[1]
    assert draft.lm_head.data_ptr() == target.lm_head.data_ptr()
    toks = _tokens(1, 12, cfg.vocab, 4)
    # Tail layers add nothing at scale 0: the target computes the draft's function.
    torch.testing.assert_close(target.forward_full(toks), draft.forward_full(toks))
    other = _model(cfg=cfg, tail_from=2, tail_scale=0.5)
    assert torch.equal(other.layers[3].wqkv, target.layers[3].wqkv)  # only the outputs scale
    assert torch.equal(other.layers[3].wo, 0.5 * _model(cfg=cfg).layers[3].wo)
    assert not torch.allclose(other.forward_full(toks), draft.forward_full(toks))


def test_sizes_and_costs():
    cfg = dec.BRRR_2B
    assert cfg.head_dim == 128 and abs(cfg.params / 1.68e9 - 1) < 0.01
    assert pm.kv_bytes_per_token(cfg) == 2 * 8 * 8 * 128 * 2  # 32 KiB per token in bf16
    m = _model(cfg=SMALL)
    assert m.weight_bytes() == SMALL.params * 4  # every parameter, fp32
    pre = dec.prefill_cost(cfg, 2, 100)
    assert pre.flops == pm.prefill(cfg, 2, 100).flops - 2 * cfg.vocab * cfg.d_model * 2 * 99
    assert dec.decode_cost(cfg, 4, 1000) == pm.decode_step(cfg, 4, 1000)


def test_bad_input():
    m = _model()
    cache = m.new_cache(1, 8)
    zero = torch.zeros(1, dtype=torch.long, device=device.DEVICE)
    with pytest.raises(ValueError, match="int64"):
        m(torch.zeros(1, 2, device=device.DEVICE), cache, zero, zero)
    with pytest.raises(ValueError, match="slots"):
        m(torch.zeros(1, 2, dtype=torch.long, device=device.DEVICE), cache, zero[:0], zero)
    with pytest.raises(ValueError, match="layers"):
        m(
            torch.zeros(1, 1, dtype=torch.long, device=device.DEVICE),
            _model(cfg=dec.TINY).new_cache(1, 8),
            zero,
            zero,
        )
    with pytest.raises(TypeError, match="dtype"):
        dec.Decoder(SMALL, dtype=torch.int8, device=device.DEVICE)
    with pytest.raises(ValueError, match="tail_from"):
        dec.Decoder(SMALL, device=device.DEVICE, tail_from=9)
    with pytest.raises(ValueError, match="n_layers"):
        m.truncated(0)
    with pytest.raises(ValueError, match="max_new"):
        m.generate(_tokens(1, 3, SMALL.vocab), 0)
