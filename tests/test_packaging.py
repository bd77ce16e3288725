"""The wheel holds every file the package reads, and works from a copy that is not this checkout.

Builds the wheel from a copy of pyproject.toml and kernels/ (so the checkout gets no build/ or
egg-info), unzips it, checks that every file of kernels/ is inside (the CUDA sources, headers and
tunings, hardware.yaml), then imports the unzipped copy in a fresh interpreter and runs a CPU smoke
test there: ``kernels.cuda.source()``, the GPU table, a vector add and a quantized GEMV."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

SMOKE = r"""
import sys
from pathlib import Path
import torch
import kernels
site = Path(sys.argv[1]).resolve()
assert Path(kernels.__file__).resolve().is_relative_to(site), kernels.__file__
from kernels import cuda, hardware, quant, vector_add
assert "sgemm" in cuda.source() and cuda.TUNE_CONFIGS and cuda.tuned_config(7) >= 0
assert hardware.load()
x = torch.randn(1000)
torch.testing.assert_close(vector_add.add(x, x), 2 * x)
qw = quant.quantize(torch.randn(32, 128), 4, 32)
xq = torch.randn(2, 128, dtype=torch.float16)
torch.testing.assert_close(quant.gemv(xq, qw).float(), quant.gemv_ref(xq, qw).float(), rtol=2e-2, atol=2e-2)
print("smoke ok")
"""


def _package_files() -> set[str]:
    """Every file of the kernels package in this checkout (what the wheel must hold)."""
    out = set()
    for p in (ROOT / "kernels").rglob("*"):
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc":
            out.add(p.relative_to(ROOT).as_posix())
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the same on every machine: CPU CI runs it")
def test_wheel_holds_every_file_and_runs_from_a_copy(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    shutil.copytree(ROOT / "kernels", src / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    dist = tmp_path / "dist"
    # The PEP 517 hook pip would call (`pip wheel --no-deps --no-build-isolation`), without pip.
    build = f"from setuptools import build_meta; build_meta.build_wheel({str(dist)!r})"
    subprocess.run(
        [sys.executable, "-c", build], cwd=src, check=True, capture_output=True, timeout=300
    )
    (wheel,) = dist.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        held = {n for n in z.namelist() if n.startswith("kernels/")}
        site = tmp_path / "site"
        z.extractall(site)
    missing = _package_files() - held
    assert not missing, f"the wheel lacks {sorted(missing)}"
    for needed in (
        "kernels/cuda/sgemm_common.cuh",
        "kernels/cuda/sgemm_tuned.json",
        "kernels/cuda/replay.cpp",
    ):
        assert needed in held
    # A fresh interpreter that finds only the unzipped copy (cwd is not the checkout).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    proc = subprocess.run(
        [sys.executable, "-c", SMOKE, str(site)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "smoke ok" in proc.stdout
