"""The quantized GEMV's K split at the shapes sweep's GEMV rows: device time against host time.

    python scripts/gpu/gemv_split_probe.py            # the sweep's GEMV rows, three rounds
    python scripts/gpu/gemv_split_probe.py --smoke    # one tiny shape, two splits (the CPU test)

At one row, ``quant.gemv``'s Triton path splits K (``qgemv._pick_split_k``) so that enough weight
loads are in flight to keep HBM busy; the price is a second launch (the sum of the partial results)
and a second allocation a call. This probe times each split the sweep's way, for the int8 weights
(the Triton path by default) and the int4 weights on the Triton path (what GPUs without the CUDA
int4 kernel run):

- device: ``kernels.bench.measure`` (L2 flushed before each call, median), as the sweep's records;
- host: ``kernels.shapes.host_time`` (back-to-back calls, wall time a call), as its host records.

Each split's result is first checked against ``quant.gemv_ref`` (fp32). The splits and
torch.matmul (on the dequantized 16-bit weight) are alternated over ROUNDS rounds; the table gives
the medians. The host profile that raised the question:
results/profiles/2026-12-06-nvidia-h100-80gb-hbm3-host-pointer-gemv.txt.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import bench, device, numerics, quant, shapes  # noqa: E402
from kernels.quant import qgemv  # noqa: E402

ROUNDS = 3
SPLITS = (None, 1, 2, 4, 8)  # None: the default rule
SMOKE = dict(shapes=[(1, 64, 256)], splits=(None, 2), rounds=1)
DTYPE = torch.bfloat16 if device.GPU_MODE else torch.float16  # the interpreter's bf16 dot is wrong
TOL = 8e-3 if DTYPE == torch.bfloat16 else 2e-3  # tests/test_quant.py's, against the fp32 reference


def cases(gemv_shapes, splits):
    for m, n, k in gemv_shapes:
        w = torch.randn(n, k, device=device.DEVICE, dtype=DTYPE) * k**-0.5
        x = torch.randn(m, k, device=device.DEVICE, dtype=DTYPE)
        for bits in (8, 4):
            qw = quant.quantize(w, bits, 128)
            w16 = quant.dequantize(qw, DTYPE)
            fns = {
                f"split={s}": (lambda s=s, x=x, qw=qw: quant.gemv(x, qw, path="mma", split_k=s))
                for s in splits
            }
            fns["torch"] = lambda x=x, w16=w16: torch.matmul(x, w16.t())
            ref = quant.gemv_ref(x, qw)  # fp32 products and sums, then x's dtype
            for s in splits:
                err = numerics.rel_error(fns[f"split={s}"](), ref)
                assert err < TOL, f"{bits}-bit weights, split {s}: relative error {err:.2e}"
            default = qgemv._plan(x, qw, "mma", None, None).split  # what split=None ran
            yield (m, n, k, bits, default), fns


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="one tiny shape, two splits (the CPU test)")
    smoke = p.parse_args(argv).smoke
    gemv_shapes, splits, rounds = SMOKE.values() if smoke else (shapes.GEMV, SPLITS, ROUNDS)
    dev: dict[tuple, list[float]] = {}
    host: dict[tuple, list[float]] = {}
    for _ in range(rounds):
        for case, fns in cases(gemv_shapes, splits):
            for name, fn in fns.items():
                dev.setdefault((case, name), []).append(bench.measure(fn).ms * 1e3)
                host.setdefault((case, name), []).append(shapes.host_time(fn).ms * 1e3)
    names = [f"split={s}" for s in splits] + ["torch"]
    print("µs a call, device (L2 flushed) / host (back-to-back); split=None is the default rule")
    print(f"{'m, n, k':<18} {'bits':>4} {'dflt':>4} " + " ".join(f"{s:>15}" for s in names))
    for case in dict.fromkeys(c for c, _ in dev):
        m, n, k, bits, default = case
        cells = [
            f"{statistics.median(dev[case, s]):.1f}/{statistics.median(host[case, s]):.1f}"
            for s in names
        ]
        print(
            f"{f'{m}, {n}, {k}':<18} {bits:>4} {default:>4} " + " ".join(f"{c:>15}" for c in cells)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
