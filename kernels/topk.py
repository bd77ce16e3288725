"""The ``k`` largest scores of each row, as token ids: a radix select in seven launches.

``torch.topk`` on a long row (DeepSeek sparse attention picks 2,048 of up to 128K tokens per query)
runs as a radix select of its own, about twenty launches per call on an H100 (Nsight Systems, Lab
6c), so a decode step spends more time launching it than reading its scores. This module does the
same select in a fixed number of launches, whatever the row length, every one of them spread over
chunks of ``CHUNK`` scores (a grid of rows x chunks, so a batch of 8 long rows fills the GPU):

1. Each fp32 score becomes a 32-bit key whose unsigned order is the float order (``_ukey``).
2. Four histogram passes narrow down the key of the k-th largest score, 8 bits at a time; each
   program adds its chunk's histogram into the row's with atomics. Every program of a later pass
   finds the bin holding the k-th largest key from the earlier histograms on its own (``_pick``),
   so no launch sits in between. After the fourth pass the threshold key is exact, and so is the
   number of keys equal to it that belong to the top k (``_threshold``).
3. A count pass writes, per chunk, how many of its keys lie above the threshold and how many equal
   it; a write pass sums the counts of the chunks before its own and writes its ids after theirs.

With the zeroed buffer for the histograms that is seven launches. Why 8-bit digits: ``tl.histogram``
builds a warp's histogram with one ballot per bit of the bin index and then has every lane test each
bin it owns (``BINS / 32`` of them) against every ballot, so its cost per key grows with the bin
count. A first version with three passes of 12, 12 and 8 bits (4,096 bins) spent about 45 us per
histogram launch on an H100, whatever the row length: 229 us for 8 rows of 4,096 scores, ten times
``torch.topk``. The ids come out in ascending
order, ties at the threshold go to the lower ids, and the bits are the same on every run: with
distinct scores the set is ``torch.topk``'s. Rows of ``k`` scores or fewer need no select: one
launch writes every id.

``topk_ids(scores, k, positions=None)``: ``fp32 [R, n]`` -> ``int32 [R, k]``; an id past
``positions[r]`` (or, without positions, an id whose score is -inf) is written as -1, as are the
slots past ``n`` when ``k > n``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _validate
from kernels.launch import Launcher, aligned, cdiv, next_power_of_2

CHUNK = 1024  # scores per program in every pass
RADIX = 8  # key bits per histogram pass: four passes of 256 bins
BINS = 1 << RADIX
PASSES = 32 // RADIX
HIST = PASSES * BINS  # int32 counts per row: the four histograms side by side


@triton.jit
def _signed_key(x):
    # fp32 -> int32 whose signed order is the float order: a negative float's 31 low bits are
    # flipped (a larger magnitude is a smaller value). NaN sorts above +inf, as in torch.topk.
    i = x.to(tl.int32, bitcast=True)
    return i ^ ((i >> 31) & 0x7FFFFFFF)


@triton.jit
def _ukey(x):
    # The same order as unsigned bits: the sign bit flipped, so that digits read off the top of
    # the key (arithmetic shifts, then a mask) count up with the score.
    return _signed_key(x) ^ -2147483648


@triton.jit
def _pick(hist_ptr, need, BINS: tl.constexpr):
    # The bin that holds the need-th largest key, counting down from the top bin, and how many
    # keys of that bin still belong to the top (1 to the bin's count).
    i = tl.arange(0, BINS)
    h = tl.load(hist_ptr + (BINS - 1) - i)  # top bin first
    c = tl.cumsum(h, 0)
    j = tl.min(tl.where(c >= need, i, BINS), 0)
    at = i == j
    h_j = tl.sum(tl.where(at, h, 0), 0)
    c_j = tl.sum(tl.where(at, c, 0), 0)
    return (BINS - 1) - j, need - (c_j - h_j)


@triton.jit
def _prefix(hist_ptr, k, DONE: tl.constexpr, RADIX: tl.constexpr):
    # The top DONE digits of the k-th largest key, read off the first DONE histograms, and how many
    # keys that share them still belong to the top k.
    prefix = tl.zeros((), tl.int32)
    need = k
    for p in tl.static_range(DONE):
        d, need = _pick(hist_ptr + p * (1 << RADIX), need, 1 << RADIX)
        prefix = (prefix << RADIX) | d
    return prefix, need


@triton.jit
def _hist_kernel(
    # pointers
    scores_ptr,
    hist_ptr,
    # sizes
    n,
    k,
    # meta-parameters
    PASS: tl.constexpr,
    RADIX: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # Pass p counts digit p (RADIX bits, from the top) of the keys whose higher digits match those of
    # the k-th largest key, which the earlier passes' histograms give (_prefix). Few bins on purpose:
    # tl.histogram's cost per key grows with the bin count (each lane owns BINS / 32 bins). Grid:
    # (rows, chunks of the row): rows on the axis without the 65,535 limit, since a prefill chunk of
    # a large batch has more query rows than that.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    in_row = offs < n
    u = _ukey(tl.load(scores_ptr + row * n + offs, mask=in_row, other=0.0))
    hist = hist_ptr + row * (32 // RADIX) * (1 << RADIX)
    match = in_row
    if PASS > 0:
        prefix, _ = _prefix(hist, k, PASS, RADIX)
        above = (u >> (32 - RADIX * PASS)) & ((1 << (RADIX * PASS)) - 1)
        match = match & (above == prefix)
    digit = (u >> (32 - RADIX * (PASS + 1))) & ((1 << RADIX) - 1)
    counts = tl.histogram(digit, 1 << RADIX, mask=match)
    bins = hist + PASS * (1 << RADIX) + tl.arange(0, 1 << RADIX)
    tl.atomic_add(bins, counts, mask=counts > 0, sem="relaxed")


@triton.jit
def _threshold(hist_ptr, k, RADIX: tl.constexpr):
    # The exact key of the k-th largest score (signed form) and how many keys equal to it belong to
    # the top k, from the row's histograms.
    key, need = _prefix(hist_ptr, k, 32 // RADIX, RADIX)
    return key ^ -2147483648, need


@triton.jit
def _count_kernel(
    # pointers
    scores_ptr,
    hist_ptr,
    counts_ptr,
    # sizes
    n,
    k,
    n_chunks,
    # meta-parameters
    RADIX: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # Per chunk: how many keys lie above the threshold and how many equal it. Grid: (rows, chunks).
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    threshold, _ = _threshold(hist_ptr + row * (32 // RADIX) * (1 << RADIX), k, RADIX)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    in_row = offs < n
    key = _signed_key(tl.load(scores_ptr + row * n + offs, mask=in_row, other=0.0))
    above = tl.sum((in_row & (key > threshold)).to(tl.int32), 0)
    equal = tl.sum((in_row & (key == threshold)).to(tl.int32), 0)
    counts = counts_ptr + (row * n_chunks + chunk) * 2
    tl.store(counts, above)
    tl.store(counts + 1, equal)


@triton.jit
def _write_kernel(
    # pointers (hist_ptr and counts_ptr unused when ALL; pos_ptr unused without HAS_POS)
    scores_ptr,
    hist_ptr,
    counts_ptr,
    pos_ptr,
    out_ptr,
    # sizes
    n,
    k,
    n_chunks,
    # meta-parameters
    ALL: tl.constexpr,
    HAS_POS: tl.constexpr,
    RADIX: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # Per chunk: the ids of its keys above the threshold and of its keys equal to it that come
    # first among the row's ties, packed after the ids that the chunks before it wrote (the counts
    # tell how many); -1 for ids the query does not see. With ALL (k >= n), every id, and -1 in
    # the slots past n. Grid: (rows, chunks of max(n, k)).
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    in_row = offs < n
    x = tl.load(scores_ptr + row * n + offs, mask=in_row, other=0.0)
    if ALL:
        take = in_row
        slot = offs
    else:
        threshold, need = _threshold(hist_ptr + row * (32 // RADIX) * (1 << RADIX), k, RADIX)
        c = tl.arange(0, BLOCK_C)
        before = c < chunk
        counts = counts_ptr + (row * n_chunks + c) * 2
        above_before = tl.sum(tl.load(counts, mask=before, other=0), 0)
        equal_before = tl.sum(tl.load(counts + 1, mask=before, other=0), 0)
        key = _signed_key(x)
        above = in_row & (key > threshold)
        equal = in_row & (key == threshold)
        tie_rank = equal_before + tl.cumsum(equal.to(tl.int32), 0) - 1
        take = above | (equal & (tie_rank < need))
        first = above_before + tl.minimum(equal_before, need)  # slots the chunks before filled
        slot = first + tl.cumsum(take.to(tl.int32), 0) - 1
    if HAS_POS:
        seen = offs <= tl.load(pos_ptr + row)
    else:
        seen = x > float("-inf")
    out = out_ptr + row * k
    tl.store(out + slot, tl.where(seen, offs, -1), mask=take)
    if ALL:
        tl.store(out + offs, tl.full([CHUNK], -1, tl.int32), mask=(offs >= n) & (offs < k))


_HIST = Launcher(_hist_kernel)
_COUNT = Launcher(_count_kernel)
_WRITE = Launcher(_write_kernel)


def topk_ids(scores: torch.Tensor, k: int, positions: torch.Tensor | None = None) -> torch.Tensor:
    """The ids of the ``k`` largest scores of each row of ``scores`` (fp32 ``[R, n]``, contiguous),
    as int32 ``[R, k]`` in ascending id order. An id past ``positions[r]`` (int32 ``[R]``; -1: the
    row sees nothing) is written as -1; without ``positions``, so is an id whose score is -inf; and
    so is every slot past ``n`` when ``k > n``. Ties at the k-th score go to the lower ids, so the
    set is ``torch.topk``'s with distinct scores, and the bits are the same on every run."""
    _validate.tensor("scores", scores, dtypes=(torch.float32,), ndim=2)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")
    if not scores.is_contiguous():
        raise ValueError("scores must be contiguous")
    rows, n = scores.shape
    if positions is not None:
        _validate.tensor("positions", positions, dtypes=(torch.int32,), ndim=1)
        if positions.shape[0] != rows or positions.device != scores.device:
            raise ValueError(
                f"positions must be int32 [{rows}] on {scores.device}, got "
                f"{tuple(positions.shape)} on {positions.device}"
            )
        positions = positions.contiguous()
    out = torch.empty((rows, k), dtype=torch.int32, device=scores.device)
    if rows == 0:
        return out
    every = k >= n
    n_chunks = cdiv(n, CHUNK)
    pos = positions if positions is not None else out  # a placeholder pointer when unused
    meta = dict(ALL=every, HAS_POS=positions is not None, RADIX=RADIX, CHUNK=CHUNK)
    meta["BLOCK_C"] = 1 if every else next_power_of_2(n_chunks)
    key = (rows, n, k, aligned(scores), aligned(pos), *meta.values())
    if every:
        args = (scores, out, out, pos, out, n, k, n_chunks)
        _WRITE(key, (rows, cdiv(k, CHUNK)), args, **meta)
        return out
    # One zeroed buffer: each row's four histograms, then its per-chunk counts (written, not added).
    work = torch.zeros(rows * (HIST + 2 * n_chunks), dtype=torch.int32, device=scores.device)
    hist, counts = work[: rows * HIST], work[rows * HIST :]
    grid = (rows, n_chunks)
    for p in range(PASSES):
        _HIST((*key, p), grid, (scores, hist, n, k), PASS=p, RADIX=RADIX, CHUNK=CHUNK)
    _COUNT(key, grid, (scores, hist, counts, n, k, n_chunks), RADIX=RADIX, CHUNK=CHUNK)
    _WRITE(key, grid, (scores, hist, counts, pos, out, n, k, n_chunks), **meta)
    return out


# The ahead-of-time compile check (tests compile every kernel for sm_90 and sm_75).
COMPILE_SPECS = (
    [
        dict(
            kernel=_hist_kernel,
            signature={"scores_ptr": "*fp32", "hist_ptr": "*i32", "n": "i32", "k": "i32"},
            constexprs={"PASS": p, "RADIX": RADIX, "CHUNK": CHUNK},
        )
        for p in range(PASSES)
    ]
    + [
        dict(
            kernel=_count_kernel,
            signature={
                "scores_ptr": "*fp32",
                "hist_ptr": "*i32",
                "counts_ptr": "*i32",
                "n": "i32",
                "k": "i32",
                "n_chunks": "i32",
            },
            constexprs={"RADIX": RADIX, "CHUNK": CHUNK},
        )
    ]
    + [
        dict(
            kernel=_write_kernel,
            signature={
                "scores_ptr": "*fp32",
                "hist_ptr": "*i32",
                "counts_ptr": "*i32",
                "pos_ptr": "*i32",
                "out_ptr": "*i32",
                "n": "i32",
                "k": "i32",
                "n_chunks": "i32",
            },
            constexprs={
                "ALL": every,
                "HAS_POS": True,
                "RADIX": RADIX,
                "CHUNK": CHUNK,
                "BLOCK_C": 128,
            },
        )
        for every in (False, True)
    ]
)
