"""The Act 4 notebook helpers: tile arithmetic read from the .cu launchers, occupancy against
Nsight Compute's own figures, the cuobjdump and ncu parsers on real output, and the plots."""

import matplotlib
import pytest

import kernels.cuda as ladder
from kernels import ladder_plots as lp

matplotlib.use("Agg")


# --- tile arithmetic ----------------------------------------------------------------------------


def test_untiled_and_tiled_intensities():
    # Steps 1-2: one float of A and one of B per FMA; step 3: 32x32 tiles, 32*32/(2*64) = 8.
    assert lp.tiling(1).global_intensity == lp.tiling(2).global_intensity == 0.25
    assert lp.tiling(1).smem_intensity is None and lp.tiling(1).smem_bytes == 0
    t3 = lp.tiling(3)
    assert (t3.BM, t3.BN, t3.BK, t3.threads) == (32, 32, 32, 1024)
    assert t3.global_intensity == 8 and t3.smem_intensity == 0.25 and t3.smem_bytes == 8192


def test_tilings_follow_the_launchers():
    t4, t5, t6 = lp.tiling(4), lp.tiling(5), lp.tiling(6)
    assert (t4.BM, t4.BN, t4.BK, t4.TM, t4.threads) == (64, 64, 8, 8, 512)
    assert t4.global_intensity == 16 and t4.smem_intensity == pytest.approx(16 / 36)
    assert (t5.BM, t5.BN, t5.TM, t5.TN, t5.threads) == (128, 128, 8, 8, 256)
    assert t5.outputs_per_thread == 64 and t5.smem_intensity == 2.0
    # Steps 5 and 6 share a shape; the step-6 launcher's template arguments say so.
    assert t6.template == (t6.BM, t6.BN, t6.BK, t6.TM, t6.TN) == (128, 128, 8, 8, 8)
    assert ladder.STEPS[5].tile == (t5.BM, t5.BN, t5.BK) and ladder.STEPS[6].tile == (128, 128, 8)


@pytest.mark.parametrize("step", [7, 8])
def test_searched_steps_cover_their_whole_space(step):
    for config in ladder.SEARCH_SPACES[step]:
        t = lp.tiling(step, config)
        assert 64 <= t.threads <= 1024 and t.smem_bytes <= 48 * 1024
        assert t.outputs_per_thread * t.threads == t.BM * t.BN  # every output owned exactly once
    default = lp.tiling(step)
    assert default.template[:3] == ladder.SEARCH_SPACES[step][ladder.tuned_config(step)][:3]


def test_warptile_arithmetic():
    t = lp.warptile((128, 128, 16, 64, 64, 4, 8, 4, 1))
    # 4 warps of 64x64; each lane owns 1 x 4 sub-tiles of 8 x 4 outputs = 128 outputs.
    assert (t.threads, t.WMITER, t.WNITER, t.outputs_per_thread, t.stages) == (128, 1, 4, 128, 2)
    assert t.template == (128, 128, 16, 64, 64, 4, 8, 4, 128, 1)
    assert t.smem_bytes == 2 * (128 + 128) * 16 * 4
    assert t.smem_intensity == pytest.approx(2 * 8 * 16 / (4 * 24))


def test_tiling_rejects_bad_step():
    with pytest.raises(ValueError, match="step"):
        lp.tiling(9)


# --- occupancy ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "regs, threads, smem, blocks, frac, limiter",
    # Nsight Compute's theoretical occupancy for the ladder's kernels on an H100 (probe run):
    [
        (32, 1024, 0, 2, 1.0, "threads"),  # steps 1-2: 100 %
        (40, 512, 4096, 3, 0.75, "registers"),  # step 4: 75 %
        (130, 256, 8192, 1, 0.125, "registers"),  # step 5: 12.5 %
        (109, 256, 8192, 2, 0.25, "registers"),  # step 6: 25 %
        (217, 128, 32768, 2, 0.125, "registers"),  # step 8: 12.5 %
        (32, 64, 100 * 1024, 2, 0.0625, "shared memory"),
        (16, 32, 0, 32, 0.5, "blocks"),
    ],
)
def test_theoretical_occupancy(regs, threads, smem, blocks, frac, limiter):
    assert lp.theoretical_occupancy(regs, threads, smem) == (blocks, frac, limiter)


def test_occupancy_rejects_bad_input():
    with pytest.raises(ValueError, match="regs_per_thread"):
        lp.theoretical_occupancy(0, 128, 0)
    with pytest.raises(ValueError, match="threads_per_block"):
        lp.theoretical_occupancy(32, 1.5, 0)
    with pytest.raises(ValueError, match="smem_per_block"):
        lp.theoretical_occupancy(32, 128, -1)


RES_USAGE = """
Fatbin elf code:
================
arch = sm_90a
Resource usage:
 Common:
  GLOBAL:28 CONSTANT[4]:224
 Function _Z22sgemm_vectorize_kernelILi128ELi128ELi8ELi8ELi8EEviiiPKfS1_Pf:
  REG:109 STACK:0 SHARED:9216 LOCAL:0 CONSTANT[0]:568 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _Z22sgemm_vectorize_kernelILi64ELi64ELi8ELi8ELi8EEviiiPKfS1_Pf:
  REG:90 STACK:0 SHARED:5120 LOCAL:0 CONSTANT[0]:568 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _Z21sgemm_warptile_kernelILi128ELi128ELi16ELi64ELi64ELi4ELi8ELi4ELi128ELb1EEviiiPKfS1_Pf:
  REG:217 STACK:0 SHARED:33792 LOCAL:0 CONSTANT[0]:568 TEXTURE:0 SURFACE:0 SAMPLER:0
 Function _Z18sgemm_naive_kerneliiiPKfS0_Pf:
  REG:32 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:568 TEXTURE:0 SURFACE:0 SAMPLER:0
"""


def test_resource_usage_parser_and_step_lookup():
    usage = lp.parse_resource_usage(RES_USAGE)
    assert len(usage) == 4
    assert usage["_Z18sgemm_naive_kerneliiiPKfS0_Pf"] == {
        "reg": 32,
        "stack": 0,
        "shared": 0,
        "local": 0,
    }
    assert lp.step_resources(usage, 1, lp.tiling(1))["reg"] == 32
    assert lp.step_resources(usage, 6, lp.tiling(6))["reg"] == 109  # not the 64x64 instantiation
    t8 = lp.warptile((128, 128, 16, 64, 64, 4, 8, 4, 1))
    assert lp.step_resources(usage, 8, t8)["reg"] == 217
    assert lp.step_resources(usage, 8, lp.warptile((128, 128, 16, 64, 64, 4, 8, 4, 0))) is None
    assert lp.step_resources(usage, 5, lp.tiling(5)) is None  # absent


def test_template_args():
    assert lp.template_args("_Z3fooILi8ELi16ELb1EEvv") == (8, 16, 1)
    assert lp.template_args("_Z18sgemm_naive_kerneliiiPKfS0_Pf") == ()


# --- Nsight Compute -----------------------------------------------------------------------------

_HEAD = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
    '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
)


def _row(kid, kernel, metric, unit, value):
    cells = [kid, "614", "python3.12", "127.0.0.1", kernel, "1", "7", "(32, 32, 1)"]
    cells += ["(128, 128, 1)", "0", "9.0", "Command line profiler metrics", metric, unit, value]
    return ",".join(f'"{c}"' for c in cells)


NCU_CSV = "\n".join(
    [
        "==PROF== Connected to process 614 (/usr/bin/python3.12)",
        _HEAD,
        _row("0", "sgemm_naive_kernel(int)", "dram__bytes_read.sum", "byte", "8,453,808,640"),
        _row("0", "sgemm_naive_kernel(int)", "gpu__time_duration.sum", "ns", "275,847,808"),
        _row(
            "0", "sgemm_naive_kernel(int)", "launch__registers_per_thread", "register/thread", "32"
        ),
        _row("0", "sgemm_naive_kernel(int)", "some__other_metric.sum", "", "7"),
        _row("1", "sm80_xmma_gemm_f32f32", "dram__bytes_read.sum", "Mbyte", "341.93"),
        _row("1", "sm80_xmma_gemm_f32f32", "gpu__time_duration.sum", "msecond", "2.67"),
        _row(
            "1",
            "sm80_xmma_gemm_f32f32",
            "sm__warps_active.avg.pct_of_peak_sustained_active",
            "%",
            "12.5",
        ),
    ]
)


def test_parse_ncu_csv_units_and_order():
    rows = lp.parse_ncu_csv(NCU_CSV)
    assert [r["kernel"] for r in rows] == ["sgemm_naive_kernel(int)", "sm80_xmma_gemm_f32f32"]
    naive, cublas = rows
    assert naive["dram_read_bytes"] == 8_453_808_640 and naive["registers"] == 32
    assert naive["time_us"] == pytest.approx(275_847.808)
    assert "some__other_metric.sum" not in naive and len(naive) == 4
    assert cublas["dram_read_bytes"] == pytest.approx(341.93e6)
    assert cublas["time_us"] == pytest.approx(2670) and cublas["achieved_occupancy_pct"] == 12.5


def test_parse_ncu_csv_without_a_table():
    assert lp.parse_ncu_csv("==ERROR== ERR_NVGPUCTRPERM - no permission") == []


def test_ncu_command():
    cmd = lp.ncu_command([5, 8], n=1024, python="python", log_file="x.csv")
    assert cmd[0] == "ncu" and "--csv" in cmd and cmd[cmd.index("--launch-count") + 1] == "3"
    assert cmd[cmd.index("--metrics") + 1].split(",") == list(lp.NCU_METRICS.values())
    assert cmd[-8:] == [
        "python",
        "-m",
        "kernels.ladder_plots",
        "--profile",
        "5",
        "8",
        "--n",
        "1024",
    ]
    assert cmd[cmd.index("--log-file") + 1] == "x.csv"
    with pytest.raises(ValueError, match="steps"):
        lp.ncu_command([])
    with pytest.raises(ValueError, match="steps"):
        lp.ncu_command([0, 9])


def test_run_ncu_reports_instead_of_raising(monkeypatch):
    monkeypatch.setattr(lp.shutil, "which", lambda name: None)
    res = lp.run_ncu([1])
    assert res.rows == [] and "not on the PATH" in res.message
    assert res.command.startswith("ncu --csv") and "--profile 1" in res.command


class _FakeNcu:
    """Stands in for subprocess.run: fails as told, or writes ``csv`` to the --log-file."""

    def __init__(self, outcomes):
        self.outcomes = list(outcomes)
        self.commands = []

    def __call__(self, cmd, **kwargs):
        import subprocess
        from pathlib import Path

        self.commands.append(cmd)
        rc, stderr, csv_text = self.outcomes.pop(0)
        if csv_text:
            Path(cmd[cmd.index("--log-file") + 1]).write_text(csv_text)
        return subprocess.CompletedProcess(cmd, rc, "", stderr)


def test_run_ncu_falls_back_to_core_metrics(monkeypatch):
    fake = _FakeNcu(
        [(1, "==ERROR== Failed to find metric l1tex__t_requests", ""), (0, "", NCU_CSV)]
    )
    monkeypatch.setattr(lp.shutil, "which", lambda name: "/usr/bin/ncu")
    monkeypatch.setattr(lp.subprocess, "run", fake)
    res = lp.run_ncu([1])
    assert res.message == "" and len(res.rows) == 2
    first, second = (c[c.index("--metrics") + 1].split(",") for c in fake.commands)
    assert first == list(lp.NCU_METRICS.values())
    assert set(second) == {lp.NCU_METRICS[k] for k in lp.NCU_METRICS_CORE} and len(second) < len(
        first
    )
    assert (
        "--log-file ladder-ncu.csv" in res.command
        and " python -m kernels.ladder_plots" in res.command
    )


def test_run_ncu_explains_locked_counters(monkeypatch):
    fake = _FakeNcu([(1, "==ERROR== ERR_NVGPUCTRPERM - The user does not have permission", "")])
    monkeypatch.setattr(lp.shutil, "which", lambda name: "/usr/bin/ncu")
    monkeypatch.setattr(lp.subprocess, "run", fake)
    res = lp.run_ncu([1, 2])
    assert res.rows == [] and "ERR_NVGPUCTRPERM" in res.message and len(fake.commands) == 1


# --- PTX ----------------------------------------------------------------------------------------

PTX = """
    cp.async.cg.shared.global [%r1], [%rd2], 16;
    @%p3 cp.async.cg.shared.global [%r4], [%rd5], 16;
    cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r6], [%rd7];
    mbarrier.try_wait.parity.shared.b64 %p1, [%r8], %r9;
    wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd1, %rd2;
    fma.rn.f32 %f2, %f3, %f4, %f5;
"""


def test_count_ptx_and_mnemonics():
    counts = lp.count_ptx(PTX)
    assert list(counts.values()) == [1, 0, 2, 1, 1, 1, 0]
    assert lp.ptx_mnemonics(PTX, "wgmma.mma_async") == [
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16"
    ]
    assert lp.ptx_mnemonics(PTX, "cp.async.cg") == ["cp.async.cg.shared.global"]
    assert lp.ptx_mnemonics(PTX, "mma.sync") == []


# --- plots --------------------------------------------------------------------------------------


def test_plots_draw():
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2)
    lp.plot_ladder_bars(ax1, {1: 0.01, 8: 0.8}, gpu="test GPU", names={1: "naive"})
    assert len(ax1.patches) == 2 * len(lp.A6000_OF_CUBLAS)
    lp.plot_sweep(ax2, [1024, 2048], {"cuBLAS fp32": [1, 2], "step 8": [0.5, 1.5]})
    assert len(ax2.get_lines()) == 2
    plt.close(fig)


def test_ladder_bars_readable_at_column_width():
    """The book's figure: every step's value label and name legible, none on top of another."""
    import matplotlib

    matplotlib.use("Agg")
    from kernels import plotstyle

    plotstyle.use()
    names = {1: "naive", 2: "coalesce", 3: "shared memory", 4: "1D block-tiling"}
    names |= {5: "2D block-tiling", 6: "vectorised", 7: "tuned", 8: "warp-tiling"}
    ours = {1: 0.01, 2: 0.12, 3: 0.18, 4: 0.31, 5: 0.43, 6: 0.71, 7: 0.78, 8: 0.86}
    fig, ax = plotstyle.figure()
    lp.plot_ladder_bars(ax, ours, gpu="NVIDIA H100 80GB HBM3", names=names)
    assert plotstyle.overlapping_texts(fig) == []
    renderer = fig.canvas.get_renderer()
    ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels()]
    assert not any(a.overlaps(b) for a, b in zip(ticks, ticks[1:])), "tick labels collide"
    assert all(t.get_fontsize() >= plotstyle.SMALL_PT for t in ax.texts + ax.get_xticklabels())


def test_a6000_column_is_the_worklogs():
    # Reading list 003: 309 GFLOP/s (1.3 %) for kernel 1 ... 21779 (93.7 %) for kernel 8.
    assert A6000_CUBLAS_GFLOPS_RANGE[0] < min(_implied_cublas()) <= max(_implied_cublas()) < 24_000
    assert lp.A6000_GFLOPS[8] == 21779 and lp.A6000_OF_CUBLAS[8] == 0.937


A6000_CUBLAS_GFLOPS_RANGE = (22_500, 24_000)


def _implied_cublas():
    # Each step's GFLOP/s over its fraction gives the A6000's cuBLAS; they must agree (steps 2-8:
    # the fractions are rounded to 0.1 %, so step 1's 1.3 % is too coarse to include).
    return [lp.A6000_GFLOPS[s] / lp.A6000_OF_CUBLAS[s] for s in range(2, 9)]


# --- the Hopper rungs ---------------------------------------------------------------------------


def test_sgemm_ladder_records_takes_the_latest_run_of_that_gpu(tmp_path):
    import json

    def row(variant, tflops, date, gpu="G", shape=(4096, 4096, 4096)):
        return {"bench": "sgemm", "variant": variant, "shape": list(shape), "tflops": tflops,
                "gpu": gpu, "date": date}  # fmt: skip

    rows = [
        row("cublas", 50.0, "2026-01-01"),
        row("step1-naive", 0.4, "2026-01-01"),
        row("cublas", 52.0, "2026-02-01"),
        row("step1-naive", 0.5, "2026-02-01"),
        row("step8-warp-tiling", 44.0, "2026-02-01"),
        row("cublas", 99.0, "2026-03-01", gpu="other"),
        row("cublas", 9.0, "2026-03-01", shape=(1024, 1024, 1024)),
        {
            "bench": "hgemm",
            "variant": "cublas",
            "shape": [4096] * 3,
            "tflops": 700,
            "gpu": "G",
            "date": "2026-03-01",
        },  # fmt: skip
    ]
    path = tmp_path / "g.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert lp.sgemm_ladder_records("G", path) == ({1: 0.5, 8: 44.0}, 52.0, "2026-02-01")
    assert lp.sgemm_ladder_records("nobody", path) is None
    assert lp.sgemm_ladder_records("G", tmp_path / "missing.jsonl") is None


def test_hopper_plots_are_readable_at_column_width():
    from kernels import plotstyle

    plotstyle.use()
    fig, ax = plotstyle.figure(height=3.6)
    sgemm = {1: 0.5, 2: 6.4, 3: 9.0, 4: 20.0, 5: 30.0, 6: 35.0, 7: 40.0, 8: 44.0}
    hopper = {9: 300.0, 10: 500.0, 11: 650.0, 12: 700.0}
    lp.plot_hopper_ladder(ax, hopper, 720.0, sgemm=sgemm, cublas_fp32=52.0)
    assert plotstyle.overlapping_texts(fig) == []
    assert len(ax.patches) == 12 and ax.get_yscale() == "log"
    fig, ax = plotstyle.figure(height=3.6)
    frac = {s: {9: 0.41, 10: 0.7, 11: 0.9, 12: 1.02} for s in ("4096³", "8192³", "4000×3000×5000")}
    lp.plot_vs_cublas(ax, frac, goals={"4096³": 1.0, "8192³": 1.0, "4000×3000×5000": 0.9})
    assert plotstyle.overlapping_texts(fig) == []
    assert len(ax.patches) == 12
    # a step that failed its check: no bar, marked, and the goals stay over step 12
    fig, ax = plotstyle.figure(height=3.6)
    frac = {"4096³": {9: 0.41, 10: 0.7}, "8192³": {9: 0.4, 10: 0.72}}
    lp.plot_vs_cublas(ax, frac, steps=[9, 10, 11, 12], goals={"4096³": 1.0, "8192³": 1.0})
    assert [t.get_text() for t in ax.texts if t.get_text() == "not timed"] == ["not timed"] * 2
    goal = [c for c in ax.collections if c.get_label() == "goal of step 12"]
    assert len(goal) == 1 and goal[0].get_segments()[0][0][0] > 2.5  # over step 12 (x = 3)
    assert plotstyle.overlapping_texts(fig) == []
    # without any measured step (a CPU run) both still draw
    lp.plot_hopper_ladder(plotstyle.figure()[1], {}, 1.0)
    lp.plot_vs_cublas(plotstyle.figure()[1], {})
