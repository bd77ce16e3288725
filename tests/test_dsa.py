import pytest
import torch
from conftest import LATENT_DTYPES, LATENT_TOL, latent_config, rel_err

from kernels import device, dsa, mla

DTYPES, TOL = LATENT_DTYPES, LATENT_TOL  # shared with test_mla.py (conftest)
_I32 = torch.int32


def _indexer_args(c):
    return c["q_idx"], c["k_idx_cache"], c["w"], c["block_table"], c["positions"]


def _attn_args(c):
    return c["q_latent"], c["q_rope"], c["kv_cache"], c["block_table"]


def _decode_attn_args(c):
    """``_attn_args`` in the decode layout: the one query of each sequence, ``[B, H, ·]``."""
    return c["q_latent"][:, 0], c["q_rope"][:, 0], c["kv_cache"], c["block_table"]


# ----------------------------------------------------------------------------- indexer


@pytest.mark.parametrize(
    "seq_lens, n_queries, n_idx_heads, d_idx, page, config",
    [
        ([1, 40, 0, 130], 1, 3, 16, 16, None),  # decode: ragged, an empty sequence
        ([5, 70], 7, 16, 24, 8, None),  # prefill chunk longer than a sequence; d_I not 2^k
        ([33], 5, 1, 16, 4, (1, 16, 4, 1)),  # one index head, BLOCK_T = 1
        ([20, 9], 3, 3, 16, 16, (4, 32, 4, 1)),  # BLOCK_T past the chunk
    ],
)
def test_indexer_matches_reference(seq_lens, n_queries, n_idx_heads, d_idx, page, config):
    c = dsa.dsa_case(seq_lens, 2, 16, 16, n_idx_heads, d_idx, n_queries=n_queries,
                     block_size=page, dtype=torch.float32, seed=sum(seq_lens))  # fmt: skip
    got = dsa.lightning_indexer(*_indexer_args(c), config=config)
    ref = dsa.lightning_indexer_ref(*_indexer_args(c))
    assert got.shape == ref.shape == (len(seq_lens), n_queries, c["block_table"].shape[1] * page)
    future = torch.isinf(ref)
    assert torch.equal(torch.isneginf(got), future)  # causal: -inf exactly past each position
    torch.testing.assert_close(got[~future], ref[~future], rtol=1e-5, atol=1e-5)


def test_indexer_fp16_and_n_ctx():
    c = dsa.dsa_case([50, 17], 2, 16, 16, 4, 32, n_queries=2, block_size=8, dtype=torch.float16)
    got = dsa.lightning_indexer(*_indexer_args(c), n_ctx=50)
    ref = dsa.lightning_indexer_ref(*_indexer_args(c), n_ctx=50)
    assert got.shape == (2, 2, 50)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), fin)
    # fp16 products are exact in the dot's fp32 accumulator and all that follows is fp32: only
    # the summation order differs from the reference (0 in the interpreter).
    assert rel_err(got[fin], ref[fin]) < 1e-4


def test_indexer_dtype_follows_the_device():
    want = torch.float32
    if device.GPU_MODE:  # bf16, or fp16 on a GPU without it
        bf16 = device.preferred_dtype(torch.bfloat16)
        want = torch.float8_e4m3fn if device.capabilities().fp8 else bf16
    assert dsa.indexer_dtype() == want


@pytest.mark.gpu
@pytest.mark.skipif(
    not (device.GPU_MODE and device.capabilities().fp8), reason="needs a GPU with FP8 dots"
)
@pytest.mark.parametrize("d_idx, config", [(16, None), (128, None), (16, (1, 32, 4, 2))])
def test_indexer_fp8_matches_reference(d_idx, config):
    """FP8 e4m3 q and k (what indexer_dtype() picks on Hopper), d_I = 16 included: an fp8 dot
    needs a reduction of at least 32, so the launcher pads d_I. The reference reads the same fp8
    values in fp32; Hopper's fp8 dots accumulate in reduced precision, hence 1e-2."""
    c = dsa.dsa_case([1, 40, 0, 130], 2, 16, 16, 8, d_idx, n_queries=3, block_size=16,
                     dtype=torch.float32, idx_dtype=torch.float8_e4m3fn)  # fmt: skip
    got = dsa.lightning_indexer(*_indexer_args(c), config=config)
    q, k, w, table, pos = _indexer_args(c)
    ref = dsa.lightning_indexer_ref(q.float(), k.float(), w, table, pos)
    future = torch.isinf(ref)
    assert torch.equal(torch.isneginf(got), future)
    assert rel_err(got[~future], ref[~future]) < 1e-2


# ----------------------------------------------------------------------------- top-k


def _topk_ref(scores, k, positions):
    """Brute force: every visible token sorted by score, the first k."""
    out = []
    for row, pos in zip(scores.reshape(-1, scores.shape[-1]), positions.reshape(-1).tolist()):
        visible = row[: pos + 1]
        order = torch.argsort(visible, descending=True)[:k]
        out.append(set(order.tolist()))
    return out


@pytest.mark.parametrize("k", [1, 8, 64])
def test_topk_is_the_reference_set(k):
    # Distinct random scores (no ties: the set is then unique), -inf past each position as the
    # indexer leaves them.
    g = torch.Generator().manual_seed(k)
    positions = torch.tensor([[38, 39], [-1, -1], [1, 2], [23, 24]], dtype=_I32)
    scores = torch.randperm(4 * 2 * 48, generator=g).view(4, 2, 48).float()
    scores = scores.masked_fill(torch.arange(48) > positions[..., None], float("-inf"))
    scores, positions = scores.to(device.DEVICE), positions.to(device.DEVICE)
    idx = dsa.topk_indices(scores, k, positions)
    assert idx.shape == (4, 2, k) and idx.dtype == _I32
    for got, want, pos in zip(idx.reshape(-1, k), _topk_ref(scores, k, positions),
                              positions.reshape(-1).tolist()):  # fmt: skip
        real = got[got >= 0].tolist()
        assert set(real) == want and len(real) == len(want)  # distinct, and the same set
        assert len(real) == min(k, pos + 1)  # padded with -1 when the context is short
    # Without positions, -inf scores mark the invisible tokens.
    torch.testing.assert_close(
        torch.sort(dsa.topk_indices(scores, k), -1).values,
        torch.sort(idx, -1).values,
    )


# ----------------------------------------------------------------------------- sparse attention


def _random_indices(seq_lens, n_queries, k, positions, seed=0, missing=0.25):
    """Distinct random earlier tokens per query, in random order, some slots -1."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((len(seq_lens), n_queries, k), -1, dtype=_I32)
    for b in range(len(seq_lens)):
        for t in range(n_queries):
            n = int(positions[b, t]) + 1
            pick = torch.randperm(max(n, 0), generator=g)[:k]
            slots = torch.randperm(k, generator=g)[: len(pick)]
            keep = torch.rand(len(pick), generator=g) >= missing
            out[b, t, slots[keep]] = pick[keep].to(_I32)
    return out.to(device.DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "seq_lens, n_queries, n_heads, r, d_rope, page, k, splits",
    [
        ([1, 40, 0, 130], 1, 3, 32, 16, 16, 24, None),  # decode, ragged, context < k
        ([90, 7], 1, 16, 48, 8, 8, 40, 3),  # split-K on, r not a power of two
        ([60], 1, 1, 16, 16, 4, 16, 1),  # one head, split-K off
        ([12, 30], 6, 20, 16, 16, 8, 8, None),  # prefill, each query its own list; 2 head blocks
        ([50], 2, 3, 512, 64, 64, 32, 2),  # DeepSeek-V3's widths
    ],
)
def test_sparse_mla_matches_reference(seq_lens, n_queries, n_heads, r, d_rope, page, k, splits,
                                      dtype):  # fmt: skip
    c = dsa.dsa_case(seq_lens, n_heads, r, d_rope, 2, 16, n_queries=n_queries, block_size=page,
                     dtype=dtype, seed=len(seq_lens) + k)  # fmt: skip
    idx = _random_indices(seq_lens, n_queries, k, c["positions"].cpu(), seed=k)
    args = _attn_args(c)
    if n_queries == 1:  # the decode layout: [B, H, ·] and indices [B, k]
        args, idx = _decode_attn_args(c), idx[:, 0]
    got = dsa.sparse_mla(*args, idx, num_splits=splits, config=latent_config(dtype, k == 24))
    ref = dsa.sparse_mla_ref(*args, idx)
    assert got.shape == args[0].shape and got.dtype == dtype
    assert rel_err(got, ref) < TOL[dtype]
    empty = (idx < 0).all(-1)  # a query with no token gets zeros
    assert torch.equal(got[empty].float(), torch.zeros_like(got[empty].float()))


def test_sparse_mla_batch_of_33_and_order_independence():
    g = torch.Generator().manual_seed(9)
    lens = torch.randint(0, 30, (33,), generator=g).tolist()
    c = dsa.dsa_case(lens, 3, 16, 16, 2, 16, block_size=4, dtype=torch.float32)
    idx = _random_indices(lens, 1, 12, c["positions"].cpu(), seed=3)[:, 0]
    q, qr, kv, table = _decode_attn_args(c)
    got = dsa.sparse_mla(q, qr, kv, table, idx, num_splits=2)
    torch.testing.assert_close(got, dsa.sparse_mla_ref(q, qr, kv, table, idx), rtol=1e-5, atol=1e-5)
    flipped = dsa.sparse_mla(q, qr, kv, table, idx.flip(-1), num_splits=1)
    torch.testing.assert_close(flipped, got, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- the pipeline


def test_dsa_decode_with_k_past_the_context_is_dense_mla():
    """With k >= every context, DSA keeps every token: it must equal dense MLA decode."""
    c = dsa.dsa_case([1, 37, 0, 20], 16, 32, 16, 3, 16, block_size=8, dtype=torch.float32)
    q, qr, kv, table = _decode_attn_args(c)
    got = dsa.dsa_decode(q, qr, kv, c["q_idx"][:, 0], c["k_idx_cache"], c["w"][:, 0], table,
                         c["seq_lens"], topk=64)  # fmt: skip
    torch.testing.assert_close(got, mla.mla_decode_ref(q, qr, kv, table, c["seq_lens"]),
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_dsa_decode_and_prefill_match_the_reference_pipeline():
    c = dsa.dsa_case([45, 9, 70], 3, 16, 16, 4, 16, n_queries=5, block_size=8,
                     dtype=torch.float32, seed=11)  # fmt: skip
    k = 8
    scores = dsa.lightning_indexer_ref(*_indexer_args(c))
    ref_idx = dsa.topk_indices(scores, k, c["positions"])
    want = dsa.sparse_mla_ref(*_attn_args(c), ref_idx)
    got = dsa.dsa_prefill(*_attn_args(c)[:3], c["q_idx"], c["k_idx_cache"], c["w"],
                          c["block_table"], c["positions"], topk=k, query_chunk=2)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The last query of each sequence is its decode step.
    q, qr, kv, table = _attn_args(c)
    dec = dsa.dsa_decode(q[:, -1], qr[:, -1], kv, c["q_idx"][:, -1], c["k_idx_cache"],
                         c["w"][:, -1], table, c["seq_lens"], topk=k)  # fmt: skip
    torch.testing.assert_close(dec, want[:, -1], rtol=1e-5, atol=1e-5)


def test_cost_model():
    kw = dict(bandwidth_gbps=3000.0, tflops_bf16=700.0, tflops_index=1400.0)  # test inputs only
    t = dsa.dsa_decode_time_s(131072, 8, kw["bandwidth_gbps"], kw["tflops_bf16"],
                              kw["tflops_index"])  # fmt: skip
    assert t["dsa"] == pytest.approx(t["indexer"] + t["topk"] + t["sparse"])
    assert t["dsa"] < t["dense"]
    x = dsa.crossover_context(**kw)
    assert 2048 < x < 8192  # k = 2048 rows of 1,152 bytes against ~136 bytes per token
    for ctx, wins in ((x, True), (x - 1, False)):
        t = dsa.dsa_decode_time_s(ctx, 1, kw["bandwidth_gbps"], kw["tflops_bf16"],
                                  kw["tflops_index"])  # fmt: skip
        assert (t["dsa"] < t["dense"]) is wins
    assert dsa.indexer_flops(1000) == 2 * 1000 * 64 * 128
    assert dsa.indexer_bytes(1000, key_bytes=1) == 1000 * 128 + 64 * 128 + 4 * 1000
    assert dsa.sparse_mla_flops(2048) == mla.mla_decode_flops(1, 2048)
    # A chunk of 4 queries ending a 10-token context: 4 * 6 + (1 + 2 + 3 + 4) = 34 causal pairs.
    dense, sparse = dsa.prefill_flops(4, 10, 8, n_heads=2, r=16, d_rope=8, n_idx_heads=3, d_idx=16)
    assert dense == 2 * 2 * 34 * (16 + 8 + 16)
    assert sparse == 2 * 34 * 3 * 16 + dsa.sparse_mla_flops(8, 4, 2, 16, 8)


# ----------------------------------------------------------------------------- bad input


def _small():
    return dsa.dsa_case([10, 5], 2, 16, 16, 2, 16, n_queries=1, block_size=4,
                        dtype=torch.float32)  # fmt: skip


def test_indexer_bad_input():
    c = _small()
    q, k, w, table, pos = _indexer_args(c)
    cases = [
        ((q.half(), k, w, table, pos), TypeError, "same dtype"),
        ((q, k[..., :8].contiguous(), w, table, pos), ValueError, "d_I"),
        ((q, k[:, :3].contiguous(), w, table, pos), ValueError, "block_size"),
        ((q, k, w.half(), table, pos), TypeError, "w must have dtype"),
        ((q, k, w[:, :, :1].contiguous(), table, pos), ValueError, "w must be"),
        ((q, k, w, table, pos.long()), TypeError, "positions"),
        ((q, k, w, table, pos + 100), ValueError, "positions must lie"),
        ((q, k, w, table.long(), pos), TypeError, "block_table"),
    ]
    bad_table = table.clone()
    bad_table[0, 0] = k.shape[0]
    cases.append(((q, k, w, bad_table, pos), ValueError, "outside the pool"))
    if not (device.GPU_MODE and device.capabilities().fp8):
        f8 = torch.float8_e4m3fn
        cases.append(((q.to(f8), k.to(f8), w, table, pos), TypeError, "FP8"))
    for args, err, match in cases:
        with pytest.raises(err, match=match):
            dsa.lightning_indexer(*args)
    with pytest.raises(ValueError, match="n_ctx"):
        dsa.lightning_indexer(q, k, w, table, pos, n_ctx=10**6)
    for config in ((3, 32, 4, 1), (2, 8, 4, 1), (2, 32, 4), (2, 32, True, 1)):
        with pytest.raises(ValueError, match="config must be \\(BLOCK_T, BLOCK_S"):
            dsa.lightning_indexer(q, k, w, table, pos, config=config)
    # More query tiles than a GPU grid axis holds (65,535): refused before the launch.
    n = 65536
    with pytest.raises(ValueError, match="q_idx holds 65536 queries"):
        dsa.lightning_indexer(
            q[:, :1].expand(-1, n, -1, -1).contiguous(), k, w[:, :1].expand(-1, n, -1).contiguous(),
            table, torch.zeros(q.shape[0], n, dtype=torch.int32, device=q.device),
        )  # fmt: skip


def test_topk_bad_input():
    scores = torch.zeros(1, 1, 5, device=device.DEVICE)
    with pytest.raises(ValueError, match="k must be"):
        dsa.topk_indices(scores, 0)
    with pytest.raises(TypeError, match="scores"):
        dsa.topk_indices(scores.half(), 2)
    with pytest.raises(ValueError, match="positions"):
        dsa.topk_indices(scores, 2, torch.zeros(2, 1, dtype=_I32, device=device.DEVICE))


def test_sparse_mla_bad_input():
    c = _small()
    q, qr, kv, table = _decode_attn_args(c)
    idx = torch.zeros(2, 4, dtype=_I32, device=device.DEVICE)
    capacity = table.shape[1] * 4
    bad_table = table.clone()
    bad_table[1, 0] = -5
    cases = [
        ((q, qr, kv, table, idx + capacity), ValueError, "indices must be -1 or token ids"),
        ((q, qr, kv, table, idx - 2), ValueError, "indices must be -1 or token ids"),
        ((q, qr, kv, table, idx.long()), TypeError, "indices"),
        ((q, qr, kv, table, idx[:1]), ValueError, "indices must be"),
        ((q, qr, kv[..., :20].contiguous(), table, idx), ValueError, "width r \\+ d_rope"),
        ((q, qr, kv[:, :3].contiguous(), table, idx), ValueError, "block_size"),
        ((q.half(), qr.half(), kv, table, idx), TypeError, "same dtype"),
        ((q, qr, kv, bad_table, idx), ValueError, "block id -5"),
    ]
    for args, err, match in cases:
        with pytest.raises(err, match=match):
            dsa.sparse_mla(*args)


def test_sparse_mla_bad_values_give_nan_without_the_checks(monkeypatch):
    c = _small()
    q, qr, kv, table = _decode_attn_args(c)
    idx = torch.tensor([[0, 3, -1, 9], [1, 4, 2, -1]], dtype=_I32, device=device.DEVICE)
    want = dsa.sparse_mla(q, qr, kv, table, idx, num_splits=1)
    monkeypatch.setattr(dsa._validate, "check_values", lambda *t: False)
    past = idx.clone()
    past[1, 0] = table.shape[1] * 4  # past the table's capacity
    bad_table = table.clone()
    bad_table[1, 1] = kv.shape[0]  # token 4 of sequence 1 lives in a block outside the pool
    for i, t in ((past, table), (idx, bad_table)):
        out = dsa.sparse_mla(q, qr, kv, t, i, num_splits=2)
        assert torch.isnan(out[1]).all()
        torch.testing.assert_close(out[0], want[0], rtol=1e-5, atol=1e-6)


def test_benchmark_runs_in_quick_mode():
    if device.GPU_MODE:
        pytest.skip("the full benchmark runs on GPU machines through kernels.bench")
    recs = dsa._bench_dsa(True)
    variants = {r["variant"] for r in recs}
    assert {"decode-dsa", "decode-dense-mla", "prefill-dsa"} <= variants
    assert any(v.startswith("prefill-sdpa-") for v in variants)
    assert all(r["ceiling"] for r in recs)
