"""The SwiGLU mixture-of-experts layer: route, permute, two grouped GEMMs, unpermute.

``moe_layer(x, router_w, w_gate, w_up, w_down, top_k)`` for ``x: [T, D]`` computes

    logits = x @ router_w^T (+ router_bias)          fp32, [T, E]
    ids, w = route(logits, top_k)                    [T, k] each
    x_sorted, offsets = permute(x, ids)              [T*k, D], rows grouped by expert
    h = silu(x_sorted @ W_gate[e]) * (x_sorted @ W_up[e])      one launch, activation fused
    y_sorted = h @ W_down[e]                         one launch
    out[t] = sum_j w[t, j] * y_sorted[pos[t, j]]     the combine

with ``w_gate, w_up: [E, D, F]`` and ``w_down: [E, F, D]`` (``trans_b=True``: ``[E, F, D]`` and
``[E, D, F]``, the ``nn.Linear`` layout checkpoints store, read in place).

Backward (``torch.autograd.Function``): every input gets its gradient. The combine's backward is one
pass that forms ``dy_sorted = w * dout[token]`` and ``dw = <dout[token], y_sorted>``; the router's
gradient flows from ``dw`` through ``route`` (plain PyTorch) to ``router_w`` and to x. Then
``dh = dy @ W_down^T`` (grouped, transposed weight) with the SwiGLU derivative in its epilogue
(``grouped_swiglu_backward``: dg and du leave the kernel, dh never does), ``dW = X_e^T dY_e`` three
times (``grouped_matmul_dw``), ``dx_sorted = dg @ W_gate^T + du @ W_up^T`` (two grouped launches,
the second adding into the first's output) and the unweighted combine back to tokens. The
forward saves ``x_sorted``, the two pre-activations, ``h`` and ``y_sorted`` (5 x ``[T*k, D or
F]``), trading memory for not recomputing them.

``moe_layer_loop`` is what a user writes without grouped kernels (a loop over experts, as in
Hugging Face's Mixtral block), ``moe_layer_ref`` the same in fp32: the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import _validate
from kernels.moe.grouped import (
    SUPPORTED_DTYPES,
    grouped_matmul,
    grouped_matmul_add_,
    grouped_matmul_dw,
    grouped_swiglu,
    grouped_swiglu_backward,
)
from kernels.moe.routing import Permutation, permute, route, unpermute, unpermute_backward


def expert_ffn(
    x_sorted: torch.Tensor,
    offsets: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    trans_b: bool = False,
) -> torch.Tensor:
    """Every expert's SwiGLU MLP on its rows of ``x_sorted``: two grouped launches, no backward.
    (Expert parallelism runs this on the rows a rank received.)"""
    h = grouped_swiglu(x_sorted, w_gate, w_up, offsets, trans_b)
    return grouped_matmul(h, w_down, offsets, trans_b)


class _MoEExperts(torch.autograd.Function):
    """permute -> grouped SwiGLU -> grouped down projection -> weighted combine, and back."""

    @staticmethod
    def forward(ctx, x, weights, ids, w_gate, w_up, w_down, trans_b, train):
        # ``train``: grad mode was on and an input needs a gradient (decided by the caller: inside
        # forward grad mode is always off): only then keep the pre-activations for the backward.
        n_experts = w_gate.shape[0]
        x_sorted, offsets, handle = permute(x, ids, n_experts)
        if train:
            h, g, u = grouped_swiglu(x_sorted, w_gate, w_up, offsets, trans_b, save_preact=True)
        else:
            h = grouped_swiglu(x_sorted, w_gate, w_up, offsets, trans_b)
        y_sorted = grouped_matmul(h, w_down, offsets, trans_b)
        out = unpermute(y_sorted, handle, weights)
        if train:
            ctx.save_for_backward(x_sorted, g, u, h, y_sorted, weights, w_gate, w_up, w_down)
            ctx.handle, ctx.trans_b = handle, trans_b
        return out

    @staticmethod
    def backward(ctx, grad_out):
        xs, g, u, h, ys, weights, w_gate, w_up, w_down = ctx.saved_tensors
        handle: Permutation = ctx.handle
        tb, offs = ctx.trans_b, handle.offsets
        need_x, need_w, _, need_g, need_u, need_d, _, _ = ctx.needs_input_grad
        dys, dweights = unpermute_backward(grad_out.contiguous(), ys, handle, weights)
        dx = dwg = dwu = dwd = None
        if need_d:
            dwd = grouped_matmul_dw(h, dys, offs, tb)
        if need_x or need_g or need_u:
            dg, du = grouped_swiglu_backward(dys, w_down, g, u, offs, tb)
            if need_g:
                dwg = grouped_matmul_dw(xs, dg, offs, tb)
            if need_u:
                dwu = grouped_matmul_dw(xs, du, offs, tb)
            if need_x:
                dxs = grouped_matmul(dg, w_gate, offs, not tb)
                grouped_matmul_add_(dxs, du, w_up, offs, not tb)
                dx = unpermute(dxs, handle)  # each token: the sum of its k copies' gradients
        return dx, dweights if need_w else None, None, dwg, dwu, dwd, None, None


def _check_layer(x, router_w, w_gate, w_up, w_down, trans_b, router_bias):
    _validate.tensor("x", x, dtypes=SUPPORTED_DTYPES, ndim=2)
    T, D = x.shape
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(w).__name__}")
        if w.ndim != 3:
            raise ValueError(f"{name} must be 3-D [n_experts, ., .], got shape {tuple(w.shape)}")
        _validate.same("x", x, name, w, shape=False)
    _validate.same("w_gate", w_gate, "w_up", w_up)
    E = w_gate.shape[0]
    F_ = w_gate.shape[1] if trans_b else w_gate.shape[2]
    want_gate = (E, F_, D) if trans_b else (E, D, F_)
    want_down = (E, D, F_) if trans_b else (E, F_, D)
    if tuple(w_gate.shape) != want_gate:
        raise ValueError(
            f"w_gate must be [n_experts, {'F, D' if trans_b else 'D, F'}] with D = x.shape[1] = "
            f"{D}, got {tuple(w_gate.shape)}"
        )
    if tuple(w_down.shape) != want_down:
        raise ValueError(
            f"w_down must be {list(want_down)} to match w_gate, got {tuple(w_down.shape)}"
        )
    if not isinstance(router_w, torch.Tensor):
        raise TypeError(f"router_w must be a torch.Tensor, got {type(router_w).__name__}")
    if tuple(router_w.shape) != (E, D) or router_w.device != x.device:
        raise ValueError(
            f"router_w must be [n_experts, D] = [{E}, {D}] on {x.device}, got "
            f"{tuple(router_w.shape)} on {router_w.device}"
        )
    if router_bias is not None and (
        not isinstance(router_bias, torch.Tensor) or tuple(router_bias.shape) != (E,)
    ):
        raise ValueError(f"router_bias must be a [n_experts] = [{E}] tensor or None")


def router_logits(x, router_w, router_bias=None) -> torch.Tensor:
    """``x @ router_w^T (+ bias)`` in fp32: routing decisions should not hinge on bf16 rounding."""
    b = None if router_bias is None else router_bias.float()
    return F.linear(x.float(), router_w.float(), b)


def moe_layer(
    x: torch.Tensor,
    router_w: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    norm_topk: bool = True,
    router_bias: torch.Tensor | None = None,
    trans_b: bool = False,
) -> torch.Tensor:
    """The SwiGLU MoE forward for ``x: [T, D]`` (fp16, bf16 or fp32), differentiable in every
    tensor argument. ``router_w: [E, D]``; ``w_gate, w_up: [E, D, F]``, ``w_down: [E, F, D]`` (or
    with ``trans_b`` ``[E, F, D]`` and ``[E, D, F]``), all in x's dtype (the router may be fp32).
    ``scoring`` and ``norm_topk`` as in ``route``. Returns ``[T, D]`` in x's dtype."""
    _check_layer(x, router_w, w_gate, w_up, w_down, trans_b, router_bias)
    ids, weights = route(router_logits(x, router_w, router_bias), top_k, scoring, norm_topk)
    train = torch.is_grad_enabled() and any(
        t.requires_grad for t in (x, weights, w_gate, w_up, w_down)
    )
    return _MoEExperts.apply(x, weights, ids, w_gate, w_up, w_down, trans_b, train)


def moe_layer_loop(
    x, router_w, w_gate, w_up, w_down, top_k, *, scoring="softmax", norm_topk=True,
    router_bias=None, trans_b=False,
) -> torch.Tensor:  # fmt: skip
    """The eager baseline: for each expert, gather its tokens, run its MLP with ``torch.matmul``,
    scatter-add the weighted result (a host sync per expert to find its tokens). x's dtype."""
    ids, weights = route(router_logits(x, router_w, router_bias), top_k, scoring, norm_topk)
    # unbind, not w[e] in the loop: the backward of w[e] writes a zero tensor of w's full size and
    # adds it into the gradient, once per expert (256 passes over 7.5 GB per weight at DeepSeek-V3's
    # shape); unbind's backward stacks the experts' gradients once, as separate parameters would.
    wg, wu, wd = ((w.transpose(1, 2) if trans_b else w).unbind(0) for w in (w_gate, w_up, w_down))
    out = torch.zeros_like(x)
    for e in range(len(wg)):
        tok, j = torch.where(ids == e)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        y = (F.silu(xe @ wg[e]) * (xe @ wu[e])) @ wd[e]
        out = out.index_add(0, tok, (y * weights[tok, j, None]).to(x.dtype))
    return out


def moe_layer_ref(x, router_w, w_gate, w_up, w_down, top_k, **kwargs) -> torch.Tensor:
    """fp32 reference: ``moe_layer_loop`` on fp32 copies of every input (differentiable: the
    gradients flow back to the original tensors)."""
    bias = kwargs.pop("router_bias", None)
    return moe_layer_loop(
        x.float(), router_w.float(), w_gate.float(), w_up.float(), w_down.float(), top_k,
        router_bias=None if bias is None else bias.float(), **kwargs,
    )  # fmt: skip
