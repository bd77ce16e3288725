"""A read-bandwidth probe for the memory hierarchy: how fast can the chip stream a working set of a
given size? Small sets live in L1/L2, large ones stream from HBM; the curve over size shows the cliffs.

One launch reads the whole buffer ``passes`` times and sums it, so the time is dominated by loads,
not by launch overhead, even for a few kilobytes. Work items are dealt out round-robin over an odd
number of programs: with a power-of-two chunk count, each program then reads *different* chunks on
every pass, so an SM's private L1 only helps when the whole buffer fits in it, and the L2 cliff is
not blurred by 132 L1 caches each holding their own slice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import _validate, device
from kernels.launch import cdiv


@triton.jit
def _read_passes_kernel(
    # pointers
    x_ptr,
    partial_ptr,
    # sizes
    n_elements,
    n_chunks,
    total_items,
    n_programs,
    items_per_program,
    # meta-parameters
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    # Work item w reads chunk w % n_chunks; program pid takes items pid, pid + P, pid + 2P, ...
    # (every program runs the same trip count; items past the end are masked off).
    for i in range(0, items_per_program):
        w = pid + i * n_programs
        chunk = (w % n_chunks).to(tl.int64)
        offsets = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = (offsets < n_elements) & (w < total_items)
        acc += tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    # Storing the sum keeps the compiler from dropping the loads, and lets us check the result.
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


def read_passes(x: torch.Tensor, passes: int = 1, *, block: int = 2048) -> torch.Tensor:
    """Read every element of the 1-D tensor ``x`` ``passes`` times; return the fp32 sum of all the
    values read (``passes * x.sum()``), so the probe can be checked like any other kernel."""
    _validate.tensor("x", x, dtypes=(torch.float32, torch.float16, torch.bfloat16), ndim=1)
    if not isinstance(passes, int) or passes < 1:
        raise ValueError(f"passes must be a positive int, got {passes!r}")
    _validate.positive_power_of_two("block", block)
    n = x.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    n_chunks = cdiv(n, block)
    total = n_chunks * passes
    # An odd program count is coprime with a power-of-two chunk count (see the module docstring).
    sms = device.capabilities().sm_count or 4
    n_programs = min(total, 8 * sms - 1)
    partial = torch.empty(n_programs, dtype=torch.float32, device=x.device)
    _read_passes_kernel[(n_programs,)](
        x,
        partial,
        n,
        n_chunks,
        total,
        n_programs,
        cdiv(total, n_programs),
        BLOCK=block,
        num_warps=8,
    )
    return partial.sum()


def read_passes_ref(x: torch.Tensor, passes: int = 1) -> torch.Tensor:
    return x.double().sum().float() * passes


COMPILE_SPECS = [
    dict(
        kernel=_read_passes_kernel,
        signature={
            "x_ptr": "*fp32",
            "partial_ptr": "*fp32",
            "n_elements": "i64",
            "n_chunks": "i64",
            "total_items": "i64",
            "n_programs": "i32",
            "items_per_program": "i32",
        },
        constexprs={"BLOCK": 2048},
    )
]
