"""A CUDA-core GEMV for one activation row that prefetches the next weight tile into registers:
the experiment behind page 7.2's "Why the Triton int4 kernel stalled, and the kernel that
replaced it" (``scripts/gpu/quant_probe.py`` times it). Triton's software pipeliner only
pipelines loads that feed ``tl.dot``, so the prefetch is written by hand (``PREFETCH``); ``LATE``
defers the K reduction to the end instead of doing it every tile. ``quant.gemv`` does not use it:
the probe found the tensor-core kernel and the CUDA C++ int4 kernel faster."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import cdiv
from kernels.quant.ptx import _unpack_int4, _unpack_int8
from kernels.quant.qgemv import _use_asm


@triton.jit
def _gemv_pf_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, N, KP, n_groups, group_size,
    BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr, LATE: tl.constexpr, USE_ASM: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dt = x_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * KP
    s_rows = s_ptr + rows.to(tl.int64) * n_groups
    k_tiles = tl.cdiv(KP, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    t0 = pid_k * per_split
    t1 = tl.minimum(t0 + per_split, k_tiles)
    if LATE:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 16), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if PREFETCH:
        b_nx = tl.load(w_rows + (t0 * BLOCK_K + offs_k)[None, :], mask=t0 < t1, other=0)
        xl_nx = tl.load(x_ptr + t0 * BLOCK_K + offs_k, mask=t0 < t1, other=0.0)
        xh_nx = xl_nx
        if BITS == 4:
            xh_nx = tl.load(x_ptr + KP + t0 * BLOCK_K + offs_k, mask=t0 < t1, other=0.0)
    for t in range(t0, t1):
        kk = t * BLOCK_K + offs_k
        if PREFETCH:
            b = b_nx
            x_lo = xl_nx
            x_hi = xh_nx
            ok = t + 1 < t1
            b_nx = tl.load(w_rows + (kk + BLOCK_K)[None, :], mask=ok, other=0)
            xl_nx = tl.load(x_ptr + kk + BLOCK_K, mask=ok, other=0.0)
            if BITS == 4:
                xh_nx = tl.load(x_ptr + KP + kk + BLOCK_K, mask=ok, other=0.0)
        else:
            b = tl.load(w_rows + kk[None, :])
            x_lo = tl.load(x_ptr + kk)
            x_hi = x_lo
            if BITS == 4:
                x_hi = tl.load(x_ptr + KP + kk)
        s_lo = tl.load(s_rows + (t * BLOCK_K) // group_size).to(tl.float32)
        if BITS == 4:
            s_hi = tl.load(s_rows + (KP + t * BLOCK_K) // group_size).to(tl.float32)
            lo, hi = _unpack_int4(b, dt, USE_ASM)
            p = lo.to(tl.float32) * x_lo.to(tl.float32)[None, :]
            q = hi.to(tl.float32) * x_hi.to(tl.float32)[None, :]
            if LATE:
                p = tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // 16, 16)), axis=2)
                q = tl.sum(tl.reshape(q, (BLOCK_N, BLOCK_K // 16, 16)), axis=2)
                acc += p * s_lo[:, None] + q * s_hi[:, None]
            else:
                acc += tl.sum(p, axis=1) * s_lo + tl.sum(q, axis=1) * s_hi
        else:
            w8 = _unpack_int8(b, dt, USE_ASM)
            p = w8.to(tl.float32) * x_lo.to(tl.float32)[None, :]
            if LATE:
                p = tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // 16, 16)), axis=2)
                acc += p * s_lo[:, None]
            else:
                acc += tl.sum(p, axis=1) * s_lo
    if LATE:
        out = tl.sum(acc, axis=1)
    else:
        out = acc
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if SPLIT_K == 1:
        tl.store(y_ptr + cols, out.to(y_ptr.dtype.element_ty), mask=cols < N)
    else:
        tl.atomic_add(y_ptr + cols, out, mask=cols < N, sem="relaxed")


def launch(x, qw, bn, bk, warps, split, prefetch, late, asm=None):
    """``y = x @ dequantize(qw).T`` for one row ``x: [1, K]`` with the kernel above: ``bn`` x ``bk``
    tiles, ``warps`` warps, a K split of ``split``, ``prefetch``/``late`` as in the kernel, ``asm``
    the PTX unpacking (default where it runs)."""
    n, kp = qw.shape[0], qw.data.shape[1]
    y = torch.zeros(1, n, device=x.device, dtype=torch.float32) if split > 1 else torch.empty(
        1, n, device=x.device, dtype=x.dtype)  # fmt: skip
    _gemv_pf_kernel[(cdiv(n, bn), split)](
        x, qw.data, qw.scales, y, n, kp, qw.scales.shape[1], qw.group_size, BITS=qw.bits,
        BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, PREFETCH=prefetch, LATE=late, USE_ASM=_use_asm(x.dtype) if asm is None else asm, num_warps=warps,
        num_stages=1,
    )  # fmt: skip
    return y.to(x.dtype) if split > 1 else y


COMPILE_SPECS = [
    dict(
        kernel=_gemv_pf_kernel,
        signature={
            "x_ptr": "*bf16",
            "w_ptr": "*u8" if bits == 4 else "*i8",
            "s_ptr": "*fp16",
            "y_ptr": "*bf16",
            **{n: "i32" for n in ("N", "KP", "n_groups", "group_size")},
        },
        constexprs={"BITS": bits, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 1}
        | {"PREFETCH": True, "LATE": late, "USE_ASM": True},
        options={"num_warps": 4, "num_stages": 1},
        min_cc=80,
    )
    for bits in (4, 8)
    for late in (False, True)
]
