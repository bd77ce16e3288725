"""The Hopper rungs of the CUDA ladder (kernels/cuda/hgemm_*.cu): every step compiles for sm_90a with
nvcc (no GPU needed) into the instructions it is about, the launcher validates its input and says
"needs Hopper" before it tries to build anything, and on an H100 each step matches an fp32
reference on odd shapes."""

import dataclasses
import re
import shutil
import subprocess

import pytest
import torch
from conftest import guarded

import kernels.cuda as ladder
from kernels import device, numerics
from kernels.cuda import hgemm_check as check

NVCC = shutil.which("nvcc")
hopper = pytest.mark.skipif(
    ladder.hgemm_unavailable_reason() is not None, reason="needs a Hopper GPU (sm_90a) and nvcc"
)
# What the step's idea must put in the PTX: (instruction, how many times) per step; None: at least
# once. wgmma per main-loop iteration: step 9 and 10 issue 4 (k16) x 2 (m64 halves), steps 11-12 4
# per consumer; step 9 copies 8 row passes x (A, B) chunks of 16 bytes per thread, unrolled. Step 12:
# one unicast (A) and one multicast (half of B) TMA load, 2 epilogue rounds x 2 boxes of TMA store
# (one commit per round), barrier.cluster at the start and the end, remote arrivals through mapa.
EXPECTED_PTX = {
    9: {"wgmma.mma_async": 8, "cp.async.cg.shared.global": 16, "fence.proxy.async": 1},
    10: {"wgmma.mma_async": 8, "cp.async.bulk.tensor.2d": None, "mbarrier.try_wait.parity": None},
    11: {
        "wgmma.mma_async": 4,
        "cp.async.bulk.tensor.2d": None,
        "setmaxnreg.dec": 1,
        "setmaxnreg.inc": 1,
        "mbarrier.arrive.shared": None,
    },
    12: {
        "wgmma.mma_async": 4,
        ".reqnctapercluster 2, 1, 1": 1,
        "cp.async.bulk.tensor.2d.shared::cluster.global": 2,
        "mbarrier::complete_tx::bytes.multicast::cluster": 1,
        "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group": 4,
        "cp.async.bulk.commit_group": 2,
        "cp.async.bulk.wait_group.read": None,
        "fence.proxy.async.shared::cta": None,
        "mapa.shared::cluster": None,
        # The empty barriers' remote arrive and the producer's wait on them: default semantics,
        # as CUTLASS's ClusterBarrier (HGEMM12_CLUSTER_RELEASE=1 builds the cluster-scope pair).
        "mbarrier.arrive.shared::cluster": None,
        "mbarrier.arrive.release.cluster": 0,
        "mbarrier.try_wait.parity.acquire.cluster": 0,
        "barrier.cluster.arrive": 2,
        "barrier.cluster.wait": 2,
        "setmaxnreg.dec": 1,
        "setmaxnreg.inc": 1,
    },
}
# Steps whose warpgroups trade registers with setmaxnreg: 65536 / 384 threads -> 168 at entry.
SETMAXNREG_STEPS = (11, 12)
# The same ideas in SASS (page 4.11's table), counted where a cuobjdump is found (the toolkit's or
# Triton's); None: at least once.
EXPECTED_SASS = {
    9: {"HGMMA": 8, "LDGSTS": 16, "UTMALDG": 0, "USETMAXREG": 0},
    10: {"HGMMA": 8, "UTMALDG": 4, "LDGSTS": 0, "USETMAXREG": 0},
    11: {"HGMMA": 4, "UTMALDG": 2, "UTMASTG": 0, "USETMAXREG": 2},
    12: {
        "HGMMA": 4,
        "UTMALDG": 2,
        "MULTICAST": 1,
        "UTMASTG": 4,
        "USETMAXREG": 2,
        "UCGABAR_ARV": None,
    },
}


def _kernel_part(step: int) -> str:
    """The part of a step's file name that check.SASS_WANT keys on: hgemm_11_warpspec.cu -> warpspec."""
    return check.step_file(step).removesuffix(".cu").split("_", 2)[2]


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_every_step_compiles_for_sm90a_into_its_instructions(tmp_path):
    results = check.compile_steps(workdir=tmp_path)  # one nvcc per step, in parallel
    assert sorted(results) == sorted(ladder.HGEMM_STEPS)
    for step, built in results.items():
        assert built.ok, f"step {step}:\n{built.log[-4000:]}"
        # ptxas says so when it must serialise wgmma (accumulators touched mid-flight) or ignores
        # setmaxnreg (C7508); either would silently cost the step its idea.
        assert not built.warnings, f"step {step}:\n{built.log[-4000:]}"
        assert built.ptxas["spill_stores"] == built.ptxas["spill_loads"] == 0, built.log
        for instr, count in EXPECTED_PTX[step].items():
            found = len(re.findall(re.escape(instr), built.ptx))
            if count is None:
                assert found >= 1, f"step {step}: no {instr} in the PTX"
            else:
                assert found == count, (
                    f"step {step}: {found} x {instr} in the PTX, expected {count}"
                )
        if built.sass_counts:
            assert not check.missing_sass(_kernel_part(step), built.sass_counts), step
            for op, count in EXPECTED_SASS[step].items():
                found = built.sass_counts[op]
                assert found >= 1 if count is None else found == count, (step, op, found)
    # setmaxnreg only works under a register cap: 65536 / 384 threads -> 168 registers at entry.
    for step in SETMAXNREG_STEPS:
        assert results[step].ptxas["registers"] == 168, step
        assert "Used 168 registers" in results[step].log, step


# Runs step 12's host-and-device helpers on the CPU: the tile scheduler and the epilogue's staging
# addresses are the kernel's own functions, not copies.
STEP12_HOST_CHECK = r"""
#include <cstdio>
#include <vector>
int main() {
  using namespace hg12;
  // Clusters walk t = id, id + clusters, ...: every cluster tile exactly once.
  const int cases[][3] = {{1, 1, 66}, {9, 17, 66}, {16, 16, 66}, {32, 32, 66}, {5, 3, 7}, {13, 29, 60}};
  for (auto& c : cases) {
    std::vector<int> seen(c[0] * c[1], 0);
    for (int id = 0; id < c[2]; ++id)
      for (int t = id; t < c[0] * c[1]; t += c[2]) {
        int tm, tn;
        cluster_tile(t, c[0], c[1], tm, tn);
        if (tm < 0 || tm >= c[0] || tn < 0 || tn >= c[1]) return printf("tile out of range\n"), 1;
        seen[tm * c[1] + tn]++;
      }
    for (int v : seen)
      if (v != 1) return printf("a tile computed %d times\n", v), 1;
  }
  // The first wave (66 clusters) at 8192^3 (32 x 32 cluster tiles): tile rows and columns spanned.
  int rows = 0, cols = 0;
  for (int t = 0; t < 66; ++t) {
    int tm, tn;
    cluster_tile(t, 32, 32, tm, tn);
    rows = tm + 1 > rows ? tm + 1 : rows;
    cols = tn + 1 > cols ? tn + 1 : cols;
  }
  printf("wave span %d x %d\n", rows, cols);
  // One epilogue round: every 4-byte word of the staging buffer written once; per warp store, the
  // most lanes that share a bank (1: conflict-free).
  std::vector<int> words(C_STAGE / 4, 0);
  int ways = 0;
  for (int j = 0; j < EPI_N / 8; ++j)
    for (int h = 0; h < 2; ++h)
      for (int warp = 0; warp < 4; ++warp) {
        int banks[32] = {0};
        for (int lane = 0; lane < 32; ++lane) {
          const uint32_t off = staging_offset(warp * 16 + lane / 4 + 8 * h, j, lane);
          if (off % 4 || off >= C_STAGE) return printf("offset %u outside\n", off), 1;
          words[off / 4]++;
          ways = ++banks[(off / 4) % 32] > ways ? banks[(off / 4) % 32] : ways;
        }
      }
  for (int v : words)
    if (v != 1) return printf("a word written %d times\n", v), 1;
  printf("bank ways %d\n", ways);
  return 0;
}
"""


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_step12_tile_order_and_staging_layout_on_the_host(tmp_path):
    src = tmp_path / "step12_host.cu"
    src.write_text(check.step_source(12) + STEP12_HOST_CHECK)
    exe = tmp_path / "step12_host"
    # PTX only for the device part (nothing runs on a GPU): the host code is what is tested.
    build = subprocess.run(
        [NVCC, "-std=c++17", "-O1", "-gencode=arch=compute_90a,code=compute_90a", str(src)]
        + ["-o", str(exe)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    # The header's napkin math: the 66 tiles in flight span 8 tile rows and 9 columns at 8192^3.
    assert "wave span 8 x 9" in run.stdout
    assert "bank ways 1" in run.stdout


def test_every_step_has_a_source_file_and_a_binding():
    bindings = (ladder.HERE / "hgemm_bindings.cu").read_text()
    for step in ladder.HGEMM_STEPS:
        assert (ladder.HERE / check.step_file(step)).exists()
        assert f"case {step}: info = hgemm_{step:02d}(" in bindings
    # the two ladders are separate builds: the SGEMM one never sees sm_90a-only code
    assert not set(ladder.HGEMM_SOURCES) & set(ladder.SOURCES)
    # every step's file is built, in ladder order, after the common header
    assert ladder.HGEMM_SOURCES == ["hgemm_common.cuh"] + [
        check.step_file(s) for s in sorted(ladder.HGEMM_STEPS)
    ]
    assert "step must be 9..12" in bindings


def test_default_step_is_the_last_one_validated_on_a_gpu():
    # Step 12 passed the GPU tests, odd shapes, compute-sanitizer and the repeat check on an H100
    # (2026-11-27) and beat step 11 at every timed shape: the default, and the docstring says so.
    assert ladder.HGEMM_DEFAULT_STEP == 12 == max(ladder.HGEMM_STEPS)
    assert "default is step 12" in ladder.hgemm.__doc__


bf16 = torch.bfloat16


@pytest.mark.parametrize(
    "a, b, kw, err, match",
    [
        ([[1.0]], torch.zeros(1, 1, dtype=bf16), {}, TypeError, "a must be a torch.Tensor"),
        (torch.zeros(4, 8), torch.zeros(8, 4, dtype=bf16), {}, TypeError, "a must have dtype"),
        (torch.zeros(4, 8, dtype=bf16), torch.zeros(8, 4), {}, TypeError, "b must have dtype"),
        (
            torch.zeros(8, dtype=bf16),
            torch.zeros(8, 4, dtype=bf16),
            {},
            ValueError,
            "a must be 2-D",
        ),
        (
            torch.zeros(4, 8, dtype=bf16),
            torch.zeros(8, dtype=bf16),
            {},
            ValueError,
            "b must be 2-D",
        ),
        (
            torch.zeros(4, 8, dtype=bf16),
            torch.zeros(4, 8, dtype=bf16),
            {},
            ValueError,
            "do not chain",
        ),
        (
            torch.zeros(4, 8, dtype=bf16),
            torch.zeros(8, 8, dtype=bf16)[:, ::2],
            {},
            ValueError,
            "b must be contiguous or the transpose",
        ),
        (
            torch.zeros(8, 4, dtype=bf16).t(),
            torch.zeros(8, 4, dtype=bf16),
            {},
            ValueError,
            "a must be contiguous",
        ),
        (
            torch.zeros(4, 8, dtype=bf16),
            torch.zeros(8, 4, dtype=bf16),
            {"step": 8},
            ValueError,
            "step",
        ),
        (
            torch.zeros(4, 8, dtype=bf16),
            torch.zeros(8, 4, dtype=bf16),
            {"step": 13},
            ValueError,
            r"step must be an int in 9\.\.12",
        ),
        (
            torch.zeros(4, 8, dtype=bf16),
            torch.zeros(8, 4, dtype=bf16),
            {"step": True},
            ValueError,
            "step",
        ),
    ],
)
def test_hgemm_rejects_bad_input_before_building(a, b, kw, err, match):
    with pytest.raises(err, match=match):
        ladder.hgemm(a, b, **kw)


def _pretend(monkeypatch, cc):
    """Pretend the toolchain is there and the GPU has compute capability ``cc``."""
    caps = dataclasses.replace(device.capabilities(), compute_capability=cc)
    monkeypatch.setattr(ladder, "unavailable_reason", lambda: None)
    monkeypatch.setattr(ladder.device, "capabilities", lambda: caps)


@pytest.mark.parametrize("cc", [(8, 0), (8, 9), (10, 0), (12, 0)])
def test_hgemm_says_it_needs_hopper(monkeypatch, cc):
    _pretend(monkeypatch, cc)
    assert "needs Hopper (sm_90a" in ladder.hgemm_unavailable_reason()
    a, b = torch.zeros(4, 8, dtype=bf16), torch.zeros(8, 4, dtype=bf16)
    with pytest.raises(RuntimeError, match=rf"needs Hopper \(sm_90a.*{cc[0]}\.{cc[1]}"):
        ladder.hgemm(a, b)
    with pytest.raises(RuntimeError, match="needs Hopper"):
        ladder.hgemm_build()  # the build is refused too, not attempted
    ladder._hgemm_module.cache_clear()  # nothing was cached, but leave no trace for other tests


def test_hgemm_on_hopper_checks_the_device_of_its_inputs(monkeypatch):
    _pretend(monkeypatch, (9, 0))
    assert ladder.hgemm_unavailable_reason() is None
    with pytest.raises(ValueError, match="CUDA tensors"):
        ladder.hgemm(torch.zeros(4, 8, dtype=bf16), torch.zeros(8, 4, dtype=bf16))


@pytest.mark.skipif(device.GPU_MODE, reason="checks the CPU-only message")
def test_hgemm_says_what_it_needs_without_a_gpu():
    assert "GPU" in ladder.hgemm_unavailable_reason()
    with pytest.raises(RuntimeError, match="GPU"):
        ladder.hgemm(torch.zeros(4, 8, dtype=bf16), torch.zeros(8, 4, dtype=bf16))


def _check(out: torch.Tensor, ref: torch.Tensor):
    """bf16 output of an fp32-accumulated product: each element is the fp32 sum rounded once to
    bf16 (relative error <= 2^-8) plus accumulation-order differences (tiny against max |ref|). A
    wrong swizzle, descriptor or fragment mapping gives errors of the order of |ref| itself. The
    bound is hgemm_check.bound_ratio's, which tests/test_hgemm_check.py checks on the CPU."""
    assert out.dtype == bf16 and out.shape == ref.shape
    ratio, rel = check.bound_ratio(out, ref)  # inf when out is not finite
    assert ratio <= 1, f"worst error / bound {ratio:.3g}, bad blocks {check.bad_blocks(out, ref)}"
    assert rel < ladder.HGEMM_BENCH_TOLERANCE  # 1e-2


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("step", sorted(ladder.HGEMM_STEPS))
# The shapes of hgemm_check.CHECK_SHAPES (what the probe's and the notebook's checks run): edge tiles,
# K % 8 != 0 (129 x 257 x 100: the padded path), K of several tiles with a partial last one (64 x 8
# x 200: ring wrap-around and zero-fill), and for step 12 9 x 17 cluster tiles (more than fit at
# once) with KT = 2 < STAGES (2177 x 4104 x 72: the producer runs a whole tile ahead and the ring's
# phases cross tile boundaries).
@pytest.mark.parametrize("mnk", check.CHECK_SHAPES)
def test_hgemm_matches_fp32_reference(step, mnk):
    m, n, k = mnk
    g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    # Guarded: a load past the end of A or Bt reads NaN and poisons the result.
    a = guarded(torch.randn(m, k, device="cuda", dtype=bf16, generator=g))
    w = guarded(torch.randn(n, k, device="cuda", dtype=bf16, generator=g))
    for b in (w.t(), w.t().contiguous()):  # K-major view (no copy) and row-major [K, N] (copied)
        _check(ladder.hgemm(a, b, step), ladder.hgemm_ref(a, b))


@pytest.mark.gpu
@hopper
@pytest.mark.parametrize("step", sorted(ladder.HGEMM_STEPS))
def test_hgemm_empty_and_unaligned_inputs(step):
    a = torch.randn(33, 72, device="cuda", dtype=bf16)
    w = torch.randn(40, 72, device="cuda", dtype=bf16)
    assert ladder.hgemm(a[:, :0].contiguous(), w[:, :0].t(), step).abs().sum() == 0
    # a view starting 2 bytes into its storage: copied to 16-byte alignment, still correct
    buf = torch.randn(33 * 72 + 1, device="cuda", dtype=bf16)
    a_off = buf[1:].view(33, 72)
    _check(ladder.hgemm(a_off, w.t(), step), ladder.hgemm_ref(a_off, w.t()))


def test_hgemm_benchmark_is_registered_and_skips_without_hopper(capsys):
    from kernels import bench

    assert "hgemm" in bench.BENCHMARKS
    if ladder.hgemm_unavailable_reason() is None:
        pytest.skip("on Hopper the benchmark times for real (scripts/gpu/hgemm_probe.py)")
    assert bench.BENCHMARKS["hgemm"](True) == []
    assert "hgemm skipped" in capsys.readouterr().out


def test_the_benchmark_refuses_to_time_a_wrong_step():
    ref = torch.randn(33, 17)
    assert numerics.rel_error(ref.to(bf16), ref) < ladder.HGEMM_BENCH_TOLERANCE
    wrong = ref.clone()
    wrong[:, 16:] = 0  # one wrong column block, as a broken multicast half or edge store would give
    assert not numerics.rel_error(wrong.to(bf16), ref) < ladder.HGEMM_BENCH_TOLERANCE
    wrong[0, 0] = float("nan")
    assert numerics.rel_error(wrong.to(bf16), ref) == float("inf")


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_step12_default_build_has_no_gpu_fence_in_its_main_loop(tmp_path):
    # The cluster-scope release on the empty barriers (the A/B build, hgemm_probe.py --define
    # HGEMM12_CLUSTER_RELEASE=1) costs a MEMBAR.ALL.GPU per consumer arrive in the k-loop (two
    # arrive sites); the default build (CUTLASS's default semantics) must keep every other
    # instruction and lack exactly those fences.
    default = check.compile_step(12, tmp_path / "default")
    ab = check.compile_step(12, tmp_path / "ab", defines=("HGEMM12_CLUSTER_RELEASE=1",))
    assert default.ok and ab.ok, default.log[-4000:]
    assert default.ptxas["spill_stores"] == default.ptxas["spill_loads"] == 0, default.log
    assert "mbarrier.arrive.release.cluster" not in default.ptx
    assert "mbarrier.arrive.release.cluster" in ab.ptx
    if default.sass and ab.sass:
        fences = [s.count("MEMBAR.ALL.GPU") for s in (default.sass, ab.sass)]
        assert fences[0] == fences[1] - 2, fences
        for op in ("HGMMA", "UTMALDG", "UTMASTG"):
            assert default.sass.count(op) == ab.sass.count(op), op
