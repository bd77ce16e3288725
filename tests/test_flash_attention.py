import math

import pytest
import torch
from conftest import eager_and_graphed, guarded

from kernels import device, replay
from kernels import flash_attention as fa

# Triton's interpreter computes bf16 wrongly (a known limitation): bf16 is checked on GPUs only.
DTYPES = [torch.float16] + ([torch.bfloat16] if device.GPU_MODE else [])
# Sequence lengths that are not multiples of any block (1, 17, 100, 130) next to one that is (64);
# the GPU adds lengths that span many tiles.
SEQS = [1, 17, 64, 100, 130] + ([1000, 4097] if device.GPU_MODE else [])
# Relative error (Frobenius norm) against the fp32 reference. One rounding of the output is ~5e-4
# (fp16) or ~4e-3 (bf16); P rounded to 16 bits before P·V and the gradient matmuls add a few more.
TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _inputs(b, h, n_q, n_kv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n_q, d, generator=g).to(device.DEVICE, dtype)
    k = torch.randn(b, h, n_kv, d, generator=g).to(device.DEVICE, dtype)
    v = torch.randn(b, h, n_kv, d, generator=g).to(device.DEVICE, dtype)
    return q, k, v


def _check_fwd_bwd(q, k, v, causal, backward="two_kernels"):
    dtype = q.dtype
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = fa.attention(qg, kg, vg, causal, backward=backward)
    assert out.shape == q.shape and out.dtype == dtype
    qr, kr, vr = (x.float().requires_grad_() for x in (q, k, v))
    ref = fa.attention_ref(qr, kr, vr, causal)
    assert _rel_err(out, ref) < TOL[dtype]

    do = torch.randn_like(out)
    out.backward(do)
    ref.backward(do.float())
    for name, ours, theirs in (("dq", qg, qr), ("dk", kg, kr), ("dv", vg, vr)):
        assert ours.grad.dtype == dtype, name
        if theirs.grad.norm() == 0:  # dq with a single key: softmax of one score is constant,
            # so the exact gradient is 0; ours is dP - delta, two fp32 sums in different orders.
            assert ours.grad.float().abs().max() < 1e-4, name
        else:
            assert _rel_err(ours.grad, theirs.grad) < TOL[dtype], name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n", SEQS)
def test_matches_fp32_reference_d64(n, causal, dtype):
    _check_fwd_bwd(*_inputs(1, 2, n, n, 64, dtype, seed=n), causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n", [17, 130])
def test_matches_fp32_reference_d128(n, causal, dtype):
    _check_fwd_bwd(*_inputs(2, 1, n, n, 128, dtype, seed=n), causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_q, n_kv", [(17, 130), (130, 33), (1, 100)])
def test_different_query_and_key_lengths(n_q, n_kv, dtype):
    _check_fwd_bwd(*_inputs(1, 2, n_q, n_kv, 64, dtype, seed=n_q + n_kv), causal=False)


# The atomic-dQ backward: the same gradients from one pass over key tiles. Lengths inside one tile
# and across several (every query row then gets adds from several key tiles), causal and not,
# queries and keys of different lengths, both head dims.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "n, d",
    [(1, 64), (17, 64), (130, 64), (130, 128)]
    + ([(1000, 128), (4097, 64)] if device.GPU_MODE else []),
)
def test_atomic_dq_backward_matches_fp32_reference(n, d, causal, dtype):
    _check_fwd_bwd(*_inputs(1, 2, n, n, d, dtype, seed=n + d), causal, backward="atomic_dq")


@pytest.mark.parametrize("n_q, n_kv", [(17, 130), (130, 33)])
def test_atomic_dq_backward_different_lengths(n_q, n_kv):
    q, k, v = _inputs(1, 2, n_q, n_kv, 64, torch.float16, seed=n_q * n_kv)
    _check_fwd_bwd(q, k, v, False, backward="atomic_dq")


def test_atomic_dq_matches_two_kernel_backward():
    # The two backwards differ only in how dQ is summed: dK and dV are the same bits, dQ close.
    q, k, v = _inputs(1, 2, 130, 130, 64, torch.float16, seed=3)
    grads = {}
    for mode in fa.BACKWARDS:
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        fa.attention(qg, kg, vg, True, backward=mode).backward(torch.ones_like(q))
        grads[mode] = (qg.grad, kg.grad, vg.grad)
    (dq2, dk2, dv2), (dqa, dka, dva) = grads["two_kernels"], grads["atomic_dq"]
    assert torch.equal(dk2, dka) and torch.equal(dv2, dva)
    assert _rel_err(dqa, dq2) < 2e-3


def test_rejects_unknown_backward():
    q, k, v = _inputs(1, 1, 8, 8, 64, torch.float16)
    with pytest.raises(ValueError, match="backward must be one of"):
        fa.attention(q, k, v, backward="atomic")


def test_sm_scale_and_lse():
    q, k, v = _inputs(1, 2, 70, 70, 64, torch.float16, seed=3)
    out, lse = fa.attention_with_lse(q, k, v, sm_scale=0.3)
    ref = fa.attention_ref(q, k, v, sm_scale=0.3)
    assert _rel_err(out, ref) < TOL[torch.float16]
    s = (q.float() @ k.float().transpose(-2, -1)) * 0.3
    torch.testing.assert_close(lse, torch.logsumexp(s, dim=-1), rtol=1e-3, atol=1e-3)


def test_rows_are_convex_combinations_of_values():
    # A property no implementation bug is likely to keep: with v = 1 every output is exactly 1,
    # and with one key every output row is that key's value.
    q, k, _ = _inputs(1, 2, 100, 100, 64, torch.float16, seed=4)
    ones = torch.ones_like(k)
    assert torch.allclose(fa.attention(q, k, ones, causal=True).float(), ones.float(), atol=1e-3)
    one = k[:, :, :1].contiguous()
    torch.testing.assert_close(fa.attention(q, one, one), one.expand_as(q), rtol=1e-3, atol=1e-3)


def test_naive_matches_reference_and_memory_formula():
    q, k, v = _inputs(1, 2, 100, 100, 64, torch.float16, seed=5)
    for causal in (False, True):
        assert (
            _rel_err(fa.naive_attention(q, k, v, causal), fa.attention_ref(q, k, v, causal)) < 5e-3
        )
    b, h, n, d = 2, 16, 4096, 128
    scores = 2 * b * h * n * n * 2  # S and P in bf16
    assert fa.naive_extra_bytes(b, h, n, n, d, torch.bfloat16) == scores
    # When the output outweighs a score matrix (N < D), P and the output set the peak.
    assert fa.naive_extra_bytes(1, 1, 8, 8, 128, torch.bfloat16) == 8 * 8 * 2 + 8 * 128 * 2
    assert fa.flash_extra_bytes(b, h, n, d, torch.bfloat16) == b * h * n * (d * 2 + 4)
    assert fa.fwd_flops(b, h, n, n, d, causal=True) == 2 * b * h * n * n * d
    assert fa.bwd_flops(b, h, n, n, d) == 2.5 * 4 * b * h * n * n * d


def test_empty_batch():
    q = torch.zeros(0, 2, 8, 64, device=device.DEVICE, dtype=torch.float16)
    assert fa.attention(q, q, q).shape == q.shape


def _t(*shape, dtype=torch.float16):
    return torch.zeros(*shape, dtype=dtype, device=device.DEVICE)


@pytest.mark.parametrize(
    "q, k, v, kw, err, match",
    [
        (_t(1, 2, 8, 64, dtype=torch.float32), _t(1, 2, 8, 64), _t(1, 2, 8, 64), {}, TypeError, "q must have dtype"),
        (_t(1, 2, 8, 64), _t(1, 2, 8, 64, dtype=torch.bfloat16), _t(1, 2, 8, 64, dtype=torch.bfloat16), {}, TypeError, "same dtype"),
        (_t(1, 2, 8, 80), _t(1, 2, 8, 80), _t(1, 2, 8, 80), {}, ValueError, "head_dim must be one of"),
        (_t(1, 2, 8, 256), _t(1, 2, 8, 256), _t(1, 2, 8, 256), {}, ValueError, "head_dim must be one of"),
        (_t(2, 8, 64), _t(2, 8, 64), _t(2, 8, 64), {}, ValueError, "q must be 4-D"),
        (_t(1, 2, 8, 64), _t(1, 2, 8, 64), _t(1, 2, 9, 64), {}, ValueError, "same shape"),
        (_t(1, 2, 8, 64), _t(1, 3, 8, 64), _t(1, 3, 8, 64), {}, ValueError, "same batch and heads"),
        (_t(1, 2, 8, 64), _t(1, 2, 8, 128), _t(1, 2, 8, 128), {}, ValueError, "same head_dim"),
        (_t(1, 2, 8, 64), _t(1, 2, 9, 64), _t(1, 2, 9, 64), {"causal": True}, ValueError, "Nq == Nk"),
        (_t(1, 2, 8, 64), _t(1, 2, 0, 64), _t(1, 2, 0, 64), {}, ValueError, "at least one key"),
        (_t(1, 2, 8, 64), _t(1, 2, 8, 64), _t(1, 2, 8, 64), {"sm_scale": -1.0}, ValueError, "sm_scale"),
        (_t(1, 2, 8, 64), _t(1, 2, 8, 64), _t(1, 2, 8, 64), {"sm_scale": math.inf}, ValueError, "finite positive"),
        (_t(1, 2, 8, 64), _t(1, 2, 8, 64), _t(1, 2, 8, 64), {"sm_scale": math.nan}, ValueError, "finite positive"),
        (_t(1, 2, 8, 64), _t(1, 2, 8, 64), _t(1, 2, 8, 64), {"causal": 1}, TypeError, "causal must be a bool"),
        (_t(1, 2, 64, 8).transpose(2, 3), _t(1, 2, 8, 64), _t(1, 2, 8, 64), {}, ValueError, "q must be contiguous"),
        ([0.0], _t(1, 2, 8, 64), _t(1, 2, 8, 64), {}, TypeError, "q must be a torch.Tensor"),
        (_t(32768, 2, 1, 64), _t(32768, 2, 1, 64), _t(32768, 2, 1, 64), {}, ValueError, "batch \\* heads must be at most 65,535"),
    ],
)  # fmt: skip
def test_rejects_bad_input(q, k, v, kw, err, match):
    with pytest.raises(err, match=match):
        fa.attention(q, k, v, **kw)


# The causal mask needs Nq == Nk: it is tried on the square case only.
@pytest.mark.parametrize(
    "n_q, n_kv, causal", [(17, 17, False), (17, 17, True), (33, 70, False), (70, 33, False)]
)
def test_reads_nothing_outside_its_inputs(n_q, n_kv, causal):
    """Out-of-bounds detection: q, k, v, the output gradient all inside NaN-filled buffers (one
    batch and head, so the poison sits right after each tensor's last row). A kernel that reads a
    row past Nq or Nk (a dropped mask) sees NaN: outputs and gradients must equal, bit for bit,
    those on clean inputs."""
    q, k, v = _inputs(1, 1, n_q, n_kv, 64, torch.float16, seed=n_q + n_kv)
    do = torch.randn_like(q)

    def run(q, k, v, do):
        qg, kg, vg = (x.requires_grad_() for x in (q, k, v))
        out = fa.attention(qg, kg, vg, causal)
        out.backward(do)
        return out.detach(), qg.grad, kg.grad, vg.grad

    clean = run(q.clone(), k.clone(), v.clone(), do)
    poisoned = run(guarded(q), guarded(k), guarded(v), guarded(do))
    for name, a, b in zip(("out", "dq", "dk", "dv"), clean, poisoned):
        assert torch.equal(a, b), name


def test_sdpa_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        fa.sdpa(_t(1, 1, 8, 64), _t(1, 1, 8, 64), _t(1, 1, 8, 64), backend="fast")


@pytest.mark.skipif(not device.GPU_MODE, reason="needs a GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_long_sequence_bf16_against_sdpa(causal):
    # At a size the autotuner picks real tiles for: our error is no worse than a small multiple of
    # the error of SDPA's own flash backend, both measured against fp32.
    q, k, v = _inputs(2, 4, 2048, 2048, 128, torch.bfloat16, seed=7)
    ref = fa.attention_ref(q, k, v, causal)
    ours = _rel_err(fa.attention(q, k, v, causal), ref)
    theirs = _rel_err(
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal), ref
    )
    assert ours < 2 * theirs + 1e-3
    assert not math.isnan(ours)


@pytest.mark.skipif(
    not (device.GPU_MODE and fa.tma_available(torch.zeros(1, device=device.DEVICE))),
    reason="needs TMA (Hopper+)",
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n, d", [(130, 64), (1000, 128), (4097, 128)])
def test_tma_and_pointer_paths_agree(n, d, causal):
    q, k, v = _inputs(2, 3, n, n, d, torch.bfloat16, seed=n)
    ref = fa.attention_ref(q, k, v, causal)
    a = fa.attention(q, k, v, causal, tma=True)
    b = fa.attention(q, k, v, causal, tma=False)
    assert _rel_err(a, ref) < TOL[torch.bfloat16] and _rel_err(b, ref) < TOL[torch.bfloat16]
    # Same arithmetic in the same order; only the tile shapes the autotuner picks may differ.
    assert _rel_err(a, b) < 1e-2


@pytest.mark.skipif(device.GPU_MODE, reason="the interpreter's check (GPU: the test above)")
@pytest.mark.parametrize("causal, n_q, n_kv, d", [(False, 45, 70, 64), (True, 33, 33, 128)])
def test_tma_forward_in_the_interpreter(monkeypatch, causal, n_q, n_kv, d):
    """The forward's TMA path (K and V through tensor descriptors, their block shapes set per
    configuration by a pre-hook) in Triton's interpreter, fp16: lengths that end inside a tile,
    causal and not. (The atomic backward's TMA reduction has no interpreter support: GPU only.)"""
    monkeypatch.setattr(fa, "tma_available", lambda *tensors: True)
    q, k, v = _inputs(1, 2, n_q, n_kv, d, torch.float16, seed=n_q)
    o, lse = fa._forward(q, k, v, causal, d**-0.5, tma=True)
    ref = fa.attention_ref(q, k, v, causal)
    assert _rel_err(o, ref) < TOL[torch.float16]
    _, lse_pointer = fa._forward(q, k, v, causal, d**-0.5, tma=False)
    torch.testing.assert_close(lse, lse_pointer, rtol=0, atol=1e-4)


@pytest.mark.skipif(device.GPU_MODE, reason="CPU-only check")
def test_tma_needs_a_hopper_gpu():
    q = _t(1, 2, 8, 64)
    with pytest.raises(ValueError, match="TMA"):
        fa.attention(q, q, q, tma=True)


@pytest.mark.parametrize("available", [False, True])
def test_tma_by_default_for_tuned_problems_only(monkeypatch, available):
    """Left to the default, TMA serves the problems large enough to autotune where it can run;
    fast-path problems read K/V through pointers. An explicit choice is kept (or refused)."""
    monkeypatch.setattr(fa, "tma_available", lambda *tensors: available)
    k = v = _t(1, 1, 8, 64)
    assert fa._use_tma(None, k, v, fast=False) is available
    assert fa._use_tma(None, k, v, fast=True) is False
    assert fa._use_tma(False, k, v, fast=False) is False
    if available:
        assert fa._use_tma(True, k, v, fast=True) is True
    else:
        with pytest.raises(ValueError, match="tma=True"):
            fa._use_tma(True, k, v, fast=True)


@pytest.mark.skipif(device.GPU_MODE, reason="the interpreter's check (GPU: the test below)")
@pytest.mark.parametrize("backward", fa.BACKWARDS)
@pytest.mark.parametrize("causal, n_q, n_kv, d", [(False, 45, 70, 64), (True, 33, 33, 128)])
def test_fast_path_launches_in_the_interpreter(monkeypatch, causal, n_q, n_kv, d, backward):
    """The fixed-tile launches of the fast path (``_fast_fwd``, ``_fast_bwd``: the grids and tiles
    the GPU launches and kernels.replay's plans copy), run in the interpreter, fp16."""
    monkeypatch.setattr(fa, "_fast", lambda tune: True)
    q, k, v = _inputs(1, 2, n_q, n_kv, d, torch.float16, seed=n_kv)
    do = torch.randn_like(q)
    o, lse = fa._forward(q, k, v, causal, d**-0.5, tma=False)
    grads = fa._backward(q, k, v, o, lse, do, causal, d**-0.5, backward)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref = fa.attention_ref(*leaves, causal)
    assert _rel_err(o, ref) < TOL[torch.float16]
    for g, r in zip(grads, torch.autograd.grad(ref, leaves, do.float())):
        assert _rel_err(g, r) < TOL[torch.float16]  # as the backward's own test


def test_only_default_options_take_the_cpp_launch_path():
    """kernels.replay keys a plan by the layout, ``causal`` (the op) and the scale (the setting):
    any other option, or a setting it could not key exactly, takes the Python path."""
    assert fa._replayable(False, None, None, "two_kernels", "auto")
    assert fa._replayable(True, 0.125, None, "two_kernels", "auto")
    assert fa._replayable(True, 1, None, "two_kernels", "auto")
    for args in [(1, None, None, "two_kernels", "auto"), (False, True, None, "two_kernels", "auto"),
                 (False, "0.1", None, "two_kernels", "auto"), (False, None, False, "two_kernels", "auto"),
                 (False, None, None, "atomic_dq", "auto"), (False, None, None, "two_kernels", "triton")]:  # fmt: skip
        assert not fa._replayable(*args), args
    for bad_scale in (0.0, 0, -1.0, -0.0, float("nan")):  # 0 would name the default's plan
        assert not fa._replayable(False, bad_scale, None, "two_kernels", "auto"), bad_scale
    assert replay.scale_setting(None) == 0.0 and replay.scale_setting(2) == 2.0


def test_attention_skips_autograd_without_grad(monkeypatch):
    """A call no gradient follows (inference, or inputs that need none) skips autograd's
    bookkeeping, microseconds of host time a call, and gives the same output."""
    q, k, v = _inputs(1, 2, 40, 40, 64, torch.float16)
    tracked = fa.attention(q.clone().requires_grad_(), k, v)
    assert tracked.grad_fn is not None

    def forbidden(*args):
        raise AssertionError("autograd's Function ran for a call no gradient follows")

    monkeypatch.setattr(fa.FlashAttention, "apply", forbidden)
    plain = fa.attention(q, k, v)
    assert plain.grad_fn is None and torch.equal(plain, tracked.detach())
    with torch.no_grad():
        assert fa.attention(q.clone().requires_grad_(), k, v).grad_fn is None


@pytest.mark.skipif(not device.GPU_MODE, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_graph_capture(causal):
    q, k, v = _inputs(2, 3, 130, 130, 64, torch.float16)
    with torch.no_grad():
        eager, graphed = eager_and_graphed(lambda: fa.attention(q, k, v, causal))
    assert torch.equal(eager, graphed)


def test_tuning_choice_is_in_every_autotune_key():
    """The autotuner keeps one tile per key; a key without the problem's size class let the first
    call of a length (a batch-1 check: SMALL) choose for a training batch at that length."""
    for kernel in (fa._attn_fwd_kernel, fa._attn_bwd_dkdv_kernel, fa._attn_bwd_dq_kernel):
        assert "TUNE" in kernel.keys, kernel.fn.__name__
    assert not fa._tune_all(1, 8192, 8192)  # 2**26: SMALL
    assert fa._tune_all(64, 2048, 2048)  # 2**28: every TUNED candidate is timed


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kernel", ["fwd", "bwd"])
def test_pruner_follows_the_tune_flag(kernel, d):
    """Large problems are timed over every TUNED tile that fits; small ones get one tile, the first
    fitting SMALL one (``_small_tile``, which the fast path launches without the autotuner)."""
    import triton

    tuned, small, resident, streamed, n_resident = {
        "fwd": (fa._FWD_TUNED, fa._FWD_SMALL, "BLOCK_M", "BLOCK_N", 1),
        "bwd": (fa._BWD_TUNED, fa._BWD_SMALL, "BLOCK_N", "BLOCK_M", 2),
    }[kernel]
    configs = [
        triton.Config({resident: r, streamed: st}, num_warps=w, num_stages=s)
        for r, st, w, s in dict.fromkeys(tuned + small)
    ]
    prune = fa._pruner(resident, streamed, tuned, small, n_resident)

    def tiles(tune):
        kept = prune(configs, {}, HEAD_DIM=d, TUNE=tune)
        return [fa._tile(c, resident, streamed) for c in kept]

    # What fits this GPU's shared memory (everything in the interpreter; not all of it on a T4).
    fits = {
        fa._tile(c, resident, streamed)
        for c in configs
        if fa._fits_smem(c, resident, streamed, n_resident, d)
    }
    # Where no TUNED tile fits (the backward's on a small GPU), a large problem gets the small one.
    assert tiles(True) == ([t for t in tuned if t in fits] or tiles(False))
    assert tiles(False) == [t for t in small if t in fits][:1]
    if kernel == "fwd" and d == 64:
        assert len(tiles(True)) > 1  # a large problem is timed over several candidates


@pytest.mark.skipif(not device.GPU_MODE, reason="the fast path launches on a GPU only")
@pytest.mark.parametrize("tma", [False, True])
# The causal mask needs Nq == Nk: it is tried on the square case only.
@pytest.mark.parametrize(
    "n_q, n_kv, d, causal", [(130, 130, 64, False), (130, 130, 64, True), (77, 200, 128, False)]
)
def test_fast_path_matches_the_autotuned_launch(monkeypatch, n_q, n_kv, d, causal, tma):
    """A small problem's forward and backward go through ``_FAST`` (no autotuner, no per-call
    binding) and give the very bits of the autotuner's launch, which picks the same tile."""
    if tma and not fa.tma_available(torch.zeros(1, device=device.DEVICE)):
        pytest.skip("needs TMA (Hopper+)")
    q, k, v = _inputs(1, 3, n_q, n_kv, d, torch.bfloat16, seed=n_q)
    do = torch.randn_like(q)
    scale = d**-0.5
    assert not fa._tune_all(3, n_q, n_kv)
    for launcher in fa._FAST.values():
        launcher.cache.clear()
    fast = fa._forward(q, k, v, causal, scale, tma=tma)
    fast += fa._backward(q, k, v, *fast, do, causal, scale)
    assert all(launcher.cache for launcher in fa._FAST.values())  # each kernel took the path
    monkeypatch.setattr(fa, "_fast", lambda tune: False)
    slow = fa._forward(q, k, v, causal, scale, tma=tma)
    slow += fa._backward(q, k, v, *slow, do, causal, scale)
    for name, a, b in zip(("o", "lse", "dq", "dk", "dv"), fast, slow):
        assert torch.equal(a, b), name
