"""Timing, same-run baselines, ceiling ratios and the results/*.jsonl records.

``measure(fn, bytes=..., flops=...)`` is the one timing routine of the course. On a GPU it times with
CUDA events after a warm-up and reports the median and the 20th/80th percentiles; by default the L2
cache is flushed before every repetition (``triton.testing.do_bench``) so a kernel is not credited
with cache hits it would not get in a real model. In CPU interpreter mode it falls back to
``time.perf_counter`` and marks the result as not a GPU number.

``python -m kernels.bench [--only NAME] [--quick]`` runs every registered benchmark, prints a table and
appends one JSON object per measurement to ``results/<gpu-slug>.jsonl``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from kernels import device

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


@dataclass(frozen=True)
class Measurement:
    ms: float  # median milliseconds per call
    p20_ms: float
    p80_ms: float
    gbps: float | None  # bytes / median time, in GB/s (1e9 bytes per second)
    tflops: float | None  # flops / median time, in TFLOP/s
    gpu_timing: bool  # False: perf_counter on a CPU, not a GPU number

    def __str__(self) -> str:
        rate = []
        if self.gbps is not None:
            rate.append(f"{self.gbps:,.0f} GB/s")
        if self.tflops is not None:
            rate.append(f"{self.tflops:,.1f} TFLOP/s")
        where = "" if self.gpu_timing else " (CPU interpreter, not a GPU number)"
        return f"{self.ms * 1e3:,.1f} us" + (f", {', '.join(rate)}" if rate else "") + where


def _rates(ms: float, bytes: float | None, flops: float | None):
    gbps = bytes / (ms * 1e-3) / 1e9 if bytes else None
    tflops = flops / (ms * 1e-3) / 1e12 if flops else None
    return gbps, tflops


def _quantiles(times: list[float]) -> tuple[float, float, float]:
    qs = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
    return statistics.median(times), qs[1], qs[7]


def _events_no_flush(fn: Callable[[], object], warmup: int, reps: int) -> list[float]:
    """Per-call event times without flushing L2: for deliberately cache-resident measurements."""
    for _ in range(warmup):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


# Ahead of each repetition of measure(device_only=True): ~1 ms of GPU spinning at H100 clocks, longer
# than the host takes to queue the flush and a call on any machine we have seen (~0.2 ms at most).
_HOST_SCREEN_CYCLES = 2_000_000
FLUSH_BYTES = 256 * 2**20  # as triton.testing.do_bench: larger than any GPU's L2


def _events_device_only(
    fn: Callable[[], object], warmup: int, reps: int, flush: bool
) -> list[float]:
    """Per-call event times with the host's launch cost kept out. A GPU-side spin queued ahead of
    each repetition keeps the GPU busy while the host queues the flush, the start event and ``fn``,
    so the interval holds ``fn``'s kernels back to back, not the wait for the host to launch them."""
    for _ in range(warmup):
        fn()
    cache = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda") if flush else None
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    torch.cuda.synchronize()
    for s, e in zip(starts, ends):
        torch.cuda._sleep(_HOST_SCREEN_CYCLES)
        if cache is not None:
            cache.zero_()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def measure(
    fn: Callable[[], object],
    *,
    bytes: float | None = None,
    flops: float | None = None,
    flush_l2: bool = True,
    device_only: bool = False,
    warmup_ms: float = 25,
    rep_ms: float = 100,
    cpu_reps: int = 3,
) -> Measurement:
    """Time ``fn()`` and convert to GB/s (``bytes`` moved) and/or TFLOP/s (``flops`` done).

    ``device_only``: keep the host's launch cost out of the time (see ``_events_device_only``). The
    default counts it where it exceeds the flush that precedes each call, as a model calling the
    kernel would pay it: always the host work between a call's launches, and the work before its
    first launch where the driver submits the start event at once (the H100 machine's did; the
    4 x H200 machine's held it back until the first kernel). ``device_only`` is for comparing what
    happens inside kernels (two variants of one kernel, say) on a host too slow to keep a small
    kernel fed.
    """
    if device.GPU_MODE:
        if flush_l2 and not device_only:
            med, p20, p80 = triton.testing.do_bench(
                fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8]
            )
        else:
            fn()  # compile / autotune outside the timed region
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            one = max((time.perf_counter() - t0) * 1e3, 1e-3)  # host included: an upper bound
            warmup = max(int(warmup_ms / one), 3)
            if device_only:  # each repetition also spins ~1 ms: count it in the budget
                reps = int(min(max(rep_ms / (one + 1.0), 20), 500))
                times = _events_device_only(fn, warmup, reps, flush_l2)
            else:
                times = _events_no_flush(fn, warmup, int(min(max(rep_ms / one, 10), 2000)))
            med, p20, p80 = _quantiles(times)
        gpu = True
    else:
        fn()  # first call pays for interpretation set-up
        times = []
        for _ in range(cpu_reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        med, p20, p80 = _quantiles(times)
        gpu = False
    gbps, tflops = _rates(med, bytes, flops)
    return Measurement(med, p20, p80, gbps, tflops, gpu)


def host_launch_ms(fn: Callable[[], object], calls: int = 20, rounds: int = 3) -> float:
    """Host milliseconds per call of ``fn``: ``calls`` back-to-back calls timed with
    ``perf_counter``, the least of ``rounds`` such loops. The GPU is not waited for inside a loop
    (its launches queue), so this is what the host spends, not what the kernels take."""
    times = []
    for _ in range(rounds):
        if device.GPU_MODE:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) * 1e3 / calls)
    if device.GPU_MODE:
        torch.cuda.synchronize()
    return min(times)


# ----------------------------------------------------------------------------- records


def dtype_name(dtype) -> str:
    """A dtype as the results files spell it: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "")


def record(
    bench: str,
    variant: str,
    shape: Iterable[int],
    dtype: torch.dtype | str,
    m: Measurement,
    *,
    baseline: tuple[str, Measurement] | None = None,
    ceiling: tuple[str, float] | None = None,
) -> dict:
    """One results row. ``ceiling`` is (name, value) in the unit of the measurement: GB/s for a
    memory-bound benchmark (``m.gbps`` set), TFLOP/s for a compute-bound one."""
    achieved = m.gbps if m.gbps is not None else m.tflops
    cap = device.capabilities()
    v = device.versions()
    return {
        "bench": bench,
        "variant": variant,
        "shape": list(shape),
        "dtype": dtype_name(dtype),
        "ms": round(m.ms, 6),
        "gbps": None if m.gbps is None else round(m.gbps, 1),
        "tflops": None if m.tflops is None else round(m.tflops, 2),
        "baseline": baseline[0] if baseline else None,
        "baseline_ms": round(baseline[1].ms, 6) if baseline else None,
        "speedup": round(baseline[1].ms / m.ms, 3) if baseline else None,
        "ceiling": ceiling[0] if ceiling else None,
        # 4 significant digits: a tiny op far below its roof is a small number, not 0.0
        "ceiling_frac": float(f"{achieved / ceiling[1]:.4g}") if ceiling and achieved else None,
        "gpu": cap.name,
        "torch": v["torch"],
        "triton": v["triton"],
        "cuda": v["cuda"],
        "date": _dt.date.today().isoformat(),
    }


def results_path(gpu_name: str | None = None) -> Path:
    return RESULTS_DIR / f"{device.gpu_slug(gpu_name)}.jsonl"


def append_records(records: list[dict], path: Path | None = None) -> Path:
    path = path or results_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def load_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def format_table(records: list[dict]) -> str:
    cols = ["bench", "variant", "shape", "dtype", "ms", "gbps", "tflops", "speedup", "ceiling_frac"]
    rows = [[str(r.get(c) if r.get(c) is not None else "-") for c in cols] for r in records]
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(cols)]
    out = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(out)


# ----------------------------------------------------------------------------- registry

BenchFn = Callable[[bool], list[dict]]
BENCHMARKS: dict[str, BenchFn] = {}
# Modules whose import registers benchmarks (each calls ``register`` at import time).
BENCH_MODULES = [
    "kernels.roofline",
    "kernels.vector_add",
    "kernels.perfmodel",
    "kernels.fusion",
    "kernels.cuda",
    "kernels.matmul",
    "kernels.flash_attention",
    "kernels.softmax",
    "kernels.norms",
    "kernels.megakernel",
    "kernels.trees",
    "kernels.quant",
    "kernels.collectives",
    "kernels.paged_attention",
    "kernels.mla",
    "kernels.dsa",
    "kernels.decoder",
    "kernels.moe",
    "kernels.shapes",
]


def register(name: str) -> Callable[[BenchFn], BenchFn]:
    """Decorator: ``fn(quick: bool) -> list[record]`` becomes ``python -m kernels.bench --only name``."""

    def deco(fn: BenchFn) -> BenchFn:
        BENCHMARKS[name] = fn
        return fn

    return deco


def main(argv: list[str] | None = None) -> int:
    import importlib

    p = argparse.ArgumentParser(prog="python -m kernels.bench", description=__doc__.split("\n")[0])
    p.add_argument("--only", action="append", help="run only this benchmark (repeatable)")
    p.add_argument("--quick", action="store_true", help="fewer sizes")
    p.add_argument("--no-save", action="store_true", help="print only; do not append to results/")
    p.add_argument("--list", action="store_true", help="list the registered benchmarks")
    args = p.parse_args(argv)
    for mod in BENCH_MODULES:
        importlib.import_module(mod)
    if args.list:
        print("\n".join(sorted(BENCHMARKS)))
        return 0
    names = args.only or list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; known: {sorted(BENCHMARKS)}")
    print(device.describe(), flush=True)
    records: list[dict] = []
    for name in names:
        records += BENCHMARKS[name](args.quick or not device.GPU_MODE)
    if not records:
        print("no benchmark produced a record")
        return 1
    print(format_table(records))
    if not device.GPU_MODE:
        print("CPU interpreter mode: these are not GPU numbers, so nothing is written to results/.")
    elif device.forced_off():
        # The records would carry this GPU's name but another GPU's code paths.
        print(
            f"{device.FORCE_CAPS_ENV} is set: these are not this GPU's numbers, nothing is saved."
        )
    elif not args.no_save:
        print(f"appended {len(records)} records to {append_records(records)}")
    return 0


if __name__ == "__main__":
    # Run as `python -m kernels.bench`, this file is `__main__`, a module distinct from the
    # `kernels.bench` that the benchmark modules register into: call that one's main.
    from kernels.bench import main as _main

    raise SystemExit(_main())
