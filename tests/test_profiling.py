import gzip
import json

import matplotlib
import pytest
import torch

from kernels import bench, device, fusion, models, profiling

matplotlib.use("Agg")
DEV = device.DEVICE


# --- interval arithmetic ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "intervals, merged",
    [
        ([], []),
        ([(0, 1)], [(0, 1)]),
        ([(3, 4), (0, 1)], [(0, 1), (3, 4)]),
        ([(0, 5), (1, 2)], [(0, 5)]),  # nested
        ([(0, 2), (1, 3), (3, 4)], [(0, 4)]),  # overlapping and touching
        ([(2, 2), (0, 1)], [(0, 1), (2, 2)]),  # zero length
    ],
)
def test_merge_intervals(intervals, merged):
    assert profiling.merge_intervals(intervals) == merged


def test_merge_intervals_rejects_reversed():
    with pytest.raises(ValueError, match="end >= start"):
        profiling.merge_intervals([(2, 1)])


def test_idle_gaps():
    occ = profiling.idle_gaps([(1, 3), (2, 4), (6, 7)], (0, 10))
    assert occ.busy_us == 4 and occ.window_us == 10 and occ.idle_us == 6
    assert occ.gaps == [(0, 1), (4, 6), (7, 10)]
    assert occ.busy_fraction == pytest.approx(0.4) and occ.largest_gap_us == 3


def test_idle_gaps_clips_to_window():
    occ = profiling.idle_gaps([(-5, 2), (8, 20), (30, 40)], (0, 10))
    assert occ.busy_us == 4 and occ.gaps == [(2, 8)]
    empty = profiling.idle_gaps([], (5, 9))
    assert empty.busy_fraction == 0 and empty.gaps == [(5, 9)]
    with pytest.raises(ValueError, match="window"):
        profiling.idle_gaps([], (9, 5))


# --- reading a trace ----------------------------------------------------------------------------


def _event(cat, name, ts, dur, **kw):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1, **kw}


SYNTHETIC = {
    "traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "python"}},
        _event("user_annotation", "profiler warm-up", 1000, 1),
        _event("cuda_runtime", "cudaLaunchKernel", 1001, 1),  # before the steps: not counted
        _event("user_annotation", "step 0", 1010, 40),
        _event("cpu_op", "aten::linear", 1012, 10),
        _event("cuda_runtime", "cudaLaunchKernel", 1014, 2),
        _event("cuda_driver", "cuLaunchKernelEx", 1020, 2),
        _event("cuda_runtime", "cudaDeviceSynchronize", 1030, 19),
        _event("kernel", "gemm", 1016, 10),
        _event("kernel", "triton_poi_fused", 1024, 6),
        _event("user_annotation", "step 1", 1050, 40),
        _event("cuda_runtime", "cudaGraphLaunch", 1052, 3),
        _event("gpu_memcpy", "Memcpy DtoD", 1060, 10),
        _event("gpu_user_annotation", "step 1", 1050, 40),  # GPU-side copy of the annotation
        {"ph": "s", "cat": "ac2g", "name": "flow", "ts": 1014, "id": 1, "pid": 1, "tid": 1},
    ]
}


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_load_trace(tmp_path, suffix):
    path = tmp_path / f"t{suffix}"
    text = json.dumps(SYNTHETIC)
    if suffix.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    tr = profiling.load_trace(path)
    assert tr.t0 == 1000
    assert tr.steps == [(10, 50), (50, 90)] and tr.window == (10, 90)
    assert tr.cpu_ops == [(12, 22)]
    assert tr.gpu == [(16, 26), (24, 30), (60, 70)]
    assert tr.gpu_names == ["gemm", "triton_poi_fused", "Memcpy DtoD"]
    assert len(tr.runtime) == len(tr.runtime_names) == 5
    # two launches in step 0, one graph launch in step 1; the one before the steps is not counted
    assert profiling.launches_per_step(tr) == 1.5
    occ = profiling.idle_gaps(tr.gpu, tr.window)
    assert occ.busy_us == 14 + 10 and occ.gaps == [(10, 16), (30, 60), (70, 90)]


def test_launches_per_step_needs_steps(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([_event("cpu_op", "aten::mm", 0, 5)]))  # a bare event list
    tr = profiling.load_trace(path)
    assert tr.window == (0, 5) and tr.steps == []
    with pytest.raises(ValueError, match="step"):
        profiling.launches_per_step(tr)


@pytest.mark.parametrize("with_gpu, rows", [(True, 3), (False, 1)])
def test_plot_timeline(tmp_path, with_gpu, rows):
    events = SYNTHETIC["traceEvents"]
    if not with_gpu:
        events = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation")]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    ax = profiling.plot_timeline(profiling.load_trace(path), title="x")
    assert [t.get_text() for t in ax.get_yticklabels()][-1] == "CPU ops"
    assert len(ax.get_yticks()) == rows
    assert ax.get_xlim() == (0, 0.08)  # the two steps, in ms


def _with_startup_stall():
    """SYNTHETIC with the profiler's start-up stall inside step 0, before the first kernel."""
    events = list(SYNTHETIC["traceEvents"])
    events.append(_event("overhead", "Activity Buffer Request", 1011, 4))
    return {"traceEvents": events}


def test_startup_stall_is_cut_from_the_window(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(_with_startup_stall()))
    tr = profiling.load_trace(path)
    assert tr.stalls == [(11, 15)]
    assert tr.startup_us == 5 and tr.steady_window == (15, 90) and tr.window == (10, 90)
    plain = profiling.load_trace(_write(tmp_path / "plain.json", SYNTHETIC))
    assert plain.startup_us == 0 and plain.steady_window == plain.window


def _write(path, data):
    path.write_text(json.dumps(data))
    return path


def test_plot_timeline_cuts_startup_and_zooms(tmp_path):
    tr = profiling.load_trace(_write(tmp_path / "t.json", _with_startup_stall()))
    ax = profiling.plot_timeline(tr)
    assert ax.get_xlim() == (0, 0.075)  # from the end of the stall (15 us) to the end (90 us)
    assert "start-up" in ax.get_xlabel()
    kept = profiling.plot_timeline(tr, cut_startup=False)
    assert kept.get_xlim() == (0, 0.08)
    zoom = profiling.plot_timeline(tr, zoom_ms=0.005)
    assert zoom.get_xlim() == (0, 0.005)
    # the first kernel starts 1 us after the cut: the zoom panel shows it (GPU row, busy 80%)
    texts = [t.get_text() for t in zoom.texts]
    assert "busy 80%" in texts, texts
    with pytest.raises(ValueError, match="zoom_ms"):
        profiling.plot_timeline(tr, zoom_ms=0)


# --- running the profiler -----------------------------------------------------------------------


def test_profile_table_and_trace(tmp_path):
    a = torch.randn(64, 64, device=DEV)
    calls = []

    def fn():
        calls.append(1)
        return a @ a

    res = profiling.profile(fn, steps=3, warmup=1, name="mm", keep_dir=tmp_path)
    assert len(calls) == 4
    assert "aten::mm" in res.table and profiling.WARMUP_NAME not in res.table
    # Kept in keep_dir on a GPU only: a CPU run's trace must not replace a committed GPU trace.
    assert res.kept == device.GPU_MODE
    assert (res.trace_path == tmp_path / "mm.json.gz") == device.GPU_MODE
    assert bool(list(tmp_path.iterdir())) == device.GPU_MODE
    tr = profiling.load_trace(res.trace_path)
    assert len(tr.steps) == 3
    assert sum(1 for s, _ in tr.cpu_ops if tr.window[0] <= s <= tr.window[1]) >= 3
    if device.GPU_MODE:
        assert tr.gpu, "no kernels recorded in GPU mode"


def test_profile_keeps_big_traces_out_of_the_repository(tmp_path):
    res = profiling.profile(lambda: torch.ones(3) * 2, steps=1, keep_dir=tmp_path, max_bytes=10)
    assert not res.kept and res.trace_path.parent != tmp_path and res.trace_path.exists()
    assert not list(tmp_path.iterdir())


def test_profile_layer():
    block = models.MLPBlock(32, device=DEV)
    x = torch.randn(4, 32, device=DEV)
    res = profiling.profile_layer(block, x, steps=2)
    assert "aten::linear" in res.table and res.trace_path.name == "mlpblock.json.gz"
    res2 = profiling.profile_layer(lambda a, b: a + b, [x, x], steps=1, name="add")
    assert "aten::add" in res2.table


@pytest.mark.parametrize(
    "call, err, match",
    [
        (lambda: profiling.profile(lambda: None, steps=0), ValueError, "steps"),
        (lambda: profiling.profile(lambda: None, warmup=-1), ValueError, "warmup"),
        (lambda: profiling.profile_layer("layer", torch.zeros(1)), TypeError, "module"),
        (lambda: profiling.profile_layer(abs, [torch.zeros(1), 3]), TypeError, "inputs"),
        (lambda: profiling.profile_layer(abs, []), TypeError, "inputs"),
        (lambda: profiling.ncu_command("a.py", ""), ValueError, "kernel_regex"),
    ],
)
def test_bad_arguments(call, err, match):
    with pytest.raises(err, match=match):
        call()


def test_ncu_command():
    cmd = profiling.ncu_command("scripts/layer.py", "gemm|gelu", count=2)
    assert cmd.startswith("ncu --set full ")
    assert "--kernel-name regex:'gemm|gelu'" in cmd and "--launch-count 2" in cmd
    assert cmd.endswith("-o layer-ncu python scripts/layer.py")


def test_wall_time():
    out, secs = profiling.wall_time(lambda: 41 + 1)
    assert out == 42 and 0 <= secs < 1


# --- generated code -----------------------------------------------------------------------------

TRITON_MODULE = """
# kernel path: /tmp/x.py
triton_poi_fused_add_0 = async_compile.triton('triton_poi_fused_add_0', '''
import triton

@triton.jit
def triton_poi_fused_add_0(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    pass
''', device_str='cuda')


cpp_fused_mul_1 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
extern "C" void kernel(const float* in_ptr0, float* out_ptr0) {}
''')

async_compile.wait(globals())
"""


def test_generated_kernels_parses_both_backends():
    found = profiling.generated_kernels(TRITON_MODULE)
    assert list(found) == ["triton_poi_fused_add_0", "cpp_fused_mul_1"]
    assert found["triton_poi_fused_add_0"].startswith("import triton")
    assert "@triton.jit" in found["triton_poi_fused_add_0"]
    assert found["cpp_fused_mul_1"].startswith('extern "C" void kernel')
    assert profiling.generated_kernels("x = 1") == {}


# --- the fusion chain ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (5, 123), (1823, 781)])
@pytest.mark.parametrize(
    "dtype, rtol, atol",
    [(torch.float32, 1e-5, 1e-5), (torch.float16, 2e-3, 2e-3), (torch.bfloat16, 2e-2, 2e-2)],
)
def test_gelu_chain_matches_reference(shape, dtype, rtol, atol):
    x, w, b = fusion.make_inputs(*shape, dtype=dtype)
    out = fusion.gelu_chain(x, w, b)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, fusion.gelu_chain_ref(x, w, b), rtol=rtol, atol=atol)


def test_compiled_chain_is_one_kernel():
    from torch._inductor.utils import run_and_get_code

    x, w, b = fusion.make_inputs(8, 48, dtype=torch.float32)
    fn = torch.compile(fusion.gelu_chain)
    out, codes = run_and_get_code(fn, x, w, b)
    torch.testing.assert_close(out, fusion.gelu_chain_ref(x, w, b), rtol=1e-5, atol=1e-5)
    kernels = {k for code in codes for k in profiling.generated_kernels(code)}
    assert len(kernels) == 1, kernels


def test_chain_bytes():
    assert sum(r + w for _, r, w in fusion.CHAIN_OPS) == 14
    assert fusion.eager_bytes(100, 2) == 14 * 100 * 2
    assert fusion.fused_bytes(100, 2) == 2 * 100 * 2


@pytest.mark.parametrize(
    "x, w, b, err, match",
    [
        (torch.zeros(4, 8), torch.zeros(7), torch.zeros(7), ValueError, "w must have"),
        (torch.zeros(8), torch.zeros(8), torch.zeros(8), ValueError, "x must be 2-D"),
        (torch.zeros(4, 8), torch.zeros(8), torch.zeros(4), ValueError, "same shape"),
        (torch.zeros(4, 8), torch.zeros(8).half(), torch.zeros(8).half(), TypeError, "same dtype"),
        (torch.zeros(4, 8, dtype=torch.int32), torch.zeros(8), torch.zeros(8), TypeError, "x must"),
        (torch.zeros(8, 4).t(), torch.zeros(8), torch.zeros(8), ValueError, "contiguous"),
    ],
)
def test_gelu_chain_rejects_bad_input(x, w, b, err, match):
    with pytest.raises(err, match=match):
        fusion.gelu_chain(x, w, b)


def test_fusion_benchmark_is_registered():
    assert "kernels.fusion" in bench.BENCH_MODULES
    assert "fusion" in bench.BENCHMARKS


def test_profile_silences_only_the_cycle_false_alarm(recwarn):
    import warnings

    profiling.profile(lambda: torch.ones(3) * 2, steps=1)
    assert not [w for w in recwarn if "clears events" in str(w.message)]
    # the filter is scoped to the profiler session: the same message raised outside still shows
    with pytest.warns(UserWarning, match="clears events"):
        warnings.warn("Profiler clears events at the end of each cycle.", UserWarning, stacklevel=1)
