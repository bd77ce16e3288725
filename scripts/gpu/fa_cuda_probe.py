"""The CUDA warp-specialised FlashAttention forward (kernels/cuda/fa_ws.py) on a Hopper GPU, in one
command: correctness in bf16 at head dim 128 against an fp32 reference and the course's Triton
forward, compute-sanitizer on a small case, then timings against the Triton forward and cuDNN's
SDPA with issue 19's goal checked.

    python scripts/gpu/fa_cuda_probe.py               # everything (a few minutes on an H100)
    python scripts/gpu/fa_cuda_probe.py --check       # correctness only
    python scripts/gpu/fa_cuda_probe.py --sanitize    # also memcheck and synccheck a small case
    python scripts/gpu/fa_cuda_probe.py --out r.jsonl # also write the timing records there

Timings (kernels.bench.measure, L2 flushed, median) use the same inputs for every implementation:
"cuda-ws-plain" (this kernel's default schedule, each product waited for in turn),
"cuda-ws-overlap" (FlashAttention-3's overlapped schedule), "course" (flash_attention.attention, Triton) and SDPA's cuDNN and
FlashAttention-2 backends where they run. Issue 19's goal: >= 0.9x cuDNN's forward at N >= 4096,
d = 128, causal and not. Records are not appended to results/ until this probe shows the kernel
right.
"""

import argparse
import functools
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fa_forward_timing import SEQS, D, forward_timings, inputs, sdpa_impls, shape_for  # noqa: E402

from kernels import device  # noqa: E402
from kernels import flash_attention as fa  # noqa: E402
from kernels.cuda import fa_ws, hgemm_check  # noqa: E402
from kernels.numerics import rel_error as rel_err  # noqa: E402

CHECK_SEQS = [77, 264, 1001, 4104] + SEQS  # lengths that end mid-tile (N = 1: tests/test_fa_ws.py)
TOL = 3e-2  # relative error: bf16 output and bf16 P before P V
LSE_TOL = 2e-2
SMALL = "SMALL_CASE"  # argv[1] of the child that compute-sanitizer runs


def correctness() -> None:
    print("\n== correctness (bf16, d=128; fp32 reference on the first two heads) ==")
    for n in CHECK_SEQS:
        shape = shape_for(n)
        q, k, v = inputs(shape, seed=n)
        for causal, schedule in ((c, s) for c in (False, True) for s in fa_ws.SCHEDULES):
            o, lse = fa_ws.attention(q, k, v, causal, schedule=schedule)
            sub = (slice(0, 1), slice(0, 2))
            o_ref, lse_ref = fa_ws.attention_ref(q[sub], k[sub], v[sub], causal)
            err_ref = rel_err(o[sub], o_ref)
            o_fa, lse_fa = fa._forward(q, k, v, causal, D**-0.5)
            err_fa = rel_err(o, o_fa)
            lse_diff = (lse - lse_fa).abs().max().item()
            ok = err_ref < TOL and err_fa < TOL and lse_diff < LSE_TOL and not o.isnan().any()
            print(f"  {'ok  ' if ok else 'FAIL'} N={n:<6} causal={causal!s:<5} {schedule:<7} vs fp32 {err_ref:.2e}"
                  f"  vs course {err_fa:.2e}  lse max diff {lse_diff:.1e}", flush=True)  # fmt: skip
            if not ok:
                bad = ((o.float() - o_fa.float()).abs() > 0.1).any(-1)  # [B, H, N] rows
                rows = bad.nonzero()[:, -1]
                print(f"    wrong rows: {bad.float().mean().item():.1%}; row % 128 of them "
                      f"{sorted(set((rows % 128).tolist()))[:16]}; first {rows[:8].tolist()}")  # fmt: skip
                raise SystemExit(f"fa_ws wrong at N={n} causal={causal} schedule={schedule}")


def small_case() -> None:
    """What compute-sanitizer runs: a ragged length, two heads, both masks."""
    q, k, v = inputs((1, 2, 264, D), seed=1)
    for causal in (False, True):
        for schedule in fa_ws.SCHEDULES:
            fa_ws.attention(q, k, v, causal, schedule=schedule)
    torch.cuda.synchronize()


def sanitize() -> None:
    print("\n== compute-sanitizer (N = 264, two heads, causal and not) ==")
    tool = hgemm_check.find_tool("compute-sanitizer")
    if tool is None:
        print("  compute-sanitizer not found: skipped")
        return
    fa_ws._module()  # build outside the sanitizer (the child loads it from torch's cache)
    for check in ("memcheck", "synccheck"):
        proc = subprocess.run(
            [tool, "--tool", check, sys.executable, __file__, SMALL],
            capture_output=True,
            text=True,
            timeout=600,
        )
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:]
        print(f"  {check}: rc={proc.returncode} {tail}", flush=True)
        if proc.returncode != 0:
            print((proc.stdout + proc.stderr)[-3000:])
            raise SystemExit(f"{check} found errors")


def impls() -> dict:
    return {
        "cuda-ws-plain": functools.partial(fa_ws.attention, schedule="plain"),
        "cuda-ws-overlap": functools.partial(fa_ws.attention, schedule="overlap"),
        "cuda-ws-persistent": functools.partial(fa_ws.attention, schedule="persistent"),
        "course": functools.partial(fa.attention, impl="triton"),
        **sdpa_impls(),
    }


def timings(out_path: str | None) -> None:
    # "ws" is the default schedule (plain): against cuDNN (the goal) and the course; then the two
    # schedules against each other.
    ratios = [
        ("ws/cudnn", "cuda-ws-plain", "sdpa-cudnn"),
        ("ws/course", "cuda-ws-plain", "course"),
        ("overlap/plain", "cuda-ws-overlap", "cuda-ws-plain"),
        ("pers/plain", "cuda-ws-persistent", "cuda-ws-plain"),
    ]
    forward_timings(impls(), ratios, "flash_attention_cuda_ws",
                    lambda name: name.startswith("cuda-ws"), out_path)  # fmt: skip


def main() -> None:
    if sys.argv[1:] == [SMALL]:
        small_case()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="correctness only")
    parser.add_argument(
        "--sanitize", action="store_true", help="memcheck and synccheck a small case"
    )
    parser.add_argument("--out", help="write the timing records (JSON Lines) to this file")
    args = parser.parse_args()
    print(device.describe())
    reason = fa_ws.unavailable_reason()
    if reason:
        raise SystemExit(reason)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    correctness()
    if args.sanitize:
        sanitize()
    if not args.check:
        timings(args.out)


if __name__ == "__main__":
    main()
