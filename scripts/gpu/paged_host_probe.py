"""Where ``paged_decode``'s host time goes at batch 1, piece by piece, against PyTorch's SDPA.

At batch 1 and 1,024 tokens the kernels take about 13 µs on an H100, level with SDPA's, but a call
cost 62-70 µs of CPU time against SDPA's 44-46 (results/profiles/2026-12-06-*-slow-cases.txt).
This probe times, in one process, the whole call (from C++ through ``kernels.replay`` where it
is built, as a decode step gets it after a layout's first call; with ``--splits`` the Python
path), the Python path's whole call, and each step of the Python path alone: the layout key, the
plan lookup, the checks of the scale and of debug mode, the allocations (the output, and one fp32
buffer for the partial outputs and their log-sum-exps), the split kernel's launch and the combine
kernel's launch. Each row is CPU µs per call (``time.process_time``, least of 5 loops of
``--calls`` back-to-back calls, a synchronize after each loop); the steps' sum against the Python
path's whole call says what is left (Python's own calls and attribute lookups).

    python scripts/gpu/paged_host_probe.py [--smoke] [--calls 500] [--splits N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout
from kernels import _validate, device, launch, replay, shapes  # noqa: E402
from kernels import paged_attention as pa  # noqa: E402


def cpu_us(fn, calls: int) -> float:
    return min(shapes.host_loops(fn, calls, 5, time.process_time)) * 1e3


def steps(batch: int, seq: int, dtype: torch.dtype, splits: int | None) -> tuple[dict, object]:
    """(label -> zero-argument callable: the whole call, its steps alone, SDPA; the plan)."""
    q, k, v, kc, vc, table, lens = pa.decode_case(batch, seq, dtype=dtype)

    def ours():
        return pa.paged_decode(q, kc, vc, table, lens, num_splits=splits)

    def python_path():
        replay.ON = False
        try:
            return pa.paged_decode(q, kc, vc, table, lens, num_splits=splits)
        finally:
            replay.ON = True

    got = ours()  # plans the layout (and tunes the kernel)
    torch.testing.assert_close(ours(), got, rtol=0, atol=0)  # from C++ where it is built
    tol = 2e-2 if dtype.itemsize == 2 else 1e-4  # 16-bit: a few steps of bf16's precision
    torch.testing.assert_close(got.float(), pa.sdpa_decode(q, k, v).float(), rtol=tol, atol=tol)
    key = launch.layout_key((q, kc, vc, table, lens), splits, None)
    plan = pa._PLANS.get(key)
    assert plan is not None and plan.grid is not None, "the call above planned this layout"
    dev = q.device
    o_dst = torch.empty(max(plan.part_numel, 1), device=dev, dtype=torch.float32)
    scale = _validate.sm_scale(None, q.shape[2])
    split_args = (q, kc, vc, table, lens, o_dst if plan.part_shape else got, scale)
    split_args += plan.sizes
    split = launch.tuned(pa._paged_decode_split_kernel)

    def allocs():
        torch.empty(plan.out_shape, device=dev, dtype=q.dtype)
        if plan.part_shape is not None:
            torch.empty(plan.part_numel, device=dev, dtype=torch.float32)

    fns = {
        "paged_decode, whole call": ours,
        "paged_decode, Python path, whole": python_path,
        "layout key (5 tensors)": lambda: launch.layout_key((q, kc, vc, table, lens), splits, None),
        "plan lookup": lambda: pa._PLANS.get(key),
        "settings checks": lambda: (pa._check_num_splits(None), pa._check_config(None)),
        "sm_scale + debug-mode test": lambda: (
            _validate.sm_scale(None, q.shape[2]),
            _validate.check_values(table, lens),
        ),
        "allocations": allocs,
        "split kernel launch": lambda: split.keyed(key, plan.grid, split_args, **plan.meta),
    }
    if plan.part_shape is not None:
        cargs = (o_dst, torch.empty_like(q), plan.part_shape[2])
        grid = (plan.out_shape[0] * plan.out_shape[1],)
        fns["combine kernel launch"] = lambda: pa._COMBINE(key, grid, cargs, **plan.combine_meta)
    fns["SDPA (PyTorch), whole call"] = lambda: pa.sdpa_decode(q, k, v)
    fns["a Python call that does nothing"] = lambda: None
    return fns, plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny case, few calls (CPU interpreter)")
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--splits", type=int, help="num_splits (default: the library's)")
    args = p.parse_args(argv)
    batch, seq, calls = (1, 64, 2) if args.smoke else (1, 1024, args.calls)
    splits = 2 if args.smoke else args.splits  # the smoke run launches the combine kernel too
    dtype = torch.float32 if args.smoke else torch.bfloat16
    print(device.describe().splitlines()[0])
    fns, plan = steps(batch, seq, dtype, splits)
    splits = plan.part_shape[2] if plan.part_shape else 1
    print(f"paged_decode batch {batch}, {seq} tokens, {dtype}: {splits} splits; CPU µs per call")
    res = {label: cpu_us(fn, calls) for label, fn in fns.items()}
    for label, us in res.items():
        print(f"  {label:34s} {us:8.1f}")
    parts = [k for k in res if "whole" not in k and k != "a Python call that does nothing"]
    total = sum(res[k] for k in parts)
    print(f"  {'sum of the steps':34s} {total:8.1f}")
    left = res["paged_decode, Python path, whole"] - total
    print(f"  {'Python path - sum of the steps':34s} {left:8.1f}")
    print(f"  (the whole call from C++: {replay.enabled() and args.splits is None})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
