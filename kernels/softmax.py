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

The backward pass (``dx = y * (dy - sum(y * dy))``) runs in PyTorch: this module's kernels are the
forward pass the benchmarks and the book measure.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import bench, device, roofline

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Rows narrower than TILE elements are packed ROWS = TILE // BLOCK_N to a program, so that a program
# for 256-wide bf16 rows still moves 8 KiB in and 8 KiB out instead of 512 bytes.
TILE = 4096
# The widest row (padded to a power of two) held in registers. At 32,768 columns and 16 warps a
# thread holds 64 fp32 values and nothing spills. At 65,536 the fp32 row is 256 KiB, the whole
# register file of an H100 SM, so some values spill to local memory. Measured on an H100 that
# still beats re-reading the row: 0.85 of the copy bandwidth against 0.75 looped in bf16, 0.72
# against 0.68 in fp32 (notebooks/04c-fused-softmax-norms.ipynb shows both). Past it, the looped
# kernel takes over.
MAX_FUSED_BLOCK = 65536
# Chunk of the looped kernel, and its warps: 16 fp32 values per thread per chunk.
LOOP_BLOCK = 8192
LOOP_WARPS = 16
# fp32's most negative finite value: the looped kernel's initial running max. Starting from -inf
# instead would make exp(m - m_new) = exp(-inf + inf) = NaN in lanes that have only seen padding.
_FP32_MIN = -3.4028234663852886e38


def num_warps_for(block_elems: int) -> int:
    """Warps for a program holding ``block_elems`` values: 4 up to 2048, 8 up to 8192, else 16.

    More warps means fewer values per thread (registers) and more loads in flight per program."""
    if block_elems <= 2048:
        return 4
    if block_elems <= 8192:
        return 8
    return 16


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
    n_cols,
    # strides
    stride_x_row,
    stride_y_row,
    # meta-parameters
    BLOCK_N: tl.constexpr,
    FP32_MIN: tl.constexpr,
):
    # One row per program, walked in BLOCK_N chunks: read 2*C elements, write C.
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x_row
    y_row = y_ptr + row * stride_y_row
    cols = tl.arange(0, BLOCK_N)
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
    # Pass 2: re-read, normalise, write; last chunk first, since it is the likeliest still in L2.
    n_chunks = tl.cdiv(n_cols, BLOCK_N)
    for i in range(0, n_chunks):
        offs = (n_chunks - 1 - i) * BLOCK_N + cols
        mask = offs < n_cols
        x = tl.load(x_row + offs, mask=mask, other=-float("inf")).to(tl.float32)
        y = tl.exp(x - row_max) * inv_sum
        tl.store(y_row + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers


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
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        raise ValueError(
            f"{name}'s leading dimensions (shape {tuple(x.shape)}, strides {tuple(x.stride())}) "
            "cannot be viewed as rows without a copy; call .contiguous() first"
        ) from None


def check_float(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must have dtype in (float32, float16, bfloat16), got {x.dtype}")


def row_launch(
    n_rows: int, n_cols: int, *, max_fused_block: int, loop_block: int, loop_warps: int, tile: int
) -> dict:
    """The launch of a row-wise kernel on ``[n_rows, n_cols]`` (softmax and the norms share it):
    rows up to ``max_fused_block`` wide are held whole in registers, ``tile // block`` rows per
    program; wider rows loop over ``loop_block``-wide chunks, one row per program."""
    block_n = triton.next_power_of_2(max(n_cols, 1))
    if block_n > max_fused_block:
        return dict(
            kernel="looped",
            BLOCK_M=1,
            BLOCK_N=loop_block,
            num_warps=loop_warps,
            programs=n_rows,
        )
    block_m = min(max(tile // block_n, 1), triton.next_power_of_2(max(n_rows, 1)))
    return dict(
        kernel="fused",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps_for(block_m * block_n),
        programs=triton.cdiv(n_rows, block_m),
    )


def launch_config(n_rows: int, n_cols: int, max_fused_block: int = MAX_FUSED_BLOCK) -> dict:
    """How ``softmax`` launches for a ``[n_rows, n_cols]`` input: the kernel, block and warps."""
    return row_launch(
        n_rows,
        n_cols,
        max_fused_block=max_fused_block,
        loop_block=LOOP_BLOCK,
        loop_warps=LOOP_WARPS,
        tile=TILE,
    )


def softmax(
    x: torch.Tensor, dim: int = -1, *, max_fused_block: int = MAX_FUSED_BLOCK
) -> torch.Tensor:
    """Softmax of ``x`` over its last dimension (fp32/fp16/bf16, fp32 math), differentiable.

    ``max_fused_block``: widest power-of-two row kept in registers; wider rows use the looped
    kernel (set it to 0 to force the looped kernel, to 2**17 to force registers)."""
    check_float("x", x)
    if x.ndim == 0:
        raise ValueError("x must have at least 1 dimension, got a 0-d tensor")
    if dim not in (-1, x.ndim - 1):
        raise ValueError(
            f"dim must be the last dimension (-1 or {x.ndim - 1}), got {dim}; "
            "move that dimension last with x.transpose(dim, -1) first"
        )
    return _Softmax.apply(x, max_fused_block)


def _launch(x2: torch.Tensor, y2: torch.Tensor, cfg: dict):
    """Launch the kernel ``cfg`` names on 2-D ``x2`` -> ``y2``; returns Triton's compiled kernel."""
    n_rows, n_cols = x2.shape
    strides = (x2.stride(0), y2.stride(0))
    if cfg["kernel"] == "fused":
        return _softmax_kernel[(cfg["programs"],)](
            x2, y2, n_rows, n_cols, *strides,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], num_warps=cfg["num_warps"],
        )  # fmt: skip
    return _softmax_looped_kernel[(cfg["programs"],)](
        x2, y2, n_cols, *strides,
        BLOCK_N=cfg["BLOCK_N"], FP32_MIN=_FP32_MIN, num_warps=cfg["num_warps"],
    )  # fmt: skip


def _softmax_forward(x: torch.Tensor, max_fused_block: int) -> torch.Tensor:
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if x.numel() == 0:
        return y
    x2, y2 = as_rows("x", x), y.view(-1, x.shape[-1])
    _launch(x2, y2, launch_config(*x2.shape, max_fused_block))
    return y


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
        # d softmax: dx = y * (dy - sum(y * dy)) per row, in fp32, in PyTorch (not one of our kernels).
        (y,) = ctx.saved_tensors
        yf, dyf = y.float(), dy.float()
        dx = yf * (dyf - (yf * dyf).sum(dim=-1, keepdim=True))
        return dx.to(y.dtype), None


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
    sig = {"x_ptr": f"*{t}", "y_ptr": f"*{t}", "n_rows": "i32", "n_cols": "i32"}
    if kernel is _softmax_looped_kernel:
        del sig["n_rows"]
    sig |= {"stride_x_row": "i64", "stride_y_row": "i64"}
    return dict(
        kernel=kernel, signature=sig, constexprs=constexprs, options={"num_warps": num_warps}
    )


# Signatures for the ahead-of-time compile check (tests compile every kernel for sm_90 and sm_75).
COMPILE_SPECS = [
    _spec(_softmax_kernel, t, {"BLOCK_M": bm, "BLOCK_N": bn}, num_warps_for(bm * bn))
    for t in ("fp32", "bf16")
    for bm, bn in ((16, 256), (1, MAX_FUSED_BLOCK))
] + [
    _spec(
        _softmax_looped_kernel,
        t,
        {"BLOCK_N": LOOP_BLOCK, "FP32_MIN": _FP32_MIN},
        LOOP_WARPS,
    )
    for t in ("fp32", "bf16")
]


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
