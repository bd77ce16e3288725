"""Paged KV cache and a split-K (flash-decoding) Triton attention kernel for the decode step.

**The cache.** Keys and values live in a pool of fixed-size *blocks* (pages) of ``block_size``
tokens: ``k_cache, v_cache: [num_blocks, n_kv_heads, block_size, head_dim]``. A sequence owns a list
of blocks, not a contiguous range; its row of the *block table* (``int32[n_seqs, max_blocks]``) maps
logical block ``j`` (tokens ``j*block_size … (j+1)*block_size - 1``) to a physical block id, exactly
as a page table maps virtual pages to physical frames. Memory is taken one block at a time as a
sequence grows, so the only waste is the unfilled tail of each sequence's last block.
``BlockAllocator`` is the free list and ``PagedKVCache`` holds the pool of every layer with the
block table (a CPU mirror that the host edits and a device copy the kernels read).

**The kernel.** ``paged_decode(q, k_cache, v_cache, block_table, seq_lens)`` computes one query token
per sequence against that sequence's ``seq_lens[b]`` cached tokens, for ``q: [n_seqs, n_heads,
head_dim]``, with grouped-query attention (``n_heads`` a multiple of ``n_kv_heads``). Decode
attention does as many FLOPs per byte it reads as there are query heads per kv head, a handful, so
its speed is the speed of reading the cache, and the design follows from that:

- *Grid over (sequence, kv head, split).* One program reads each KV byte of its share exactly once,
  and handles all ``n_heads / n_kv_heads`` query heads of its kv head together (their scores are one
  small ``tl.dot``): with GQA the cache is read once, not once per query head.
- *Split-K over the sequence* (flash-decoding). A batch of 8 sequences with 8 kv heads is only 64
  (sequence, head) pairs, too few programs for a GPU with 132 SMs. Each pair's tokens are cut into
  ``num_splits`` contiguous chunks; each program reduces its chunk with the online softmax and
  writes its normalised partial output and log-sum-exp; a second small kernel merges the splits,
  weighting each by ``exp(lse_s - max lse)``. With one split the first kernel writes the output
  directly.
- *Pages gathered per tile.* A tile of ``BLOCK_N`` tokens may span several blocks: each token's
  block id comes from the block table and its row address from that id, so tiles need not align
  with blocks: any power-of-two block size works.

The number of splits and the grid depend only on shapes (the block table's width), never on the
values of ``seq_lens``: a decode step can be captured in a CUDA graph and replayed as sequences
grow. Programs whose chunk lies past a sequence's end exit after writing an empty partial result.

**The host path.** A decode step calls this once per layer with the same layout, and at batch 1
the host's work per call takes longer than the kernels. The first call of a layout checks the
inputs, tunes the split kernel and compiles; later calls of that layout (with the default split
count and tile, outside debug mode) launch both kernels from C++ (``kernels.replay``), the way
PyTorch's own ops launch, with the combine as a programmatic dependent of the split kernel.

``paged_decode_ref`` gathers each sequence's blocks into contiguous tensors and computes attention
in fp32: the reference. ``gather_kv`` does the same gathering for a batch (used by multi-token
forwards in ``kernels.decoder``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import _validate, bench, device, replay, roofline, sdpa
from kernels.launch import (
    Launcher,
    Plans,
    cdiv,
    gdc_launch_dependents,
    gdc_wait,
    layout_key,
    next_power_of_2,
    pdl_supported,
    sm_count,
    tuned,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)

# ----------------------------------------------------------------------------- configurations

# (BLOCK_N, num_warps, num_stages). Tiles of 32-128 tokens. Because each K/V load depends on a
# block-table load, Triton's pipeliner spends one stage on the table: 3 stages keep one K and one
# V tile in flight under the current tile's math, 5 stages two (64 x 128 bf16 is 16 KB a tile).
# The autotuner times these once per shape on a GPU (briefly: decode calls are short); the
# interpreter runs the first one only.
_CONFIGS = [(64, 4, 3), (64, 4, 5), (32, 4, 5), (128, 4, 3), (128, 8, 5)]


def _configs():
    shapes = _CONFIGS[:1] if device.INTERPRET else _CONFIGS
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s) for n, w, s in shapes]


# ----------------------------------------------------------------------------- kernels


@triton.autotune(
    configs=_configs(),
    key=["seqs_bucket", "tokens_bucket", "num_splits", "HEAD_DIM", "PAGE_SIZE", "GROUP_PAD"],
    do_bench=functools.partial(triton.testing.do_bench, warmup=10, rep=40),
)
@triton.jit(
    do_not_specialize=[
        "seqs_bucket",
        "tokens_bucket",
        "num_splits",
        "group",
        "num_blocks",
        "max_tokens",
    ]
)
def _paged_decode_split_kernel(
    # pointers: q [n_seqs, n_heads, D]; k, v caches [num_blocks, n_kv, PAGE, D];
    # block_table int32 [n_seqs, max_blocks]; seq_lens int32 [n_seqs];
    # out [n_seqs, n_heads, D] (DIRECT: one split) or, with several, one fp32 buffer: the partial
    # outputs [n_seqs, n_heads, num_splits, D], then their log-sum-exps [n_seqs, n_heads,
    # num_splits] (one allocation instead of two: the call's three allocations took 9.4 of its
    # 32.7 µs of host time at batch 1 on an H100, results/profiles/2026-12-06-*-paged-host.txt)
    q_ptr,
    k_ptr,
    v_ptr,
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,
    # scalars and sizes
    sm_scale,
    seqs_bucket,  # (the two buckets only key the autotuner: powers of two of the batch and of
    tokens_bucket,  # the block table's capacity, so that similar shapes share one tuning run)
    num_splits,
    group,  # query heads per kv head
    num_blocks,  # blocks in the pool: a block id outside [0, num_blocks) is never dereferenced
    max_tokens,  # the block table's capacity, max_blocks * PAGE_SIZE
    # strides (elements)
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kt,
    stride_bt,
    stride_os,
    stride_oh,
    stride_osplit,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # group rounded up to a tl.dot tile (>= 16)
    DIRECT: tl.constexpr,  # one split: write the normalised output, no merge
    FP32_EXACT: tl.constexpr,  # fp32 inputs: full-precision dots (no TF32)
    PDL: tl.constexpr,  # programmatic dependent launch (Hopper on): the combine may start early
    BLOCK_N: tl.constexpr,
):
    if PDL:
        # Let the combine kernel's programs be placed now, on the SMs this grid leaves idle; they
        # wait in gdc_wait until this grid has finished and its writes are visible.
        gdc_launch_dependents()
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # A length outside [0, max_tokens] would walk past the block table's row: such a sequence
    # reads nothing and answers NaN (the launcher raises first in debug mode). n_bad counts the
    # reasons this program's answer is NaN.
    n_bad = ((seq_len < 0) | (seq_len > max_tokens)).to(tl.int32)
    seq_len = tl.where(n_bad > 0, 0, seq_len)
    # This program's share of the sequence: a whole number of tiles, so that only the tile at the
    # end of the sequence is partial. Splits past the end get an empty range.
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    # The group of query heads that share this kv head, padded to a tl.dot tile with zero rows.
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * group + offs_g
    head_ok = offs_g < group
    q_off = seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=head_ok[:, None], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e), launch.LOG2E: exp(x) = exp2(x * log2 e)

    # Online-softmax state per query head, fp32.
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)

    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head.to(tl.int64) * stride_kh
    for start in range(lo, hi, BLOCK_N):
        toks = start + tl.arange(0, BLOCK_N)
        tok_ok = toks < hi
        # Page-table walk: each token's physical block, then its row inside the block. Reads
        # BLOCK_N / PAGE_SIZE distinct int32 entries (from L1) per tile of BLOCK_N * D * 2 values.
        block = tl.load(bt_row + toks // PAGE_SIZE, mask=tok_ok, other=0)
        # A block id outside the pool is never dereferenced: its tokens load zeros and poison
        # the answer with NaN.
        block_ok = (block >= 0) & (block < num_blocks)
        n_bad += tl.sum((tok_ok & ~block_ok).to(tl.int32), 0)
        kv_ok = tok_ok & block_ok
        rows = block.to(tl.int64) * stride_kb + kv_head_off + (toks % PAGE_SIZE) * stride_kt
        kv_off = rows[:, None] + offs_d[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_ok[:, None], other=0.0)
        if FP32_EXACT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(tok_ok[None, :], s * qk_scale, float("-inf"))
        # Every tile holds at least one valid token (start < hi), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off, mask=kv_ok[:, None], other=0.0)
        if FP32_EXACT:
            acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new

    # An empty range leaves l = 0: its partial output is 0 and its log-sum-exp -inf (weight 0).
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]
    o = tl.where(n_bad > 0, float("nan"), o)  # NaN survives the merge: 0 * NaN is NaN
    o_off = seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + offs_d[None, :]
    if DIRECT:
        tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        tl.store(out_ptr + o_off + split * stride_osplit, o, mask=head_ok[:, None])
        lse = tl.where(l_i > 0.0, m_i + tl.math.log2(l_safe), float("-inf"))
        n_heads = tl.num_programs(1) * group
        lse_ptr = out_ptr + tl.num_programs(0).to(tl.int64) * n_heads * num_splits * HEAD_DIM
        lse_off = (seq.to(tl.int64) * n_heads + heads) * num_splits + split
        tl.store(lse_ptr + lse_off, lse, mask=head_ok)


@triton.jit
def _paged_decode_combine_kernel(
    # pointers: the split kernel's fp32 buffer (o_part [n_seqs, n_heads, num_splits, D], then
    # lse_part [n_seqs, n_heads, num_splits], base 2); out [n_seqs, n_heads, D]
    o_part_ptr,
    out_ptr,
    # sizes
    num_splits,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    PDL: tl.constexpr,  # launched as a programmatic dependent of the split kernel
):
    # One program per (sequence, query head): reads num_splits partial rows, writes one row.
    if PDL:
        gdc_wait()  # every split has finished and its partial outputs are visible
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    lse_ptr = o_part_ptr + tl.num_programs(0).to(tl.int64) * num_splits * HEAD_DIM
    lse = tl.load(lse_ptr + row * num_splits + offs_s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # an empty sequence: every weight is 0
    w = tl.math.exp2(lse - m)
    o = tl.load(
        o_part_ptr + (row * num_splits + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
        mask=s_ok[:, None],
        other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + offs_d, out.to(out_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------- launcher

# Both kernels launch through kernels.launch's fast path (the split kernel through launch.tuned): a
# decode step calls this once per layer with the same shapes, and Triton's own launch (the
# autotuner's on top) costs more host time than the kernel takes at batch 1.
_COMBINE = Launcher(_paged_decode_combine_kernel)


# The default split count fills one wave: about one (sequence, kv head, split) program per SM, and
# one split (no merge kernel) once the pairs alone fill the SMs. A split is never shorter than
# MIN_SPLIT_TOKENS. Measured on an H100, 2026-12-06 (device time against SDPA on a contiguous
# cache, bf16, 32 query and 8 kv heads;
# results/profiles/2026-12-06-nvidia-h100-80gb-hbm3-paged-splits.txt), the old default of 16
# programs per SM and splits of at least 256 tokens ran batch 1 x 1,024 tokens in 4 splits at
# 0.82x (8 splits: 0.95x) and batch 16 x 1,024 in 4 at 0.85x (1 split, 128 programs: 0.95x): past
# one wave, writing and merging partial outputs costs more than the extra programs gain.
MIN_SPLIT_TOKENS = 128
MAX_SPLITS = 64


def default_num_splits(n_seqs: int, n_kv_heads: int, max_tokens: int) -> int:
    """Splits per (sequence, kv head) for a batch whose block table holds ``max_tokens`` tokens
    per sequence: one program per SM in all (at least one split, at most ``MAX_SPLITS``), each
    split at least ``MIN_SPLIT_TOKENS`` long."""
    pairs = max(1, n_seqs * n_kv_heads)
    want = sm_count(interpreter=4) // pairs
    return int(max(1, min(want, max_tokens // MIN_SPLIT_TOKENS, MAX_SPLITS)))


def _check_q(q):
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(f"q must have dtype in ({names}), got {q.dtype}")
    if q.ndim != 3:
        raise ValueError(f"q must be 3-D [n_seqs, n_heads, head_dim], got shape {tuple(q.shape)}")
    if q.stride(-1) != 1:
        raise ValueError("q must have a contiguous last dimension (head_dim)")


def _check(q, k_cache, v_cache, block_table, seq_lens, sm_scale, num_splits):
    _check_q(q)  # q may be a strided view (of a fused projection): head_dim must be contiguous
    _validate.tensor("k_cache", k_cache, dtypes=SUPPORTED_DTYPES, ndim=4)
    _validate.tensor("v_cache", v_cache, dtypes=SUPPORTED_DTYPES, ndim=4)
    _validate.same("k_cache", k_cache, "v_cache", v_cache)
    _validate.same("q", q, "k_cache", k_cache, shape=False)
    _validate.tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2)
    _validate.tensor("seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1)
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device} with q, got {t.device}")
    if device.GPU_MODE and not q.is_cuda:
        raise ValueError(f"q and the caches must be on a CUDA device, got {q.device}")
    n_seqs, n_heads, d = q.shape
    _, n_kv, page, d_kv = k_cache.shape
    if d_kv != d:
        raise ValueError(
            f"k_cache must be [num_blocks, n_kv_heads, block_size, head_dim] with q's head_dim {d}, "
            f"got shape {tuple(k_cache.shape)}"
        )
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {d}")
    _validate.positive_power_of_two("block_size (k_cache.shape[2])", page)
    if n_heads % n_kv:
        raise ValueError(
            f"q's n_heads ({n_heads}) must be a multiple of the caches' n_kv_heads ({n_kv})"
        )
    if block_table.shape[0] != n_seqs or seq_lens.shape[0] != n_seqs:
        raise ValueError(
            f"block_table and seq_lens need one row per sequence of q ({n_seqs}), got "
            f"{tuple(block_table.shape)} and {tuple(seq_lens.shape)}"
        )
    _check_num_splits(num_splits)
    if k_cache.shape[0] >= 2**31:
        raise ValueError(f"the pool must hold fewer than 2**31 blocks, got {k_cache.shape[0]}")
    _validate.sm_scale(sm_scale, d)


def check_block_ids(
    block_table, used: torch.Tensor, num_blocks: int, pool: str = "k_cache"
) -> None:
    """Every block id the kernel will read (``used``: a boolean mask over the table) lies in the
    pool ``[0, num_blocks)`` (``pool`` names the cache tensor in the message). Entries a sequence
    never reads may hold anything."""
    ids = block_table[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        bad = ids[(ids < 0) | (ids >= num_blocks)][0].item()
        raise ValueError(
            f"block_table holds block id {bad}, outside the pool of {num_blocks} blocks "
            f"({pool}.shape[0])"
        )


def check_lengths_and_blocks(
    block_table, seq_lens, num_blocks: int, page: int, pool: str = "k_cache"
) -> None:
    """The checks that read values (debug mode on a GPU; always on the CPU): every length within
    the block table's capacity and every block id a sequence reads inside the pool. Shared by every
    paged kernel (paged_decode, mla_decode, dsa.lightning_indexer)."""
    if seq_lens.numel() == 0:
        return
    capacity = block_table.shape[1] * page
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 0:
        raise ValueError(f"seq_lens must be >= 0, got {lo}")
    if hi > capacity:
        raise ValueError(
            f"seq_lens must be at most the block table's capacity (max_blocks {block_table.shape[1]}"
            f" x block_size {page} = {capacity} tokens), got {hi}"
        )
    # Only the entries a sequence reads: the first ceil(seq_len / block_size) of its row.
    n_used = (seq_lens.long() + page - 1) // page
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    check_block_ids(block_table, cols[None, :] < n_used[:, None], num_blocks, pool)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
    *,
    num_splits: int | None = None,
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged KV cache.

    ``q: [n_seqs, n_heads, head_dim]`` (any strides with head_dim contiguous, e.g. a slice of a
    fused projection); ``k_cache, v_cache: [num_blocks, n_kv_heads, block_size, head_dim]`` (fp16,
    bf16 or fp32, like q, contiguous; block_size a power of two); ``block_table: int32 [n_seqs,
    max_blocks]`` of block ids in ``[0, num_blocks)``; ``seq_lens: int32 [n_seqs]``, each in
    ``[0, max_blocks * block_size]``. Sequence ``b`` attends to its tokens ``0 … seq_lens[b] - 1``;
    an empty sequence gets zeros. Lengths and block ids are values on the device: they are checked
    (``ValueError``) on the CPU and in debug mode (``kernels._validate``), where reading them costs
    a host sync; otherwise the kernel never reads outside the pool or the table, and a sequence
    with a bad length or block id gets NaN. ``num_splits`` defaults to
    ``default_num_splits``. ``config = (BLOCK_N, num_warps, num_stages)`` skips the autotuner (one
    compilation instead of one per candidate: for checks at many small shapes). Returns
    ``[n_seqs, n_heads, head_dim]`` in q's dtype.
    """
    # A layout seen before, on a GPU, at the default split count and tile: launched from C++.
    replayable = _replayable(sm_scale, num_splits, config)
    inputs = (q, k_cache, v_cache, block_table, seq_lens)
    if replayable:
        out = replay.inference_call(replay.PAGED_DECODE, inputs, replay.scale_setting(sm_scale))
        if out is not None:
            return out
    layout = layout_key(inputs, num_splits, config)
    plan = _PLANS.get(layout)
    if plan is None:  # a layout not seen yet: check the inputs' structure, work out the launch
        _check(q, k_cache, v_cache, block_table, seq_lens, sm_scale, num_splits)
        _check_config(config)
        plan = _PLANS.put(layout, _plan(q, k_cache, block_table, num_splits, config))
    else:  # the settings are in the key by value (True == 1, 2.0 == 2): check their types
        _check_num_splits(num_splits)
        _check_config(config)
    scale = _validate.sm_scale(sm_scale, q.shape[2])
    if _validate.check_values(block_table, seq_lens):
        check_lengths_and_blocks(block_table, seq_lens, k_cache.shape[0], k_cache.shape[2])
    out = torch.empty(plan.out_shape, device=q.device, dtype=q.dtype)
    if plan.grid is None:  # no sequences or no heads
        return out
    if plan.part_shape is None:  # one split: the kernel writes the output
        o_dst = out
    else:  # the partial outputs and their log-sum-exps, one buffer
        o_dst = torch.empty(plan.part_numel, device=q.device, dtype=torch.float32)
    args = (q, k_cache, v_cache, block_table, seq_lens, o_dst, scale, *plan.sizes)
    split = tuned(_paged_decode_split_kernel)
    if config is None:
        split.keyed(layout, plan.grid, args, **plan.meta)
    else:  # one fixed tile, no autotuner
        split.fixed(plan.grid, args, **plan.meta, **plan.tile)
    if plan.part_shape is not None:
        args = (o_dst, out, plan.part_shape[2])
        _COMBINE(layout, _combine_grid(plan), args, **plan.combine_meta)
    if replayable and replay.planning(q):
        replay.build(_native_plan, inputs, plan, scale, replay.scale_setting(sm_scale), layout)
    return out


def _combine_grid(plan) -> tuple[int]:
    return (plan.out_shape[0] * plan.out_shape[1],)  # one program per (sequence, query head)


# ----------------------------------------------------------------------------- the C++ launch path

# Slots of kernels.replay's plan: the five inputs, the output, the split kernel's partials.
_Q, _K, _V, _TABLE, _LENS, _OUT, _PARTS = range(7)


def _replayable(sm_scale, num_splits, config) -> bool:
    """Whether a call may take the C++ path: the default split count and tile, a scale
    ``replay.scale_setting`` takes, and not in debug mode, whose value checks read the device."""
    return (
        num_splits is None
        and config is None
        and replay.scale_setting(sm_scale) is not None
        and not _validate.debug()
    )


def _native_plan(inputs, plan: _DecodePlan, scale: float, setting: float, layout) -> None:
    """The launches the Python path just made for this layout, as a plan: the split kernel at the
    config its autotuner chose, then (several splits) the combine."""
    S, A = replay.Slot, replay.Alloc
    slots = [None] * replay.N_SLOTS
    slots[: len(inputs)] = inputs
    allocs = [A(replay.NEW, _OUT, _Q, shape=plan.out_shape)]
    if plan.part_shape is not None:
        allocs.append(A(replay.NEW, _PARTS, _Q, dtype=replay.FP32, shape=(plan.part_numel,)))
    replay.materialize(allocs, slots)
    o_dst = _OUT if plan.part_shape is None else _PARTS
    args = (S(_Q), S(_K), S(_V), S(_TABLE), S(_LENS), S(o_dst), scale, *plan.sizes)
    # The config the autotuner chose for this layout: the one the launcher keeps for it (the
    # autotuner's best_config, the last call's, where nothing is kept: in the interpreter).
    cache = tuned(_paged_decode_split_kernel).cache
    kept = cache.get((torch.cuda.current_device(), layout)) if cache else None
    config = (kept[3] if kept else _paged_decode_split_kernel.best_config).all_kwargs()
    split = _paged_decode_split_kernel.fn
    steps = [replay.compiled_step(split, args, slots, plan.grid, {**plan.meta, **config})]
    if plan.part_shape is not None:
        args = (S(_PARTS), S(_OUT), plan.part_shape[2])
        combine, grid = _paged_decode_combine_kernel, _combine_grid(plan)
        steps.append(replay.compiled_step(combine, args, slots, grid, plan.combine_meta))
    prog = replay.Program(allocs, steps)
    replay.add_inference(replay.PAGED_DECODE, inputs, setting, prog, _OUT)


@dataclass(frozen=True)
class _DecodePlan:
    """What ``paged_decode`` works out from its inputs' layout alone, once per layout."""

    out_shape: tuple[int, int, int]
    part_shape: tuple[int, int, int, int] | None  # the fp32 partial outputs (None: one split)
    part_numel: int  # their buffer's values: the partial outputs, then one log-sum-exp per row
    sizes: tuple  # the split kernel's arguments after sm_scale: buckets, sizes, strides
    meta: dict
    tile: dict  # a fixed config's BLOCK_N, num_warps, num_stages ({} under the autotuner)
    grid: tuple[int, int, int] | None  # None: nothing to launch
    combine_meta: dict


# paged_decode's plans per input layout (kernels.launch.Plans): the structural checks and the launch
# arithmetic run once per layout; the layout key also keys the launchers.
_PLANS = Plans()


def _check_num_splits(num_splits) -> None:
    if num_splits is not None and (
        isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1
    ):
        raise ValueError(f"num_splits must be a positive int or None, got {num_splits!r}")


def _check_config(config) -> None:
    if config is not None and (
        not isinstance(config, tuple)
        or len(config) != 3
        or not all(isinstance(c, int) and c > 0 for c in config)
        or config[0] < 16
        or config[0] & (config[0] - 1)
    ):
        raise ValueError(
            f"config must be (BLOCK_N, num_warps, num_stages) with BLOCK_N a power of two >= 16, "
            f"got {config!r}"
        )


def _plan(q, k_cache, block_table, num_splits, config) -> _DecodePlan:
    n_seqs, n_heads, d = q.shape
    _, n_kv, page, _ = k_cache.shape
    tile = {}
    if config is not None:
        tile = {"BLOCK_N": config[0], "num_warps": config[1], "num_stages": config[2]}
    if n_seqs == 0 or n_heads == 0:
        return _DecodePlan((n_seqs, n_heads, d), None, 0, (), {}, tile, None, {})
    max_tokens = block_table.shape[1] * page
    splits = num_splits or default_num_splits(n_seqs, n_kv, max_tokens)
    group = n_heads // n_kv
    if splits == 1:  # the output itself, contiguous [n_seqs, n_heads, d]
        part_shape, o_strides = None, (n_heads * d, d, 0)
    else:  # fp32 partials [n_seqs, n_heads, splits, d], contiguous
        part_shape, o_strides = (n_seqs, n_heads, splits, d), (n_heads * splits * d, splits * d, d)
    sizes = (
        next_power_of_2(n_seqs), next_power_of_2(max_tokens), splits, group,
        k_cache.shape[0], max_tokens,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        *o_strides,
    )  # fmt: skip
    pdl = splits > 1 and pdl_supported()
    meta = dict(
        HEAD_DIM=d, PAGE_SIZE=page, GROUP_PAD=max(16, next_power_of_2(group)),
        DIRECT=splits == 1, FP32_EXACT=q.dtype == torch.float32, PDL=pdl,
    )  # fmt: skip
    combine_meta = dict(HEAD_DIM=d, SPLITS_PAD=next_power_of_2(splits), PDL=pdl)
    if pdl:
        combine_meta["launch_pdl"] = True
    part_numel = 0 if part_shape is None else n_seqs * n_heads * splits * (d + 1)
    return _DecodePlan(
        (n_seqs, n_heads, d), part_shape, part_numel, sizes, meta, tile, (n_seqs, n_kv, splits),
        combine_meta,
    )  # fmt: skip


# ----------------------------------------------------------------------------- references


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Tokens ``0 … length-1`` of each sequence as one contiguous tensor ``[n_seqs, n_kv_heads,
    length, head_dim]``, from ``cache: [num_blocks, n_kv_heads, block_size, head_dim]``.

    Positions past a sequence's own length read whatever its block table points at there (mask
    them). This costs a read and a write of every gathered byte: the price of calling a contiguous
    attention kernel on a paged cache."""
    page = cache.shape[2]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table[:, pos // page].long()  # [n_seqs, length]
    out = cache[blocks, :, pos % page, :]  # advanced indices first: [n_seqs, length, n_kv, d]
    return out.permute(0, 2, 1, 3)


def paged_decode_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """fp32 reference: gather each sequence's blocks, repeat kv heads for GQA, softmax(q kᵀ) v."""
    n_seqs, n_heads, d = q.shape
    n_kv, page = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    out = torch.zeros(n_seqs, n_heads, d, dtype=torch.float32, device=q.device)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        blocks = block_table[b, : cdiv(n, page)].long()
        k = k_cache[blocks].float().permute(1, 0, 2, 3).reshape(n_kv, -1, d)[:, :n]
        v = v_cache[blocks].float().permute(1, 0, 2, 3).reshape(n_kv, -1, d)[:, :n]
        k = k.repeat_interleave(n_heads // n_kv, 0)
        v = v.repeat_interleave(n_heads // n_kv, 0)
        s = torch.einsum("hd,hnd->hn", q[b].float(), k) * scale
        out[b] = torch.einsum("hn,hnd->hd", torch.softmax(s, -1), v)
    return out


def contiguous_to_paged(
    k: torch.Tensor, v: torch.Tensor, block_size: int, *, shuffle: bool = True, seed: int = 0
):
    """Copy a contiguous cache ``k, v: [n_seqs, n_kv_heads, seq, head_dim]`` into a block pool.

    Returns ``(k_cache, v_cache, block_table)``, the pool with ``n_seqs * seq / block_size`` blocks
    in a random order (``shuffle``): physical blocks of one sequence are scattered, as they are in a
    long-running server. ``seq`` must be a multiple of ``block_size``."""
    n_seqs, n_kv, seq, d = k.shape
    if seq % block_size:
        raise ValueError(f"seq ({seq}) must be a multiple of block_size ({block_size})")
    per_seq = seq // block_size
    n_blocks = n_seqs * per_seq
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n_blocks, generator=g) if shuffle else torch.arange(n_blocks)
    perm = perm.to(k.device)
    block_table = perm.view(n_seqs, per_seq).to(torch.int32)

    def pool(x):
        # [n_seqs, n_kv, per_seq, block, d] -> one block per (seq, logical block): [n_blocks, ...]
        blocks = x.view(n_seqs, n_kv, per_seq, block_size, d).permute(0, 2, 1, 3, 4)
        out = torch.empty(n_blocks, n_kv, block_size, d, device=x.device, dtype=x.dtype)
        out[perm] = blocks.reshape(n_blocks, n_kv, block_size, d)
        return out

    return pool(k), pool(v), block_table


def sdpa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str | None = None):
    """The baseline: PyTorch SDPA on a contiguous cache, ``q: [n_seqs, n_heads, d]``, ``k, v:
    [n_seqs, n_kv_heads, seq, d]``, GQA through ``enable_gqa`` (no copy of k and v).
    ``backend``: None (PyTorch's choice) or 'flash', 'efficient', 'cudnn', 'math'."""
    gqa = q.shape[1] != k.shape[1]
    return sdpa.sdpa(q.unsqueeze(2), k, v, backend=backend, enable_gqa=gqa).squeeze(2)


def kv_read_bytes(seq_lens, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """The bytes a decode-attention call must read: K and V of every cached token of every
    sequence, each once (q, the output and the block table are noise next to them)."""
    return int(sum(seq_lens)) * 2 * n_kv_heads * head_dim * dtype.itemsize


# ----------------------------------------------------------------------------- the block pool


class BlockAllocator:
    """A free list of physical block ids and, per sequence, the list of blocks it owns.

    Block ids below ``reserved`` are never handed out: block 0 is the *null block* that unused
    block-table entries point to (padding slots of a fixed-size batch write there harmlessly)."""

    def __init__(self, num_blocks: int, block_size: int, *, reserved: int = 1):
        if (
            isinstance(num_blocks, bool)
            or not isinstance(num_blocks, int)
            or num_blocks <= reserved
        ):
            raise ValueError(
                f"num_blocks must be an int > reserved ({reserved}), got {num_blocks!r}"
            )
        _validate.positive_power_of_two("block_size", block_size)
        self.num_blocks, self.block_size, self.reserved = num_blocks, block_size, reserved
        self._free = list(range(num_blocks - 1, reserved - 1, -1))  # pop() hands out low ids first
        self.blocks: dict[object, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.reserved - len(self._free)

    def blocks_needed(self, seq, n_tokens: int) -> int:
        """New blocks ``seq`` must get to hold ``n_tokens`` tokens in all."""
        have = len(self.blocks.get(seq, ()))
        return max(0, cdiv(n_tokens, self.block_size) - have)

    def can_hold(self, seq, n_tokens: int) -> bool:
        return self.blocks_needed(seq, n_tokens) <= len(self._free)

    def ensure(self, seq, n_tokens: int) -> list[int]:
        """Grow ``seq``'s block list to hold ``n_tokens`` tokens; returns the blocks it added.
        Raises ``MemoryError`` (and changes nothing) if the pool has too few free blocks."""
        need = self.blocks_needed(seq, n_tokens)
        if need > len(self._free):
            raise MemoryError(
                f"KV pool exhausted: {seq!r} needs {need} blocks, {self.num_free} free"
            )
        new = [self._free.pop() for _ in range(need)]
        self.blocks.setdefault(seq, []).extend(new)
        return new

    def free(self, seq) -> None:
        """Return every block of ``seq`` to the pool."""
        self._free.extend(reversed(self.blocks.pop(seq, [])))


@dataclass
class PagedKVCache:
    """The KV pool of every layer, ``k, v: [n_layers, num_blocks, n_kv_heads, block_size,
    head_dim]``, and the block table of ``max_seqs`` sequence slots.

    ``block_table_cpu`` is the host's copy, edited as sequences grow; ``sync()`` copies it to
    ``block_table`` (on the device) when it changed. Unused entries hold 0, the null block."""

    k: torch.Tensor
    v: torch.Tensor
    block_table: torch.Tensor
    block_table_cpu: torch.Tensor
    allocator: BlockAllocator
    _dirty: bool = False

    @classmethod
    def allocate(
        cls,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        num_blocks: int,
        block_size: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> PagedKVCache:
        shape = (n_layers, num_blocks, n_kv_heads, block_size, head_dim)
        k = torch.zeros(shape, dtype=dtype, device=device)
        v = torch.zeros(shape, dtype=dtype, device=device)
        table = torch.zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32)
        return cls(k, v, table.to(device), table, BlockAllocator(num_blocks, block_size))

    @property
    def block_size(self) -> int:
        return self.k.shape[3]

    @property
    def max_tokens_per_seq(self) -> int:
        return self.block_table.shape[1] * self.block_size

    def bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def ensure(self, slot: int, n_tokens: int) -> None:
        """Make sequence slot ``slot`` able to hold ``n_tokens`` tokens (allocating blocks)."""
        if n_tokens > self.max_tokens_per_seq:
            raise ValueError(
                f"n_tokens ({n_tokens}) exceeds the block table's {self.max_tokens_per_seq} tokens"
            )
        have = len(self.allocator.blocks.get(slot, ()))
        new = self.allocator.ensure(slot, n_tokens)
        if new:
            self.block_table_cpu[slot, have : have + len(new)] = torch.tensor(
                new, dtype=torch.int32
            )
            self._dirty = True

    def free(self, slot: int) -> None:
        self.allocator.free(slot)
        self.block_table_cpu[slot] = 0
        self._dirty = True

    def sync(self) -> None:
        if self._dirty:
            self.block_table.copy_(self.block_table_cpu, non_blocking=False)
            self._dirty = False


# ----------------------------------------------------------------------------- compile check

_SIG_SIZES = {
    "sm_scale": "fp32",
    "seqs_bucket": "i32",
    "tokens_bucket": "i32",
    "num_splits": "i32",
    "group": "i32",
    "num_blocks": "i32",
    "max_tokens": "i32",
}
_SIG_STRIDES = {
    n: "i32"
    for n in (
        "stride_qs",
        "stride_qh",
        "stride_kb",
        "stride_kh",
        "stride_kt",
        "stride_bt",
        "stride_os",
        "stride_oh",
        "stride_osplit",
    )
}


def _split_spec(t: str, splits: int, min_cc: int, pdl: bool = False) -> dict:
    out_t = t if splits == 1 else "fp32"
    return dict(
        kernel=_paged_decode_split_kernel.fn,
        signature={
            "q_ptr": f"*{t}",
            "k_ptr": f"*{t}",
            "v_ptr": f"*{t}",
            "block_table_ptr": "*i32",
            "seq_lens_ptr": "*i32",
            "out_ptr": f"*{out_t}",
            **_SIG_SIZES,
            **_SIG_STRIDES,
        },
        constexprs={
            "HEAD_DIM": 128,
            "PAGE_SIZE": 16,
            "GROUP_PAD": 16,
            "DIRECT": splits == 1,
            "FP32_EXACT": t == "fp32",
            "PDL": pdl,
            "BLOCK_N": 64,
        },
        options={"num_warps": 4, "num_stages": 3},
        min_cc=min_cc,
    )


def _combine_spec(t: str, head_dim: int, min_cc: int, pdl: bool = False) -> dict:
    return dict(
        kernel=_paged_decode_combine_kernel,
        signature={
            "o_part_ptr": "*fp32",
            "out_ptr": f"*{t}",
            "num_splits": "i32",
        },
        constexprs={"HEAD_DIM": head_dim, "SPLITS_PAD": 8, "PDL": pdl},
        options={"launch_pdl": True} if pdl else None,
        min_cc=min_cc,
    )


# bf16 dots need Ampere (8.0); Turing (sm_75) builds the fp16 and fp32 variants; the
# programmatic-dependent-launch pair (griddepcontrol) needs Hopper (9.0).
COMPILE_SPECS = [
    _split_spec("bf16", 8, 80),
    _split_spec("bf16", 8, 90, pdl=True),
    _combine_spec("bf16", 128, 90, pdl=True),
    _split_spec("bf16", 1, 80),
    _split_spec("fp16", 8, 0),
    _split_spec("fp32", 1, 0),
    _combine_spec("bf16", 128, 80),
    _combine_spec("fp16", 64, 0),
]


# ----------------------------------------------------------------------------- benchmark


def sdpa_backends(dtype: torch.dtype = torch.bfloat16, n_heads: int = 32, n_kv: int = 8) -> list:
    """The SDPA backends that run a GQA decode (one query, ``enable_gqa``) on this machine."""
    return [
        b
        for b in ("flash", "efficient", "cudnn", "math")
        if sdpa.available(b, dtype, 128, n_heads=n_heads, n_kv_heads=n_kv, n_q=1)
    ]


def decode_case(
    batch: int,
    seq: int,
    *,
    n_heads: int = 32,
    n_kv: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    shuffle: bool = True,
):
    """Random q and a contiguous cache of ``batch`` sequences of ``seq`` tokens, and the same cache
    in a block pool (blocks in random order, or in order with ``shuffle=False``). Returns
    ``(q, k, v, k_cache, v_cache, block_table, seq_lens)``."""
    g = torch.Generator(device=device.DEVICE).manual_seed(seed)
    dev = device.DEVICE
    q = torch.randn(batch, n_heads, head_dim, device=dev, dtype=dtype, generator=g)
    k = torch.randn(batch, n_kv, seq, head_dim, device=dev, dtype=dtype, generator=g)
    v = torch.randn(batch, n_kv, seq, head_dim, device=dev, dtype=dtype, generator=g)
    k_cache, v_cache, table = contiguous_to_paged(k, v, block_size, shuffle=shuffle, seed=seed)
    lens = torch.full((batch,), seq, dtype=torch.int32, device=dev)
    return q, k, v, k_cache, v_cache, table, lens


def _paged_decode_records(batch, seq, dtype, backends, copy_gbps) -> list[dict]:
    """One batch size of the benchmark (its caches are freed on return)."""
    q, k, v, kc, vc, table, lens = decode_case(batch, seq, dtype=dtype)
    nbytes = kv_read_bytes([seq] * batch, 8, 128, dtype)
    shape = [batch, 32, 8, seq, 128]
    base = {b: bench.measure(lambda b=b: sdpa_decode(q, k, v, b), bytes=nbytes) for b in backends}
    best = min(base, key=lambda b: base[b].ms)
    ours = bench.measure(lambda: paged_decode(q, kc, vc, table, lens), bytes=nbytes)
    ceil = ("copy", copy_gbps)
    recs = [
        bench.record(
            "paged_decode", "triton", shape, dtype, ours,
            baseline=(f"sdpa-{best}", base[best]), ceiling=ceil,
        )
    ]  # fmt: skip
    for b, m in base.items():
        recs.append(bench.record("paged_decode", f"sdpa-{b}", shape, dtype, m, ceiling=ceil))
    return recs


@bench.register("paged_decode")
def _bench_paged_decode(quick: bool) -> list[dict]:
    """Decode attention at long context: ours on a shuffled paged cache against SDPA on a
    contiguous one, in GB/s of KV read and as a fraction of the measured copy bandwidth."""
    dtype = device.preferred_dtype(torch.bfloat16)
    copy = roofline.copy_bandwidth()
    seq = device.pick(32768, 256)
    # The math backend copies K and V once per query head of a group: far too slow and big here.
    fused = [b for b in sdpa_backends(dtype) if b != "math"] if device.GPU_MODE else []
    backends = fused or ["math"]
    recs = []
    for batch in device.pick([8] if quick else [8, 16, 32], [2]):
        recs += _paged_decode_records(batch, seq, dtype, backends, copy.value)
    return recs
