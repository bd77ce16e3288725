"""Helpers for the course notebooks: MyST-NB glue and the book's number formats (``fmt``,
``fmt_bytes``).

``glue(name, value)`` stores a value in a notebook's outputs under ``name`` exactly as
``myst_nb.glue(..., display=False)`` does, so the book's chapters can paste measured numbers and
figures instead of typing them: from a chapter in acts/, ``{glue:text}`../notebooks/NB.ipynb::name:s` ``
(the path is relative to the chapter; the trailing format spec is required). It works without myst_nb
installed, which matters on GPU machines that only have torch.
"""

from __future__ import annotations

GLUE_PREFIX = "application/papermill.record/"


def glue(name: str, value) -> None:
    """Record ``value`` (a number, string or matplotlib figure) for the book, without displaying it."""
    from IPython.core.formatters import format_display_data
    from IPython.display import display

    _forget_render(value)
    bundle, metadata = format_display_data(value)
    _keep_render(value, bundle)
    metadata = dict(metadata)
    metadata["scrapbook"] = {"name": name, "mime_prefix": GLUE_PREFIX}
    display({GLUE_PREFIX + k: v for k, v in bundle.items()}, raw=True, metadata=metadata)


# A glued figure is usually shown too (glue, then plt.show()), and MyST-NB writes the image file a
# page's {glue} points at from the render the cell shows. Two renders of one figure can differ (a
# constrained layout settles over draws), and then that page has a missing image. So glue keeps its
# render on the figure, and the PNG formatter returns it for every later display of that figure:
# the notebook shows exactly the bytes the pages glue. (Glue a figure after its last change.)
_RENDER = "_gpu_brrr_png"


def _png_formatter():
    try:
        from IPython import get_ipython
        from matplotlib.figure import Figure
    except ImportError:
        return None, None
    ip = get_ipython()
    return (ip.display_formatter.formatters["image/png"], Figure) if ip else (None, None)


def _forget_render(value) -> None:
    if hasattr(value, _RENDER):
        delattr(value, _RENDER)


def _keep_render(value, bundle: dict) -> None:
    formatter, figure = _png_formatter()
    if formatter is None or not isinstance(value, figure) or "image/png" not in bundle:
        return
    try:
        printer = formatter.lookup_by_type(figure)
    except KeyError:  # no PNG printer for figures (not the inline backend): nothing re-renders
        return
    if not getattr(printer, "keeps_glued_render", False):

        def printer_keeping_glue(fig, render=printer):
            kept = getattr(fig, _RENDER, None)
            return kept if kept is not None else render(fig)

        printer_keeping_glue.keeps_glued_render = True
        formatter.for_type(figure, printer_keeping_glue)
    setattr(value, _RENDER, bundle["image/png"])


def fmt(value: float, digits: int = 0) -> str:
    """A number as the book prints it: thousands separators, fixed digits."""
    return f"{value:,.{digits}f}"


def fmt_bytes(nbytes: float) -> str:
    """A message or buffer size as the book prints it: 1 KiB, 64 MiB, 1 GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes / 1024:g} KiB"
