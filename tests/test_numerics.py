"""kernels.numerics: formats from their bit layouts, rounding, scaling, library and emulated matmuls.

Independent references: torch.finfo for the formats torch stores, the OCP spec's published limits
for fp6/fp4, numpy's float16 (correctly rounded from float64) for the fp16 accumulator, and fp64
products for every error.
"""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels import device, numerics

DEV = device.DEVICE
ROOT = Path(__file__).resolve().parents[1]
TORCH_FORMATS = ["fp64", "fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"]


# --- formats -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_format_limits_match_torch_finfo(name):
    f = numerics.FORMATS[name]
    fi = torch.finfo(f.dtype)
    assert f.max == fi.max
    assert f.min_normal == fi.smallest_normal
    assert 2 * f.unit_roundoff == fi.eps  # eps is the spacing above 1: two unit roundoffs
    assert f.bits == fi.bits


@pytest.mark.parametrize(
    "name, bits, max_value, min_normal, min_subnormal",
    [  # the OCP Microscaling spec's element types, and tf32 (fp32 range, 10 stored bits)
        ("fp6_e2m3", 6, 7.5, 1.0, 0.125),
        ("fp6_e3m2", 6, 28.0, 0.25, 0.0625),
        ("fp4_e2m1", 4, 6.0, 1.0, 0.5),
        ("tf32", 19, (2 - 2**-10) * 2.0**127, 2.0**-126, 2.0**-136),
    ],
)
def test_formats_without_torch_dtype(name, bits, max_value, min_normal, min_subnormal):
    f = numerics.FORMATS[name]
    assert (f.bits, f.max, f.min_normal, f.min_subnormal) == (
        bits,
        max_value,
        min_normal,
        min_subnormal,
    )


def test_fp4_has_exactly_the_published_values():
    grid = torch.linspace(-8, 8, 16001, dtype=torch.float64)
    values = sorted(set(numerics.round_to(grid, "fp4_e2m1").abs().tolist()))
    assert values == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _wide_values(n=50_000, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-40, 40, (n,), generator=g).double())
    # ties, exact powers of two, zeros and values past each format's max
    extra = [0.0, -0.0, 1.0, 1 + 2**-11, 1 + 3 * 2**-11, 448, 464, 465, 500, 57344, 61440, 7e4]
    return torch.cat([x, torch.tensor(extra, dtype=torch.float64)]).float()


@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8_e4m3", "fp8_e5m2"])
def test_cast_and_grid_rounding_agree(name):
    x = _wide_values()
    cast, grid = numerics.round_to(x, name), numerics.round_to_grid(x, name)
    same = (cast == grid) | (cast.isnan() & grid.isnan())
    assert same.all(), x[~same][:5]


def test_float64_input_is_rounded_once():
    # torch casts float64 -> fp16 through fp32: -23624.0005885 becomes the tie -23624.0 and then
    # rounds to even (-23616). The correctly rounded fp16 value is -23632.
    x = torch.tensor([-23624.000588505518], dtype=torch.float64)
    assert numerics.round_to(x, "fp16").item() == -23632.0


@pytest.mark.parametrize("name", ["fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"])
def test_rounding_error_at_most_unit_roundoff(name):
    f = numerics.FORMATS[name]
    x = torch.randn(100_000, dtype=torch.float64) * 3
    x = x[(x.abs() >= f.min_normal) & (x.abs() <= f.max)]
    rel = ((numerics.round_to(x, name) - x).abs() / x.abs()).max().item()
    assert rel <= f.unit_roundoff
    assert rel > f.unit_roundoff / 2  # and the bound is nearly reached: it is the right u


def test_tf32_ties_to_even():
    x = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-10])
    assert (numerics.round_to(x, "tf32") - 1).tolist() == [0.0, 2**-9, 2**-10]


def test_e4m3_saturates_and_fp16_overflows():
    assert numerics.round_to(torch.tensor([465.0, -1e6]), "fp8_e4m3").tolist() == [448, -448]
    assert numerics.round_to(torch.tensor([7e4]), "fp16").item() == math.inf
    assert numerics.round_to(torch.tensor([7e4]), "fp16", saturate=True).item() == 65504


@pytest.mark.parametrize("bits", [8, 14, 24])
def test_round_significand(bits):
    x = torch.randn(10_000, dtype=torch.float64) * 1e3
    near = numerics.round_significand(x, bits)
    trunc = numerics.round_significand(x, bits, "truncate")
    assert ((near - x).abs() <= 2.0**-bits * x.abs()).all()
    assert (trunc.abs() <= x.abs()).all()  # toward zero
    assert ((trunc - x).abs() < 2.0 ** (1 - bits) * x.abs()).all()
    # 24 significant bits is fp32's precision
    if bits == 24:
        assert torch.equal(near, x.float().double())


def test_rounding_bad_input():
    with pytest.raises(TypeError, match="x must"):
        numerics.round_to(torch.arange(3), "fp16")
    with pytest.raises(ValueError, match="fmt must"):
        numerics.round_to(torch.ones(3), "fp7")
    with pytest.raises(ValueError, match="bits must"):
        numerics.round_significand(torch.ones(3), 60)
    with pytest.raises(ValueError, match="mode must"):
        numerics.round_significand(torch.ones(3), 8, "up")


# --- scaling -------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1,), (7, 13), (5, 123, 123)])
def test_quantize_maps_amax_to_format_max(shape):
    x = torch.randn(shape, device=DEV) * 37
    q = numerics.quantize(x, "fp8_e4m3")
    assert q.values.dtype == torch.float8_e4m3fn
    assert q.values.float().abs().max().item() == 448.0
    deq = q.dequantize()
    f = numerics.FORMATS["fp8_e4m3"]
    normal = x.abs() / q.scale >= f.min_normal  # scaled into e4m3's normal range
    rel = ((deq - x).abs() / x.abs())[normal]
    assert (rel <= f.unit_roundoff * (1 + 1e-6)).all()


def test_quantize_zeros_and_bad_input():
    assert torch.equal(numerics.quantize(torch.zeros(4), "fp8_e4m3").dequantize(), torch.zeros(4))
    with pytest.raises(ValueError, match="x must not be empty"):
        numerics.quantize(torch.empty(0), "fp8_e4m3")
    with pytest.raises(TypeError, match="x must"):
        numerics.quantize(torch.ones(3, dtype=torch.int32), "fp8_e4m3")
    with pytest.raises(ValueError, match="fmt must"):
        numerics.quantize(torch.ones(3), "bf16")
    with pytest.raises(ValueError, match="inf or NaN"):
        numerics.quantize(torch.tensor([1.0, math.inf]), "fp8_e4m3")


def test_block_scaling():
    x = torch.randn(6, 64)
    # one value per block: every value is its block's max, so it comes back (up to fp32 rounding)
    torch.testing.assert_close(numerics.fake_quantize(x, "fp4_e2m1", block=1), x)
    # blocks along dim 0 equal blocks along dim -1 of the transpose
    torch.testing.assert_close(
        numerics.fake_quantize(x.t(), "fp4_e2m1", block=16, dim=0),
        numerics.fake_quantize(x, "fp4_e2m1", block=16).t(),
    )
    # finer blocks never lose to one scale for the whole tensor on heavy-tailed data
    a, _ = numerics.make_inputs(64, 256, 1, "student_t", seed=3, dev="cpu")
    errs = [
        numerics.rel_error(numerics.fake_quantize(a, "fp4_e2m1", block=b), a)
        for b in (None, 128, 16)
    ]
    assert errs[0] > errs[1] > errs[2]
    with pytest.raises(ValueError, match="multiple of block"):
        numerics.fake_quantize(x, "fp4_e2m1", block=5)
    with pytest.raises(ValueError, match="block must"):
        numerics.fake_quantize(x, "fp4_e2m1", block=0)


# --- inputs and error ----------------------------------------------------------------------------


def test_make_inputs():
    a, b = numerics.make_inputs(5, 7, 3, dev="cpu")
    assert a.shape == (5, 7) and b.shape == (7, 3) and a.dtype == torch.float32
    a2, _ = numerics.make_inputs(5, 7, 3, dev="cpu")
    assert torch.equal(a, a2)  # seeded
    g, _ = numerics.make_inputs(200, 500, 1, "gaussian", dev="cpu")
    t, _ = numerics.make_inputs(200, 500, 1, "student_t", dev="cpu")

    def kurtosis(v):
        v = v.double().flatten() - v.double().mean()
        return (v**4).mean().item() / (v**2).mean().item() ** 2

    assert kurtosis(g) == pytest.approx(3, abs=0.3)
    assert kurtosis(t) > 6  # heavy tails
    with pytest.raises(ValueError, match="dist must"):
        numerics.make_inputs(2, 2, 2, "cauchy")
    with pytest.raises(ValueError, match="m, k, n"):
        numerics.make_inputs(0, 2, 2)


def test_rel_error_and_slope():
    ref = torch.tensor([3.0, 4.0])
    assert numerics.rel_error(ref + torch.tensor([0.3, 0.4]), ref) == pytest.approx(0.1)
    assert numerics.rel_error(torch.tensor([math.inf, 4.0]), ref) == math.inf
    with pytest.raises(ValueError, match="same shape"):
        numerics.rel_error(ref[:1], ref)
    with pytest.raises(ValueError, match="all zeros"):
        numerics.rel_error(ref, torch.zeros(2))
    ks = [64, 256, 1024]
    assert numerics.loglog_slope(ks, [math.sqrt(k) for k in ks]) == pytest.approx(0.5)
    with pytest.raises(AssertionError, match="outside the expected band"):
        numerics.assert_in_band(0.5, 0, 0.1, "x")


# --- library matmul ------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", numerics.MATMUL_FORMATS)
@pytest.mark.parametrize("shape", [(37, 1031, 29), (1, 4099, 1), (64, 512, 48)])
def test_matmul_error_in_band(fmt, shape):
    m, k, n = shape
    a, b = numerics.make_inputs(m, k, n, seed=k)
    r = numerics.matmul(a, b, fmt)
    assert r.out.shape == (m, n)
    err = numerics.rel_error(r.out, numerics.reference(a, b))
    low, high = numerics.library_error_band(fmt, k)
    # One dot product is one random draw: only the upper bound holds for every draw.
    numerics.assert_in_band(err, low if m * n >= 64 else 0, high, f"{fmt} {shape}")
    # The inputs the path reports are the ones it multiplied: what is left is the summation,
    # smaller than the total (over many outputs; one dot product's errors may cancel). cuBLAS
    # converts fp32 to tf32 itself, so its "inputs" are our guess there.
    acc = numerics.rel_error(r.out, numerics.reference(r.a_in, r.b_in))
    if m * n >= 64 and not (fmt == "tf32" and numerics.native_tf32()):
        assert acc <= err * 1.01 + 1e-6
    emulated = "emulated" in r.path
    if fmt == "fp8_e4m3":
        assert emulated != numerics.native_fp8()
    if fmt == "tf32":
        assert emulated != numerics.native_tf32()


def test_matmul_bad_input():
    a, b = torch.ones(4, 8, device=DEV), torch.ones(8, 3, device=DEV)
    with pytest.raises(TypeError, match="a must be a 2-D float32"):
        numerics.matmul(a.double(), b, "fp32")
    with pytest.raises(TypeError, match="b must be a 2-D float32"):
        numerics.matmul(a, b[0], "fp32")
    with pytest.raises(ValueError, match="do not chain"):
        numerics.matmul(a, a, "fp32")
    with pytest.raises(ValueError, match="fmt must"):
        numerics.matmul(a, b, "int8")
    with pytest.raises(ValueError, match="fp8_fast_accum"):
        numerics.matmul(a, b, "fp16", fp8_fast_accum=True)
    if not device.GPU_MODE:
        with pytest.raises(ValueError, match="fp16_accumulation"):
            numerics.matmul(a, b, "fp16", fp16_accumulation=True)


def test_cublas_flags_are_restored():
    m = torch.backends.cuda.matmul
    before = m.allow_tf32
    with numerics.cublas_flags(allow_tf32=not before):
        assert m.allow_tf32 == (not before)
    assert m.allow_tf32 == before


@pytest.mark.gpu
@pytest.mark.skipif(not numerics.native_fp8(), reason="needs fp8 tensor cores")
def test_scaled_mm_matches_emulation_and_fast_accum_loses_bits():
    a, b = numerics.make_inputs(256, 8192, 256, seed=5)
    exact = numerics.matmul(a, b, "fp8_e4m3")
    ref = numerics.reference(exact.a_in, exact.b_in)
    # The fp8 values and scales are exact: only accumulation separates _scaled_mm from fp64, and
    # with periodic promotion to fp32 (use_fast_accum=False) it costs little.
    e_exact = numerics.rel_error(exact.out, ref)
    assert e_exact < 1e-3
    fast = numerics.matmul(a, b, "fp8_e4m3", fp8_fast_accum=True)
    e_fast = numerics.rel_error(fast.out, ref)
    assert e_fast < 5e-2
    if device.capabilities().compute_capability < (10, 0):
        # Ada and Hopper: fast accumulation keeps the tensor cores' ~14-bit sums, no promotion.
        assert e_fast > 3 * e_exact


# --- emulated accumulation -----------------------------------------------------------------------


def test_emulated_fp16_accumulator_matches_numpy_loop():
    a, b = numerics.make_inputs(3, 300, 2, seed=11, dev="cpu")
    a, b = a.half().float(), b.half().float()
    got = numerics.emulated_matmul(a, b, accumulator="fp16")
    an, bn = a.double().numpy(), b.double().numpy()
    want = np.zeros((3, 2))
    for i in range(3):
        for j in range(2):
            acc = 0.0
            for k in range(300):
                acc = float(np.float16(acc + an[i, k] * bn[k, j]))  # numpy rounds f64->f16 once
            want[i, j] = acc
    assert np.array_equal(got.numpy(), want)


def test_emulated_wide_accumulator_is_exact_enough():
    a, b = numerics.make_inputs(8, 1000, 8, seed=1)
    ref = numerics.reference(a, b)
    assert numerics.rel_error(numerics.emulated_matmul(a, b, accumulator=53), ref) < 1e-14
    assert numerics.rel_error(numerics.emulated_matmul(a, b, accumulator="fp32"), ref) < 1e-6


def test_checkpoints_equal_prefix_products():
    a, b = numerics.make_inputs(4, 256, 5, seed=2)
    kw = dict(accumulator="bf16", group=8, promote_every=32)
    prefixes = numerics.emulated_matmul(a, b, checkpoints=[64, 256], **kw)
    assert set(prefixes) == {64, 256}
    assert torch.equal(prefixes[64], numerics.emulated_matmul(a[:, :64], b[:64], **kw))
    assert torch.equal(prefixes[256], numerics.emulated_matmul(a, b, **kw))


def test_promotion_reduces_error_and_error_grows_with_k():
    a, b = numerics.make_inputs(16, 4096, 16, seed=4)
    a, b = a.half().float(), b.half().float()
    ks = [256, 1024, 4096]
    seq = numerics.emulated_matmul(a, b, accumulator="fp16", checkpoints=ks)
    errs = [numerics.rel_error(seq[k], numerics.reference(a[:, :k], b[:k])) for k in ks]
    assert 0.3 < numerics.loglog_slope(ks, errs) < 0.8  # about sqrt(K)
    chunked = numerics.emulated_matmul(a, b, accumulator="fp16", promote_every=128)
    assert numerics.rel_error(chunked, numerics.reference(a, b)) < errs[-1] / 2


def test_truncating_accumulator_is_worse_than_rounding():
    a, b = numerics.make_inputs(16, 4096, 16, seed=6)
    ref = numerics.reference(a, b)
    near = numerics.emulated_matmul(a, b, accumulator=14, group=32)
    trunc = numerics.emulated_matmul(a, b, accumulator=14, mode="truncate", group=32)
    promoted = numerics.emulated_matmul(
        a, b, accumulator=14, mode="truncate", group=32, promote_every=128
    )
    e_near, e_trunc = numerics.rel_error(near, ref), numerics.rel_error(trunc, ref)
    assert e_trunc > 3 * e_near
    assert numerics.rel_error(promoted, ref) < e_trunc / 5


def test_emulated_bad_input():
    a, b = torch.ones(2, 64), torch.ones(64, 3)
    with pytest.raises(ValueError, match="a and b must be"):
        numerics.emulated_matmul(a, a)
    with pytest.raises(ValueError, match="promote_every"):
        numerics.emulated_matmul(a, b, group=32, promote_every=48)
    with pytest.raises(ValueError, match="checkpoints"):
        numerics.emulated_matmul(a, b, group=8, checkpoints=[12])
    with pytest.raises(ValueError, match="truncate"):
        numerics.emulated_matmul(a, b, accumulator="fp16", mode="truncate")
    with pytest.raises(ValueError, match="group must"):
        numerics.emulated_matmul(a, b, group=0)


def test_library_error_band():
    assert numerics.library_error_band("fp32", 8192)[0] == 0
    assert numerics.library_error_band("fp32", 8192)[1] < 1.1e-5
    low, high = numerics.library_error_band("bf16", 8192)
    assert low == 2**-8 / 4 and 7e-3 < high < 1e-2
    with pytest.raises(ValueError, match="fmt must"):
        numerics.library_error_band("fp12", 10)


def test_error_models():
    m = numerics.error_models("fp16", [1, 4])
    assert m == {"sqrtK_u": [2**-11, 2**-10], "K_u": [2**-11, 2**-9]}


def test_formats_table_and_chapter_copy_is_current():
    table = numerics.formats_table()
    assert len(table.splitlines()) == 2 + len(numerics.FORMATS)
    assert "| fp8_e4m3 | 8: 1.4.3 | 4 |" in table and "| 448 |" in table
    # One of the Act 1.5 pages pastes this table; regenerate it there when FORMATS changes.
    pages = sorted((ROOT / "acts").glob("act1-5-moving-target*.md"))
    assert pages, "the Act 1.5 pages are missing"
    assert any(table in p.read_text(encoding="utf-8") for p in pages)
