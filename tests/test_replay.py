"""kernels.replay: row-wise ops and small attention problems launched from C++ once a layout has a plan.

On a CPU the encoding of a launch (what replay.cpp is handed) is tested against stand-ins for
Triton's compiled kernels; on a GPU every op is run twice per layout, the second call through C++,
and must give exactly what the Python path gave (the same binaries, in the same order)."""

from types import SimpleNamespace

import pytest
import torch

from kernels import _validate, device, norms, replay, softmax, vector_add
from kernels import flash_attention as fa
from kernels import paged_attention as pa

# ----------------------------------------------------------------------------- CPU: the encoding


def _compiled(signature, **meta):
    """A stand-in for Triton's CompiledKernel: the fields encode_step reads."""
    fields = dict(num_warps=4, shared=1024, num_ctas=1, launch_cooperative_grid=False)
    fields.update(global_scratch_size=0, profile_scratch_size=0)
    fields.update(meta)
    return SimpleNamespace(
        src=SimpleNamespace(signature=signature),
        metadata=SimpleNamespace(**fields),
        function=0xABC,
        _init_handles=lambda: None,
    )


def test_encode_step_skips_constants_and_appends_scratch():
    sig = {"x_ptr": "*bf16", "y_ptr": "*fp32", "n": "i32", "one": "constexpr", "big": "i64",
           "eps": "fp32", "BLOCK": "constexpr"}  # fmt: skip
    c = _compiled(sig, num_warps=8, shared=4096)
    step = replay.Step(c, (3,), (replay.Slot(0), replay.Slot(5, 64), 7, 1, 2**40, 0.5))
    enc = replay.encode_step(step)
    assert enc[:7] == [0xABC, 3, 1, 1, 256, 4096, 0]
    params = [tuple(enc[i : i + 3]) for i in range(7, len(enc), 3)]
    assert params == [
        (replay.PTR, 0, 0),
        (replay.PTR, 5, 64),
        (replay.I32, 0, 7),
        (replay.I64, 0, 2**40),
        (replay.F32, 0, 0x3F000000),  # 0.5 as fp32 bits
        (replay.NUL, 0, 0),  # global scratch
        (replay.NUL, 0, 0),  # profile scratch
    ]


def test_encode_step_without_scratch_fields():
    """An older Triton (no scratch parameters in its launcher): none are appended."""
    c = _compiled({"x_ptr": "*fp16"})
    del c.metadata.global_scratch_size, c.metadata.profile_scratch_size
    assert replay.encode_step(replay.Step(c, (1, 2), (replay.Slot(0),)))[7:] == [replay.PTR, 0, 0]


def test_encode_step_marks_a_programmatic_dependent_launch():
    c = _compiled({"x_ptr": "*fp16"}, launch_pdl=True)
    assert replay.encode_step(replay.Step(c, (4,), (replay.Slot(1),)))[:7] == [
        0xABC, 4, 1, 1, 128, 1024, 1,
    ]  # fmt: skip


@pytest.mark.parametrize(
    "signature, args, meta, message",
    [
        ({"x_ptr": "*fp16"}, (torch.empty(1),), {}, "not a Slot"),
        ({"x_ptr": "*fp16", "n": "i32"}, (replay.Slot(0),), {}, "fewer arguments"),
        ({"d": "fp64"}, (1.0,), {}, "fp64"),
        ({"x_ptr": "*fp16"}, (replay.Slot(0),), {"global_scratch_size": 128}, "scratch"),
        ({"x_ptr": "*fp16"}, (replay.Slot(0),), {"num_ctas": 2}, "clusters"),
    ],
)
def test_encode_step_refuses_what_it_cannot_replay(signature, args, meta, message):
    with pytest.raises((TypeError, NotImplementedError), match=message):
        replay.encode_step(replay.Step(_compiled(signature, **meta), (1,), args))


def test_materialize_and_real_give_the_pointers_cpp_will_see():
    slots = [None] * replay.N_SLOTS
    slots[0] = torch.randn(6, 10, dtype=torch.bfloat16)
    slots[1] = torch.randn(10, dtype=torch.bfloat16)
    allocs = [
        replay.Alloc(replay.LIKE, 3, 0),
        replay.Alloc(replay.NEW, 4, 0, dtype=replay.FP32, shape=(2, 5, 10)),
        replay.Alloc(replay.NEW, 5, 1, shape=(2, 10)),
        replay.Alloc(replay.SELECT, 6, 5, index=1),
    ]
    replay.materialize(allocs, slots)
    assert slots[3].shape == (6, 10) and slots[3].dtype == torch.bfloat16
    assert slots[4].shape == (2, 5, 10) and slots[4].dtype == torch.float32
    assert slots[5].dtype == torch.bfloat16 and slots[6].data_ptr() == slots[5].data_ptr() + 20
    x, part, n = replay.real((replay.Slot(0), replay.Slot(4, 5 * 10 * 4), 3), slots)
    assert x is slots[0] and n == 3
    assert part.data_ptr() == slots[4].data_ptr() + 200
    assert [a.encode() for a in allocs][1] == [replay.NEW, 4, 0, 0, replay.FP32, 2, 5, 10]


def test_a_plan_that_fails_to_build_turns_the_path_off_and_the_op_runs_on(monkeypatch):
    monkeypatch.setattr(replay, "ON", True)
    made = []
    replay.build(lambda a, b: made.append((a, b)), 1, 2)
    assert made == [(1, 2)] and replay.ON

    def broken(*args):
        raise AttributeError("'CompiledKernel' object has no attribute 'src'")

    with pytest.warns(UserWarning, match="no plan made.*Python path kept"):
        replay.build(broken, 1)
    assert replay.ON is False


@pytest.mark.skipif(device.GPU_MODE, reason="what a machine without a GPU gets")
def test_the_python_path_runs_where_cpp_cannot():
    assert not replay.enabled() and replay.module() is None
    x = torch.randn(3, 8)
    assert replay.call(replay.SOFTMAX, x, None, None, 1.0) is None


# ----------------------------------------------------------------------------- GPU: the replay

gpu = pytest.mark.skipif(
    not replay.enabled(), reason="needs the C++ launch path (a CUDA GPU and the CUDA toolkit)"
)
DTYPES = [torch.float32, torch.bfloat16]
# One program; several programs with partial sums; 3-D; odd width; many rows; rows too wide for
# the fused backward (two-step: row means, then dx by column chunks), one also looped forward.
NORM_SHAPES = [(1, 4096), (8, 4096), (64, 1024), (2, 3, 768), (7, 1000), (4096, 1024),
               (3, 16384), (1, 65536)]  # fmt: skip


def _norm(kind, x, w, b):
    return norms.rms_norm(x, w) if kind == "rms_norm" else norms.layer_norm(x, w, b)


def _grads(kind, x, w, b, dy):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    if kind == "rms_norm":
        leaves = leaves[:2]
    y = _norm(kind, *leaves, *([None] if kind == "rms_norm" else []))
    return (y, *torch.autograd.grad(y, leaves, dy))


@pytest.fixture
def python_path_forbidden(monkeypatch):
    """Makes any call that reaches the Python path fail: proof that a call was replayed."""

    def forbid(*args, **kwargs):
        raise AssertionError("the Python path ran: this call was not replayed from C++")

    def forbid_all():
        monkeypatch.setattr(norms, "_forward", forbid)
        monkeypatch.setattr(norms, "_backward", forbid)
        monkeypatch.setattr(softmax, "_softmax_forward", forbid)
        monkeypatch.setattr(softmax, "_softmax_backward", forbid)
        monkeypatch.setattr(fa, "_dispatch_forward", forbid)
        monkeypatch.setattr(fa, "_backward", forbid)
        monkeypatch.setattr(pa, "layout_key", forbid)  # the Python path's first step

    return forbid_all


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
def test_norm_replay_matches_python_path_exactly(
    kind, shape, dtype, python_path_forbidden, monkeypatch
):
    rows = 1 if len(shape) == 1 else int(torch.tensor(shape[:-1]).prod())
    x, w, b, dy = norms.make_inputs(rows, shape[-1], dtype)
    x, dy = x.reshape(shape) * 2 + 1, dy.reshape(shape)
    first = _grads(kind, x, w, b, dy)  # Python path; it hands C++ the plan
    with monkeypatch.context() as m:  # the plan exists now: only this keeps the no-grad call Python
        m.setattr(replay, "ON", False)
        nograd_first = _norm(kind, x, w, b)
    python_path_forbidden()
    second = _grads(kind, x, w, b, dy)
    for a, r in zip(second, first):
        assert a.dtype == r.dtype and a.shape == r.shape
        torch.testing.assert_close(a, r, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(_norm(kind, x, w, b), nograd_first, rtol=0, atol=0)
    # and against the fp32 reference, as the Python path is tested
    ref = norms.rms_norm_ref(x, w) if kind == "rms_norm" else norms.layer_norm_ref(x, w, b)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=2e-2)
    torch.testing.assert_close(second[0], ref.to(dtype), **tol)


@gpu
@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
def test_norm_replay_strided_input_and_expanded_gradient(kind, python_path_forbidden):
    """x a view with a row stride (the first 1,000 of 1,024 columns); dy from .sum() (stride 0)."""
    big, w, b, _ = norms.make_inputs(33, 1024, torch.bfloat16)
    w, b = w[:1000].contiguous(), b[:1000].contiguous()
    results = []
    for i in range(2):
        if i == 1:
            python_path_forbidden()
        xl = big.clone()[:, :1000].requires_grad_()  # a leaf view: rows 1,024 elements apart
        wl = w.clone().requires_grad_()
        assert xl.stride(0) == 1024
        y = _norm(kind, xl, wl, b)
        y.sum().backward()  # in y's dtype: the gradient reaches the norm expanded, row stride 0
        results.append((y, xl.grad, wl.grad))
    for a, r in zip(*results):
        torch.testing.assert_close(a, r, rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4096), (64, 32000), (3, 5, 1000), (4096, 1024)])
def test_softmax_replay_matches_python_path_exactly(
    shape, dtype, python_path_forbidden, monkeypatch
):
    x = torch.randn(shape, device=device.DEVICE, dtype=dtype) * 4
    dy = torch.randn(shape, device=device.DEVICE, dtype=dtype)
    out = []
    for i in range(2):
        if i == 1:
            python_path_forbidden()
        xl = x.clone().requires_grad_()
        y = softmax.softmax(xl)
        grads = torch.autograd.grad(y, xl, dy)
        with monkeypatch.context() as m:  # the first no-grad call through Python, the second C++
            if i == 0:
                m.setattr(replay, "ON", False)
            nograd = softmax.softmax(x)
        out.append((y, *grads, nograd))
    for a, r in zip(*out):
        torch.testing.assert_close(a, r, rtol=0, atol=0)
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(out[1][0], softmax.softmax_ref(x), **tol)


@gpu
def test_softmax_over_the_last_dim_by_number_is_replayed(python_path_forbidden):
    x = torch.randn(6, 4, 100, device=device.DEVICE)
    first = softmax.softmax(x, dim=2)  # plans the layout
    python_path_forbidden()
    torch.testing.assert_close(softmax.softmax(x, dim=2), first, rtol=0, atol=0)
    torch.testing.assert_close(softmax.softmax(x, dim=-1), first, rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(4096,), (1000,), (3, 5, 4099), (2**20 + 7,)])
def test_vector_add_replay_matches_python_path_exactly(monkeypatch, shape, dtype):
    x = torch.randn(shape, device=device.DEVICE, dtype=dtype)
    y = torch.randn(shape, device=device.DEVICE, dtype=dtype)
    first = vector_add.add(x, y)  # Python path; it hands C++ the plan
    n = replay.module().plan_count()

    def forbid(*args, **kwargs):
        raise AssertionError("the Python path ran: this call was not replayed from C++")

    monkeypatch.setattr(vector_add, "_ADD", forbid)
    second = vector_add.add(x, y)
    assert replay.module().plan_count() == n
    assert (
        second.dtype == dtype and second.shape == x.shape and second.data_ptr() != first.data_ptr()
    )
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    torch.testing.assert_close(second, vector_add.add_ref(x, y), rtol=0, atol=0)
    # Not the default launch, or inputs that want a gradient: the Python path (forbidden here).
    with pytest.raises(AssertionError, match="not replayed"):
        vector_add.add(x, y, block_size=1024)
    with pytest.raises(AssertionError, match="not replayed"):
        vector_add.add(x.clone().requires_grad_(), y)
    # A layout never planned still gets the Python path's checks.
    monkeypatch.undo()
    with pytest.raises(ValueError, match="same shape"):
        vector_add.add(x, y.flatten()[:-1].clone())


# Problems too small to autotune (one short sequence, a decode-sized batch), odd lengths, both head
# dims, a given scale; none that "auto" may hand to the CUDA kernels (bf16, d 128, 512+ tokens).
# ([B, H, Nq, D], Nk, causal, sm_scale)
ATTENTION_CASES = [((1, 16, 128, 128), 128, False, None), ((1, 16, 128, 64), 128, True, None),
                   ((2, 3, 77, 64), 77, True, 0.3), ((1, 4, 300, 128), 300, False, 0.1),
                   ((3, 2, 33, 128), 33, True, None), ((1, 2, 45, 64), 70, False, None),
                   ((2, 2, 70, 128), 45, False, 0.2)]  # fmt: skip


def _attention_grads(q, k, v, do, causal, scale):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = fa.attention(*leaves, causal, scale)
    return (o, *torch.autograd.grad(o, leaves, do))


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape, n_kv, causal, scale", ATTENTION_CASES)
def test_attention_replay_matches_python_path_exactly(
    shape, n_kv, causal, scale, dtype, python_path_forbidden, monkeypatch
):
    q, do = (torch.randn(shape, device=device.DEVICE, dtype=dtype) for _ in range(2))
    kv_shape = (*shape[:2], n_kv, shape[3])
    k, v = (torch.randn(kv_shape, device=device.DEVICE, dtype=dtype) for _ in range(2))
    n = replay.module().plan_count()
    first = _attention_grads(q, k, v, do, causal, scale)  # Python path; it hands C++ the plan
    assert replay.module().plan_count() == n + 1
    with monkeypatch.context() as m:
        m.setattr(replay, "ON", False)
        nograd_first = fa.attention(q, k, v, causal, scale)  # the Python path without autograd
    python_path_forbidden()
    second = _attention_grads(q, k, v, do, causal, scale)
    for name, a, r in zip(("o", "dq", "dk", "dv"), second, first):
        assert a.dtype == r.dtype and a.shape == r.shape, name
        torch.testing.assert_close(a, r, rtol=0, atol=0, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(
            fa.attention(q, k, v, causal, scale), nograd_first, rtol=0, atol=0
        )
    ref = fa.attention_ref(q, k, v, causal, scale)
    assert ((second[0].float() - ref).norm() / ref.norm()).item() < 1e-2


@gpu
def test_attention_replay_keys_the_scale_and_the_options(python_path_forbidden):
    """Another scale is another plan (with its own answer); the Triton options and the CUDA
    kernels' own problems are never replayed; bad input still gets the Python path's errors."""
    q, k, v = (
        torch.randn(1, 2, 64, 64, device=device.DEVICE, dtype=torch.float16) for _ in range(3)
    )
    fa.attention(q, k, v)
    n = replay.module().plan_count()
    fa.attention(q, k, v)
    assert replay.module().plan_count() == n
    o = fa.attention(q, k, v, sm_scale=0.5)
    assert replay.module().plan_count() == n + 1
    ref = fa.attention_ref(q, k, v, sm_scale=0.5)
    assert ((o.float() - ref).norm() / ref.norm()).item() < 1e-2
    long = torch.randn(1, 2, 512, 128, device=device.DEVICE, dtype=torch.bfloat16)
    fa._plan_native(long, long, long, False, 0.1, 0.0)  # "auto" may take the CUDA forward here
    fa.attention(q, k, v, impl="triton")
    assert replay.module().plan_count() == n + 1
    for bad_scale in (-1.0, 0.0, 0):  # 0 is the default's setting in the plan key: not a scale
        with pytest.raises(ValueError, match="sm_scale"):
            fa.attention(q, k, v, sm_scale=bad_scale)
    k32 = k[..., :32].contiguous()
    with pytest.raises(ValueError, match="same head_dim"):
        fa.attention(q, k32, k32)
    python_path_forbidden()
    with pytest.raises(AssertionError, match="not replayed"):
        fa.attention(q, k, v, tma=False)
    torch.testing.assert_close(fa.attention(q, k, v, sm_scale=0.5), o, rtol=0, atol=0)


@gpu
def test_replayed_ops_under_cuda_graph_capture():
    x, w, b, _ = norms.make_inputs(8, 4096, torch.bfloat16)
    expected = (norms.rms_norm(x, w), norms.layer_norm(x, w, b), softmax.softmax(x))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream, as torch's docs ask
        norms.rms_norm(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = (norms.rms_norm(x, w), norms.layer_norm(x, w, b), softmax.softmax(x))
    x.copy_(torch.randn_like(x))  # new values (norms ignore a scale or a shift of x)
    graph.replay()
    torch.cuda.synchronize()
    again = (norms.rms_norm(x, w), norms.layer_norm(x, w, b), softmax.softmax(x))
    for o, a, e in zip(outs, again, expected):
        torch.testing.assert_close(o, a, rtol=0, atol=0)
        assert not torch.equal(o, e)  # the replay ran on the new x


@gpu
def test_a_changed_layout_or_setting_is_planned_anew_and_bad_input_still_raises():
    x, w, b, _ = norms.make_inputs(16, 512, torch.float16)
    norms.layer_norm(x, w, b)
    n = replay.module().plan_count()
    norms.layer_norm(x, w, b)  # replayed: no new plan
    assert replay.module().plan_count() == n
    y = norms.layer_norm(x, w, b, eps=0.5)  # another eps: its own plan, its own answer
    assert replay.module().plan_count() == n + 1
    torch.testing.assert_close(
        y, norms.layer_norm_ref(x, w, b, eps=0.5).half(), rtol=2e-3, atol=2e-3
    )
    with pytest.raises(TypeError, match="weight must have x's dtype"):
        norms.layer_norm(x, w.float(), b)
    with pytest.raises(ValueError, match="weight must have shape"):
        norms.layer_norm(x, w[:256], b)
    with pytest.raises(ValueError, match="dim must be the last dimension"):
        softmax.softmax(x, dim=0)


@gpu
def test_switching_the_path_off_sends_calls_to_python(monkeypatch):
    x, w, _, _ = norms.make_inputs(4, 256, torch.bfloat16)
    norms.rms_norm(x, w)
    calls = []
    forward = norms._forward
    monkeypatch.setattr(norms, "_forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    norms.rms_norm(x, w)
    assert calls == []
    monkeypatch.setattr(replay, "ON", False)
    norms.rms_norm(x, w)
    assert calls == [1]


# Paged decode: (batch, tokens per sequence, n_heads, n_kv, head_dim, block_size, dtype). Several
# splits (batch 1 with 256+ tokens: the combine runs, a programmatic dependent launch on Hopper) in
# all three dtypes, and one (the rest), GQA and not; the lengths are drawn at random below.
PAGED_CASES = [(1, 1024, 32, 8, 128, 16, torch.bfloat16), (1, 512, 4, 4, 64, 16, torch.float16),
               (1, 384, 8, 2, 128, 32, torch.float32), (3, 64, 8, 2, 128, 32, torch.float32),
               (64, 512, 32, 8, 128, 16, torch.bfloat16), (2, 48, 4, 2, 64, 16, torch.bfloat16)]  # fmt: skip


@pytest.fixture
def debug_off():
    """Debug mode (on in the test suite) reads lengths and block ids on every call: it keeps paged
    decode on the Python path. Off here, as in a server."""
    was = _validate.debug()
    _validate.debug(False)
    yield
    _validate.debug(was)


@gpu
@pytest.mark.parametrize("case", PAGED_CASES)
def test_paged_decode_replay_matches_python_path_exactly(case, debug_off, python_path_forbidden):
    batch, seq, n_heads, n_kv, d, block, dtype = case
    q, k, v, kc, vc, table, lens = pa.decode_case(
        batch, seq, n_heads=n_heads, n_kv=n_kv, head_dim=d, block_size=block, dtype=dtype
    )
    lens = torch.randint(0, seq + 1, lens.shape, device=lens.device, dtype=lens.dtype)
    lens[0] = seq  # one sequence at the table's capacity
    n = replay.module().plan_count()
    first = pa.paged_decode(q, kc, vc, table, lens)  # Python path; it hands C++ the plan
    assert replay.module().plan_count() == n + 1
    python_path_forbidden()
    second = pa.paged_decode(q, kc, vc, table, lens)
    assert second.dtype == first.dtype and second.shape == first.shape
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    lens.fill_(seq // 2)  # new lengths (values on the device) under the same plan
    third = pa.paged_decode(q, kc, vc, table, lens)
    ref = pa.paged_decode_ref(q, kc, vc, table, lens)
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(third.float(), ref, rtol=tol, atol=tol)


@gpu
def test_paged_decode_replays_only_what_it_can(debug_off, python_path_forbidden, monkeypatch):
    """A given split count or tile, debug mode, a bad scale: the Python path, its checks and its
    errors; another scale is its own plan; a layout never planned still gets the checks."""
    q, k, v, kc, vc, table, lens = pa.decode_case(1, 256, n_heads=8, n_kv=2, head_dim=64)
    pa.paged_decode(q, kc, vc, table, lens)
    n = replay.module().plan_count()
    o = pa.paged_decode(q, kc, vc, table, lens, sm_scale=0.5)
    assert replay.module().plan_count() == n + 1
    ref = pa.paged_decode_ref(q, kc, vc, table, lens, sm_scale=0.5)
    torch.testing.assert_close(o.float(), ref, rtol=2e-2, atol=2e-2)
    pa.paged_decode(q, kc, vc, table, lens, num_splits=2)
    pa.paged_decode(q, kc, vc, table, lens, config=(32, 4, 2))
    for bad_scale in (-1.0, 0.0, 0, float("nan")):
        with pytest.raises(ValueError, match="sm_scale"):
            pa.paged_decode(q, kc, vc, table, lens, sm_scale=bad_scale)
    with pytest.raises((TypeError, ValueError), match="block_table"):
        pa.paged_decode(q, kc, vc, table.long(), lens)
    assert replay.module().plan_count() == n + 1
    python_path_forbidden()
    torch.testing.assert_close(
        pa.paged_decode(q, kc, vc, table, lens, sm_scale=0.5), o, rtol=0, atol=0
    )
    with pytest.raises(AssertionError, match="not replayed"):
        pa.paged_decode(q, kc, vc, table, lens, num_splits=2)
    _validate.debug(True)
    with pytest.raises(AssertionError, match="not replayed"):
        pa.paged_decode(q, kc, vc, table, lens)


@gpu
def test_replayed_paged_decode_under_cuda_graph_capture(debug_off, python_path_forbidden):
    """A decode step captured in a CUDA graph replays the C++ launches, the programmatic dependent
    one included, and reads the lengths as they are when the graph runs."""
    q, k, v, kc, vc, table, lens = pa.decode_case(1, 512, n_heads=8, n_kv=2, head_dim=128)
    pa.paged_decode(q, kc, vc, table, lens)  # the plan
    python_path_forbidden()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pa.paged_decode(q, kc, vc, table, lens)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pa.paged_decode(q, kc, vc, table, lens)
    lens.fill_(300)
    graph.replay()
    torch.cuda.synchronize()
    ref = pa.paged_decode_ref(q, kc, vc, table, lens)
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


FIRST_BACKWARD = """
import torch
from kernels import norms, replay, softmax
assert replay.enabled()
x = torch.randn(3, 512, device="cuda") * 4
w = torch.ones(512, device="cuda")
softmax.softmax(x)  # a forward without autograd makes the plans
norms.rms_norm(x, w)
for f in (lambda x: softmax.softmax(x), lambda x: norms.rms_norm(x, w)):
    xl = x.clone().requires_grad_()
    # the process's first backward runs a C++ node on the autograd engine's thread
    (f(xl) * torch.arange(512, device="cuda")).sum().backward()
    assert torch.isfinite(xl.grad).all() and xl.grad.abs().sum() > 0
print("ok")
"""


@gpu
def test_the_first_backward_of_a_process_can_be_replayed():
    """The autograd engine's thread has no driver context until something makes one current: a
    process whose first backward is a replayed node must still launch (it crashed once)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FIRST_BACKWARD], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# ----------------------------------------------------------------------------- CPU: plans mirror the Python path
#
# A plan repeats, as slots, the launches the Python path makes. If a kernel's signature or a
# launch's arguments change on one side only, the GPU tests would catch it; CI has no GPU, so here
# both sides run in the interpreter and their launches are compared: the same kernels in the same
# order, the same grids, meta-parameters and integer and float arguments, tensors where tensors go,
# and the op's inputs in the same places.


def _python_launches(monkeypatch, run):
    """The launches ``run()`` makes through kernels.launch.Launcher: (kernel, grid, args, meta)."""
    from kernels import launch

    seen, call = [], launch.Launcher.__call__

    def spy(self, key, grid, args, **meta):
        seen.append((self.fn, tuple(grid), tuple(args), meta))
        return call(self, key, grid, args, **meta)

    monkeypatch.setattr(launch.Launcher, "__call__", spy)
    run()
    monkeypatch.setattr(launch.Launcher, "__call__", call)
    return seen


def _planned_launches(monkeypatch, kernels_, make_plan):
    """The launches of the plan ``make_plan()`` hands replay.add, compiled by stand-ins:
    {"fwd" | "nograd" | "bwd": [(kernel, grid, args, meta)]}."""
    for k in kernels_:
        monkeypatch.setattr(
            k, "warmup", lambda *a, grid, _k=k, **meta: SimpleNamespace(k=_k, meta=meta)
        )
    got = {}

    def add(op, x, w, b, setting, fwd, nograd, bwd, *rest):
        for name, prog in (("fwd", fwd), ("nograd", nograd), ("bwd", bwd)):
            got[name] = [(s.compiled.k, tuple(s.grid), s.args, s.compiled.meta) for s in prog.steps]

    monkeypatch.setattr(replay, "add", add)
    make_plan()
    return got


def _same_launches(python, planned, inputs):
    """``inputs``: {id(tensor): slot} of the op's own tensors (x, weight, bias, dy)."""
    assert [p[0] for p in python] == [q[0] for q in planned]
    for (kp, gp, ap, mp), (_, gq, aq, mq) in zip(python, planned):
        assert gp == gq and mp == mq and len(ap) == len(aq), kp
        for a, s in zip(ap, aq):
            if isinstance(a, torch.Tensor):
                assert isinstance(s, replay.Slot), (kp, a, s)
                if id(a) in inputs:
                    assert (s.index, s.offset) == (inputs[id(a)], 0), kp
            else:
                assert a == s and type(a) is type(s), (kp, a, s)


NORM_KERNELS = [norms._norm_fwd_kernel, norms._norm_fwd_looped_kernel, norms._norm_bwd_kernel,
                norms._norm_bwd_stats_kernel, norms._norm_bwd_dx_kernel]  # fmt: skip


@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize(
    "shape", [(2, 64), (300, 96), (3, 9000)]
)  # one program; partials; two-step
@pytest.mark.parametrize("strided", [False, True])  # x a view whose rows are 8 elements apart
def test_norm_plan_repeats_the_python_paths_launches(monkeypatch, kind, shape, strided):
    from kernels import partial_sums

    is_rms = kind == "rms_norm"
    x, w, b, dy = norms.make_inputs(*shape, torch.float32)
    if strided:
        x = torch.cat([x, x[:, :8]], dim=1)[:, : shape[1]]
        assert x.stride(0) == shape[1] + 8
    bias = None if is_rms else b
    eps = 1e-6 if is_rms else 1e-5
    py = {}
    for stats in (True, False):

        def forward(stats=stats):
            py["out"] = norms._forward(x, w, bias, eps, is_rms, stats=stats)

        py[stats] = _python_launches(monkeypatch, forward)
    _, mean, rstd = py["out"] = norms._forward(x, w, bias, eps, is_rms)
    bwd = _python_launches(
        monkeypatch, lambda: norms._backward(dy, x, w, mean, rstd, bias is not None)
    )
    planned = _planned_launches(
        monkeypatch,
        [*NORM_KERNELS, partial_sums._sum_kernel],
        lambda: norms._native_plan(x, w, bias, eps, is_rms),
    )
    inputs = {id(x): 0, id(w): 1, id(dy): 6}
    if bias is not None:
        inputs[id(bias)] = 2
    _same_launches(py[True], planned["fwd"], inputs)
    _same_launches(py[False], planned["nograd"], inputs)
    _same_launches(bwd, planned["bwd"], inputs)
    assert len(bwd) == (1 if shape == (2, 64) else 2 if shape == (300, 96) else 3)


@pytest.mark.parametrize("shape", [(5, 300), (2, 70_001)])  # fused; looped
def test_softmax_plan_repeats_the_python_paths_launches(monkeypatch, shape):
    x = torch.randn(shape, device=device.DEVICE)
    dy = torch.randn(shape, device=device.DEVICE)
    y = []
    fwd = _python_launches(
        monkeypatch, lambda: y.append(softmax._softmax_forward(x, softmax.MAX_FUSED_BLOCK))
    )
    bwd = _python_launches(
        monkeypatch, lambda: softmax._softmax_backward(y[0], dy, softmax.MAX_FUSED_BLOCK_BWD)
    )
    kernels_ = [softmax._softmax_kernel, softmax._softmax_looped_kernel, softmax._softmax_bwd_kernel,
                softmax._softmax_bwd_looped_kernel]  # fmt: skip
    planned = _planned_launches(
        monkeypatch, kernels_, lambda: softmax._native_plan(x, softmax.MAX_FUSED_BLOCK)
    )
    _same_launches(fwd, planned["fwd"], {id(x): 0})
    _same_launches(bwd, planned["bwd"], {id(dy): 4})


def test_vector_add_plan_repeats_the_python_paths_launch(monkeypatch):
    x = torch.randn(5000, device=device.DEVICE)
    y = torch.randn(5000, device=device.DEVICE)
    python = _python_launches(monkeypatch, lambda: vector_add.add(x, y))
    planned = _planned_launches(
        monkeypatch, [vector_add._add_kernel], lambda: vector_add._native_plan(x, y)
    )
    _same_launches(python, planned["fwd"], {id(x): 0, id(y): 1})
    assert planned["nograd"] == planned["fwd"] and planned["bwd"] == []


def test_vector_add_plans_only_calls_it_can_replay(monkeypatch):
    """Only a default launch on inputs that want no gradient hands C++ a plan: a call that can never
    be replayed (another block, or inputs that want a gradient) must not rebuild one each time."""
    built = []
    monkeypatch.setattr(replay, "planning", lambda x: True)
    monkeypatch.setattr(replay, "build", lambda make, *args: built.append(make))
    x = torch.randn(300, device=device.DEVICE)
    y = torch.randn(300, device=device.DEVICE)
    vector_add.add(x.clone().requires_grad_(), y)
    vector_add.add(x, y, block_size=1024)
    assert built == []
    vector_add.add(x, y)
    assert built == [vector_add._native_plan]
    with torch.no_grad():  # no gradient wanted in no-grad mode
        vector_add.add(x.clone().requires_grad_(), y)
    assert len(built) == 2


@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_plan_repeats_the_python_paths_launches(monkeypatch, splits):
    """The plan launches the split kernel at the config the autotuner chose, then (several splits)
    the combine, with the Python path's grids, arguments and meta-parameters."""
    from kernels import launch

    q, _, _, kc, vc, table, lens = pa.decode_case(
        2, 48, n_heads=4, n_kv=2, head_dim=64, dtype=torch.float32
    )
    inputs = (q, kc, vc, table, lens)
    python = _python_launches(monkeypatch, lambda: pa.paged_decode(*inputs, num_splits=splits))
    plan = pa._PLANS.get(launch.layout_key(inputs, splits, None))
    config = pa._paged_decode_split_kernel.best_config.all_kwargs()
    split, combine = pa._paged_decode_split_kernel.fn, pa._paged_decode_combine_kernel
    for k in (split, combine):
        monkeypatch.setattr(
            k, "warmup", lambda *a, grid, _k=k, **meta: SimpleNamespace(k=_k, meta=meta)
        )
    got = {}
    monkeypatch.setattr(replay, "add_inference", lambda op, i, s, prog, y: got.update(p=prog, y=y))
    pa._native_plan(inputs, plan, 0.125, 0.0, None)
    planned = [(s.compiled.k, tuple(s.grid), s.args, s.compiled.meta) for s in got["p"].steps]
    assert len(python) == len(planned) == (1 if splits == 1 else 2)
    # The Python path launches the split kernel through its autotuner, which adds the config.
    assert python[0][0] is pa._paged_decode_split_kernel
    python[0] = (split, python[0][1], python[0][2], {**python[0][3], **config})
    _same_launches(python, planned, {id(t): i for i, t in enumerate(inputs)})
    assert got["y"] == pa._OUT
    assert [a.slot for a in got["p"].allocs] == ([pa._OUT] if splits == 1 else [pa._OUT, pa._PARTS])
