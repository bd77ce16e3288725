import pytest
import torch

from kernels import device, matmul

# Triton's interpreter computes bf16 wrongly (a known limitation): bf16 is checked on GPUs only.
DTYPES = [torch.float16] + ([torch.bfloat16] if device.GPU_MODE else [])
SHAPES = [(1, 1, 1), (5, 7, 9), (33, 65, 17), (100, 33, 70), (128, 64, 256)] + (
    [(4000, 3000, 5000), (16, 8192, 1024), (1823, 781, 129)] if device.GPU_MODE else []
)


def _rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mkn", SHAPES)
def test_matmul_matches_fp32_reference(dtype, mkn):
    m, k, n = mkn
    a = torch.randn(m, k, device=device.DEVICE, dtype=dtype)
    b = torch.randn(k, n, device=device.DEVICE, dtype=dtype)
    out = matmul.matmul(a, b)
    assert out.shape == (m, n) and out.dtype == dtype
    # One rounding of the fp32 result to 16 bits: relative error ~ unit roundoff (fp16 5e-4, bf16 4e-3).
    assert _rel_err(out, a.float() @ b.float()) < (2e-3 if dtype is torch.float16 else 8e-3)


@pytest.mark.skipif(
    not (device.GPU_MODE and device.capabilities().tma), reason="needs TMA (Hopper+)"
)
@pytest.mark.parametrize("mkn", [(128, 64, 256), (1000, 2048, 520), (4096, 4096, 4096)])
def test_persistent_tma_variant(mkn):
    m, k, n = mkn
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    out = matmul.matmul(a, b, persistent=True)
    assert _rel_err(out, a.float() @ b.float()) < 8e-3


def test_matmul_degenerate_shapes():
    a = torch.randn(3, 0, device=device.DEVICE, dtype=torch.float16)
    b = torch.randn(0, 4, device=device.DEVICE, dtype=torch.float16)
    assert torch.equal(
        matmul.matmul(a, b), torch.zeros(3, 4, device=device.DEVICE, dtype=torch.float16)
    )


@pytest.mark.parametrize(
    "a, b, kw, err, match",
    [
        (torch.zeros(4, 3), torch.zeros(3, 4), {}, TypeError, "a must have dtype"),
        (torch.zeros(4, 3, dtype=torch.half), torch.zeros(4, 4, dtype=torch.half), {}, ValueError, "do not chain"),
        (torch.zeros(4, dtype=torch.half), torch.zeros(4, 4, dtype=torch.half), {}, ValueError, "a must be 2-D"),
        (torch.zeros(4, 4, dtype=torch.half), torch.zeros(4, 4, dtype=torch.bfloat16), {}, TypeError, "same dtype"),
        (torch.zeros(4, 4, dtype=torch.half), torch.zeros(4, 4, dtype=torch.half).t(), {}, ValueError, "b must be contiguous"),
    ],
)  # fmt: skip
def test_matmul_rejects_bad_input(a, b, kw, err, match):
    with pytest.raises(err, match=match):
        matmul.matmul(a, b, **kw)


@pytest.mark.skipif(device.GPU_MODE, reason="CPU-only check")
def test_persistent_needs_tma():
    a = torch.zeros(8, 8, dtype=torch.half)
    with pytest.raises(ValueError, match="TMA"):
        matmul.matmul(a, a, persistent=True)
