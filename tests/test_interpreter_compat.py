"""The interpreter's NumPy 2.4 shim (kernels/_interpreter_compat.py): a loop over a runtime bound."""

import pytest
import torch
import triton
import triton.language as tl

from kernels import _interpreter_compat, device


@triton.jit
def _strided_sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):  # the bound is a runtime scalar: __index__ in the interpreter
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr, tl.sum(acc, axis=0))


def test_needs_patch_matches_this_numpy():
    import numpy as np

    major, minor = (int(p) for p in np.__version__.split(".")[:2])
    assert _interpreter_compat.needs_patch() == ((major, minor) >= (2, 4))


@pytest.mark.skipif(not device.INTERPRET, reason="the shim patches the CPU interpreter only")
def test_patched_interpreter_runs_a_loop_over_a_runtime_bound():
    import warnings

    from triton.runtime import interpreter

    _interpreter_compat.apply(force=True)  # forced, so NumPy < 2.4 runs the patched path too
    assert not _interpreter_compat.apply(force=True)  # idempotent: the second call does nothing
    assert interpreter._patch_lang_tensor._gpu_brrr_compat
    x = torch.arange(1000, dtype=torch.float32)
    out = torch.empty(1, dtype=torch.float32)
    with warnings.catch_warnings():
        # NumPy 1.25-2.3 warn where 2.4 raises: as an error, the unpatched interpreter fails here
        warnings.simplefilter("error", DeprecationWarning)
        _strided_sum_kernel[(1,)](x, out, x.numel(), BLOCK=128)
    assert out.item() == pytest.approx(x.sum().item())


def test_import_kernels_survives_deprecations_as_errors():
    import subprocess
    import sys

    cmd = [sys.executable, "-W", "error::DeprecationWarning", "-c", "import kernels"]
    assert subprocess.run(cmd, capture_output=True, text=True).returncode == 0
