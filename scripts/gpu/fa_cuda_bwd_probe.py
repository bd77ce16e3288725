"""The CUDA warp-specialised FlashAttention backward (kernels/cuda/fa_ws_bwd.py) timed on a Hopper GPU
against the course's two Triton kernels and cuDNN's backward, at the flash_attention benchmark's
shapes (bf16, d = 128, 16 heads, 16k tokens per batch), causal and not, with issue 19's goal checked
(>= 0.85x cuDNN's backward). Correctness is tests/test_fa_ws_bwd.py's, and compute-sanitizer's
(scripts/gpu/sanitize_all.py, step hopper_attention).

    python scripts/gpu/fa_cuda_bwd_probe.py                 # the table (about a minute on an H100)
    python scripts/gpu/fa_cuda_bwd_probe.py --out r.jsonl   # also the records, one line per case
    python scripts/gpu/fa_cuda_bwd_probe.py --schedules     # fa_ws_bwd.VARIANTS against each other

``--schedules`` first checks every schedule of the loop against the first (dK and dV bit for bit, dQ
up to rounding) and an fp32 reference at odd lengths, then times them and cuDNN in three interleaved
rounds at 2,048-8,192 tokens and prints the medians (about three minutes on an H100).

Every implementation differentiates the same output: o and lse from kernels.cuda.fa_ws.attention
(the Triton backward reads lse in the same log2 units), and cuDNN its own forward's graph, kept
with retain_graph. TFLOP/s credit the backward with 2.5 times the forward's FLOPs (five matmuls
against two); kernels.bench.measure, L2 flushed, median.
"""

import argparse
import functools
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fa_forward_timing import DTYPE, SEQS, D, inputs, shape_for  # noqa: E402

from kernels import bench, device  # noqa: E402
from kernels import flash_attention as fa  # noqa: E402
from kernels.cuda import fa_ws, fa_ws_bwd  # noqa: E402

GOAL, GOAL_MIN_N = 0.85, 4096  # issue 19: backward >= 0.85x cuDNN's at N >= 4096


def backwards(q, k, v, do, causal: bool) -> dict:
    """name -> a zero-argument call computing (dq, dk, dv) of the same attention."""
    o, lse = fa_ws.attention(q, k, v, causal=causal)
    calls = {
        "cuda-ws": functools.partial(fa_ws_bwd.backward, q, k, v, o, lse, do, causal),
        "course": functools.partial(fa._backward, q, k, v, o, lse, do, causal, 1 / math.sqrt(D)),
    }
    if fa.sdpa_available("cudnn", DTYPE, D):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = fa.sdpa(*leaves, causal, "cudnn")
        calls["sdpa-cudnn"] = lambda: torch.autograd.grad(out, leaves, do, retain_graph=True)
    return calls


def check_schedules() -> None:
    """Every schedule against the first and against fp32 autograd, at lengths that end mid-tile."""
    for b, h, n in [(2, 3, 264), (1, 2, 1000), (1, 1, 77)]:
        q, k, v = inputs((b, h, n, D), seed=n)
        do = torch.randn_like(q)
        for causal in (False, True):
            o, lse = fa_ws.attention(q, k, v, causal=causal)
            first = fa_ws_bwd.backward(q, k, v, o, lse, do, causal, variant=0)
            leaves = [t.float().requires_grad_() for t in (q, k, v)]
            fa_ws.attention_ref(*leaves, causal=causal)[0].backward(do.float())
            for variant in fa_ws_bwd.VARIANTS:
                got = fa_ws_bwd.backward(q, k, v, o, lse, do, causal, variant=variant)
                assert torch.equal(got[1], first[1]) and torch.equal(got[2], first[2]), variant
                torch.testing.assert_close(got[0].float(), first[0].float(), rtol=1e-2, atol=1e-3)
                for grad, leaf in zip(got, leaves):
                    err = (grad.float() - leaf.grad).norm() / leaf.grad.norm().clamp_min(1e-3)
                    assert err < 2e-2, (variant, b, h, n, causal, err.item())
    print(f"schedules {fa_ws_bwd.VARIANTS}: dK, dV equal to schedule 0's, all within 2e-2 of fp32")


def time_schedules(rounds: int = 3) -> None:
    """The schedules and cuDNN's backward, timed in interleaved rounds (medians)."""
    print(f"\n== fa_ws_bwd schedules: median of {rounds} rounds, us (x cuDNN, x schedule 0) ==")
    for n in (2048, 4096, 8192):
        shape = shape_for(n)
        q, k, v = inputs(shape, seed=1)
        do = torch.randn_like(q)
        for causal in (False, True):
            calls = backwards(q, k, v, do, causal)
            o, lse = fa_ws.attention(q, k, v, causal=causal)
            runs = {f"s{var}": functools.partial(fa_ws_bwd.backward, q, k, v, o, lse, do, causal,
                                                 variant=var)
                    for var in fa_ws_bwd.VARIANTS}  # fmt: skip
            if "sdpa-cudnn" not in calls:
                raise SystemExit("cuDNN's attention is not available here")
            runs["cudnn"] = calls["sdpa-cudnn"]
            times = {name: [] for name in runs}
            for _ in range(rounds):
                for name, call in runs.items():
                    times[name].append(bench.measure(call).ms * 1e3)
            us = {name: statistics.median(t) for name, t in times.items()}
            cells = "  ".join(f"{name} {us[name]:.0f} ({us['cudnn'] / us[name]:.3f}, "
                              f"{us['s0'] / us[name]:.3f})" for name in runs if name != "cudnn")  # fmt: skip
            print(f"  {str(list(shape)):<18} causal={causal!s:<5} cudnn {us['cudnn']:.0f}  {cells}",
                  flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="append the timing records (JSON Lines) to this file")
    parser.add_argument("--schedules", action="store_true", help="compare fa_ws_bwd.VARIANTS")
    args = parser.parse_args()
    print(device.describe())
    reason = fa_ws.unavailable_reason()
    if reason:
        raise SystemExit(reason)
    if args.schedules:
        check_schedules()
        time_schedules()
        return
    print(
        f"\n== backward timings (bf16, d={D}, 16 heads, 16k tokens; TFLOP/s = 2.5 x fwd_flops) =="
    )
    print(
        f"  {'N':>6} {'causal':<6} {'cuda-ws':>9} {'course':>9} {'cudnn':>9}   ws/cudnn  ws/course"
    )
    missed = []
    for n in SEQS:
        shape = shape_for(n)
        q, k, v = inputs(shape, seed=n)
        do = torch.randn_like(q)
        for causal in (False, True):
            flops = 2.5 * fa.fwd_flops(*shape[:3], n, D, causal)
            ms = {name: bench.measure(call, flops=flops)
                  for name, call in backwards(q, k, v, do, causal).items()}  # fmt: skip
            tf = {name: m.tflops for name, m in ms.items()}
            vs_cudnn = tf["cuda-ws"] / tf["sdpa-cudnn"] if "sdpa-cudnn" in tf else None
            print(f"  {n:>6} {causal!s:<6} {tf['cuda-ws']:>9.1f} {tf['course']:>9.1f} "
                  f"{tf.get('sdpa-cudnn', float('nan')):>9.1f}   "
                  f"{vs_cudnn if vs_cudnn else float('nan'):>8.3f}  "
                  f"{tf['cuda-ws'] / tf['course']:>9.3f}", flush=True)  # fmt: skip
            if n >= GOAL_MIN_N and vs_cudnn is not None and vs_cudnn < GOAL:
                missed.append(f"N={n} causal={causal} ({vs_cudnn:.3f}x)")
            if args.out:
                tag = "-bwd" + ("-causal" if causal else "")
                base = ("sdpa-cudnn" + tag, ms["sdpa-cudnn"]) if "sdpa-cudnn" in ms else None
                with open(args.out, "a") as f:
                    for name, m in ms.items():
                        rec = bench.record("flash_attention_cuda_ws", name + tag, shape, DTYPE, m,
                                           baseline=base if name == "cuda-ws" else None)  # fmt: skip
                        f.write(json.dumps(rec) + "\n")
    print(f"\n  goal (issue 19): cuda-ws >= {GOAL}x cuDNN's backward at N >= {GOAL_MIN_N}")
    print("  MISSED at " + ", ".join(missed) if missed else "  MET at every N >= 4096")


if __name__ == "__main__":
    main()
