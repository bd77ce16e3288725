"""Evidence for the open hypotheses of four pages: Nsight Compute profiles and plain timings.

    bash scripts/gpu/profile_misses.sh [OUTDIR] [moe hgemm mla]  # on a GPU: ncu + timings
    python scripts/gpu/profile_misses.py TOPIC --part profile   # what ncu runs
    python scripts/gpu/profile_misses.py TOPIC --part time      # the timings, no profiler
    python scripts/gpu/profile_misses.py TOPIC --smoke          # toy shapes on a CPU

Topics, and the hypotheses each settles:

- ``mla`` (acts/act6-serving-4-long-context.md, "MLA decode"). *A fixed cost per call*: batch 1 at
  4k and 32k timed by ``bench.measure``, with the host hidden (``device_only``), inside a CUDA graph
  (no host at all) and as host µs per call; if the graph is much faster, the host's launcher work
  is the floor. DSA's decode step at batch 8, 64k the same way. *A slow steady state*: at batch 128
  and 32k, ncu's local-memory (spill) traffic, stalls, DRAM and tensor-pipe use of the autotuned
  tile and of a tile that does not spill, and each fixed tile timed.
- ``moe`` (acts/act4-moe.md, "What still misses, and why"). Whether DRAM and the tensor pipes are
  busy together in ``grouped_matmul`` at 4,096 tokens (ncu Speed Of Light); the price of partial
  tiles (256 groups of exactly 128 rows against the uniform routing's groups, same rows); at
  16,384 tokens whether the kernel body is the limit (ours on one dense group against
  ``torch.matmul``, ncu stalls); and ``permute``'s sort and ``searchsorted`` timed apart from its
  gather, against the copy bandwidth.
- ``hgemm`` (acts/act4-hopper-rungs.md, steps 11 and 12 and the drop at 8192^3). Stalls and tensor
  pipes of steps 9-12 at 4096^3, and of steps 11 and 12 built with ``--define
  HGEMM12_CLUSTER_RELEASE=1`` (step 12's earlier cluster-scope release fence, for the A/B;
  ``hgemm_probe.py``'s path: the defines name their own build); DRAM
  bytes and L2 hit rate of steps 9-12 at 8192^3; timings beside cuBLAS in the same run.

- ``fa`` (acts/act4-flash-attention-4-cuda.md, issue 19's attention goals). Why the CUDA
  warp-specialised forward (kernels/cuda/fa_ws.py) trails cuDNN, and why its overlapped schedule
  trails its plain one: tensor-pipe use, issue slots and stalls of both schedules, of the course's
  Triton forward and of cuDNN's SDPA at N = 8192, d = 128, causal and not. And where the course's
  backward (two kernels, dK/dV then dQ, each recomputing P) loses to cuDNN's: the same counters for
  it, for its one-pass variant with an atomic fp32 dQ (``backward="atomic_dq"``) and for cuDNN's.
  Timings of every case beside.

``--part profile`` warms every case up first (compiles, autotunes, builds), then runs each once
between ``cudaProfilerStart`` and ``cudaProfilerStop``, inside an NVTX range ``case:<label>`` that
``summarize`` reads back from ncu's raw page. ``ncu-metrics`` prints the extra metrics this ncu
knows (an unknown name fails a whole ncu run); ``summarize RAW.csv`` turns ``ncu --import R --page
raw --csv --print-units base`` into a per-kernel summary.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import bench, device, dsa, megakernel, mla, moe, roofline  # noqa: E402
from kernels import cuda as ladder  # noqa: E402
from kernels.moe import grouped  # noqa: E402

GRAPH_CALLS = 20  # calls captured in one CUDA graph
HOST_CALLS = 500  # back-to-back calls for the host's µs per call
# A 32-head tile, profiled beside the autotuner's choice at batch 128 (page 6.4 had guessed that
# the 64-head tiles spill and these do not; the profile found no spills in either).
COMPARE_TILE = (32, 32, 8, 2)
HGEMM_DEFINES_AB = "HGEMM12_CLUSTER_RELEASE=1"

Case = tuple[str, Callable[[], object]]


# ----------------------------------------------------------------------------- helpers


def ctx_label(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


@contextlib.contextmanager
def profiled():
    """Nsight Compute collects only between these two calls (``ncu --profile-from-start off``)."""
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
    try:
        yield
    finally:
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()


def profile_cases(cases: list[Case]) -> None:
    """Each case once to compile, autotune or build it (outside the profiled region), then each
    once more between the profiler's start and stop, inside an NVTX range ``case:<label>``."""
    for _, fn in cases:
        fn()
    device.synchronize()
    print(f"profiling {len(cases)} cases: {', '.join(label for label, _ in cases)}", flush=True)
    with profiled():
        for label, fn in cases:
            if torch.cuda.is_available():
                torch.cuda.nvtx.range_push(f"case:{label}")
            fn()
            if torch.cuda.is_available():
                torch.cuda.nvtx.range_pop()


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.2f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def table(title: str, header: list[str], rows: list[list]) -> None:
    """Rows under a header, the first column left-aligned and the others right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]

    def line(vals):
        return "  " + "  ".join(
            v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(vals, widths))
        )

    print(f"\n{title}\n{line(header)}")
    for r in cells:
        print(line(r))
    sys.stdout.flush()


def us(m: bench.Measurement) -> float:
    return m.ms * 1e3


def replay_us(g: torch.cuda.CUDAGraph, reps: int = 10) -> float:
    """Median µs of one replay of ``g``, each replay timed with events."""
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def graph_us(fn: Callable[[], object], flush: bool) -> float | str:
    """µs per call of ``fn`` replayed from a CUDA graph of GRAPH_CALLS calls: no host work at all.
    With ``flush`` each call follows an L2 flush (as ``bench.measure``'s), and a graph of the
    flushes alone is subtracted. A string says why capture failed."""
    try:
        cache = (
            torch.empty(bench.FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if flush else None
        )

        def calls(with_fn: bool):
            for _ in range(GRAPH_CALLS):
                if cache is not None:
                    cache.zero_()
                if with_fn:
                    fn()

        def graph(with_fn: bool) -> torch.cuda.CUDAGraph:  # warmed up once off the graph
            return megakernel.cuda_graph(lambda: calls(with_fn), warmup=1).graph

        t = replay_us(graph(True))
        if flush:
            t -= replay_us(graph(False))
        return t / GRAPH_CALLS
    except Exception as e:  # noqa: BLE001 - why capture fails is itself the finding
        with contextlib.suppress(Exception):
            torch.cuda.synchronize()
        return f"capture failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:100]}"


def host_us(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    """µs per call over ``calls`` back-to-back calls: until the last is enqueued, and until the
    GPU has finished them (the larger of the host's and the GPU's cost per call)."""
    device.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    device.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


FIXED_COST_HEADER = ["case", "measure", "dev-only", "dev-only warm", "graph", "graph warm",
                     "host enqueue", "host total"]  # fmt: skip
FIXED_COST_NOTE = f"""\
  µs per call. measure: bench.measure (L2 flushed; the host counts where it outlasts the
  flush); dev-only: device_only=True (a GPU spin hides the host); warm: no L2 flush; graph:
  {GRAPH_CALLS} calls in one CUDA graph, L2 flushed before each (a graph of the flushes alone
  subtracted); host: perf_counter over {HOST_CALLS} back-to-back calls, until the last is enqueued
  and until the GPU is done. The host's work is the floor where measure ~ host total >> graph."""


def fixed_cost_row(label: str, fn: Callable[[], object], smoke: bool) -> list:
    """One row of FIXED_COST_HEADER: ``fn`` timed with and without the host's work (the CUDA
    graphs last: a capture that fails cannot spoil the other numbers)."""
    fn()
    timed = [
        us(bench.measure(fn)),
        us(bench.measure(fn, device_only=True)),
        us(bench.measure(fn, device_only=True, flush_l2=False)),
    ]
    host = host_us(fn, HOST_CALLS if not smoke else 3)
    graphs = ["skipped (smoke)"] * 2
    if device.GPU_MODE and not smoke:
        graphs = [graph_us(fn, flush=True), graph_us(fn, flush=False)]
    return [label, *timed, *graphs, *host]


# ----------------------------------------------------------------------------- mla


def mla_setup(smoke: bool) -> SimpleNamespace:
    """Page 6.4's shapes (DeepSeek-V3: 128 heads, latent 512, rope 64, pages of 64, bf16; DSA:
    64 index heads of 128, top-2048), or toys the interpreter runs in seconds."""
    if smoke:
        return SimpleNamespace(
            shape=dict(n_heads=16, r=32, d_rope=16), dtype=torch.float32, b1=(64, 256),
            steady=(4, 256), dsa=(2, 128), dsa_dims=(16, 32, 16, 4, 16), topk=16,
            tiles=[mla._INTERPRETER_CONFIG],
        )  # fmt: skip
    v3, v32 = mla.DEEPSEEK_V3, dsa.DEEPSEEK_V32
    return SimpleNamespace(
        shape=dict(n_heads=v3["n_heads"], r=v3["r"], d_rope=v3["d_rope"]),
        dtype=device.preferred_dtype(torch.bfloat16), b1=(4096, 32768), steady=(128, 32768),
        dsa=(8, 65536), dsa_dims=(v3["n_heads"], v3["r"], v3["d_rope"], v32["n_idx_heads"],
                                  v32["d_idx"]),
        topk=v32["topk"], tiles=list(mla._CONFIGS),
    )  # fmt: skip


def mla_inputs(s: SimpleNamespace, batch: int, ctx: int) -> tuple:
    """``(q_latent, q_rope, kv_cache, block_table, seq_lens)`` of ``batch`` sequences of ``ctx``
    tokens, the table sized to the context exactly (as the notebook times it)."""
    sh = s.shape
    return mla.decode_case([ctx] * batch, sh["n_heads"], sh["r"], sh["d_rope"], dtype=s.dtype,
                           spare_blocks=0, exact_table=True)  # fmt: skip


def dsa_step(s: SimpleNamespace) -> tuple[Callable[[], object], int]:
    """One DSA decode step (indexer -> top-k -> sparse MLA) as notebooks/06c calls it, and the
    bytes its three stages must move (``dsa.decode_stage_costs``)."""
    batch, ctx = s.dsa
    idx_dtype = dsa.indexer_dtype()
    c = dsa.dsa_case([ctx] * batch, *s.dsa_dims, dtype=s.dtype, idx_dtype=idx_dtype,
                     exact_table=True)  # fmt: skip
    args = (c["q_latent"][:, 0], c["q_rope"][:, 0], c["kv_cache"], c["q_idx"][:, 0],
            c["k_idx_cache"], c["w"][:, 0], c["block_table"], c["seq_lens"], s.topk)  # fmt: skip
    h, r, dr, hi, di = s.dsa_dims
    cost = dsa.decode_stage_costs(ctx, batch, topk=s.topk, key_bytes=idx_dtype.itemsize,
                                  dtype_bytes=s.dtype.itemsize, n_heads=h, r=r, d_rope=dr,
                                  n_idx_heads=hi, d_idx=di)  # fmt: skip
    return (lambda: dsa.dsa_decode(*args)), sum(cost[k][0] for k in ("indexer", "topk", "sparse"))


def tile_of(config: dict | None) -> tuple | None:
    if config is None:
        return None
    return (config["BLOCK_H"], config["BLOCK_N"], config["num_warps"], config["num_stages"])


def mla_profile(s: SimpleNamespace) -> None:
    """ncu cases: batch 1 at both contexts (the kernels' own time, against the fixed cost the
    timings show), and batch 128 at 32k with the autotuned tile and with COMPARE_TILE (spills,
    stalls, DRAM and tensor pipes: page 6.4's steady state)."""
    cases: list[Case] = []
    for ctx in s.b1:
        q = mla_inputs(s, 1, ctx)
        cases.append((f"mla-b1-{ctx_label(ctx)}", lambda q=q: mla.mla_decode(*q)))
    batch, ctx = s.steady
    q = mla_inputs(s, batch, ctx)
    mla.mla_decode(*q)  # autotunes this shape
    chosen = tile_of(mla.chosen_config())
    alt = COMPARE_TILE if chosen != COMPARE_TILE else (64, 16, 8, 2)
    print(f"autotuned tile at batch {batch}, {ctx} tokens (BLOCK_H, BLOCK_N, warps, stages): "
          f"{chosen}; profiled beside it: {alt}", flush=True)  # fmt: skip
    name = f"mla-b{batch}-{ctx_label(ctx)}"
    cases.append((f"{name}-auto-{'x'.join(map(str, chosen or ()))}", lambda: mla.mla_decode(*q)))
    cases.append((f"{name}-tile-{'x'.join(map(str, alt))}", lambda: mla.mla_decode(*q, config=alt)))
    profile_cases(cases)


def dsa_profile(s: SimpleNamespace) -> None:
    """ncu case: one DSA decode step at batch 8, 64k: each of its kernels' duration (page 6.4's
    "the chained step costs more than its stages timed alone")."""
    step, _ = dsa_step(s)
    profile_cases([(f"dsa-b{s.dsa[0]}-{ctx_label(s.dsa[1])}-step", step)])
    print(f"tiles: indexer {getattr(dsa._indexer_kernel, 'best_config', None)}, sparse "
          f"{mla.chosen_config(dsa._sparse_mla_kernel)}")  # fmt: skip


def roofs(dtype: torch.dtype) -> tuple[float, float]:
    """The measured copy bandwidth (GB/s) and matmul peak (TFLOP/s) for ``dtype``, printed."""
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    copy, peak = roofline.copy_bandwidth().value, roofline.matmul_peak(name).value
    print(f"measured roofs: copy {copy:,.0f} GB/s, {name} matmul {peak:,.1f} TFLOP/s", flush=True)
    return copy, peak


def mla_time(s: SimpleNamespace, smoke: bool) -> None:
    """Page 6.4's two MLA hypotheses in plain timings: the fixed cost at batch 1 measured with
    and without the host; the steady state at batch 128, 32k with the autotuner's tile and with
    every fixed tile, against the measured roofline."""
    copy, peak = roofs(s.dtype)
    rows = []
    for ctx in s.b1:
        q = mla_inputs(s, 1, ctx)
        fn = lambda q=q: mla.mla_decode(*q)
        rows.append(fixed_cost_row(f"mla_decode b1 {ctx_label(ctx)}", fn, smoke))
        print(f"  tile at batch 1, {ctx} tokens: {mla.chosen_config()}, splits "
              f"{mla.default_num_splits(1, ctx)}", flush=True)  # fmt: skip
        del q
    table("fixed cost per call (page 6.4: host work or GPU work?)", FIXED_COST_HEADER, rows)
    print(FIXED_COST_NOTE)

    batch, ctx = s.steady
    q = mla_inputs(s, batch, ctx)
    kw = dict(bytes=mla.mla_decode_bytes(batch, ctx, **s.shape, dtype_bytes=s.dtype.itemsize),
              flops=mla.mla_decode_flops(batch, ctx, **s.shape))  # fmt: skip
    roof_s, bound = mla.mla_decode_roof_s(batch, ctx, copy, peak, **s.shape,
                                          dtype_bytes=s.dtype.itemsize)  # fmt: skip
    auto = bench.measure(lambda: mla.mla_decode(*q), **kw)
    chosen = tile_of(mla.chosen_config())
    rows = [[f"autotuned {chosen}", us(auto), auto.gbps, auto.tflops, roof_s * 1e6 / us(auto)]]
    for tile in s.tiles:
        try:
            m = bench.measure(lambda t=tile: mla.mla_decode(*q, config=t), **kw)
        except Exception as e:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
            rows.append([f"tile {tile}", f"{type(e).__name__}", None, None, None])
            continue
        rows.append([f"tile {tile}", us(m), m.gbps, m.tflops, roof_s * 1e6 / us(m)])
    table(f"steady state: mla_decode batch {batch}, {ctx_label(ctx)} tokens, splits "
          f"{mla.default_num_splits(batch, ctx)}; roof {roof_s * 1e6:,.1f} µs ({bound}-bound)",
          ["tile (BLOCK_H, BLOCK_N, warps, stages)", "µs", "GB/s", "TFLOP/s", "of roof"],
          rows)  # fmt: skip


def dsa_time(s: SimpleNamespace, smoke: bool) -> None:
    """DSA's decode step at batch 8, 64k timed with and without the host (page 6.4: "the dense
    curve ... has the same floor", "the chained step costs more than its stages")."""
    copy, _ = roofs(s.dtype)
    step, nbytes = dsa_step(s)
    row = fixed_cost_row(f"dsa_decode b{s.dsa[0]} {ctx_label(s.dsa[1])}", step, smoke)
    table("fixed cost per DSA decode step (indexer + top-k + sparse MLA)", FIXED_COST_HEADER,
          [row])  # fmt: skip
    print(FIXED_COST_NOTE)
    print(f"  the stages' bytes over the copy bandwidth: {nbytes / copy / 1e3:,.1f} µs; tiles: "
          f"indexer {getattr(dsa._indexer_kernel, 'best_config', None)}, sparse "
          f"{mla.chosen_config(dsa._sparse_mla_kernel)}")  # fmt: skip


def run_mla(args) -> None:
    """MLA and DSA decode (acts/act6-serving-4-long-context.md): fixed cost and steady state."""
    s = mla_setup(args.smoke)
    parts = [(mla_profile, mla_time)] if not args.only_dsa else []
    parts += [(dsa_profile, dsa_time)] if not args.no_dsa else []
    for profile, timings in parts:
        if args.part in ("profile", "all"):
            profile(s)
        if args.part in ("time", "all"):
            timings(s, args.smoke)
        if device.GPU_MODE:
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- moe


def moe_setup(smoke: bool) -> SimpleNamespace:
    """The DeepSeek-V3-like shape of page 4.10 (hidden 7168, expert width 2048, 256 experts,
    top-8, bf16) at 4,096 and 16,384 tokens, or a toy (8 experts, top-4) for the interpreter."""
    if smoke:
        return SimpleNamespace(E=8, K=32, N=16, k=4, tokens=(32, 64), dtype=torch.float32)
    s = moe.MODEL_SHAPES["deepseek-v3"]
    dtype = device.preferred_dtype(torch.bfloat16)
    return SimpleNamespace(E=s.n_experts, K=s.hidden, N=s.expert_width, k=s.top_k,
                           tokens=(4096, 16384), dtype=dtype)  # fmt: skip


def moe_inputs(s: SimpleNamespace, T: int) -> SimpleNamespace:
    """``T`` tokens with the notebook's uniform routing (``moe.benchmark._routing``), permuted."""
    ids, _ = moe.benchmark._routing(T, s.E, s.k, "uniform", device.DEVICE)
    x = torch.randn(T, s.K, device=device.DEVICE, dtype=s.dtype)
    x_sorted, offsets, _ = moe.permute(x, ids, s.E)
    return SimpleNamespace(ids=ids, x=x, x_sorted=x_sorted, offsets=offsets)


def exact_offsets(M: int, E: int) -> torch.Tensor:
    """Offsets of ``E`` groups of exactly ``M / E`` rows: the same rows, the fewest tiles."""
    assert M % E == 0, (M, E)
    return torch.arange(0, M + 1, M // E, device=device.DEVICE, dtype=torch.int32)


def gmm_cost(offsets: torch.Tensor, K: int, N: int, itemsize: int) -> tuple[int, int]:
    """``(FLOPs, bytes)`` of a grouped GEMM: every row's product; the weights of every non-empty
    expert once, the rows in and the outputs out."""
    counts = offsets.diff()
    M, used = int(counts.sum()), int((counts > 0).sum())
    return 2 * M * K * N, itemsize * (used * K * N + M * K + M * N)


def tiles(offsets: torch.Tensor, block_m: int) -> int:
    return int(((offsets.diff() + block_m - 1) // block_m).sum())


def gmm_config() -> str:
    c = getattr(grouped._grouped_mm_tuned, "best_config", None)
    if c is None:
        return "?"
    return f"{tuple(c.kwargs.values())} warps {c.num_warps} stages {c.num_stages}"


def moe_weights(s: SimpleNamespace, E: int) -> torch.Tensor:
    return torch.randn(E, s.K, s.N, device=device.DEVICE, dtype=s.dtype).mul_(s.K**-0.5)


def moe_profile(s: SimpleNamespace) -> None:
    """ncu cases: grouped_matmul at 4,096 tokens, uniform and exactly M / E rows per expert
    (DRAM and tensor pipes busy together?); at 16,384 tokens uniform, all rows to one expert and
    torch.matmul on that dense GEMM (stalls: is the kernel body the limit?); one permute (its
    sort, searchsorted and gather kernels, each with its duration)."""
    t_small, t_big = s.tokens
    w = moe_weights(s, s.E)
    w1 = w[:1].contiguous()
    a, b = moe_inputs(s, t_small), moe_inputs(s, t_big)
    exact = exact_offsets(a.x_sorted.shape[0], s.E)
    one = torch.tensor([0, b.x_sorted.shape[0]], device=device.DEVICE, dtype=torch.int32)
    rows = b.x_sorted.shape[0] // s.E
    cases: list[Case] = [
        (f"gmm-uniform-{t_small}", lambda: moe.grouped_matmul(a.x_sorted, w, a.offsets)),
        (f"gmm-exact{a.x_sorted.shape[0] // s.E}-{t_small}",
         lambda: moe.grouped_matmul(a.x_sorted, w, exact)),
        (f"gmm-uniform-{t_big}", lambda: moe.grouped_matmul(b.x_sorted, w, b.offsets)),
        (f"gmm-one-expert-{t_big}", lambda: moe.grouped_matmul(b.x_sorted, w1, one)),
        (f"matmul-dense-{t_big}", lambda: b.x_sorted @ w1[0]),
        (f"matmul-one-expert-rows{rows}", lambda: b.x_sorted[:rows] @ w[0]),
        (f"permute-{t_small}", lambda: moe.permute(a.x, a.ids, s.E)),
    ]  # fmt: skip
    for label, fn in cases:  # warm here too, to print each grouped case's tile
        fn()
        if label.startswith("gmm"):
            print(f"  {label}: tile {gmm_config()}", flush=True)
    profile_cases(cases)


GMM_HEADER = ["case", "µs", "TFLOP/s", "GB/s", "of roof", "row tiles"]


def gmm_row(s, label, fn, offsets, roof: tuple[float, float], block_m: int | None = None) -> list:
    """One row of GMM_HEADER: ``fn`` (a grouped GEMM over ``offsets``) timed, against the roofline
    time max(bytes / copy, FLOPs / peak) of ``gmm_cost``; the row tiles at ``block_m``."""
    copy, peak = roof
    flops, nbytes = gmm_cost(offsets, s.K, s.N, s.dtype.itemsize)
    try:
        m = bench.measure(fn, flops=flops, bytes=nbytes)
    except (RuntimeError, NotImplementedError) as e:  # torch._grouped_mm refusing a layout
        return [label, f"{type(e).__name__}: {str(e)[:60]}", None, None, None, None]
    roof_us = max(nbytes / (copy * 1e9), flops / (peak * 1e12)) * 1e6
    return [label, us(m), m.tflops, m.gbps, roof_us / us(m),
            tiles(offsets, block_m) if block_m else None]  # fmt: skip


def moe_partial_tiles(s, w, roof) -> None:
    """Page 4.10, "partial tiles": every expert given exactly M / E rows (the fewest row tiles)
    against the uniform routing's groups of the same M rows: the same bytes and FLOPs."""
    a = moe_inputs(s, s.tokens[0])
    M = a.x_sorted.shape[0]
    exact = exact_offsets(M, s.E)
    one = torch.tensor([0, M], device=device.DEVICE, dtype=torch.int32)
    w1 = w[:1].contiguous()
    moe.grouped_matmul(a.x_sorted, w, a.offsets)
    block_m = grouped._grouped_mm_tuned.best_config.kwargs["BLOCK_M"]
    print(f"\ngrouped_matmul tile at {s.tokens[0]} tokens: {gmm_config()}")
    rows = [
        gmm_row(s, f"ours, uniform routing ({s.tokens[0]} tokens)",
                lambda: moe.grouped_matmul(a.x_sorted, w, a.offsets), a.offsets, roof, block_m),
        gmm_row(s, f"ours, {M // s.E} rows to every expert",
                lambda: moe.grouped_matmul(a.x_sorted, w, exact), exact, roof, block_m),
        gmm_row(s, "ours, every row to one expert",
                lambda: moe.grouped_matmul(a.x_sorted, w1, one), one, roof, block_m),
    ]  # fmt: skip
    if moe.torch_grouped_mm_available(device.DEVICE, s.dtype):
        rows += [
            gmm_row(s, "torch._grouped_mm, uniform",
                    lambda: moe.grouped_matmul_torch(a.x_sorted, w, a.offsets), a.offsets, roof),
            gmm_row(s, f"torch._grouped_mm, {M // s.E} rows each",
                    lambda: moe.grouped_matmul_torch(a.x_sorted, w, exact), exact, roof),
        ]  # fmt: skip
    table(f"partial tiles: {M:,} rows, K {s.K}, N {s.N}, {s.E} experts (row tiles of "
          f"BLOCK_M = {block_m})", GMM_HEADER, rows)  # fmt: skip


def moe_large_groups(s, w, roof) -> None:
    """Page 4.10, "large groups": at the larger token count, our kernel on the real groups and
    on one dense group of all the rows, against torch.matmul on that dense GEMM (is the kernel
    body the limit?), one expert's GEMM, the loop and torch._grouped_mm."""
    b = moe_inputs(s, s.tokens[1])
    M = b.x_sorted.shape[0]
    per = M // s.E
    one = torch.tensor([0, M], device=device.DEVICE, dtype=torch.int32)
    one_per = torch.tensor([0, per], device=device.DEVICE, dtype=torch.int32)
    w1 = w[:1].contiguous()
    moe.grouped_matmul(b.x_sorted, w, b.offsets)
    print(f"\ngrouped_matmul tile at {s.tokens[1]} tokens: {gmm_config()}")
    rows = [
        gmm_row(s, f"ours, uniform routing ({s.tokens[1]} tokens)",
                lambda: moe.grouped_matmul(b.x_sorted, w, b.offsets), b.offsets, roof),
        gmm_row(s, "ours, every row to one expert",
                lambda: moe.grouped_matmul(b.x_sorted, w1, one), one, roof),
        gmm_row(s, f"torch.matmul [{M} x {s.K}] @ [{s.K} x {s.N}]",
                lambda: b.x_sorted @ w1[0], one, roof),
        gmm_row(s, f"torch.matmul, one expert's [{per} x {s.K}] @ [{s.K} x {s.N}]",
                lambda: b.x_sorted[:per] @ w[0], one_per, roof),
        gmm_row(s, "loop of torch.matmul (grouped_matmul_loop)",
                lambda: moe.grouped_matmul_loop(b.x_sorted, w, b.offsets), b.offsets, roof),
    ]  # fmt: skip
    if moe.torch_grouped_mm_available(device.DEVICE, s.dtype):
        rows.append(gmm_row(s, "torch._grouped_mm, uniform",
                            lambda: moe.grouped_matmul_torch(b.x_sorted, w, b.offsets),
                            b.offsets, roof))  # fmt: skip
    table(f"large groups: {M:,} rows ({per} per expert)", GMM_HEADER[:5], [r[:5] for r in rows])


def moe_permute(s, copy: float) -> None:
    """Page 4.10, "data movement": permute is torch.sort + arange + searchsorted + .to(int32)
    and then one gather launch (kernels/moe/routing.py); the same torch calls on the same ids
    timed alone, the gather as the difference, all against the copy bandwidth."""
    a = moe_inputs(s, s.tokens[0])
    M = a.x_sorted.shape[0]
    flat = a.ids.reshape(-1)
    keys, order = torch.sort(flat, stable=True)
    bounds = torch.arange(s.E + 1, device=device.DEVICE, dtype=keys.dtype)

    def sort_part():
        k, _ = torch.sort(flat, stable=True)
        e = torch.arange(s.E + 1, device=device.DEVICE, dtype=k.dtype)
        return torch.searchsorted(k, e).to(torch.int32)

    nbytes = 2 * M * s.K * s.dtype.itemsize  # every copied row read once and written once
    fns = {  # label: (fn, whether it moves the rows: only those get a rate)
        "permute (all of it)": (lambda: moe.permute(a.x, a.ids, s.E), True),
        "  torch.sort(stable) of the ids": (lambda: torch.sort(flat, stable=True), False),
        "  torch.searchsorted of the sorted ids": (lambda: torch.searchsorted(keys, bounds), False),
        "  sort + arange + searchsorted + to(int32)": (sort_part, False),
        "torch index_select of the same rows": (lambda: a.x.index_select(0, order // s.k), True),
        "permute_ref (argsort, bincount, index)": (lambda: moe.permute_ref(a.x, a.ids, s.E), True),
    }  # fmt: skip
    got = {label: us(bench.measure(fn)) for label, (fn, _) in fns.items()}
    gather = got["permute (all of it)"] - got["  sort + arange + searchsorted + to(int32)"]

    def rate(t_us: float, moves: bool) -> list:
        if not moves or t_us <= 0:
            return [None, None]
        gbps = nbytes / (t_us * 1e-6) / 1e9
        return [gbps, gbps / copy]

    rows = [[label, t, *rate(t, fns[label][1])] for label, t in got.items()]
    rows.insert(4, ["  gather = permute - the sort part", gather, *rate(gather, True)])
    table(f"permute at {s.tokens[0]} tokens: {M:,} rows of {s.K} ({nbytes / 1e6:,.0f} MB moved); "
          f"copy bandwidth {copy:,.0f} GB/s", ["case", "µs", "GB/s", "of copy"], rows)  # fmt: skip
    print("  GB/s: permute's bytes (each row read and written once) over the time")


def moe_time(s: SimpleNamespace) -> None:
    """Page 4.10's three open questions in plain timings: partial tiles, the kernel body on
    large groups, permute's sort apart from its gather."""
    roof = roofs(s.dtype)
    w = moe_weights(s, s.E)
    for part in (moe_partial_tiles, moe_large_groups):
        part(s, w, roof)
        if device.GPU_MODE:
            torch.cuda.empty_cache()
    del w
    moe_permute(s, roof[0])


def run_moe(args) -> None:
    """The grouped GEMM and permute (acts/act4-moe.md, "What still misses, and why")."""
    s = moe_setup(args.smoke)
    if args.part in ("profile", "all"):
        moe_profile(s)
        if device.GPU_MODE:
            torch.cuda.empty_cache()
    if args.part in ("time", "all"):
        moe_time(s)


# ----------------------------------------------------------------------------- hgemm

HGEMM_SIZES = {4096: (9, 10, 11, 12), 8192: (9, 10, 11, 12)}  # the steps each size profiles


def hgemm_cases(steps: list[int], tag: str, with_cublas: bool) -> list[Case]:
    """Each step at 4096^3 (stalls: do they move from barrier waits to a busy tensor pipe up the
    ladder, and what holds step 12 below step 11?) and at 8192^3 (DRAM bytes, L2 hit rate: the
    drop of steps 10 and 11), one launch each, B the transpose of a contiguous [N, K] tensor as
    in ``hgemm_check.time_steps``."""
    cases: list[Case] = []
    for n, want in HGEMM_SIZES.items():
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16).t()
        if with_cublas:
            cases.append((f"cublas-{n}", lambda a=a, b=b: a @ b))
        cases += [(f"step{st}-{n}{tag}", lambda a=a, b=b, st=st: ladder.hgemm(a, b, st))
                  for st in want if st in steps]  # fmt: skip
    return cases


def run_hgemm(args) -> None:
    """The Hopper ladder (acts/act4-hopper-rungs.md): step 12's barrier, the drop at 8192^3."""
    from kernels.cuda import hgemm_check

    if args.define:  # hgemm_probe.py --define: the defines name their own build
        os.environ[ladder.HGEMM_DEFINES_ENV] = " ".join(args.define)
    tag = "+" + "+".join(args.define) if args.define else ""
    print(f"build: {ladder.hgemm_extension_name()} (defines: {args.define or 'none'}), steps "
          f"{args.steps}", flush=True)  # fmt: skip
    if args.smoke or (reason := ladder.hgemm_unavailable_reason()):
        why = "smoke mode" if args.smoke else reason
        plan = [f"step{st}-{n}{tag}" for n, want in HGEMM_SIZES.items() for st in want
                if st in args.steps]  # fmt: skip
        print(f"would profile: {', '.join(plan)}; would time steps {args.steps} at "
              f"{list(HGEMM_SIZES)}^3 beside cuBLAS")  # fmt: skip
        print(f"hgemm skipped: {why}")
        if not args.smoke:
            raise SystemExit(2)
        return
    t0 = time.perf_counter()
    ladder.hgemm_build()
    print(f"built or loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.build_only:
        return
    if args.part in ("profile", "all"):
        profile_cases(hgemm_cases(args.steps, tag, with_cublas=not args.define))
        torch.cuda.empty_cache()
    if args.part in ("time", "all"):
        # Every step checked against hgemm_ref before it is timed, cuBLAS in the same run.
        hgemm_check.time_steps(args.steps, [(n, n, n) for n in HGEMM_SIZES])


FA_N, FA_BH = 8192, (2, 16)  # 2 x 16 heads x 8,192 tokens, d = 128: the goal's regime


def fa_cases(smoke: bool, n: int = FA_N, batch: int = FA_BH[0]) -> list[Case]:
    """The forwards (both CUDA schedules, the course's Triton kernel, cuDNN's SDPA) and the
    backwards (the course's, cuDNN's), causal and not, one call each, at ``batch`` x 16 heads x
    ``n`` tokens. A backward case replays the autograd graph of a forward run once beforehand
    (``retain_graph``), gradients cleared first, so only the backward's kernels run in the profiled
    region."""
    from kernels import flash_attention as fa
    from kernels.cuda import fa_ws

    n = 64 if smoke else n  # smoke: the labels, from interpreter runs kept small
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(batch, FA_BH[1], n, 128, device=dev, dtype=torch.bfloat16, generator=g)
               for _ in range(3))  # fmt: skip
    do = torch.randn_like(q)
    cases: list[Case] = []
    for causal in (False, True):
        tag = f"-{n}" + ("-causal" if causal else "")
        if fa_ws.unavailable_reason() is None:
            for sched in fa_ws.SCHEDULES:
                cases.append((f"fwd-cuda-ws-{sched}{tag}",
                              lambda c=causal, s=sched: fa_ws.attention(q, k, v, c, schedule=s)))  # fmt: skip
        cases.append((f"fwd-course{tag}", lambda c=causal: fa.attention(q, k, v, c, impl="triton")))
        if fa.sdpa_available("cudnn"):
            cases.append((f"fwd-sdpa-cudnn{tag}", lambda c=causal: fa.sdpa(q, k, v, c, "cudnn")))
        backwards = [(f"course-{mode}", lambda qq, kk, vv, c, m=mode: fa.attention(qq, kk, vv, c, backward=m, impl="triton"))
                     for mode in fa.BACKWARDS]  # fmt: skip
        if fa.sdpa_available("cudnn"):
            backwards.append(("sdpa-cudnn", lambda qq, kk, vv, c: fa.sdpa(qq, kk, vv, c, "cudnn")))
        for name, fwd in backwards:
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            out = fwd(*leaves, causal)

            def bwd(out=out, leaves=leaves):
                for t in leaves:
                    t.grad = None
                out.backward(do, retain_graph=True)

            cases.append((f"bwd-{name}{tag}", bwd))
    return cases


def run_fa(args) -> None:
    """FlashAttention on Hopper (issue 19): the CUDA forward's schedules, the course's backward."""
    from kernels import flash_attention as fa

    cases = fa_cases(args.smoke, args.n, args.batch)
    if args.smoke:
        print(f"would profile: {', '.join(label for label, _ in cases)}")
        return
    if args.part in ("profile", "all"):
        profile_cases(cases)
    if args.part in ("time", "all"):
        n, b, h = args.n, args.batch, FA_BH[1]
        print("\ntimings (bench.measure, median; TFLOP/s from fa.fwd_flops, backward 2.5x that):")
        for label, fn in cases:
            causal = label.endswith("causal")
            flops = fa.fwd_flops(b, h, n, n, 128, causal) * (2.5 if label.startswith("bwd") else 1)
            m = bench.measure(fn, flops=flops)
            print(f"  {label:<36s} {m.ms * 1e3:>9.1f} us {m.tflops:>8.1f} TFLOP/s")


# ----------------------------------------------------------------------------- ncu helpers

# Extra metrics beyond the sections: DRAM bytes, L2 hit rate, the tensor pipes (Hopper's wgmma
# is "gmma", mma.sync "hmma"), local-memory (spill) traffic, achieved occupancy; and every
# per-reason stall ratio this ncu lists (WarpStateStats draws them; asking by name makes sure).
WANTED_METRICS = [
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "lts__t_sector_hit_rate.pct",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum",
    "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "lts__t_sectors_op_red.sum",  # L2 sectors of reductions (red: the atomic backward's dQ adds)
    "lts__t_sectors_op_atom.sum",
]
STALL_BASE = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active$")
# Every tensor pipe this ncu names (as kernels/cuda/hgemm_check.py picks them).
TENSOR_BASE = re.compile(r"^sm__pipe_tensor_op_\w*_cycles_active$|^sm__pipe_tensor_cycles_active$")
METRIC_TOKEN = re.compile(r"^[a-z0-9]+__[A-Za-z0-9_.]+$")


def _query(ncu: str, extra: list[str]) -> set[str]:
    """The metric names (tokens with a ``__``) that ``ncu --query-metrics EXTRA`` prints."""
    try:
        p = subprocess.run([ncu, "--query-metrics", *extra], capture_output=True, text=True,
                           timeout=90)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"ncu --query-metrics {' '.join(extra)}: {e}", file=sys.stderr)
        return set()
    return {t for line in p.stdout.splitlines() for t in line.split() if METRIC_TOKEN.match(t)}


def ncu_metrics(ncu: str) -> list[str]:
    """WANTED_METRICS and the stall ratios whose base name this ncu lists for this GPU; then, where
    ``--query-metrics-mode suffix`` prints full names, only the full names it prints."""
    bases = _query(ncu, []) or _query(ncu, ["--chip", "gh100"])
    wanted = [m for m in WANTED_METRICS if m.split(".")[0] in bases]
    wanted += sorted(
        f"{b}.avg.pct_of_peak_sustained_active"
        for b in bases
        if TENSOR_BASE.match(b) and f"{b}.avg.pct_of_peak_sustained_active" not in wanted
    )
    wanted += sorted(f"{b}.ratio" for b in bases if STALL_BASE.match(b))
    if not wanted:
        return []
    names = ",".join(sorted({m.split(".")[0] for m in wanted}))
    full = _query(ncu, ["--query-metrics-mode", "suffix", "--metrics", names])
    known = [m for m in wanted if m in full]
    dropped = sorted(set(WANTED_METRICS) - set(known or wanted))
    checked = "full names" if known else "base names"
    print(f"{len(known or wanted)} extra metrics ({checked} checked); "
          f"not known here: {dropped or 'none'}", file=sys.stderr)  # fmt: skip
    return known or wanted


# ----------------------------------------------------------------------------- summary

_TIME_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
            "second": 1e6, "s": 1e6}  # fmt: skip
_BYTES_MB = {"byte": 1e-6, "b": 1e-6, "kbyte": 1e-3, "kb": 1e-3, "mbyte": 1.0, "mb": 1.0,
             "gbyte": 1e3, "gb": 1e3, "tbyte": 1e6}  # fmt: skip
_NUMBER = re.compile(r"[-+]?\d[\d,]*\.?\d*(?:[eE][-+]?\d+)?")
_LABEL = re.compile(r"case:([\w.+=-]+)")
# Stall reasons: the per-issue ratios WarpStateStats charts, else the per-warp percentages.
_STALLS = [
    re.compile(r"^smsp__average_warps?_issue_stalled_(\w+)_per_issue_active\.ratio$"),
    re.compile(r"^smsp__warps?_issue_stalled_(\w+)_per_warp_active\.pct$"),
]
_TENSOR = re.compile(r"^sm__pipe_(tensor\w*?)_cycles_active\.avg\.pct_of_peak_sustained_active$")
_PICK = {  # summary field: raw-page columns, first found wins
    "us": ["gpu__time_duration.sum"],
    "sm": ["sm__throughput.avg.pct_of_peak_sustained_elapsed"],
    "dram": ["dram__throughput.avg.pct_of_peak_sustained_elapsed",
             "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"],
    "read": ["dram__bytes_read.sum"],
    "write": ["dram__bytes_write.sum"],
    "l2": ["lts__t_sector_hit_rate.pct"],
    "regs": ["launch__registers_per_thread"],
    "occ": ["sm__warps_active.avg.pct_of_peak_sustained_active"],
    "occ_max": ["sm__maximum_warps_per_active_cycle_pct"],
    "local_ld": ["l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum"],
    "local_st": ["l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum"],
    "red": ["lts__t_sectors_op_red.sum"],
    "atom": ["lts__t_sectors_op_atom.sum"],
}  # fmt: skip


def _number(cell: str) -> float | None:
    m = _NUMBER.search(cell or "")
    return float(m.group().replace(",", "")) if m else None


def _scaled(value: float | None, unit: str, scale: dict[str, float]) -> float | None:
    if value is None:
        return None
    return value * scale.get(unit.strip().lower(), 1.0)


def _pick(cell: dict, units: dict, field: str, scale: dict | None = None) -> float | None:
    """The first of ``_PICK[field]``'s columns present in a raw-page row, as a number (scaled from
    its unit by ``scale``), or None."""
    for col in _PICK[field]:
        if col in cell:
            v = _number(cell[col])
            return _scaled(v, units.get(col, ""), scale) if scale else v
    return None


def summarize(path: Path) -> None:
    """Per kernel of an ncu raw page (``--page raw --csv``, ideally ``--print-units base``): the
    case (its NVTX range), duration, DRAM throughput and bytes, L2 hit rate, tensor pipes,
    registers, occupancy, local-memory traffic and the top three stall reasons; then per case
    the kernels' summed duration."""
    lines = path.read_text(errors="replace").splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        print(f"no kernels in {path.name} (no raw-page header)")
        return
    reader = csv.reader(lines[start:])
    header = next(reader)
    rows = [r for r in reader if len(r) == len(header)]
    units = {}
    if rows and rows[0][0] == "":  # the units row
        units = dict(zip(header, rows.pop(0)))
    nvtx = [h for h in header if "Push/Pop" in h or "NVTX" in h.upper()]
    per_case: dict[str, list[float]] = {}
    print(f"{len(rows)} kernels. % of peak; durations at the clocks ncu ran them "
          "(--clock-control none); caches flushed before each kernel.")  # fmt: skip
    for r in rows:
        cell = dict(zip(header, r))

        def get(field, scale=None, cell=cell):
            return _pick(cell, units, field, scale)

        label = next((m.group(1) for h in nvtx if (m := _LABEL.search(cell[h]))), "-")
        t_us = get("us", _TIME_US)
        per_case.setdefault(label, []).append(t_us or 0.0)
        tensor = {m.group(1): _number(v) for h, v in cell.items() if (m := _TENSOR.match(h))}
        # gmma (wgmma) and hmma (mma.sync) always; other pipes only where busy.
        tensor = {
            k: v for k, v in tensor.items() if k.endswith(("gmma", "hmma")) or (v or 0) >= 0.1
        }
        stalls = {}
        for pattern in _STALLS:
            stalls = {m.group(1): _number(v) for h, v in cell.items() if (m := pattern.match(h))}
            stalls = {k: v for k, v in stalls.items() if v is not None and k != "selected"}
            if stalls:
                break
        top = sorted(stalls.items(), key=lambda kv: -kv[1])[:3]

        def f(v, unit="", fmt="{:,.1f}"):
            return "n/a" if v is None else fmt.format(v) + unit

        name = cell.get("Kernel Name", "?")
        print(f"\n[{cell.get('ID', '?')}] {label}  {name[:70]}  grid {cell.get('Grid Size', '?')} "
              f"x block {cell.get('Block Size', '?')}")  # fmt: skip
        print(f"    {f(t_us, ' us')} | DRAM {f(get('dram'), '%')} of peak, read "
              f"{f(get('read', _BYTES_MB), ' MB')}, written {f(get('write', _BYTES_MB), ' MB')} | "
              f"L2 hit {f(get('l2'), '%')} | SM throughput {f(get('sm'), '%')}")  # fmt: skip
        pipes = ", ".join(f"{k} {f(v, '%')}" for k, v in sorted(tensor.items())) or "n/a"
        print(f"    tensor pipes (of active cycles): {pipes} | {f(get('regs'), '', '{:.0f}')} "
              f"registers/thread | occupancy {f(get('occ'), '%')} achieved, "
              f"{f(get('occ_max'), '%')} theoretical")  # fmt: skip
        stall_txt = ", ".join(f"{k} {v:.2f}" for k, v in top) or "n/a"
        red, atom = get("red"), get("atom")
        if red or atom:  # 32-byte sectors of reductions and atomics at L2
            print(f"    atomics at L2: red {f((red or 0) * 32e-6, ' MB')}, "
                  f"atom {f((atom or 0) * 32e-6, ' MB')}")  # fmt: skip
        print(f"    local memory (spills): load {f(get('local_ld', _BYTES_MB), ' MB', '{:,.2f}')}, "
              f"store {f(get('local_st', _BYTES_MB), ' MB', '{:,.2f}')} | top stalls (warps per "
              f"issued instruction): {stall_txt}")  # fmt: skip
    print("\nper case (kernels, summed duration):")
    for label, times in per_case.items():
        print(f"  {label:<44s} {len(times):>3d} kernels {sum(times):>12,.1f} us")


# ----------------------------------------------------------------------------- main

TOPICS = {"mla": run_mla, "moe": run_moe, "hgemm": run_hgemm, "fa": run_fa}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn in TOPICS.items():
        sp = sub.add_parser(name, help=fn.__doc__.splitlines()[0])
        sp.add_argument("--part", choices=("profile", "time", "all"), default="all",
                        help="profile: warm up, then the bracketed launches (run it under ncu); "
                             "time: the plain timings; all: both (default)")  # fmt: skip
        sp.add_argument("--smoke", action="store_true",
                        help="toy shapes, no CUDA graph: check the plumbing on a CPU")  # fmt: skip
    m = sub.choices["mla"].add_mutually_exclusive_group()
    m.add_argument("--no-dsa", action="store_true", help="MLA decode only")
    m.add_argument("--only-dsa", action="store_true", help="DSA's decode step only")
    h = sub.choices["hgemm"]
    h.add_argument("--steps", type=int, nargs="+", default=[9, 10, 11, 12])
    h.add_argument("--define", nargs="+", default=[], metavar="NAME=VALUE",
                   help=f"build with these defines (e.g. {HGEMM_DEFINES_AB})")  # fmt: skip
    h.add_argument("--build-only", action="store_true", help="build (or load) the extension")
    f = sub.choices["fa"]
    f.add_argument("--n", type=int, default=FA_N, help=f"tokens (default {FA_N})")
    f.add_argument("--batch", type=int, default=FA_BH[0],
                   help=f"batch of {FA_BH[1]} heads each (default {FA_BH[0]}); the shapes sweep's "
                        "short case is --n 512 --batch 32")  # fmt: skip
    q = sub.add_parser("ncu-metrics", help="the extra metrics this ncu knows, comma-separated")
    q.add_argument("--ncu", default="ncu")
    s = sub.add_parser("summarize", help="per-kernel summary of an ncu raw-page CSV")
    s.add_argument("csv", type=Path)
    args = p.parse_args(argv)

    if args.command == "ncu-metrics":
        print(",".join(ncu_metrics(args.ncu)))
        return 0
    if args.command == "summarize":
        summarize(args.csv)
        return 0
    print(device.describe().splitlines()[0])
    print(f"{args.command} --part {args.part}{' --smoke' if args.smoke else ''}", flush=True)
    t0 = time.perf_counter()
    TOPICS[args.command](args)
    print(f"\n{args.command} --part {args.part}: done in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
