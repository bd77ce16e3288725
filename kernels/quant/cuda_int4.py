"""The CUDA C++ int4 GEMV (``kernels/cuda/int4_gemv_mma.cu``): its configurations, the one-time
repacking of a weight into the register order of ``mma.m16n8k16`` (``repack_int4_mma``) and the build."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from kernels import device
from kernels.quant.formats import QuantizedWeight

# (NT, S, D) of kernels/cuda/int4_gemv_mma.cu in order of preference: 16-row tiles per warp, warps
# per block (each a slice of K), groups prefetched. Timed on an H100 by scripts/gpu/int4_mma_probe.py;
# the first that divides the shape runs (N a multiple of 16 NT, K / 128 of S).
INT4_MMA_CONFIGS = [(2, 16, 1), (2, 8, 1), (2, 4, 2)]
INT4_MMA_MAX_M = 8
_CUDA_DIR = Path(__file__).resolve().parents[1] / "cuda"


@functools.cache
def int4_mma_unavailable() -> str | None:
    """Why the CUDA int4 kernel cannot be built here, or None when it can: it needs an NVIDIA GPU of
    compute capability 8.0+ (bf16 ``mma``), a CUDA build of PyTorch and nvcc. Asked once per
    process (``gemv``'s default path asks on every call)."""
    from kernels import cuda

    reason = cuda.unavailable_reason()
    if reason:
        return reason
    if not device.capabilities().bf16:  # sm_80+, or turned off by GPU_BRRR_FORCE_CAPS
        return "the bf16 tensor-core instruction needs a GPU with bf16 (compute capability 8.0+)"
    return None


def _int4_mma_config(n: int, k: int) -> tuple[int, int, int] | None:
    return next(
        (c for c in INT4_MMA_CONFIGS if n % (16 * c[0]) == 0 and (k // 128) % c[1] == 0), None
    )


def _int4_mma_misfit(x2: torch.Tensor, qw: QuantizedWeight) -> str | None:
    """Why this call does not fit the CUDA kernel (None when it does)."""
    n, k = qw.shape
    if qw.bits != 4 or qw.group_size != 128:
        return f"it takes int4 with groups of 128, got {qw.bits}-bit with groups of {qw.group_size}"
    if x2.dtype != torch.bfloat16:
        return f"it takes bf16 activations, got {x2.dtype}"
    if not x2.is_cuda:
        return "it needs CUDA tensors"
    if x2.shape[0] > INT4_MMA_MAX_M:
        return f"it takes at most {INT4_MMA_MAX_M} rows of x, got {x2.shape[0]}"
    if k % 128 or _int4_mma_config(n, k) is None:
        return f"no configuration divides N = {n}, K = {k}"
    return None


@functools.cache
def _int4_mma_build_error() -> str | None:
    """Build the CUDA int4 kernel once for the default path; on failure warn and return why, so that
    ``gemv`` falls back to Triton instead of failing (an explicit ``path="cuda"`` still raises)."""
    try:
        _int4_mma_module()
    except Exception as e:  # noqa: BLE001 - any toolchain failure means "use the Triton kernel"
        import warnings

        msg = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else e!r}"
        warnings.warn(f"CUDA int4 kernel unavailable, using Triton: {msg}", stacklevel=3)
        return msg
    return None


@functools.cache
def _int4_mma_module():
    from torch.utils.cpp_extension import load_inline

    from kernels import cuda

    signature = "torch::Tensor x, int64_t nt, int64_t s, int64_t d"
    return load_inline(
        name="gpu_brrr_int4_gemv_mma",
        cpp_sources=f"torch::Tensor int4_gemv_mma(torch::Tensor w, torch::Tensor sc, {signature});",
        cuda_sources=(_CUDA_DIR / "int4_gemv_mma.cu").read_text()
        + "\n"
        + (_CUDA_DIR / "int4_gemv_mma_bindings.cu").read_text(),
        functions=["int4_gemv_mma"],
        extra_cuda_cflags=["-O3", "-lineinfo", "-std=c++17", *cuda.arch_flags()],
        verbose=False,
    )


def repack_int4_mma(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 weight and scales in the order ``kernels/cuda/int4_gemv_mma.cu`` loads them: returns
    ``(w, scales)``, ``w`` uint8 of ``N * K / 2`` bytes, ``scales`` fp16 ``[N/16, K/128, 8, 2]``.

    For row tile ``rb`` (16 rows), group ``g`` (128 k), quad ``q`` (4 k-steps of 16) and lane ``l``
    there are 16 bytes, four 32-bit words; word ``i`` is k-step ``j = 4q + i`` and its nibble ``p``
    holds the code of row ``16 rb + l // 4 + 8 (p & 1)`` and column
    ``128 g + 16 j + 2 (l % 4) + (p >> 2) + 8 ((p >> 1) & 1)``: exactly the A fragment of one
    ``mma.m16n8k16`` for lane ``l``. Computed once per weight (views and one permute) and cached on
    it."""
    cached = getattr(qw, "_int4_mma", None)
    if cached is not None:
        return cached
    n, k = qw.shape
    if qw.bits != 4 or qw.group_size != 128 or n % 16 or k % 128:
        raise ValueError(
            f"qw must be int4 with groups of 128 and N % 16 == K % 128 == 0, got {qw.bits}-bit, "
            f"groups of {qw.group_size}, shape {qw.shape}"
        )
    half = k // 2
    codes = torch.empty(n, k, dtype=torch.uint8, device=qw.data.device)
    codes[:, :half] = qw.data & 0xF
    codes[:, half:] = qw.data >> 4
    rb, g = n // 16, k // 128
    # [rb, h, lr, g, q, i, kh, lc, e] with row = 16 rb + 8 h + lr, col = 128 g + 64 q + 16 i + 8 kh
    # + 2 lc + e; reorder to [rb, g, q, lane = 4 lr + lc, word i, nibble p = 4 e + 2 kh + h].
    c = codes.view(rb, 2, 8, g, 2, 4, 2, 4, 2).permute(0, 3, 4, 2, 7, 5, 8, 6, 1)
    c = c.reshape(rb, g, 2, 32, 4, 8)
    w = (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous().view(-1)  # little-endian nibble pairs
    scales = qw.scales.view(rb, 2, 8, g).permute(0, 3, 2, 1).contiguous()
    object.__setattr__(qw, "_int4_mma", (w, scales))  # a frozen dataclass: cache beside the fields
    return w, scales
