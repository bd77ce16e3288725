import importlib.util
import os
import sys
from pathlib import Path

# Kernel tests run in Triton's interpreter on machines without a GPU; importing kernels sets it up.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
# Debug mode: launchers also run the checks that read tensor values (block ids, sequence lengths,
# barrier timeouts), which would cost a host sync per call outside tests (kernels/_validate.py).
os.environ["GPU_BRRR_DEBUG"] = "1"

import torch  # noqa: E402

import kernels  # noqa: E402,F401
from kernels import _validate, device, numerics  # noqa: E402

_validate.debug(True)

GUARD = 4096  # elements of poison on each side of a guarded tensor
ROOT = Path(__file__).resolve().parents[1]


def load_script(relpath: str):
    """A script of the repository (``scripts/gpu/...``, ``tools/...``) imported as a module, so a
    test can call its functions or its ``main(argv)`` in this process."""
    path = ROOT / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


def guarded(t: torch.Tensor, fill: float = float("nan")) -> torch.Tensor:
    """A contiguous copy of ``t`` that lives inside a larger buffer whose other elements are
    ``fill`` (NaN, or a huge value for integer tensors): a kernel that reads one element before
    or after ``t`` (a dropped mask, an off-by-one) sees poison, and its result changes."""
    buf = torch.full((2 * GUARD + t.numel(),), fill, dtype=t.dtype, device=t.device)
    view = buf[GUARD : GUARD + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def eager_and_graphed(fn):
    """``(fn(), the same call captured in a CUDA graph and replayed)``: the eager call first
    compiles and autotunes (neither may happen during capture), a warm-up on a side stream as
    PyTorch's graph docs ask, then capture and one replay. Equal results mean the launcher
    allocates, chooses and launches without reading anything from the host."""
    eager = fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return eager, out


# ----------------------------------------------------------------------------- MLA and DSA tests

# Triton's interpreter computes bf16 wrongly (a known limitation): bf16 is checked on GPUs only.
LATENT_DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if device.GPU_MODE else [])
# Relative error (Frobenius) against the fp32 reference: 16-bit inputs and P rounded once, the
# split merge in fp32.
LATENT_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}


def latent_config(dtype, autotune=False):
    """On a GPU one fixed tile per dtype (autotuning every case would compile six variants of
    each: minutes, testing nothing more), except where ``autotune``; the interpreter's single
    config otherwise."""
    if not device.GPU_MODE or autotune:
        return None
    return (16, 16, 4, 1) if dtype == torch.float32 else (32, 32, 8, 2)


# Relative Frobenius error in fp64 (inf where ``out`` has NaN or inf): the course's own.
rel_err = numerics.rel_error
