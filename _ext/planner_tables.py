"""The planner's tables, computed at build time by ``kernels/planner.py`` (page 5.4).

``planner-validation``: the planner's prediction of every measured Act 5 DDP/FSDP step next to the
measurement (``planner.validate`` over ``results/nvidia-h200.jsonl``), with the calibrated MFU.
``planner-scaling``: the fastest configuration that fits for the 8B-, 70B- and 405B-class models on
8 to 1024 H100s (``planner.scaling_table``). A results file that changes rebuilds the page; so does a change to the planner itself.
"""

from __future__ import annotations

from pathlib import Path

from docutils import nodes
from results_tables import _table
from sphinx.util.docutils import SphinxDirective

from kernels import planner


def _note_sources(env) -> None:
    env.note_dependency(str(planner.RESULTS))
    env.note_dependency(str(Path(planner.__file__)))


def validation_rows() -> tuple[float, list[list[str]]]:
    v = planner.validate(planner.load_records())
    rows = [
        [
            r["variant"],
            f"{r['measured_ms']:.1f}",
            f"{r['predicted_ms']:.1f}",
            f"{100 * r['error']:+.1f}%",
        ]
        for r in v["rows"]
    ]
    return v["mfu"], rows


def scaling_rows() -> list[list[str]]:
    out = []
    for r in planner.scaling_table():
        pl = r["plan"]
        if pl is None:
            out.append([r["model"], str(r["gpus"]), "nothing fits", "", "", "", ""])
            continue
        t, mem = pl.time, pl.memory
        comm = sum(v for k, v in t.items() if k.startswith("comm_"))
        out.append(
            [
                r["model"],
                str(r["gpus"]),
                pl.parallel.label(),
                pl.recompute,
                f"{mem['total'] / 1e9:.1f}",
                f"{pl.step_s:.2f}",
                f"{t['compute']:.2f} / {comm:.2f} / {t['bubble']:.2f}",
            ]
        )
    return out


class PlannerValidation(SphinxDirective):
    def run(self):
        _note_sources(self.env)
        mfu, rows = validation_rows()
        header = ["run (GPUs)", "measured step (ms)", "planner (ms)", "error"]
        note = nodes.paragraph(
            text=f"Calibrated MFU (the one fitted constant, from the 1-GPU DDP step): {mfu:.3f}."
        )
        return [_table(header, rows), note]


class PlannerScaling(SphinxDirective):
    def run(self):
        _note_sources(self.env)
        header = [
            "model",
            "GPUs",
            "fastest configuration that fits",
            "recompute",
            "GB / GPU",
            "step (s)",
            "compute / comm / bubble (s)",
        ]
        return [_table(header, scaling_rows())]


def setup(app):
    app.add_directive("planner-validation", PlannerValidation)
    app.add_directive("planner-scaling", PlannerScaling)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
