"""The planner's tables, computed at build time by ``kernels/planner.py`` (page 5.5).

``planner-validation``: the planner's prediction of every measured Act 5 DDP/FSDP step next to the
measurement (``planner.validate`` over ``results/nvidia-h200.jsonl``), with the calibrated MFU.
``planner-scaling``: the fastest configuration that fits for the 8B-, 70B- and 405B-class models on
8 to 1024 H100s (``planner.scaling_table``); ``planner-figure`` draws the same rows (memory per GPU by
kind, the step's time by part; ``kernels/planner_plots.py``) as a numbered figure with ``:name:``,
``:alt:`` and its caption as content. A results file that changes rebuilds the page; so does a change to the planner itself.
"""

from __future__ import annotations

import functools
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from results_tables import _table, check_figure, figure_nodes
from sphinx.util.docutils import SphinxDirective

from kernels import planner, planner_plots


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


@functools.cache
def _scaling() -> list[dict]:
    """``planner.scaling_table()`` once per build (a search over thousands of layouts: seconds)."""
    return planner.scaling_table()


def scaling_rows() -> list[list[str]]:
    return planner.scaling_cells(_scaling())


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


class PlannerFigure(SphinxDirective):
    has_content = True
    option_spec = {"name": directives.unchanged_required, "alt": directives.unchanged_required}

    def run(self):
        check_figure(self, "planner-figure", ("name", "alt"))
        _note_sources(self.env)
        return figure_nodes(self, planner_plots.draw_scaling(_scaling()))


def setup(app):
    app.add_directive("planner-validation", PlannerValidation)
    app.add_directive("planner-scaling", PlannerScaling)
    app.add_directive("planner-figure", PlannerFigure)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
