"""Input checks shared by every launcher: each raises an error that names the argument."""

from __future__ import annotations

from collections.abc import Iterable

import torch


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
