"""The FlashAttention backward's dK/dV kernel at each tile configuration, both backwards.

    python scripts/gpu/fa_bwd_tiles.py [N] [causal] [--d 64]   (default N = 8192; bf16, d = 128, 2 x 16 heads)

Each row launches ``_attn_bwd_dkdv_kernel`` at one configuration (BN key rows per program, BM query
rows per step, warps, stages) and prints its registers and spills (from Triton's compiled kernel),
its median time (``triton.testing.do_bench``), TFLOP/s (4 matmuls, or 5 when it also computes dQ) and
its largest difference from the default backward's gradients. Modes: ``two`` is two_kernels' first
kernel; ``atomic`` the atomic_dq kernel adding dQ with ``tl.atomic_add``; ``tma`` the same with TMA
bulk reductions (what ``backward="atomic_dq"`` uses on Hopper). The log of an H100 run is
results/profiles/2026-11-27-nvidia-h100-80gb-hbm3-fa-bwd-tiles.txt; page 4.12 reads it.
"""

import argparse
import sys
from pathlib import Path

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout
from kernels import flash_attention as fa  # noqa: E402
from kernels.launch import cdiv  # noqa: E402

B, H = 2, 16
# (BN, BM, warps, stages): the tuned candidates and their neighbours, and at d = 64 one more. An
# ahead-of-time sm_90a compile of the two_kernels dK/dV kernel (no GPU; 2026-12-05) found no spills
# at d = 64 in any tuned tile (150-218 registers) but 284-1,584 bytes a thread in 128 x 128 (w8) and
# 128 x 64 (w4 s3): the d = 64 backward does not gain room for larger tiles from its smaller rows.
CONFIGS = [(64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3),
           (128, 64, 8, 4), (128, 32, 8, 4), (64, 64, 8, 2), (128, 128, 8, 2)]  # fmt: skip
EXTRA_D64 = [(64, 64, 4, 3)]
MODES = {"two": (False, False, CONFIGS[:5]), "atomic": (True, False, [(128, 64, 8, 3)]),
         "tma": (True, True, CONFIGS)}  # fmt: skip


def main(n: int, causal: bool, D: int = 128) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, n, D, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))  # fmt: skip
    sm = D**-0.5
    o, lse = fa._forward(q, k, v, causal, sm, None)
    ref = fa._backward(q, k, v, o, lse, do, causal, sm, "two_kernels")
    delta = torch.empty_like(lse)
    rows = B * H * n
    fa._attn_bwd_preprocess_kernel[(cdiv(rows, 64),)](
        o, do, delta, lse.new_empty(1), rows, HEAD_DIM=D, BLOCK_M=64, ZERO_DQ=False
    )
    flops = fa.fwd_flops(B, H, n, n, D, causal) / 2  # one n x n x d matmul
    kernel = fa._attn_bwd_dkdv_kernel.fn
    print(f"N={n} causal={causal} d={D}")
    print(
        f"{'mode':<7}{'BN':>4}{'BM':>4}{'w':>3}{'s':>3}{'regs':>5}{'spill':>6}{'us':>9}{'TF/s':>7}  err"
    )
    for mode, (atomic, tma, configs) in MODES.items():
        if D == 64 and mode != "atomic":
            configs = configs + EXTRA_D64
        for bn, bm, w, s in configs:
            dk, dv = torch.empty_like(k), torch.empty_like(v)
            dq_acc = q.new_zeros(q.shape, dtype=torch.float32) if atomic else lse.new_empty(1)
            dq_desc = TensorDescriptor.from_tensor(dq_acc.view(rows, D), [bm, D]) if tma else dq_acc

            def run(
                dk=dk,
                dv=dv,
                dq_acc=dq_acc,
                dq_desc=dq_desc,
                bn=bn,
                bm=bm,
                w=w,
                s=s,
                atomic=atomic,
                tma=tma,
            ):
                return kernel[(cdiv(n, bn), B * H)](
                    q, k, v, do, lse, delta, dk, dv, dq_acc, dq_desc, sm, n, n, HEAD_DIM=D,
                    CAUSAL=causal, ATOMIC_DQ=atomic, DQ_TMA=tma, TUNE=False, BLOCK_M=bm, BLOCK_N=bn,
                    num_warps=w, num_stages=s,
                )  # fmt: skip

            head = f"{mode:<7}{bn:>4}{bm:>4}{w:>3}{s:>3}"
            try:
                compiled = run()
                torch.cuda.synchronize()
            except triton.runtime.errors.OutOfResources as e:
                print(f"{head}  FAILED {type(e).__name__}: {str(e)[:80]}")
                continue
            errs = [
                (dk.float() - ref[1].float()).abs().max(),
                (dv.float() - ref[2].float()).abs().max(),
            ]
            if atomic:  # one call's dQ, not the warm-up's too
                errs.append((dq_acc.to(q.dtype).float() - ref[0].float()).abs().max())
            err = max(e.item() for e in errs)
            ms = triton.testing.do_bench(run, warmup=25, rep=150)
            tf = flops * (5 if atomic else 4) / ms * 1e-9
            print(f"{head}{compiled.n_regs:>5}{compiled.n_spills:>6}{ms * 1e3:>9.0f}{tf:>7.0f}  "
                  f"{err:.1e}", flush=True)  # fmt: skip


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("fa_bwd_tiles: needs a CUDA GPU")
    ap = argparse.ArgumentParser()
    ap.add_argument("n", nargs="?", type=int, default=8192)
    ap.add_argument("causal", nargs="?", choices=["causal"])
    ap.add_argument("--d", type=int, default=128, choices=[64, 128], help="head dim")
    args = ap.parse_args()
    main(args.n, args.causal == "causal", args.d)
