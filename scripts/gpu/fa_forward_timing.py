"""What the two FlashAttention forward probes share (scripts/gpu/fa_ws_probe.py for the Triton
warp-specialised experiment, scripts/gpu/fa_cuda_probe.py for the CUDA kernel): the benchmark's
shapes and inputs, SDPA's backends as rivals, and the forward timing table with issue 19's goal.

Timings: kernels.bench.measure (L2 flushed, median), the same random inputs for every
implementation of a case, TFLOP/s from flash_attention.fwd_flops.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout
from kernels import bench, device  # noqa: E402
from kernels import flash_attention as fa  # noqa: E402

DTYPE = torch.bfloat16
HEADS, D = 16, 128
SEQS = [1024, 2048, 4096, 8192, 16384]
GOAL, GOAL_MIN_N = 0.9, 4096  # issue 19: >= 0.9x cuDNN's forward from N = 4096 on, d = 128


def shape_for(n: int, heads: int = HEADS, d: int = D) -> tuple[int, int, int, int]:
    """16k tokens per batch, as the flash_attention benchmark uses."""
    return (max(1, 16384 // n), heads, n, d)


def inputs(shape, seed=0, dtype=DTYPE):
    g = torch.Generator(device=device.DEVICE).manual_seed(seed)
    return tuple(
        torch.randn(shape, device=device.DEVICE, dtype=dtype, generator=g) for _ in range(3)
    )


def sdpa_impls() -> dict[str, Callable]:
    """SDPA's cuDNN and FlashAttention-2 backends, where they run here."""
    return {
        f"sdpa-{b}": functools.partial(fa.sdpa, backend=b)
        for b in ("cudnn", "flash")
        if fa.sdpa_available(b, DTYPE, D)
    }


def forward_timings(
    fns: dict[str, Callable],
    ratios: list[tuple[str, str, str]],
    bench_name: str,
    baselined: Callable[[str], bool],
    out_path: str | None = None,
    seqs: list[int] = SEQS,
    heads: int = HEADS,
    note: Callable[[], str] | None = None,
) -> list[dict]:
    """Times every implementation at every N of ``seqs``, causal and not, and prints one row per
    case: TFLOP/s of each, then the ``ratios`` (label, numerator, denominator: TFLOP/s over
    TFLOP/s). The first ratio is the one the goal is checked on (the kernel over cuDNN). Records
    (``bench_name``, variant = name + "-fwd[-causal]") are returned and written to ``out_path``;
    those whose name ``baselined`` accepts carry cuDNN's time as their baseline. ``note()`` adds a
    last cell to each row (the autotuner's tile, say)."""
    names = list(fns)
    print(
        f"\n== forward timings (bf16, d={D}, {heads} heads, 16k tokens; TFLOP/s from fwd_flops) =="
    )
    print("  " + f"{'N':>6} {'causal':<6} " + " ".join(f"{n:>11}" for n in names) + "   "
          + "  ".join(f"{label:>8}" for label, _, _ in ratios))  # fmt: skip
    rows, missed = [], []
    goal_label, goal_num, goal_den = ratios[0]
    for n in seqs:
        shape = shape_for(n, heads)
        q, k, v = inputs(shape, seed=n)
        for causal in (False, True):
            flops = fa.fwd_flops(*shape[:3], n, D, causal)
            with torch.no_grad():
                ms = {name: bench.measure(functools.partial(fn, q, k, v, causal), flops=flops)
                      for name, fn in fns.items()}  # fmt: skip
            got = {
                label: ms[a].tflops / ms[b].tflops for label, a, b in ratios if a in ms and b in ms
            }
            cells = " ".join(f"{ms[name].tflops:>11.1f}" for name in names)
            cols = "  ".join(f"{got[label]:>8.3f}" if label in got else f"{'-':>8}"
                             for label, _, _ in ratios)  # fmt: skip
            print(
                f"  {n:>6} {causal!s:<6} {cells}   {cols}{'  ' + note() if note else ''}",
                flush=True,
            )
            if n >= GOAL_MIN_N and got.get(goal_label, 0.0) < GOAL:
                missed.append((n, causal, got.get(goal_label)))
            tag = "-fwd" + ("-causal" if causal else "")
            base = (goal_den, ms[goal_den]) if goal_den in ms else None
            for name, m in ms.items():
                rows.append(bench.record(bench_name, name + tag, shape, DTYPE, m,
                                         baseline=base if baselined(name) else None))  # fmt: skip
    print(
        f"\n  goal (issue 19): {goal_num} >= {GOAL}x {goal_den} forward at N >= {GOAL_MIN_N}, d = {D}"
    )
    if goal_den not in fns:
        print(f"  {goal_den} does not run here: goal not checked")
    elif missed:
        print("  MISSED at " + ", ".join(f"N={n} causal={c} ({r:.3f}x)" for n, c, r in missed))
    else:
        print(f"  MET at every N >= {GOAL_MIN_N}, causal and not")
    if out_path:
        with open(out_path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        print(f"  {len(rows)} records written to {out_path}")
    return rows
