"""Dequantize-GEMV probe at batch 1: the sweep behind Act 7's "Why the int4 kernel stops at 38%".

Times, against bf16 cuBLAS in the same run and each checked against ``quant.gemv_ref``:
(a) the tensor-core ``quant._qmm_kernel`` over wider tiles, fewer warps and a K split (the x tile is
    padded to 16 rows and every warp re-reads it from shared memory, 64 * warps / BLOCK_N bytes of x
    per weight byte, so wide tiles and few warps should help), and
(b) the CUDA-core GEMV of ``kernels.quant.prefetch`` that prefetches the next weight tile into registers (Triton's
    software pipeliner only pipelines loads that feed ``tl.dot``), with the K reduction done every
    tile or deferred to the end.

    python scripts/gpu/quant_probe.py          # tensor-core tiles and CUDA-core GEMVs (about 2 minutes)
    python scripts/gpu/quant_probe.py --fp32   # CUDA-core GEMVs that unpack straight to fp32
    ncu --kernel-name regex:_qmm --launch-skip 2 --launch-count 1 --section WarpStateStats \
        --section Occupancy python scripts/gpu/quant_probe.py --one "qmm 32x128 w4 s4 k1"
"""

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import bench, device, partial_sums, quant, roofline  # noqa: E402
from kernels.quant import prefetch  # noqa: E402


def launch_qmm(x, qw, bn, bk, warps, stages, split):
    m, k = x.shape
    n, kp = qw.shape[0], qw.data.shape[1]
    # A K split writes one fp32 [m, n] plane per split, which partial_sums adds up (as quant.gemv).
    shape, dt = ((split, m, n), torch.float32) if split > 1 else ((m, n), x.dtype)
    y = torch.empty(shape, device=x.device, dtype=dt)
    quant._qmm_kernel[(triton.cdiv(n, bn), split)](
        x, qw.data, qw.scales, y, m, n, kp, qw.scales.shape[1], qw.group_size,
        x.stride(0), n, BITS=qw.bits, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk,
        SPLIT_K=split, USE_ASM=True, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if split == 1:
        return y
    return partial_sums.sum_stacked(y.view(1, split, m * n), x.dtype).view(m, n)


def sweep():
    out = [("qmm 32x128 w4 s4 k1", launch_qmm, (32, 128, 4, 4, 1))]  # the notebook's pick
    for bn, w, st, sp in itertools.product((64, 128, 256), (1, 2, 4), (3, 5), (1, 2)):
        out.append((f"qmm {bn}x128 w{w} s{st} k{sp}", launch_qmm, (bn, 128, w, st, sp)))
    for bn, w, sp, pf, late in itertools.product((16, 32, 64), (2, 4), (1, 2, 4), (1, 0), (0, 1)):
        if not pf and (late or sp == 4):
            continue
        out.append((f"pf {bn}x128 w{w} k{sp} pf{pf} late{late}", prefetch.launch,
                    (bn, 128, w, sp, pf, late)))  # fmt: skip
    return out


def sweep_fp32():
    """CUDA-core variants that unpack straight to fp32 (the portable magic-number code: an AND,
    an OR and a subtraction per weight, no bf16 round trip), several rows per thread."""
    out = []
    for bn, w, sp, late in itertools.product((32, 64, 128), (1, 2, 4), (2, 4, 8), (0, 1)):
        if bn // (4 * w) > 8:  # more than 8 rows a thread: too many registers
            continue
        out.append((f"pf32 {bn}x128 w{w} k{sp} late{late}", prefetch.launch,
                    (bn, 128, w, sp, 1, late, False)))  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", help="launch only this candidate (a label of the sweep), int4 8192^2")
    ap.add_argument("--fp32", action="store_true", help="the fp32-unpack CUDA-core sweep")
    args = ap.parse_args()
    if not device.GPU_MODE:
        sys.exit("quant_probe times GPU kernels: run it on a GPU")
    if args.one:
        label, fn, cargs = next(c for c in sweep() + sweep_fp32() if c[0] == args.one)
        w = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, 8192, device="cuda", dtype=torch.bfloat16)
        qw = quant.quantize(w, 4, 128)
        for _ in range(4):
            fn(x, qw, *cargs)
        torch.cuda.synchronize()
        return
    bw = roofline.copy_bandwidth().value
    print(f"{device.capabilities().name}: copy {bw:,.0f} GB/s; batch 1, bf16 x", flush=True)
    t_start = time.perf_counter()

    def run(n, k, bits, cands, top=None):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        base = bench.measure(lambda: x @ w.T)
        qw = quant.quantize(w, bits, 128 if bits == 4 else None)
        ref = quant.gemv_ref(x, qw).float()
        nbytes = quant.gemv_bytes(1, n, k, bits, 128 if bits == 4 else None)
        auto = bench.measure(lambda: quant.gemv(x, qw))
        res = [("quant.gemv (committed)", auto.ms)]
        for label, fn, args in cands:
            try:
                y = fn(x, qw, *args)
                torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
                res.append((label, bench.measure(lambda f=fn, a=args: f(x, qw, *a)).ms))
            except Exception as e:  # noqa: BLE001
                res.append((label + f" FAILED {type(e).__name__}: {str(e)[:60]}", float("nan")))
        res.sort(key=lambda r: (r[1] != r[1], r[1]))
        print(f"\n{n}x{k} int{bits}: bf16 cuBLAS {base.ms * 1e3:.1f} us  "
              f"({time.perf_counter() - t_start:.0f} s)")  # fmt: skip
        for label, ms in res[: top or len(res)]:
            gbps = nbytes / (ms * 1e-3) / 1e9
            print(f"  {label:40s}{ms * 1e3:8.1f} us{gbps:8,.0f} GB/s{gbps / bw:6.0%}"
                  f"{base.ms / ms:7.2f}x")  # fmt: skip
        fails = [r[0] for r in res if r[1] != r[1]]
        if fails:
            print("  failed:", fails[:6])
        return [r[0] for r in res if r[1] == r[1]]

    if args.fp32:
        cands = sweep_fp32()
        ranked = run(8192, 8192, 4, cands, top=20)
        best = [c for c in cands if c[0] in ranked[:6]]
        run(8192, 8192, 8, best)
        run(28672, 8192, 4, best)
        run(8192, 28672, 4, best)
        return
    allc = sweep()
    ranked = run(8192, 8192, 4, allc, top=25)
    best = [c for c in allc if c[0] in ranked[:12]]
    run(8192, 8192, 8, best)
    run(28672, 8192, 4, best)
    run(8192, 28672, 4, best)
    run(28672, 8192, 8, best, top=6)


if __name__ == "__main__":
    main()
