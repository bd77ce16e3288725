"""A warp-specialised FlashAttention forward for Hopper, shaped the way Triton 3.6's pass accepts.

An experiment for issue 19 (item 2), not the course's default: ``flash_attention.attention`` stays
the attention everywhere until a GPU run shows this one correct and faster.

**The idea.** In the course's forward every warp does everything in turn: wait for a K/V tile,
multiply, exponentiate, multiply again. *Warp specialisation* splits the program into roles that
run at the same time: a *producer* warpgroup issues the TMA copies of the next K/V tiles into a
ring of shared-memory buffers, and *consumer* warpgroups run the wgmma matmuls and the softmax on
tiles that have already arrived, each waiting on an mbarrier rather than on the whole program. The
producer needs few registers and the consumers many, so the compiler re-balances them
(``setmaxnreg``: down to 40 for the producer, up to 232 for the consumers): the structure of
FlashAttention-3 (shah2024flashattention3 in references.bib).

Triton writes that pipeline itself from ``tl.range(..., warp_specialize=True)``, but on sm_90 only
for loops it can fully analyse (see the comment after ``_AUTOTUNE_KEY`` in kernels/flash_attention.py
and ``build_evidence`` below): every tile the loop uses comes from a TMA tensor descriptor (q too),
there is ONE K/V loop with no branch inside it, and the program has 4 warps (the pass adds a second
consumer warpgroup and makes the original one the producer: 384 threads, the BLOCK_M = 128 query
rows split into two 64-row consumer halves). So this kernel differs from the course's in three ways:

- q, k, v and o move through ``tl.make_tensor_descriptor`` descriptors built per head on the
  device, of shape ``[N, D]``: rows past a head's end read as zeros and are never written, so no
  load or store needs a mask (the launch asks for a little global scratch for the descriptors,
  through a Triton allocator the launcher sets for the call and restores);
- the causal diagonal and the ragged last tile are not separate loops but a mask inside the one
  loop, and it is applied to every tile: an ``if`` that masks only the tiles that need it is a
  branch in the loop, and with it Triton 3.6 makes no ``ttg.warp_specialize`` at all (compiled for
  sm_90, the flag is then silently ignored). The cost is one compare and one select per score on
  the CUDA cores, beside the FMA, exp2, max, sum and conversion each score already costs: on every
  tile if causal (the course masks only the BLOCK_M / BLOCK_N diagonal tiles) or if N_KV is not a
  multiple of 128, and nowhere otherwise (``EVEN_N``, a compile-time switch);
- num_warps = 4 with BLOCK_M = 128 on the GPU (at 8 warps the flag is ignored).

Everything else is the course's forward: online softmax in base 2 with the scale folded into one
FMA, fp32 accumulators, and the base-2 log-sum-exp per row (``attention_ws_with_lse`` returns it in
natural log, the convention of ``flash_attention.attention_with_lse``).

The interpreter runs the same source with ``WARP_SPECIALIZE=False`` (descriptors work there), which
is how the CPU tests check the arithmetic; whether the specialised pipeline is correct and fast on
an H100 is for ``scripts/gpu/fa_ws_probe.py`` to say.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from kernels import device
from kernels import flash_attention as fa
from kernels.launch import LOG2E, cdiv

# GPU configurations, as (BLOCK_M, BLOCK_N, num_stages); num_warps is always 4 (the pass needs it).
# BLOCK_M = 128 gives the two 64-row consumer warpgroups. Each, causal and not, at head dim 64 and
# 128, compiled ahead of time for sm_90 with the pass firing (tests/test_flash_attention_ws.py checks
# the first at d = 128; scripts/gpu/fa_ws_probe.py prints all of them). Shared memory at d = 128
# (Triton's figure): 197,024 / 164,376 / 131,488 bytes.
_WS_CONFIGS = [(128, 128, 2), (128, 64, 3), (128, 64, 2)]
_WS_WARPS = 4
# Every BLOCK_N divides this, so the launcher can say "no ragged last tile" (EVEN_N) before the
# autotuner has picked BLOCK_N.
EVEN_UNIT = tl.constexpr(128)
# The specialised pipeline on the GPU; the interpreter runs the same loop plainly.
WARP_SPECIALIZE = not device.INTERPRET
# Measured on an H100 (2026-11-27, Triton 3.6, scripts/gpu/fa_ws_probe.py): with the pass on, the
# log-sum-exp of rows 64-127 of every 128-row tile (the second consumer warpgroup's half) comes
# back as 0 and the causal output is wrong (relative error 0.2); the non-causal output is right.
# Triton's own attention tutorial has had the pass off on Hopper for similar reasons (Hopper's
# data partitioning of the 128-row tile across two consumer warpgroups: triton-lang/triton pull
# requests 7108 and 7658). Until the probe passes, the launcher refuses to run the pass on a GPU
# unless this is set to 1.
UNSAFE_ENV = "GPU_BRRR_WS_UNSAFE"


def _configs():
    if device.INTERPRET:  # one small tile: the interpreter cannot autotune over several
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 16})]
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=_WS_WARPS, num_stages=s)
        for m, n, s in _WS_CONFIGS
    ]


def _prune(configs, nargs, **kwargs):
    """Drop tiles whose q tile, o tile and num_stages K/V pairs overflow shared memory."""
    d = kwargs["HEAD_DIM"]
    fits = [c for c in configs if fa._fits_smem(c, "BLOCK_M", "BLOCK_N", 2, d)]
    return fits or configs[-1:]


@triton.autotune(
    configs=_configs(),
    key=fa._AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": _prune},
)
@triton.jit
def _attn_fwd_ws_kernel(
    # pointers: q, o [B*H, N_Q, HEAD_DIM]; k, v [B*H, N_KV, HEAD_DIM]; lse [B*H, N_Q] (fp32)
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    lse_ptr,
    # scalars and sizes
    sm_scale,
    N_Q,
    N_KV,
    # meta-parameters
    HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    EVEN_N: tl.constexpr,  # N_KV % EVEN_UNIT == 0, so no tile holds keys past the end
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tl.static_assert(EVEN_UNIT % BLOCK_N == 0)
    pid_m = tl.program_id(0)
    if CAUSAL:  # the last query tiles have the most keys to visit: start them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1).to(tl.int64)  # int64: B*H*N*D can exceed 2**31
    # One descriptor per tensor and head, of shape [N, D]: the copy engine zero-fills rows past
    # the head's end on loads and drops them on stores, so no tile needs a bounds mask.
    q_desc = tl.make_tensor_descriptor(
        q_ptr + bh * N_Q * HEAD_DIM, [N_Q, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM]
    )
    o_desc = tl.make_tensor_descriptor(
        o_ptr + bh * N_Q * HEAD_DIM, [N_Q, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_M, HEAD_DIM]
    )
    k_desc = tl.make_tensor_descriptor(
        k_ptr + bh * N_KV * HEAD_DIM, [N_KV, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM]
    )
    v_desc = tl.make_tensor_descriptor(
        v_ptr + bh * N_KV * HEAD_DIM, [N_KV, HEAD_DIM], [HEAD_DIM, 1], [BLOCK_N, HEAD_DIM]
    )

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    # The query tile is copied once and reused against every key tile.
    q = q_desc.load([start_m, 0])

    # Per-row online-softmax state, all fp32.
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # launch.LOG2E (a jit function reads literals)

    # Causal: query i sees keys 0..i, so this tile's last key is start_m + BLOCK_M - 1.
    hi = tl.minimum(start_m + BLOCK_M, N_KV) if CAUSAL else N_KV
    for start_n in tl.range(0, hi, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        k = k_desc.load([start_n, 0])
        # s = q kᵀ for this tile, fp32 on the tensor cores; it lives in registers only.
        s = tl.dot(q, tl.trans(k))
        # The mask is applied to every tile, not under an `if` for the tiles that need it: a
        # branch inside the loop stops the pass (no ttg.warp_specialize is made). Cost: one
        # compare and one select per score, on the CUDA cores beside the exp2 they already run.
        if CAUSAL:
            # Key j is visible to query i iff j <= i. This also hides keys past the end (N_Q ==
            # N_KV, so every stored query is before them); padded query rows are never stored.
            offs_n = start_n + tl.arange(0, BLOCK_N)
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        elif not EVEN_N:  # keys past the end read as zeros: hide their scores
            offs_n = start_n + tl.arange(0, BLOCK_N)
            s = tl.where(offs_n[None, :] < N_KV, s, float("-inf"))
        # The course's online-softmax step (base 2, scale folded into one FMA per score).
        acc, l_i, m_i, p = fa._online_softmax_step(acc, l_i, m_i, s, qk_scale)
        v = v_desc.load([start_n, 0])
        # P is rounded to the input dtype for the second tensor-core matmul; acc stays fp32.
        acc = tl.dot(p.to(v.dtype), v, acc)

    # Epilogue: one division per output element, and the base-2 log-sum-exp of the scaled scores.
    acc = acc / l_i[:, None]
    o_desc.store([start_m, 0], acc.to(o_desc.dtype))
    tl.store(lse_ptr + bh * N_Q + offs_m, m_i + tl.math.log2(l_i), mask=offs_m < N_Q)


# ----------------------------------------------------------------------------- launchers


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    # Device-side descriptors are written to global scratch memory the launch asks for.
    return torch.empty(size, device=device.DEVICE, dtype=torch.int8)


def on_hopper() -> bool:
    """Whether this machine has the GPU the kernel is written for: an NVIDIA Hopper (compute
    capability 9.x, with TMA; an AMD part that reports 9.x has no TMA)."""
    if not device.GPU_MODE:
        return False
    cap = device.capabilities()
    return cap.compute_capability is not None and cap.compute_capability[0] == 9 and cap.tma


def _check_hopper(q, k, v) -> None:
    """On a GPU: Hopper (sm_90) and 16-byte-aligned tensors, or a clear error. The interpreter
    runs the kernel everywhere (without the specialisation) for the CPU tests."""
    if not device.GPU_MODE:
        return
    if not on_hopper():
        raise RuntimeError(
            f"attention_ws needs a Hopper GPU (compute capability 9.x: TMA, wgmma, setmaxnreg), "
            f"got {device.capabilities().compute_capability}; use "
            f"kernels.flash_attention.attention, which runs everywhere"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must start at a 16-byte-aligned address for TMA")


def _forward_ws(
    q, k, v, causal: bool, sm_scale: float, warp_specialize: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    # warp_specialize=False: the same kernel and tiles without the pass (the probe's A/B).
    ws = WARP_SPECIALIZE if warp_specialize is None else warp_specialize
    if ws and not device.INTERPRET and os.environ.get(UNSAFE_ENV) != "1":
        raise RuntimeError(
            "attention_ws: the warp-specialised pipeline gives wrong results on the GPU with "
            f"Triton {triton.__version__} (the lse of half of each tile, the causal output); pass "
            f"warp_specialize=False, or set {UNSAFE_ENV}=1 to run it anyway (the probe does)"
        )
    B, H, n_q, D = q.shape
    n_kv = k.shape[2]
    o = torch.empty_like(q)
    lse = torch.empty(B, H, n_q, device=q.device, dtype=torch.float32)
    if o.numel() == 0:
        return o, lse

    def grid(meta):
        return (cdiv(n_q, meta["BLOCK_M"]), B * H)

    token = None if device.INTERPRET else _allocation._allocator.set(_torch_scratch)
    try:
        _attn_fwd_ws_kernel[grid](
            q, k, v, o, lse, sm_scale, n_q, n_kv, HEAD_DIM=D, CAUSAL=causal,
            WARP_SPECIALIZE=ws, EVEN_N=n_kv % EVEN_UNIT.value == 0,
        )  # fmt: skip
    finally:  # leave the caller's allocator as it was
        if token is not None:
            _allocation._allocator.reset(token)
    return o, lse


def attention_ws(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
    warp_specialize: bool | None = None,
) -> torch.Tensor:
    """Forward-only ``softmax(q kᵀ · sm_scale [+ causal mask]) v`` with the warp-specialised kernel.

    Same contract as ``flash_attention.attention`` (``q: [B, H, Nq, D]``, ``k, v: [B, H, Nk, D]``,
    fp16/bf16, contiguous, D in 64 or 128, causal needs Nq == Nk) but forward only (no autograd)
    and, on a GPU, Hopper only. Experimental: ``flash_attention.attention`` is the default.
    ``warp_specialize=False`` runs the same kernel and tiles without the pass (see UNSAFE_ENV for
    why a GPU refuses the pass for now).
    """
    scale = fa._check(q, k, v, causal, sm_scale)
    _check_hopper(q, k, v)
    return _forward_ws(q, k, v, causal, scale, warp_specialize)[0]


def attention_ws_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
    warp_specialize: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_ws`` plus the natural-log log-sum-exp of each row's scaled scores,
    ``lse: fp32[B, H, Nq]``, in the convention of ``flash_attention.attention_with_lse`` (what the
    course's backward needs instead of the probabilities)."""
    scale = fa._check(q, k, v, causal, sm_scale)
    _check_hopper(q, k, v)
    o, lse2 = _forward_ws(q, k, v, causal, scale, warp_specialize)
    return o, lse2 / LOG2E


# The references and FLOP counts are the course's.
attention_ref = fa.attention_ref
fwd_flops = fa.fwd_flops


# ----------------------------------------------------------------------------- compile check


def compile_spec(
    causal: bool, block_n: int = 128, num_stages: int = 2, head_dim: int = 128
) -> dict:
    """The sm_90 ahead-of-time spec of one configuration: bf16, BLOCK_M = 128, 4 warps, the pass on
    (tests/test_compile.py compiles these; tests/test_flash_attention_ws.py also reads the asm)."""
    ptr = "*bf16"
    return dict(
        kernel=_attn_fwd_ws_kernel.fn,
        signature={
            "q_ptr": ptr,
            "k_ptr": ptr,
            "v_ptr": ptr,
            "o_ptr": ptr,
            "lse_ptr": "*fp32",
            **fa._SIZES,
        },  # fmt: skip
        constexprs={
            "HEAD_DIM": head_dim,
            "CAUSAL": causal,
            "WARP_SPECIALIZE": True,
            "EVEN_N": False,
            "BLOCK_M": 128,
            "BLOCK_N": block_n,
        },  # fmt: skip
        options={"num_warps": _WS_WARPS, "num_stages": num_stages},
        min_cc=90,  # TMA, wgmma and setmaxnreg exist from Hopper on
    )


COMPILE_SPECS = [compile_spec(False), compile_spec(True)]


def build_evidence(spec: dict, cc: int = 90) -> dict:
    """Compile one spec for ``sm_<cc>`` (no GPU needed; set TRITON_INTERPRET=0 before triton is
    imported) and report what the warp-specialisation pass made of it: whether the TTGIR holds a
    ``ttg.warp_specialize`` op, the PTX's ``setmaxnreg`` requests, threads per program, and counts
    of wgmma and TMA instructions."""
    import re

    from triton.backends.compiler import GPUTarget

    sig = dict(spec["signature"])
    sig.update({k: "constexpr" for k in spec["constexprs"]})
    src = triton.compiler.ASTSource(fn=spec["kernel"], signature=sig, constexprs=spec["constexprs"])
    k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=spec["options"])
    ptx, ttgir = k.asm["ptx"], k.asm["ttgir"]
    regs = r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)"
    return {
        "causal": spec["constexprs"]["CAUSAL"],
        "warp_specialize_op": "ttg.warp_specialize" in ttgir,
        "setmaxnreg": sorted({f"{a}.{n}" for a, n in re.findall(regs, ptx)}),
        "threads": [int(t) for t in re.findall(r"\.reqntid (\d+)", ptx)],
        "wgmma": ptx.count("wgmma.mma_async"),
        "tma_copies": ptx.count("cp.async.bulk.tensor"),
        "shared_bytes": k.metadata.shared,
    }
