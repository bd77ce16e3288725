"""The planner's scaling table as a figure (page 5.5): where each GPU's memory and each step's time go.

``scaling_series(rows)`` turns ``planner.scaling_table`` rows into plain numbers (pure, tested);
``draw_scaling(rows)`` draws them in two panels sharing one row per (model, GPU count): memory per
GPU stacked by kind against the GPU's capacity, and the step's time split into compute,
communication, bubble and optimizer as fractions of the step. A layout that does not fit is a row
that says so.
"""

from __future__ import annotations

from dataclasses import dataclass

MEMORY_PARTS = ("weights", "grads", "optimizer", "activations")
TIME_PARTS = ("compute", "comm", "bubble", "optimizer")
# Palette indices: the optimizer is green in both panels (its states, its update); no other
# colour means two things.
COLORS = {"weights": 0, "grads": 1, "optimizer": 2, "activations": 3, "compute": 5, "comm": 4,
          "bubble": 6}  # fmt: skip


@dataclass(frozen=True)
class ScalingRow:
    label: str  # "70B-class · 64 GPUs"
    config: str | None  # the layout's label, None where nothing fits
    memory_gb: dict[str, float]  # MEMORY_PARTS -> GB per GPU
    time_frac: dict[str, float]  # TIME_PARTS -> fraction of the step
    capacity_gb: float


def scaling_series(rows: list[dict]) -> list[ScalingRow]:
    """One ``ScalingRow`` per ``scaling_table`` row; memory in GB, time as fractions summing to 1."""
    out = []
    for r in rows:
        label = f"{r['model']} · {r['gpus']} GPUs"
        pl = r["plan"]
        if pl is None:
            out.append(ScalingRow(label, None, {}, {}, 0.0))
            continue
        mem = {k: pl.memory[k] / 1e9 for k in MEMORY_PARTS}
        t = pl.time
        parts = {
            "compute": t["compute"],
            "comm": pl.comm_s,
            "bubble": t["bubble"],
            "optimizer": t["optimizer"],
        }
        total = sum(parts.values())
        frac = {k: v / total for k, v in parts.items()}
        out.append(ScalingRow(label, pl.parallel.label(), mem, frac, pl.cluster.memory_bytes / 1e9))
    return out


def draw_scaling(rows: list[dict]):
    """The figure of :func:`scaling_series` (a matplotlib Figure)."""
    import matplotlib as mpl

    from kernels import plotstyle

    series = scaling_series(rows)
    with mpl.rc_context(plotstyle.rc()):
        fig, (ax_m, ax_t) = plotstyle.figure(1, 2, height=0.9 + 0.36 * len(series), sharey=True)
        ys = list(range(len(series)))
        for ax, parts, key in ((ax_m, MEMORY_PARTS, "memory_gb"), (ax_t, TIME_PARTS, "time_frac")):
            left = [0.0] * len(series)
            for part in parts:
                vals = [getattr(s, key).get(part, 0.0) for s in series]
                ax.barh(
                    ys, vals, left=left, height=0.7, color=plotstyle.color(COLORS[part]), label=part
                )
                left = [a + b for a, b in zip(left, vals, strict=True)]
            ax.grid(axis="y", visible=False)
            ax.legend(loc="lower center", bbox_to_anchor=(0.5, 1.0), ncols=2)
        for y, s in zip(ys, series, strict=True):
            if s.config is None:
                ax_m.text(1, y, "nothing fits", va="center", fontsize=plotstyle.SMALL_PT)
        cap = max((s.capacity_gb for s in series), default=0.0)
        if cap:
            ax_m.axvline(cap, color="0.3", lw=0.8, ls="--")
        ax_m.set_xlabel("GB per GPU (dashed: the GPU's memory)")
        ax_t.set_xlabel("share of the step's time")
        ax_t.set_xlim(0, 1)
        ax_m.set_yticks(ys, [s.label for s in series])
        ax_m.set_ylim(len(series) - 0.5, -0.5)
    return fig
