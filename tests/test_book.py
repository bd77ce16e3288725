"""Structure of the book's sources: no build needed, runs in a second.

The table of contents and the files agree; every notebook carries the outputs of a full top-to-bottom
run on a real GPU, starts with the Colab bootstrap and the device report, and stays small; the
Jupyter Book configuration keeps the site offline and un-executed; every act page has its Takeaway,
exercises with folded solutions and citations that resolve. Each rule is a function that returns the
problems it finds, and `test_rules_catch_*` feed each rule a broken example, so no rule is vacuous.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
ACTS = sorted((ROOT / "acts").glob("act*.md"))

MAX_NOTEBOOK_BYTES = 1_500_000
MAX_IMAGE_BYTES = 300_000
NOTEBOOK_NAME = re.compile(r"^\d{2}[a-z]-[a-z0-9]+(?:-[a-z0-9]+)*\.ipynb$")
GPU_VENDOR = re.compile(r"\b(NVIDIA|AMD)\b")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


# --- the table of contents ---------------------------------------------------------------------


def toc_entries(toc: dict) -> list[tuple[str, str | None]]:
    """Every `file:` of the toc, with the chapter it is nested under (None for chapters)."""
    entries: list[tuple[str, str | None]] = [(toc["root"], None)]

    def walk(node, parent):
        if isinstance(node, list):
            for item in node:
                walk(item, parent)
        elif isinstance(node, dict):
            here = parent
            if "file" in node:
                entries.append((node["file"], parent))
                here = node["file"] if parent is None else parent
            for key in ("parts", "chapters", "sections"):
                if key in node:
                    walk(node[key], here)

    walk({k: v for k, v in toc.items() if k != "root"}, None)
    return entries


def resolve(entry: str) -> Path | None:
    """The source file a toc entry names (Jupyter Book accepts it with or without a suffix)."""
    for candidate in (ROOT / entry, ROOT / f"{entry}.md", ROOT / f"{entry}.ipynb"):
        if candidate.is_file():
            return candidate
    return None


TOC = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
TOC_ENTRIES = toc_entries(TOC)
TOC_FILES = {resolve(e) for e, _ in TOC_ENTRIES} - {None}


def test_toc_is_a_book():
    assert TOC.get("format") == "jb-book"
    assert "parts" in TOC, "_toc.yml groups its chapters into captioned parts"


def test_every_toc_entry_exists():
    missing = [e for e, _ in TOC_ENTRIES if resolve(e) is None]
    assert not missing, f"_toc.yml names files that do not exist: {missing}"


def test_no_toc_entry_twice():
    names = [re.sub(r"\.(md|ipynb)$", "", e) for e, _ in TOC_ENTRIES]
    dupes = sorted({n for n in names if names.count(n) > 1})
    assert not dupes, f"listed twice in _toc.yml: {dupes}"


def test_course_has_acts_and_notebooks():
    assert ACTS, "no acts/act*.md"
    assert NOTEBOOKS, "no notebooks/*.ipynb"


def pending_gpu_run(nb: dict) -> bool:
    """A lab written and checked on a CPU (CI executes it under nbval like any notebook) whose
    first GPU run is still to come: metadata ``gpu_brrr.pending_gpu_run``. It stays out of the
    book, with no outputs, until that run stores them; then the flag goes and the toc takes it
    (README, "Running on a GPU")."""
    return bool(nb.get("metadata", {}).get("gpu_brrr", {}).get("pending_gpu_run"))


PENDING = [p for p in NOTEBOOKS if pending_gpu_run(json.loads(p.read_text(encoding="utf-8")))]
PUBLISHED = [p for p in NOTEBOOKS if p not in PENDING]


@pytest.mark.parametrize("path", PUBLISHED + ACTS, ids=_rel)
def test_in_toc(path):
    # only_build_toc_files: a page missing from the toc is silently left out of the site.
    assert path in TOC_FILES, f"{_rel(path)} is not in _toc.yml, so the site does not show it"


def check_pending(nb: dict, in_toc: bool) -> list[str]:
    """A lab waiting for its GPU run is neither in the book nor holding any output."""
    problems = ["in _toc.yml before its GPU run"] if in_toc else []
    ran = [i for i, c in enumerate(_code_cells(nb)) if c.get("outputs") or c.get("execution_count")]
    if ran:
        problems.append(f"code cells {ran} hold outputs from a run that was not its GPU run")
    return problems


@pytest.mark.parametrize("path", PENDING, ids=_rel)
def test_pending_lab_is_out_of_the_book_and_unrun(path):
    assert not (problems := check_pending(_load(path), path in TOC_FILES)), problems


def test_notebooks_sit_under_their_act():
    parents = {resolve(e): parent for e, parent in TOC_ENTRIES}
    wrong = {
        _rel(nb): parents.get(nb)
        for nb in NOTEBOOKS
        if nb in parents and not (parents[nb] or "").startswith("acts/")
    }
    assert not wrong, f"notebooks not nested under an acts/ chapter in _toc.yml: {wrong}"


# --- notebooks ---------------------------------------------------------------------------------


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _output_text(out: dict) -> str:
    parts = []
    if "text" in out:
        parts.append(_source({"source": out["text"]}))
    for mime, value in out.get("data", {}).items():
        if mime.startswith("text/"):
            parts.append(_source({"source": value}))
    if out.get("output_type") == "error":
        parts.append(f"{out.get('ename')}: {out.get('evalue')}")
    return "\n".join(parts)


def _code_cells(nb: dict) -> list[dict]:
    return [c for c in nb.get("cells", []) if c.get("cell_type") == "code"]


def check_bootstrap(nb: dict, repo_url: str) -> list[str]:
    """The first code cell bootstraps a bare runtime (Colab) and reports the device.

    Bootstrap: clone this course's repository and pip install what the runtime lacks (the cell may
    detect Colab or look for the repository; it may shell out with `!` or subprocess). The device
    report printed by kernels.device is the provenance of every output below it.
    """
    cells = _code_cells(nb)
    if not cells:
        return ["no code cell"]
    src = _source(cells[0])
    problems = []
    if repo_url not in src or not re.search(r"\bclone\b", src):
        problems.append(f"first code cell does not clone {repo_url} (the Colab bootstrap)")
    if not re.search(r"\bpip\b[\"',\s]+install\b", src):
        problems.append("first code cell does not pip install what a bare runtime lacks")
    if not re.search(
        r"^\s*(from\s+kernels\s+import\s+[^\n]*\bdevice\b|import\s+kernels\.device\b"
        r"|from\s+kernels\.device\s+import\b)",
        src,
        flags=re.MULTILINE,
    ):
        problems.append("first code cell does not import kernels.device")
    text = "\n".join(_output_text(o) for o in cells[0].get("outputs", []))
    # A lab waiting for its first GPU run holds no outputs at all (check_pending): nothing to name.
    if not pending_gpu_run(nb) and not GPU_VENDOR.search(text):
        problems.append("first code cell's stored output names no NVIDIA/AMD GPU (not a GPU run?)")
    return problems


_ASSIGN = r'^{name}\s*=\s*["\']([^"\']*)["\']'


def check_repository_setting(nb: dict, repo_url: str, branch: str) -> list[str]:
    """The bootstrap clones exactly the repository and branch that _config.yml names.

    _config.yml's ``repository`` (url and branch) is the one setting: the launch buttons open
    ``<url>/blob/<branch>/notebooks/...``. The bootstrap cannot import it (on Colab it runs before
    the course is there), so each notebook writes it as ``REPO_URL`` and ``REPO_BRANCH`` and clones
    with ``--branch REPO_BRANCH``; this rule keeps every notebook equal to the configuration.
    """
    cells = _code_cells(nb)
    src = _source(cells[0]) if cells else ""
    problems = []
    for name, want in (("REPO_URL", repo_url), ("REPO_BRANCH", branch)):
        found = re.findall(_ASSIGN.format(name=name), src, flags=re.MULTILINE)
        if found != [want]:
            problems.append(
                f"bootstrap sets {name} to {found or 'nothing'}, _config.yml says {want!r}"
            )
    others = set(re.findall(r"https?://[^\s\"']+", src)) - {repo_url}
    if others:
        problems.append(f"bootstrap names other URLs than REPO_URL: {sorted(others)}")
    if not re.search(r'"--branch",\s*REPO_BRANCH,\s*REPO_URL', src):
        problems.append('bootstrap does not clone with "--branch", REPO_BRANCH, REPO_URL')
    return problems


def check_full_gpu_run(nb: dict) -> list[str]:
    """Every code cell ran, top to bottom, in one session, without an error.

    One exception: a graded exercise's cells (tagged ``exercise``: the skeleton, the folded solution
    and the grading cell) may be unexecuted. They are the learner's cells, added to a lab after its
    last GPU run; the next run of the notebook stores their outputs (the grader's verdict), and from
    then on they are held to the same order as every other cell. CI executes them either way."""
    problems = []
    last = 0
    for i, cell in enumerate(_code_cells(nb)):
        tags = set(cell.get("metadata", {}).get("tags", []))
        if not _source(cell).strip() or "skip-execution" in tags:
            continue
        count = cell.get("execution_count")
        if count is None and "exercise" in tags and not cell.get("outputs"):
            continue
        if count is None:
            problems.append(f"code cell {i} has no execution count (not run)")
            continue
        if count <= last:
            problems.append(f"code cell {i} ran as [{count}] after [{last}] (not one clean run)")
        last = count
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error" and "raises-exception" not in tags:
                problems.append(f"code cell {i} stored an error: {out.get('ename')}")
    texts = "\n".join(_output_text(o) for c in _code_cells(nb) for o in c.get("outputs", []))
    if not GPU_VENDOR.search(texts):
        problems.append("no stored output mentions an NVIDIA or AMD GPU")
    return problems


def check_images(nb: dict) -> list[str]:
    problems = []
    for i, cell in enumerate(_code_cells(nb)):
        for out in cell.get("outputs", []):
            for mime, value in out.get("data", {}).items():
                if not mime.startswith("image/"):
                    continue
                value = _source({"source": value})
                size = len(value) if mime == "image/svg+xml" else len(base64.b64decode(value))
                if size > MAX_IMAGE_BYTES:
                    problems.append(f"code cell {i}: {mime} of {size // 1000} KB")
    for i, cell in enumerate(nb.get("cells", [])):
        for name, att in (cell.get("attachments") or {}).items():
            for mime, value in att.items():
                size = len(base64.b64decode(value)) if mime.startswith("image/") else 0
                if size > MAX_IMAGE_BYTES:
                    problems.append(f"cell {i} attachment {name}: {size // 1000} KB")
    return problems


def _load(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_notebook_name(path):
    assert NOTEBOOK_NAME.match(path.name), f"{path.name}: want NN<letter>-<topic>.ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_notebook_starts_with_bootstrap_and_device(path):
    problems = check_bootstrap(_load(path), CONFIG["repository"]["url"])
    assert not problems, problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_notebook_clones_the_configured_repository(path):
    repo = CONFIG["repository"]
    problems = check_repository_setting(_load(path), repo["url"], repo["branch"])
    assert not problems, problems


def test_front_matter_names_the_configured_repository():
    """README and setup point at the same repository and branch as the launch buttons."""
    repo = CONFIG["repository"]
    slug = repo["url"].removeprefix("https://github.com/")
    for page in ("README.md", "setup.md"):
        text = (ROOT / page).read_text(encoding="utf-8")
        named = set(re.findall(r"github\.com/([\w.-]+/[\w.-]+)", text))
        assert named <= {slug}, f"{page} names another repository: {named - {slug}}"
        colab = re.findall(
            r"colab\.research\.google\.com/github/([\w.-]+/[\w.-]+)/blob/([\w.-]+)", text
        )
        assert all(c == (slug, repo["branch"]) for c in colab), f"{page}: Colab links {colab}"


@pytest.mark.parametrize("path", PUBLISHED, ids=_rel)
def test_notebook_outputs_are_a_full_gpu_run(path):
    assert not (problems := check_full_gpu_run(_load(path))), problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_notebook_size(path):
    size = path.stat().st_size
    assert size < MAX_NOTEBOOK_BYTES, f"{path.name} is {size / 1e6:.2f} MB (limit 1.5 MB)"
    assert not (problems := check_images(_load(path))), f"images over 300 KB: {problems}"


# --- _config.yml -------------------------------------------------------------------------------


def test_config_never_executes_notebooks():
    # YAML reads a bare `off` as False; either way the site shows the committed GPU outputs.
    assert CONFIG["execute"]["execute_notebooks"] in ("off", False)


def test_config_bibliography():
    bibfiles = CONFIG.get("bibtex_bibfiles") or []
    assert "references.bib" in bibfiles
    assert all((ROOT / b).is_file() for b in bibfiles), bibfiles


def test_config_colab_and_repository():
    assert CONFIG["launch_buttons"]["colab_url"] == "https://colab.research.google.com"
    url = CONFIG["repository"]["url"]
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url), url
    assert CONFIG["repository"].get("branch"), "the Colab links need the branch"


def test_config_mathjax_is_local():
    sphinx = CONFIG["sphinx"]["config"]
    path = sphinx["mathjax_path"]
    assert "://" not in path and not path.startswith("//"), f"MathJax from a CDN: {path}"
    assert "_vendor/static" in sphinx.get("html_static_path", [])
    script = (ROOT / "tools" / "vendor_mathjax.sh").read_text(encoding="utf-8")
    assert "_vendor/static/mathjax" in script and path == "mathjax/tex-chtml.js"


def test_config_navigation():
    """One search box, a favicon and logo, the book's CSS, numbered figures (issue 15, item 4)."""
    sphinx = CONFIG["sphinx"]["config"]
    assert sphinx.get("numfig") is True, "numfig makes {numref} to figures work"
    for path in (CONFIG.get("logo"), CONFIG["html"].get("favicon")):
        assert path and (ROOT / path).is_file(), path
    static = sphinx.get("html_static_path", [])
    css = sphinx.get("html_css_files", [])
    assert css and all(any((ROOT / d / c).is_file() for d in static) for c in css), css
    sidebars = [t for ts in (sphinx.get("html_sidebars") or {}).values() for t in ts]
    assert sidebars and not any("search" in t for t in sidebars), (
        "the sidebar's search field doubles the header's search button"
    )
    # jupyter-book adds every .js under every static path as a script when a _static folder
    # exists; the vendored MathJax would then load twice.
    assert not (ROOT / "_static").exists(), "keep site assets in assets/, not _static/"


def test_config_keeps_tooling_out_of_the_build():
    assert CONFIG.get("only_build_toc_files") is True
    excluded = set(CONFIG.get("exclude_patterns") or [])
    assert {".venv", "_vendor", ".pytest_cache"} <= excluded, excluded


# --- act pages ---------------------------------------------------------------------------------

_FENCE = r"^(?P<fence>`{3,}|:{3,})\s*\{(?P<name>[\w:-]+)\}[ \t]*(?P<arg>[^\n]*)$"
CITE = re.compile(r"\{cite(?::\w+)?\}`([^`]+)`")


def bib_keys(text: str) -> set[str]:
    return set(re.findall(r"^\s*@\w+\s*\{\s*([^,\s]+)\s*,", text, flags=re.MULTILINE))


def check_act(text: str, keys: set[str]) -> list[str]:
    problems = []
    directives = list(re.finditer(_FENCE, text, flags=re.MULTILINE))
    if not any(
        "takeaway" in d["arg"].lower() and d["name"] in ("admonition", "tip", "important", "note")
        for d in directives
    ):
        problems.append("no Takeaway admonition (```{admonition} Takeaway ...)")
    m = re.search(r"^#{1,6}\s+.*\bexercises?\b", text, flags=re.MULTILINE | re.IGNORECASE)
    if not m:
        problems.append("no Exercises heading")
    else:
        after = text[m.end() :]
        has_dropdown = re.search(_FENCE.replace("[\\w:-]+", "dropdown"), after, re.MULTILINE)
        has_class = re.search(r"^\s*:class:\s*[^\n]*\bdropdown\b", after, flags=re.MULTILINE)
        if not (has_dropdown or has_class):
            problems.append("exercises have no folded solution ({dropdown} or :class: dropdown)")
    cited = {k.strip() for group in CITE.findall(text) for k in group.split(",")}
    if not cited:
        problems.append("no {cite} reference")
    if unknown := sorted(cited - keys):
        problems.append(f"cite keys not in references.bib: {unknown}")
    return problems


def _toc_files(nodes: list) -> list[str]:
    """The `file:` entries under some toc chapters, sections included, in reading order."""
    files: list[str] = []
    for item in nodes:
        if "file" in item:
            files.append(item["file"])
        files += _toc_files(item.get("sections", []))
    return files


def toc_parts(toc: dict) -> list[tuple[str, list[str]]]:
    """(caption, every file of the part in reading order) for each part of the toc."""
    return [
        (part.get("caption", ""), _toc_files(part.get("chapters", [])))
        for part in toc.get("parts", [])
    ]


def act_parts(toc: dict) -> dict[str, list[Path]]:
    """Each toc part holding acts/ pages -> those pages (an act is the union of its pages)."""
    acts = {}
    for caption, files in toc_parts(toc):
        pages = [resolve(f) for f in files if f.startswith("acts/")]
        if pages := [p for p in pages if p is not None and p.suffix == ".md"]:
            acts[caption] = pages
    return acts


ACT_PARTS = act_parts(TOC)


@pytest.mark.parametrize("caption", list(ACT_PARTS))
def test_act(caption):
    """The act as a whole (all its pages): a Takeaway, Exercises with folded solutions, citations."""
    keys = bib_keys((ROOT / "references.bib").read_text(encoding="utf-8"))
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in ACT_PARTS[caption])
    assert not (problems := check_act(text, keys)), problems


def test_every_act_page_is_in_an_act_part():
    in_parts = {p for pages in ACT_PARTS.values() for p in pages}
    assert not (lost := [_rel(p) for p in ACTS if p not in in_parts]), lost


# --- page length, titles and captions -----------------------------------------------------------

MAX_PAGE_WORDS = 3500
_CODE_DIRECTIVES = {
    "code",
    "code-block",
    "code-cell",
    "sourcecode",
    "literalinclude",
    "math",
    "raw",
}
_ANY_FENCE = re.compile(r"^\s*(?P<fence>`{3,}|~{3,}|:{3,})\s*(?:\{(?P<name>[\w:.-]+)\})?")


def prose_text(text: str) -> str:
    """A Markdown page without code blocks, math, directive option lines and comments.

    Roles (a glued number, a citation, a cross-reference) stay as one word each.
    """
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        line, stripped = lines[i], lines[i].strip()
        fence = _ANY_FENCE.match(line)
        if fence and (
            (fence["name"] is None and fence["fence"][0] != ":" and stripped != fence["fence"])
            or fence["name"] in _CODE_DIRECTIVES
        ):
            close = re.compile(rf"^\s*{re.escape(fence['fence'][0])}{{{len(fence['fence'])},}}\s*$")
            i += 1
            while i < len(lines) and not close.match(lines[i]):
                i += 1
            i += 1
            continue
        if stripped.startswith("$$"):
            if stripped.count("$$") == 1:
                i += 1
                while i < len(lines) and "$$" not in lines[i]:
                    i += 1
            i += 1
            continue
        if fence or re.match(r"^\s*(%|:[\w-]+:|\(.+\)=\s*$)", line):
            i += 1  # fence lines (the directive's title stays), options, comments, labels
            if fence and (title := line[fence.end() :].strip()):
                out.append(title)
            continue
        out.append(line)
        i += 1
    prose = "\n".join(out)
    prose = re.sub(r"<!--.*?-->", " ", prose, flags=re.S)
    prose = re.sub(r"\{[\w:.-]+\}`[^`]*`", " ROLE ", prose)
    prose = re.sub(r"(?<!\\)\$[^$]+\$", " ", prose)
    prose = re.sub(r"\]\([^)]*\)", "] ", prose)
    return prose


def prose_words(text: str) -> int:
    return sum(1 for w in prose_text(text).split() if re.search(r"[^\W_]", w))


@pytest.mark.parametrize("path", ACTS, ids=_rel)
def test_act_page_length(path):
    words = prose_words(path.read_text(encoding="utf-8"))
    assert words <= MAX_PAGE_WORDS, (
        f"{_rel(path)} has {words} prose words (limit {MAX_PAGE_WORDS}): split it along its ## sections"
    )


def page_title(path: Path) -> str | None:
    """The page's H1: the first `# ` line of a Markdown page or of a notebook's first cell."""
    if path.suffix == ".ipynb":
        cells = _load(path).get("cells", [])
        text = _source(cells[0]) if cells and cells[0].get("cell_type") == "markdown" else ""
    else:
        text = path.read_text(encoding="utf-8")
    m = re.search(r"^# (.+)$", text, flags=re.MULTILINE)
    return m.group(1).strip() if m else None


def _bare_title(title: str) -> str:
    """A title without its act / page / lab number, lower-case, punctuation as spaces."""
    title = re.sub(r"^(act|lab)?\s*[\d.]+[a-z]?\b|^side quests?\b", "", title.strip(), flags=re.I)
    title = re.sub(r"^(act|lab)\s*[\d.]+[a-z]?\b", "", title.strip(" ,:·—–-"), flags=re.I)
    title = re.sub(r"\bpart\s+\d+\b", "", title, flags=re.I)
    return " ".join(re.sub(r"[^\w]+", " ", title.lower()).split())


def check_captions(parts: list[tuple[str, list[tuple[str, str | None]]]]) -> list[str]:
    """A part's caption says what the act is about; it does not repeat one of its page titles."""
    problems = []
    for caption, pages in parts:
        for name, title in pages:
            if title and _bare_title(title) == _bare_title(caption):
                problems.append(f"caption {caption!r} repeats the title of {name}: {title!r}")
    return problems


def test_part_captions_differ_from_page_titles():
    parts = [
        (caption, [(f, page_title(p)) for f in files if (p := resolve(f))])
        for caption, files in toc_parts(TOC)
    ]
    assert not (problems := check_captions(parts)), problems


_PAGE_NUMBER = re.compile(r"^(?P<act>\d+(?:\.5)?|S)\.(?P<k>\d+) \S")
_LAB_TITLE = re.compile(r"^Lab \w+ · \S")


def check_page_numbers(parts: list[tuple[str, list[tuple[str, str | None]]]]) -> list[str]:
    """Prose pages are titled `N.k Title`, k = 1, 2, ... in reading order within their act's part
    (`1.5.k` for Act 1.5, `S.k` for a side quest); labs are titled `Lab Nx · Title`."""
    problems = []
    for caption, pages in parts:
        prose = [(n, t) for n, t in pages if n.startswith("acts/")]
        for name, title in pages:
            if name.startswith("notebooks/") and not _LAB_TITLE.match(title or ""):
                problems.append(f"{name}: title {title!r} is not 'Lab Nx · Title'")
        numbers = [(_PAGE_NUMBER.match(t or ""), n, t) for n, t in prose]
        for m, name, title in numbers:
            if not m:
                problems.append(f"{name}: title {title!r} is not numbered 'N.k Title'")
        found = [m for m, _, _ in numbers if m]
        if found and len(found) == len(numbers):
            acts = {m["act"] for m in found}
            ks = [int(m["k"]) for m in found]
            if len(acts) > 1 or ks != list(range(1, len(ks) + 1)):
                got = [f"{m['act']}.{m['k']}" for m in found]
                problems.append(f"{caption}: pages numbered {got}, want one act numbered 1, 2, ...")
    return problems


def test_pages_are_numbered():
    parts = [
        (caption, [(f, page_title(p)) for f in files if (p := resolve(f))])
        for caption, files in toc_parts(TOC)
        if any(f.startswith("acts/") for f in files)
    ]
    assert not (problems := check_page_numbers(parts)), "\n".join(problems)


# --- notebook pages: title first, plumbing folded, figures numbered -------------------------------


def check_notebook_opening(nb: dict) -> list[str]:
    """The page starts with its title; the bootstrap (the first code cell) is folded or hidden."""
    problems = []
    cells = nb.get("cells", [])
    first = cells[0] if cells else {}
    if first.get("cell_type") != "markdown":
        problems.append("first cell is not a markdown cell with the page title")
    elif not re.match(r"# \S", _source(first).lstrip("\n")):
        problems.append("first cell's first line is not an H1 (# Lab Nx · Title)")
    code = _code_cells(nb)
    if code and not {"remove-input", "hide-input"} & set(
        code[0].get("metadata", {}).get("tags", [])
    ):
        problems.append("first code cell (the bootstrap) is not tagged remove-input or hide-input")
    return problems


NEEDS = "**Needs:** "


def check_needs_line(nb: dict) -> list[str]:
    """Right under the title, one paragraph says what the notebook needs (a CUDA GPU, bf16, Hopper
    for TMA, fp8, two GPUs) and what runs without it: a Colab or T4 reader sees it before running."""
    cells = nb.get("cells", [])
    lines = _source(cells[0]).lstrip("\n").splitlines() if cells else []
    paragraph = next((ln for ln in lines[1:] if ln.strip()), "")
    if not paragraph.startswith(NEEDS):
        return [f"the paragraph under the title does not start with {NEEDS.strip()!r}"]
    if len(lines) > 1 and lines[1].strip():
        return ["no blank line between the title and the Needs paragraph"]
    return []


_HIDDEN_OUTPUT_TAGS = {"remove-output", "remove-cell", "hide-output"}


def check_figures(nb: dict) -> list[str]:
    """Every image a notebook page shows is a numbered MyST figure: mystnb figure caption and name."""
    problems = []
    for i, cell in enumerate(_code_cells(nb)):
        meta = cell.get("metadata", {})
        if _HIDDEN_OUTPUT_TAGS & set(meta.get("tags", [])):
            continue
        shown = [
            o
            for o in cell.get("outputs", [])
            if any(m.startswith("image/") for m in o.get("data", {}))
        ]
        if not shown:
            continue
        figure = (meta.get("mystnb") or {}).get("figure") or {}
        missing = [k for k in ("caption", "name") if not str(figure.get(k, "")).strip()]
        if missing:
            problems.append(
                f"code cell {i} shows an image without mystnb figure {' and '.join(missing)}"
            )
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_notebook_page_opens_with_its_title(path):
    assert not (problems := check_notebook_opening(_load(path))), problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_notebook_says_what_it_needs(path):
    assert not (problems := check_needs_line(_load(path))), problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_rel)
def test_notebook_figures_are_numbered(path):
    assert not (problems := check_figures(_load(path))), problems


# --- README and Makefile ----------------------------------------------------------------------


def test_readme_commands_exist():
    """Every `make X` the README tells a reader to run is a Makefile target, and the files it
    points at exist (the two commands, the GPU workflow's runner)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w-]+):", makefile, flags=re.MULTILINE))
    assert {"venv", "book", "test", "lint", "bench", "gpu-notebooks"} <= targets, targets
    told = set(re.findall(r"\bmake ([a-z][\w-]*)", readme))
    assert {"book", "test"} <= told, "the README's two commands are make book and make test"
    assert told <= targets, f"README names make targets that do not exist: {told - targets}"
    assert "scripts/run_gpu_notebooks.py" in readme
    for path in ("scripts/run_gpu_notebooks.py", "tools/vendor_mathjax.sh", ".ci/run"):
        assert (ROOT / path).is_file(), f"{path} is missing"
    assert "make test" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


# --- the rules themselves ----------------------------------------------------------------------

_PNG = base64.b64encode(b"\x89PNG" + b"\0" * (MAX_IMAGE_BYTES + 1)).decode()
_REPO = "https://github.com/gpu-brrr/gpu-brrr"
_GOOD_FIRST = {
    "cell_type": "code",
    "execution_count": 1,
    "metadata": {},
    "source": "import subprocess, sys\nif 'google.colab' in sys.modules:\n"
    f"    subprocess.run(['git', 'clone', '{_REPO}'])\n"
    "    subprocess.run([sys.executable, '-m', 'pip', 'install', 'pyyaml'])\n"
    "from kernels import device\nprint(device.describe())",
    "outputs": [{"output_type": "stream", "name": "stdout", "text": "GPU: NVIDIA H100\n"}],
}


def _nb(*cells):
    return {"cells": list(cells), "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def _code(count, source="x = 1", outputs=()):
    return {
        "cell_type": "code",
        "execution_count": count,
        "metadata": {},
        "source": source,
        "outputs": list(outputs),
    }


def test_rules_catch_bad_notebooks():
    good = _nb(_GOOD_FIRST, _code(2), _code(3))
    assert check_bootstrap(good, _REPO) == [] and check_full_gpu_run(good) == []
    shell_src = f"!git clone {_REPO}\n%pip install -q pyyaml\nimport kernels.device"
    shell = dict(_GOOD_FIRST, source=shell_src)
    assert check_bootstrap(_nb(shell), _REPO) == []
    cpu = dict(_GOOD_FIRST, outputs=[{"output_type": "stream", "text": "device : CPU (x86_64)"}])
    assert any("NVIDIA/AMD" in p for p in check_bootstrap(_nb(cpu), _REPO))
    assert any("mentions an NVIDIA" in p for p in check_full_gpu_run(_nb(cpu)))
    no_colab = dict(_GOOD_FIRST, source="from kernels import device")
    assert len(check_bootstrap(_nb(no_colab), _REPO)) == 2
    other_repo = check_bootstrap(_nb(_GOOD_FIRST), "https://github.com/someone/else")
    assert len(other_repo) == 1 and "clone" in other_repo[0]
    no_device = dict(_GOOD_FIRST, source=_GOOD_FIRST["source"].replace("kernels", "other"))
    assert check_bootstrap(_nb(no_device), _REPO) == [
        "first code cell does not import kernels.device"
    ]
    assert any("no execution count" in p for p in check_full_gpu_run(_nb(_GOOD_FIRST, _code(None))))
    # an exercise's cells may wait for the next GPU run; once run, they keep the order
    todo = dict(_code(None), metadata={"tags": ["exercise"]})
    assert check_full_gpu_run(_nb(_GOOD_FIRST, _code(2), todo, _code(3))) == []
    ran = dict(_code(2), metadata={"tags": ["exercise"]})
    assert any("after [3]" in p for p in check_full_gpu_run(_nb(_GOOD_FIRST, _code(3), ran)))
    assert any("after [3]" in p for p in check_full_gpu_run(_nb(_GOOD_FIRST, _code(3), _code(2))))
    err = {"output_type": "error", "ename": "OutOfMemoryError", "evalue": "", "traceback": []}
    assert any("Out" in p for p in check_full_gpu_run(_nb(_GOOD_FIRST, _code(2, outputs=[err]))))
    big = {"output_type": "display_data", "data": {"image/png": _PNG}, "metadata": {}}
    assert check_images(_nb(_code(1, outputs=[big]))), "an oversized PNG went unnoticed"
    assert not NOTEBOOK_NAME.match("gpu-hierarchy.ipynb") and NOTEBOOK_NAME.match("01a-gpu.ipynb")


def test_rules_catch_a_bootstrap_that_disagrees_with_the_config():
    good = _code(
        1,
        'REPO_URL = "https://github.com/o/r"\nREPO_BRANCH = "main"\n'
        'clone = ["git", "clone", "--branch", REPO_BRANCH, REPO_URL, "r"]\n',
    )
    assert check_repository_setting(_nb(good), "https://github.com/o/r", "main") == []
    fork = check_repository_setting(_nb(good), "https://github.com/o/r-fork", "main")
    assert "REPO_URL" in fork[0] and "other URLs" in fork[1], fork
    other_branch = check_repository_setting(_nb(good), "https://github.com/o/r", "dev")
    assert len(other_branch) == 1 and "REPO_BRANCH" in other_branch[0], other_branch
    no_branch = dict(good, source=good["source"].replace('"--branch", REPO_BRANCH, ', ""))
    assert check_repository_setting(_nb(no_branch), "https://github.com/o/r", "main") == [
        'bootstrap does not clone with "--branch", REPO_BRANCH, REPO_URL'
    ]
    extra = dict(good, source=good["source"] + "# see https://github.com/o/other\n")
    assert "other URLs" in check_repository_setting(_nb(extra), "https://github.com/o/r", "main")[0]
    twice = dict(good, source=good["source"] + 'REPO_URL = "https://github.com/o/r"\n')
    assert "REPO_URL" in check_repository_setting(_nb(twice), "https://github.com/o/r", "main")[0]


def test_rules_catch_a_pending_lab_in_the_book_or_with_outputs():
    pending = {"metadata": {"gpu_brrr": {"pending_gpu_run": True}}}
    assert pending_gpu_run(pending) and not pending_gpu_run({"metadata": {}})
    clean = dict(pending, cells=[_code(None, outputs=[])])
    assert check_pending(clean, in_toc=False) == []
    assert check_pending(clean, in_toc=True) == ["in _toc.yml before its GPU run"]
    cpu_run = dict(pending, cells=[_code(1, outputs=[{"output_type": "stream", "text": "x"}])])
    assert any("outputs" in p for p in check_pending(cpu_run, in_toc=False))
    # its bootstrap is checked like any other, except for the GPU name its (absent) output prints
    unrun = dict(_GOOD_FIRST, execution_count=None, outputs=[])
    assert check_bootstrap(dict(pending, cells=[unrun]), _REPO) == []
    assert check_bootstrap(_nb(unrun), _REPO) == [
        "first code cell's stored output names no NVIDIA/AMD GPU (not a GPU run?)"
    ]
    assert check_bootstrap(dict(pending, cells=[dict(unrun, source="x = 1")]), _REPO) != []


def test_rules_catch_bad_act_pages():
    good = (
        "# Act\n\nSee {cite}`a`.\n\n```{admonition} Takeaway\n:class: tip\nBytes.\n```\n\n"
        "## Exercises\n\n1. Why?\n\n:::{dropdown} Solution\nBecause.\n:::\n"
    )
    assert check_act(good, {"a"}) == []
    assert check_act(good.replace("Takeaway", "Summary"), {"a"}) == [
        "no Takeaway admonition (```{admonition} Takeaway ...)"
    ]
    assert any("folded" in p for p in check_act(good.replace("dropdown", "note"), {"a"}))
    assert any("Exercises heading" in p for p in check_act(good.replace("Exercises", "X"), {"a"}))
    assert check_act(good, set()) == ["cite keys not in references.bib: ['a']"]
    assert check_act(good.replace("{cite}`a`", "a"), {"a"}) == ["no {cite} reference"]
    assert bib_keys("@article{k1,\n title={x}}\n@misc{ k2 ,}") == {"k1", "k2"}
    toc = {
        "root": "intro",
        "parts": [{"chapters": [{"file": "acts/a", "sections": [{"file": "n"}]}]}],
    }
    assert toc_entries(toc) == [("intro", None), ("acts/a", None), ("n", "acts/a")]


def _md(source):
    return {"cell_type": "markdown", "metadata": {}, "source": source}


def test_rules_catch_bad_notebook_openings():
    boot = dict(_GOOD_FIRST, metadata={"tags": ["remove-input"]})
    good = _nb(_md("# Lab 4c · Fused softmax\n\nWhat you will measure."), boot, _code(2))
    assert check_notebook_opening(good) == []
    assert check_notebook_opening(_nb(boot, _md("# Lab 4c · Title"))) == [
        "first cell is not a markdown cell with the page title",
    ]
    assert check_notebook_opening(_nb(_md("Some text\n# Title"), boot)) == [
        "first cell's first line is not an H1 (# Lab Nx · Title)"
    ]
    assert check_notebook_opening(_nb(_md("## Lab"), boot)) == [
        "first cell's first line is not an H1 (# Lab Nx · Title)"
    ]
    shown = check_notebook_opening(_nb(_md("# Lab"), _GOOD_FIRST))
    assert shown == ["first code cell (the bootstrap) is not tagged remove-input or hide-input"]
    folded = dict(_GOOD_FIRST, metadata={"tags": ["hide-input"]})
    assert check_notebook_opening(_nb(_md("# Lab"), folded)) == []


def test_rules_catch_a_missing_needs_line():
    title = "# Lab 4c · Fused softmax\n\n"
    good = _nb(
        _md(title + "**Needs:** a CUDA GPU (bf16 on Ampere or newer, fp16 before).\n\nText.")
    )
    assert check_needs_line(good) == []
    missing = check_needs_line(_nb(_md(title + "What you will measure.\n\n**Needs:** x")))
    assert missing == ["the paragraph under the title does not start with '**Needs:**'"]
    assert check_needs_line(_nb(_md("# Lab 4c\nNeeds: a GPU"))) == missing
    assert check_needs_line(_nb(_md("# Lab 4c\n**Needs:** a GPU"))) == [
        "no blank line between the title and the Needs paragraph"
    ]
    assert check_needs_line(_nb()) == missing


def test_rules_catch_unnumbered_figures():
    png = {"output_type": "display_data", "data": {"image/png": "iVBOR", "text/plain": "<Figure>"}}
    text = {"output_type": "stream", "name": "stdout", "text": "no image"}
    bare = _code(1, outputs=[png])
    assert check_figures(_nb(bare)) == [
        "code cell 0 shows an image without mystnb figure caption and name"
    ]
    named = dict(bare, metadata={"mystnb": {"figure": {"name": "fig-x"}}})
    assert check_figures(_nb(named)) == ["code cell 0 shows an image without mystnb figure caption"]
    good = dict(bare, metadata={"mystnb": {"figure": {"caption": "What to see.", "name": "fig-x"}}})
    assert check_figures(_nb(good, _code(2, outputs=[text]))) == []
    hidden = dict(bare, metadata={"tags": ["remove-output"]})
    assert check_figures(_nb(hidden)) == []
    svg = {"output_type": "execute_result", "data": {"image/svg+xml": "<svg/>"}}
    assert check_figures(_nb(_code(1), _code(2, outputs=[svg])))[0].startswith("code cell 1")


def test_rules_catch_long_pages_and_repeated_captions():
    code = "```python\n" + "word " * 5000 + "\n```\n"
    math = "$$\n" + "x + " * 3000 + "\n$$\n"
    opts = "```{figure} a.svg\n:alt: " + "alt " * 10 + "\nCaption here.\n```\n"
    page = "# 4.1 Title\n\n" + code + math + opts + "% comment " + "c " * 50 + "\n\nTwo words.\n"
    assert prose_words(page) == 3 + 2 + 2  # title, figure caption, the paragraph
    assert prose_words("A {glue:text}`nb::x:.1f` µs and {cite:p}`k`.") == 5
    assert prose_words("word " * (MAX_PAGE_WORDS + 1)) > MAX_PAGE_WORDS
    parts = [("Act 1 · The GPU hierarchy", [("acts/a", "1.1 The GPU hierarchy")])]
    assert check_captions(parts) == [
        "caption 'Act 1 · The GPU hierarchy' repeats the title of acts/a: '1.1 The GPU hierarchy'"
    ]
    assert check_captions([("Act 4 · Custom kernels", [("acts/b", "4.1 The matmul ladder")])]) == []
    old = [("Act 1: The GPU hierarchy", [("acts/c", "Act 1 — The GPU hierarchy")])]
    assert check_captions(old)
    assert check_captions([("Act 4 · Custom kernels", [("n", "Lab 4c · Custom kernels")])])
    toc = {
        "root": "i",
        "parts": [
            {
                "caption": "Act 9 · X",
                "chapters": [
                    {"file": "acts/a", "sections": [{"file": "notebooks/n"}]},
                    {"file": "acts/b"},
                ],
            }
        ],
    }
    assert toc_parts(toc) == [("Act 9 · X", ["acts/a", "notebooks/n", "acts/b"])]


def test_rules_catch_unnumbered_pages():
    good = [
        (
            "Act 4 · Custom kernels",
            [
                ("acts/a", "4.1 The matmul ladder"),
                ("notebooks/04a-x", "Lab 4a · The SGEMM ladder"),
                ("acts/b", "4.2 Fused kernels"),
            ],
        ),
        ("Act 1.5 · The moving target", [("acts/c", "1.5.1 Generations")]),
        ("Side quest · Compiled trees", [("acts/d", "S.1 Trees")]),
    ]
    assert check_page_numbers(good) == []
    bad = [
        ("Act 4 · X", [("acts/a", "Act 4 — The matmul ladder"), ("notebooks/n", "Act 4 lab: x")]),
        ("Act 5 · Y", [("acts/b", "5.1 One"), ("acts/c", "5.3 Three")]),
        ("Act 6 · Z", [("acts/d", "6.1 One"), ("acts/e", "7.2 Two")]),
    ]
    problems = check_page_numbers(bad)
    assert len(problems) == 4, problems
    assert any("not numbered" in p for p in problems) and any("Lab Nx" in p for p in problems)


GLUED_PNG = "application/papermill.record/image/png"


def _text(v) -> str:
    return "".join(v) if isinstance(v, list) else v


def unmatched_glued_figures(nb: dict) -> list[str]:
    """Glued figures whose cell also shows a figure with different bytes. MyST-NB writes the image
    file of a cross-page {glue} from the cell's shown output: when a second render of the figure
    (plt.show() after glue) differs by a byte, the page that glues it gets a missing image. Glue
    a figure after its last change, so that both renders agree."""
    bad = []
    for c in _code_cells(nb):
        outs = c.get("outputs", [])
        shown = {_text(o["data"]["image/png"]) for o in outs if "image/png" in o.get("data", {})}
        for o in outs:
            if (
                GLUED_PNG in o.get("data", {})
                and shown
                and _text(o["data"][GLUED_PNG]) not in shown
            ):
                bad.append(o["metadata"]["scrapbook"]["name"])
    return bad


@pytest.mark.parametrize("path", PUBLISHED, ids=_rel)
def test_glued_figures_match_what_their_cell_shows(path):
    assert not (bad := unmatched_glued_figures(_load(path))), bad


def test_unmatched_glued_figure_is_caught():
    png = base64.b64encode(b"a").decode()
    glued = {"output_type": "display_data", "data": {GLUED_PNG: png},
             "metadata": {"scrapbook": {"name": "fig"}}}  # fmt: skip
    shown = {"output_type": "display_data", "data": {"image/png": base64.b64encode(b"b").decode()}}
    nb = {"cells": [{"cell_type": "code", "source": "", "outputs": [glued, shown]}]}
    assert unmatched_glued_figures(nb) == ["fig"]
    shown["data"]["image/png"] = png
    assert unmatched_glued_figures(nb) == []


def glued_names(nb: dict) -> set[str]:
    """The names a notebook's committed outputs glue (myst-nb's scrapbook metadata)."""
    return {
        o["metadata"]["scrapbook"]["name"]
        for c in nb["cells"]
        for o in c.get("outputs", [])
        if "scrapbook" in o.get("metadata", {})
    }


GLUE_REF = re.compile(r"notebooks/([\w-]+\.ipynb)::([\w-]+)")


def test_every_glue_reference_names_a_glued_output():
    # Faster than the book build at the same fault: a page that pastes a number from a notebook whose
    # last run did not glue it (a run on fewer GPUs than the page describes, a renamed key).
    cache, missing = {}, []
    for page in sorted((ROOT / "acts").glob("*.md")) + sorted(ROOT.glob("*.md")):
        for nb_name, key in GLUE_REF.findall(page.read_text()):
            if nb_name not in cache:
                cache[nb_name] = glued_names(_load(ROOT / "notebooks" / nb_name))
            if key not in cache[nb_name]:
                missing.append(f"{page.name}: {nb_name}::{key}")
    assert not missing, missing


def test_glue_reference_check_reads_keys_with_hyphens():
    text = "{glue:text}`../notebooks/04c-x.ipynb::act4f_low_two-step_regs:s` µs"
    assert GLUE_REF.findall(text) == [("04c-x.ipynb", "act4f_low_two-step_regs")]
