"""The built site, opened page by page in headless Chromium, works offline.

One pass over every page of `_build/html` (served on 127.0.0.1) records what the browser saw; the
tests below each judge one aspect of that record, so a failure names the page and what broke:
JavaScript errors, requests that failed or left the machine, internal links whose file or #fragment
is missing, images that did not load, math that MathJax did not typeset, notebook figures that are
not on the page, and notebook pages without their "open in Colab" button. Each page is also laid
out at a desktop and at a phone width: no page is wider than the viewport, no raster image is
stretched past its natural width (its text would be blurred and small), a notebook page shows its
title before any code cell, the favicon resolves and exactly one search box shows.

The site is built by `make book`; when `_build/html` is missing the session builds it. Setting
GPU_BRRR_SKIP_BROWSER=1 skips these tests (for a machine without Chromium); nothing else does.
"""

from __future__ import annotations

import contextlib
import functools
import html.parser
import json
import os
import re
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlsplit

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "_build" / "html"
CHROMIUM = os.environ.get("GPU_BRRR_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--headless",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
# Pages that are not content: Sphinx's generated index and the search page (its results are built
# from a query string at run time), and the theme's own assets.
SKIP_PAGES = {"genindex.html", "search.html"}
SKIP_DIRS = {"_static", "_sources", "_images", "_downloads"}

# Errors the browser reports that say nothing wrong about this site, each matched as narrowly as
# possible (a regex on the message of a console.error or an uncaught exception) and with the reason.
HARMLESS_ERRORS = [
    # Sphinx 7.4 (jupyter-book 1.x pins sphinx~=7.0) emits an inline <script> added by an extension
    # after the builder started twice: Sphinx.add_js_file passes filename None, the builder's own
    # replay passes '', so its de-duplication misses (fixed upstream in Sphinx 8.2, sphinx-doc/sphinx
    # PR 13402). sphinx-thebe's copy declares `const THEBE_JS_URL`, so the second, identical copy
    # throws; the first already defined the same values, and thebe itself is only loaded on demand.
    (
        re.compile(r"^Identifier 'THEBE_JS_URL' has already been declared\b"),
        "Sphinx 7.4 duplicates sphinx-thebe's inline config script",
    ),
    # pydata-sphinx-theme 0.17 reads the colour mode from localStorage, else from the theme option
    # default_mode, which sphinx-book-theme leaves empty; on a first visit (a fresh browser profile,
    # as here) it logs this and uses "auto", which is the intended default.
    (
        re.compile(r"^Got invalid theme mode: \. Resetting to auto\."),
        "pydata-sphinx-theme's first-visit colour-mode fallback",
    ),
]
# Requests the browser makes by itself rather than because a page asked. None: the book declares a
# favicon (assets/favicon.svg), so Chromium has no reason to probe /favicon.ico.
HARMLESS_PATHS: set[str] = set()

# The widths every page is laid out at (CSS pixels): a desktop window and a phone.
WIDTHS = (1400, 390)

PAGE_TIMEOUT_MS = 30_000


# --- the local server --------------------------------------------------------------------------


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        pass


@dataclass
class PageRecord:
    rel: str  # path of the page relative to the site root, e.g. "acts/act1.html"
    url: str
    page_errors: list[str] = field(default_factory=list)
    console_errors: list[str] = field(default_factory=list)
    failed_requests: list[str] = field(default_factory=list)
    external_requests: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)  # absolute URLs of <a href>
    ids: set[str] = field(default_factory=set)
    broken_images: list[str] = field(default_factory=list)
    output_images: int = 0  # loaded <img> inside notebook cell outputs
    math_elements: int = 0  # Sphinx's .math spans/divs
    math_untypeset: int = 0  # .math elements with no mjx-container inside
    mjx_containers: int = 0
    raw_math_text: list[str] = field(default_factory=list)
    mathjax_src: str | None = None
    colab_links: list[str] = field(default_factory=list)
    mathjax_done: bool = False
    # per viewport width: how much wider than the viewport the page is (0 = fits), and what sticks out
    overflow: dict[int, int] = field(default_factory=dict)
    overflow_culprits: dict[int, list[str]] = field(default_factory=dict)
    upscaled_images: list[str] = field(
        default_factory=list
    )  # raster images shown past natural size
    code_before_title: bool = False  # a notebook code cell precedes the page's first <h1>
    has_title: bool = True
    favicon: str | None = None  # href of <link rel=icon>
    favicon_status: int | None = None
    search_boxes: dict[int, list[str]] = field(default_factory=dict)  # visible search widgets


def _content_pages(site: Path) -> list[str]:
    pages = []
    for path in sorted(site.rglob("*.html")):
        rel = path.relative_to(site).as_posix()
        if rel in SKIP_PAGES or rel.split("/")[0] in SKIP_DIRS:
            continue
        pages.append(rel)
    return pages


def _redirect_target(path: Path) -> str | None:
    """The target of a meta-refresh page (jupyter-book writes index.html as one), else None."""
    text = path.read_text(encoding="utf-8", errors="replace")
    m = re.search(
        r'<meta\s+http-equiv="refresh"\s+content="\d+;\s*url=([^"]+)"', text, flags=re.IGNORECASE
    )
    return m.group(1) if m else None


@pytest.fixture(scope="session")
def site() -> Path:
    if os.environ.get("GPU_BRRR_SKIP_BROWSER"):
        pytest.skip("GPU_BRRR_SKIP_BROWSER is set")
    if not (SITE / "intro.html").exists():
        # `make test` builds the book first; a bare `pytest` builds it here the same way.
        subprocess.run(["bash", str(ROOT / "tools" / "vendor_mathjax.sh")], check=True)
        jb = Path(sys.executable).with_name("jupyter-book")
        subprocess.run(
            [str(jb), "build", str(ROOT), "-W", "-n", "--keep-going"], check=True, cwd=ROOT
        )
    return SITE


@contextlib.contextmanager
def serve(directory: Path):
    """Serve `directory` on 127.0.0.1 (a free port) from a thread; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="session")
def server(site: Path):
    with serve(site) as url:
        yield url


# What the page looks like after MathJax has finished and every <img> has settled.
_INSPECT_JS = """
async () => {
  const mj = window.MathJax;
  let mathjaxDone = false;
  if (mj && mj.startup && mj.startup.promise) { await mj.startup.promise; mathjaxDone = true; }
  await document.fonts.ready;  // MathJax's and the theme's web fonts: a 404 shows up before close
  const imgs = Array.from(document.images);
  await Promise.all(imgs.map(img => img.complete ? null : new Promise(r => {
    img.addEventListener('load', r); img.addEventListener('error', r); setTimeout(r, 10000);
  })));
  // Text the reader sees, outside code and outside what MathJax produced.
  const skip = 'pre, code, script, style, textarea, mjx-container, .highlight, .MathJax';
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const raw = [];
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (n.parentElement && n.parentElement.closest(skip)) continue;
    const t = n.textContent;
    const i = t.search(/\\\\\\(|\\\\\\[|\\$\\$/);
    if (i >= 0) raw.push(t.slice(Math.max(0, i - 30), i + 50));
  }
  const maths = Array.from(document.querySelectorAll('.math'));
  const script = document.querySelector('script[src*="tex-chtml"], script[src*="mathjax"]');
  return {
    mathjaxDone,
    links: Array.from(document.querySelectorAll('a[href]')).map(a => a.href),
    ids: Array.from(document.querySelectorAll('[id]')).map(e => e.id)
      .concat(Array.from(document.querySelectorAll('a[name]')).map(a => a.name)),
    brokenImages: imgs.filter(i => !(i.complete && i.naturalWidth > 0))
      .map(i => i.getAttribute('src')),
    outputImages: Array.from(document.querySelectorAll('.cell_output img, .output img'))
      .filter(i => i.naturalWidth > 0).length,
    mathElements: maths.length,
    mathUntypeset: maths.filter(m => !m.querySelector('mjx-container')).length,
    mjxContainers: document.querySelectorAll('mjx-container').length,
    rawMath: raw,
    mathjaxSrc: script ? script.src : null,
  };
}
"""


# The page's layout at the current viewport width.
_LAYOUT_JS = """
async () => {
  const vw = window.innerWidth;
  const sw = document.documentElement.scrollWidth;
  const visible = e => {
    const r = e.getBoundingClientRect(), st = getComputedStyle(e);
    return r.width > 0 && r.height > 0 && st.visibility !== 'hidden' && st.display !== 'none'
      && e.closest('dialog:not([open])') === null;
  };
  const describe = e => {
    const cls = (e.getAttribute('class') || '').trim().split(/\\s+/).slice(0, 2).join('.');
    const text = (e.textContent || '').trim().slice(0, 40);
    return `<${e.tagName.toLowerCase()}${cls ? '.' + cls : ''}> ${Math.round(e.getBoundingClientRect().right)}px "${text}"`;
  };
  let culprits = [];
  if (sw > vw + 1) {
    // What sticks out and is neither in a box that scrolls or clips within the viewport nor in a
    // fixed drawer (the theme parks its closed sidebars beside the viewport).
    const contained = e => {
      for (let a = e; a; a = a.parentElement) {
        const st = getComputedStyle(a);
        if (st.position === 'fixed') return true;
        if (a !== e && st.overflowX !== 'visible' && a.getBoundingClientRect().right <= vw + 1) return true;
      }
      return false;
    };
    const over = new Set(Array.from(document.body.querySelectorAll('*'))
      .filter(e => e.getBoundingClientRect().right > vw + 1 && !contained(e)));
    culprits = Array.from(over).filter(e => !Array.from(e.children).some(c => over.has(c)))
      .slice(0, 3).map(describe);
  }
  const raster = i => !/(\\.svg([?#].*)?$)|^data:image\\/svg/i.test(i.currentSrc || i.src);
  const upscaled = Array.from(document.images)
    .filter(i => i.naturalWidth > 0 && raster(i) && visible(i)
      && i.getBoundingClientRect().width > i.naturalWidth + 1)
    .map(i => `${i.getAttribute('src').slice(0, 80)}: shown ${Math.round(i.getBoundingClientRect().width)}px, natural ${i.naturalWidth}px`);
  const sel = 'input[type="search"], button.search-button, .search-button-field, form.bd-search';
  const found = Array.from(document.querySelectorAll(sel)).filter(visible);
  const search = found.filter(e => !found.some(o => o !== e && o.contains(e))).map(describe);
  return {scrollWidth: sw, innerWidth: vw, culprits, upscaled, search};
}
"""

# Facts that do not depend on the width: the order of title and code cells, the favicon.
_PAGE_FACTS_JS = """
async () => {
  // The article, not <main>: jupyter-book puts a print-only copy of the title above it.
  const main = document.querySelector('article') || document.querySelector('main') || document.body;
  const h1 = main.querySelector('h1');
  const cell = main.querySelector('div.cell');
  const codeBeforeTitle = !!cell && (!h1 ||
    !!(cell.compareDocumentPosition(h1) & Node.DOCUMENT_POSITION_FOLLOWING));
  const icon = document.querySelector('link[rel~="icon"]');
  let status = null;
  if (icon) {
    try { status = (await fetch(icon.href, {cache: 'no-store'})).status; } catch (e) { status = -1; }
  }
  return {codeBeforeTitle, hasTitle: !!h1, favicon: icon ? icon.href : null, faviconStatus: status};
}
"""


def visit(site: Path, base: str, pages: list[str]) -> dict[str, PageRecord]:
    """Open each page of `site` (served at `base`) in Chromium and record what happened."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).exists():
        pytest.fail(
            f"Chromium not found at {CHROMIUM}: run `make test` (installs Debian's chromium when "
            "run as root), `apt-get install -y chromium`, or set GPU_BRRR_CHROMIUM; "
            "GPU_BRRR_SKIP_BROWSER=1 skips these tests."
        )
    origin = urlsplit(base).netloc
    out: dict[str, PageRecord] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(
            service_workers="block", viewport={"width": WIDTHS[0], "height": 900}
        )
        current: list[PageRecord] = []

        # The site must work with no network: a request to any other host is recorded against the
        # page and aborted, so a CDN script cannot quietly succeed on a machine that is online.
        def route(r):
            parts = urlsplit(r.request.url)
            if parts.scheme in ("http", "https", "ws", "wss") and parts.netloc != origin:
                if current:
                    current[0].external_requests.append(r.request.url)
                r.abort()
            else:
                r.continue_()

        context.route("**/*", route)
        for rel in pages:
            rec = PageRecord(rel=rel, url=base + rel)
            current[:] = [rec]
            page = context.new_page()
            page.on("pageerror", lambda e, rec=rec: rec.page_errors.append(str(e)))

            def on_console(msg, rec=rec):
                if msg.type == "error":
                    loc = (msg.location or {}).get("url", "")
                    rec.console_errors.append(f"{msg.text} ({loc})" if loc else msg.text)

            def on_failed(req, rec=rec):
                parts = urlsplit(req.url)
                if parts.netloc == origin and parts.path not in HARMLESS_PATHS:
                    rec.failed_requests.append(f"{req.url}: {req.failure}")

            def on_response(resp, rec=rec):
                parts = urlsplit(resp.url)
                if resp.status >= 400 and parts.path not in HARMLESS_PATHS:
                    rec.failed_requests.append(f"{resp.url}: HTTP {resp.status}")

            page.on("console", on_console)
            page.on("requestfailed", on_failed)
            page.on("response", on_response)
            page.goto(rec.url, wait_until="load", timeout=PAGE_TIMEOUT_MS)
            info = page.evaluate(_INSPECT_JS)
            facts = page.evaluate(_PAGE_FACTS_JS)
            for width in WIDTHS:
                if width != WIDTHS[0]:
                    page.set_viewport_size({"width": width, "height": 844})
                    page.wait_for_timeout(100)  # let the theme's resize handlers run
                layout = page.evaluate(_LAYOUT_JS)
                rec.overflow[width] = max(0, layout["scrollWidth"] - layout["innerWidth"])
                rec.overflow_culprits[width] = layout["culprits"]
                rec.search_boxes[width] = layout["search"]
                if width == WIDTHS[0]:
                    rec.upscaled_images = layout["upscaled"]
            page.close()
            rec.code_before_title = facts["codeBeforeTitle"]
            rec.has_title = facts["hasTitle"]
            rec.favicon = facts["favicon"]
            rec.favicon_status = facts["faviconStatus"]
            rec.mathjax_done = info["mathjaxDone"]
            rec.links = info["links"]
            rec.ids = set(info["ids"])
            rec.broken_images = info["brokenImages"]
            rec.output_images = info["outputImages"]
            rec.math_elements = info["mathElements"]
            rec.math_untypeset = info["mathUntypeset"]
            rec.mjx_containers = info["mjxContainers"]
            rec.raw_math_text = info["rawMath"]
            rec.mathjax_src = info["mathjaxSrc"]
            rec.colab_links = [u for u in rec.links if "colab.research.google.com" in u]
            out[rel] = rec
        current.clear()
        context.close()
        browser.close()
    return out


@pytest.fixture(scope="session")
def records(site: Path, server: str) -> dict[str, PageRecord]:
    """Every content page of the built site, opened once (redirect stubs are checked apart)."""
    pages = [rel for rel in _content_pages(site) if not _redirect_target(site / rel)]
    return visit(site, server, pages)


# --- the checks: each returns {page: [problem, ...]} -------------------------------------------

Problems = dict[str, list[str]]


def _report(problems: Problems) -> str:
    lines = []
    for page, items in sorted(problems.items()):
        lines.append(f"{page}:")
        lines.extend(f"    {item}" for item in items)
    return "\n".join(lines)


def check_javascript(records: dict[str, PageRecord]) -> Problems:
    problems = {}
    for rec in records.values():
        errors = [
            f"{kind}: {msg}"
            for kind, msgs in (("uncaught", rec.page_errors), ("console.error", rec.console_errors))
            for msg in msgs
            if not any(rx.search(msg) for rx, _why in HARMLESS_ERRORS)
        ]
        if errors:
            problems[rec.rel] = errors
    return problems


def check_offline(records: dict[str, PageRecord]) -> Problems:
    return {r.rel: r.external_requests for r in records.values() if r.external_requests}


def check_local_requests(records: dict[str, PageRecord]) -> Problems:
    return {r.rel: r.failed_requests for r in records.values() if r.failed_requests}


def _ids_in_file(path: Path) -> set[str]:
    class P(html.parser.HTMLParser):
        def __init__(self):
            super().__init__()
            self.ids: set[str] = set()

        def handle_starttag(self, tag, attrs):
            for k, v in attrs:
                if k == "id" or (tag == "a" and k == "name"):
                    self.ids.add(v or "")

    p = P()
    p.feed(path.read_text(encoding="utf-8", errors="replace"))
    return p.ids


def check_links(records: dict[str, PageRecord], site: Path, base: str) -> Problems:
    ids_cache: dict[str, set[str]] = {}
    problems: Problems = {}
    for rec in records.values():
        for url in rec.links:
            if not url.startswith(base):
                continue  # external links are not followed: reading the site must not need them
            target, fragment = urldefrag(url)
            path = unquote(urlsplit(target).path).lstrip("/")
            if path == "" or path.endswith("/"):
                path += "index.html"
            file = site / path
            if not file.is_file():
                problems.setdefault(rec.rel, []).append(f"{url}: no file {path}")
                continue
            if not fragment or not path.endswith(".html"):
                continue
            if path not in ids_cache:
                ids_cache[path] = records[path].ids if path in records else _ids_in_file(file)
            if unquote(fragment) not in ids_cache[path]:
                problems.setdefault(rec.rel, []).append(f"{url}: no id '{fragment}' on {path}")
    return problems


def check_images(records: dict[str, PageRecord]) -> Problems:
    return {
        r.rel: [f"<img src={s!r}> did not load" for s in r.broken_images]
        for r in records.values()
        if r.broken_images
    }


def check_math(records: dict[str, PageRecord], base: str) -> Problems:
    problems: Problems = {}
    for rec in records.values():
        items = [f"raw TeX left in the text: {t!r}" for t in rec.raw_math_text]
        if rec.math_elements:
            src = rec.mathjax_src or ""
            if not src.startswith(base + "_static/mathjax/"):
                items.append(f"MathJax not loaded from the site's _static/mathjax/: {src!r}")
            if not rec.mathjax_done:
                items.append("MathJax.startup.promise never appeared (MathJax did not start)")
            if rec.mjx_containers == 0 or rec.math_untypeset:
                items.append(
                    f"{rec.math_untypeset} of {rec.math_elements} math elements not typeset "
                    f"({rec.mjx_containers} mjx-container on the page)"
                )
        if items:
            problems[rec.rel] = items
    return problems


# Output mime types myst-nb renders ahead of an image (its HTML render priority).
_BEFORE_IMAGE = ("application/vnd.jupyter.widget-view+json", "application/javascript", "text/html")
_IMAGE = ("image/svg+xml", "image/png", "image/jpeg", "image/gif")


def notebook_figures(nb_path: Path) -> int:
    """How many figure outputs of the notebook the page should show as images."""
    nb = json.loads(nb_path.read_text(encoding="utf-8"))
    count = 0
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        tags = set(cell.get("metadata", {}).get("tags", []))
        if tags & {"remove-output", "remove-cell", "hide-output"}:
            continue
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if any(m in data for m in _IMAGE) and not any(m in data for m in _BEFORE_IMAGE):
                count += 1
    return count


def check_notebook_figures(records: dict[str, PageRecord], src_root: Path) -> Problems:
    problems = {}
    for rec in records.values():
        nb = src_root / rec.rel.replace(".html", ".ipynb")
        if not nb.is_file():
            continue
        figures = notebook_figures(nb)
        if figures and rec.output_images < figures:
            problems[rec.rel] = [
                f"{nb.name} stores {figures} figure output(s); the page shows {rec.output_images}"
            ]
    return problems


def check_overflow(records: dict[str, PageRecord]) -> Problems:
    """No page is wider than the viewport (1 px of rounding allowed) at any of WIDTHS."""
    problems: Problems = {}
    for rec in records.values():
        for width, extra in rec.overflow.items():
            if extra > 1:
                culprits = "; ".join(rec.overflow_culprits.get(width, []))
                problems.setdefault(rec.rel, []).append(
                    f"{extra}px wider than a {width}px viewport (sticking out: {culprits})"
                )
    return problems


def check_legible_images(records: dict[str, PageRecord]) -> Problems:
    """A raster figure is never shown wider than it was drawn: its text would be blurred and small."""
    return {r.rel: r.upscaled_images for r in records.values() if r.upscaled_images}


def check_title_first(records: dict[str, PageRecord], src_root: Path) -> Problems:
    """A notebook page opens with its title: no code cell (input or output) before the first <h1>."""
    problems: Problems = {}
    for rec in records.values():
        if not (src_root / rec.rel.replace(".html", ".ipynb")).is_file():
            continue
        if not rec.has_title:
            problems[rec.rel] = ["the page has no <h1> title"]
        elif rec.code_before_title:
            problems[rec.rel] = ["a code cell comes before the page's title"]
    return problems


def check_favicon(records: dict[str, PageRecord]) -> Problems:
    return {
        r.rel: [f"favicon {r.favicon!r} answered {r.favicon_status}" if r.favicon else "no favicon"]
        for r in records.values()
        if not r.favicon or r.favicon_status != 200
    }


def check_one_search_box(records: dict[str, PageRecord]) -> Problems:
    problems: Problems = {}
    for rec in records.values():
        for width, boxes in rec.search_boxes.items():
            if len(boxes) != 1:
                problems.setdefault(rec.rel, []).append(
                    f"{len(boxes)} search boxes at {width}px: {boxes}"
                )
    return problems


# --- the tests ---------------------------------------------------------------------------------


def _toc_files() -> list[str]:
    import yaml

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                files.append(node["file"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk({k: v for k, v in toc.items() if k != "root"})
    return files


def test_every_toc_page_was_opened(records):
    expected = {re.sub(r"\.(md|ipynb)$", "", f) + ".html" for f in _toc_files()}
    missing = sorted(expected - set(records))
    assert not missing, f"pages in _toc.yml that the built site lacks: {missing}"


def test_no_javascript_errors(records):
    problems = check_javascript(records)
    assert not problems, "JavaScript errors:\n" + _report(problems)


def test_site_is_offline(records):
    problems = check_offline(records)
    assert not problems, "requests that left the machine (the site must work offline):\n" + _report(
        problems
    )


def test_no_failed_local_requests(records):
    problems = check_local_requests(records)
    assert not problems, "failed requests to the site:\n" + _report(problems)


def test_internal_links_resolve(records, site, server):
    problems = check_links(records, site, server)
    assert not problems, "broken internal links:\n" + _report(problems)


def test_redirect_pages_point_at_pages(site):
    for rel in _content_pages(site):
        target = _redirect_target(site / rel)
        if target:
            dest = (site / rel).parent / urlsplit(target).path
            assert dest.is_file(), f"{rel} redirects to {target}, which does not exist"


def test_images_load(records):
    problems = check_images(records)
    assert not problems, "images that did not load:\n" + _report(problems)


def test_math_is_typeset_by_local_mathjax(records, server):
    assert any(r.math_elements for r in records.values()), (
        "no page has math: the book's napkin math should be typeset somewhere"
    )
    problems = check_math(records, server)
    assert not problems, "math not rendered:\n" + _report(problems)


def test_notebook_figures_are_shown(records):
    assert any((ROOT / r.replace(".html", ".ipynb")).is_file() for r in records), (
        "no notebook page in the built site"
    )
    problems = check_notebook_figures(records, ROOT)
    assert not problems, "notebook figures missing from the site:\n" + _report(problems)


def test_no_horizontal_overflow(records):
    problems = check_overflow(records)
    assert not problems, "pages wider than the viewport:\n" + _report(problems)


def test_images_are_not_stretched(records):
    problems = check_legible_images(records)
    assert not problems, "raster images shown wider than their natural size:\n" + _report(problems)


def test_notebook_pages_open_with_their_title(records):
    problems = check_title_first(records, ROOT)
    assert not problems, "notebook pages with code before the title:\n" + _report(problems)


def test_favicon_resolves(records):
    problems = check_favicon(records)
    assert not problems, "favicon missing:\n" + _report(problems)


def test_one_search_box(records):
    problems = check_one_search_box(records)
    assert not problems, "not exactly one search box:\n" + _report(problems)


def test_notebook_pages_open_in_colab(records):
    import yaml

    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    repo = urlsplit(config["repository"]["url"]).path.strip("/")
    problems = {}
    for rec in records.values():
        if not (ROOT / rec.rel.replace(".html", ".ipynb")).is_file():
            continue
        want = f"colab.research.google.com/github/{repo}/blob/"
        suffix = "/" + rec.rel.replace(".html", ".ipynb")
        if not any(want in u and u.endswith(suffix) for u in rec.colab_links):
            problems[rec.rel] = [f"no Colab launch link ending in {suffix}: {rec.colab_links}"]
    assert not problems, "notebook pages without a Colab button:\n" + _report(problems)


_PNG_1PX = (  # a 1x1 PNG
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
    "+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


def test_checks_catch_a_broken_site(tmp_path, site):
    """The checks are not vacuous: on a page that breaks every rule, each one reports it."""
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "ok.html").write_text('<p id="here">fine</p>')
    (tmp_path / "notebooks" / "nb.html").write_text(
        f"""<!doctype html><html><head>
        <script>throw new Error("boom");</script>
        <script src="https://cdn.invalid/mathjax/tex-chtml.js"></script>
        </head><body>
        <a href="../ok.html#here">good</a> <a href="../ok.html#gone">bad fragment</a>
        <a href="../missing.html">bad file</a>
        <img src="../missing.png"> <img src="data:image/png;base64,{_PNG_1PX}">
        <span class="math notranslate nohighlight">\\(x^2\\)</span>
        <p>$$ y $$</p>
        <article><div class="cell">code</div><h1>Title after code</h1>
        <div style="width: 2000px">a table too wide for any window</div>
        <img style="width: 300px" src="data:image/png;base64,{_PNG_1PX}"></article>
        </body></html>"""
    )
    nb = {"cells": [{"cell_type": "code", "metadata": {}, "source": "", "outputs": [
        {"output_type": "display_data", "data": {"image/png": _PNG_1PX}, "metadata": {}}
    ]}], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}  # fmt: skip
    (tmp_path / "notebooks" / "nb.ipynb").write_text(json.dumps(nb))
    with serve(tmp_path) as base:
        recs = visit(tmp_path, base, ["ok.html", "notebooks/nb.html"])
        links = check_links(recs, tmp_path, base)["notebooks/nb.html"]
    bad = "notebooks/nb.html"
    assert any("boom" in e for e in check_javascript(recs)[bad])
    assert check_offline(recs)[bad] == ["https://cdn.invalid/mathjax/tex-chtml.js"]
    assert any("missing.png" in e for e in check_local_requests(recs)[bad])
    assert len(links) == 2 and any("#gone" in e for e in links), links
    assert len(check_images(recs)[bad]) == 1
    math = check_math(recs, base)[bad]
    assert any("raw TeX" in m for m in math) and any("not typeset" in m for m in math), math
    assert check_notebook_figures(recs, tmp_path) == {
        bad: ["nb.ipynb stores 1 figure output(s); the page shows 0"]
    }
    overflow = check_overflow(recs)[bad]
    assert [w for w in WIDTHS if any(f"{w}px viewport" in p for p in overflow)] == list(WIDTHS)
    assert any("natural 1px" in p for p in check_legible_images(recs)[bad])
    assert check_title_first(recs, tmp_path) == {bad: ["a code cell comes before the page's title"]}
    assert check_favicon(recs)[bad] == ["no favicon"]
    assert any("0 search boxes" in p for p in check_one_search_box(recs)[bad])
    assert set(recs) == {"ok.html", bad} and not any(
        f(recs).get("ok.html")
        for f in (
            check_javascript,
            check_offline,
            check_images,
            check_overflow,
            check_legible_images,
        )
    )
