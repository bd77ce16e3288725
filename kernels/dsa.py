"""DeepSeek sparse attention (DSA, DeepSeek-V3.2-Exp): a lightning indexer, a top-k, and MLA
attention over only the selected tokens.

At long context, MLA decode reads every cached row of 576 values for every new token. DSA reads
instead a much smaller *index key* per token (``d_I = 128`` values, in FP8: 128 bytes against MLA's
1,152), scores every earlier token with it, keeps the ``k = 2048`` best and runs MLA attention on
those only. Three steps, three functions:

1. ``lightning_indexer``: ``I[t, s] = Σ_j w[t, j] · ReLU(q_I[t, j] · k_I[s])`` for ``H_I = 64``
   index heads of ``d_I = 128``; one key per token shared by every index head (so, like MLA's
   cache, one stream that all heads read together: the heads are the M dimension of the dot),
   stored paged with the attention cache's block table: ``k_idx_cache: [num_blocks, block_size,
   d_I]``. Causal: ``I[t, s] = -inf`` for ``s > position[t]``. Inputs FP8 e4m3 where the GPU has
   FP8 (``indexer_dtype``), bf16 on other GPUs, fp32 in the interpreter; scores in fp32.
2. ``topk_indices``: the ``k`` best tokens per query (a radix select, ``kernels.topk``), ``-1``
   where the context holds fewer than ``k``.
3. ``sparse_mla``: MLA attention (``kernels.mla``'s absorbed form) of each query over its own
   ``k`` indices, gathering the latent rows inside the kernel: token index -> block table ->
   physical row. Decode (one query per sequence) and prefill (a chunk of ``T`` queries per
   sequence) are the same kernel: a program is one query and a block of heads.

``dsa_decode`` and ``dsa_prefill`` chain the three. The references (``lightning_indexer_ref``,
``sparse_mla_ref``: dense attention under the top-k mask) compute in fp32. The cost-model helpers
(``indexer_bytes`` … ``crossover_context``) compare DSA's O(L·d_I) index read plus O(k·(r +
d_rope)) attention read with dense MLA's O(L·(r + d_rope)).

Why a one-key-per-token indexer scales: its score for a query costs ``2·H_I·d_I = 16K`` FLOPs and
``d_I`` bytes per earlier token, against MLA's ``2·H·(2r + d_rope) ≈ 279K`` FLOPs and 1,152 bytes:
DSA keeps the O(L) term but shrinks its constant ~9x in bytes (FP8 keys) and ~17x in FLOPs.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import triton
import triton.language as tl

from kernels import _validate, bench, device, launch, mla, paged_attention, roofline, sdpa
from kernels.launch import cdiv, next_power_of_2
from kernels.mla import _attend_tile, _store_partial
from kernels.topk import topk_ids

INDEX_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)

# DeepSeek-V3.2-Exp's indexer: 64 heads of 128, top-2048.
DEEPSEEK_V32 = dict(n_idx_heads=64, d_idx=128, topk=2048)

# ----------------------------------------------------------------------------- configurations

# Indexer tiles (BLOCK_T, BLOCK_S, num_warps, num_stages): BLOCK_T queries x H_I heads are the M
# rows of one dot against BLOCK_S keys. Decode has one query (BLOCK_T = 1: M = 64 rows); in
# prefill BLOCK_T = 2-4 gives M = 128-256 and reads each key tile once per BLOCK_T queries.
_INDEXER_CONFIGS = [  # no register spills in ptxas's report (sm_90, fp8, H_I = 64, d_I = 128)
    (1, 64, 4, 3),
    (1, 128, 8, 3),
    (2, 64, 8, 3),
    (2, 128, 8, 3),
    (4, 64, 8, 3),
    (4, 32, 8, 4),
]
_INDEXER_INTERPRETER_CONFIG = (2, 32, 4, 1)  # BLOCK_T = 2: decode tests exercise the query mask


def _indexer_configs():
    shapes = [_INDEXER_INTERPRETER_CONFIG] if device.INTERPRET else _INDEXER_CONFIGS
    return [
        triton.Config({"BLOCK_T": t, "BLOCK_S": s}, num_warps=w, num_stages=st)
        for t, s, w, st in shapes
    ]


# ----------------------------------------------------------------------------- kernels


@triton.autotune(
    configs=_indexer_configs(),
    key=["queries_bucket", "ctx_bucket", "N_HEADS", "D", "PAGE_SIZE"],
    do_bench=functools.partial(triton.testing.do_bench, warmup=10, rep=40),
)
@triton.jit(do_not_specialize=["queries_bucket", "ctx_bucket", "n_queries", "n_ctx", "num_blocks"])
def _indexer_kernel(
    # pointers: q [B, T, N_HEADS, D]; k [num_blocks, PAGE, D]; w fp32 [B, T, N_HEADS];
    # block_table int32 [B, max_blocks]; positions int32 [B, T]; out fp32 [B, T, n_ctx]
    q_ptr,
    k_ptr,
    w_ptr,
    block_table_ptr,
    pos_ptr,
    out_ptr,
    # sizes
    queries_bucket,  # (the buckets only key the autotuner)
    ctx_bucket,
    n_queries,
    n_ctx,
    num_blocks,
    max_tokens,  # the block table's capacity: a position at or past it answers NaN
    # strides (elements)
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_wb,
    stride_wt,
    stride_bt,
    stride_pb,
    stride_ob,
    stride_ot,
    # meta-parameters
    N_HEADS: tl.constexpr,
    D: tl.constexpr,
    H_PAD: tl.constexpr,  # N_HEADS and D rounded up to powers of two >= 16
    D_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    FP32_EXACT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # One program: BLOCK_T queries of one sequence against BLOCK_S consecutive keys. It reads
    # BLOCK_S * D key values once for BLOCK_T * N_HEADS dot rows and writes BLOCK_T * BLOCK_S
    # fp32 scores.
    seq = tl.program_id(0)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    toks = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)
    t_ok = offs_t < n_queries
    pos = tl.load(pos_ptr + seq.to(tl.int64) * stride_pb + offs_t, mask=t_ok, other=-1)
    bad_t = pos >= max_tokens  # would walk past the block table's row: NaN for that query
    pos = tl.where(bad_t, -1, pos)
    last = tl.max(pos, 0)  # the latest key any query of this tile may see

    scores = tl.full([BLOCK_T, BLOCK_S], float("-inf"), dtype=tl.float32)
    n_bad = tl.full([], 0, tl.int32)
    # Key tiles wholly in the future of every query here are skipped: half the work of a causal
    # prefill chunk's diagonal, and every tile of the padding past a short sequence.
    if tl.program_id(2) * BLOCK_S <= last:
        tok_ok = toks <= last
        block = tl.load(
            block_table_ptr + seq.to(tl.int64) * stride_bt + toks // PAGE_SIZE,
            mask=tok_ok,
            other=0,
        )
        block_ok = (block >= 0) & (block < num_blocks)
        n_bad = tl.sum((tok_ok & ~block_ok).to(tl.int32), 0)
        rows = block.to(tl.int64) * stride_kb + (toks % PAGE_SIZE) * stride_kt
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < D
        k = tl.load(
            k_ptr + rows[:, None] + offs_d[None, :],
            mask=(tok_ok & block_ok)[:, None] & d_ok[None, :],
            other=0.0,
        )
        # The M rows of the dot: query t0 + m // H_PAD, index head m % H_PAD (padding rows 0).
        offs_m = tl.arange(0, BLOCK_T * H_PAD)
        t = tl.program_id(1) * BLOCK_T + offs_m // H_PAD
        h = offs_m % H_PAD
        m_ok = (t < n_queries) & (h < N_HEADS)
        q_off = seq.to(tl.int64) * stride_qb + t.to(tl.int64) * stride_qt + h * stride_qh
        q = tl.load(
            q_ptr + q_off[:, None] + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0
        )
        if FP32_EXACT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # fp8 / bf16 operands, fp32 accumulation
        w = tl.load(w_ptr + seq.to(tl.int64) * stride_wb + t * stride_wt + h, mask=m_ok, other=0.0)
        # ReLU, weight per (query, head), then the sum over heads: [BLOCK_T, BLOCK_S].
        s = tl.maximum(s, 0.0) * w[:, None]
        idx = tl.sum(tl.reshape(s, [BLOCK_T, H_PAD, BLOCK_S]), 1)
        scores = tl.where(toks[None, :] <= pos[:, None], idx, float("-inf"))
    scores = tl.where(bad_t[:, None] | (n_bad > 0), float("nan"), scores)
    out_off = seq.to(tl.int64) * stride_ob + offs_t[:, None].to(tl.int64) * stride_ot
    tl.store(
        out_ptr + out_off + toks[None, :],
        scores,
        mask=t_ok[:, None] & (toks < n_ctx)[None, :],
    )


@triton.autotune(
    configs=mla._configs(),
    key=["rows_bucket", "n_idx", "num_splits", "n_heads", "R", "ROPE", "PAGE_SIZE"],
    do_bench=functools.partial(triton.testing.do_bench, warmup=10, rep=40),
)
@triton.jit(
    do_not_specialize=["rows_bucket", "num_splits", "n_queries", "num_blocks", "max_tokens"]
)
def _sparse_mla_kernel(
    # pointers: q_latent [B*T, H, R]; q_rope [B*T, H, ROPE]; kv [num_blocks, PAGE, R + ROPE];
    # block_table int32 [B, max_blocks]; indices int32 [B*T, n_idx] (token ids, -1 = none);
    # out [B*T, H, R] (DIRECT) or partials fp32 [B*T, H, num_splits, R] + lse [B*T, H, splits]
    q_lat_ptr,
    q_rope_ptr,
    kv_ptr,
    block_table_ptr,
    idx_ptr,
    out_ptr,
    lse_ptr,
    # scalars and sizes
    sm_scale,
    rows_bucket,  # (keys the autotuner: a power of two of B*T)
    num_splits,
    n_heads,
    n_queries,  # T: queries per sequence (row q_row belongs to sequence q_row // T)
    n_idx,  # k: indices per query
    num_blocks,
    max_tokens,  # the block table's capacity: an index at or past it answers NaN
    # strides (elements)
    stride_qrow,
    stride_qh,
    stride_prow,
    stride_ph,
    stride_kb,
    stride_kt,
    stride_bt,
    stride_irow,
    stride_orow,
    stride_oh,
    stride_osplit,
    # meta-parameters
    R: tl.constexpr,
    ROPE: tl.constexpr,
    R_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DIRECT: tl.constexpr,
    FP32_EXACT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # mla_decode's program with one change: the BLOCK_N tokens of a tile are not consecutive
    # positions but BLOCK_N entries of this query's index list. Each index goes through the
    # block table to a physical row, so a tile gathers BLOCK_N scattered 576-wide rows.
    # The grid as mla_decode's: axis 0 = (query, head block), head blocks adjacent; axis 1 = split.
    n_head_blocks = tl.cdiv(n_heads, BLOCK_H)
    q_row = (tl.program_id(0) // n_head_blocks).to(tl.int64)
    head_block = tl.program_id(0) % n_head_blocks
    split = tl.program_id(1)
    seq = q_row // n_queries
    chunk = tl.cdiv(tl.cdiv(n_idx, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_idx)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < n_heads
    offs_r = tl.arange(0, R_PAD)
    offs_p = tl.arange(0, ROPE_PAD)
    q_lat = tl.load(
        q_lat_ptr + q_row * stride_qrow + heads[:, None] * stride_qh + offs_r[None, :],
        mask=head_ok[:, None] & (offs_r < R)[None, :],
        other=0.0,
    )
    q_rope = tl.load(
        q_rope_ptr + q_row * stride_prow + heads[:, None] * stride_ph + offs_p[None, :],
        mask=head_ok[:, None] & (offs_p < ROPE)[None, :],
        other=0.0,
    )
    qk_scale = sm_scale * 1.4426950408889634  # log2(e), launch.LOG2E

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, R_PAD], dtype=tl.float32)
    n_bad = tl.full([], 0, tl.int32)

    bt_row = block_table_ptr + seq * stride_bt
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        tok = tl.load(idx_ptr + q_row * stride_irow + j, mask=j_ok, other=-1)
        # -1 marks "no token" (a context shorter than k): skipped. Anything else outside
        # [0, max_tokens) is an error: never dereferenced, the query answers NaN.
        in_table = (tok >= 0) & (tok < max_tokens)
        n_bad += tl.sum((j_ok & (tok != -1) & ~in_table).to(tl.int32), 0)
        block = tl.load(bt_row + tok // PAGE_SIZE, mask=in_table, other=0)
        block_ok = (block >= 0) & (block < num_blocks)
        n_bad += tl.sum((in_table & ~block_ok).to(tl.int32), 0)
        rows = block.to(tl.int64) * stride_kb + (tok % PAGE_SIZE) * stride_kt
        m_i, l_i, acc = _attend_tile(
            q_lat, q_rope, kv_ptr, rows, in_table & block_ok, m_i, l_i, acc, qk_scale,
            R, ROPE, R_PAD, ROPE_PAD, FP32_EXACT,
        )  # fmt: skip

    _store_partial(
        out_ptr, lse_ptr, acc, m_i, l_i, n_bad, q_row, heads, head_ok, n_heads,
        num_splits, split, stride_orow, stride_oh, stride_osplit, R, R_PAD, DIRECT,
    )  # fmt: skip


# ----------------------------------------------------------------------------- launchers


def indexer_dtype() -> torch.dtype:
    """The dtype of the indexer's q and k on this device: FP8 e4m3 where the GPU has FP8 tensor
    cores (``device.capabilities().fp8``), bf16 on other GPUs, fp32 in the interpreter (whose
    bf16 and fp8 arithmetic is wrong)."""
    if not device.GPU_MODE:
        return torch.float32
    if device.capabilities().fp8:
        return torch.float8_e4m3fn
    return device.preferred_dtype(torch.bfloat16)


def _check_int_tensor(name: str, t, ndim: int, shape: tuple, dev) -> None:
    _validate.tensor(name, t, dtypes=(torch.int32,), ndim=ndim)
    if tuple(t.shape) != tuple(shape) or t.device != dev:
        raise ValueError(
            f"{name} must have shape {tuple(shape)} on {dev}, got {tuple(t.shape)} on {t.device}"
        )


def lightning_indexer(
    q_idx: torch.Tensor,
    k_idx_cache: torch.Tensor,
    w: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    n_ctx: int | None = None,
    *,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Index scores ``I[b, t, s] = Σ_j w[b, t, j] · ReLU(q_idx[b, t, j] · k_idx[b, s])``.

    ``q_idx: [B, T, H_I, d_I]`` (contiguous; ``T = 1`` at decode), ``k_idx_cache: [num_blocks,
    block_size, d_I]`` (one key per token, paged with ``block_table: int32 [B, max_blocks]``, the
    attention cache's table), both fp8 e4m3 (GPUs with FP8 only), bf16, fp16 or fp32
    (``indexer_dtype`` picks); ``w: fp32 [B, T, H_I]`` (DeepSeek folds the softmax scale and
    ``H_I^-1/2`` into it; a per-token FP8 scale of q is positive and folds in too: ReLU(a·x) =
    a·ReLU(x) for a > 0). ``positions: int32 [B, T]``: query ``t`` sees tokens ``0 …
    positions[b, t]`` (decode: ``seq_len - 1``; -1 sees none). Returns fp32 ``[B, T, n_ctx]``,
    ``-inf`` past each query's position; ``n_ctx`` defaults to the table's capacity. Positions
    and block ids are checked on the CPU and in debug mode; otherwise a bad one gives NaN.
    ``config = (BLOCK_T, BLOCK_S, num_warps, num_stages)`` skips the autotuner."""
    _validate.tensor("q_idx", q_idx, dtypes=INDEX_DTYPES, ndim=4)
    _validate.tensor("k_idx_cache", k_idx_cache, dtypes=INDEX_DTYPES, ndim=3)
    _validate.same("q_idx", q_idx, "k_idx_cache", k_idx_cache, shape=False)
    if q_idx.dtype == torch.float8_e4m3fn and not (device.GPU_MODE and device.capabilities().fp8):
        raise TypeError(
            "q_idx in float8_e4m3fn needs a GPU with FP8 tensor cores (Ada, Hopper or newer); "
            "use indexer_dtype()"
        )
    n_seqs, n_queries, n_heads, d = q_idx.shape
    num_blocks, page, d_k = k_idx_cache.shape
    if d_k != d:
        raise ValueError(
            f"k_idx_cache must be [num_blocks, block_size, d_I] with q_idx's d_I = {d}, got "
            f"shape {tuple(k_idx_cache.shape)}"
        )
    _validate.positive_power_of_two("block_size (k_idx_cache.shape[1])", page)
    _validate.tensor("w", w, dtypes=(torch.float32,), ndim=3)
    if tuple(w.shape) != (n_seqs, n_queries, n_heads) or w.device != q_idx.device:
        raise ValueError(
            f"w must be [B, T, H_I] = {(n_seqs, n_queries, n_heads)} on {q_idx.device}, got "
            f"{tuple(w.shape)} on {w.device}"
        )
    _validate.tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2)
    if block_table.shape[0] != n_seqs or block_table.device != q_idx.device:
        raise ValueError(
            f"block_table needs one row per sequence ({n_seqs}) on {q_idx.device}, got shape "
            f"{tuple(block_table.shape)} on {block_table.device}"
        )
    _check_int_tensor("positions", positions, 2, (n_seqs, n_queries), q_idx.device)
    capacity = block_table.shape[1] * page
    if n_ctx is None:
        n_ctx = capacity
    if isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or not 0 <= n_ctx <= capacity:
        raise ValueError(
            f"n_ctx must be an int in [0, the block table's capacity {capacity}], got {n_ctx!r}"
        )
    mla.check_config(config, ("BLOCK_T", "BLOCK_S"), min_first=1)
    # The grid's y and z axes (query tiles, key tiles) hold at most 65,535 programs on a GPU
    # (the interpreter has no limit): the smallest tiles the autotuner may pick set the bound.
    max_t, max_s = 65535 * (config[0] if config else 1), 65535 * (config[1] if config else 32)
    if n_queries > max_t or n_ctx > max_s:
        raise ValueError(
            f"q_idx holds {n_queries} queries per sequence and n_ctx is {n_ctx}: one call takes "
            f"at most {max_t} queries (split them, as dsa_prefill does) and {max_s} keys"
        )
    if device.GPU_MODE and not q_idx.is_cuda:
        raise ValueError(f"q_idx must be on a CUDA device, got {q_idx.device}")
    if _validate.check_values(block_table, positions) and positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < -1 or hi >= n_ctx:
            raise ValueError(
                f"positions must lie in [-1, n_ctx - 1 = {n_ctx - 1}], got values in [{lo}, {hi}]"
            )
        # A sequence reads its keys up to its last position: that length's blocks (the length
        # itself is within the capacity, since hi < n_ctx).
        paged_attention.check_lengths_and_blocks(
            block_table, positions.amax(1) + 1, num_blocks, page, pool="k_idx_cache"
        )

    out = torch.empty(n_seqs, n_queries, n_ctx, device=q_idx.device, dtype=torch.float32)
    if out.numel() == 0:
        return out
    args = (
        q_idx, k_idx_cache, w, block_table, positions, out,
        next_power_of_2(n_queries), next_power_of_2(n_ctx), n_queries, n_ctx, num_blocks,
        capacity,
        q_idx.stride(0), q_idx.stride(1), q_idx.stride(2),
        k_idx_cache.stride(0), k_idx_cache.stride(1),
        w.stride(0), w.stride(1), block_table.stride(0), positions.stride(0),
        out.stride(0), out.stride(1),
    )  # fmt: skip
    # tl.dot's reduction is D_PAD wide: at least 16, and 32 for fp8 operands (the compiler
    # rejects an fp8 dot with K < 32); the padding columns load zeros.
    d_pad = max(mla._dot_pad(d), 32 if q_idx.dtype == torch.float8_e4m3fn else 16)
    meta = dict(
        N_HEADS=n_heads, D=d, H_PAD=mla._dot_pad(n_heads), D_PAD=d_pad,
        PAGE_SIZE=page, FP32_EXACT=q_idx.dtype == torch.float32,
    )  # fmt: skip
    if config is None:

        def grid(m):
            return (n_seqs, cdiv(n_queries, m["BLOCK_T"]), cdiv(n_ctx, m["BLOCK_S"]))

        launch.tuned(_indexer_kernel)(grid, args, **meta)
    else:
        bt, bs, nw, ns = config
        grid = (n_seqs, cdiv(n_queries, bt), cdiv(n_ctx, bs))
        launch.tuned(_indexer_kernel).fixed(
            grid, args, **meta, BLOCK_T=bt, BLOCK_S=bs, num_warps=nw, num_stages=ns
        )
    return out


def topk_indices(
    scores: torch.Tensor, k: int, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """The ``k`` highest-scoring token ids per query: ``scores: fp32 [B, T, n_ctx]`` ->
    ``int32 [B, T, k]`` (in ascending id order), ``-1`` wherever the query sees fewer than ``k``
    tokens (ids past ``positions[b, t]``, or with ``positions=None`` ids whose score is -inf).

    A radix select in seven launches (``kernels.topk``): four 8-bit histogram passes find the k-th
    largest score of each row, then a count pass and a write pass pack the ids above it, chunk by
    chunk. It reads the ``n_ctx`` scores six times (4 bytes per token each, against the indexer's
    d_I-byte key and MLA's 1,152 bytes). ``torch.topk`` did the same work in about twenty launches per call, and on
    an H100 (Lab 6c, batch 8, k = 2048) took 178 us at 64K tokens and 228 us at 128K in the run
    page 6.4 cites (87 and 100 us in an earlier one), more than the indexer."""
    _validate.tensor("scores", scores, dtypes=(torch.float32,), ndim=3)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    b, t, n_ctx = scores.shape
    flat_pos = None
    if positions is not None:
        _check_int_tensor("positions", positions, 2, scores.shape[:2], scores.device)
        flat_pos = positions.reshape(b * t)
    ids = topk_ids(scores.reshape(b * t, n_ctx).contiguous(), k, flat_pos)
    return ids.view(b, t, k)


def sparse_mla(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float | None = None,
    *,
    num_splits: int | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """MLA attention of every query over its own list of tokens.

    ``q_latent: [B, T, H, r]``, ``q_rope: [B, T, H, d_rope]`` (``[B, H, ·]`` for decode: then
    T = 1 and the output is ``[B, H, r]``); ``kv_cache: [num_blocks, block_size, r + d_rope]`` and
    ``block_table: int32 [B, max_blocks]`` as for ``mla.mla_decode``; ``indices: int32 [B, T,
    k]``: token ids in ``[0, max_blocks * block_size)`` (distinct per query: a repeated id counts
    twice), ``-1`` for none (skipped; a query with none gets zeros). The ids come from
    ``topk_indices``, which keeps them causal: this function attends to whatever it is given.
    ``num_splits`` cuts each query's list into that many parts merged like ``mla_decode``'s
    (default from the number of queries and the SM count: several at decode, one in prefill).
    Returns the latent output ``[B, T, H, r]`` in q's dtype."""
    decode = isinstance(q_latent, torch.Tensor) and q_latent.ndim == 3
    if decode:
        if not isinstance(q_rope, torch.Tensor) or q_rope.ndim != 3:
            raise ValueError("q_rope must be 3-D like q_latent")
        if isinstance(indices, torch.Tensor) and indices.ndim == 2:
            indices = indices[:, None]
        q_latent, q_rope = q_latent[:, None], q_rope[:, None]
    if not isinstance(q_latent, torch.Tensor) or q_latent.ndim != 4:
        raise ValueError(
            "q_latent must be 4-D [B, T, H, r] (or 3-D [B, H, r] for decode), got "
            f"{getattr(q_latent, 'shape', type(q_latent).__name__)}"
        )
    n_seqs, n_queries, n_heads, _ = q_latent.shape
    r, d_rope, page = mla.check_latent_inputs(q_latent, q_rope, kv_cache, block_table, n_seqs)
    _validate.tensor("indices", indices, dtypes=(torch.int32,), ndim=3)
    if tuple(indices.shape[:2]) != (n_seqs, n_queries) or indices.device != q_latent.device:
        raise ValueError(
            f"indices must be [B, T, k] with B, T = {n_seqs}, {n_queries} on {q_latent.device}, "
            f"got {tuple(indices.shape)} on {indices.device}"
        )
    mla.check_num_splits(num_splits)
    mla.check_config(config)
    scale = _validate.sm_scale(sm_scale, r + d_rope)
    capacity = block_table.shape[1] * page
    n_idx = indices.shape[2]
    if _validate.check_values(block_table, indices) and indices.numel():
        lo, hi = int(indices.min()), int(indices.max())
        if lo < -1 or hi >= capacity:
            raise ValueError(
                f"indices must be -1 or token ids in [0, the block table's capacity {capacity}), "
                f"got values in [{lo}, {hi}]"
            )
        used = torch.zeros(block_table.shape, dtype=torch.bool, device=block_table.device)
        flat = indices.reshape(n_seqs, -1).long()
        ok = flat >= 0
        rows = torch.arange(n_seqs, device=flat.device)[:, None].expand_as(flat)
        used[rows[ok], flat[ok] // page] = True
        paged_attention.check_block_ids(block_table, used, kv_cache.shape[0], pool="kv_cache")

    n_rows = n_seqs * n_queries
    out = torch.empty(n_seqs, n_queries, n_heads, r, device=q_latent.device, dtype=q_latent.dtype)
    if out.numel() == 0 or n_idx == 0:
        out.zero_()
        return out[:, 0] if decode else out
    q_lat = q_latent.reshape(n_rows, n_heads, r)
    q_rp = q_rope.reshape(n_rows, n_heads, d_rope)
    idx = indices.reshape(n_rows, n_idx)
    splits = num_splits or mla.default_num_splits(n_rows, n_idx)
    o_dst, lse, stride_osplit = mla.split_outputs(out.view(n_rows, n_heads, r), splits)
    args = (
        q_lat, q_rp, kv_cache, block_table, idx, o_dst, lse,
        scale, next_power_of_2(n_rows), splits, n_heads, n_queries, n_idx,
        kv_cache.shape[0], capacity,
        q_lat.stride(0), q_lat.stride(1), q_rp.stride(0), q_rp.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0), idx.stride(0),
        o_dst.stride(0), o_dst.stride(1), stride_osplit,
    )  # fmt: skip
    mla.launch_attention(
        _sparse_mla_kernel, n_rows, n_heads, splits, config, args,
        R=r, ROPE=d_rope, R_PAD=mla._dot_pad(r), ROPE_PAD=mla._dot_pad(d_rope),
        PAGE_SIZE=page, DIRECT=splits == 1, FP32_EXACT=q_latent.dtype == torch.float32,
    )  # fmt: skip
    if splits > 1:
        mla.combine(o_dst, lse, out)
    return out[:, 0] if decode else out


def dsa_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx_cache: torch.Tensor,
    w: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int = 2048,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """One DSA decode step: indexer -> top-k -> sparse MLA. ``q_latent: [B, H, r]``, ``q_rope:
    [B, H, d_rope]``, ``q_idx: [B, H_I, d_I]``, ``w: fp32 [B, H_I]``; the caches share
    ``block_table``; sequence ``b``'s new token sees its ``seq_lens[b]`` cached tokens. Returns
    ``o_lat: [B, H, r]``."""
    positions = (seq_lens - 1)[:, None].contiguous()
    q_i, w_i = q_idx[:, None].contiguous(), w[:, None].contiguous()  # tiny: B x H_I x d_I
    scores = lightning_indexer(q_i, k_idx_cache, w_i, block_table, positions)
    indices = topk_indices(scores, topk, positions)
    return sparse_mla(q_latent, q_rope, kv_cache, block_table, indices[:, 0], sm_scale)


def dsa_prefill(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx_cache: torch.Tensor,
    w: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    topk: int = 2048,
    sm_scale: float | None = None,
    *,
    query_chunk: int = 2048,
) -> torch.Tensor:
    """DSA over a chunk of ``T`` queries per sequence (their keys already in the caches):
    ``q_latent: [B, T, H, r]``, ``q_idx: [B, T, H_I, d_I]``, ``w: [B, T, H_I]``, ``positions:
    int32 [B, T]``. The indexer's fp32 scores are ``[B, T, n_ctx]`` (4 GiB for 16K queries at 64K
    context), so indexer + top-k run ``query_chunk`` queries at a time; the sparse attention
    then runs over the whole chunk. Returns ``[B, T, H, r]``."""
    n_ctx = None
    if positions.numel():
        n_ctx = min(block_table.shape[1] * kv_cache.shape[1], int(positions.max()) + 1)
    parts = []
    for t0 in range(0, q_idx.shape[1], query_chunk):
        sl = slice(t0, t0 + query_chunk)
        pos = positions[:, sl].contiguous()
        scores = lightning_indexer(
            q_idx[:, sl].contiguous(), k_idx_cache, w[:, sl].contiguous(), block_table, pos, n_ctx
        )
        parts.append(topk_indices(scores, topk, pos))
        del scores
    indices = torch.cat(parts, 1) if parts else positions.new_full((*positions.shape, topk), -1)
    return sparse_mla(q_latent, q_rope, kv_cache, block_table, indices, sm_scale)


# ----------------------------------------------------------------------------- references


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """``mla.gather_latent`` with the table's ids clamped into the pool: references gather whole
    rows of the table, including entries no sequence uses (their tokens are masked anyway)."""
    table = block_table.clamp(0, cache.shape[0] - 1)
    return mla.gather_latent(cache, table, length)


def lightning_indexer_ref(
    q_idx: torch.Tensor,
    k_idx_cache: torch.Tensor,
    w: torch.Tensor,
    block_table: torch.Tensor,
    positions: torch.Tensor,
    n_ctx: int | None = None,
) -> torch.Tensor:
    """fp32 reference of ``lightning_indexer`` over the gathered keys."""
    n_ctx = block_table.shape[1] * k_idx_cache.shape[1] if n_ctx is None else n_ctx
    k = _gather(k_idx_cache, block_table, n_ctx).float()  # [B, n_ctx, d_I]
    s = torch.relu(torch.einsum("bthd,bsd->bths", q_idx.float(), k))
    scores = torch.einsum("bths,bth->bts", s, w.float())
    future = torch.arange(n_ctx, device=scores.device) > positions[..., None]
    return scores.masked_fill(future, float("-inf"))


def sparse_mla_ref(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """fp32 reference: dense MLA attention over the whole gathered cache under the mask "token is
    one of this query's indices". Accepts the decode (3-D) and prefill (4-D) layouts."""
    decode = q_latent.ndim == 3
    if decode:
        q_latent, q_rope = q_latent[:, None], q_rope[:, None]
        indices = indices[:, None] if indices.ndim == 2 else indices
    r = q_latent.shape[-1]
    scale = 1.0 / math.sqrt(kv_cache.shape[2]) if sm_scale is None else sm_scale
    length = block_table.shape[1] * kv_cache.shape[1]
    kv = _gather(kv_cache, block_table, length).float()  # [B, L, r + d_rope]
    q = torch.cat([q_latent, q_rope], -1).float()  # [B, T, H, r + d_rope]
    s = torch.einsum("bthw,blw->bthl", q, kv) * scale
    keep = torch.zeros(*indices.shape[:2], length + 1, dtype=torch.bool, device=s.device)
    keep.scatter_(2, torch.where(indices >= 0, indices, length).long(), True)  # -1 -> a spare
    keep = keep[..., :length]
    p = torch.softmax(s.masked_fill(~keep[:, :, None], float("-inf")), -1).nan_to_num(0.0)
    out = torch.einsum("bthl,blr->bthr", p, kv[..., :r])
    return out[:, 0] if decode else out


# ----------------------------------------------------------------------------- cost model


def indexer_bytes(
    context: int, n_queries: int = 1, d_idx: int = 128, key_bytes: int = 1, n_idx_heads: int = 64
) -> int:
    """Bytes the indexer moves for ``n_queries`` queries of one sequence over ``context`` keys:
    the keys once (a tile of queries shares them), the queries, and the fp32 scores out."""
    return context * d_idx * key_bytes + n_queries * (n_idx_heads * d_idx * key_bytes + 4 * context)


def indexer_flops(context: int, n_queries: int = 1, n_idx_heads: int = 64, d_idx: int = 128) -> int:
    """FLOPs of the indexer: a dot of d_I per (query, index head, key): O(L·H_I·d_I) per query."""
    return 2 * n_queries * context * n_idx_heads * d_idx


def sparse_mla_bytes(
    topk: int,
    n_queries: int = 1,
    n_heads: int = 128,
    r: int = 512,
    d_rope: int = 64,
    dtype_bytes: int = 2,
) -> int:
    """Bytes of sparse MLA attention: ``topk`` cache rows per query (an upper bound in prefill,
    where neighbouring queries share rows), the queries and the outputs."""
    per_query = topk * (r + d_rope) + n_heads * (2 * r + d_rope)
    return n_queries * (per_query * dtype_bytes + 4 * topk)  # + the int32 indices


def sparse_mla_flops(
    topk: int, n_queries: int = 1, n_heads: int = 128, r: int = 512, d_rope: int = 64
) -> int:
    """FLOPs of sparse MLA attention: MLA's per-token work on ``topk`` tokens per query."""
    return mla.mla_decode_flops(n_queries, topk, n_heads, r, d_rope)


def prefill_flops(
    chunk: int,
    context: int,
    topk: int = 2048,
    n_heads: int = 128,
    r: int = 512,
    d_rope: int = 64,
    n_idx_heads: int = 64,
    d_idx: int = 128,
) -> tuple[int, int]:
    """FLOPs of a chunk of ``chunk`` queries at the end of a ``context``-token sequence, as
    ``(dense, dsa)``: dense causal attention in the non-absorbed form (per-head keys of d_nope +
    d_rope and values of d_v, d_nope = d_v = min(128, r)) over every causal pair, and DSA (the
    indexer over every causal pair, sparse MLA over ``topk`` rows per query)."""
    # Causal pairs: query t (position context - chunk + t) sees context - chunk + t + 1 keys.
    pairs = chunk * (context - chunk) + chunk * (chunk + 1) // 2
    d_nope = d_v = min(128, r)
    dense = 2 * n_heads * pairs * (d_nope + d_rope + d_v)
    indexer = 2 * pairs * n_idx_heads * d_idx
    return dense, indexer + sparse_mla_flops(topk, chunk, n_heads, r, d_rope)


def decode_stage_costs(
    context: int,
    batch: int,
    *,
    topk: int = 2048,
    key_bytes: int = 1,
    dtype_bytes: int = 2,
    n_heads: int = 128,
    r: int = 512,
    d_rope: int = 64,
    n_idx_heads: int = 64,
    d_idx: int = 128,
) -> dict[str, tuple[int, int]]:
    """``(bytes, FLOPs)`` of each stage of one decode step for ``batch`` sequences of ``context``
    tokens: the ``indexer``, the ``topk`` (reads the fp32 scores, writes the int32 ids), ``sparse``
    MLA over ``min(topk, context)`` rows, and ``dense`` MLA decode over the whole context."""
    k_eff = min(topk, context)
    return {
        "indexer": (
            batch * indexer_bytes(context, 1, d_idx, key_bytes, n_idx_heads),
            batch * indexer_flops(context, 1, n_idx_heads, d_idx),
        ),
        "topk": (batch * (4 * context + 4 * topk), 0),
        "sparse": (
            batch * sparse_mla_bytes(k_eff, 1, n_heads, r, d_rope, dtype_bytes),
            batch * sparse_mla_flops(k_eff, 1, n_heads, r, d_rope),
        ),
        "dense": (
            mla.mla_decode_bytes(batch, context, n_heads, r, d_rope, dtype_bytes),
            mla.mla_decode_flops(batch, context, n_heads, r, d_rope),
        ),
    }


def dsa_decode_time_s(
    context: int,
    batch: int,
    bandwidth_gbps: float,
    tflops_bf16: float,
    tflops_index: float | None = None,
    *,
    topk: int = 2048,
    key_bytes: int = 1,
    n_heads: int = 128,
    r: int = 512,
    d_rope: int = 64,
    n_idx_heads: int = 64,
    d_idx: int = 128,
) -> dict[str, float]:
    """Roofline times (seconds) of one decode step per stage, each max(bytes / bandwidth, FLOPs /
    peak): the indexer (at ``tflops_index``, the FP8 peak, default the bf16 one), the top-k (reads
    the scores), sparse MLA, their ``dsa`` total, and ``dense`` MLA decode over the whole context
    (the counts of ``decode_stage_costs``, in bf16)."""
    idx_peak = tflops_index or tflops_bf16
    cost = decode_stage_costs(context, batch, topk=topk, key_bytes=key_bytes, n_heads=n_heads,
                              r=r, d_rope=d_rope, n_idx_heads=n_idx_heads, d_idx=d_idx)  # fmt: skip
    t = {
        stage: mla.roof_time_s(
            nbytes, flops, bandwidth_gbps, idx_peak if stage == "indexer" else tflops_bf16
        )[0]
        for stage, (nbytes, flops) in cost.items()
    }
    t["dsa"] = t["indexer"] + t["topk"] + t["sparse"]
    return {k: t[k] for k in ("indexer", "topk", "sparse", "dsa", "dense")}


def crossover_context(
    bandwidth_gbps: float, tflops_bf16: float, tflops_index: float | None = None, **kw
) -> int:
    """The shortest context at which the DSA decode step's roofline time beats dense MLA decode
    (the cost model of ``dsa_decode_time_s``; batch cancels out). Found by bisection: DSA's cost
    grows with a smaller slope in L than dense's, so the difference changes sign once."""

    def wins(ctx):
        t = dsa_decode_time_s(ctx, 1, bandwidth_gbps, tflops_bf16, tflops_index, **kw)
        return t["dsa"] < t["dense"]

    lo, hi = 1, 1 << 24
    if not wins(hi):
        raise ValueError("DSA never beats dense MLA decode under 16M tokens with these figures")
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid) else (mid + 1, hi)
    return lo


# ----------------------------------------------------------------------------- test data


def dsa_case(
    seq_lens,
    n_heads: int,
    r: int,
    d_rope: int,
    n_idx_heads: int,
    d_idx: int,
    *,
    n_queries: int = 1,
    block_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    idx_dtype: torch.dtype | None = None,
    seed: int = 0,
    exact_table: bool = False,
    dev=None,
):
    """Random inputs of a DSA step over sequences of ``seq_lens`` cached tokens, with the last
    ``n_queries`` tokens of each as the queries (decode: 1). Returns a dict with ``q_latent,
    q_rope`` ``[B, T, H, ·]``, ``kv_cache``, ``q_idx [B, T, H_I, d_I]``, ``k_idx_cache``, ``w``,
    ``block_table`` (``exact_table``: as ``mla.decode_case``'s), ``seq_lens``,
    ``positions [B, T]`` (``seq_len - T + t``; -1 … for a sequence shorter than T)."""
    dev = dev or device.DEVICE
    idx_dtype = idx_dtype or dtype
    q_lat, _, kv, table, lens = mla.decode_case(
        seq_lens, n_heads, r, d_rope, block_size=block_size, dtype=dtype, seed=seed,
        exact_table=exact_table, dev=dev,
    )  # fmt: skip
    n = len(seq_lens)
    q_lat = mla.randn(n, n_queries, n_heads, r, dtype=dtype, seed=seed + 11, dev=dev)
    q_rope = mla.randn(n, n_queries, n_heads, d_rope, dtype=dtype, seed=seed + 12, dev=dev)
    q_idx = mla.randn(n, n_queries, n_idx_heads, d_idx, dtype=idx_dtype, seed=seed + 13, dev=dev)
    k_idx = mla.randn(kv.shape[0], block_size, d_idx, dtype=idx_dtype, seed=seed + 14, dev=dev)
    w = mla.randn(n, n_queries, n_idx_heads, dtype=torch.float32, seed=seed + 15, dev=dev)
    w /= math.sqrt(n_idx_heads * d_idx)
    pos = lens.cpu()[:, None] - n_queries + torch.arange(n_queries)[None, :]
    return dict(
        q_latent=q_lat,
        q_rope=q_rope,
        kv_cache=kv,
        q_idx=q_idx,
        k_idx_cache=k_idx,
        w=w,
        block_table=table,
        seq_lens=lens,
        positions=pos.clamp_min(-1).to(torch.int32).to(dev),
    )


# ----------------------------------------------------------------------------- compile check

_INDEXER_SIZES = {
    n: "i32"
    for n in (
        "queries_bucket", "ctx_bucket", "n_queries", "n_ctx", "num_blocks", "max_tokens",
        "stride_qb", "stride_qt", "stride_qh", "stride_kb", "stride_kt", "stride_wb",
        "stride_wt", "stride_bt", "stride_pb", "stride_ob", "stride_ot",
    )
}  # fmt: skip


def _indexer_spec(t: str, block_t: int, min_cc: int) -> dict:
    return dict(
        kernel=_indexer_kernel.fn,
        signature={
            "q_ptr": f"*{t}",
            "k_ptr": f"*{t}",
            "w_ptr": "*fp32",
            "block_table_ptr": "*i32",
            "pos_ptr": "*i32",
            "out_ptr": "*fp32",
            **_INDEXER_SIZES,
        },
        constexprs={
            "N_HEADS": 64,
            "D": 128,
            "H_PAD": 64,
            "D_PAD": 128,
            "PAGE_SIZE": 64,
            "FP32_EXACT": t == "fp32",
            "BLOCK_T": block_t,
            "BLOCK_S": 64,
        },
        options={"num_warps": 4 if block_t == 1 else 8, "num_stages": 3},
        min_cc=min_cc,
    )


_SPARSE_SIZES = {
    n: "i32"
    for n in (
        "rows_bucket", "num_splits", "n_heads", "n_queries", "n_idx", "num_blocks", "max_tokens",
        "stride_qrow", "stride_qh", "stride_prow", "stride_ph", "stride_kb", "stride_kt",
        "stride_bt", "stride_irow", "stride_orow", "stride_oh", "stride_osplit",
    )
}  # fmt: skip


def _sparse_spec(t: str, splits: int, min_cc: int, block_h: int = 32, warps: int = 8) -> dict:
    return mla._attention_spec(
        _sparse_mla_kernel, _SPARSE_SIZES, "idx_ptr", t, splits, min_cc, block_h, warps
    )


# fp8 dots need Ada/Hopper (8.9+); bf16 Ampere; Turing builds the fp16 variants.
COMPILE_SPECS = [
    _indexer_spec("fp8e4nv", 1, 90),
    _indexer_spec("fp8e4nv", 4, 90),
    _indexer_spec("bf16", 2, 80),
    _indexer_spec("fp16", 1, 0),
    _sparse_spec("bf16", 4, 80),
    _sparse_spec("bf16", 1, 80, block_h=64),
    _sparse_spec("fp16", 1, 0, block_h=16, warps=4),
]


# ----------------------------------------------------------------------------- benchmark


def _decode_records(batch, context, topk, shapes, dtype, copy, peak, idx_peak) -> list[dict]:
    h, r, dr, hi, di = shapes
    idx_dtype = indexer_dtype()
    c = dsa_case([context] * batch, h, r, dr, hi, di, dtype=dtype, idx_dtype=idx_dtype,
                 exact_table=True)  # fmt: skip
    q_lat, q_rope = c["q_latent"][:, 0], c["q_rope"][:, 0]
    q_idx, w = c["q_idx"][:, 0], c["w"][:, 0]
    kv, kidx, table, lens = c["kv_cache"], c["k_idx_cache"], c["block_table"], c["seq_lens"]
    pos = c["positions"]
    kb = idx_dtype.itemsize
    shape = [batch, context, topk, h, r, dr, hi, di]
    cost = decode_stage_costs(context, batch, topk=topk, key_bytes=kb, dtype_bytes=dtype.itemsize,
                              n_heads=h, r=r, d_rope=dr, n_idx_heads=hi, d_idx=di)  # fmt: skip
    (dense_b, dense_f), (i_b, i_f), (s_b, s_f) = cost["dense"], cost["indexer"], cost["sparse"]
    t_b = cost["topk"][0]
    idx_peak_name = "matmul_fp8" if idx_dtype == torch.float8_e4m3fn else "matmul_bf16"

    dense = bench.measure(lambda: mla.mla_decode(q_lat, q_rope, kv, table, lens), bytes=dense_b)
    full = bench.measure(
        lambda: dsa_decode(q_lat, q_rope, kv, q_idx, kidx, w, table, lens, topk),
        bytes=i_b + t_b + s_b,
    )
    scores = lightning_indexer(c["q_idx"], kidx, c["w"], table, pos)
    indices = topk_indices(scores, topk, pos)
    m_idx = bench.measure(
        lambda: lightning_indexer(c["q_idx"], kidx, c["w"], table, pos), bytes=i_b
    )
    m_top = bench.measure(lambda: topk_indices(scores, topk, pos), bytes=t_b)
    m_sp = bench.measure(lambda: sparse_mla(q_lat, q_rope, kv, table, indices[:, 0]), bytes=s_b)
    t = dsa_decode_time_s(context, batch, copy, peak, idx_peak, topk=topk, key_bytes=kb,
                          n_heads=h, r=r, d_rope=dr, n_idx_heads=hi, d_idx=di)  # fmt: skip
    return [
        bench.record("dsa", "decode-dsa", shape, dtype, full, baseline=("mla_decode-dense", dense),
                     ceiling=("roof:model", (i_b + t_b + s_b) / t["dsa"] / 1e9)),
        bench.record("dsa", "decode-dense-mla", shape, dtype, dense,
                     ceiling=mla._roof(dense_b, dense_f, copy, peak, "matmul_bf16")),
        bench.record("dsa", "decode-indexer", shape, str(idx_dtype), m_idx,
                     ceiling=mla._roof(i_b, i_f, copy, idx_peak, idx_peak_name)),
        bench.record("dsa", "decode-topk", shape, "float32", m_top, ceiling=("copy", copy)),
        bench.record("dsa", "decode-sparse-mla", shape, dtype, m_sp,
                     ceiling=mla._roof(s_b, s_f, copy, peak, "matmul_bf16")),
    ]  # fmt: skip


def _dense_causal_prefill(chunk, context, h, d_qk, d_v, dtype, flops):
    """Time SDPA over a chunk of ``chunk`` queries at the end of ``context`` keys, causal
    (bottom-right aligned), with per-head keys and values already expanded (freed on return).
    Returns (backend, Measurement), or (None, None) if no fused backend takes the call: each is
    forced in turn, so that a decline raises instead of falling back to the math backend, whose
    [H, chunk, context] score matrix would not fit (128 x 16K x 64K)."""
    from torch.nn.attention.bias import causal_lower_right

    g = torch.Generator(device=device.DEVICE).manual_seed(2)
    q = torch.randn(1, h, chunk, d_qk, device=device.DEVICE, dtype=dtype, generator=g)
    k = torch.randn(1, h, context, d_qk, device=device.DEVICE, dtype=dtype, generator=g)
    v = torch.randn(1, h, context, d_v, device=device.DEVICE, dtype=dtype, generator=g)
    bias = causal_lower_right(chunk, context)
    backends = ("efficient", "flash", "cudnn") + (() if device.GPU_MODE else ("math",))
    for backend in backends:

        def run(b=backend):
            return sdpa.sdpa(q, k, v, backend=b, attn_mask=bias)

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                run()
        except (RuntimeError, NotImplementedError):
            continue
        return backend, bench.measure(run, flops=flops)
    return None, None


def _prefill_records(chunk, context, topk, shapes, dtype, copy, peak) -> list[dict]:
    """A chunk of ``chunk`` queries at the end of a ``context``-token sequence: DSA against dense
    causal attention in the non-absorbed form (SDPA over per-head keys of d_nope + d_rope = 192
    and values of 128, expanded beforehand: not timed, in the baseline's favour)."""
    h, r, dr, hi, di = shapes
    shape = [1, chunk, context, topk, h, r, dr, hi, di]
    d_nope, d_v = min(128, r), min(128, r)
    dense_f, f = prefill_flops(chunk, context, topk, h, r, dr, hi, di)
    backend, dense = _dense_causal_prefill(chunk, context, h, d_nope + dr, d_v, dtype, dense_f)
    c = dsa_case([context], h, r, dr, hi, di, n_queries=chunk, dtype=dtype,
                 idx_dtype=indexer_dtype(), exact_table=True)  # fmt: skip
    keys = ("q_latent", "q_rope", "kv_cache", "q_idx", "k_idx_cache", "w", "block_table")
    args = [c[n] for n in keys] + [c["positions"]]
    full = bench.measure(lambda: dsa_prefill(*args, topk), flops=f)
    if dense is None:
        print("dsa prefill: no fused SDPA backend takes a bottom-right causal mask here")
        return [
            bench.record("dsa", "prefill-dsa", shape, dtype, full, ceiling=("matmul_bf16", peak))
        ]
    base = f"sdpa-{backend}-dense-causal"
    return [
        bench.record("dsa", "prefill-dsa", shape, dtype, full,
                     baseline=(base, dense), ceiling=("matmul_bf16", peak)),
        bench.record("dsa", f"prefill-{base}", shape, dtype, dense,
                     ceiling=("matmul_bf16", peak)),
    ]  # fmt: skip


@bench.register("dsa")
def _bench_dsa(quick: bool) -> list[dict]:
    """DSA decode (indexer + top-k + sparse MLA) against dense MLA decode over the whole context,
    each stage against its roof; DSA prefill of a chunk against dense causal SDPA."""
    dtype = device.preferred_dtype(torch.bfloat16)
    copy = roofline.copy_bandwidth().value
    peak = roofline.matmul_peak("bfloat16").value
    if not device.GPU_MODE:  # the interpreter: tiny shapes through every code path
        shapes = (16, 32, 16, 4, 16)
        recs = _decode_records(2, 128, 32, shapes, torch.float32, copy, peak, peak)
        return recs + _prefill_records(8, 64, 16, shapes, torch.float32, copy, peak)
    idx_peak = roofline.fp8_matmul_peak().value if device.capabilities().fp8 else peak
    shapes = (128, 512, 64, 64, 128)
    recs = []
    for context in [65536] if quick else [65536, 131072]:
        recs += _decode_records(8, context, 2048, shapes, dtype, copy, peak, idx_peak)
        torch.cuda.empty_cache()
    recs += _prefill_records(4096 if quick else 16384, 65536, 2048, shapes, dtype, copy, peak)
    return recs
