"""One figure style for the whole book.

Every notebook calls :func:`use` once in its set-up cell; every measured plot puts the GPU and dtype
in its title with :func:`title`, and labels its points with :func:`label_points`, which moves labels
apart so that none overlaps another or a marker.

Sizes: the book's text column is about 760 CSS pixels wide. A figure of ``COLUMN_WIDTH_IN`` inches
saved at ``DPI`` is 1,140 pixels wide, so the browser shows it at its own width or sharper (never
blown up), and a 10 pt font on it is as tall as the page's footnotes. The palette is Okabe and Ito's,
safe for the common forms of colour blindness.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

# Okabe & Ito (2008), "Color Universal Design": distinguishable under protanopia, deuteranopia and
# tritanopia. Black last: it is the axis colour, so it is used only when the others run out.
PALETTE = (
    "#0072B2",  # blue
    "#D55E00",  # vermillion
    "#009E73",  # bluish green
    "#E69F00",  # orange
    "#CC79A7",  # reddish purple
    "#56B4E9",  # sky blue
    "#F0E442",  # yellow
    "#000000",  # black
)
COLUMN_WIDTH_IN = 7.6  # the text column at 100 dpi (760 CSS px)
DPI = 150  # saved resolution: 1,140 px for a column-wide figure
FONT_PT = 10
SMALL_PT = 9  # the smallest text any figure may carry (tick labels, point labels, legends)


def rc() -> dict:
    """The matplotlib settings of the book (see :func:`use`)."""
    from cycler import cycler

    return {
        "figure.figsize": (COLUMN_WIDTH_IN, COLUMN_WIDTH_IN * 0.5),
        "figure.dpi": DPI,
        "savefig.dpi": DPI,
        "savefig.bbox": "tight",
        "figure.constrained_layout.use": True,
        "font.size": FONT_PT,
        "axes.titlesize": FONT_PT + 1,
        "axes.labelsize": FONT_PT,
        "xtick.labelsize": SMALL_PT,
        "ytick.labelsize": SMALL_PT,
        "legend.fontsize": SMALL_PT,
        "legend.frameon": False,
        "axes.prop_cycle": cycler(color=PALETTE),
        "axes.grid": True,
        "grid.alpha": 0.3,
        "axes.spines.top": False,
        "axes.spines.right": False,
        "lines.linewidth": 1.8,
        "lines.markersize": 5,
        "image.cmap": "viridis",  # perceptually uniform and colour-blind safe
    }


def use() -> None:
    """Apply the book's style to matplotlib and to the notebook's inline figures (PNG at DPI)."""
    import matplotlib as mpl

    mpl.rcParams.update(rc())
    try:  # inside IPython: inline figures at the saved resolution, cropped to their content
        from matplotlib_inline.backend_inline import set_matplotlib_formats

        set_matplotlib_formats("png", dpi=DPI, bbox_inches="tight")
    except Exception:  # plain Python (scripts, tests): nothing to configure
        pass


def figure(rows: int = 1, cols: int = 1, *, height: float | None = None, **kwargs):
    """``plt.subplots`` at the column width; ``height`` in inches (default: half the width per row)."""
    import matplotlib.pyplot as plt

    h = height if height is not None else COLUMN_WIDTH_IN * 0.5 * rows
    return plt.subplots(rows, cols, figsize=(COLUMN_WIDTH_IN, h), **kwargs)


def color(i: int) -> str:
    """The i-th colour of the palette (wraps around)."""
    return PALETTE[i % len(PALETTE)]


def title(ax, what: str, *, gpu: str | None = None, dtype: str | None = None) -> None:
    """Title a measured plot: what it shows, then the GPU (and dtype) it was measured on."""
    parts = [what]
    detail = ", ".join(p for p in (gpu, dtype) if p)
    if detail:
        parts.append(detail)
    text = ax.set_title(" · ".join(parts))
    if len(parts) > 1 and _wider_than_axes(text, ax):
        ax.set_title("\n".join(parts))  # a panel of a 1 x 2 figure is half the column wide


def _wider_than_axes(text, ax) -> bool:
    # Measured with the figure's renderer on the axes as laid out before drawing (constrained
    # layout then narrows them a little: hence the margin).
    renderer = ax.figure.canvas.get_renderer()
    return text.get_window_extent(renderer).width > 0.95 * ax.get_window_extent(renderer).width


def gpu_name() -> str:
    """The device measured plots are titled with ('CPU interpreter' without a GPU)."""
    from kernels import device

    return device.capabilities().name if device.GPU_MODE else "CPU interpreter (not GPU numbers)"


def label_points(
    ax,
    xs: Sequence[float],
    ys: Sequence[float],
    labels: Sequence[str],
    *,
    colors: Sequence[str] | None = None,
    fontsize: float = SMALL_PT,
) -> list:
    """Label points so that no two labels overlap each other or a marker.

    Labels start beside their points and are then moved apart by adjustText (with a thin leader
    line where a label had to move); without adjustText they stay beside their points.
    """
    texts = []
    for i, (x, y, text) in enumerate(zip(xs, ys, labels, strict=True)):
        c = colors[i] if colors is not None else "black"
        texts.append(ax.text(x, y, f" {text}", fontsize=fontsize, color=c, va="center"))
    if len(texts) > 1:
        try:
            from adjustText import adjust_text
        except ImportError:  # the labels stay where they are; a test checks adjustText is pinned
            return texts
        adjust_text(
            texts,
            x=list(xs),
            y=list(ys),
            ax=ax,
            arrowprops=dict(arrowstyle="-", color="0.5", lw=0.5),
        )
    return texts


def overlapping_texts(fig) -> list[tuple[str, str]]:
    """Pairs of visible texts on ``fig`` whose drawn boxes overlap (for tests of a figure): the
    axes' own texts (point labels, annotations) and their tick labels (long category names run
    into their neighbours)."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    pairs = _overlaps([t for ax in fig.axes for t in ax.texts], renderer)  # across panels too
    for ax in fig.axes:  # tick labels against their neighbours on the same axis
        pairs += _overlaps(ax.get_xticklabels(), renderer) + _overlaps(
            ax.get_yticklabels(), renderer
        )
    return pairs


def _overlaps(texts, renderer) -> list[tuple[str, str]]:
    boxes = [
        (t.get_text().strip(), t.get_window_extent(renderer))
        for t in texts
        if t.get_visible() and t.get_text().strip()
    ]
    return [
        (boxes[i][0], boxes[j][0])
        for i in range(len(boxes))
        for j in range(i + 1, len(boxes))
        if boxes[i][1].overlaps(boxes[j][1])
    ]


def save_svg(fig, path: Path) -> Path:
    """Write ``fig`` as SVG with no date or random ids in it (the same records give the same file)."""
    import matplotlib as mpl
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    with mpl.rc_context({"svg.hashsalt": "gpu-brrr"}):
        fig.savefig(path, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)
    return path
