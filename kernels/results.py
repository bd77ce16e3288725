"""Every GPU's benchmark records, side by side: what the "Results across GPUs" page shows.

``python -m kernels.bench`` appends one JSON object a line to ``results/<gpu-slug>.jsonl``. This
module reads every such file, keeps the newest record of each case (a re-run supersedes an older
run of the same GPU), and summarises each benchmark per GPU: how many cases, the median fraction of
that GPU's own roof (measured in the same run) and the median speed-up over the library baseline.
The book's page is built from it at build time (``_ext/results_tables.py``), so a reader who adds
their GPU's file to ``results/`` sees it in the next build.
"""

from __future__ import annotations

import json
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
