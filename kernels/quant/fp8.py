"""fp8 for prefill (compute capability 8.9+): ``quantize_fp8`` (per tensor, per row or per 1 x 128
block, one Triton pass), ``fp8_linear`` (``torch._scaled_mm``) and ``fp8_block_matmul`` (a Triton
``tl.dot`` kernel with DeepSeek-V3's 1 x 128 / 128 x 128 scales), with their benchmark."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _validate, bench, device, numerics, roofline
from kernels.launch import cdiv, next_power_of_2

FP8_BLOCK = 128  # fp8 block scaling: 1 x 128 activation blocks, 128 x 128 weight blocks


def fp8_dtype() -> torch.dtype:
    """The OCP e4m3 type of this platform (AMD's MI300 multiplies the "fnuz" variant)."""
    return torch.float8_e4m3fnuz if torch.version.hip else torch.float8_e4m3fn


FP8_MAX = numerics.FORMATS["fp8_e4m3"].max  # 448


@triton.jit
def _fp8_quant_kernel(
    # pointers
    x_ptr,  # [M, K] fp16/bf16/fp32
    q_ptr,  # [M, K] fp8 e4m3
    s_ptr,  # [M, n_groups] fp32 dequantization scales (written), or [1] (read) when PER_TENSOR
    # sizes
    M,
    K,
    n_groups,
    group_size,
    # strides
    stride_xm,
    stride_qm,
    # meta-parameters
    PER_TENSOR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    ROUND_IN_FP32: tl.constexpr,  # True in the interpreter only (see below)
):
    # One pass: read x once (2 bytes), write fp8 (1 byte) and one fp32 scale per group. Each
    # program owns BLOCK_M rows of one group, so the group's amax is a register reduction.
    pid_m = tl.program_id(0)
    g = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = tl.arange(0, BLOCK_G)
    cols = g * group_size + offs
    mask = (rows[:, None] < M) & (offs[None, :] < group_size) & (cols[None, :] < K)
    x = tl.load(
        x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0
    )
    x = x.to(tl.float32)
    if PER_TENSOR:
        scale = tl.load(s_ptr) + tl.zeros((BLOCK_M,), dtype=tl.float32)
    else:
        amax = tl.max(tl.abs(x), axis=1)
        # amax maps onto the format's largest value, 448; an all-zero group keeps scale 1.
        scale = tl.where(amax > 0, amax / 448.0, 1.0)
        tl.store(s_ptr + rows.to(tl.int64) * n_groups + g, scale, mask=rows < M)
    q = tl.clamp(x / scale[:, None], -448.0, 448.0)
    if ROUND_IN_FP32:
        # Triton 3.6's interpreter drops the carry when rounding to fp8 crosses a power of two
        # (1.97 becomes 1.0, not 2.0). Round onto the e4m3 grid in fp32 first, so the cast is
        # exact: 3 mantissa bits (ties to even) for normals, steps of 2**-9 below 2**-6.
        b = q.to(tl.int32, bitcast=True)
        b = (b + 0x7FFFF + ((b >> 20) & 1)) & -1048576
        sub = ((q * 512.0 + 12582912.0) - 12582912.0) / 512.0
        q = tl.where(tl.abs(q) >= 0.015625, b.to(tl.float32, bitcast=True), sub)
    q_ptrs = q_ptr + rows.to(tl.int64)[:, None] * stride_qm + cols[None, :]
    tl.store(q_ptrs, q.to(q_ptr.dtype.element_ty), mask=mask)


def _quantize_fp8_torch(x, scale, n_groups: int, group: int):
    """``_fp8_quant_kernel``'s arithmetic in PyTorch, for GPUs without fp8 conversion (a T4: Triton
    refuses e4m3 below compute capability 8.9; PyTorch's cast runs in software on any GPU).
    ``scale``: the per-tensor scale ``[1]``, or None to compute one per group."""
    m, k = x.shape
    groups = x.float().reshape(m, n_groups, group)
    if scale is None:
        amax = groups.abs().amax(dim=2)
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (groups / s[:, :, None]).clamp(-FP8_MAX, FP8_MAX)
        return q.reshape(m, k).to(fp8_dtype()), s
    q = (groups / scale.reshape(1, 1, 1)).clamp(-FP8_MAX, FP8_MAX)
    return q.reshape(m, k).to(fp8_dtype()), scale.reshape(())


def quantize_fp8(
    x: torch.Tensor, granularity: str = "row", *, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x: [M, K]`` to fp8 e4m3 in one Triton pass; returns ``(q, scale)``, ``x ≈ q * scale``.
    On a GPU without fp8 (before compute capability 8.9) the same arithmetic runs in PyTorch.

    ``granularity``: "tensor" (one scale, ``scale`` shape ``[]``; from the current amax unless
    ``scale`` is given, as a calibrated static scale would be), "row" (``[M, 1]``, what
    ``torch._scaled_mm``'s row-wise mode wants) or "block" (``[M, K/128]``: one scale per 1 x 128
    block, the activation side of DeepSeek-V3's recipe).
    """
    _validate.tensor("x", x, dtypes=(torch.float16, torch.bfloat16, torch.float32), ndim=2)
    if granularity not in ("tensor", "row", "block"):
        raise ValueError(f"granularity must be 'tensor', 'row' or 'block', got {granularity!r}")
    if scale is not None and granularity != "tensor":
        raise ValueError("a given scale is per tensor: use granularity='tensor'")
    m, k = x.shape
    if m == 0 or k == 0:
        raise ValueError(f"x must not be empty, got shape {tuple(x.shape)}")
    if granularity == "tensor":
        if scale is None:
            amax = x.abs().amax().float()
            scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        s = scale.reshape(1).float()
        group, n_groups, per_tensor = k, 1, True
    elif granularity == "row":
        group, n_groups, per_tensor = k, 1, False
    else:
        if k % FP8_BLOCK:
            raise ValueError(f"block scaling needs K to be a multiple of {FP8_BLOCK}, got {k}")
        group, n_groups, per_tensor = FP8_BLOCK, k // FP8_BLOCK, False
    block_g = next_power_of_2(group)
    if block_g > 16384:
        raise ValueError(f"row-wise fp8 quantization handles K up to 16384, got {k}")
    if device.GPU_MODE and not device.capabilities().fp8:
        return _quantize_fp8_torch(x, s if per_tensor else None, n_groups, group)
    q = torch.empty(m, k, device=x.device, dtype=fp8_dtype())
    if not per_tensor:
        s = torch.empty(m, n_groups, device=x.device, dtype=torch.float32)
    block_m = max(1, min(16, 4096 // block_g))
    grid = (cdiv(m, block_m), n_groups)
    _fp8_quant_kernel[grid](
        x, q, s, m, k, n_groups, group, x.stride(0), q.stride(0),
        PER_TENSOR=per_tensor, BLOCK_M=block_m, BLOCK_G=block_g, ROUND_IN_FP32=device.INTERPRET, num_warps=4 if block_g <= 2048 else 8,
    )  # fmt: skip
    return q, (s.reshape(()) if per_tensor else s)


def quantize_fp8_weight(w: torch.Tensor, granularity: str = "row"):
    """Quantize a weight ``w: [N, K]`` once, offline: "tensor" (scale ``[]``), "row" (one per
    output channel, returned as ``[1, N]`` for ``torch._scaled_mm``) or "block" (128 x 128 tiles,
    scales ``[ceil(N/128), K/128]``)."""
    _validate.tensor("w", w, ndim=2)
    if granularity in ("tensor", "row"):
        q, s = quantize_fp8(w, granularity)
        return q, (s if granularity == "tensor" else s.reshape(1, -1))
    if granularity != "block":
        raise ValueError(f"granularity must be 'tensor', 'row' or 'block', got {granularity!r}")
    n, k = w.shape
    if k % FP8_BLOCK:
        raise ValueError(f"block scaling needs K to be a multiple of {FP8_BLOCK}, got {k}")
    nb = cdiv(n, FP8_BLOCK)
    wp = torch.nn.functional.pad(w.float(), (0, 0, 0, nb * FP8_BLOCK - n))
    tiles = wp.reshape(nb, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
    amax = tiles.abs().amax(dim=(1, 3))
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(nb * FP8_BLOCK, k)[:n]
    return q.to(fp8_dtype()).contiguous(), s.contiguous()


def fp8_linear(xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor):
    """``y = (xq * x_scale) @ (wq * w_scale).T`` in bf16 through ``torch._scaled_mm`` (cuBLASLt fp8
    tensor cores). Scales are per tensor (``[]`` and ``[]``) or per row (``[M, 1]`` and ``[1, N]``).
    ``wq: [N, K]`` is the weight as stored; its transpose is the column-major operand cuBLASLt wants.
    """
    if not (device.GPU_MODE and device.capabilities().fp8):
        raise RuntimeError("fp8_linear needs a GPU with fp8 tensor cores (compute capability 8.9+)")
    return roofline.fp8_matmul(xq, wq.t(), x_scale, w_scale)


@triton.jit
def _fp8_block_mm_kernel(
    # pointers
    a_ptr,  # [M, K] fp8, row-major
    b_ptr,  # [N, K] fp8, row-major (the weight as stored)
    c_ptr,  # [M, N] bf16
    sa_ptr,  # [M, K / 128] fp32: one scale per 1 x 128 block of a
    sb_ptr,  # [ceil(N / 128), K / 128] fp32: one scale per 128 x 128 block of b
    # sizes
    M,
    N,
    K,
    # strides
    stride_am,
    stride_bn,
    stride_cm,
    stride_sam,
    stride_sbn,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # = 128, the scale block
    GROUP_M: tl.constexpr,
):
    # The scales change every 128 values of K, so they cannot be applied after the loop as a
    # per-tensor scale can: each 128-deep partial product is scaled and added to an fp32
    # accumulator. That "promotion" also bounds how many products the fp8 tensor cores sum in
    # their own, narrower accumulator.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
    sa_ptrs = sa_ptr + offs_m * stride_sam
    sb_ptr = sb_ptr + ((pid_n * BLOCK_N) // BLOCK_K) * stride_sbn  # BLOCK_N divides 128
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        part = tl.dot(a, tl.trans(b))
        acc += part * tl.load(sa_ptrs + kb)[:, None] * tl.load(sb_ptr + kb)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


def _fp8_block_configs() -> list[triton.Config]:
    if device.INTERPRET:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "GROUP_M": 4})]
    shapes = [(128, 128, 8, 3), (128, 128, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4)]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "GROUP_M": 8}, num_warps=w, num_stages=s)
        for bm, bn, w, s in shapes
    ]


_FP8_BLOCK_MM = triton.autotune(configs=_fp8_block_configs(), key=["M", "N", "K"])(
    _fp8_block_mm_kernel
)


def fp8_block_matmul(
    aq: torch.Tensor, a_scale: torch.Tensor, bq: torch.Tensor, b_scale: torch.Tensor
) -> torch.Tensor:
    """``(aq * a_scale) @ (bq * b_scale).T`` in bf16 with 1 x 128 scales for ``aq: fp8[M, K]``
    (``a_scale: [M, K/128]``, from ``quantize_fp8(x, "block")``) and 128 x 128 scales for
    ``bq: fp8[N, K]`` (``b_scale: [ceil(N/128), K/128]``, from ``quantize_fp8_weight(w, "block")``).
    """
    _validate.tensor("aq", aq, dtypes=(fp8_dtype(),), ndim=2)
    _validate.tensor("bq", bq, dtypes=(fp8_dtype(),), ndim=2)
    m, k = aq.shape
    n = bq.shape[0]
    if bq.shape[1] != k:
        raise ValueError(
            f"aq and bq do not chain: aq is {tuple(aq.shape)}, bq is {tuple(bq.shape)}"
        )
    if k % FP8_BLOCK or k == 0 or m == 0 or n == 0:
        raise ValueError(
            f"K must be a positive multiple of {FP8_BLOCK}, got shape {tuple(aq.shape)}"
        )
    nk = k // FP8_BLOCK
    if tuple(a_scale.shape) != (m, nk) or a_scale.dtype != torch.float32:
        raise ValueError(
            f"a_scale must be float32 [{m}, {nk}], got {a_scale.dtype} {tuple(a_scale.shape)}"
        )
    nb = cdiv(n, FP8_BLOCK)
    if tuple(b_scale.shape) != (nb, nk) or b_scale.dtype != torch.float32:
        raise ValueError(
            f"b_scale must be float32 [{nb}, {nk}], got {b_scale.dtype} {tuple(b_scale.shape)}"
        )
    if device.GPU_MODE and not device.capabilities().fp8:
        raise RuntimeError("fp8_block_matmul needs fp8 tensor cores (compute capability 8.9+)")
    c = torch.empty(m, n, device=aq.device, dtype=torch.bfloat16)

    def grid(meta):
        return (cdiv(m, meta["BLOCK_M"]) * cdiv(n, meta["BLOCK_N"]),)

    _FP8_BLOCK_MM[grid](
        aq, bq, c, a_scale, b_scale, m, n, k,
        aq.stride(0), bq.stride(0), c.stride(0), a_scale.stride(0), b_scale.stride(0),
        BLOCK_K=FP8_BLOCK,
    )  # fmt: skip
    return c


def fp8_block_matmul_ref(aq, a_scale, bq, b_scale) -> torch.Tensor:
    """fp32 reference: dequantize both operands block by block, multiply."""
    m, k = aq.shape
    n = bq.shape[0]
    a = (aq.float().reshape(m, -1, FP8_BLOCK) * a_scale[..., None]).reshape(m, k)
    sb = b_scale.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)
    return (a @ (bq.float() * sb).T).to(torch.bfloat16)


# --------------------------------------------------------------------------- compile, bench

COMPILE_SPECS = [
    dict(
        kernel=_fp8_quant_kernel,
        signature={
            "x_ptr": "*bf16",
            "q_ptr": "*fp8e4nv",
            "s_ptr": "*fp32",
            **{n: "i32" for n in ("M", "K", "n_groups", "group_size", "stride_xm", "stride_qm")},
        },
        constexprs={
            "PER_TENSOR": per_tensor,
            "BLOCK_M": 1,
            "BLOCK_G": 8192,
            "ROUND_IN_FP32": False,
        },
        options={"num_warps": 8},
        min_cc=89,  # fp8 e4m3 conversions exist from Ada / Hopper on
    )
    for per_tensor in (False, True)
] + [
    dict(
        kernel=_fp8_block_mm_kernel,
        signature={
            "a_ptr": "*fp8e4nv",
            "b_ptr": "*fp8e4nv",
            "c_ptr": "*bf16",
            "sa_ptr": "*fp32",
            "sb_ptr": "*fp32",
            **{n: "i32" for n in ("M", "N", "K", "stride_am", "stride_bn", "stride_cm")},
            **{n: "i32" for n in ("stride_sam", "stride_sbn")},
        },
        constexprs={"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8},
        options={"num_warps": 8, "num_stages": 3},
        min_cc=89,  # fp8 tensor cores
    )
]


def bench_fp8(m: int, n: int, k: int) -> dict[str, bench.Measurement]:
    """Prefill-sized ``x: bf16[m, k] @ W[n, k].T``: bf16 cuBLAS, and fp8 with each scaling, timed
    *including* the activation quantization (weights are quantized once, offline). Needs fp8."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    flops = 2 * m * n * k
    res = {"bf16": bench.measure(lambda: x @ w.T, flops=flops)}
    wq_t, ws_t = quantize_fp8_weight(w, "tensor")
    wq_r, ws_r = quantize_fp8_weight(w, "row")
    wq_b, ws_b = quantize_fp8_weight(w, "block")
    static = quantize_fp8(x, "tensor")[1]  # a calibrated scale, fixed ahead of time
    xq, xs = quantize_fp8(x, "tensor", scale=static)
    res["fp8 tensor, matmul only"] = bench.measure(
        lambda: fp8_linear(xq, xs, wq_t, ws_t), flops=flops
    )
    res["fp8 tensor, static scale"] = bench.measure(
        lambda: fp8_linear(*quantize_fp8(x, "tensor", scale=static), wq_t, ws_t), flops=flops
    )
    res["fp8 tensor, dynamic scale"] = bench.measure(
        lambda: fp8_linear(*quantize_fp8(x, "tensor"), wq_t, ws_t), flops=flops
    )
    res["fp8 row"] = bench.measure(
        lambda: fp8_linear(*quantize_fp8(x, "row"), wq_r, ws_r), flops=flops
    )
    res["fp8 block (Triton)"] = bench.measure(
        lambda: fp8_block_matmul(*quantize_fp8(x, "block"), wq_b, ws_b), flops=flops
    )
    xb = quantize_fp8(x, "block")
    res["fp8 block (Triton), matmul only"] = bench.measure(
        lambda: fp8_block_matmul(*xb, wq_b, ws_b), flops=flops
    )
    res["quantize x, row"] = bench.measure(lambda: quantize_fp8(x, "row"), bytes=3 * m * k + 4 * m)
    return res


@bench.register("quant_fp8")
def _bench_quant_fp8(quick: bool) -> list[dict]:
    if not (device.GPU_MODE and device.capabilities().fp8):
        print("quant_fp8 benchmark skipped: needs a GPU with fp8 tensor cores (cc 8.9+)")
        return []
    peak = roofline.matmul_peak("bfloat16")
    recs = []
    for m, n, k in [(8192, 8192, 8192)] if quick else [(8192, 8192, 8192), (8192, 28672, 8192)]:
        res = bench_fp8(m, n, k)
        base = res.pop("bf16")
        quant_x = res.pop("quantize x, row")
        for name, meas in res.items():
            recs.append(bench.record("quant_fp8", name, (m, n, k), "fp8_e4m3", meas,
                                     baseline=("cublas-bf16", base), ceiling=(peak.name, peak.value)))  # fmt: skip
        recs.append(bench.record("quant_fp8", "cublas-bf16", (m, n, k), "bfloat16", base,
                                 ceiling=(peak.name, peak.value)))  # fmt: skip
        recs.append(bench.record("quant_fp8", "quantize x, row", (m, k), "bfloat16", quant_x))
    return recs
