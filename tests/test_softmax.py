import pytest
import torch

from kernels import device, rows, softmax

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
    assert [rows.num_warps_for(n) for n in (256, 2048, 4096, 8192, 16384)] == [4, 4, 8, 8, 16]


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
    if isinstance(x, torch.Tensor):
        x = x.to(device.DEVICE)  # so the check under test fires, not the device check
    with pytest.raises(err, match=match):
        softmax.softmax(x, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not device.GPU_MODE, reason="needs a GPU: Triton's compiled kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [4096, 20000, 65536, 70001])
def test_softmax_wide_rows_on_gpu(dtype, n):
    x = _inputs((9, n), dtype)
    ref = torch.softmax(x.double(), dim=-1)
    for mfb in KERNELS.values():
        err = (softmax.softmax(x, max_fused_block=mfb).double() - ref).abs().max().item()
        assert err < (1e-6 if dtype is torch.float32 else 4e-3), (mfb, err)


# ----------------------------------------------------------------------------- out of bounds


@pytest.fixture
def guard(monkeypatch):
    """Fail any interpreted load or store that touches ``forbidden`` memory: the elements of a
    buffer other than those of the view a kernel was given. ``guard(buffer, view)`` arms it."""
    import numpy as np
    from triton.runtime import interpreter

    regions = []

    def arm(buffer: torch.Tensor, view: torch.Tensor):
        es = buffer.element_size()
        lo, hi = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * es
        idx = (
            torch.arange(buffer.numel())
            .view(buffer.shape)
            .as_strided(view.shape, view.stride(), view.storage_offset() - buffer.storage_offset())
        )
        regions.append((lo, hi, np.asarray(lo + idx.flatten().numpy() * es, dtype=np.uint64)))

    def check(ptrs, mask, what):
        active = ptrs.data[mask.data.astype(bool)].astype(np.uint64)
        for lo, hi, allowed in regions:
            inside = (active >= lo) & (active < hi)
            bad = inside & ~np.isin(active, allowed)
            assert not bad.any(), f"{what} of {int(bad.sum())} element(s) outside the view"

    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def guarded_load(self, ptrs, mask, *args):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, *args)

    def guarded_store(self, ptrs, value, mask, *args):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *args)

    monkeypatch.setattr(builder, "create_masked_load", guarded_load)
    monkeypatch.setattr(builder, "create_masked_store", guarded_store)
    return arm


@pytest.mark.skipif(device.GPU_MODE, reason="watches the interpreter's loads and stores")
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", [(5, 123), (1, 1), (3, 4097)])
def test_softmax_touches_only_its_rows(guard, kernel, shape):
    # The input is a window into a larger buffer of poison (NaN): rows above and below it (more
    # than a program's padding rows), columns left and right. A kernel that reads past the last
    # row (a missing row clamp) or the last column (a missing mask) trips the guard; a poisoned
    # value that reached a sum would also turn the output NaN.
    r, c = shape
    x = _inputs(shape, torch.float32)
    buffer = torch.full((r + 40, c + 9), float("nan"))
    view = buffer[7 : 7 + r, 5 : 5 + c]
    view.copy_(x)
    guard(buffer, view)
    y = softmax.softmax(view, max_fused_block=KERNELS[kernel])
    torch.testing.assert_close(y, softmax.softmax_ref(x), rtol=1e-5, atol=1e-7)
    assert buffer[7 : 7 + r, 5 : 5 + c].equal(x)  # the input is untouched
    assert buffer.isnan().sum() == buffer.numel() - x.numel()  # and so is the poison


@pytest.mark.skipif(device.GPU_MODE, reason="watches the interpreter's loads and stores")
def test_guard_catches_a_read_past_the_last_row(guard):
    # The guard itself: a view that hides the buffer's last rows from a kernel told they exist.
    buffer = torch.zeros(8, 16)
    guard(buffer, buffer[:5])
    with pytest.raises(Exception, match="outside the view"):
        softmax._launch(buffer, torch.empty(8, 16), softmax.launch_config(8, 16))


@pytest.mark.parametrize("dtype, rtol, atol", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 123), (1823, 781), (2, 3, 33)])
def test_softmax_backward_odd_shapes(dtype, rtol, atol, shape):
    # Against the formula on the same rounded y the kernel reads, in fp32: what the kernel adds is
    # its own rounding of dx, once.
    x = _inputs(shape, dtype)
    dy = _inputs(shape, dtype, scale=1.0)
    y = softmax.softmax(x)
    yf, dyf = y.float(), dy.float()
    ref = (yf * (dyf - (yf * dyf).sum(dim=-1, keepdim=True))).to(dtype)
    for mfb in (softmax.MAX_FUSED_BLOCK_BWD, 0):
        dx = softmax._softmax_backward(y, dy, mfb)
        assert dx.shape == x.shape and dx.dtype == dtype
        # dy - sum(y * dy) cancels: the absolute error follows the size of y * dy, not of dx.
        scale = (yf * dyf).abs().max().item()
        torch.testing.assert_close(dx, ref, rtol=rtol, atol=max(atol, 4 * rtol * scale))


def test_softmax_backward_of_an_expanded_gradient():
    # y.sum().backward() hands the backward an expanded dy (stride 0 everywhere).
    x = _inputs((4, 300), torch.float32).requires_grad_()
    softmax.softmax(x).sum().backward()
    assert x.grad.abs().max() < 1e-6  # the rows of a softmax sum to 1: its gradient is zero


def test_softmax_skips_autograd_without_grad():
    x = _inputs((3, 50), torch.float32)
    assert softmax.softmax(x).grad_fn is None
    assert softmax.softmax(x.requires_grad_()).grad_fn is not None
    with torch.no_grad():
        assert softmax.softmax(x).grad_fn is None


@pytest.mark.gpu
@pytest.mark.skipif(not device.GPU_MODE, reason="needs a GPU")
def test_softmax_under_cuda_graph_capture():
    x = torch.randn(8, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    wide = torch.randn(3, 70001, device="cuda")

    def step():
        (dx,) = torch.autograd.grad(softmax.softmax(x), x, dy)
        return softmax.softmax(wide), dx

    step()  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y_wide, dx = step()
    x.data.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    (ref,) = torch.autograd.grad(torch.softmax(x.float(), -1), x, dy.float())
    torch.testing.assert_close(dx.float(), ref.float(), rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(y_wide, torch.softmax(wide, -1), rtol=1e-5, atol=1e-8)


@pytest.mark.gpu
@pytest.mark.skipif(not device.GPU_MODE, reason="needs a GPU")
def test_softmax_rejects_a_cpu_tensor_on_a_gpu_machine():
    with pytest.raises(ValueError, match="x must be on cuda"):
        softmax.softmax(torch.zeros(2, 8))


def test_fused_forward_compiles_for_sm90_without_spills_up_to_32768():
    """Triton compiles the fused forward for Hopper (no GPU needed, outside the interpreter) with no
    spills for rows of 32,768 (64 values a thread). At 65,536, 128 a thread at the 128-register cap,
    it spills, fp16 most: scripts/softmax_ptxas.py's report that explains page 4.5's fp16 case."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    out = subprocess.run(
        [sys.executable, str(root / "scripts" / "softmax_ptxas.py"), "--width", "32768"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows_ = [
        line.split() for line in out.stdout.splitlines() if line[:4] in ("fp16", "bf16", "fp32")
    ]
    assert [r[0] for r in rows_] == ["fp16", "bf16", "fp32"], out.stdout
    for dtype, block_n, _, per_thread, regs, stores, loads in rows_:
        assert (int(block_n), int(per_thread)) == (32768, 64), (dtype, out.stdout)
        assert 0 < int(regs) <= 255 and int(stores) == int(loads) == 0, (dtype, out.stdout)
