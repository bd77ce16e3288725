import pytest
import torch

from kernels import device, matmul

# Triton's interpreter computes bf16 wrongly (a known limitation): bf16 is checked on GPUs only.
DTYPES = [torch.float16] + ([torch.bfloat16] if device.GPU_MODE else [])
# (M, K, N): partial tiles in every dimension, one row, sizes that are not multiples of 8.
SHAPES = [(1, 1, 1), (5, 7, 9), (17, 33, 65), (127, 255, 63), (100, 33, 70), (128, 64, 256)] + (
    [(4000, 5000, 3000), (16, 8192, 1024), (1823, 781, 129), (1, 4096, 4096), (64, 4096, 14336)]
    if device.GPU_MODE
    else []
)
TMA = device.GPU_MODE and device.capabilities().tma


@pytest.fixture(autouse=True)
def _one_configuration(monkeypatch):
    # One compile per case instead of timing every candidate: these tests check results, not speed.
    monkeypatch.setattr(matmul, "TUNE", False)


def _rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _tol(dtype):
    # One rounding of the fp32 result to 16 bits: relative error ~ unit roundoff (fp16 5e-4, bf16 4e-3).
    return 2e-3 if dtype is torch.float16 else 8e-3


def _check(a, b, **kw):
    out = matmul.matmul(a, b, **kw)
    assert out.shape == (a.shape[0], b.shape[1]) and out.dtype == a.dtype and out.is_contiguous()
    assert _rel_err(out, a.float() @ b.float()) < _tol(a.dtype)
    return out


def _randn(*shape, dtype):
    return torch.randn(*shape, device=device.DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mkn", SHAPES)
def test_matmul_matches_fp32_reference(dtype, mkn):
    m, k, n = mkn
    _check(_randn(m, k, dtype=dtype), _randn(k, n, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mkn", [(1, 1, 1), (17, 33, 65), (127, 255, 63), (8, 64, 48)])
@pytest.mark.parametrize(
    "layout",
    ["w.t()", "a.t()", "both.t()", "column slices", "row slices"],
)
def test_matmul_takes_any_strides(dtype, mkn, layout):
    m, k, n = mkn
    if layout == "w.t()":  # a model's weight [N, K], applied as x @ w.t()
        a, b = _randn(m, k, dtype=dtype), _randn(n, k, dtype=dtype).t()
    elif layout == "a.t()":
        a, b = _randn(k, m, dtype=dtype).t(), _randn(k, n, dtype=dtype)
    elif layout == "both.t()":
        a, b = _randn(k, m, dtype=dtype).t(), _randn(n, k, dtype=dtype).t()
    elif layout == "column slices":  # no unit stride at all
        a, b = _randn(m, 2 * k, dtype=dtype)[:, ::2], _randn(k, 3 * n, dtype=dtype)[:, 1::3]
    else:  # rows of a wider tensor: leading strides larger than the width
        a, b = _randn(m, k + 5, dtype=dtype)[:, 2 : k + 2], _randn(k, n + 3, dtype=dtype)[:, :n]
    _check(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mkn", [(3, 17, 9), (64, 128, 64), (33, 72, 40)])
def test_matmul_offset_view_with_misaligned_base(dtype, mkn):
    # One element into a buffer: the base is 2 bytes past a 16-byte boundary (no TMA, no 16-byte
    # loads); the launcher must notice and still be right.
    m, k, n = mkn
    a = _randn(m * k + 1, dtype=dtype)[1:].view(m, k)
    b = _randn(k * n + 1, dtype=dtype)[1:].view(k, n)
    assert a.data_ptr() % 16 and b.data_ptr() % 16
    _check(a, b)
    _check(a, _randn(k, n, dtype=dtype))


def test_rows_of_one_bucket_share_a_plan():
    b = _randn(40, 24, dtype=torch.float16)
    _check(_randn(5, 40, dtype=torch.float16), b)
    n = len(matmul._PLANS)
    _check(_randn(9, 40, dtype=torch.float16), b)  # 2-16 rows: one bucket, no new tuning
    assert len(matmul._PLANS) == n
    _check(_randn(17, 40, dtype=torch.float16), b)  # 17-32 rows: the next one
    assert len(matmul._PLANS) == n + 1


def test_matmul_degenerate_shapes():
    a = torch.randn(3, 0, device=device.DEVICE, dtype=torch.float16)
    b = torch.randn(0, 4, device=device.DEVICE, dtype=torch.float16)
    assert torch.equal(
        matmul.matmul(a, b), torch.zeros(3, 4, device=device.DEVICE, dtype=torch.float16)
    )
    assert matmul.matmul(a.new_zeros(0, 5), a.new_zeros(5, 2)).shape == (0, 2)


def _bad_cases():
    h, d = torch.half, device.DEVICE
    other = torch.device("meta") if not device.GPU_MODE else torch.device("cpu")
    return [
        (torch.zeros(4, 3, device=d), torch.zeros(3, 4, device=d), TypeError, "a must have dtype"),
        (torch.zeros(4, 3, device=d, dtype=h), torch.zeros(3, 4, device=d, dtype=torch.int8), TypeError, "b must have dtype"),
        (torch.zeros(4, 3, device=d, dtype=h), torch.zeros(4, 4, device=d, dtype=h), ValueError, "do not chain"),
        (torch.zeros(4, device=d, dtype=h), torch.zeros(4, 4, device=d, dtype=h), ValueError, "a must be 2-D"),
        (torch.zeros(4, 4, device=d, dtype=h), torch.zeros(1, 4, 4, device=d, dtype=h), ValueError, "b must be 2-D"),
        (torch.zeros(4, 4, device=d, dtype=h), torch.zeros(4, 4, device=d, dtype=torch.bfloat16), TypeError, "same dtype"),
        (torch.zeros(4, 4, device=other, dtype=h), torch.zeros(4, 4, device=d, dtype=h), ValueError, "a must be on"),
        (torch.zeros(4, 4, device=d, dtype=h), [[0.0] * 4] * 4, TypeError, "b must be a torch.Tensor"),
    ]  # fmt: skip


@pytest.mark.parametrize("a, b, err, match", _bad_cases())
def test_matmul_rejects_bad_input(a, b, err, match):
    with pytest.raises(err, match=match):
        matmul.matmul(a, b)


@pytest.mark.skipif(device.GPU_MODE, reason="CPU-only check")
def test_persistent_needs_tma():
    a = torch.zeros(8, 8, dtype=torch.half)
    with pytest.raises(ValueError, match="TMA"):
        matmul.matmul(a, a, persistent=True)


@pytest.mark.skipif(device.GPU_MODE, reason="the interpreter's check (GPU: the tests below)")
@pytest.mark.parametrize(
    "m, n, k, a_t, b_t",
    [(100, 88, 80, False, False), (64, 152, 48, False, True), (72, 64, 40, True, False)],
)
def test_persistent_tma_kernel_in_the_interpreter(m, n, k, a_t, b_t):
    """The persistent TMA kernel runs in Triton's interpreter too (fp16: its bf16 dot is wrong):
    its tile loop (3 programs for 6 to 12 tiles), transposed operands read through their
    descriptors, ragged edges, and the epilogue that stores each tile as two halves along N (N = 88
    and 152 end inside a half). Swapping or misplacing a half would put another tile's columns
    here."""
    g = torch.Generator().manual_seed(m)
    a = (torch.randn(k, m, generator=g).t() if a_t else torch.randn(m, k, generator=g)).half()
    b = (torch.randn(n, k, generator=g).t() if b_t else torch.randn(k, n, generator=g)).half()
    c = torch.full((m, n), float("nan"), dtype=torch.half)
    plan = matmul._Plan(True, (32, 32, 16, 2, 4), 1, a_t, b_t, sms=3)
    matmul._launch(plan, a, b, c, m, n, k)
    assert _rel_err(c, a.float() @ b.float()) < _tol(torch.float16)  # NaN where a tile was missed


# ----------------------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.skipif(not TMA, reason="needs TMA (Hopper+)")
@pytest.mark.parametrize(
    "mkn", [(128, 64, 256), (1000, 2048, 520), (4096, 4096, 4096), (1, 4096, 4096)]
)
@pytest.mark.parametrize("b_t", [False, True])
@pytest.mark.parametrize("a_t", [False, True])
def test_persistent_tma_variant(mkn, a_t, b_t):
    m, k, n = mkn
    a = _randn(k, m, dtype=torch.bfloat16).t() if a_t else _randn(m, k, dtype=torch.bfloat16)
    b = _randn(n, k, dtype=torch.bfloat16).t() if b_t else _randn(k, n, dtype=torch.bfloat16)
    if a_t and m % 8:
        assert not matmul.tma_applies(a, b)  # A^T's rows (length M) are not 16-byte aligned
        return
    assert matmul.tma_applies(a, b)
    _check(a, b, persistent=True)
    assert matmul.describe(a, b, persistent=True).startswith("TMA")


@pytest.mark.gpu
@pytest.mark.skipif(not TMA, reason="needs TMA (Hopper+)")
def test_tma_falls_back_on_misaligned_views():
    m, k, n = 256, 512, 256
    base = _randn(m * k + 8, dtype=torch.bfloat16)
    a = base[1 : 1 + m * k].view(m, k)  # base 2 bytes off a 16-byte boundary
    b = _randn(k, n, dtype=torch.bfloat16)
    assert not matmul.tma_applies(a, b)
    out = _check(a, b)  # default: the plain kernel
    assert matmul.describe(a, b).startswith("plain")
    with pytest.raises(ValueError, match="16-byte"):
        matmul.matmul(a, b, persistent=True)
    # 16 bytes in: TMA applies (a's values cloned first: the two views of base overlap)
    aligned = base[8 : 8 + m * k].view(m, k).copy_(a.clone())
    assert matmul.tma_applies(aligned, b)
    assert _rel_err(out, matmul.matmul(aligned, b, persistent=False)) < 1e-3
    # rows of odd length: the plain kernel, unaligned
    a = _randn(m, k + 1, dtype=torch.bfloat16)[:, :k]
    assert not matmul.tma_applies(a, b)
    _check(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not device.GPU_MODE, reason="needs a GPU")
@pytest.mark.parametrize("persistent", [None, False])
def test_matmul_under_cuda_graph_capture(persistent):
    if persistent is None and not TMA:
        pytest.skip("the default path is the plain kernel here")
    x = _randn(64, 1024, dtype=torch.bfloat16)
    w = _randn(3072, 1024, dtype=torch.bfloat16)
    matmul.matmul(x, w.t(), persistent=persistent)  # tune and compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = matmul.matmul(x, w.t(), persistent=persistent)
    x.copy_(_randn(64, 1024, dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel_err(out, x.float() @ w.float().t()) < 8e-3


@pytest.mark.gpu
@pytest.mark.skipif(not device.GPU_MODE, reason="needs a GPU")
def test_cached_call_launches_the_chosen_kernel_directly():
    a = _randn(100, 256, dtype=torch.float16)
    b = _randn(256, 72, dtype=torch.float16)
    _check(a, b)
    n = len(matmul._PLANS)
    _check(_randn(100, 256, dtype=torch.float16), b)  # same case: no new plan
    assert len(matmul._PLANS) == n
    assert all(p.compiled is not None for p in matmul._PLANS.values())


@pytest.mark.parametrize("transposed", [False, True])
def test_pitched_copy_keeps_values_and_orientation(transposed):
    # B at a pitch of 37 elements (74 bytes), row- or column-contiguous (a weight's w.t())
    b = _randn(37, 9, dtype=torch.float16).t() if transposed else _randn(9, 37, dtype=torch.float16)
    p = matmul.pitched(b)
    assert torch.equal(p, b)
    assert p.stride() == ((1, 64) if transposed else (64, 1))  # 64 fp16 elements: 128 bytes


def test_pitch_copy_is_tried_only_where_it_can_pay():
    t = torch.empty(8, 3000, dtype=torch.float16)  # rows of 6,000 bytes: not a multiple of 128
    assert matmul._pitch_may_pay(t, matmul.PITCH_MIN_ROWS)
    assert not matmul._pitch_may_pay(t, matmul.PITCH_MIN_ROWS - 1)  # too few rows of A to pay
    assert not matmul._pitch_may_pay(torch.empty(8, 4096, dtype=torch.float16), 8192)
    assert matmul._pitch_may_pay(torch.empty(3000, 8, dtype=torch.float16).t(), 8192)
    assert not matmul._pitch_may_pay(torch.empty(8, 16, 2)[:, :, 0], 8192)  # no unit stride


def _pitch_b_plans():
    plans = [("plain", False, False)]
    if TMA or not device.GPU_MODE:  # the TMA kernel runs in the interpreter too (fp16)
        plans += [("tma", True, False), ("tma w.t()", True, True)]
    return plans


@pytest.mark.parametrize("name, tma, b_t", _pitch_b_plans())
def test_plan_with_a_pitched_copy_of_b_matches_reference(name, tma, b_t):
    # K = 520 and N = 3000 (CPU: 40 and 72): B's rows (either way round) are 16-byte aligned, not
    # 128-byte aligned.
    m, k, n = (256, 520, 3000) if device.GPU_MODE else (33, 40, 72)
    dtype = torch.bfloat16 if device.GPU_MODE else torch.float16
    a = _randn(m, k, dtype=dtype)
    b = _randn(n, k, dtype=dtype).t() if b_t else _randn(k, n, dtype=dtype)
    cfg = matmul._Config(128, 256, 64, 3, 8) if device.GPU_MODE else matmul._configs(m)[0]
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device.GPU_MODE else 2
    plan = matmul._Plan(tma, cfg, 1, False, b_t, sms, pitch_b=True)
    c = a.new_empty(m, n)
    matmul._launch(plan, a, b, c, m, n, k)
    assert _rel_err(c, a.float() @ b.float()) < _tol(dtype)
    assert matmul._plan_name(plan).endswith("B copied to 128-byte rows")


@pytest.mark.skipif(device.GPU_MODE, reason="CPU-only check (timings stubbed)")
def test_tuner_charges_each_path_its_host_time(monkeypatch):
    # Stubbed timings: the TMA tile has the faster kernel (do_bench, whose L2 flush hides host
    # work) but costs 60 us of host per call; the plain tile's kernel takes 25 us and its host 15.
    plain = matmul._Plan(False, matmul._Config(128, 128, 64, 4, 4), 8, False, False)
    tma = matmul._Plan(True, matmul._Config(128, 256, 64, 3, 8), 1, False, False, 132)
    device_ms = {plain.tma: 0.025, tma.tma: 0.020}
    host_ms = {plain.tma: 0.015, tma.tma: 0.060}
    monkeypatch.setattr(matmul, "TUNE", True)
    monkeypatch.setattr(matmul.device, "INTERPRET", False)
    monkeypatch.setattr(matmul.torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(matmul, "_compile_all", lambda plans, *a: [object() for _ in plans])
    monkeypatch.setattr(matmul, "_launch", lambda p, *a, **k: p)
    monkeypatch.setattr(matmul.triton.testing, "do_bench", lambda fn, **k: device_ms[fn().tma])
    monkeypatch.setattr(matmul, "_host_ms", lambda p, *a: host_ms[p.tma])
    best, timings = matmul._tune([tma, plain], None, None, None, 1, 1, 1)
    assert not best.tma  # 25 us a call against 60
    host_ms[tma.tma] = 0.010  # a host as fast as the plain path's: the faster kernel wins
    best, _ = matmul._tune([tma, plain], None, None, None, 1, 1, 1)
    assert best.tma
    assert [t for _, t in timings] == [0.020, 0.025]


@pytest.mark.parametrize("b_t", [False, True], ids=["B", "w.t()"])
def test_every_few_rows_candidate_matches_reference(b_t):
    # The tests above run the first candidate only (TUNE off), so a tile that only the autotuner
    # picks would go unchecked: here every candidate for up to 64 rows runs on both launch paths,
    # at 50 rows (a partial row tile) and N = 1,032 (partial column tiles).
    m, k, n = (50, 1000, 1032) if device.GPU_MODE else (33, 40, 72)
    dtype = torch.bfloat16 if device.GPU_MODE else torch.float16
    a = _randn(m, k, dtype=dtype)
    b = _randn(n, k, dtype=dtype).t() if b_t else _randn(k, n, dtype=dtype)
    ref = a.float() @ b.float()
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device.GPU_MODE else 2
    align = matmul._plain_align(n, k, (*a.stride(), *b.stride()))
    for cfg in matmul._configs(m):
        paths = [matmul._Plan(False, cfg, align, False, False)]
        if TMA or not device.GPU_MODE:
            paths.append(matmul._Plan(True, cfg, 1, False, b_t, sms))
        for plan in paths:
            c = a.new_empty(m, n)
            matmul._launch(plan, a, b, c, m, n, k)
            assert _rel_err(c, ref) < _tol(dtype), matmul._plan_name(plan)
