"""FlashAttention forward with warp specialisation, in CUDA C++ on the Hopper ladder's machinery.

``attention(q, k, v, causal=False, sm_scale=None)`` -> ``(o, lse)`` for bf16 ``[B, H, N, 128]``
tensors: ``o = softmax(q kᵀ · sm_scale) v`` in bf16 and the log-sum-exp of every row in
``kernels.flash_attention``'s log2 convention (fp32 ``[B, H, N]``). ``fa_ws.cu`` says how it works:
a producer warpgroup streams K and V tiles with TMA into a two-slot mbarrier ring, and two consumer
warpgroups each run 64 query rows through ``wgmma`` (S = Q Kᵀ from shared memory, O += P V with P
from registers) and the online softmax between them. Four schedules (``SCHEDULES``): "plain", which
waits for each product in turn; FlashAttention-3's "overlap", which measured 1-8% slower on an H100
(page 4.12, FlashAttention-3 in CUDA, says by how much and why); "persistent", the plain one on a
grid of one block per SM that draws tiles off a global counter (on an H100 1.05-1.11x plain with
the causal mask, 1.08x at 512 tokens without it, level from 1,024): the default without the mask;
and "persistent-early", which also issues the next tile's first S before it stores this tile's O:
the default with the mask (1.01-1.03x "persistent" there; ``default_schedule``).

Why CUDA and not Triton: Triton 3.6's automatic warp specialisation of this kernel computes the
causal case wrongly (``kernels/flash_attention_ws.py`` keeps that experiment), and splitting the
query tile by hand made each consumer partition do both halves. The CUDA kernel is built from
pieces the Hopper ladder's steps 9-11 already tested: descriptors, TMA boxes, the mbarrier ring and
``setmaxnreg``.

Needs an sm_90 GPU (wgmma, TMA, setmaxnreg exist on ``sm_90a`` only) and nvcc; any ``N`` (Q, K and
V are read as they lie, rows of 128 values). ``compile_check``
builds the kernels for sm_90a with nvcc and no GPU: the tests check their instructions with it.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

import kernels.cuda as ladder
from kernels.cuda import hgemm_check

HEAD_DIM = 128
# "plain": each consumer waits for each of its products in turn, and the two consumers run
# unsynchronised, so one's softmax can overlap the other's products; "persistent" (the default
# without the mask): the plain schedule with one block per SM drawing
# (query tile, head) pairs off a counter, so one tile's epilogue overlaps the next one's loads and
# blocks that drew short causal tiles draw more (a fixed stride of tiles per block measured 7-11%
# slower than plain with the mask: the hardware's block scheduler balanced uneven tiles better);
# "overlap": FlashAttention-3's schedule (the softmax of one key tile runs while the tensor cores do
# the previous tile's P V, and named barriers make the two consumers take turns to issue products).
# "persistent-early" (the default with the mask): the persistent schedule issuing the next tile's
# first S before it stores this tile's O, so the tensor cores work through the epilogue.
SCHEDULES = ("plain", "overlap", "persistent", "persistent-early")  # the binding's 0, 1, 2, 3
SOURCES = ["hgemm_common.cuh", "fa_ws.cu"]
SIGNATURE = (
    "std::vector<torch::Tensor> fa_ws(torch::Tensor q, torch::Tensor k, torch::Tensor v, "
    "bool causal, double sm_scale, int64_t schedule);"
)


# ``kernels.flash_attention.attention`` sends a forward here from this many tokens on (bf16, head dim
# 128, self-attention, Hopper): on an H100 the default schedules ran 1.11-1.28x the course's Triton
# forward at every length from 1,024 to 16,384, causal and not (the third run of
# results/profiles/2026-11-27-nvidia-h100-80gb-hbm3-fa-persistent.txt), and 1.20-1.25x at 512
# (results/profiles/2026-12-05-nvidia-h100-80gb-hbm3-fa-short.txt). Shorter ones were not timed.
FASTER_FROM = 512
# GPU_BRRR_CUDA_ATTENTION=0 keeps every call of ``flash_attention.attention`` on the Triton kernels.
ENV = "GPU_BRRR_CUDA_ATTENTION"


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None: what the Hopper ladder needs (kernels.cuda)."""
    return ladder.hgemm_unavailable_reason()


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, from_tokens: int) -> bool:
    """Whether these checked inputs of ``flash_attention.attention`` fit the CUDA kernels and are
    long enough (``from_tokens``) for them to be the faster: bf16 ``[B, H, N, 128]`` self-attention
    on the GPU, N >= from_tokens, on an sm_90 GPU with nvcc, unless ``ENV`` is "0". The shape tests
    come first, so a call that cannot take the path never asks the GPU anything."""
    return (
        shape_fits(q, k, from_tokens)
        and q.is_cuda
        and os.environ.get(ENV, "1") != "0"
        and unavailable_reason() is None
    )


def shape_fits(q: torch.Tensor, k: torch.Tensor, from_tokens: int) -> bool:
    """``takes``' test of the inputs alone (not of the GPU or the environment)."""
    return (
        q.dtype == torch.bfloat16
        and q.shape[-1] == HEAD_DIM
        and q.shape[2] >= from_tokens
        and k.shape == q.shape
    )


def built(load) -> bool:
    """Whether ``load()`` (an extension's cached loader) builds; a failure warns once (the caller
    caches the answer) and the Triton kernels run instead."""
    try:
        load()
    except Exception as err:  # noqa: BLE001 (any build failure keeps the Triton path)
        warnings.warn(
            f"kernels.cuda.fa_ws: build failed, the Triton kernels run instead ({err})",
            stacklevel=4,  # from a forward: the caller of flash_attention.attention
        )
        return False
    return True


@functools.cache
def forward_built() -> bool:
    """Whether the forward's extension builds here (asked once per process)."""
    return built(_module)


@functools.cache
def _module():
    return ladder._load(
        unavailable_reason(),
        "gpu_brrr_fa_ws",
        [*SOURCES, "fa_ws_bindings.cu"],
        "fa_ws",
        SIGNATURE,
        lambda: ladder.HGEMM_ARCH_FLAGS,
    )


def _check(q, k, v, sm_scale) -> float:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name} must have dtype bfloat16, got {t.dtype}")
        if t.ndim != 4:
            raise ValueError(
                f"{name} must be 4-D [B, H, N, {HEAD_DIM}], got shape {tuple(t.shape)}"
            )
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(
            f"q, k and v must have one shape (self-attention), got {tuple(q.shape)}, "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[-1] != HEAD_DIM:
        raise ValueError(f"q's head dimension must be {HEAD_DIM}, got {q.shape[-1]}")
    if q.shape[0] * q.shape[1] > 65535:  # the grid's y axis: one row of programs per (batch, head)
        raise ValueError(f"batch * heads must be at most 65,535, got {q.shape[0]} * {q.shape[1]}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}"
        )
    if sm_scale is None:
        return 1.0 / math.sqrt(HEAD_DIM)
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
        raise TypeError(f"sm_scale must be a number, got {type(sm_scale).__name__}")
    if not (math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be positive and finite, got {sm_scale!r}")
    return float(sm_scale)


def default_schedule(causal: bool) -> str:
    """The schedule ``attention`` runs when none is named: the faster on an H100 (16k tokens, bf16;
    scripts/gpu/fa_schedules_probe.py). "persistent" without the mask: its producer loads the next
    tile while the consumers finish the last, which pays where tiles are short (2026-12-06: 1.08x
    plain at 512 tokens, 0.99-1.01x at 1,024-8,192). "persistent-early" with it: the tile counter
    balances the causal tiles (1.05-1.11x plain), and issuing the next tile's first S before the
    epilogue measured 1.006-1.033x "persistent" at every length from 512 to 8,192 tokens; without
    the mask it measured 0.987-1.017x, inside the spread between runs
    (results/profiles/2026-12-07-nvidia-h100-80gb-hbm3-fa-schedules-early.txt)."""
    return "persistent-early" if causal else "persistent"


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
    schedule: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)`` of attention over bf16 ``[B, H, N, 128]`` q, k, v (see the module docstring);
    ``schedule`` is one of ``SCHEDULES``, or None for the faster on an H100: ``default_schedule``."""
    scale = _check(q, k, v, sm_scale)
    if schedule is None:
        schedule = default_schedule(causal)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    if q.device.type != "cuda":
        raise ValueError(f"q, k and v must be on the GPU, got {q.device}")
    if q.numel() == 0:
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)
    # TMA needs 16-byte aligned bases: a contiguous view that starts off-alignment is copied.
    q, k, v = (ladder._aligned(t.contiguous()) for t in (q, k, v))
    o, lse = _module().fa_ws(q, k, v, bool(causal), scale, SCHEDULES.index(schedule))
    return o, lse


def attention_ref(q, k, v, causal=False, sm_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 reference: ``(o, lse)`` in the same conventions (lse in log2 units)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = q.float() @ k.float().transpose(-1, -2) * scale
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(
            torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf")
        )
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v.float(), lse / math.log(2)


@dataclass
class Compiled:
    returncode: int
    log: str
    sass: str  # '' without a cuobjdump
    ptxas: dict

    def problems(self) -> list[str]:
        """Why this build is unfit for a warp-specialised kernel, if it is: a failed build, ptxas's
        warnings (``hgemm_check.ptxas_warnings``), spills, or more than 168 registers per thread at
        entry (three warpgroups at 168 fill the register file: the cap that lets the consumers'
        ``setmaxnreg`` take more)."""
        if self.returncode != 0:
            return ["nvcc failed: " + self.log[-2000:]]
        found = []
        if hgemm_check.ptxas_warnings(self.log):
            found.append("ptxas warns: " + self.log[-2000:])
        if self.ptxas["spill_stores"] or self.ptxas["spill_loads"]:
            found.append(f"spills: {self.ptxas}")
        if self.ptxas["registers"] > 168:
            found.append(f"{self.ptxas['registers']} registers at entry (at most 168)")
        return found


def compile_check(workdir: str | Path | None = None, sources: list[str] = SOURCES) -> Compiled:
    """Build ``sources`` (by default ``hgemm_common.cuh`` + ``fa_ws.cu``) for sm_90a with
    ``-Xptxas -v`` (nvcc, no GPU) and disassemble it: the registers, spills and instructions the
    tests look at."""
    nvcc = hgemm_check.find_tool("nvcc")
    if nvcc is None:
        raise RuntimeError(hgemm_check.compile_unavailable_reason())
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="gpubrrr-faws-") as tmp:
            return compile_check(tmp, sources)
    src, obj = Path(workdir) / "fa_ws_all.cu", Path(workdir) / "fa_ws_all.o"
    src.write_text(ladder._read(sources))
    proc = subprocess.run(
        [nvcc, "-std=c++17", "-O3", *ladder.HGEMM_ARCH_FLAGS, "-Xptxas", "-v"]
        + ["-c", str(src), "-o", str(obj)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = proc.stderr + proc.stdout
    sass = hgemm_check.disassemble(obj) if proc.returncode == 0 else ""
    return Compiled(proc.returncode, log, sass, hgemm_check.parse_ptxas(log))
