"""Sequence parallelism (Megatron-LM style) for the tensor-parallel MLP and attention blocks.

The MLP block is pre-norm with a residual, on activations laid out sequence-first, ``x: [s, b, h]``::

    y = x + dropout(gelu(LayerNorm(x) @ w1 + b1) @ w2 + b2)

**Tensor parallelism alone** (``tp_block``): ``w1`` is split by columns and ``w2`` by rows
(``kernels.distributed.shard_mlp``); each rank holds all of ``x``, runs the LayerNorm, the bias,
the dropout and the residual add on all ``s`` tokens (the same work on every rank, and the same
activations kept for backward on every rank), and one all-reduce completes ``h_r @ w2_r``.

**With sequence parallelism** (``sp_block``) the work outside the two matmuls is split along the
sequence instead of repeated. Each rank holds ``s/t`` tokens of ``x``; it normalises only those,
*all-gathers* the normalised tokens just before the column-parallel matmul (which needs all of
them), and *reduce-scatters* the row-parallel matmul's partial sums, so that each rank receives the
sum for its own ``s/t`` tokens only; the bias, dropout and residual run on those. A ring all-reduce
is a reduce-scatter followed by an all-gather, so the bytes moved are the same as TP's; what
changes is that LayerNorm, dropout and the residual (their compute, and the ``10 sbh`` of
activations they keep for backward in Korthikanti et al.'s count {cite}`korthikanti2022activation`)
are divided by ``t``. In the backward pass the two collectives swap: the all-gather's gradient is a
reduce-scatter and the reduce-scatter's an all-gather. One all-gather is added there: the
column-parallel matmul keeps only its ``s/t`` input tokens and gathers them again to form its
weight gradient (Megatron-LM overlaps it with the input-gradient matmul; here it runs before).

Parameters that every rank holds whole but applies to its own tokens only (the LayerNorm weight and
bias, ``b2``) receive a *partial* gradient on each rank under SP: ``reduce_replicated_grads``
all-reduces them over the tensor-parallel group, as Megatron-LM does after the backward pass.

``block_ref`` is the single-device block both must equal. The attention block gets the same
treatment (``tp_attention_block``, ``sp_attention_block``, ``attention_block_ref``): heads split
over the ranks (``shard_attention``: the QKV projection by columns, the output projection by rows),
each rank's heads attending over the whole gathered sequence.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels import collectives as C
from kernels import distributed as D


def _gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    C.all_gather(out, x, group=group)
    return out


def _reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    C.reduce_scatter(out, x, group=group)
    return out


class _GatherFromSP(torch.autograd.Function):
    """All-gather along the sequence forward; reduce-scatter backward (each rank's copy of the
    gathered tensor fed its own branch of the column-parallel matmul, so the gradients add)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    """Reduce-scatter along the sequence forward (sum the partial products, keep my tokens);
    all-gather backward (every rank's partial product needs the gradient of every token)."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _reduce_scatter_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.group), None


class _GatherLinear(torch.autograd.Function):
    """The column-parallel linear of SP: ``all_gather(h_shard) @ w + b``, keeping only ``h_shard``
    for backward (Megatron-LM's choice): the backward all-gathers it again to form ``dW``, so the
    gathered ``[s, b, h]`` tensor is never held between the forward and the backward passes.
    Backward: ``dh_shard = reduce_scatter(dy @ wᵀ)`` (each rank's column branch contributes)."""

    @staticmethod
    def forward(ctx, h_shard, w, b, group):
        ctx.group = group
        ctx.save_for_backward(h_shard, w)
        return _gather_seq(h_shard, group) @ w + b

    @staticmethod
    def backward(ctx, dy):
        h_shard, w = ctx.saved_tensors
        h_full = _gather_seq(h_shard, ctx.group)  # again: traded for sbh of activation memory
        dh = _reduce_scatter_seq(dy @ w.transpose(0, 1), ctx.group)
        flat_h, flat_dy = h_full.reshape(-1, h_full.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dw = flat_h.transpose(0, 1) @ flat_dy
        return dh, dw, flat_dy.sum(0), None


def gather_seq(x: torch.Tensor, group=None) -> torch.Tensor:
    """Differentiable all-gather along dim 0 (the sequence); backward: reduce-scatter."""
    return _GatherFromSP.apply(x, group)


def reduce_scatter_seq(y: torch.Tensor, group=None) -> torch.Tensor:
    """Differentiable reduce-scatter along dim 0: the sum over ranks, this rank's tokens;
    backward: all-gather."""
    return _ReduceScatterToSP.apply(y, group)


def column_parallel_sp(h_shard, w_shard, b_shard, group=None) -> torch.Tensor:
    """``all_gather(h_shard) @ w_shard + b_shard``, saving only ``h_shard`` (see ``_GatherLinear``)."""
    return _GatherLinear.apply(h_shard, w_shard, b_shard, group)


def _check(x, ln_w, p_drop) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim < 2 or x.shape[-1] != ln_w.shape[0]:
        raise ValueError(
            f"x must be [s, ..., h] with h = {ln_w.shape[0]} (the norm's width), got {tuple(x.shape)}"
        )
    if isinstance(p_drop, bool) or not isinstance(p_drop, (int, float)) or not 0 <= p_drop < 1:
        raise ValueError(f"p_drop must be in [0, 1), got {p_drop!r}")


def block_ref(x, ln_w, ln_b, w1, b1, w2, b2, p_drop: float = 0.0, eps: float = 1e-5):
    """The single-device block: ``x + dropout(gelu(LayerNorm(x) @ w1 + b1) @ w2 + b2)``."""
    _check(x, ln_w, p_drop)
    h = F.layer_norm(x, (x.shape[-1],), ln_w, ln_b, eps)
    y = D.mlp_ref(h, w1, b1, w2, b2)
    return x + F.dropout(y, p_drop, training=p_drop > 0)


def tp_block(x, ln_w, ln_b, w1_shard, b1_shard, w2_shard, b2, group=None, p_drop=0.0, eps=1e-5):
    """Tensor parallelism alone: ``x: [s, b, h]`` whole on every rank; the norm, dropout and
    residual repeated on every rank; one all-reduce forward, one backward."""
    _check(x, ln_w, p_drop)
    h = F.layer_norm(x, (x.shape[-1],), ln_w, ln_b, eps)
    y = D.tp_mlp(h, w1_shard, b1_shard, w2_shard, b2, group)
    return x + F.dropout(y, p_drop, training=p_drop > 0)


def sp_block(
    x_shard, ln_w, ln_b, w1_shard, b1_shard, w2_shard, b2, group=None, p_drop=0.0, eps=1e-5
):
    """Tensor + sequence parallelism: ``x_shard: [s/t, b, h]`` is this rank's slice of the
    sequence (rank ``r`` holds tokens ``r·s/t … (r+1)·s/t - 1``); returns the block's output for
    those tokens. Norm, dropout and residual on ``s/t`` tokens; all-gather before the
    column-parallel matmul (which keeps only the shard for backward and gathers it again there),
    reduce-scatter after the row-parallel one. Afterwards call
    ``reduce_replicated_grads([ln_w, ln_b, b2], group)``."""
    _check(x_shard, ln_w, p_drop)
    h = F.layer_norm(x_shard, (x_shard.shape[-1],), ln_w, ln_b, eps)
    # The column-parallel matmul needs every token: all-gather inside it, keep only my slice.
    a = F.gelu(column_parallel_sp(h, w1_shard, b1_shard, group))
    y = reduce_scatter_seq(a @ w2_shard, group) + b2  # [s/t, b, h]: my tokens, summed over ranks
    return x_shard + F.dropout(y, p_drop, training=p_drop > 0)


def shard_sequence(x: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's contiguous slice of ``x`` along dim 0 (the sequence); a view."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[0] % world:
        raise ValueError(
            f"x.shape[0] (the sequence) = {x.shape[0]} must divide by the group size {world}"
        )
    n = x.shape[0] // world
    return x[rank * n : (rank + 1) * n]


def reduce_replicated_grads(params: Iterable[torch.Tensor], group=None) -> None:
    """All-reduce the gradients of parameters every rank holds whole but applied to its own
    tokens only (under SP: the norm's weight and bias, the second bias)."""
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)


# ----------------------------------------------------------------------------- the attention block


def attention_ref(h: torch.Tensor, wqkv, bqkv, wo, bo, head_dim: int) -> torch.Tensor:
    """Causal multi-head attention on ``h: [s, b, width]``: ``qkv = h @ wqkv + bqkv`` with
    ``wqkv: [width, 3·H·head_dim]`` laid out ``[q | k | v]``, heads contiguous in each; output
    ``o @ wo + bo`` with ``wo: [H·head_dim, width]``. Works on any number of heads, so a rank's
    head shard runs it as is (without ``bo``: pass ``None``)."""
    o = _causal_heads(h @ wqkv + bqkv, head_dim) @ wo
    return o if bo is None else o + bo


def _causal_heads(qkv: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Causal attention of each head in ``qkv: [s, b, 3·heads·head_dim]`` (``[q | k | v]``), the
    heads' outputs side by side: ``[s, b, heads·head_dim]``."""
    s, b, _ = qkv.shape
    q, k, v = (t.reshape(s, b, -1, head_dim).permute(1, 2, 0, 3) for t in qkv.chunk(3, dim=-1))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, d]
    return o.permute(2, 0, 1, 3).reshape(s, b, -1)


def shard_attention(wqkv, bqkv, wo, bo, n_heads: int, rank: int, world: int):
    """This rank's heads (``chunk_bounds(n_heads, world)[rank]``): their q, k and v columns of
    ``wqkv`` and ``bqkv``, their rows of ``wo``; ``bo`` whole."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    if n_heads < world:
        raise ValueError(f"n_heads ({n_heads}) must be at least the group size ({world})")
    width3 = wqkv.shape[1]
    if width3 % (3 * n_heads) or wo.shape[0] != width3 // 3:
        raise ValueError(
            f"wqkv {tuple(wqkv.shape)} and wo {tuple(wo.shape)} disagree with n_heads={n_heads}"
        )
    d = width3 // (3 * n_heads)
    lo, hi = C.chunk_bounds(n_heads, world)[rank]
    cols = torch.cat(
        [torch.arange(p * n_heads * d + lo * d, p * n_heads * d + hi * d) for p in range(3)]
    )
    cols = cols.to(wqkv.device)
    return wqkv[:, cols].contiguous(), bqkv[cols].contiguous(), wo[lo * d : hi * d].contiguous(), bo


def attention_block_ref(x, ln_w, ln_b, wqkv, bqkv, wo, bo, head_dim: int, eps: float = 1e-5):
    """The single-device block: ``x + attention(LayerNorm(x))``."""
    _check(x, ln_w, 0.0)
    return x + attention_ref(
        F.layer_norm(x, (x.shape[-1],), ln_w, ln_b, eps), wqkv, bqkv, wo, bo, head_dim
    )


def tp_attention_block(
    x, ln_w, ln_b, wqkv_shard, bqkv_shard, wo_shard, bo, head_dim: int, group=None, eps=1e-5
):
    """Tensor parallelism alone: each rank computes its heads on all of ``x``; one all-reduce
    completes the output projection (and one the input's gradient)."""
    _check(x, ln_w, 0.0)
    h = D._CopyToTP.apply(F.layer_norm(x, (x.shape[-1],), ln_w, ln_b, eps), group)
    o = attention_ref(h, wqkv_shard, bqkv_shard, wo_shard, None, head_dim)
    return x + D._ReduceFromTP.apply(o, group) + bo


def sp_attention_block(
    x_shard, ln_w, ln_b, wqkv_shard, bqkv_shard, wo_shard, bo, head_dim: int, group=None, eps=1e-5
):
    """Tensor + sequence parallelism: norm on this rank's ``s/t`` tokens, all-gathered into the
    QKV projection (each rank's heads attend over the whole sequence), the output projection's
    partial sums reduce-scattered back to ``s/t`` tokens. Afterwards
    ``reduce_replicated_grads([ln_w, ln_b, bo], group)``."""
    _check(x_shard, ln_w, 0.0)
    h = F.layer_norm(x_shard, (x_shard.shape[-1],), ln_w, ln_b, eps)
    qkv = column_parallel_sp(h, wqkv_shard, bqkv_shard, group)  # [s, b, 3·heads_r·d]
    o = _causal_heads(qkv, head_dim)
    return x_shard + reduce_scatter_seq(o @ wo_shard, group) + bo


def activation_elements(s: int, b: int, h: int, t: int, sp: bool) -> float:
    """Elements of activations the block keeps for backward per rank (no dropout), counted from the
    code above: the norm's input ``sbh`` and its mean and rstd ``2 sb``; the column-parallel
    matmul's input ``sbh`` (with SP its shard only); the GELU's input and output ``2 · 4sbh/t``
    (``d_ff = 4h``); the bias and residual adds keep nothing. TP alone: ``sb(2h + 2) + 8sbh/t``;
    with SP everything is divided by ``t``: ``sb(10h + 2)/t``."""
    rest = s * b * (2 * h + 2)
    return rest / (t if sp else 1) + 8 * s * b * h / t
