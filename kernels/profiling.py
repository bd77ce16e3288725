"""Profiling helpers: run ``torch.profiler``, keep its trace, and read the trace back.

- ``profile(fn, steps=...)`` profiles a few calls of ``fn`` (after a warm-up), each wrapped in a
  ``step i`` annotation and ending with a device synchronise so a step's GPU work lies inside it. It
  returns the ``key_averages()`` table (sorted by device time on a GPU, CPU time on a CPU) and the path
  of the Chrome/Perfetto trace, written gzipped (``ui.perfetto.dev`` opens ``.json.gz`` directly).
- ``profile_layer(module, inputs, steps)``: the same for one module's forward pass, the recipe the
  book recommends for "why is my layer slow?".
- ``load_trace(path)`` parses that JSON into rows of intervals (CPU ops, CUDA runtime calls, GPU
  kernels, the profiler's own start-up stall); ``idle_gaps`` computes how much of a window a row
  was busy, and ``plot_timeline`` draws the rows with matplotlib (the book's style), the GPU's idle
  gaps shaded, starting after the profiler's start-up stall so that the plot shows the workload.
- ``ncu_command(...)`` builds the Nsight Compute command line for one kernel of a script.
- ``wall_time(fn)`` times ONE call on the host clock: for one-shot costs such as compilation, which
  ``bench.measure`` (median over many calls) cannot see. Steady-state timings still go through
  ``bench.measure``.
"""

from __future__ import annotations

import gzip
import json
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, record_function

from kernels import device

# Traces under this size may be committed next to the notebooks; bigger ones stay in a temp dir.
MAX_KEPT_TRACE_BYTES = 300_000
# Trace categories (Kineto's Chrome-trace export) that occupy the GPU.
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_PREFIX = "step "
WARMUP_NAME = "profiler warm-up"
# `name = async_compile.triton('name', '''source''', ...)` or `.cpp_pybinding([...], r'''source''')`
_ASYNC_COMPILE = re.compile(r"^(\w+) = async_compile\.\w+\(.*?'{3}(.*?)'{3}", re.S | re.M)
# Kineto's own work inside a trace: "Activity Buffer Request" (CUPTI allocating its buffers at the
# first kernel launch it records) stalls that launch by a millisecond or more, with the GPU idle.
PROFILER_CATEGORIES = ("overhead",)
# torch 2.11 warns on every profiler use that it "clears events at the end of each cycle"; profile()
# records exactly one cycle, so nothing is lost and the warning would only alarm the reader.
_CYCLE_WARNING = r".*Profiler clears events at the end of each cycle"
# Host calls that put work on the GPU: runtime and driver kernel launches, and CUDA graph launches.
LAUNCH_CALL = re.compile(r"^cu(da)?(LaunchKernel|LaunchCooperativeKernel|GraphLaunch)")


# ----------------------------------------------------------------------------- running the profiler


@dataclass
class ProfileResult:
    table: str  # key_averages() table, sorted by device time (GPU) or CPU time (CPU)
    trace_path: Path  # gzipped Chrome trace JSON: open it at https://ui.perfetto.dev
    kept: bool  # True if the trace was small enough to keep in the requested directory
    averages: object = field(repr=False)  # the EventList from prof.key_averages()


def _export_trace(prof, name: str, keep_dir: Path | None, max_bytes: int) -> tuple[Path, bool]:
    """Write the trace gzipped to a temp dir; move it to ``keep_dir`` if it is under ``max_bytes``."""
    tmp = Path(tempfile.mkdtemp(prefix="gpubrrr-trace-")) / f"{name}.json.gz"
    prof.export_chrome_trace(str(tmp))
    if keep_dir is None or tmp.stat().st_size >= max_bytes:
        return tmp, False
    keep_dir = Path(keep_dir)
    keep_dir.mkdir(parents=True, exist_ok=True)
    dest = keep_dir / tmp.name
    shutil.move(tmp, dest)
    return dest, True


def profile(
    fn: Callable[[], object],
    *,
    steps: int = 2,
    warmup: int = 2,
    name: str = "trace",
    keep_dir: str | Path | None = None,
    max_bytes: int = MAX_KEPT_TRACE_BYTES,
    row_limit: int = 12,
    record_shapes: bool = False,
) -> ProfileResult:
    """Profile ``steps`` calls of ``fn`` (after ``warmup`` unprofiled ones).

    CUDA activity is recorded only in GPU mode. The trace goes to ``keep_dir/<name>.json.gz`` when it
    is smaller than ``max_bytes`` (so it can be committed) and was recorded on a GPU, otherwise it
    stays in a temp dir: a CPU run's trace, with no GPU rows, must not replace a GPU run's.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
    # Warm-up outside the profiler: first calls pay for allocation, cuBLAS handles, autotuning.
    for _ in range(warmup):
        fn()
    device.synchronize()
    activities = [ProfilerActivity.CPU]
    if device.GPU_MODE:
        activities.append(ProfilerActivity.CUDA)
    with warnings.catch_warnings():
        # A false alarm in some torch releases (see _CYCLE_WARNING): silence that message only.
        warnings.filterwarnings("ignore", message=_CYCLE_WARNING, category=UserWarning)
        with torch.profiler.profile(activities=activities, record_shapes=record_shapes) as prof:
            # The first annotation of a session pays a one-off set-up cost (up to milliseconds):
            # pay it here rather than inside step 0. It is dropped from the table below.
            with record_function(WARMUP_NAME):
                pass
            for i in range(steps):
                with record_function(f"{STEP_PREFIX}{i}"):
                    fn()
                    # Inside the annotation: the step then spans its GPU work; steps do not overlap.
                    device.synchronize()
    averages = prof.key_averages()
    averages[:] = [e for e in averages if e.key != WARMUP_NAME]  # an EventList is a list
    sort_by = "device_time_total" if device.GPU_MODE else "cpu_time_total"
    table = averages.table(sort_by=sort_by, row_limit=row_limit)
    keep = Path(keep_dir) if keep_dir is not None and device.GPU_MODE else None
    path, kept = _export_trace(prof, name, keep, max_bytes)
    return ProfileResult(table, path, kept, averages)


def profile_layer(
    module: Callable[..., object],
    inputs: torch.Tensor | Sequence[torch.Tensor],
    steps: int = 2,
    **kwargs,
) -> ProfileResult:
    """Profile ``module(*inputs)`` (forward only, no autograd) for ``steps`` steps.

    ``kwargs`` go to ``profile`` (``warmup``, ``name``, ``keep_dir``, ``row_limit`` ...).
    """
    if not callable(module):
        raise TypeError(f"module must be callable, got {type(module).__name__}")
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    if not args or not all(isinstance(a, torch.Tensor) for a in args):
        raise TypeError("inputs must be a tensor or a non-empty sequence of tensors")

    def step():
        with torch.no_grad():
            return module(*args)

    kwargs.setdefault("name", type(module).__name__.lower())
    return profile(step, steps=steps, **kwargs)


# ----------------------------------------------------------------------------- reading the trace

Interval = tuple[float, float]  # (start, end) in microseconds


@dataclass
class Trace:
    """The rows of a Chrome trace that matter here, in microseconds since ``t0``, the trace's first
    complete event."""

    cpu_ops: list[Interval]
    runtime: list[Interval]  # CUDA runtime/driver calls on the CPU (cudaLaunchKernel ...)
    runtime_names: list[str]
    gpu: list[Interval]  # kernels, memcpys, memsets
    gpu_names: list[str]
    steps: list[Interval]  # the "step i" annotations written by profile()
    t0: float
    stalls: list[Interval] = field(default_factory=list)  # the profiler's own work (see below)

    @property
    def window(self) -> Interval:
        """The profiled steps, or everything if the trace has no step annotations."""
        if self.steps:
            return (self.steps[0][0], self.steps[-1][1])
        spans = self.cpu_ops + self.runtime + self.gpu
        if not spans:
            return (0.0, 0.0)
        return (min(s for s, _ in spans), max(e for _, e in spans))

    @property
    def startup_us(self) -> float:
        """How long the profiler's start-up stall held up the start of the window: from the window's
        start to the end of the last profiler stall that began inside it before any GPU work (0 when
        there is none). CUPTI sets up its buffers at the first launch it records, inside step 0."""
        lo, hi = self.window
        first_gpu = min((s for s, _ in self.gpu), default=hi)
        ends = [e for s, e in self.stalls if lo <= s < min(hi, first_gpu)]
        return max(0.0, min(max(ends), hi) - lo) if ends else 0.0

    @property
    def steady_window(self) -> Interval:
        """The window without the profiler's start-up stall: what the workload itself did."""
        lo, hi = self.window
        return (lo + self.startup_us, hi)


def load_trace(path: str | Path) -> Trace:
    """Parse a Chrome trace written by ``torch.profiler`` (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    rows: dict[str, list[tuple[float, float, str]]] = {
        "cpu": [],
        "rt": [],
        "gpu": [],
        "step": [],
        "stall": [],
    }
    t0 = float("inf")
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        t0 = min(t0, float(e["ts"]))
        cat, name = e.get("cat", ""), e.get("name", "")
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]), name)
        if cat == "cpu_op":
            rows["cpu"].append(span)
        elif cat in ("cuda_runtime", "cuda_driver"):
            rows["rt"].append(span)
        elif cat in GPU_CATEGORIES:
            rows["gpu"].append(span)
        elif cat == "user_annotation" and name.startswith(STEP_PREFIX):
            rows["step"].append(span)
        elif cat in PROFILER_CATEGORIES:
            rows["stall"].append(span)
    t0 = 0.0 if t0 == float("inf") else t0
    for row in rows.values():
        row.sort()

    def rel(row):
        return [(s - t0, e - t0) for s, e, _ in row]

    return Trace(
        cpu_ops=rel(rows["cpu"]),
        runtime=rel(rows["rt"]),
        runtime_names=[n for _, _, n in rows["rt"]],
        gpu=rel(rows["gpu"]),
        gpu_names=[n for _, _, n in rows["gpu"]],
        steps=rel(rows["step"]),
        t0=t0,
        stalls=rel(rows["stall"]),
    )


def launches_per_step(trace: Trace) -> float:
    """Kernel and graph launch calls the host made per profiled step (0 on a CPU-only trace)."""
    if not trace.steps:
        raise ValueError("trace has no 'step i' annotations: record it with profiling.profile")
    lo, hi = trace.window
    n = sum(
        1
        for (s, _), name in zip(trace.runtime, trace.runtime_names)
        if lo <= s <= hi and LAUNCH_CALL.match(name)
    )
    return n / len(trace.steps)


def merge_intervals(intervals: Sequence[Interval]) -> list[Interval]:
    """The union of possibly overlapping intervals, as sorted disjoint intervals."""
    merged: list[list[float]] = []
    for s, e in sorted(intervals):
        if e < s:
            raise ValueError(f"intervals must have end >= start, got ({s}, {e})")
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


@dataclass(frozen=True)
class Occupancy:
    """How a row of intervals fills a window (all times in microseconds)."""

    window_us: float
    busy_us: float
    gaps: list[Interval]  # the idle stretches inside the window

    @property
    def idle_us(self) -> float:
        return self.window_us - self.busy_us

    @property
    def busy_fraction(self) -> float:
        return self.busy_us / self.window_us if self.window_us > 0 else 0.0

    @property
    def largest_gap_us(self) -> float:
        return max((e - s for s, e in self.gaps), default=0.0)


def idle_gaps(intervals: Sequence[Interval], window: Interval) -> Occupancy:
    """Busy time (the union of ``intervals`` clipped to ``window``) and the idle gaps between."""
    lo, hi = window
    if hi < lo:
        raise ValueError(f"window must have end >= start, got {window}")
    clipped = [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]
    busy = merge_intervals(clipped)
    gaps, cursor = [], lo
    for s, e in busy:
        if s > cursor:
            gaps.append((cursor, s))
        cursor = e
    if cursor < hi:
        gaps.append((cursor, hi))
    return Occupancy(hi - lo, sum(e - s for s, e in busy), gaps)


def plot_timeline(
    trace: Trace,
    ax=None,
    *,
    title: str = "",
    zoom_ms: float | None = None,
    cut_startup: bool = True,
):
    """Draw the CPU-op, CUDA-runtime and GPU rows of ``trace`` (milliseconds), in the book's style.

    The plot starts where the profiler's start-up stall ends (``trace.steady_window``; pass
    ``cut_startup=False`` to keep it), so the workload fills the axis rather than a millisecond of
    the profiler setting itself up; the cut is named on the x axis. ``zoom_ms`` shows only the
    first ``zoom_ms`` milliseconds after that start. Each row's busy fraction over the plotted
    window is written beside it, and the GPU's idle gaps are shaded. A CPU-only trace has no GPU
    rows.
    """
    from kernels import plotstyle

    if zoom_ms is not None and not zoom_ms > 0:
        raise ValueError(f"zoom_ms must be a positive number of milliseconds, got {zoom_ms!r}")
    if ax is None:
        _, ax = plotstyle.figure(height=2.4)
    lo, hi = trace.steady_window if cut_startup else trace.window
    if zoom_ms is not None:
        hi = min(hi, lo + zoom_ms * 1e3)
    rows = [("CPU ops", trace.cpu_ops, plotstyle.color(0))]
    if trace.runtime:
        rows.append(("CUDA runtime", trace.runtime, plotstyle.color(2)))
    if trace.gpu:
        rows.append(("GPU kernels", trace.gpu, plotstyle.color(3)))
    n = len(rows)
    for i, (label, row, color) in enumerate(rows):
        y = n - 1 - i  # first row on top
        occ = idle_gaps(row, (lo, hi))
        busy = merge_intervals([(max(s, lo), min(e, hi)) for s, e in row if e > lo and s < hi])
        ax.broken_barh(
            [((s - lo) / 1e3, (e - s) / 1e3) for s, e in busy], (y - 0.35, 0.7), color=color
        )
        ax.text(
            1.01,
            y,
            f"busy {occ.busy_fraction:.0%}",
            transform=ax.get_yaxis_transform(),
            va="center",
            fontsize=plotstyle.SMALL_PT,
        )
        if label == "GPU kernels":
            gaps = [((s - lo) / 1e3, (e - s) / 1e3) for s, e in occ.gaps]
            ax.broken_barh(
                gaps, (y - 0.45, 0.9), color=plotstyle.color(1), alpha=0.2, lw=0, label="GPU idle"
            )
            ax.legend(loc="upper right", bbox_to_anchor=(1.0, 1.22), ncols=1)
    for s, _ in trace.steps:
        if lo <= s <= hi:
            ax.axvline((s - lo) / 1e3, color="0.3", lw=0.8, ls=":")
    ax.set_yticks(range(n), [label for label, _, _ in reversed(rows)])
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlim(0, (hi - lo) / 1e3)
    cut = trace.startup_us if cut_startup else 0.0
    since = (
        f"ms after the profiler's start-up ({cut / 1e3:.1f} ms, not shown)"
        if cut > 0
        else "ms since the first profiled step"
    )
    ax.set_xlabel(since)
    ax.grid(True, axis="x", alpha=0.3)
    ax.grid(False, axis="y")
    if title:
        ax.set_title(title)
    return ax


# ----------------------------------------------------------------------------- other tools


def ncu_command(
    script: str, kernel_regex: str, *, section_set: str = "full", count: int = 1
) -> str:
    """The Nsight Compute command line that profiles ``count`` launches of kernels matching
    ``kernel_regex`` while ``script`` runs, and saves a report next to it."""
    if not kernel_regex:
        raise ValueError("kernel_regex must be a non-empty regular expression")
    report = Path(script).stem + "-ncu"
    return (
        f"ncu --set {section_set} --kernel-name regex:'{kernel_regex}' --launch-count {count} "
        f"-o {report} python {script}"
    )


def generated_kernels(code: str) -> dict[str, str]:
    """The kernels in an Inductor output module (``run_and_get_code`` / ``TORCH_LOGS=output_code``).

    Each kernel is a source string handed to ``async_compile`` (Triton on a GPU, C++ on a CPU);
    returns ``{kernel name: source}`` in the order they appear.
    """
    found = {}
    for m in _ASYNC_COMPILE.finditer(code):
        found[m.group(1)] = m.group(2).strip("\n")
    return found


def wall_time(fn: Callable[[], object]) -> tuple[object, float]:
    """Run ``fn()`` once; return its result and the host wall time in seconds, after the device has
    finished. For one-shot costs (compilation): steady-state timing belongs to ``bench.measure``."""
    device.synchronize()
    t0 = time.perf_counter()
    out = fn()
    device.synchronize()
    return out, time.perf_counter() - t0
