import pytest
import torch

from kernels import device, megakernel

DEV = device.DEVICE
# Triton's interpreter computes bf16 wrongly (a known limitation): bf16 is checked on GPUs only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if device.GPU_MODE else [])
# (n_layers, batch, width): odd widths leave the last program's slice partly empty.
SHAPES = [(1, 1, 16), (3, 1, 40), (2, 5, 100), (4, 16, 64), (3, 3, 200)]
# Model-sized widths, on a GPU only and in bf16 only: each new shape and dtype compiles its own
# tiles, about a second a case on an H100, and the other dtypes add nothing the small shapes miss.
LARGE = [(8, 1, 1024), (8, 16, 1024), (8, 3, 1000), (8, 1, 2048), (4, 2, 4096)]
GPU_ONLY = pytest.mark.skipif(not device.GPU_MODE, reason="the persistent grid needs a GPU")


def _rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _tol(dtype):
    # The kernel and the reference both round every layer's output to `dtype`; what differs is the
    # order of the fp32 additions, so one or two units in the last place at most, per layer.
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]


def _case(n_layers, m, d, dtype, bias=True, seed=0):
    w, b = megakernel.make_weights(n_layers, d, dtype=dtype, seed=seed)
    x = torch.randn(m, d, generator=torch.Generator().manual_seed(seed + 1)).to(DEV, dtype)
    return x, w, (b if bias else None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tile", ["auto", "dot"])
def test_layered_path_matches_reference(shape, dtype, tile):
    n_layers, m, d = shape
    x, w, b = _case(n_layers, m, d, dtype)
    # Several programs per layer (three on a CPU), so the column slices and their masks are tested.
    kw = {} if device.GPU_MODE else {"max_programs": 3}
    out = megakernel.fused_mlp_stack(x, w, b, persistent=False, tile=tile, return_all=True, **kw)
    assert out.shape == (n_layers, m, d) and out.dtype == dtype
    ref = megakernel.mlp_stack_ref(x, w, b, round_each_layer=True)
    assert _rel_err(out[-1], ref) < _tol(dtype)
    # Each layer on its own: layer l of the kernel from layer l - 1 of the kernel.
    for layer in range(1, n_layers):
        one = megakernel.mlp_stack_ref(out[layer - 1], w[layer : layer + 1], b[layer : layer + 1])
        assert _rel_err(out[layer], one) < _tol(dtype)


@pytest.mark.skipif(not device.GPU_MODE, reason="model-sized widths: GPU only")
@pytest.mark.parametrize("shape", LARGE)
@pytest.mark.parametrize("tile", ["auto", "dot"])
def test_layered_path_at_model_sizes(shape, tile):
    test_layered_path_matches_reference(shape, torch.bfloat16, tile)


@pytest.mark.parametrize("tile", ["gemv", "dot"])
@pytest.mark.parametrize("shape", [(3, 1, 40), (2, 5, 48), (4, 2, 64)])
def test_persistent_kernel_one_program_equals_layered(shape, tile):
    # With one program a spin barrier cannot wait on anyone, so the persistent kernel runs in the
    # interpreter too: same tiles as the layered path, hence bitwise the same result.
    n_layers, m, d = shape
    x, w, b = _case(n_layers, m, d, torch.float32)
    kw = dict(max_programs=1, tile=tile, return_all=True)
    persistent = megakernel.fused_mlp_stack(x, w, b, persistent=True, **kw)
    layered = megakernel.fused_mlp_stack(x, w, b, persistent=False, **kw)
    assert torch.equal(persistent, layered)


def test_barrier_words_return_to_rest():
    # The sense-reversing barrier needs no reset from the host: after each launch the arrival count
    # is back to 0 and the generation has moved on by one per barrier (n_layers - 1 of them).
    n_layers = 4
    x, w, b = _case(n_layers, 1, 32, torch.float32)
    before = megakernel.barrier_state()
    for _ in range(3):
        megakernel.fused_mlp_stack(x, w, b, persistent=True, max_programs=1)
    after = megakernel.barrier_state()
    assert after["count"] == 0 and after["timeout"] == 0
    assert after["generation"] == before["generation"] + 3 * (n_layers - 1)


def test_barrier_timeout_raises_in_debug_mode(monkeypatch):
    """A program that gives up at a barrier must not go unnoticed: with a poll budget of zero
    every wait gives up at once, the timeout word is set and the launch raises (debug mode is on
    in the tests; on the CPU the check is always on). The word is cleared for the next launch."""
    x, w, b = _case(3, 1, 32, torch.float32)
    monkeypatch.setattr(megakernel, "MAX_POLLS", 0)
    with pytest.raises(RuntimeError, match="timed out at a grid barrier"):
        megakernel.fused_mlp_stack(x, w, b, persistent=True, max_programs=1)
    monkeypatch.undo()
    assert not megakernel.barrier_timeouts()
    out = megakernel.fused_mlp_stack(x, w, b, persistent=True, max_programs=1)
    torch.testing.assert_close(out, megakernel.mlp_stack_ref(x, w, b, round_each_layer=True))


def test_no_bias_and_no_activation():
    x, w, _ = _case(3, 2, 48, torch.float32, bias=False)
    kw = {} if device.GPU_MODE else {"max_programs": 2}
    out = megakernel.fused_mlp_stack(x, w, None, activation="none", **kw)
    ref = megakernel.mlp_stack_ref(x, w, None, activation="none")
    assert _rel_err(out, ref) < 1e-5
    assert (out < 0).any(), "without ReLU some outputs are negative"


def test_eager_baseline_matches_reference():
    x, w, b = _case(3, 4, 40, torch.float32)
    ref = megakernel.mlp_stack_ref(x, w, b)
    assert _rel_err(megakernel.mlp_stack_eager(x, w, b), ref) < 1e-5


def test_plan():
    # 132 SMs: a 1024-wide layer in 128 slices of 8 columns, held whole (GEMV form).
    assert megakernel.plan(1024, 1, 132) == (128, 8, 1024, True, 4)
    # A 2048-wide slice of 16 columns needs 16 warps to stay in registers.
    assert megakernel.plan(2048, 1, 132) == (128, 16, 2048, True, 16)
    # Past two rows the 16-row tl.dot wins; its slices are at least 16 wide.
    assert megakernel.plan(1024, 16, 132) == (64, 16, 128, False, 4)
    assert megakernel.plan(1024, 2, 132)[3] and not megakernel.plan(1024, 3, 132)[3]
    assert megakernel.plan(4096, 1, 132)[3] is False  # too big for registers: streamed
    with pytest.raises(ValueError, match="allow more programs"):
        megakernel.plan(4096, 1, 2, tile="dot")
    with pytest.raises(ValueError, match="does not fit in registers"):
        megakernel.plan(4096, 1, 2, tile="gemv")


def test_degenerate_shapes():
    x, w, b = _case(2, 1, 16, torch.float32)
    out = megakernel.fused_mlp_stack(x[:0], w, b)
    assert out.shape == (0, 16)


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(x=torch.zeros(4, 8, dtype=torch.float64)), TypeError, "x must have dtype"),
        (dict(x=torch.zeros(17, 8)), ValueError, "at most 16 rows"),
        (dict(x=torch.zeros(8)), ValueError, "x must be 2-D"),
        (dict(weights=torch.zeros(2, 8, 6)), ValueError, "weights must be"),
        (dict(weights=torch.zeros(0, 8, 8)), ValueError, "at least one layer"),
        (
            dict(weights=torch.zeros(2, 8, 8).transpose(1, 2)),
            ValueError,
            "weights must be contiguous",
        ),
        (dict(weights=torch.zeros(2, 8, 8, dtype=torch.float16)), TypeError, "same dtype"),
        (dict(biases=torch.zeros(3, 8)), ValueError, "biases must be"),
        (dict(activation="gelu"), ValueError, "activation must be"),
        (dict(max_programs=0), ValueError, "max_programs"),
        (dict(num_warps=3), ValueError, "num_warps"),
        (dict(tile="wide"), ValueError, "tile must be"),
    ],
)
def test_rejects_bad_input(kw, err, match):
    args = dict(x=torch.zeros(2, 8), weights=torch.zeros(2, 8, 8), biases=torch.zeros(2, 8))
    args.update({k: kw.pop(k) for k in list(kw) if k in args})
    args = {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    with pytest.raises(err, match=match):
        megakernel.fused_mlp_stack(args["x"], args["weights"], args["biases"], **kw)


@pytest.mark.skipif(device.GPU_MODE, reason="interpreter-only guard")
def test_interpreter_refuses_a_multi_program_persistent_grid():
    x, w, b = _case(2, 1, 64, torch.float32)
    with pytest.raises(ValueError, match="spin forever"):
        megakernel.fused_mlp_stack(x, w, b, persistent=True, max_programs=4)


@GPU_ONLY
@pytest.mark.parametrize(
    "shape", [(8, 1, 1024), (8, 2, 1000), (8, 3, 1000), (8, 16, 1024), (8, 1, 2048), (4, 2, 4096)]
)
def test_persistent_grid_on_gpu(shape):
    # The real thing: one program per slice, up to one per SM, all resident, barriers in between.
    n_layers, m, d = shape
    x, w, b = _case(n_layers, m, d, torch.bfloat16)
    n = megakernel.plan(d, m, megakernel.sm_count())[0]
    assert n > 1
    before = megakernel.barrier_state()
    out = megakernel.fused_mlp_stack(x, w, b, return_all=True)
    layered = megakernel.fused_mlp_stack(x, w, b, persistent=False, return_all=True)
    assert torch.equal(out, layered)
    ref = megakernel.mlp_stack_ref(x, w, b, round_each_layer=True)
    assert _rel_err(out[-1], ref) < _tol(torch.bfloat16)
    # Many back-to-back launches reuse the barrier words without a reset from the host.
    first = out[-1].clone()
    for _ in range(200):
        again = megakernel.fused_mlp_stack(x, w, b)
    assert torch.equal(again, first)
    after = megakernel.barrier_state()
    assert after["count"] == 0 and after["timeout"] == 0
    assert (after["generation"] - before["generation"]) % 2**32 == 201 * (n_layers - 1)


@GPU_ONLY
def test_persistent_kernel_in_a_cuda_graph():
    x, w, b = _case(8, 1, 1024, torch.bfloat16)
    expected = megakernel.fused_mlp_stack(x, w, b).clone()
    replay = megakernel.cuda_graph(megakernel.fused_mlp_stack, x, w, b)
    for _ in range(50):
        out = replay()
    assert torch.equal(out, expected)
    assert not megakernel.barrier_timeouts()


@GPU_ONLY
def test_grid_larger_than_the_gpu_is_refused():
    x, w, b = _case(2, 1, 1024, torch.bfloat16)
    with pytest.raises(ValueError, match="deadlocks"):
        megakernel.fused_mlp_stack(x, w, b, max_programs=megakernel.sm_count() + 1)
