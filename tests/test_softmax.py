import pytest
import torch

from kernels import device, softmax

# Odd widths: a single column, a few, just past a power of two, not a power of two, and past the
# 4096-wide tile; 1000 rows of width 3 also packs many rows into each program.
SHAPES = [(3, 1), (1000, 3), (7, 257), (4, 1000), (2, 4097), (2, 3, 33), (1, 1, 8)]
# (dtype, rtol, atol). fp32: the kernel's exp and sum round differently from torch's, a few ulp.
# bf16: one rounding of an fp32 result to 8 bits (2**-8 relative), plus the interpreter's bf16
# store, which can differ from the GPU's by one more ulp.
DTYPES = [
    (torch.float32, 1e-5, 1e-7),
    (torch.float16, 1e-3, 1e-6),
    (torch.bfloat16, 2**-7, 1e-5),
]
# max_fused_block=0 forces the looped (two-pass, online-normaliser) kernel at any width.
KERNELS = {"fused": softmax.MAX_FUSED_BLOCK, "looped": 0}


def _inputs(shape, dtype, scale=4.0):
    g = torch.Generator().manual_seed(sum(shape))
    return (torch.randn(shape, generator=g) * scale).to(device.DEVICE, dtype)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, rtol, atol", DTYPES)
def test_softmax_matches_reference(kernel, shape, dtype, rtol, atol):
    x = _inputs(shape, dtype)
    y = softmax.softmax(x, max_fused_block=KERNELS[kernel])
    assert y.shape == x.shape and y.dtype == dtype and y.is_contiguous()
    torch.testing.assert_close(y, softmax.softmax_ref(x), rtol=rtol, atol=atol)
    # Rows sum to one (in fp32, to within the rounding of each output element).
    sums = y.float().sum(dim=-1)
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=tol)


@pytest.mark.parametrize("kernel", KERNELS)
def test_softmax_large_and_masked_values(kernel):
    # The max subtraction: logits of 1e4 would overflow exp() in any dtype without it. A row of
    # -inf but one entry puts all the mass on that entry.
    x = torch.tensor(
        [[1e4, 1e4 - 1.0, -1e4, 0.0], [float("-inf"), 2.0, float("-inf"), float("-inf")]],
        device=device.DEVICE,
    )
    y = softmax.softmax(x, max_fused_block=KERNELS[kernel])
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, torch.softmax(x, dim=-1), rtol=1e-6, atol=1e-7)
    assert y[1, 1] == 1.0 and y[1, 0] == 0.0


def test_looped_kernel_crosses_chunks():
    # A row of three chunks whose max sits in the last chunk: the online normaliser must rescale
    # the sums it built before it saw the max.
    n = 2 * softmax.LOOP_BLOCK + 5
    x = _inputs((3, n), torch.float32)
    x[:, -1] = 30.0
    y = softmax.softmax(x, max_fused_block=0)
    torch.testing.assert_close(y, softmax.softmax_ref(x), rtol=1e-5, atol=1e-8)


def test_launch_config_follows_width():
    narrow = softmax.launch_config(10_000, 256)
    assert narrow["kernel"] == "fused" and narrow["BLOCK_M"] * narrow["BLOCK_N"] == softmax.TILE
    assert softmax.launch_config(3, 256)["BLOCK_M"] == 4  # never more rows than exist (padded)
    wide = softmax.launch_config(8, softmax.MAX_FUSED_BLOCK)
    assert wide["kernel"] == "fused" and wide["BLOCK_M"] == 1 and wide["num_warps"] == 16
    assert softmax.launch_config(8, softmax.MAX_FUSED_BLOCK + 1)["kernel"] == "looped"
    assert [softmax.num_warps_for(n) for n in (256, 2048, 4096, 8192, 16384)] == [4, 4, 8, 8, 16]


def test_softmax_row_strided_input():
    # A slice of wider rows: contiguous along the last dimension, row stride 300, no copy needed.
    base = _inputs((6, 300), torch.float32)
    x = base[:, 5:262]
    assert not x.is_contiguous()
    torch.testing.assert_close(softmax.softmax(x), softmax.softmax_ref(x), rtol=1e-5, atol=1e-7)
    # An expanded batch (row stride 0) reads the same row for every output row.
    row = _inputs((1, 100), torch.float32)
    y = softmax.softmax(row.expand(4, 100))
    torch.testing.assert_close(y, softmax.softmax_ref(row).expand(4, 100), rtol=1e-5, atol=1e-7)


def test_softmax_writes_every_element():
    # A NaN-filled block of the output's size is freed just before the launch: on a GPU the
    # caching allocator hands it to the output, so an element a mask wrongly skips stays NaN.
    x = _inputs((37, 1000), torch.float32)
    poison = torch.full_like(x, float("nan"))
    del poison
    assert torch.isfinite(softmax.softmax(x)).all()


def test_softmax_backward_matches_autograd():
    x = _inputs((5, 257), torch.float32).requires_grad_()
    dy = _inputs((5, 257), torch.float32, scale=1.0)
    (dx,) = torch.autograd.grad(softmax.softmax(x), x, dy)
    (ref,) = torch.autograd.grad(torch.softmax(x, dim=-1), x, dy)
    torch.testing.assert_close(dx, ref, rtol=1e-5, atol=1e-7)


def test_softmax_empty():
    for shape in [(0, 5), (4, 0), (0,)]:
        x = torch.empty(shape, device=device.DEVICE)
        assert softmax.softmax(x).shape == x.shape


@pytest.mark.parametrize(
    "x, kw, err, match",
    [
        (torch.zeros(4, 4, dtype=torch.float64), {}, TypeError, "x must have dtype"),
        (torch.zeros(4, 4, dtype=torch.int32), {}, TypeError, "x must have dtype"),
        ([[1.0, 2.0]], {}, TypeError, "x must be a torch.Tensor"),
        (torch.zeros(()), {}, ValueError, "at least 1 dimension"),
        (torch.zeros(4, 5), {"dim": 0}, ValueError, "dim must be the last dimension"),
        (torch.zeros(5, 4).t(), {}, ValueError, "x must have a contiguous last dimension"),
        (torch.zeros(4, 6, 5).transpose(0, 1), {}, ValueError, "cannot be viewed as rows"),
    ],
)
def test_softmax_rejects_bad_input(x, kw, err, match):
    with pytest.raises(err, match=match):
        softmax.softmax(x, **kw)


@pytest.mark.skipif(not device.GPU_MODE, reason="needs a GPU: Triton's compiled kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [4096, 20000, 65536, 70001])
def test_softmax_wide_rows_on_gpu(dtype, n):
    x = _inputs((9, n), dtype)
    ref = torch.softmax(x.double(), dim=-1)
    for mfb in KERNELS.values():
        err = (softmax.softmax(x, max_fused_block=mfb).double() - ref).abs().max().item()
        assert err < (1e-6 if dtype is torch.float32 else 4e-3), (mfb, err)
