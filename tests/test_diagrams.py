"""Concept diagrams (issue 15, item 3): hand-written SVGs in diagrams/, in one visual language.

Each diagrams/*.svg is valid XML with a <title> and a <desc>, is drawn for the 760 px text column
(viewBox width 760), has no text below 13 px, references nothing outside itself, and is shown on
some page with alt text. Every act shows at least one diagram. `test_rules_*` feed the checks
broken examples, so no rule is vacuous.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DIAGRAMS = sorted((ROOT / "diagrams").glob("*.svg"))
SVG_NS = "{http://www.w3.org/2000/svg}"
VIEWBOX_WIDTH = 760
MIN_FONT_PX = 13
NAME = re.compile(r"^(act\d+(-5)?|side)-[a-z0-9]+(-[a-z0-9]+)*\.svg$")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _font_sizes(root: ET.Element) -> list[float]:
    """Every font size the SVG sets, in px (attributes and inline/embedded CSS)."""
    sizes = []
    for el in root.iter():
        if (value := el.get("font-size")) is not None:
            sizes.append(value)
        sizes += re.findall(r"font-size\s*:\s*([^;\"'}]+)", el.get("style") or "")
        if el.tag == f"{SVG_NS}style" and el.text:
            sizes += re.findall(r"font-size\s*:\s*([^;\"'}]+)", el.text)
    out = []
    for size in sizes:
        m = re.fullmatch(r"\s*([\d.]+)\s*(px|pt)?\s*", size)
        if not m:
            out.append(0.0)  # a relative size (em, %, smaller) cannot be checked: report it
            continue
        out.append(float(m[1]) * (4 / 3 if m[2] == "pt" else 1))
    return out


def check_svg(text: str) -> list[str]:
    """What is wrong with one diagram's source."""
    try:
        root = ET.fromstring(text)
    except ET.ParseError as exc:
        return [f"not valid XML: {exc}"]
    problems = []
    if root.tag != f"{SVG_NS}svg":
        problems.append("root element is not <svg> in the SVG namespace")
    for part in ("title", "desc"):
        el = root.find(f"{SVG_NS}{part}")
        if el is None or not (el.text or "").strip():
            problems.append(f"no <{part}> (accessibility) as a child of <svg>")
    box = (root.get("viewBox") or "").replace(",", " ").split()
    if len(box) != 4 or box[:3] != ["0", "0", str(VIEWBOX_WIDTH)]:
        problems.append(f'viewBox is {root.get("viewBox")!r}, not "0 0 {VIEWBOX_WIDTH} H"')
    if small := sorted({s for s in _font_sizes(root) if s < MIN_FONT_PX}):
        problems.append(f"font sizes below {MIN_FONT_PX}px: {small}")
    if not any(el.tag == f"{SVG_NS}text" for el in root.iter()):
        problems.append("no <text>: a concept diagram labels its parts")
    for el in root.iter():
        tag = el.tag.removeprefix(SVG_NS)
        if tag in ("script", "foreignObject", "image"):
            problems.append(f"<{tag}> element (no scripts, embedded HTML or images)")
        for key, value in el.attrib.items():
            if key.endswith("href") and not value.startswith("#"):
                problems.append(f"external reference {key}={value!r}")
        refs = re.findall(
            r"url\(\s*['\"]?([^)'\"]+)", " ".join(el.attrib.values()) + (el.text or "")
        )
        problems += [f"external url({r})" for r in refs if not r.startswith("#")]
        if tag == "style" and el.text and "@import" in el.text:
            problems.append("@import in <style> (no external fonts or CSS)")
    return problems


# --- where diagrams are shown ----------------------------------------------------------------


def _page_sources() -> dict[Path, str]:
    """Every page's Markdown: acts/*.md and the other top-level pages, notebooks' markdown cells."""
    pages = {p: p.read_text(encoding="utf-8") for p in sorted(ROOT.glob("*.md"))}
    pages.update({p: p.read_text(encoding="utf-8") for p in sorted((ROOT / "acts").glob("*.md"))})
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8")).get("cells", [])
        md = [c for c in cells if c.get("cell_type") == "markdown"]
        pages[nb] = "\n\n".join(
            "".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in md
        )
    return pages


_FIGURE = re.compile(
    r"^(?P<fence>`{3,}|:{3,})\{figure\}\s+(?P<src>\S+)\s*\n(?P<body>.*?)^(?P=fence)\s*$",
    re.MULTILINE | re.DOTALL,
)
_MD_IMAGE = re.compile(r"!\[(?P<alt>[^\]]*)\]\((?P<src>[^)\s]+)")
_HTML_IMG = re.compile(r"<img\b[^>]*>", re.IGNORECASE)


def diagram_uses(text: str) -> list[tuple[str, str]]:
    """(diagram file name, alt text) for every diagram a page shows ('' when it has no alt)."""
    uses = []
    for m in _FIGURE.finditer(text):
        alt = re.search(r"^\s*:alt:\s*(.+)$", m["body"], re.MULTILINE)
        uses.append((m["src"], alt.group(1).strip() if alt else ""))
    uses += [(m["src"], m["alt"].strip()) for m in _MD_IMAGE.finditer(text)]
    for tag in _HTML_IMG.findall(text):
        src = re.search(r"src=[\"']([^\"']+)", tag)
        alt = re.search(r"alt=[\"']([^\"']*)", tag)
        if src:
            uses.append((src.group(1), alt.group(1).strip() if alt else ""))
    return [
        (Path(src).name, alt) for src, alt in uses if "diagrams/" in src and src.endswith(".svg")
    ]


PAGES = _page_sources()
USES = {page: diagram_uses(text) for page, text in PAGES.items()}


@pytest.mark.parametrize("svg", DIAGRAMS, ids=_rel)
def test_diagram_source(svg):
    assert NAME.match(svg.name), (
        f"{svg.name}: want actN-<what>.svg, act1-5-<what>.svg or side-<what>.svg"
    )
    assert not (problems := check_svg(svg.read_text(encoding="utf-8"))), problems


@pytest.mark.parametrize("svg", DIAGRAMS, ids=_rel)
def test_diagram_is_shown_with_alt_text(svg):
    shown = [(page, alt) for page, uses in USES.items() for name, alt in uses if name == svg.name]
    assert shown, f"{_rel(svg)} is not shown on any page"
    assert all(alt for _page, alt in shown), f"{_rel(svg)} shown without alt text: {shown}"


def test_every_shown_diagram_exists():
    names = {svg.name for svg in DIAGRAMS}
    missing = sorted({(_rel(p), n) for p, uses in USES.items() for n, _ in uses if n not in names})
    assert not missing, missing


def _act_parts() -> dict[str, list[Path]]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    parts = {}
    for part in toc.get("parts", []):
        files, stack = [], list(part.get("chapters", []))
        while stack:
            item = stack.pop(0)
            if "file" in item:
                files.append(item["file"])
            stack[:0] = item.get("sections", [])
        pages = [ROOT / f"{f}.md" for f in files if f.startswith("acts/")]
        pages += [ROOT / f"{f}.ipynb" for f in files if f.startswith("notebooks/")]
        if any(p.suffix == ".md" for p in pages):
            parts[part.get("caption", "")] = [p for p in pages if p.is_file()]
    return parts


@pytest.mark.parametrize("caption", list(_act_parts()))
def test_every_act_has_a_concept_diagram(caption):
    pages = _act_parts()[caption]
    assert any(USES.get(p) for p in pages), f"{caption}: no diagrams/*.svg shown on its pages"


# --- the rules themselves ----------------------------------------------------------------------

_GOOD = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 760 200" '
    'font-family="DejaVu Sans, Helvetica, Arial, sans-serif">'
    "<title>Ring all-reduce</title><desc>Four GPUs pass chunks around a ring.</desc>"
    '<defs><marker id="arrow"><path d="M0,0 L6,3 L0,6"/></marker></defs>'
    '<rect x="10" y="10" width="100" height="40" rx="6" fill="#CCE3F0" stroke="#333333"/>'
    '<line x1="110" y1="30" x2="200" y2="30" marker-end="url(#arrow)"/>'
    '<text x="20" y="35" font-size="14">GPU 0</text></svg>'
)


def test_rules_accept_a_good_diagram():
    assert check_svg(_GOOD) == []


@pytest.mark.parametrize(
    ("change", "expect"),
    [
        (lambda s: s.replace("</svg>", ""), "not valid XML"),
        (lambda s: s.replace("<title>Ring all-reduce</title>", ""), "no <title>"),
        (lambda s: s.replace("<desc>Four GPUs pass chunks around a ring.</desc>", ""), "no <desc>"),
        (lambda s: s.replace("0 0 760 200", "0 0 800 200"), "viewBox"),
        (lambda s: s.replace('font-size="14"', 'font-size="11"'), "font sizes below"),
        (lambda s: s.replace('font-size="14"', 'style="font-size: 9pt"'), "font sizes below"),
        (lambda s: s.replace("</svg>", '<image href="https://x.org/a.png"/></svg>'), "<image>"),
        (
            lambda s: s.replace(
                "</svg>", '<style>@import url("https://fonts.x/f.css");</style></svg>'
            ),
            "@import",
        ),
        (lambda s: s.replace("url(#arrow)", "url(https://x.org/m.svg#a)"), "external url"),
        (
            lambda s: s.replace("</svg>", '<a href="https://x.org">x</a></svg>'),
            "external reference",
        ),
    ],
)
def test_rules_catch_bad_diagrams(change, expect):
    problems = check_svg(change(_GOOD))
    assert any(expect in p for p in problems), problems


def test_rules_find_diagram_uses_and_alt_text():
    page = (
        "```{figure} ../diagrams/act5-ring-all-reduce.svg\n:name: fig-ring\n"
        ":alt: Four GPUs in a ring pass chunks.\n:width: 100%\n\nCaption.\n```\n\n"
        "![](../diagrams/act2-roofline.svg)\n"
        '<img src="../diagrams/act4-tiles.svg" alt="Tiles of A and B">\n'
        "```{figure} ../_static/logo.svg\n:alt: not a diagram\n```\n"
    )
    assert diagram_uses(page) == [
        ("act5-ring-all-reduce.svg", "Four GPUs in a ring pass chunks."),
        ("act2-roofline.svg", ""),
        ("act4-tiles.svg", "Tiles of A and B"),
    ]
    assert NAME.match("act1-5-formats.svg") and NAME.match("side-tree-layout.svg")
    assert not NAME.match("roofline.svg")
