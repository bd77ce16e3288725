"""FlashAttention in Triton: exact attention without the N x N score matrix ever reaching HBM.

``attention(q, k, v, causal=False, sm_scale=None)`` computes ``softmax(q kᵀ · sm_scale) v`` for
fp16/bf16 ``q: [B, H, Nq, D]``, ``k, v: [B, H, Nk, D]`` (contiguous, D in 64 or 128) and is
differentiable: it is a ``torch.autograd.Function`` with a hand-written backward.

**Forward** (one program per BLOCK_M query rows of one head). The program loads its query tile once
and streams the keys and values of the head through shared memory in BLOCK_N-row tiles. It keeps,
per query row and in fp32 registers, the running maximum ``m`` of the scores seen so far, the running
sum ``l`` of their exponentials and the unnormalised output ``acc`` (the *online softmax*): when a
new tile raises the maximum, the old sum and accumulator are rescaled by ``exp(m_old - m_new)``. The
scores of one tile live in registers only. Reads: q once, k and v once per query tile (from L2,
mostly); writes: o and one fp32 log-sum-exp per row. The log-sum-exp is all the backward needs to
rebuild the probabilities.

Exponentials are base 2 (``exp2`` is one hardware instruction; ``exp`` is ``exp2`` plus a multiply):
scores are multiplied by ``sm_scale * log2(e)`` inside the fused multiply-add that also subtracts
the running maximum, so the scale costs nothing. With ``causal=True`` the key loop is split: tiles
left of the diagonal need no mask, and only the BLOCK_M/BLOCK_N tiles on the diagonal are masked.

**Backward** (FlashAttention-2's partitioning, no atomics): a preprocess kernel computes
``delta_i = sum_d dO_id * O_id``; one kernel per key tile walks over the query tiles, recomputes
``P`` from q, k and the log-sum-exp, and accumulates ``dV += Pᵀ dO`` and ``dK += dSᵀ Q`` in
registers; a second kernel per query tile walks over the key tiles and accumulates ``dQ += dS K``.
``dS = P ∘ (dP - delta)`` with ``dP = dO Vᵀ``. Every accumulator is fp32.

``backward="atomic_dq"`` (``BACKWARDS``) is FlashAttention-2's own CUDA design and FlashAttention-3's:
the key-tile kernel also computes ``dS K`` for each query tile it visits and adds it to an fp32 dQ
with atomic adds, so P and dP are computed once instead of twice (five matmuls per pair of tiles
instead of seven) at the price of ``N_kv / BLOCK_N`` atomic adds per element of dQ and a conversion
to fp16/bf16 at the end. The sum's order then changes from run to run: dQ is not bit-reproducible.
On Hopper the adds go out as TMA bulk reductions (``tensor_descriptor.atomic_add``), elsewhere as
``tl.atomic_add``. Measured on an H100 at 8,192 tokens it is not faster: the extra matmul and the
dQ tile push the key-tile kernel past 255 registers into spills, and it takes 6,950 µs where the
two kernels take 3,951 + 2,638 (scripts/gpu/fa_bwd_tiles.py; page 4.12 has the numbers).

**On Hopper** ``attention`` hands bf16 self-attention with head dim 128 to the CUDA kernels of page
4.12 (``kernels.cuda.fa_ws``, FlashAttention-3's warp-specialised design) from the lengths where they
measured faster than these: the forward from ``fa_ws.FASTER_FROM`` tokens, the backward from
``fa_ws_bwd.FASTER_FROM``. ``impl="triton"`` (or ``GPU_BRRR_CUDA_ATTENTION=0``) keeps this module's
kernels; the chapters that teach them do so.

**Host path.** Problems too small to autotune launch at a fixed tile (``_fast_fwd``,
``_fast_bwd``) through ``kernels.launch``'s fast path, and from a layout's second call on, with the
default options, from C++ (``kernels.replay``): the forward and the three-kernel backward, with no
Python between the call and the launches (page 3.4 measures it).

``naive_attention`` is the textbook version that materialises the scores (for the chapter's memory
and speed comparison) and ``attention_ref`` the fp32 reference.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kernels import _validate, bench, device, launch, replay, roofline
from kernels import sdpa as _sdpa
from kernels.launch import LOG2E, cdiv

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_DIMS = (64, 128)
# How the backward computes dQ: "two_kernels" (a second kernel over query tiles recomputes P and dP:
# no atomics, the same bits every run) or "atomic_dq" (the key-tile kernel adds dS K into an fp32 dQ
# with atomics). The first is the default: the second measured 3-5% slower on an H100 (causal: 3%
# faster, within run-to-run noise).
BACKWARDS = ("two_kernels", "atomic_dq")
# Which kernels ``attention`` runs: "auto" (the CUDA FlashAttention-3 kernels of page 4.12 where they
# measured faster than these Triton ones, on Hopper; see ``attention``), "triton" or "cuda".
IMPLS = ("auto", "triton", "cuda")

# ----------------------------------------------------------------------------- configurations

# Tile shapes, as (resident rows, streamed rows, num_warps, num_stages). The resident tile stays on
# chip for the whole loop (queries in the forward and in the dQ kernel, keys and values in the
# dK/dV kernel); the streamed tiles go through shared memory, num_stages of them in flight. The
# resident size must be a multiple of the streamed one. TUNED are the candidates the autotuner
# times on large problems (the winners of a sweep on an H100 at N = 4096 and 16384, head dim 128);
# SMALL, in order of preference, give the one configuration used on small problems, where timing
# every candidate would cost more than it saves.
# The last TUNED candidate of each came from a sweep at head dim 64 (on an H100, 2026-12-06, every
# tile of 64-128 x 32-128 rows, 4 or 8 warps, 2-4 stages, each kernel timed alone; bf16,
# results/profiles/2026-12-06-nvidia-h100-80gb-hbm3-fa-tiles-d64.txt): (64, 64, 4, 3) ran the
# d = 64 forward 12-14% faster than the d = 128 winners at 2,048 and 8,192 tokens (1,407 -> 1,234
# µs at 2 x 16 x 8,192), and the dK/dV kernel 3-4% faster.
_FWD_TUNED = [(128, 128, 8, 3), (128, 64, 8, 4), (128, 64, 8, 3), (64, 64, 4, 3)]
_FWD_SMALL = [(128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2)]
_BWD_TUNED = [(128, 64, 8, 3), (64, 64, 4, 2), (64, 32, 4, 3), (64, 64, 4, 3)]
_BWD_SMALL = [(64, 64, 4, 2), (64, 32, 4, 3), (32, 32, 4, 2)]
# Problems with B * H * Nq * Nk below this use the first SMALL configuration that fits. (2**27 was
# tried on 2026-12-06: on an H200 the backward at 32 x 16 heads of 512 tokens, d = 64, then ran
# 1.03x cuDNN, but the forward fell to 0.50x, unexplained; the probe on an H100 had SMALL's first
# forward tile among the fastest there. Kept at 2**28 until that is understood.)
_TUNE_MIN_WORK = 2**28
_AUTOTUNE_KEY = ["N_Q", "N_KV", "HEAD_DIM", "CAUSAL"]
# The autotuner keeps one choice per key, and the key holds the sequence lengths, not the batch:
# so each kernel also takes TUNE (work >= _TUNE_MIN_WORK, computed by the launcher) and has it in
# its key. Without it the first call of a length decided for every batch: a check at batch 1
# (SMALL) fixed the tile of the training batch that followed at the same length. (TUNE is a
# constexpr the body never reads: where both classes meet one length, the same code compiles twice.)
_TUNE_KEY = [*_AUTOTUNE_KEY, "TUNE"]


def _tune_all(batch_heads: int, n_q: int, n_kv: int) -> bool:
    """Whether a problem is large enough to autotune over TUNED (else SMALL's first fit)."""
    return batch_heads * n_q * n_kv >= _TUNE_MIN_WORK


# Warp specialisation (issue 19, item 2): tried and NOT added, Triton 3.6, compiled ahead of time
# for GPUTarget("cuda", 90, 32) on a CPU (TRITON_INTERPRET=0), never run on a GPU. The experiment:
# the K/V loop of `_fwd_tiles` written as `tl.range(start, end, BLOCK_N, warp_specialize=WS)`, WS on
# the main loop only (not on the tail / diagonal loop), bf16, d = 128, BLOCK_M = 128, BLOCK_N = 64.
# - num_warps = 8 (every configuration below): the flag is silently ignored. `tt.warp_specialize`
#   reaches the TTGIR but no `ttg.warp_specialize` op is made, and the PTX is byte-identical to the
#   build without the flag (TMA and pointer paths, causal and not): 256 threads, no `setmaxnreg`, on
#   the TMA path only CTA-wide `bar.sync 0`. The Hopper pass (`nvgpu-warp-specialization`) acted
#   only when num_warps = 4.
# - num_warps = 4: the pass aborts (RuntimeError "PassManager::run failed", which the autotuner does
#   not catch), TMA and pointer paths, causal and not. Two features of this kernel each trigger it,
#   found by removing them one at a time from a minimal copy of the loop:
#   (a) q loaded with `tl.load` (masked or not) before the loop: assertion in WSLowerToken.cpp
#       (processProducerCommitOp); apparently every tile the loop uses must come from a TMA
#       descriptor, q included;
#   (b) a second K/V loop after the specialised one (our unmasked-tail or causal-diagonal split),
#       whether or not it is specialised too: MLIR dominance assertion ("expected non-null blocks").
# - The minimal copy WITHOUT (a) and (b) (q, k, v all by descriptor; one loop over whole tiles;
#   num_warps = 4) does compile to a warp-specialised pipeline: 384 threads (`.reqntid 384`), one
#   ttg.warp_specialize op with a producer (default partition: TMA copies of q, k, v and mbarrier
#   expect/wait) and two consumer warpgroups that each take 64 of the 128 query rows (wgmma, their
#   own named barriers `bar.sync 2, 128` / `bar.sync 3, 128`), with `setmaxnreg.dec 40` for the
#   producer and `setmaxnreg.inc 232` for the consumers. Whether it is correct or faster is unknown.
# So the course kernel needs restructuring first (q through a descriptor; the masked tail and the
# causal diagonal folded into the one loop, e.g. a per-tile mask predicate) before the flag can be
# an autotune option; retry on each Triton upgrade, since the pass is young (its docstring still says
# "only supported on Blackwell"). kernels/flash_attention_ws.py is that restructured forward, kept
# apart as an experiment: on an H100 its specialised pipeline gave wrong results (half of each
# tile's lse, the causal output; its UNSAFE_ENV says how it is refused), so it is untimed.


def _smem_limit() -> int:
    """Shared memory one program may use on this GPU, in bytes."""
    if not device.GPU_MODE:
        return 1 << 30
    return getattr(launch.properties(), "shared_memory_per_block_optin", 49152)


def _tile(config: triton.Config, resident: str, streamed: str) -> tuple[int, int, int, int]:
    kw = config.kwargs
    return kw[resident], kw[streamed], config.num_warps, config.num_stages


def _fits_smem(
    config: triton.Config, resident: str, streamed: str, n_resident: int, d: int
) -> bool:
    """Whether a tile fits this GPU's shared memory, an estimate: ``n_resident`` 16-bit resident
    tiles plus num_stages pairs (K and V) of streamed ones, each ``d`` wide."""
    return _fits(_tile(config, resident, streamed), n_resident, d)


def _fits(tile: tuple[int, int, int, int], n_resident: int, d: int) -> bool:
    r, st, _, stages = tile
    return 2 * d * (n_resident * r + stages * 2 * st) <= _smem_limit()


@functools.cache
def _small_tile(tuned: tuple, small: tuple, n_resident: int, d: int) -> tuple[int, int, int, int]:
    """The tile a small problem (TUNE false) runs with, through the fast path or ``_pruner``: the
    first of ``small`` that fits shared memory, else the smallest of all."""
    fitting = [t for t in small if _fits(t, n_resident, d)]
    return fitting[0] if fitting else min(tuned + small)


def _pruner(resident: str, streamed: str, tuned: list, small: list, n_resident: int):
    """An ``early_config_prune`` for the autotuner: drop tiles that overflow shared memory
    (``_fits_smem``), then keep the TUNED candidates for large problems (the kernel's TUNE) or the
    first fitting SMALL one for small ones."""

    def prune(configs, nargs, **kwargs):
        d = kwargs["HEAD_DIM"]
        fits = (c for c in configs if _fits_smem(c, resident, streamed, n_resident, d))
        by_shape = {_tile(c, resident, streamed): c for c in fits}
        if kwargs["TUNE"]:
            chosen = [by_shape[t] for t in tuned if t in by_shape]
            if chosen:
                return chosen
        tile = _small_tile(tuple(tuned), tuple(small), n_resident, d)
        if tile in by_shape:
            return [by_shape[tile]]
        # None of SMALL fits, or the interpreter's single tile: the smallest configuration.
        return [min(configs, key=lambda c: _tile(c, resident, streamed))]

    return prune


def _configs(resident: str, streamed: str, tuned: list, small: list, hook=None):
    if device.INTERPRET:  # the interpreter cannot autotune over several configs: one small tile
        return [triton.Config({resident: 32, streamed: 32}, pre_hook=hook)]
    shapes = list(dict.fromkeys(tuned + small))
    return [
        triton.Config({resident: r, streamed: st}, num_warps=w, num_stages=s, pre_hook=hook)
        for r, st, w, s in shapes
    ]


# ----------------------------------------------------------------------------- forward


@triton.jit
def _online_softmax_step(acc, l_i, m_i, s, qk_scale):
    # Online softmax, base 2: scale and subtract the new running max in one FMA per score.
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)  # rescales what was accumulated under the old max
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    return acc, l_i, m_new, p


@triton.jit
def _fwd_tiles(
    acc,
    l_i,
    m_i,
    q,
    k_src,
    v_src,
    kv_row0,
    offs_m,
    start,
    end,
    N_KV,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,  # 0: whole tiles, no mask; 1: the causal diagonal; 2: the last, partial tile
    USE_TMA: tl.constexpr,  # k_src, v_src: TMA descriptors of [B*H*N_KV, D], else base pointers
):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_off = offs_n[:, None] * HEAD_DIM + offs_d[None, :]
        if USE_TMA:
            # The copy engine moves the whole tile; rows past this head's keys are the next head's
            # (or zeros past the tensor's end) and are masked out of the scores below.
            k = k_src.load([kv_row0 + start_n, 0])
        elif MASK == 0:
            k = tl.load(k_src + kv_off)
        else:  # rows past the end of the keys read as zeros; their scores are masked below
            k = tl.load(k_src + kv_off, mask=offs_n[:, None] < N_KV, other=0.0)
        # s = q kᵀ for this tile, fp32 on the tensor cores; it lives in registers only.
        s = tl.dot(q, tl.trans(k))
        if MASK == 1:
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        if MASK == 2:
            s = tl.where(offs_n[None, :] < N_KV, s, float("-inf"))
        acc, l_i, m_i, p = _online_softmax_step(acc, l_i, m_i, s, qk_scale)
        if USE_TMA:
            v = v_src.load([kv_row0 + start_n, 0])
        elif MASK == 0:
            v = tl.load(v_src + kv_off)
        else:
            v = tl.load(v_src + kv_off, mask=offs_n[:, None] < N_KV, other=0.0)
        # P is rounded to the input dtype for the second tensor-core matmul; acc stays fp32.
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_i


def _set_kv_blocks(nargs):
    # Autotuning changes BLOCK_N, and a TMA descriptor carries the shape of the tile it copies.
    if nargs["USE_TMA"]:
        block = [nargs["BLOCK_N"], nargs["HEAD_DIM"]]
        nargs["k_src"].block_shape = block
        nargs["v_src"].block_shape = block


@triton.autotune(
    configs=_configs("BLOCK_M", "BLOCK_N", _FWD_TUNED, _FWD_SMALL, hook=_set_kv_blocks),
    key=[*_TUNE_KEY, "USE_TMA"],
    prune_configs_by={
        "early_config_prune": _pruner("BLOCK_M", "BLOCK_N", _FWD_TUNED, _FWD_SMALL, 1)
    },
)
@triton.jit
def _attn_fwd_kernel(
    # pointers: q, o [B*H, N_Q, HEAD_DIM]; k, v [B*H, N_KV, HEAD_DIM] (pointers or TMA
    # descriptors of the [B*H*N_KV, HEAD_DIM] view); lse [B*H, N_Q] (fp32)
    q_ptr,
    k_src,
    v_src,
    o_ptr,
    lse_ptr,
    # scalars and sizes
    sm_scale,
    N_Q,
    N_KV,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_TMA: tl.constexpr,
    TUNE: tl.constexpr,  # only the autotuner reads it (its key): see _TUNE_KEY
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    pid_m = tl.program_id(0)
    if CAUSAL:  # the last query tiles have the most keys to visit: start them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1).to(tl.int64)  # int64: B*H*N*D can exceed 2**31
    if USE_TMA:
        k_base, v_base = k_src, v_src
        kv_row0 = (bh * N_KV).to(tl.int32)  # descriptor coordinates are rows of the 2-D view
    else:
        k_base = k_src + bh * N_KV * HEAD_DIM
        v_base = v_src + bh * N_KV * HEAD_DIM
        kv_row0 = 0

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m[:, None] < N_Q
    qo_off = bh * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    # The query tile is loaded once and reused against every key tile.
    q = tl.load(q_ptr + qo_off, mask=row_ok, other=0.0)

    # Per-row online-softmax state, all fp32.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # launch.LOG2E (a jit function reads literals)

    if CAUSAL:
        # Key tiles wholly left of the diagonal are fully visible to every row: no mask. Then
        # the BLOCK_M / BLOCK_N tiles on the diagonal, masked (they also cover the end of N).
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, kv_row0, offs_m, 0, start_m,
                                   N_KV, qk_scale, HEAD_DIM, BLOCK_N, 0, USE_TMA)  # fmt: skip
        diag_end = tl.minimum(start_m + BLOCK_M, N_KV)
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, kv_row0, offs_m, start_m,
                                   diag_end, N_KV, qk_scale, HEAD_DIM, BLOCK_N, 1, USE_TMA)  # fmt: skip
    else:
        full_end = (N_KV // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, kv_row0, offs_m, 0, full_end,
                                   N_KV, qk_scale, HEAD_DIM, BLOCK_N, 0, USE_TMA)  # fmt: skip
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_base, v_base, kv_row0, offs_m, full_end,
                                   N_KV, N_KV, qk_scale, HEAD_DIM, BLOCK_N, 2, USE_TMA)  # fmt: skip

    # Epilogue: one division per output element, and the log-sum-exp (base 2, of the scaled
    # scores) that lets the backward recompute P = exp2(s * qk_scale - lse) without a second pass.
    acc = acc / l_i[:, None]
    tl.store(o_ptr + qo_off, acc.to(o_ptr.dtype.element_ty), mask=row_ok)
    tl.store(lse_ptr + bh * N_Q + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < N_Q)


# ----------------------------------------------------------------------------- backward


@triton.jit
def _attn_bwd_preprocess_kernel(
    # pointers: o, do [rows, HEAD_DIM]; delta [rows] (fp32); dq_acc [rows, HEAD_DIM] (fp32, written
    # only with ZERO_DQ)
    o_ptr,
    do_ptr,
    delta_ptr,
    dq_acc_ptr,
    # sizes
    n_rows,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ZERO_DQ: tl.constexpr,  # also zero the fp32 dQ that the atomic backward adds into
):
    # delta_i = dO_i · O_i = sum_j P_ij dP_ij: the term every dS_ij subtracts. Reads o and do once.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = rows[:, None] < n_rows
    o = tl.load(o_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(do_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(delta_ptr + rows, delta, mask=rows < n_rows)
    if ZERO_DQ:
        zeros = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        tl.store(dq_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], zeros, mask=mask)


@triton.jit
def _dkdv_tiles(
    dk,
    dv,
    k,
    v,
    q_base,
    do_base,
    lse_base,
    delta_base,
    dq_base,
    dq_desc,
    q_row0,
    offs_n,
    start,
    end,
    N_Q,
    qk_scale,
    sm_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,
    BOUNDS: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    DQ_TMA: tl.constexpr,
):
    offs_m = start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_ptrs = q_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    do_ptrs = do_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    for start_m in range(start, end, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        if BOUNDS:  # query rows past the end read as zeros, so they add nothing to dK or dV
            q = tl.load(q_ptrs, mask=offs_m[:, None] < N_Q, other=0.0)
            do = tl.load(do_ptrs, mask=offs_m[:, None] < N_Q, other=0.0)
            lse = tl.load(lse_base + offs_m, mask=offs_m < N_Q, other=0.0)
            delta = tl.load(delta_base + offs_m, mask=offs_m < N_Q, other=0.0)
        else:
            q = tl.load(q_ptrs)
            do = tl.load(do_ptrs)
            lse = tl.load(lse_base + offs_m)
            delta = tl.load(delta_base + offs_m)
        # Work with the transposes (keys along rows) so that k, v and the accumulators stay put.
        s_t = tl.dot(k, tl.trans(q))  # [BLOCK_N, BLOCK_M]
        p_t = tl.math.exp2(s_t * qk_scale - lse[None, :])  # P, rebuilt from the log-sum-exp
        if CAUSAL_MASK:
            p_t = tl.where(offs_m[None, :] >= offs_n[:, None], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)  # dV += Pᵀ dO
        dp_t = tl.dot(v, tl.trans(do))  # dPᵀ = V dOᵀ
        ds_t = p_t * (dp_t - delta[None, :])  # dSᵀ = Pᵀ ∘ (dPᵀ - delta)
        # dK += dSᵀ Q (times sm_scale, applied once at the end)
        ds_t = ds_t.to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
        if ATOMIC_DQ:  # this key tile's share of dQ = dS K, added into the fp32 dQ
            dq = tl.dot(tl.trans(ds_t), k) * sm_scale
            if DQ_TMA:
                # One bulk reduction by the TMA unit (cp.reduce.async.bulk.tensor .add) from
                # shared memory, instead of a red.global per element from every thread. Rows past
                # N_Q (the next head's, or clipped at the end) get exact zeros: their dS is 0.
                dq_desc.atomic_add([q_row0 + start_m, 0], dq)
            else:
                dq_ptrs = dq_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
                mask = offs_m[:, None] < N_Q if BOUNDS else None
                tl.atomic_add(dq_ptrs, dq, mask=mask, sem="relaxed")
        offs_m += BLOCK_M
        q_ptrs += BLOCK_M * HEAD_DIM
        do_ptrs += BLOCK_M * HEAD_DIM
    return dk, dv


def _set_dq_block(nargs):
    # The dQ descriptor's tile is one step's query rows: it changes with the config's BLOCK_M.
    if nargs["DQ_TMA"]:
        nargs["dq_desc"].block_shape = [nargs["BLOCK_M"], nargs["HEAD_DIM"]]


@triton.autotune(
    configs=_configs("BLOCK_N", "BLOCK_M", _BWD_TUNED, _BWD_SMALL, hook=_set_dq_block),
    key=[*_TUNE_KEY, "ATOMIC_DQ", "DQ_TMA"],
    prune_configs_by={
        "early_config_prune": _pruner("BLOCK_N", "BLOCK_M", _BWD_TUNED, _BWD_SMALL, 2)
    },
    # The atomic backward adds into dQ: every timing run of the autotuner would add again.
    reset_to_zero=["dq_acc_ptr"],
)
@triton.jit
def _attn_bwd_dkdv_kernel(
    # pointers: q, do [B*H, N_Q, HEAD_DIM]; k, v, dk, dv [B*H, N_KV, HEAD_DIM]; lse, delta [B*H, N_Q];
    # dq_acc [B*H, N_Q, HEAD_DIM] fp32 (used only with ATOMIC_DQ)
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    dq_acc_ptr,
    dq_desc,  # with DQ_TMA: a TMA descriptor of dq_acc as [B*H*N_Q, HEAD_DIM] (else unused)
    # scalars and sizes
    sm_scale,
    N_Q,
    N_KV,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,  # also add this key tile's dS K into dq_acc (backward="atomic_dq")
    DQ_TMA: tl.constexpr,  # ... by TMA bulk reductions through dq_desc (else tl.atomic_add)
    TUNE: tl.constexpr,  # only the autotuner reads it (its key): see _TUNE_KEY
    BLOCK_M: tl.constexpr,  # query rows per step of the loop
    BLOCK_N: tl.constexpr,  # key rows owned by this program
):
    tl.static_assert(BLOCK_N % BLOCK_M == 0)
    bh = tl.program_id(1).to(tl.int64)
    start_n = tl.program_id(0) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    kv_off = bh * N_KV * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    key_ok = offs_n[:, None] < N_KV
    # This program's keys and values stay in registers/shared memory for the whole loop; key rows
    # past the end read as zeros and their gradients are never stored.
    k = tl.load(k_ptr + kv_off, mask=key_ok, other=0.0)
    v = tl.load(v_ptr + kv_off, mask=key_ok, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # launch.LOG2E (a jit function reads literals)

    q_base = q_ptr + bh * N_Q * HEAD_DIM
    do_base = do_ptr + bh * N_Q * HEAD_DIM
    lse_base = lse_ptr + bh * N_Q
    delta_base = delta_ptr + bh * N_Q
    dq_base = dq_acc_ptr + bh * N_Q * HEAD_DIM
    q_row0 = (bh * N_Q).to(tl.int32)  # descriptor coordinates are rows of the 2-D view
    full_end = (N_Q // BLOCK_M) * BLOCK_M
    first = 0
    if CAUSAL:
        # Queries before start_n see none of these keys. The BLOCK_N / BLOCK_M query tiles on the
        # diagonal are masked; every query tile below them sees all of these keys.
        first = start_n + BLOCK_N
        diag_end = tl.minimum(first, N_Q)
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, dq_desc,
                             q_row0, offs_n, start_n, diag_end, N_Q, qk_scale, sm_scale, HEAD_DIM,
                             BLOCK_M, True, True, ATOMIC_DQ, DQ_TMA)  # fmt: skip
    dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, dq_desc,
                         q_row0, offs_n, first, full_end, N_Q, qk_scale, sm_scale, HEAD_DIM,
                         BLOCK_M, False, False, ATOMIC_DQ, DQ_TMA)  # fmt: skip
    dk, dv = _dkdv_tiles(dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, dq_desc,
                         q_row0, offs_n, tl.maximum(first, full_end), N_Q, N_Q, qk_scale,
                         sm_scale, HEAD_DIM, BLOCK_M, False, True, ATOMIC_DQ, DQ_TMA)  # fmt: skip

    dk = dk * sm_scale  # s = sm_scale * q·k, so dL/dk carries one factor of sm_scale
    tl.store(dk_ptr + kv_off, dk.to(dk_ptr.dtype.element_ty), mask=key_ok)
    tl.store(dv_ptr + kv_off, dv.to(dv_ptr.dtype.element_ty), mask=key_ok)


@triton.jit
def _dq_tiles(
    dq,
    q,
    do,
    lse,
    delta,
    k_base,
    v_base,
    offs_m,
    start,
    end,
    N_KV,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK: tl.constexpr,  # 0: whole tiles; 1: the causal diagonal; 2: the last, partial tile
):
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k_ptrs = k_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    v_ptrs = v_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    for start_n in range(start, end, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        if MASK == 0:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=offs_n[:, None] < N_KV, other=0.0)
            v = tl.load(v_ptrs, mask=offs_n[:, None] < N_KV, other=0.0)
        s = tl.dot(q, tl.trans(k))
        p = tl.math.exp2(s * qk_scale - lse[:, None])
        if MASK == 1:
            p = tl.where(offs_m[:, None] >= offs_n[None, :], p, 0.0)
        if MASK == 2:
            p = tl.where(offs_n[None, :] < N_KV, p, 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)  # dQ += dS K (times sm_scale at the end)
        offs_n += BLOCK_N
        k_ptrs += BLOCK_N * HEAD_DIM
        v_ptrs += BLOCK_N * HEAD_DIM
    return dq


@triton.autotune(
    configs=_configs("BLOCK_M", "BLOCK_N", _BWD_TUNED, _BWD_SMALL),
    key=_TUNE_KEY,
    prune_configs_by={
        "early_config_prune": _pruner("BLOCK_M", "BLOCK_N", _BWD_TUNED, _BWD_SMALL, 2)
    },
)
@triton.jit
def _attn_bwd_dq_kernel(
    # pointers: q, do, dq [B*H, N_Q, HEAD_DIM]; k, v [B*H, N_KV, HEAD_DIM]; lse, delta [B*H, N_Q]
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    # scalars and sizes
    sm_scale,
    N_Q,
    N_KV,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    TUNE: tl.constexpr,  # only the autotuner reads it (its key): see _TUNE_KEY
    BLOCK_M: tl.constexpr,  # query rows owned by this program
    BLOCK_N: tl.constexpr,  # key rows per step of the loop
):
    tl.static_assert(BLOCK_M % BLOCK_N == 0)
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1).to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_off = bh * N_Q * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    row_ok = offs_m < N_Q
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + q_off, mask=row_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + bh * N_Q + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + bh * N_Q + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # launch.LOG2E (a jit function reads literals)

    k_base = k_ptr + bh * N_KV * HEAD_DIM
    v_base = v_ptr + bh * N_KV * HEAD_DIM
    if CAUSAL:
        dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, offs_m, 0, start_m, N_KV, qk_scale,
                       HEAD_DIM, BLOCK_N, 0)  # fmt: skip
        diag_end = tl.minimum(start_m + BLOCK_M, N_KV)
        dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, offs_m, start_m, diag_end, N_KV,
                       qk_scale, HEAD_DIM, BLOCK_N, 1)  # fmt: skip
    else:
        full_end = (N_KV // BLOCK_N) * BLOCK_N
        dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, offs_m, 0, full_end, N_KV, qk_scale,
                       HEAD_DIM, BLOCK_N, 0)  # fmt: skip
        dq = _dq_tiles(dq, q, do, lse, delta, k_base, v_base, offs_m, full_end, N_KV, N_KV,
                       qk_scale, HEAD_DIM, BLOCK_N, 2)  # fmt: skip

    dq = dq * sm_scale
    tl.store(dq_ptr + q_off, dq.to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


# ----------------------------------------------------------------------------- launchers


# The kernels' grids put (batch, head) on the y axis, which holds at most 65,535 programs on a GPU.
MAX_BATCH_HEADS = 65535


def _check(q, k, v, causal, sm_scale) -> float:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _validate.tensor(name, t, dtypes=SUPPORTED_DTYPES, ndim=4)
    _validate.same("q", q, "k", k, shape=False)
    _validate.same("k", k, "v", v)
    if device.GPU_MODE and not q.is_cuda:
        raise ValueError(f"q, k and v must be on a CUDA device, got {q.device}")
    if q.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"q and k must have the same batch and heads [B, H, N, D], got q {tuple(q.shape)} "
            f"and k {tuple(k.shape)}"
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[3]} and {k.shape[3]}")
    if q.shape[3] not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {q.shape[3]}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"causal=True needs as many queries as keys (Nq == Nk), got {q.shape[2]} and "
            f"{k.shape[2]}"
        )
    if k.shape[2] == 0 and q.shape[2] > 0:
        raise ValueError("k and v must hold at least one key (Nk >= 1)")
    if q.shape[0] * q.shape[1] > MAX_BATCH_HEADS:
        raise ValueError(
            f"batch * heads must be at most {MAX_BATCH_HEADS:,} (one grid axis of programs per "
            f"(batch, head)), got {q.shape[0]} * {q.shape[1]}: split the batch"
        )
    return _validate.sm_scale(sm_scale, q.shape[3])


def tma_available(*tensors: torch.Tensor) -> bool:
    """Whether the forward can move K/V tiles with TMA: a Hopper-or-newer GPU, and 16-byte-aligned
    base addresses (row strides are D * 2 bytes, a multiple of 16 for every supported D)."""
    return (
        device.GPU_MODE
        and device.capabilities().tma
        and all(t.is_cuda and t.data_ptr() % 16 == 0 for t in tensors)
    )


# Small problems (the kernels' TUNE false) skip the autotuner on a GPU: their tile is fixed
# (``_small_tile``, the autotuner's own choice for them), and kernels.launch's fast path launches the
# binary it kept for the call's layout directly, without Triton's per-call argument binding. These
# calls take microseconds on the device, so the host's part decides their time. (The launcher keys
# hold everything the kernels specialise on: dtype, alignment, sizes and options; outputs and
# the fp32 scratch are fresh, hence aligned.)
_FAST = {
    "fwd": launch.Launcher(_attn_fwd_kernel.fn),
    "pre": launch.Launcher(_attn_bwd_preprocess_kernel),
    "dkdv": launch.Launcher(_attn_bwd_dkdv_kernel.fn),
    "dq": launch.Launcher(_attn_bwd_dq_kernel.fn),
}


def _fast(tune: bool) -> bool:
    """Whether a problem launches at its fixed small tile through ``_FAST`` (a GPU, TUNE false);
    in the interpreter every launch goes through Triton at the interpreter's one tile."""
    return device.GPU_MODE and not tune


def _use_tma(tma: bool | None, k, v, fast: bool) -> bool:
    """Whether the forward moves K/V with TMA: ``tma`` if given (True raises where TMA cannot
    run), else wherever it can, except for problems on the fast path. Their two TMA descriptors
    are encoded at every launch, which costs the host more than the copy engine saves on the
    device at these sizes (page 3.4: 36-42 against 49-66 µs a call at one 128-token sequence)."""
    if tma is None:
        return tma_available(k, v) and not fast
    if tma and not tma_available(k, v):
        raise ValueError("tma=True needs a GPU with TMA (Hopper or newer) and 16-byte-aligned k, v")
    return tma


def _forward(
    q, k, v, causal: bool, sm_scale: float, tma: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, n_q, D = q.shape
    n_kv = k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(B, H, n_q, device=q.device, dtype=torch.float32)
    if o.numel() == 0:
        return o, lse
    tune = _tune_all(B * H, n_q, n_kv)
    fast = _fast(tune)
    use_tma = _use_tma(tma, k, v, fast)
    if fast:
        grid, meta = _fast_fwd(q.shape, causal, use_tma)
    k_src, v_src = k, v
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        # Through the autotuner _set_kv_blocks replaces the block per configuration.
        block = [meta["BLOCK_N"] if fast else 16, D]
        k_src = TensorDescriptor.from_tensor(k.view(B * H * n_kv, D), block)
        v_src = TensorDescriptor.from_tensor(v.view(B * H * n_kv, D), block)
    args = (q, k_src, v_src, o, lse, sm_scale, n_q, n_kv)
    if fast:
        key = (q.dtype, *map(launch.aligned, (q, k, v)), n_q, n_kv, *meta.values())
        _FAST["fwd"](key, grid, args, **meta)
    else:
        meta = {"HEAD_DIM": D, "CAUSAL": causal, "USE_TMA": use_tma, "TUNE": tune}
        _attn_fwd_kernel[lambda m: (cdiv(n_q, m["BLOCK_M"]), B * H)](*args, **meta)
    return o, lse


def _pre_launch(rows: int, head_dim: int, zero_dq: bool) -> tuple[tuple, dict]:
    """The backward's preprocess launch, ``(grid, meta)``: 64 rows of o and dO a program, at every
    size (it is never autotuned)."""
    return (cdiv(rows, 64),), {"HEAD_DIM": head_dim, "BLOCK_M": 64, "ZERO_DQ": zero_dq}


def _fast_fwd(shape, causal: bool, use_tma: bool) -> tuple[tuple, dict]:
    """The forward's launch on the fast path, ``(grid, meta)``: its fixed tile (``_small_tile``,
    the autotuner's own choice for a small problem). ``shape`` is q's, ``[B, H, Nq, D]``."""
    B, H, n_q, D = shape
    bm, bn, warps, stages = _small_tile(tuple(_FWD_TUNED), tuple(_FWD_SMALL), 1, D)
    meta = {"HEAD_DIM": D, "CAUSAL": causal, "USE_TMA": use_tma, "TUNE": False, "BLOCK_M": bm,
            "BLOCK_N": bn, "num_warps": warps, "num_stages": stages}  # fmt: skip
    return (cdiv(n_q, bm), B * H), meta


def _fast_bwd(shape, n_kv: int, causal: bool, atomic: bool, dq_tma: bool) -> dict:
    """The backward's two tiled launches on the fast path, ``{"dkdv" | "dq": (grid, meta)}``. One
    tile serves both: (rows owned, rows a step of the loop, warps, stages), the owned rows keys
    in the dK/dV kernel and queries in the dQ kernel."""
    B, H, n_q, D = shape
    owned, step, warps, stages = _small_tile(tuple(_BWD_TUNED), tuple(_BWD_SMALL), 2, D)
    common = {"HEAD_DIM": D, "CAUSAL": causal, "TUNE": False}
    launch_opts = {"num_warps": warps, "num_stages": stages}
    dkdv = {**common, "ATOMIC_DQ": atomic, "DQ_TMA": dq_tma, "BLOCK_M": step, "BLOCK_N": owned}
    dq = {**common, "BLOCK_M": owned, "BLOCK_N": step}
    return {
        "dkdv": ((cdiv(n_kv, owned), B * H), {**dkdv, **launch_opts}),
        "dq": ((cdiv(n_q, owned), B * H), {**dq, **launch_opts}),
    }


@functools.cache
def _placeholder(dev: torch.device) -> torch.Tensor:
    """One fp32 element per device, kept: an allocation a backward call need not make."""
    return torch.zeros(1, device=dev, dtype=torch.float32)


def _backward(q, k, v, o, lse, do, causal: bool, sm_scale: float, backward: str = "two_kernels"):
    B, H, n_q, D = q.shape
    n_kv = k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0:
        return dq, dk.zero_(), dv.zero_()
    atomic = backward == "atomic_dq"
    delta = torch.empty_like(lse)
    # The fp32 dQ the atomic backward adds into (zeroed by the preprocess); else a one-element
    # placeholder no kernel reads (the autotuner zeroes whatever dq_acc_ptr points to).
    dq_acc = (
        torch.empty(q.shape, device=q.device, dtype=torch.float32)
        if atomic
        else _placeholder(q.device)
    )
    rows = B * H * n_q
    tune = _tune_all(B * H, n_q, n_kv)
    fast = _fast(tune)
    # The layout every launch's key shares (each kernel adds what else it specialises on).
    layout = (q.dtype, *map(launch.aligned, (q, k, v, do)), n_q, n_kv, D, causal)
    grid, meta = _pre_launch(rows, D, atomic)
    _FAST["pre"]((*layout, atomic), grid, (o, do, delta, dq_acc, rows), **meta)
    # On Hopper the dQ adds go out as TMA bulk reductions (a descriptor over dq_acc as rows).
    dq_tma = atomic and tma_available(dq_acc)
    if fast:
        launches = _fast_bwd(q.shape, n_kv, causal, atomic, dq_tma)
    dq_desc = dq_acc
    if dq_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        # One step's query rows; through the autotuner _set_dq_block sets them per configuration.
        block = [launches["dkdv"][1]["BLOCK_M"] if fast else 16, D]
        dq_desc = TensorDescriptor.from_tensor(dq_acc.view(rows, D), block)
    args = (q, k, v, do, lse, delta, dk, dv, dq_acc, dq_desc, sm_scale, n_q, n_kv)
    if fast:
        grid, meta = launches["dkdv"]
        _FAST["dkdv"]((*layout, atomic, dq_tma), grid, args, **meta)
    else:
        meta = {
            "HEAD_DIM": D,
            "CAUSAL": causal,
            "ATOMIC_DQ": atomic,
            "DQ_TMA": dq_tma,
            "TUNE": tune,
        }
        _attn_bwd_dkdv_kernel[lambda m: (cdiv(n_kv, m["BLOCK_N"]), B * H)](*args, **meta)
    if atomic:
        dq.copy_(dq_acc)  # fp32 -> fp16/bf16, one launch
        return dq, dk, dv
    args = (q, k, v, do, lse, delta, dq, sm_scale, n_q, n_kv)
    if fast:
        grid, meta = launches["dq"]
        _FAST["dq"](layout, grid, args, **meta)
    else:
        meta = {"HEAD_DIM": D, "CAUSAL": causal, "TUNE": tune}
        _attn_bwd_dq_kernel[lambda m: (cdiv(n_q, m["BLOCK_M"]), B * H)](*args, **meta)
    return dq, dk, dv


def _cuda_forward(q, k, v, impl: str, tma) -> bool:
    """Whether this forward runs the CUDA kernel of page 4.12 (``kernels.cuda.fa_ws``) instead of
    the Triton one: always with ``impl="cuda"``; with "auto" where it measured faster (its
    ``takes``), unless the caller chose a Triton option (``tma``)."""
    if impl == "triton" or (impl == "auto" and tma is not None):
        return False
    from kernels.cuda import fa_ws

    if impl == "cuda":
        return True  # fa_ws checks the inputs and says what it cannot take
    return fa_ws.takes(q, k, v, fa_ws.FASTER_FROM) and fa_ws.forward_built()


def _cuda_backward(q, k, v, impl: str, backward: str) -> bool:
    """The same choice for the backward (``kernels.cuda.fa_ws_bwd``), made where the forward was
    CUDA's too; "auto" keeps Triton for ``backward="atomic_dq"``, a Triton option."""
    if impl == "triton" or (impl == "auto" and backward != "two_kernels"):
        return False
    from kernels.cuda import fa_ws, fa_ws_bwd

    if impl == "cuda":
        return True
    return fa_ws.takes(q, k, v, fa_ws_bwd.FASTER_FROM) and fa_ws_bwd.built()


def _dispatch_forward(q, k, v, causal: bool, sm_scale: float, tma, impl: str):
    """The forward on the kernel ``impl`` picks: ``(o, lse, whether it was CUDA's)``."""
    if _cuda_forward(q, k, v, impl, tma):
        from kernels.cuda import fa_ws

        return (*fa_ws.attention(q, k, v, causal, sm_scale), True)
    return (*_forward(q, k, v, causal, sm_scale, tma), False)


class FlashAttention(torch.autograd.Function):
    """The autograd node: saves q, k, v, o and the per-row log-sum-exp, never the N x N matrix.
    Both kernels keep the log-sum-exp in the same units (log2), so either backward can follow
    either forward."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        causal: bool,
        sm_scale: float,
        tma: bool | None = None,
        backward="two_kernels",
        impl="auto",
    ):
        o, lse, cuda = _dispatch_forward(q, k, v, causal, sm_scale, tma, impl)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal = causal
        ctx.sm_scale = sm_scale
        ctx.backward_mode = backward
        ctx.cuda_forward, ctx.impl = cuda, impl
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        # Chosen here, not in the forward: a forward without a backward never builds its extension.
        if ctx.cuda_forward and _cuda_backward(q, k, v, ctx.impl, ctx.backward_mode):
            from kernels.cuda import fa_ws_bwd

            dq, dk, dv = fa_ws_bwd.backward(
                q, k, v, o, lse, do.contiguous(), ctx.causal, ctx.sm_scale
            )
        else:
            dq, dk, dv = _backward(
                q, k, v, o, lse, do.contiguous(), ctx.causal, ctx.sm_scale, ctx.backward_mode
            )
        return dq, dk, dv, None, None, None, None, None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
    *,
    tma: bool | None = None,
    backward: str = "two_kernels",
    impl: str = "auto",
) -> torch.Tensor:
    """``softmax(q kᵀ · sm_scale [+ causal mask]) v`` for ``q: [B, H, Nq, D]``, ``k, v: [B, H, Nk, D]``.

    fp16 or bf16, contiguous, head dim 64 or 128; ``sm_scale`` defaults to ``1/sqrt(D)``. With
    ``causal=True`` query i sees keys 0..i (Nq must equal Nk). Differentiable in q, k and v.

    ``impl`` (one of ``IMPLS``): "triton" runs this module's kernels; "cuda" the CUDA kernels of
    page 4.12 (``kernels.cuda.fa_ws`` and ``fa_ws_bwd``: Hopper, bf16, head dim 128, Nq == Nk); "auto"
    takes the CUDA forward from ``fa_ws.FASTER_FROM`` tokens and its backward from
    ``fa_ws_bwd.FASTER_FROM``, where they measured faster, and Triton's elsewhere.
    The Triton kernels' options: ``tma`` moves the forward's K/V tiles with the TMA copy engine
    (Hopper+; the default where it applies, except for problems too small to autotune, whose
    descriptors cost the host more than TMA saves; both paths compute the same thing);
    ``backward``, how the gradient computes dQ, one of ``BACKWARDS`` (the module docstring
    compares them). Under "auto", choosing ``tma`` or ``backward="atomic_dq"`` keeps that pass on
    Triton.
    """
    # The default options at a layout seen before, on a GPU: launched from C++ (kernels.replay).
    replayable = _replayable(causal, sm_scale, tma, backward, impl)
    if replayable:
        o = replay.call(_REPLAY_OPS[causal], q, k, v, replay.scale_setting(sm_scale))
        if o is not None:
            return o
    scale = _check(q, k, v, causal, sm_scale)
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if replayable:
        _plan_native(q, k, v, causal, scale, replay.scale_setting(sm_scale))
    # Autograd's bookkeeping costs microseconds a call: pay it only when a gradient is wanted.
    if replay.wants_grad(q, k, v):
        return FlashAttention.apply(q, k, v, causal, scale, tma, backward, impl)
    return _dispatch_forward(q, k, v, causal, scale, tma, impl)[0]


# ----------------------------------------------------------------------------- the C++ launch path

# Slots of kernels.replay's plans: the inputs, what the forward allocates (the backward gets them
# back as saved tensors), then dO and what the backward allocates.
_Q, _K, _V, _O, _LSE, _DO, _DELTA, _DQ, _DK, _DV = range(10)
_REPLAY_OPS = {False: replay.ATTENTION, True: replay.ATTENTION_CAUSAL}


def _replayable(causal, sm_scale, tma, backward, impl) -> bool:
    """Whether a call may take the C++ path: the default options, and settings C++ keys exactly
    (a bool ``causal``, a scale ``replay.scale_setting`` takes); anything else takes Python's
    path, whose checks name what is wrong."""
    return (
        tma is None
        and backward == "two_kernels"
        and impl == "auto"
        and type(causal) is bool
        and replay.scale_setting(sm_scale) is not None
    )


def _plan_native(q, k, v, causal: bool, scale: float, setting: float) -> None:
    """Give kernels.replay this layout's plan (checked inputs only) where the Python path launches
    fixed tiles through ``_FAST`` in both directions: problems too small to autotune, on the
    Triton kernels (not where "auto" takes the CUDA ones of page 4.12), K/V through pointers."""
    if not replay.planning(q) or _tune_all(q.shape[0] * q.shape[1], q.shape[2], k.shape[2]):
        return
    from kernels.cuda import fa_ws

    # Not where "auto" may take them (the backward follows the forward's kernels): which it does
    # depends on the GPU, nvcc and the environment, none of them in the plan's key.
    if fa_ws.shape_fits(q, k, fa_ws.FASTER_FROM):
        return
    replay.build(_native_plan, q, k, v, causal, scale, setting)


def _native_plan(q, k, v, causal: bool, scale: float, setting: float) -> None:
    """The launches of ``_forward`` and ``_backward`` on the fast path, as a plan."""
    S, A = replay.Slot, replay.Alloc
    B, H, n_q, D = q.shape
    n_kv = k.shape[2]
    slots = [None] * replay.N_SLOTS
    slots[_Q], slots[_K], slots[_V] = q, k, v
    lse_shape = (B, H, n_q)
    fwd_allocs = [
        A(replay.LIKE, _O, _Q),
        A(replay.NEW, _LSE, _Q, dtype=replay.FP32, shape=lse_shape),
    ]
    replay.materialize(fwd_allocs, slots)
    args = (S(_Q), S(_K), S(_V), S(_O), S(_LSE), scale, n_q, n_kv)
    step = replay.compiled_step(
        _attn_fwd_kernel.fn, args, slots, *_fast_fwd(q.shape, causal, False)
    )
    fwd = replay.Program(fwd_allocs, [step])

    slots[_DO] = torch.empty_like(q)  # what the compile sees for dO: fresh, contiguous
    bwd_allocs = [A(replay.NEW, _DELTA, _Q, dtype=replay.FP32, shape=lse_shape),
                  A(replay.LIKE, _DQ, _Q), A(replay.LIKE, _DK, _K), A(replay.LIKE, _DV, _V)]  # fmt: skip
    replay.materialize(bwd_allocs, slots)
    rows = B * H * n_q
    # dq_acc is a pointer no kernel of the two-kernel backward reads: the lse slot will do.
    args = (S(_O), S(_DO), S(_DELTA), S(_LSE), rows)
    pre = _attn_bwd_preprocess_kernel
    steps = [replay.compiled_step(pre, args, slots, *_pre_launch(rows, D, False))]
    launches = _fast_bwd(q.shape, n_kv, causal, False, False)
    args = (S(_Q), S(_K), S(_V), S(_DO), S(_LSE), S(_DELTA), S(_DK), S(_DV), S(_LSE), S(_LSE),
            scale, n_q, n_kv)  # fmt: skip
    steps.append(replay.compiled_step(_attn_bwd_dkdv_kernel.fn, args, slots, *launches["dkdv"]))
    args = (S(_Q), S(_K), S(_V), S(_DO), S(_LSE), S(_DELTA), S(_DQ), scale, n_q, n_kv)
    steps.append(replay.compiled_step(_attn_bwd_dq_kernel.fn, args, slots, *launches["dq"]))
    bwd = replay.Program(bwd_allocs, steps)
    op = _REPLAY_OPS[causal]
    replay.add(op, q, k, v, setting, fwd, fwd, bwd, _O, _DO, [_Q, _K, _V, _O, _LSE],
               [_DQ, _DK, _DV])  # fmt: skip


def attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward only, returning also the natural-log log-sum-exp of each row's scaled scores,
    ``lse: fp32[B, H, Nq]`` (what the backward keeps instead of the N x N probabilities)."""
    scale = _check(q, k, v, causal, sm_scale)
    o, lse2 = _forward(q, k, v, causal, scale, tma=False)
    return o, lse2 / LOG2E


# ----------------------------------------------------------------------------- references


def _causal_mask(n_q: int, n_kv: int, dev) -> torch.Tensor:
    """True where a score is hidden: key j after query i."""
    return torch.ones(n_q, n_kv, dtype=torch.bool, device=dev).triu_(1)


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """fp32 reference (returned in fp32, for error measurements). Differentiable: call it on
    ``x.float().requires_grad_()`` copies to get reference gradients."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(_causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return torch.softmax(s, dim=-1) @ v.float()


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Textbook attention in the inputs' dtype that materialises the scores, for teaching.

    Three kernels and two ``[B, H, Nq, Nk]`` tensors in HBM: the scores S = q kᵀ (scaled and masked
    in place) and the probabilities P = softmax(S), alive together while softmax runs; then P v.
    Its extra memory is ``naive_extra_bytes``.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = torch.matmul(q, k.transpose(-2, -1))
    s.mul_(scale)
    if causal:
        s.masked_fill_(_causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    p = torch.softmax(s, dim=-1)
    del s
    return torch.matmul(p, v)


def naive_extra_bytes(
    batch: int, heads: int, n_q: int, n_kv: int, head_dim: int, dtype: torch.dtype, causal=False
) -> int:
    """Peak memory ``naive_attention`` allocates beyond its inputs: S and P alive together while
    softmax runs, or afterwards P and the output, whichever is larger (the causal mask, one byte per
    score of one head, is freed before P is allocated and never sets the peak)."""
    b = dtype.itemsize
    scores = batch * heads * n_q * n_kv * b
    out = batch * heads * n_q * head_dim * b
    return max(2 * scores, scores + out, scores + (n_q * n_kv if causal else 0))


def naive_hbm_bytes(
    batch: int, heads: int, n_q: int, n_kv: int, head_dim: int, dtype: torch.dtype, causal=False
) -> int:
    """HBM traffic of ``naive_attention``: q, k, v read and o written once, plus the score-sized
    passes: S written, scaled in place (read + write), masked in place if causal (read + write),
    read by softmax, P written, P read by P·v. Six passes over ``[B, H, Nq, Nk]``, eight if causal."""
    b = dtype.itemsize
    passes = 8 if causal else 6
    return passes * batch * heads * n_q * n_kv * b + 2 * batch * heads * (n_q + n_kv) * head_dim * b


def flash_hbm_bytes(
    batch: int, heads: int, n_q: int, n_kv: int, head_dim: int, dtype: torch.dtype
) -> int:
    """The fewest bytes fused attention can move: q, k, v read once, o written once (the lse is
    negligible). The kernel reads k and v once per query tile, but mostly from L2."""
    return 2 * batch * heads * (n_q + n_kv) * head_dim * dtype.itemsize


def flash_extra_bytes(batch: int, heads: int, n_q: int, head_dim: int, dtype: torch.dtype) -> int:
    """Memory ``attention`` allocates beyond its inputs: the output and one fp32 per query row."""
    return batch * heads * n_q * (head_dim * dtype.itemsize + 4)


def fwd_flops(batch: int, heads: int, n_q: int, n_kv: int, head_dim: int, causal=False) -> float:
    """Two matmuls, q kᵀ and P v, of 2·Nq·Nk·D each per head; causal does half."""
    return 4 * batch * heads * n_q * n_kv * head_dim * (0.5 if causal else 1.0)


def bwd_flops(batch: int, heads: int, n_q: int, n_kv: int, head_dim: int, causal=False) -> float:
    """Five matmuls (S again, dV, dP, dQ, dK): 2.5 times the forward, the usual convention."""
    return 2.5 * fwd_flops(batch, heads, n_q, n_kv, head_dim, causal)


# ----------------------------------------------------------------------------- SDPA baselines

# The SDPA helpers live in kernels.sdpa; these names stay here for the notebooks that use them.
SDPA_BACKENDS = _sdpa.SDPA_BACKENDS
sdpa_backend = _sdpa.sdpa_backend


def sdpa(q, k, v, causal: bool = False, backend: str = "flash") -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` forced onto one backend
    (``kernels.sdpa.sdpa``)."""
    return _sdpa.sdpa(q, k, v, causal, backend)


def sdpa_available(backend: str, dtype: torch.dtype = torch.bfloat16, head_dim: int = 128) -> bool:
    """Whether ``sdpa(..., backend=backend)`` runs on this machine for this dtype and head dim."""
    return _sdpa.available(backend, dtype, head_dim)


# ----------------------------------------------------------------------------- compile check

# Ahead-of-time compile specs (tests/test_compile.py). bf16 needs Ampere (8.0) tensor cores; the
# sm_75 build uses fp16 and tiles small enough for Turing's 64 KB of shared memory.
_SIZES = {"sm_scale": "fp32", "N_Q": "i32", "N_KV": "i32"}


def _dkdv_signature(ptr: str, dq_desc: str) -> dict:
    """The dK/dV kernel's run-time arguments: ``ptr`` the 16-bit tensors' type, ``dq_desc`` the
    dQ descriptor's (a pointer where it is unused, a tensor descriptor with DQ_TMA)."""
    return {
        **{name: ptr for name in ("q_ptr", "k_ptr", "v_ptr", "do_ptr")},
        "lse_ptr": "*fp32",
        "delta_ptr": "*fp32",
        "dk_ptr": ptr,
        "dv_ptr": ptr,
        "dq_acc_ptr": "*fp32",
        "dq_desc": dq_desc,
        **_SIZES,
    }


def _specs(t: str, tiles: dict, options: dict, min_cc: int) -> list[dict]:
    fwd_tiles = {"BLOCK_M": tiles["fwd"][0], "BLOCK_N": tiles["fwd"][1]}
    dkdv_tiles = {"BLOCK_N": tiles["bwd"][0], "BLOCK_M": tiles["bwd"][1]}
    dq_tiles = {"BLOCK_M": tiles["bwd"][0], "BLOCK_N": tiles["bwd"][1]}
    d = tiles["head_dim"]
    ptr = f"*{t}"
    out = []
    for causal in (False, True):
        meta = {"HEAD_DIM": d, "CAUSAL": causal, "TUNE": False}
        out += [
            dict(
                kernel=_attn_fwd_kernel.fn,
                signature={
                    "q_ptr": ptr,
                    "k_src": ptr,
                    "v_src": ptr,
                    "o_ptr": ptr,
                    "lse_ptr": "*fp32",
                    **_SIZES,
                },  # fmt: skip
                constexprs={**meta, "USE_TMA": False, **fwd_tiles},
                options=options,
                min_cc=min_cc,
            ),
            *[
                dict(
                    kernel=_attn_bwd_dkdv_kernel.fn,
                    signature=_dkdv_signature(ptr, "*fp32"),
                    constexprs={**meta, "ATOMIC_DQ": atomic, "DQ_TMA": False, **dkdv_tiles},
                    options=options,
                    min_cc=min_cc,
                )
                for atomic in (False, True)
            ],
            dict(
                kernel=_attn_bwd_dq_kernel.fn,
                signature={
                    "q_ptr": ptr,
                    "k_ptr": ptr,
                    "v_ptr": ptr,
                    "do_ptr": ptr,
                    "lse_ptr": "*fp32",
                    "delta_ptr": "*fp32",
                    "dq_ptr": ptr,
                    **_SIZES,
                },  # fmt: skip
                constexprs={**meta, **dq_tiles},
                options=options,
                min_cc=min_cc,
            ),
        ]
    out.append(
        dict(
            kernel=_attn_bwd_preprocess_kernel,
            signature={
                "o_ptr": ptr,
                "do_ptr": ptr,
                "delta_ptr": "*fp32",
                "dq_acc_ptr": "*fp32",
                "n_rows": "i32",
            },
            constexprs={"HEAD_DIM": d, "BLOCK_M": 64, "ZERO_DQ": True},
            min_cc=min_cc,
        )
    )
    return out


def _tma_spec(causal: bool) -> dict:
    desc = "tensordesc<bf16[64, 128]>"
    return dict(
        kernel=_attn_fwd_kernel.fn,
        signature={
            "q_ptr": "*bf16",
            "k_src": desc,
            "v_src": desc,
            "o_ptr": "*bf16",
            "lse_ptr": "*fp32",
            **_SIZES,
        },  # fmt: skip
        constexprs={
            "HEAD_DIM": 128,
            "CAUSAL": causal,
            "USE_TMA": True,
            "TUNE": False,
            "BLOCK_M": 128,
            "BLOCK_N": 64,
        },  # fmt: skip
        options={"num_warps": 8, "num_stages": 3},
        min_cc=90,  # TMA exists from Hopper on
    )


def _dq_tma_spec(causal: bool) -> dict:
    """The atomic backward's dK/dV kernel with dQ reduced through a TMA descriptor (Hopper)."""
    return dict(
        kernel=_attn_bwd_dkdv_kernel.fn,
        signature=_dkdv_signature("*bf16", "tensordesc<fp32[64, 128]>"),
        constexprs={
            "HEAD_DIM": 128,
            "CAUSAL": causal,
            "ATOMIC_DQ": True,
            "DQ_TMA": True,
            "TUNE": False,
            "BLOCK_N": 128,
            "BLOCK_M": 64,
        },  # fmt: skip
        options={"num_warps": 8, "num_stages": 3},
        min_cc=90,
    )


# The TMA-reduce build once, causal (its code is the non-causal one's plus the diagonal's).
COMPILE_SPECS = [_tma_spec(False), _tma_spec(True), _dq_tma_spec(True)] + _specs(
    "fp16", {"fwd": (64, 32), "bwd": (64, 32), "head_dim": 64}, {"num_warps": 4, "num_stages": 2}, 0
) + _specs(
    "bf16", {"fwd": (128, 64), "bwd": (128, 32), "head_dim": 128},
    {"num_warps": 8, "num_stages": 3}, 90,
)  # fmt: skip


# ----------------------------------------------------------------------------- benchmark


IMPLEMENTATIONS = {
    "triton": functools.partial(attention, impl="triton"),
    "triton-pointers": functools.partial(attention, tma=False, impl="triton"),
    "cuda": functools.partial(attention, impl="cuda"),  # Hopper, bf16, head dim 128: page 4.12
    "naive": naive_attention,
    **{f"sdpa-{b}": functools.partial(sdpa, backend=b) for b in SDPA_BACKENDS},
}


def _grads(o, inputs, do):
    # autograd.grad, not .backward(): nothing accumulates into .grad between timed repetitions.
    return torch.autograd.grad(o, inputs, do, retain_graph=True)


def time_case(
    shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    causal: bool,
    impls: list[str],
    *,
    backward: bool = False,
) -> dict[str, bench.Measurement]:
    """Time each of ``impls`` (keys of ``IMPLEMENTATIONS``) on one ``[B, H, N, D]`` self-attention
    problem, all on the same random inputs: the forward, or with ``backward=True`` the backward
    alone (the forward runs once outside the timed region). TFLOP/s use ``fwd_flops`` /
    ``bwd_flops``, the same count for every implementation."""
    b, h, n, d = shape
    q, k, v, do = (torch.randn(shape, device=device.DEVICE, dtype=dtype) for _ in range(4))
    flops = (bwd_flops if backward else fwd_flops)(b, h, n, n, d, causal)
    out = {}
    for name in impls:
        fn = IMPLEMENTATIONS[name]
        if backward:
            qkv = tuple(t.clone().requires_grad_() for t in (q, k, v))
            run = functools.partial(_grads, fn(*qkv, causal), qkv, do)
        else:
            run = functools.partial(fn, q, k, v, causal)
        out[name] = bench.measure(run, flops=flops)
    return out


@bench.register("flash_attention")
def _bench_flash_attention(quick: bool) -> list[dict]:
    """Forward and backward against SDPA's FlashAttention-2 backend (and cuDNN's where present),
    bf16, head dim 128, 16 heads, Nq = Nk = N with B·N = 16k tokens; ceiling: the bf16 matmul peak."""
    if not device.GPU_MODE:
        print("flash_attention benchmark skipped: tensor-core timings need a GPU")
        return []
    dtype = device.preferred_dtype(torch.bfloat16)
    peak = roofline.matmul_peak("bfloat16" if dtype is torch.bfloat16 else "float16")
    ceiling = (peak.name, peak.value)
    heads, head_dim = 16, 128
    seqs = [4096] if quick else [512, 1024, 2048, 4096, 8192, 16384]
    impls = ["triton"] + [f"sdpa-{b}" for b in ("flash", "cudnn") if sdpa_available(b, dtype)]
    recs = []
    for n in seqs:
        shape = (max(1, 16384 // n), heads, n, head_dim)
        for causal in (False, True):
            for backward in (False, True):
                ms = time_case(shape, dtype, causal, impls, backward=backward)
                tag = ("-bwd" if backward else "-fwd") + ("-causal" if causal else "")
                base = ("sdpa-flash", ms["sdpa-flash"]) if "sdpa-flash" in ms else None
                for name, m in ms.items():
                    baseline = base if name == "triton" else None
                    recs.append(bench.record("flash_attention", name + tag, shape, dtype, m,
                                             baseline=baseline, ceiling=ceiling))  # fmt: skip
    return recs
