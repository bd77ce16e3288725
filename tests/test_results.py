"""kernels.results: every GPU's records, the newest of each case, summarised per benchmark."""

import json

import pytest

from kernels import results


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
