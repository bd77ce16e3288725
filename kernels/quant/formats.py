"""The int8/int4 weight format: ``QuantizedWeight``, ``quantize``, ``unpack``, ``dequantize`` and the
byte model of a fused dequantize-GEMV (``gemv_bytes``). See ``kernels.quant`` for the layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import _validate

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)  # activations and outputs
SCALE_DTYPE = torch.float16


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight ``W: [N, K]`` stored as ``bits``-bit integers with one fp16 scale per group.

    ``W[n, k] ≈ q[n, k] * scales[n, k // group_size]``; see ``kernels.quant`` for the layout.
    The fields are checked when the weight is built (``quantize`` builds valid ones; a hand-built
    one with the wrong dtype, shape or grouping raises instead of feeding the kernels garbage).
    """

    data: torch.Tensor  # int8 [N, K] (bits=8) or uint8 [N, K // 2] (bits=4)
    scales: torch.Tensor  # fp16 [N, K // group_size]
    bits: int
    group_size: int  # K for per-channel scales
    shape: tuple[int, int]  # (N, K)

    def __post_init__(self) -> None:
        shape = self.shape
        if (
            not isinstance(shape, tuple)
            or len(shape) != 2
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
        ):
            raise ValueError(f"shape must be a tuple (N, K) of two positive ints, got {shape!r}")
        n, k = shape
        if isinstance(self.bits, bool) or self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int):
            raise ValueError(
                f"group_size must be an int (K for per-channel), got {self.group_size!r}"
            )
        if _check_group(k, self.bits, self.group_size) != self.group_size:
            raise ValueError(f"group_size must divide K = {k}, got {self.group_size}")
        want = (torch.int8, (n, k)) if self.bits == 8 else (torch.uint8, (n, k // 2))
        _validate.tensor("data", self.data, dtypes=(want[0],), ndim=2)
        if tuple(self.data.shape) != want[1]:
            raise ValueError(
                f"data of an int{self.bits} weight of shape {shape} must be {want[1]}, "
                f"got {tuple(self.data.shape)}"
            )
        _validate.tensor("scales", self.scales, dtypes=(SCALE_DTYPE,), ndim=2)
        if tuple(self.scales.shape) != (n, k // self.group_size):
            raise ValueError(
                f"scales must be [N, K / group_size] = [{n}, {k // self.group_size}], got "
                f"{tuple(self.scales.shape)}"
            )
        if self.scales.device != self.data.device:
            raise ValueError(
                f"data and scales must be on one device, got {self.data.device} and "
                f"{self.scales.device}"
            )

    @property
    def nbytes(self) -> int:
        """Bytes a kernel must read to use the weight: packed values plus scales."""
        return self.data.numel() * self.data.element_size() + self.scales.numel() * 2

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per weight, scales included (int4 with groups of 128: 4.125)."""
        return 8 * self.nbytes / (self.shape[0] * self.shape[1])

    def __repr__(self) -> str:
        n, k = self.shape
        g = "per-channel" if self.group_size == k else f"group {self.group_size}"
        return (
            f"QuantizedWeight(int{self.bits}, {g}, shape=({n}, {k}), "
            f"{self.nbytes / 1e6:.2f} MB, {self.bits_per_weight:.3f} bits/weight)"
        )


def _check_group(k: int, bits: int, group_size: int | None) -> int:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits!r}")
    if bits == 4 and k % 2:
        raise ValueError(f"int4 packs two values a byte: w.shape[1] must be even, got {k}")
    if group_size is None or group_size == k:
        return k
    if not isinstance(group_size, int) or group_size <= 0 or k % group_size:
        raise ValueError(f"group_size must divide w.shape[1] = {k}, got {group_size!r}")
    # Kernel tiles never straddle a group: a group must hold a whole number of 16-wide tiles in
    # each half of the packed int4 row (16 is tl.dot's smallest K).
    need = 32 if bits == 4 else 16
    if group_size % need:
        raise ValueError(
            f"group_size must be a multiple of {need} for int{bits} (or None for per-channel), "
            f"got {group_size}"
        )
    return group_size


def quantize(w: torch.Tensor, bits: int = 4, group_size: int | None = 128) -> QuantizedWeight:
    """Symmetric round-to-nearest quantization of a weight ``w: [N, K]`` (any float dtype).

    Each group's scale is ``amax / qmax`` (qmax 127 for int8, 7 for int4), rounded to fp16; values
    are divided by the rounded scale, rounded and clamped, so ``dequantize`` reproduces exactly the
    grid the kernel multiplies by. ``group_size=None`` gives one scale per output row.
    """
    _validate.tensor("w", w.contiguous() if isinstance(w, torch.Tensor) else w, ndim=2)
    if not w.is_floating_point():
        raise TypeError(f"w must be a floating-point tensor, got {w.dtype}")
    n, k = w.shape
    if n == 0 or k == 0:
        raise ValueError(f"w must not be empty, got shape {tuple(w.shape)}")
    g = _check_group(k, bits, group_size)
    wf = w.float().reshape(n, k // g, g)
    amax = wf.abs().amax(dim=-1)
    if not torch.isfinite(amax).all():
        raise ValueError("w contains inf or NaN")
    qmax = 2 ** (bits - 1) - 1
    scale = (amax / qmax).to(SCALE_DTYPE)
    # An all-zero group (or one whose scale underflows fp16) gets scale 1: its values round to 0.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round(wf / scale.float()[..., None]), -qmax, qmax).reshape(n, k)
    if bits == 8:
        data = q.to(torch.int8)
    else:
        u = (q + 8).to(torch.uint8)  # offset binary: [-7, 7] -> [1, 15]
        data = u[:, : k // 2] | (u[:, k // 2 :] << 4)
    return QuantizedWeight(data.contiguous(), scale.contiguous(), bits, g, (n, k))


def _check_qw(qw) -> None:
    if not isinstance(qw, QuantizedWeight):
        raise TypeError(f"qw must be a QuantizedWeight (from quantize), got {type(qw).__name__}")


def unpack(qw: QuantizedWeight) -> torch.Tensor:
    """The integer values ``q: int8[N, K]`` of a quantized weight, unscaled."""
    _check_qw(qw)
    if qw.bits == 8:
        return qw.data
    lo = (qw.data & 0xF).to(torch.int8) - 8
    hi = (qw.data >> 4).to(torch.int8) - 8
    return torch.cat([lo, hi], dim=1)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``W ≈ q * scale`` as a dense ``[N, K]`` tensor, computed in fp32 and cast to ``dtype``."""
    n, k = qw.shape if isinstance(qw, QuantizedWeight) else (0, 0)
    q = unpack(qw).float().reshape(n, k // qw.group_size, qw.group_size)
    return (q * qw.scales.float()[..., None]).reshape(n, k).to(dtype)


def gemv_bytes(m: int, n: int, k: int, bits: int | str, group_size: int | None = None) -> int:
    """Minimum bytes of ``y[m, n] = x[m, k] @ W[n, k].T`` with 16-bit ``x``, ``y``: weights,
    fp16 scales (``bits`` 4 or 8), or a bf16 weight (``bits="bf16"``)."""
    act = 2 * m * k + 2 * m * n
    if bits == "bf16":
        return 2 * n * k + act
    g = group_size or k
    return n * k * bits // 8 + 2 * n * (k // g) + act
