"""Vector add: the first Triton kernel, and the course's first memory-bound benchmark.

Per element it reads two values and writes one: 3 x itemsize bytes for one FLOP, an arithmetic
intensity of 1/12 FLOP/byte in fp32, hundreds of times below any GPU's ridge point. Its speed is
therefore set by memory bandwidth alone, and the honest yardstick is the copy bandwidth measured in
the same run (``kernels.roofline.copy_bandwidth``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _validate, bench, device, replay, roofline
from kernels.launch import Launcher, aligned, cdiv, next_power_of_2, sm_count

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Defaults chosen by the BLOCK_SIZE x num_warps sweep in notebooks/01a-gpu-hierarchy.ipynb: large
# blocks give each thread several 16-byte loads in flight; past that the choice barely matters.
DEFAULT_BLOCK_SIZE = 4096
DEFAULT_NUM_WARPS = 4


def default_block_size(n: int, dtype: torch.dtype) -> int:
    """The block ``add`` uses unless told: ``DEFAULT_BLOCK_SIZE`` once there are enough elements
    for a program per SM at that size, else smaller blocks so that a small tensor still spreads over
    the SMs, down to one 16-byte vector a thread. At 65,536 fp32 values the 4,096 block ran 16
    programs on a 132-SM H100, 5.8 µs on the device against torch.add's 5.0
    (results/profiles/2026-12-06-nvidia-h100-80gb-hbm3-slow-cases.txt); 512-value blocks (128
    programs) took 4.9-5.0 µs against 5.0 (-slow-cases-2.txt, the same day)."""
    one_vector = 32 * DEFAULT_NUM_WARPS * 16 // dtype.itemsize
    spread = next_power_of_2(cdiv(n, sm_count(interpreter=4)))
    return min(DEFAULT_BLOCK_SIZE, max(one_vector, spread))


@triton.jit
def _add_kernel(
    # pointers
    x_ptr,
    y_ptr,
    out_ptr,
    # sizes
    n_elements,
    # meta-parameters
    BLOCK_SIZE: tl.constexpr,
):
    # One program instance (≈ one thread block) handles BLOCK_SIZE consecutive elements. The program
    # id is widened to int64 so offsets of tensors past 2**31 elements do not overflow.
    pid = tl.program_id(axis=0).to(tl.int64)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    # The last block runs past the end when n_elements is not a multiple of BLOCK_SIZE.
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    # Add in fp32 whatever the storage type, round once on the store.
    out = x.to(tl.float32) + y.to(tl.float32)
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


_ADD = Launcher(_add_kernel)


def add(
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    block_size: int | None = None,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> torch.Tensor:
    """``x + y`` elementwise for contiguous float32/float16/bfloat16 tensors of the same shape
    (not differentiable: the result has no autograd history). ``block_size`` defaults to
    ``default_block_size`` of the tensors' size."""
    # A layout seen before, on a GPU, at the default launch: launched from C++ (kernels.replay),
    # PyTorch's own host path. Inputs that want a gradient stay here, where the result has none,
    # and leave no plan behind.
    native = block_size is None and num_warps == DEFAULT_NUM_WARPS and not replay.wants_grad(x, y)
    if native:
        out = replay.call(replay.ADD, x, y, None, 0.0)
        if out is not None:
            return out
    _validate.tensor("x", x, dtypes=SUPPORTED_DTYPES)
    _validate.tensor("y", y, dtypes=SUPPORTED_DTYPES)
    _validate.same("x", x, "y", y)
    if block_size is not None:
        _validate.positive_power_of_two("block_size", block_size)
    _validate.positive_power_of_two("num_warps", num_warps)
    if x.is_cuda != device.GPU_MODE:
        raise ValueError(f"x must be on {device.DEVICE.type}, got a tensor on {x.device}")
    out = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return out
    if block_size is None:
        block_size = default_block_size(n, x.dtype)
    # The key fixes what the binary depends on (out is new and aligned); later calls of the same
    # size skip Triton's argument binding (see kernels.launch.Launcher).
    key = (x.dtype, n, block_size, num_warps, aligned(x), aligned(y))
    _ADD(key, (cdiv(n, block_size),), (x, y, out, n), BLOCK_SIZE=block_size,
         num_warps=num_warps)  # fmt: skip
    if native and replay.planning(x):
        replay.build(_native_plan, x, y)
    return out


# Slots of the C++ launch path's plan: the inputs x and y, the output.
_X, _Y, _OUT = 0, 1, 3


def _native_plan(x: torch.Tensor, y: torch.Tensor) -> None:
    """Give kernels.replay this layout's plan (checked inputs only): the launch ``add`` makes at
    the default block (of this size) and warps. The plan's forward with and without a gradient is
    the same; it has no backward (``add`` sends inputs that want a gradient down the Python
    path)."""
    n = x.numel()
    slots = [None] * replay.N_SLOTS
    slots[_X], slots[_Y] = x, y
    out = replay.Alloc(replay.LIKE, _OUT, _X)
    replay.materialize([out], slots)
    block = default_block_size(n, x.dtype)
    grid = (cdiv(n, block),)
    args = (replay.Slot(_X), replay.Slot(_Y), replay.Slot(_OUT), n)
    meta = dict(BLOCK_SIZE=block, num_warps=DEFAULT_NUM_WARPS)
    forward = replay.Program([out], [replay.compiled_step(_add_kernel, args, slots, grid, meta)])
    no_backward = replay.Program([], [])
    # No backward: its gradient slot (_OUT + 1) is never read.
    replay.add(replay.ADD, x, y, None, 0.0, forward, forward, no_backward, _OUT, _OUT + 1,
               [_X], [])  # fmt: skip


def add_ref(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The reference: computed in fp32 by torch, returned in the inputs' dtype."""
    return (x.float() + y.float()).to(x.dtype)


# Signatures for the ahead-of-time compile check (tests compile every kernel for sm_90 and sm_75).
COMPILE_SPECS = [
    dict(
        kernel=_add_kernel,
        signature={"x_ptr": f"*{t}", "y_ptr": f"*{t}", "out_ptr": f"*{t}", "n_elements": "i64"},
        constexprs={"BLOCK_SIZE": 4096},
    )
    for t in ("fp32", "fp16", "bf16")
]


@bench.register("vector_add")
def _bench_vector_add(quick: bool) -> list[dict]:
    copy = roofline.copy_bandwidth()
    sizes = [2**26] if quick else [2**24, 2**26, 2**28]
    dtypes = [torch.float32] if quick else [torch.float32, device.preferred_dtype(torch.bfloat16)]
    if not device.GPU_MODE:
        sizes = [2**16]
    recs = []
    for dtype in dtypes:
        for n in sizes:
            x = torch.randn(n, device=device.DEVICE, dtype=dtype)
            y = torch.randn(n, device=device.DEVICE, dtype=dtype)
            out = torch.empty_like(x)
            nbytes = 3 * n * x.element_size()
            ours = bench.measure(lambda: add(x, y), bytes=nbytes)  # noqa: B023
            base = bench.measure(lambda: torch.add(x, y, out=out), bytes=nbytes)  # noqa: B023
            ceil = ("copy", copy.value)
            recs.append(
                bench.record(
                    "vector_add", "triton", [n], dtype, ours, baseline=("torch", base), ceiling=ceil
                )
            )
            recs.append(bench.record("vector_add", "torch", [n], dtype, base, ceiling=ceil))
    return recs
