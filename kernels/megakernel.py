"""A megakernel for a stack of small layers: every layer in one persistent Triton launch.

The workload is a decode-sized MLP stack, ``L`` square layers ``y = act(x @ W_l^T + b_l)`` applied to
a batch of 1 to 16 rows. At that batch a layer is a GEMV: it reads a ``D x D`` weight matrix once and
does two FLOPs per weight. With ``D = 1024`` and bf16 weights a layer is 2 MiB, which an H100 reads
in about a microsecond, so launching one kernel per layer (and a second one for the activation)
spends more time on launches, kernel tails and empty gaps than on moving weights.

``fused_mlp_stack`` runs the whole stack as ONE launch:

- a *persistent* grid of at most one program per SM (so every program is resident at once), each
  program owning a fixed ``BLOCK_N``-column slice of every layer's output;
- between layers a *grid-wide barrier* in global memory: an arrival counter and a generation number
  (a sense-reversing barrier), so the same two integers serve every barrier of every launch without
  being reset from the host;
- activations written to a small scratch buffer (``L x M x D`` elements, under a megabyte) that stays
  in L2; the next layer reads it from there, bypassing L1 (``.cg``), which is not coherent across SMs;
- while a program waits at a barrier it has already issued the loads of its next layer's weights,
  which do not depend on the barrier: the weight stream keeps going across the layer boundary.

Deadlock. A spin barrier is only correct if every program of the grid is resident on the GPU at the
same time: a program spinning on an SM waits for programs that, if they were not yet scheduled,
could never start. The launcher therefore caps the grid at the number of SMs and checks, from the
compiled kernel's registers, shared memory and thread count, that one program fits on an SM. It
cannot know about other kernels running concurrently on other streams (or an MPS/green-context
limit on the SMs it may use): those delay our programs but finish by themselves, so the barrier still
completes; a partition smaller than the grid would not, and the bounded spin then sets a flag
(``barrier_timeouts``) instead of hanging forever. Reading that flag costs a host sync, so the
launcher reads it after every launch only where that is free (the CPU) or asked for (debug mode,
``GPU_BRRR_DEBUG=1``, see ``kernels._validate``): there a timeout raises ``RuntimeError`` rather
than returning wrong activations; elsewhere call ``barrier_timeouts()`` after a run. Two launches must not overlap in time on one
device, because they share the barrier counter; launches on one stream never do.

Tiles. At batch <= 2 each program keeps its whole slice of a layer (BLOCK_N x D weights) in registers
and forms each output row as a broadcast multiply and a reduction (the GEMV form); from 3 rows on, a
16-row ``tl.dot`` over pipelined 128-wide K chunks. (A 16 x 16 ``tl.dot`` over all of K at once spills:
every warp holds its operand's whole K extent.)

Why D = 1024. Eight bf16 layers of 1024 x 1024 are 16 MiB: they fit the H100's 50 MiB L2, so between
back-to-back steps the weights stay on chip and what is measured is launch, boundary and barrier
cost. At D = 2048 (64 MiB) they stream from HBM each step and bandwidth starts to matter; at 4096
(256 MiB) it dominates.

Measured on an H100 SXM (torch 2.11, Triton 3.6), 8 x bf16[1024, 1024], batch 1, steps back to back:
eager PyTorch 211 us, eager in a CUDA graph 43.7 us, ``fused_mlp_stack`` launched from Python 42.5 us
(of which ~26 us is the host: Python and Triton's launch path), the megakernel in a CUDA graph 21.7 us.
The same tiles launched once per layer inside a CUDA graph took 20.6 us: on this GPU a grid barrier
across 128 SMs costs about what a kernel boundary inside a graph does (~2.6 us per layer, work
included). Notebook 08a measures all of these in one run.

Triton's CPU interpreter runs programs one after another, so a barrier across several programs would
spin forever. In interpreter mode the default path is the *layered* one: the same tile code launched
once per layer (``_mlp_layer_kernel``), where the kernel boundary is the barrier. The persistent
kernel itself still runs in the interpreter with a grid of one program (``max_programs=1``), which
exercises its barrier state machine; tests use both.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import _validate, bench, device, roofline
from kernels.launch import (  # sm_count: notebook 08a
    cdiv,
    next_power_of_2,
    programs_per_sm,
    sm_count,
)

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTIVATIONS = {"none": 0, "relu": 1}
MAX_BATCH = 16  # rows are padded to BLOCK_M = 16, the smallest tl.dot tile
BLOCK_M = 16
DEFAULT_BLOCK_K = 128
DEFAULT_NUM_STAGES = 3
# A program keeps its whole slice of a layer in registers when the slice has at most this many
# values per thread (bf16: 32 registers, plus 64 for the fp32 copy the products are formed from).
SLICE_ELEMS_PER_THREAD = 64
TILES = ("auto", "gemv", "dot")
# Up to this many rows the GEMV form (one reduction per row) beats the 16-row tl.dot. Measured on an
# H100 (8 x 1024^2 bf16, in CUDA graphs): GEMV ~22 us at 1 row, +~5 us per extra row; tl.dot ~34 us
# whatever the batch up to 16.
GEMV_MAX_ROWS = 2
MAX_BLOCK_N = 256
# Polls of the generation word before a program gives up on a barrier and raises the timeout flag.
# One poll is an L2 atomic round trip (~0.5 us), so this is about a second: far beyond any real wait.
MAX_POLLS = 1 << 21
# sync buffer words: arrival count, generation, timeout flag (padded to 4 int32)
_SYNC_WORDS = 4


# ----------------------------------------------------------------------------- device code


@triton.jit
def _w_chunk(w_ptr, layer, k0, offs_n, D, BLOCK_K: tl.constexpr):
    # Rows offs_n, columns [k0, k0 + BLOCK_K) of layer `layer`'s D x D weight (row-major, K fastest).
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = w_ptr + layer * D * D + offs_n[:, None] * D + offs_k[None, :]
    mask = (offs_n[:, None] < D) & (offs_k[None, :] < D)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _tile_rows(
    src_ptr,
    w,
    b_ptr,
    dst_ptr,
    layer,
    offs_n,
    M,
    D,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # GEMV form, for a slice that fits in registers: `w` is the program's whole [BLOCK_N, BLOCK_K >= D]
    # slice of the layer, already loaded. Each row of src is one broadcast multiply and one
    # reduction over K: every thread does its share of FMAs, then a shuffle tree sums them. No
    # serial chain of tensor-core steps through one accumulator, which is what a 16 x 16 tl.dot over
    # all of K would be at batch 1.
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < D
    n_ok = offs_n < D
    wf = w.to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + layer * D + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    for m in tl.static_range(BLOCK_M):
        row_ok = m < M
        # .cg: read through L2 only. Another SM wrote these activations, and L1 is not coherent.
        x = tl.load(src_ptr + m * D + offs_k, mask=k_ok & row_ok, other=0.0, cache_modifier=".cg")
        y = tl.sum(wf * x.to(tl.float32)[None, :], axis=1)
        if HAS_BIAS:
            y += bias
        if ACT == 1:
            y = tl.maximum(y, 0.0)
        # Round once to the storage dtype, as an eager layer does when it writes its output.
        tl.store(dst_ptr + m * D + offs_n, y.to(dst_ptr.dtype.element_ty), mask=n_ok & row_ok)


@triton.jit
def _tile_dot(
    src_ptr,
    w_ptr,
    w_first,
    b_ptr,
    dst_ptr,
    layer,
    offs_n,
    M,
    D,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Chunked form, for slices too big for registers: a [16, BLOCK_N] tile accumulated over K by
    # tl.dot (rows of src past M masked to zero, so any M <= 16 rides on one 16-row MMA). The first
    # chunk, `w_first`, was loaded by the caller; the rest stream through a software-pipelined loop.
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = src_ptr + offs_m[:, None] * D
    row_ok = offs_m[:, None] < M
    x = tl.load(
        x_rows + offs_k[None, :],
        mask=row_ok & (offs_k[None, :] < D),
        other=0.0,
        cache_modifier=".cg",
    )
    acc = tl.dot(
        x,
        tl.trans(w_first),
        tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32),
        input_precision=DOT_PRECISION,
    )
    w_rows = w_ptr + layer * D * D + offs_n[:, None] * D
    n_ok = offs_n[:, None] < D
    for k0 in tl.range(BLOCK_K, D, BLOCK_K, num_stages=NUM_STAGES):
        ks = (k0 + offs_k)[None, :]
        w = tl.load(w_rows + ks, mask=n_ok & (ks < D), other=0.0)
        x = tl.load(x_rows + ks, mask=row_ok & (ks < D), other=0.0, cache_modifier=".cg")
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        bias = tl.load(b_ptr + layer * D + offs_n, mask=offs_n < D, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    if ACT == 1:
        acc = tl.maximum(acc, 0.0)
    out_mask = row_ok & (offs_n[None, :] < D)
    tl.store(
        dst_ptr + offs_m[:, None] * D + offs_n[None, :],
        acc.to(dst_ptr.dtype.element_ty),
        mask=out_mask,
    )


@triton.jit
def _layer_tile(
    src_ptr,
    w_ptr,
    b_ptr,
    dst_ptr,
    layer,
    w_first,
    offs_n,
    M,
    D,
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SINGLE_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One program's share of one layer, dst[:, offs_n] = act(src @ W_layer[offs_n]^T + b[offs_n]):
    # it reads BLOCK_N * D weights (its rows of W) and M * D activations, and writes M * BLOCK_N.
    if SINGLE_CHUNK:
        _tile_rows(
            src_ptr, w_first, b_ptr, dst_ptr, layer, offs_n, M, D, HAS_BIAS, ACT, BLOCK_M, BLOCK_K
        )
    else:
        _tile_dot(
            src_ptr,
            w_ptr,
            w_first,
            b_ptr,
            dst_ptr,
            layer,
            offs_n,
            M,
            D,
            HAS_BIAS,
            ACT,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            NUM_STAGES,
            DOT_PRECISION,
        )


@triton.jit
def _barrier_arrive(count_ptr, n_programs):
    # A sense-reversing grid barrier on one counter: count_ptr[0] counts arrivals, count_ptr[1] is
    # the generation. debug_barrier (a CTA-wide bar.sync) makes every thread of this program issue
    # its stores before thread 0 arrives; the arrival is a release, so those stores are visible to
    # whoever acquires the generation bump that completes the barrier.
    tl.debug_barrier()
    # Read the generation BEFORE arriving: it cannot move until this program has arrived.
    gen = tl.atomic_add(count_ptr + 1, 0, sem="acquire")
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if arrived == n_programs - 1:
        # Last to arrive: reset the count for the next barrier, then open this one. The release on
        # the bump orders the reset before any program can arrive at the next barrier.
        tl.atomic_xchg(count_ptr, 0, sem="relaxed")
        tl.atomic_add(count_ptr + 1, 1, sem="release")
    return gen


@triton.jit
def _barrier_wait(count_ptr, gen, timeout_ptr, max_polls):
    # Spin until the generation moves past `gen` (acquire: the other programs' activations are then
    # visible). Bounded: a grid that is not fully resident sets the timeout flag instead of hanging.
    polls = 0
    while (tl.atomic_add(count_ptr + 1, 0, sem="acquire") == gen) & (polls < max_polls):
        polls += 1
    if polls >= max_polls:
        tl.atomic_xchg(timeout_ptr, 1, sem="relaxed")
    tl.debug_barrier()


@triton.jit
def _mlp_stack_kernel(
    # pointers
    x_ptr,
    w_ptr,
    b_ptr,
    act_ptr,
    sync_ptr,
    # sizes
    M,
    D,
    n_layers,
    n_programs,
    max_polls,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SINGLE_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Persistent: program p owns output columns [p * BLOCK_N, (p + 1) * BLOCK_N) of every layer and
    # runs all layers, separated by grid barriers. Per layer the grid reads the D x D weights once and
    # the M x D activations once per program (from L2), and writes M x D activations.
    # sync_ptr: [arrival count, generation, timeout flag].
    pid = tl.program_id(axis=0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    MD = M * D
    w = _w_chunk(w_ptr, 0, 0, offs_n, D, BLOCK_K)
    _layer_tile(
        x_ptr,
        w_ptr,
        b_ptr,
        act_ptr,
        0,
        w,
        offs_n,
        M,
        D,
        HAS_BIAS,
        ACT,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        NUM_STAGES,
        SINGLE_CHUNK,
        DOT_PRECISION,
    )
    for layer in range(1, n_layers):
        gen = _barrier_arrive(sync_ptr, n_programs)
        # Weights do not depend on the barrier: issue this layer's loads while the others arrive.
        w = _w_chunk(w_ptr, layer, 0, offs_n, D, BLOCK_K)
        _barrier_wait(sync_ptr, gen, sync_ptr + 2, max_polls)
        src = act_ptr + (layer - 1) * MD
        dst = act_ptr + layer * MD
        _layer_tile(
            src,
            w_ptr,
            b_ptr,
            dst,
            layer,
            w,
            offs_n,
            M,
            D,
            HAS_BIAS,
            ACT,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            NUM_STAGES,
            SINGLE_CHUNK,
            DOT_PRECISION,
        )


@triton.jit
def _mlp_layer_kernel(
    # pointers
    src_ptr,
    w_ptr,
    b_ptr,
    dst_ptr,
    # sizes
    layer,
    M,
    D,
    # meta-parameters
    HAS_BIAS: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    SINGLE_CHUNK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # One layer, one launch: the same tile code as the persistent kernel, with the kernel boundary
    # as the barrier. This is the interpreter's path and the "layered" baseline on a GPU.
    pid = tl.program_id(axis=0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w = _w_chunk(w_ptr, layer, 0, offs_n, D, BLOCK_K)
    _layer_tile(
        src_ptr,
        w_ptr,
        b_ptr,
        dst_ptr,
        layer,
        w,
        offs_n,
        M,
        D,
        HAS_BIAS,
        ACT,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
        NUM_STAGES,
        SINGLE_CHUNK,
        DOT_PRECISION,
    )


# ----------------------------------------------------------------------------- host code


@functools.cache
def plan(
    d: int,
    m: int,
    max_programs: int,
    *,
    tile: str = "auto",
    num_warps: int | None = None,
    block_k: int = DEFAULT_BLOCK_K,
) -> tuple[int, int, int, bool, int]:
    """(n_programs, BLOCK_N, BLOCK_K, gemv, num_warps) for width ``d`` and ``m`` rows on at most
    ``max_programs`` programs, each owning one BLOCK_N-column slice of every layer.

    ``tile="gemv"``: BLOCK_N is the smallest power of two that covers ``d`` in ``max_programs``
    slices; the program holds its whole slice (BLOCK_N x d, padded to a power of two) in registers,
    at most ``SLICE_ELEMS_PER_THREAD`` values a thread (``num_warps=None``: the fewest of 4, 8, 16
    warps that hold it), loads it in one go (before the barrier, in the persistent kernel) and forms
    each output row as a broadcast multiply and a reduction. ``tile="dot"``: BLOCK_N >= 16 (the
    tl.dot minimum), the slice streams in BLOCK_K chunks through a pipelined 16-row tl.dot
    (``num_warps`` default 4). ``"auto"`` picks gemv for at most ``GEMV_MAX_ROWS`` rows when the
    slice fits, dot otherwise.
    """
    if tile not in TILES:
        raise ValueError(f"tile must be one of {TILES}, got {tile!r}")
    block_n = next_power_of_2(cdiv(d, max_programs))
    slice_elems = block_n * next_power_of_2(d)
    per_warp = 32 * SLICE_ELEMS_PER_THREAD
    fits = [w for w in (4, 8, 16) if slice_elems <= w * per_warp]
    if num_warps is not None:
        fits = [num_warps] if slice_elems <= num_warps * per_warp else []
    if tile == "gemv" or (tile == "auto" and m <= GEMV_MAX_ROWS):
        if fits:
            return cdiv(d, block_n), block_n, next_power_of_2(d), True, fits[0]
        if tile == "gemv":
            raise ValueError(
                f"a {block_n} x {d} weight slice does not fit in registers with "
                f"num_warps={num_warps}: use tile='dot', more programs or more warps"
            )
    block_n = max(16, block_n)
    if block_n > MAX_BLOCK_N:
        raise ValueError(
            f"weights of width {d} need BLOCK_N = {block_n} > {MAX_BLOCK_N} columns per program with "
            f"max_programs={max_programs}: allow more programs"
        )
    block_k = max(16, min(block_k, next_power_of_2(d)))
    return cdiv(d, block_n), block_n, block_k, False, num_warps or 4


# Barrier words per device: [arrival count, generation, timeout flag, pad]. The barrier leaves the
# count at 0 after every use, so one buffer serves every launch and every CUDA-graph replay.
_SYNC: dict[str, torch.Tensor] = {}


def _sync_buffer(dev: torch.device) -> torch.Tensor:
    if dev.type == "cuda" and dev.index is None:  # "cuda" and "cuda:0" must find the same words
        dev = torch.device("cuda", torch.cuda.current_device())
    key = str(dev)
    buf = _SYNC.get(key)
    if buf is None:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "fused_mlp_stack: call it once before CUDA graph capture, so that its barrier "
                "buffer is allocated outside the graph"
            )
        buf = _SYNC[key] = torch.zeros(_SYNC_WORDS, dtype=torch.int32, device=dev)
    return buf


def barrier_state(dev: torch.device | str | None = None) -> dict:
    """The device's barrier words: ``count`` (arrivals: 0 between launches), ``generation``
    (advanced by ``n_layers - 1`` per persistent launch, modulo 2**32) and ``timeout`` (1 if a
    program ever gave up waiting: its launch's output is then wrong). Synchronises."""
    count, generation, timeout, _ = _sync_buffer(
        torch.device(dev) if dev is not None else device.DEVICE
    ).tolist()
    return {"count": count, "generation": generation, "timeout": timeout}


def barrier_timeouts(dev: torch.device | str | None = None) -> bool:
    """True if a persistent launch on ``dev`` ever gave up waiting at a barrier."""
    return barrier_state(dev)["timeout"] != 0


def _raise_on_timeout(sync: torch.Tensor) -> None:
    """Debug mode (``kernels._validate``): after a persistent launch, read the timeout word (a host
    sync) and raise if a program gave up at a barrier; the word is cleared, so the next launch
    starts clean."""
    if sync[2].item() != 0:
        sync[2] = 0
        raise RuntimeError(
            f"fused_mlp_stack: a program of the persistent kernel timed out at a grid barrier "
            f"(after {MAX_POLLS:,} polls): the grid was not all resident at once (another kernel "
            "or a GPU partition held SMs), so the activations returned are wrong. Retry with "
            "persistent=False or a smaller max_programs."
        )


def _check(x, weights, biases, activation):
    _validate.tensor("x", x, dtypes=SUPPORTED_DTYPES, ndim=2)
    _validate.tensor("weights", weights, dtypes=SUPPORTED_DTYPES, ndim=3)
    _validate.same("x", x, "weights", weights, shape=False)
    n_layers, d_out, d_in = weights.shape
    m, d = x.shape
    if n_layers < 1:
        raise ValueError("weights must hold at least one layer, got shape [0, ...]")
    if d_out != d_in or d_in != d:
        raise ValueError(
            f"weights must be [n_layers, D, D] with D = x.shape[1] = {d}, got {tuple(weights.shape)}"
        )
    if weights.numel() >= 2**31:
        raise ValueError(f"weights must have fewer than 2**31 elements, got {weights.numel():,}")
    if m > MAX_BATCH:
        raise ValueError(f"x must have at most {MAX_BATCH} rows (a decode-sized batch), got {m}")
    if biases is not None:
        _validate.tensor("biases", biases, dtypes=SUPPORTED_DTYPES, ndim=2)
        _validate.same("x", x, "biases", biases, shape=False)
        if tuple(biases.shape) != (n_layers, d):
            raise ValueError(
                f"biases must be [n_layers, D] = [{n_layers}, {d}], got {tuple(biases.shape)}"
            )
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")


def _configure(x, m, d, persistent, opts) -> tuple[int, dict]:
    """Check the tuning options and plan one launch configuration."""
    has_bias, activation, max_programs, tile, num_warps, block_k, num_stages = opts
    n_sms = sm_count()
    if max_programs is None:
        max_programs = n_sms
    if not isinstance(max_programs, int) or max_programs < 1:
        raise ValueError(f"max_programs must be a positive int, got {max_programs!r}")
    if persistent and device.GPU_MODE and max_programs > n_sms:
        raise ValueError(
            f"max_programs={max_programs} exceeds the {n_sms} SMs: a persistent grid larger than "
            "what is co-resident deadlocks at its first barrier"
        )
    if num_warps is not None:
        _validate.positive_power_of_two("num_warps", num_warps)
    _validate.positive_power_of_two("block_k", block_k)
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    n_programs, block_n, block_k, gemv, num_warps = plan(
        d, m, max_programs, tile=tile, num_warps=num_warps, block_k=block_k
    )
    if persistent and device.INTERPRET and n_programs > 1:
        raise ValueError(
            f"the persistent kernel needs {n_programs} programs resident at once, but Triton's "
            "interpreter runs programs one after another: its first barrier would spin forever. "
            "Use persistent=False (one launch per layer) or max_programs=1."
        )
    meta = dict(
        HAS_BIAS=has_bias,
        ACT=ACTIVATIONS[activation],
        # The GEMV form loops over the rows it is given; the tl.dot form always pads to 16.
        BLOCK_M=next_power_of_2(m) if gemv else BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        NUM_STAGES=num_stages,
        SINGLE_CHUNK=gemv,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )
    return n_programs, meta


def _check_residency(compiled, n_programs: int, num_warps: int) -> None:
    if programs_per_sm(compiled) * sm_count() < n_programs:
        raise RuntimeError(
            f"one program of the persistent kernel does not fit on an SM ({compiled.n_regs} "
            f"registers x {num_warps * 32} threads, {compiled.metadata.shared} B shared memory): "
            f"its {n_programs} programs could not all be resident. Lower num_warps or block_k."
        )


# Launch configurations already planned (and, for the persistent kernel, checked): key -> plan.
_CONFIGS: dict[tuple, tuple[int, dict]] = {}


def fused_mlp_stack(
    x: torch.Tensor,
    weights: torch.Tensor,
    biases: torch.Tensor | None = None,
    *,
    activation: str = "relu",
    persistent: bool | None = None,
    max_programs: int | None = None,
    tile: str = "auto",
    num_warps: int | None = None,
    block_k: int = DEFAULT_BLOCK_K,
    num_stages: int = DEFAULT_NUM_STAGES,
    return_all: bool = False,
) -> torch.Tensor:
    """``act(... act(act(x @ W_0^T + b_0) @ W_1^T + b_1) ...)`` for ``weights: [L, D, D]``.

    ``x: [M, D]`` with ``M <= 16``; ``biases: [L, D]`` or None; one dtype throughout (fp32, fp16,
    bf16), fp32 accumulation, each layer's output rounded to that dtype.

    ``persistent`` picks the single-launch megakernel (default on a GPU) or one launch per layer
    (default in the interpreter, where a multi-program barrier cannot work). ``max_programs`` caps
    the grid (default and, for the persistent kernel, maximum: the SM count). ``tile``,
    ``num_warps``, ``block_k`` and ``num_stages`` choose the tile form (see ``plan``).
    ``return_all=True`` returns every layer's output, ``[L, M, D]``.
    """
    _check(x, weights, biases, activation)
    n_layers, d = weights.shape[0], weights.shape[2]
    m = x.shape[0]
    if persistent is None:
        persistent = device.GPU_MODE
    acts = torch.empty((n_layers, m, d), device=x.device, dtype=x.dtype)
    if m == 0 or d == 0:
        return acts if return_all else acts[-1]
    has_bias = biases is not None
    b = biases if has_bias else weights  # never read when HAS_BIAS is False
    opts = (has_bias, activation, max_programs, tile, num_warps, block_k, num_stages)
    key = (x.device, x.dtype, d, next_power_of_2(m), persistent, opts)
    cfg = _CONFIGS.get(key)
    if persistent:
        sync = _sync_buffer(x.device)
        if cfg is None:
            cfg = _configure(x, m, d, persistent, opts)
        n_programs, meta = cfg
        args = (x, weights, b, acts, sync, m, d, n_layers, n_programs, MAX_POLLS)
        if key not in _CONFIGS:
            if device.GPU_MODE:
                compiled = _mlp_stack_kernel.warmup(*args, grid=(n_programs,), **meta)
                _check_residency(compiled, n_programs, meta["num_warps"])
            _CONFIGS[key] = cfg
        _mlp_stack_kernel[(n_programs,)](*args, **meta)
        if _validate.check_values(sync):
            _raise_on_timeout(sync)
    else:
        if cfg is None:
            cfg = _CONFIGS[key] = _configure(x, m, d, persistent, opts)
        n_programs, meta = cfg
        src = x
        for layer in range(n_layers):
            _mlp_layer_kernel[(n_programs,)](src, weights, b, acts[layer], layer, m, d, **meta)
            src = acts[layer]
    return acts if return_all else acts[-1]


# ----------------------------------------------------------------------------- references, baselines


def mlp_stack_ref(
    x: torch.Tensor,
    weights: torch.Tensor,
    biases: torch.Tensor | None = None,
    *,
    activation: str = "relu",
    round_each_layer: bool = False,
) -> torch.Tensor:
    """The reference, in fp32 (fp64 for fp32 inputs). ``round_each_layer`` rounds every layer's
    output to ``x.dtype`` as the kernels do, for a tighter comparison."""
    _check(x, weights, biases, activation)
    hi = torch.float64 if x.dtype == torch.float32 else torch.float32
    h = x.to(hi)
    for layer in range(weights.shape[0]):
        h = h @ weights[layer].to(hi).T
        if biases is not None:
            h = h + biases[layer].to(hi)
        if activation == "relu":
            h = torch.relu(h)
        if round_each_layer:
            h = h.to(x.dtype).to(hi)
    return h.to(x.dtype)


def mlp_stack_eager(
    x: torch.Tensor,
    weights: torch.Tensor,
    biases: torch.Tensor | None = None,
    activation: str = "relu",
) -> torch.Tensor:
    """The eager PyTorch baseline: per layer one ``F.linear`` (cuBLAS) and one activation kernel."""
    h = x
    for layer in range(weights.shape[0]):
        h = F.linear(h, weights[layer], None if biases is None else biases[layer])
        if activation == "relu":
            h = torch.relu(h)
    return h


@functools.cache
def compiled_mlp_stack():
    """``torch.compile`` of the eager stack (default mode: Inductor kernels, no CUDA graph)."""
    return torch.compile(mlp_stack_eager, dynamic=False)


def cuda_graph(fn, *args, warmup: int = 3):
    """Capture ``fn(*args)`` in a CUDA graph and return ``replay()``, which re-runs it with one
    launch and returns the (static) output tensor. ``args`` are the static inputs: copy new data into
    them to change what the next replay computes. The output buffer is overwritten by each replay."""
    if not device.GPU_MODE:
        raise RuntimeError("CUDA graphs need a CUDA device")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (allocations, autotuning, compilation) off the graph
        for _ in range(warmup):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)

    def replay():
        graph.replay()
        return out

    replay.graph = graph
    return replay


def make_weights(
    n_layers: int,
    d: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    dev: torch.device | str | None = None,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """He-initialised ``weights: [L, D, D]`` and small ``biases: [L, D]``: with ReLU the activations
    keep their scale through the stack, so a many-layer comparison tests every layer."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_layers, d, d, generator=g) * (2.0 / d) ** 0.5
    b = torch.randn(n_layers, d, generator=g) * 0.1
    dev = dev if dev is not None else device.DEVICE
    return w.to(dev, dtype).contiguous(), b.to(dev, dtype).contiguous()


def weight_bytes(n_layers: int, d: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of weights one forward pass must read: the stack's memory floor."""
    return n_layers * d * d * torch.tensor([], dtype=dtype).element_size()


# Signatures for the ahead-of-time compile check (tests compile every kernel for sm_90 and sm_75):
# both tile forms, the GEMV one as planned for D = 1024 at batch 1 on a 132-SM GPU.
_SINGLE = dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=1024, SINGLE_CHUNK=True)
_CHUNKED = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, SINGLE_CHUNK=False)
_SIGNATURES = {
    _mlp_stack_kernel: [
        "x_ptr",
        "w_ptr",
        "b_ptr",
        "act_ptr",
        "sync_ptr",
        "M",
        "D",
        "n_layers",
        "n_programs",
        "max_polls",
    ],
    _mlp_layer_kernel: ["src_ptr", "w_ptr", "b_ptr", "dst_ptr", "layer", "M", "D"],
}
COMPILE_SPECS = [
    dict(
        kernel=kernel,
        signature={
            n: ("*i32" if n == "sync_ptr" else f"*{t}") if n.endswith("_ptr") else "i32"
            for n in names
        },
        constexprs=dict(HAS_BIAS=True, ACT=1, NUM_STAGES=3, DOT_PRECISION="tf32", **form),
        options={"num_warps": 4},
    )
    for kernel, names in _SIGNATURES.items()
    for t, form in (("bf16", _SINGLE), ("bf16", _CHUNKED), ("fp16", _SINGLE))
]


@bench.register("megakernel")
def _bench_megakernel(quick: bool) -> list[dict]:
    """An 8-layer stack at batch 1, every variant in the same run: eager PyTorch, eager in a CUDA
    graph, one Triton launch per layer, the megakernel, and the megakernel in a CUDA graph."""
    n_layers = 8
    dims = [1024] if quick else [1024, 2048]
    if not device.GPU_MODE:
        dims, n_layers = [64], 2
    dtype = device.preferred_dtype(torch.bfloat16) if device.GPU_MODE else torch.float32
    copy = roofline.copy_bandwidth()
    recs = []
    for d in dims:
        w, b = make_weights(n_layers, d, dtype=dtype)
        x = torch.randn(1, d, device=device.DEVICE, dtype=dtype)
        nbytes = weight_bytes(n_layers, d, dtype)
        # Back-to-back steps without an L2 flush: a flush between steps would hide the host's launch
        # time behind the flush kernel, and launch time is exactly what is being measured here.
        kw = dict(bytes=nbytes, flush_l2=False)
        fns = {
            "eager": lambda: mlp_stack_eager(x, w, b),  # noqa: B023
            "layered": lambda: fused_mlp_stack(x, w, b, persistent=False),  # noqa: B023
            "megakernel": lambda: fused_mlp_stack(x, w, b),  # noqa: B023
        }
        if device.GPU_MODE:
            fns["cuda_graph"] = cuda_graph(mlp_stack_eager, x, w, b)
            fns["megakernel_graph"] = cuda_graph(fused_mlp_stack, x, w, b)
        variants = {name: bench.measure(fn, **kw) for name, fn in fns.items()}
        shape = [n_layers, 1, d]
        ceil = ("copy", copy.value)
        for name, m in variants.items():
            base = ("eager", variants["eager"]) if name != "eager" else None
            recs.append(
                bench.record("mlp_stack", name, shape, dtype, m, baseline=base, ceiling=ceil)
            )
        if "cuda_graph" in variants:
            recs.append(
                bench.record(
                    "mlp_stack",
                    "megakernel_graph_vs_graph",
                    shape,
                    dtype,
                    variants["megakernel_graph"],
                    baseline=("cuda_graph", variants["cuda_graph"]),
                    ceiling=ceil,
                )
            )
    return recs
