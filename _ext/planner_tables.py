"""The planner's tables, computed at build time by ``kernels/planner.py`` (page 5.5).

``planner-validation``: the planner's prediction of every measured Act 5 DDP/FSDP step next to the
measurement (``planner.validate`` over ``results/nvidia-h200.jsonl``), with the calibrated MFU.
``planner-validation-lab5d``: the same for Lab 5d's runs (``planner.validate_lab5d``): the decoder's
steps under each recomputation policy, ring attention on two GPUs, TP+SP against TP.
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


def _cell(value: float, unit: str) -> str:
    return f"{value:.1f} ms" if unit == "ms" else f"{value:.3f}"


def lab5d_rows() -> tuple[dict, list[list[str]]]:
    """``planner.validate_lab5d``'s result and its rows as cells: what was measured, GPUs,
    measured, planner, error (times in ms, ratios bare)."""
    v = planner.validate_lab5d(planner.load_records())
    rows = [
        [
            r["variant"],
            str(r["gpus"]),
            _cell(r["measured"], r["unit"]),
            _cell(r["predicted"], r["unit"]),
            f"{100 * r['error']:+.1f}%",
        ]
        for r in v["rows"]
    ]
    return v, rows


def lab5d_note(v: dict) -> str:
    bw = ", ".join(f"{gbps:.1f} GB/s on {n} GPUs" for n, gbps in sorted(v["gbps"].items()))
    return (
        f"Calibrated MFU (the one fitted constant, from the {v['model']} step without "
        f"recomputation): {v['mfu']:.3f}. Ring rows start from one GPU's time at the same length, "
        f"SP rows from the TP time; bandwidth: the measured NCCL all-reduce bus bandwidth, {bw}; "
        "nothing overlapped."
    )


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


class PlannerValidationLab5d(SphinxDirective):
    def run(self):
        _note_sources(self.env)
        v, rows = lab5d_rows()
        header = ["Lab 5d measurement", "GPUs", "measured", "planner", "error"]
        return [_table(header, rows), nodes.paragraph(text=lab5d_note(v))]


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
    app.add_directive("planner-validation-lab5d", PlannerValidationLab5d)
    app.add_directive("planner-scaling", PlannerScaling)
    app.add_directive("planner-figure", PlannerFigure)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
