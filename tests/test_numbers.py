"""Every number traceable (issue 15, item 6): tools/check_numbers.py over the book's prose pages.

A typed measurement (a number with a unit such as µs, ms, GB/s, TFLOP/s, ×) in acts/*.md, intro.md
or setup.md is glued from a notebook output, cited in its block, or marked `% numbers: <reason>`.
The `test_checker_*` tests plant numbers in synthetic pages, so the rule is never vacuous.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_numbers", ROOT / "tools" / "check_numbers.py")
check_numbers = importlib.util.module_from_spec(_spec)
sys.modules["check_numbers"] = check_numbers  # dataclasses look their module up there
_spec.loader.exec_module(check_numbers)

PAGES = check_numbers.default_paths(ROOT)


def typed(text: str, keys: set[str] | None = None) -> list[str]:
    """The offending texts of a synthetic page."""
    return [o.text for o in check_numbers.check_text(text, "page.md", keys)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_typed_number_is_traceable(page):
    offenders = check_numbers.check_files([page], ROOT)
    assert not offenders, (
        "typed measurements that are neither glued, nor cited in their block, nor marked "
        "`% numbers: napkin|datasheet|published <key>|profiled <file>|illustrative`:\n"
        + "\n".join(map(str, offenders))
    )


def test_checker_catches_a_planted_typed_number():
    page = "# 2.1 Title\n\nThe kernel runs in 23.1 µs and reaches 3.0 TB/s.\n"
    assert typed(page) == ["23.1 µs", "3.0 TB/s"]
    offender = check_numbers.check_text(page, "acts/x.md")[0]
    assert str(offender) == 'acts/x.md:3: "23.1 µs"'


@pytest.mark.parametrize(
    "text",
    [
        "It took 5\u00a0ms.",
        "It took 5ms.",
        "About 1,176 us.",
        "It is 2.5x faster.",
        "It is **1.55×** faster.",
        "Speed-up 3.9 ×, which",
        "A rate of 600 tokens/s or 60 tok/s.",
        "It gives 989 TFLOP/s, 60 GFLOP/s or 2 PFLOP/s.",
        "Copy at 2.9 GiB/s and 500 GB/s.",
        "It waits 500 ns.",
        "- a list item with 4 ms in it",
        "| row | 7 µs |",
        "```{admonition} Takeaway\nint4 gives 3.9× here.\n```",
        ":::{dropdown} Solution\nIt takes 12 ms.\n:::",
    ],
)
def test_checker_catches_every_unit_and_block_kind(text):
    assert typed(text), text


def test_checker_accepts_glued_cited_and_marked_numbers():
    page = "\n".join(
        [
            "Glued: {glue:text}`../notebooks/07a-x.ipynb::us:s` µs and {glue:text}`nb::sp:.2f`×.",
            "",
            "Published: 3.35 TB/s on the datasheet {cite:p}`nvidia2022h100`.",
            "",
            "| H100 | 989 TFLOP/s | {cite}`nvidia2022h100` |",
            "",
            "% numbers: napkin, 3.22 GB at 3.35 TB/s from the paragraph above",
            "That takes 0.96 ms.",
            "A second line of the same block: 1.07 ms.",
            "",
            "% numbers: datasheet H100 SXM",
            "- HBM3 at 3.35 TB/s",
            "- 989 TFLOP/s dense bf16",
            "",
            "% numbers: published nvidia2022h100",
            "Up to 3× over A100.",
            "",
            "% numbers: illustrative",
            "```{admonition} Answer",
            ":class: dropdown",
            "At 3 TB/s it takes 5 ms.",
            "",
            "A second paragraph in the directive: 2×.",
            "```",
        ]
    )
    assert typed(page, {"nvidia2022h100"}) == []


def test_checker_skips_code_math_comments_and_products():
    page = "\n".join(
        [
            "Inline `time = 5 ms` code, math $t = 3\\,\\mu s$ and $2 \\times 10$ ms.",
            "",
            "```python",
            "print(f'{t:.1f} ms')  # 4 ms",
            "```",
            "",
            "```{code-block} text",
            "23.1 µs",
            "```",
            "",
            "$$",
            "t = 4 ms",
            "$$",
            "",
            "```{math}",
            "9 \\times 3 TB/s",
            "```",
            "",
            "% an ordinary comment that says 5 ms",
            "<!-- an HTML comment with 7 µs -->",
            "A 8192 × 8192 weight, a 128 ×",
            "128 tile, 8x8 blocks, 0x1F, 2 × {glue:text}`nb::n` and [a link](https://x.org/2x).",
            "See https://example.com/10ms for more.",
        ]
    )
    assert typed(page) == []


def test_marker_covers_only_its_block():
    page = "% numbers: napkin\nFirst block: 2 ms.\n\nNext block: 3 ms.\n"
    assert typed(page) == ["3 ms"]


def test_cite_covers_only_its_block():
    page = "Cited 2 ms {cite}`k`.\n- item: 3 ms\n\n| a | 4 µs |\n| b | 5 µs {cite:t}`k` |\n"
    assert typed(page) == ["3 ms", "4 µs"]


def test_malformed_markers_are_offenders():
    assert typed("% numbers: because\nIt takes 2 ms.\n")[0].startswith("% numbers: because")
    assert "covers no block" in typed("% numbers: napkin\n\nIt takes 2 ms.\n")[0]
    published = typed("% numbers: published nosuchkey\nIt takes 2 ms.\n", {"realkey"})
    assert len(published) == 1 and "nosuchkey" in published[0]
    assert typed("% numbers: published\nIt takes 2 ms.\n", {"realkey"})
    missing = typed("% numbers: profiled results/profiles/no-such.txt\nIt takes 2 ms.\n")
    assert len(missing) == 1 and "no-such.txt" in missing[0]
    assert typed("% numbers: profiled\nIt takes 2 ms.\n")


def test_profiled_marker_names_a_committed_file():
    assert (
        typed("% numbers: profiled tests/test_numbers.py (a file that exists)\nIt takes 2 ms.\n")
        == []
    )


def test_line_numbers_follow_the_source():
    page = "# T\n\n```{admonition} A\n:class: dropdown\nline five\nsix: 9 ms\n```\n"
    [offender] = check_numbers.check_text(page, "p.md")
    assert offender.line == 6


def test_cli_lists_offenders_and_exits_1(tmp_path):
    bad, good = tmp_path / "bad.md", tmp_path / "good.md"
    bad.write_text("Typed: 42 ms.\n", encoding="utf-8")
    good.write_text("Glued: {glue:text}`nb::t` ms.\n", encoding="utf-8")
    script = ROOT / "tools" / "check_numbers.py"
    run = subprocess.run([sys.executable, script, bad, good], capture_output=True, text=True)
    assert run.returncode == 1
    assert run.stdout.strip() == f'{bad}:1: "42 ms"'
    run = subprocess.run([sys.executable, script, good], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout == ""
