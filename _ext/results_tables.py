"""The ``results-across-gpus`` directive: a table built at build time from every results/*.jsonl.

Rows are benchmarks, columns GPUs; each cell is the median fraction of that GPU's own measured roof,
the median speed-up over the same-run library baseline, and the number of cases (kernels/results.py
does the reading and the arithmetic). A results file added to results/ appears in the next build.
Options: ``:prefix:`` keeps only benchmarks whose name starts with it; ``:exclude:`` drops those
that start with it.
"""

from __future__ import annotations

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.util.docutils import SphinxDirective

from kernels import results


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


class ResultsAcrossGpus(SphinxDirective):
    option_spec = {"prefix": directives.unchanged, "exclude": directives.unchanged}

    def run(self):
        directory = results.RESULTS_DIR
        for path in directory.glob("*.jsonl"):  # rebuild the page when a results file changes
            self.env.note_dependency(str(path))
        gpus, summary = results.summary(results.load_all(directory))
        prefix, exclude = self.options.get("prefix", ""), self.options.get("exclude")
        kept = {
            bench: per_gpu
            for bench, per_gpu in summary.items()
            if bench.startswith(prefix) and not (exclude and bench.startswith(exclude))
        }
        gpus = [g for g in gpus if any(g in per_gpu for per_gpu in kept.values())]
        if not kept:
            return [nodes.paragraph(text="No results recorded yet.")]
        rows = [[b] + [results.cell_text(p.get(g)) for g in gpus] for b, p in kept.items()]
        return [_table(["benchmark", *gpus], rows)]


def setup(app):
    app.add_directive("results-across-gpus", ResultsAcrossGpus)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
