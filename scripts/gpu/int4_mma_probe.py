"""Probe: the CUDA tensor-core int4 GEMV (kernels/cuda/int4_gemv_mma.cu) against Triton and cuBLAS.

python scripts/gpu/int4_mma_probe.py
"""

import functools
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from kernels import bench, device, quant, roofline  # noqa: E402

CONFIGS = [(2, 8, 1), (2, 8, 2), (1, 8, 2), (1, 16, 2), (2, 16, 1), (2, 4, 2), (4, 8, 1), (2, 8, 3)]


def repack(qw):
    n, k = qw.shape
    kp = k // 2
    codes = torch.empty(n, k, dtype=torch.uint8, device=qw.data.device)
    codes[:, :kp] = qw.data & 0xF
    codes[:, kp:] = qw.data >> 4
    rb, g = n // 16, k // 128
    c = codes.view(rb, 2, 8, g, 2, 4, 2, 4, 2).permute(0, 3, 4, 2, 7, 5, 8, 6, 1)
    c = c.reshape(rb, g, 2, 32, 4, 8)
    w = (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()
    s = qw.scales.view(rb, 2, 8, g).permute(0, 3, 2, 1).contiguous()
    return w, s


@functools.cache
def ext():
    from torch.utils.cpp_extension import load_inline

    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    d = ROOT / "kernels" / "cuda"
    return load_inline(
        name="gpu_brrr_int4_mma_probe",
        cpp_sources="torch::Tensor int4_gemv_mma(torch::Tensor w, torch::Tensor sc, torch::Tensor x, int64_t nt, int64_t s, int64_t d);",
        cuda_sources=(d / "int4_gemv_mma.cu").read_text() + "\n" + (d / "int4_gemv_mma_bindings.cu").read_text(),
        functions=["int4_gemv_mma"],
        extra_cuda_cflags=["-O3", "-lineinfo", "-std=c++17"],
    )  # fmt: skip


def main():
    if not device.GPU_MODE:
        sys.exit("GPU only")
    bw = roofline.copy_bandwidth().value
    e = ext()
    print(f"{device.capabilities().name}: copy {bw:,.0f} GB/s; extension built", flush=True)
    # correctness at small odd-ish shapes and several M
    for n, k, m in [(64, 256, 1), (128, 1024, 3), (256, 2048, 8), (8192, 8192, 1), (8192, 8192, 5)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        qw = quant.quantize(w, 4, 128)
        pw, ps = repack(qw)
        ref = quant.gemv_ref(x, qw).float()
        for nt, s, d in CONFIGS:
            if n % (16 * nt) or (k // 128) % s:
                continue
            y = e.int4_gemv_mma(pw, ps, x, nt, s, d).float()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            ok = torch.allclose(y, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
            if not ok:
                print(f"  WRONG n={n} k={k} m={m} nt={nt} s={s} d={d}: rel err {err:.3g}")
        print(f"checked n={n} k={k} m={m}", flush=True)
    for n, k in [(8192, 8192), (28672, 8192), (8192, 28672)]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        qw = quant.quantize(w, 4, 128)
        pw, ps = repack(qw)
        nbytes = quant.gemv_bytes(1, n, k, 4, 128)
        base = bench.measure(lambda x=x, w=w: x @ w.T)
        tri = bench.measure(lambda x=x, qw=qw: quant.gemv(x, qw))
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
