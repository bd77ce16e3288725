"""Row softmax over the last dimension: one HBM read and one HBM write per element.

``softmax(x)`` computes ``exp(x - max) / sum(exp(x - max))`` along the last dimension of an fp32,
fp16 or bf16 tensor, in fp32 arithmetic, rounded once on the store. Written as separate PyTorch ops
(max, subtract, exp, sum, divide) the same function moves every element through HBM eight times;
a fused kernel moves it twice, once in and once out, which is all a memory-bound op can hope for.

Two kernels, picked by the width of a row:

- ``_softmax_kernel`` holds whole rows in registers. One program handles ``BLOCK_M`` rows of
  ``BLOCK_N = next_power_of_2(width)`` columns; narrow rows are packed several to a program so each
  program still holds 4,096 values (8 to 16 KiB each way). Traffic: read ``R*C``, write ``R*C``
  elements.
- ``_softmax_looped_kernel`` is for rows too wide for registers (``BLOCK_N > MAX_FUSED_BLOCK``).
  It walks the row in chunks twice: the first pass keeps a running max and a running sum of
  exponentials rescaled to that max (the online normaliser of Milakov and Gimelshein, 2018), the
  second re-reads the row, normalises and writes it. Traffic: read ``2*R*C``, write ``R*C``, less
  whatever part of the second read the L2 cache serves (the second pass walks the row backwards so
  the chunks read last in the first pass, the likeliest to still be in L2, come first).

The backward pass, ``dx = y * (dy - sum(y * dy))`` per row, has the same two shapes
(``_softmax_bwd_kernel``, ``_softmax_bwd_looped_kernel``): read ``y`` and ``dy``, write ``dx``.

On a Hopper GPU, rows wider than 32,768 values (1,024 rows or more) may instead be split across
the CTAs of a thread-block cluster (``kernels.cuda.cluster_rows``, page 4.5): read once and written
once at any width up to 65,536, where it measured faster than these kernels.

Launches go through ``kernels.rows``: the plan of each ``(rows, width)`` is worked out once and the
compiled kernel is called without Triton's per-call argument binding, so a one-row softmax costs
about what ``torch.softmax`` costs on the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import bench, device, launch, replay, roofline, rows

SUPPORTED_DTYPES = rows.SUPPORTED_DTYPES

# Rows narrower than TILE elements are packed ROWS = TILE // BLOCK_N to a program, so that a program
# for 256-wide bf16 rows still moves 8 KiB in and 8 KiB out instead of 512 bytes.
TILE = 4096
# The widest row (padded to a power of two) held in registers. At 32,768 columns and 16 warps a
# thread holds 64 fp32 values and nothing spills. At 65,536 the fp32 row is 256 KiB, the whole
# register file of an H100 SM, so some values spill to local memory. Measured on an H100 that
# still beat the looped kernel when it ran one program per row: 0.85 of the copy bandwidth against
# 0.75 in bf16, 0.72 against 0.68 in fp32 (notebooks/04c-fused-softmax-norms.ipynb). The looped
# kernel now walks rows over a grid of LOOP_PROGRAMS_PER_SM programs per SM so that the rows in
# flight fit in L2; scripts/gpu/rows_probe.py --sweep times it against this limit. Past it, the
# looped kernel takes over.
MAX_FUSED_BLOCK = 65536
# The backward holds two rows (y and dy) per element: a quarter of the forward's width.
MAX_FUSED_BLOCK_BWD = 16384
# Chunk of the looped kernels, their warps, and their programs per SM: each program walks whole
# rows, so the rows in flight (programs x row bytes) should fit in L2 for the second read to hit.
LOOP_BLOCK = 8192
LOOP_WARPS = 16
LOOP_PROGRAMS_PER_SM = 2
# fp32's most negative finite value: the looped kernel's initial running max. Starting from -inf
# instead would make exp(m - m_new) = exp(-inf + inf) = NaN in lanes that have only seen padding.
_FP32_MIN = -3.4028234663852886e38


@triton.jit
def _softmax_kernel(
    # pointers
    x_ptr,
    y_ptr,
    # sizes
    n_rows,
    n_cols,
    # strides (elements between the starts of consecutive rows; columns are contiguous)
    stride_x_row,
    stride_y_row,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # BLOCK_M whole rows per program, held in registers: read R*C elements, write R*C, nothing else.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols[None, :] < n_cols
    # The last program may run past the last row: its extra rows recompute the last real row
    # (loads stay in bounds, no NaN from all-padding rows) and the store mask drops them.
    # Row offsets in int64: R * stride can pass 2**31 elements on an 80 GB GPU.
    rows64 = tl.minimum(rows, n_rows - 1).to(tl.int64)
    # Padding columns load -inf: they do not change the max, and exp(-inf) = 0 adds nothing to the sum.
    x = tl.load(
        x_ptr + rows64[:, None] * stride_x_row + cols[None, :], mask=col_mask, other=-float("inf")
    )
    # fp32 math whatever the storage type: a bf16 sum of thousands of terms would keep 8 bits.
    x = x.to(tl.float32)
    # Subtracting the row max keeps exp() <= 1: no overflow for any input, and the largest term is
    # exactly 1, so the sum is at least 1 and the division is well conditioned.
    row_max = tl.max(x, axis=1)
    num = tl.exp(x - row_max[:, None])
    den = tl.sum(num, axis=1)
    # One division per row, then a multiply per element.
    y = num * (1.0 / den)[:, None]
    tl.store(
        y_ptr + rows64[:, None] * stride_y_row + cols[None, :],
        y.to(y_ptr.dtype.element_ty),
        mask=(rows[:, None] < n_rows) & col_mask,
    )


@triton.jit
def _softmax_looped_kernel(
    # pointers
    x_ptr,
    y_ptr,
    # sizes
    n_rows,
    n_cols,
    # strides
    stride_x_row,
    stride_y_row,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    FP32_MIN: tl.constexpr,
):
    # Rows walked in BLOCK_N chunks, read 2*C elements and write C per row. A program takes every
    # num_programs-th row: with a grid of a few programs per SM, the rows in flight at once fit in
    # L2 and the second read of each row comes from there rather than from HBM.
    cols = tl.arange(0, BLOCK_N)
    n_chunks = tl.cdiv(n_cols, BLOCK_N)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row64 = tl.cast(row, tl.int64)
        x_row = x_ptr + row64 * stride_x_row
        y_row = y_ptr + row64 * stride_y_row
        # Pass 1, the online normaliser: lane i keeps the max m_i of the values it has seen and
        # l_i = sum exp(x - m_i). A new value x rescales the old sum to the new max:
        #   m' = max(m, x),  l' = l * exp(m - m') + exp(x - m').
        m = tl.full([BLOCK_N], FP32_MIN, tl.float32)
        l_sum = tl.zeros([BLOCK_N], tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            offs = start + cols
            x = tl.load(x_row + offs, mask=offs < n_cols, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            l_sum = l_sum * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        # Merge the lanes the same way: rescale each lane's sum to the row max.
        row_max = tl.max(m, axis=0)
        inv_sum = 1.0 / tl.sum(l_sum * tl.exp(m - row_max), axis=0)
        # Pass 2: re-read, normalise, write; last chunk first, the likeliest still in L2.
        for i in range(0, n_chunks):
            offs = (n_chunks - 1 - i) * BLOCK_N + cols
            mask = offs < n_cols
            x = tl.load(x_row + offs, mask=mask, other=-float("inf")).to(tl.float32)
            y = tl.exp(x - row_max) * inv_sum
            tl.store(y_row + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd_kernel(
    # pointers
    y_ptr,
    dy_ptr,
    dx_ptr,
    # sizes
    n_rows,
    n_cols,
    # strides
    stride_y_row,
    stride_dy_row,
    stride_dx_row,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # The backward of y = softmax(x): dx = y * (dy - sum(y * dy)) per row. BLOCK_M whole rows per
    # program in registers: read y and dy once, write dx once (3 passes; PyTorch's is the same).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols[None, :] < n_cols
    # Rows past the end recompute the last row (in bounds), and the store mask drops them.
    rows64 = tl.minimum(rows, n_rows - 1).to(tl.int64)[:, None]
    y = tl.load(y_ptr + rows64 * stride_y_row + cols[None, :], mask=col_mask, other=0.0)
    dy = tl.load(dy_ptr + rows64 * stride_dy_row + cols[None, :], mask=col_mask, other=0.0)
    y, dy = y.to(tl.float32), dy.to(tl.float32)
    dot = tl.sum(y * dy, axis=1)
    dx = y * (dy - dot[:, None])
    tl.store(
        dx_ptr + rows64 * stride_dx_row + cols[None, :],
        dx.to(dx_ptr.dtype.element_ty),
        mask=(rows[:, None] < n_rows) & col_mask,
    )


@triton.jit
def _softmax_bwd_looped_kernel(
    # pointers
    y_ptr,
    dy_ptr,
    dx_ptr,
    # sizes
    n_rows,
    n_cols,
    # strides
    stride_y_row,
    stride_dy_row,
    stride_dx_row,
    # meta-parameters
    BLOCK_N: tl.constexpr,
):
    # Wide rows: pass 1 sums y * dy in chunks, pass 2 re-reads both (last chunk first, from L2 if
    # it is still there) and writes dx: read 4*C elements, write C.
    cols = tl.arange(0, BLOCK_N)
    n_chunks = tl.cdiv(n_cols, BLOCK_N)
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        row64 = tl.cast(row, tl.int64)
        y_row = y_ptr + row64 * stride_y_row
        dy_row = dy_ptr + row64 * stride_dy_row
        dx_row = dx_ptr + row64 * stride_dx_row
        acc = tl.zeros([BLOCK_N], tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            offs = start + cols
            mask = offs < n_cols
            y = tl.load(y_row + offs, mask=mask, other=0.0).to(tl.float32)
            acc += y * tl.load(dy_row + offs, mask=mask, other=0.0).to(tl.float32)
        dot = tl.sum(acc, axis=0)
        for i in range(0, n_chunks):
            offs = (n_chunks - 1 - i) * BLOCK_N + cols
            mask = offs < n_cols
            y = tl.load(y_row + offs, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_row + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx_row + offs, (y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers

_FWD = {
    "fused": launch.Launcher(_softmax_kernel),
    "looped": launch.Launcher(_softmax_looped_kernel),
}
_BWD = {
    "fused": launch.Launcher(_softmax_bwd_kernel),
    "looped": launch.Launcher(_softmax_bwd_looped_kernel),
}


def launch_config(n_rows: int, n_cols: int, max_fused_block: int = MAX_FUSED_BLOCK) -> dict:
    """How ``softmax`` launches for a ``[n_rows, n_cols]`` input: the kernel, block and warps."""
    return rows.row_launch(
        n_rows,
        n_cols,
        max_fused_block=max_fused_block,
        loop_block=LOOP_BLOCK,
        loop_warps=LOOP_WARPS,
        tile=TILE,
        loop_programs_per_sm=LOOP_PROGRAMS_PER_SM,
    )


def bwd_launch_config(n_rows: int, n_cols: int, max_fused_block: int = MAX_FUSED_BLOCK_BWD) -> dict:
    """How the backward pass launches: as the forward, with rows of two tensors in registers."""
    cfg = launch_config(n_rows, n_cols, max_fused_block)
    if cfg["kernel"] == "fused":
        cfg["num_warps"] = rows.num_warps_for(2 * cfg["BLOCK_M"] * cfg["BLOCK_N"])
    return cfg


def _meta(cfg: dict, backward: bool) -> dict:
    """The constexprs and options of the kernel ``cfg`` names."""
    meta = dict(BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"])
    if cfg["kernel"] == "fused":
        meta["BLOCK_M"] = cfg["BLOCK_M"]
    elif not backward:
        meta["FP32_MIN"] = _FP32_MIN
    return meta


# (rows, columns, max_fused_block, backward) -> (launcher, grid, meta): a model calls a handful of
# shapes again and again, so the launch plan of each is worked out once.
_PLANS: dict[tuple, tuple] = {}


def _plan(n_rows: int, n_cols: int, max_fused_block: int, backward: bool) -> tuple:
    key = (n_rows, n_cols, max_fused_block, backward)
    plan = _PLANS.get(key)
    if plan is None:
        config = bwd_launch_config if backward else launch_config
        cfg = config(n_rows, n_cols, max_fused_block)
        launcher = (_BWD if backward else _FWD)[cfg["kernel"]]
        plan = _PLANS[key] = (launcher, (cfg["programs"],), _meta(cfg, backward))
    return plan


def softmax(
    x: torch.Tensor, dim: int = -1, *, max_fused_block: int = MAX_FUSED_BLOCK
) -> torch.Tensor:
    """Softmax of ``x`` over its last dimension (fp32/fp16/bf16, fp32 math), differentiable.

    ``max_fused_block``: widest power-of-two row kept in registers; wider rows use the looped
    kernel (set it to 0 to force the looped kernel, to 2**17 to force registers)."""
    # A layout seen before, on a GPU: launched from C++ (kernels.replay).
    if dim == -1 or (isinstance(x, torch.Tensor) and dim == x.ndim - 1):
        y = replay.call(replay.SOFTMAX, x, None, None, max_fused_block)
        if y is not None:
            return y
    rows.check_float("x", x)
    if x.ndim == 0:
        raise ValueError("x must have at least 1 dimension, got a 0-d tensor")
    if dim != -1 and dim != x.ndim - 1:
        raise ValueError(
            f"dim must be the last dimension (-1 or {x.ndim - 1}), got {dim}; "
            "move that dimension last with x.transpose(dim, -1) first"
        )
    rows.check_device("x", x)
    _plan_native(x, max_fused_block)
    # Autograd's bookkeeping costs microseconds per call: pay it only when a gradient is wanted.
    if x.requires_grad and torch.is_grad_enabled():
        return _Softmax.apply(x, max_fused_block)
    return _softmax_forward(x, max_fused_block)


# Slots of the C++ launch path's plans (kernels.replay): x, the output, dy, dx.
_X, _Y, _DY, _DX = 0, 3, 4, 5


def _plan_native(x: torch.Tensor, max_fused_block: int) -> None:
    """Give kernels.replay this layout's plan (checked inputs only): the same launches as
    ``_softmax_forward`` and ``_softmax_backward``, made from the same plans."""
    if isinstance(max_fused_block, bool) or not isinstance(max_fused_block, int):
        return
    default = max_fused_block == MAX_FUSED_BLOCK
    # Layouts whose forward or backward takes the cluster kernels stay on the Python path.
    wide = _wide(x, default) is not None or _wide(x, default, "softmax_bwd") is not None
    if not wide and replay.planning(x):
        replay.build(_native_plan, x, max_fused_block)


def _native_plan(x: torch.Tensor, max_fused_block: int) -> None:
    n_cols = x.shape[-1]
    n_rows, stride = rows.row_stride("x", x)
    slots = [None] * replay.N_SLOTS
    slots[_X] = x
    y_alloc, dx_alloc = replay.Alloc(replay.LIKE, _Y, _X), replay.Alloc(replay.LIKE, _DX, _Y)
    launcher, grid, meta = _plan(n_rows, n_cols, max_fused_block, False)
    args = (replay.Slot(_X), replay.Slot(_Y), n_rows, n_cols, stride, n_cols)
    replay.materialize([y_alloc], slots)
    fwd = replay.compiled_step(launcher.fn, args, slots, grid, meta)
    slots[_DY] = torch.empty_like(slots[_Y])  # what the compile sees for dy: fresh, contiguous
    launcher, grid, meta = _plan(n_rows, n_cols, MAX_FUSED_BLOCK_BWD, True)
    args = (replay.Slot(_Y), replay.Slot(_DY), replay.Slot(_DX), n_rows, n_cols, n_cols, n_cols,
            n_cols)  # fmt: skip
    replay.materialize([dx_alloc], slots)
    bwd = replay.compiled_step(launcher.fn, args, slots, grid, meta)
    forward = replay.Program([y_alloc], [fwd])
    replay.add(replay.SOFTMAX, x, None, None, max_fused_block, forward, forward,
               replay.Program([dx_alloc], [bwd]), _Y, _DY, [_Y], [_DX])  # fmt: skip


def _wide(x: torch.Tensor, default: bool, op: str = "softmax_fwd"):
    """kernels.cuda.cluster_rows if it takes these rows, else None. Only for the default
    ``max_fused_block`` (``default``): a caller who sets it asks for a Triton kernel."""
    if not default or x.numel() == 0:
        return None
    return rows.cluster_path(x, x.numel() // x.shape[-1], op)


def _softmax_forward(x: torch.Tensor, max_fused_block: int) -> torch.Tensor:
    # Rows of 32,769+ values on Hopper may be split across a thread-block cluster.
    wide = _wide(x, max_fused_block == MAX_FUSED_BLOCK)
    if wide is not None:
        return wide.softmax_forward(x)
    # empty_like, not new_empty(shape): a microsecond less of host time per call on an H100 host
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    n_cols = x.shape[-1]
    if n_cols == 0 or x.numel() == 0:
        return y
    n_rows, stride = rows.row_stride("x", x)
    launcher, grid, meta = _plan(n_rows, n_cols, max_fused_block, False)
    # The key fixes everything the binary depends on; y is new, contiguous and aligned.
    key = (x.dtype, n_rows, n_cols, stride, launch.aligned(x), max_fused_block)
    launcher(key, grid, (x, y, n_rows, n_cols, stride, n_cols), **meta)
    return y


def _softmax_backward(y: torch.Tensor, dy: torch.Tensor, max_fused_block: int) -> torch.Tensor:
    """dx from the forward's output ``y`` (contiguous) and the upstream gradient ``dy``."""
    wide = _wide(y, max_fused_block == MAX_FUSED_BLOCK_BWD, "softmax_bwd")
    if wide is not None:
        return wide.softmax_backward(y, dy)
    dx = torch.empty_like(y, memory_format=torch.contiguous_format)
    n_cols = y.shape[-1]
    if n_cols == 0 or y.numel() == 0:
        return dx
    if not dy.is_contiguous():
        dy = dy.contiguous()  # an expanded gradient (from .sum().backward()) has row stride 0
    n_rows = y.numel() // n_cols
    launcher, grid, meta = _plan(n_rows, n_cols, max_fused_block, True)
    key = (y.dtype, n_rows, n_cols, launch.aligned(y), launch.aligned(dy), max_fused_block)
    launcher(key, grid, (y, dy, dx, n_rows, n_cols, n_cols, n_cols, n_cols), **meta)
    return dx


def _launch(x2: torch.Tensor, y2: torch.Tensor, cfg: dict):
    """Launch the forward kernel ``cfg`` names on 2-D ``x2`` -> ``y2``; returns Triton's compiled
    kernel (None in the interpreter)."""
    n_rows, n_cols = x2.shape
    meta = _meta(cfg, False)
    strides = (x2.stride(0), y2.stride(0))
    key = (x2.dtype, y2.dtype, n_rows, n_cols, *strides, launch.aligned(x2), launch.aligned(y2))
    key += (cfg["programs"], *sorted(meta.items()))
    return _FWD[cfg["kernel"]](key, (cfg["programs"],), (x2, y2, n_rows, n_cols, *strides), **meta)


def kernel_resources(
    n_cols: int, dtype: torch.dtype, max_fused_block: int = MAX_FUSED_BLOCK
) -> dict:
    """The launch configuration for rows of ``n_cols`` and, on a GPU, the registers per thread
    and the bytes spilled to local memory of the compiled kernel (None in the interpreter)."""
    cfg = launch_config(1 << 20, n_cols, max_fused_block)
    x = torch.zeros(cfg["BLOCK_M"], n_cols, device=device.DEVICE, dtype=dtype)
    kernel = _launch(x, torch.empty_like(x), dict(cfg, programs=1))
    return dict(
        cfg,
        n_regs=getattr(kernel, "n_regs", None) if device.GPU_MODE else None,
        n_spills=getattr(kernel, "n_spills", None) if device.GPU_MODE else None,
    )


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, max_fused_block):
        y = _softmax_forward(x, max_fused_block)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        return _softmax_backward(y, dy, MAX_FUSED_BLOCK_BWD), None


def softmax_ref(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The reference: ``torch.softmax`` in fp32, returned in ``x``'s dtype."""
    return torch.softmax(x.float(), dim=dim).to(x.dtype)


def eager_softmax(x: torch.Tensor) -> torch.Tensor:
    """Safe softmax as five separate PyTorch ops: what fusion saves is this function's traffic."""
    m = x.amax(dim=-1, keepdim=True)  # read x
    z = x - m  # read x, write z
    e = z.exp()  # read z, write e
    s = e.sum(dim=-1, keepdim=True)  # read e
    return e / s  # read e, write y


# Full-size passes over HBM of each version (a [R, C] tensor read or written once is one pass).
EAGER_PASSES = {"amax": 1, "x - m": 2, "exp": 2, "sum": 1, "e / s": 2}
FUSED_PASSES = 2
LOOPED_PASSES = 3


def _spec(kernel, t: str, constexprs: dict, num_warps: int) -> dict:
    if kernel in (_softmax_kernel, _softmax_looped_kernel):
        sig = {"x_ptr": f"*{t}", "y_ptr": f"*{t}", "n_rows": "i32", "n_cols": "i32"}
        sig |= {"stride_x_row": "i64", "stride_y_row": "i64"}
    else:
        sig = {"y_ptr": f"*{t}", "dy_ptr": f"*{t}", "dx_ptr": f"*{t}", "n_rows": "i32"}
        sig |= {"n_cols": "i32", "stride_y_row": "i64", "stride_dy_row": "i64"}
        sig |= {"stride_dx_row": "i64"}
    return dict(
        kernel=kernel, signature=sig, constexprs=constexprs, options={"num_warps": num_warps}
    )


# Signatures for the ahead-of-time compile check (tests compile every kernel for sm_90 and sm_75).
COMPILE_SPECS = (
    [
        _spec(_softmax_kernel, t, {"BLOCK_M": bm, "BLOCK_N": bn}, rows.num_warps_for(bm * bn))
        for t in ("fp32", "bf16")
        for bm, bn in ((16, 256), (1, MAX_FUSED_BLOCK))
    ]
    + [
        _spec(
            _softmax_bwd_kernel, t, {"BLOCK_M": bm, "BLOCK_N": bn}, rows.num_warps_for(2 * bm * bn)
        )
        for t in ("fp32", "bf16")
        for bm, bn in ((16, 256), (1, MAX_FUSED_BLOCK_BWD))
    ]
    + [
        _spec(_softmax_looped_kernel, t, {"BLOCK_N": LOOP_BLOCK, "FP32_MIN": _FP32_MIN}, LOOP_WARPS)
        for t in ("fp32", "bf16")
    ]
    + [
        _spec(_softmax_bwd_looped_kernel, t, {"BLOCK_N": LOOP_BLOCK}, LOOP_WARPS)
        for t in ("fp32", "bf16")
    ]
)


# ----------------------------------------------------------------------------- benchmark

# Widths of the sweep, and the bytes of each input tensor: 512 MiB fills the H100 (132 SMs times
# hundreds of rows each) and is ten times its 50 MB L2.
WIDTHS = [256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
TENSOR_BYTES = 2**29


def rows_for(width: int, dtype: torch.dtype, tensor_bytes: int = TENSOR_BYTES) -> int:
    """Rows that make a ``[rows, width]`` tensor of ``dtype`` about ``tensor_bytes`` big."""
    return max(1, tensor_bytes // (width * torch.empty((), dtype=dtype).element_size()))


def _bench_width(x: torch.Tensor, copy: roofline.Ceiling) -> list[dict]:
    """Ours and torch.softmax on ``x``, both charged the minimum traffic: read once, write once."""
    torch.testing.assert_close(softmax(x), softmax_ref(x), rtol=2e-2, atol=1e-5)
    nbytes = FUSED_PASSES * x.numel() * x.element_size()
    ours = bench.measure(lambda: softmax(x), bytes=nbytes)
    base = bench.measure(lambda: torch.softmax(x, dim=-1), bytes=nbytes)
    ceil, shape = ("copy", copy.value), list(x.shape)
    return [
        bench.record(
            "softmax", "triton", shape, x.dtype, ours, baseline=("torch", base), ceiling=ceil
        ),
        bench.record("softmax", "torch", shape, x.dtype, base, ceiling=ceil),
    ]


@bench.register("softmax")
def _bench_softmax(quick: bool) -> list[dict]:
    copy = roofline.copy_bandwidth()
    widths = [4096] if quick else WIDTHS
    dtypes = [device.preferred_dtype(torch.bfloat16)] + ([] if quick else [torch.float32])
    tensor_bytes = TENSOR_BYTES if device.GPU_MODE else 2**16
    if not device.GPU_MODE:
        widths = [256, 1000]
    recs = []
    for dtype in dtypes:
        for w in widths:
            rows = rows_for(w, dtype, tensor_bytes)
            recs += _bench_width(torch.randn(rows, w, device=device.DEVICE, dtype=dtype), copy)
    return recs
