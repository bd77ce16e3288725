"""Every number traceable: find the typed measurements in the book's prose (issue 15, item 6).

A *typed measurement* is a number followed (optionally after a space, a no-break space or a thin
space) by a unit: ns µs us ms GB/s TB/s GiB/s TFLOP/s GFLOP/s PFLOP/s tokens/s tok/s ×, or an ``x``
right after the digits (``2.5x``). A ``×`` or ``x`` between two numbers is a product or a shape
(``8192 × 8192``, ``8x8``), not a measurement.

Code (fenced, code directives, inline), math (``$...$``, ``$$...$$``, ``{math}``), HTML and its
comments, MyST ``%`` comments, roles (``{glue:text}`...```, ``{cite}`...```...), link targets and
bare URLs are not prose and are not scanned. A typed measurement is traceable when

1. it is glued: a glue role is a role, so a glued number is never typed at all;
2. its block (a paragraph, a list item, a table row, a directive's title line) also holds a
   ``{cite}`` role: a published figure with its source;
3. its block is covered by a MyST comment line ``% numbers: <reason>`` directly above it, the
   reason starting with ``napkin``, ``datasheet``, ``published <bibkey>``, ``profiled <file>``
   (a measurement kept in the repository, e.g. a Nsight Compute summary under ``results/``) or
   ``illustrative``. The marker covers the lines after it up to the next blank line; placed right before a directive's
   opening fence it covers the whole directive.

Any other typed measurement is an offender, reported as ``file:line: "text"``; so is a malformed
marker, a marker that covers nothing, a ``published`` marker whose key is not in references.bib
and a ``profiled`` marker whose file is not in the repository.

    python tools/check_numbers.py                 # acts/*.md, intro.md and setup.md
    python tools/check_numbers.py acts/act7-*.md  # some pages

Exit status 1 when there is an offender, 0 otherwise.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Directives whose body is code or math, never prose.
CODE_DIRECTIVES = {
    "code",
    "code-block",
    "code-cell",
    "sourcecode",
    "literalinclude",
    "math",
    "raw",
    "mermaid",
    "graphviz",
}
REASONS = ("napkin", "datasheet", "published", "profiled", "illustrative")

FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,}|:{3,})\s*(?:\{(?P<name>[\w:.-]+)\})?")
MARKER = re.compile(r"^\s*%\s*numbers\s*:\s*(?P<reason>.*)$")
COMMENT = re.compile(r"^\s*%")
BLOCK_START = re.compile(r"^\s*(?:[-*+]\s|\d+[.)]\s|\||#{1,6}\s|\(.+\)=\s*$|\+\+\+)")
OPTION = re.compile(r"^\s*:[\w-]+:")
CITE = re.compile(r"\{cite(?::[\w]+)?\}`")

# Placeholder for a removed role, code span or inline formula: it stands for "a value" so that
# `8192 × {glue:text}`n`` still reads as a product, and it never matches as a number itself.
HOLE = "\u27e8\u27e9"
INLINE_STRIP = [
    re.compile(r"<!--.*?-->", re.S),  # HTML comments inside a block
    re.compile(r"\{[\w:.-]+\}(`+).*?\1", re.S),  # roles, glue and cite included
    re.compile(r"(`+).*?\1", re.S),  # inline code
    re.compile(r"\$\$.*?\$\$", re.S),  # display math written inline
    re.compile(r"(?<![\\$])\$(?!\$)[^$]+?(?<!\\)\$", re.S),  # inline math
    re.compile(r"\{\{.*?\}\}", re.S),  # substitutions
    re.compile(r"(?<=\])\([^)\s]*\)"),  # link targets
    re.compile(r"https?://\S+"),  # bare URLs (linkify)
    re.compile(r"</?[A-Za-z][^>]*>"),  # HTML tags
]

SPACE = "[ \u00a0\u202f\u2009]?"
NUMBER = r"(?<![\w.,/\u27e9])\d+(?:[.,]\d+)*"
UNIT = (
    r"(?:(?:ns|\u00b5s|\u03bcs|us|ms)(?![\w/])"
    r"|(?:GB|TB|GiB)/s|[TGP]FLOP/s|tokens/s|tok/s)"
)
NOT_A_FACTOR = r"(?!\s*[\d\u27e8$])"  # `8192 × 8192` and `8x8` are products, not speed-ups
MEASUREMENT = re.compile(
    rf"{NUMBER}(?:{SPACE}{UNIT}|{SPACE}\u00d7{NOT_A_FACTOR}|x(?![\w\u27e8]){NOT_A_FACTOR})"
)


@dataclass(frozen=True)
class Offender:
    path: str
    line: int
    text: str

    def __str__(self) -> str:
        return f'{self.path}:{self.line}: "{self.text}"'


def bib_keys(bib: Path = ROOT / "references.bib") -> set[str]:
    """The citation keys of a BibTeX file (empty when it does not exist)."""
    if not bib.is_file():
        return set()
    return set(re.findall(r"^\s*@\w+\s*\{\s*([^,\s]+)\s*,", bib.read_text(encoding="utf-8"), re.M))


def _closing(lines: list[str], start: int, fence: str) -> int:
    """Index of the line closing the fence opened at `start` (the last line when unclosed)."""
    char, width = fence[0], len(fence)
    pattern = re.compile(rf"^\s*{re.escape(char)}{{{width},}}\s*$")
    for i in range(start + 1, len(lines)):
        if pattern.match(lines[i]):
            return i
    return len(lines) - 1


def _check_marker(reason: str, keys: set[str] | None) -> str | None:
    """Why a `% numbers:` reason is malformed, or None when it is fine."""
    words = reason.split()
    if not words or not any(words[0].lower().startswith(r) for r in REASONS):
        return f"marker reason must start with one of {', '.join(REASONS)}"
    if words[0].lower().startswith("published"):
        if len(words) < 2:
            return "a `published` marker names the bib key of its source"
        key = words[1].strip(",.;:()")
        if keys is not None and key not in keys:
            return f"bib key {key!r} of the marker is not in references.bib"
    if words[0].lower().startswith("profiled"):
        if len(words) < 2:
            return "a `profiled` marker names the file that holds the measurement"
        path = words[1].strip(",.;:()")
        if not (ROOT / path).is_file():
            return f"file {path!r} of the `profiled` marker is not in the repository"
    return None


def _blocks(lines: list[str], report) -> tuple[list[tuple[int, int]], set[int]]:
    """The prose blocks (first, last line index) and the line indices covered by a marker."""
    blocks: list[tuple[int, int]] = []
    covered: set[int] = set()
    current: list[int] = []

    def close():
        if current:
            blocks.append((current[0], current[-1]))
            current.clear()

    i = 0
    if lines and lines[0].strip() == "---":  # YAML front matter
        i = next((j + 1 for j in range(1, len(lines)) if lines[j].strip() == "---"), len(lines))
    pending: int | None = None  # line of a marker waiting for its block
    open_fences: list[str] = []  # the fences of the prose directives we are inside
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        marker = MARKER.match(line)
        if marker:
            close()
            problem = _check_marker(marker["reason"], report.keys)
            if problem:
                report.add(i, f"{stripped}: {problem}")
            pending = i
            i += 1
            continue
        if COMMENT.match(line):
            close()
            i += 1
            continue
        if pending is not None:
            if not stripped:
                report.add(
                    pending, f"{lines[pending].strip()}: covers no block (blank line after it)"
                )
            else:
                fence = FENCE.match(line)
                if fence:
                    end = _closing(lines, i, fence["fence"])
                else:
                    end = next(
                        (j - 1 for j in range(i, len(lines)) if not lines[j].strip()),
                        len(lines) - 1,
                    )
                covered.update(range(i, end + 1))
            pending = None
        if not stripped:
            close()
            i += 1
            continue
        if stripped.startswith("<!--"):
            close()
            end = next((j for j in range(i, len(lines)) if "-->" in lines[j]), len(lines) - 1)
            i = end + 1
            continue
        if stripped.startswith("$$"):
            close()
            if stripped.count("$$") >= 2:
                i += 1
            else:
                i = (
                    next((j for j in range(i + 1, len(lines)) if "$$" in lines[j]), len(lines) - 1)
                    + 1
                )
            continue
        fence = FENCE.match(line)
        if fence:
            close()
            mark, name = fence["fence"], fence["name"]
            if open_fences and stripped == mark and mark[0] == open_fences[-1][0]:
                if len(mark) >= len(open_fences[-1]):  # closes the innermost prose directive
                    open_fences.pop()
                i += 1
                continue
            if (name is None and mark[0] != ":") or name in CODE_DIRECTIVES:
                i = _closing(lines, i, mark) + 1  # code or math: skipped whole
                continue
            open_fences.append(mark)
            blocks.append((i, i))  # the directive line (its title) is a block of its own
            i += 1
            continue
        if BLOCK_START.match(line) or OPTION.match(line):
            close()
        current.append(i)
        if OPTION.match(line) or stripped.startswith("#") or stripped.startswith("|"):
            close()
        i += 1
    close()
    if pending is not None:
        report.add(pending, f"{lines[pending].strip()}: covers no block (end of file)")
    return blocks, covered


def _strip(text: str) -> str:
    """The prose of a block: everything that is not prose becomes a HOLE, newlines kept."""
    for pattern in INLINE_STRIP:
        text = pattern.sub(lambda m: HOLE + "\n" * m.group(0).count("\n"), text)
    return text


class _Report:
    def __init__(self, path: str, keys: set[str] | None):
        self.path, self.keys = path, keys
        self.offenders: list[Offender] = []

    def add(self, index: int, text: str):
        self.offenders.append(Offender(self.path, index + 1, text))


def check_text(text: str, path: str = "<text>", keys: set[str] | None = None) -> list[Offender]:
    """The offenders in one page's Markdown source; `keys` (when given) validates `published`."""
    lines = text.splitlines()
    report = _Report(path, keys)
    blocks, covered = _blocks(lines, report)
    for first, last in blocks:
        raw = "\n".join(lines[first : last + 1])
        if CITE.search(raw):
            continue
        prose = _strip(raw)
        for match in MEASUREMENT.finditer(prose):
            index = first + prose.count("\n", 0, match.start())
            if index not in covered:
                report.add(index, match.group(0).replace("\u00a0", " ").replace("\u202f", " "))
    return sorted(report.offenders, key=lambda o: o.line)


def check_files(paths, root: Path = ROOT) -> list[Offender]:
    """The offenders in the given Markdown files, paths shown relative to `root` when inside it."""
    keys = bib_keys(root / "references.bib") or None
    found: list[Offender] = []
    for path in map(Path, paths):
        try:
            shown = path.resolve().relative_to(root).as_posix()
        except ValueError:
            shown = str(path)
        found += check_text(path.read_text(encoding="utf-8"), shown, keys)
    return found


def default_paths(root: Path = ROOT) -> list[Path]:
    """The pages the rule applies to: every acts/*.md, intro.md and setup.md."""
    return sorted((root / "acts").glob("*.md")) + [root / "intro.md", root / "setup.md"]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    paths = [Path(a) for a in args] or default_paths()
    missing = [p for p in paths if not p.is_file()]
    if missing:
        print(f"error: no such file: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    offenders = check_files(paths)
    for offender in offenders:
        print(offender)
    if offenders:
        print(
            f"{len(offenders)} untraceable typed number(s): glue them, cite their source in the same "
            "block, or mark the block with `% numbers: napkin|datasheet|published <key>|profiled <file>|illustrative`",
            file=sys.stderr,
        )
    return 1 if offenders else 0


if __name__ == "__main__":
    sys.exit(main())
