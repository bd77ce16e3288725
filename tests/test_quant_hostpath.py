"""quant.gemv's per-layout plans: the checks and launch decisions run on a layout's first call, and
later calls with that layout reuse them. Repeated calls must give what the first call gave, a new
layout must get a plan of its own, and bad input must raise the same errors after a call planned."""

import pytest
import torch
from conftest import load_script

from kernels import device, launch, quant
from kernels.quant import qgemv

DEV = device.DEVICE
# Triton's interpreter computes bf16 wrongly (a known limitation): bf16 is checked on GPUs only.
DTYPES = [torch.float16] + ([torch.bfloat16] if device.GPU_MODE else [])
M, N, K = 3, 37, 256  # N off every tile


@pytest.fixture
def plans(monkeypatch):
    """A fresh plan cache for one test (so other tests' layouts and monkeypatches do not leak in
    or out), and the plans ``gemv`` makes in it, in order."""
    made = []
    work = qgemv._plan
    monkeypatch.setattr(qgemv, "_PLANS", launch.Plans())
    monkeypatch.setattr(qgemv, "_plan", lambda *a: made.append(work(*a)) or made[-1])
    return made


def _weight(bits, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    return quant.quantize((torch.randn(N, K, generator=g) * 0.02).to(DEV), bits, group)


def _check(y, x, qw):
    """y is ``x @ dequantize(qw).T``, to test_quant's tolerances."""
    ref = quant.gemv_ref(x, qw)
    assert y.shape == ref.shape and y.dtype == x.dtype
    rel = quant.relative_error(y.float(), ref.float())
    assert rel < (2e-3 if x.dtype is torch.float16 else 8e-3), rel


def _same(a, b, plan):
    """Repeated calls agree bit for bit: a K split sums its partial results in a fixed order."""
    assert torch.equal(a, b)


@pytest.mark.parametrize("split_k", [None, 2])
@pytest.mark.parametrize("path", [None, "gemv", "mma"])
@pytest.mark.parametrize("bits, group", [(8, None), (4, 32)])
def test_repeated_calls_reuse_one_plan(plans, bits, group, path, split_k):
    qw = _weight(bits, group)
    x = torch.randn(M, K, device=DEV, dtype=torch.float16)
    first = quant.gemv(x, qw, path=path, split_k=split_k)
    _check(first, x, qw)
    again = quant.gemv(x, qw, path=path, split_k=split_k)
    _same(again, first, plans[0])
    # Same layout, other values: the plan holds no data, each call reads its own tensors.
    x2, qw2 = torch.randn_like(x), _weight(bits, group, seed=1)
    _check(quant.gemv(x2, qw2, path=path, split_k=split_k), x2, qw2)
    assert len(plans) == 1 and len(qgemv._PLANS.plans) == 1
    assert plans[0].path == (path or "mma")


def _layouts(base: torch.Tensor) -> dict[str, torch.Tensor]:
    """x's of other layouts than ``base`` [M, K]: each differs in one thing a plan depends on."""
    tall = torch.randn(K, 1, device=DEV, dtype=base.dtype).t()  # [1, K], strides (1, 1)
    offset = torch.randn(K + 1, device=DEV, dtype=base.dtype)[1:].view(1, K)  # 2 bytes off
    out = {
        "other M": torch.randn(2, K, device=DEV, dtype=base.dtype),
        "1-D": torch.randn(K, device=DEV, dtype=base.dtype),
        "other strides": tall,
        "unaligned": offset,
        "no rows": base[:0],
    }
    for dt in DTYPES:
        if dt != base.dtype:
            out["other dtype"] = base.to(dt)
    return out


@pytest.mark.parametrize("path", [None, "gemv"])
def test_each_layout_gets_its_own_plan(plans, path):
    qw = _weight(8, None)
    base = torch.randn(M, K, device=DEV, dtype=torch.float16)
    _check(quant.gemv(base, qw, path=path), base, qw)
    variants = _layouts(base)
    for i, (name, x) in enumerate(variants.items(), start=2):
        assert x.is_contiguous(), name
        y = quant.gemv(x, qw, path=path)
        assert len(plans) == i and len(qgemv._PLANS.plans) == i, name
        _check(y, x, qw)
        _same(quant.gemv(x, qw, path=path), y, plans[-1])
        assert len(plans) == i, name
    # The weight is part of the layout too: another format at the same shape, or the same weight
    # 1 byte off 16-byte alignment (Triton compiles another binary), is planned anew.
    qw4 = _weight(4, 32)
    data = torch.empty(N * K + 1, device=DEV, dtype=torch.int8)[1:].view(N, K)
    qw_off = quant.QuantizedWeight(data.copy_(qw.data), qw.scales, 8, K, (N, K))
    for w in (qw4, qw_off):
        _check(quant.gemv(base, w, path=path), base, w)
    assert len(plans) == len(variants) + 3
    assert [p.y_shape for p in plans[:3]] == [(M, N), (2, N), (N,)]


@pytest.mark.skipif(device.GPU_MODE, reason="GPUs check bf16 in test_each_layout_gets_its_own_plan")
def test_another_activation_dtype_is_planned_anew(plans):
    """On the CPU bf16 results are not checked (the interpreter's bf16 is wrong), but a bf16 x must
    still get a plan of its own and a bf16 result."""
    qw = _weight(8, None)
    x = torch.randn(M, K, dtype=torch.float16)
    quant.gemv(x, qw)
    y = quant.gemv(x.to(torch.bfloat16), qw)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N) and len(plans) == 2


@pytest.mark.parametrize(
    "planned, bad, err, match",
    [
        ({}, dict(x=torch.zeros(M, K - 32, dtype=torch.float16)), ValueError, "K = 224"),
        ({}, dict(x=torch.zeros(M, K)), TypeError, "x must have dtype"),
        ({}, dict(x=torch.zeros(K, M, dtype=torch.float16).t()), ValueError, "x must be contiguous"),
        ({}, dict(x=torch.zeros(1, M, K, dtype=torch.float16)), ValueError, "x must be 1-D"),
        ({}, dict(qw="w"), TypeError, "qw must be a QuantizedWeight"),
        ({"path": "gemv"}, dict(x=torch.zeros(8, K, dtype=torch.float16)), ValueError, "at most 4 rows"),
        ({}, dict(path="cublas"), ValueError, "path must be"),
        ({}, dict(split_k=3), ValueError, "split_k must be"),
        ({"split_k": 2}, dict(split_k=2.0), ValueError, "split_k must be"),  # 2.0 == 2 in the key
        ({}, dict(fast_unpack=True), ValueError, "fast_unpack=True needs"),
    ],
)  # fmt: skip
def test_bad_input_after_a_planned_call_raises(plans, planned, bad, err, match):
    if "fast_unpack" in bad and qgemv._use_asm(torch.float16):
        pytest.skip("the PTX unpacking runs here: fast_unpack=True is valid")
    qw = _weight(4, 32)
    x = torch.randn(M, K, device=DEV, dtype=torch.float16)
    call = dict(x=x, qw=qw, **planned)
    quant.gemv(call.pop("x"), call.pop("qw"), **call)
    assert len(plans) == 1
    call = dict(x=x, qw=qw, **planned) | bad
    if isinstance(call["x"], torch.Tensor):
        call["x"] = call["x"].to(DEV)
    with pytest.raises(err, match=match):
        quant.gemv(call.pop("x"), call.pop("qw"), **call)
    assert len(qgemv._PLANS.plans) == 1  # a layout that failed its checks is not planned


def test_split_probe_runs_and_checks_each_split(capsys):
    """scripts/gpu/gemv_split_probe.py --smoke: each K split checked against the fp32 reference,
    then timed on the device and on the host against torch.matmul (the interpreter here)."""
    probe = load_script("scripts/gpu/gemv_split_probe.py")
    assert probe.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("1, 64, 256")]
    assert [r[3] for r in rows] == ["8", "4"]  # both weight formats
    assert all(len(r) == 5 + 3 for r in rows)  # the default, split 2 and torch: device/host each


def test_split_k_rule(monkeypatch):
    """K is split only for weights of SPLIT_FROM_BYTES or more (smaller GEMVs are latency-bound,
    and the split's second launch costs the host more than it saves), then while fewer than
    SPLIT_BELOW_PROGRAMS_PER_SM programs per SM would stream them. An H100's 132 SMs:"""
    monkeypatch.setattr(qgemv.device, "GPU_MODE", True)
    monkeypatch.setattr(launch, "sm_count", lambda *a: 132)
    mib = 1 << 20
    assert qgemv._pick_split_k(128, 32, 16 * mib) == 1  # 4096 x 4096 int8: unsplit
    assert qgemv._pick_split_k(256, 64, 64 * mib) == 2  # 8192 x 8192 int8: two waves of programs
    assert qgemv._pick_split_k(128, 32, 32 * mib) == 4  # at the floor, few programs: four ways
    assert qgemv._pick_split_k(448, 32, 56 * mib) == 1  # 14336 x 4096 int8: enough programs
    assert qgemv._pick_split_k(8, 2, 64 * mib) == 1  # K too short to split
