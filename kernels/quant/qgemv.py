"""The two Triton dequantize-GEMV kernels and ``gemv``, the launcher that picks among them and the
CUDA C++ int4 kernel (``kernels.quant.cuda_int4``). See ``kernels.quant`` for what each path does."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from kernels import _validate, bench, device, launch, partial_sums, roofline
from kernels.launch import cdiv, next_power_of_2
from kernels.quant import cuda_int4
from kernels.quant.formats import (
    SUPPORTED_DTYPES,
    QuantizedWeight,
    _check_qw,
    dequantize,
    gemv_bytes,
    quantize,
)
from kernels.quant.ptx import _unpack_int4, _unpack_int8

GEMV_MAX_M = 4  # the most rows the CUDA-core kernel (path="gemv") takes
MAX_M_BLOCK = 128  # the tensor-core kernel's largest row tile


@triton.jit
def _gemv_kernel(
    # pointers
    x_ptr,  # [M, K] activations, fp16/bf16
    w_ptr,  # [N, KP] int8 (BITS=8) or packed uint8 (BITS=4)
    s_ptr,  # [N, n_groups] fp16 scales
    y_ptr,  # [M, N] output (x's dtype), or fp32 [SPLIT_K, M, N] partial sums when SPLIT_K > 1
    # sizes
    M,
    N,
    KP,  # packed columns per row: K for int8, K // 2 for int4
    n_groups,
    group_size,
    # strides
    stride_xm,
    stride_ym,
    # meta-parameters
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    # Reads BLOCK_N weight rows once, every x row once per tile (from L1/L2: x is tiny), writes
    # BLOCK_N outputs per activation row. The products are summed along K inside each tile (the
    # reduction stays in the load's register layout: no shuffling of the unpacked weights), then
    # scaled once per tile and row.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dt = x_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past N wrap around (modulo) so the weight loads need no row mask; the store drops them.
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * KP
    s_rows = s_ptr + rows.to(tl.int64) * n_groups
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(KP, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    for t in range(pid_k * per_split, tl.minimum(pid_k * per_split + per_split, k_tiles)):
        kk = t * BLOCK_K + offs_k
        k_ok = kk < KP
        # A tile lies inside one scale group (the launcher guarantees it), so one scale per row.
        s_lo = tl.load(s_rows + (t * BLOCK_K) // group_size).to(tl.float32)
        b = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0)
        if BITS == 4:
            s_hi = tl.load(s_rows + (KP + t * BLOCK_K) // group_size).to(tl.float32)
            lo, hi = _unpack_int4(b, dt, USE_ASM)
            lo = lo.to(tl.float32)
            hi = hi.to(tl.float32)
        else:
            lo = _unpack_int8(b, dt, USE_ASM).to(tl.float32)
        # One activation row at a time (unrolled): each is a vector load of BLOCK_K values that
        # every weight row of the tile reuses; fp32 FMAs on the CUDA cores.
        for m in tl.static_range(BLOCK_M):
            x_ok = k_ok & (m < M)
            x_lo = tl.load(x_ptr + m * stride_xm + kk, mask=x_ok, other=0.0).to(tl.float32)
            p = tl.sum(lo * x_lo[None, :], axis=1) * s_lo
            if BITS == 4:
                x_hi = tl.load(x_ptr + m * stride_xm + KP + kk, mask=x_ok, other=0.0)
                p += tl.sum(hi * x_hi.to(tl.float32)[None, :], axis=1) * s_hi
            acc += tl.where(offs_m[:, None] == m, p[None, :], 0.0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + cols[None, :]
    y_ok = (offs_m[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K > 1:  # each split writes its own fp32 plane of y ([SPLIT_K, M, N]); a second
        y_ptrs += pid_k.to(tl.int64) * M * stride_ym  # launch adds them up (kernels.partial_sums)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_ok)


@triton.jit
def _qmm_kernel(
    # pointers
    x_ptr,  # [M, K] activations, fp16/bf16
    w_ptr,  # [N, KP] int8 (BITS=8) or packed uint8 (BITS=4)
    s_ptr,  # [N, n_groups] fp16 scales
    y_ptr,  # [M, N] output (x's dtype), or fp32 [SPLIT_K, M, N] partial sums when SPLIT_K > 1
    # sizes
    M,
    N,
    KP,
    n_groups,
    group_size,
    # strides
    stride_xm,
    stride_ym,
    # meta-parameters
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    # Programs that share a weight tile (same pid_n, all pid_m) are numbered consecutively, so they
    # run together and the tile comes from HBM once and from L2 after that.
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % num_m
    pid_n = tl.program_id(0) // num_m
    pid_k = tl.program_id(1)
    dt = x_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * KP
    s_rows = s_ptr + rows.to(tl.int64) * n_groups
    # Rows of x past M are masked, not wrapped: with M = 1 the other 15 rows of the tile cost
    # no memory traffic.
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    m_ok = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(KP, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    for t in range(pid_k * per_split, tl.minimum(pid_k * per_split + per_split, k_tiles)):
        kk = t * BLOCK_K + offs_k
        k_ok = kk < KP
        s_lo = tl.load(s_rows + (t * BLOCK_K) // group_size).to(tl.float32)
        b = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0)
        x_lo = tl.load(x_rows + kk[None, :], mask=m_ok & k_ok[None, :], other=0.0)
        if BITS == 4:
            s_hi = tl.load(s_rows + (KP + t * BLOCK_K) // group_size).to(tl.float32)
            x_hi = tl.load(x_rows + KP + kk[None, :], mask=m_ok & k_ok[None, :], other=0.0)
            # Integers in [-8, 7] are exact in fp16 and bf16: the tensor cores see q, unscaled,
            # and the group scale multiplies the fp32 partial product, once per output.
            lo, hi = _unpack_int4(b, dt, USE_ASM)
            p_lo = tl.dot(x_lo, tl.trans(lo))
            p_hi = tl.dot(x_hi, tl.trans(hi))
            acc += p_lo * s_lo[None, :] + p_hi * s_hi[None, :]
        else:
            # int8 in [-127, 127] is exact in fp16 and bf16 too.
            p = tl.dot(x_lo, tl.trans(_unpack_int8(b, dt, USE_ASM)))
            acc += p * s_lo[None, :]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    y_ok = m_ok & (cols[None, :] < N)
    if SPLIT_K > 1:  # each split writes its own fp32 plane of y ([SPLIT_K, M, N]); a second
        y_ptrs += pid_k.to(tl.int64) * M * stride_ym  # launch adds them up (kernels.partial_sums)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_ok)


# Candidate tiles (BLOCK_N, BLOCK_K in bytes, num_warps, num_stages). Few on purpose: each one is a
# compile (seconds) the first time a shape is seen. Chosen by reasoning about an H100, and timed by
# the autotuner on whatever GPU runs them: BLOCK_K = 128 bytes is one 128-byte line per weight row
# and tile; small BLOCK_N gives a 8192-row weight enough programs to fill 132 SMs; 3-4 stages keep
# about 24-32 KB of weights in flight per SM, what HBM needs to stay busy.
_GEMV_TILES = [(16, 128, 4, 3), (32, 128, 4, 3), (32, 64, 4, 3), (64, 128, 8, 3)]
# Tensor-core kernel: up to 32 rows of x the tile is mostly weights (4 warps); larger row tiles need
# 8 warps for their accumulators.
_QMM_TILES_SMALL_M = [(32, 128, 4, 4), (64, 128, 4, 3), (64, 64, 4, 4), (128, 128, 4, 3)]
_QMM_TILES_LARGE_M = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)]


def _configs(tiles) -> list[triton.Config]:
    if device.INTERPRET:  # the interpreter cannot autotune: one small, always-valid tile
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 16}, num_warps=4)]
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in tiles
    ]


def _prune(configs, named_args, **kwargs):
    """Keep the tiles meant for this row-tile size whose K tile fits inside one scale group."""
    args = {**named_args, **kwargs}
    kp, g = args["KP"], args["group_size"]
    k = 2 * kp if args["BITS"] == 4 else kp
    limit = max_block_k(k, kp, g)
    if len(configs) == len(_QMM_TILES) and not device.INTERPRET:  # the tensor-core set
        n_small = len(_QMM_TILES_SMALL_M)
        configs = configs[n_small:] if args["BLOCK_M"] > 32 else configs[:n_small]
    kept = [c for c in configs if c.kwargs["BLOCK_K"] <= limit]
    if kept:
        return kept
    c = configs[0]
    return [triton.Config({**c.kwargs, "BLOCK_K": limit}, num_warps=c.num_warps)]


def _autotuned(kernel, configs):
    # Keyed on the row tile (not M itself, so a batch sweep does not retune every M), the problem
    # and the grouping.
    # A GEMV runs for microseconds: 5 ms of warm-up and 20 of timing per candidate rank them as
    # well as Triton's default 25 + 100 ms, and a new shape's first call waits a fifth as long.
    return triton.autotune(
        configs=configs,
        key=["BLOCK_M", "N", "KP", "group_size", "BITS", "SPLIT_K", "USE_ASM"],
        prune_configs_by={"early_config_prune": _prune},
        do_bench=functools.partial(triton.testing.do_bench, warmup=5, rep=20),
    )(kernel)


_QMM_TILES = _QMM_TILES_SMALL_M + _QMM_TILES_LARGE_M
_GEMV = _autotuned(_gemv_kernel, _configs(_GEMV_TILES))
_QMM = _autotuned(_qmm_kernel, _configs(_QMM_TILES))


def max_block_k(k: int, kp: int, group_size: int) -> int:
    """Widest power-of-two K tile (in packed columns) that never straddles a scale group: it must
    divide the group and, for int4, the offset ``kp = K/2`` of the high nibbles' half-row."""
    if group_size == k:
        return 1 << 30  # one group per row: any tile, the last one masked
    span = math.gcd(group_size, kp)
    return span & -span  # its largest power-of-two divisor


# Programs (of 32 weight rows) per SM below which K is split. A GEMV streams its weights once, so
# its speed is the bytes in flight: one wave of programs leaves the SMs' load queues short. Measured
# on an H100 (batch 1, bf16, the CUDA-core kernel at its best tile): at 8192 x 8192 (256 programs,
# about two per SM) splitting K in two took int8 from 66 to 48 µs and int4 from 43 to 34 µs; at
# 4096 x 4096, 31 -> 21 µs and 21 -> 14 µs (SPLIT_FROM_BYTES below keeps that one unsplit: its
# split cost the host more than it saved on the device). Each split writes its own fp32 partial
# sums and kernels.partial_sums adds them in a fixed order: the result is the same on every run.
SPLIT_BELOW_PROGRAMS_PER_SM = 2
# Weights smaller than this are never split. Below it a GEMV is latency-bound, and the split's second
# launch and allocation cost the host more than the extra loads save on the device. Measured on an
# H100 (2026-12-06, scripts/gpu/gemv_split_probe.py, one row of 4096 x 4096 int8, 16 MiB): split
# four ways 17.1 µs on the device and 25.0 µs of host a call; unsplit 19.1 and 14.8 (torch.matmul
# on the 16-bit weight: 23.3 and 16.3). The 8192 x 8192 gains above are 32-64 MiB.
SPLIT_FROM_BYTES = 32 << 20


def _pick_split_k(n_programs: int, k_tiles: int, weight_bytes: int) -> int:
    """Split K across programs while fewer than ``SPLIT_BELOW_PROGRAMS_PER_SM`` programs per SM
    would stream the weights, for weights of ``SPLIT_FROM_BYTES`` or more: the sum of the splits'
    partial results costs one extra launch, which the extra loads in flight repay at these sizes."""
    if not device.GPU_MODE or weight_bytes < SPLIT_FROM_BYTES:
        return 1
    target = SPLIT_BELOW_PROGRAMS_PER_SM * launch.sm_count()
    split = 1
    while n_programs * split < target and split * 2 <= max(k_tiles // 4, 1):
        split *= 2
    return split


@functools.cache
def _use_asm(dtype: torch.dtype = torch.bfloat16) -> bool:
    """The PTX unpacking needs an NVIDIA GPU (not the interpreter); its bf16 form uses packed bf16
    math (sm_80+: the ``bf16`` capability, which GPU_BRRR_FORCE_CAPS can turn off), its fp16 form
    runs on anything a course GPU has (sm_53+)."""
    cap = device.capabilities()
    if not (device.GPU_MODE and cap.vendor == "NVIDIA"):
        return False
    return cap.bf16 if dtype is torch.bfloat16 else cap.compute_capability >= (5, 3)


def gemv(
    x: torch.Tensor,
    qw: QuantizedWeight,
    *,
    path: str | None = None,
    split_k: int | None = None,
    fast_unpack: bool | None = None,
) -> torch.Tensor:
    """``x @ dequantize(qw).T`` fused: ``x: [M, K]`` or ``[K]`` in fp16/bf16, result in x's dtype.

    ``path``: "cuda" (the CUDA C++ tensor-core kernel for int4, groups of 128, bf16, M <= 8; the
    default where ``int4_mma_unavailable`` is None and the shape fits), "mma" (Triton, tensor
    cores, any M; the default otherwise, and whenever ``split_k`` or ``fast_unpack`` is given) or
    "gemv" (CUDA-core FMAs, M <= 4: the textbook GEMV, kept to measure against). ``split_k``:
    force a K split (default: only when N is too small to fill the GPU and the weight is at least
    ``SPLIT_FROM_BYTES``). ``fast_unpack``: the PTX unpacking (default where it runs: NVIDIA
    sm_80+) or False for the portable Triton code.
    """
    _check_qw(qw)  # before the key reads its fields
    layout = launch.layout_key(
        (x, qw.data, qw.scales), qw.bits, qw.group_size, qw.shape, path, split_k, fast_unpack
    )
    plan = _PLANS.get(layout)
    if plan is None:  # a layout not seen yet: check the inputs, decide the path and the launch
        plan = _PLANS.put(layout, _plan(x, qw, path, split_k, fast_unpack))
    elif split_k is not None:  # in the key by value (2.0 == 2): check its type
        _validate.positive_power_of_two("split_k", split_k)
    if plan.path == "cuda":
        w_packed, s_packed = cuda_int4.repack_int4_mma(qw)
        x2 = x.view(1, -1) if x.ndim == 1 else x
        y = cuda_int4._int4_mma_module().int4_gemv_mma(w_packed, s_packed, x2, *plan.config)
        return y.view(plan.y_shape) if x.ndim == 1 else y
    if plan.path == "empty":  # no rows: nothing to launch
        return x.new_empty(plan.y_shape)
    if plan.split == 1:
        y = x.new_empty(plan.y_shape)
    else:  # each K slice writes its own fp32 plane of partial sums: [1, split, M * N]
        y = x.new_empty(plan.sum_shape, dtype=torch.float32)
    # The kernel reads x and writes y through their pointers and the row strides in plan.sizes, so
    # a 1-D x and y need no [1, K] / [1, N] views. The layout key serves as the launcher's key: it
    # fixes every size, stride, dtype and alignment the binary is specialised on (y is fresh, so
    # aligned). The fast launch (kernels.launch): at batch 1 Triton's own launch through the
    # autotuner costs more host time than the GEMV takes on the GPU.
    args = (x, qw.data, qw.scales, y, *plan.sizes)
    launch.tuned(plan.kernel).keyed(layout, plan.grid, args, **plan.meta)
    if plan.split == 1:
        return y
    out = x.new_empty(plan.y_shape)
    partial_sums.run(plan.sum_launch, y, out)  # the planes' sum, in a fixed order, cast once
    return out


@dataclass(frozen=True)
class _GemvPlan:
    """What ``gemv`` works out from its inputs' layout and settings alone, once per layout."""

    path: str  # "cuda", "gemv", "mma", or "empty" (no rows: nothing to launch)
    y_shape: tuple[int, ...]  # the result's: (N,) for a 1-D x, else (M, N)
    config: tuple[int, int, int] | None = None  # path "cuda": the CUDA kernel's (NT, S, D)
    # The Triton paths': K slices (> 1: fp32 partial sums of shape sum_shape, then their sum,
    # launched as sum_launch), the autotuned kernel, its grid (a function of the chosen config's
    # BLOCK_N), its arguments after the four pointers and its meta-parameters.
    split: int = 1
    sum_shape: tuple[int, int, int] | None = None
    sum_launch: tuple | None = None
    kernel: triton.runtime.Autotuner | None = None
    grid: Callable[[dict], tuple[int, int]] | None = None
    sizes: tuple[int, ...] = ()
    meta: dict = field(default_factory=dict)


# gemv's plans per layout of (x, qw) and settings (kernels.launch.Plans): the checks and the launch
# arithmetic run on a layout's first call; a decode step then pays for the launch alone.
_PLANS = launch.Plans()


def _plan(x, qw: QuantizedWeight, path, split_k, fast_unpack) -> _GemvPlan:
    """Check one call's inputs and settings and decide its launch (``gemv``'s first call of a
    layout): raises on bad input, so only valid layouts are planned."""
    _validate.tensor("x", x, dtypes=SUPPORTED_DTYPES)
    if x.ndim not in (1, 2):
        raise ValueError(f"x must be 1-D [K] or 2-D [M, K], got shape {tuple(x.shape)}")
    n, k = qw.shape
    x2 = x.reshape(1, -1) if x.ndim == 1 else x
    m = x2.shape[0]
    if x2.shape[1] != k:
        raise ValueError(f"x has K = {x2.shape[1]} but qw was quantized with K = {k}")
    if x.device != qw.data.device:
        raise ValueError(f"x and qw must be on one device, got {x.device} and {qw.data.device}")
    if path not in (None, "gemv", "mma", "cuda"):
        raise ValueError(f"path must be None, 'cuda', 'gemv' or 'mma', got {path!r}")
    if path == "cuda":
        why = cuda_int4._int4_mma_misfit(x2, qw) or cuda_int4.int4_mma_unavailable()
        if why:
            raise ValueError(f"path='cuda' cannot run here: {why}")
    if path is None and (split_k is not None or fast_unpack is not None):
        path = "mma"  # the Triton kernel's own knobs ask for the Triton kernel
    if path is None:
        path = (
            "cuda"
            if not (cuda_int4._int4_mma_misfit(x2, qw) or cuda_int4.int4_mma_unavailable())
            else "mma"
        )
        if path == "cuda" and cuda_int4._int4_mma_build_error() is not None:
            path = "mma"  # the build failed once (warned then): the Triton kernel serves
    y_shape = (n,) if x.ndim == 1 else (m, n)
    if path == "cuda":
        if m == 0:
            return _GemvPlan("empty", y_shape)
        return _GemvPlan("cuda", y_shape, config=cuda_int4._int4_mma_config(n, k))
    if path == "gemv" and m > GEMV_MAX_M:
        raise ValueError(f"path='gemv' handles at most {GEMV_MAX_M} rows, got M = {m}")
    if split_k is not None:
        _validate.positive_power_of_two("split_k", split_k)
    use_asm = _use_asm(x.dtype) if fast_unpack is None else bool(fast_unpack)
    if use_asm and not _use_asm(x.dtype):
        raise ValueError(
            "fast_unpack=True needs an NVIDIA GPU (compute capability 8.0+ for bf16 activations)"
        )
    if m == 0:
        return _GemvPlan("empty", y_shape)
    kp = qw.data.shape[1]
    if path == "gemv":
        block_m = next_power_of_2(m)
        kernel = _GEMV
        tiles_m = 1  # one program covers every row
    else:
        block_m = max(16, min(MAX_M_BLOCK, next_power_of_2(m)))
        kernel = _QMM
        tiles_m = cdiv(m, block_m)
    weight_bytes = qw.data.numel() * qw.data.element_size()
    split = split_k or _pick_split_k(cdiv(n, 32) * tiles_m, cdiv(kp, 128), weight_bytes)

    def grid(meta):  # BLOCK_N is the autotuner's choice; the launcher keeps the tuple it gives
        return (cdiv(n, meta["BLOCK_N"]) * tiles_m, split)

    # y is fresh and contiguous [M, N] (one such plane per split): its row stride is N.
    sizes = (m, n, kp, qw.scales.shape[1], qw.group_size, x2.stride(0), n)
    meta = dict(BITS=qw.bits, BLOCK_M=block_m, SPLIT_K=split, USE_ASM=use_asm)
    sums = {}
    if split > 1:
        sums["sum_shape"] = (1, split, m * n)
        sums["sum_launch"] = partial_sums.sum_launch(sums["sum_shape"], x.dtype)
    return _GemvPlan(
        path, y_shape, split=split, kernel=kernel, grid=grid, sizes=sizes, meta=meta, **sums
    )


def gemv_ref(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """The reference: ``x @ dequantize(qw).T`` in fp32, cast to x's dtype."""
    return (x.float() @ dequantize(qw).T).to(x.dtype)


# --------------------------------------------------------------------------- compile, bench

_QSIG = {"M": "i32", "N": "i32", "KP": "i32", "n_groups": "i32", "group_size": "i32"}
_QSIG |= {"stride_xm": "i32", "stride_ym": "i32"}
COMPILE_SPECS = [
    dict(
        kernel=kernel,
        signature={
            "x_ptr": f"*{t}",
            "w_ptr": "*u8" if bits == 4 else "*i8",
            "s_ptr": "*fp16",
            "y_ptr": f"*{t}" if split == 1 else "*fp32",
            **_QSIG,
        },
        constexprs={
            "BITS": bits,
            "BLOCK_M": bm,
            "BLOCK_N": bn,
            "BLOCK_K": 128,
            "SPLIT_K": split,
            "USE_ASM": asm,
        },
        options={"num_warps": 4},
        # The bf16 PTX unpacking uses packed bf16 fma (sm_80+); fp16 and portable: anywhere.
        min_cc=80 if asm and t == "bf16" else 0,
    )
    for kernel, bm, bn in ((_gemv_kernel, 1, 32), (_gemv_kernel, 4, 16), (_qmm_kernel, 16, 64))
    for t in ("fp16", "bf16")
    for bits in (4, 8)
    for split, asm in ((1, True), (4, True), (1, False))
] + [
    dict(  # the largest row tile of the batch sweep: 8 warps, 80 KB of shared memory a stage
        kernel=_qmm_kernel,
        signature={"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp16", "y_ptr": "*bf16"} | _QSIG,
        constexprs={"BITS": 4, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1}
        | {"USE_ASM": True},
        options={"num_warps": 8, "num_stages": 3},
        min_cc=90,
    )
]

# (N, K) of the benchmarked weights: a square 8192 projection and a 70B-class MLP's up (N=28672)
# and down (K=28672) projections.
GEMV_SHAPES = [(8192, 8192), (28672, 8192), (8192, 28672)]


def bench_gemv(n: int, k: int, m: int = 1, schemes=(("int4", 4, 128), ("int8", 8, None))):
    """Time bf16 cuBLAS (``x @ w.T``) and the fused kernel for each (name, bits, group) scheme at
    one shape, same run. Returns ``{name: Measurement}`` with "bf16" the baseline (fp16 in the
    CPU interpreter, whose bf16 arithmetic is wrong)."""
    dt = device.preferred_dtype(torch.bfloat16) if device.GPU_MODE else torch.float16
    w = torch.randn(n, k, device=device.DEVICE, dtype=dt) * 0.02
    x = torch.randn(m, k, device=device.DEVICE, dtype=dt)
    out = {"bf16": bench.measure(lambda: x @ w.T, bytes=gemv_bytes(m, n, k, "bf16"))}
    for name, bits, group in schemes:
        qw = quantize(w, bits, group)
        y = gemv(x, qw)
        torch.testing.assert_close(y.float(), gemv_ref(x, qw).float(), rtol=2e-2, atol=2e-2)
        nbytes = gemv_bytes(m, n, k, bits, group)
        out[name] = bench.measure(lambda qw=qw: gemv(x, qw), bytes=nbytes)
    return out


@bench.register("quant_gemv")
def _bench_quant_gemv(quick: bool) -> list[dict]:
    if not device.GPU_MODE:
        print("quant_gemv benchmark skipped: weight-streaming timings need a GPU")
        return []
    copy = roofline.copy_bandwidth()
    recs = []
    for n, k in GEMV_SHAPES[:1] if quick else GEMV_SHAPES:
        for m in (1,) if quick else (1, 16):
            res = bench_gemv(n, k, m)
            base = res.pop("bf16")
            dt = device.preferred_dtype(torch.bfloat16)
            for name, meas in res.items():
                recs.append(bench.record("quant_gemv", name, (m, n, k), dt, meas,
                                         baseline=("cublas-bf16", base), ceiling=("copy", copy.value)))  # fmt: skip
            recs.append(bench.record("quant_gemv", "cublas-bf16", (m, n, k), dt, base,
                                     ceiling=("copy", copy.value)))  # fmt: skip
    return recs
