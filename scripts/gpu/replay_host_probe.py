"""Host cost per call of the row-wise ops and of small attention problems: the Python launch path,
the C++ one (kernels.replay), and PyTorch's own op, in one run.

For each op and shape, three callables run the same work: ours with ``replay.ON = False`` (every
call down the Python path: checks, plan lookup, ``Launcher``, a Python autograd node), ours with
``replay.ON = True`` (a layout seen before goes straight to C++, and its backward is a C++ node),
and PyTorch's op. Each is timed three ways:

- wall µs per call: 200 back-to-back calls, then a synchronize, the least of 7 loops (what a
  decode step or a small batch pays when the GPU waits on the host);
- CPU µs per call: the same loops timed with ``time.process_time`` (every thread of the process:
  the autograd engine runs a CUDA backward on its own thread), steadier than wall time on a
  shared host;
- device µs: ``bench.measure(device_only=True)``, the kernels alone (the same binaries on both
  of our paths, so the same time up to noise).

Forward rows call the op under ``torch.no_grad``; backward rows call ``torch.autograd.grad`` on one
kept forward (``kernels.shapes.grad_call``). Three rounds, the paths' order rotated; each number is
the least of the three.

    python scripts/gpu/replay_host_probe.py [--ops rms_norm layer_norm softmax attention]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout
from kernels import bench, norms, replay, shapes, softmax  # noqa: E402
from kernels import flash_attention as fa  # noqa: E402

SHAPES = [(1, 4096), (8, 4096), (64, 1024), (4096, 1024)]
# [B, H, N, D]: one 128-token sequence at both head dims, a batch of eight, one tiny head.
ATTENTION_SHAPES = [(1, 16, 128, 128), (1, 16, 128, 64), (8, 16, 128, 128), (1, 1, 16, 64)]
OPS = ("rms_norm", "layer_norm", "softmax", "attention")
ROUNDS = 3
PATHS = ("python", "c++", "torch")


def loop_us(fn, clock, calls: int = 200, loops: int = 7) -> float:
    """µs per call of ``fn`` by ``clock``: the least of ``loops`` loops of ``calls`` calls."""
    return min(shapes.host_loops(fn, calls, loops, clock)) * 1e3


def device_us(fn) -> float:
    return bench.measure(fn, device_only=True, warmup_ms=10, rep_ms=40).ms * 1e3


def ops(kind: str, shape: tuple):
    """(ours, PyTorch's) forward callables and their inputs, bf16."""
    if kind == "attention":  # q, k, v in the places of x, weight, bias
        q, k, v, do = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        return (fa.attention, sdpa, q, k, v, do)
    rows, cols = shape
    x, w, b, dy = norms.make_inputs(rows, cols, torch.bfloat16)
    if kind == "rms_norm":
        return (lambda x, w, b: norms.rms_norm(x, w),
                lambda x, w, b: torch.nn.functional.rms_norm(x, (cols,), w, 1e-6), x, w, None, dy)  # fmt: skip
    if kind == "layer_norm":
        return (lambda x, w, b: norms.layer_norm(x, w, b),
                lambda x, w, b: torch.nn.functional.layer_norm(x, (cols,), w, b, 1e-5), x, w, b, dy)  # fmt: skip
    return (lambda x, w, b: softmax.softmax(x),
            lambda x, w, b: torch.softmax(x, dim=-1), x * 4, None, None, dy)  # fmt: skip


def callables(kind: str, shape: tuple, backward: bool) -> dict:
    ours, theirs, x, w, b, dy = ops(kind, shape)
    if not backward:

        def nograd(f):
            def call():
                with torch.no_grad():
                    return f(x, w, b)

            return call

        return {"ours": nograd(ours), "torch": nograd(theirs)}
    leaves = [t.requires_grad_() for t in (x, w, b) if t is not None]
    return {
        "ours": lambda: shapes.grad_call(lambda: ours(x, w, b), leaves, dy),
        "torch": shapes.grad_call(lambda: theirs(x, w, b), leaves, dy),
    }


def measure(kind, shape, backward) -> dict:
    res: dict = {}
    fns = callables(kind, shape, backward)
    order = list(PATHS)
    for rnd in range(ROUNDS):
        for path in order[rnd % 3 :] + order[: rnd % 3]:
            replay.ON = path == "c++"
            # The backward's graph is made by the path in force when its forward runs.
            fn = fns["torch"] if path == "torch" else (fns["ours"]() if backward else fns["ours"])
            fn()  # a layout's first call plans it
            fn = fns["torch"] if path == "torch" else (fns["ours"]() if backward else fns["ours"])
            res.setdefault(("wall", path), []).append(loop_us(fn, time.perf_counter))
            res.setdefault(("cpu", path), []).append(loop_us(fn, time.process_time))
            res.setdefault(("dev", path), []).append(device_us(fn))
    replay.ON = True
    return {k: min(v) for k, v in res.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    args = parser.parse_args(argv)
    assert replay.enabled(), "the C++ launch path did not build here"
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"bf16; least of {ROUNDS} rounds; µs per call")
    head = " ".join(f"{p:>7s}" for p in PATHS)
    print(f"{'case':30s} wall: {head} | CPU: {head} | device: {head}")
    for backward in (False, True):
        for kind in args.ops:
            for shape in ATTENTION_SHAPES if kind == "attention" else SHAPES:
                m = measure(kind, shape, backward)
                name = f"{kind}_{'bwd' if backward else 'fwd'} {'x'.join(map(str, shape))}"
                cells = [
                    " ".join(f"{m[clock, p]:7.1f}" for p in PATHS)
                    for clock in ("wall", "cpu", "dev")
                ]
                print(
                    f"{name:30s}       {cells[0]} |      {cells[1]} |         {cells[2]}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
