"""Row-wise kernels' shared launch plan and input checks.

Softmax and the norms (and their backward passes) all treat their input as ``[rows, width]`` and
launch one of two kernel shapes: whole rows held in registers, several narrow rows to a program, or
one row per program walked in chunks. This module is the one home of that plan (``row_launch``)
and of the checks that turn any tensor into rows without a copy (``as_rows``, ``check_float``).
The kernels launch through ``kernels.launch.Launcher``, which skips Triton's per-call argument
binding: a decode step calls a norm on one ``[1, 4096]`` row, where the host's cost per call is
most of the time.
"""

from __future__ import annotations

import torch

from kernels import device
from kernels.launch import cdiv, next_power_of_2, sm_count

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# Rows wider than CLUSTER_ABOVE_COLS (the widest the Triton norms hold in registers), at least
# CLUSTER_MIN_ROWS of them, may take the thread-block cluster kernels of kernels.cuda.cluster_rows
# (rows split across the SMs of a cluster; Hopper and later). 1,024 rows of 65,536 bf16 values are
# 128 MiB: about 90 us of GPU time forward, more than the Python launch path's host time.
CLUSTER_ABOVE_COLS = 32768
CLUSTER_MIN_ROWS = 1024


def cluster_path(x: torch.Tensor, n_rows: int, op: str, *others: torch.Tensor | None):
    """``kernels.cuda.cluster_rows`` if it takes the rows of ``x`` for ``op`` (with the weight and
    bias in ``others``), else None. The width and row count are tested first, so the narrow rows
    of a decode step pay two comparisons; the module is imported only for rows that pass them."""
    if x.shape[-1] <= CLUSTER_ABOVE_COLS or n_rows < CLUSTER_MIN_ROWS:
        return None
    from kernels.cuda import cluster_rows

    return cluster_rows if cluster_rows.use(x, op, *others) else None


def check_float(name: str, x) -> None:
    """TypeError naming ``name`` unless ``x`` is an fp32, fp16 or bf16 tensor."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must have dtype in (float32, float16, bfloat16), got {x.dtype}")


def as_rows(name: str, x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D ``[rows, last dim]`` view without copying, or a ValueError naming ``name``.

    The kernels take a row stride, so row-strided inputs (a slice ``x[:, :k]``, an expanded batch)
    work as they are; the last dimension itself must be contiguous."""
    if x.ndim == 0:
        raise ValueError(f"{name} must have at least 1 dimension, got a 0-d tensor")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(
            f"{name} must have a contiguous last dimension (stride 1), got strides "
            f"{tuple(x.stride())}; call .contiguous() first"
        )
    if x.ndim == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{name}'s leading dimensions (shape {tuple(x.shape)}, strides {tuple(x.stride())}) "
            "cannot be viewed as rows without a copy; call .contiguous() first"
        ) from None


def check_device(name: str, x: torch.Tensor) -> None:
    """ValueError naming ``name`` unless ``x`` is where the kernels run (the GPU in GPU mode)."""
    if x.is_cuda != device.GPU_MODE:
        raise ValueError(f"{name} must be on {device.DEVICE.type}, got a tensor on {x.device}")


def row_stride(name: str, x: torch.Tensor) -> tuple[int, int]:
    """``(rows, row stride)`` of ``x`` seen as ``[rows, last dim]``, without a copy or a view
    when ``x`` is contiguous (the common case, and the cheapest to ask); a ValueError naming
    ``name`` when no such view exists. ``x`` must not be empty."""
    n_cols = x.shape[-1]
    if x.is_contiguous():
        return x.numel() // n_cols, n_cols
    x2 = as_rows(name, x)
    return x2.shape[0], x2.stride(0)


def num_warps_for(block_elems: int) -> int:
    """Warps for a program holding ``block_elems`` values: 4 up to 2048, 8 up to 8192, else 16.

    More warps means fewer values per thread (registers) and more loads in flight per program."""
    if block_elems <= 2048:
        return 4
    if block_elems <= 8192:
        return 8
    return 16


def row_launch(
    n_rows: int,
    n_cols: int,
    *,
    max_fused_block: int,
    loop_block: int,
    loop_warps: int,
    tile: int,
    loop_programs_per_sm: int | None = None,
) -> dict:
    """The launch of a row-wise kernel on ``[n_rows, n_cols]`` (softmax and the norms share it):
    rows up to ``max_fused_block`` wide are held whole in registers, ``tile // block`` rows per
    program; wider rows loop over ``loop_block``-wide chunks, one row per program, or, with
    ``loop_programs_per_sm``, that many programs per SM walking the rows (so the rows in flight
    stay in L2 for the second read)."""
    block_n = next_power_of_2(n_cols)
    if block_n > max_fused_block:
        programs = n_rows
        if loop_programs_per_sm is not None:
            programs = max(1, min(n_rows, loop_programs_per_sm * sm_count()))
        return dict(
            kernel="looped",
            BLOCK_M=1,
            BLOCK_N=loop_block,
            num_warps=loop_warps,
            programs=programs,
        )
    block_m = min(max(tile // block_n, 1), next_power_of_2(n_rows))
    return dict(
        kernel="fused",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps_for(block_m * block_n),
        programs=cdiv(n_rows, block_m),
    )
