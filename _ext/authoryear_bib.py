"""One labelling style for citations and the bibliography: author-year in both (issue 15, item 7).

The chapters cite with sphinxcontrib-bibtex's `author_year` referencing style, "(Boehm, 2022)". This
extension makes the bibliography's labels read the same way, "[Boehm, 2022]", with a pybtex
formatting style `authoryear` (the plain style, sorted by author, year and title, labelled by the
very template the in-text citations use).

Many entries share an author and a year ("NVIDIA, 2025"). As in any author-year bibliography they
get a letter after the year, "2025a", "2025b" ... in title order, in the text and in the list alike:
the letter is written into the year field of the parsed entries, once, for the whole bibliography
(sphinxcontrib-bibtex offers no hook for that, so the extension wraps its `process_bibdata`).
"""

from __future__ import annotations

import string
from collections import defaultdict
from types import SimpleNamespace

import pybtex.plugin
from pybtex.style.formatting.plain import Style as PlainStyle
from pybtex.style.labels import BaseLabelStyle
from sphinxcontrib.bibtex import domain as bibtex_domain
from sphinxcontrib.bibtex.style.referencing import PersonStyle
from sphinxcontrib.bibtex.style.template import join, year

_PERSON = PersonStyle()
# The same author and year the `author_year` style prints inside "(...)" for {cite:p}.
_AUTHOR_YEAR = join(sep=", ")[_PERSON.author_or_editor_or_title(full=False), year]
BASE_YEAR = "x-base-year"  # where the year as written in references.bib is kept


def author_year_label(entry) -> str:
    """ "Author, year" as the in-text parenthetical citation shows it."""
    data = {"entry": entry, "style": SimpleNamespace(person=_PERSON)}
    return _AUTHOR_YEAR.format_data(data).render_as("text")


def disambiguate_years(entries) -> None:
    """Give entries that share "Author, year" the letters a, b, ... after the year, by title."""
    groups = defaultdict(list)
    for entry in entries.values():
        fields = entry.fields
        if BASE_YEAR in fields:  # already done for this parse
            fields["year"] = fields[BASE_YEAR]
        elif "year" in fields:
            fields[BASE_YEAR] = fields["year"]
        groups[author_year_label(entry)].append(entry)
    for group in groups.values():
        if len(group) < 2 or "year" not in group[0].fields:
            continue
        group.sort(key=lambda e: (e.fields.get("title", "").lower(), e.key))
        letters = _letters(len(group))
        for entry, letter in zip(group, letters):
            entry.fields["year"] = entry.fields[BASE_YEAR] + letter


def _letters(n: int) -> list[str]:
    """a ... z, then aa, ab ... (a group of 27 or more is unlikely, but stays unique)."""
    abc = string.ascii_lowercase
    return (list(abc) + [a + b for a in abc for b in abc])[:n]


class AuthorYearLabelStyle(BaseLabelStyle):
    def format_labels(self, sorted_entries):
        for entry in sorted_entries:
            yield author_year_label(entry)


class AuthorYearStyle(PlainStyle):
    default_label_style = AuthorYearLabelStyle
    default_sorting_style = "author_year_title"


_process_bibdata = bibtex_domain.process_bibdata


def _process_bibdata_with_letters(*args, **kwargs):
    bibdata = _process_bibdata(*args, **kwargs)
    disambiguate_years(bibdata.data.entries)
    return bibdata


def setup(app):
    pybtex.plugin.register_plugin("pybtex.style.formatting", "authoryear", AuthorYearStyle)
    bibtex_domain.process_bibdata = _process_bibdata_with_letters
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
