"""Why one case of the shapes sweep is slow: the sweep's timing against the device and host times.

The sweep times a case with ``triton.testing.do_bench``, which queues an L2 flush (about 100 µs of
GPU work) ahead of every timed call, so a call's host time shows only where it outlasts the flush.
For a host-bound case (a backward through autograd at a few rows, say) that makes the recorded
speed-up the small difference of two host times, each about as long as the flush. This probe takes
the cases named on the command line from ``kernels.shapes.cases`` and times each side ROUNDS
times, in alternation, four ways:

- ``sweep``: as the sweep does (``bench.measure`` with the sweep's ``TIMING``);
- ``device``: the kernels alone, host kept out (``bench.measure(device_only=True)``);
- ``cpu``: CPU µs per call of every thread (``time.process_time``), least of 5 loops of 200 calls;
- ``wall``: wall µs per call of 200 back-to-back calls (what a model's eager step pays), median of 5.

    python scripts/gpu/slow_case_probe.py layer_norm_bwd:8x1024:float16 [more op:RxC:dtype ...]
"""

# ruff: noqa: B023  (each closure is timed before its loop variables change)
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout
from kernels import bench, device, shapes  # noqa: E402

ROUNDS = 5


def find(spec: str) -> shapes.Case:
    """The sweep's case ``op:RxC:dtype`` (shape dimensions separated by x)."""
    op, shape, dtype = spec.split(":")
    want = [int(d) for d in shape.split("x")]
    for case in shapes.cases(quick=not device.GPU_MODE):
        if case.op == op and list(case.shape) == want and bench.dtype_name(case.dtype) == dtype:
            return case
    raise SystemExit(f"no case {spec!r} in kernels.shapes.cases")


def times(fn) -> dict[str, float]:
    """µs per call of ``fn``, four ways (see the module's docstring)."""
    return {
        "sweep": bench.measure(fn, **shapes.TIMING).ms * 1e3,
        "device": bench.measure(fn, device_only=True, **shapes.TIMING).ms * 1e3,
        "cpu": min(shapes.host_loops(fn, 200, 5, time.process_time)) * 1e3,
        "wall": sorted(shapes.host_loops(fn, 200, 5))[2] * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("cases", nargs="+", help="op:RxC:dtype, as in the sweep's log")
    args = p.parse_args()
    print(device.describe())
    for spec in args.cases:
        case = find(spec)
        ours, theirs, *config = case.setup()
        print(f"\n{spec} against {case.baseline}: µs per call, {ROUNDS} rounds (ours / torch)")
        print(f"  {'round':>5s}" + "".join(f"{k:>16s}" for k in ("sweep", "device", "cpu", "wall")))
        for r in range(ROUNDS):
            a, b = times(ours), times(theirs)
            cells = "".join(f"{a[k]:8.1f}/{b[k]:<7.1f}" for k in a)
            ratio = b["sweep"] / a["sweep"]
            print(f"  {r + 1:5d}{cells}  sweep speed-up {ratio:.2f}")
        if config:  # what ours ran (a case that tunes itself)
            print(f"  ours ran: {config[0]()}")


if __name__ == "__main__":
    main()
