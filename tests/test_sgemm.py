"""The CUDA SGEMM ladder: every step compiles (with nvcc, no GPU needed), validates its input on any
machine, and on a GPU matches an fp64 reference on odd shapes."""

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import kernels.cuda as ladder
from kernels import device

NVCC = shutil.which("nvcc")
gpu = pytest.mark.skipif(
    ladder.unavailable_reason() is not None, reason="needs a CUDA GPU and nvcc"
)


def _nvcc(arch: str, text: str, tmp_path) -> subprocess.CompletedProcess:
    src = tmp_path / f"ladder_{arch}.cu"
    src.write_text(text)
    return subprocess.run(
        [NVCC, "-std=c++17", "-O1", f"-arch={arch}", "-c", str(src), "-o", str(src) + ".o"],
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_ladder_compiles_for_sm90_and_sm75(tmp_path):
    # sm_90 builds every step including every configuration of the searched steps 7 and 8 (their
    # static_asserts are the launch-configuration checks); sm_75 builds steps 1-6, to stay quick.
    no_search = "\n".join(
        (ladder.HERE / f).read_text()
        for f in ladder.SOURCES
        if f not in ("sgemm_07_tuned.cu", "sgemm_08_warptile.cu")
    )
    with ThreadPoolExecutor(2) as pool:
        jobs = [
            pool.submit(_nvcc, "sm_90", ladder.source(), tmp_path),
            pool.submit(_nvcc, "sm_75", no_search, tmp_path),
        ]
        for job in jobs:
            proc = job.result()
            assert proc.returncode == 0, proc.stderr[-4000:]


def test_search_space_is_parsed_from_the_source():
    assert len(ladder.TUNE_CONFIGS) >= 20
    assert (128, 128, 8, 8, 8) in ladder.TUNE_CONFIGS
    for bm, bn, bk, tm, tn in ladder.TUNE_CONFIGS:
        threads = bm * bn // (tm * tn)
        assert 64 <= threads <= 1024 and (bm + bn) * bk * 4 <= 48 * 1024


def test_warptile_search_space_is_parsed_and_valid():
    assert len(ladder.WARPTILE_CONFIGS) >= 16
    assert ladder.DEFAULT_CONFIGS[8] in ladder.WARPTILE_CONFIGS
    for bm, bn, bk, wm, wn, wniter, tm, tn, db in ladder.WARPTILE_CONFIGS:
        threads = (bm // wm) * (bn // wn) * 32
        wmiter = wm * wn // (32 * tm * tn * wniter)
        assert bm % wm == 0 and bn % wn == 0 and 64 <= threads <= 1024
        assert wmiter >= 1 and (wm // wmiter // tm) * (wn // wniter // tn) == 32
        assert db in (0, 1) and (1 + db) * (bm + bn) * bk * 4 <= 48 * 1024
    # both variants of the original shape are searched, so the effect of double buffering shows
    assert {
        c[-1] for c in ladder.WARPTILE_CONFIGS if c[:-1] == (128, 128, 16, 64, 64, 4, 8, 4)
    } == {0, 1}


@pytest.mark.parametrize("step", [7, 8])
def test_tuned_config_defaults_without_a_tuning(step):
    idx = ladder.tuned_config(step, "a GPU nobody tuned")
    assert ladder.SEARCH_SPACES[step][idx] == ladder.DEFAULT_CONFIGS[step]
    assert ladder.DEFAULT_CONFIGS[7] == (128, 128, 8, 8, 8)  # step 6's shape


def test_tuned_config_rejects_an_unsearched_step():
    with pytest.raises(ValueError, match="step"):
        ladder.tuned_config(5)


@pytest.mark.parametrize(
    "a, b, kw, err, match",
    [
        (torch.zeros(4, 3), torch.zeros(4, 3), {}, ValueError, "do not chain"),
        (
            torch.zeros(4, 4, dtype=torch.float16),
            torch.zeros(4, 4),
            {},
            TypeError,
            "a must have dtype",
        ),
        (torch.zeros(4), torch.zeros(4, 4), {}, ValueError, "a must be 2-D"),
        (torch.zeros(4, 4), torch.zeros(4, 4).t(), {}, ValueError, "b must be contiguous"),
        (torch.zeros(4, 4), torch.zeros(4, 4), {"step": 9}, ValueError, "step must be"),
        (torch.zeros(4, 4), torch.zeros(4, 4), {"step": 7, "config": 10_000}, ValueError, "config"),
        (torch.zeros(4, 4), torch.zeros(4, 4), {"step": 3, "config": 0}, ValueError, "config"),
        (torch.zeros(4, 4), torch.zeros(4, 4), {"step": 8, "config": -1}, ValueError, "config"),
    ],
)
def test_sgemm_rejects_bad_input(a, b, kw, err, match):
    with pytest.raises(err, match=match):
        ladder.sgemm(a, b, **kw)


@pytest.mark.skipif(device.GPU_MODE, reason="checks the CPU-only message")
def test_sgemm_says_what_it_needs_without_a_gpu():
    assert "GPU" in ladder.unavailable_reason()
    with pytest.raises(ValueError, match="CUDA tensors"):
        ladder.sgemm(torch.zeros(2, 2), torch.zeros(2, 2))


@gpu
@pytest.mark.parametrize("step", list(ladder.STEPS))
@pytest.mark.parametrize(
    "mkn", [(1, 1, 1), (17, 33, 65), (127, 255, 129), (256, 128, 512), (1000, 300, 777)]
)
def test_sgemm_matches_fp64_reference(step, mkn):
    m, k, n = mkn
    a = torch.randn(m, k, device="cuda")
    b = torch.randn(k, n, device="cuda")
    out = ladder.sgemm(a, b, step)
    ref = ladder.sgemm_ref(a, b)
    assert out.shape == (m, n) and torch.isfinite(out).all()
    # fp32 accumulation over K: relative error ~ sqrt(K) * 6e-8, far under 1e-5.
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5


@gpu
@pytest.mark.parametrize("step", [7, 8])
def test_every_searched_config_is_correct(step):
    a = torch.randn(256, 512, device="cuda")
    b = torch.randn(512, 256, device="cuda")
    ref = ladder.sgemm_ref(a, b)
    for i, cfg in enumerate(ladder.SEARCH_SPACES[step]):
        out = ladder.sgemm(a, b, step, config=i)
        assert ((out - ref).norm() / ref.norm()).item() < 1e-5, cfg


@gpu
def test_builds_pass_arch_flags_and_leave_the_environment_alone():
    """Both CUDA builds (the ladder, quant's int4 GEMV) name the current GPU's architecture in their
    own nvcc flags instead of setting the process-wide TORCH_CUDA_ARCH_LIST."""
    import os

    from kernels import quant

    before = os.environ.get("TORCH_CUDA_ARCH_LIST")
    ladder.build()
    if quant.int4_mma_unavailable() is None:
        quant._int4_mma_module()
    assert os.environ.get("TORCH_CUDA_ARCH_LIST") == before
    major, minor = torch.cuda.get_device_capability()
    assert ladder.arch_flags() == (f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}",)
