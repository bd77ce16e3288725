"""Host and device cost of the norm backward through autograd: one program against two launches.

A backward of at most ``norms.ONE_PROGRAM_BLOCKS`` row blocks runs as one program that writes dw
and db itself; above it, as many programs as fit on the GPU write fp32 partial sums and a second
launch adds them up. This probe times both ways at decode-to-training shapes by setting
``ONE_PROGRAM_BLOCKS`` to 0 (two launches wherever the grid has more than one program) and to its
default, in one run, against PyTorch's backward:

- host: CPU time per ``torch.autograd.grad`` call (``time.process_time``, every thread of the
  process: the autograd engine runs a CUDA backward on its own thread), the least of 7 loops of
  200 calls. CPU time, not wall time, because on a shared host the wall time of a loop moves by
  tens of µs between runs while the work done does not;
- device: ``bench.measure(..., device_only=True)``, the kernels' time with the host kept out.

Three rounds, the variants' order alternated; each number is the least of the three.

    python scripts/gpu/norm_bwd_host_probe.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout
from kernels import bench, norms, shapes  # noqa: E402

SHAPES = [(1, 4096), (8, 4096), (64, 1024), (4096, 1024)]
ROUNDS = 3


def cpu_us(fn, calls: int = 200, loops: int = 7) -> float:
    """CPU µs per call of ``fn``: the least of ``loops`` loops of ``calls`` back-to-back calls."""
    return min(shapes.host_loops(fn, calls, loops, time.process_time)) * 1e3


def device_us(fn) -> float:
    return bench.measure(fn, device_only=True, warmup_ms=10, rep_ms=40).ms * 1e3


def grad_calls(kind: str, rows: int, cols: int):
    """(ours, PyTorch's) backward of ``kind`` on ``[rows, cols]`` bf16, each one kept forward."""
    x, w, b, dy = norms.make_inputs(rows, cols, torch.bfloat16)
    x, w, b = (t.requires_grad_() for t in (x, w, b))
    if kind == "rms_norm":
        leaves = [x, w]
        ours = lambda: norms.rms_norm(x, w)  # noqa: E731
        theirs = lambda: torch.nn.functional.rms_norm(x, (cols,), w, 1e-6)  # noqa: E731
    else:
        leaves = [x, w, b]
        ours = lambda: norms.layer_norm(x, w, b)  # noqa: E731
        theirs = lambda: torch.nn.functional.layer_norm(x, (cols,), w, b, 1e-5)  # noqa: E731
    return (lambda: shapes.grad_call(ours, leaves, dy)), shapes.grad_call(theirs, leaves, dy)


def main() -> None:
    default = norms.ONE_PROGRAM_BLOCKS
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"ONE_PROGRAM_BLOCKS = {default}; least of {ROUNDS} rounds")
    print(f"{'case':22s} {'host CPU µs per call':>33s} | {'device µs':>26s}")
    print(f"{'':22s} {'2 launch':>9s} {'default':>9s} {'torch':>8s}  | {'2 launch':>8s} "
          f"{'default':>8s} {'torch':>7s}  one program?")  # fmt: skip
    for rows, cols in SHAPES:
        for kind in ("rms_norm", "layer_norm"):
            make_ours, theirs = grad_calls(kind, rows, cols)
            res: dict = {}
            for rnd in range(ROUNDS):
                for blocks in (0, default) if rnd % 2 == 0 else (default, 0):
                    norms.ONE_PROGRAM_BLOCKS = blocks
                    norms._BWD_PLANS.clear()
                    norms._BWD_LAYOUTS.plans.clear()
                    ours = make_ours()
                    res.setdefault(("cpu", blocks), []).append(cpu_us(ours))
                    res.setdefault(("dev", blocks), []).append(device_us(ours))
                res.setdefault(("cpu", "torch"), []).append(cpu_us(theirs))
                res.setdefault(("dev", "torch"), []).append(device_us(theirs))
            norms.ONE_PROGRAM_BLOCKS = default
            m = {k: min(v) for k, v in res.items()}
            one = norms.bwd_config(rows, cols)["programs"] == 1
            print(
                f"{kind + f' {rows}x{cols}':22s} {m['cpu', 0]:9.1f} {m['cpu', default]:9.1f} "
                f"{m['cpu', 'torch']:8.1f}  | {m['dev', 0]:8.1f} {m['dev', default]:8.1f} "
                f"{m['dev', 'torch']:7.1f}  {'yes' if one else 'no'}",
                flush=True,
            )


if __name__ == "__main__":
    main()
