"""Old-vs-new tiles of the fused dequantize-GEMV (kernels/quant.py) against bf16 cuBLAS, batch 1.

Run first in the next GPU session, in one device call (about 2-4 minutes, most of it compiles):

    python scripts/gpu/quant_probe.py            # add --quick for the 8192 x 8192 shape only

For each weight shape of the issue it times bf16 cuBLAS, then ``_qmm_kernel`` launched directly at
each tile (BLOCK_N, BLOCK_K, warps, stages), split of K and scale prefetch, every result checked
against ``gemv_ref`` before it is timed, and last the public ``quant.gemv`` with the autotuner's
pick printed. "v1" rows are the committed (measured) tile set without the scale prefetch, the
kernel of notebooks/07a; see notes/quant-tune.md for what the rows should show.
"""

import argparse
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import bench, device, quant, roofline  # noqa: E402

# (label, BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K, PREFETCH_S)
V1 = [("v1", bn, bk, w, s, 1, False) for bn, bk, w, s in quant._QMM_TILES_SMALL_M_V1]
NEW = [("new", bn, bk, w, s, 1, True) for bn, bk, w, s in quant._QMM_TILES_SMALL_M]
SPLIT = [("split", 64, 128, 4, 5, 2, True), ("split", 32, 128, 4, 6, 2, True),
         ("split", 128, 128, 4, 4, 4, True)]  # fmt: skip
SHAPES = [(8192, 8192), (28672, 8192), (8192, 28672)]
SCHEMES = [("int4", 4, 128), ("int8", 8, None)]


def launch(x, qw, bn, bk, warps, stages, split, prefetch):
    m, k = x.shape
    n, kp = qw.shape[0], qw.data.shape[1]
    dt = torch.float32 if split > 1 else x.dtype
    y = (torch.zeros if split > 1 else torch.empty)(m, n, device=x.device, dtype=dt)
    grid = (triton.cdiv(n, bn), split)
    quant._qmm_kernel[grid](
        x, qw.data, qw.scales, y, m, n, kp, qw.scales.shape[1], qw.group_size,
        x.stride(0), y.stride(0), BITS=qw.bits, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk,
        SPLIT_K=split, USE_ASM=True, PREFETCH_S=prefetch, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y.to(x.dtype) if split > 1 else y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="8192 x 8192 only")
    args = ap.parse_args()
    if not device.GPU_MODE:
        sys.exit("quant_probe times GPU kernels: run it on a GPU")
    cap = device.capabilities()
    bw = roofline.copy_bandwidth().value
    print(f"{cap.name}, {cap.sm_count} SMs, copy {bw:,.0f} GB/s; batch 1, bf16 activations")
    print(f"{'N x K':>13s} {'scheme':6s} {'variant':30s}{'us':>8s}{'GB/s':>8s}{'copy':>6s}"
          f"{'vs bf16':>8s}{'progs/SM':>9s}")  # fmt: skip
    for n, k in SHAPES[:1] if args.quick else SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        base = bench.measure(lambda x=x, w=w: x @ w.T, bytes=quant.gemv_bytes(1, n, k, "bf16"))
        print(f"{n:>6d}x{k:<6d} {'bf16':6s} {'cuBLAS':30s}{base.ms * 1e3:8.1f}{base.gbps:8,.0f}"
              f"{base.gbps / bw:6.0%}{1:8.2f}x")  # fmt: skip
        for name, bits, group in SCHEMES:
            qw = quant.quantize(w, bits, group)
            ref = quant.gemv_ref(x, qw).float()
            nbytes = quant.gemv_bytes(1, n, k, bits, group)
            rows = [(f"{t} {bn}x{bk} w{wa} s{st} k{sp}{' pf' if pf else ''}", (bn, bk, wa, st, sp, pf))
                    for t, bn, bk, wa, st, sp, pf in V1 + NEW + SPLIT]  # fmt: skip
            rows.append(("quant.gemv (autotuned, new)", None))
            for label, cfg in rows:
                fn = (
                    (lambda x=x, qw=qw: quant.gemv(x, qw))
                    if cfg is None
                    else (lambda c=cfg, x=x, qw=qw: launch(x, qw, *c))
                )
                try:
                    y = fn()
                    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
                except Exception as e:  # a tile that does not fit (shared memory) or is wrong
                    print(
                        f"{n:>6d}x{k:<6d} {name:6s} {label:30s}  FAILED {type(e).__name__}: {str(e)[:80]}"
                    )
                    continue
                r = bench.measure(fn, bytes=nbytes)
                progs = (
                    "" if cfg is None else f"{triton.cdiv(n, cfg[0]) * cfg[4] / cap.sm_count:9.2f}"
                )
                print(f"{n:>6d}x{k:<6d} {name:6s} {label:30s}{r.ms * 1e3:8.1f}{r.gbps:8,.0f}"
                      f"{r.gbps / bw:6.0%}{base.ms / r.ms:8.2f}x{progs}")  # fmt: skip
            best = getattr(quant._QMM, "best_config", None)
            print(f"{'':13s} {name:6s} autotuner picked: {best}")


if __name__ == "__main__":
    main()
