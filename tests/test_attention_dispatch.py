"""Which kernels ``flash_attention.attention`` runs: the Triton ones, or on Hopper the CUDA kernels of
page 4.12 where they measured faster (``impl="auto"``).

On a CPU: the rule (``fa_ws.takes``) on stand-in tensors, the options that keep Triton, and the
plumbing of a CUDA forward and backward through the autograd node, with the CUDA calls replaced by
the Triton kernels under the CUDA functions' own signatures. On a Hopper GPU: "auto" gives the CUDA
kernels' bits where the rule says so and Triton's elsewhere, the gradients match fp32 autograd, and
the path works under CUDA graph capture."""

import inspect
from types import SimpleNamespace

import pytest
import torch
from conftest import eager_and_graphed

from kernels import device
from kernels import flash_attention as fa
from kernels.cuda import fa_ws, fa_ws_bwd

BF16 = torch.bfloat16
HOPPER = device.GPU_MODE and fa_ws.unavailable_reason() is None


def _stand_in(n, d=128, dtype=BF16, is_cuda=True, n_k=None):
    """What ``takes`` reads of a tensor, without a GPU."""
    q = SimpleNamespace(dtype=dtype, shape=(2, 4, n, d), is_cuda=is_cuda)
    k = SimpleNamespace(dtype=dtype, shape=(2, 4, n if n_k is None else n_k, d), is_cuda=is_cuda)
    return q, k, k


@pytest.fixture
def on_hopper(monkeypatch):
    """``takes`` as on a Hopper GPU with nvcc."""
    monkeypatch.setattr(fa_ws, "unavailable_reason", lambda: None)
    monkeypatch.delenv(fa_ws.ENV, raising=False)


def test_takes_bf16_self_attention_with_head_dim_128_from_the_measured_length(on_hopper):
    frm = fa_ws.FASTER_FROM
    assert fa_ws.takes(*_stand_in(frm), frm)
    assert fa_ws.takes(*_stand_in(8 * frm), frm)
    assert not fa_ws.takes(*_stand_in(frm - 1), frm)
    assert not fa_ws.takes(*_stand_in(frm, d=64), frm)
    assert not fa_ws.takes(*_stand_in(frm, dtype=torch.float16), frm)
    assert not fa_ws.takes(*_stand_in(frm, n_k=2 * frm), frm)  # cross-attention
    assert not fa_ws.takes(*_stand_in(frm, is_cuda=False), frm)


def test_takes_nothing_when_turned_off_or_not_on_hopper(on_hopper, monkeypatch):
    args = (*_stand_in(4096), fa_ws.FASTER_FROM)
    monkeypatch.setenv(fa_ws.ENV, "0")
    assert not fa_ws.takes(*args)
    monkeypatch.delenv(fa_ws.ENV)
    monkeypatch.setattr(fa_ws, "unavailable_reason", lambda: "kernels.cuda.hgemm needs Hopper")
    assert not fa_ws.takes(*args)


def test_the_backward_is_taken_from_a_longer_length_than_the_forward():
    # At 1,024 tokens the CUDA backward measured 0.87-0.99x the Triton one: the forward alone goes.
    assert fa_ws.FASTER_FROM <= fa_ws_bwd.FASTER_FROM


def test_triton_options_keep_triton(on_hopper, monkeypatch):
    monkeypatch.setattr(fa_ws, "forward_built", lambda: True)
    monkeypatch.setattr(fa_ws_bwd, "built", lambda: True)
    q, k, v = _stand_in(4096)
    assert fa._cuda_forward(q, k, v, "auto", None)
    assert fa._cuda_backward(q, k, v, "auto", "two_kernels")
    assert not fa._cuda_forward(q, k, v, "auto", True)  # tma is a Triton option
    assert not fa._cuda_forward(q, k, v, "triton", None)
    assert not fa._cuda_backward(q, k, v, "auto", "atomic_dq")
    assert not fa._cuda_backward(q, k, v, "triton", "two_kernels")
    assert fa._cuda_forward(*_stand_in(100), "cuda", None)  # forced: fa_ws says what it can't take


def test_a_failed_build_keeps_triton(on_hopper, monkeypatch):
    monkeypatch.setattr(fa_ws, "forward_built", lambda: False)
    assert not fa._cuda_forward(*_stand_in(4096), "auto", None)


def test_a_failed_build_warns_and_says_no():
    def broken():
        raise RuntimeError("nvcc exploded")

    with pytest.warns(UserWarning, match="build failed, the Triton kernels run instead"):
        assert not fa_ws.built(broken)


def test_bad_impl_is_named():
    q = torch.zeros(1, 1, 4, 64, dtype=torch.float16, device=device.DEVICE)
    with pytest.raises(ValueError, match="impl must be one of"):
        fa.attention(q, q, q, impl="fastest")


def test_host_tensors_never_take_the_cuda_path(monkeypatch):
    def no_build():
        raise AssertionError("built an extension for host tensors")

    monkeypatch.setattr(fa_ws, "forward_built", no_build)
    q = torch.zeros(1, 1, 4096, 128, dtype=BF16)
    assert not fa._cuda_forward(q, q, q, "auto", None)


def _as(real, stand_in):
    """``stand_in`` called with the arguments ``real`` would be given (checked against its
    signature), recording each call."""
    sig = inspect.signature(real)
    calls = []

    def call(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append(bound.arguments)
        return stand_in(**bound.arguments)

    return call, calls


@pytest.mark.skipif(device.GPU_MODE, reason="the stand-in path is for machines without Hopper")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cuda_bwd", [False, True])
def test_cuda_forward_and_backward_plumbing(monkeypatch, causal, cuda_bwd):
    """The autograd node calls the CUDA functions with the arguments they take, keeps their output
    and log-sum-exp, and gives either backward what it needs: checked with the Triton kernels
    standing in for the CUDA ones (same outputs, same log2 units)."""
    fwd, fwd_calls = _as(
        fa_ws.attention,
        lambda q, k, v, causal, sm_scale, schedule: fa._forward(q, k, v, causal, sm_scale, False),
    )
    bwd, bwd_calls = _as(
        fa_ws_bwd.backward,
        lambda q, k, v, o, lse, do, causal, sm_scale, stages, group_heads, variant: fa._backward(
            q, k, v, o, lse, do, causal, sm_scale
        ),
    )
    monkeypatch.setattr(fa_ws, "attention", fwd)
    monkeypatch.setattr(fa_ws_bwd, "backward", bwd)
    monkeypatch.setattr(fa, "_cuda_forward", lambda *a: True)
    monkeypatch.setattr(fa, "_cuda_backward", lambda *a: cuda_bwd)
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, 2, 37, 64, generator=g, dtype=torch.float16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fa.attention(*leaves, causal, sm_scale=0.2)
    grads = torch.autograd.grad(out, leaves, do)
    assert len(fwd_calls) == 1 and fwd_calls[0]["causal"] is causal
    assert fwd_calls[0]["sm_scale"] == 0.2
    assert len(bwd_calls) == int(cuda_bwd)
    ref_leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref = fa.attention_ref(*ref_leaves, causal, sm_scale=0.2)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.float())
    assert (out.float() - ref).norm() / ref.norm() < 5e-3
    for a, b in zip(grads, ref_grads):
        assert (a.float() - b).norm() / b.norm() < 1e-2


# ----------------------------------------------------------------------------- on a Hopper GPU


def _inputs(n, seed=0, b=2, h=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, n, 128, generator=g).to(device.DEVICE, BF16) for _ in range(4)]


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a) and nvcc")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "n", [fa_ws.FASTER_FROM - 24, fa_ws.FASTER_FROM, fa_ws_bwd.FASTER_FROM + 9]
)
def test_auto_takes_the_kernels_the_rule_names_and_matches_fp32(n, causal):
    q, k, v, do = _inputs(n, seed=n)
    cuda_fwd = n >= fa_ws.FASTER_FROM
    cuda_bwd = n >= fa_ws_bwd.FASTER_FROM
    with torch.no_grad():
        o_auto = fa.attention(q, k, v, causal)
        o_cuda = fa.attention(q, k, v, causal, impl="cuda")
        o_triton = fa.attention(q, k, v, causal, impl="triton")
    assert torch.equal(o_auto, o_cuda if cuda_fwd else o_triton)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(fa.attention(*leaves, causal), leaves, do)
    o, lse = (fa_ws.attention if cuda_fwd else fa._forward)(q, k, v, causal, 128**-0.5)
    expect = (
        fa_ws_bwd.backward(q, k, v, o, lse, do, causal)
        if cuda_bwd
        else fa._backward(q, k, v, o, lse, do, causal, 128**-0.5)
    )
    for name, a, b in zip(("dq", "dk", "dv"), grads, expect):
        if cuda_bwd and name == "dq":
            # The CUDA backward adds dQ with TMA reductions, in an order that changes run to run:
            # a few bf16 roundings apart, not equal.
            assert (a.float() - b.float()).norm() / b.float().norm() < 1e-2, name
        else:
            assert torch.equal(a, b), name

    ref_leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref = fa.attention_ref(*ref_leaves, causal)
    ref_grads = torch.autograd.grad(ref, ref_leaves, do.float())
    assert (o_auto.float() - ref).norm() / ref.norm() < 3e-2
    for name, a, b in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert (a.float() - b).norm() / b.norm() < 3e-2, name


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a) and nvcc")
def test_turned_off_it_runs_triton(monkeypatch):
    q, k, v, _ = _inputs(fa_ws.FASTER_FROM)
    monkeypatch.setenv(fa_ws.ENV, "0")
    with torch.no_grad():
        assert torch.equal(fa.attention(q, k, v), fa.attention(q, k, v, impl="triton"))


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a) and nvcc")
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_path_under_graph_capture(causal):
    q, k, v, _ = _inputs(fa_ws.FASTER_FROM, b=1, h=2)
    with torch.no_grad():
        eager, graphed = eager_and_graphed(lambda: fa.attention(q, k, v, causal))
    assert torch.equal(eager, graphed)
