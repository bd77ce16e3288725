"""Weight quantization for decoding (int8, int4 and a fused dequantize-GEMV) and fp8 for prefill.

Decoding a token multiplies a handful of activation rows ``x: bf16[M, K]`` by every weight matrix
``W: [N, K]`` of the model. With ``M`` of 1 to 16 the arithmetic is a rounding error and the time
is the weight read, so storing ``W`` in fewer bits makes the product faster in proportion to the
bytes removed. Per call the kernels here move

    bytes = weights (N*K*bits/8) + scales (2 * N * K/group) + x (2*M*K) + y (2*M*N),

and ``gemv_bytes`` returns exactly that, so every timing converts to an effective GB/s that can be
held against the measured copy bandwidth.

Format (``quantize``): symmetric, round-to-nearest, one fp16 scale per ``group_size`` consecutive
values of a row (``group_size=None``: one per row, "per channel"):

- int8: ``data`` is int8 ``[N, K]`` in [-127, 127];
- int4: two values a byte, ``data`` is uint8 ``[N, K/2]``. Byte ``j`` of a row holds value ``j``
  in its low nibble and value ``j + K/2`` in its high nibble, each stored as ``q + 8`` in [1, 15].
  Splitting the row in halves (rather than pairing neighbours ``2j, 2j+1``) means a tile of
  ``BLOCK_K`` bytes unpacks into two *contiguous* runs of K, so the matching pieces of ``x`` are two
  plain vector loads, with no shuffling of ``x`` or of the unpacked weights.

Kernels:

- ``_qmm_kernel`` (the default path, any M): tensor cores. Each program owns ``BLOCK_N`` output
  features and walks K in tiles of ``BLOCK_K`` bytes; the packed tile is unpacked into small
  integers (exact in fp16/bf16) and fed to ``tl.dot`` unscaled, and the group scale multiplies the
  fp32 partial product, once per tile and output instead of once per weight. ``x`` is padded to a
  tile of at least 16 rows (masked: the padding costs no memory traffic).
- ``_gemv_kernel`` (``path="gemv"``, 1 to 4 rows): the textbook GEMV on CUDA cores, one fp32 FMA
  per weight and row, kept to measure against: it runs out of instruction issue slots long before
  HBM runs out of bytes.
- ``int4_gemv_mma`` (``path="cuda"``, int4 with groups of 128, bf16, 1 to 8 rows; the default
  where it builds: an NVIDIA GPU of compute capability 8.0+ with nvcc): CUDA C++ in
  ``kernels/cuda/int4_gemv_mma.cu``. The weight is repacked once (``repack_int4_mma``) into the
  register order of the tensor-core instruction, so each lane's 16-byte load unpacks straight into
  ``mma`` operands, with no shared memory for the weights and no padded copies of x: the
  instructions per weight byte that limit the Triton kernel (Act 7 measures them) disappear.
- Unpacking uses a few lines of PTX per four bytes (``INT4_BF16_ASM`` and friends) where the GPU
  supports them, and portable Triton code elsewhere (the interpreter, pre-Ampere GPUs).
- Both kernels take a split of K across programs (``SPLIT_K``) with fp32 atomics, used only when
  the output features alone cannot fill the GPU.

fp8 for prefill (cc >= 8.9): ``quantize_fp8`` (per tensor, per row, or per 1 x 128 block, fused in
one Triton pass), ``fp8_linear`` (``torch._scaled_mm``, per-tensor or per-row scales) and
``fp8_block_matmul`` (a Triton ``tl.dot`` kernel with 1 x 128 activation and 128 x 128 weight
scales, DeepSeek-V3's recipe). Accuracy helpers at the end build heavy-tailed weights and a small
decoder-like MLP stack to compare schemes.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from kernels import _validate, bench, device, numerics, roofline

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # activations and outputs
SCALE_DTYPE = torch.float16
GEMV_MAX_M = 4  # the most rows the CUDA-core kernel (path="gemv") takes
MAX_M_BLOCK = 128  # the tensor-core kernel's largest row tile
FP8_BLOCK = 128  # fp8 block scaling: 1 x 128 activation blocks, 128 x 128 weight blocks


# --------------------------------------------------------------------------- format


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight ``W: [N, K]`` stored as ``bits``-bit integers with one fp16 scale per group.

    ``W[n, k] ≈ q[n, k] * scales[n, k // group_size]``; see the module docstring for the layout.
    """

    data: torch.Tensor  # int8 [N, K] (bits=8) or uint8 [N, K // 2] (bits=4)
    scales: torch.Tensor  # fp16 [N, K // group_size]
    bits: int
    group_size: int  # K for per-channel scales
    shape: tuple[int, int]  # (N, K)

    @property
    def nbytes(self) -> int:
        """Bytes a kernel must read to use the weight: packed values plus scales."""
        return self.data.numel() * self.data.element_size() + self.scales.numel() * 2

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight, scales included (int4 with groups of 128: 4.125)."""
        return 8 * self.nbytes / (self.shape[0] * self.shape[1])

    def __repr__(self) -> str:
        n, k = self.shape
        g = "per-channel" if self.group_size == k else f"group {self.group_size}"
        return (
            f"QuantizedWeight(int{self.bits}, {g}, shape=({n}, {k}), "
            f"{self.nbytes / 1e6:.2f} MB, {self.bits_per_weight:.3f} bits/weight)"
        )


def _check_group(k: int, bits: int, group_size: int | None) -> int:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if bits == 4 and k % 2:
        raise ValueError(f"int4 packs two values a byte: w.shape[1] must be even, got {k}")
    if group_size is None or group_size == k:
        return k
    if not isinstance(group_size, int) or group_size <= 0 or k % group_size:
        raise ValueError(f"group_size must divide w.shape[1] = {k}, got {group_size!r}")
    # Kernel tiles never straddle a group: a group must hold a whole number of 16-wide tiles in
    # each half of the packed int4 row (16 is tl.dot's smallest K).
    need = 32 if bits == 4 else 16
    if group_size % need:
        raise ValueError(
            f"group_size must be a multiple of {need} for int{bits} (or None for per-channel), "
            f"got {group_size}"
        )
    return group_size


def quantize(w: torch.Tensor, bits: int = 4, group_size: int | None = 128) -> QuantizedWeight:
    """Symmetric round-to-nearest quantization of a weight ``w: [N, K]`` (any float dtype).

    Each group's scale is ``amax / qmax`` (qmax 127 for int8, 7 for int4), rounded to fp16; values
    are divided by the rounded scale, rounded and clamped, so ``dequantize`` reproduces exactly the
    grid the kernel multiplies by. ``group_size=None`` gives one scale per output row.
    """
    _validate.tensor("w", w.contiguous() if isinstance(w, torch.Tensor) else w, ndim=2)
    if not w.is_floating_point():
        raise TypeError(f"w must be a floating-point tensor, got {w.dtype}")
    n, k = w.shape
    if n == 0 or k == 0:
        raise ValueError(f"w must not be empty, got shape {tuple(w.shape)}")
    g = _check_group(k, bits, group_size)
    wf = w.float().reshape(n, k // g, g)
    amax = wf.abs().amax(dim=-1)
    if not torch.isfinite(amax).all():
        raise ValueError("w contains inf or NaN")
    qmax = 2 ** (bits - 1) - 1
    scale = (amax / qmax).to(SCALE_DTYPE)
    # An all-zero group (or one whose scale underflows fp16) gets scale 1: its values round to 0.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(wf / scale.float()[..., None]), -qmax, qmax).reshape(n, k)
    if bits == 8:
        data = q.to(torch.int8)
    else:
        u = (q + 8).to(torch.uint8)  # offset binary: [-7, 7] -> [1, 15]
        data = u[:, : k // 2] | (u[:, k // 2 :] << 4)
    return QuantizedWeight(data.contiguous(), scale.contiguous(), bits, g, (n, k))


def _check_qw(qw) -> None:
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a QuantizedWeight (from quantize), got {type(qw).__name__}")


def unpack(qw: QuantizedWeight) -> torch.Tensor:
    """The integer values ``q: int8[N, K]`` of a quantized weight, unscaled."""
    _check_qw(qw)
    if qw.bits == 8:
        return qw.data
    lo = (qw.data & 0xF).to(torch.int8) - 8
    hi = (qw.data >> 4).to(torch.int8) - 8
    return torch.cat([lo, hi], dim=1)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``W ≈ q * scale`` as a dense ``[N, K]`` tensor, computed in fp32 and cast to ``dtype``."""
    n, k = qw.shape if isinstance(qw, QuantizedWeight) else (0, 0)
    q = unpack(qw).float().reshape(n, k // qw.group_size, qw.group_size)
    return (q * qw.scales.float()[..., None]).reshape(n, k).to(dtype)


def gemv_bytes(m: int, n: int, k: int, bits: int | str, group_size: int | None = None) -> int:
    """Minimum bytes of ``y[m, n] = x[m, k] @ W[n, k].T`` with 16-bit ``x``, ``y``: weights,
    fp16 scales (``bits`` 4 or 8), or a bf16 weight (``bits="bf16"``)."""
    act = 2 * m * k + 2 * m * n
    if bits == "bf16":
        return 2 * n * k + act
    g = group_size or k
    return n * k * bits // 8 + 2 * n * (k // g) + act


# --------------------------------------------------------------------------- kernels


# Fast unpacking: PTX that turns 4 packed bytes into 16-bit floats with byte permutes (prmt),
# three-input logic ops (lop3) and one packed fma per two values, instead of an integer-to-float
# conversion per value (a quarter-rate instruction or worse). Each asm block is elementwise: output
# element i depends on input byte i only, so it is correct whatever register layout Triton picks.
# Magic numbers: OR-ing a small integer c into the mantissa of 128.0 (bf16 0x4300) or of 1024.0
# (fp16 0x6400) gives exactly 128 + c or 1024 + c; one fma then subtracts the offset.
_INT4_ASM = """
{
.reg .b32 t0, t1, z, lo_mask, magic, one, bias;
mov.b32 z, 0;
mov.b32 lo_mask, 0x000F000F;
mov.b32 magic, MAGIC;
mov.b32 one, ONE;
mov.b32 bias, BIAS;
prmt.b32 t0, $4, z, 0x4140;
prmt.b32 t1, $4, z, 0x4342;
lop3.b32 $0, t0, lo_mask, magic, 0xEA;
lop3.b32 $1, t1, lo_mask, magic, 0xEA;
fma.rn.FMT $0, $0, one, bias;
fma.rn.FMT $1, $1, one, bias;
shr.b32 t0, t0, 4;
shr.b32 t1, t1, 4;
lop3.b32 $2, t0, lo_mask, magic, 0xEA;
lop3.b32 $3, t1, lo_mask, magic, 0xEA;
fma.rn.FMT $2, $2, one, bias;
fma.rn.FMT $3, $3, one, bias;
}
"""
# byte b -> [b & 15, b >> 4] - 8 as (lo, hi); bytes are spread one per 16-bit half by prmt first.
INT4_BF16_ASM = tl.constexpr(
    _INT4_ASM.replace("MAGIC", "0x43004300").replace("ONE", "0x3F803F80")
    .replace("BIAS", "0xC308C308").replace("FMT", "bf16x2")
)  # fmt: skip
INT4_FP16_ASM = tl.constexpr(
    _INT4_ASM.replace("MAGIC", "0x64006400").replace("ONE", "0x3C003C00")
    .replace("BIAS", "0xE408E408").replace("FMT", "f16x2")
)  # fmt: skip
# int8 -> bf16: flip the sign bit (v + 128 = u in [1, 255]), place u in the mantissa of 2**23 in
# fp32, subtract 2**23 + 128, and keep each result's upper half: small integers are exact in bf16.
INT8_BF16_ASM = tl.constexpr("""
{
.reg .b32 x, m, f0, f1, f2, f3;
xor.b32 x, $2, 0x80808080;
mov.b32 m, 0x4B000000;
prmt.b32 f0, x, m, 0x7650;
prmt.b32 f1, x, m, 0x7651;
prmt.b32 f2, x, m, 0x7652;
prmt.b32 f3, x, m, 0x7653;
sub.f32 f0, f0, 0f4B000080;
sub.f32 f1, f1, 0f4B000080;
sub.f32 f2, f2, 0f4B000080;
sub.f32 f3, f3, 0f4B000080;
prmt.b32 $0, f0, f1, 0x7632;
prmt.b32 $1, f2, f3, 0x7632;
}
""")
# int8 -> fp16: u = v + 128 in the mantissa of 1024.0, two values per register, minus 1152.
INT8_FP16_ASM = tl.constexpr("""
{
.reg .b32 x, m, h0, h1, bias;
xor.b32 x, $2, 0x80808080;
mov.b32 m, 0x64646464;
mov.b32 bias, 0x64806480;
prmt.b32 h0, x, m, 0x4140;
prmt.b32 h1, x, m, 0x4342;
sub.f16x2 $0, h0, bias;
sub.f16x2 $1, h1, bias;
}
""")


@triton.jit
def _nibbles_to_f32(nib):
    # Portable path (interpreter, pre-Ampere): OR the 4-bit code into the mantissa of 2**23, whose
    # bit pattern is 0x4B000000, reinterpret as fp32 and subtract 2**23 + 8: exact, q = code - 8.
    bits = nib.to(tl.int32) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388616.0


@triton.jit
def _unpack_int4(b, dt: tl.constexpr, USE_ASM: tl.constexpr):
    """Packed bytes -> (low-nibble values, high-nibble values), integers in [-8, 7] as ``dt``."""
    if USE_ASM:
        if dt == tl.bfloat16:
            lo, hi = tl.inline_asm_elementwise(
                INT4_BF16_ASM, "=r,=r,=r,=r,r", [b], dtype=(tl.bfloat16, tl.bfloat16),
                is_pure=True, pack=4,
            )  # fmt: skip
        else:
            lo, hi = tl.inline_asm_elementwise(
                INT4_FP16_ASM, "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16),
                is_pure=True, pack=4,
            )  # fmt: skip
    else:
        lo = _nibbles_to_f32(b & 0xF).to(dt)
        hi = _nibbles_to_f32(b >> 4).to(dt)
    return lo, hi


@triton.jit
def _unpack_int8(b, dt: tl.constexpr, USE_ASM: tl.constexpr):
    """int8 values as ``dt`` (exact: |q| <= 127)."""
    if USE_ASM:
        if dt == tl.bfloat16:
            w = tl.inline_asm_elementwise(
                INT8_BF16_ASM, "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4
            )
        else:
            w = tl.inline_asm_elementwise(
                INT8_FP16_ASM, "=r,=r,r", [b], dtype=tl.float16, is_pure=True, pack=4
            )
    else:
        w = b.to(dt)
    return w


@triton.jit
def _gemv_kernel(
    # pointers
    x_ptr,  # [M, K] activations, fp16/bf16
    w_ptr,  # [N, KP] int8 (BITS=8) or packed uint8 (BITS=4)
    s_ptr,  # [N, n_groups] fp16 scales
    y_ptr,  # [M, N] output (x's dtype), or fp32 when SPLIT_K > 1
    # sizes
    M,
    N,
    KP,  # packed columns per row: K for int8, K // 2 for int4
    n_groups,
    group_size,
    # strides
    stride_xm,
    stride_ym,
    # meta-parameters
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    # Reads BLOCK_N weight rows once, every x row once per tile (from L1/L2: x is tiny), writes
    # BLOCK_N outputs per activation row. The products are summed along K inside each tile (the
    # reduction stays in the load's register layout: no shuffling of the unpacked weights), then
    # scaled once per tile and row.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    dt = x_ptr.dtype.element_ty
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past N wrap around (modulo) so the weight loads need no row mask; the store drops them.
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * KP
    s_rows = s_ptr + rows.to(tl.int64) * n_groups
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(KP, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    for t in range(pid_k * per_split, tl.minimum(pid_k * per_split + per_split, k_tiles)):
        kk = t * BLOCK_K + offs_k
        k_ok = kk < KP
        # A tile lies inside one scale group (the launcher guarantees it), so one scale per row.
        s_lo = tl.load(s_rows + (t * BLOCK_K) // group_size).to(tl.float32)
        b = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0)
        if BITS == 4:
            s_hi = tl.load(s_rows + (KP + t * BLOCK_K) // group_size).to(tl.float32)
            lo, hi = _unpack_int4(b, dt, USE_ASM)
            lo = lo.to(tl.float32)
            hi = hi.to(tl.float32)
        else:
            lo = _unpack_int8(b, dt, USE_ASM).to(tl.float32)
        # One activation row at a time (unrolled): each is a vector load of BLOCK_K values that
        # every weight row of the tile reuses; fp32 FMAs on the CUDA cores.
        for m in tl.static_range(BLOCK_M):
            x_ok = k_ok & (m < M)
            x_lo = tl.load(x_ptr + m * stride_xm + kk, mask=x_ok, other=0.0).to(tl.float32)
            p = tl.sum(lo * x_lo[None, :], axis=1) * s_lo
            if BITS == 4:
                x_hi = tl.load(x_ptr + m * stride_xm + KP + kk, mask=x_ok, other=0.0)
                p += tl.sum(hi * x_hi.to(tl.float32)[None, :], axis=1) * s_hi
            acc += tl.where(offs_m[:, None] == m, p[None, :], 0.0)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + cols[None, :]
    y_ok = (offs_m[:, None] < M) & (cols[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_ok)
    else:
        tl.atomic_add(y_ptrs, acc, mask=y_ok, sem="relaxed")


@triton.jit
def _qmm_kernel(
    # pointers
    x_ptr,  # [M, K] activations, fp16/bf16
    w_ptr,  # [N, KP] int8 (BITS=8) or packed uint8 (BITS=4)
    s_ptr,  # [N, n_groups] fp16 scales
    y_ptr,  # [M, N] output (x's dtype), or fp32 when SPLIT_K > 1
    # sizes
    M,
    N,
    KP,
    n_groups,
    group_size,
    # strides
    stride_xm,
    stride_ym,
    # meta-parameters
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    # Programs that share a weight tile (same pid_n, all pid_m) are numbered consecutively, so they
    # run together and the tile comes from HBM once and from L2 after that.
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % num_m
    pid_n = tl.program_id(0) // num_m
    pid_k = tl.program_id(1)
    dt = x_ptr.dtype.element_ty
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    rows = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * KP
    s_rows = s_ptr + rows.to(tl.int64) * n_groups
    # Rows of x past M are masked, not wrapped: with M = 1 the other 15 rows of the tile cost
    # no memory traffic.
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    m_ok = offs_m[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(KP, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    for t in range(pid_k * per_split, tl.minimum(pid_k * per_split + per_split, k_tiles)):
        kk = t * BLOCK_K + offs_k
        k_ok = kk < KP
        s_lo = tl.load(s_rows + (t * BLOCK_K) // group_size).to(tl.float32)
        b = tl.load(w_rows + kk[None, :], mask=k_ok[None, :], other=0)
        x_lo = tl.load(x_rows + kk[None, :], mask=m_ok & k_ok[None, :], other=0.0)
        if BITS == 4:
            s_hi = tl.load(s_rows + (KP + t * BLOCK_K) // group_size).to(tl.float32)
            x_hi = tl.load(x_rows + KP + kk[None, :], mask=m_ok & k_ok[None, :], other=0.0)
            # Integers in [-8, 7] are exact in fp16 and bf16: the tensor cores see q, unscaled,
            # and the group scale multiplies the fp32 partial product, once per output.
            lo, hi = _unpack_int4(b, dt, USE_ASM)
            p_lo = tl.dot(x_lo, tl.trans(lo))
            p_hi = tl.dot(x_hi, tl.trans(hi))
            acc += p_lo * s_lo[None, :] + p_hi * s_hi[None, :]
        else:
            # int8 in [-127, 127] is exact in fp16 and bf16 too.
            p = tl.dot(x_lo, tl.trans(_unpack_int8(b, dt, USE_ASM)))
            acc += p * s_lo[None, :]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    y_ok = m_ok & (cols[None, :] < N)
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_ok)
    else:
        tl.atomic_add(y_ptrs, acc, mask=y_ok, sem="relaxed")


# Candidate tiles (BLOCK_N, BLOCK_K in bytes, num_warps, num_stages). Few on purpose: each one is a
# compile (seconds) the first time a shape is seen. Chosen by reasoning about an H100, and timed by
# the autotuner on whatever GPU runs them: BLOCK_K = 128 bytes is one 128-byte line per weight row
# and tile; small BLOCK_N gives a 8192-row weight enough programs to fill 132 SMs; 3-4 stages keep
# about 24-32 KB of weights in flight per SM, what HBM needs to stay busy.
_GEMV_TILES = [(16, 128, 4, 3), (32, 128, 4, 3), (32, 64, 4, 3), (64, 128, 8, 3)]
# Tensor-core kernel: up to 32 rows of x the tile is mostly weights (4 warps); larger row tiles need
# 8 warps for their accumulators.
_QMM_TILES_SMALL_M = [(32, 128, 4, 4), (64, 128, 4, 3), (64, 64, 4, 4), (128, 128, 4, 3)]
_QMM_TILES_LARGE_M = [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3)]


def _configs(tiles) -> list[triton.Config]:
    if device.INTERPRET:  # the interpreter cannot autotune: one small, always-valid tile
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 16}, num_warps=4)]
    return [
        triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bn, bk, w, s in tiles
    ]


def _prune(configs, named_args, **kwargs):
    """Keep the tiles meant for this row-tile size whose K tile fits inside one scale group."""
    args = {**named_args, **kwargs}
    kp, g = args["KP"], args["group_size"]
    k = 2 * kp if args["BITS"] == 4 else kp
    limit = max_block_k(k, kp, g)
    if len(configs) == len(_QMM_TILES) and not device.INTERPRET:  # the tensor-core set
        n_small = len(_QMM_TILES_SMALL_M)
        configs = configs[n_small:] if args["BLOCK_M"] > 32 else configs[:n_small]
    kept = [c for c in configs if c.kwargs["BLOCK_K"] <= limit]
    if kept:
        return kept
    c = configs[0]
    return [triton.Config({**c.kwargs, "BLOCK_K": limit}, num_warps=c.num_warps)]


def _autotuned(kernel, configs, zero_y: bool):
    # Keyed on the row tile (not M itself, so a batch sweep does not retune every M), the problem
    # and the grouping. With SPLIT_K > 1 the output accumulates with atomics, so the autotuner must
    # zero it between trials.
    return triton.autotune(
        configs=configs,
        key=["BLOCK_M", "N", "KP", "group_size", "BITS", "SPLIT_K", "USE_ASM"],
        prune_configs_by={"early_config_prune": _prune},
        reset_to_zero=["y_ptr"] if zero_y else None,
    )(kernel)


_QMM_TILES = _QMM_TILES_SMALL_M + _QMM_TILES_LARGE_M
_GEMV = _autotuned(_gemv_kernel, _configs(_GEMV_TILES), zero_y=False)
_GEMV_SPLIT = _autotuned(_gemv_kernel, _configs(_GEMV_TILES), zero_y=True)
_QMM = _autotuned(_qmm_kernel, _configs(_QMM_TILES), zero_y=False)
_QMM_SPLIT = _autotuned(_qmm_kernel, _configs(_QMM_TILES), zero_y=True)


def max_block_k(k: int, kp: int, group_size: int) -> int:
    """Widest power-of-two K tile (in packed columns) that never straddles a scale group: it must
    divide the group and, for int4, the offset ``kp = K/2`` of the high nibbles' half-row."""
    if group_size == k:
        return 1 << 30  # one group per row: any tile, the last one masked
    span = math.gcd(group_size, kp)
    return span & -span  # its largest power-of-two divisor


def _pick_split_k(n_programs: int, k_tiles: int) -> int:
    """Split K across programs only when even the narrowest tiles leave SMs idle (weights of a few
    thousand rows or fewer): the fp32 atomics, the zeroed output and the final cast cost two
    extra launches, a visible share of a 10 µs GEMV."""
    if not device.GPU_MODE:
        return 1
    sms = device.capabilities().sm_count
    split = 1
    while n_programs * split < sms and split * 2 <= max(k_tiles // 4, 1):
        split *= 2
    return split


def _use_asm(dtype: torch.dtype = torch.bfloat16) -> bool:
    """The PTX unpacking needs an NVIDIA GPU (not the interpreter); its bf16 form uses packed bf16
    math (sm_80+), its fp16 form runs on anything a course GPU has (sm_53+)."""
    cap = device.capabilities()
    if not (device.GPU_MODE and cap.vendor == "NVIDIA"):
        return False
    return cap.compute_capability >= ((8, 0) if dtype is torch.bfloat16 else (5, 3))


# --------------------------------------------------------------------------- the CUDA int4 kernel

# (NT, S, D) of kernels/cuda/int4_gemv_mma.cu in order of preference: 16-row tiles per warp, warps
# per block (each a slice of K), groups prefetched. Timed on an H100 by scripts/gpu/int4_mma_probe.py;
# the first that divides the shape runs (N a multiple of 16 NT, K / 128 of S).
INT4_MMA_CONFIGS = [(2, 16, 1), (2, 8, 1), (2, 4, 2)]
INT4_MMA_MAX_M = 8
_CUDA_DIR = Path(__file__).resolve().parent / "cuda"


def int4_mma_unavailable() -> str | None:
    """Why the CUDA int4 kernel cannot be built here, or None when it can: it needs an NVIDIA GPU of
    compute capability 8.0+ (bf16 ``mma``), a CUDA build of PyTorch and nvcc."""
    from kernels import cuda

    reason = cuda.unavailable_reason()
    if reason:
        return reason
    if device.capabilities().compute_capability < (8, 0):
        return "the bf16 tensor-core instruction needs compute capability 8.0 or newer"
    return None


def _int4_mma_config(n: int, k: int) -> tuple[int, int, int] | None:
    return next(
        (c for c in INT4_MMA_CONFIGS if n % (16 * c[0]) == 0 and (k // 128) % c[1] == 0), None
    )


def _int4_mma_misfit(x2: torch.Tensor, qw: QuantizedWeight) -> str | None:
    """Why this call does not fit the CUDA kernel (None when it does)."""
    n, k = qw.shape
    if qw.bits != 4 or qw.group_size != 128:
        return f"it takes int4 with groups of 128, got {qw.bits}-bit with groups of {qw.group_size}"
    if x2.dtype != torch.bfloat16:
        return f"it takes bf16 activations, got {x2.dtype}"
    if not x2.is_cuda:
        return "it needs CUDA tensors"
    if x2.shape[0] > INT4_MMA_MAX_M:
        return f"it takes at most {INT4_MMA_MAX_M} rows of x, got {x2.shape[0]}"
    if k % 128 or _int4_mma_config(n, k) is None:
        return f"no configuration divides N = {n}, K = {k}"
    return None


@functools.cache
def _int4_mma_build_error() -> str | None:
    """Build the CUDA int4 kernel once for the default path; on failure warn and return why, so that
    ``gemv`` falls back to Triton instead of failing (an explicit ``path="cuda"`` still raises)."""
    try:
        _int4_mma_module()
    except Exception as e:  # noqa: BLE001 - any toolchain failure means "use the Triton kernel"
        import warnings

        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
        warnings.warn(f"CUDA int4 kernel unavailable, using Triton: {msg}", stacklevel=3)
        return msg
    return None


@functools.cache
def _int4_mma_module():
    from torch.utils.cpp_extension import load_inline

    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")  # build for this GPU only
    signature = "torch::Tensor x, int64_t nt, int64_t s, int64_t d"
    return load_inline(
        name="gpu_brrr_int4_gemv_mma",
        cpp_sources=f"torch::Tensor int4_gemv_mma(torch::Tensor w, torch::Tensor sc, {signature});",
        cuda_sources=(_CUDA_DIR / "int4_gemv_mma.cu").read_text()
        + "\n"
        + (_CUDA_DIR / "int4_gemv_mma_bindings.cu").read_text(),
        functions=["int4_gemv_mma"],
        extra_cuda_cflags=["-O3", "-lineinfo", "-std=c++17"],
        verbose=False,
    )


def repack_int4_mma(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 weight and scales in the order ``kernels/cuda/int4_gemv_mma.cu`` loads them: returns
    ``(w, scales)``, ``w`` uint8 of ``N * K / 2`` bytes, ``scales`` fp16 ``[N/16, K/128, 8, 2]``.

    For row tile ``rb`` (16 rows), group ``g`` (128 k), quad ``q`` (4 k-steps of 16) and lane ``l``
    there are 16 bytes, four 32-bit words; word ``i`` is k-step ``j = 4q + i`` and its nibble ``p``
    holds the code of row ``16 rb + l // 4 + 8 (p & 1)`` and column
    ``128 g + 16 j + 2 (l % 4) + (p >> 2) + 8 ((p >> 1) & 1)``: exactly the A fragment of one
    ``mma.m16n8k16`` for lane ``l``. Computed once per weight (views and one permute) and cached on
    it."""
    cached = getattr(qw, "_int4_mma", None)
    if cached is not None:
        return cached
    n, k = qw.shape
    if qw.bits != 4 or qw.group_size != 128 or n % 16 or k % 128:
        raise ValueError(
            f"qw must be int4 with groups of 128 and N % 16 == K % 128 == 0, got {qw.bits}-bit, "
            f"groups of {qw.group_size}, shape {qw.shape}"
        )
    half = k // 2
    codes = torch.empty(n, k, dtype=torch.uint8, device=qw.data.device)
    codes[:, :half] = qw.data & 0xF
    codes[:, half:] = qw.data >> 4
    rb, g = n // 16, k // 128
    # [rb, h, lr, g, q, i, kh, lc, e] with row = 16 rb + 8 h + lr, col = 128 g + 64 q + 16 i + 8 kh
    # + 2 lc + e; reorder to [rb, g, q, lane = 4 lr + lc, word i, nibble p = 4 e + 2 kh + h].
    c = codes.view(rb, 2, 8, g, 2, 4, 2, 4, 2).permute(0, 3, 4, 2, 7, 5, 8, 6, 1)
    c = c.reshape(rb, g, 2, 32, 4, 8)
    w = (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous().view(-1)  # little-endian nibble pairs
    scales = qw.scales.view(rb, 2, 8, g).permute(0, 3, 2, 1).contiguous()
    object.__setattr__(qw, "_int4_mma", (w, scales))  # a frozen dataclass: cache beside the fields
    return w, scales


def gemv(
    x: torch.Tensor,
    qw: QuantizedWeight,
    *,
    path: str | None = None,
    split_k: int | None = None,
    fast_unpack: bool | None = None,
) -> torch.Tensor:
    """``x @ dequantize(qw).T`` fused: ``x: [M, K]`` or ``[K]`` in fp16/bf16, result in x's dtype.

    ``path``: "cuda" (the CUDA C++ tensor-core kernel for int4, groups of 128, bf16, M <= 8; the
    default where ``int4_mma_unavailable`` is None and the shape fits), "mma" (Triton, tensor
    cores, any M; the default otherwise, and whenever ``split_k`` or ``fast_unpack`` is given) or
    "gemv" (CUDA-core FMAs, M <= 4: the textbook GEMV, kept to measure against). ``split_k``: force a K split (default: only when N is
    too small to fill the GPU). ``fast_unpack``: the PTX unpacking (default where it runs: NVIDIA
    sm_80+) or False for the portable Triton code.
    """
    _check_qw(qw)
    _validate.tensor("x", x, dtypes=SUPPORTED_DTYPES)
    if x.ndim not in (1, 2):
        raise ValueError(f"x must be 1-D [K] or 2-D [M, K], got shape {tuple(x.shape)}")
    n, k = qw.shape
    x2 = x.reshape(1, -1) if x.ndim == 1 else x
    m = x2.shape[0]
    if x2.shape[1] != k:
        raise ValueError(f"x has K = {x2.shape[1]} but qw was quantized with K = {k}")
    if x.device != qw.data.device:
        raise ValueError(f"x and qw must be on one device, got {x.device} and {qw.data.device}")
    if path not in (None, "gemv", "mma", "cuda"):
        raise ValueError(f"path must be None, 'cuda', 'gemv' or 'mma', got {path!r}")
    if path == "cuda":
        why = _int4_mma_misfit(x2, qw) or int4_mma_unavailable()
        if why:
            raise ValueError(f"path='cuda' cannot run here: {why}")
    if path is None and (split_k is not None or fast_unpack is not None):
        path = "mma"  # the Triton kernel's own knobs ask for the Triton kernel
    if path is None:
        path = "cuda" if not (_int4_mma_misfit(x2, qw) or int4_mma_unavailable()) else "mma"
        if path == "cuda" and _int4_mma_build_error() is not None:
            path = "mma"  # the build failed once (warned then): the Triton kernel serves
    if path == "cuda":
        if m == 0:
            return torch.empty((n,) if x.ndim == 1 else (m, n), device=x.device, dtype=x.dtype)
        w_packed, s_packed = repack_int4_mma(qw)
        cfg = _int4_mma_config(n, k)
        y = _int4_mma_module().int4_gemv_mma(w_packed, s_packed, x2.contiguous(), *cfg)
        return y.reshape((n,) if x.ndim == 1 else (m, n))
    if path == "gemv" and m > GEMV_MAX_M:
        raise ValueError(f"path='gemv' handles at most {GEMV_MAX_M} rows, got M = {m}")
    if split_k is not None:
        _validate.positive_power_of_two("split_k", split_k)
    use_asm = _use_asm(x.dtype) if fast_unpack is None else bool(fast_unpack)
    if use_asm and not _use_asm(x.dtype):
        raise ValueError(
            "fast_unpack=True needs an NVIDIA GPU (compute capability 8.0+ for bf16 activations)"
        )
    y_shape = (n,) if x.ndim == 1 else (m, n)
    if m == 0:
        return torch.empty(y_shape, device=x.device, dtype=x.dtype)
    kp = qw.data.shape[1]
    if path == "gemv":
        block_m = triton.next_power_of_2(m)
        plain, split_kernel = _GEMV, _GEMV_SPLIT
        n_programs = triton.cdiv(n, 32)
    else:
        block_m = max(16, min(MAX_M_BLOCK, triton.next_power_of_2(m)))
        plain, split_kernel = _QMM, _QMM_SPLIT
        n_programs = triton.cdiv(n, 32) * triton.cdiv(m, block_m)
    split = split_k or _pick_split_k(n_programs, triton.cdiv(kp, 128))
    y = torch.empty(m, n, device=x.device, dtype=x.dtype) if split == 1 else None
    if split > 1:
        y = torch.zeros(m, n, device=x.device, dtype=torch.float32)

    def grid(meta):
        tiles_n = triton.cdiv(n, meta["BLOCK_N"])
        return (tiles_n * (1 if path == "gemv" else triton.cdiv(m, block_m)), split)

    kernel = plain if split == 1 else split_kernel
    kernel[grid](
        x2,
        qw.data,
        qw.scales,
        y,
        m,
        n,
        kp,
        qw.scales.shape[1],
        qw.group_size,
        x2.stride(0),
        y.stride(0),
        BITS=qw.bits,
        BLOCK_M=block_m,
        SPLIT_K=split,
        USE_ASM=use_asm,
    )
    if split > 1:
        y = y.to(x.dtype)
    return y.reshape(y_shape)


def gemv_ref(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """The reference: ``x @ dequantize(qw).T`` in fp32, cast to x's dtype."""
    return (x.float() @ dequantize(qw).T).to(x.dtype)


# --------------------------------------------------------------------------- fp8 for prefill


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


def quantize_fp8(
    x: torch.Tensor, granularity: str = "row", *, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x: [M, K]`` to fp8 e4m3 in one Triton pass; returns ``(q, scale)``, ``x ≈ q * scale``.

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
    q = torch.empty(m, k, device=x.device, dtype=fp8_dtype())
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
    if not per_tensor:
        s = torch.empty(m, n_groups, device=x.device, dtype=torch.float32)
    block_g = triton.next_power_of_2(group)
    if block_g > 16384:
        raise ValueError(f"row-wise fp8 quantization handles K up to 16384, got {k}")
    block_m = max(1, min(16, 4096 // block_g))
    grid = (triton.cdiv(m, block_m), n_groups)
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
    nb = triton.cdiv(n, FP8_BLOCK)
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
    nb = triton.cdiv(n, FP8_BLOCK)
    if tuple(b_scale.shape) != (nb, nk) or b_scale.dtype != torch.float32:
        raise ValueError(
            f"b_scale must be float32 [{nb}, {nk}], got {b_scale.dtype} {tuple(b_scale.shape)}"
        )
    if device.GPU_MODE and not device.capabilities().fp8:
        raise RuntimeError("fp8_block_matmul needs fp8 tensor cores (compute capability 8.9+)")
    c = torch.empty(m, n, device=aq.device, dtype=torch.bfloat16)

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

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


# --------------------------------------------------------------------------- accuracy


def student_t(
    shape: tuple[int, ...], df: float = 4.0, std: float = 0.02, *, seed: int = 0, device=None
) -> torch.Tensor:
    """Heavy-tailed fp32 "weights": Student-t with ``df`` degrees of freedom, rescaled to ``std``.

    Trained weights have heavier tails than a Gaussian; a few large values per row set each
    absmax scale and leave the bulk of the values on a few quantization levels. Smaller ``df`` is
    heavier (``df=inf`` would be Gaussian); ``df`` must exceed 2 for the variance to exist.
    """
    if not df > 2:
        raise ValueError(f"df must be > 2 (finite variance), got {df!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        t = torch.distributions.StudentT(float(df)).sample(shape)
    t = t * (std / math.sqrt(df / (df - 2)))
    return t.to(device or "cpu")


WEIGHT_SCHEMES = ("bf16", "fp8-row", "int8", "int4-g32", "int4-g128", "int4")
ACT_SCHEMES = (None, "fp8-token", "int8-token", "int8-tensor")


def fake_quantize_weight(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """``w: [N, K]`` rounded through ``scheme`` and back to fp32 (see WEIGHT_SCHEMES).

    "int8" and "int4" are per output channel; "int4-gG" has one scale per G values; "fp8-row" is
    e4m3 with one scale per output channel (numerics.fake_quantize with a block of a whole row).
    """
    if scheme == "bf16":
        return w.to(torch.bfloat16).float()
    if scheme == "fp8-row":
        return numerics.fake_quantize(w.float(), "fp8_e4m3", block=w.shape[1])
    if scheme in ("int8", "int4") or scheme.startswith("int4-g"):
        bits = 8 if scheme == "int8" else 4
        group = int(scheme.split("-g")[1]) if "-g" in scheme else None
        return dequantize(quantize(w, bits, group))
    raise ValueError(f"scheme must be one of {WEIGHT_SCHEMES}, got {scheme!r}")


def fake_quantize_act(a: torch.Tensor, scheme: str | None) -> torch.Tensor:
    """Activations ``a: [T, D]`` rounded through ``scheme`` (see ACT_SCHEMES; None: unchanged):
    int8 or fp8 with one dynamic absmax scale per token (row) or for the whole tensor."""
    if scheme is None:
        return a
    if scheme not in ACT_SCHEMES:
        raise ValueError(f"scheme must be one of {ACT_SCHEMES}, got {scheme!r}")
    kind, gran = scheme.split("-")
    amax = a.abs().amax() if gran == "tensor" else a.abs().amax(dim=-1, keepdim=True)
    if kind == "fp8":
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return numerics.round_to(a / s, "fp8_e4m3", saturate=True) * s
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.clamp(torch.round(a / s), -127, 127) * s


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """‖approx − exact‖ / ‖exact‖ in fp64 (Frobenius)."""
    exact = exact.double()
    return ((approx.double() - exact).norm() / exact.norm().clamp_min(1e-300)).item()


@dataclass(frozen=True)
class MLPStack:
    """A decoder-like stack of pre-norm MLP blocks with a residual stream and an output head:
    ``h += W_down @ gelu(W_up @ rms_norm(h))`` per layer, then ``logits = W_head @ rms_norm(h)``.
    Random heavy-tailed weights, no training: a controlled place to watch rounding errors grow."""

    ups: tuple[torch.Tensor, ...]  # [f, d] each
    downs: tuple[torch.Tensor, ...]  # [d, f] each
    head: torch.Tensor  # [vocab, d]


def mlp_stack(
    d: int = 512, f: int = 1536, n_layers: int = 4, vocab: int = 2048, *, df: float = 4.0, seed=0
) -> MLPStack:
    """Build an ``MLPStack`` with Student-t weights scaled like a standard initialisation."""
    ups = tuple(student_t((f, d), df, d**-0.5, seed=seed + 2 * i) for i in range(n_layers))
    downs = tuple(
        student_t((d, f), df, f**-0.5 / math.sqrt(n_layers), seed=seed + 2 * i + 1)
        for i in range(n_layers)
    )
    return MLPStack(ups, downs, student_t((vocab, d), df, d**-0.5, seed=seed + 999))


def activations(
    tokens: int, d: int, *, outlier_channels: int = 4, outlier_scale: float = 30.0, seed: int = 1
) -> torch.Tensor:
    """Residual-stream inputs ``[tokens, d]``: Gaussian, with a few channels ``outlier_scale``
    times larger in every token, the "massive activation" pattern LLM.int8() and SmoothQuant
    describe, which is what makes activation quantization harder than weight quantization."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=g)
    idx = torch.randperm(d, generator=g)[:outlier_channels]
    x[:, idx] *= outlier_scale
    return x


def _rms_norm(h: torch.Tensor) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def mlp_forward(
    stack: MLPStack, x: torch.Tensor, weights: str = "bf16", acts: str | None = None
) -> torch.Tensor:
    """Logits of ``x: [T, d]`` through ``stack`` in fp32 with the MLP weights rounded through the
    ``weights`` scheme and each matmul's input through the ``acts`` scheme. The head stays fp32
    (as most quantization recipes keep it in high precision)."""
    h = x.float()
    for up, down in zip(stack.ups, stack.downs):
        wu = fake_quantize_weight(up.to(h.device), weights)
        wd = fake_quantize_weight(down.to(h.device), weights)
        a = fake_quantize_act(_rms_norm(h), acts)
        u = torch.nn.functional.gelu(a @ wu.T)
        h = h + fake_quantize_act(u, acts) @ wd.T
    return _rms_norm(h) @ stack.head.to(h.device).T


def divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    """How far a quantized model's outputs are from the reference's: mean KL(p_ref || p) in nats
    per token (a loss proxy: the extra cross-entropy against the reference's own predictions),
    top-1 agreement, and the logits' relative error."""
    lp_ref = torch.log_softmax(ref_logits.double(), -1)
    lp = torch.log_softmax(logits.double(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean().item()
    top1 = (ref_logits.argmax(-1) == logits.argmax(-1)).double().mean().item()
    return {"kl": kl, "top1": top1, "rel": relative_error(logits, ref_logits)}


# --------------------------------------------------------------------------- compile, bench

_QSIG = {"M": "i32", "N": "i32", "KP": "i32", "n_groups": "i32", "group_size": "i32"}
_QSIG |= {"stride_xm": "i32", "stride_ym": "i32"}
COMPILE_SPECS = (
    [
        dict(
            kernel=kernel,
            signature={
                "x_ptr": f"*{t}",
                "w_ptr": "*u8" if bits == 4 else "*i8",
                "s_ptr": "*fp16",
                "y_ptr": f"*{t}" if split == 1 else "*fp32",
                **_QSIG,
            },
            constexprs={
                "BITS": bits,
                "BLOCK_M": bm,
                "BLOCK_N": bn,
                "BLOCK_K": 128,
                "SPLIT_K": split,
                "USE_ASM": asm,
            },
            options={"num_warps": 4},
            # The bf16 PTX unpacking uses packed bf16 fma (sm_80+); fp16 and portable: anywhere.
            min_cc=80 if asm and t == "bf16" else 0,
        )
        for kernel, bm, bn in ((_gemv_kernel, 1, 32), (_gemv_kernel, 4, 16), (_qmm_kernel, 16, 64))
        for t in ("fp16", "bf16")
        for bits in (4, 8)
        for split, asm in ((1, True), (4, True), (1, False))
    ]
    + [
        dict(  # the largest row tile of the batch sweep: 8 warps, 80 KB of shared memory a stage
            kernel=_qmm_kernel,
            signature={"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*fp16", "y_ptr": "*bf16"}
            | _QSIG,
            constexprs={"BITS": 4, "BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1}
            | {"USE_ASM": True},
            options={"num_warps": 8, "num_stages": 3},
            min_cc=90,
        )
    ]
    + [
        dict(
            kernel=_fp8_quant_kernel,
            signature={
                "x_ptr": "*bf16",
                "q_ptr": "*fp8e4nv",
                "s_ptr": "*fp32",
                **{
                    n: "i32" for n in ("M", "K", "n_groups", "group_size", "stride_xm", "stride_qm")
                },
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
    ]
    + [
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
)

# (N, K) of the benchmarked weights: a square 8192 projection and a 70B-class MLP's up (N=28672)
# and down (K=28672) projections.
GEMV_SHAPES = [(8192, 8192), (28672, 8192), (8192, 28672)]


def bench_gemv(n: int, k: int, m: int = 1, schemes=(("int4", 4, 128), ("int8", 8, None))):
    """Time bf16 cuBLAS (``x @ w.T``) and the fused kernel for each (name, bits, group) scheme at
    one shape, same run. Returns ``{name: Measurement}`` with "bf16" the baseline (fp16 in the
    CPU interpreter, whose bf16 arithmetic is wrong)."""
    dt = device.preferred_dtype(torch.bfloat16) if device.GPU_MODE else torch.float16
    w = torch.randn(n, k, device=device.DEVICE, dtype=dt) * 0.02
    x = torch.randn(m, k, device=device.DEVICE, dtype=dt)
    out = {"bf16": bench.measure(lambda: x @ w.T, bytes=gemv_bytes(m, n, k, "bf16"))}
    for name, bits, group in schemes:
        qw = quantize(w, bits, group)
        y = gemv(x, qw)
        torch.testing.assert_close(y.float(), gemv_ref(x, qw).float(), rtol=2e-2, atol=2e-2)
        nbytes = gemv_bytes(m, n, k, bits, group)
        out[name] = bench.measure(lambda qw=qw: gemv(x, qw), bytes=nbytes)
    return out


@bench.register("quant_gemv")
def _bench_quant_gemv(quick: bool) -> list[dict]:
    if not device.GPU_MODE:
        print("quant_gemv benchmark skipped: weight-streaming timings need a GPU")
        return []
    copy = roofline.copy_bandwidth()
    recs = []
    for n, k in GEMV_SHAPES[:1] if quick else GEMV_SHAPES:
        for m in (1,) if quick else (1, 16):
            res = bench_gemv(n, k, m)
            base = res.pop("bf16")
            dt = device.preferred_dtype(torch.bfloat16)
            for name, meas in res.items():
                recs.append(bench.record("quant_gemv", name, (m, n, k), dt, meas,
                                         baseline=("cublas-bf16", base), ceiling=("copy", copy.value)))  # fmt: skip
            recs.append(bench.record("quant_gemv", "cublas-bf16", (m, n, k), dt, base,
                                     ceiling=("copy", copy.value)))  # fmt: skip
    return recs


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
