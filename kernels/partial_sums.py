"""Column sums of fp32 partial sums, rounded once: the second step of a split reduction.

A kernel that splits a reduction across programs (the norms' backward splits the rows behind dw
and db, the quantized GEMV splits K) can let each program write its own fp32 partial result and
add them up in a second launch, instead of accumulating with atomics into a zeroed buffer and
casting afterwards. The sum has a fixed order, so the result is the same on every run, and it
costs one launch where atomics cost three (zero, accumulate, cast).

``sum_stacked(partials, dtype)`` takes ``[k, n_partials, n_cols]`` (k stacked blocks, e.g. dw's and
db's) and returns ``[k, n_cols]`` in ``dtype``, one launch for all k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import Launcher, aligned, cdiv, next_power_of_2


@triton.jit
def _sum_kernel(
    # pointers
    partial_ptr,
    out_ptr,
    # sizes
    n_partials,
    n_cols,
    # meta-parameters
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Column sums of the [n_partials, n_cols] fp32 partial sums, rounded once to out's dtype. Axis
    # 1 of the grid picks one of several stacked [n_partials, n_cols] blocks and the matching row
    # of out: one launch finishes every block.
    which = tl.program_id(1).to(tl.int64)
    partial_ptr += which * n_partials * n_cols
    out_ptr += which * n_cols
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    for start in range(0, n_partials, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        mask = (p[:, None] < n_partials) & (cols[None, :] < n_cols)
        acc += tl.load(
            partial_ptr + p[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0
        )
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < n_cols)


_SUM = Launcher(_sum_kernel)


# Columns each program of the sum adds up. Narrow blocks run many programs: 128 at 4,096 columns,
# where 256 columns a program ran 16 (an eighth of an H100's SMs), each walking 264 partial rows in
# turn. Measured on an H100 (scripts/gpu/norm_bwd_split_probe.py, device time of the whole
# backward, bf16): on 2026-12-06 32 against 256 took 512 x 4,096 RMSNorm from 23.3 to 16.0 µs,
# 4,096 x 1,024 from 31.3 to 22.8 and 4,096 x 4,096 from 55.4 to 48.1, 64 between
# (results/profiles/2026-12-06-nvidia-h100-80gb-hbm3-norm-bwd-split.txt). 16 or 8 columns, 64
# rows a step with 8 warps, and loads pipelined over the rows came within run-to-run noise of 32
# in two later runs at training shapes (-split-2.txt, -split-3.txt).
SUM_BLOCK_N = 32


def sum_launch(shape: tuple[int, int, int], dtype: torch.dtype, is_aligned: bool = True) -> tuple:
    """(launcher key, grid, meta) of ``sum_stacked`` on contiguous fp32 partial sums of ``shape``
    ``[k, n_partials, n_cols]`` (16-byte aligned unless ``is_aligned`` is False; a fresh buffer
    is): a caller that plans per layout keeps it and calls ``run``."""
    k, n_partials, n_cols = shape
    block_n = min(next_power_of_2(n_cols), SUM_BLOCK_N)
    grid = (cdiv(n_cols, block_n), k)
    key = (dtype, k, n_partials, n_cols, is_aligned)
    return key, grid, dict(BLOCK_P=32, BLOCK_N=block_n, num_warps=4)


def run(launch: tuple, partials: torch.Tensor, out: torch.Tensor) -> None:
    """Sum ``partials`` into ``out`` (``[k, n_cols]`` values, contiguous; only its data is used)
    with a planned ``sum_launch``. The launch key holds no alignment bit for ``out``: it must be
    16-byte aligned, as a fresh buffer is (a binary compiled for an aligned ``out`` may use vector
    stores that a misaligned one would fault on)."""
    key, grid, meta = launch
    _SUM(key, grid, (partials, out, partials.shape[1], partials.shape[2]), **meta)


def sum_stacked(partials: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Column sums of stacked fp32 partial sums ``[k, n_partials, n_cols]`` (contiguous):
    ``[k, n_cols]`` in ``dtype``, one launch for all k."""
    k, _, n_cols = partials.shape
    out = partials.new_empty((k, n_cols), dtype=dtype)
    run(sum_launch(partials.shape, dtype, aligned(partials)), partials, out)
    return out


# The ahead-of-time compile check (tests compile every kernel for sm_90 and sm_75).
COMPILE_SPECS = [
    dict(
        kernel=_sum_kernel,
        signature={
            "partial_ptr": "*fp32",
            "out_ptr": "*bf16",
            "n_partials": "i32",
            "n_cols": "i32",
        },
        constexprs={"BLOCK_P": 32, "BLOCK_N": 256},
        options={"num_warps": 4},
    )
]
