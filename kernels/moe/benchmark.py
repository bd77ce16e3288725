"""The ``moe`` benchmark: ``python -m kernels.bench --only moe [--quick]``.

At the DeepSeek-V3-like shape (hidden 7168, expert width 2048, 256 experts, top-8), bf16, with
uniform and with skewed routing (``workloads.skewed_routing``: Zipf 0.5 popularity, 1 expert in
32 empty):

- ``grouped_matmul`` (one projection, ``[T*8, 7168] x [256, 7168, 2048]``) against the per-expert
  loop and ``torch._grouped_mm`` (where this PyTorch runs it), at 4096 and 16384 tokens, in TFLOP/s
  against the dense bf16 matmul peak measured in the same run (``roofline.matmul_peak``);
- ``moe_layer`` forward and forward + backward against ``moe_layer_loop`` at 4096 tokens;
- ``permute`` and ``unpermute`` against their PyTorch indexing equivalents, in GB/s of the bytes they
  must move, against the measured copy bandwidth.

In the interpreter (no GPU) every case shrinks to a toy size: the records check the plumbing, their
times are not GPU numbers and are not saved.
"""

from __future__ import annotations

import torch

from kernels import bench, device, roofline
from kernels.moe import grouped, layer, routing, workloads

SKEWS = {"uniform": dict(zipf=0.0, n_empty=0), "skewed": dict(zipf=0.5, n_empty=1 / 32)}


def _skew(E: int, skew: str) -> dict:
    """The ``zipf`` and ``n_empty`` keywords of ``SKEWS[skew]`` for ``E`` experts."""
    s = SKEWS[skew]
    return dict(zipf=s["zipf"], n_empty=int(E * s["n_empty"]))


def _routing(T: int, E: int, k: int, skew: str, dev):
    return workloads.skewed_routing(T, E, k, **_skew(E, skew), seed=0, device=dev)


def _grouped_records(T, E, K, N, k, skew, dtype, peak) -> list[dict]:
    dev = device.DEVICE
    ids, _ = _routing(T, E, k, skew, dev)
    M = T * k
    x = torch.randn(T, K, device=dev, dtype=dtype)
    x_sorted, offsets, _ = routing.permute(x, ids, E)
    w = torch.randn(E, K, N, device=dev, dtype=dtype) * K**-0.5
    flops = 2 * M * K * N
    shape = (T, E, K, N, k)
    ceil = (peak.name, peak.value)
    ours = bench.measure(lambda: grouped.grouped_matmul(x_sorted, w, offsets), flops=flops)
    loop = bench.measure(lambda: grouped.grouped_matmul_loop(x_sorted, w, offsets), flops=flops)
    recs = []
    base = ("loop", loop)
    tgm = None
    if grouped.torch_grouped_mm_available(dev, dtype):
        try:
            tgm = bench.measure(
                lambda: grouped.grouped_matmul_torch(x_sorted, w, offsets), flops=flops
            )
        except (RuntimeError, NotImplementedError) as e:  # a layout or size this build refuses
            print(f"torch._grouped_mm failed at {shape}: {str(e)[:200]}")
    if tgm is not None:
        recs.append(bench.record("moe", f"grouped_mm-torch-{skew}", shape, dtype, tgm,
                                 baseline=("loop", loop), ceiling=ceil))  # fmt: skip
        base = ("torch._grouped_mm", tgm)
    recs.append(bench.record("moe", f"grouped_mm-triton-{skew}", shape, dtype, ours,
                             baseline=base, ceiling=ceil))  # fmt: skip
    recs.append(bench.record("moe", f"grouped_mm-loop-{skew}", shape, dtype, loop, ceiling=ceil))
    return recs


def _layer_records(T, E, D, F, k, skew, dtype, peak, backward: bool) -> list[dict]:
    dev = device.DEVICE
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale):
        return torch.randn(*shape, generator=g, device=dev, dtype=dtype) * scale

    x = rand(T, D, scale=1.0)
    bias = workloads.skewed_bias(E, **_skew(E, skew)).to(dev)
    params = [
        rand(E, D, scale=D**-0.5),
        rand(E, D, F, scale=D**-0.5),
        rand(E, D, F, scale=D**-0.5),
        rand(E, F, D, scale=F**-0.5),
    ]
    kw = dict(top_k=k, router_bias=bias)
    fwd_flops = 3 * 2 * T * k * D * F
    shape = (T, E, D, F, k)
    ceil = (peak.name, peak.value)
    if not backward:
        with torch.no_grad():
            ours = bench.measure(lambda: layer.moe_layer(x, *params, **kw), flops=fwd_flops)
            loop = bench.measure(lambda: layer.moe_layer_loop(x, *params, **kw), flops=fwd_flops)
        return [
            bench.record("moe", f"layer-fwd-triton-{skew}", shape, dtype, ours,
                         baseline=("loop", loop), ceiling=ceil),
            bench.record("moe", f"layer-fwd-loop-{skew}", shape, dtype, loop, ceiling=ceil),
        ]  # fmt: skip
    leaves = [t.requires_grad_() for t in (x, *params)]
    dout = torch.randn_like(x)

    def step(fn):
        return lambda: torch.autograd.grad(fn(*leaves, **kw), leaves, dout)

    ours = bench.measure(step(layer.moe_layer), flops=3 * fwd_flops)
    loop = bench.measure(step(layer.moe_layer_loop), flops=3 * fwd_flops)
    return [
        bench.record("moe", f"layer-fwdbwd-triton-{skew}", shape, dtype, ours,
                     baseline=("loop", loop), ceiling=ceil),
        bench.record("moe", f"layer-fwdbwd-loop-{skew}", shape, dtype, loop, ceiling=ceil),
    ]  # fmt: skip


def _permute_records(T, E, D, k, skew, dtype, copy) -> list[dict]:
    dev = device.DEVICE
    ids, w = _routing(T, E, k, skew, dev)
    x = torch.randn(T, D, device=dev, dtype=dtype)
    M = T * k
    x_sorted, _, handle = routing.permute(x, ids, E)
    nbytes_p = 2 * M * D * dtype.itemsize  # read a token row, write a sorted row: per copy
    nbytes_u = (M + T) * D * dtype.itemsize  # read every sorted row, write every token row
    shape = (T, E, D, k)
    ceil = ("copy", copy.value)
    pos = handle.sorted_pos.long()
    w_cast = w.to(dtype)[:, :, None]
    ours_p = bench.measure(lambda: routing.permute(x, ids, E), bytes=nbytes_p)
    torch_p = bench.measure(lambda: routing.permute_ref(x, ids, E), bytes=nbytes_p)
    ours_u = bench.measure(lambda: routing.unpermute(x_sorted, handle, w), bytes=nbytes_u)
    torch_u = bench.measure(lambda: (x_sorted[pos] * w_cast).sum(1), bytes=nbytes_u)
    return [
        bench.record("moe", f"permute-triton-{skew}", shape, dtype, ours_p,
                     baseline=("torch-index", torch_p), ceiling=ceil),
        bench.record("moe", f"unpermute-triton-{skew}", shape, dtype, ours_u,
                     baseline=("torch-index", torch_u), ceiling=ceil),
    ]  # fmt: skip


@bench.register("moe")
def _bench_moe(quick: bool) -> list[dict]:
    if device.GPU_MODE:
        dtype = device.preferred_dtype(torch.bfloat16)
        s = workloads.MODEL_SHAPES["deepseek-v3"]
        E, D, F, k = s.n_experts, s.hidden, s.expert_width, s.top_k
        tokens = [4096] if quick else [4096, 16384]
        skews = ["skewed"] if quick else list(SKEWS)
        if quick:  # a smoke run (the tests'): DeepSeek-V3's widths with 32 of its 256 experts,
            E = 32  # 3 GB of weights instead of 22, so it fits beside other GPU jobs
    else:  # the interpreter: toy sizes, plumbing only
        dtype, (E, D, F, k), tokens, skews = torch.float32, (4, 32, 32, 2), [8], ["skewed"]
    peak = roofline.matmul_peak("bfloat16" if dtype is torch.bfloat16 else "float32")
    copy = roofline.copy_bandwidth()
    recs = []
    for skew in skews:
        for T in tokens:
            recs += _grouped_records(T, E, D, F, k, skew, dtype, peak)
            if device.GPU_MODE:
                torch.cuda.empty_cache()
        T = tokens[0]
        recs += _layer_records(T, E, D, F, k, skew, dtype, peak, backward=False)
        recs += _layer_records(T, E, D, F, k, skew, dtype, peak, backward=True)
        recs += _permute_records(T, E, D, k, skew, dtype, copy)
        if device.GPU_MODE:
            torch.cuda.empty_cache()
    return recs
