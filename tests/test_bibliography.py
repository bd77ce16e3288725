"""Checks on references.bib and the bibliography page.

The reading lists the course is built from live beside the repository in
``../shared/seeds`` (a clean clone in CI has them there). Coverage tests read the
titles and URLs they check straight out of those files, so a resource added to a
reading list and forgotten here makes a test fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import unicodedata
from collections import Counter
from pathlib import Path
from urllib.parse import urlparse

import pytest

pybtex_database = pytest.importorskip(
    "pybtex.database", reason="pybtex comes with the book's requirements"
)
parse_file = pybtex_database.parse_file

ROOT = Path(__file__).resolve().parents[1]
BIB = ROOT / "references.bib"
BIBLIOGRAPHY_PAGE = ROOT / "bibliography.md"
# GPU_BRRR_SEEDS points elsewhere (a git worktree, for instance, does not sit beside shared/).
SEEDS = Path(os.environ.get("GPU_BRRR_SEEDS", ROOT.parent / "shared" / "seeds"))

GROUPS = (
    "act1",
    "act1.5",
    "act2",
    "act3",
    "act4",
    "act5",
    "act6",
    "act7",
    "act8",
    "sidequests",
    "people",
    "hardware",
    "tools",
    "general",
)

URL_RE = re.compile(r"https?://[^\s)<>\]\"]+")
ENTRY_HEAD_RE = re.compile(r"^\s*@(\w+)\s*\{\s*([^,\s]+)\s*,", re.MULTILINE)
CITE_RE = re.compile(r"\{cite(?::\w+)?\}`([^`]+)`")


# --------------------------------------------------------------------------- helpers


def normalise(text: str) -> str:
    """Lowercase, drop LaTeX braces/accents and punctuation, collapse spaces."""
    text = re.sub(r"\\[`'^\"~=.uvHckbdrt]\s*\{?(\w)\}?", r"\1", text)  # \'{e} -> e
    text = text.replace("{", "").replace("}", "").replace("\\", " ")
    text = unicodedata.normalize("NFKD", text)
    text = "".join(c for c in text if not unicodedata.combining(c))
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def norm_url(url: str) -> str:
    return url.strip().rstrip("/")


def seed(prefix: str) -> Path:
    if not SEEDS.is_dir():
        pytest.skip(f"reading lists not found at {SEEDS} (they sit beside the repository)")
    matches = sorted(SEEDS.glob(f"{prefix}_*.txt"))
    if not matches:
        pytest.skip(f"no seed file {prefix}_*.txt in {SEEDS}")
    return matches[0]


@pytest.fixture(scope="module")
def bib():
    return parse_file(str(BIB))


@pytest.fixture(scope="module")
def titles(bib):
    """Normalised title and shorttitle strings of every entry."""
    out = []
    for entry in bib.entries.values():
        for field in ("title", "shorttitle"):
            if field in entry.fields:
                out.append((field, normalise(entry.fields[field])))
    return out


@pytest.fixture(scope="module")
def bib_urls(bib):
    return {norm_url(e.fields["url"]) for e in bib.entries.values() if "url" in e.fields}


def covered(item: str, titles, fields=("title", "shorttitle")) -> bool:
    wanted = normalise(item)
    return any(f in fields and wanted in t for f, t in titles)


# ------------------------------------------------------------------ seed parsing

RESOURCE_HEADERS = re.compile(
    r"^(Resources|Kernel Resources|FlashAttention Resources|"
    r"Compiler and Runtime Side Quests|People and Feeds)$"
)


def spine_titles() -> list[str]:
    """Resource titles of 000: bullets under the resource headers, before ' - '."""
    found, active = [], False
    for raw in seed("000").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if RESOURCE_HEADERS.match(line):
            active = True
        elif line.startswith("Act "):
            active = False
        elif active and line.startswith("- "):
            found.append(line[2:].split(" - ", 1)[0].strip())
    return found


def learning_list_items() -> tuple[list[str], list[str]]:
    """Named items and bare URLs of 002.

    The list mixes named items with commentary written as bullets. A bullet's
    head is the text before ' - ' when a description (five words or more)
    follows, or before ': ' when the author's comment ("I think ...") follows.
    A head is a named item when it is short (at most 60 characters) and carries
    a capital letter or digit after its first character (names, acronyms,
    product versions); commentary heads are long sentences or plain prose.
    """
    names, urls = [], []
    for raw in seed("002").read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line.startswith("- "):
            continue
        body = line[2:].strip().rstrip("*").strip()
        if URL_RE.fullmatch(body):
            urls.append(body)
            continue
        head = body
        if " - " in body:
            first, rest = body.split(" - ", 1)
            if len(rest.split()) >= 5:
                head = first
        if ": " in head:
            first, rest = head.split(": ", 1)
            if rest.startswith(("I ", "I'm ")):
                head = first
        head = head.strip()
        if len(head) <= 60 and re.search(r"[A-Z0-9]", head[1:]):
            names.append(head)
    return names, urls


def seed_urls(prefix: str) -> list[str]:
    text = seed(prefix).read_text(encoding="utf-8")
    return sorted({u.rstrip(".,;") for u in URL_RE.findall(text)})


# ------------------------------------------------------------------ bib structure


def test_keys_unique_in_raw_text():
    text = BIB.read_text(encoding="utf-8")
    keys = [k for _, k in ENTRY_HEAD_RE.findall(text)]
    dupes = [k for k, n in Counter(k.lower() for k in keys).items() if n > 1]
    assert not dupes, f"duplicate keys: {dupes}"
    assert len(keys) > 100


def test_parses_with_pybtex(bib):
    text = BIB.read_text(encoding="utf-8")
    assert len(bib.entries) == len(ENTRY_HEAD_RE.findall(text))


def test_entry_types_supported(bib):
    supported = {"article", "book", "inproceedings", "incollection", "misc", "techreport"}
    bad = {k: e.type for k, e in bib.entries.items() if e.type.lower() not in supported}
    assert not bad, f"entry types the plain style does not render: {bad}"


# An entry the reading lists name without an author says so in its note; it then needs no author.
NO_AUTHOR_NOTE = "without an author"
VENUE_FIELDS = ("howpublished", "journal", "booktitle", "publisher", "school", "institution")


def identification_problems(key: str, entry) -> list[str]:
    """An entry links to the resource itself, or identifies it by author, year and venue."""
    f = entry.fields
    if "url" in f:
        return []
    problems = []
    has_author = "author" in entry.persons or "editor" in entry.persons or "organization" in f
    if not has_author and NO_AUTHOR_NOTE not in f.get("note", ""):
        problems.append(f"{key}: no url, so it needs an author")
    if "year" not in f:
        problems.append(f"{key}: no url, so it needs a year")
    if not any(v in f for v in VENUE_FIELDS):
        problems.append(f"{key}: no url, so it needs a venue ({', '.join(VENUE_FIELDS)})")
    return problems


def test_required_fields(bib):
    problems = []
    for key, e in bib.entries.items():
        f = e.fields
        if "title" not in f:
            problems.append(f"{key}: no title")
        problems += identification_problems(key, e)
        if "year" not in f and "note" not in f:
            problems.append(f"{key}: neither year nor note")
        if "author" not in e.persons and "organization" not in f and "howpublished" not in f:
            problems.append(f"{key}: no author, organization or howpublished")
        need = {
            "article": ("journal", "year"),
            "inproceedings": ("booktitle", "year"),
            "book": ("publisher", "year"),
        }.get(e.type.lower(), ())
        problems += [f"{key}: @{e.type} needs {n}" for n in need if n not in f]
        if e.type.lower() in ("article", "inproceedings", "book") and "author" not in e.persons:
            problems.append(f"{key}: @{e.type} needs an author")
    assert not problems, "\n".join(problems)


def test_identification_rule_can_fail():
    from pybtex.database import Entry, Person

    bare = Entry("misc", fields={"title": "T"})
    assert len(identification_problems("k", bare)) == 3
    linked = Entry("misc", fields={"title": "T", "url": "https://example.org/t"})
    assert identification_problems("k", linked) == []
    named = Entry("misc", fields={"title": "T", "year": "2025", "howpublished": "Talk"})
    named.persons["author"] = [Person("Ada Lovelace")]
    assert identification_problems("k", named) == []
    anonymous = Entry("misc", fields={"title": "T", "year": "2025", "howpublished": "Blog post"})
    assert identification_problems("k", anonymous) == ["k: no url, so it needs an author"]
    anonymous.fields["note"] = f"The learning list names it {NO_AUTHOR_NOTE} or a link"
    assert identification_problems("k", anonymous) == []


# A link to a search (or a search-like listing) is never the resource itself.
SEARCH_URL_PATTERNS = [
    r"[?&](q|query|search_query|keywords|searchtype)=",
    r"/search[/?]|/search$|/results[/?]",
    r"youtube\.com/results",
    r"google\.[a-z.]+/search",
    r"(x|twitter)\.com/search",
    r"linkedin\.com/search",
    r"arxiv\.org/(search|a/)",
    r"scholar\.google\.",
    r"(bing|duckduckgo)\.com/",
]
SEARCH_URL = re.compile("|".join(SEARCH_URL_PATTERNS), re.IGNORECASE)


@pytest.mark.parametrize(
    "url",
    [
        "https://www.youtube.com/results?search_query=Give+Me+30+min",
        "https://www.google.com/search?q=%22Flash+Attention%22",
        "https://x.com/search?q=%22Ali%20Taha%22&f=user",
        "https://www.linkedin.com/search/results/content/?keywords=CuTeDSL",
        "https://arxiv.org/search/?query=Transport+Muon&searchtype=all",
        "https://scholar.google.com/scholar?q=flashattention",
    ],
)
def test_search_url_pattern_catches(url):
    assert SEARCH_URL.search(url)


@pytest.mark.parametrize(
    "url",
    [
        "https://www.youtube.com/watch?v=xewKxorikwE",
        "https://x.com/waterloo_intern/status/2070643039668974060",
        "https://arxiv.org/abs/2205.14135",
        "https://huggingface.co/spaces/nanotron/ultrascale-playbook?section=kernels",
        "https://github.com/gpu-mode/Triton-Puzzles",
    ],
)
def test_search_url_pattern_spares_resources(url):
    assert not SEARCH_URL.search(url)


def test_no_entry_links_to_a_search(bib):
    found = []
    for key, e in bib.entries.items():
        for field in ("url", "note", "howpublished"):
            found += [
                f"{key}.{field}: {u}"
                for u in URL_RE.findall(e.fields.get(field, ""))
                if SEARCH_URL.search(u)
            ]
    assert not found, "links to searches, not to the resources:\n" + "\n".join(found)


def test_no_unconfirmed_notes(bib):
    """An entry is either linked to its resource or identified without a link: never "not confirmed"."""
    bad = [
        f"{key}.{field}"
        for key, e in bib.entries.items()
        for field, value in e.fields.items()
        if re.search(r"not\s+confirmed|unconfirmed|is a search", value, re.IGNORECASE)
    ]
    assert not bad, bad


def test_pages_do_not_call_a_link_a_search():
    pages = [ROOT / "people.md", BIBLIOGRAPHY_PAGE, ROOT / "intro.md", ROOT / "prerequisites.md"]
    bad = [
        p.name
        for p in pages
        if p.is_file()
        and re.search(r"is a search|not confirmed", p.read_text(encoding="utf-8"), re.I)
    ]
    assert not bad, bad


def test_urls_are_well_formed(bib):
    bad = []
    for key, e in bib.entries.items():
        if "url" not in e.fields:  # identified by author, year and venue instead
            continue
        url = e.fields["url"]
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc or re.search(r"\s", url):
            bad.append(f"{key}: {url!r}")
    assert not bad, "\n".join(bad)


def test_howpublished_is_not_a_raw_url_command(bib):
    # pybtex renders \url{...} literally ("\url https://..."); the url field carries the link.
    bad = [k for k, e in bib.entries.items() if "\\url" in e.fields.get("howpublished", "")]
    assert not bad, bad


def test_keywords_one_known_group(bib):
    bad = {
        k: e.fields.get("keywords")
        for k, e in bib.entries.items()
        if e.fields.get("keywords") not in GROUPS
    }
    assert not bad, f"keywords must be exactly one of {GROUPS}: {bad}"


def test_every_group_used(bib):
    used = {e.fields["keywords"] for e in bib.entries.values()}
    assert used == set(GROUPS), f"groups without entries: {set(GROUPS) - used}"


ACRONYM_RE = re.compile(r"\b[A-Z][A-Z0-9]*[A-Z0-9]\b|\b[A-Za-z0-9]+[A-Z][A-Za-z0-9]*\b")


def unprotected_words(title: str) -> list[str]:
    """Words with a capital after their first letter (GPU, CUDA, PyTorch) outside braces."""
    depth, plain = 0, []
    for ch in title:
        if ch == "{":
            depth += 1
            plain.append(" ")
        elif ch == "}":
            depth -= 1
            plain.append(" ")
        else:
            plain.append(ch if depth == 0 else " ")
    text = re.sub(r"\\[a-zA-Z]+", " ", "".join(plain))  # \L, \c etc. are commands
    return [w for w in ACRONYM_RE.findall(text) if not w.isdigit() and re.search(r"[A-Z]", w[1:])]


def test_unprotected_words_detector():
    assert unprotected_words("The {CUDA} Guide for LLM and PyTorch") == ["LLM", "PyTorch"]
    assert unprotected_words("{FlashAttention}: {IO}-Awareness") == []


def test_capitals_are_protected(bib):
    bad = {}
    for key, e in bib.entries.items():
        if e.type.lower() == "book":  # book titles are printed as written
            continue
        words = unprotected_words(e.fields["title"])
        if words:
            bad[key] = words
    assert not bad, f"acronyms/camel-case outside braces would be lowercased: {bad}"


def test_required_keys_exist(bib):
    required = """
        mlsysgpuexecution mlsysgpucourse cudaclick30min gpumodelectures gpumodelecture001
        cudamode001materials cs149lecture1 hwu2022pmpp nvidiacudaguide nvidia2022hopperindepth
        luo2024dissectinghopper he2022brrr tritonvectoradd boehm2022sgemm dao2022flashattention
        austin2025scaling chen2022inferencearithmetic nvidia2017v100 nvidia2018t4 nvidia2018turing
        nvidia2021a10 nvidia2023l4 nvidia2020a100 nvidia2020ampere nvidia2022h100
        nvidia2022hopperwhitepaper nvidia2023h200 nvidia2024blackwell amd2023mi300x amd2023cdna3
        nvidia2022ada kwon2023pagedattention
    """.split()
    missing = [k for k in required if k not in bib.entries]
    assert not missing, missing
    fixed_groups = {
        "mlsysgpucourse": "act1",
        "cudamode001materials": "act1",
        "gpumodelecture001": "act3",
        "he2022brrr": "act2",
    }
    for key, group in fixed_groups.items():
        assert bib.entries[key].fields["keywords"] == group, key
    for key in required:
        if key.startswith(("nvidia20", "amd20")) and key != "nvidia2022hopperindepth":
            assert bib.entries[key].fields["keywords"] == "hardware", key


# --------------------------------------------------------------- bibliography page


def page_filters() -> list[str]:
    text = BIBLIOGRAPHY_PAGE.read_text(encoding="utf-8")
    blocks = re.findall(r"```\{bibliography\}(.*?)```", text, re.DOTALL)
    filters = []
    for block in blocks:
        m = re.search(r':filter:\s*keywords\s*%\s*"\^(.+?)\$"', block)
        assert m, f"bibliography block without an anchored keywords filter:\n{block}"
        # author-year labels, like the in-text citations: no [A1-n] prefixes
        assert ":style: authoryear" in block and ":labelprefix:" not in block, block
        filters.append(m.group(1))
    return filters


def test_page_has_one_directive_per_group_in_order():
    patterns = page_filters()
    # each filter is a regex; the group it selects is the one it fully matches
    selected = [[g for g in GROUPS if re.fullmatch(p.replace("\\\\", "\\"), g)] for p in patterns]
    assert all(len(s) == 1 for s in selected), (
        f"each filter must select exactly one group: {selected}"
    )
    assert [s[0] for s in selected] == list(GROUPS)


def test_page_title_and_headings():
    text = BIBLIOGRAPHY_PAGE.read_text(encoding="utf-8")
    assert text.startswith("# Bibliography\n")
    headings = re.findall(r"^## (.+)$", text, re.MULTILINE)
    assert len(headings) == len(GROUPS)


def test_each_entry_in_exactly_one_section(bib):
    patterns = [p.replace("\\\\", "\\") for p in page_filters()]
    for key, e in bib.entries.items():
        hits = sum(bool(re.search(f"^{p}$", e.fields["keywords"])) for p in patterns)
        assert hits == 1, f"{key} shown in {hits} sections"


# ------------------------------------------------------------------ coverage


def test_learning_list_parser_finds_known_items():
    names, urls = learning_list_items()
    assert "Static Polymorphism" in names and "DSA" in names and "tcgen05 for dummies" in names
    assert "FlashInfer - Better Sampling" in names
    assert "The scheduling section is interesting" not in names
    assert len(urls) == 3


@pytest.mark.parametrize("prefix", ["001", "004"])
def test_curated_list_urls_covered(prefix, bib_urls):
    urls = seed_urls(prefix)
    assert len(urls) > 50
    missing = [u for u in urls if norm_url(u) not in bib_urls]
    coverage = 1 - len(missing) / len(urls)
    assert coverage >= 0.95, (
        f"{prefix}: {coverage:.1%} of URLs in references.bib; missing {missing}"
    )


def test_spine_titles_covered(titles):
    items = spine_titles()
    assert len(items) > 50, items
    missing = [t for t in items if not covered(t, titles)]
    coverage = 1 - len(missing) / len(items)
    assert coverage >= 0.95, f"000: {coverage:.1%} of titles matched; missing {missing}"


def test_learning_list_fully_covered(titles, bib_urls):
    names, urls = learning_list_items()
    missing = [t for t in names if not covered(t, titles)]
    missing += [u for u in urls if norm_url(u) not in bib_urls]
    assert not missing, f"002 items without an entry: {missing}"


def test_sgemm_worklog_present(bib_urls):
    assert "https://siboehm.com/articles/22/CUDA-MMM" in bib_urls


def test_coverage_helpers_can_fail(titles):
    assert not covered("A Title That Is Not In Any Reading List Xyzzy", titles)
    assert (
        normalise("Give Me 30 min, I’ll Make {CUDA} Click") == "give me 30 min i ll make cuda click"
    )


# ------------------------------------------------------------------ citations


def cited_keys() -> dict[str, set[str]]:
    sources: dict[str, set[str]] = {}
    skip = {".venv", "_build", ".git", "node_modules"}
    for path in ROOT.rglob("*"):
        if skip & set(path.relative_to(ROOT).parts) or not path.is_file():
            continue
        if path.suffix == ".md":
            texts = [path.read_text(encoding="utf-8")]
        elif path.suffix == ".ipynb":
            nb = json.loads(path.read_text(encoding="utf-8"))
            texts = [
                "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
                for c in nb.get("cells", [])
                if c.get("cell_type") == "markdown"
            ]
        else:
            continue
        for text in texts:
            for group in CITE_RE.findall(text):
                for key in group.split(","):
                    sources.setdefault(key.strip(), set()).add(str(path.relative_to(ROOT)))
    return sources


def test_hardware_table_sources_exist(bib):
    table = ROOT / "kernels" / "hardware.yaml"
    if not table.exists():
        pytest.skip("kernels/hardware.yaml not present")
    yaml = pytest.importorskip("yaml")
    data = yaml.safe_load(table.read_text(encoding="utf-8"))
    keys = {
        figure[1]
        for gpu in data.values()
        if isinstance(gpu, dict)
        for figure in (gpu.get("figures") or {}).values()
        if isinstance(figure, list) and len(figure) == 2
    }
    assert keys, "no figure sources found in kernels/hardware.yaml"
    missing = sorted(k for k in keys if k not in bib.entries)
    assert not missing, f"hardware.yaml cites keys missing from references.bib: {missing}"
    bad_group = sorted(k for k in keys if bib.entries[k].fields["keywords"] != "hardware")
    assert not bad_group, f"spec sources should be in the hardware group: {bad_group}"


def test_cite_regex():
    assert CITE_RE.findall("see {cite}`a,b` and {cite:p}`c`") == ["a,b", "c"]


def test_every_cited_key_exists(bib):
    missing = {k: sorted(v) for k, v in cited_keys().items() if k not in bib.entries}
    assert not missing, f"cited but not in references.bib: {missing}"


# ------------------------------------------------------------ author-year labels

_ext_spec = importlib.util.spec_from_file_location(
    "authoryear_bib", ROOT / "_ext" / "authoryear_bib.py"
)
authoryear_bib = importlib.util.module_from_spec(_ext_spec)
sys.modules["authoryear_bib"] = authoryear_bib
_ext_spec.loader.exec_module(authoryear_bib)


def test_labels_read_like_the_in_text_citations():
    from pybtex.database import Entry, Person

    one = Entry("misc", fields={"title": "Worklog", "year": "2022"})
    one.persons["author"] = [Person("Simon Boehm")]
    two = Entry("misc", fields={"title": "Paper", "year": "2023"})
    two.persons["author"] = [
        Person("Tri Dao"),
        Person("Dan Fu"),
        Person("Stefano Ermon"),
        Person("Atri Rudra"),
    ]
    org = Entry("misc", fields={"title": "Datasheet", "year": "2022"})
    org.persons["author"] = [Person("{NVIDIA}")]
    assert authoryear_bib.author_year_label(one) == "Boehm, 2022"
    assert authoryear_bib.author_year_label(two) == "Dao et al., 2023"
    assert authoryear_bib.author_year_label(org) == "NVIDIA, 2022"


def test_shared_author_years_get_letters_once():
    from pybtex.database import Entry, Person

    entries = {}
    for key, title in [("b", "Beta"), ("a", "Alpha"), ("c", "Gamma")]:
        entries[key] = Entry("misc", fields={"title": title, "year": "2025"})
        entries[key].key = key
        entries[key].persons["author"] = [Person("{NVIDIA}")]
    entries["d"] = Entry("misc", fields={"title": "Alone", "year": "2024"})
    entries["d"].persons["author"] = [Person("{NVIDIA}")]
    for _ in range(2):  # a second pass over the same data must not add a second letter
        authoryear_bib.disambiguate_years(entries)
        assert [entries[k].fields["year"] for k in "abcd"] == ["2025a", "2025b", "2025c", "2024"]


def test_built_bibliography_has_author_year_labels():
    """On the built site (skipped before `make book`): labels like [Boehm, 2022], never [A1-1]."""
    page = ROOT / "_build" / "html" / "bibliography.html"
    if not page.is_file():
        pytest.skip("the site is not built")
    html = page.read_text(encoding="utf-8")
    labels = re.findall(r'<span class="label"><span class="fn-bracket">\[</span>(.*?)<span', html)
    assert labels, "no citation labels found on the bibliography page"
    prefixed = [label for label in labels if re.fullmatch(r"[A-Z][\d.]*-\d+", label)]
    assert not prefixed, prefixed[:5]
    assert all(re.search(r", (\d{4}[a-z]{0,2}|n\.d\.)$", label) for label in labels), [
        label for label in labels if not re.search(r", \d{4}", label)
    ][:5]
