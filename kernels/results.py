"""Every GPU's benchmark records, side by side: what the "Results across GPUs" page shows.

``python -m kernels.bench`` appends one JSON object a line to ``results/<gpu-slug>.jsonl``. This
module reads every such file, keeps the newest record of each case (a re-run supersedes an older
run of the same GPU), and summarises each benchmark per GPU: how many cases, the median fraction of
that GPU's own roof (measured in the same run) and the median speed-up over the library baseline.
The book's page is built from it at build time (``_ext/results_tables.py``), so a reader who adds
their GPU's file to ``results/`` sees it in the next build.

The page's figures come from here too: :func:`bar_series` (each benchmark's median per GPU, the
grouped bars of :func:`draw_bars`) and :func:`pairs` (every case measured on two GPUs, the scatter of
:func:`draw_pairs`). The series functions are pure (records in, numbers out) and tested; the drawing
functions only lay those numbers out in the book's style (``kernels/plotstyle.py``).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"


def load(path: Path) -> list[dict]:
    """The records of one results file, in file order (blank lines skipped)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def case_key(r: dict) -> tuple:
    """What makes two records measurements of the same case on the same GPU."""
    return (r["gpu"], r["bench"], r.get("variant"), tuple(r.get("shape") or ()), r.get("dtype"))


def newest(records: list[dict]) -> list[dict]:
    """One record per case: the one with the latest date, and of equal dates the one written last."""
    best: dict[tuple, tuple[str, int, dict]] = {}
    for i, r in enumerate(records):
        k = case_key(r)
        rank = (r.get("date") or "", i)
        if k not in best or rank >= best[k][:2]:
            best[k] = (*rank, r)
    return [v[2] for v in sorted(best.values(), key=lambda v: v[1])]


def load_all(directory: Path = RESULTS_DIR) -> list[dict]:
    """The newest record of every case from every ``*.jsonl`` file in ``directory``."""
    records = []
    for path in sorted(directory.glob("*.jsonl")):
        records += load(path)
    return newest(records)


@dataclass(frozen=True)
class Cell:
    """One benchmark on one GPU."""

    cases: int
    roof_frac: float | None  # median fraction of the GPU's own measured roof
    speedup: float | None  # median speed-up over the same-run library baseline
    date: str  # the newest record's date


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summary(records: list[dict]) -> tuple[list[str], dict[str, dict[str, Cell]]]:
    """(GPU names, {bench: {gpu: Cell}}) over the records that carry a measurement."""
    table: dict[str, dict[str, list[dict]]] = {}
    for r in records:
        if r.get("ms") is None:  # an error row of the shapes sweep
            continue
        table.setdefault(r["bench"], {}).setdefault(r["gpu"], []).append(r)
    gpus = sorted({g for row in table.values() for g in row})
    out = {}
    for bench in sorted(table):
        out[bench] = {
            gpu: Cell(
                cases=len(rs),
                roof_frac=_median([r["ceiling_frac"] for r in rs if r.get("ceiling_frac")]),
                speedup=_median([r["speedup"] for r in rs if r.get("speedup")]),
                date=max(r.get("date") or "" for r in rs),
            )
            for gpu, rs in table[bench].items()
        }
    return gpus, out


def cell_text(cell: Cell | None) -> str:
    """How the page prints one cell: roof fraction · speed-up (cases)."""
    if cell is None:
        return "–"
    roof = f"{cell.roof_frac:.2f} of roof" if cell.roof_frac is not None else "no roof"
    speed = f"{cell.speedup:.2f}×" if cell.speedup is not None else "no baseline"
    return f"{roof} · {speed} ({cell.cases})"


def select(
    table: dict[str, dict[str, Cell]], prefix: str = "", exclude: str | None = None
) -> dict[str, dict[str, Cell]]:
    """The benchmarks whose name starts with ``prefix`` and not with ``exclude`` (a page section)."""
    return {
        bench: per_gpu
        for bench, per_gpu in table.items()
        if bench.startswith(prefix) and not (exclude and bench.startswith(exclude))
    }


@dataclass(frozen=True)
class Bars:
    """Grouped bars: one group per benchmark, one bar per GPU (None: no value on that GPU)."""

    benches: list[str]
    gpus: list[str]
    values: dict[str, list[float | None]]  # gpu -> one value per bench, in ``benches`` order


def bar_series(table: dict[str, dict[str, Cell]], field: str) -> Bars:
    """Each benchmark's ``field`` (``"roof_frac"`` or ``"speedup"``) per GPU, for grouped bars.

    Only benchmarks with a value on at least one GPU, and only GPUs with at least one value, are
    kept; the order is the table's (alphabetical), GPUs alphabetical.
    """
    if field not in ("roof_frac", "speedup"):
        raise ValueError(f"field must be 'roof_frac' or 'speedup', not {field!r}")
    benches = [
        b
        for b, per_gpu in table.items()
        if any(getattr(c, field) is not None for c in per_gpu.values())
    ]
    gpus = sorted(
        {g for b in benches for g, c in table[b].items() if getattr(c, field) is not None}
    )
    values = {
        g: [getattr(table[b][g], field) if g in table[b] else None for b in benches] for g in gpus
    }
    return Bars(benches, gpus, values)


def reference_gpu(records: list[dict]) -> str | None:
    """The GPU with the most measured cases (of equal counts, the first by name): the scatter's x."""
    counts: dict[str, int] = {}
    for r in records:
        if r.get("ms") is not None:
            counts[r["gpu"]] = counts.get(r["gpu"], 0) + 1
    return min(counts, key=lambda g: (-counts[g], g)) if counts else None


@dataclass(frozen=True)
class Pair:
    """One case measured on the reference GPU (x) and on another GPU (y)."""

    bench: str
    x: float  # fraction of the reference GPU's roof
    y: float  # fraction of the other GPU's roof


def pairs(records: list[dict], reference: str) -> dict[str, list[Pair]]:
    """Every case that has a roof fraction on ``reference`` and on another GPU, per other GPU.

    A case is the same benchmark, variant, shape and dtype (:func:`case_key` without the GPU);
    pass the newest records (:func:`newest`/:func:`load_all`). GPUs that share no case are left out.
    """
    by_case: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if r.get("ms") is None or not r.get("ceiling_frac"):
            continue
        by_case.setdefault(case_key(r)[1:], {})[r["gpu"]] = r
    out: dict[str, list[Pair]] = {}
    for key in sorted(by_case, key=repr):
        per_gpu = by_case[key]
        if reference not in per_gpu:
            continue
        x = per_gpu[reference]["ceiling_frac"]
        for gpu in sorted(per_gpu):
            if gpu != reference:
                out.setdefault(gpu, []).append(Pair(key[0], x, per_gpu[gpu]["ceiling_frac"]))
    return out


# --- figures (drawn at build time by _ext/results_tables.py) ---------------------------------------

BAR_ROW_IN = 0.17  # inches of height per bar: 9 pt labels on rows that do not touch


def gpu_colors(gpus: list[str]) -> dict[str, str]:
    """One palette colour per GPU, by name order over every GPU of the page, so that a GPU has the
    same colour in every figure even where some other GPU is missing."""
    from kernels import plotstyle

    return {g: plotstyle.color(i) for i, g in enumerate(sorted(gpus))}


def draw_bars(
    table: dict[str, dict[str, Cell]], colors: dict[str, str] | None = None, strip: str = ""
):
    """Two panels sharing the benchmark axis: median fraction of the roof, and median speed-up over
    the library (log scale), one bar per GPU. ``colors``: GPU -> colour (:func:`gpu_colors` of every
    GPU on the page); ``strip``: a prefix the labels leave out (the section's). Returns the matplotlib
    figure (None: nothing to draw)."""
    import matplotlib as mpl

    from kernels import plotstyle

    roof, speed = bar_series(table, "roof_frac"), bar_series(table, "speedup")
    benches = [b for b in table if b in roof.benches or b in speed.benches]
    if not benches:
        return None
    gpus = sorted(set(roof.gpus) | set(speed.gpus))
    colors = colors or gpu_colors(gpus)
    with mpl.rc_context(plotstyle.rc()):
        return _draw_bars(benches, gpus, roof, speed, colors, strip)


def _draw_bars(
    benches: list[str], gpus: list[str], roof: Bars, speed: Bars, colors: dict, strip: str
):
    import matplotlib as mpl

    from kernels import plotstyle

    rows = len(benches) * max(len(gpus), 1)
    fig, (ax_r, ax_s) = plotstyle.figure(
        1, 2, height=1.3 + BAR_ROW_IN * rows + 0.08 * len(benches), sharey=True
    )
    width = 0.8 / len(gpus)
    ys = range(len(benches))
    # Speed-ups are ratios on a log axis: each bar starts at 1 (as fast as the library) and runs
    # right when the course's kernel is faster, left when it is slower.
    for ax, series, base, label in ((ax_r, roof, 0.0, "fraction of this GPU's roof"),
                                    (ax_s, speed, 1.0, "speed-up over the library baseline")):  # fmt: skip
        for i, gpu in enumerate(gpus):
            vals = dict(zip(series.benches, series.values.get(gpu, []), strict=True))
            pos = [y - 0.4 + width * (i + 0.5) for y in ys]
            ends = [vals.get(b) or base for b in benches]
            ax.barh(pos, [e - base for e in ends], left=base, height=width * 0.9,
                    color=colors[gpu], label=gpu if ax is ax_r else None)  # fmt: skip
        ax.set_xlabel(label)
        ax.grid(axis="y", visible=False)
    ax_r.axvline(1.0, color="0.3", lw=0.8, ls="--")
    ax_s.set_xscale("log")
    ax_s.axvline(1.0, color="0.3", lw=0.8, ls="--")
    # Powers of two read as "2×", "0.5×" rather than 10^0: a speed-up is a ratio.
    got = [v for vs in speed.values.values() for v in vs if v]
    lo, hi = min(got + [1.0]), max(got + [1.0])
    e0, e1 = math.floor(math.log2(lo)), math.ceil(math.log2(hi))
    step = 1 if e1 - e0 <= 6 else 2  # labels that do not run into each other
    ticks = [2.0**e for e in range(e0 - e0 % step, e1 + step, step) if e <= e1 or e % step == 0]
    ax_s.set_xticks(ticks, [f"{t:g}×" for t in ticks])
    ax_s.xaxis.set_minor_locator(mpl.ticker.NullLocator())
    ax_s.set_xlim(ticks[0] / 1.1, ticks[-1] * 1.1)
    ax_r.set_yticks(list(ys), [b.removeprefix(strip) for b in benches])
    ax_r.set_ylim(len(benches) - 0.5, -0.5)  # first benchmark on top, no empty band
    ax_r.set_title("Fraction of the roof")
    ax_s.set_title("Speed-up over the library")
    fig.legend(loc="outside lower center", ncols=min(len(gpus), 3))
    return fig


def draw_pairs(records: list[dict], colors: dict[str, str] | None = None):
    """Every case's fraction of the roof on the reference GPU (x) against another GPU (y), one colour
    per other GPU, with the diagonal where both reach the same fraction. None: no shared case."""
    import matplotlib as mpl

    from kernels import plotstyle

    ref = reference_gpu(records)
    found = pairs(records, ref) if ref else {}
    if not found:
        return None
    colors = colors or gpu_colors([ref, *found])
    with mpl.rc_context(plotstyle.rc()):
        return _draw_pairs(ref, found, colors)


def _draw_pairs(ref: str, found: dict[str, list[Pair]], colors: dict[str, str]):
    from kernels import plotstyle

    fig, ax = plotstyle.figure(height=plotstyle.COLUMN_WIDTH_IN * 0.6)
    top = max(1.05, *(max(p.x, p.y) for ps in found.values() for p in ps)) * 1.02
    ax.plot([0, top], [0, top], color="0.4", lw=0.8, ls="--", label="same fraction on both")
    for gpu, ps in found.items():
        n = f"{len(ps)} case" + ("" if len(ps) == 1 else "s")
        xs, ys = [p.x for p in ps], [p.y for p in ps]
        ax.scatter(xs, ys, s=14, alpha=0.7, color=colors[gpu], label=f"{gpu} ({n})")
    ax.set_xlim(0, top)
    ax.set_ylim(0, top)
    ax.set_aspect("equal")
    ax.set_xlabel(f"fraction of the roof on {ref}")
    ax.set_ylabel("fraction of the roof on the other GPU")
    ax.set_title("Each case on two GPUs, each against its own roof")
    ax.legend(loc="upper left")
    return fig
