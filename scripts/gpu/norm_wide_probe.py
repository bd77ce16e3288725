"""The norms' Triton kernels for wide rows (65,536 columns and more), on the device alone.

Two questions, both at the widths where rows no longer fit one program's registers:

- the looped forward (a statistics pass, then a normalise pass that re-reads the row): how much
  of the copy bandwidth does it reach with other column chunks, warps and programs per SM? The
  2026-12-06 shapes sweep had LayerNorm's forward at 4,096 x 65,536 at 0.66 of copy in bf16 and
  fp16, which is what a row read twice from memory allows (three passes where two would do). (The
  run in results/profiles/2026-12-06-nvidia-h100-80gb-hbm3-norm-wide.txt also tried 2 and 4 rows at
  a time, with a kernel variant kept on branch s22-looped-block-m: no better.)
- the two-step backward (row sums, then dx by column chunks): its time with the row sums split
  over column chunks (the library's now) against ``--old MODULE``, a copy of kernels/norms.py from
  before (the row sums one program a row: at 64 rows, 64 programs on a 132-SM GPU).

Every forward setting's output is checked against the library's default first. Times are device
µs (``bench.measure(device_only=True)``: the L2 flushed before each call, the host's launch cost
kept out); fractions are of the measured copy bandwidth, counting each tensor once (forward: read
x, write y; backward: read x and dy, write dx). The Hopper cluster kernels are turned off
(``GPU_BRRR_CLUSTER_ROWS=0``) so that the Triton kernels are what runs.

    GPU_BRRR_CLUSTER_ROWS=0 python scripts/gpu/norm_wide_probe.py [--old kernels.norms_old] [--smoke]
"""

# ruff: noqa: B023  (each closure is timed before its loop variables change)
from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout
from kernels import bench, device, norms, roofline, shapes  # noqa: E402
from kernels.launch import sm_count  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FWD_SHAPE, SMOKE_FWD = (4096, 65536), (6, 300)
BWD_SHAPES = [(1, 65536), (64, 65536), (4096, 65536), (512, 16384)]
SMOKE_BWD = [(1, 300), (5, 300)]
# (BLOCK_N, warps, programs per SM) of the looped forward; the library's first.
FWD_SETTINGS = [
    (norms.LOOP_BLOCK, norms.LOOP_WARPS, norms.LOOP_PROGRAMS_PER_SM),
    (4096, 16, 1),
    (4096, 16, 3),
    (2048, 8, 2),
    (2048, 8, 4),
    (8192, 16, 2),
]


def device_us(fn) -> float:
    return bench.measure(fn, device_only=True, **shapes.TIMING).ms * 1e3


def forward_table(smoke: bool, copy_gbps: float) -> None:
    rows, cols = SMOKE_FWD if smoke else FWD_SHAPE
    for dtype in DTYPES:
        x, w, b, _ = norms.make_inputs(rows, cols, dtype)
        nbytes = 2 * x.numel() * x.element_size()
        base = norms.fwd_config(rows, cols, 0 if smoke else norms.MAX_FUSED_BLOCK)
        ref, *_ = norms._forward(x, w, b, 1e-5, False, base)
        print(f"\nlayer_norm fwd {rows} x {cols} {bench.dtype_name(dtype)} (looped kernel)")
        print(f"  {'BLOCK_N':>7s} {'warps':>5s} {'per SM':>6s} {'µs':>8s} {'copy':>6s}")
        for block_n, warps, per_sm in FWD_SETTINGS:
            programs = min(per_sm * sm_count(interpreter=2), rows)
            cfg = dict(base, BLOCK_N=block_n, num_warps=warps, programs=programs)
            y, *_ = norms._forward(x, w, b, 1e-5, False, cfg)
            # Another chunk width sums in another order: a rounding of the output apart at most.
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(y.float(), ref.float(), rtol=tol, atol=tol)
            us = device_us(lambda cfg=cfg: norms._forward(x, w, b, 1e-5, False, cfg, stats=False))
            frac = nbytes / (us * 1e-6) / 1e9 / copy_gbps
            print(f"  {block_n:7d} {warps:5d} {per_sm:6d} {us:8.1f} {frac:6.3f}")


def backward_table(smoke: bool, copy_gbps: float, old) -> None:
    for rows, cols in SMOKE_BWD if smoke else BWD_SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            x, w, b, dy = norms.make_inputs(rows, cols, dtype)
            nbytes = 3 * x.numel() * x.element_size()
            line = f"  {rows:5d} x {cols:<6d} {bench.dtype_name(dtype):9s}"
            for kind, bias in (("rms", None), ("layer", b)):
                is_rms = bias is None
                _, mean, rstd = norms._forward(x, w, bias, 1e-5, is_rms)
                mods = [norms] + ([old] if old else [])
                grads = []
                for i, mod in enumerate(mods):
                    cfg = mod.bwd_config(rows, cols, 0)
                    grads.append(mod._backward(dy, x, w, mean, rstd, not is_rms, cfg))
                    us = device_us(
                        lambda mod=mod, cfg=cfg: mod._backward(
                            dy, x, w, mean, rstd, not is_rms, cfg
                        )
                    )
                    line += f" {kind}{' old' if i else ''} {us:8.1f} µs"
                    line += f" {nbytes / (us * 1e-6) / 1e9 / copy_gbps:5.3f}"
                for g_new, g_old in zip(grads[0], grads[-1]):
                    if g_new is not None:
                        tol = 1e-5 if dtype == torch.float32 else 2e-2
                        torch.testing.assert_close(g_new.float(), g_old.float(), rtol=tol, atol=tol)
            print(line)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--old", default=None, help="module with the norms code to compare against")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (the CPU test)")
    p.add_argument("--only", choices=("fwd", "bwd"), default=None)
    args = p.parse_args()
    if device.GPU_MODE and os.environ.get("GPU_BRRR_CLUSTER_ROWS") != "0":
        print("note: GPU_BRRR_CLUSTER_ROWS=0 is not set; the cluster kernels may run instead")
    old = importlib.import_module(args.old) if args.old else None
    copy_gbps = roofline.copy_bandwidth().value
    print(device.describe())
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; device µs, L2 flushed before each call")
    if args.only in (None, "fwd"):
        forward_table(args.smoke, copy_gbps)
    if args.only in (None, "bwd"):
        print("\ntwo-step backward (dx, dw, db; copy fraction counts x, dy, dx once)")
        backward_table(args.smoke, copy_gbps, old)


if __name__ == "__main__":
    main()
