"""FlashAttention backward with warp specialisation, in CUDA for Hopper: ``fa_ws_bwd.cu`` says how it
works (FlashAttention-3's design: one block per 128 keys keeps K and V in shared memory, walks over
the query tiles once, and adds each tile's dQ into an fp32 buffer with TMA bulk reductions).

``backward(q, k, v, o, lse, do, causal)`` takes the forward's output and log-sum-exp as
``kernels.cuda.fa_ws.attention`` returns them (lse in log2 units) and returns ``(dq, dk, dv)``.
``attention(q, k, v, causal)`` is the pair as one differentiable call: ``fa_ws``'s forward, this
backward. On an H100, with its default schedule (``VARIANT``), it runs at 0.89-1.01x cuDNN's
backward and at 1.05-1.18x the course's two Triton kernels at 1,024 and 2,048 tokens (page 4.12,
which also gives Nsight Compute's account of the gap).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

import kernels.cuda as ladder
from kernels.cuda import fa_ws

SOURCES = ["hgemm_common.cuh", "fa_ws.cu", "fa_ws_bwd.cu"]
# With the causal mask, blocks in groups of two heads, the longest key tiles first: 3-5% faster than
# the 2-D grid at 8,192 tokens on an H100; without it the 2-D grid is as fast as any grouping.
CAUSAL_GROUP_HEADS = 2
# ``kernels.flash_attention.attention`` sends a backward here from this many tokens on (where its
# forward is fa_ws's too). On an H100, with schedule 15, this backward ran 1.05-1.18x the course's
# two Triton kernels at 1,024 and 2,048 tokens, causal and not, and 0.97-1.00x at 512
# (results/profiles/2026-12-07-nvidia-h100-80gb-hbm3-fa-bwd-default.txt); with schedule 0 it had
# needed 2,048 (0.87-0.99x at 1,024: results/profiles/2026-11-27-nvidia-h100-80gb-hbm3-fa-ws-bwd.txt).
FASTER_FROM = 1024
# The loop's schedules (fa_ws_bwd.cu, bits of its VARIANT): 1 lse and delta brought into shared
# memory by the producer, 2 dQ's reductions issued by producer warps, 4 dS^T in registers of its own
# (dK need not wait for dV), 8 dS^T stored with stmatrix; the others spill registers. On an H100 (one
# process, 2,048-8,192 tokens) 15 ran 1.09-1.20x faster than 0, at 0.89-1.01x cuDNN's backward
# (results/profiles/2026-12-07-nvidia-h100-80gb-hbm3-fa-bwd-schedules.txt). 15 is the default since
# tests/test_fa_ws_bwd.py and compute-sanitizer's memcheck passed on it (same day, H100).
VARIANTS = (0, 1, 9, 11, 13, 15)
VARIANT = 15
SIGNATURE = (
    "std::vector<torch::Tensor> fa_ws_bwd(torch::Tensor q, torch::Tensor k, torch::Tensor v, "
    "torch::Tensor o, torch::Tensor lse, torch::Tensor dout, bool causal, double sm_scale, "
    "int64_t stages, int64_t group_heads, int64_t variant);"
)


@functools.cache
def _module():
    return ladder._load(
        fa_ws.unavailable_reason(),
        "gpu_brrr_fa_ws_bwd",
        [*SOURCES, "fa_ws_bwd_bindings.cu"],
        "fa_ws_bwd",
        SIGNATURE,
        lambda: ladder.HGEMM_ARCH_FLAGS,
    )


def backward(
    q,
    k,
    v,
    o,
    lse,
    do,
    causal: bool = False,
    sm_scale: float | None = None,
    *,
    stages: int = 2,
    group_heads: int | None = None,
    variant: int = VARIANT,
):
    """``(dq, dk, dv)`` of ``o = attention(q, k, v)`` for the upstream gradient ``do``: bf16
    ``[B, H, N, 128]`` tensors and the forward's fp32 ``lse`` ``[B, H, N]`` (log2 units).
    ``stages`` (2 or 3): slots of the Q/dO ring; ``group_heads``: 0 for the 2-D grid, or order the
    blocks in groups of that many heads, key tiles ascending (the causal mask's longest first);
    ``None`` picks ``CAUSAL_GROUP_HEADS`` with the causal mask and 0 without (page 4.12);
    ``variant``: the loop's schedule, one of ``VARIANTS``."""
    scale = fa_ws._check(q, k, v, sm_scale)
    if stages not in (2, 3):
        raise ValueError(f"stages must be 2 or 3, got {stages!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if group_heads is None:
        group_heads = CAUSAL_GROUP_HEADS if causal else 0
    if not isinstance(group_heads, int) or group_heads < 0:
        raise ValueError(f"group_heads must be a non-negative int, got {group_heads!r}")
    for name, t in (("o", o), ("do", do)):
        if not isinstance(t, torch.Tensor) or t.shape != q.shape or t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be a bf16 tensor of q's shape {tuple(q.shape)}")
    if not isinstance(lse, torch.Tensor) or lse.shape != q.shape[:3] or lse.dtype != torch.float32:
        raise ValueError(f"lse must be an fp32 tensor of shape {tuple(q.shape[:3])}")
    reason = fa_ws.unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    if q.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    q, k, v, o, do = (ladder._aligned(t.contiguous()) for t in (q, k, v, o, do))
    tensors = (q, k, v, o, lse.contiguous(), do)
    dq, dk, dv = _module().fa_ws_bwd(
        *tensors, bool(causal), scale, int(stages), int(group_heads), int(variant)
    )
    return dq, dk, dv


@functools.cache
def built() -> bool:
    """Whether the backward's extension builds here (asked once per process; a failure warns once)."""
    return fa_ws.built(_module)


def compile_check(workdir: str | Path | None = None) -> fa_ws.Compiled:
    """Build the backward (with the forward it is built on) for sm_90a with ``-Xptxas -v`` (nvcc,
    no GPU) and disassemble it."""
    return fa_ws.compile_check(workdir, SOURCES)


class _Attention(torch.autograd.Function):
    """``fa_ws.attention``'s output, with ``backward`` as its gradient."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale):
        o, lse = fa_ws.attention(q, k, v, causal=causal, sm_scale=sm_scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.sm_scale = causal, sm_scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = backward(q, k, v, o, lse, do.contiguous(), ctx.causal, ctx.sm_scale)
        return dq, dk, dv, None, None


def attention(q, k, v, causal: bool = False, sm_scale: float | None = None) -> torch.Tensor:
    """``o = softmax(q k^T sm_scale) v`` over bf16 ``[B, H, N, 128]`` tensors, differentiable: the
    warp-specialised CUDA forward and backward (Hopper only)."""
    return _Attention.apply(q, k, v, bool(causal), sm_scale)
