"""The thread-block cluster row kernels (kernels.cuda.cluster_rows) against the Triton kernels and
PyTorch, on wide rows: correctness first, then device time as a fraction of the copy bandwidth.

Each case is timed three ways in one process: the cluster kernels, the Triton kernels (the cluster
path turned off through ``kernels.rows.CLUSTER_ABOVE_COLS``) and PyTorch. Forward traffic is 2 passes
(read x, write y), backward 3 (read x or y and dy, write dx), as in kernels.shapes.

    python scripts/gpu/cluster_rows_probe.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from kernels import norms, roofline, rows, shapes, softmax
from kernels.cuda import cluster_rows

DEV = "cuda"
CALLS = {}


def _count(name):
    inner = getattr(cluster_rows, name)

    def wrapped(*a, **k):
        CALLS[name] = CALLS.get(name, 0) + 1
        return inner(*a, **k)

    setattr(cluster_rows, name, wrapped)


for _name in ("norm_forward", "norm_backward", "softmax_forward", "softmax_backward"):
    _count(_name)
OPS = [
    "softmax_fwd",
    "softmax_bwd",
    "rms_norm_fwd",
    "rms_norm_bwd",
    "layer_norm_fwd",
    "layer_norm_bwd",
]


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def calls(op: str, r: int, w: int, dtype):
    """(ours, torch) callables for one op on fresh inputs."""
    x, wt, b, dy = norms.make_inputs(r, w, dtype, DEV)
    kind = op.rsplit("_", 1)[0]
    if kind == "softmax":
        x = x * 4
        f, g = (lambda: softmax.softmax(x)), (lambda: torch.softmax(x, -1))
        leaves = [x]
    elif kind == "rms_norm":
        f, g = (
            (lambda: norms.rms_norm(x, wt)),
            (lambda: torch.nn.functional.rms_norm(x, (w,), wt, 1e-6)),
        )
        leaves = [x, wt]
    else:
        f = lambda: norms.layer_norm(x, wt, b)  # noqa: E731
        g = lambda: torch.nn.functional.layer_norm(x, (w,), wt, b, 1e-5)  # noqa: E731
        leaves = [x, wt, b]
    if op.endswith("_bwd"):
        return shapes.grad_call(f, leaves, dy), shapes.grad_call(g, leaves, dy)
    return f, g


def check(r: int, w: int, dtype) -> dict:
    """Max errors of the cluster path against an fp64 PyTorch reference (outputs and gradients)."""
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
    x, wt, b, dy = norms.make_inputs(r, w, dtype, DEV, seed=1)
    out = {}
    for kind in ("softmax", "rms_norm", "layer_norm", "layer_norm_nobias"):
        leaves = [x.clone().requires_grad_(), wt.clone().requires_grad_()]
        if kind == "layer_norm":
            leaves.append(b.clone().requires_grad_())
        ref = [t.detach().double().requires_grad_() for t in leaves]

        def run(ts, kind=kind, ref=False):
            if kind == "softmax":
                return torch.softmax(ts[0] * 4, -1) if ref else softmax.softmax(ts[0] * 4)
            if kind == "rms_norm":
                if ref:
                    return torch.nn.functional.rms_norm(ts[0], (w,), ts[1], 1e-6)
                return norms.rms_norm(ts[0], ts[1])
            bias = ts[2] if len(ts) > 2 else None
            if ref:
                return torch.nn.functional.layer_norm(ts[0], (w,), ts[1], bias, 1e-5)
            return norms.layer_norm(ts[0], ts[1], bias)

        y = run(leaves)
        y.backward(dy)
        yr = run(ref, ref=True)
        yr.backward(dy.double())
        errs = [(y.double() - yr).abs().max().item() / max(yr.abs().max().item(), 1e-30)]
        for t, tr in zip(leaves, ref):
            if kind == "softmax" and t is leaves[1]:
                continue
            errs.append(
                (t.grad.double() - tr.grad).abs().max().item()
                / max(tr.grad.abs().max().item(), 1e-30)
            )
        out[kind] = max(errs)
        assert out[kind] < tol, (kind, r, w, dtype, errs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()
    cluster_rows.module()
    print(f"build/load: {time.time() - t0:.1f} s", flush=True)
    assert cluster_rows.unavailable_reason() is None
    # Every op and dtype on the cluster kernels (WINS is what this probe measures), any row count.
    cluster_rows.WINS = {op: {2, 4} for op in cluster_rows.WINS}
    rows.CLUSTER_MIN_ROWS = cluster_rows.CLUSTER_MIN_ROWS = 1
    rows.CLUSTER_ABOVE_COLS = cluster_rows.CLUSTER_ABOVE_COLS = 8192

    for dtype in (torch.bfloat16, torch.float16, torch.float32) if not args.quick else ():
        for r, w in ((256, 16384), (300, 65536), (257, 40000), (512, 24576 + 8)):
            CALLS.clear()
            errs = check(r, w, dtype)
            assert CALLS == {"norm_forward": 3, "norm_backward": 3, "softmax_forward": 1,
                             "softmax_backward": 1}, CALLS  # fmt: skip
            print(
                f"check {str(dtype)[6:]:9s} {r}x{w}: "
                + " ".join(f"{k}={v:.1e}" for k, v in errs.items()),
                flush=True,
            )

    copy = roofline.copy_bandwidth().value  # GB/s
    print(f"copy bandwidth: {copy:.0f} GB/s", flush=True)
    cases = [(torch.bfloat16, 4096, 65536), (torch.float32, 4096, 65536), (torch.bfloat16, 8192, 32768),
             (torch.bfloat16, 16384, 16384), (torch.bfloat16, 512, 65536), (torch.float16, 4096, 65536)]  # fmt: skip
    if args.quick:
        cases = cases[:2]
    recs = []
    for dtype, r, w in cases:
        ms = {op: {} for op in OPS}
        # The cluster path first: a Triton layout, once timed, has a C++ replay plan that later
        # calls of the same layout take (kernels.replay), whatever the cluster setting.
        CALLS.clear()
        for op in OPS:
            ours, theirs = calls(op, r, w, dtype)
            ms[op]["cluster"], ms[op]["torch"] = bench_ms(ours), bench_ms(theirs)
            ours = theirs = None
        assert len(CALLS) == 4, CALLS  # every op took the cluster path
        rows.CLUSTER_ABOVE_COLS, keep = 1 << 40, rows.CLUSTER_ABOVE_COLS
        CALLS.clear()
        for op in OPS:
            triton_fn, _ = calls(op, r, w, dtype)
            ms[op]["triton"] = bench_ms(triton_fn)
            triton_fn = None
        assert not CALLS, CALLS
        rows.CLUSTER_ABOVE_COLS = keep
        for op in OPS:
            nbytes = r * w * dtype.itemsize * (3 if op.endswith("_bwd") else 2)
            frac = {k: round(nbytes / (v * 1e-3) / 1e9 / copy, 3) for k, v in ms[op].items()}
            rec = dict(op=op, dtype=str(dtype)[6:], shape=[r, w], ms=ms[op], frac=frac)
            recs.append(rec)
            print(rec["op"], rec["dtype"], rec["shape"], rec["frac"], flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(copy_gbps=copy, gpu=torch.cuda.get_device_name(), records=recs), f, indent=1
            )
    print("\nfraction of copy bandwidth (device time, median of do_bench)")
    keys = ["cluster", "triton", "torch"]
    print(f"{'op':16s} {'dtype':9s} {'shape':14s} " + " ".join(f"{k:>11s}" for k in keys))
    for rec in recs:
        cells = " ".join(
            f"{rec['frac'][k]:11.3f}" if k in rec["frac"] else f"{'':11s}" for k in keys
        )
        print(f"{rec['op']:16s} {rec['dtype']:9s} {str(rec['shape']):14s} {cells}")


if __name__ == "__main__":
    main()
