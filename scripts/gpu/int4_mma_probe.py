"""Probe: the CUDA tensor-core int4 GEMV (kernels/cuda/int4_gemv_mma.cu) against Triton and cuBLAS.

python scripts/gpu/int4_mma_probe.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import bench, device, quant, roofline  # noqa: E402
from kernels.cuda import _search_space  # noqa: E402

# Every (NT, S, D) the .cu instantiates, read from its INT4_MMA_CONFIGS list.
CONFIGS = _search_space("int4_gemv_mma.cu", "INT4_MMA_CONFIGS")


def main():
    if not device.GPU_MODE:
        sys.exit("GPU only")
    bw = roofline.copy_bandwidth().value
    e = quant._int4_mma_module()
    print(f"{device.capabilities().name}: copy {bw:,.0f} GB/s; extension built", flush=True)
    # Correctness first, at small shapes and several M: every configuration against the reference.
    wrong = []
    for n, k, m in [(64, 256, 1), (128, 1024, 3), (256, 2048, 8), (8192, 8192, 1), (8192, 8192, 5)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        qw = quant.quantize(w, 4, 128)
        pw, ps = quant.repack_int4_mma(qw)
        ref = quant.gemv_ref(x, qw).float()
        for nt, s, d in CONFIGS:
            if n % (16 * nt) or (k // 128) % s:
                continue
            y = e.int4_gemv_mma(pw, ps, x, nt, s, d).float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            ok = torch.allclose(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
            if not ok:
                wrong.append(f"n={n} k={k} m={m} nt={nt} s={s} d={d}: rel err {err:.3g}")
        print(f"checked n={n} k={k} m={m}", flush=True)
    assert not wrong, "\n".join(wrong)
    for n, k in [(8192, 8192), (28672, 8192), (8192, 28672)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        qw = quant.quantize(w, 4, 128)
        pw, ps = quant.repack_int4_mma(qw)
        nbytes = quant.gemv_bytes(1, n, k, 4, 128)
        base = bench.measure(lambda x=x, w=w: x @ w.T)
        tri = bench.measure(lambda x=x, qw=qw: quant.gemv(x, qw, path="mma"))
        print(f"\n{n}x{k}: cuBLAS bf16 {base.ms * 1e3:.1f} us; Triton int4 {tri.ms * 1e3:.1f} us "
              f"({base.ms / tri.ms:.2f}x)")  # fmt: skip
        for nt, s, d in CONFIGS:
            if n % (16 * nt) or (k // 128) % s:
                continue
            m = bench.measure(lambda c=(nt, s, d), a=(pw, ps, x): e.int4_gemv_mma(*a, *c))
            gbps = nbytes / (m.ms * 1e-3) / 1e9
            print(f"  cuda nt={nt} s={s} d={d}: {m.ms * 1e3:7.1f} us {gbps:7,.0f} GB/s {gbps / bw:5.0%}"
                  f"  {base.ms / m.ms:5.2f}x cuBLAS")  # fmt: skip


if __name__ == "__main__":
    main()
