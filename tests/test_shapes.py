"""The shapes sweep (kernels/shapes.py) end to end on its quick subset: every op, well-formed
records, ratios that follow from the timings, and failures recorded instead of raised."""

import re
import time

import pytest
import torch

from kernels import bench, device, shapes

FIELDS = [
    "bench", "variant", "shape", "dtype", "ms", "gbps", "tflops", "baseline", "baseline_ms",
    "speedup", "ceiling", "ceiling_frac", "gpu", "torch", "triton", "cuda", "date",
]  # fmt: skip
# Every public kernel the sweep must cover, and the ones this package's row-wise code owns (these
# must never produce an error row).
OPS = {
    "add", "softmax_fwd", "softmax_bwd", "rms_norm_fwd", "rms_norm_bwd", "layer_norm_fwd",
    "layer_norm_bwd", "matmul", "attention_fwd", "attention_bwd", "attention_causal_fwd",
    "attention_causal_bwd", "paged_decode", "gemv_int4", "gemv_int8", "fused_mlp_stack",
}  # fmt: skip
ROW_OPS = {"add", "softmax_fwd", "softmax_bwd", "rms_norm_fwd", "rms_norm_bwd"}
ROW_OPS |= {"layer_norm_fwd", "layer_norm_bwd"}


@pytest.fixture(scope="module")
def records():
    return shapes.run(quick=True)


def _op(rec):
    return rec["bench"].split("/", 1)[1]


def test_every_op_has_a_case_and_a_record(records):
    assert {c.op for c in shapes.cases(quick=True)} == OPS
    assert {c.op for c in shapes.cases(quick=False)} == OPS
    # A host-time record for every op but the causal attention (host_cases).
    host = {f"{op}/host" for op in OPS if not op.startswith("attention_causal")}
    assert {_op(r) for r in records} == OPS | host


def test_records_are_well_formed(records):
    for r in records:
        if "error" in r:
            assert list(r) == FIELDS + ["error"] and r["ms"] is None and r["error"]
            continue
        # A case that tunes itself (matmul) also names the configuration it ran, a host case its
        # time until issued, and on a GPU a case slower than its baseline carries its three
        # timings, a large one its device time.
        extra = ["config"] if r["bench"] == "shapes/matmul" else []
        extra += ["issued"] if r["bench"].endswith("/host") else []
        extra += [k for k in ("retimed", "device") if k in r]
        assert list(r) == FIELDS + extra, r
        assert r["bench"].startswith("shapes/") and r["variant"] == "triton"
        assert (
            r["ms"] > 0 and r["baseline_ms"] > 0 and r["baseline"].startswith(("torch", "s", "m"))
        )
        assert r["speedup"] == pytest.approx(r["baseline_ms"] / r["ms"], rel=1e-2, abs=1e-3)
        if r["bench"].endswith("/host"):
            assert r["ceiling"] is None and r["shape"][0] in (1, 1000)
        else:
            assert r["ceiling"] == "copy" or r["ceiling"].startswith("matmul_")
            assert 0 < r["ceiling_frac"] < 1.5, r


def test_row_ops_never_error(records):
    errors = [r for r in records if "error" in r and _op(r).split("/")[0] in ROW_OPS]
    assert errors == []


def test_full_sweep_covers_the_shapes_models_use():
    full = shapes.cases(quick=False)
    rows = {c.shape[0] for c in full if c.op == "rms_norm_bwd"}
    assert rows == set(shapes.ROWS)
    assert {c.shape[1] for c in full if c.op == "softmax_fwd"} == {1024, 4096, 8192, 65536}
    assert {c.dtype for c in full if c.op == "layer_norm_fwd"} == set(shapes.DTYPES)
    mm = {tuple(c.shape) for c in full if c.op == "matmul"}
    assert (4000, 3000, 5000) in mm and (1000, 4096, 11008) in mm and (1, 8192, 28672) in mm
    for c in full:
        if c.op in ROW_OPS - {"add"}:  # no tensor above the cap
            assert c.shape[0] * c.shape[1] * c.dtype.itemsize <= shapes.MAX_TENSOR_BYTES


def test_a_raising_case_becomes_an_error_row():
    def setup():
        raise RuntimeError("kernel exploded\nsecond line")

    case = shapes.Case("boom", [3, 4], torch.float16, "torch.boom", setup, bytes=1)
    rec = shapes.run_case(case, roofs=None)
    assert rec["bench"] == "shapes/boom" and rec["ms"] is None
    assert rec["error"] == "RuntimeError: kernel exploded"
    assert list(rec) == FIELDS + ["error"]


def test_a_large_memory_bound_case_is_also_timed_on_the_device_alone(monkeypatch):
    monkeypatch.setattr(shapes, "_device_above", lambda: 1000)  # as on a GPU, at 1,000 bytes

    def setup():
        return (lambda: time.sleep(0.001)), (lambda: None)

    class CopyRoof:
        asked = []

        def __call__(self, case):
            return ("copy", 1.0)  # 1 GB/s

        def same_size_copy(self, nbytes):
            self.asked.append(nbytes)
            return 0.5  # a copy as large as the case: 0.5 GB/s

    copy_roof = CopyRoof()
    big = shapes.Case("big", [3, 4], torch.float32, "torch.big", setup, bytes=2000)
    rec = shapes.run_case(big, roofs=copy_roof)
    alone = rec["device"]
    assert set(alone) == {"ms", "frac", "same_size_copy_frac"} and alone["ms"] > 0
    # The case's 2,000 bytes over the device-alone time, as a fraction of the 1 GB/s roof, and of
    # the 0.5 GB/s of a 2,000-byte copy.
    gbps = 2000 / (alone["ms"] * 1e-3) / 1e9
    assert alone["frac"] == pytest.approx(gbps, rel=1e-3)
    assert alone["same_size_copy_frac"] == pytest.approx(gbps / 0.5, rel=1e-3)
    assert copy_roof.asked == [2000]
    assert list(shapes._common(rec)) == FIELDS  # the results files get the common fields only
    # Small, or not memory-bound: no device-alone timing.
    small = shapes.Case("small", [3], torch.float32, "torch.small", setup, bytes=1000)
    assert "device" not in shapes.run_case(small, roofs=copy_roof)
    mm = shapes.Case("mm", [3], torch.float32, "b", setup, flops=10**6, roof="matmul")
    assert "device" not in shapes.run_case(mm, roofs=lambda case: ("matmul_float32", 1.0))


def test_a_slow_case_is_timed_again(monkeypatch):
    monkeypatch.setattr(shapes, "_retime_below", lambda: shapes.RETIME_BELOW)  # as on a GPU

    def ours():
        time.sleep(0.002)  # what the host's clock sees
        if device.GPU_MODE:
            # CUDA events time the device: around a host sleep alone they can read ~0 when another
            # process's work holds the GPU (0.001 ms once, in `make gpu-test`'s 8 workers). A spin
            # of 4e6 cycles takes 2 ms or more at any clock up to 2 GHz.
            torch.cuda._sleep(4_000_000)

    def setup():
        return ours, lambda: None

    def no_roof(case):
        return None

    case = shapes.Case("slow", [3, 4], torch.float32, "torch.fast", setup, bytes=1)
    rec = shapes.run_case(case, roofs=no_roof)
    assert rec["speedup"] < shapes.RETIME_BELOW, rec
    assert set(rec["retimed"]) == {"ms", "baseline_ms"}
    assert len(rec["retimed"]["ms"]) == shapes.RETIMES and min(rec["retimed"]["ms"]) > 1.0
    # Ours far faster than the baseline: never timed again (two no-ops could time either way).
    fast = shapes.Case("fast", [3], torch.float32, "b", lambda: (lambda: None, ours))
    assert "retimed" not in shapes.run_case(fast, roofs=no_roof)
    # The results files get the common fields only.
    assert list(shapes._common({**rec, "config": "TMA"})) == FIELDS


def test_a_one_off_slow_timing_is_outvoted(monkeypatch):
    """The record is the median of three timings a side: one slow timing of ours (the first here)
    does not make the case slow, while a kernel slow every time stays slow."""
    monkeypatch.setattr(shapes, "_retime_below", lambda: shapes.RETIME_BELOW)

    def scripted(times):
        it = iter(times)

        def measure(fn, **kw):
            ms = next(it)
            return bench.Measurement(ms, ms, ms, None, None, True)

        return measure

    def ours():
        pass

    def theirs():
        pass

    case = shapes.Case("op", [3], torch.float32, "torch.op", lambda: (ours, theirs), bytes=1)
    # ours, theirs, ours, theirs, ...: a 10 ms outlier first, then ours at 1.0 ms against 1.1.
    monkeypatch.setattr(bench, "measure", scripted([10.0, 1.1, 1.0, 1.1, 1.0, 1.1]))
    rec = shapes.run_case(case, roofs=lambda c: None)
    assert rec["ms"] == 1.0 and rec["baseline_ms"] == 1.1 and rec["speedup"] == 1.1
    assert rec["retimed"] == {"ms": [10.0, 1.0, 1.0], "baseline_ms": [1.1, 1.1, 1.1]}
    # Slow every time: recorded slow.
    monkeypatch.setattr(bench, "measure", scripted([2.0, 1.0, 2.2, 1.0, 1.9, 1.0]))
    rec = shapes.run_case(case, roofs=lambda c: None)
    assert rec["ms"] == 2.0 and rec["speedup"] == 0.5
    # At or above the baseline's speed: timed once.
    monkeypatch.setattr(bench, "measure", scripted([1.0, 1.0]))
    assert "retimed" not in shapes.run_case(case, roofs=lambda c: None)


def test_every_host_case_is_timed_three_times(monkeypatch):
    """Host-time cases are timed three times a side, slow or fast: the 12-07 sweep recorded the
    attention backward's host cost once, at 117 µs against SDPA's 90 (three rounds the same day:
    78-86 against 86-103), and SDPA's forward at 26.5 µs (14.6-14.9)."""
    monkeypatch.setattr(shapes, "_retime_below", lambda: shapes.RETIME_BELOW)

    def ours():
        pass

    def theirs():
        pass

    def scripted(times):
        """host_time with each side's timings in turn (each side keyed by its callable)."""
        its = {fn: iter(ms) for fn, ms in times.items()}

        def host_time(fn):
            ms = next(its[fn])
            return bench.Measurement(ms, ms, ms, None, None, True)

        return host_time

    case = shapes.Case("op", [3], torch.float32, "torch.op", lambda: (ours, theirs))
    monkeypatch.setattr(shapes, "host_cases", lambda quick: [case])
    # One slow timing of ours first, then ours below the baseline.
    slow = {ours: [0.117, 0.080, 0.085], theirs: [0.090, 0.095, 0.100]}
    monkeypatch.setattr(shapes, "host_time", scripted(slow))
    (rec,) = shapes.host_records(True)
    assert rec["bench"] == "shapes/op/host"
    assert rec["ms"] == 0.085 and rec["baseline_ms"] == 0.095
    assert rec["retimed"] == {"ms": slow[ours], "baseline_ms": slow[theirs]}
    assert "timed 3 times" in shapes._retimed_note(rec)
    # Faster than the baseline: timed three times too (a slow baseline timing would flatter ours).
    fast = {ours: [0.010, 0.011, 0.012], theirs: [0.040, 0.020, 0.021]}
    monkeypatch.setattr(shapes, "host_time", scripted(fast))
    (rec,) = shapes.host_records(True)
    assert rec["ms"] == 0.011 and rec["baseline_ms"] == 0.021 and rec["speedup"] < 2
    # Off a GPU (the interpreter's every case is slow): timed once.
    monkeypatch.setattr(shapes, "_retime_below", lambda: None)
    monkeypatch.setattr(shapes, "host_time", scripted(slow))
    (rec,) = shapes.host_records(True)
    assert "retimed" not in rec and shapes._retimed_note(rec) == ""


def test_issue_time_does_not_wait_for_the_gpu(monkeypatch):
    """``issue_time`` times issuing the calls, not waiting for the GPU: a synchronize that waits
    20 ms counts in ``host_loops`` and not in it, though it still synchronizes before each loop
    (each starts with the launch queue empty)."""
    syncs = []
    monkeypatch.setattr(device, "GPU_MODE", True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(1) or time.sleep(0.02))
    waited = shapes.host_loops(lambda: None, calls=10, loops=2)
    assert min(waited) >= 1.9, waited
    syncs.clear()
    assert shapes.issue_time(lambda: None, calls=10) < 0.5
    assert len(syncs) == 5 + 1  # before each of its 5 loops, and once after


def test_the_bench_cli_gets_the_common_fields_only(monkeypatch):
    """``python -m kernels.bench --only shapes`` appends what ``_bench_shapes`` returns: the
    results files' fields, without the log's extras."""
    rec = {f: None for f in FIELDS} | {"config": "TMA", "retimed": {}, "device": {}, "issued": {}}
    monkeypatch.setattr(shapes, "run", lambda quick, **kw: [rec])
    assert [list(r) for r in shapes._bench_shapes(True)] == [FIELDS]


def test_registered_in_the_bench_cli():
    import importlib

    for mod in bench.BENCH_MODULES:
        importlib.import_module(mod)
    assert bench.BENCHMARKS["shapes"] is shapes._bench_shapes


def test_slowest_is_the_lowest_speedup():
    recs = [{"speedup": 2.0}, {"speedup": 0.5, "bench": "x"}, {"speedup": None, "error": "e"}]
    assert shapes.slowest(recs) == recs[1]


def test_matmul_records_name_the_configuration_they_ran(records):
    mm = [r for r in records if r["bench"] == "shapes/matmul" and "error" not in r]
    assert mm and all(r["config"].startswith(("TMA", "plain")) for r in mm), mm


def test_the_log_prints_host_records_too(capsys):
    """The printed log carries the host-time rows (a run whose results file is lost keeps them)."""
    recs = shapes.run(True, {"add"}, progress=True)
    out = capsys.readouterr().out
    host = [r for r in recs if r["bench"] == "shapes/add/host"]
    assert host and "shapes/add/host" in out and "host µs a call" in out
    assert all(set(r["issued"]) == {"ms", "baseline_ms"} for r in host) and "until issued" in out
    assert out.count("\n") >= len(recs)
    timed = [line for line in out.splitlines() if line.startswith("shapes/add ")]
    assert timed and all(re.search(r"  \(\d+\.\d s\)", line) for line in timed), timed


def test_dtype_filter_applies_to_host_records(monkeypatch):
    """A sweep split by dtype over two calls times each host case once, in the call of its dtype."""
    timed = []
    monkeypatch.setattr(
        shapes,
        "host_time",
        lambda fn: timed.append(fn) or bench.Measurement(1e-3, 1e-3, 1e-3, None, None, False),
    )
    monkeypatch.setattr(shapes, "cases", lambda quick: [])
    host = [c for c in shapes.host_cases(True) if c.op == "add"]
    dtype = str(host[0].dtype).replace("torch.", "")
    other = ({"float16", "bfloat16", "float32"} - {dtype}).pop()
    assert shapes.run(True, {"add"}, dtypes={other}) == [] and not timed
    recs = shapes.run(True, {"add"}, dtypes={dtype})
    # On a GPU every host case is timed RETIMES times on each side (_timed_pair's ``always``).
    timings = shapes.RETIMES if shapes._retime_below() is not None else 1
    assert [r["bench"] for r in recs] == ["shapes/add/host"] * len(host)
    assert len(timed) == 2 * timings * len(host)


def test_resume_skips_what_the_file_has_today_and_retries_errors(tmp_path, monkeypatch):
    """A sweep cut short is finished by ``--resume``: the cases with a timed record dated today
    are skipped (host-time records included); yesterday's records and error rows are not."""
    monkeypatch.setattr(
        shapes, "host_time", lambda fn: bench.Measurement(1e-3, 1e-3, 1e-3, None, None, False)
    )
    first = shapes.run(True, {"add"})
    host, timed = first[0], first[1]
    assert host["bench"] == "shapes/add/host" and timed["bench"] == "shapes/add"
    key = {r["bench"]: shapes.case_key(r["bench"], r["shape"], r["dtype"]) for r in first}
    today = host["date"]

    path = tmp_path / "sweep.jsonl"
    failed = dict(timed, ms=None, speedup=None, error="RuntimeError: out of memory")
    bench.append_records([host, failed], path)
    assert shapes.recorded_today(path, today) == {key["shapes/add/host"]}
    again = shapes.run(True, {"add"}, done=shapes.recorded_today(path, today))
    assert [r["bench"] for r in again] == ["shapes/add"]  # the host case skipped, the error retried

    old = tmp_path / "old.jsonl"
    bench.append_records([dict(r, date="2000-01-01") for r in first], old)
    assert shapes.recorded_today(old, today) == set()
    assert shapes.recorded_today(tmp_path / "missing.jsonl") == set()
    both = shapes.recorded_today(path, today) | {key["shapes/add"]}
    assert shapes.run(True, {"add"}, done=both) == []


def test_resume_on_the_command_line(tmp_path, capsys):
    """``--resume`` reads the output file it will append to and says how much it skips."""
    path = tmp_path / "sweep.jsonl"
    recs = shapes.run(True, {"add"})
    bench.append_records(recs, path)
    assert shapes.main(["--ops", "add", "--resume", "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"resume: {len(recs)} cases already recorded today" in out


def test_same_size_copy_is_measured_once_per_size(monkeypatch):
    calls = []
    real = shapes.bench.measure

    def measure(fn, **kw):
        calls.append(kw.get("bytes"))
        return real(fn, **kw)

    shapes.roofline.copy_bandwidth.cache_clear()  # no size measured by an earlier test
    roofs = shapes.Roofs()
    monkeypatch.setattr(shapes.bench, "measure", measure)
    first = roofs.same_size_copy(8000)
    assert first > 0 and roofs.same_size_copy(8000) == first
    roofs.same_size_copy(16000)
    assert calls == [8000, 16000]  # a copy of 1,000 fp32 values each way, then of 2,000


@pytest.mark.skipif(not device.GPU_MODE, reason="the fast launch runs on a GPU only")
def test_host_cases_launch_through_the_fast_path_after_their_first_call(monkeypatch):
    """Every op at a decode step's size (``host_cases``) launches its Triton kernels through
    kernels.launch's cached binaries once a call has been seen: none of the later calls goes back
    through Triton's binding or the autotuner (``_first``), which would cost tens of µs of host
    time a call (a refused fast launch, say, that falls back every time)."""
    from kernels import launch

    slow = []
    for cls in (launch.Launcher, launch.TunedLauncher):
        first = cls._first

        def counted(self, *args, _first=first, **kwargs):
            slow.append(getattr(self.fn, "__name__", type(self.fn).__name__))
            return _first(self, *args, **kwargs)

        monkeypatch.setattr(cls, "_first", counted)
    for case in shapes.host_cases(quick=False):
        ours = case.setup()[0]
        ours(), ours()  # compiles, tunes and caches
        slow.clear()
        for _ in range(3):
            ours()
        torch.cuda.synchronize()
        assert not slow, f"{case.op} {case.shape}: later calls went through Triton: {slow}"


def _rec(bench_name, shape, speedup=1.0, ms=1e-3, **kw):
    rec = dict.fromkeys(FIELDS) | {"bench": bench_name, "variant": "triton", "shape": shape}
    rec |= {"dtype": "bfloat16", "ms": ms, "baseline_ms": ms * speedup, "speedup": speedup}
    return rec | {"date": "2026-12-07"} | kw


def test_goals_names_every_miss_of_the_latest_sweep(tmp_path, capsys):
    """``--report`` reads the latest date, one record per case (the later wins), and names the
    cases below 0.9x, the large memory-bound ones below 0.9 of copy, the host rows more than 2 µs
    above PyTorch's and the errors; small or compute-bound cases have no copy goal."""
    mib = 2**20
    big = dict(ceiling="copy", ceiling_frac=0.8, gbps=64 * mib / 1e-3 / 1e9)  # 64 MiB in 1 ms
    recs = [
        _rec("shapes/softmax_fwd", [1, 8], speedup=0.5, date="2026-12-06"),  # an older sweep
        _rec("shapes/softmax_fwd", [1, 8], speedup=0.8),
        _rec("shapes/softmax_fwd", [2, 8], speedup=0.7),
        _rec("shapes/softmax_fwd", [2, 8], speedup=1.2),  # timed again that day: this one counts
        _rec("shapes/rms_norm_fwd", [4096, 8192], speedup=1.5, ms=1.0, **big),
        _rec("shapes/rms_norm_fwd", [64, 8192], speedup=1.5, ms=1.0, **big | {"gbps": 1.0}),
        _rec("shapes/matmul", [8, 8, 8], speedup=1.1, ceiling="matmul_bfloat16", ceiling_frac=0.2),
        _rec("shapes/add/host", [4096], ms=10e-3, baseline_ms=7e-3, speedup=0.7),
        _rec("shapes/softmax_fwd/host", [1, 4096], ms=8e-3, baseline_ms=7e-3, speedup=0.875),
        dict(_rec("shapes/add", [3]), ms=None, speedup=None, error="RuntimeError: boom"),
    ]
    date, latest = shapes.latest_sweep(recs)
    assert date == "2026-12-07" and len(latest) == 8
    miss = shapes.goals(latest)
    assert [(r["shape"], r["speedup"]) for r in miss["speedup"]] == [([1, 8], 0.8)]
    assert [r["shape"] for r in miss["copy"]] == [[4096, 8192]]
    assert [r["bench"] for r in miss["host"]] == ["shapes/add/host"]
    assert [r["error"] for r in miss["error"]] == ["RuntimeError: boom"]
    path = tmp_path / "gpu.jsonl"
    bench.append_records(recs, path)
    text = shapes.report(path)
    assert "sweep of 2026-12-07: 8 records, 5 timed, 2 host rows" in text
    assert "below 0.9x PyTorch: 1 of 5" in text and "below 0.9 of copy: 1" in text
    assert "2.0 µs above PyTorch's: 1 of 2" in text and "errors: 1" in text
    assert shapes.report(tmp_path / "none.jsonl").startswith("no shapes records")
    capsys.readouterr()
    assert shapes.main(["--report", str(path)]) == 0  # times nothing
    assert capsys.readouterr().out.strip() == text
