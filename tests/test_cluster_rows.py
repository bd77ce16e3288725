"""kernels.cuda.cluster_rows: softmax and the norms on rows split across a thread-block cluster.

On a CPU: which layouts the cluster path takes (kernels.rows.cluster_path), which tile and loop
flag reach the extension and, where nvcc is installed, that the kernels compile for sm_90. On a
Hopper GPU: every kernel against an fp64
PyTorch reference, forward and backward, on widths that are and are not a multiple of a CTA's
chunk, with strided and expanded inputs, and a layout that must fall back to Triton."""

import importlib.util
import itertools
from pathlib import Path

import pytest
import torch

from kernels import device, norms, rows, softmax
from kernels.cuda import cluster_rows

HERE = Path(cluster_rows.__file__).resolve().parent


# ----------------------------------------------------------------------------- CPU: the choice


def test_clusters_per_row():
    assert cluster_rows.clusters_for(65536, 32) == 8
    assert cluster_rows.clusters_for(65536, 16) == 16
    assert cluster_rows.clusters_for(40000, 32) == 5  # the last CTA holds 7,232 values
    assert cluster_rows.clusters_for(16384, 32) == 2


def test_narrow_or_few_rows_never_reach_the_module(monkeypatch):
    """A decode step's rows pay two comparisons: the module's own test is not even called."""

    def boom(*a):
        raise AssertionError("cluster_rows.use called")

    monkeypatch.setattr(cluster_rows, "use", boom)
    assert rows.cluster_path(torch.empty(4096, 32768), 4096, "rms_norm_fwd") is None
    assert rows.cluster_path(torch.empty(8, 65536), 8, "rms_norm_fwd") is None


def test_only_measured_wins_take_the_cluster(monkeypatch):
    """WINS decides per op and dtype, and kernels.rows the width and row count (the
    build and the GPU are stubbed to yes)."""
    monkeypatch.setattr(cluster_rows, "unavailable_reason", lambda: None)
    monkeypatch.setattr(cluster_rows, "module", lambda: object())
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    bf16 = torch.empty(2048, 65536, dtype=torch.bfloat16)
    fp32 = torch.empty(2048, 65536, dtype=torch.float32)

    def takes(x, op, n_rows=2048):
        return rows.cluster_path(x, n_rows, op) is cluster_rows

    assert takes(bf16, "rms_norm_fwd") and takes(bf16, "layer_norm_fwd")
    assert not takes(bf16, "layer_norm_bwd") and not takes(bf16, "softmax_fwd")
    assert takes(bf16.half(), "softmax_fwd") and takes(bf16.half(), "layer_norm_fwd")
    assert all(takes(fp32, op) for op in cluster_rows.WINS)
    assert not takes(fp32, "rms_norm_fwd", n_rows=512)  # too few rows
    assert not takes(fp32[:, :32768], "rms_norm_fwd")  # not wider than 32,768
    assert not takes(fp32[:, 1:40001], "rms_norm_fwd")  # rows start 4 bytes past a 16-byte line


def test_tiles_default_to_e_fwd_and_e_bwd_until_measured(monkeypatch):
    bf16 = torch.empty(2, 65536, dtype=torch.bfloat16)
    for op, tiles in cluster_rows.TILES.items():  # a measured tile: one the .cu builds, for a
        for dtype, t in tiles.items():  # dtype and op that take the cluster path at all
            assert t in cluster_rows.CANDIDATE_TILES[op], (op, dtype)
            assert dtype in cluster_rows.WINS[op], (op, dtype)
    assert cluster_rows.tile("rms_norm_fwd", bf16.float()) == (cluster_rows.E_FWD, 0)  # fp32: none
    monkeypatch.setattr(cluster_rows, "TILES", {})
    assert cluster_rows.tile("softmax_fwd", bf16) == (cluster_rows.E_FWD, 0)
    assert cluster_rows.tile("softmax_bwd", bf16) == (cluster_rows.E_BWD, 0)
    monkeypatch.setattr(cluster_rows, "TILES", {"softmax_fwd": {torch.bfloat16: (64, 4)}})
    assert cluster_rows.tile("softmax_fwd", bf16) == (64, 4)
    assert cluster_rows.tile("softmax_fwd", bf16.half()) == (cluster_rows.E_FWD, 0)  # per dtype


class _FakeExtension:
    """The built extension's four entry points, recording the tile and loop flag each receives."""

    def __init__(self):
        self.seen = []

    def cr_norm_fwd(self, x, w, b, eps, rms, stats, e, occ, loop):
        self.seen.append(("norm_fwd", e, occ, loop))
        return torch.empty_like(x), torch.empty(0), torch.empty(0)

    def cr_norm_bwd(self, dy, x, w, mean, rstd, bias, e, clusters):
        self.seen.append(("norm_bwd", e))
        return torch.empty_like(x), torch.zeros(2 if bias else 1, 1, x.shape[1])

    def cr_softmax_fwd(self, x, e, occ, loop):
        self.seen.append(("softmax_fwd", e, occ, loop))
        return torch.empty_like(x)

    def cr_softmax_bwd(self, y, dy, e, occ):
        self.seen.append(("softmax_bwd", e, occ))
        return torch.empty_like(y)


def test_entry_points_pass_the_tile_and_loop_flag_they_choose(monkeypatch):
    """What TILES and LOOP_FWD name reaches the extension (the GPU tests check the kernels' values,
    which a wrong tile would not change)."""
    fake = _FakeExtension()
    monkeypatch.setattr(cluster_rows, "module", lambda: fake)
    monkeypatch.setattr(
        cluster_rows.partial_sums, "sum_stacked", lambda p, dtype: p.sum(1).to(dtype)
    )
    monkeypatch.setattr(
        cluster_rows,
        "TILES",
        {"rms_norm_bwd": {torch.bfloat16: (32, 0)}, "softmax_fwd": {torch.float16: (64, 4)}},
    )
    monkeypatch.setattr(cluster_rows, "LOOP_FWD", {"rms_norm_fwd": {torch.bfloat16}})
    x = torch.randn(4, 1024).bfloat16()
    w, r = torch.ones(1024, dtype=torch.bfloat16), torch.ones(4)
    cluster_rows.norm_backward(x, x, w, None, r, False)  # RMSNorm: TILES' 32
    cluster_rows.norm_backward(x, x, w, r, r, True)  # LayerNorm: the default
    cluster_rows.norm_forward(x, w, None, 1e-6, True)  # LOOP_FWD names bf16 RMSNorm
    cluster_rows.norm_forward(x, w, None, 1e-5, False)  # not LayerNorm
    cluster_rows.softmax_forward(x.half())  # TILES' (64, 4): no persistent build
    cluster_rows.softmax_backward(x, x)
    e_f, e_b = cluster_rows.E_FWD, cluster_rows.E_BWD
    assert fake.seen == [
        ("norm_bwd", 32),
        ("norm_bwd", e_b),
        ("norm_fwd", e_f, 0, True),
        ("norm_fwd", e_f, 0, False),
        ("softmax_fwd", 64, 4, False),
        ("softmax_bwd", e_b, 0),
    ]
    monkeypatch.setattr(cluster_rows, "TILES", {"rms_norm_bwd": {torch.bfloat16: (64, 4)}})
    with pytest.raises(ValueError, match="occupancy target"):
        cluster_rows.norm_backward(x, x, w, None, r, False)


def test_rows_must_be_aligned_whole_vectors():
    x = torch.empty(4, 1024, dtype=torch.bfloat16)
    assert cluster_rows._rows_fit(x)
    assert not cluster_rows._rows_fit(x[:, 1:1001])  # 1000 wide (ok) but offset by 2 bytes
    assert not cluster_rows._rows_fit(x[:, :1004])  # width not a whole number of 8-value vectors
    assert cluster_rows._rows_fit(x[:, :1000])  # row stride 1024: a multiple of 8
    assert not cluster_rows._rows_fit(torch.empty(4, 1022)[:, :1016])  # fp32 rows 1,022 apart


@pytest.mark.skipif(device.GPU_MODE, reason="what a machine without a GPU gets")
def test_the_triton_path_runs_where_clusters_cannot():
    assert cluster_rows.unavailable_reason() is not None
    x = torch.empty(2048, 65536)
    assert rows.cluster_path(x, 2048, "rms_norm_fwd") is None


_spec = importlib.util.spec_from_file_location(
    "cluster_rows_ptxas", HERE.parents[1] / "scripts" / "cluster_rows_ptxas.py"
)
ptxas = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ptxas)


@pytest.mark.skipif(ptxas.find_tool("nvcc") is None, reason="needs nvcc (the CUDA toolkit)")
def test_kernels_compile_for_sm90_without_spills():
    """Every kernel builds for sm_90 with no register spills (a spilled chunk would be read and
    written through local memory, the traffic the cluster exists to avoid), and every candidate
    tile is built for both 16-bit types (cluster_rows.cu's built() and with_bwd_tile())."""
    report = ptxas.compile_report()
    # norm_fwd: (3 dtypes x E 16, 32, and 2 16-bit dtypes at (64, 4)) x (RMSNorm, LayerNorm with
    # and without a bias) x stats or not; softmax_fwd: 3 x 2 and 16-bit (64, 4); softmax_bwd: 3 x 2;
    # norm_bwd: 3 dtypes at E 16 and 16-bit at E 32, x (RMSNorm, LayerNorm with and without a bias);
    # the persistent forwards at (32, 0): norm_fwd_loop 3 x 3 x 2, softmax_fwd_loop 3.
    expected = (3 * 2 + 2) * 3 * 2 + (3 * 2 + 2) + 3 * 2 + (3 + 2) * 3 + (3 * 3 * 2 + 3)
    assert len(report) == expected, (len(report), expected)
    assert all("op" in r for r in report), [r["name"] for r in report if "op" not in r]
    spills = [r["name"] for r in report if r["spill_bytes"]]
    assert not spills, spills
    built = {(r["op"].split(" ")[0], r["dtype"], r["e"], r["occ"]) for r in report}
    for op, tiles in cluster_rows.CANDIDATE_TILES.items():
        for (e, occ), dtype in itertools.product(tiles, ("fp16", "bf16")):
            assert (op, dtype, e, occ) in built, (op, dtype, e, occ)


# ----------------------------------------------------------------------------- GPU: the kernels

gpu = pytest.mark.skipif(
    not device.GPU_MODE or cluster_rows.unavailable_reason() is not None,
    reason="needs a GPU with thread-block clusters (compute capability 9.0+) and nvcc",
)
# Two ulp of the dtype at the largest value (bf16 2**-6, fp16 2**-9); fp32: reductions in another
# order. An earlier build of these kernels measured at most 3.5e-3 (bf16), 7.1e-4 (fp16) and
# 6.8e-7 (fp32) of the largest value on an H100, over these shapes.
TOL = {torch.float32: 1e-5, torch.float16: 2**-9, torch.bfloat16: 2**-6}
# A chunk's multiple; a width whose last CTA is partly padding; an odd number of rows.
SHAPES = [(256, 16384), (300, 65536), (257, 40000), (2, 128, 24584)]
KINDS = ["softmax", "rms_norm", "layer_norm", "layer_norm_nobias"]


@pytest.fixture
def calls(monkeypatch):
    """Which cluster entry points ran. The kernels' reach is widened to every width, row count,
    op and dtype they support (WINS and the thresholds say where they are *used*: not a question
    of correctness)."""
    monkeypatch.setattr(rows, "CLUSTER_ABOVE_COLS", 8192)
    monkeypatch.setattr(rows, "CLUSTER_MIN_ROWS", 1)
    monkeypatch.setattr(
        cluster_rows, "WINS", {op: set(rows.SUPPORTED_DTYPES) for op in cluster_rows.WINS}
    )
    seen = {}
    for name in ("norm_forward", "norm_backward", "softmax_forward", "softmax_backward"):
        inner = getattr(cluster_rows, name)

        def wrapped(*a, _inner=inner, _name=name, **k):
            seen[_name] = seen.get(_name, 0) + 1
            return _inner(*a, **k)

        monkeypatch.setattr(cluster_rows, name, wrapped)
    return seen


def _run(kind, x, w, b, ref=False):
    n = x.shape[-1]
    if kind == "softmax":
        return torch.softmax(x, -1) if ref else softmax.softmax(x)
    if kind == "rms_norm":
        return torch.nn.functional.rms_norm(x, (n,), w, 1e-6) if ref else norms.rms_norm(x, w)
    bias = b if kind == "layer_norm" else None
    if ref:
        return torch.nn.functional.layer_norm(x, (n,), w, bias, 1e-5)
    return norms.layer_norm(x, w, bias)


def _check(kind, x, w, b, dy):
    """Output and every gradient within TOL of an fp64 reference, relative to the largest value."""
    leaves = [t.detach().requires_grad_() for t in (x, w, b)]  # views kept as they lie
    refs = [t.detach().double().requires_grad_() for t in (x, w, b)]
    y = _run(kind, *leaves)
    y.backward(dy)
    yr = _run(kind, *refs, ref=True)
    yr.backward(dy.double())
    pairs = [(y, yr)] + [(t.grad, r.grad) for t, r in zip(leaves, refs) if r.grad is not None]
    for got, want in pairs:
        _assert_close(got, want, x.dtype, kind)


def _assert_close(got, want, dtype, what=""):
    """got within TOL[dtype] of the fp64 reference want, relative to want's largest value."""
    assert got is not None and torch.isfinite(got).all(), what
    err = (got.double() - want).abs().max().item()
    assert err <= TOL[dtype] * want.abs().max().item() + 1e-30, (what, got.shape, err)


def _inputs(shape, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    n = shape[-1]
    x = (torch.randn(*shape, generator=g) * 2 + 0.5).to("cuda", dtype)
    w = (torch.randn(n, generator=g) * 0.1 + 1).to("cuda", dtype)
    b = (torch.randn(n, generator=g) * 0.1).to("cuda", dtype)
    dy = torch.randn(*shape, generator=g).to("cuda", dtype)
    return x, w, b, dy


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_matches_fp64_reference(calls, kind, shape, dtype):
    x, w, b, dy = _inputs(shape, dtype)
    if kind == "softmax":
        x = x * 4
    _check(kind, x, w, b, dy)
    fwd, bwd = ("softmax_forward", "softmax_backward") if kind == "softmax" else (
        "norm_forward", "norm_backward")  # fmt: skip
    assert calls == {fwd: 1, bwd: 1}, calls


@gpu
@pytest.mark.parametrize("kind", KINDS)
def test_strided_rows_and_a_broadcast_gradient(calls, kind):
    """x a view whose rows are 32,832 values apart; dy broadcast over the rows (row stride 0)."""
    base, w, b, _ = _inputs((300, 32768 + 64), torch.bfloat16)
    n = 32768
    x = base[:, :n].requires_grad_()
    w, b = w[:n].contiguous(), b[:n].contiguous()
    c = torch.linspace(-1, 1, n, device="cuda", dtype=x.dtype)
    y = _run(kind, x, w, b)
    # Handed to autograd as it lies, the expanded gradient reaches the kernel with row stride 0.
    (dx,) = torch.autograd.grad(y, [x], c.expand_as(y))
    xr = x.detach().double().requires_grad_()
    yr = _run(kind, xr, w.double(), b.double(), ref=True)
    (dxr,) = torch.autograd.grad(yr, [xr], c.double().expand_as(yr))
    _assert_close(y, yr, x.dtype, kind)
    _assert_close(dx, dxr, x.dtype, kind)
    assert len(calls) == 2, calls


CANDIDATES = [(op, t) for op, tiles in cluster_rows.CANDIDATE_TILES.items() for t in tiles]
# The _run kinds that exercise an op's kernels (LayerNorm's with and without a bias).
_KINDS_OF = {
    "softmax_fwd": ["softmax"],
    "softmax_bwd": ["softmax"],
    "rms_norm_fwd": ["rms_norm"],
    "rms_norm_bwd": ["rms_norm"],
    "layer_norm_fwd": ["layer_norm", "layer_norm_nobias"],
    "layer_norm_bwd": ["layer_norm", "layer_norm_nobias"],
}


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(300, 65536), (257, 40000)])
@pytest.mark.parametrize(("op", "tile"), CANDIDATES)
def test_candidate_tiles_match_fp64_reference(calls, monkeypatch, op, tile, shape, dtype):
    """The 16-bit tiles the probe times (more values a thread, or fewer registers) are as exact
    as the default ones."""
    monkeypatch.setattr(cluster_rows, "TILES", {op: {dtype: tile}})
    x, w, b, dy = _inputs(shape, dtype, seed=1)
    for kind in _KINDS_OF[op]:
        _check(kind, x * 4 if kind == "softmax" else x, w, b, dy)
    assert len(calls) == 2, calls


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(300, 65536), (257, 40000)])
@pytest.mark.parametrize("op", cluster_rows.LOOP_OPS)
def test_persistent_forwards_match_fp64_reference(calls, monkeypatch, op, shape, dtype):
    """The forwards as persistent clusters (the next row in flight, the exchange's slot
    alternating row by row) are as exact as the one-row kernels."""
    monkeypatch.setattr(cluster_rows, "TILES", {})
    monkeypatch.setattr(cluster_rows, "LOOP_FWD", {op: {dtype}})
    x, w, b, dy = _inputs(shape, dtype, seed=2)
    for kind in _KINDS_OF[op]:
        x_in = x * 4 if kind == "softmax" else x
        _check(kind, x_in, w, b, dy)  # a training forward: the norms save their statistics
        with torch.no_grad():  # and without them (the kernels' STATS = false)
            y, yr = (
                _run(kind, x_in, w, b),
                _run(kind, x_in.double(), w.double(), b.double(), ref=True),
            )
        _assert_close(y, yr, dtype, kind)
    assert len(calls) == 2, calls


def test_looped_only_where_named_and_at_the_default_tile(monkeypatch):
    x = torch.empty(2, 65536, dtype=torch.bfloat16)
    monkeypatch.setattr(cluster_rows, "LOOP_FWD", {"softmax_fwd": {torch.bfloat16}})
    assert cluster_rows.looped("softmax_fwd", x, cluster_rows.E_FWD, 0)
    assert not cluster_rows.looped("softmax_fwd", x, 64, 4)  # built for (E_FWD, 0) only
    assert not cluster_rows.looped("softmax_fwd", x.half(), cluster_rows.E_FWD, 0)
    assert not cluster_rows.looped("rms_norm_fwd", x, cluster_rows.E_FWD, 0)


@gpu
def test_misaligned_rows_fall_back_to_triton(calls):
    """A view starting 2 bytes into the buffer cannot be read in 16-byte vectors: Triton runs it."""
    x, w, b, dy = _inputs((256, 16384 + 8), torch.bfloat16)
    x = x[:, 1 : 16384 + 1]
    _check("layer_norm", x, w[:16384].contiguous(), b[:16384].contiguous(), dy[:, :16384])
    assert calls == {}, calls


@gpu
def test_graph_capture(calls):
    x, w, _, _ = _inputs((256, 65536), torch.bfloat16)
    y = norms.rms_norm(x, w)  # builds and warms up outside the capture
    s = softmax.softmax(x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y2 = norms.rms_norm(x, w)
        s2 = softmax.softmax(x)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, y2) and torch.equal(s, s2)
    assert calls == {"norm_forward": 2, "softmax_forward": 2}, calls
