"""RMSNorm and LayerNorm over the last dimension, forward and backward, one kernel family for both.

For ``x: [R, C]`` and a weight ``w: [C]`` (and, for LayerNorm, a bias ``b: [C]``):

    RMSNorm:   y = x * rstd * w,               rstd = 1 / sqrt(mean(x^2) + eps)
    LayerNorm: y = (x - mean) * rstd * w + b,  rstd = 1 / sqrt(mean((x - mean)^2) + eps)

Every statistic is computed in fp32 whatever the storage type. The forward pass also writes the
per-row ``rstd`` (and ``mean``), ``R`` fp32 values, so the backward pass does not recompute them.
``IS_RMS`` and ``HAS_BIAS`` are compile-time switches: one source, four specialised kernels.

Forward. ``_norm_fwd_kernel`` holds ``BLOCK_M`` whole rows in registers: read ``R*C``, write
``R*C`` (plus the ``C``-element weight and bias, read once per program from L2). Rows wider than
``MAX_FUSED_BLOCK`` go to ``_norm_fwd_looped_kernel``: a statistics pass, then a normalise pass
that reads the row again (read ``2*R*C``, write ``R*C``).

Backward. With ``xhat`` the normalised input and ``g = w * dy``, per row

    RMSNorm:   dx = rstd * (g - xhat * mean(g * xhat))
    LayerNorm: dx = rstd * (g - xhat * mean(g * xhat) - mean(g))
    dw = sum over rows of dy * xhat,   db = sum over rows of dy.

``dx`` needs two row reductions, so a row is read whole before any of it is written. ``dw`` and
``db`` are column sums over all rows: each program accumulates its rows' share in registers and
writes one fp32 row of partial sums, and ``kernels.partial_sums`` adds those partial rows up (no
atomics, a deterministic result). ``_norm_bwd_kernel`` does this with rows held in registers: read
``x`` and ``dy``, write ``dx``, three passes. Rows too wide for that take two kernels:
``_norm_bwd_stats_kernel`` computes the two row sums in shares, one program per row and column
chunk, then ``_norm_bwd_dx_kernel`` tiles the matrix into column chunks, adds up each row's shares,
re-reads ``x`` and ``dy`` and writes ``dx`` (five passes).

On a Hopper GPU, rows wider than 32,768 values (1,024 rows or more) may instead be split across the
CTAs of a thread-block cluster (``kernels.cuda.cluster_rows``, page 4.5), where that measured
faster: one read and one write forward, three passes backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import bench, device, partial_sums, replay, roofline
from kernels.launch import (
    Launcher,
    Plans,
    aligned,
    cdiv,
    layout_key,
    next_power_of_2,
    resident_programs,
    sm_count,
)
from kernels.rows import (
    check_device,
    check_float,
    cluster_path,
    num_warps_for,
    row_launch,
    row_stride,
)

# Rows narrower than TILE elements are packed several to a program (as in kernels.softmax).
TILE = 4096
# Widest power-of-two row the forward kernel keeps in registers. At 65,536 columns x and w no
# longer fit in an SM's register file and spill: on an H100, bf16 LayerNorm in registers reached
# 0.49 of the copy bandwidth there, the looped kernel 0.68.
MAX_FUSED_BLOCK = 32768
# The backward keeps x, dy, w, xhat and the dw/db accumulators per element: registers run out
# sooner. At 16,384 columns LayerNorm's backward spilled heavily on an H100 and reached 0.10 of
# the copy bandwidth; the two-step kernels reach 0.59.
MAX_FUSED_BLOCK_BWD = 8192
# Column chunk of the looped and tiled kernels and its warps.
LOOP_BLOCK = 4096
LOOP_WARPS = 16
# Programs per SM of the looped forward: each walks whole rows, every num_programs-th one. On an
# H100 at 4,096 x 65,536 (scripts/gpu/norm_wide_probe.py, results/profiles/2026-12-06-nvidia-h100-
# 80gb-hbm3-norm-wide.txt) LayerNorm reached 0.66 of copy in bf16 this way, 0.53 with one program
# an SM; no other chunk, warp count or programs per SM tried did better, nor taking 2 or 4 rows at
# a time (each chunk of w and b then loaded once for them: 0.56-0.66). 0.66 is what reading each
# row twice from memory allows: the second read misses L2.
LOOP_PROGRAMS_PER_SM = 2
# Software-pipelining depth of the in-register backward's loop over rows.
BWD_STAGES = 3
# Programs per SM of the two-step backward's dx kernel (each writes one row of dw partial sums).
TWO_STEP_PROGRAMS_PER_SM = 2
# A backward of at most this many row blocks runs as one program that writes dw and db itself:
# one launch and no partial sums to add up. A decode step's few rows take microseconds of GPU
# time either way; the second launch and its buffer cost the host more (see ``bwd_config``).
ONE_PROGRAM_BLOCKS = 8


@triton.jit
def _norm_fwd_kernel(
    # pointers (b_ptr is unused when HAS_BIAS is False, mean_ptr when IS_RMS is True)
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    # sizes
    n_rows,
    n_cols,
    eps,
    # strides (elements between row starts; columns are contiguous)
    stride_x_row,
    stride_y_row,
    # meta-parameters
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STATS: tl.constexpr,  # write mean and rstd for the backward (False: no gradient wanted)
):
    # BLOCK_M whole rows per program, in registers: x is read once and y written once.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    row_mask = rows < n_rows
    # Rows past the end (last program only) recompute the last row; the masked stores drop them.
    rows64 = tl.minimum(rows, n_rows - 1).to(tl.int64)
    x = tl.load(
        x_ptr + rows64[:, None] * stride_x_row + cols[None, :], mask=col_mask[None, :], other=0.0
    ).to(tl.float32)
    # Two-pass statistics over registers (mean first, then squares of x - mean): no cancellation,
    # and no extra HBM traffic, since the row is already on chip.
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / n_cols
        xc = tl.where(col_mask[None, :], x - mean[:, None], 0.0)
        if STATS:
            tl.store(mean_ptr + rows, mean, mask=row_mask)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    if STATS:
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(
        y_ptr + rows64[:, None] * stride_y_row + cols[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _norm_fwd_looped_kernel(
    # pointers
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    mean_ptr,
    rstd_ptr,
    # sizes
    n_rows,
    n_cols,
    eps,
    # strides
    stride_x_row,
    stride_y_row,
    # meta-parameters
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STATS: tl.constexpr,
):
    # Rows in BLOCK_N chunks: a statistics pass, then a normalise pass that re-reads the row (read
    # 2*C elements, write C). A program takes every num_programs-th row; a grid of a few programs
    # per SM keeps the rows in flight small enough for L2 to serve the second read.
    cols = tl.arange(0, BLOCK_N)
    n_chunks = tl.cdiv(n_cols, BLOCK_N)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row64 = tl.cast(row, tl.int64)
        x_row = x_ptr + row64 * stride_x_row
        y_row = y_ptr + row64 * stride_y_row
        # One pass gives sum(d) and sum(d^2) per lane. For LayerNorm d = x - K with K the row's
        # first element (the "shifted data" algorithm): var = E[d^2] - E[d]^2 then does not
        # cancel catastrophically when |mean| is much larger than the spread of the row.
        shift = 0.0
        if not IS_RMS:
            shift = tl.load(x_row).to(tl.float32)
        s1 = tl.zeros([BLOCK_N], tl.float32)
        s2 = tl.zeros([BLOCK_N], tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            offs = start + cols
            mask = offs < n_cols
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            d = tl.where(mask, x - shift, 0.0)
            s1 += d
            s2 += d * d
        if IS_RMS:
            mean = 0.0
            var = tl.sum(s2, axis=0) / n_cols
        else:
            mean_d = tl.sum(s1, axis=0) / n_cols
            mean = shift + mean_d
            var = tl.maximum(tl.sum(s2, axis=0) / n_cols - mean_d * mean_d, 0.0)
            if STATS:
                tl.store(mean_ptr + row64, mean)
        rstd = tl.rsqrt(var + eps)
        if STATS:
            tl.store(rstd_ptr + row64, rstd)
        # Normalise pass, last chunk first: the chunks read last are the likeliest still in L2.
        for i in range(0, n_chunks):
            offs = (n_chunks - 1 - i) * BLOCK_N + cols
            mask = offs < n_cols
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            y = (x - mean) * rstd * w
            if HAS_BIAS:
                y += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(
    # pointers (mean_ptr unused when IS_RMS; db_partial_ptr unused without HAS_BIAS)
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    db_partial_ptr,
    # sizes
    n_rows,
    n_cols,
    # strides
    stride_dy_row,
    stride_x_row,
    stride_dx_row,
    # meta-parameters
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    # A persistent grid, as many programs as fit on the GPU at once: each loops over blocks of
    # BLOCK_M rows, reads x and dy once, writes dx once, and keeps its share of dw (and db) in
    # registers until the end.
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    n_blocks = tl.cdiv(n_rows, BLOCK_M)
    for block in tl.range(tl.program_id(0), n_blocks, tl.num_programs(0), num_stages=NUM_STAGES):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        # Masked elements load 0: with dy = 0 and w = 0 there they add nothing to any sum.
        x = tl.load(x_ptr + rows64 * stride_x_row + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(dy_ptr + rows64 * stride_dy_row + cols[None, :], mask=mask, other=0.0)
        x, dy = x.to(tl.float32), dy.to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
            xhat = (x - mean[:, None]) * rstd[:, None]
        g = dy * w[None, :]
        c1 = tl.sum(xhat * g, axis=1) / n_cols
        if IS_RMS:
            dx = (g - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(g, axis=1) / n_cols
            dx = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        tl.store(
            dx_ptr + rows64 * stride_dx_row + cols[None, :],
            dx.to(dx_ptr.dtype.element_ty),
            mask=mask,
        )
        dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
    # One row of fp32 partial sums per program; kernels.partial_sums adds them up. A grid of one
    # program is handed dw and db themselves (the weight's dtype): its sums are the whole answer.
    partial = tl.program_id(0).to(tl.int64) * n_cols + cols
    dw = tl.sum(dw_acc, axis=0).to(dw_partial_ptr.dtype.element_ty)
    tl.store(dw_partial_ptr + partial, dw, mask=col_mask)
    if HAS_BIAS:
        db = tl.sum(db_acc, axis=0).to(db_partial_ptr.dtype.element_ty)
        tl.store(db_partial_ptr + partial, db, mask=col_mask)


@triton.jit
def _norm_bwd_stats_kernel(
    # pointers
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    c1_ptr,
    c2_ptr,
    # sizes
    n_cols,
    # strides
    stride_dy_row,
    stride_x_row,
    # meta-parameters
    IS_RMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Wide rows, step 1 of 2: program (row, j) takes column chunk j of one row and writes its share
    # of the two row sums of the dx formula, sum(g * xhat) and sum(g) for g = w * dy, to
    # c1[row, j] and c2[row, j] (fp32). Reads x and dy once. One program per chunk, not per row:
    # a few rows (a decode step's) still spread over the whole GPU: on an H100 the backward of one
    # row of 65,536 took 12.5 µs instead of 21.3 (RMSNorm, bf16), of 64 rows 26.5 instead of 31.3;
    # at 4,096 rows it stayed within 2% (norm_wide_probe.py, results/profiles/2026-12-06-nvidia-
    # h100-80gb-hbm3-norm-wide.txt). Rows go along the grid's first axis, which has room for
    # 2^31 - 1 of them; the second has for 65,535.
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    offs = j * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < n_cols
    rstd = tl.load(rstd_ptr + row)
    mean = 0.0
    if not IS_RMS:
        mean = tl.load(mean_ptr + row)
    x = tl.load(x_ptr + row * stride_x_row + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * stride_dy_row + offs, mask=mask, other=0.0).to(tl.float32)
    g = dy * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    partial = row * tl.num_programs(1) + j
    tl.store(c1_ptr + partial, tl.sum(g * (x - mean) * rstd, axis=0))
    tl.store(c2_ptr + partial, tl.sum(g, axis=0))


@triton.jit
def _norm_bwd_dx_kernel(
    # pointers
    dy_ptr,
    x_ptr,
    w_ptr,
    mean_ptr,
    rstd_ptr,
    c1_ptr,
    c2_ptr,
    dx_ptr,
    dw_partial_ptr,
    db_partial_ptr,
    # sizes
    n_rows,
    n_cols,
    # strides
    stride_dy_row,
    stride_x_row,
    stride_dx_row,
    # meta-parameters
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    # Wide rows, step 2 of 2: program (j, g) owns column chunk j and every G-th row starting at g.
    # A row's c1 = mean(g * xhat) and c2 = mean(g) are the sums of step 1's shares, one per column
    # chunk, as many as this grid's axis 0 (CHUNKS: that count rounded up to a power of two). With
    # them dx is elementwise; dw and db for chunk j accumulate in registers.
    n_chunks = tl.num_programs(0)
    shares = tl.arange(0, CHUNKS)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], tl.float32)
    db_acc = tl.zeros([BLOCK_N], tl.float32)
    for row in tl.range(tl.program_id(1), n_rows, tl.num_programs(1)):
        row64 = tl.cast(row, tl.int64)
        x = tl.load(x_ptr + row64 * stride_x_row + cols, mask=col_mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row64 * stride_dy_row + cols, mask=col_mask, other=0.0)
        dy = dy.to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        share = row64 * n_chunks + shares
        c1 = tl.sum(tl.load(c1_ptr + share, mask=shares < n_chunks, other=0.0), axis=0) / n_cols
        if IS_RMS:
            xhat = x * rstd
            dx = (dy * w - xhat * c1) * rstd
        else:
            c2 = tl.sum(tl.load(c2_ptr + share, mask=shares < n_chunks, other=0.0), axis=0)
            xhat = (x - tl.load(mean_ptr + row)) * rstd
            dx = (dy * w - xhat * c1 - c2 / n_cols) * rstd
        tl.store(
            dx_ptr + row64 * stride_dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=col_mask
        )
        dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
    partial = tl.program_id(1).to(tl.int64) * n_cols + cols
    tl.store(dw_partial_ptr + partial, dw_acc, mask=col_mask)
    if HAS_BIAS:
        tl.store(db_partial_ptr + partial, db_acc, mask=col_mask)


# ----------------------------------------------------------------------------- launchers

_FWD = {"fused": Launcher(_norm_fwd_kernel), "looped": Launcher(_norm_fwd_looped_kernel)}
_BWD = {"fused": Launcher(_norm_bwd_kernel), "two-step": Launcher(_norm_bwd_dx_kernel)}
_BWD_STATS = Launcher(_norm_bwd_stats_kernel)


def fwd_config(n_rows: int, n_cols: int, max_fused_block: int = MAX_FUSED_BLOCK) -> dict:
    """The forward launch for ``[n_rows, n_cols]``: kernel, rows per program, block, warps, grid."""
    return row_launch(
        n_rows,
        n_cols,
        max_fused_block=max_fused_block,
        loop_block=LOOP_BLOCK,
        loop_warps=LOOP_WARPS,
        tile=TILE,
        loop_programs_per_sm=LOOP_PROGRAMS_PER_SM,
    )


def bwd_config(n_rows: int, n_cols: int, max_fused_block: int = MAX_FUSED_BLOCK_BWD) -> dict:
    """The backward launch: kernel(s), block and warps. ``programs`` is None for the fused kernel:
    the launcher runs as many as fit on the GPU at once (``kernels.launch.resident_programs``),
    or 1 for at most ``ONE_PROGRAM_BLOCKS`` blocks of rows."""
    cfg = fwd_config(n_rows, n_cols, max_fused_block)
    if cfg["kernel"] == "looped":
        programs = TWO_STEP_PROGRAMS_PER_SM * sm_count(interpreter=2)
        chunks = cdiv(n_cols, cfg["BLOCK_N"])
        return dict(cfg, kernel="two-step", programs=programs, chunks=chunks)
    # x and dy (and xhat, g, two accumulators) per element: twice the forward's warps. From 1,024
    # columns a 3-stage pipeline over rows keeps the next rows' loads in flight while this one is
    # reduced. Measured on an H100, bf16 LayerNorm backward: 0.83 -> 0.94 of the copy bandwidth at
    # 8,192 columns, 0.86 -> 0.90 at 4,096; at 256 columns (16 rows a program) it lost 3%.
    tile = cfg["BLOCK_M"] * cfg["BLOCK_N"]
    stages = BWD_STAGES if cfg["BLOCK_N"] >= 1024 else 1
    # A few row blocks (a decode step's rows): one program walks them all and writes dw and db
    # itself, one launch in all. Measured on an H100 host, the partial sums' second launch and
    # buffer cost more host time than a [8, 4096] backward takes on the GPU.
    programs = 1 if cfg["programs"] <= ONE_PROGRAM_BLOCKS else None
    return dict(cfg, num_warps=num_warps_for(2 * tile), programs=programs, stages=stages)


def _check(x, weight, bias, eps) -> None:
    check_float("x", x)
    check_float("weight", weight)
    if bias is not None:
        check_float("bias", bias)
    if x.ndim == 0:
        raise ValueError("x must have at least 1 dimension, got a 0-d tensor")
    check_device("x", x)
    n_cols, dtype, dev = x.shape[-1], x.dtype, x.device
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if t.ndim != 1 or t.shape[0] != n_cols:
            raise ValueError(
                f"{name} must have shape ({n_cols},) (x's last dimension), got {tuple(t.shape)}"
            )
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
        if t.dtype != dtype:
            raise TypeError(f"{name} must have x's dtype {dtype}, got {t.dtype}")
        if t.device != dev:
            raise ValueError(f"{name} must be on x's device {dev}, got {t.device}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative number, got {eps!r}")


def _fwd_meta(cfg: dict, is_rms: bool, has_bias: bool, stats: bool = True) -> dict:
    meta = dict(IS_RMS=is_rms, HAS_BIAS=has_bias, BLOCK_N=cfg["BLOCK_N"], STATS=stats)
    if cfg["kernel"] == "fused":
        meta["BLOCK_M"] = cfg["BLOCK_M"]
    return dict(meta, num_warps=cfg["num_warps"])


# (rows, columns, is_rms, has_bias, stats) -> (launcher, grid, meta) of the default forward launch.
_FWD_PLANS: dict[tuple, tuple] = {}


def _forward(x, weight, bias, eps, is_rms, cfg=None, stats=True):
    """y, mean, rstd for x viewed as rows (mean is None for RMSNorm). ``stats=False`` (no
    gradient wanted): mean and rstd are neither written nor allocated, and come back as None."""
    n_cols = x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    if cfg is None:
        op = "rms_norm_fwd" if is_rms else "layer_norm_fwd"
        wide = cluster_path(x, n_rows, op, weight, bias)  # rows of 32,769+ values on Hopper
        if wide is not None:
            return wide.norm_forward(x, weight, bias, eps, is_rms, stats)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    rstd = x.new_empty(n_rows, dtype=torch.float32) if stats else None
    mean = None if is_rms or not stats else x.new_empty(n_rows, dtype=torch.float32)
    if n_rows == 0 or n_cols == 0:
        return y, mean, rstd
    has_bias = bias is not None
    if cfg is None:
        key = (n_rows, n_cols, is_rms, has_bias, stats)
        plan = _FWD_PLANS.get(key)
        if plan is None:
            cfg = fwd_config(n_rows, n_cols)
            meta = _fwd_meta(cfg, is_rms, has_bias, stats)
            plan = _FWD_PLANS[key] = (_FWD[cfg["kernel"]], (cfg["programs"],), meta, key)
        launcher, grid, meta, key = plan
    else:
        meta = _fwd_meta(cfg, is_rms, has_bias, stats)
        launcher, grid = _FWD[cfg["kernel"]], (cfg["programs"],)
        key = (n_rows, n_cols, cfg["programs"], *sorted(meta.items()))
    n_rows, stride = row_stride("x", x)
    b = weight if bias is None else bias
    # y, mean and rstd are new (contiguous, aligned): the key needs the inputs' layout only.
    key = (x.dtype, stride, aligned(x), aligned(weight), aligned(b), key)
    if stats:
        saved = (rstd if mean is None else mean, rstd)
    else:
        saved = (y, y)  # not written (STATS=False): any pointer will do
    args = (x, weight, b, y, *saved, n_rows, n_cols, float(eps))
    launcher(key, grid, (*args, stride, n_cols), **meta)
    return y, mean, rstd


def _launch_fwd(x2, weight, bias, y2, mean, rstd, eps, cfg):
    """Launch the forward kernel ``cfg`` names on 2-D ``x2`` -> ``y2``; returns Triton's compiled
    kernel (None in the interpreter)."""
    n_rows, n_cols = x2.shape
    meta = _fwd_meta(cfg, mean is None, bias is not None)
    b = weight if bias is None else bias
    strides = (x2.stride(0), y2.stride(0))
    key = (x2.dtype, n_rows, n_cols, *strides, cfg["programs"], *sorted(meta.items()))
    key += tuple(aligned(t) for t in (x2, weight, b, y2))
    args = (x2, weight, b, y2, rstd if mean is None else mean, rstd, n_rows, n_cols, float(eps))
    return _FWD[cfg["kernel"]](key, (cfg["programs"],), (*args, *strides), **meta)


_RESIDENT: dict[tuple, int] = {}  # resident programs of each compiled backward kernel
# (rows, columns) -> the default backward configuration.
_BWD_PLANS: dict[tuple, dict] = {}


@dataclass(frozen=True)
class _BwdPlan:
    """The fused backward's two launches for one layout of (dy, x, weight): everything
    ``_backward`` works out from shapes, strides and alignment alone."""

    copy_dy: bool  # dy must be made contiguous (its last dim has stride 0: .sum().backward())
    n_rows: int
    n_cols: int
    strides: tuple[int, int, int]  # dy's, x's and dx's row strides
    partials_shape: tuple[int, int, int]
    launch: tuple  # the backward kernel's (key, grid, meta)
    sum_launch: tuple | None  # the partial sums' reduction's (key, grid, meta); None: one program


# (dy, x, weight, rstd (and mean) layouts, bias or not) -> the fused backward's plan. A training step
# calls the backward with the same layouts on every step: the launch arithmetic runs once.
_BWD_LAYOUTS = Plans()


def _backward(dy, x, weight, mean, rstd, has_bias, cfg=None):
    """dx, dweight, dbias (None without a bias) for x viewed as rows."""
    layout = None
    if cfg is None:
        n_cols = x.shape[-1]
        op = "rms_norm_bwd" if mean is None else "layer_norm_bwd"
        wide = cluster_path(x, x.numel() // n_cols if n_cols else 0, op, weight)
        if wide is not None:
            return wide.norm_backward(dy, x, weight, mean, rstd, has_bias)
        saved = (rstd,) if mean is None else (rstd, mean)
        layout = layout_key((dy, x, weight, *saved), has_bias)
        plan = _BWD_LAYOUTS.get(layout)
        if plan is not None:
            return _backward_planned(plan, dy, x, weight, mean, rstd, has_bias)
    n_cols = x.shape[-1]
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    n_rows = x.numel() // n_cols if n_cols else 0
    if n_rows == 0 or n_cols == 0:
        dw = torch.zeros_like(weight)
        return dx, dw, (torch.zeros_like(weight) if has_bias else None)
    if cfg is None:
        cfg = _BWD_PLANS.get((n_rows, n_cols))
        if cfg is None:
            cfg = _BWD_PLANS[(n_rows, n_cols)] = bwd_config(n_rows, n_cols)
    copy_dy = dy.stride(-1) != 1 and n_cols > 1
    if copy_dy:
        dy = dy.contiguous()  # an expanded gradient (from .sum().backward()) has column stride 0
    _, x_stride = row_stride("x", x)
    _, dy_stride = row_stride("dy", dy)
    strides = (dy_stride, x_stride, n_cols)
    _, partials, main, one = _launch_bwd_rows(
        dy, x, weight, mean, rstd, dx, has_bias, n_rows, n_cols, strides, cfg, direct=True
    )
    if one:
        grads = partials[:, 0]  # one program wrote dw and db themselves
        sum_launch = None
    else:
        grads = partial_sums.sum_stacked(partials, weight.dtype)
        sum_launch = partial_sums.sum_launch(partials.shape, weight.dtype)
    if layout is not None and cfg["kernel"] == "fused":
        plan = _BwdPlan(copy_dy, n_rows, n_cols, strides, tuple(partials.shape), main,
                        sum_launch)  # fmt: skip
        _BWD_LAYOUTS.put(layout, plan)
    return dx, grads[0], (grads[1] if has_bias else None)


def _backward_planned(p: _BwdPlan, dy, x, weight, mean, rstd, has_bias):
    """``_backward`` for a layout seen before: the same launches, worked out already."""
    if p.copy_dy:
        dy = dy.contiguous()
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    key, grid, meta = p.launch
    if p.sum_launch is None:  # one program: it writes dw (and db) in the weight's dtype
        dw = torch.empty_like(weight)
        db = torch.empty_like(weight) if has_bias else dw
        args = (dy, x, weight, rstd if mean is None else mean, rstd, dx, dw, db)
        _BWD["fused"](key, grid, (*args, p.n_rows, p.n_cols, *p.strides), **meta)
        return dx, dw, (db if has_bias else None)
    partials = x.new_empty(p.partials_shape, dtype=torch.float32)
    dw_part = partials[0]
    db_part = partials[1] if has_bias else dw_part
    args = (dy, x, weight, rstd if mean is None else mean, rstd, dx, dw_part, db_part)
    _BWD["fused"](key, grid, (*args, p.n_rows, p.n_cols, *p.strides), **meta)
    grads = partials.new_empty((p.partials_shape[0], p.n_cols), dtype=weight.dtype)
    partial_sums.run(p.sum_launch, partials, grads)
    return dx, grads[0], (grads[1] if has_bias else None)


def _launch_bwd(dy2, x2, weight, mean, rstd, dx2, has_bias, cfg):
    """Launch the backward kernel(s) ``cfg`` names on 2-D tensors; returns (compiled dx kernel,
    dw partial sums, db partial sums): ``_sum_partials`` finishes each."""
    n_rows, n_cols = x2.shape
    strides = (dy2.stride(0), x2.stride(0), dx2.stride(0))
    kernel, partials, _, _ = _launch_bwd_rows(
        dy2, x2, weight, mean, rstd, dx2, has_bias, n_rows, n_cols, strides, cfg
    )
    return kernel, partials[0], (partials[1] if has_bias else partials[0])


def _bwd_programs(dy, x, weight, mean, rstd, dx, n_rows, n_cols, strides, meta) -> int:
    """Programs of the persistent in-register backward: as many as the GPU holds at once."""
    if not device.GPU_MODE:
        return 4  # the interpreter runs programs one by one; a few exercise the partial sums
    key = (x.dtype, torch.cuda.current_device(), *sorted(meta.items()))
    if key not in _RESIDENT:
        # Compile (or fetch) without launching to learn the kernel's registers; a placeholder
        # stands in for the partial sums, whose size depends on the answer.
        tmp = torch.empty(1, device=x.device, dtype=torch.float32)
        compiled = _norm_bwd_kernel.warmup(
            dy, x, weight, mean, rstd, dx, tmp, tmp, n_rows, n_cols, *strides, grid=(1,), **meta
        )
        _RESIDENT[key] = resident_programs(compiled)
    return _RESIDENT[key]


def _bwd_meta(cfg: dict, is_rms: bool, has_bias: bool) -> dict:
    """The constexprs and warps of the backward's dx kernel (fused or two-step) ``cfg`` names."""
    meta = dict(IS_RMS=is_rms, HAS_BIAS=has_bias, num_warps=cfg["num_warps"])
    if cfg["kernel"] == "fused":
        return meta | dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], NUM_STAGES=cfg["stages"])
    return meta | dict(BLOCK_N=cfg["BLOCK_N"], CHUNKS=next_power_of_2(cfg["chunks"]))


def _bwd_stats_meta(cfg: dict, is_rms: bool) -> dict:
    """The two-step backward's row-sums kernel: its constexprs and warps (grid: rows x chunks)."""
    return dict(IS_RMS=is_rms, BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"])


def _bwd_grid(cfg: dict, n_rows: int, n_cols: int, programs: int | None) -> tuple[tuple, int]:
    """(grid, rows of partial sums) of the backward's dx kernel: the fused kernel runs
    ``programs`` (``cfg``'s or as many as fit on the GPU) and writes a row each; the two-step
    kernel tiles columns by rows and writes a row per group of rows."""
    if cfg["kernel"] == "fused":
        grid = (min(cdiv(n_rows, cfg["BLOCK_M"]), programs),)
        return grid, grid[0]
    n_chunks = cdiv(n_cols, cfg["BLOCK_N"])
    grid = (n_chunks, max(1, min(n_rows, cfg["programs"] // n_chunks)))
    return grid, grid[1]


def _launch_bwd_rows(
    dy, x, weight, mean, rstd, dx, has_bias, n_rows, n_cols, strides, cfg, direct=False
):
    """The backward kernel(s) on tensors of ``n_rows`` rows with row ``strides`` (dy, x, dx);
    returns (compiled dx kernel, stacked fp32 partial sums [1 or 2, n_partials, n_cols], the main
    launch's (launcher key, grid, meta), and whether one program ran). With ``direct`` and a
    configuration of one program (``bwd_config``), that program writes dw (and db) in the weight's
    dtype instead: ``[1 or 2, 1, n_cols]``, the finished sums."""
    is_rms = mean is None
    mean = rstd if is_rms else mean
    meta = _bwd_meta(cfg, is_rms, has_bias)
    key = (x.dtype, n_rows, n_cols, *strides, aligned(dy), aligned(x), aligned(weight))
    key += (aligned(dx), aligned(mean), aligned(rstd))
    programs = cfg["programs"]
    if cfg["kernel"] == "fused":
        programs = programs or _bwd_programs(
            dy, x, weight, mean, rstd, dx, n_rows, n_cols, strides, meta
        )
    else:
        stats = x.new_empty((2, n_rows, cfg["chunks"]), dtype=torch.float32)
        c1, c2 = stats[0], stats[1]
        _BWD_STATS(
            (*key, is_rms, cfg["BLOCK_N"], cfg["num_warps"]),
            (n_rows, cfg["chunks"]),
            (dy, x, weight, mean, rstd, c1, c2, n_cols, *strides[:2]),
            **_bwd_stats_meta(cfg, is_rms),
        )
    grid, n_partials = _bwd_grid(cfg, n_rows, n_cols, programs)
    one = direct and cfg["kernel"] == "fused" and cfg["programs"] == 1
    out_dtype = weight.dtype if one else torch.float32
    partials = x.new_empty((2 if has_bias else 1, n_partials, n_cols), dtype=out_dtype)
    db_part = partials[1] if has_bias else partials[0]
    key += (grid, out_dtype, *sorted(meta.items()))
    if cfg["kernel"] == "fused":
        args = (dy, x, weight, mean, rstd, dx, partials[0], db_part, n_rows, n_cols, *strides)
    else:
        args = (dy, x, weight, mean, rstd, c1, c2, dx, partials[0], db_part, n_rows, n_cols)
        args += strides
    kernel = _BWD[cfg["kernel"]](key, grid, args, **meta)
    return kernel, partials, (key, grid, meta), one


def _sum_partials(partial: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Column sums of one ``[n_partials, n_cols]`` block of fp32 partial sums, in ``dtype``."""
    return partial_sums.sum_stacked(partial.unsqueeze(0), dtype)[0]


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms):
        y, mean, rstd = _forward(x, weight, bias, eps, is_rms)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _backward(dy, x, weight, mean, rstd, ctx.has_bias)
        return dx, dw, db, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (fp32/fp16/bf16), ``weight`` of x's dtype and
    shape ``[x.shape[-1]]``; fp32 statistics; differentiable with respect to ``x`` and ``weight``."""
    y = replay.call(replay.RMS_NORM, x, weight, None, eps)  # a layout seen before, on a GPU
    if y is not None:
        return y
    _check(x, weight, None, eps)
    _plan_native(x, weight, None, eps, True)
    # Autograd's bookkeeping costs microseconds per call: pay it only when a gradient is wanted.
    if replay.wants_grad(x, weight):
        return _Norm.apply(x, weight, None, eps, True)
    return _forward(x, weight, None, eps, True, stats=False)[0]


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x`` with ``weight`` and optional ``bias`` (both of
    x's dtype, shape ``[x.shape[-1]]``); fp32 statistics; differentiable in x, weight and bias."""
    y = replay.call(replay.LAYER_NORM, x, weight, bias, eps)
    if y is not None:
        return y
    _check(x, weight, bias, eps)
    _plan_native(x, weight, bias, eps, False)
    if replay.wants_grad(x, weight, bias):
        return _Norm.apply(x, weight, bias, eps, False)
    return _forward(x, weight, bias, eps, False, stats=False)[0]


# ----------------------------------------------------------------------------- the C++ launch path
#
# kernels.replay launches a layout's kernels from C++ once the layout has a plan: the slots of its
# tensors, what to allocate, and each launch's compiled kernel, grid and arguments. The plan is
# made here, from the same configuration functions and argument lists as the Python path above.

_X, _W, _B, _Y, _MEAN, _RSTD, _DY, _DX, _GRADS, _PART, _DW, _DB, _C = range(13)


def _plan_native(x, weight, bias, eps, is_rms) -> None:
    """Give kernels.replay this layout's plan (checked inputs only), if it can run it. Layouts
    whose forward or backward takes the cluster kernels (kernels.cuda.cluster_rows) are not
    planned: they stay on the Python path, whose host cost is small beside theirs on the GPU."""
    name, n_cols = "rms_norm" if is_rms else "layer_norm", x.shape[-1]
    n_rows = x.numel() // n_cols if n_cols else 0
    wide = any(cluster_path(x, n_rows, f"{name}_{d}", weight, bias) for d in ("fwd", "bwd"))
    if not wide and replay.planning(x):
        replay.build(_native_plan, x, weight, bias, eps, is_rms)


def _native_plan(x, weight, bias, eps, is_rms) -> None:
    n_rows, stride = row_stride("x", x)
    n_cols = x.shape[-1]
    bcfg = bwd_config(n_rows, n_cols)
    slots = [None] * replay.N_SLOTS
    slots[_X], slots[_W], slots[_B] = x, weight, bias
    fwd = _native_forward(slots, n_rows, n_cols, stride, eps, is_rms, bias is not None, True)
    nograd = _native_forward(slots, n_rows, n_cols, stride, eps, is_rms, bias is not None, False)
    bwd = _native_backward(slots, n_rows, n_cols, stride, is_rms, bias is not None, bcfg)
    saved = [_X, _W, _RSTD] if is_rms else [_X, _W, _MEAN, _RSTD]
    grads = [_DX, _DW, _DB if bias is not None else -1]
    op = replay.RMS_NORM if is_rms else replay.LAYER_NORM
    replay.add(op, x, weight, bias, eps, fwd, nograd, bwd, _Y, _DY, saved, grads)


def _native_forward(slots, n_rows, n_cols, stride, eps, is_rms, has_bias, stats) -> replay.Program:
    """The forward as ``_forward`` launches it: y, and mean/rstd if ``stats``."""
    allocs = [replay.Alloc(replay.LIKE, _Y, _X)]
    if stats:
        if not is_rms:
            allocs.append(replay.Alloc(replay.NEW, _MEAN, _X, dtype=replay.FP32, shape=(n_rows,)))
        allocs.append(replay.Alloc(replay.NEW, _RSTD, _X, dtype=replay.FP32, shape=(n_rows,)))
        saved = (replay.Slot(_RSTD if is_rms else _MEAN), replay.Slot(_RSTD))
    else:
        saved = (replay.Slot(_Y), replay.Slot(_Y))  # not written (STATS=False)
    b = replay.Slot(_B if has_bias else _W)
    args = (replay.Slot(_X), replay.Slot(_W), b, replay.Slot(_Y), *saved, n_rows, n_cols,
            float(eps), stride, n_cols)  # fmt: skip
    cfg = fwd_config(n_rows, n_cols)
    meta = _fwd_meta(cfg, is_rms, has_bias, stats)
    kernel = _norm_fwd_kernel if cfg["kernel"] == "fused" else _norm_fwd_looped_kernel
    replay.materialize(allocs, slots)
    grid = (cfg["programs"],)
    return replay.Program(allocs, [replay.compiled_step(kernel, args, slots, grid, meta)])


def _native_backward(slots, n_rows, n_cols, stride, is_rms, has_bias, cfg) -> replay.Program:
    """The backward as ``_backward`` launches it, fused or two-step (dy contiguous: replay.cpp
    sees to it)."""
    S = replay.Slot
    n_grads = 2 if has_bias else 1
    slots[_DY] = torch.empty_like(slots[_Y])  # what the compile sees for dy: fresh, contiguous
    mean = S(_RSTD if is_rms else _MEAN)
    strides = (n_cols, stride, n_cols)
    inputs = (S(_DY), S(_X), S(_W), mean, S(_RSTD))
    allocs = [replay.Alloc(replay.LIKE, _DX, _X)]
    steps = []
    meta = _bwd_meta(cfg, is_rms, has_bias)
    programs = cfg["programs"]
    if cfg["kernel"] == "fused":
        replay.materialize(allocs, slots)
        programs = programs or _bwd_programs(
            *replay.real((*inputs, S(_DX)), slots), n_rows, n_cols, strides, meta
        )
        kernel, middle = _norm_bwd_kernel, ()
    else:  # two-step: the row sums' shares first, then dx by column chunks
        shape = (2, n_rows, cfg["chunks"])
        allocs.append(replay.Alloc(replay.NEW, _C, _X, dtype=replay.FP32, shape=shape))
        replay.materialize(allocs, slots)
        middle = (S(_C), S(_C, n_rows * cfg["chunks"] * 4))
        args = (*inputs, *middle, n_cols, *strides[:2])
        stats_grid = (n_rows, cfg["chunks"])
        stats_meta = _bwd_stats_meta(cfg, is_rms)
        steps.append(
            replay.compiled_step(_norm_bwd_stats_kernel, args, slots, stats_grid, stats_meta)
        )
        kernel = _norm_bwd_dx_kernel
    grid, n_partials = _bwd_grid(cfg, n_rows, n_cols, programs)
    grads = replay.Alloc(replay.NEW, _GRADS, _W, shape=(n_grads, n_cols))  # the weight's dtype
    one = cfg["kernel"] == "fused" and cfg["programs"] == 1
    if one:  # one program writes dw and db themselves
        allocs.append(grads)
        sums, row = _GRADS, n_cols * slots[_W].element_size()
    else:
        shape = (n_grads, n_partials, n_cols)
        allocs += [replay.Alloc(replay.NEW, _PART, _X, dtype=replay.FP32, shape=shape), grads]
        sums, row = _PART, n_partials * n_cols * 4
    allocs.append(replay.Alloc(replay.SELECT, _DW, _GRADS, index=0))
    if has_bias:
        allocs.append(replay.Alloc(replay.SELECT, _DB, _GRADS, index=1))
    dw = S(sums)
    db = S(sums, row) if has_bias else dw
    args = (*inputs, *middle, S(_DX), dw, db, n_rows, n_cols, *strides)
    replay.materialize(allocs, slots)
    steps.append(replay.compiled_step(kernel, args, slots, grid, meta))
    if not one:
        _, sum_grid, sum_meta = partial_sums.sum_launch(shape, slots[_W].dtype)
        sum_args = (S(_PART), S(_GRADS), n_partials, n_cols)
        sum_kernel = partial_sums._sum_kernel
        steps.append(replay.compiled_step(sum_kernel, sum_args, slots, sum_grid, sum_meta))
    return replay.Program(allocs, steps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The reference in fp32, returned in x's dtype (differentiable, for checking gradients)."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype)


def layer_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """``torch.nn.functional.layer_norm`` in fp32, returned in x's dtype."""
    b = None if bias is None else bias.float()
    n = (x.shape[-1],)
    return torch.nn.functional.layer_norm(x.float(), n, weight.float(), b, eps).to(x.dtype)


def eager_layer_norm(x, weight, bias, eps: float = 1e-5):
    """LayerNorm as separate PyTorch ops: the traffic that a fused kernel saves."""
    mean = x.mean(dim=-1, keepdim=True)  # read x
    xc = x - mean  # read x, write xc
    var = (xc * xc).mean(dim=-1, keepdim=True)  # read xc, write xc^2; read xc^2
    xhat = xc * torch.rsqrt(var + eps)  # read xc, write xhat
    return xhat * weight + bias  # read xhat, write t; read t, write y


# Full-size HBM passes of each version of the LayerNorm forward (one [R, C] read or write = 1).
EAGER_LN_PASSES = {
    "mean": 1, "x - mean": 2, "xc * xc": 2, "mean(xc^2)": 1, "xc * rstd": 2, "* w": 2, "+ b": 2,
}  # fmt: skip
FUSED_FWD_PASSES = 2  # read x, write y
FUSED_BWD_PASSES = 3  # read x and dy, write dx
TWO_STEP_BWD_PASSES = 5  # read x and dy twice, write dx


def _spec(kernel, signature: dict, constexprs: dict, num_warps: int) -> dict:
    return dict(
        kernel=kernel, signature=signature, constexprs=constexprs, options={"num_warps": num_warps}
    )


def _compile_specs() -> list[dict]:
    specs = []
    i32, i64, f32 = "i32", "i64", "fp32"
    for t in ("fp32", "bf16"):
        ptr, fptr = f"*{t}", "*fp32"
        fwd_sig = {"x_ptr": ptr, "w_ptr": ptr, "b_ptr": ptr, "y_ptr": ptr, "mean_ptr": fptr}
        fwd_sig |= {"rstd_ptr": fptr, "n_rows": i32, "n_cols": i32, "eps": f32}
        fwd_sig |= {"stride_x_row": i64, "stride_y_row": i64}
        bwd_sig = {"dy_ptr": ptr, "x_ptr": ptr, "w_ptr": ptr, "mean_ptr": fptr, "rstd_ptr": fptr}
        for is_rms, has_bias in ((True, False), (False, True)):
            flags = {"IS_RMS": is_rms, "HAS_BIAS": has_bias}
            for bm, bn in ((16, 256), (1, MAX_FUSED_BLOCK)):
                specs.append(
                    _spec(_norm_fwd_kernel, fwd_sig,
                          flags | {"BLOCK_M": bm, "BLOCK_N": bn, "STATS": True},
                          num_warps_for(bm * bn))
                )  # fmt: skip
            specs.append(
                _spec(
                    _norm_fwd_looped_kernel,
                    fwd_sig,
                    flags | {"BLOCK_N": LOOP_BLOCK, "STATS": True},
                    LOOP_WARPS,
                )
            )
            sig = bwd_sig | {"dx_ptr": ptr, "dw_partial_ptr": fptr, "db_partial_ptr": fptr}
            sig |= {"n_rows": i32, "n_cols": i32}
            sig |= {"stride_dy_row": i64, "stride_x_row": i64, "stride_dx_row": i64}
            for bm, bn in ((16, 256), (1, MAX_FUSED_BLOCK_BWD)):
                specs.append(
                    _spec(_norm_bwd_kernel, sig,
                          flags | {"BLOCK_M": bm, "BLOCK_N": bn, "NUM_STAGES": BWD_STAGES},
                          num_warps_for(2 * bm * bn))
                )  # fmt: skip
            sig = bwd_sig | {"c1_ptr": fptr, "c2_ptr": fptr, "n_cols": i32}
            sig |= {"stride_dy_row": i64, "stride_x_row": i64}
            specs.append(
                _spec(_norm_bwd_stats_kernel, sig,
                      {"IS_RMS": is_rms, "BLOCK_N": LOOP_BLOCK},
                      LOOP_WARPS)
            )  # fmt: skip
            sig = bwd_sig | {"c1_ptr": fptr, "c2_ptr": fptr, "dx_ptr": ptr}
            sig |= {"dw_partial_ptr": fptr, "db_partial_ptr": fptr, "n_rows": i32, "n_cols": i32}
            sig |= {"stride_dy_row": i64, "stride_x_row": i64, "stride_dx_row": i64}
            specs.append(
                _spec(_norm_bwd_dx_kernel, sig, flags | {"BLOCK_N": LOOP_BLOCK, "CHUNKS": 16},
                      LOOP_WARPS)
            )  # fmt: skip
    return specs


# Signatures for the ahead-of-time compile check (tests compile every kernel for sm_90 and sm_75).
COMPILE_SPECS = _compile_specs()


# ----------------------------------------------------------------------------- benchmark

WIDTHS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
TENSOR_BYTES = 2**29  # each [rows, width] input: 512 MiB, ten times the H100's L2


def make_inputs(rows: int, cols: int, dtype: torch.dtype, dev=None, seed: int = 0):
    """x, weight, bias and an upstream gradient dy, random, on ``dev`` (default: the device)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    dev = dev or device.DEVICE

    def rnd(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(dev, dtype)

    return rnd(rows, cols), rnd(cols, scale=0.1, shift=1.0), rnd(cols, scale=0.1), rnd(rows, cols)


def _torch_norm(kind: str, x, w, b, n: int):
    if kind == "rms_norm":
        return torch.nn.functional.rms_norm(x, (n,), w, 1e-6)
    return torch.nn.functional.layer_norm(x, (n,), w, b, 1e-5)


def _bench_shape(kind: str, x, wt, b, dy, copy: roofline.Ceiling) -> list[dict]:
    """Ours and PyTorch's ``kind`` (rms_norm or layer_norm), forward and backward, on one shape."""
    n, es = x.shape[-1], x.element_size()
    bias = b if kind == "layer_norm" else None
    if kind == "rms_norm":
        ours_f = lambda: rms_norm(x, wt)  # noqa: E731
    else:
        ours_f = lambda: layer_norm(x, wt, bias)  # noqa: E731
    torch_f = lambda: _torch_norm(kind, x, wt, bias, n)  # noqa: E731
    torch.testing.assert_close(ours_f(), torch_f(), rtol=2e-2, atol=2e-2)
    fwd = {
        "triton": bench.measure(ours_f, bytes=FUSED_FWD_PASSES * x.numel() * es),
        "torch": bench.measure(torch_f, bytes=FUSED_FWD_PASSES * x.numel() * es),
    }
    # Backward through autograd for both, so both pay the same framework overhead.
    bwd = {}
    for name, f in (("triton", ours_f), ("torch", torch_f)):
        leaves = [t.requires_grad_() for t in (x, wt, bias) if t is not None]
        y = f()
        bwd[name] = bench.measure(
            lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True),  # noqa: B023
            bytes=FUSED_BWD_PASSES * x.numel() * es,
        )
        for t in leaves:
            t.requires_grad_(False)
    ceil, shape, recs = ("copy", copy.value), list(x.shape), []
    for op, m in ((f"{kind}_fwd", fwd), (f"{kind}_bwd", bwd)):
        base = ("torch", m["torch"])
        recs.append(bench.record(op, "triton", shape, x.dtype, m["triton"], baseline=base,
                                 ceiling=ceil))  # fmt: skip
        recs.append(bench.record(op, "torch", shape, x.dtype, m["torch"], ceiling=ceil))
    return recs


@bench.register("norms")
def _bench_norms(quick: bool) -> list[dict]:
    copy = roofline.copy_bandwidth()
    widths = [4096] if quick else WIDTHS
    dtypes = [device.preferred_dtype(torch.bfloat16)] + ([] if quick else [torch.float32])
    tensor_bytes = TENSOR_BYTES if device.GPU_MODE else 2**15
    if not device.GPU_MODE:
        widths = [256, 1000]
    recs = []
    for dtype in dtypes:
        for w in widths:
            rows = max(1, tensor_bytes // (w * torch.empty((), dtype=dtype).element_size()))
            x, wt, b, dy = make_inputs(rows, w, dtype)
            for kind in ("rms_norm", "layer_norm"):
                recs += _bench_shape(kind, x, wt, b, dy, copy)
    return recs
