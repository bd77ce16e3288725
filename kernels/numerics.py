"""Number formats, rounding, per-tensor fp8 scaling and measured matmul error (Act 1.5).

Three things live here, used by ``notebooks/01c-numerics-lab.ipynb`` and its tests:

- ``FORMATS``: the floating-point formats of ML hardware (fp64 … fp4 e2m1), each derived from its
  bit layout (exponent bits, stored mantissa bits, how it spends its top exponent), and
  ``round_to(x, fmt)``, which rounds values onto any of them, including the formats torch cannot
  store (tf32, fp6, fp4).
- ``matmul(a, b, fmt)``: a matrix product in a given format through the *library* path a model
  would use (cuBLAS with TF32 on or off, fp16/bf16, ``torch._scaled_mm`` for fp8 with per-tensor
  scales), or an emulation where the device lacks the format. It reports which path ran.
- ``emulated_matmul(a, b, accumulator=...)``: the same product with an accumulator we control
  (its precision, rounding, how many products it adds at once, and whether partial sums are
  promoted to fp32 every so often), to show what the matrix units' accumulation does to the error.

Errors are measured as ``rel_error(out, ref) = ‖out − ref‖ / ‖ref‖`` (Frobenius norms, in fp64)
against an fp64 reference.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kernels import device

# --- formats -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: 1 sign bit, ``exponent_bits``, ``mantissa_bits`` stored.

    ``specials`` says how the top exponent code is spent: "ieee" reserves it for inf/NaN (fp64,
    fp32, tf32, bf16, fp16, fp8 e5m2); "fn" ("finite") keeps it for numbers except the all-ones
    mantissa, which is NaN, and has no inf (fp8 e4m3fn); "none" has no inf or NaN at all (the OCP
    fp6 and fp4 elements).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    specials: str
    dtype: torch.dtype | None  # torch's storage type, where torch has one
    note: str = ""

    @property
    def bits(self) -> int:
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def precision(self) -> int:
        """Significant bits, counting the implicit leading 1."""
        return self.mantissa_bits + 1

    @property
    def unit_roundoff(self) -> float:
        """u = 2^-p: the largest relative error of rounding to nearest (in the normal range)."""
        return 2.0**-self.precision

    @property
    def emin(self) -> int:
        return 1 - self.bias

    @property
    def emax(self) -> int:
        top = 2**self.exponent_bits - 1  # the all-ones exponent code
        return (top - 1 if self.specials == "ieee" else top) - self.bias

    @property
    def max(self) -> float:
        # "fn" loses one mantissa code (all ones) at the top exponent to NaN.
        lost = 2 if self.specials == "fn" else 1
        return (2.0 - lost * 2.0**-self.mantissa_bits) * 2.0**self.emax

    @property
    def min_normal(self) -> float:
        return 2.0**self.emin

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.emin - self.mantissa_bits)


FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in [
        FloatFormat("fp64", 11, 52, "ieee", torch.float64, "IEEE double: the reference"),
        FloatFormat("fp32", 8, 23, "ieee", torch.float32, "IEEE single"),
        FloatFormat("tf32", 8, 10, "ieee", None, "fp32 range, fp16 precision; matmul inputs only"),
        FloatFormat("bf16", 8, 7, "ieee", torch.bfloat16, "fp32 range, 8 significant bits"),
        FloatFormat("fp16", 5, 10, "ieee", torch.float16, "IEEE half"),
        FloatFormat("fp8_e4m3", 4, 3, "fn", torch.float8_e4m3fn, "OCP fp8 for weights/activations"),
        FloatFormat("fp8_e5m2", 5, 2, "ieee", torch.float8_e5m2, "OCP fp8 for gradients"),
        FloatFormat("fp6_e2m3", 2, 3, "none", None, "OCP MX element"),
        FloatFormat("fp6_e3m2", 3, 2, "none", None, "OCP MX element"),
        FloatFormat("fp4_e2m1", 2, 1, "none", None, "OCP MX / NVFP4 element"),
    ]
}


def formats_table() -> str:
    """The Markdown table of FORMATS that the notebook shows and the chapter reproduces verbatim
    (tests/test_numerics.py checks that the chapter's copy is current)."""
    rows = [
        "| format | bits: sign.exp.mant | precision p | unit roundoff u | max | min normal "
        "| min subnormal | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in FORMATS.values():
        rows.append(
            f"| {f.name} | {f.bits}: 1.{f.exponent_bits}.{f.mantissa_bits} | {f.precision} | "
            f"$2^{{-{f.precision}}}$ ≈ {f.unit_roundoff:.1e} | "
            f"{f'{f.max:.6g}' if f.max < 1e6 else f'{f.max:.4g}'} | {f.min_normal:.3g} | "
            f"{f.min_subnormal:.3g} | {f.note} |"
        )
    return "\n".join(rows)


def get_format(fmt: str | FloatFormat) -> FloatFormat:
    if isinstance(fmt, FloatFormat):
        return fmt
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {list(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]


def _round_grid(
    x: torch.Tensor,
    mantissa_bits: int,
    *,
    emin: int | None = None,
    max_value: float | None = None,
    mode: str = "nearest",
    overflow: str = "inf",
) -> torch.Tensor:
    """Round float64 ``x`` onto a binary grid with ``mantissa_bits`` stored bits.

    ``emin`` (None: unbounded) is the smallest normal exponent, below which the spacing stays fixed
    (subnormals); ``max_value`` (None: unbounded) is the largest finite value, beyond which results
    become ``overflow`` ("inf" or "saturate"). ``mode`` is "nearest" (ties to even, as
    torch.round) or "truncate" (toward zero). Scaling by powers of two is exact in float64.
    """
    ax = x.abs()
    _, e = torch.frexp(ax)  # ax = m * 2**e with m in [0.5, 1): the leading bit is 2**(e-1)
    e = e.to(torch.float64) - 1
    if emin is not None:
        e = e.clamp(min=emin)
    spacing = torch.exp2(e - mantissa_bits)
    steps = ax / spacing
    steps = torch.round(steps) if mode == "nearest" else torch.trunc(steps)
    r = steps * spacing
    r = torch.where(ax == 0, ax, r)  # frexp(0) gives e = 0: keep zeros as they are
    if max_value is not None:
        big = r > max_value
        fill = {"inf": math.inf, "saturate": max_value}[overflow]
        r = torch.where(big, torch.full_like(r, fill), r)
    # inf and NaN need no special case: inf / spacing stays inf (then overflows as above), NaN
    # stays NaN through every step.
    return torch.copysign(r, x)


def _overflow(f: FloatFormat) -> str:
    # IEEE-style formats overflow to inf. e4m3fn has no inf, and torch's own cast to it changed
    # between versions, so this lab saturates it to ±448 everywhere; fp6/fp4 have no inf either.
    return "inf" if f.specials == "ieee" else "saturate"


def round_to(x: torch.Tensor, fmt: str | FloatFormat, *, saturate: bool = False) -> torch.Tensor:
    """``x`` rounded to the nearest value of ``fmt`` (ties to even), returned in ``x``'s dtype.

    float32 inputs to formats torch can store are rounded by a cast (one correctly rounded
    conversion). Everything else goes through an exact float64 grid: tf32, fp6 and fp4, and float64
    inputs, because torch converts float64 to 16- and 8-bit types through float32, which rounds
    twice and is occasionally off by one unit in the last place. Overflow gives inf in IEEE-style
    formats and ±max in formats without inf (fp8 e4m3fn, fp6, fp4); ``saturate=True`` clamps to
    ±max in every format, as the scaled quantization recipes do.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point torch.Tensor, got {type(x).__name__}")
    f = get_format(fmt)
    if saturate or f.specials != "ieee":
        x = x.clamp(-f.max, f.max)
    if f.dtype is not None and (x.dtype == torch.float32 or f.bits >= 32):
        return x.to(f.dtype).to(x.dtype)
    return round_to_grid(x, f)


def round_to_grid(x: torch.Tensor, fmt: str | FloatFormat) -> torch.Tensor:
    """Like ``round_to`` but always through the float64 grid, never a cast (tests compare both)."""
    f = get_format(fmt)
    r = _round_grid(
        x.double(), f.mantissa_bits, emin=f.emin, max_value=f.max, overflow=_overflow(f)
    )
    return r.to(x.dtype)


def round_significand(x: torch.Tensor, bits: int, mode: str = "nearest") -> torch.Tensor:
    """``x`` (float64) kept to ``bits`` significant bits, exponent unbounded: a model accumulator.

    ``mode`` "nearest" rounds ties to even; "truncate" rounds toward zero, as some matrix units
    do when they align and add partial products.
    """
    if not isinstance(bits, int) or not 2 <= bits <= 53:
        raise ValueError(f"bits must be an int in [2, 53], got {bits!r}")
    if mode not in ("nearest", "truncate"):
        raise ValueError(f"mode must be 'nearest' or 'truncate', got {mode!r}")
    return _round_grid(x.double(), bits - 1, mode=mode)


# --- inputs, scaling, error ----------------------------------------------------------------------


def make_inputs(
    m: int,
    k: int,
    n: int,
    dist: str = "gaussian",
    *,
    df: int = 3,
    seed: int = 0,
    dev: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``a: [m, k]`` and ``b: [k, n]`` with i.i.d. entries.

    ``dist`` "gaussian" is N(0, 1); "student_t" is Student's t with ``df`` degrees of freedom
    (built from normals as z / sqrt(chi2_df / df)), whose heavy tails put a few large values among
    many small ones, like outlier features in real activations.
    """
    if dist not in ("gaussian", "student_t"):
        raise ValueError(f"dist must be 'gaussian' or 'student_t', got {dist!r}")
    if min(m, k, n) < 1:
        raise ValueError(f"m, k, n must be positive, got {(m, k, n)}")
    if not isinstance(df, int) or df < 1:
        raise ValueError(f"df must be a positive int, got {df!r}")
    dev = torch.device(dev) if dev is not None else device.DEVICE
    g = torch.Generator(device=dev).manual_seed(seed)

    def sample(shape):
        z = torch.randn(shape, generator=g, device=dev)
        if dist == "gaussian":
            return z
        chi2 = sum(torch.randn(shape, generator=g, device=dev) ** 2 for _ in range(df))
        return z / torch.sqrt(chi2 / df)

    return sample((m, k)), sample((k, n))


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (Frobenius norms); inf if ``out`` has inf or NaN."""
    if out.shape != ref.shape:
        raise ValueError(f"out and ref must have the same shape, got {out.shape} and {ref.shape}")
    # In chunks of 2^24 elements: a float64 copy of a whole 4 G-element tensor (MoE's dW) would
    # not fit beside it on an 80 GB GPU.
    o, r = out.reshape(-1), ref.reshape(-1)
    num = den = 0.0
    for i in range(0, r.numel(), 1 << 24):
        rc = r[i : i + (1 << 24)].double()
        diff = o[i : i + (1 << 24)].double() - rc
        if not torch.isfinite(diff).all():
            return math.inf
        num += torch.linalg.vector_norm(diff).item() ** 2
        den += torch.linalg.vector_norm(rc).item() ** 2
    if den == 0:
        raise ValueError("ref is all zeros: the relative error is undefined")
    return math.sqrt(num / den)


def assert_in_band(value: float, low: float, high: float, what: str) -> None:
    """Fail loudly if a measured error is outside the band the theory allows."""
    if not low <= value <= high:
        raise AssertionError(
            f"{what}: {value:.3g} is outside the expected band [{low:g}, {high:g}]"
        )


def loglog_slope(xs: Iterable[float], ys: Iterable[float]) -> float:
    """Least-squares slope of log(y) against log(x): 0.5 for y ∝ √x, 1 for y ∝ x."""
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    if len(lx) != len(ly) or len(lx) < 2:
        raise ValueError("need at least two (x, y) points of equal count")
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    sxx = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / sxx


@dataclass(frozen=True)
class Quantized:
    """Per-tensor scaled values: ``x ≈ values * scale``."""

    values: torch.Tensor  # in the format's torch dtype (fp8) or float32 holding grid values
    scale: torch.Tensor  # float32 scalar: the dequantization multiplier, amax / format max
    fmt: str

    def dequantize(self) -> torch.Tensor:
        return self.values.float() * self.scale


def quantize(x: torch.Tensor, fmt: str = "fp8_e4m3") -> Quantized:
    """Scale ``x`` so its largest magnitude lands on the format's max, then round (saturating).

    One scale for the whole tensor: outliers set it, so heavy-tailed data pushes the bulk of the
    values down towards the format's subnormals. Finer scaling (per row, per block of 32 or 128
    values) is the fix, and what MXFP8, NVFP4 and DeepSeek's recipe use.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point torch.Tensor, got {type(x).__name__}")
    if x.numel() == 0:
        raise ValueError("x must not be empty")
    f = get_format(fmt)
    if f.bits > 8:
        raise ValueError(f"fmt must be an 8-bit-or-narrower format, got {fmt!r}")
    amax = x.abs().max().float()
    if not torch.isfinite(amax):
        raise ValueError("x contains inf or NaN")
    scale = amax / f.max if amax > 0 else torch.ones((), device=x.device)
    q = round_to(x.float() / scale, f, saturate=True)
    if f.dtype is not None:
        q = q.to(f.dtype)
    return Quantized(q, scale.float().reshape(()), f.name)


def fake_quantize(
    x: torch.Tensor, fmt: str, *, block: int | None = None, dim: int = -1
) -> torch.Tensor:
    """``x`` quantized to ``fmt`` and back (float32), one scale per tensor or per ``block``.

    With ``block``, every run of ``block`` consecutive values along ``dim`` gets its own scale
    (its own amax maps to the format's max), as MX formats (blocks of 32) and NVFP4 (blocks of 16)
    do along a matmul's K dimension. Scales stay in float32 here; the real formats round them too
    (MX to a power of two, NVFP4 to fp8 e4m3), which this idealisation leaves out.
    """
    if block is None:
        return quantize(x, fmt).dequantize()
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"block must be a positive int, got {block!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() == 0:
        raise TypeError("x must be a non-empty floating-point torch.Tensor")
    if x.shape[dim] % block:
        raise ValueError(f"x.shape[{dim}] = {x.shape[dim]} is not a multiple of block={block}")
    f = get_format(fmt)
    xt = x.float().movedim(dim, -1)
    blocks = xt.reshape(*xt.shape[:-1], -1, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / f.max, torch.ones_like(amax))
    deq = round_to(blocks / scale, f, saturate=True) * scale
    return deq.reshape(xt.shape).movedim(-1, dim)


# --- matmul through the library ------------------------------------------------------------------

MATMUL_FORMATS = ("fp32", "tf32", "bf16", "fp16", "fp8_e4m3")


@dataclass(frozen=True)
class MatmulResult:
    out: torch.Tensor  # the product in the dtype the path returns (bf16/fp16 output for those)
    path: str  # what actually ran: library and settings, or "emulated: …"
    a_in: torch.Tensor  # the inputs as the matrix units saw them (rounded / dequantized), float32
    b_in: torch.Tensor


@contextlib.contextmanager
def cublas_flags(**flags):
    """Set ``torch.backends.cuda.matmul`` flags inside a ``with`` block and restore them after.

    Flags set to None are left alone. On a CPU the flags exist but nothing reads them.
    """
    m = torch.backends.cuda.matmul
    old = {k: getattr(m, k) for k, v in flags.items() if v is not None}
    try:
        for k in old:
            setattr(m, k, flags[k])
        yield
    finally:
        for k, v in old.items():
            setattr(m, k, v)


def _library() -> str:
    if not device.GPU_MODE:
        return "CPU BLAS"
    return "hipBLASLt" if torch.version.hip else "cuBLAS"


def native_tf32() -> bool:
    """Whether ``matmul(..., "tf32")`` runs on TF32 tensor cores here (NVIDIA, Ampere or newer)."""
    cap = device.capabilities()
    return device.GPU_MODE and cap.vendor == "NVIDIA" and cap.compute_capability >= (8, 0)


def native_fp8() -> bool:
    """Whether ``matmul(..., "fp8_e4m3")`` runs ``torch._scaled_mm`` on fp8 tensor cores here."""
    # MI300 multiplies the "fnuz" fp8 variants, not the OCP e4m3fn this lab uses: emulate there.
    cap = device.capabilities()
    return device.GPU_MODE and cap.fp8 and cap.vendor == "NVIDIA"


def _pad16(t: torch.Tensor) -> torch.Tensor:
    """Zero-pad both dims to multiples of 16 (torch._scaled_mm's constraint); zeros add nothing.

    The padding is done in float32 and cast back, which is exact for fp8 values and needs no
    fp8 fill kernel.
    """
    r, c = t.shape
    if r % 16 == 0 and c % 16 == 0:
        return t
    return torch.nn.functional.pad(t.float(), (0, -c % 16, 0, -r % 16)).to(t.dtype)


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    fmt: str,
    *,
    reduced_precision_reduction: bool | None = None,
    fp16_accumulation: bool = False,
    fp8_fast_accum: bool = False,
) -> MatmulResult:
    """``a @ b`` with fp32 ``a: [M, K]``, ``b: [K, N]`` computed in ``fmt`` (one of MATMUL_FORMATS).

    - fp32: the library with TF32 off; tf32: TF32 tensor cores where the GPU has them (Ampere+),
      else inputs rounded to tf32 and an fp32 product.
    - bf16/fp16: inputs cast, the library's 16-bit GEMM (fp32 accumulation), 16-bit output.
      ``reduced_precision_reduction`` sets torch's allow_{bf16,fp16}_reduced_precision_reduction
      (None keeps torch's default); ``fp16_accumulation=True`` asks cuBLAS to accumulate in fp16
      (torch.backends.cuda.matmul.allow_fp16_accumulation, a CUDA GPU and fp16 only).
    - fp8_e4m3: each input quantized with one per-tensor scale; ``torch._scaled_mm`` on GPUs with
      fp8 tensor cores (``fp8_fast_accum`` is its use_fast_accum), else the fp8 values dequantized
      to fp32 and multiplied in fp32.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.ndim != 2:
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a 2-D float32 tensor, got {got}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a and b do not chain: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")
    if fmt not in MATMUL_FORMATS:
        raise ValueError(f"fmt must be one of {MATMUL_FORMATS}, got {fmt!r}")
    if fp16_accumulation and (fmt != "fp16" or not device.GPU_MODE or torch.version.hip):
        raise ValueError("fp16_accumulation needs fmt='fp16' on a CUDA GPU")
    if fp8_fast_accum and fmt != "fp8_e4m3":
        raise ValueError("fp8_fast_accum applies to fmt='fp8_e4m3' only")
    lib = _library()

    if fmt == "fp32" or (fmt == "tf32" and native_tf32()):
        tf32 = fmt == "tf32"
        with cublas_flags(allow_tf32=tf32):
            out = a @ b
        a_in, b_in = (round_to(a, "tf32"), round_to(b, "tf32")) if tf32 else (a, b)
        path = f"{lib}, TF32 tensor cores" if tf32 else f"{lib} fp32 (TF32 off)"
        return MatmulResult(out, path, a_in, b_in)
    if fmt == "tf32":
        a_in, b_in = round_to(a, "tf32"), round_to(b, "tf32")
        with cublas_flags(allow_tf32=False):
            out = a_in @ b_in
        return MatmulResult(out, "emulated: inputs rounded to tf32, fp32 matmul", a_in, b_in)
    if fmt in ("bf16", "fp16"):
        dt = FORMATS[fmt].dtype
        flag = f"allow_{fmt}_reduced_precision_reduction"
        flags = {flag: reduced_precision_reduction}
        if fp16_accumulation:
            flags["allow_fp16_accumulation"] = True
        a16, b16 = a.to(dt), b.to(dt)
        with cublas_flags(**flags):
            out = a16 @ b16
        setting = (
            getattr(torch.backends.cuda.matmul, flag)
            if reduced_precision_reduction is None
            else reduced_precision_reduction
        )
        path = f"{lib} {fmt}, " + (
            "fp16 accumulation" if fp16_accumulation else "fp32 accumulation"
        )
        if device.GPU_MODE:
            path += f", reduced-precision reduction {'allowed' if setting else 'off'}"
        return MatmulResult(out, path, a16.float(), b16.float())
    # fp8 e4m3 with per-tensor scales
    qa, qb = quantize(a, fmt), quantize(b, fmt)
    a_in, b_in = qa.dequantize(), qb.dequantize()
    if native_fp8():
        m, n = a.shape[0], b.shape[1]
        # _scaled_mm wants the second operand column-major: transpose a contiguous transpose.
        b_cm = _pad16(qb.values.t().contiguous()).t()
        out = torch._scaled_mm(
            _pad16(qa.values),
            b_cm,
            scale_a=qa.scale,
            scale_b=qb.scale,
            out_dtype=torch.float32,
            use_fast_accum=fp8_fast_accum,
        )[:m, :n]
        path = f"torch._scaled_mm, fp8 e4m3 tensor cores, per-tensor scales, use_fast_accum={fp8_fast_accum}"
        return MatmulResult(out, path, a_in, b_in)
    if fp8_fast_accum:
        raise ValueError("fp8_fast_accum needs a GPU with fp8 tensor cores (capability flag fp8)")
    with cublas_flags(allow_tf32=False):
        out = a_in @ b_in
    return MatmulResult(out, "emulated: fp8 values dequantized to fp32, fp32 matmul", a_in, b_in)


def library_error_band(fmt: str, k: int, *, reduced_reduction: bool = False) -> tuple[float, float]:
    """The band a library product's total relative error should fall in, for zero-mean i.i.d.
    inputs (Gaussian or Student-t) and reduction length ``k``.

    Rounding each input to a format with unit roundoff u gives every product a random relative
    error of roughly u/2 per operand; summed over k products with random signs, the error and the
    result both grow like √k, so the relative error stays near 0.5-1 u whatever k is. fp16/bf16
    paths also round their output (up to u more). fp32 accumulation adds at most about √k·u_fp32.
    So: low = u/4 (the format really was applied), high = 2u + 2·√k·u_fp32. fp32 inputs are
    exact, so fp32's own band is [0, 2·√k·u_fp32].

    ``reduced_reduction=True`` is for fp16/bf16 GEMMs run with torch's
    ``allow_{fp16,bf16}_reduced_precision_reduction`` (on by default): cuBLAS may then split K
    and round each partial sum to the 16-bit format before adding them, about one more u.
    """
    u32 = FORMATS["fp32"].unit_roundoff
    u = 0.0 if fmt == "fp32" else get_format(fmt).unit_roundoff
    extra = u if reduced_reduction and fmt in ("bf16", "fp16") else 0.0
    return u / 4, 2 * u + extra + 2 * math.sqrt(k) * u32


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The fp64 product: the yardstick for every error in the lab."""
    return a.double() @ b.double()


# --- matmul with an accumulator we control -------------------------------------------------------


def _accumulator_round(accumulator: str | int, mode: str):
    if isinstance(accumulator, int) and not isinstance(accumulator, bool):
        return lambda s: round_significand(s, accumulator, mode)
    f = get_format(accumulator)
    if mode != "nearest":
        raise ValueError("mode='truncate' needs an int accumulator (significant bits)")
    return lambda s: round_to(s, f)


def emulated_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    accumulator: str | int = "fp32",
    mode: str = "nearest",
    group: int = 1,
    promote_every: int | None = None,
    checkpoints: Iterable[int] | None = None,
) -> torch.Tensor | dict[int, torch.Tensor]:
    """``a @ b`` (values taken as exact) summed along K into an accumulator we control.

    ``accumulator`` is a format name (e.g. "fp16": every partial sum is rounded to fp16) or an int,
    a significand width in bits with an unbounded exponent (14 models the ~14-bit accumulation of
    fp8 tensor cores on Hopper). ``mode`` "truncate" (int accumulators only) rounds toward zero.
    Every ``group`` products are summed exactly (in fp64) before they meet the accumulator: 1 is a
    sequential loop of fused multiply-adds; a tensor core adds a small group at a time.
    ``promote_every`` (a multiple of ``group``) starts a fresh low-precision partial sum every so
    many products and adds the finished one into an fp32 accumulator: the "promotion to CUDA
    cores" of DeepSeek-V3 / DeepGEMM. ``checkpoints`` (multiples of ``group``) returns
    ``{k: result over the first k products}`` instead of the final result, from one pass.

    Results are float64 tensors. Cost: K / group elementwise steps over an [M, N] tensor.
    """
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"a and b must be [M, K] and [K, N], got {tuple(a.shape)}, {tuple(b.shape)}"
        )
    if mode not in ("nearest", "truncate"):
        raise ValueError(f"mode must be 'nearest' or 'truncate', got {mode!r}")
    if not isinstance(group, int) or group < 1:
        raise ValueError(f"group must be a positive int, got {group!r}")
    if promote_every is not None and (promote_every < group or promote_every % group):
        raise ValueError(
            f"promote_every must be a multiple of group={group}, got {promote_every!r}"
        )
    k_total = a.shape[1]
    wanted = sorted(set(checkpoints)) if checkpoints is not None else [k_total]
    if any(k % group or not 0 < k <= k_total for k in wanted):
        raise ValueError(f"checkpoints must be multiples of group={group} in (0, {k_total}]")
    rnd = _accumulator_round(accumulator, mode)
    A, B = a.double(), b.double()
    low = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64, device=a.device)
    high = torch.zeros_like(low) if promote_every else None
    results: dict[int, torch.Tensor] = {}
    for k0 in range(0, wanted[-1], group):
        k1 = min(k0 + group, k_total)
        part = A[:, k0, None] * B[None, k0, :] if k1 - k0 == 1 else A[:, k0:k1] @ B[k0:k1]
        low = rnd(low + part)
        if promote_every and k1 % promote_every == 0:
            high = round_to(high + low, "fp32")
            low = torch.zeros_like(low)
        if k1 in wanted:
            results[k1] = round_to(high + low, "fp32") if promote_every else low.clone()
    return results if checkpoints is not None else results[k_total]


def error_models(fmt: str | FloatFormat, ks: Iterable[int]) -> dict[str, list[float]]:
    """The two textbook growth laws of summation error for ``K`` terms with unit roundoff u:
    random rounding errors that cancel (√K·u) and the worst case where they all add (K·u)."""
    u = get_format(fmt).unit_roundoff
    ks = list(ks)
    return {"sqrtK_u": [math.sqrt(k) * u for k in ks], "K_u": [k * u for k in ks]}
