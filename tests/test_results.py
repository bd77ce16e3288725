"""kernels.results: every GPU's records, the newest of each case, summarised per benchmark."""

import json

import pytest

from kernels import plotstyle, results


def rec(gpu="GPU A", bench="softmax", shape=(4, 8), date="2026-01-01", ms=1.0, **kw):
    r = {"gpu": gpu, "bench": bench, "variant": "triton", "shape": list(shape), "dtype": "float16",
         "ms": ms, "date": date, "ceiling_frac": 0.5, "speedup": 1.0}  # fmt: skip
    r.update(kw)
    return r


def test_newest_supersedes_older_runs_of_the_same_case():
    old = rec(date="2026-01-01", ceiling_frac=0.4)
    new = rec(date="2026-02-01", ceiling_frac=0.9)
    same_day_later = rec(date="2026-02-01", ceiling_frac=0.95)
    other_gpu = rec(gpu="GPU B", date="2025-01-01")
    other_shape = rec(shape=(4, 16))
    kept = results.newest([new, old, same_day_later, other_gpu, other_shape])
    assert len(kept) == 3
    mine = [r for r in kept if r["gpu"] == "GPU A" and r["shape"] == [4, 8]]
    assert [r["ceiling_frac"] for r in mine] == [0.95]
    assert other_gpu in kept and other_shape in kept


def test_summary_medians_per_bench_and_gpu_and_skips_error_rows():
    recs = [
        rec(ceiling_frac=0.2, speedup=0.5, shape=(1,)),
        rec(ceiling_frac=0.6, speedup=1.5, shape=(2,)),
        rec(ceiling_frac=0.9, speedup=2.0, shape=(3,), date="2026-03-04"),
        rec(ms=None, shape=(4,), error="boom"),
        rec(gpu="GPU B", bench="matmul", ceiling_frac=None, speedup=None),
    ]
    gpus, table = results.summary(recs)
    assert gpus == ["GPU A", "GPU B"]
    cell = table["softmax"]["GPU A"]
    assert (cell.cases, cell.roof_frac, cell.speedup, cell.date) == (3, 0.6, 1.5, "2026-03-04")
    assert "GPU B" not in table["softmax"]
    assert results.cell_text(cell) == "0.60 of roof · 1.50× (3)"
    assert results.cell_text(table["matmul"]["GPU B"]) == "no roof · no baseline (1)"
    assert results.cell_text(None) == "–"


def test_load_all_reads_every_file(tmp_path):
    (tmp_path / "gpu-a.jsonl").write_text(
        json.dumps(rec(date="2026-01-01")) + "\n\n" + json.dumps(rec(date="2026-05-01")) + "\n"
    )
    (tmp_path / "gpu-b.jsonl").write_text(json.dumps(rec(gpu="GPU B")) + "\n")
    (tmp_path / "notes.txt").write_text("not a results file")
    kept = results.load_all(tmp_path)
    assert sorted((r["gpu"], r["date"]) for r in kept) == [
        ("GPU A", "2026-05-01"),
        ("GPU B", "2026-01-01"),
    ]


@pytest.mark.parametrize("path", sorted(results.RESULTS_DIR.glob("*.jsonl")), ids=lambda p: p.name)
def test_committed_results_files_are_well_formed(path):
    recs = results.load(path)
    assert recs, f"{path.name} is empty"
    need = {"bench", "gpu", "ms", "date", "shape", "dtype"}
    for i, r in enumerate(recs):
        assert need <= r.keys(), f"{path.name} line {i + 1} lacks {need - r.keys()}"
    assert len({r["gpu"] for r in recs}) == 1, f"{path.name} mixes GPUs"


def test_the_committed_results_cover_more_than_one_gpu():
    gpus, table = results.summary(results.load_all())
    assert len(gpus) >= 2, gpus
    assert any(b.startswith("shapes/") for b in table)


# --- the figures' series (pure functions) and the figures themselves -------------------------------


def _table():
    recs = [
        rec(bench="add", ceiling_frac=0.9, speedup=1.1),
        rec(bench="add", gpu="GPU B", ceiling_frac=0.8, speedup=None),
        rec(bench="ceiling", ceiling_frac=0.7, speedup=None),
        rec(bench="step", gpu="GPU B", ceiling_frac=None, speedup=2.0),
        rec(bench="nothing", ceiling_frac=None, speedup=None),
    ]
    return results.summary(recs)


def test_bar_series_keeps_benches_and_gpus_with_a_value():
    _gpus, table = _table()
    roof = results.bar_series(table, "roof_frac")
    assert roof.benches == ["add", "ceiling"] and roof.gpus == ["GPU A", "GPU B"]
    assert roof.values == {"GPU A": [0.9, 0.7], "GPU B": [0.8, None]}
    speed = results.bar_series(table, "speedup")
    assert speed.benches == ["add", "step"] and speed.gpus == ["GPU A", "GPU B"]
    assert speed.values == {"GPU A": [1.1, None], "GPU B": [None, 2.0]}
    with pytest.raises(ValueError, match="field"):
        results.bar_series(table, "ms")


def test_select_is_the_page_sections():
    table = {"shapes/add": 1, "shapes/add/host": 2, "softmax": 3}
    assert list(results.select(table, prefix="shapes/")) == ["shapes/add", "shapes/add/host"]
    assert list(results.select(table, exclude="shapes/")) == ["softmax"]
    assert list(results.select(table)) == list(table)


def test_pairs_match_cases_across_gpus_against_the_reference():
    recs = [
        rec(shape=(1,), ceiling_frac=0.5),
        rec(shape=(2,), ceiling_frac=0.6),
        rec(shape=(3,), ceiling_frac=0.7),  # only on GPU A
        rec(gpu="GPU B", shape=(1,), ceiling_frac=0.55),
        rec(gpu="GPU B", shape=(2,), ceiling_frac=0.4),
        rec(gpu="GPU B", shape=(2,), dtype="bfloat16", ceiling_frac=0.9),  # another case
        rec(gpu="GPU C", shape=(2,), ceiling_frac=None),  # no roof: not a point
        rec(gpu="GPU C", shape=(1,), ms=None),  # an error row: not a point
        rec(gpu="GPU D", bench="matmul", ceiling_frac=0.3),  # shares no case
    ]
    assert results.reference_gpu(recs) == "GPU A"
    got = results.pairs(recs, "GPU A")
    assert got == {"GPU B": [results.Pair("softmax", 0.5, 0.55), results.Pair("softmax", 0.6, 0.4)]}
    assert results.pairs(recs, "GPU D") == {}
    assert results.reference_gpu([rec(gpu="Z"), rec(gpu="Y")]) == "Y"  # a tie: by name
    assert results.reference_gpu([rec(ms=None)]) is None


def test_gpu_colors_are_stable_and_distinct():
    colors = results.gpu_colors(["GPU B", "GPU A", "GPU C"])
    assert list(colors) == ["GPU A", "GPU B", "GPU C"] and len(set(colors.values())) == 3
    assert results.gpu_colors(["GPU A", "GPU B"]) == {g: colors[g] for g in ("GPU A", "GPU B")}


def test_figures_name_the_gpus_and_save_as_svg(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    _gpus, table = _table()
    fig = results.draw_bars(table)
    texts = {t.get_text() for t in fig.legends[0].get_texts()}
    assert texts == {"GPU A", "GPU B"}
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels == ["add", "ceiling", "step"]  # "nothing" has neither a roof nor a speed-up
    path = plotstyle.save_svg(fig, tmp_path / "bars.svg")
    svg = path.read_text()
    assert svg.startswith("<?xml") and "<svg" in svg and "Date" not in svg
    assert results.draw_bars({}) is None
    recs = [rec(shape=(1,)), rec(gpu="GPU B", shape=(1,), ceiling_frac=0.4)]
    fig = results.draw_pairs(recs)
    ax = fig.axes[0]
    assert "GPU A" in ax.get_xlabel()
    assert any("GPU B (1 case)" in t.get_text() for t in ax.get_legend().get_texts())
    assert results.draw_pairs([rec()]) is None
    plotstyle.save_svg(fig, tmp_path / "pairs.svg")
