"""Input checks shared by every launcher: each raises an error that names the argument.

Debug mode. Checks of shapes, dtypes and devices are free and always run. Checks that must read a
tensor's *values* (the block ids of a paged-attention block table, the sequence lengths, a
megakernel's barrier-timeout word) would make a GPU launcher wait for the device on every call,
so on a GPU they run only in debug mode: set ``GPU_BRRR_DEBUG=1`` in the environment before
importing ``kernels``, or call ``kernels._validate.debug(True)``. The test suite turns it on
(tests/conftest.py). On the CPU (the interpreter) reading a value costs nothing, so the checks
always run there. Without debug mode a GPU kernel still never reads out of bounds: it answers NaN
where a value check would have raised (see each launcher's docstring).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

import torch

_DEBUG = os.environ.get("GPU_BRRR_DEBUG", "0").strip().lower() not in ("", "0", "false", "no")


def debug(on: bool | None = None) -> bool:
    """Turn debug mode on or off (``None``: leave it); returns whether it is on."""
    global _DEBUG
    if on is not None:
        _DEBUG = bool(on)
    return _DEBUG


def check_values(*tensors: torch.Tensor) -> bool:
    """Whether a launcher should check the values of ``tensors``: always on the CPU, in debug mode
    on a GPU, and never while a CUDA graph is being captured (reading a value there is an error)."""
    on_gpu = any(t.is_cuda for t in tensors)
    if not on_gpu:
        return True
    return _DEBUG and not torch.cuda.is_current_stream_capturing()


def sm_scale(v, head_dim: int) -> float:
    """``sm_scale`` checked: a finite positive number, or ``None`` for ``1 / sqrt(head_dim)``."""
    if v is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
        raise ValueError(f"sm_scale must be a finite positive number or None, got {v!r}")
    return float(v)


def tensor(name: str, t, *, dtypes: Iterable[torch.dtype] | None = None, ndim: int | None = None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    return t


def same(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor, *, shape=True, dtype=True):
    if a.device != b.device:
        raise ValueError(
            f"{name_a} and {name_b} must be on one device, got {a.device} and {b.device}"
        )
    if shape and a.shape != b.shape:
        raise ValueError(
            f"{name_a} and {name_b} must have the same shape, got {tuple(a.shape)} and "
            f"{tuple(b.shape)}"
        )
    if dtype and a.dtype != b.dtype:
        raise TypeError(
            f"{name_a} and {name_b} must have the same dtype, got {a.dtype} and {b.dtype}"
        )


def positive_power_of_two(name: str, v: int):
    if not isinstance(v, int) or v <= 0 or v & (v - 1):
        raise ValueError(f"{name} must be a positive power of two, got {v!r}")
