"""PyTorch's ``scaled_dot_product_attention`` forced onto one backend: the baseline every attention
kernel of the course is measured against, and the one place that knows the backends' names.

``sdpa_backend(name)`` is a context manager ('flash' = FlashAttention-2, 'cudnn', 'efficient' =
memory-efficient / xFormers, 'math'); ``sdpa(q, k, v, causal, backend)`` calls SDPA under it;
``available(backend, ...)`` says whether a backend runs a given kind of call on this machine.
"""

from __future__ import annotations

import functools
import warnings

import torch

from kernels import device

SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")
_MEMBERS = {
    "flash": "FLASH_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
}


def sdpa_backend(backend: str):
    """A context manager that forces ``scaled_dot_product_attention`` onto one backend:
    'flash' (FlashAttention-2), 'cudnn', 'efficient' (memory-efficient, xFormers) or 'math'."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend not in _MEMBERS:
        raise ValueError(f"backend must be one of {SDPA_BACKENDS}, got {backend!r}")
    member = getattr(SDPBackend, _MEMBERS[backend], None)
    if member is None:
        raise RuntimeError(f"this torch ({torch.__version__}) has no SDPA backend {backend!r}")
    return sdpa_kernel(member)


def sdpa(q, k, v, causal: bool = False, backend: str | None = "flash", **kwargs) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` forced onto ``backend`` (None:
    PyTorch's own choice); ``kwargs`` go to SDPA (``enable_gqa=True`` for grouped queries)."""
    f = torch.nn.functional.scaled_dot_product_attention
    if backend is None:
        return f(q, k, v, is_causal=causal, **kwargs)
    with sdpa_backend(backend):
        return f(q, k, v, is_causal=causal, **kwargs)


@functools.cache
def available(
    backend: str,
    dtype: torch.dtype = torch.bfloat16,
    head_dim: int = 128,
    *,
    n_heads: int = 2,
    n_kv_heads: int | None = None,
    n_q: int = 128,
) -> bool:
    """Whether ``backend`` runs this kind of call here: ``n_q`` queries of ``n_heads`` heads
    against 256 keys (``n_q == 1``, a decode step) or ``n_q`` keys (self-attention) of
    ``n_kv_heads`` heads (default ``n_heads``; fewer: grouped-query attention
    through ``enable_gqa``). A backend that declines raises, or explains why in a warning: both
    mean False. Probed once per kind of call."""
    n_kv_heads = n_kv_heads or n_heads
    q = torch.randn(1, n_heads, n_q, head_dim, device=device.DEVICE, dtype=dtype)
    k = torch.randn(
        1, n_kv_heads, 256 if n_q == 1 else n_q, head_dim, device=device.DEVICE, dtype=dtype
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sdpa(q, k, k, backend=backend, enable_gqa=n_kv_heads != n_heads)
        return True
    except (RuntimeError, AttributeError, ValueError):
        return False
