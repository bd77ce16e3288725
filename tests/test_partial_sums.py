"""kernels.partial_sums: the second step of a split reduction (the norms' dw/db, the GEMV's K split)."""

import pytest
import torch

from kernels import device, partial_sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 3, 17), (2, 33, 300), (1, 4, 4096)])
def test_sum_stacked_matches_an_fp32_sum_rounded_once(shape, dtype):
    g = torch.Generator().manual_seed(0)
    partials = torch.randn(shape, generator=g).to(device.DEVICE)
    out = partial_sums.sum_stacked(partials, dtype)
    ref = partials.double().sum(dim=1).to(dtype)
    assert out.shape == (shape[0], shape[2]) and out.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    assert torch.equal(partial_sums.sum_stacked(partials, dtype), out)  # a fixed order


def test_run_with_a_planned_launch_writes_into_a_fresh_buffer_of_any_shape():
    partials = torch.randn(1, 4, 6 * 5).to(device.DEVICE)
    launch = partial_sums.sum_launch(partials.shape, torch.float32)
    out = torch.empty(6, 5, device=device.DEVICE)  # the caller's shape: only the data is used
    partial_sums.run(launch, partials, out)
    torch.testing.assert_close(out.flatten(), partials.sum(dim=1)[0], rtol=1e-5, atol=1e-5)


def test_sum_launch_spreads_columns_over_many_programs():
    """32 columns a program: at 4,096 columns 128 programs a gradient, not 16 (the H100 probe of
    2026-12-06 measured the whole norm backward 1.1-1.5x faster for it)."""
    key, grid, meta = partial_sums.sum_launch((2, 264, 4096), torch.bfloat16)
    assert grid == (128, 2) and meta["BLOCK_N"] == partial_sums.SUM_BLOCK_N == 32
    # narrower rows: the power of 2 at or above their width
    assert partial_sums.sum_launch((1, 16, 7), torch.float32)[2]["BLOCK_N"] == 8
