"""Where the norms' backward spends its device time at 64 to 4,096 rows, and what the partial sums'
settings change there.

The shapes sweep has the norm backwards below 0.9 times PyTorch's speed mostly at 512 rows (0.68 to
0.85 on an H100, 2026-12-05), and times the device alone only above 32 MiB. At 512 rows of 4,096
the fused backward runs as many programs as the GPU holds at once (2 an SM for the fp32 LayerNorm
profiled on an H200 at 4,096 columns), each over about 2 rows, and each writes a row of fp32
partial sums: on an H100, 264 rows of dw (and of db) to add up, as many bytes as a 16-bit x. The
second launch added them with 16 programs for each (columns 256 at a time), an eighth of the SMs
(the library now takes 32 columns a program: ``partial_sums.SUM_BLOCK_N``, from this probe).
Two settings move that, and this probe times them on the device alone:

- ``programs``: fewer programs (down to one an SM), each over more rows, write fewer partial rows
  (the dx kernel's parallelism against the sum's work);
- the sum's launch: a narrower column block runs more programs over the same rows; more rows a
  step with more warps (``SUM_VARIANTS``) keeps more loads in flight.

For each case it prints, in µs of device time (``bench.measure(device_only=True)``, the L2
flushed before each call): ours called directly under each setting, the library's first (every
setting's gradients are checked against it before it is timed), then the library's two launches
alone (the dx kernel, the sum), then ours and PyTorch's through autograd. ``--smoke`` runs tiny
shapes (the CPU test runs it in the interpreter).

    python scripts/gpu/norm_bwd_split_probe.py [--smoke] [--dtype bfloat16] [--shapes 4096x4096,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout
from kernels import bench, device, launch, norms, partial_sums, shapes  # noqa: E402
from kernels.launch import cdiv  # noqa: E402

SHAPES = [(64, 1024), (512, 1024), (512, 4096), (512, 8192), (4096, 1024), (4096, 4096)]
SMOKE_SHAPES = [
    (48, 1024),
    (12, 4096),
]  # 12 row blocks: partial sums, 4 programs in the interpreter
ROWS_PER_PROGRAM = (
    2,
    4,
    8,
)  # programs = the row blocks over this, where that is fewer than the library's
# The sum's launch: the library's (``{}``), then each override of its meta-parameters (column
# block; rows a step and warps).
SUM_VARIANTS = (
    ("", {}),
    ("sum block 8", {"BLOCK_N": 8}),
    ("sum block 16", {"BLOCK_N": 16}),
    ("sum block 64", {"BLOCK_N": 64}),
    ("sum 64 rows, 8 warps", {"BLOCK_P": 64, "num_warps": 8}),
)
LIBRARY_SUM_LAUNCH = partial_sums.sum_launch


def device_us(fn) -> float:
    return bench.measure(fn, device_only=True, **shapes.TIMING).ms * 1e3


def with_sum_meta(override: dict, seen: list):
    """partial_sums.sum_launch with ``override`` in its meta-parameters (sum_stacked looks it up
    by name); each call appends (the partial rows it sums, the meta-parameters) to ``seen``."""

    def launch(shape, dtype, is_aligned=True):
        key, _, meta = LIBRARY_SUM_LAUNCH(shape, dtype, is_aligned)
        meta = dict(meta, **override)
        k, n_partials, n_cols = shape
        seen.append((n_partials, meta))
        key = (*key, *sorted(override.items()))
        return key, (cdiv(n_cols, meta["BLOCK_N"]), k), meta

    return launch


def case(kind: str, rows: int, cols: int, dtype: torch.dtype, check_only: bool) -> dict:
    is_rms, eps = kind == "rms_norm", 1e-6 if kind == "rms_norm" else 1e-5
    x, w, b, dy = norms.make_inputs(rows, cols, dtype)
    b = None if is_rms else b
    _, mean, rstd = norms._forward(x, w, b, eps, is_rms)
    has_bias = b is not None
    base = norms.bwd_config(rows, cols)
    assert base["kernel"] == "fused", base  # the in-register backward: up to 8,192 columns

    def direct(cfg):
        return lambda: norms._backward(dy, x, w, mean, rstd, has_bias, cfg)

    dx = torch.empty_like(x)
    strides = (dy.stride(0), x.stride(0), cols)
    args = (dy, x, w, mean, rstd, dx, has_bias, rows, cols, strides, base)
    library_rows = norms._launch_bwd_rows(*args)[1].shape[1]  # the library's programs
    # The settings: (label, programs or None for the library's, the sum's override). Fewer
    # programs only: more than one, and fewer than the library runs; one per SM among them.
    blocks = cdiv(rows, base["BLOCK_M"])
    fewer = [(f"rows/program {r}", cdiv(blocks, r)) for r in ROWS_PER_PROGRAM]
    fewer.append(("1 program/SM", launch.sm_count(interpreter=2)))
    fewer = [(name, p) for name, p in fewer if 1 < p < library_rows]
    settings = [("default", None, {})]
    settings += [(name, p, {}) for name, p in fewer]
    settings += [(label, None, o) for label, o in SUM_VARIANTS[1:]]
    settings += [(f"{name}, {label}", p, o) for name, p in fewer for label, o in SUM_VARIANTS[1:]]
    want = direct(base)()
    out: dict = {}
    for label, programs, override in settings:
        cfg = dict(base, programs=programs) if programs else base
        seen: list = []
        partial_sums.sum_launch = with_sum_meta(override, seen)
        try:
            fn = direct(cfg)
            got = fn()
            for name, g, r in zip(("dx", "dw", "db"), got, want):
                if r is None:
                    continue
                # dx does not depend on the split; dw and db are fp32 sums in another order
                # (1e-5 of the largest covers that), rounded once to the weight's dtype (one step
                # of its precision).
                scale = r.float().abs().max().item()
                eps = torch.finfo(dtype).eps
                tol = dict(rtol=0, atol=0) if name == "dx" else dict(rtol=eps, atol=1e-5 * scale)
                torch.testing.assert_close(g.float(), r.float(), **tol, msg=f"{label}: {name}")
            # What ran: the partial rows the sum was asked for, and its block.
            out[label] = seen[-1] if check_only else device_us(fn)
        finally:
            partial_sums.sum_launch = LIBRARY_SUM_LAUNCH
    if check_only:
        return out
    # The library's two launches alone, and the whole call through autograd, ours and PyTorch's.
    partials = norms._launch_bwd_rows(*args)[1]
    out["dx kernel"] = device_us(lambda: norms._launch_bwd_rows(*args))
    out["partial sums"] = device_us(lambda: partial_sums.sum_stacked(partials, dtype))
    out["partial rows"] = partials.shape[1]
    leaves = [t.requires_grad_() for t in (x, w, b) if t is not None]
    ours = (lambda: norms.rms_norm(x, w)) if is_rms else (lambda: norms.layer_norm(x, w, b))
    theirs = ((lambda: torch.nn.functional.rms_norm(x, (cols,), w, eps)) if is_rms
              else (lambda: torch.nn.functional.layer_norm(x, (cols,), w, b, eps)))  # fmt: skip
    out["ours (autograd)"] = device_us(shapes.grad_call(ours, leaves, dy))
    out["torch (autograd)"] = device_us(shapes.grad_call(theirs, leaves, dy))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes, gradients checked only")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shapes", help="ROWSxCOLS,... instead of the default shapes")
    args = p.parse_args(argv)
    todo = SMOKE_SHAPES if args.smoke else SHAPES
    if args.shapes:
        todo = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    dtype = getattr(torch, args.dtype)
    print(
        f"{device.describe().splitlines()[0]}; {args.dtype}; device µs, L2 flushed before each call"
    )
    for rows, cols in todo:
        for kind in ("rms_norm", "layer_norm"):
            res = case(kind, rows, cols, dtype, check_only=args.smoke)
            if args.smoke:
                tried = sorted({r for r, _ in res.values()})
                print(
                    f"{kind} {rows}x{cols}: the gradients of every setting (partial rows {tried}, "
                    f"sum launches {[label or 'default' for label, _ in SUM_VARIANTS]}) match the "
                    "default's"
                )
                continue
            print(f"\n{kind} [{rows}, {cols}]: {res['partial rows']} partial rows")
            for label, us in res.items():
                if label != "partial rows":
                    print(f"  {label:34s} {us:8.1f}")
            best = min(
                (k for k in res if k.startswith(("default", "rows/", "sum ", "1 program"))),
                key=res.get,
            )
            print(
                f"  best setting: {best} ({res['default'] / res[best]:.2f}x the default)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
