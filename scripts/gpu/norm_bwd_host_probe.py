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

Three rounds, the variants' order alternated; each number is the least of the three. ``--blocks``
adds thresholds to try (64: one program up to 64 row blocks), ``--dtype`` and ``--shapes`` pick
the cases.

    python scripts/gpu/norm_bwd_host_probe.py [--blocks 64] [--dtype fp16] [--shapes 64x1024 16x4096]
"""

from __future__ import annotations

import argparse
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


def grad_calls(kind: str, rows: int, cols: int, dtype: torch.dtype):
    """(ours, PyTorch's) backward of ``kind`` on ``[rows, cols]``, each one kept forward."""
    x, w, b, dy = norms.make_inputs(rows, cols, dtype)
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, nargs="*", default=[], help="more thresholds to try")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--shapes", nargs="*", default=[f"{r}x{c}" for r, c in SHAPES])
    args = ap.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    cases = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    default = norms.ONE_PROGRAM_BLOCKS
    variants = sorted({0, default, *args.blocks})
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"{args.dtype}; ONE_PROGRAM_BLOCKS = {default} (default); least of {ROUNDS} rounds")
    names = [f"{v}{'*' if v == default else ''}" for v in variants] + ["torch"]
    print(f"{'case':24s} {'row blocks':>10s} | host CPU µs a call: " + " ".join(f"{n:>7s}" for n in names)
          + " | device µs: " + " ".join(f"{n:>7s}" for n in names))  # fmt: skip
    for rows, cols in cases:
        for kind in ("rms_norm", "layer_norm"):
            make_ours, theirs = grad_calls(kind, rows, cols, dtype)
            res: dict = {}
            for rnd in range(ROUNDS):
                for blocks in variants if rnd % 2 == 0 else variants[::-1]:
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
            keys = [*variants, "torch"]
            row_blocks = norms.fwd_config(rows, cols)["programs"]
            print(
                f"{kind + f' {rows}x{cols}':24s} {row_blocks:10d} | {'':20s}"
                + " ".join(f"{m['cpu', k]:7.1f}" for k in keys)
                + f" | {'':10s}"
                + " ".join(f"{m['dev', k]:7.1f}" for k in keys),
                flush=True,
            )


if __name__ == "__main__":
    main()
