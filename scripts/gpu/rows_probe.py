"""Host time and kernel time of the row-wise kernels (softmax, norms, vector add) against PyTorch.

Run from a checkout with ``PYTHONPATH`` pointing at it; run it on two checkouts (before and after a
change) on the same GPU to compare. ``--sweep`` also times the looped kernels' launch settings at
width 65,536 (the new code only) and the norms' backward at training shapes.

    python scripts/gpu/rows_probe.py [--sweep] [--label NAME]
"""

# ruff: noqa: B023  (each closure is timed before its loop variable changes)
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout
from kernels import norms, roofline, shapes, softmax, vector_add  # noqa: E402

DEV = "cuda"


def host_us(fn, calls: int = 200) -> float:
    """Host µs per call: kernels.shapes.host_time (median of 5 loops of back-to-back calls)."""
    return shapes.host_time(fn, calls).ms * 1e3


def bench_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50) * 1e3


grad_call = shapes.grad_call


def norm_fns(kind, x, w, b):
    n = x.shape[-1]
    if kind == "rms_norm":
        return (lambda: norms.rms_norm(x, w)), (
            lambda: torch.nn.functional.rms_norm(x, (n,), w, 1e-6)
        )
    return (lambda: norms.layer_norm(x, w, b)), (
        lambda: torch.nn.functional.layer_norm(x, (n,), w, b, 1e-5)
    )


def host_table(label: str) -> list[dict]:
    bf16 = torch.bfloat16
    x = torch.randn(1, 1024, device=DEV, dtype=bf16)
    a = torch.randn(4096, device=DEV, dtype=bf16)
    cases = [
        ("softmax fwd 1x1024 bf16", lambda: softmax.softmax(x), lambda: torch.softmax(x, -1)),
        ("add 4096 bf16", lambda: vector_add.add(a, a), lambda: torch.add(a, a)),
    ]
    xs = torch.randn(1, 1024, device=DEV, dtype=bf16)
    dys = torch.randn_like(xs)
    cases.append(
        (
            "softmax bwd 1x1024 bf16",
            grad_call(lambda: softmax.softmax(xs), [xs], dys),
            grad_call(lambda: torch.softmax(xs, -1), [xs], dys),
        )
    )
    for kind in ("rms_norm", "layer_norm"):
        xn, w, b, dy = norms.make_inputs(1, 4096, bf16, dev=DEV)
        ours, theirs = norm_fns(kind, xn, w, b)
        cases.append((f"{kind} fwd 1x4096 bf16", ours, theirs))
        leaves = [xn, w] + ([b] if kind == "layer_norm" else [])
        cases.append(
            (
                f"{kind} bwd 1x4096 bf16",
                grad_call(ours, leaves, dy),
                grad_call(theirs, leaves, dy),
            )
        )
    out = []
    for name, ours, theirs in cases:
        r = dict(label=label, case=name, ours_host_us=host_us(ours), torch_host_us=host_us(theirs))
        r["ours_bench_us"], r["torch_bench_us"] = bench_us(ours), bench_us(theirs)
        out.append(r)
    # The table: do_bench (L2 flushed) at model shapes.
    for name, shape, dt in [
        ("softmax fwd", (64, 4096), torch.float32),
        ("softmax fwd", (4096, 1024), torch.float16),
        ("layer_norm fwd", (4096, 1024), torch.float16),
        ("layer_norm bwd", (4096, 1024), torch.float16),
        ("layer_norm bwd", (4096, 8192), torch.float16),
        ("rms_norm bwd", (4096, 8192), torch.bfloat16),
        ("rms_norm bwd", (65536, 4096), torch.bfloat16),
        ("layer_norm bwd", (16384, 8192), torch.bfloat16),
    ]:
        if name.startswith("softmax"):
            xx = torch.randn(*shape, device=DEV, dtype=dt)
            ours, theirs = (lambda: softmax.softmax(xx)), (lambda: torch.softmax(xx, -1))
        else:
            kind = name.split()[0]
            xn, w, b, dy = norms.make_inputs(*shape, dt, dev=DEV)
            ours, theirs = norm_fns(kind, xn, w, b)
            if name.endswith("bwd"):
                leaves = [xn, w] + ([b] if kind == "layer_norm" else [])
                ours, theirs = grad_call(ours, leaves, dy), grad_call(theirs, leaves, dy)
        out.append(
            dict(
                label=label,
                case=f"{name} {shape[0]}x{shape[1]} {str(dt)[6:]}",
                ours_bench_us=bench_us(ours),
                torch_bench_us=bench_us(theirs),
            )
        )
    return out


def kernel_count(label: str) -> dict:
    """Kernels launched by one LayerNorm backward (fp16, 4096 x 1024) through autograd."""
    xn, w, b, dy = norms.make_inputs(4096, 1024, torch.float16, dev=DEV)
    call = grad_call(lambda: norms.layer_norm(xn, w, b), [xn, w, b], dy)
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return dict(label=label, case="layer_norm bwd kernels", kernels=names)


def sweep() -> list[dict]:
    """Width 65,536: the looped kernels' chunk, warps and programs per SM, as fractions of copy."""
    copy = roofline.copy_bandwidth().value
    out = []
    for dt in (torch.bfloat16, torch.float32):
        rows = 4096
        x = torch.randn(rows, 65536, device=DEV, dtype=dt)
        nbytes = 2 * x.numel() * x.element_size()

        def frac(fn):
            return nbytes / (triton.testing.do_bench(fn, warmup=5, rep=30) * 1e-3) / 1e9 / copy

        res = {"torch": frac(lambda: torch.softmax(x, -1))}
        res["fused 2^17"] = frac(lambda: softmax.softmax(x, max_fused_block=2**17))
        for block, warps in ((4096, 8), (8192, 16), (16384, 16)):
            for pps in (1, 2, 64):
                softmax.LOOP_BLOCK, softmax.LOOP_WARPS, softmax.LOOP_PROGRAMS_PER_SM = (
                    block,
                    warps,
                    pps,
                )
                softmax._PLANS.clear()
                res[f"looped b{block} w{warps} pps{pps}"] = frac(lambda: softmax.softmax(x))
        softmax._PLANS.clear()
        out.append(dict(case=f"softmax fwd 4096x65536 {dt}", fracs=res))
        # Norm forward at 65,536, the same knobs.
        w, b = torch.ones(65536, device=DEV, dtype=dt), torch.zeros(65536, device=DEV, dtype=dt)
        res = {"torch": frac(lambda: torch.nn.functional.layer_norm(x, (65536,), w, b))}
        for block, warps in ((4096, 16), (8192, 16)):
            for pps in (1, 2, 64):
                norms.LOOP_BLOCK, norms.LOOP_WARPS, norms.LOOP_PROGRAMS_PER_SM = block, warps, pps
                norms._FWD_PLANS.clear()
                res[f"looped b{block} w{warps} pps{pps}"] = frac(lambda: norms.layer_norm(x, w, b))
        norms._FWD_PLANS.clear()
        out.append(dict(case=f"layer_norm fwd 4096x65536 {dt}", fracs=res))
        x = None
        torch.cuda.empty_cache()
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--label", default="new")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    recs = host_table(args.label)
    for r in recs:
        print(json.dumps(r), flush=True)
    try:
        recs.append(kernel_count(args.label))
        print(json.dumps(recs[-1]), flush=True)
    except Exception as e:  # noqa: BLE001
        print("kernel count failed:", e)
    if args.sweep:
        for r in sweep():
            best = max(r["fracs"].items(), key=lambda kv: kv[1])
            print(r["case"], "best:", best, json.dumps(r["fracs"]), flush=True)
            recs.append(r)
    if args.out:
        with open(args.out, "a") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
