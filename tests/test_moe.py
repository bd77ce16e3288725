"""kernels.moe: routing, permute/unpermute, the grouped GEMMs (forward, transposed, SwiGLU, dW) and
the MoE layer's forward and gradients against fp32 references, in the interpreter; bad input.

Routing cases cover odd token counts, empty experts (skewed routing, and more experts than token
copies), a single expert, top-k 1 and 8, and both weight layouts. Inputs sit inside NaN-poisoned
buffers (``conftest.guarded``): a kernel that reads one element outside its tensor changes the
answer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from kernels import device, moe
from tests.conftest import guarded

# The interpreter's tests run on a GPU too (make gpu-test): the launchers refuse CPU tensors there.
DEV = device.DEVICE

# (tokens, K, N, n_experts, top_k, n_empty): odd sizes; skew leaves n_empty experts without rows
GEMM_CASES = [
    (13, 40, 24, 6, 2, 2),
    (1, 19, 33, 1, 1, 0),  # a single expert, a single row
    (9, 17, 20, 16, 8, 4),  # top-8 over 16 experts, 4 of them empty
    (23, 33, 7, 5, 1, 1),  # top-1; N narrower than a tile
    (2, 16, 16, 12, 3, 0),  # 6 copies for 12 experts: at least 6 empty
]


def _routing(T, E, k, n_empty, seed=0):
    return moe.skewed_routing(T, E, k, zipf=0.7, n_empty=n_empty, seed=seed, device=DEV)


def _sorted_input(T, K, E, k, n_empty, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids, w = _routing(T, E, k, n_empty, seed)
    x = torch.randn(T, K, generator=g).to(DEV).to(dtype)
    x_sorted, offsets = moe.permute_ref(x, ids, E)
    return x, ids, w, guarded(x_sorted), guarded(offsets, fill=2**30)


# ----------------------------------------------------------------------------- routing


@pytest.mark.parametrize("scoring", moe.routing.SCORINGS)
@pytest.mark.parametrize("norm_topk", [True, False])
def test_route_picks_top_scores_and_normalises(scoring, norm_topk):
    logits = torch.randn(11, 9, generator=torch.Generator().manual_seed(1)).to(DEV)
    ids, w = moe.route(logits, 3, scoring, norm_topk)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (11, 3)
    scores = torch.softmax(logits, -1) if scoring == "softmax" else torch.sigmoid(logits)
    top = scores.topk(3, -1)
    assert torch.equal(ids.long(), top.indices)
    want = top.values / top.values.sum(-1, keepdim=True) if norm_topk else top.values
    torch.testing.assert_close(w, want)


def test_route_bias_changes_the_choice_not_the_weights():
    logits = torch.zeros(4, 5, device=DEV)
    logits[:, 0] = 1.0
    bias = torch.tensor([-10.0, 0.0, 0.0, 0.0, 5.0], device=DEV)
    ids, w = moe.route(logits, 1, "sigmoid", norm_topk=False, bias=bias)
    assert (ids == 4).all()
    torch.testing.assert_close(
        w, torch.full((4, 1), 0.5, device=DEV)
    )  # sigmoid(0): the unbiased score


def test_skewed_routing_is_seeded_and_skewed():
    ids, w = moe.skewed_routing(400, 32, 4, zipf=1.0, n_empty=5, seed=3, device=DEV)
    again, _ = moe.skewed_routing(400, 32, 4, zipf=1.0, n_empty=5, seed=3, device=DEV)
    assert torch.equal(ids, again)
    c = moe.counts(ids, 32)
    assert (c == 0).sum() >= 5 and c.max() > 3 * c.float().mean()
    torch.testing.assert_close(w.sum(-1), torch.ones(400, device=DEV))
    s = moe.MODEL_SHAPES["deepseek-v3"]
    assert (s.hidden, s.expert_width, s.n_experts, s.top_k, s.scoring) == (
        7168, 2048, 256, 8, "sigmoid"
    )  # fmt: skip
    assert moe.MODEL_SHAPES["mixtral-8x7b"].expert_params() == 3 * 8 * 4096 * 14336


# ----------------------------------------------------------------------------- permute / unpermute


@pytest.mark.parametrize("T, D, E, k, n_empty", [(13, 40, 6, 2, 2), (1, 7, 1, 1, 0),
                                                 (9, 65, 16, 8, 4), (31, 33, 5, 3, 0)])  # fmt: skip
def test_permute_unpermute_round_trip(T, D, E, k, n_empty):
    ids, w = _routing(T, E, k, n_empty)
    x = guarded(torch.randn(T, D, device=DEV))
    x_sorted, offsets, h = moe.permute(x, ids, E)
    x_ref, off_ref = moe.permute_ref(x, ids, E)
    assert torch.equal(x_sorted, x_ref) and torch.equal(offsets, off_ref)
    assert torch.equal(offsets[1:] - offsets[:-1], moe.counts(ids, E).int())
    # sorted_pos inverts the sort: every copy of token t sits in a row holding x[t]
    assert torch.equal(x_sorted[h.sorted_pos.long()], x[:, None, :].expand(T, k, D))
    torch.testing.assert_close(moe.unpermute(x_sorted, h), x * k)
    y = guarded(torch.randn(T * k, D, device=DEV))
    torch.testing.assert_close(moe.unpermute(y, h, w), moe.unpermute_ref(y, h, w))
    # the combine's backward: one pass gives both gradients
    yr, wr = y.clone().requires_grad_(), w.clone().requires_grad_()
    g = torch.randn(T, D, device=DEV)
    moe.unpermute_ref(yr, h, wr).backward(g)
    gy, gw = moe.unpermute_backward(g, y, h, w)
    torch.testing.assert_close(gy, yr.grad)
    torch.testing.assert_close(gw, wr.grad)


def test_permute_of_no_tokens():
    x_sorted, offsets, h = moe.permute(
        torch.randn(0, 8, device=DEV), torch.zeros(0, 2, dtype=torch.int32, device=DEV), 4
    )
    assert x_sorted.shape == (0, 8) and offsets.tolist() == [0] * 5
    assert moe.unpermute(x_sorted, h, torch.zeros(0, 2, device=DEV)).shape == (0, 8)


# ----------------------------------------------------------------------------- grouped GEMMs


@pytest.mark.parametrize("T, K, N, E, k, n_empty", GEMM_CASES)
@pytest.mark.parametrize("trans_b", [False, True])
def test_grouped_matmul(T, K, N, E, k, n_empty, trans_b):
    _, _, _, x_sorted, offsets = _sorted_input(T, K, E, k, n_empty)
    w = torch.randn(E, K, N, device=DEV)
    if trans_b:  # the nn.Linear layout [E, N, K]: a transposed view, read in place
        w = w.transpose(1, 2).contiguous()
    y = moe.grouped_matmul(x_sorted, guarded(w), offsets, trans_b=trans_b)
    ref = moe.grouped_matmul_ref(x_sorted, w, offsets, trans_b)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(moe.grouped_matmul_loop(x_sorted, w, offsets, trans_b), ref)


@pytest.mark.parametrize("T, K, N, E, k, n_empty", GEMM_CASES[:3])
@pytest.mark.parametrize("trans_b", [False, True])
def test_grouped_matmul_dw(T, K, N, E, k, n_empty, trans_b):
    _, _, _, x_sorted, offsets = _sorted_input(T, K, E, k, n_empty)
    dy = guarded(torch.randn(x_sorted.shape[0], N, device=DEV))
    dw = moe.grouped_matmul_dw(x_sorted, dy, offsets, trans_b)
    ref = moe.grouped_matmul_dw_ref(x_sorted, dy, offsets, trans_b)
    assert dw.shape == ((E, N, K) if trans_b else (E, K, N))
    torch.testing.assert_close(dw, ref, rtol=1e-5, atol=1e-5)
    empty = (offsets[1:] == offsets[:-1]).nonzero().flatten()
    assert (dw[empty] == 0).all()  # an expert without rows has a zero gradient, not garbage


def test_grouped_matmul_strided_and_fp16_inputs():
    T, K, N, E, k = 11, 48, 40, 5, 2
    _, _, _, x_sorted, offsets = _sorted_input(T, K, E, k, 1)
    wide = torch.randn(x_sorted.shape[0], 2 * K, device=DEV)
    wide[:, ::2] = x_sorted
    x_view = wide[:, ::2]  # K stride 2: any strides, no copy
    w = torch.randn(E, N, K, device=DEV).transpose(1, 2)  # [E, K, N] view of an [E, N, K] tensor
    torch.testing.assert_close(moe.grouped_matmul(x_view, w, offsets),
                               moe.grouped_matmul_ref(x_sorted, w, offsets), rtol=1e-5, atol=1e-5)  # fmt: skip
    xh, wh = x_sorted.half(), (w * 0.2).half()
    y = moe.grouped_matmul(xh, wh, offsets)
    assert y.dtype == torch.float16
    # fp32 accumulation, one rounding to fp16 (half an ulp: 2^-11 = 4.9e-4 relative)
    torch.testing.assert_close(
        y.float(), moe.grouped_matmul_ref(xh, wh, offsets), rtol=1e-3, atol=1e-3
    )


@pytest.mark.parametrize("trans_b", [False, True])
def test_grouped_swiglu_fuses_gate_and_up(trans_b):
    T, K, N, E, k = 13, 40, 24, 6, 2
    _, _, _, x_sorted, offsets = _sorted_input(T, K, E, k, 2)
    shape = (E, N, K) if trans_b else (E, K, N)
    wg, wu = torch.randn(shape, device=DEV), torch.randn(shape, device=DEV)
    h, g, u = moe.grouped_swiglu(x_sorted, wg, wu, offsets, trans_b, save_preact=True)
    g_ref = moe.grouped_matmul_ref(x_sorted, wg, offsets, trans_b)
    u_ref = moe.grouped_matmul_ref(x_sorted, wu, offsets, trans_b)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(u, u_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, F.silu(g_ref) * u_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(moe.grouped_swiglu(x_sorted, wg, wu, offsets, trans_b), h)


@pytest.mark.parametrize("trans_b", [False, True])
def test_swiglu_backward_epilogue_and_accumulate(trans_b):
    T, D, F_, E, k = 13, 24, 40, 6, 2
    _, _, _, dy, offsets = _sorted_input(T, D, E, k, 2)
    g_, u_ = torch.randn(dy.shape[0], F_, device=DEV), torch.randn(dy.shape[0], F_, device=DEV)
    w_down = torch.randn((E, D, F_) if trans_b else (E, F_, D), device=DEV)
    dg, du = moe.grouped_swiglu_backward(dy, w_down, guarded(g_), guarded(u_), offsets, trans_b)
    dh = moe.grouped_matmul_ref(dy, w_down, offsets, not trans_b)
    gr, ur = g_.clone().requires_grad_(), u_.clone().requires_grad_()
    (F.silu(gr) * ur).backward(dh)
    torch.testing.assert_close(dg, gr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(du, ur.grad, rtol=1e-5, atol=1e-5)
    out = torch.randn(dy.shape[0], F_, device=DEV)
    want = out + dh
    assert moe.grouped_matmul_add_(out, dy, w_down, offsets, not trans_b) is out
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gate must be \\[M, F\\]"):
        moe.grouped_swiglu_backward(dy, w_down, g_[:, :5].contiguous(), u_, offsets, trans_b)
    with pytest.raises(ValueError, match="out must be \\[M, N\\]"):
        moe.grouped_matmul_add_(out[:3], dy, w_down, offsets, not trans_b)


def test_accumulate_adds_once_when_the_autotuner_reruns_it(monkeypatch):
    """On a GPU the autotuner times every config on a shape's first call, running the kernel many
    times on the real arguments: ``out += x @ w`` must still add once (the autotuner's hooks). The
    interpreter has one config, so two are forced here and timed by a stub that runs each 3x."""
    tuned = moe.grouped._grouped_mm_tuned
    one = tuned.configs[0]
    two = triton.Config(dict(one.kwargs), num_warps=2 * one.num_warps, num_stages=one.num_stages)

    def bench(kernel_call, quantiles=None):
        for _ in range(3):
            kernel_call()
        return [1.0, 1.0, 1.0]

    monkeypatch.setattr(tuned, "configs", [one, two])
    monkeypatch.setattr(tuned, "cache", {})
    monkeypatch.setitem(tuned.__dict__, "do_bench", bench)  # (a cached_property on the class)
    T, D, F_, E, k = 13, 24, 40, 6, 2
    _, _, _, dy, offsets = _sorted_input(T, D, E, k, 2)
    w_down = torch.randn(E, D, F_, device=DEV)
    out = torch.randn(dy.shape[0], F_, device=DEV)
    want = out + moe.grouped_matmul_ref(dy, w_down, offsets)
    moe.grouped_matmul_add_(out, dy, w_down, offsets)
    assert len(tuned.cache) == 1  # the autotuner did run its two configs
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_no_rows_and_torch_grouped_mm():
    w = torch.randn(3, 8, 5, device=DEV)
    empty = moe.grouped_matmul(
        torch.randn(0, 8, device=DEV), w, torch.zeros(4, dtype=torch.int32, device=DEV)
    )
    assert empty.shape == (0, 5)
    dw = moe.grouped_matmul_dw(
        torch.randn(0, 8, device=DEV),
        torch.randn(0, 5, device=DEV),
        torch.zeros(4, dtype=torch.int32, device=DEV),
    )
    assert dw.shape == (3, 8, 5) and (dw == 0).all()
    # torch._grouped_mm: present in this PyTorch (2.13) and runs on the CPU; it agrees with ours
    assert moe.torch_grouped_mm_available("cpu", torch.float32) == hasattr(torch, "_grouped_mm")
    if moe.torch_grouped_mm_available(DEV, torch.float32):
        _, _, _, x_sorted, offsets = _sorted_input(13, 40, 6, 2, 2)
        w = torch.randn(6, 40, 24, device=DEV)
        torch.testing.assert_close(moe.grouped_matmul_torch(x_sorted, w, offsets),
                                   moe.grouped_matmul_ref(x_sorted, w, offsets), rtol=1e-5, atol=1e-5)  # fmt: skip


# ----------------------------------------------------------------------------- the layer

# (tokens, D, F, n_experts, top_k, scoring, norm_topk, trans_b, router bias: None or n_empty)
LAYER_CASES = [
    (13, 24, 20, 6, 2, "softmax", True, False, None),  # Mixtral-like routing
    (9, 16, 12, 16, 8, "sigmoid", True, True, None),  # DeepSeek-like: sigmoid, top-8, Linear layout
    (7, 20, 17, 1, 1, "softmax", True, False, None),  # a single expert
    (11, 16, 24, 8, 4, "softmax", False, False, 3),  # Qwen-like (no renormalisation), 3 empty
]


def _layer_inputs(T, D, F_, E, trans_b, n_empty, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_shape = (E, F_, D) if trans_b else (E, D, F_)
    down_shape = (E, D, F_) if trans_b else (E, F_, D)
    ins = [
        torch.randn(T, D, generator=g).to(DEV),
        torch.randn(E, D, generator=g).to(DEV) * D**-0.5,
        torch.randn(gate_shape, generator=g).to(DEV) * D**-0.5,
        torch.randn(gate_shape, generator=g).to(DEV) * D**-0.5,
        torch.randn(down_shape, generator=g).to(DEV) * F_**-0.5,
    ]
    bias = (
        None
        if n_empty is None
        else moe.skewed_bias(E, zipf=0.5, n_empty=n_empty, seed=seed).to(DEV)
    )
    return ins, bias


@pytest.mark.parametrize("T, D, F_, E, k, scoring, norm, trans_b, n_empty", LAYER_CASES)
def test_moe_layer_forward_and_gradients(T, D, F_, E, k, scoring, norm, trans_b, n_empty):
    ins, bias = _layer_inputs(T, D, F_, E, trans_b, n_empty)
    kw = dict(top_k=k, scoring=scoring, norm_topk=norm, trans_b=trans_b, router_bias=bias)
    ours = [t.clone().requires_grad_() for t in ins]
    refs = [t.clone().requires_grad_() for t in ins]
    out = moe.moe_layer(*ours, **kw)
    ref = moe.moe_layer_ref(*refs, **kw)
    assert out.dtype == torch.float32 and out.shape == (T, D)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn(T, D, generator=torch.Generator().manual_seed(9)).to(DEV)
    out.backward(grad)
    ref.backward(grad)
    for name, a, b in zip(("x", "router_w", "w_gate", "w_up", "w_down"), ours, refs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    if E > 1:  # the router learns: its gradient is not zero
        assert ours[1].grad.abs().sum() > 0


def test_moe_layer_without_grad_and_partial_grads():
    ins, _ = _layer_inputs(10, 16, 12, 4, False, None)
    with torch.no_grad():
        out = moe.moe_layer(*ins, top_k=2)
    torch.testing.assert_close(out, moe.moe_layer_ref(*ins, top_k=2), rtol=1e-5, atol=1e-5)
    w_down = ins[4].clone().requires_grad_()  # only one weight trains
    moe.moe_layer(*ins[:4], w_down, top_k=2).sum().backward()
    ref = ins[4].clone().requires_grad_()
    moe.moe_layer_ref(*ins[:4], ref, top_k=2).sum().backward()
    torch.testing.assert_close(w_down.grad, ref.grad, rtol=1e-4, atol=1e-5)


def test_loop_baseline_backward_stacks_expert_gradients_once():
    # w[e] in a loop would make autograd write a full-size zero gradient per expert (SelectBackward);
    # the baseline unbinds the weights, whose backward stacks the experts' gradients once.
    ins, _ = _layer_inputs(10, 16, 12, 4, False, None)
    leaves = [t.clone().requires_grad_() for t in ins]
    out = moe.moe_layer_loop(*leaves, top_k=2)
    seen, todo = set(), [out.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo += [n for n, _ in node.next_functions]
    names = {type(n).__name__ for n in seen}
    assert "UnbindBackward0" in names and "SelectBackward0" not in names, names


def test_autotuner_restores_the_accumulator_between_timed_runs():
    # On a GPU the autotuner runs each config many times on the caller's tensors; with ACCUMULATE
    # (y += x @ w) its hooks must put y back after every run, and leave other variants alone.
    tuner = moe.grouped._grouped_mm_tuned
    y = torch.arange(6.0)
    for accumulate in (True, False):
        nargs = {"y_ptr": y, "ACCUMULATE": accumulate}
        tuner.pre_hook(nargs)
        y.add_(1.0)  # what one timed run of an accumulating kernel does
        tuner.post_hook(nargs, exception=None)
        want = torch.arange(6.0) + (0.0 if accumulate else 1.0)
        torch.testing.assert_close(y, want)
    tuner.pre_hook({"y_ptr": y, "ACCUMULATE": True}, reset_only=True)  # after tuning: no copy
    assert not moe.grouped._accumulator


# ----------------------------------------------------------------------------- bad input


def test_bad_routing_and_permute_input():
    x, ids = torch.randn(4, 8, device=DEV), torch.zeros(4, 2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="top_k must be at most n_experts"):
        moe.route(torch.randn(4, 3, device=DEV), 4)
    with pytest.raises(ValueError, match="scoring must be one of"):
        moe.route(torch.randn(4, 3, device=DEV), 1, "relu")
    with pytest.raises(ValueError, match="bias must be"):
        moe.route(torch.randn(4, 3, device=DEV), 1, bias=torch.zeros(4, device=DEV))
    with pytest.raises(ValueError, match=r"expert_ids holds expert 4, outside \[0, n_experts\)"):
        moe.permute(
            x, torch.tensor([[0, 1], [4, 0], [1, 1], [2, 3]], dtype=torch.int32, device=DEV), 4
        )
    with pytest.raises(ValueError, match="expert_ids holds expert -1"):
        moe.permute(x, torch.full((4, 2), -1, dtype=torch.int32, device=DEV), 4)
    with pytest.raises(ValueError, match="expert_ids must have one row per token"):
        moe.permute(x, torch.zeros(3, 2, dtype=torch.int32, device=DEV), 4)
    with pytest.raises(TypeError, match="expert_ids must have dtype"):
        moe.permute(x, ids.float(), 4)
    with pytest.raises(TypeError, match="x must have dtype"):
        moe.permute(x.int(), ids, 4)
    with pytest.raises(ValueError, match="n_experts must be a positive int"):
        moe.permute(x, ids, 0)
    x_sorted, _, h = moe.permute(x, ids, 4)
    with pytest.raises(ValueError, match="y_sorted must have n_tokens \\* top_k = 8 rows"):
        moe.unpermute(x_sorted[:7], h)
    with pytest.raises(ValueError, match="weights must be \\[n_tokens, top_k\\]"):
        moe.unpermute(x_sorted, h, torch.ones(4, 3, device=DEV))
    with pytest.raises(TypeError, match="weights must have dtype"):
        moe.unpermute(x_sorted, h, torch.ones(4, 2, dtype=torch.float64, device=DEV))
    with pytest.raises(TypeError, match="handle must be the Permutation"):
        moe.unpermute(x_sorted, "handle")


def test_bad_grouped_matmul_input():
    x, w = torch.randn(6, 8, device=DEV), torch.randn(3, 8, 5, device=DEV)
    offs = torch.tensor([0, 2, 2, 6], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="offsets must have n_experts \\+ 1 = 4 entries"):
        moe.grouped_matmul(x, w, offs[:3])
    with pytest.raises(ValueError, match="offsets must start at 0 and end at the number of rows"):
        moe.grouped_matmul(x, w, torch.tensor([0, 2, 2, 5], dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="offsets must start at 0"):
        moe.grouped_matmul(x, w, torch.tensor([1, 2, 2, 6], dtype=torch.int32, device=DEV))
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):
        moe.grouped_matmul(x, w, torch.tensor([0, 4, 2, 6], dtype=torch.int32, device=DEV))
    with pytest.raises(TypeError, match="offsets must have dtype"):
        moe.grouped_matmul(x, w, offs.long())
    with pytest.raises(ValueError, match="weights must be \\[E, K, N\\] with K = x_sorted.shape"):
        moe.grouped_matmul(x, torch.randn(3, 7, 5, device=DEV), offs)
    with pytest.raises(ValueError, match="weights must be \\[E, N, K\\]"):
        moe.grouped_matmul(x, w, offs, trans_b=True)
    with pytest.raises(ValueError, match="weights must be 3-D"):
        moe.grouped_matmul(x, w[0], offs)
    with pytest.raises(TypeError, match="x_sorted and weights must have the same dtype"):
        moe.grouped_matmul(x, w.double().float().half(), offs)
    with pytest.raises(TypeError, match="x_sorted must have dtype"):
        moe.grouped_matmul(x.long(), w, offs)
    with pytest.raises(ValueError, match="dy_sorted must have x_sorted's 6 rows"):
        moe.grouped_matmul_dw(x, torch.randn(5, 5, device=DEV), offs)
    with pytest.raises(ValueError, match="w_gate and w_up must have the same shape"):
        moe.grouped_swiglu(x, w, torch.randn(3, 8, 4, device=DEV), offs)


def test_bad_layer_input():
    ins, _ = _layer_inputs(5, 8, 6, 4, False, None)
    x, router_w, wg, wu, wd = ins
    with pytest.raises(ValueError, match="w_gate must be \\[n_experts, D, F\\]"):
        moe.moe_layer(x, router_w, wg[:, :7], wu[:, :7], wd, 2)
    with pytest.raises(ValueError, match="w_down must be"):
        moe.moe_layer(x, router_w, wg, wu, wd[:, :5], 2)
    with pytest.raises(ValueError, match="router_w must be \\[n_experts, D\\]"):
        moe.moe_layer(x, router_w[:3], wg, wu, wd, 2)
    with pytest.raises(TypeError, match="x and w_down must have the same dtype"):
        moe.moe_layer(x, router_w, wg, wu, wd.half(), 2)
    with pytest.raises(ValueError, match="top_k must be a positive int"):
        moe.moe_layer(x, router_w, wg, wu, wd, 0)
    with pytest.raises(ValueError, match="router_bias must be"):
        moe.moe_layer(x, router_w, wg, wu, wd, 1, router_bias=torch.zeros(3, device=DEV))


def test_moe_benchmark_runs_in_quick_mode():
    from kernels import bench

    recs = bench.BENCHMARKS["moe"](True)
    variants = {r["variant"] for r in recs}
    assert {
        "grouped_mm-triton-skewed",
        "layer-fwdbwd-triton-skewed",
        "permute-triton-skewed",
    } <= variants
    for r in recs:
        assert r["bench"] == "moe" and r["ms"] > 0 and r["ceiling"]
        if "triton" in r["variant"]:
            assert r["baseline"] and r["baseline_ms"] > 0  # (speedups round to 0 here)


# ----------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("trans_b", [False, True])
def test_bf16_grouped_gemms_on_gpu(trans_b):
    # bf16 tensor cores at a mid-sized skewed case (64 experts, some empty), against fp32.
    T, K, N, E, k = 1031, 512, 384, 64, 4
    ids, _ = moe.skewed_routing(T, E, k, zipf=0.7, n_empty=6, seed=2, device="cuda")
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    x_sorted, offsets, _ = moe.permute(x, ids, E)
    shape = (E, N, K) if trans_b else (E, K, N)
    w = torch.randn(shape, device="cuda", dtype=torch.bfloat16) * K**-0.5
    y = moe.grouped_matmul(x_sorted, w, offsets, trans_b=trans_b)
    torch.testing.assert_close(y.float(), moe.grouped_matmul_ref(x_sorted, w, offsets, trans_b),
                               rtol=2e-2, atol=2e-2)  # fmt: skip
    dy = torch.randn(x_sorted.shape[0], N, device="cuda", dtype=torch.bfloat16)
    dw = moe.grouped_matmul_dw(x_sorted, dy, offsets, trans_b)
    ref = moe.grouped_matmul_dw_ref(x_sorted, dy, offsets, trans_b)
    assert ((dw.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_moe_layer_bf16_and_cuda_graph_on_gpu():
    from tests.conftest import eager_and_graphed

    ins, bias = _layer_inputs(517, 256, 192, 32, False, 3)
    ins = [t.cuda().to(torch.bfloat16) for t in ins]
    kw = dict(top_k=4, router_bias=bias.cuda())
    with torch.no_grad():
        ref = moe.moe_layer_ref(*ins, **kw)
        eager, graphed = eager_and_graphed(lambda: moe.moe_layer(*ins, **kw))
    assert ((eager.float() - ref).norm() / ref.norm()).item() < 2e-2
    torch.testing.assert_close(graphed, eager)  # no host sync, no value read on the host


# Compiles with the real compiler (no GPU needed): TRITON_INTERPRET=0 in a child process.
PTX_SCRIPT = r"""
import json
from kernels import launch
from kernels.moe import grouped
cases = [
    (grouped._mm_spec("bf16", False, False), ("stride_xk", "stride_wn", "stride_w2n", "stride_yn")),
    (grouped._mm_spec("bf16", True, True), ("stride_xk", "stride_wn", "stride_w2n", "stride_yn")),
    (grouped._dw_spec("bf16"), ("stride_ak", "stride_bn", "stride_cn")),
]
out = {}
for spec, unit in cases:
    ptx = launch.ptx_as_launched(spec, unit)
    swiglu = "+swiglu" if spec["constexprs"].get("SWIGLU") else ""
    out[spec["kernel"].fn.__name__ + swiglu] = {
        "b16_loads": ptx.count("ld.global.b16"), "cp_async": ptx.count("cp.async.cg.shared.global")
    }
print(json.dumps(out))
"""


def test_sm90_build_loads_every_operand_in_16_byte_vectors():
    # The first H100 run measured the grouped GEMM at 4-6% of peak: its weight columns were clamped
    # to N - 1, which hid their contiguity, and every weight element became a 2-byte load
    # (ld.global.b16). Both kernels must copy their 16-bit operands 16 bytes at a time (cp.async).
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", PTX_SCRIPT], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name, c in json.loads(proc.stdout.splitlines()[-1]).items():
        assert c["b16_loads"] == 0, f"{name}: {c['b16_loads']} 2-byte scalar loads of an operand"
        assert c["cp_async"] > 0, f"{name}: operands not copied asynchronously"


def test_fp32_builds_one_small_tile_on_a_gpu(monkeypatch):
    # fp32's full-precision dots are FMAs: a 128-wide tile took ptxas minutes per config (the GPU
    # suite stalled), so a GPU gets one 64 x 64 tile; bf16/fp16 keep the list, SWIGLU its pruned one.
    from kernels.moe import grouped

    monkeypatch.setattr(grouped.device, "INTERPRET", False)
    configs = grouped._autotune_configs(grouped._GPU_DW_CONFIGS, grouped._CPU_DW_CONFIG,
                                        ("BLOCK_M", "BLOCK_N", "BLOCK_R"))  # fmt: skip
    (only,) = grouped._prune(configs, {}, FP32_EXACT=True)
    assert only.kwargs == {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_R": 32}
    assert (only.num_warps, only.num_stages) == (4, 2)
    assert grouped._prune(configs, {}, FP32_EXACT=False) == configs
    kept = grouped._prune(configs, {"SWIGLU": True}, FP32_EXACT=False)
    assert kept and all(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128 for c in kept)
