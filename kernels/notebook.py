"""Helpers for the course notebooks: the bootstrap's repository finder and MyST-NB glue.

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

    bundle, metadata = format_display_data(value)
    metadata = dict(metadata)
    metadata["scrapbook"] = {"name": name, "mime_prefix": GLUE_PREFIX}
    display({GLUE_PREFIX + k: v for k, v in bundle.items()}, raw=True, metadata=metadata)


def fmt(value: float, digits: int = 0) -> str:
    """A number as the book prints it: thousands separators, fixed digits."""
    return f"{value:,.{digits}f}"


def fmt_bytes(nbytes: float) -> str:
    """A message or buffer size as the book prints it: 1 KiB, 64 MiB, 1 GiB."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes / 1024:g} KiB"
