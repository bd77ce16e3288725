"""The performance model: op costs against torch's own FLOP counter, inference arithmetic against
published parameter counts and hand derivations, and bad input refused by name."""

import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from kernels import bench, device
from kernels import perfmodel as pm

H100 = dict(bandwidth_gbps=3000.0, peak_tflops=750.0)  # measured-like roofs, ridge 250 FLOP/B


def counted_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


# --- dtypes and the roofline -------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, nbytes",
    [(torch.float32, 4), (torch.bfloat16, 2), ("bf16", 2), ("tf32", 4), ("fp8", 1), ("int4", 0.5)],
)
def test_dtype_bytes(dtype, nbytes):
    assert pm.dtype_bytes(dtype) == nbytes


@pytest.mark.parametrize("bad", ["bfloat", 2, None])
def test_dtype_bytes_rejects_unknown(bad):
    with pytest.raises(TypeError, match="dtype"):
        pm.dtype_bytes(bad)


def test_cost_time_is_the_larger_of_memory_and_compute():
    c = pm.Cost("x", flops=3e12, bytes=6e9)  # 1 ms of memory, 4 ms of compute at 750 TFLOP/s
    assert c.intensity == 500
    assert c.memory_s(3000) == pytest.approx(2e-3)
    assert c.compute_s(750) == pytest.approx(4e-3)
    assert c.time_s(**H100) == pytest.approx(4e-3)
    assert c.bound(**H100) == "compute"
    assert pm.Cost("y", flops=1e9, bytes=1e9).bound(**H100) == "memory"
    s = c + pm.Cost("z", 1, 2)
    assert (s.flops, s.bytes) == (3e12 + 1, 6e9 + 2)


def test_ridge_and_attainable():
    assert pm.ridge_point(750, 3000) == pytest.approx(250)
    assert pm.attainable_tflops(1.0, 3000, 750) == pytest.approx(3.0)
    assert pm.attainable_tflops(1e4, 3000, 750) == 750
    # At the ridge the two roofs meet.
    assert pm.attainable_tflops(250, 3000, 750) == pytest.approx(750)
    with pytest.raises(ValueError, match="bandwidth_gbps"):
        pm.ridge_point(750, 0)
    with pytest.raises(ValueError, match="intensity"):
        pm.attainable_tflops(-1, 3000, 750)


def test_regime():
    floor = 0.005  # a 5 us launch
    tiny = pm.elementwise(1024, torch.bfloat16, n_inputs=2)
    big_add = pm.elementwise(2**28, torch.bfloat16, n_inputs=2)
    big_mm = pm.matmul(8192, 8192, 8192, torch.bfloat16)
    kw = dict(launch_floor_ms=floor, **H100)
    assert pm.regime(tiny, 0.006, **kw) == "overhead"
    assert pm.regime(big_add, 0.55, **kw) == "memory"
    assert pm.regime(big_mm, 1.5, **kw) == "compute"
    # A tiny op that took many launches' worth of time is not explained by overhead alone.
    assert pm.regime(tiny, 10 * floor, **kw) == "memory"
    with pytest.raises(ValueError, match="launch_floor_ms"):
        pm.regime(tiny, 1.0, bandwidth_gbps=3000, peak_tflops=750, launch_floor_ms=0)


# --- op costs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("m, n, k", [(64, 64, 64), (5, 123, 123), (1823, 781, 17)])
def test_matmul_cost_matches_torch_flop_counter(m, n, k):
    a, b = torch.randn(m, k), torch.randn(k, n)
    c = pm.matmul(m, n, k, torch.bfloat16)
    assert c.flops == counted_flops(lambda: a @ b)
    assert c.bytes == 2 * (m * k + k * n + m * n)


@pytest.mark.parametrize("n", [64, 1024, 8192])
def test_square_matmul_intensity_is_n_over_3_in_bf16(n):
    assert pm.matmul(n, n, n, "bf16").intensity == pytest.approx(n / 3)
    assert pm.matmul(n, n, n, "fp32").intensity == pytest.approx(n / 6)


@pytest.mark.parametrize("b, h, s, d", [(1, 2, 64, 32), (2, 3, 17, 8)])
def test_attention_cost_matches_torch_flop_counter(b, h, s, d):
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    with sdpa_kernel(SDPBackend.MATH):
        counted = counted_flops(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    c = pm.attention(b, h, s, s, d, torch.bfloat16)
    assert c.flops == counted == 4 * b * h * s * s * d
    assert c.bytes == 4 * b * h * s * d * 2  # q, k, v, o
    assert c.intensity == pytest.approx(s / 2)  # bf16, non-causal, seq_q = seq_kv


def test_attention_causal_and_gqa():
    full = pm.attention(1, 8, 1024, 1024, 128, "bf16")
    causal = pm.attention(1, 8, 1024, 1024, 128, "bf16", causal=True)
    assert causal.flops == full.flops / 2 and causal.bytes == full.bytes
    gqa = pm.attention(1, 8, 1024, 1024, 128, "bf16", kv_heads=2)
    assert gqa.flops == full.flops and gqa.bytes == full.bytes * (2 + 2 * 2 / 8) / 4


def test_elementwise_reduction_softmax_costs():
    add = pm.elementwise(1000, torch.float32, n_inputs=2)
    assert (add.flops, add.bytes) == (1000, 12_000)
    assert add.intensity == pytest.approx(1 / 12)
    gelu = pm.elementwise(1000, "bf16", flops_per_element=pm.FLOPS_PER_ELEMENT["gelu"])
    assert gelu.intensity == pytest.approx(5 / 4)
    s = pm.reduction(7, 1001, torch.float32)
    assert (s.flops, s.bytes) == (7 * 1001, 4 * (7 * 1001 + 7))
    sm = pm.softmax(7, 1001, "bf16")
    assert (sm.flops, sm.bytes) == (5 * 7 * 1001, 2 * 2 * 7 * 1001)


@pytest.mark.parametrize(
    "call, arg",
    [
        (lambda: pm.matmul(0, 4, 4, "bf16"), "m"),
        (lambda: pm.matmul(4, 4, -1, "bf16"), "k"),
        (lambda: pm.softmax(4, 0, "bf16"), "cols"),
        (lambda: pm.reduction(-2, 4, "bf16"), "rows"),
        (lambda: pm.elementwise(0, "bf16"), "n"),
        (lambda: pm.attention(1, 1, 8, 8, 0, "bf16"), "head_dim"),
        (lambda: pm.attention(1, 4, 8, 8, 16, "bf16", kv_heads=0), "kv_heads"),
        (lambda: pm.elementwise_case("relu", 8, torch.float32), "op"),
    ],
)
def test_bad_sizes_raise_naming_the_argument(call, arg):
    with pytest.raises(ValueError, match=rf"\b{arg}\b"):
        call()


@pytest.mark.parametrize(
    "make",
    [
        lambda: pm.matmul_case(48, torch.float32),
        lambda: pm.matmul_case(40, torch.float32, m=3, k=17),
        lambda: pm.attention_case(1, 2, 33, 16, torch.float32),
    ],
)
def test_cases_cost_what_they_run(make):
    cost, fn = make()
    if "attention" in cost.name:
        with sdpa_kernel(SDPBackend.MATH):
            assert counted_flops(fn) == cost.flops
    else:
        assert counted_flops(fn) == cost.flops


def test_cases_run_and_return_the_right_result():
    cost, fn = pm.elementwise_case("gelu", 1001, torch.float32)
    assert fn().shape == (1001,) and cost.bytes == 2 * 4 * 1001
    cost, fn = pm.reduction_case(5, 123, torch.float32)
    assert fn().shape == (5,) and cost.flops == 5 * 123
    cost, fn = pm.softmax_case(5, 123, torch.float32)
    torch.testing.assert_close(fn().sum(-1), torch.ones(5, device=device.DEVICE))
    cost, fn = pm.elementwise_case("add", 17, torch.bfloat16)
    assert fn().dtype == torch.bfloat16 and cost.intensity == pytest.approx(1 / 6)


# --- transformer inference arithmetic ------------------------------------------------------------


def test_llama2_parameter_counts_match_the_published_models():
    # Exact counts of the released checkpoints: 6,738,415,616 and 68,976,648,192 parameters.
    assert pm.LLAMA2_7B.params == 6_738_415_616
    assert pm.LLAMA2_70B.params == 68_976_648_192
    p = pm.LLAMA2_7B.param_breakdown()
    assert p["attention"] == 32 * 4 * 4096**2
    assert p["mlp"] == 32 * 3 * 4096 * 11008
    assert pm.LLAMA2_7B.matmul_params == pm.LLAMA2_7B.params - p["embedding"] - p["norms"]


def test_head_dims_and_gqa():
    assert pm.LLAMA2_7B.head_dim == 128 and pm.LLAMA2_7B.d_kv == 4096
    assert pm.LLAMA2_70B.head_dim == 128 and pm.LLAMA2_70B.d_kv == 1024


def test_kv_cache_bytes():
    # 7B: 2 (K and V) x 32 layers x 32 heads x 128 x 2 bytes = 512 KiB per token.
    assert pm.kv_bytes_per_token(pm.LLAMA2_7B) == 512 * 1024
    # 70B with 8 KV heads: 2 x 80 x 8 x 128 x 2 = 320 KiB per token, less than the 7B's.
    assert pm.kv_bytes_per_token(pm.LLAMA2_70B) == 320 * 1024
    assert pm.kv_bytes_per_token(pm.LLAMA2_70B, "fp8") == 160 * 1024
    assert pm.kv_cache_bytes(pm.LLAMA2_7B, batch=16, context=4096) == 32 * 2**30


def test_flops_per_token():
    cfg = pm.LLAMA2_7B
    assert pm.flops_per_token(cfg, 0) == 2 * cfg.matmul_params
    extra = pm.flops_per_token(cfg, 4096) - pm.flops_per_token(cfg, 0)
    assert extra == 2 * 2 * cfg.n_layers * 4096 * cfg.d_model  # QK and AV


def test_decode_intensity_is_about_the_batch():
    for batch in (1, 8, 64):
        step = pm.decode_step(pm.LLAMA2_7B, batch, context=0)
        assert step.intensity == pytest.approx(batch, rel=0.01)
    # Weights in int8 halve the bytes: intensity doubles.
    step8 = pm.decode_step(pm.LLAMA2_7B, 8, context=0, weight_dtype="int8")
    assert step8.intensity == pytest.approx(16, rel=0.01)


def test_decode_bytes_and_prefill():
    cfg = pm.LLAMA2_7B
    step = pm.decode_step(cfg, 4, context=100)
    assert step.bytes == 2 * cfg.matmul_params + 4 * 101 * pm.kv_bytes_per_token(cfg)
    pre = pm.prefill(cfg, 1, 2048)
    # Prefill of P tokens: about P times the FLOPs of one token, the weights read once.
    assert pre.flops > 2048 * 2 * cfg.matmul_params
    assert pre.flops < 2048 * pm.flops_per_token(cfg, 2048)
    assert pre.bound(**H100) == "compute" and step.bound(**H100) == "memory"


def test_critical_batch_is_the_ridge_without_kv_cache():
    b = pm.critical_batch(pm.LLAMA2_7B, 0, **H100)
    assert b == pytest.approx(250, rel=0.02)  # ridge x 2 bytes / 2 FLOPs per weight
    b8 = pm.critical_batch(pm.LLAMA2_7B, 0, weight_dtype="int8", **H100)
    assert b8 == pytest.approx(125, rel=0.02)


@pytest.mark.parametrize("cfg", [pm.LLAMA2_7B, pm.LLAMA2_70B])
@pytest.mark.parametrize("context", [0, 512, 1024, 4096])
def test_critical_batch_agrees_with_a_search(cfg, context):
    b = pm.critical_batch(cfg, context, **H100)

    def compute_bound(batch):
        return pm.decode_step(cfg, batch, context).bound(**H100) == "compute"

    if b is None:
        assert not compute_bound(10**6)
    else:
        assert not compute_bound(math.floor(b) - 1) and compute_bound(math.ceil(b) + 1)


def test_mha_long_context_never_turns_compute_bound():
    # Llama-2-7B (MHA): each sequence adds ~1 FLOP per KV byte, far below the ridge.
    assert pm.critical_batch(pm.LLAMA2_7B, 4096, **H100) is None
    # GQA reads 4x fewer KV bytes per FLOP than MHA: 70B still has a critical batch at 1k.
    assert pm.critical_batch(pm.LLAMA2_70B, 1024, **H100) is not None


def test_tokens_per_s_and_max_batch():
    cfg = pm.LLAMA2_7B
    one = pm.decode_tokens_per_s(cfg, 1, 0, **H100)
    assert one == pytest.approx(3000e9 / (2 * cfg.matmul_params), rel=1e-3)
    assert pm.decode_tokens_per_s(cfg, 64, 0, **H100) > 60 * one
    assert pm.max_batch(cfg, 80e9, 2048) == math.floor(
        (80e9 - 2 * cfg.params) / (2048 * 512 * 1024)
    )
    assert pm.max_batch(pm.LLAMA2_70B, 80e9, 2048) == 0  # 138 GB of bf16 weights


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(d_model=100, n_heads=3), "d_model"),
        (dict(n_kv_heads=3), "n_heads"),
        (dict(d_ff=0), "d_ff"),
        (dict(n_layers=2.5), "n_layers"),
    ],
)
def test_bad_config_raises_naming_the_field(kwargs, arg):
    base = dict(name="x", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, vocab=100)
    with pytest.raises(ValueError, match=arg):
        pm.TransformerConfig(**(base | kwargs))


TINY = pm.TransformerConfig(
    "tiny", d_model=64, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=96, vocab=50
)


def _layer_ref(x, w):
    x, w = x.double(), {k: v.double() for k, v in w.items()}
    q = x @ w["q"].T
    h = x + q @ w["o"].T
    a = torch.nn.functional.silu(h @ w["gate"].T) * (h @ w["up"].T)
    return h + a @ w["down"].T


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("batch", [1, 5])
def test_decoder_layer_against_fp64_reference(dtype, tol, batch):
    torch.manual_seed(batch)
    w = pm.make_layer_weights(TINY, dtype=dtype)
    assert {k: tuple(v.shape) for k, v in w.items()} == TINY.layer_weight_shapes()
    x = torch.randn(batch, TINY.d_model, device=device.DEVICE, dtype=dtype)
    out = pm.decoder_layer(x, w)
    assert out.dtype == dtype and out.shape == x.shape
    ref = _layer_ref(x, w)
    # Absolute error relative to the output's scale: in bf16 an output near zero sums rounded
    # products of size ~1 (an unseeded run once missed atol 0.03 by 0.006 on an element of 0.04).
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("batch", [1, 7])
def test_decoder_layer_cost(batch):
    w = pm.make_layer_weights(TINY, dtype=torch.float32)
    x = torch.randn(batch, TINY.d_model, device=device.DEVICE)
    cost = pm.decoder_layer_cost(TINY, batch, torch.float32)
    matmul_flops = 2 * batch * TINY.layer_matmul_params
    assert counted_flops(lambda: pm.decoder_layer(x, w)) == matmul_flops
    elementwise_flops = 2 * batch * TINY.d_model + 5 * batch * TINY.d_ff
    assert cost.flops == matmul_flops + elementwise_flops
    # The weights dominate the bytes at small batch.
    assert cost.bytes > 4 * TINY.layer_matmul_params
    assert cost.bytes < 4 * TINY.layer_matmul_params * (1 + batch)


# --- the benchmark -----------------------------------------------------------------------------


def test_roofline_points_is_registered_and_records_ceilings():
    assert "kernels.perfmodel" in bench.BENCH_MODULES
    assert "roofline_points" in bench.BENCHMARKS
    if device.GPU_MODE:
        pytest.skip("the full benchmark runs on GPU machines through python -m kernels.bench")
    recs = bench.BENCHMARKS["roofline_points"](True)
    assert {r["bench"] for r in recs} == {
        "roofline_matmul",
        "roofline_softmax",
        "roofline_attention",
    }
    for r in recs:
        assert r["ceiling"] in ("copy", "matmul_bfloat16") and r["ceiling_frac"] > 0
        assert r["baseline"] in ("copy", "sdpa_math") and r["baseline_ms"] > 0
        assert (r["gbps"] is None) != (r["tflops"] is None)
        assert (r["ceiling"] == "copy") == (r["gbps"] is not None)
