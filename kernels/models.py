"""Small transformer building blocks, built in code with random weights (nothing to download).

The acts profile, compile, fuse and quantize *these* modules, so they stay plain PyTorch: every size
is an argument, and ``dtype`` / ``device`` go straight to the parameters.

- ``MLPBlock``: the transformer feed-forward sub-layer, pre-norm with its residual,
  ``x + W2 · gelu(W1 · LayerNorm(x) + b1) + b2`` on ``x: [..., d_model]``.
  With ``decomposed=True`` LayerNorm and GELU are written as elementary tensor ops, the way a
  hand-written model often ends up: the same function, many more (tiny) kernel launches in eager mode,
  and exactly what a compiler can fuse back together.
- ``MLPStack``: ``n_layers`` MLP blocks in a row (the small-batch, launch-bound workload).
- ``CausalSelfAttention`` and ``DecoderBlock``: a pre-norm decoder layer on ``x: [batch, seq, d_model]``
  using ``scaled_dot_product_attention``.

Napkin helpers (``mlp_flops``, ``mlp_weight_bytes``) count the work of an MLP block for rooflines.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def _check_input(x, d_model: int, *, ndim: int | None = None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None and x.ndim != ndim:
        raise ValueError(f"x must be {ndim}-D [batch, seq, d_model], got shape {tuple(x.shape)}")
    if x.ndim == 0 or x.shape[-1] != d_model:
        raise ValueError(
            f"x must have last dimension d_model={d_model}, got shape {tuple(x.shape)}"
        )


def layer_norm_decomposed(x: torch.Tensor, weight, bias, eps: float) -> torch.Tensor:
    """LayerNorm from elementary ops (fp32 statistics, like ``F.layer_norm``): about a dozen kernels."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True)
    centred = xf - mean
    var = (centred * centred).mean(-1, keepdim=True)
    y = centred * torch.rsqrt(var + eps)
    return (y * weight.float() + bias.float()).to(x.dtype)


def gelu_decomposed(h: torch.Tensor) -> torch.Tensor:
    """The exact (erf) GELU from elementary ops: ``0.5 · h · (1 + erf(h / √2))``, five kernels."""
    return 0.5 * h * (1.0 + torch.erf(h * (1.0 / math.sqrt(2.0))))


class MLPBlock(nn.Module):
    """Pre-norm transformer MLP with residual: ``x + fc2(gelu(fc1(LayerNorm(x))))``.

    ``d_ff`` defaults to ``4 * d_model``. ``decomposed=True`` computes the same function from
    elementary ops (see the module docstring).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int | None = None,
        *,
        decomposed: bool = False,
        eps: float = 1e-5,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.d_model = _positive_int("d_model", d_model)
        self.d_ff = _positive_int("d_ff", 4 * d_model if d_ff is None else d_ff)
        self.decomposed = decomposed
        self.eps = eps
        kw = {"dtype": dtype, "device": device}
        self.norm = nn.LayerNorm(d_model, eps=eps, **kw)
        self.fc1 = nn.Linear(d_model, self.d_ff, **kw)
        self.fc2 = nn.Linear(self.d_ff, d_model, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.d_model)
        if self.decomposed:
            h = layer_norm_decomposed(x, self.norm.weight, self.norm.bias, self.eps)
            h = gelu_decomposed(self.fc1(h))
        else:
            h = F.gelu(self.fc1(self.norm(x)))
        return x + self.fc2(h)


class MLPStack(nn.Module):
    """``n_layers`` ``MLPBlock``s applied one after the other."""

    def __init__(
        self,
        n_layers: int,
        d_model: int,
        d_ff: int | None = None,
        *,
        decomposed: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        _positive_int("n_layers", n_layers)
        self.d_model = d_model
        self.layers = nn.ModuleList(
            MLPBlock(d_model, d_ff, decomposed=decomposed, dtype=dtype, device=device)
            for _ in range(n_layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on ``x: [batch, seq, d_model]`` (fused QKV projection)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        _positive_int("d_model", d_model)
        _positive_int("n_heads", n_heads)
        if d_model % n_heads:
            raise ValueError(f"n_heads must divide d_model={d_model}, got n_heads={n_heads}")
        self.d_model, self.n_heads = d_model, n_heads
        kw = {"dtype": dtype, "device": device}
        self.qkv = nn.Linear(d_model, 3 * d_model, **kw)
        self.out = nn.Linear(d_model, d_model, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.d_model, ndim=3)
        b, s, d = x.shape
        # [b, s, 3, heads, head_dim] -> three [b, heads, s, head_dim] tensors
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class DecoderBlock(nn.Module):
    """Pre-norm decoder layer: ``x + attn(LayerNorm(x))``, then an ``MLPBlock`` (with its residual)."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        d_ff: int | None = None,
        *,
        decomposed: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        self.d_model = d_model
        self.norm = nn.LayerNorm(d_model, dtype=dtype, device=device)
        self.attn = CausalSelfAttention(d_model, n_heads, dtype=dtype, device=device)
        self.mlp = MLPBlock(d_model, d_ff, decomposed=decomposed, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_input(x, self.d_model, ndim=3)
        return self.mlp(x + self.attn(self.norm(x)))


# ----------------------------------------------------------------------------- napkin maths


def mlp_flops(n_tokens: int, d_model: int, d_ff: int | None = None) -> int:
    """FLOPs of one MLP block's two matmuls (2 per multiply-add); the norm and GELU are noise."""
    d_ff = 4 * d_model if d_ff is None else d_ff
    return 2 * 2 * n_tokens * d_model * d_ff


def mlp_weight_bytes(d_model: int, d_ff: int | None = None, dtype=torch.bfloat16) -> int:
    """Bytes of one MLP block's two weight matrices: what a small-batch step must read from HBM."""
    d_ff = 4 * d_model if d_ff is None else d_ff
    return 2 * d_model * d_ff * torch.empty((), dtype=dtype).element_size()
