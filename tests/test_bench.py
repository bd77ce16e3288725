import json
import time

import pytest
import torch

from kernels import bench, device

FIELDS = [
    "bench", "variant", "shape", "dtype", "ms", "gbps", "tflops", "baseline", "baseline_ms",
    "speedup", "ceiling", "ceiling_frac", "gpu", "torch", "triton", "cuda", "date",
]  # fmt: skip


def test_measure_converts_to_rates():
    x = torch.randn(1 << 12)
    m = bench.measure(lambda: x * 2, bytes=8 * x.numel(), flops=x.numel())
    assert m.ms > 0 and m.p20_ms <= m.ms <= m.p80_ms
    assert m.gbps == pytest.approx(8 * x.numel() / (m.ms * 1e-3) / 1e9)
    assert m.tflops == pytest.approx(x.numel() / (m.ms * 1e-3) / 1e12)
    assert m.gpu_timing == device.GPU_MODE
    if not device.GPU_MODE:
        assert "not a GPU number" in str(m)


def test_record_schema_and_ratios():
    m = bench.Measurement(2.0, 1.9, 2.1, 1500.0, None, True)
    base = bench.Measurement(3.0, 2.9, 3.1, 1000.0, None, True)
    r = bench.record("op", "triton", (4, 5), torch.bfloat16, m, baseline=("torch", base),
                     ceiling=("copy", 3000.0))  # fmt: skip
    assert list(r) == FIELDS
    assert r["dtype"] == "bfloat16" and r["shape"] == [4, 5]
    assert r["speedup"] == 1.5 and r["ceiling_frac"] == 0.5
    json.dumps(r)


def test_compute_bound_record_uses_tflops_for_the_ceiling():
    m = bench.Measurement(1.0, 1.0, 1.0, None, 600.0, True)
    assert bench.record("mm", "x", (1,), "bfloat16", m, ceiling=("matmul", 800.0))[
        "ceiling_frac"
    ] == pytest.approx(0.75)


def test_append_and_load_roundtrip(tmp_path):
    m = bench.Measurement(1.0, 1.0, 1.0, 10.0, None, False)
    recs = [bench.record("a", "v", (1,), "float32", m)] * 2
    path = bench.append_records(recs, tmp_path / "x.jsonl")
    bench.append_records(recs, path)
    assert bench.load_records(path) == recs * 2
    assert "bench" in bench.format_table(recs)


def test_gpu_slug():
    assert device.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert device.gpu_slug("Tesla T4") == "tesla-t4"


def test_cli_lists_and_runs_without_writing_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "RESULTS_DIR", tmp_path)
    assert bench.main(["--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert {"vector_add", "ceilings"} <= set(listed)
    if device.GPU_MODE:
        pytest.skip("the full CLI run is exercised on GPU machines by make gpu-notebooks")
    assert bench.main(["--only", "vector_add"]) == 0
    out = capsys.readouterr().out
    assert "vector_add" in out and "not GPU numbers" in out
    assert list(tmp_path.iterdir()) == []


def test_cli_rejects_unknown_benchmark():
    with pytest.raises(SystemExit):
        bench.main(["--only", "nope"])


def test_committed_results_follow_the_schema():
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "results").glob("*.jsonl"))
    for f in files:
        for r in bench.load_records(f):
            if "error" in r:  # a case that raised (kernels/shapes.py): no timings, the message
                assert list(r) == FIELDS + ["error"] and r["ms"] is None and r["error"], f
                continue
            assert list(r) == FIELDS, f
            assert r["gpu"] and r["ms"] > 0, f


def test_module_entry_point_sees_the_registered_benchmarks():
    # `python -m kernels.bench` runs bench.py as __main__: the registry must still be the package's.
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "kernels.bench", "--list"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert {"vector_add", "ceilings"} <= set(out)


@pytest.mark.skipif(not device.GPU_MODE, reason="needs a GPU: CUDA events")
@pytest.mark.parametrize("flush_l2", [True, False])
def test_device_only_keeps_the_host_launch_cost_out(flush_l2):
    # Two ~3 µs kernels with 300 µs of host work between them: device_only times the kernels alone.
    # Without the flush, the default timing counts the GPU's wait for the second launch (with it, a
    # slow-memory GPU's 256 MB flush can outlast the host's 300 µs and hide it: no claim there).
    # The host work sits between launches, not before the first: on 4 x H200 (2026-11-27) the
    # driver submitted the start event only with the first kernel, so host time ahead of a call's
    # first launch never reached the events (4.8 µs measured), while on the H100 it did.
    x = torch.zeros(1024, device=device.DEVICE)

    def slow_host(wait_for_gpu):
        x.add_(1)
        if wait_for_gpu:
            # The start event and the first kernel reach the GPU before the host work begins. A
            # stream query was not enough: on one H100 host (2026-11-27, eighth session) the driver
            # still held the first launch back until the second, and the events saw 5.9 µs.
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 300e-6:
            pass
        x.add_(1)

    alone = bench.measure(lambda: slow_host(False), flush_l2=flush_l2, device_only=True, rep_ms=20)
    assert alone.ms < 0.05, alone
    if not flush_l2:
        with_host = bench.measure(lambda: slow_host(True), flush_l2=False, rep_ms=20)
        assert with_host.ms > 0.15, with_host


def test_host_launch_ms_times_back_to_back_calls():
    calls = []

    def fn():
        calls.append(1)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1e-4:  # 0.1 ms of host work per call
            pass

    ms = bench.host_launch_ms(fn, calls=5, rounds=2)
    assert len(calls) == 10
    assert 0.1 <= ms < 5.0
