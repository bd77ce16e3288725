"""Grouped GEMM for ragged groups: every expert's product in one launch, with no padding.

After ``permute``, expert ``e`` owns rows ``offsets[e] : offsets[e+1]`` of ``x_sorted: [M, K]`` and
multiplies them by its own ``W[e]: [K, N]``. The counts are whatever the router chose: 0 for an idle
expert, thousands for a popular one. Three ways to compute this:

- a loop over experts with ``torch.matmul`` (``grouped_matmul_loop``): one launch per expert, each
  a small GEMM that fills a fraction of the GPU, plus a host round trip to read the counts;
- padding every group to the largest (or to a tile multiple) and one batched GEMM: wasted FLOPs
  and bytes in proportion to the imbalance;
- one kernel that walks every expert's tiles (``grouped_matmul``, here).

**The tile scheduler.** Expert ``e`` needs ``ceil(count_e / BLOCK_M)`` row tiles, times ``N /
BLOCK_N`` column tiles. The kernel is *persistent*: one program per SM (two for 64 x 128 tiles)
loops over a flat list of output tiles, ``tile_id = pid, pid + programs, ...``. To map a tile to
its expert, each program loads the ``n_experts + 1`` offsets once (one vector load, 1 KB for 256 experts, from L2), computes
every expert's row-tile count and their inclusive prefix sum ``ends`` in registers
(``tl.cumsum``), and then per tile finds its expert as ``sum(ends <= m_tile)``: a vectorised search
of a few hundred integers, no memory traffic. We chose this in-kernel search over a tile map
precomputed on the device (a second launch with its own buffer, sized for the worst case) because
it costs nothing next to a tile's ``2 * BLOCK_M * BLOCK_N * K`` FLOPs, needs no extra launch or
buffer, never reads the counts on the host (the launch is CUDA-graph capturable) and keeps the
schedule a pure function of ``offsets``. The grid size is fixed by shapes alone (the SM count);
the loop bound (the total tile count) is computed on the device.

- *No padding in memory*: a tile's rows past its expert's end belong to the next expert. Their
  loads are clamped to the expert's last row (unconditional, in-bounds loads) and their stores
  masked. An expert with no rows has no tiles: it costs one integer in the prefix sum.
- *L2 reuse*: tiles are numbered like ``kernels.matmul``'s grouped order over the global row tiles:
  ``GROUP_M`` row tiles (often several experts) are walked down a column of ``BLOCK_N`` before
  moving right, so the tiles in flight share x rows and weight panels in L2.
- *Imbalance*: all tiles cost the same (``K / BLOCK_K`` steps), so a heavy expert is just more
  tiles in the same queue: the persistent loop balances them across SMs. What imbalance still
  costs is partial tiles: each non-empty expert wastes up to ``BLOCK_M - 1`` rows of FLOPs.

``trans_b=True`` takes the weights as ``[E, N, K]`` (the ``nn.Linear`` layout of a checkpoint)
through strides, with no copy; it is also the backward's ``dX = dY @ W[e]^T``. ``grouped_matmul_dw``
is the weight gradient ``dW[e] = X_e^T @ dY_e``: there the *reduction* is ragged, every expert has
the same number of output tiles, and a program walks its expert's rows.

``SWIGLU``: the gate and up projections of an expert MLP share their input. The kernel keeps two
accumulators, loads each x tile once for both, and writes ``silu(x W_g) * (x W_u)`` (and, for
training, the two pre-activations): the ``[M, 2N]`` intermediate never reaches memory. We keep gate
and up as two ``[E, K, N]`` weights rather than one ``[E, K, 2N]``: a tile's epilogue needs gate
column j and up column j together, which a concatenated weight only gives with an interleaved
layout no checkpoint has.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import _validate, device, launch
from kernels.launch import cdiv
from kernels.matmul import GROUP_M, _tile_coords

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_EXPERTS = 4096  # the offsets vector each program holds in registers

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). A 128 x 256 tile with two fp32 accumulators
# (SWIGLU) would need 2 x 128 KB = 256 KB of registers per program, an SM's whole register file:
# pruned for the fused kernel.
_GPU_CONFIGS = [
    (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 3),
    (64, 128, 64, 4, 4),
    (64, 256, 64, 8, 3),
    (128, 128, 64, 4, 3),
    (64, 128, 64, 4, 3),
]
_CPU_CONFIG = (16, 32, 16, 4, 1)  # the interpreter: one small tile, so tests cross tile edges
# dW: (BLOCK_K out, BLOCK_N out, BLOCK_R reduction rows, num_warps, num_stages)
_GPU_DW_CONFIGS = [
    (128, 128, 64, 8, 4),
    (128, 256, 64, 8, 3),
    (64, 128, 64, 4, 4),
    (128, 128, 32, 4, 4),
]
_CPU_DW_CONFIG = (16, 32, 16, 4, 1)


def _autotune_configs(gpu: list, cpu: tuple, names: tuple[str, str, str]) -> list:
    shapes = [cpu] if device.INTERPRET else gpu
    return [triton.Config(dict(zip(names, s[:3])), num_warps=s[3], num_stages=s[4]) for s in shapes]


# fp32 inputs take full-precision dots, which Triton builds from FMAs rather than tensor cores: a
# 128 x 128 tile unrolls into thousands of instructions per thread and ptxas spends minutes on each
# config (the GPU suite stalled there). fp32 is the checking dtype, not a fast path: one small
# tile, which compiles in seconds.
_GPU_FP32_CONFIG = (64, 64, 32, 4, 2)


def _prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    if args.get("FP32_EXACT") and not device.INTERPRET:
        *tile, warps, stages = _GPU_FP32_CONFIG
        names = list(configs[0].kwargs)  # BLOCK_M, BLOCK_N, then BLOCK_K or BLOCK_R
        return [triton.Config(dict(zip(names, tile)), num_warps=warps, num_stages=stages)]
    if not args.get("SWIGLU", False):
        return configs
    kept = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 128 * 128]
    return kept or configs[:1]


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _expert_tiles(offs_ptr, n_experts, M, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    # Every expert's row-tile count and their inclusive prefix sum, in registers. Offsets are
    # clamped to [0, M] and to be non-decreasing per expert, so bad offsets (unchecked on a GPU
    # outside debug mode) give wrong rows but never an out-of-bounds read.
    e = tl.arange(0, E_PAD)
    e_ok = e < n_experts
    lo = tl.minimum(tl.maximum(tl.load(offs_ptr + e, mask=e_ok, other=0), 0), M)
    hi = tl.minimum(tl.maximum(tl.load(offs_ptr + e + 1, mask=e_ok, other=0), lo), M)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    return e, lo, hi, tiles, tl.cumsum(tiles, 0)


@triton.jit
def _grouped_mm_kernel(
    # pointers: x [M, K] (rows sorted by expert); w, w2 [E, K, N] through strides; y, y2 [M, N];
    # g, u [M, N] (the gate and up pre-activations: SAVE_PREACT writes them, SWIGLU_BWD reads
    # them); offsets int32 [E + 1]
    x_ptr,
    w_ptr,
    w2_ptr,
    y_ptr,
    y2_ptr,
    g_ptr,
    u_ptr,
    offs_ptr,
    # sizes
    M,
    N,
    K,
    n_experts,
    # strides (elements); the weights' (k, n) strides say whether they are [E, K, N] or [E, N, K]
    stride_xm,
    stride_xk,
    stride_we,
    stride_wk,
    stride_wn,
    stride_w2e,
    stride_w2k,
    stride_w2n,
    stride_ym,
    stride_yn,
    # meta-parameters
    rows_bucket,  # (keys the autotuner only: the next power of two of M)
    SWIGLU: tl.constexpr,  # y = silu(x @ w) * (x @ w2)
    SAVE_PREACT: tl.constexpr,  # SWIGLU for training: also store x @ w and x @ w2
    SWIGLU_BWD: tl.constexpr,  # x @ w is dh: write dg (to y) and du (to y2) from g and u
    ACCUMULATE: tl.constexpr,  # y += x @ w (the second term of a sum of products)
    FP32_EXACT: tl.constexpr,  # fp32 inputs: full-precision dots (no TF32)
    E_PAD: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    e, lo, hi, tiles, ends = _expert_tiles(offs_ptr, n_experts, M, BLOCK_M, E_PAD)
    num_m = tl.sum(tiles, 0)  # row tiles of all experts: at most cdiv(M, BLOCK_M) + n_experts
    num_n = tl.cdiv(N, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Persistent loop: this program's share of every expert's tiles, in grouped order.
    for tile_id in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile_id, num_m, num_n, GROUP_M)
        # Which expert owns global row tile pid_m: the number of experts whose tiles all come
        # before it. Then this tile's rows within that expert.
        expert = tl.sum((ends <= pid_m).to(tl.int32), 0)
        is_e = e == expert
        first_tile = tl.sum(tl.where(is_e, ends - tiles, 0), 0)
        row_lo = tl.sum(tl.where(is_e, lo, 0), 0)
        row_hi = tl.sum(tl.where(is_e, hi, 0), 0)
        rows = row_lo + (pid_m - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        # Rows past the expert's end are the next expert's: load the last valid row instead
        # (in bounds, unmasked loads) and drop them at the store. No padding in memory.
        rows_in = tl.minimum(rows, row_hi - 1)
        # Columns past N are masked, not clamped like the rows: min(cols, N - 1) hides from the
        # compiler that cols are consecutive, and with [E, K, N] weights (N the contiguous axis)
        # every weight element then became its own 2-byte load, 64-bit pointer and register (255
        # registers and spills at 128 x 128 tiles, 4-6% of the H100's peak in Lab 4e's first run).
        # Clamping the rows is free: they are not the contiguous axis of any operand.
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols < N
        x_ptrs = x_ptr + rows_in.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
        w_base = expert.to(tl.int64) * stride_we
        w_ptrs = w_ptr + w_base + offs_k[:, None] * stride_wk + cols[None, :] * stride_wn
        if SWIGLU:
            w2_base = expert.to(tl.int64) * stride_w2e
            w2_ptrs = w2_ptr + w2_base + offs_k[:, None] * stride_w2k + cols[None, :] * stride_w2n
            acc2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # fp32 accumulators: 16-bit products summed over K would lose the low bits.
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = offs_k < K - k0  # the last K step may be partial: zeros past the edge
            a = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP32_EXACT:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            if SWIGLU:  # the x tile just loaded serves both products
                b2 = tl.load(w2_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if FP32_EXACT:
                    acc2 = tl.dot(a, b2, acc2, input_precision="ieee")
                else:
                    acc2 = tl.dot(a, b2, acc2)
                w2_ptrs += BLOCK_K * stride_w2k
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        out_off = rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
        mask = (rows < row_hi)[:, None] & n_ok[None, :]
        if SWIGLU:
            if SAVE_PREACT:
                tl.store(g_ptr + out_off, acc.to(g_ptr.dtype.element_ty), mask=mask)
                tl.store(u_ptr + out_off, acc2.to(u_ptr.dtype.element_ty), mask=mask)
            acc = acc * tl.sigmoid(acc) * acc2  # silu(gate) * up, in fp32 registers
        if SWIGLU_BWD:
            # The SwiGLU derivative on the dh tile while it is in registers: dh itself never
            # reaches memory. d silu(g)/dg = sig(g) * (1 + g * (1 - sig(g))).
            g = tl.load(g_ptr + out_off, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(u_ptr + out_off, mask=mask, other=0.0).to(tl.float32)
            sig = tl.sigmoid(g)
            tl.store(y2_ptr + out_off, (acc * g * sig).to(y2_ptr.dtype.element_ty), mask=mask)
            acc = acc * u * sig * (1.0 + g * (1.0 - sig))
        if ACCUMULATE:
            acc += tl.load(y_ptr + out_off, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + out_off, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_dw_kernel(
    # pointers: a [M, K] and b [M, N] (rows sorted by expert); c: dW [E, K, N] through strides;
    # offsets int32 [E + 1]
    a_ptr,
    b_ptr,
    c_ptr,
    offs_ptr,
    # sizes
    M,
    N,
    K,
    # strides (elements); c's (k, n) strides say whether dW is stored [E, K, N] or [E, N, K]
    stride_am,
    stride_ak,
    stride_bm,
    stride_bn,
    stride_ce,
    stride_ck,
    stride_cn,
    # meta-parameters
    rows_bucket,  # (keys the autotuner only)
    FP32_EXACT: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,  # output rows: a tile of K
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,  # reduction step: rows of the expert
):
    # dW[e] = A_e^T @ B_e: every expert has the same output tiles (K x N); the ragged dimension is
    # the reduction, so a program walks its expert's rows and an empty expert writes zeros.
    # Programs are numbered expert by expert: the tiles in flight read the same rows from L2.
    num_k = tl.cdiv(K, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    expert = pid // (num_k * num_n)
    pid_k, pid_n = _tile_coords(pid % (num_k * num_n), num_k, num_n, GROUP_M)
    lo = tl.minimum(tl.maximum(tl.load(offs_ptr + expert), 0), M)
    hi = tl.minimum(tl.maximum(tl.load(offs_ptr + expert + 1), lo), M)
    offs_r = tl.arange(0, BLOCK_R)
    ks = pid_k * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Masked, not clamped to K - 1 / N - 1: the columns are both operands' contiguous axis, and a
    # clamp would turn every load into 2-byte scalars (see _grouped_mm_kernel).
    k_ok = ks < K
    n_ok = ns < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_R):
        rows = r0 + offs_r
        r_ok = rows < hi  # the reduction dimension: rows past the end must contribute zero
        a = tl.load(
            a_ptr + rows.to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak,
            mask=r_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + rows.to(tl.int64)[:, None] * stride_bm + ns[None, :] * stride_bn,
            mask=r_ok[:, None] & n_ok[None, :],
            other=0.0,
        )
        if FP32_EXACT:
            acc = tl.dot(tl.trans(a), b, acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(a), b, acc)
    c_off = expert.to(tl.int64) * stride_ce + ks[:, None] * stride_ck + ns[None, :] * stride_cn
    tl.store(c_ptr + c_off, acc.to(c_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


# The autotuner times every config by running the kernel many times on the caller's tensors. With
# ACCUMULATE the kernel reads y (y += x @ w), so each run would add once more into it and the first
# call of a new key would return y + many products. The hooks save y before each timed run and put
# it back after; the other variants only write y, and skip the copy.
_accumulator: dict[str, torch.Tensor] = {}


def _save_accumulator(nargs, reset_only: bool = False) -> None:
    if nargs.get("ACCUMULATE") and not reset_only:
        _accumulator["y"] = nargs["y_ptr"].clone()


def _restore_accumulator(nargs, exception=None) -> None:
    if "y" in _accumulator:
        nargs["y_ptr"].copy_(_accumulator.pop("y"))


_grouped_mm_tuned = triton.autotune(
    configs=_autotune_configs(_GPU_CONFIGS, _CPU_CONFIG, ("BLOCK_M", "BLOCK_N", "BLOCK_K")),
    key=[
        "N",
        "K",
        "rows_bucket",
        "SWIGLU",
        "SAVE_PREACT",
        "SWIGLU_BWD",
        "ACCUMULATE",
        "stride_wk",
        "stride_wn",
    ],  # fmt: skip
    prune_configs_by={"early_config_prune": _prune},
    pre_hook=_save_accumulator,  # y put back after every timed run of an accumulating variant
    post_hook=_restore_accumulator,
)(_grouped_mm_kernel)

_grouped_dw_tuned = triton.autotune(
    configs=_autotune_configs(_GPU_DW_CONFIGS, _CPU_DW_CONFIG, ("BLOCK_M", "BLOCK_N", "BLOCK_R")),
    key=["N", "K", "rows_bucket", "stride_ck", "stride_cn"],
    prune_configs_by={"early_config_prune": _prune},
)(_grouped_dw_kernel)


# ----------------------------------------------------------------------------- launchers


def _check_offsets(offsets, n_experts: int, M: int, dev) -> None:
    _validate.tensor("offsets", offsets, dtypes=(torch.int32,), ndim=1)
    if offsets.shape[0] != n_experts + 1:
        raise ValueError(
            f"offsets must have n_experts + 1 = {n_experts + 1} entries (weights.shape[0] + 1), "
            f"got {offsets.shape[0]}"
        )
    if offsets.device != dev:
        raise ValueError(f"offsets must be on {dev}, got {offsets.device}")
    if _validate.check_values(offsets):
        o = offsets.tolist()
        if o[0] != 0 or o[-1] != M:
            raise ValueError(
                f"offsets must start at 0 and end at the number of rows ({M}), got {o[0]} and "
                f"{o[-1]}"
            )
        if any(b < a for a, b in zip(o, o[1:])):
            raise ValueError("offsets must be non-decreasing (expert e owns rows offsets[e]:"
                             "offsets[e+1])")  # fmt: skip


def _check_operand(name: str, t, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must have dtype in (float16, bfloat16, float32), got {t.dtype}")
    if t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device.GPU_MODE and not t.is_cuda:
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")


def _weight_strides(name: str, w, K: int, trans_b: bool) -> tuple[int, int, int, int]:
    """``(N, stride_e, stride_k, stride_n)`` of ``w`` read as ``[E, K, N]``."""
    if trans_b:
        E, N, Kw = w.shape
        se, sn, sk = w.stride()
    else:
        E, Kw, N = w.shape
        se, sk, sn = w.stride()
    if Kw != K:
        layout = "[E, N, K]" if trans_b else "[E, K, N]"
        raise ValueError(
            f"{name} must be {layout} with K = x_sorted.shape[1] = {K}, got {tuple(w.shape)}"
        )
    return N, se, sk, sn


def _bucket(m: int) -> int:
    return launch.next_power_of_2(max(m, 16))


@functools.cache
def _persistent_programs() -> int:
    return launch.sm_count(interpreter=3)  # the interpreter: a few programs, each looping


def _launch_mm(
    x, w, w2, y, g, u, offsets, N, strides, strides2, swiglu, save, *, y2=None,
    swiglu_bwd=False, accumulate=False,
):  # fmt: skip
    M, K = x.shape
    E = offsets.shape[0] - 1
    e_pad = max(16, launch.next_power_of_2(E))

    def grid(meta):
        # One program per SM for the large tiles (their staged buffers fill an SM's shared
        # memory), two for 64 x 128 tiles; never more programs than tiles can exist.
        per_sm = 2 if meta["BLOCK_M"] * meta["BLOCK_N"] <= 64 * 128 else 1
        bound = (cdiv(M, meta["BLOCK_M"]) + E) * cdiv(N, meta["BLOCK_N"])
        return (max(1, min(per_sm * _persistent_programs(), bound)),)

    _grouped_mm_tuned[grid](
        x, w, w2, y, y if y2 is None else y2, g, u, offsets, M, N, K, E,
        x.stride(0), x.stride(1), *strides, *strides2, y.stride(0), y.stride(1), _bucket(M),
        SWIGLU=swiglu, SAVE_PREACT=save, SWIGLU_BWD=swiglu_bwd, ACCUMULATE=accumulate,
        FP32_EXACT=x.dtype == torch.float32, E_PAD=e_pad, GROUP_M=GROUP_M,
    )  # fmt: skip


def _check_mm(x_sorted, weights, offsets, trans_b: bool, name: str = "weights"):
    _check_operand("x_sorted", x_sorted, 2)
    _check_operand(name, weights, 3)
    _validate.same("x_sorted", x_sorted, name, weights, shape=False)
    if not isinstance(trans_b, bool):
        raise TypeError(f"trans_b must be a bool, got {type(trans_b).__name__}")
    E = weights.shape[0]
    if E > MAX_EXPERTS:
        raise ValueError(f"at most {MAX_EXPERTS} experts, got {E}")
    N, se, sk, sn = _weight_strides(name, weights, x_sorted.shape[1], trans_b)
    _check_offsets(offsets, E, x_sorted.shape[0], x_sorted.device)
    return N, (se, sk, sn)


def grouped_matmul(
    x_sorted: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, trans_b: bool = False
) -> torch.Tensor:
    """``y[rows of e] = x_sorted[rows of e] @ W[e]`` for every expert, in one launch.

    ``x_sorted: [M, K]`` (fp16, bf16 or fp32; any strides), rows of expert ``e`` at ``offsets[e] :
    offsets[e+1]`` (``offsets`` int32 ``[E + 1]``, from 0 to M, non-decreasing: checked on the CPU
    and in debug mode). ``weights: [E, K, N]``, or ``[E, N, K]`` with ``trans_b`` (``nn.Linear``
    layout, and the backward's ``dY @ W^T``), any strides, no copy. Returns ``[M, N]`` in x's
    dtype, accumulated in fp32 (fp32 inputs: full fp32 products, no TF32).
    """
    N, strides = _check_mm(x_sorted, weights, offsets, trans_b)
    M = x_sorted.shape[0]
    y = torch.empty(M, N, device=x_sorted.device, dtype=x_sorted.dtype)
    if M and N:
        if x_sorted.shape[1] == 0:
            return y.zero_()
        _launch_mm(x_sorted, weights, weights, y, y, y, offsets, N, strides, strides, False, False)
    return y


def grouped_swiglu(
    x_sorted: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    offsets: torch.Tensor,
    trans_b: bool = False,
    save_preact: bool = False,
):
    """``silu(x @ W_gate[e]) * (x @ W_up[e])`` per expert, one launch, the two products sharing
    every x tile and the activation applied in the epilogue. With ``save_preact`` returns ``(h,
    gate, up)`` (the pre-activations the backward needs), else ``h``. Arguments as
    ``grouped_matmul``; ``w_gate`` and ``w_up`` have one shape and dtype."""
    N, strides = _check_mm(x_sorted, w_gate, offsets, trans_b, "w_gate")
    _, strides2 = _check_mm(x_sorted, w_up, offsets, trans_b, "w_up")
    _validate.same("w_gate", w_gate, "w_up", w_up)
    M, K = x_sorted.shape
    new = functools.partial(torch.empty, M, N, device=x_sorted.device, dtype=x_sorted.dtype)
    h = new()
    g, u = (new(), new()) if save_preact else (h, h)
    if M and N:
        if K == 0:
            for t in (h, g, u):  # (g and u are h without save_preact: zeroed again, harmlessly)
                t.zero_()
        else:
            _launch_mm(x_sorted, w_gate, w_up, h, g, u, offsets, N, strides, strides2, True,
                       save_preact)  # fmt: skip
    return (h, g, u) if save_preact else h


def grouped_matmul_add_(
    out: torch.Tensor,
    x_sorted: torch.Tensor,
    weights: torch.Tensor,
    offsets: torch.Tensor,
    trans_b: bool = False,
) -> torch.Tensor:
    """``out += grouped_matmul(x_sorted, weights, offsets, trans_b)`` in the GEMM's epilogue (one
    read of ``out`` instead of a separate add kernel's two reads and a write); returns ``out``
    (contiguous ``[M, N]``, x's dtype). The backward uses it for ``dg W_g^T + du W_u^T``."""
    N, strides = _check_mm(x_sorted, weights, offsets, trans_b)
    _validate.tensor("out", out, dtypes=(x_sorted.dtype,), ndim=2)
    if tuple(out.shape) != (x_sorted.shape[0], N) or out.device != x_sorted.device:
        raise ValueError(f"out must be [M, N] = [{x_sorted.shape[0]}, {N}], got {tuple(out.shape)}")
    if out.numel() and x_sorted.shape[1]:
        _launch_mm(x_sorted, weights, weights, out, out, out, offsets, N, strides, strides, False,
                   False, accumulate=True)  # fmt: skip
    return out


def grouped_swiglu_backward(
    dy_sorted: torch.Tensor,
    w_down: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    offsets: torch.Tensor,
    trans_b: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """From the down projection's output gradient to the two pre-activations' gradients in one
    launch: ``dh = dy_sorted @ W_down[e]^T`` (``w_down`` as given to the forward, ``[E, F, D]`` or,
    with ``trans_b``, ``[E, D, F]``), then, in the epilogue, ``dg = dh * u * silu'(g)`` and
    ``du = dh * silu(g)`` from ``gate``, ``up: [M, F]``. Returns ``(dg, du)``; dh is never stored."""
    F_, strides = _check_mm(dy_sorted, w_down, offsets, not trans_b, "w_down")
    M = dy_sorted.shape[0]
    for name, t in (("gate", gate), ("up", up)):
        _validate.tensor(name, t, dtypes=(dy_sorted.dtype,), ndim=2)
        if tuple(t.shape) != (M, F_) or t.device != dy_sorted.device:
            raise ValueError(f"{name} must be [M, F] = [{M}, {F_}], got {tuple(t.shape)}")
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    if M and F_:
        if dy_sorted.shape[1] == 0:
            return dg.zero_(), du.zero_()
        _launch_mm(dy_sorted, w_down, w_down, dg, gate, up, offsets, F_, strides, strides, False,
                   False, y2=du, swiglu_bwd=True)  # fmt: skip
    return dg, du


def grouped_matmul_dw(
    x_sorted: torch.Tensor, dy_sorted: torch.Tensor, offsets: torch.Tensor, trans_b: bool = False
) -> torch.Tensor:
    """The weight gradient of ``grouped_matmul``: ``dW[e] = x_sorted[rows of e]^T @
    dy_sorted[rows of e]``, ``[E, K, N]`` (``[E, N, K]`` with ``trans_b``, written through strides),
    in x's dtype, fp32 accumulation. An expert with no rows gets zeros. ``E = len(offsets) - 1``."""
    _check_operand("x_sorted", x_sorted, 2)
    _check_operand("dy_sorted", dy_sorted, 2)
    _validate.same("x_sorted", x_sorted, "dy_sorted", dy_sorted, shape=False)
    M, K = x_sorted.shape
    if dy_sorted.shape[0] != M:
        raise ValueError(f"dy_sorted must have x_sorted's {M} rows, got {tuple(dy_sorted.shape)}")
    _validate.tensor("offsets", offsets, dtypes=(torch.int32,), ndim=1)
    if offsets.shape[0] < 2:
        raise ValueError(f"offsets must have n_experts + 1 >= 2 entries, got {offsets.shape[0]}")
    E = offsets.shape[0] - 1
    _check_offsets(offsets, E, M, x_sorted.device)
    N = dy_sorted.shape[1]
    shape = (E, N, K) if trans_b else (E, K, N)
    dw = torch.empty(shape, device=x_sorted.device, dtype=x_sorted.dtype)
    if dw.numel() == 0:
        return dw
    if M == 0:
        return dw.zero_()
    se, s1, s2 = dw.stride()
    sk, sn = (s2, s1) if trans_b else (s1, s2)

    def grid(meta):
        return (E * cdiv(K, meta["BLOCK_M"]) * cdiv(N, meta["BLOCK_N"]),)

    _grouped_dw_tuned[grid](
        x_sorted, dy_sorted, dw, offsets, M, N, K,
        x_sorted.stride(0), x_sorted.stride(1), dy_sorted.stride(0), dy_sorted.stride(1),
        se, sk, sn, _bucket(M), FP32_EXACT=x_sorted.dtype == torch.float32, GROUP_M=GROUP_M,
    )  # fmt: skip
    return dw


# ------------------------------------------------------------------------- references, baselines


def _groups(offsets: torch.Tensor) -> list[tuple[int, int, int]]:
    o = offsets.tolist()
    return [(e, a, b) for e, (a, b) in enumerate(zip(o, o[1:]))]


def _as_kn(weights: torch.Tensor, trans_b: bool) -> torch.Tensor:
    return weights.transpose(1, 2) if trans_b else weights


def grouped_matmul_ref(x_sorted, weights, offsets, trans_b: bool = False) -> torch.Tensor:
    """fp32 reference: one ``torch.matmul`` per expert in fp32, result in fp32."""
    w = _as_kn(weights, trans_b).float()
    y = torch.zeros(x_sorted.shape[0], w.shape[2], device=x_sorted.device)
    for e, a, b in _groups(offsets):
        if b > a:
            y[a:b] = x_sorted[a:b].float() @ w[e]
    return y


def grouped_matmul_dw_ref(x_sorted, dy_sorted, offsets, trans_b: bool = False) -> torch.Tensor:
    """fp32 reference of ``grouped_matmul_dw``."""
    E = offsets.shape[0] - 1
    dw = torch.zeros(E, x_sorted.shape[1], dy_sorted.shape[1], device=x_sorted.device)
    for e, a, b in _groups(offsets):
        dw[e] = x_sorted[a:b].float().T @ dy_sorted[a:b].float()
    return dw.transpose(1, 2) if trans_b else dw


def grouped_matmul_loop(x_sorted, weights, offsets, trans_b: bool = False) -> torch.Tensor:
    """The baseline a user writes: a Python loop over experts, one ``torch.matmul`` each, in the
    inputs' dtype (reading the offsets on the host: a device sync per call)."""
    w = _as_kn(weights, trans_b)
    y = x_sorted.new_empty(x_sorted.shape[0], w.shape[2])
    for e, a, b in _groups(offsets):
        if b > a:
            torch.matmul(x_sorted[a:b], w[e], out=y[a:b])
    return y


def torch_grouped_mm_available(dev: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` exists in this PyTorch and runs on ``dev`` in ``dtype``.

    ``torch._grouped_mm`` is a private op (2-D x 3-D with int32 end offsets);
    ``torch.nn.functional.grouped_mm`` is its public name. This course's CPU build (2.13) has both
    and runs them on the CPU in bf16 and fp32; which versions, GPUs and dtypes have it varies, so
    we ask the build at hand rather than trust a version number.
    """
    return _grouped_mm_available(str(torch.device(dev)), dtype)


@functools.cache
def _grouped_mm_available(dev: str, dtype: torch.dtype) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(32, 16, device=dev, dtype=dtype)
        w = torch.ones(2, 16, 16, device=dev, dtype=dtype)
        offs = torch.tensor([16, 32], device=dev, dtype=torch.int32)
        y = torch._grouped_mm(x, w, offs=offs)
        return bool(torch.all(y.float() == 16))
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def grouped_matmul_torch(x_sorted, weights, offsets, trans_b: bool = False) -> torch.Tensor:
    """``torch._grouped_mm`` (check ``torch_grouped_mm_available`` first); it takes the groups'
    *end* offsets, ``offsets[1:]``."""
    return torch._grouped_mm(x_sorted, _as_kn(weights, trans_b), offs=offsets[1:])


def _dw_spec(t: str, min_cc: int = 0) -> dict:
    return dict(
        kernel=_grouped_dw_kernel,
        signature={
            "a_ptr": f"*{t}",
            "b_ptr": f"*{t}",
            "c_ptr": f"*{t}",
            "offs_ptr": "*i32",
            **{n: "i32" for n in ("M", "N", "K", "stride_am", "stride_ak", "stride_bm")},
            **{n: "i32" for n in ("stride_bn", "stride_ce", "stride_ck", "stride_cn")},
            "rows_bucket": "i32",
        },  # fmt: skip
        constexprs={
            "FP32_EXACT": t == "fp32",
            "GROUP_M": GROUP_M,
            "BLOCK_M": 128,
            "BLOCK_N": 128,
            "BLOCK_R": 64,
        },
        options={"num_warps": 8, "num_stages": 4},
        min_cc=min_cc,
    )


def _mm_spec(t: str, swiglu: bool, save: bool, min_cc: int = 0, bwd: bool = False) -> dict:
    ints = ("M", "N", "K", "n_experts", "stride_xm", "stride_xk", "stride_we", "stride_wk")
    ints2 = ("stride_wn", "stride_w2e", "stride_w2k", "stride_w2n", "stride_ym", "stride_yn")
    return dict(
        kernel=_grouped_mm_kernel,
        signature={
            **{n: f"*{t}" for n in ("x_ptr", "w_ptr", "w2_ptr", "y_ptr", "y2_ptr", "g_ptr")},
            "u_ptr": f"*{t}",
            "offs_ptr": "*i32",
            **{n: "i32" for n in (*ints, *ints2, "rows_bucket")},
        },
        constexprs={
            "SWIGLU": swiglu,
            "SAVE_PREACT": save,
            "SWIGLU_BWD": bwd,
            "ACCUMULATE": bwd,
            "FP32_EXACT": t == "fp32",
            "E_PAD": 256,
            "GROUP_M": GROUP_M,
            "BLOCK_M": 128,
            "BLOCK_N": 128 if swiglu else 256,
            "BLOCK_K": 64,
        },
        options={"num_warps": 8, "num_stages": 3},
        min_cc=min_cc,
    )


# bf16 from Ampere on (the GPUs with bf16 tensor cores); fp16, what a T4 runs instead, for every
# target. Each Turing compile of the grouped kernel took the compiler about 20 s on a 2-core CPU
# machine when this was written, so the Turing target gets one of them.
COMPILE_SPECS = [
    _mm_spec("bf16", False, False, min_cc=80),
    _mm_spec("bf16", True, True, min_cc=80),
    _mm_spec("bf16", False, False, min_cc=80, bwd=True),
    _mm_spec("fp16", False, False),
    _dw_spec("bf16", min_cc=80),
]
