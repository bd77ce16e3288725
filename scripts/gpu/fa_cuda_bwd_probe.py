"""The CUDA warp-specialised FlashAttention backward (kernels/cuda/fa_ws_bwd.py) timed on a Hopper GPU
against the course's two Triton kernels and cuDNN's backward, at the flash_attention benchmark's
shapes (bf16, d = 128, 16 heads, 16k tokens per batch), causal and not, with issue 19's goal checked
(>= 0.85x cuDNN's backward). Correctness is tests/test_fa_ws_bwd.py's, and compute-sanitizer's
(scripts/gpu/sanitize_all.py, step hopper_attention).

    python scripts/gpu/fa_cuda_bwd_probe.py                 # the table (about a minute on an H100)
    python scripts/gpu/fa_cuda_bwd_probe.py --out r.jsonl   # also the records, one line per case

Every implementation differentiates the same output: o and lse from kernels.cuda.fa_ws.attention
(the Triton backward reads lse in the same log2 units), and cuDNN its own forward's graph, kept
with retain_graph. TFLOP/s credit the backward with 2.5 times the forward's FLOPs (five matmuls
against two); kernels.bench.measure, L2 flushed, median.
"""

import argparse
import functools
import json
import math
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="append the timing records (JSON Lines) to this file")
    args = parser.parse_args()
    print(device.describe())
    reason = fa_ws.unavailable_reason()
    if reason:
        raise SystemExit(reason)
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
