import pytest
import torch
from conftest import load_script

from kernels import device, norms, rows

SHAPES = [(3, 1), (200, 3), (7, 257), (4, 1000), (2, 4097), (2, 3, 33)]
# (dtype, rtol, atol) against the fp32 reference. fp32: reductions in a different order, a few
# ulp of each sum. bf16: one rounding of the output to 8 bits, one more ulp from the interpreter.
DTYPES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 2**-7, 2e-2)]
# Forcing the wide-row kernels at any width: looped forward, two-step backward.
PATHS = {"fused": (norms.MAX_FUSED_BLOCK, norms.MAX_FUSED_BLOCK_BWD), "wide": (0, 0)}
KINDS = ["rms_norm", "layer_norm"]


def _run(kind, x, w, b, path):
    """Our forward and backward through the launchers, forcing one path."""
    is_rms = kind == "rms_norm"
    bias = None if is_rms else b
    eps = 1e-6 if is_rms else 1e-5
    fwd_cfg = norms.fwd_config(*rows.as_rows("x", x).shape, PATHS[path][0])
    bwd_cfg = norms.bwd_config(*rows.as_rows("x", x).shape, PATHS[path][1])
    y, mean, rstd = norms._forward(x, w, bias, eps, is_rms, fwd_cfg)
    return y, mean, rstd, bias, eps, bwd_cfg


def _reference(kind, x, w, bias, dy):
    """fp32 reference output and gradients (of x, weight and bias), through torch autograd."""
    xs = [
        t.detach().float().requires_grad_() for t in (x, w) + ((bias,) if bias is not None else ())
    ]
    if kind == "rms_norm":
        y = norms.rms_norm_ref(*xs)
    else:
        y = norms.layer_norm_ref(*xs)
    grads = torch.autograd.grad(y, xs, dy.float())
    return y, grads


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, rtol, atol", DTYPES)
def test_forward_and_backward_match_reference(path, kind, shape, dtype, rtol, atol):
    x, w, b, dy = norms.make_inputs(shape[0] if len(shape) == 2 else 6, shape[-1], dtype)
    x, dy = x.reshape(shape) * 2 + 1, dy.reshape(shape)  # a non-zero mean for LayerNorm
    y, mean, rstd, bias, eps, bwd_cfg = _run(kind, x, w, b, path)
    y_ref, grads_ref = _reference(kind, x, w, bias, dy)
    assert y.shape == x.shape and y.dtype == dtype
    torch.testing.assert_close(y, y_ref.to(dtype), rtol=rtol, atol=atol)
    grads = norms._backward(dy, x, w, mean, rstd, bias is not None, bwd_cfg)
    grads = [g for g in grads if g is not None]
    assert len(grads) == len(grads_ref)
    # Gradients: dx per row as above; dw, db sum over rows, so scale atol with the row count.
    n_rows = x.numel() // x.shape[-1]
    for i, (g, r) in enumerate(zip(grads, grads_ref)):
        assert g.dtype == dtype
        if shape[-1] == 1 and i == 0:
            # One column: the output does not depend on x (LayerNorm gives b, RMSNorm sign(x) w),
            # so dx is zero up to round-off that rstd ~ 1/sqrt(eps) amplifies. Check its size.
            assert g.float().abs().max() < 1e-2 and r.abs().max() < 1e-2
            continue
        scale = 1 if i == 0 else n_rows**0.5
        torch.testing.assert_close(g, r.to(dtype), rtol=rtol, atol=atol * scale)


@pytest.mark.parametrize("kind", KINDS)
def test_autograd_function(kind):
    # The public functions through torch.autograd, against F.layer_norm / the RMS reference.
    x, w, b, dy = norms.make_inputs(9, 300, torch.float32)
    params = [x.requires_grad_(), w.requires_grad_()]
    if kind == "rms_norm":
        y = norms.rms_norm(x, w)
    else:
        params.append(b.requires_grad_())
        y = norms.layer_norm(x, w, b)
    grads = torch.autograd.grad(y, params, dy)
    y_ref, grads_ref = _reference(kind, x, w, b if kind == "layer_norm" else None, dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, grads_ref):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_layer_norm_without_bias_and_rms_against_torch():
    x, w, _, _ = norms.make_inputs(5, 64, torch.float32)
    ref = torch.nn.functional.layer_norm(x, (64,), w, None, 1e-5)
    torch.testing.assert_close(norms.layer_norm(x, w), ref, rtol=1e-5, atol=1e-5)
    if hasattr(torch.nn.functional, "rms_norm"):
        ref = torch.nn.functional.rms_norm(x, (64,), w, 1e-6)
        torch.testing.assert_close(norms.rms_norm(x, w), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_layer_norm_large_mean(path):
    # |mean| 1000 times the spread: the looped kernel's shifted sums must not cancel.
    x, w, b, _ = norms.make_inputs(4, 1000, torch.float32)
    x = x + 1000.0
    y, *_ = _run("layer_norm", x, w, b, path)
    ref = torch.nn.functional.layer_norm(x.double(), (1000,), w.double(), b.double(), 1e-5)
    torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-3)


def test_backward_sums_partials_over_several_programs():
    # More row blocks than programs: each program accumulates several blocks of dw, and the
    # partial-sum reduction adds the programs' rows.
    x, w, b, dy = norms.make_inputs(100, 500, torch.float32)
    cfg = norms.bwd_config(100, 500)
    assert cfg["BLOCK_M"] * 4 * 2 < 100  # the interpreter runs 4 programs: each loops twice or more
    y, mean, rstd = norms._forward(x, w, b, 1e-5, False)
    dx, dw, db = norms._backward(dy, x, w, mean, rstd, True)
    _, (_, dw_ref, db_ref) = _reference("layer_norm", x, w, b, dy)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(db, db_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(1, 4096), (7, 1000), (24, 1000)])
@pytest.mark.parametrize("kind", KINDS)
def test_one_program_backward_writes_dw_itself(kind, shape):
    """A few row blocks run as one program that stores dw and db in the weight's dtype (no
    partial sums): 24 x 1000 is six blocks of four rows, walked by that one program."""
    dtype = torch.float16
    assert norms.bwd_config(*shape)["programs"] == 1
    x, w, b, dy = norms.make_inputs(*shape, dtype)
    y, mean, rstd, bias, eps, _ = _run(kind, x, w, b, "fused")
    grads = [g for g in norms._backward(dy, x, w, mean, rstd, bias is not None) if g is not None]
    assert all(g.dtype == dtype for g in grads[1:])
    _, refs = _reference(kind, x, w, bias, dy)
    for got, ref in zip(grads, refs, strict=True):
        rel = ((got.float() - ref).norm() / ref.norm()).item()
        assert rel < 8e-3, rel


@pytest.mark.parametrize("kind", KINDS)
def test_forward_without_gradients_writes_no_statistics(kind):
    """With no gradient wanted the forward skips mean and rstd: the same y, no buffers."""
    x, w, b, _ = norms.make_inputs(5, 300, torch.float32)
    is_rms = kind == "rms_norm"
    bias = None if is_rms else b
    y, mean, rstd = norms._forward(x, w, bias, 1e-5, is_rms, stats=False)
    assert mean is None and rstd is None
    y_stats, *_ = norms._forward(x, w, bias, 1e-5, is_rms)
    # Two binaries (with and without the stores) may contract multiply-adds differently: ulps.
    torch.testing.assert_close(y, y_stats, rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        out = norms.rms_norm(x, w, 1e-5) if is_rms else norms.layer_norm(x, w, b, 1e-5)
    assert torch.equal(out, y)


def test_row_strided_input():
    base, w, b, _ = norms.make_inputs(6, 300, torch.float32)
    x = base[:, :257]
    ref = torch.nn.functional.layer_norm(x, (257,), w[:257], b[:257], 1e-5)
    torch.testing.assert_close(norms.layer_norm(x, w[:257], b[:257]), ref, rtol=1e-5, atol=1e-5)


def test_empty():
    x = torch.empty(0, 8, device=device.DEVICE)
    w = torch.ones(8, device=device.DEVICE)
    assert norms.rms_norm(x, w).shape == (0, 8)
    x.requires_grad_()
    w.requires_grad_()
    y = norms.layer_norm(x, w, torch.zeros(8, device=device.DEVICE))
    (dw,) = torch.autograd.grad(y, w, torch.empty_like(y))
    assert torch.equal(dw, torch.zeros_like(w))


def _on_device(t: torch.Tensor) -> torch.Tensor:
    # .to() makes a strided view contiguous; the contiguity checks need the strides kept.
    out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device.DEVICE)
    return out.copy_(t)


def _bad(**kw):
    args = dict(x=torch.zeros(4, 8), weight=torch.ones(8), bias=torch.zeros(8), eps=1e-5)
    args.update(kw)
    return args


@pytest.mark.parametrize(
    "args, err, match",
    [
        (_bad(x=torch.zeros(4, 8, dtype=torch.float64)), TypeError, "x must have dtype"),
        (_bad(x=[1.0]), TypeError, "x must be a torch.Tensor"),
        (_bad(weight=torch.ones(7)), ValueError, r"weight must have shape \(8,\)"),
        (_bad(weight=torch.ones(8, dtype=torch.bfloat16)), TypeError, "weight must have x's dtype"),
        (_bad(bias=torch.zeros(2, 4)), ValueError, r"bias must have shape \(8,\)"),
        (_bad(weight=torch.ones(16)[::2]), ValueError, "weight must be contiguous"),
        (_bad(eps=-1.0), ValueError, "eps must be a non-negative number"),
        (_bad(eps="small"), ValueError, "eps must be a non-negative number"),
        (_bad(x=torch.zeros(())), ValueError, "at least 1 dimension"),
        (_bad(x=torch.zeros(8, 4).t()), ValueError, "x must have a contiguous last dimension"),
    ],
)
def test_rejects_bad_input(args, err, match):
    # On the device the kernels run on, so the check under test fires, not the device check.
    args = {k: _on_device(v) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    with pytest.raises(err, match=match):
        norms.layer_norm(**args)
    if "bias" not in match:
        rms_args = {k: v for k, v in args.items() if k != "bias"}
        rms_args["eps"] = args["eps"]
        with pytest.raises(err, match=match):
            norms.rms_norm(**rms_args)


@pytest.mark.gpu
@pytest.mark.skipif(not device.GPU_MODE, reason="needs a GPU: Triton's compiled kernels")
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [4096, 8192, 20000, 32768, 65536])
def test_wide_rows_on_gpu(kind, n):
    x, w, b, dy = norms.make_inputs(33, n, torch.bfloat16)
    x = x * 2 + 1
    for path in PATHS:
        y, mean, rstd, bias, eps, bwd_cfg = _run(kind, x, w, b, path)
        grads = [
            g
            for g in norms._backward(dy, x, w, mean, rstd, bias is not None, bwd_cfg)
            if g is not None
        ]
        y_ref, grads_ref = _reference(kind, x, w, bias, dy)
        for out, ref in zip([y, *grads], [y_ref, *grads_ref]):
            rel = ((out.float() - ref).norm() / ref.norm()).item()
            assert rel < 8e-3, (path, rel)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1, 1), (5, 123), (1823, 781)])
def test_public_functions_odd_shapes_fp16(kind, shape):
    # fp16 through autograd at odd shapes: many rows packed per program, a ragged last program.
    x, w, b, dy = norms.make_inputs(*shape, torch.float16)
    leaves = [x.requires_grad_(), w.requires_grad_()] + (
        [b.requires_grad_()] if kind == "layer_norm" else []
    )
    y = getattr(norms, kind)(*leaves)
    grads = torch.autograd.grad(y, leaves, dy)
    y_ref, grads_ref = _reference(kind, x, w, b if kind == "layer_norm" else None, dy)
    torch.testing.assert_close(y, y_ref.half(), rtol=1e-3, atol=2e-3)
    for i, (g, r) in enumerate(zip(grads, grads_ref)):
        if shape[-1] == 1 and i == 0:
            continue  # one column: dx is round-off (see test_forward_and_backward_match_reference)
        scale = 1 if i == 0 else shape[0] ** 0.5
        torch.testing.assert_close(g, r.half(), rtol=2e-3, atol=2e-3 * scale)


def test_no_autograd_without_grad():
    x, w, b, _ = norms.make_inputs(3, 40, torch.float32)
    assert norms.layer_norm(x, w, b).grad_fn is None
    assert norms.rms_norm(x, w.requires_grad_()).grad_fn is not None


@pytest.mark.gpu
@pytest.mark.skipif(not device.GPU_MODE, reason="needs a GPU")
def test_rejects_a_cpu_tensor_on_a_gpu_machine():
    with pytest.raises(ValueError, match="x must be on cuda"):
        norms.rms_norm(torch.zeros(2, 8), torch.ones(8))


@pytest.mark.gpu
@pytest.mark.skipif(not device.GPU_MODE, reason="needs a GPU")
@pytest.mark.parametrize("kind", KINDS)
def test_forward_and_backward_under_cuda_graph_capture(kind):
    # Training step shapes: fused forward and backward (4096 wide) and the wide paths (70001).
    cases = []
    for n_rows, n in ((64, 4096), (3, 70001)):
        x, w, b, dy = norms.make_inputs(n_rows, n, torch.bfloat16)
        bias = b.requires_grad_() if kind == "layer_norm" else None
        leaves = [x.requires_grad_(), w.requires_grad_()] + ([bias] if bias is not None else [])
        cases.append((leaves, dy))

    def step():
        return [torch.autograd.grad(getattr(norms, kind)(*lv), lv, dy) for lv, dy in cases]

    step()  # compile and size the grids outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for leaves, _ in cases:
        leaves[0].data.normal_()
    g.replay()
    torch.cuda.synchronize()
    for (leaves, dy), grads in zip(cases, out):
        b = leaves[2] if kind == "layer_norm" else None
        _, refs = _reference(kind, leaves[0], leaves[1], b, dy)
        for got, ref in zip(grads, refs):
            rel = ((got.float() - ref).norm() / ref.norm()).item()
            assert rel < 8e-3, rel


@pytest.mark.parametrize("rows, cols", [(6, 40), (100, 500)])
@pytest.mark.parametrize("kind", ["rms_norm", "layer_norm"])
def test_backward_plans_each_layout_once(monkeypatch, kind, rows, cols):
    """The fused backward keeps its launches per layout: a repeated call (the next training
    step) skips the launch arithmetic and gives the same gradients; an expanded dy (from
    .sum().backward()) is a layout of its own. 6 x 40: one program writes dw and db itself;
    100 x 500: several programs and the partial sums' launch."""
    calls = []
    monkeypatch.setattr(norms, "_BWD_LAYOUTS", norms.Plans())  # no plan from an earlier test
    work = norms._launch_bwd_rows
    monkeypatch.setattr(norms, "_launch_bwd_rows", lambda *a, **k: calls.append(1) or work(*a, **k))
    x, w, b, dy = norms.make_inputs(rows, cols, torch.float32)
    one = norms.bwd_config(rows, cols)["programs"] == 1
    assert one == (rows == 6)
    x.requires_grad_(), w.requires_grad_(), b.requires_grad_()

    def grads(dy):
        y = norms.rms_norm(x, w) if kind == "rms_norm" else norms.layer_norm(x, w, b)
        leaves = [x, w] if kind == "rms_norm" else [x, w, b]
        return torch.autograd.grad(y, leaves, dy)

    first = grads(dy)
    again = grads(dy)
    assert len(calls) == 1
    for a, b_ in zip(first, again, strict=True):
        assert torch.equal(a, b_)
    # strides (0, 0): the gradient .sum().backward() hands on
    expanded = torch.ones((), device=dy.device).expand(rows, cols)
    want = grads(expanded.contiguous())
    for _ in range(2):
        for a, b_ in zip(grads(expanded), want, strict=True):
            torch.testing.assert_close(a, b_, rtol=0, atol=0)


def _split_probe():
    return load_script("scripts/gpu/norm_bwd_split_probe.py")


@pytest.mark.parametrize("kind,rows,cols", [("layer_norm", 48, 1024), ("rms_norm", 12, 4096)])
def test_split_probe_settings_run_what_they_say_and_keep_the_gradients(kind, rows, cols):
    """scripts/gpu/norm_bwd_split_probe.py times the backward with fewer programs (fewer partial
    rows) and other launches of the partial sums. Each setting must reach the kernels (the partial
    rows the sum is asked for, its meta-parameters) and give the library's gradients (checked
    inside ``case``), or the probe would time something other than its label, or a wrong answer."""
    from kernels import launch, partial_sums

    probe = _split_probe()
    res = probe.case(kind, rows, cols, torch.float32, check_only=True)
    library_rows, library_meta = res["default"]
    assert library_meta == probe.LIBRARY_SUM_LAUNCH((1, library_rows, cols), torch.float32)[2]
    blocks = -(-rows // norms.bwd_config(rows, cols)["BLOCK_M"])
    fewer = {f"rows/program {r}": -(-blocks // r) for r in probe.ROWS_PER_PROGRAM}
    fewer["1 program/SM"] = launch.sm_count(interpreter=2)
    fewer = {name: p for name, p in fewer.items() if 1 < p < library_rows}
    assert fewer, "the test's shape leaves no setting with fewer programs"
    variants = probe.SUM_VARIANTS[1:]
    assert all(o and not o.items() <= library_meta.items() for _, o in variants)  # each differs
    for name, p in fewer.items():
        assert res[name] == (p, library_meta)
        for label, o in variants:
            assert res[f"{name}, {label}"] == (p, dict(library_meta, **o))
    for label, o in variants:
        assert res[label] == (library_rows, dict(library_meta, **o))
    assert len(res) == (1 + len(fewer)) * (1 + len(variants))
    assert partial_sums.sum_launch is probe.LIBRARY_SUM_LAUNCH  # put back after each setting


def test_wide_probe_backward_runs_and_agrees_with_itself():
    """scripts/gpu/norm_wide_probe.py --smoke times the two-step backward against an ``--old``
    copy of the module, after checking that both give the same gradients (here the library against
    itself, in the interpreter on a CPU)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = root / "scripts" / "gpu" / "norm_wide_probe.py"
    args = [sys.executable, str(script), "--smoke", "--only", "bwd", "--old", "kernels.norms"]
    out = subprocess.run(
        args, capture_output=True, text=True, cwd=root, timeout=600, env=_probe_env(root)
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("rms old") == 4 and out.stdout.count("layer old") == 4


def _probe_env(root):
    import os

    env = dict(os.environ, PYTHONPATH=str(root))
    if not device.GPU_MODE:
        env["TRITON_INTERPRET"] = "1"
    return env
