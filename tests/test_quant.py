import math

import numpy as np
import pytest
import torch
from conftest import eager_and_graphed, guarded

from kernels import device, quant

DEV = device.DEVICE
# Triton's interpreter computes bf16 wrongly (a known limitation): bf16 is checked on GPUs only.
DTYPES = [torch.float16] + ([torch.bfloat16] if device.GPU_MODE else [])
# (bits, group_size): int8 per channel and grouped, int4 grouped and per channel.
SCHEMES = [(8, None), (8, 64), (4, 32), (4, 128), (4, None)]
# Small odd shapes for every scheme and dtype. A GPU autotunes every new shape (each candidate
# compiled and timed), so there it takes three of them, and the model-sized shapes with the two
# schemes models use, in bf16 (on an H100 the first 119 cases of the full cross product took 140 s).
SHAPES = [(1, 33, 256), (3, 17, 384), (5, 40, 128)] + (
    [] if device.GPU_MODE else [(16, 24, 256), (37, 65, 512)]
)
LARGE = [(1, 4100, 4096), (4, 1823, 2048), (16, 8192, 1024), (200, 1000, 2048)]


def _rel(out, ref) -> float:
    return quant.relative_error(out.float(), ref.float())


# --------------------------------------------------------------------------- quantize / dequantize


@pytest.mark.parametrize("bits, group", SCHEMES)
def test_quantize_round_trip(bits, group):
    n, k = 24, 256
    w = torch.randn(n, k) * 0.05
    qw = quant.quantize(w, bits, group)
    g = group or k
    assert qw.shape == (n, k) and qw.group_size == g and qw.bits == bits
    assert qw.scales.shape == (n, k // g) and qw.scales.dtype == torch.float16
    assert qw.data.shape == ((n, k) if bits == 8 else (n, k // 2))
    assert qw.data.dtype == (torch.int8 if bits == 8 else torch.uint8)
    q = quant.unpack(qw)
    qmax = 2 ** (bits - 1) - 1
    assert q.abs().max() <= qmax and q.abs().max() == qmax  # the absmax lands on the top level
    # Round to nearest: every value is within half a step of its group's grid.
    step = qw.scales.float().repeat_interleave(g, dim=1)
    assert ((quant.dequantize(qw) - w).abs() <= 0.5 * step + 1e-7).all()
    assert qw.nbytes == qw.data.numel() * qw.data.element_size() + 2 * qw.scales.numel()


def test_int4_packing_layout():
    # Byte j of a row: value j in the low nibble, value j + K/2 in the high one, each as q + 8.
    k = 64
    q = torch.arange(-7, 8).repeat(5)[:k].float()
    w = q[None, :].repeat(3, 1)
    qw = quant.quantize(w, 4, None)  # amax 7 -> scale 1: codes are the values themselves
    assert torch.equal(qw.scales.float(), torch.ones(3, 1))
    lo, hi = (qw.data & 0xF).int() - 8, (qw.data >> 4).int() - 8
    assert torch.equal(lo[0], q[: k // 2].int()) and torch.equal(hi[0], q[k // 2 :].int())
    assert torch.equal(quant.unpack(qw)[0].float(), q)


def test_quantize_error_shrinks_with_bits_and_groups():
    w = quant.student_t((64, 1024), df=4, seed=3)
    err = {
        s: quant.relative_error(quant.fake_quantize_weight(w, s), w) for s in quant.WEIGHT_SCHEMES
    }
    assert err["bf16"] < err["int8"] < err["int4-g32"] < err["int4-g128"] < err["int4"]
    # int8: 127 levels, a relative error of about 1%; int4 per channel on heavy tails: tens of %.
    assert 0.003 < err["int8"] < 0.03 and 0.1 < err["int4"] < 0.5


def test_zero_group_and_bytes_model():
    w = torch.zeros(4, 64)
    w[0, 5] = 1.75  # amax 1.75: scale 0.25, exact in fp16
    qw = quant.quantize(w, 4, 32)
    assert torch.equal(quant.dequantize(qw), w)  # all-zero groups get scale 1 and stay zero
    # int4, groups of 128: 4 bits plus 16 bits per 128 values = 4.125 bits per weight.
    qw = quant.quantize(torch.randn(8, 1024), 4, 128)
    assert math.isclose(qw.bits_per_weight, 4.125)
    assert quant.gemv_bytes(1, 8192, 8192, 4, 128) == 8192 * 4096 + 2 * 8192 * 64 + 2 * 8192 * 2
    assert quant.gemv_bytes(1, 8192, 8192, "bf16") == 2 * 8192 * 8192 + 4 * 8192


@pytest.mark.parametrize(
    "w, kw, err, match",
    [
        ([[1.0]], {}, TypeError, "w must be a torch.Tensor"),
        (torch.zeros(4, 64, dtype=torch.int32), {}, TypeError, "floating-point"),
        (torch.zeros(4), {}, ValueError, "w must be 2-D"),
        (torch.zeros(4, 63), {"bits": 4, "group_size": None}, ValueError, "must be even"),
        (torch.zeros(4, 64), {"bits": 3}, ValueError, "bits must be 4 or 8"),
        (torch.zeros(4, 64), {"bits": 4, "group_size": 48}, ValueError, "group_size must divide"),
        (torch.zeros(4, 96), {"bits": 4, "group_size": 48}, ValueError, "multiple of 32"),
        (torch.zeros(0, 64), {}, ValueError, "must not be empty"),
        (torch.full((2, 128), math.inf), {}, ValueError, "inf or NaN"),
    ],
)  # fmt: skip
def test_quantize_rejects_bad_input(w, kw, err, match):
    with pytest.raises(err, match=match):
        quant.quantize(w, **kw)


# --------------------------------------------------------------------------- the fused kernels


def _gemv_case(m, n, k, bits, group, dtype, path):
    if bits == 4 and group and k % group:
        pytest.skip("group does not divide K")
    if group and k % group:
        pytest.skip("group does not divide K")
    w = torch.randn(n, k, device=DEV) * 0.02
    qw = quant.quantize(w, bits, group)
    x = torch.randn(m, k, device=DEV, dtype=dtype)
    y = quant.gemv(x, qw, path=path)
    assert y.shape == (m, n) and y.dtype == dtype
    # Against dequantize(qw) @ x in fp32: the kernel's integers and scales are exact, so the only
    # differences are fp32 summation order and one rounding of the output to 16 bits.
    ref = x.float() @ quant.dequantize(qw).T
    assert _rel(y, ref) < (2e-3 if dtype is torch.float16 else 8e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits, group", SCHEMES)
@pytest.mark.parametrize("mnk", SHAPES)
def test_gemv_matches_fp32_reference(mnk, bits, group, dtype):
    _gemv_case(*mnk, bits, group, dtype, None)


@pytest.mark.skipif(not device.GPU_MODE, reason="model-sized shapes: GPU only")
@pytest.mark.parametrize("bits, group", [(4, 128), (8, None)])
@pytest.mark.parametrize("mnk", LARGE)
def test_gemv_matches_fp32_reference_at_model_sizes(mnk, bits, group):
    _gemv_case(*mnk, bits, group, torch.bfloat16, None)


@pytest.mark.parametrize("bits, group", [(4, 32), (8, None)])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_both_paths_agree_for_small_batches(m, bits, group):
    for path in ("gemv", "mma"):
        _gemv_case(m, 48, 256, bits, group, torch.float16, path)


# --------------------------------------------------------------------------- the CUDA int4 kernel


def test_repack_int4_mma_layout():
    """Every nibble of the repacked weight is the code the kernel's formula says it is."""
    n, k = 32, 384
    qw = quant.quantize(torch.randn(n, k) * 0.02, 4, 128)
    w, s = quant.repack_int4_mma(qw)
    assert w.dtype == torch.uint8 and w.numel() == n * k // 2
    assert s.shape == (n // 16, k // 128, 8, 2) and s.dtype == torch.float16
    codes = torch.cat([qw.data & 0xF, qw.data >> 4], 1).long()
    b = w.view(n // 16, k // 128, 2, 32, 4, 4).long()  # [rb, g, q, lane, word, byte]
    nib = torch.stack([b & 0xF, b >> 4], -1).flatten(-2)  # [..., word, nibble p]
    rb, g, q, lane, i, p = torch.meshgrid(
        *[torch.arange(d) for d in (n // 16, k // 128, 2, 32, 4, 8)], indexing="ij"
    )
    row = 16 * rb + lane // 4 + 8 * (p & 1)
    col = 128 * g + 16 * (4 * q + i) + 2 * (lane % 4) + (p >> 2) + 8 * ((p >> 1) & 1)
    assert torch.equal(nib, codes[row, col])
    r = torch.arange(n).view(n // 16, 2, 8).permute(0, 2, 1)  # [rb, lr, h] -> row
    assert torch.equal(s, qw.scales[r].permute(0, 3, 1, 2))
    assert quant.repack_int4_mma(qw)[0] is w  # cached on the weight


def test_int4_mma_configs_are_instantiated():
    """Every configuration quant.gemv may pick is one the .cu file compiles."""
    from kernels.cuda import _search_space

    built = set(_search_space("int4_gemv_mma.cu", "INT4_MMA_CONFIGS"))
    assert set(quant.INT4_MMA_CONFIGS) <= built, set(quant.INT4_MMA_CONFIGS) - built


def test_repack_and_cuda_path_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="int4 with groups of 128"):
        quant.repack_int4_mma(quant.quantize(torch.randn(16, 256), 8, None))
    qw = quant.quantize(torch.randn(32, 256, device=DEV) * 0.02, 4, 128)
    x = torch.randn(9, 256, device=DEV, dtype=torch.float16)
    with pytest.raises(ValueError, match="path='cuda' cannot run here"):
        quant.gemv(x, qw, path="cuda")


def test_default_path_falls_back_when_the_cuda_build_fails(monkeypatch):
    """A machine that looks able to build the CUDA kernel but fails to: warn once, serve Triton."""
    qw = quant.quantize(torch.randn(32, 256, device=DEV) * 0.02, 4, 128)
    x = torch.randn(2, 256, device=DEV, dtype=torch.float16)
    want = quant.gemv(x, qw, path="mma")

    def broken():
        raise RuntimeError("Error building extension 'gpu_brrr_int4_gemv_mma'")

    # gemv looks these up in kernels.quant.cuda_int4, their one home.
    monkeypatch.setattr(quant.cuda_int4, "_int4_mma_misfit", lambda x2, qw: None)
    monkeypatch.setattr(quant.cuda_int4, "int4_mma_unavailable", lambda: None)
    monkeypatch.setattr(quant.cuda_int4, "_int4_mma_module", broken)
    quant._int4_mma_build_error.cache_clear()
    try:
        with pytest.warns(UserWarning, match="using Triton"):
            y = quant.gemv(x, qw)
        assert torch.equal(y, want)
    finally:
        quant._int4_mma_build_error.cache_clear()


@pytest.mark.skipif(
    not device.GPU_MODE or quant.int4_mma_unavailable() is not None,
    reason="the CUDA int4 kernel needs an NVIDIA GPU (cc 8.0+) and nvcc",
)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("nk", [(32, 2048), (96, 1024), (4096, 4096)])
def test_cuda_int4_kernel_matches_reference(nk, m):
    n, k = nk
    qw = quant.quantize(torch.randn(n, k, device=DEV) * 0.02, 4, 128)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    y = quant.gemv(x, qw, path="cuda")
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    assert _rel(y, x.float() @ quant.dequantize(qw).T) < 8e-3
    assert torch.equal(quant.gemv(x, qw), y)  # the default path where it runs


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("path", ["gemv", "mma"])
def test_split_k(path, split):
    w = torch.randn(20, 512, device=DEV) * 0.02
    qw = quant.quantize(w, 4, 64)
    x = torch.randn(2, 512, device=DEV, dtype=torch.float16)
    y = quant.gemv(x, qw, path=path, split_k=split)
    assert _rel(y, quant.gemv_ref(x, qw)) < 2e-3


def test_gemv_vector_and_empty_batch():
    qw = quant.quantize(torch.randn(10, 64, device=DEV), 8, None)
    x = torch.randn(64, device=DEV, dtype=torch.float16)
    y = quant.gemv(x, qw)
    assert y.shape == (10,) and _rel(y, quant.gemv_ref(x[None], qw)[0]) < 2e-3
    assert quant.gemv(x[:0].reshape(0, 64), qw).shape == (0, 10)


def test_gemv_writes_every_output():
    # NaN-poisoned memory from a previous allocation must not survive: the kernel writes each y.
    qw = quant.quantize(torch.randn(37, 128, device=DEV), 4, 32)
    x = torch.randn(3, 128, device=DEV, dtype=torch.float16)
    torch.full((4096,), math.nan, device=DEV)  # leave NaN behind in the caching allocator
    assert torch.isfinite(quant.gemv(x, qw)).all()


@pytest.mark.parametrize(
    "x, qw, kw, err, match",
    [
        (torch.zeros(2, 64, dtype=torch.float16), "w", {}, TypeError, "qw must be a QuantizedWeight"),
        (torch.zeros(2, 64), None, {}, TypeError, "x must have dtype"),
        (torch.zeros(2, 32, dtype=torch.float16), None, {}, ValueError, "K = 32"),
        (torch.zeros(2, 2, 64, dtype=torch.float16), None, {}, ValueError, "x must be 1-D"),
        (torch.zeros(64, 2, dtype=torch.float16).t(), None, {}, ValueError, "x must be contiguous"),
        (torch.zeros(8, 64, dtype=torch.float16), None, {"path": "gemv"}, ValueError, "at most 4 rows"),
        (torch.zeros(2, 64, dtype=torch.float16), None, {"path": "cublas"}, ValueError, "path must be"),
        (torch.zeros(2, 64, dtype=torch.float16), None, {"split_k": 3}, ValueError, "split_k must be"),
    ],
)  # fmt: skip
def test_gemv_rejects_bad_input(x, qw, kw, err, match):
    # qw=None: a valid weight built here, on x's device, so that only the named fault is wrong
    # (a weight built at import on the CPU would trip the device check first on a GPU).
    if qw is None:
        qw = quant.quantize(torch.randn(8, 64, device=DEV), 4, 32)
    with pytest.raises(err, match=match):
        quant.gemv(x.to(DEV), qw, **kw)


def test_gemv_rejects_a_weight_on_another_device():
    qw = quant.quantize(torch.randn(8, 64), 4, 32)  # on the CPU
    x = torch.zeros(2, 64, dtype=torch.float16, device="meta")
    with pytest.raises(ValueError, match="one device"):
        quant.gemv(x, qw)


def _fields(qw, **change):
    f = dict(data=qw.data, scales=qw.scales, bits=qw.bits, group_size=qw.group_size, shape=qw.shape)
    return {**f, **change}


@pytest.mark.parametrize(
    "change, err, match",
    [
        (lambda q: {"data": q.data.to(torch.int8)}, TypeError, "data must have dtype"),
        (lambda q: {"data": q.data[:, :16].contiguous()}, ValueError, "data of an int4"),
        (lambda q: {"data": q.data.t().contiguous().t()}, ValueError, "data must be contiguous"),
        (lambda q: {"scales": q.scales.float()}, TypeError, "scales must have dtype"),
        (lambda q: {"scales": q.scales[:, :1].contiguous()}, ValueError, "scales must be"),
        (lambda q: {"bits": 3}, ValueError, "bits must be 4 or 8"),
        (lambda q: {"bits": 8}, TypeError, "data must have dtype"),
        (lambda q: {"group_size": 48}, ValueError, "group_size must"),
        (lambda q: {"group_size": 32.0}, ValueError, "group_size must be an int"),
        (lambda q: {"shape": (8, 65)}, ValueError, "int4 packs two values a byte"),
        (lambda q: {"shape": [8, 64]}, ValueError, "shape must be a tuple"),
        (lambda q: {"shape": (0, 64)}, ValueError, "shape must be a tuple"),
    ],
)
def test_quantized_weight_checks_its_fields(change, err, match):
    qw = quant.quantize(torch.randn(8, 64), 4, 32)
    with pytest.raises(err, match=match):
        quant.QuantizedWeight(**_fields(qw, **change(qw)))
    assert quant.QuantizedWeight(**_fields(qw)).shape == (8, 64)  # the valid one builds


@pytest.mark.parametrize("split", [None, 2])
@pytest.mark.parametrize("path", ["gemv", "mma"])
@pytest.mark.parametrize("bits, group", [(4, 32), (8, None)])
def test_reads_nothing_outside_its_inputs(bits, group, path, split):
    """Out-of-bounds detection: x, the packed weight and the scales inside poisoned buffers (NaN
    activations and scales, all-ones weight bytes), at a width N and a depth K off every tile.
    A kernel that reads past a row of x, a row of the weight or the scale table sees poison: the
    result must equal, bit for bit, the one on clean inputs."""
    m, n, k = 3, 37, 192
    qw = quant.quantize(torch.randn(n, k, device=DEV) * 0.02, bits, group)
    x = torch.randn(m, k, device=DEV, dtype=torch.float16)
    clean = quant.gemv(x, qw, path=path, split_k=split)
    data = guarded(qw.data, 0xFF if bits == 4 else -1)
    qp = quant.QuantizedWeight(data, guarded(qw.scales), bits, qw.group_size, qw.shape)
    assert torch.equal(quant.gemv(guarded(x), qp, path=path, split_k=split), clean)


def test_max_block_k():
    assert quant.max_block_k(8192, 4096, 128) == 128  # int4, groups of 128
    assert quant.max_block_k(384, 192, 128) == 64  # K/G odd: the high half starts mid-group
    assert quant.max_block_k(100, 50, 100) > 1 << 20  # per channel: any tile


# --------------------------------------------------------------------------- fp8


@pytest.mark.parametrize("gran", ["tensor", "row", "block"])
def test_quantize_fp8(gran):
    x = torch.randn(5, 256, device=DEV)
    x[2, 7] = 300.0  # an outlier: per-tensor scaling pays for it everywhere, row/block locally
    q, s = quant.quantize_fp8(x, gran)
    assert q.dtype == quant.fp8_dtype() and q.shape == x.shape and s.dtype == torch.float32
    assert s.shape == {"tensor": (), "row": (5, 1), "block": (5, 2)}[gran]
    s_full = s.expand(5, 256) if gran != "block" else s.repeat_interleave(128, dim=1)
    deq = q.float() * s_full
    # e4m3 keeps 4 significant bits: each value within half a unit in its last place, 2^-4.
    err = (deq - x).abs() / x.abs().clamp_min(1e-30)
    normal = x.abs() >= s_full * 2.0**-6  # above the format's smallest normal, after scaling
    assert (err[normal] <= 2**-4 + 1e-6).all()
    # The reference helper of Act 1.5 agrees on per-tensor scaling.
    if gran == "tensor":
        from kernels import numerics

        ref = numerics.quantize(x.float(), "fp8_e4m3")
        torch.testing.assert_close(s, ref.scale)
        torch.testing.assert_close(deq, ref.dequantize())


@pytest.mark.parametrize("gran", ["tensor", "static", "row", "block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_quantize_fp8_without_fp8_hardware_matches_the_kernel(gran, dtype, monkeypatch):
    # A GPU before compute capability 8.9 (a T4) quantizes in PyTorch: the kernel's scales and
    # values. Bit for bit against the interpreter; on a GPU Triton's fp32 division may round
    # differently from PyTorch's by an ulp, which can move a value by one fp8 step.
    import dataclasses

    x = (torch.randn(7, 384, device=DEV) * torch.logspace(-3, 2, 384, device=DEV)).to(dtype)
    x[3] = 0.0  # an all-zero row keeps scale 1
    kw = {"scale": torch.tensor(0.05, device=DEV)} if gran == "static" else {}
    g = "tensor" if gran == "static" else gran
    want_q, want_s = quant.quantize_fp8(x, g, **kw)
    cap = dataclasses.replace(device.capabilities(), fp8=False)
    monkeypatch.setattr(device, "GPU_MODE", True)
    monkeypatch.setattr(device, "capabilities", lambda: cap)
    q, s = quant.quantize_fp8(x, g, **kw)
    assert q.dtype == want_q.dtype and q.shape == want_q.shape and s.shape == want_s.shape
    exact = device.INTERPRET or not torch.cuda.is_available()
    torch.testing.assert_close(s, want_s, rtol=0 if exact else 2**-22, atol=0)
    if exact:  # (the interpreter may drop the sign of a zero: compare values, not bytes)
        assert torch.equal(q.float(), want_q.float())
    else:
        torch.testing.assert_close(q.float(), want_q.float(), rtol=2**-3, atol=2**-9)
    with pytest.raises(ValueError, match="K up to 16384"):  # the same limits on both paths
        quant.quantize_fp8(torch.ones(2, 16385, device=DEV), "row")


def test_quantize_fp8_static_scale_and_errors():
    x = torch.randn(4, 128, device=DEV)
    q, s = quant.quantize_fp8(x, "tensor", scale=torch.tensor(0.001, device=DEV))
    assert s.item() == pytest.approx(0.001)
    assert q.float().abs().max() == quant.FP8_MAX  # saturates instead of overflowing to NaN
    with pytest.raises(ValueError, match="granularity must be"):
        quant.quantize_fp8(x, "column")
    with pytest.raises(ValueError, match="multiple of 128"):
        quant.quantize_fp8(x[:, :100].contiguous(), "block")
    with pytest.raises(ValueError, match="per tensor"):
        quant.quantize_fp8(x, "row", scale=torch.tensor(1.0))


@pytest.mark.parametrize("mnk", [(16, 16, 128), (33, 130, 256), (5, 300, 384)])
def test_fp8_block_matmul(mnk):
    m, n, k = mnk
    x = torch.randn(m, k, device=DEV)
    w = torch.randn(n, k, device=DEV) * 0.02
    aq, a_s = quant.quantize_fp8(x, "block")
    bq, b_s = quant.quantize_fp8_weight(w, "block")
    assert b_s.shape == ((n + 127) // 128, k // 128)
    out = quant.fp8_block_matmul(aq, a_s, bq, b_s)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # Same fp8 inputs: only summation order and the bf16 output rounding differ.
    assert _rel(out, quant.fp8_block_matmul_ref(aq, a_s, bq, b_s)) < 8e-3
    # Against the unquantized product: e4m3's 4 significant bits on both operands.
    assert _rel(out, x @ w.T) < 0.06


def test_fp8_block_matmul_rejects_bad_scales():
    aq, a_s = quant.quantize_fp8(torch.randn(4, 128, device=DEV), "block")
    bq, b_s = quant.quantize_fp8_weight(torch.randn(8, 128, device=DEV), "block")
    with pytest.raises(ValueError, match="a_scale must be"):
        quant.fp8_block_matmul(aq, a_s.t().contiguous(), bq, b_s)
    with pytest.raises(TypeError, match="bq must have dtype"):
        quant.fp8_block_matmul(aq, a_s, bq.float(), b_s)


@pytest.mark.skipif(
    not (device.GPU_MODE and device.capabilities().fp8), reason="needs fp8 tensor cores"
)
@pytest.mark.parametrize("gran", ["tensor", "row"])
def test_fp8_linear(gran):
    x = torch.randn(64, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(96, 512, device="cuda", dtype=torch.bfloat16) * 0.02
    xq, xs = quant.quantize_fp8(x, gran)
    wq, ws = quant.quantize_fp8_weight(w, gran)
    out = quant.fp8_linear(xq, xs, wq, ws)
    ref = (xq.float() * xs) @ (
        wq.float() * ws.reshape(-1, 1) if gran == "row" else wq.float() * ws
    ).T
    assert _rel(out, ref) < 8e-3


@pytest.mark.skipif(device.GPU_MODE, reason="CPU-only check")
def test_fp8_linear_needs_a_gpu():
    with pytest.raises(RuntimeError, match="fp8 tensor cores"):
        quant.fp8_linear(None, None, None, None)


# --------------------------------------------------------------------------- accuracy helpers


def test_student_t_is_heavy_tailed():
    t = quant.student_t((256, 1024), df=3, std=0.02, seed=0)
    g = torch.randn(256, 1024) * 0.02
    assert abs(t.std().item() / 0.02 - 1) < 0.25
    kurt = lambda v: ((v - v.mean()) ** 4).mean() / v.var() ** 2  # noqa: E731
    assert kurt(t) > 3 * kurt(g)
    with pytest.raises(ValueError, match="df must be"):
        quant.student_t((2, 2), df=2)


def test_mlp_stack_divergence_orders_schemes():
    stack = quant.mlp_stack(d=128, f=256, n_layers=2, vocab=256)
    x = quant.activations(32, 128)
    ref = quant.mlp_forward(stack, x, "bf16")
    same = quant.divergence(ref, ref)
    assert same["kl"] == pytest.approx(0.0, abs=1e-12) and same["top1"] == 1.0
    kl = {s: quant.divergence(ref, quant.mlp_forward(stack, x, s))["kl"] for s in ("int8", "int4")}
    assert 0 < kl["int8"] < kl["int4"]
    w8a8 = quant.divergence(ref, quant.mlp_forward(stack, x, "int8", "int8-tensor"))["kl"]
    assert w8a8 > kl["int8"]  # quantizing the activations too can only add error here
    with pytest.raises(ValueError, match="scheme must be"):
        quant.fake_quantize_weight(torch.zeros(2, 32), "int3")
    with pytest.raises(ValueError, match="scheme must be"):
        quant.fake_quantize_act(torch.zeros(2, 32), "int4-token")


# --------------------------------------------------------------------------- the PTX, emulated
# The PTX unpacking only runs on a GPU. This tiny interpreter executes the exact asm strings of
# kernels/quant.py for every byte value, so their bit tricks are checked on any machine.


def _f32(bits: int) -> float:
    return float(np.frombuffer(np.uint32(bits).tobytes(), dtype=np.float32)[0])


def _bits32(v: float) -> int:
    return int(np.frombuffer(np.float32(v).tobytes(), dtype=np.uint32)[0])


def _half(bits: int, kind: str) -> float:
    if kind == "bf16":
        return _f32(bits << 16)
    return float(np.frombuffer(np.uint16(bits).tobytes(), dtype=np.float16)[0])


def _to_half(v: float, kind: str) -> int:
    if kind == "bf16":
        return int(torch.tensor(v).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF
    return int(np.frombuffer(np.float16(v).tobytes(), dtype=np.uint16)[0])


def _run_ptx(asm: str, inputs: list[int], n_out: int) -> list[int]:
    regs = {f"${n_out + i}": v for i, v in enumerate(inputs)}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if tok.startswith("0f"):
            return int(tok[2:], 16)
        return int(tok, 0)

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *a = [t.strip() for t in args.split(",")]
        a = [val(t) for t in a]
        if op == "mov.b32":
            r = a[0]
        elif op == "xor.b32":
            r = a[0] ^ a[1]
        elif op == "shr.b32":
            r = a[0] >> a[1]
        elif op == "lop3.b32":
            assert a[3] == 0xEA  # (a & b) | c
            r = (a[0] & a[1]) | a[2]
        elif op == "prmt.b32":
            pool = [(a[0] >> 8 * i) & 0xFF for i in range(4)] + [
                (a[1] >> 8 * i) & 0xFF for i in range(4)
            ]
            r = sum(pool[(a[2] >> 4 * i) & 7] << 8 * i for i in range(4))
        elif op == "sub.f32":
            r = _bits32(_f32(a[0]) - _f32(a[1]))
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2", "sub.f16x2"):
            kind = "bf16" if "bf16" in op else "f16"
            r = 0
            for h in range(2):
                x, y = (_half((v >> 16 * h) & 0xFFFF, kind) for v in a[:2])
                out = (
                    x * y + _half((a[2] >> 16 * h) & 0xFFFF, kind)
                    if op.startswith("fma")
                    else x - y
                )
                r |= _to_half(out, kind) << 16 * h
        else:
            raise AssertionError(f"emulator does not know {op}")
        regs[d] = r & 0xFFFFFFFF
    return [regs[f"${i}"] for i in range(n_out)]


def _halves(regs: list[int], kind: str) -> list[float]:
    return [_half((r >> 16 * h) & 0xFFFF, kind) for r in regs for h in range(2)]


@pytest.mark.parametrize("kind", ["bf16", "f16"])
def test_ptx_unpacking_is_exact(kind):
    asm4 = (quant.INT4_BF16_ASM if kind == "bf16" else quant.INT4_FP16_ASM).value
    asm8 = (quant.INT8_BF16_ASM if kind == "bf16" else quant.INT8_FP16_ASM).value
    for start in range(0, 256, 4):  # every byte value, in every position of the 32-bit word
        for rot in range(4):
            bs = [(start + (i + rot) % 4) % 256 for i in range(4)]
            word = sum(b << 8 * i for i, b in enumerate(bs))
            out = _run_ptx(asm4, [word], 4)
            assert _halves(out[:2], kind) == [(b & 15) - 8 for b in bs]  # low nibbles, in order
            assert _halves(out[2:], kind) == [(b >> 4) - 8 for b in bs]  # high nibbles
            signed = [b - 256 if b > 127 else b for b in bs]
            if -128 not in signed:  # quantize never stores -128
                assert _halves(_run_ptx(asm8, [word], 2), kind) == signed


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("bits, group", [(4, 128), (8, None)])
def test_prefetch_gemv_probe_kernel(bits, group, prefetch, late):
    """The prefetching CUDA-core GEMV that scripts/gpu/quant_probe.py times (one row of x)."""
    from kernels.quant import prefetch as pf

    qw = quant.quantize(torch.randn(40, 256, device=DEV) * 0.02, bits, group)
    x = torch.randn(1, 256, device=DEV, dtype=torch.float16)
    for split in (1, 2):
        y = pf.launch(x, qw, 16, 64, 4, split, prefetch, late)
        assert _rel(y, quant.gemv_ref(x, qw)) < 2e-3


@pytest.mark.skipif(not device.GPU_MODE, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("m, bits, group", [(1, 4, 128), (3, 8, None), (24, 4, 128)])
def test_cuda_graph_capture(m, bits, group):
    """The default path (the CUDA int4 kernel where it builds, Triton otherwise) in a graph."""
    qw = quant.quantize(torch.randn(256, 1024, device=DEV) * 0.02, bits, group)
    x = torch.randn(m, 1024, device=DEV, dtype=torch.bfloat16)
    eager, graphed = eager_and_graphed(lambda: quant.gemv(x, qw))
    assert torch.equal(eager, graphed)
