"""Collectives on torch.distributed: a ring all-reduce built from send/recv, bus bandwidth, the
alpha-beta cost model, and a timer that every rank runs in lockstep.

``ring_all_reduce(tensor, group=None)`` sums ``tensor`` over the ranks of ``group`` in place, like
``dist.all_reduce``, but written on point-to-point messages: the flat tensor is cut into ``n`` chunks,
``n - 1`` reduce-scatter steps leave each rank with one fully summed chunk, and ``n - 1`` all-gather
steps pass the summed chunks round the ring. Each rank sends and receives ``2 (n - 1) / n`` of the
tensor, the least any all-reduce built from sends and receives can move (Patarasuk and Yuan, 2009).
It runs on NCCL (CUDA tensors) and gloo (CPU tensors) alike; on NCCL nothing in it waits on the host.

Bandwidths follow nccl-tests (doc/PERFORMANCE.md): ``algbw = S / t`` for an operation on ``S`` bytes
(for all-gather and reduce-scatter ``S`` is the full, gathered size) and ``busbw = algbw * factor``,
with factor ``2 (n - 1) / n`` for all-reduce and ``(n - 1) / n`` for all-gather, reduce-scatter and
all-to-all, so that ``busbw`` can be held against one link's bandwidth whatever ``n`` is.
GB/s means 1e9 bytes per second, as in nccl-tests and ``kernels.bench``.

Every function that communicates must be called by every rank of the group, in the same order, with
tensors of the same shape and dtype; none of them checks that the other ranks did.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from kernels import bench, distributed
from kernels.distributed import barrier, chunk_bounds  # their home; C.barrier, C.chunk_bounds

# Sub-chunks of this many bytes are sent, received and summed one after the other, so the sum of one
# sub-chunk overlaps the transfer of the next. Splitting has a price: NCCL's send/recv bandwidth keeps
# rising with the message size (on two NVLink H200s, 165 GB/s at 64 MiB and 352 GB/s at 1 GiB), so
# smaller transfers lose more than the hidden additions win. notebooks/05a-collectives.ipynb sweeps
# the choice; there one whole chunk per transfer beat every split up to 1 GiB tensors, so only
# chunks larger than 1 GiB are split by default.
DEFAULT_SUB_CHUNK_BYTES = 2**30
MAX_SUB_CHUNKS = 64

SUPPORTED_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
)

# nccl-tests' correction from algorithm to bus bandwidth, as a function of the number of ranks.
BUSBW_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send_recv": lambda n: 1.0,
}


# ----------------------------------------------------------------------------- the ring


def ring_schedule(n: int, rank: int) -> list[tuple[str, int, int]]:
    """The ``2 (n - 1)`` steps of the ring on ``rank``: ``(phase, chunk sent right, chunk received
    from the left)``. In the reduce-scatter phase the received chunk is added to the local one; in
    the all-gather phase it overwrites it. After step ``n - 2`` rank ``r`` holds the full sum of chunk
    ``(r + 1) % n``."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if not 0 <= rank < n:
        raise ValueError(f"rank must be in [0, {n}), got {rank}")
    steps = [("reduce-scatter", (rank - s) % n, (rank - s - 1) % n) for s in range(n - 1)]
    steps += [("all-gather", (rank + 1 - t) % n, (rank - t) % n) for t in range(n - 1)]
    return steps


def _check(tensor, group, sub_chunk_bytes) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ring_all_reduce needs an initialised process group: call "
            "torch.distributed.init_process_group first (torchrun sets up the environment)"
        )
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(f"tensor must have dtype in ({names}), got {tensor.dtype}")
    if tensor.layout != torch.strided:
        raise ValueError(f"tensor must be dense (strided), got layout {tensor.layout}")
    if not tensor.is_contiguous():
        raise ValueError("tensor must be contiguous (the ring works on tensor.view(-1) in place)")
    if isinstance(sub_chunk_bytes, bool) or not isinstance(sub_chunk_bytes, int):
        raise TypeError(f"sub_chunk_bytes must be an int, got {type(sub_chunk_bytes).__name__}")
    if sub_chunk_bytes <= 0:
        raise ValueError(f"sub_chunk_bytes must be positive, got {sub_chunk_bytes}")
    backend = str(dist.get_backend(group)).lower()
    if tensor.is_cuda and "nccl" not in backend:
        raise ValueError(f"tensor is on {tensor.device}, but the group's backend is {backend!r}")
    if not tensor.is_cuda and "gloo" not in backend:
        raise ValueError(
            f"tensor is on {tensor.device}; the {backend!r} backend needs CUDA tensors"
        )


def ring_all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    sub_chunk_bytes: int = DEFAULT_SUB_CHUNK_BYTES,
) -> torch.Tensor:
    """Sum ``tensor`` over the ranks of ``group`` in place, with a ring of send/recv; returns it.

    The result equals ``dist.all_reduce(tensor)`` (SUM) up to the order of the additions: exact for
    integers and for two ranks, within rounding for floats on more ranks. Every rank ends with
    bitwise the same values. Each of the ``n`` chunks is cut into sub-chunks of at most
    ``sub_chunk_bytes`` that are pipelined: sub-chunk ``j`` is summed while ``j + 1`` is on the wire.
    """
    _check(tensor, group, sub_chunk_bytes)
    n = dist.get_world_size(group)
    if n == 1 or tensor.numel() == 0:
        return tensor
    if tensor.numel() < n:
        # Fewer elements than ranks: some chunks would be empty and some ranks would sit out a step,
        # so pad to one element per rank; the copies cost nothing at this size.
        padded = torch.zeros(n, dtype=tensor.dtype, device=tensor.device)
        padded[: tensor.numel()] = tensor.view(-1)
        ring_all_reduce(padded, group, sub_chunk_bytes=sub_chunk_bytes)
        tensor.view(-1).copy_(padded[: tensor.numel()])
        return tensor

    rank = dist.get_rank(group)
    pg = group if group is not None else dist.group.WORLD
    right = dist.get_global_rank(pg, (rank + 1) % n)
    left = dist.get_global_rank(pg, (rank - 1) % n)
    flat = tensor.view(-1)
    chunks = chunk_bounds(flat.numel(), n)
    longest = chunks[0][1] - chunks[0][0]
    shortest = chunks[-1][1] - chunks[-1][0]  # >= 1 because numel >= n
    # Every rank computes the same split from (numel, n, itemsize), so sends and receives match.
    k = math.ceil(longest * flat.element_size() / sub_chunk_bytes)
    k = max(1, min(k, shortest, MAX_SUB_CHUNKS))
    subs = [chunk_bounds(stop - start, k) for start, stop in chunks]

    def piece(chunk: int, j: int) -> torch.Tensor:
        lo, hi = subs[chunk][j]
        return flat[chunks[chunk][0] + lo : chunks[chunk][0] + hi]

    # One receive buffer per sub-chunk: sub-chunk j's next transfer is issued only after its sum has
    # been queued, and the NCCL stream waits for the queue, so the buffer is never overwritten early.
    width = subs[0][0][1] - subs[0][0][0]
    scratch = torch.empty(k, width, dtype=flat.dtype, device=flat.device)

    def exchange(send: torch.Tensor, recv: torch.Tensor) -> list:
        # One grouped send + receive: on NCCL a single fused kernel, so two neighbours that send to
        # each other (n = 2) cannot deadlock the way two separate blocking calls could.
        return dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, send, right, pg), dist.P2POp(dist.irecv, recv, left, pg)]
        )

    def wait(works: list) -> None:
        # NCCL: makes the current stream wait for the transfer (no host sync). gloo: blocks.
        for w in works:
            w.wait()

    schedule = ring_schedule(n, rank)
    rs, ag = schedule[: n - 1], schedule[n - 1 :]

    def rs_exchange(step: int, j: int) -> list:
        _, send, recv = rs[step]
        return exchange(piece(send, j), scratch[j, : piece(recv, j).numel()])

    # Reduce-scatter, software-pipelined over sub-chunks: issue every sub-chunk's first transfer,
    # then for each one in turn wait, add in place and issue what depends on that sum.
    pending = [rs_exchange(0, j) for j in range(k)]
    for step in range(n - 1):
        for j in range(k):
            wait(pending[j])
            dst = piece(rs[step][2], j)
            dst.add_(scratch[j, : dst.numel()])
            if step + 1 < n - 1:
                pending[j] = rs_exchange(step + 1, j)
            else:  # this sub-chunk is fully summed: its first all-gather transfer can leave
                _, send, recv = ag[0]
                pending[j] = exchange(piece(send, j), piece(recv, j))
    # All-gather: received chunks land in place and are forwarded on the next step.
    for step in range(1, n - 1):
        for j in range(k):
            wait(pending[j])
            _, send, recv = ag[step]
            pending[j] = exchange(piece(send, j), piece(recv, j))
    for works in pending:
        wait(works)
    return tensor


def ring_all_reduce_ref(tensor: torch.Tensor, group: dist.ProcessGroup | None = None):
    """The reference: a copy of ``tensor`` summed by the library's own ``dist.all_reduce``."""
    out = tensor.clone()
    dist.all_reduce(out, group=group)
    return out


# ----------------------------------------------------------------------------- library collectives


def all_gather(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``out = cat(inp of every rank)``: ``all_gather_single`` where torch has it (2.13 deprecates
    ``all_gather_into_tensor``), else ``all_gather_into_tensor`` (2.11)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group=None, async_op: bool = False):
    """``out = (sum over ranks of inp)[rank's slice]``, under whichever name this torch has."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


# ----------------------------------------------------------------------------- bandwidth and cost


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' factor from algorithm to bus bandwidth for ``op`` on ``n`` ranks."""
    if op not in BUSBW_FACTORS:
        raise ValueError(f"op must be one of {sorted(BUSBW_FACTORS)}, got {op!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    return BUSBW_FACTORS[op](n)


def bandwidths(op: str, nbytes: float, seconds: float, n: int) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s for ``op`` on ``nbytes`` (the full-size buffer) in ``seconds``."""
    if seconds <= 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    algbw = nbytes / seconds / 1e9
    return algbw, algbw * busbw_factor(op, n)


def ring_cost(op: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Alpha-beta time of the ring algorithm, in seconds: each step costs ``alpha`` (latency, s) plus
    its bytes times ``beta`` (s per byte, the inverse of one link's bandwidth).

    all-reduce: ``2 (n - 1) alpha + 2 (n - 1) / n * S * beta``; all-gather and reduce-scatter:
    ``(n - 1) alpha + (n - 1) / n * S * beta``, with ``S`` the full buffer size.
    """
    steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1}
    if op not in steps:
        raise ValueError(f"op must be one of {sorted(steps)}, got {op!r}")
    return steps[op] * alpha + busbw_factor(op, n) * nbytes * beta


def tree_all_reduce_cost(nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Idealised pipelined (double binary) tree all-reduce: the latency term grows as ``log2 n``
    (a reduce up the tree and a broadcast down it) while, pipelined over two complementary trees,
    the bandwidth term matches the ring's ``2 (n - 1) / n * S * beta``."""
    return (
        2 * math.ceil(math.log2(max(n, 2))) * alpha + busbw_factor("all_reduce", n) * nbytes * beta
    )


def fit_alpha_beta(
    op: str, nbytes: Sequence[float], seconds: Sequence[float], n: int
) -> tuple[float, float]:
    """Non-negative least-squares ``(alpha, beta)`` of ``ring_cost`` to measured times, weighting
    each point by ``1 / time`` so that microsecond latencies and millisecond transfers count alike.
    (Noisy timings can make the unconstrained fit negative; then the better one-term fit wins.)"""
    import numpy as np

    if len(nbytes) != len(seconds) or len(nbytes) < 2:
        raise ValueError("need at least two (nbytes, seconds) points of equal length")
    steps = ring_cost(op, 0, n, 1.0, 0.0)
    t = np.asarray(seconds, dtype=float)
    if np.any(t <= 0):
        raise ValueError("seconds must all be positive")
    a = np.array([[steps, busbw_factor(op, n) * s] for s in nbytes], dtype=float) / t[:, None]
    y = np.ones_like(t)  # t / t: the weighted target
    candidates = [np.linalg.lstsq(a, y, rcond=None)[0]]
    for j in (0, 1):  # one term only
        coef = np.zeros(2)
        coef[j] = max(float(a[:, j] @ y) / float(a[:, j] @ a[:, j]), 0.0)
        candidates.append(coef)
    feasible = [c for c in candidates if np.all(c >= 0)]
    best = min(feasible, key=lambda c: float(np.sum((a @ c - y) ** 2)))
    return float(best[0]), float(best[1])


# ----------------------------------------------------------------------------- timing


def time_collective(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int = 5,
    reps: int = 20,
    inner: int = 1,
    group=None,
    host: bool = False,
) -> float:
    """Median seconds per call of ``fn`` (a collective every rank calls), from the slowest rank.

    ``kernels.bench.measure`` picks its repetition count from a first timing, which differs from rank
    to rank, and ranks that call a collective a different number of times hang. Here the counts are
    fixed: ``warmup`` calls, then ``reps`` samples, each a barrier followed by ``inner`` back-to-back
    calls timed with CUDA events (``perf_counter`` on CPU). Each rank takes its median per call; the
    result is the largest median over the ranks. ``host=True`` times instead how long the calls
    take to return on the host (``perf_counter``, the GPU left to finish: the next sample's barrier
    waits for it), which tells a host-bound step from a GPU-bound one.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        barrier(device, group)
        if device.type == "cuda" and not host:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times.append((time.perf_counter() - t0) / inner)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return float(slowest.item())


# ----------------------------------------------------------------------------- registered benchmark


def row_measurement(row: dict) -> bench.Measurement:
    """A ``bench.Measurement`` from one row of ``scripts/dist/collectives_bench.py`` (its time is the
    slowest rank's median, the only statistic ``time_collective`` keeps; GB/s is bus bandwidth)."""
    ms = row["seconds"] * 1e3
    return bench.Measurement(ms, ms, ms, row["busbw"], None, True)


@bench.register("collectives")
def _bench_collectives(quick: bool) -> list[dict]:
    """Ring all-reduce and NCCL's collectives at large sizes on every GPU of this machine (torchrun,
    one process per GPU). Baseline: NCCL's all-reduce; ceiling: the measured send/recv bus bandwidth.
    Bandwidths in the records are bus bandwidths (GB/s)."""
    plan = distributed.plan()
    if not plan.gpu:
        print("collectives: needs two or more GPUs (NCCL); skipped")
        return []
    sizes = [256 * 2**20] if quick else [256 * 2**20, 2**30]
    res = distributed.torchrun(
        "collectives_bench.py",
        plan.nproc,
        ["--sizes", *sizes, "--reps", 10, "--check-numel", 4099],
        backend=plan.backend,
    )

    records = []
    for size in sorted({r["bytes"] for r in res["rows"]}):
        rows = {r["op"]: r for r in res["rows"] if r["bytes"] == size}
        nccl = row_measurement(rows["all_reduce"])
        ceiling = ("send_recv_busbw", rows["send_recv"]["busbw"])
        for op in ("ring_all_reduce", "all_reduce", "all_gather", "reduce_scatter"):
            records.append(
                bench.record(
                    f"collectives_{op}",
                    f"{'course ring' if op.startswith('ring') else 'nccl'} x{res['world']}",
                    [size // 4],
                    "float32",
                    row_measurement(rows[op]),
                    baseline=("nccl_all_reduce", nccl) if op == "ring_all_reduce" else None,
                    ceiling=ceiling,
                )
            )
    return records
