import math

import pytest
import torch
from conftest import LATENT_DTYPES, LATENT_TOL, latent_config, rel_err

from kernels import device, mla

DTYPES, TOL = LATENT_DTYPES, LATENT_TOL  # shared with test_dsa.py (conftest)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "seq_lens, n_heads, r, d_rope, page, splits",
    [
        ([1, 17, 100], 3, 32, 16, 16, None),  # odd head count, lengths off every tile
        ([130, 0, 33], 16, 64, 16, 8, 3),  # an empty sequence, several splits
        ([40], 1, 48, 8, 16, 7),  # one head, r not a power of two, more splits than tiles
        ([77, 3], 33, 16, 8, 1, 2),  # one-token blocks; 33 heads: several head blocks
        ([0, 0], 3, 16, 16, 4, 1),  # nothing to attend to: zeros through the direct path
        ([70, 5], 3, 512, 64, 64, 2),  # DeepSeek-V3's widths
    ],
)
def test_matches_fp32_reference(seq_lens, n_heads, r, d_rope, page, splits, dtype):
    q, qr, kv, table, lens = mla.decode_case(
        seq_lens, n_heads, r, d_rope, block_size=page, dtype=dtype, seed=sum(seq_lens)
    )
    config = latent_config(dtype, autotune=seq_lens == [1, 17, 100])
    out = mla.mla_decode(q, qr, kv, table, lens, num_splits=splits, config=config)
    assert out.shape == q.shape and out.dtype == dtype
    ref = mla.mla_decode_ref(q, qr, kv, table, lens)
    if max(seq_lens):
        assert rel_err(out, ref) < TOL[dtype]
    for b, n in enumerate(seq_lens):
        if n == 0:  # an empty sequence attends to nothing: zeros, not NaN
            assert torch.equal(out[b].float(), torch.zeros_like(out[b].float()))


@pytest.mark.parametrize("splits", [1, 3])
def test_batch_of_33_ragged(splits):
    g = torch.Generator().manual_seed(33)
    lens = torch.randint(0, 25, (33,), generator=g).tolist()
    lens[5] = 0
    q, qr, kv, table, sl = mla.decode_case(lens, 3, 16, 16, block_size=4, dtype=torch.float32)
    out = mla.mla_decode(
        q, qr, kv, table, sl, num_splits=splits, config=latent_config(torch.float32)
    )
    torch.testing.assert_close(out, mla.mla_decode_ref(q, qr, kv, table, sl), rtol=1e-5, atol=1e-5)


def test_splits_do_not_change_the_result():
    q, qr, kv, table, lens = mla.decode_case([150, 41], 3, 32, 16, block_size=16,
                                             dtype=torch.float32, seed=1)  # fmt: skip
    one = mla.mla_decode(q, qr, kv, table, lens, num_splits=1, config=latent_config(q.dtype))
    for splits in (2, 7):
        got = mla.mla_decode(
            q, qr, kv, table, lens, num_splits=splits, config=latent_config(q.dtype)
        )
        torch.testing.assert_close(got, one, rtol=1e-5, atol=1e-6)


def test_sm_scale_config_and_strided_query():
    q, qr, kv, table, lens = mla.decode_case([60, 9], 5, 32, 16, block_size=16,
                                             dtype=torch.float32, seed=2)  # fmt: skip
    ref = mla.mla_decode_ref(q, qr, kv, table, lens, 0.3)
    got = mla.mla_decode(q, qr, kv, table, lens, 0.3, num_splits=2, config=(16, 16, 4, 1))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # The queries as slices of one fused projection [B, H, r + d_rope]: last dim contiguous only.
    fused = torch.cat([q, qr], -1)
    got = mla.mla_decode(fused[..., :32], fused[..., 32:], kv, table, lens, 0.3)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_eager_baseline_matches_reference():
    q, qr, kv, table, lens = mla.decode_case([33, 0, 8], 4, 32, 16, block_size=8,
                                             dtype=torch.float32, seed=4)  # fmt: skip
    ref = mla.mla_decode_ref(q, qr, kv, table, lens)
    torch.testing.assert_close(mla.mla_decode_eager(q, qr, kv, table, lens), ref,
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_absorbed_equals_naive_in_fp64():
    """The absorption identity: attention over re-expanded per-head keys and values (the model's
    definition) equals attention over latents with W_UK folded into the query and W_UV applied
    after, to fp64 rounding."""
    n_heads, d_nope, d_v, r, d_rope = 3, 8, 12, 16, 8
    g = torch.Generator().manual_seed(5)
    w_kv_b = torch.randn(n_heads * (d_nope + d_v), r, generator=g, dtype=torch.float64)
    w_kv_b = w_kv_b.to(device.DEVICE)  # with decode_case's tensors (a GPU's launcher wants it)
    w_uk, w_uv = mla.split_kv_b_proj(w_kv_b, n_heads, d_nope, d_v)
    weights = mla.absorb(w_uk, w_uv, n_heads)
    assert weights.w_uk.shape == (n_heads, d_nope, r) and weights.w_uv.shape == (n_heads, r, d_v)
    _, q_rope, kv, table, lens = mla.decode_case([19, 0, 7], n_heads, r, d_rope, block_size=4,
                                                 dtype=torch.float64, seed=6)  # fmt: skip
    q_nope = torch.randn(3, n_heads, d_nope, generator=g, dtype=torch.float64).to(device.DEVICE)
    scale = 1.0 / math.sqrt(d_nope + d_rope)  # the model's scale, before absorption
    naive = mla.mla_decode_naive(q_nope, q_rope, kv, table, lens, weights, scale)
    absorbed = weights.output(mla.mla_decode_ref(weights.query(q_nope), q_rope, kv, table, lens,
                                                 scale))  # fmt: skip
    assert naive.shape == (3, n_heads, d_v)
    torch.testing.assert_close(absorbed, naive, rtol=1e-10, atol=1e-12)
    # The Triton kernel on the absorbed form, in fp32.
    o_lat = mla.mla_decode(weights.query(q_nope).float(), q_rope.float(), kv.float(), table, lens,
                           scale)  # fmt: skip
    # fp32 against fp64: the file's fp32 tolerance (largest error 1.3e-6 in the interpreter).
    torch.testing.assert_close(weights.output(o_lat.double()), naive, rtol=1e-5, atol=1e-5)


def test_absorb_layout_and_errors():
    w_uk = torch.arange(2 * 3 * 4, dtype=torch.float32).view(6, 4)  # H = 2, d_nope = 3, r = 4
    w_uv = torch.arange(2 * 5 * 4, dtype=torch.float32).view(10, 4)  # d_v = 5
    a = mla.absorb(w_uk, w_uv, 2)
    assert torch.equal(a.w_uk[1], w_uk[3:6])  # head 1's key rows
    assert torch.equal(a.w_uv[1], w_uv[5:10].T)  # head 1's value rows, transposed
    with pytest.raises(ValueError, match="multiple of n_heads"):
        mla.absorb(w_uk, w_uv, 4)
    with pytest.raises(ValueError, match="latent rank"):
        mla.absorb(w_uk, w_uv[:, :3], 2)
    with pytest.raises(ValueError, match="n_heads must be a positive int"):
        mla.absorb(w_uk, w_uv, 0)
    with pytest.raises(ValueError, match="w_uv must be a 2-D"):
        mla.absorb(w_uk, w_uv[None], 2)


def test_empty_batch():
    q, qr, kv, table, lens = mla.decode_case([5], 2, 16, 16, block_size=4, dtype=torch.float16)
    assert mla.mla_decode(q[:0], qr[:0], kv, table[:0], lens[:0]).shape == (0, 2, 16)


def test_napkin_math():
    assert mla.mla_cache_bytes_per_token() == 576 * 2
    assert mla.mha_cache_bytes_per_token() == 128 * (192 + 128) * 2
    assert mla.gqa_cache_bytes_per_token() == 2 * 8 * 128 * 2
    b, ctx = 4, 1000
    assert mla.mla_decode_bytes(b, ctx) == 2 * (b * ctx * 576 + b * 128 * (576 + 512))
    assert mla.mla_decode_flops(b, ctx) == b * 128 * ctx * (2 * 576 + 2 * 512)
    # Intensity: about 1.9 FLOP per byte per head, almost independent of the batch.
    at = [mla.mla_decode_intensity(b, 32768) for b in (1, 128)]
    assert 1.85 * 128 < at[0] < 1.9 * 128 and abs(at[0] - at[1]) < 1e-9
    t, roof = mla.mla_decode_roof_s(1, 1024, bandwidth_gbps=1000.0, tflops=1e6)
    assert roof == "memory" and t == pytest.approx(mla.mla_decode_bytes(1, 1024) / 1e12)
    assert mla.mla_decode_roof_s(1, 1024, bandwidth_gbps=1e9, tflops=1.0)[1] == "compute"
    assert 1 <= mla.default_num_splits(128, 32768) <= mla.default_num_splits(1, 32768) <= 64
    assert mla.default_num_splits(1, 100) == 1  # too short to split


def test_decode_case_exact_table():
    loose = mla.decode_case([130, 5], 2, 16, 16, spare_blocks=0, dtype=torch.float32)
    exact = mla.decode_case([130, 5], 2, 16, 16, spare_blocks=0, exact_table=True,
                            dtype=torch.float32)  # fmt: skip
    assert loose[3].shape == (2, 4) and exact[3].shape == (2, 3)  # ceil(130 / 64) = 3 blocks
    assert torch.equal(exact[3], loose[3][:, :3])
    for a, b in zip(loose[:3] + loose[4:], exact[:3] + exact[4:]):
        assert torch.equal(a, b)


def _t(*shape, dtype=torch.float16):
    return torch.zeros(*shape, dtype=dtype, device=device.DEVICE)


_I32 = torch.int32
_GOOD = (_t(2, 3, 32), _t(2, 3, 16), _t(9, 16, 48), _t(2, 3, dtype=_I32), _t(2, dtype=_I32))


def _with(i, v):
    args = list(_GOOD)
    args[i] = v
    return tuple(args)


@pytest.mark.parametrize(
    "args, kw, err, match",
    [
        (_with(0, _t(2, 3, 32, dtype=torch.int8)), {}, TypeError, "q_latent must have dtype"),
        (_with(2, _t(9, 16, 48, dtype=torch.float32)), {}, TypeError, "same dtype"),
        (_with(2, _t(9, 16, 40)), {}, ValueError, "width r \\+ d_rope"),
        (_with(1, _t(2, 4, 16)), {}, ValueError, "q_rope must match"),
        (_with(2, _t(9, 12, 48)), {}, ValueError, "block_size"),
        (_with(3, _t(2, 3, dtype=torch.int64)), {}, TypeError, "block_table"),
        (_with(4, _t(2, dtype=torch.int64)), {}, TypeError, "seq_lens"),
        (_with(4, _t(3, dtype=_I32)), {}, ValueError, "seq_lens"),
        (_with(3, _t(3, 3, dtype=_I32)), {}, ValueError, "block_table"),
        (_with(0, _t(2, 3, 4, 32)), {}, ValueError, "q_latent must be 3-D"),
        (_GOOD, {"num_splits": 0}, ValueError, "num_splits"),
        (_GOOD, {"config": (16, 24, 4, 1)}, ValueError, "config"),
        (_GOOD, {"config": (8, 16, 4, 1)}, ValueError, "BLOCK_H a power of two >= 16"),
        (_GOOD, {"sm_scale": -1.0}, ValueError, "sm_scale"),
    ],
)
def test_bad_input(args, kw, err, match):
    with pytest.raises(err, match=match):
        mla.mla_decode(*args, **kw)


def _bad_values():
    q, qr, kv, table, lens = mla.decode_case([5, 3], 2, 16, 16, block_size=4, dtype=torch.float32)
    capacity = table.shape[1] * 4
    too_long = torch.tensor([5, capacity + 1], dtype=_I32, device=device.DEVICE)
    negative = torch.tensor([5, -1], dtype=_I32, device=device.DEVICE)
    past_pool = table.clone()
    past_pool[1, 0] = kv.shape[0]
    return (q, qr, kv, table, lens), [
        ((table, too_long), "capacity", 1),
        ((table, negative), "seq_lens must be >= 0", 1),
        ((past_pool, lens), "outside the pool", 1),
    ]


def test_bad_values_raise_in_debug_mode():
    (q, qr, kv, _, _), cases = _bad_values()
    for (table, lens), match, _ in cases:
        with pytest.raises(ValueError, match=match):
            mla.mla_decode(q, qr, kv, table, lens)


@pytest.mark.parametrize("splits", [1, 2])
def test_bad_values_give_nan_without_the_checks(monkeypatch, splits):
    """Outside debug mode on a GPU values go unchecked: the kernel must still never read outside
    the pool or the table, and the sequence at fault answers NaN; the other is unaffected."""
    (q, qr, kv, table, lens), cases = _bad_values()
    want = mla.mla_decode(q, qr, kv, table, lens, num_splits=splits)
    monkeypatch.setattr(mla._validate, "check_values", lambda *t: False)
    for (bad_table, bad_lens), match, fault in cases:
        out = mla.mla_decode(q, qr, kv, bad_table, bad_lens, num_splits=splits)
        assert torch.isnan(out[fault]).all(), match
        assert torch.equal(out[1 - fault], want[1 - fault]), match


def test_unused_table_entries_are_not_checked():
    q, qr, kv, table, lens = mla.decode_case([5, 3], 2, 16, 16, block_size=4, dtype=torch.float32)
    want = mla.mla_decode(q, qr, kv, table, lens, num_splits=1)
    table[1, 1] = 10**9  # sequence 1 (3 tokens) reads only column 0
    assert torch.equal(mla.mla_decode(q, qr, kv, table, lens, num_splits=1), want)


def test_benchmark_runs_in_quick_mode():
    if device.GPU_MODE:
        pytest.skip("the full benchmark runs on GPU machines through kernels.bench")
    recs = mla._bench_mla_decode(True)
    assert {r["variant"] for r in recs} == {"triton", "eager-absorbed", "naive-sdpa"}
    ours = next(r for r in recs if r["variant"] == "triton")
    assert ours["baseline"] == "eager-absorbed" and ours["ceiling"].startswith("roof:")


@pytest.mark.skipif(not device.GPU_MODE, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("splits", [None, 1])
def test_cuda_graph_capture(splits):
    from conftest import eager_and_graphed

    q, qr, kv, table, lens = mla.decode_case([37, 1, 200], 16, 64, 16, dtype=torch.bfloat16)
    eager, graphed = eager_and_graphed(
        lambda: mla.mla_decode(q, qr, kv, table, lens, num_splits=splits)
    )
    assert torch.equal(eager, graphed)


def test_a_layout_is_checked_and_planned_once_its_values_on_every_call(monkeypatch):
    """As paged_decode: the structural checks run on a layout's first call, the values (lengths,
    block ids) and sm_scale on every call, and a new layout is checked afresh."""
    q, qr, kv, table, sl = mla.decode_case([21, 6], 3, 16, 16, block_size=4, dtype=torch.float32)
    cfg = latent_config(torch.float32)
    calls = []
    check = mla._check_decode
    monkeypatch.setattr(mla, "_check_decode", lambda *a: calls.append(1) or check(*a))
    want = mla.mla_decode(q, qr, kv, table, sl, num_splits=2, config=cfg)
    assert torch.equal(mla.mla_decode(q, qr, kv, table, sl, num_splits=2, config=cfg), want)
    assert len(calls) == 1
    bad = sl.clone()
    bad[1] = 10**6
    with pytest.raises(ValueError, match="seq_lens"):
        mla.mla_decode(q, qr, kv, table, bad, num_splits=2, config=cfg)
    with pytest.raises(TypeError, match="block_table"):
        mla.mla_decode(q, qr, kv, table.long(), sl, num_splits=2, config=cfg)
    with pytest.raises(ValueError, match="sm_scale"):
        mla.mla_decode(q, qr, kv, table, sl, -1.0, num_splits=2, config=cfg)
    with pytest.raises(ValueError, match="num_splits"):
        mla.mla_decode(q, qr, kv, table, sl, num_splits=[2], config=cfg)
    with pytest.raises(ValueError, match="num_splits"):
        mla.mla_decode(q, qr, kv, table, sl, num_splits=2.0, config=cfg)
