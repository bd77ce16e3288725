"""Multi-head latent attention (MLA) decode over a paged latent cache, as in DeepSeek-V2/V3.

**The cache.** MLA caches, per token and per layer, one *latent* ``c_kv`` of rank ``r`` (512 in
DeepSeek-V2/V3) and one rotary key ``k_rope`` of ``d_rope`` (64) shared by every head: 576 values,
1,152 bytes in bf16, where multi-head attention with DeepSeek-V3's 128 heads of 192 (key) + 128
(value) would cache 40,960 values. Here the two parts are concatenated per token and paged like any
KV cache: ``kv_cache: [num_blocks, block_size, r + d_rope]`` with a block table mapping each
sequence's logical blocks to physical ones (``kernels.paged_attention`` explains paging).

**Absorption.** Keys and values of head ``h`` are up-projections of the latent:
``k_nope[h] = W_UK[h] c`` and ``v[h] = W_UV[h]ᵀ c`` (in this module's layout ``W_UK[h]: [d_nope, r]``,
``W_UV[h]: [r, d_v]``). A score is ``q_nope · (W_UK[h] c) + q_rope · k_rope = (q_nope W_UK[h]) · c +
q_rope · k_rope``: multiply the query by ``W_UK[h]`` once (``q_latent``, ``r`` wide) and the keys
never need expanding. Likewise ``Σ_s p_s v_s[h] = (Σ_s p_s c_s) W_UV[h]``: attend over the latents
(``o_lat``, ``r`` wide) and project once afterwards. Attention becomes multi-query attention whose
single KV stream is the cache itself: keys are whole 576-wide rows, values their first 512 columns.
``absorb`` reshapes the checkpoint's up-projection weights into that form (a one-time step);
``AbsorbedMLA.query`` and ``.output`` do the two per-step products.

**The kernel.** ``mla_decode(q_latent, q_rope, kv_cache, block_table, seq_lens)`` is one query token
per sequence, ``H`` heads. All heads read the same cache rows, so the heads are the M dimension of
the matrix multiply, as in FlashMLA: a program takes ``BLOCK_H`` heads of one sequence and one split
of its context and reads each of its cache rows once for all of them. Every token costs ``2·H·(r +
d_rope) + 2·H·r`` FLOPs for ``(r + d_rope) · 2`` bytes: with 128 heads about 240 FLOP per byte,
close to an H100's ridge point, so tiles must keep both the tensor cores and the memory busy.
Split-K over the context (flash-decoding): each split writes a normalised partial output and its
log-sum-exp, and ``_mla_combine_kernel`` merges them; the split count comes from the batch size and
the SM count (``default_num_splits``), never from the values of ``seq_lens``, so a decode step can
be captured in a CUDA graph.

**References and baselines.** ``mla_decode_ref`` gathers the cache and computes in fp32.
``mla_decode_eager`` is the absorbed form a user would write in PyTorch (gather, two matmuls, a
softmax); ``mla_decode_naive`` re-expands the latents into per-head keys and values and calls SDPA,
the form of the model's definition. ``mla_decode_bytes`` / ``mla_decode_flops`` and the
``*_cache_bytes_per_token`` helpers are the napkin math of page 6.4.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import _validate, bench, device, launch, paged_attention, roofline
from kernels.launch import Launcher, call_key, cdiv, next_power_of_2, sm_count

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# DeepSeek-V2/V3 attention shapes (the configs of both models): kv_lora_rank, qk_rope_head_dim,
# num_attention_heads, qk_nope_head_dim, v_head_dim.
DEEPSEEK_V3 = dict(r=512, d_rope=64, n_heads=128, d_nope=128, d_v=128)

# ----------------------------------------------------------------------------- configurations

# (BLOCK_H, BLOCK_N, num_warps, num_stages). The fp32 accumulator is BLOCK_H x r and the latent
# queries stay resident beside it, so registers bind: at BLOCK_H = 64 over 8 warps a 16-token tile
# takes 210 registers a thread and no spills, a 64-token one all 255 and spills (Nsight Compute,
# H100; the caches absorb the spills: the cache is still read from DRAM once), and either way one
# program fills an SM. The 16-token program is latency-bound (12% of DRAM bandwidth and 16% of
# the tensor pipe at batch 128, 32k tokens; results/profiles/), so what pays is more work per
# loop trip: 64-token tiles ran batch 128 x 32k in 7.1 ms against 11.8 ms for 16-token ones (the
# profile call's tile sweep). Sixteen warps
# lost to eight at every tile. Smaller head blocks re-read each row once per head block: the grid
# puts a row's head blocks next to each other so that those re-reads come from L2; they win at
# batch 1, where 128 heads / 32 gives more programs. A 64-row tile of 576 bf16 values is 72 KB,
# so two stages fit in shared memory. The interpreter runs one config only (multi-config
# autotuning fails there).
_CONFIGS = [
    (64, 64, 8, 2),
    (64, 32, 8, 3),
    (64, 32, 8, 2),
    (32, 64, 8, 2),
    (32, 32, 8, 2),
    (16, 32, 8, 2),
    (16, 16, 4, 2),
    (64, 16, 8, 2),
]
_INTERPRETER_CONFIG = (16, 32, 4, 1)


def _configs():
    shapes = [_INTERPRETER_CONFIG] if device.INTERPRET else _CONFIGS
    return [
        triton.Config({"BLOCK_H": h, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for h, n, w, s in shapes
    ]


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _attend_tile(
    q_lat,  # [BLOCK_H, R_PAD] this program's latent queries
    q_rope,  # [BLOCK_H, ROPE_PAD] and rotary queries
    kv_ptr,
    rows,  # int64 [BLOCK_N]: element offset of each token's cache row
    ok,  # [BLOCK_N]: which tokens take part (others load zeros and score -inf)
    m_i,
    l_i,
    acc,
    qk_scale,  # sm_scale * log2(e): the softmax runs in base 2
    R: tl.constexpr,
    ROPE: tl.constexpr,
    R_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    FP32_EXACT: tl.constexpr,
):
    """One tile of MLA attention, shared by mla_decode and sparse_mla: scores of BLOCK_H heads
    against BLOCK_N cache rows, then the online-softmax update of (m_i, l_i, acc)."""
    offs_r = tl.arange(0, R_PAD)
    offs_p = tl.arange(0, ROPE_PAD)
    # Each row is read once for every head of the block: the latent part serves as key AND value.
    k_lat = tl.load(
        kv_ptr + rows[:, None] + offs_r[None, :],
        mask=ok[:, None] & (offs_r < R)[None, :],
        other=0.0,
    )
    k_rope = tl.load(
        kv_ptr + rows[:, None] + R + offs_p[None, :],
        mask=ok[:, None] & (offs_p < ROPE)[None, :],
        other=0.0,
    )
    # Score = q_latent . c + q_rope . k_rope: two dots into one fp32 accumulator.
    if FP32_EXACT:
        s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
        s = tl.dot(q_rope, tl.trans(k_rope), s, input_precision="ieee")
    else:
        s = tl.dot(q_lat, tl.trans(k_lat))
        s = tl.dot(q_rope, tl.trans(k_rope), s)
    s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A tile with no valid token (sparse attention's -1 indices) leaves m at -inf: subtract 0
    # instead, so that p = 0 and alpha = 0 or 1 rather than NaN from -inf - -inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if FP32_EXACT:
        acc = tl.dot(p, k_lat, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(k_lat.dtype), k_lat, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _store_partial(
    out_ptr,
    lse_ptr,
    acc,
    m_i,
    l_i,
    n_bad,
    q_row,  # int64: the query this program answers (a sequence, or a (sequence, token) pair)
    heads,
    head_ok,
    n_heads,
    num_splits,
    split,
    stride_orow,
    stride_oh,
    stride_osplit,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    DIRECT: tl.constexpr,
):
    """Write the normalised output of one program: the final answer (one split) or a partial one
    and its base-2 log-sum-exp for the combine kernel."""
    offs_r = tl.arange(0, R_PAD)
    # An empty range leaves l = 0: the partial output is 0 and its log-sum-exp -inf (weight 0).
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    o = tl.where(n_bad > 0, float("nan"), o)  # NaN survives the merge: 0 * NaN is NaN
    o_off = q_row * stride_orow + heads[:, None] * stride_oh + offs_r[None, :]
    mask = head_ok[:, None] & (offs_r < R)[None, :]
    if DIRECT:
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + o_off + split * stride_osplit, o, mask=mask)
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + (q_row * n_heads + heads) * num_splits + split, lse, mask=head_ok)


@triton.autotune(
    configs=_configs(),
    key=["seqs_bucket", "tokens_bucket", "num_splits", "n_heads", "R", "ROPE", "PAGE_SIZE"],
    do_bench=functools.partial(triton.testing.do_bench, warmup=10, rep=40),
)
@triton.jit(
    do_not_specialize=["seqs_bucket", "tokens_bucket", "num_splits", "num_blocks", "max_tokens"]
)
def _mla_decode_kernel(
    # pointers: q_latent [B, H, R]; q_rope [B, H, ROPE]; kv [num_blocks, PAGE, R + ROPE];
    # block_table int32 [B, max_blocks]; seq_lens int32 [B]; out [B, H, R] (DIRECT) or the
    # partial outputs fp32 [B, H, num_splits, R] with lse fp32 [B, H, num_splits]
    q_lat_ptr,
    q_rope_ptr,
    kv_ptr,
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    # scalars and sizes
    sm_scale,
    seqs_bucket,  # (the two buckets only key the autotuner: powers of two of the batch and of
    tokens_bucket,  # the block table's capacity, so similar shapes share one tuning run)
    num_splits,
    n_heads,
    num_blocks,  # blocks in the pool: an id outside [0, num_blocks) is never dereferenced
    max_tokens,  # the block table's capacity, max_blocks * PAGE_SIZE
    # strides (elements)
    stride_qb,
    stride_qh,
    stride_pb,
    stride_ph,
    stride_kb,
    stride_kt,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_osplit,
    # meta-parameters
    R: tl.constexpr,
    ROPE: tl.constexpr,
    R_PAD: tl.constexpr,  # R and ROPE rounded up to powers of two >= 16 (tl.dot tiles)
    ROPE_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DIRECT: tl.constexpr,  # one split: write the normalised output, no merge
    FP32_EXACT: tl.constexpr,  # fp32 inputs: full-precision dots (no TF32)
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # Axis 0 is (sequence, head block) with the head blocks of one sequence adjacent: they run
    # together and share each cache row through L2. Axis 1 is the split.
    n_head_blocks = tl.cdiv(n_heads, BLOCK_H)
    seq = tl.program_id(0) // n_head_blocks
    head_block = tl.program_id(0) % n_head_blocks
    split = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    # A length outside [0, max_tokens] would walk past the block table's row: the sequence reads
    # nothing and answers NaN (the launcher raises first in debug mode).
    n_bad = ((seq_len < 0) | (seq_len > max_tokens)).to(tl.int32)
    seq_len = tl.where(n_bad > 0, 0, seq_len)
    # This split's share of the context: a whole number of tiles, so only the last tile of the
    # sequence is partial. Splits past the end get an empty range.
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    # BLOCK_H heads of this sequence (zero rows past n_heads): the M dimension of both dots.
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < n_heads
    offs_r = tl.arange(0, R_PAD)
    offs_p = tl.arange(0, ROPE_PAD)
    q_base = seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    # Masked lanes must load 0 (not whatever tl.load leaves there): the padding columns of q
    # meet the padding columns of k in the dot.
    q_lat = tl.load(
        q_lat_ptr + q_base + offs_r[None, :],
        mask=head_ok[:, None] & (offs_r < R)[None, :],
        other=0.0,
    )
    p_base = seq.to(tl.int64) * stride_pb + heads[:, None] * stride_ph
    q_rope = tl.load(
        q_rope_ptr + p_base + offs_p[None, :],
        mask=head_ok[:, None] & (offs_p < ROPE)[None, :],
        other=0.0,
    )
    qk_scale = sm_scale * 1.4426950408889634  # log2(e), launch.LOG2E

    # Online-softmax state per head, fp32.
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, R_PAD], dtype=tl.float32)

    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        toks = start + tl.arange(0, BLOCK_N)
        tok_ok = toks < hi
        # Page-table walk: each token's physical block, then its row inside the block.
        block = tl.load(bt_row + toks // PAGE_SIZE, mask=tok_ok, other=0)
        block_ok = (block >= 0) & (block < num_blocks)
        n_bad += tl.sum((tok_ok & ~block_ok).to(tl.int32), 0)
        rows = block.to(tl.int64) * stride_kb + (toks % PAGE_SIZE) * stride_kt
        m_i, l_i, acc = _attend_tile(
            q_lat, q_rope, kv_ptr, rows, tok_ok & block_ok, m_i, l_i, acc, qk_scale,
            R, ROPE, R_PAD, ROPE_PAD, FP32_EXACT,
        )  # fmt: skip

    _store_partial(
        out_ptr, lse_ptr, acc, m_i, l_i, n_bad, seq.to(tl.int64), heads, head_ok, n_heads,
        num_splits, split, stride_ob, stride_oh, stride_osplit, R, R_PAD, DIRECT,
    )  # fmt: skip


@triton.jit
def _mla_combine_kernel(
    # pointers: o_part fp32 [n_rows, num_splits, R]; lse fp32 [n_rows, num_splits] (base 2);
    # out [n_rows, R] (a row is one (query, head) pair)
    o_part_ptr,
    lse_ptr,
    out_ptr,
    # sizes
    num_splits,
    # meta-parameters
    R: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # One program per (row, BLOCK_R columns): reads num_splits partial rows, writes one. The
    # columns are cut so that a 64-split merge of a 512-wide row stays in registers.
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    s_ok = offs_s < num_splits
    lse = tl.load(lse_ptr + row * num_splits + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # an empty sequence: every weight is 0
    w = tl.math.exp2(lse - m)
    o = tl.load(
        o_part_ptr + (row * num_splits + offs_s[:, None]) * R + offs_r[None, :],
        mask=s_ok[:, None] & (offs_r < R)[None, :],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + row * R + offs_r, out.to(out_ptr.dtype.element_ty), mask=offs_r < R)


# ----------------------------------------------------------------------------- launcher

# The default split count aims for PROGRAMS_PER_SM (query, split) programs per SM before head
# blocks multiply them (H / BLOCK_H more), and never cuts a split below MIN_SPLIT_TOKENS: under
# that, writing and merging partial outputs costs more than the parallelism gains.
PROGRAMS_PER_SM = 2
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64


def default_num_splits(n_queries: int, max_tokens: int) -> int:
    """Splits per query for ``n_queries`` queries (sequences at decode) over at most
    ``max_tokens`` keys each: about ``PROGRAMS_PER_SM`` per SM in all, at most 64."""
    want = cdiv(PROGRAMS_PER_SM * sm_count(interpreter=4), max(1, n_queries))
    return int(max(1, min(want, max_tokens // MIN_SPLIT_TOKENS, MAX_SPLITS)))


def _dot_pad(n: int) -> int:
    """A width rounded up to a tl.dot tile: a power of two, at least 16."""
    return max(16, next_power_of_2(n))


def check_config(
    config, tiles: tuple[str, str] = ("BLOCK_H", "BLOCK_N"), min_first: int = 16
) -> None:
    """``config = (tile, tile, num_warps, num_stages)`` (default ``(BLOCK_H, BLOCK_N, ...)``):
    positive ints, both tiles powers of two, the second >= 16 (a tl.dot dimension) and the first
    >= ``min_first`` (16 for MLA's head block, the dot's M; ``dsa``'s indexer passes 1 for its
    query tile, whose dot rows are BLOCK_T x the padded index heads)."""
    if config is None:
        return
    if not (
        isinstance(config, tuple)
        and len(config) == 4
        and all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in config)
        and all(not c & (c - 1) for c in config[:2])
        and config[0] >= min_first
        and config[1] >= 16
    ):
        first, second = tiles
        at_least = f" >= {min_first}" if min_first > 1 else ""
        raise ValueError(
            f"config must be ({first}, {second}, num_warps, num_stages) with {first} a power of "
            f"two{at_least} and {second} a power of two >= 16, got {config!r}"
        )


def check_num_splits(num_splits) -> None:
    if num_splits is not None and (
        isinstance(num_splits, bool)
        or not isinstance(num_splits, int)
        or not 1 <= num_splits <= 1024
    ):
        raise ValueError(f"num_splits must be an int in [1, 1024] or None, got {num_splits!r}")


def check_latent_inputs(q_latent, q_rope, kv_cache, block_table, n_queries: int):
    """Checks shared by mla_decode and dsa.sparse_mla: q_latent ``[..., H, r]`` and q_rope
    ``[..., H, d_rope]`` (head dim contiguous), the cache ``[num_blocks, block_size, r + d_rope]``
    of the same dtype, and an int32 block table with ``n_queries`` rows. Returns
    ``(r, d_rope, block_size)``."""
    for name, t in (("q_latent", q_latent), ("q_rope", q_rope)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
            raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")
        if t.ndim != q_latent.ndim:
            raise ValueError(
                f"q_latent and q_rope must have the same number of dimensions, got shapes "
                f"{tuple(q_latent.shape)} and {tuple(q_rope.shape)}"
            )
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if q_rope.shape[:-1] != q_latent.shape[:-1]:
        raise ValueError(
            f"q_rope must match q_latent in every dimension but the last, got "
            f"{tuple(q_rope.shape)} and {tuple(q_latent.shape)}"
        )
    _validate.same("q_latent", q_latent, "q_rope", q_rope, shape=False)
    _validate.tensor("kv_cache", kv_cache, dtypes=SUPPORTED_DTYPES, ndim=3)
    _validate.same("q_latent", q_latent, "kv_cache", kv_cache, shape=False)
    _validate.tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2)
    if block_table.device != q_latent.device:
        raise ValueError(f"block_table must be on {q_latent.device}, got {block_table.device}")
    if device.GPU_MODE and not q_latent.is_cuda:
        raise ValueError(f"q_latent and kv_cache must be on a CUDA device, got {q_latent.device}")
    r, d_rope = q_latent.shape[-1], q_rope.shape[-1]
    if r < 1 or d_rope < 1:
        raise ValueError(f"q_latent and q_rope need widths >= 1, got r={r}, d_rope={d_rope}")
    num_blocks, page, width = kv_cache.shape
    if width != r + d_rope:
        raise ValueError(
            f"kv_cache must be [num_blocks, block_size, r + d_rope] with width r + d_rope = "
            f"{r} + {d_rope} = {r + d_rope} (q_latent's and q_rope's widths), got {width}"
        )
    _validate.positive_power_of_two("block_size (kv_cache.shape[1])", page)
    if num_blocks >= 2**31:
        raise ValueError(f"the pool must hold fewer than 2**31 blocks, got {num_blocks}")
    if block_table.shape[0] != n_queries:
        raise ValueError(
            f"block_table needs one row per sequence ({n_queries}), got shape "
            f"{tuple(block_table.shape)}"
        )
    return r, d_rope, page


def launch_attention(
    kernel, grid_rows: int, n_heads: int, splits: int, config, args, key=None, **meta
):
    """Launch an autotuned MLA attention kernel (or, with ``config``, its plain jit function at
    one tile) over the grid (rows x head blocks, splits). ``key``: a launcher key the caller
    built (``kernels.launch.layout_key``); by default one is made from the arguments."""
    if splits > 65535:
        raise ValueError(f"num_splits must be at most 65535, got {splits}")
    if config is None:

        def grid(m):
            return (grid_rows * cdiv(n_heads, m["BLOCK_H"]), splits)

        if key is None:
            launch.tuned(kernel)(grid, args, **meta)
        else:
            launch.tuned(kernel).keyed(key, grid, args, **meta)
    else:
        bh, bn, w, s = config
        grid = (grid_rows * cdiv(n_heads, bh), splits)
        launch.tuned(kernel).fixed(
            grid, args, **meta, BLOCK_H=bh, BLOCK_N=bn, num_warps=w, num_stages=s
        )


_COMBINE = Launcher(_mla_combine_kernel)


def split_outputs(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where an attention kernel writes for ``out: [rows, H, r]``: with one split ``out`` itself
    (the lse pointer unused), else fp32 partials ``[rows, H, splits, r]`` and their log-sum-exps
    ``[rows, H, splits]`` for ``combine``. Returns ``(o_dst, lse, stride_osplit)``."""
    if splits == 1:
        return out, out, 0
    rows, n_heads, r = out.shape
    o_dst = torch.empty(rows, n_heads, splits, r, device=out.device, dtype=torch.float32)
    lse = torch.empty(rows, n_heads, splits, device=out.device, dtype=torch.float32)
    return o_dst, lse, o_dst.stride(2)


def combine(o_part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, key=None) -> None:
    """Merge split partial outputs ``o_part: fp32 [..., splits, R]`` with their base-2 log-sum-exps
    ``lse: [..., splits]`` into ``out: [..., R]`` (all contiguous). ``key``: as
    ``launch_attention``'s."""
    splits, r = o_part.shape[-2], o_part.shape[-1]
    n_rows = out.numel() // max(r, 1)
    block_r = min(_dot_pad(r), 64)
    args = (o_part, lse, out, splits)
    meta = dict(R=r, SPLITS_PAD=next_power_of_2(splits), BLOCK_R=block_r)
    key = call_key(args, meta) if key is None else key
    _COMBINE(key, (n_rows, cdiv(r, block_r)), args, **meta)


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    *,
    num_splits: int | None = None,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """MLA decode attention (absorbed form) of one query token per sequence over a paged cache.

    ``q_latent: [B, H, r]`` (``q_nope`` times ``W_UK``: ``AbsorbedMLA.query``) and ``q_rope: [B, H,
    d_rope]`` (any strides with the last dim contiguous); ``kv_cache: [num_blocks, block_size, r +
    d_rope]``, each row a token's latent then its rotary key, contiguous, the same dtype (fp16,
    bf16 or fp32); block_size a power of two (64 in FlashMLA). ``block_table: int32 [B,
    max_blocks]``, ``seq_lens: int32 [B]``; sequence ``b`` attends to its tokens ``0 …
    seq_lens[b] - 1``, an empty one gets zeros. All heads share the cache (multi-query): any
    ``H >= 1``. ``sm_scale`` defaults to ``1 / sqrt(r + d_rope)``; a model passes its own
    (DeepSeek: ``1 / sqrt(d_nope + d_rope)``, the head dim before absorption, times its YaRN
    factor). ``num_splits`` defaults to ``default_num_splits``; ``config = (BLOCK_H, BLOCK_N,
    num_warps, num_stages)`` skips the autotuner. Lengths and block ids are checked
    (``ValueError``) on the CPU and in debug mode; otherwise a sequence with a bad one answers NaN.
    Returns the latent output ``o_lat: [B, H, r]`` in q's dtype (``AbsorbedMLA.output`` maps it to
    per-head values).
    """
    layout = launch.layout_key(
        (q_latent, q_rope, kv_cache, block_table, seq_lens), num_splits, config
    )
    plan = _DECODE_PLANS.get(layout)
    if plan is None:  # a layout not seen yet: check the inputs' structure, work out the launch
        _check_decode(q_latent, q_rope, kv_cache, block_table, seq_lens, num_splits, config)
        plan = _DECODE_PLANS.put(
            layout, _decode_plan(q_latent, q_rope, kv_cache, block_table, num_splits)
        )
    else:  # the settings are in the key by value (True == 1, 2.0 == 2): check their types
        check_num_splits(num_splits)
        check_config(config)
    scale = _validate.sm_scale(sm_scale, plan.r + plan.d_rope)
    if _validate.check_values(block_table, seq_lens):
        paged_attention.check_lengths_and_blocks(
            block_table, seq_lens, kv_cache.shape[0], plan.page, pool="kv_cache"
        )
    out = torch.empty(plan.out_shape, device=q_latent.device, dtype=q_latent.dtype)
    if plan.splits == 0:  # no sequences or no heads
        return out
    n_seqs, n_heads, _ = plan.out_shape
    o_dst, lse, _ = split_outputs(out, plan.splits)
    args = (q_latent, q_rope, kv_cache, block_table, seq_lens, o_dst, lse, scale, *plan.sizes)
    launch_attention(
        _mla_decode_kernel, n_seqs, n_heads, plan.splits, config, args, key=layout, **plan.meta
    )
    if plan.splits > 1:
        combine(o_dst, lse, out, key=layout)
    return out


@dataclass(frozen=True)
class _DecodePlan:
    """What ``mla_decode`` works out from its inputs' layout alone, once per layout."""

    r: int
    d_rope: int
    page: int
    out_shape: tuple[int, int, int]
    splits: int  # 0: nothing to launch
    sizes: tuple  # the kernel's arguments after sm_scale: buckets, sizes, strides
    meta: dict


# mla_decode's plans per input layout (kernels.launch.Plans): its structural checks and launch
# arithmetic run once per layout; the layout key also keys the launchers.
_DECODE_PLANS = launch.Plans()


def _check_decode(q_latent, q_rope, kv_cache, block_table, seq_lens, num_splits, config) -> None:
    if isinstance(q_latent, torch.Tensor) and q_latent.ndim != 3:
        raise ValueError(f"q_latent must be 3-D [B, H, r], got shape {tuple(q_latent.shape)}")
    n_seqs = q_latent.shape[0] if isinstance(q_latent, torch.Tensor) else 0  # else: TypeError
    check_latent_inputs(q_latent, q_rope, kv_cache, block_table, n_seqs)
    _validate.tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1)
    if seq_lens.shape[0] != n_seqs or seq_lens.device != q_latent.device:
        raise ValueError(
            f"seq_lens must hold one length per sequence ({n_seqs}) on {q_latent.device}, got "
            f"shape {tuple(seq_lens.shape)} on {seq_lens.device}"
        )
    check_num_splits(num_splits)
    check_config(config)


def _decode_plan(q_latent, q_rope, kv_cache, block_table, num_splits) -> _DecodePlan:
    n_seqs, n_heads, r = q_latent.shape
    _, page, width = kv_cache.shape
    d_rope = width - r
    if n_seqs == 0 or n_heads == 0:
        return _DecodePlan(r, d_rope, page, (n_seqs, n_heads, r), 0, (), {})
    max_tokens = block_table.shape[1] * page
    splits = num_splits or default_num_splits(n_seqs, max_tokens)
    # split_outputs' tensors are fresh and contiguous: [B, H, r], or fp32 [B, H, splits, r]
    o_strides = (n_heads * r, r, 0) if splits == 1 else (n_heads * splits * r, splits * r, r)
    sizes = (
        next_power_of_2(n_seqs), next_power_of_2(max_tokens), splits, n_heads,
        kv_cache.shape[0], max_tokens,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        *o_strides,
    )  # fmt: skip
    meta = dict(
        R=r, ROPE=d_rope, R_PAD=_dot_pad(r), ROPE_PAD=_dot_pad(d_rope), PAGE_SIZE=page,
        DIRECT=splits == 1, FP32_EXACT=q_latent.dtype == torch.float32,
    )  # fmt: skip
    return _DecodePlan(r, d_rope, page, (n_seqs, n_heads, r), splits, sizes, meta)


def chosen_config(kernel=None) -> dict | None:
    """The tile the autotuner picked last (``BLOCK_H``, ``BLOCK_N``, warps, stages), or None."""
    kernel = kernel or _mla_decode_kernel
    best = getattr(kernel, "best_config", None)
    if best is None:
        return None
    return {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}


# ----------------------------------------------------------------------------- absorption


@dataclass(frozen=True)
class AbsorbedMLA:
    """The per-head up-projections in the absorbed layout: ``w_uk: [H, d_nope, r]`` (query side,
    ``q_latent[b, h] = q_nope[b, h] @ w_uk[h]``) and ``w_uv: [H, r, d_v]`` (output side,
    ``out[b, h] = o_lat[b, h] @ w_uv[h]``)."""

    w_uk: torch.Tensor
    w_uv: torch.Tensor

    def query(self, q_nope: torch.Tensor) -> torch.Tensor:
        """``q_nope: [B, H, d_nope]`` -> ``q_latent: [B, H, r]`` (one batched matmul over heads:
        ``2·B·H·d_nope·r`` FLOPs per step)."""
        return torch.einsum("bhd,hdr->bhr", q_nope, self.w_uk.to(q_nope.dtype))

    def output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """``o_lat: [B, H, r]`` -> the per-head attention output ``[B, H, d_v]``."""
        return torch.einsum("bhr,hrv->bhv", o_lat, self.w_uv.to(o_lat.dtype))


def absorb(w_uk: torch.Tensor, w_uv: torch.Tensor, n_heads: int) -> AbsorbedMLA:
    """Turn the key and value up-projections into the absorbed form (a one-time step).

    ``w_uk: [H * d_nope, r]`` and ``w_uv: [H * d_v, r]`` are ``nn.Linear`` weights mapping the
    latent ``c`` (``r`` wide) to every head's key (no-rope part) and value: ``k_nope = c @ w_ukᵀ``.
    (DeepSeek checkpoints store both stacked per head as ``kv_b_proj.weight: [H * (d_nope + d_v),
    r]``: ``split_kv_b_proj`` separates them.) For head ``h`` the key is ``W_UK[h] c`` with
    ``W_UK[h] = w_uk[h*d_nope:(h+1)*d_nope]: [d_nope, r]``, so ``q_nope · k_nope = (q_nope
    W_UK[h]) · c``; the value is ``W_V[h] c`` and ``Σ p v = (Σ p c) W_V[h]ᵀ``, so the output side
    stores ``W_UV[h] = W_V[h]ᵀ: [r, d_v]``. DeepSeek-V3: H = 128, d_nope = d_v = 128, r = 512.
    """
    if isinstance(n_heads, bool) or not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
    for name, w in (("w_uk", w_uk), ("w_uv", w_uv)):
        if not isinstance(w, torch.Tensor) or w.ndim != 2:
            raise ValueError(f"{name} must be a 2-D [H * d, r] tensor (an nn.Linear weight)")
        if w.shape[0] % n_heads:
            raise ValueError(
                f"{name}'s rows ({w.shape[0]}) must be a multiple of n_heads ({n_heads})"
            )
    if w_uk.shape[1] != w_uv.shape[1]:
        raise ValueError(
            f"w_uk and w_uv must share the latent rank r, got {w_uk.shape[1]} and {w_uv.shape[1]}"
        )
    r = w_uk.shape[1]
    return AbsorbedMLA(
        w_uk=w_uk.reshape(n_heads, -1, r).contiguous(),
        w_uv=w_uv.reshape(n_heads, -1, r).transpose(1, 2).contiguous(),
    )


def split_kv_b_proj(w_kv_b: torch.Tensor, n_heads: int, d_nope: int, d_v: int):
    """DeepSeek's ``kv_b_proj.weight: [H * (d_nope + d_v), r]`` (per head: d_nope key rows, then
    d_v value rows) as ``(w_uk [H * d_nope, r], w_uv [H * d_v, r])`` for ``absorb``."""
    w = w_kv_b.reshape(n_heads, d_nope + d_v, -1)
    r = w.shape[-1]
    return w[:, :d_nope].reshape(-1, r), w[:, d_nope:].reshape(-1, r)


# ----------------------------------------------------------------------------- references


def gather_latent(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Tokens ``0 … length-1`` of every sequence as ``[B, length, r + d_rope]`` (positions past a
    sequence's own length read whatever its table points at: mask them). A read and a write of
    every gathered byte: the price of calling contiguous PyTorch ops on a paged cache. The cache is
    paged attention's with one kv head and no head axis."""
    return paged_attention.gather_kv(kv_cache[:, None], block_table, length)[:, 0]


def _ref_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def mla_decode_ref(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """fp32 reference (fp64 for fp64 inputs): gather each sequence's rows, softmax over
    ``[q_latent, q_rope] · row``, weighted sum of the rows' latent parts. Empty sequences: 0."""
    n_seqs, n_heads, r = q_latent.shape
    ct = _ref_dtype(q_latent)
    scale = 1.0 / math.sqrt(kv_cache.shape[2]) if sm_scale is None else sm_scale
    out = torch.zeros(n_seqs, n_heads, r, dtype=ct, device=q_latent.device)
    q = torch.cat([q_latent, q_rope], -1).to(ct)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        kv = gather_latent(kv_cache, block_table[b : b + 1], n)[0].to(ct)  # [n, r + d_rope]
        p = torch.softmax(q[b] @ kv.T * scale, -1)
        out[b] = p @ kv[:, :r]
    return out


def mla_decode_eager(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """The absorbed form as a user would write it in PyTorch: gather the cache to ``[B, L, r +
    d_rope]`` (L the block table's capacity: no host sync), two batched matmuls and a masked
    softmax, in the inputs' dtype. Baseline of the ``mla_decode`` benchmark."""
    n_seqs, _, r = q_latent.shape
    length = block_table.shape[1] * kv_cache.shape[1]
    scale = 1.0 / math.sqrt(kv_cache.shape[2]) if sm_scale is None else sm_scale
    kv = gather_latent(kv_cache, block_table, length)
    s = torch.cat([q_latent, q_rope], -1) @ kv.transpose(1, 2)  # [B, H, L]
    pad = torch.arange(length, device=s.device)[None, :] >= seq_lens[:, None]
    s = s.float().mul_(scale).masked_fill_(pad[:, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num_(0.0)  # an empty sequence: a row of NaN, zeroed
    return (p.to(kv.dtype) @ kv[..., :r]).to(q_latent.dtype)


def mla_decode_naive(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    weights: AbsorbedMLA,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """MLA as the model defines it: re-expand every cached latent into per-head keys ``[B, H, L,
    d_nope + d_rope]`` and values ``[B, H, L, d_v]``, then SDPA. ``q_nope: [B, H, d_nope]``;
    returns the per-head output ``[B, H, d_v]``. ``sm_scale`` defaults to ``1 / sqrt(d_nope +
    d_rope)``. It moves ``H · (d_nope + d_rope + d_v) / (r + d_rope)`` times the cache's bytes:
    the cost absorption removes."""
    n_seqs, n_heads, d_nope = q_nope.shape
    r = kv_cache.shape[2] - q_rope.shape[-1]
    length = block_table.shape[1] * kv_cache.shape[1]
    scale = 1.0 / math.sqrt(d_nope + q_rope.shape[-1]) if sm_scale is None else sm_scale
    kv = gather_latent(kv_cache, block_table, length)
    c, k_rope = kv[..., :r], kv[..., r:]
    k_nope = torch.einsum("blr,hdr->bhld", c, weights.w_uk.to(c.dtype))
    v = torch.einsum("blr,hrv->bhlv", c, weights.w_uv.to(c.dtype))
    k = torch.cat([k_nope, k_rope[:, None].expand(-1, n_heads, -1, -1)], -1)
    q = torch.cat([q_nope, q_rope], -1)[:, :, None]
    keep = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :], scale=scale)
    return torch.where((seq_lens > 0)[:, None, None], o[:, :, 0], 0.0).to(q_nope.dtype)


# ----------------------------------------------------------------------------- napkin math


def mla_cache_bytes_per_token(r: int = 512, d_rope: int = 64, dtype_bytes: int = 2) -> int:
    """Bytes one token adds to one layer's MLA cache: its latent and its rotary key."""
    return (r + d_rope) * dtype_bytes


def mha_cache_bytes_per_token(
    n_heads: int = 128, d_k: int = 192, d_v: int = 128, dtype_bytes: int = 2
) -> int:
    """Bytes per token and layer of a multi-head cache (every head's key and value); the
    defaults are DeepSeek-V3's heads without MLA (keys 128 + 64 rope, values 128)."""
    return n_heads * (d_k + d_v) * dtype_bytes


def gqa_cache_bytes_per_token(
    n_kv_heads: int = 8, head_dim: int = 128, dtype_bytes: int = 2
) -> int:
    """Bytes per token and layer of a grouped-query cache (``n_kv_heads`` keys and values)."""
    return 2 * n_kv_heads * head_dim * dtype_bytes


def mla_decode_bytes(
    batch: int,
    context: int,
    n_heads: int = 128,
    r: int = 512,
    d_rope: int = 64,
    dtype_bytes: int = 2,
) -> int:
    """Bytes one decode step must move: every cached row once (``context`` tokens of each of
    ``batch`` sequences), the queries in and the latent outputs out."""
    cache = batch * context * (r + d_rope)
    q_and_out = batch * n_heads * (r + d_rope + r)
    return (cache + q_and_out) * dtype_bytes


def mla_decode_flops(
    batch: int, context: int, n_heads: int = 128, r: int = 512, d_rope: int = 64
) -> int:
    """FLOPs of one decode step: scores (``2·(r + d_rope)`` per head and token) and the weighted
    sum of latents (``2·r``)."""
    return batch * n_heads * context * 2 * (2 * r + d_rope)


def mla_decode_intensity(batch: int, context: int, **shape) -> float:
    """FLOPs per byte of one decode step. Each sequence reads its own cache, so batch barely
    moves it: the heads sharing a row are what raises it (about 1.9 FLOP/byte per head in bf16)."""
    return mla_decode_flops(batch, context, **shape) / mla_decode_bytes(batch, context, **shape)


def mla_decode_roof_s(
    batch: int,
    context: int,
    bandwidth_gbps: float,
    tflops: float,
    n_heads: int = 128,
    r: int = 512,
    d_rope: int = 64,
    dtype_bytes: int = 2,
) -> tuple[float, str]:
    """The roofline time of one decode step, max(bytes / bandwidth, FLOPs / peak), and which roof
    binds ('memory' or 'compute')."""
    nbytes = mla_decode_bytes(batch, context, n_heads, r, d_rope, dtype_bytes)
    flops = mla_decode_flops(batch, context, n_heads, r, d_rope)
    return roof_time_s(nbytes, flops, bandwidth_gbps, tflops)


def roof_time_s(nbytes: int, flops: int, bandwidth_gbps: float, tflops: float) -> tuple[float, str]:
    """The roofline time of any work, max(bytes / bandwidth, FLOPs / peak) in seconds, and which
    roof binds ('memory' or 'compute'). One home for the max: MLA's and DSA's cost models and the
    benchmarks' ceilings use it."""
    t_mem, t_cmp = nbytes / (bandwidth_gbps * 1e9), flops / (tflops * 1e12)
    return (t_mem, "memory") if t_mem >= t_cmp else (t_cmp, "compute")


# ----------------------------------------------------------------------------- test data


def decode_case(
    seq_lens,
    n_heads: int,
    r: int,
    d_rope: int,
    *,
    block_size: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    spare_blocks: int = 2,
    exact_table: bool = False,
    dev=None,
):
    """Random ``(q_latent, q_rope, kv_cache, block_table, seq_lens)`` with each sequence's blocks
    scattered over a pool (block 0 unused, a few spare blocks). Every table row has one column
    more than its longest sequence needs, pointing at a real block; with ``exact_table`` the table
    stops at the longest sequence's last block (for timing: the eager baselines gather the
    table's whole capacity)."""
    dev = torch.device(dev or device.DEVICE)
    g = torch.Generator().manual_seed(seed)
    n = len(seq_lens)
    per_seq = max(1, -(-max(seq_lens, default=0) // block_size)) + 1
    num_blocks = 1 + n * per_seq + spare_blocks
    perm = torch.randperm(num_blocks - 1, generator=g)[: n * per_seq] + 1
    table = perm.view(n, per_seq).to(torch.int32)
    if exact_table:
        table = table[:, : per_seq - 1].contiguous()
    lens = torch.tensor(list(seq_lens), dtype=torch.int32)
    return (
        randn(n, n_heads, r, dtype=dtype, seed=seed + 1, dev=dev),
        randn(n, n_heads, d_rope, dtype=dtype, seed=seed + 2, dev=dev),
        randn(num_blocks, block_size, r + d_rope, dtype=dtype, seed=seed + 3, dev=dev),
        table.to(dev),
        lens.to(dev),
    )


def randn(*shape, dtype: torch.dtype, seed: int, dev) -> torch.Tensor:
    """Standard normal values made on ``dev`` (gigabytes of cache at benchmark sizes: drawing
    them on the host would take longer than the benchmark), rounded to ``dtype``."""
    dev = torch.device(dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    draw = dtype if dtype in (torch.float16, torch.bfloat16, torch.float64) else torch.float32
    return torch.randn(*shape, generator=g, device=dev, dtype=draw).to(dtype)


# ----------------------------------------------------------------------------- compile check

_SIZES = {
    n: "i32"
    for n in (
        "seqs_bucket", "tokens_bucket", "num_splits", "n_heads", "num_blocks", "max_tokens",
        "stride_qb", "stride_qh", "stride_pb", "stride_ph", "stride_kb", "stride_kt",
        "stride_bt", "stride_ob", "stride_oh", "stride_osplit",
    )
}  # fmt: skip


def _attention_spec(
    kernel, sizes: dict, index_ptr: str, t: str, splits: int, min_cc: int, block_h: int, warps: int
) -> dict:
    """The compile spec of an MLA attention kernel at DeepSeek-V3's shapes: ``mla_decode``'s
    (``index_ptr`` its seq_lens) and ``dsa.sparse_mla``'s (its top-k indices) share all but the
    kernel, the token-selecting pointer and the sizes."""
    out_t = t if splits == 1 else "fp32"
    return dict(
        kernel=kernel.fn,
        signature={
            "q_lat_ptr": f"*{t}",
            "q_rope_ptr": f"*{t}",
            "kv_ptr": f"*{t}",
            "block_table_ptr": "*i32",
            index_ptr: "*i32",
            "out_ptr": f"*{out_t}",
            "lse_ptr": "*fp32" if splits > 1 else f"*{out_t}",
            "sm_scale": "fp32",
            **sizes,
        },
        constexprs={
            "R": 512,
            "ROPE": 64,
            "R_PAD": 512,
            "ROPE_PAD": 64,
            "PAGE_SIZE": 64,
            "DIRECT": splits == 1,
            "FP32_EXACT": t == "fp32",
            "BLOCK_H": block_h,
            "BLOCK_N": 32,
        },
        options={"num_warps": warps, "num_stages": 2},
        min_cc=min_cc,
    )  # fmt: skip


def _decode_spec(t: str, splits: int, min_cc: int, block_h: int = 32, warps: int = 8) -> dict:
    return _attention_spec(
        _mla_decode_kernel, _SIZES, "seq_lens_ptr", t, splits, min_cc, block_h, warps
    )


def _combine_spec(t: str, min_cc: int) -> dict:
    return dict(
        kernel=_mla_combine_kernel,
        signature={
            "o_part_ptr": "*fp32",
            "lse_ptr": "*fp32",
            "out_ptr": f"*{t}",
            "num_splits": "i32",
        },
        constexprs={"R": 512, "SPLITS_PAD": 64, "BLOCK_R": 64},
        min_cc=min_cc,
    )


# bf16 dots need Ampere (8.0); Turing (sm_75) builds the fp16 variant at a smaller head block.
COMPILE_SPECS = [
    _decode_spec("bf16", 8, 80),
    _decode_spec("bf16", 1, 80, block_h=64),
    _decode_spec("fp16", 4, 0, block_h=16, warps=4),
    _combine_spec("bf16", 80),
    _combine_spec("fp16", 0),
]


# ----------------------------------------------------------------------------- benchmark


def _roof(
    nbytes: int, flops: int, copy_gbps: float, peak_tflops: float, peak_name: str = "matmul_bf16"
) -> tuple[str, float]:
    """The benchmark's ceiling as a record wants it (GB/s, since records carry GB/s): the bytes
    over the roofline time max(bytes / copy bandwidth, FLOPs / matmul peak), named after the roof
    that binds."""
    t, bound = roof_time_s(nbytes, flops, copy_gbps, peak_tflops)
    return ("roof:copy" if bound == "memory" else f"roof:{peak_name}"), nbytes / t / 1e9


def _mla_records(batch, context, n_heads, r, d_rope, dtype, copy_gbps, peak, naive) -> list[dict]:
    q_lat, q_rope, kv, table, lens = decode_case(
        [context] * batch, n_heads, r, d_rope, dtype=dtype, spare_blocks=0, exact_table=True
    )
    nbytes = mla_decode_bytes(batch, context, n_heads, r, d_rope, dtype.itemsize)
    flops = mla_decode_flops(batch, context, n_heads, r, d_rope)
    ceiling = _roof(nbytes, flops, copy_gbps, peak)
    shape = [batch, context, n_heads, r, d_rope]

    def run(fn):
        return bench.measure(fn, bytes=nbytes, flops=flops)

    eager = run(lambda: mla_decode_eager(q_lat, q_rope, kv, table, lens))
    ours = run(lambda: mla_decode(q_lat, q_rope, kv, table, lens))
    recs = [
        bench.record("mla_decode", "triton", shape, dtype, ours,
                     baseline=("eager-absorbed", eager), ceiling=ceiling),
        bench.record("mla_decode", "eager-absorbed", shape, dtype, eager, ceiling=ceiling),
    ]  # fmt: skip
    if naive:
        dev = q_lat.device
        w = AbsorbedMLA(
            randn(n_heads, 128, r, dtype=dtype, seed=1, dev=dev) / math.sqrt(r),
            randn(n_heads, r, 128, dtype=dtype, seed=2, dev=dev) / math.sqrt(r),
        )
        q_nope = randn(batch, n_heads, 128, dtype=dtype, seed=3, dev=dev)
        m = run(lambda: mla_decode_naive(q_nope, q_rope, kv, table, lens, w))
        recs.append(bench.record("mla_decode", "naive-sdpa", shape, dtype, m, ceiling=ceiling))
    return recs


@bench.register("mla_decode")
def _bench_mla_decode(quick: bool) -> list[dict]:
    """MLA decode at DeepSeek-V3's shapes (128 heads, r = 512, d_rope = 64, pages of 64) against
    the eager absorbed form and the naive re-expanded form, measured against the roofline bound
    max(bytes / copy bandwidth, FLOPs / bf16 matmul peak), both roofs measured in this run."""
    dtype = device.preferred_dtype(torch.bfloat16)
    copy = roofline.copy_bandwidth().value
    peak = roofline.matmul_peak("bfloat16").value
    if not device.GPU_MODE:  # the interpreter: a tiny case that runs every code path
        return _mla_records(2, 128, 16, 32, 16, torch.float32, copy, peak, naive=True)
    batches = [1, 32, 128] if quick else [1, 8, 32, 64, 128]
    contexts = [4096, 32768] if not quick else [8192]
    recs = []
    for context in contexts:
        for batch in batches:
            # The naive form materialises H * (192 + 128) values per token: small cases only.
            naive = batch * context * 128 * 320 * 2 <= 8 * 2**30
            recs += _mla_records(batch, context, 128, 512, 64, dtype, copy, peak, naive)
            torch.cuda.empty_cache()
    return recs
