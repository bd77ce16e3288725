"""The results-across-gpus page, built at build time from every results/*.jsonl.

Two directives; kernels/results.py does the reading, the arithmetic and the drawing, so that the
logic has one home and its tests (tests/test_results.py) cover what the page shows. A results file
added to results/ appears in the next build.

``results-across-gpus``: a table. Rows are benchmarks, columns GPUs; each cell is the median fraction
of that GPU's own measured roof, the median speed-up over the same-run library baseline, and the
number of cases.

``results-figure``: a numbered figure (an SVG drawn now, written under ``_build/results-figures/``
next to the HTML, never committed), captioned by the directive's content and labelled by ``:name:``
for ``{numref}``. ``:kind: bars`` draws each benchmark's median roof fraction and speed-up per GPU;
``:kind: pairs`` draws every case measured on two GPUs, roof fraction against roof fraction; where
no case has been, the directive prints a sentence saying so instead of an empty plot. ``:alt:`` is
the image's alt text.

Both take ``:prefix:`` (keep only benchmarks whose name starts with it) and ``:exclude:`` (drop
those that start with it); a figure's labels leave the prefix out.
"""

from __future__ import annotations

from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective

from kernels import plotstyle, results

FIGURE_DIR = Path("_build") / "results-figures"  # relative to the book's source folder


def _table(header: list[str], rows: list[list[str]]) -> nodes.table:
    table = nodes.table(classes=["results-across-gpus"])
    group = nodes.tgroup(cols=len(header))
    table += group
    for _ in header:
        group += nodes.colspec(colwidth=1)
    head, body = nodes.thead(), nodes.tbody()
    group += head
    group += body
    for target, cells in ((head, [header]), (body, rows)):
        for cells_row in cells:
            row = nodes.row()
            for text in cells_row:
                entry = nodes.entry()
                entry += nodes.paragraph(text=text)
                row += entry
            target += row
    return table


def check_figure(directive: SphinxDirective, name: str, needs: tuple[str, ...]) -> None:
    """The start of a figure directive's ``run``: matplotlib without a display, the ``needs``
    options and a caption present (an error naming the directive ``name`` otherwise)."""
    import matplotlib

    matplotlib.use("Agg")  # no display in a build
    for need in needs:
        if need not in directive.options:
            raise directive.error(f"{name} needs :{need}:")
    if not directive.content:
        raise directive.error(f"{name} needs a caption (the directive's content)")


def figure_nodes(directive: SphinxDirective, fig) -> list[nodes.Node]:
    """A numbered figure of ``fig`` for a figure directive with ``:name:``, ``:alt:`` and its caption
    as content: the SVG is written under ``FIGURE_DIR`` (built, never committed) and shown with the
    caption; ``:name:`` labels it for ``{numref}``."""
    rel = FIGURE_DIR / f"{nodes.make_id(directive.options['name'])}.svg"
    plotstyle.save_svg(fig, Path(directive.env.srcdir) / rel)
    figure = nodes.figure(classes=["results-figure"])
    figure += nodes.image(uri="/" + rel.as_posix(), alt=directive.options["alt"])
    text = " ".join(directive.content).strip()
    inline, messages = directive.state.inline_text(text, directive.lineno)
    figure += nodes.caption(text, "", *inline)
    directive.add_name(figure)
    return [figure, *messages]


class _ResultsDirective(SphinxDirective):
    def records(self) -> list[dict]:
        directory = results.RESULTS_DIR
        for path in directory.glob("*.jsonl"):  # rebuild the page when a results file changes
            self.env.note_dependency(str(path))
        return results.load_all(directory)

    def section(self, table: dict) -> dict:
        return results.select(table, self.options.get("prefix", ""), self.options.get("exclude"))


class ResultsAcrossGpus(_ResultsDirective):
    option_spec = {"prefix": directives.unchanged, "exclude": directives.unchanged}

    def run(self):
        gpus, summary = results.summary(self.records())
        kept = self.section(summary)
        gpus = [g for g in gpus if any(g in per_gpu for per_gpu in kept.values())]
        if not kept:
            return [nodes.paragraph(text="No results recorded yet.")]
        rows = [[b] + [results.cell_text(p.get(g)) for g in gpus] for b, p in kept.items()]
        return [_table(["benchmark", *gpus], rows)]


class ResultsFigure(_ResultsDirective):
    has_content = True
    option_spec = {
        "kind": lambda arg: directives.choice(arg, ("bars", "pairs")),
        "name": directives.unchanged_required,
        "alt": directives.unchanged_required,
        "prefix": directives.unchanged,
        "exclude": directives.unchanged,
    }

    def run(self):
        check_figure(self, "results-figure", ("kind", "name", "alt"))
        records = self.records()
        gpus, summary = results.summary(records)
        colors = results.gpu_colors(gpus)  # one colour per GPU across the page's figures
        if self.options["kind"] == "bars":
            prefix = self.options.get("prefix", "")
            fig = results.draw_bars(self.section(summary), colors, strip=prefix)
            empty = "No results recorded yet."
        else:
            kept = set(self.section(summary))
            fig = results.draw_pairs([r for r in records if r["bench"] in kept], colors)
            empty = (
                "No case has been measured on two GPUs yet, so there is no case-by-case "
                "comparison to draw: a run of the same benchmark on a second GPU adds one."
            )
        if fig is None:
            return [nodes.paragraph(text=empty)]
        return figure_nodes(self, fig)


def setup(app):
    app.add_directive("results-across-gpus", ResultsAcrossGpus)
    app.add_directive("results-figure", ResultsFigure)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
