"""Launch helpers every kernel module shares: the SM count, occupancy, powers of two, log2(e).

One home for each: a kernel module that needs the number of SMs, how many of its programs the GPU
holds at once, or the next power of two imports it from here. The device queries are cached, so a
launcher may call them on every call without paying a driver round trip (about 10 µs each).
"""

from __future__ import annotations

import functools

import torch
import triton

from kernels import device

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E), and exp2 is one instruction


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the size of a ``tl.arange`` that covers n."""
    return triton.next_power_of_2(max(int(n), 1))


@functools.cache
def _properties(index: int):
    return torch.cuda.get_device_properties(index)


def properties():
    """The current CUDA device's properties, cached per device."""
    return _properties(torch.cuda.current_device())


def sm_count(interpreter: int = 1) -> int:
    """The number of SMs of the current GPU; ``interpreter`` on a CPU, where programs run one by one."""
    if not device.GPU_MODE:
        return interpreter
    return properties().multi_processor_count


def programs_per_sm(compiled) -> int:
    """How many programs of a compiled Triton kernel one SM holds at once: the fewest allowed by its
    threads, its registers (allocated 8 per thread at a time) and its shared memory (each resident
    block also reserves 1 KiB for the system)."""
    compiled._init_handles()  # loads the binary: fills in n_regs
    props = properties()
    # Older torch builds lack some of these fields: fall back to an A100's (64K registers, 2,048
    # threads and 164 KiB of shared memory per SM), which an H100 matches or exceeds.
    max_threads = getattr(props, "max_threads_per_multi_processor", 2048)
    max_regs = getattr(props, "regs_per_multiprocessor", 65536)
    max_smem = getattr(props, "shared_memory_per_multiprocessor", 167936)
    threads = compiled.metadata.num_warps * 32
    regs = -(-max(compiled.n_regs, 1) // 8) * 8 * threads
    fits = [max_threads // threads, max_regs // regs]
    if compiled.metadata.shared:
        fits.append(max_smem // (compiled.metadata.shared + 1024))
    return max(min(fits), 1)


def resident_programs(compiled) -> int:
    """How many programs of a compiled Triton kernel the whole GPU holds at once."""
    return programs_per_sm(compiled) * sm_count()


def ptx_as_launched(spec: dict, unit_strides: tuple[str, ...] = (), cc: int = 90) -> str:
    """The PTX of an ahead-of-time compile spec (a module's ``COMPILE_SPECS`` entry) as Triton's
    JIT builds it at a real launch: the strides named in ``unit_strides`` become constants 1, and
    every other pointer, stride, N and K is known to be a multiple of 16 (what the JIT specialises
    on). A spec compiled without that knowledge can look worse than the launched kernel (no vector
    loads); one compiled with it shows what the GPU will run. Needs real JIT functions
    (TRITON_INTERPRET=0), not a GPU."""
    from triton.backends.compiler import GPUTarget

    fn = spec["kernel"]
    consts = {**spec["constexprs"], **dict.fromkeys(unit_strides, 1)}
    sig = {n: t for n, t in spec["signature"].items() if n not in unit_strides}
    aligned = [n for n in sig if n.endswith("_ptr") or n.startswith("stride") or n in ("N", "K")]
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    target = GPUTarget("cuda", cc, 32)
    return triton.compile(src, target=target, options=spec.get("options")).asm["ptx"]
