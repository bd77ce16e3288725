"""Unpacking int4 and int8 weights into 16-bit floats inside a Triton kernel: PTX (``prmt``,
``lop3``, packed ``fma``) on NVIDIA GPUs, portable Triton code elsewhere (the interpreter, pre-Ampere
GPUs). Both Triton kernels of ``kernels.quant.qgemv`` (and the probes in scripts/gpu) use them."""

from __future__ import annotations

import triton
import triton.language as tl

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
