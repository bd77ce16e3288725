"""A tensor-core matmul in Triton: tiles, grouped program order, tuned launch configurations, and on
Hopper a persistent kernel that moves tiles with TMA.

``matmul(a, b)`` computes ``a @ b`` for fp16/bf16 ``a[M, K]``, ``b[K, N]`` with fp32 accumulation, for
any strides: ``matmul(x, w.t())``, the way a model applies a ``[N, K]`` weight, reads the weight in
place. Each program computes a BLOCK_M x BLOCK_N tile of C, walking K in BLOCK_K steps; ``tl.dot``
lowers to the GPU's matrix instructions (``mma`` on Ampere/Ada, ``wgmma`` on Hopper; none on Turing's
``sm_75`` compile of bf16, which falls back to FMA-based code and is correct but slow).

Per tile it reads (BLOCK_M + BLOCK_N) * K values and does 2 * BLOCK_M * BLOCK_N * K FLOPs, so the
intensity against global memory grows with the tile: that is the whole point of tiling. Programs
are numbered in *groups* of GROUP_M row-tiles so that programs running at the same time share
column panels of B (and row panels of A) in L2. With few rows (M <= 64: decoding, small batches)
the time is the weight stream, so the tiles are short in M and narrow in N: more programs share the
stream, each with several K steps in flight.

The launcher picks a configuration once per (rows bucket, N, K, dtype, strides, alignment) by timing
the candidates (compiled concurrently), caches it, and afterwards launches the compiled kernel
directly: a cached call costs a key, a lookup and the launch.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import _validate, bench, device, launch, roofline

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
_DTYPES = frozenset(SUPPORTED_DTYPES)
ALIGN = 8  # elements of a 16-bit dtype in 16 bytes: one vector load, and TMA's unit of alignment
GROUP_M = 8


class _Config(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_stages: int
    num_warps: int


def _configs(rows: int) -> list[_Config]:
    """The candidate tiles for a product with ``rows`` rows (M)."""
    if device.INTERPRET:  # the interpreter runs one configuration, programs one by one: small tiles
        return [_Config(32, 32, 32, 1, 4)]
    if rows <= 64:
        # Few rows: the weights' bytes bound the time. Narrow N tiles give enough programs to
        # keep every SM streaming; deep K tiles keep several 8-32 KB loads in flight per program.
        shapes = [
            (16, 32, 256, 4, 4),
            (16, 64, 256, 3, 4),
            (16, 64, 128, 5, 4),
            (16, 128, 128, 4, 4),
            (32, 64, 128, 4, 4),
            (64, 64, 128, 4, 4),
            (64, 128, 64, 4, 4),
            # 33-64 rows in one row tile, so that B is read once, and N in 32-wide tiles, so that
            # N = 4,096 still makes 128 programs. On an H100 the candidates above left 64 x 4,096 x
            # 4,096 at 0.89x cuBLAS (16 x 64 tiles: B read by four row tiles) and 64 x 14,336 x
            # 4,096 at 0.90x (64 x 64 tiles: 64 programs) in the 2026-12-06 sweep.
            (64, 32, 128, 5, 4),
            (64, 32, 256, 3, 4),
        ]
    else:
        shapes = [
            (128, 256, 64, 3, 8),
            (256, 128, 64, 3, 8),
            # Four stages of 128 x 256 fit the TMA kernel's shared memory only since its epilogue
            # stores half a tile at a time: 4096^3 bf16 at 1.01x cuBLAS where three stages made
            # 0.99x, 1000 x 4096 x 11008 at 1.11x (1.09x)
            # (results/profiles/2026-12-06-nvidia-h100-80gb-hbm3-matmul-split-epilogue.txt).
            (128, 256, 64, 4, 8),
            (256, 128, 64, 4, 8),
            (128, 128, 64, 4, 8),
            (128, 128, 64, 4, 4),
            (128, 64, 64, 4, 4),
            (64, 128, 64, 4, 4),
            (128, 128, 128, 3, 8),
            (64, 64, 64, 4, 4),
            # Five stages for few tiles (M = 512: 128 x 128 tiles are one wave on an H100): 496-713
            # TFLOP/s where the 4-stage tile made 457-653
            # (results/profiles/2026-11-27-nvidia-h100-80gb-hbm3-matmul-pitch.txt).
            (128, 128, 64, 5, 4),
        ]
    return [_Config(*s) for s in shapes if s[0] <= max(16, launch.next_power_of_2(rows))]


@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Grouped order: walk GROUP_M row-tiles down a column of tiles before moving right, so the
    # programs in flight reuse the same panels of A and B from L2.
    tiles_per_group = GROUP_M * num_pid_n
    first_m = (tile_id // tiles_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile_id % tiles_per_group) % group_rows
    pid_n = (tile_id % tiles_per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _multiple_of(x, ALIGN: tl.constexpr):
    # The JIT marks an integer argument as a multiple of 16 when it is one, and nothing less: with
    # K = 5000 or N = 3000 (multiples of 8) it knows nothing, so every load is 2 bytes wide and
    # none can be asynchronous. The launcher passes ALIGN = 8 only when x is a multiple of 8;
    # x // 8 * 8 is then x itself, and says so to the compiler. A stride of 1 arrives as a
    # compile-time constant (the JIT specialises it) and is left alone.
    if ALIGN > 1:
        if not isinstance(x, int):
            x = x // ALIGN * ALIGN
    return x


@triton.jit
def _matmul_kernel(
    # pointers
    a_ptr,
    b_ptr,
    c_ptr,
    # sizes
    M,
    N,
    K,
    # strides
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    ALIGN: tl.constexpr,  # 8: N, K and every stride other than 1 are multiples of 8; else 1
):
    N = _multiple_of(N, ALIGN)
    K = _multiple_of(K, ALIGN)
    stride_am = _multiple_of(stride_am, ALIGN)
    stride_ak = _multiple_of(stride_ak, ALIGN)
    stride_bk = _multiple_of(stride_bk, ALIGN)
    stride_bn = _multiple_of(stride_bn, ALIGN)
    stride_cm = _multiple_of(stride_cm, ALIGN)
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    # Rows/columns past the edge wrap around (modulo) instead of being masked: the loads stay
    # unconditional and the wrapped results are dropped by the masked store.
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :].to(tl.int64) * stride_bn
    # fp32 accumulator: 16-bit products summed over K would lose the low bits.
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K  # the last K step may be partial: mask it with zeros
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _matmul_tma_persistent_kernel(
    # TMA descriptors: the copy engine moves whole tiles between global and shared memory
    a_desc,
    b_desc,
    c_desc,
    # sizes
    M,
    N,
    K,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr,
    A_T: tl.constexpr,  # a_desc describes A^T ([K, M], rows contiguous): A was a transposed view
    B_T: tl.constexpr,  # b_desc describes B^T ([N, K]): B was a transposed view, e.g. w.t()
):
    # Persistent: one program per SM loops over output tiles, so there is no tail wave of programs
    # and the next tile's loads can be issued while the current one finishes (flatten=True lets the
    # compiler pipeline across the tile boundary).
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_SMS, flatten=True):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            # Out-of-bounds parts of a tile are zero-filled by the TMA unit itself. A transposed
            # operand is loaded as stored and transposed in shared memory, which wgmma reads
            # either way round.
            if A_T:
                a = a_desc.load([ki * BLOCK_K, pid_m * BLOCK_M]).T
            else:
                a = a_desc.load([pid_m * BLOCK_M, ki * BLOCK_K])
            if B_T:
                b = b_desc.load([pid_n * BLOCK_N, ki * BLOCK_K]).T
            else:
                b = b_desc.load([ki * BLOCK_K, pid_n * BLOCK_N])
            acc = tl.dot(a, b, acc)
        # The tile goes out in two halves along N (c_desc's block is BLOCK_N / 2 wide): half the
        # shared memory for staging the output, which leaves room for a fourth stage of operand
        # tiles at 128 x 256 (``_configs``).
        acc = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
        c0, c1 = tl.split(acc)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], c0.to(c_desc.dtype))
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], c1.to(c_desc.dtype))


# ----------------------------------------------------------------------------- launcher


class _Plan(NamedTuple):
    """One way to launch a product: which kernel, its tile, and how to read the operands."""

    tma: bool
    cfg: _Config
    align: int  # ALIGN of the plain kernel
    a_t: bool  # TMA: describe A by its transpose (A's first dimension has unit stride)
    b_t: bool
    sms: int = 0  # TMA: programs of the persistent grid, one per SM
    compiled: object = None  # the compiled kernel, launched directly once chosen
    pitch_b: bool = False  # copy B first into rows that start every 128 bytes (``pitched``)


_PLANS: dict[tuple, _Plan] = {}  # the chosen plan per case (see matmul's key)
TIMINGS: dict[tuple, list[tuple[_Plan, float]]] = {}  # every candidate's median ms, per case
TUNE = True  # False: take the first candidate untimed (one compile per case; the GPU tests do)
_TMA_CAPABLE: dict[int, bool] = {}


def _tma_capable(index: int) -> bool:
    if index not in _TMA_CAPABLE:
        props = torch.cuda.get_device_properties(index)
        # GPU_BRRR_FORCE_CAPS=no-tma (a T4 rehearsal) takes the plain kernel on a Hopper too.
        forced = "tma" in device.forced_off()
        _TMA_CAPABLE[index] = torch.version.hip is None and props.major >= 9 and not forced
    return _TMA_CAPABLE[index]


def _tma_layout(t: torch.Tensor, stride0: int, stride1: int) -> bool | None:
    """How TMA can read ``t``: False (rows contiguous), True (columns contiguous: describe t.T), or
    None (it cannot: TMA needs a 16-byte-aligned base, a unit stride and 16-byte-aligned rows)."""
    if t.data_ptr() % 16:
        return None
    if stride1 == 1 and stride0 % ALIGN == 0:
        return False
    if stride0 == 1 and stride1 % ALIGN == 0:
        return True
    return None


# B's rows (of its contiguous dimension) at a pitch that is not a multiple of 128 bytes cost both
# kernels 30-40% on an H100 at 4000 x 3000 x 5000 (K = 5000, N = 3000: rows of 6,000 bytes): with
# B's rows padded to 128-byte multiples the TMA kernel went from 0.70x to 0.98x cuBLAS. A padded
# copy of B costs a read and a write of B, which pays only when M is large; from this many rows of A
# on, the tuner also times every large tile with a padded copy of B made on each call, and keeps it
# only if it wins (results/profiles/2026-11-27-nvidia-h100-80gb-hbm3-matmul-pitch.txt).
PITCH_BYTES = 128
PITCH_MIN_ROWS = 2048


def _leading(t: torch.Tensor) -> tuple[bool, int] | None:
    """(whether 2-D ``t`` is column-contiguous, the elements between the starts of the rows of its
    contiguous dimension), or None when neither dimension has unit stride."""
    s0, s1 = t.stride()
    if s1 == 1:
        return False, s0
    return (True, s1) if s0 == 1 else None


def _padded(n: int, t: torch.Tensor) -> int:
    """``n`` elements of ``t``'s dtype rounded up to a multiple of ``PITCH_BYTES``."""
    per = PITCH_BYTES // t.element_size()
    return -(-n // per) * per


def pitched(t: torch.Tensor) -> torch.Tensor:
    """A copy of 2-D ``t`` with the same values and orientation (row- or column-contiguous)
    whose rows of the contiguous dimension start every ``PITCH_BYTES`` bytes (the padding is never
    read)."""
    transposed = (_leading(t) or (False, 0))[0]
    r = t.t() if transposed else t
    out = torch.empty((r.shape[0], _padded(r.shape[1], t)), dtype=t.dtype, device=t.device)
    out = out[:, : r.shape[1]]
    out.copy_(r)
    return out.t() if transposed else out


def _pitch_may_pay(b: torch.Tensor, M: int) -> bool:
    """Whether the tuner should also try a padded copy of B (``PITCH_MIN_ROWS``)."""
    layout = _leading(b)
    return (
        M >= PITCH_MIN_ROWS
        and layout is not None
        and layout[1] * b.element_size() % PITCH_BYTES != 0
    )


def _plain_align(N: int, K: int, strides: tuple[int, ...]) -> int:
    """ALIGN for the plain kernel: 8 when N, K and every stride other than 1 are multiples of 8."""
    if device.INTERPRET:  # the interpreter passes integers as tensors: x // 8 * 8 would apply to 1
        return 1
    ok = all(s == 1 or s % ALIGN == 0 for s in (N, K, *strides))
    return ALIGN if ok else 1


def _descriptor(t: torch.Tensor, transposed: bool, block: tuple[int, int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    if transposed:
        t = t.t()
    return TensorDescriptor(t, [t.shape[0], t.shape[1]], [t.stride(0), 1], list(block))


_current_stream = None


def _launch(plan: _Plan, a, b, c, M: int, N: int, K: int, *, warmup: bool = False):
    """Launch ``plan`` (or with ``warmup``, only compile it and return the compiled kernel)."""
    global _current_stream
    bm, bn, bk, stages, warps = plan.cfg
    compiled = None if warmup else plan.compiled
    tiles = -(-M // bm) * -(-N // bn)
    if plan.pitch_b:
        b = pitched(b)
    if plan.tma:
        grid = (min(plan.sms, tiles), 1, 1)
        a_desc = _descriptor(a, plan.a_t, (bk, bm) if plan.a_t else (bm, bk))
        b_desc = _descriptor(b, plan.b_t, (bn, bk) if plan.b_t else (bk, bn))
        c_desc = _descriptor(c, False, (bm, bn // 2))  # the kernel stores two halves
        kernel = _matmul_tma_persistent_kernel
        args = (a_desc, b_desc, c_desc, M, N, K, bm, bn, bk, GROUP_M, plan.sms, plan.a_t, plan.b_t)
    else:
        grid = (tiles, 1, 1)
        kernel = _matmul_kernel
        args = (a, b, c, M, N, K, *a.stride(), *b.stride(), N, 1, bm, bn, bk, GROUP_M, plan.align)
    if compiled is not None:
        # The direct launch: what kernel[grid](...) does after binding its arguments, which costs
        # more host time than the launch itself. The plan's key pins every property the JIT
        # specialised the compiled kernel on.
        if _current_stream is None:
            _current_stream = triton.runtime.driver.active.get_current_stream
        stream = _current_stream(c.get_device())
        compiled.run(
            *grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args
        )
        return compiled
    meta = {"num_warps": warps, "num_stages": stages}
    if warmup:
        return kernel.warmup(*args, grid=grid, **meta)
    return kernel[grid](*args, **meta)


def _tune(plans: list[_Plan], a, b, c, M: int, N: int, K: int) -> tuple[_Plan, list]:
    """The fastest of ``plans`` on these operands, with its compiled kernel attached, and the
    (plan, median ms) of every candidate that compiled. Untimed (the first candidate) in the
    interpreter, with ``TUNE`` off, and inside a CUDA graph capture, where nothing may be timed."""
    if device.INTERPRET:
        return plans[0], []
    if not TUNE or torch.cuda.is_current_stream_capturing():
        plans = plans[:1]
    compiled = _compile_all(plans, a, b, c, M, N, K)
    ok = [p._replace(compiled=k) for p, k in zip(plans, compiled) if k is not None]
    if not ok:
        raise RuntimeError(f"no matmul configuration compiled for {M}x{N}x{K} {a.dtype}")
    if len(ok) == 1:
        return ok[0], []
    times = [
        triton.testing.do_bench(
            lambda p=p: _launch(p, a, b, c, M, N, K), warmup=5, rep=20, return_mode="median"
        )
        for p in ok
    ]
    # The fastest tile of each launch path: plain or TMA, with or without a padded copy of B.
    fastest: dict[tuple[bool, bool], int] = {}
    for i, p in enumerate(ok):
        kind = (p.tma, p.pitch_b)
        if kind not in fastest or times[i] < times[fastest[kind]]:
            fastest[kind] = i
    # do_bench flushes L2 before every call, which hides a call's host work behind the flush. But
    # a TMA launch builds three descriptors on the host (on an H100 host 20-21 us a launch against
    # the plain kernel's 7: results/profiles/2026-12-07-nvidia-h100-80gb-hbm3-matmul-host.txt), and
    # a pitched one copies B: where the kernel is short the host is the bound. So a path's cost per
    # call is the larger of its kernel time and its whole call's host time; a path with extra host
    # work or memory must also win by 3%.
    cost = {
        i: max(times[i], _host_ms(ok[i], a, b, c, M, N, K))
        * (1.0 if kind == (False, False) else 1.03)
        for kind, i in fastest.items()
    }
    best = min(cost, key=cost.__getitem__)
    return ok[best], list(zip(ok, times))


def _host_ms(plan: _Plan, a, b, c, M: int, N: int, K: int) -> float:
    """Host milliseconds per call of ``matmul`` on ``plan`` (``bench.host_launch_ms``): its prologue
    (the checks and the output's allocation) and the key as well as the launch. Those are the same
    for every plan, but they count against the kernel's time: a launch path that looks cheaper than
    a short kernel alone may not be with them."""

    def call():
        _prologue(a, b)
        _key(a, b, M, N, K, None)
        _launch(plan, a, b, c, M, N, K)

    return bench.host_launch_ms(call)


def _compile_all(plans: list[_Plan], a, b, c, M: int, N: int, K: int) -> list:
    """Compile every plan, several at a time (Triton's compiler releases the GIL); None for a
    configuration that does not fit this GPU (shared memory, registers)."""
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # a Triton without concurrent compilation: one by one
        AsyncCompileMode = None
    if AsyncCompileMode is not None and len(plans) > 1:
        with ThreadPoolExecutor(min(len(plans), os.cpu_count() or 1)) as pool:
            with AsyncCompileMode(pool, ignore_errors=True):
                futures = [_launch(p, a, b, c, M, N, K, warmup=True) for p in plans]
            kernels = [f.result(ignore_errors=True) if hasattr(f, "result") else f for f in futures]
    else:
        kernels = []
        for p in plans:
            try:
                kernels.append(_launch(p, a, b, c, M, N, K, warmup=True))
            except Exception:  # noqa: BLE001 (a configuration too large for this GPU)
                kernels.append(None)
    out = []
    for k in kernels:
        try:
            if k is not None:
                k._init_handles()  # loads the binary: raises if it needs more than the GPU has
        except Exception:  # noqa: BLE001
            k = None
        out.append(k)
    return out


def _check(a, b):
    # One cheap test for the common case; the precise complaint only when it fails.
    try:
        ok = (
            a.dtype in _DTYPES
            and b.dtype is a.dtype
            and a.ndim == 2
            and b.ndim == 2
            and a.shape[1] == b.shape[0]
            and (a.is_cuda and b.is_cuda if device.GPU_MODE else a.is_cpu and b.is_cpu)
            and a.get_device() == b.get_device()
        )
    except AttributeError:
        ok = False
    if not ok:
        _complain(a, b)


def _complain(a, b):
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} must have dtype in (float16, bfloat16), got {t.dtype}")
        if t.ndim != 2:
            raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
        if not (t.is_cuda if device.GPU_MODE else t.is_cpu):
            raise ValueError(f"{name} must be on {device.DEVICE.type}, got {t.device}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a and b do not chain: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    _validate.same("a", a, "b", b, shape=False)


def _prologue(a, b) -> tuple[int, int, int, torch.Tensor]:
    """``matmul``'s work before it picks a plan: the checks and the output; (M, N, K, c)."""
    _check(a, b)
    M, K = a.shape
    N = b.shape[1]
    return M, N, K, a.new_empty(M, N)


def matmul(a: torch.Tensor, b: torch.Tensor, *, persistent: bool | None = None) -> torch.Tensor:
    """``a @ b`` for 2-D fp16/bf16 tensors of one dtype and any strides, fp32 accumulation, output
    (contiguous) in that dtype.

    ``persistent``: True runs the persistent TMA kernel (Hopper+; it needs 16-byte-aligned base
    pointers and rows, a unit stride in one dimension of each operand, and N a multiple of 8) and
    raises ValueError where it cannot; False runs the plain kernel, which takes anything. None
    (default): the faster of the two where TMA applies, else the plain kernel.

    The first call for a new (rows bucket, N, K, dtype, strides, alignment) compiles and times the
    candidate configurations (seconds); later calls launch the chosen one directly. Inside a CUDA
    graph capture a new case takes the first candidate untimed: warm up before capturing.
    """
    M, N, K, c = _prologue(a, b)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    key = _key(a, b, M, N, K, persistent)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(key, a, b, c, M, N, K, persistent)
    _launch(plan, a, b, c, M, N, K)
    return c


def _key(a, b, M: int, N: int, K: int, persistent: bool | None) -> tuple:
    # Everything the compiled kernel was specialised on: rows bucket, sizes, strides, and whether
    # each base pointer is 16-byte aligned (M == 1 and M % 16 == 0 are JIT specialisations too).
    # Rows are bucketed (1, 2-16, 17-32, 33-64, then powers of two) so that a decode batch or a
    # prompt of a new length reuses a tuned choice instead of timing the candidates again.
    rows = M if M == 1 else max(16, launch.next_power_of_2(M))
    return (a.dtype, rows, M == 1, M % 16 == 0, N, K, *a.stride(), *b.stride(),
            a.data_ptr() % 16 == 0, b.data_ptr() % 16 == 0, persistent)  # fmt: skip


def _plan(key: tuple, a, b, c, M: int, N: int, K: int, persistent: bool | None) -> _Plan:
    sam, sak = a.stride()
    sbk, sbn = b.stride()
    a_t = b_t = None
    if device.GPU_MODE and _tma_capable(a.device.index) and N % ALIGN == 0:
        a_t = _tma_layout(a, sam, sak)
        b_t = _tma_layout(b, sbk, sbn)
    tma_ok = a_t is not None and b_t is not None
    if persistent and not tma_ok:
        raise ValueError(
            "persistent=True needs a GPU with TMA (Hopper+), N a multiple of 8, and operands with a "
            "16-byte-aligned base, a unit stride and 16-byte-aligned rows; persistent=None falls "
            "back to the plain kernel"
        )
    configs = _configs(key[1])
    align = _plain_align(N, K, (sam, sak, sbk, sbn))
    plans = []
    if tma_ok and persistent is not False:
        plans += [_Plan(True, cfg, 1, a_t, b_t, launch.sm_count()) for cfg in configs]
    if not persistent:
        plans += [_Plan(False, cfg, align, False, False) for cfg in configs]
    if device.GPU_MODE and _pitch_may_pay(b, M):
        big = [cfg for cfg in configs if cfg.block_m * cfg.block_n >= 128 * 256]
        transposed = _leading(b)[0]  # B[K, N], or B^T's rows of K contiguous
        pitch = _padded(K if transposed else N, b)
        p_align = _plain_align(N, K, (sam, sak, *((1, pitch) if transposed else (pitch, 1))))
        if tma_ok and persistent is not False:
            plans += [_Plan(True, cfg, 1, a_t, b_t, launch.sm_count(), pitch_b=True) for cfg in big]
        if not persistent:
            plans += [_Plan(False, cfg, p_align, False, False, pitch_b=True) for cfg in big]
    plan, TIMINGS[key] = _tune(plans, a, b, c, M, N, K)
    if not torch.cuda.is_available() or not torch.cuda.is_current_stream_capturing():
        _PLANS[key] = plan  # a choice made untimed inside a capture is not kept
    return plan


def matmul_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 reference, cast to the inputs' dtype."""
    return (a.float() @ b.float()).to(a.dtype)


def tma_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the persistent TMA kernel can run ``a @ b`` (see ``matmul``'s ``persistent``)."""
    if not (device.GPU_MODE and _tma_capable(a.device.index) and b.shape[1] % ALIGN == 0):
        return False
    return _tma_layout(a, *a.stride()) is not None and _tma_layout(b, *b.stride()) is not None


def describe(a: torch.Tensor, b: torch.Tensor, *, persistent: bool | None = None) -> str:
    """The configuration ``matmul(a, b, persistent=persistent)`` runs, e.g. 'TMA 128x256x64 w8 s3'
    (tuning it first if this case is new)."""
    matmul(a, b, persistent=persistent)
    return _plan_name(_PLANS[_key(a, b, a.shape[0], b.shape[1], a.shape[1], persistent)])


def _plan_name(p: _Plan) -> str:
    bm, bn, bk, stages, warps = p.cfg
    kind = "TMA" if p.tma else f"plain (ALIGN {p.align})"
    return f"{kind} {bm}x{bn}x{bk} w{warps} s{stages}" + (
        ", B copied to 128-byte rows" if p.pitch_b else ""
    )


COMPILE_SPECS = [
    dict(
        kernel=_matmul_kernel,
        signature={
            "a_ptr": f"*{t}",
            "b_ptr": f"*{t}",
            "c_ptr": f"*{t}",
            **{n: "i32" for n in ("M", "N", "K", "stride_am", "stride_ak", "stride_bk")},
            **{n: "i32" for n in ("stride_bn", "stride_cm", "stride_cn")},
        },
        constexprs={"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "ALIGN": align},
    )
    for t in ("fp16", "bf16")
    for align in (1, 8)
] + [
    dict(
        kernel=_matmul_tma_persistent_kernel,
        signature={
            "a_desc": "tensordesc<bf16[128, 64]>",
            "b_desc": f"tensordesc<bf16[{'256, 64' if b_t else '64, 256'}]>",
            "c_desc": "tensordesc<bf16[128, 128]>",  # half a tile: the epilogue stores two
            **{n: "i32" for n in ("M", "N", "K")},
        },
        constexprs={
            "BLOCK_M": 128,
            "BLOCK_N": 256,
            "BLOCK_K": 64,
            "GROUP_M": 8,
            "NUM_SMS": 132,
            "A_T": False,
            "B_T": b_t,
        },  # fmt: skip
        options={"num_warps": 8, "num_stages": 3},
        min_cc=90,  # TMA exists from Hopper on
    )
    for b_t in (False, True)
]


@bench.register("matmul")
def _bench_matmul(quick: bool) -> list[dict]:
    if not device.GPU_MODE:
        print("matmul benchmark skipped: tensor-core timings need a GPU")
        return []
    dtype = device.preferred_dtype(torch.bfloat16)
    peak = roofline.matmul_peak("bfloat16" if dtype is torch.bfloat16 else "float16")
    shapes = [(4096, 4096, 4096)] if quick else [
        (4096, 4096, 4096), (8192, 8192, 8192), (4000, 3000, 5000), (16, 8192, 8192),
    ]  # fmt: skip
    recs = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        flops = 2 * m * n * k
        cublas = bench.measure(lambda: a @ b, flops=flops)  # noqa: B023
        variants = [("triton", False)] + (
            [("triton-tma-persistent", True)] if tma_applies(a, b) else []
        )
        for name, persistent in variants:
            ours = bench.measure(lambda p=persistent: matmul(a, b, persistent=p), flops=flops)  # noqa: B023
            recs.append(bench.record("matmul", name, (m, n, k), dtype, ours,
                                     baseline=("cublas", cublas), ceiling=(peak.name, peak.value)))  # fmt: skip
        recs.append(bench.record("matmul", "cublas", (m, n, k), dtype, cublas,
                                 ceiling=(peak.name, peak.value)))  # fmt: skip
    return recs
