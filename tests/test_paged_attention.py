import pytest
import torch
from conftest import eager_and_graphed, guarded, load_script

from kernels import _validate, device
from kernels import paged_attention as pa

# Triton's interpreter computes bf16 wrongly (a known limitation): bf16 is checked on GPUs only.
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if device.GPU_MODE else [])
# Relative error (Frobenius norm) against the fp32 reference: one 16-bit rounding of P and of the
# output (~5e-4 fp16, ~4e-3 bf16) plus the merge of the splits in fp32.
TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}


def _rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _case(seq_lens, n_heads, n_kv, d, page, dtype, seed=0, spare_blocks=3):
    """A shuffled pool with room for every sequence (plus spares), and its block table."""
    g = torch.Generator().manual_seed(seed)
    n = len(seq_lens)
    per_seq = max(1, -(-max(seq_lens) // page)) + 1  # one extra column: never read
    num_blocks = 1 + n * per_seq + spare_blocks
    perm = torch.randperm(num_blocks - 1, generator=g)[: n * per_seq] + 1  # block 0 is the null
    table = perm.view(n, per_seq).to(torch.int32)
    k = torch.randn(num_blocks, n_kv, page, d, generator=g).to(dtype)
    v = torch.randn(num_blocks, n_kv, page, d, generator=g).to(dtype)
    q = torch.randn(n, n_heads, d, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return [t.to(device.DEVICE) for t in (q, k, v, table, lens)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "seq_lens, n_heads, n_kv, d, page, splits",
    [
        ([1, 17, 100], 4, 2, 64, 16, None),  # GQA group 2, lengths off every tile
        ([130, 0, 33], 8, 1, 32, 4, 3),  # MQA (group 8), an empty sequence, several splits
        ([5, 64], 6, 3, 16, 8, 1),  # one split: the direct path
        ([40], 2, 2, 128, 16, 7),  # MHA, more splits than tiles: empty splits
        ([77, 3], 8, 2, 64, 1, 2),  # one-token blocks
        ([300], 16, 4, 64, 32, 4),  # group 4, long enough for several tiles per split
    ],
)
def test_matches_fp32_reference(seq_lens, n_heads, n_kv, d, page, splits, dtype):
    q, k, v, table, lens = _case(seq_lens, n_heads, n_kv, d, page, dtype, seed=sum(seq_lens))
    # On a GPU one fixed tile, except for the first case: autotuning every case (five candidates,
    # each timed) would cost minutes and test nothing more (test_fixed_config_matches_autotuned).
    config = (32, 4, 2) if device.GPU_MODE and seq_lens != [1, 17, 100] else None
    out = pa.paged_decode(q, k, v, table, lens, num_splits=splits, config=config)
    assert out.shape == q.shape and out.dtype == dtype
    ref = pa.paged_decode_ref(q, k, v, table, lens)
    assert _rel_err(out, ref) < TOL[dtype]
    for b, n in enumerate(seq_lens):
        if n == 0:  # an empty sequence attends to nothing: zeros, not NaN
            assert torch.equal(out[b].float(), torch.zeros_like(out[b].float()))


def test_fixed_config_matches_autotuned():
    q, k, v, table, lens = _case([150, 7], 8, 2, 64, 16, torch.float16, seed=7)
    tuned = pa.paged_decode(q, k, v, table, lens, num_splits=2)
    for config in [(16, 4, 1), (32, 4, 2), (64, 2, 3)]:
        fixed = pa.paged_decode(q, k, v, table, lens, num_splits=2, config=config)
        torch.testing.assert_close(fixed, tuned, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="config"):
        pa.paged_decode(q, k, v, table, lens, config=(48, 4, 3))


def test_splits_do_not_change_the_result():
    q, k, v, table, lens = _case([250, 91], 4, 2, 64, 16, torch.float32, seed=1)
    one = pa.paged_decode(q, k, v, table, lens, num_splits=1)
    for splits in (2, 5, 16):
        torch.testing.assert_close(
            pa.paged_decode(q, k, v, table, lens, num_splits=splits), one, rtol=1e-5, atol=1e-6
        )


def test_strided_query():
    # q as a slice of a fused projection [n_seqs, heads + extra, d]: only head_dim must be contiguous.
    q, k, v, table, lens = _case([70, 9], 4, 2, 64, 16, torch.float32, seed=6)
    fused = torch.cat([q, torch.randn_like(q[:, :2])], dim=1)
    view = fused[:, :4]
    assert not view.is_contiguous()
    torch.testing.assert_close(
        pa.paged_decode(view, k, v, table, lens), pa.paged_decode(q, k, v, table, lens)
    )
    with pytest.raises(ValueError, match="last dimension"):
        pa.paged_decode(q.transpose(1, 2), k, v, table, lens)


def test_sm_scale_and_convexity():
    q, k, v, table, lens = _case([60], 4, 2, 64, 16, torch.float32, seed=2)
    torch.testing.assert_close(
        pa.paged_decode(q, k, v, table, lens, 0.3),
        pa.paged_decode_ref(q, k, v, table, lens, 0.3),
        rtol=1e-5,
        atol=1e-5,
    )
    # With every value row equal to 1, every output is 1 whatever the scores.
    ones = torch.ones_like(v)
    out = pa.paged_decode(q, k, ones, table, lens, num_splits=3)
    torch.testing.assert_close(out, torch.ones_like(out))


def test_only_the_block_table_matters():
    # The same logical cache in two different physical layouts gives the same answer.
    g = torch.Generator().manual_seed(3)
    kc = torch.randn(2, 2, 96, 32, generator=g).to(device.DEVICE)
    vc = torch.randn(2, 2, 96, 32, generator=g).to(device.DEVICE)
    q = torch.randn(2, 4, 32, generator=g).to(device.DEVICE)
    lens = torch.tensor([96, 70], dtype=torch.int32, device=device.DEVICE)
    outs = []
    for shuffle in (False, True):
        k, v, table = pa.contiguous_to_paged(kc, vc, 16, shuffle=shuffle, seed=4)
        outs.append(pa.paged_decode(q, k, v, table, lens))
        # gather_kv recovers the contiguous cache exactly
        assert torch.equal(pa.gather_kv(k, table, 96), kc)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_sdpa_baseline_matches_reference():
    g = torch.Generator().manual_seed(5)
    k = torch.randn(2, 2, 64, 32, generator=g).to(device.DEVICE)
    v = torch.randn(2, 2, 64, 32, generator=g).to(device.DEVICE)
    q = torch.randn(2, 8, 32, generator=g).to(device.DEVICE)
    kc, vc, table = pa.contiguous_to_paged(k, v, 16)
    lens = torch.tensor([64, 64], dtype=torch.int32, device=device.DEVICE)
    ref = pa.paged_decode_ref(q, kc, vc, table, lens)
    torch.testing.assert_close(pa.sdpa_decode(q, k, v).float(), ref, rtol=1e-4, atol=1e-5)


def test_bytes_and_splits_helpers():
    assert pa.kv_read_bytes([32768] * 8, 8, 128, torch.bfloat16) == 8 * 32768 * 2 * 8 * 128 * 2
    assert pa.default_num_splits(1, 1, 100) == 1  # too short to split
    assert 1 <= pa.default_num_splits(64, 8, 32768) <= pa.default_num_splits(1, 8, 32768) <= 64


def test_default_splits_fill_one_wave(monkeypatch):
    """About one program per SM: a single split (no merge kernel) once the (sequence, kv head)
    pairs fill the SMs; never a split under MIN_SPLIT_TOKENS. The values the H100 probe favoured."""
    monkeypatch.setattr(pa, "sm_count", lambda interpreter=4: 132)
    assert pa.default_num_splits(1, 8, 1024) == 8  # 1,024 // 128 tokens caps 132 // 8 = 16
    assert pa.default_num_splits(16, 8, 1024) == 1  # 128 pairs: one wave already
    assert pa.default_num_splits(1, 8, 4096) == 16
    assert pa.default_num_splits(8, 8, 32768) == 2
    assert pa.default_num_splits(64, 8, 4096) == 1
    assert pa.default_num_splits(1, 1, 1 << 20) == pa.MAX_SPLITS


def test_empty_batch():
    q, k, v, table, lens = _case([5], 2, 1, 16, 4, torch.float16)
    out = pa.paged_decode(q[:0], k, v, table[:0], lens[:0])
    assert out.shape == (0, 2, 16)


def test_block_allocator():
    alloc = pa.BlockAllocator(6, 4)
    assert alloc.num_free == 5 and alloc.num_used == 0  # block 0 is reserved
    assert alloc.ensure("a", 9) == [1, 2, 3]  # 9 tokens need 3 blocks of 4
    assert alloc.ensure("a", 12) == [] and alloc.blocks_needed("a", 13) == 1
    assert alloc.ensure("b", 1) == [4]
    assert not alloc.can_hold("c", 5)
    with pytest.raises(MemoryError, match="exhausted"):
        alloc.ensure("c", 5)
    assert "c" not in alloc.blocks  # a failed allocation changes nothing
    alloc.free("a")
    assert alloc.num_free == 4 and 0 not in alloc.ensure("c", 16)


def test_paged_kv_cache_table():
    cache = pa.PagedKVCache.allocate(
        2, 1, 16, num_blocks=9, block_size=4, max_seqs=2, max_blocks_per_seq=3,
        dtype=torch.float16, device=device.DEVICE,
    )  # fmt: skip
    cache.ensure(1, 6)
    cache.sync()
    assert cache.block_table.cpu().tolist() == [[0, 0, 0], [1, 2, 0]]
    with pytest.raises(ValueError, match="exceeds"):
        cache.ensure(0, 13)
    cache.free(1)
    cache.sync()
    assert cache.block_table.cpu().sum() == 0 and cache.allocator.num_used == 0
    assert cache.bytes() == 2 * 2 * 9 * 4 * 16 * 2


def _t(*shape, dtype=torch.float16):
    return torch.zeros(*shape, dtype=dtype, device=device.DEVICE)


_I32 = torch.int32


@pytest.mark.parametrize(
    "args, kw, err, match",
    [
        ((_t(2, 4, 64, dtype=torch.int8), _t(9, 2, 16, 64), _t(9, 2, 16, 64), _t(2, 3, dtype=_I32), _t(2, dtype=_I32)), {}, TypeError, "q must have dtype"),
        ((_t(2, 4, 64), _t(9, 2, 16, 64, dtype=torch.float32), _t(9, 2, 16, 64, dtype=torch.float32), _t(2, 3, dtype=_I32), _t(2, dtype=_I32)), {}, TypeError, "same dtype"),
        ((_t(2, 4, 64), _t(9, 2, 16, 64), _t(9, 2, 16, 32), _t(2, 3, dtype=_I32), _t(2, dtype=_I32)), {}, ValueError, "same shape"),
        ((_t(2, 4, 48), _t(9, 2, 16, 48), _t(9, 2, 16, 48), _t(2, 3, dtype=_I32), _t(2, dtype=_I32)), {}, ValueError, "head_dim"),
        ((_t(2, 3, 64), _t(9, 2, 16, 64), _t(9, 2, 16, 64), _t(2, 3, dtype=_I32), _t(2, dtype=_I32)), {}, ValueError, "multiple"),
        ((_t(2, 4, 64), _t(9, 2, 12, 64), _t(9, 2, 12, 64), _t(2, 3, dtype=_I32), _t(2, dtype=_I32)), {}, ValueError, "block_size"),
        ((_t(2, 4, 64), _t(9, 2, 16, 64), _t(9, 2, 16, 64), _t(2, 3, dtype=torch.int64), _t(2, dtype=_I32)), {}, TypeError, "block_table"),
        ((_t(2, 4, 64), _t(9, 2, 16, 64), _t(9, 2, 16, 64), _t(2, 3, dtype=_I32), _t(3, dtype=_I32)), {}, ValueError, "one row per sequence"),
        ((_t(2, 4, 64), _t(9, 2, 16, 64), _t(9, 2, 16, 64), _t(2, 3, dtype=_I32), _t(2, dtype=_I32)), {"num_splits": 0}, ValueError, "num_splits"),
        ((_t(2, 4, 64), _t(9, 2, 16, 64), _t(9, 2, 16, 64), _t(2, 3, dtype=_I32), _t(2, dtype=_I32)), {"sm_scale": -1.0}, ValueError, "sm_scale"),
        ((_t(2, 4, 64), _t(9, 2, 16, 64), _t(9, 2, 16, 64), _t(2, 3, dtype=_I32).t(), _t(3, dtype=_I32)), {}, ValueError, "contiguous"),
    ],
)  # fmt: skip
def test_bad_input(args, kw, err, match):
    with pytest.raises(err, match=match):
        pa.paged_decode(*args, **kw)


@pytest.mark.parametrize("sm_scale", [float("inf"), float("nan"), 0.0])
def test_sm_scale_must_be_finite_and_positive(sm_scale):
    q, k, v, table, lens = _case([5], 2, 2, 16, 4, torch.float16)
    with pytest.raises(ValueError, match="sm_scale must be a finite positive number"):
        pa.paged_decode(q, k, v, table, lens, sm_scale=sm_scale)


def _bad_values():
    """Cases whose fault is in tensor values: lengths past the block table's capacity, negative
    lengths, block ids outside the pool."""
    q, k, v, table, lens = _case([5, 3], 2, 2, 16, 4, torch.float16)
    capacity = table.shape[1] * 4
    too_long = torch.tensor([5, capacity + 1], dtype=torch.int32, device=device.DEVICE)
    negative = torch.tensor([5, -1], dtype=torch.int32, device=device.DEVICE)
    past_pool, below = table.clone(), table.clone()
    past_pool[1, 0] = k.shape[0]
    below[0, 1] = -3
    return (
        q,
        k,
        v,
        table,
        lens,
        [
            ((table, too_long), "capacity"),
            ((table, negative), "seq_lens must be >= 0"),
            ((past_pool, lens), "outside the pool"),
            ((below, lens), "block id -3"),
        ],
    )


def test_bad_values_raise_in_debug_mode():
    q, k, v, _, _, cases = _bad_values()
    for (table, lens), match in cases:
        with pytest.raises(ValueError, match=match):
            pa.paged_decode(q, k, v, table, lens)


def test_unused_table_entries_are_not_checked():
    """Entries past a sequence's length are never read: any value there is fine."""
    q, k, v, table, lens = _case([5, 3], 2, 2, 16, 4, torch.float16)
    want = pa.paged_decode(q, k, v, table, lens, num_splits=1)
    table[1, 1] = 10**9  # sequence 1 (3 tokens) reads only column 0
    assert torch.equal(pa.paged_decode(q, k, v, table, lens, num_splits=1), want)


@pytest.mark.parametrize("splits", [1, 2])
def test_bad_values_give_nan_without_the_checks(monkeypatch, splits):
    """Outside debug mode on a GPU the values go unchecked: the kernel must still never read
    outside the pool or the table, and the sequence at fault answers NaN, never a plausible
    number; the other sequences are unaffected."""
    q, k, v, table, lens, cases = _bad_values()
    want = pa.paged_decode(q, k, v, table, lens, num_splits=splits)
    monkeypatch.setattr(pa._validate, "check_values", lambda *t: False)
    for (bad_table, bad_lens), match in cases:
        out = pa.paged_decode(q, k, v, bad_table, bad_lens, num_splits=splits)
        fault = 0 if match == "block id -3" else 1
        assert torch.isnan(out[fault]).all(), match
        assert torch.equal(out[1 - fault], want[1 - fault]), match


@pytest.mark.parametrize("splits", [1, 3])
def test_reads_nothing_outside_its_inputs(splits):
    """Out-of-bounds detection: q a strided view with NaN between its rows; caches, table and
    lengths inside NaN- (or huge-id-) filled buffers; every pool block and table column that no
    sequence owns, and every token slot past a sequence's end, poisoned too. A kernel that reads
    one element it should not (a dropped mask, an off-by-one in the page walk) returns NaN or
    a different number: the result must equal, bit for bit, the one on clean inputs."""
    seq_lens, page, d = [37, 1, 64, 0], 8, 32
    q, k, v, table, lens = _case(seq_lens, 4, 2, d, page, torch.float32, seed=3)
    clean = pa.paged_decode(q, k, v, table, lens, num_splits=splits)
    torch.testing.assert_close(clean, pa.paged_decode_ref(q, k, v, table, lens), rtol=0, atol=1e-5)
    used = torch.zeros(k.shape[0], dtype=torch.bool)
    kp, vp, tp = k.clone(), v.clone(), table.clone()
    for b, n in enumerate(seq_lens):
        n_blocks = -(-n // page)
        used[table[b, :n_blocks].long().cpu()] = True
        tp[b, n_blocks:] = 10**9  # never read: far outside the pool
        if n % page:  # the unfilled tail of the last block
            last = int(table[b, n_blocks - 1])
            kp[last, :, n % page :] = float("nan")
            vp[last, :, n % page :] = float("nan")
    kp[~used.to(kp.device)] = float("nan")
    vp[~used.to(vp.device)] = float("nan")
    qbuf = torch.full((q.shape[0], q.shape[1] + 3, d + 5), float("nan"), device=q.device)
    qbuf[:, 1 : 1 + q.shape[1], 2 : 2 + d] = q
    qv = qbuf[:, 1 : 1 + q.shape[1], 2 : 2 + d]  # strided: head_dim contiguous only
    out = pa.paged_decode(
        qv,
        guarded(kp),
        guarded(vp),
        guarded(tp, 10**9),
        guarded(lens, 10**9),
        num_splits=splits,
    )
    assert torch.equal(out, clean)


@pytest.mark.skipif(not device.GPU_MODE, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("splits", [None, 1])
def test_cuda_graph_capture(splits):
    q, k, v, table, lens = _case([37, 1, 200], 8, 2, 64, 16, torch.float16)
    eager, graphed = eager_and_graphed(
        lambda: pa.paged_decode(q, k, v, table, lens, num_splits=splits)
    )
    assert torch.equal(eager, graphed)


def test_a_layout_is_checked_and_planned_once_its_values_on_every_call(monkeypatch):
    """The launch plan is kept per input layout: the structural checks run on a layout's first
    call only; the values (lengths, block ids) are checked on every call where they are checked
    at all, and a new layout (another dtype, shape or stride) is checked afresh."""
    q, k, v, table, lens = _case([9, 20], 4, 2, 16, 8, torch.float32, seed=5)
    calls = []
    check = pa._check
    monkeypatch.setattr(pa, "_check", lambda *a: calls.append(1) or check(*a))
    want = pa.paged_decode(q, k, v, table, lens, num_splits=2)
    assert torch.equal(pa.paged_decode(q, k, v, table, lens, num_splits=2), want)
    assert len(calls) == 1
    bad = lens.clone()
    bad[0] = 10**6  # past the table's capacity: same layout, bad value
    with pytest.raises(ValueError, match="seq_lens"):
        pa.paged_decode(q, k, v, table, bad, num_splits=2)
    with pytest.raises(TypeError, match="block_table"):
        pa.paged_decode(q, k, v, table.long(), lens, num_splits=2)  # a new layout: checked
    with pytest.raises(ValueError, match="sm_scale"):
        pa.paged_decode(q, k, v, table, lens, float("inf"), num_splits=2)
    with pytest.raises(ValueError, match="num_splits"):
        pa.paged_decode(q, k, v, table, lens, num_splits=[2])  # unhashable: never planned
    # Equal in value to a planned setting, but of the wrong type: still rejected.
    with pytest.raises(ValueError, match="num_splits"):
        pa.paged_decode(q, k, v, table, lens, num_splits=2.0)
    pa.paged_decode(q, k, v, table, lens, num_splits=1)
    with pytest.raises(ValueError, match="num_splits"):
        pa.paged_decode(q, k, v, table, lens, num_splits=True)


def test_only_default_settings_take_the_cpp_launch_path():
    """kernels.replay keys paged decode's plan by the layout and the scale: a given split count or
    tile, a scale it could not key exactly, or debug mode (whose value checks read the device)
    takes the Python path."""
    was = _validate.debug()
    try:
        _validate.debug(False)  # as in a server (the test suite runs in debug mode)
        assert pa._replayable(None, None, None) and pa._replayable(0.125, None, None)
        for args in [(None, 2, None), (None, None, (32, 4, 2)), (0, None, None), (-1.0, None, None),
                     (float("nan"), None, None), (True, None, None), ("0.1", None, None)]:  # fmt: skip
            assert not pa._replayable(*args), args
        _validate.debug(True)
        assert not pa._replayable(None, None, None)
    finally:
        _validate.debug(was)


def test_host_probe_times_every_step_of_a_call(capsys):
    """scripts/gpu/paged_host_probe.py --smoke: the planned path's steps, each timed alone, the
    combine kernel's launch included (two splits), and the whole call against SDPA."""
    probe = load_script("scripts/gpu/paged_host_probe.py")
    assert probe.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "2 splits" in out
    for row in (
        "whole call",
        "Python path, whole",
        "layout key",
        "allocations",
        "split kernel",
        "combine kernel",
        "SDPA",
    ):
        assert row in out, row


def test_programmatic_dependent_launch_changes_no_value(monkeypatch):
    """With several splits on Hopper or later, the combine kernel is launched as a programmatic
    dependent of the split kernel (it may start early and waits in gdc_wait). That changes when
    it starts, never what it reads: the output equals the ordinary launch's bit for bit. Elsewhere
    (a CPU, an older GPU) no plan asks for it."""
    from kernels import launch

    q, k, v, table, lens = _case([700, 33], 8, 2, 64, 16, device.preferred_dtype(), seed=3)
    pa._PLANS.plans.clear()
    got = pa.paged_decode(q, k, v, table, lens, num_splits=4)
    plan = pa._PLANS.get(launch.layout_key((q, k, v, table, lens), 4, None))
    assert plan.meta["PDL"] == plan.combine_meta["PDL"] == launch.pdl_supported()
    assert plan.combine_meta.get("launch_pdl", False) == launch.pdl_supported()
    if not launch.pdl_supported():
        assert not device.GPU_MODE or device.capabilities().compute_capability < (9, 0)
        return
    # The launchers keep each layout's binary under the layout's key: drop them with the plans.
    split = launch.tuned(pa._paged_decode_split_kernel)
    caches = (pa._COMBINE.cache, split.cache, split.plain.cache)
    monkeypatch.setattr(pa, "pdl_supported", lambda: False)
    for c in (pa._PLANS.plans, *caches):
        c.clear()
    want = pa.paged_decode(q, k, v, table, lens, num_splits=4)
    assert not pa._PLANS.get(launch.layout_key((q, k, v, table, lens), 4, None)).meta["PDL"]
    assert torch.equal(got, want)
    for c in (pa._PLANS.plans, *caches):
        c.clear()
