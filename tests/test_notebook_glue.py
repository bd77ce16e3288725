"""kernels.notebook.glue: a glued figure's later displays show the bytes glue recorded, so a page's
{glue} image and the cell's shown figure are one render (MyST-NB writes the page's image file from
the shown output; two renders of a constrained layout can differ, leaving the page a missing image)."""

from __future__ import annotations

import pytest

pytest.importorskip("IPython")
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from IPython.core.pylabtools import select_figure_formats  # noqa: E402

from kernels.notebook import GLUE_PREFIX, glue  # noqa: E402


@pytest.fixture
def shell(monkeypatch):
    sh = InteractiveShell.instance()
    select_figure_formats(sh, {"png"})  # what the inline backend registers in a notebook
    shown = []
    monkeypatch.setattr(
        sh.display_pub, "publish", lambda data, metadata=None, **kw: shown.append(data)
    )
    yield sh, shown
    InteractiveShell.clear_instance()


def test_a_glued_figure_shows_the_glued_bytes(shell):
    sh, shown = shell
    fig, ax = plt.subplots(layout="constrained")
    ax.plot([1, 2, 3])
    ax.set_title("a title long enough for the layout to move")
    glue("fig", fig)
    glued = shown[-1][GLUE_PREFIX + "image/png"]
    fig.axes[0].set_ylabel("a change after glue is not shown: glue after the last change")
    data, _ = sh.display_formatter.format(fig)
    assert data["image/png"] == glued
    glue("fig", fig)  # glued again: a fresh render, which later displays then show
    again = shown[-1][GLUE_PREFIX + "image/png"]
    assert again != glued and sh.display_formatter.format(fig)[0]["image/png"] == again
    plt.close(fig)


def test_figures_never_glued_render_as_usual(shell):
    sh, shown = shell
    fig, ax = plt.subplots()
    ax.plot([3, 1])
    glue("other", plt.figure())
    first = sh.display_formatter.format(fig)[0]["image/png"]
    ax.set_xlabel("x")
    assert sh.display_formatter.format(fig)[0]["image/png"] != first
    plt.close("all")


def test_numbers_glue_as_text(shell):
    _, shown = shell
    glue("n", "1,234")
    assert shown[-1] == {GLUE_PREFIX + "text/plain": "'1,234'"}
