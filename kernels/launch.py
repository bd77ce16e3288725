"""Launch helpers every kernel module shares: the SM count, occupancy, powers of two, log2(e),
and a fast launch (``Launcher``, ``TunedLauncher``) that skips Triton's per-call argument binding.

One home for each: a kernel module that needs the number of SMs, how many of its programs the GPU
holds at once, or the next power of two imports it from here. The device queries are cached, so a
launcher may call them on every call without paying a driver round trip (about 10 µs each).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
from triton import knobs

from kernels import device

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E), and exp2 is one instruction


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): the size of a ``tl.arange`` that covers n.
    Plain Python, like ``cdiv``: ``triton.next_power_of_2`` is a constexpr function, and calling
    one from the host costs about 2 µs (more on a busy host), several times per launch."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints: what ``triton.cdiv`` computes, without its host-call cost."""
    return -(-a // b)


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


def blocks_per_sm(
    threads: int,
    registers: int,
    shared: int = 0,
    *,
    max_threads: int = 2048,
    max_regs: int = 65536,
    max_smem: int = 167936,
) -> int:
    """How many blocks of ``threads`` threads using ``registers`` registers a thread and ``shared``
    bytes of shared memory one SM holds at once: the fewest allowed by its threads, its registers
    (allocated 8 per thread at a time) and its shared memory (each resident block also reserves
    1 KiB for the system). The limits default to an A100's (64K registers, 2,048 threads and 164
    KiB of shared memory per SM), which an H100 matches or exceeds."""
    regs = -(-max(registers, 1) // 8) * 8 * threads
    fits = [max_threads // threads, max_regs // regs]
    if shared:
        fits.append(max_smem // (shared + 1024))
    return max(min(fits), 1)


def programs_per_sm(compiled) -> int:
    """How many programs of a compiled Triton kernel one SM holds at once (``blocks_per_sm`` with
    the current GPU's limits)."""
    compiled._init_handles()  # loads the binary: fills in n_regs
    props = properties()
    # Older torch builds lack some of these fields: blocks_per_sm's defaults stand in.
    limits = {
        key: getattr(props, field)
        for key, field in (
            ("max_threads", "max_threads_per_multi_processor"),
            ("max_regs", "regs_per_multiprocessor"),
            ("max_smem", "shared_memory_per_multiprocessor"),
        )
        if hasattr(props, field)
    }
    threads = compiled.metadata.num_warps * 32
    return blocks_per_sm(threads, compiled.n_regs, compiled.metadata.shared, **limits)


# Programmatic dependent launch (Hopper on): a kernel launched with ``launch_pdl=True`` may start
# while the kernel before it on the stream still runs, once every program of that one has called
# ``gdc_launch_dependents`` (or exited); it must call ``gdc_wait`` before reading what that kernel
# wrote. Both are no-ops where PDL is off. Triton has them from 3.4; older versions get stand-ins
# and ``pdl_supported()`` says False, so no kernel is compiled with the flag.
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_GDC = True
except ImportError:  # pragma: no cover (Triton < 3.4)

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass

    _HAS_GDC = False

PDL_ENV = "GPU_BRRR_PDL"  # "0" turns programmatic dependent launch off


@functools.cache
def pdl_supported() -> bool:
    """Whether launches here may use programmatic dependent launch: an NVIDIA GPU of compute
    capability 9.0 or more, a Triton that has it, and ``GPU_BRRR_PDL`` not "0"."""
    if not (device.GPU_MODE and _HAS_GDC) or os.environ.get(PDL_ENV) == "0":
        return False
    cap = device.capabilities()
    return cap.vendor == "NVIDIA" and (cap.compute_capability or (0, 0)) >= (9, 0)


def resident_programs(compiled) -> int:
    """How many programs of a compiled Triton kernel the whole GPU holds at once."""
    return programs_per_sm(compiled) * sm_count()


def ptx_as_launched(
    spec: dict,
    unit_strides: tuple[str, ...] = (),
    cc: int = 90,
    sizes: tuple[str, ...] = ("N", "K"),
) -> str:
    """The PTX of an ahead-of-time compile spec (a module's ``COMPILE_SPECS`` entry) as Triton's
    JIT builds it at a real launch: the strides named in ``unit_strides`` become constants 1, and
    every other pointer, stride and the integer arguments named in ``sizes`` are known to be
    multiples of 16 (what the JIT specialises on). A spec compiled without that knowledge can look
    worse than the launched kernel (no vector loads); one compiled with it shows what the GPU will
    run. Needs real JIT functions (TRITON_INTERPRET=0), not a GPU."""
    from triton.backends.compiler import GPUTarget

    fn = spec["kernel"]
    consts = {**spec["constexprs"], **dict.fromkeys(unit_strides, 1)}
    sig = {n: t for n, t in spec["signature"].items() if n not in unit_strides}
    aligned = [n for n in sig if n.endswith("_ptr") or n.startswith("stride") or n in sizes]
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    target = GPUTarget("cuda", cc, 32)
    return triton.compile(src, target=target, options=spec.get("options")).asm["ptx"]


# ----------------------------------------------------------------------------- the fast launch
#
# A decode step calls a norm on one [1, 4096] row, or attention on one query token, where the
# kernel runs for a few µs and everything the host does per call is added to it. Triton's
# ``kernel[grid](...)`` binds every argument, computes its specialisation key, hashes it and looks
# the binary up on every call, and an autotuned kernel adds its own key and dictionary work on top:
# tens of µs on a busy host. ``Launcher`` does that once per distinct call (the exact sizes,
# strides, dtypes, pointer alignment and meta-parameters) and afterwards hands the arguments
# straight to the compiled kernel's C launcher, as torch's own ops do. Setting ``FAST = False``
# sends every launch through Triton's own path again (to measure what the fast path saves:
# scripts/gpu/launch_probe.py).

FAST = True


def aligned(t: torch.Tensor) -> bool:
    """Whether ``t``'s data pointer is 16-byte aligned: Triton compiles a separate binary (with
    vector loads) for aligned pointers, so a ``Launcher`` key holds this bit for every input."""
    return t.data_ptr() % 16 == 0


def call_key(args: tuple, meta: dict) -> tuple:
    """A ``Launcher`` key built from the arguments themselves: each tensor's dtype and alignment,
    each int's and bool's value and type (Triton specialises on ints equal to 1 and multiples of
    16), None as itself, floats by type only (never specialised on), then the meta-parameters.
    Costs a few µs for two dozen arguments; a hot path that knows which of its arguments vary
    builds a shorter key itself."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, aligned(a)))
        elif isinstance(a, float):
            key.append(float)
        elif isinstance(a, bool):  # a bool is an int to Python, not to Triton's signature
            key.append((bool, a))
        else:
            key.append(a)
    return (*key, *sorted(meta.items()))


def layout_key(tensors, *settings) -> tuple | None:
    """The key of a per-layout plan cache (``Plans``): every tensor's shape, strides, dtype, device
    and 16-byte alignment, then ``settings`` (hashable call options). None when an input is not a
    tensor: the caller's checks then say which. Everything Triton specialises a binary on is in
    it, so it also serves as a ``Launcher`` key for launches whose integer arguments follow from
    the layout (fresh outputs are always aligned)."""
    try:
        metas = [(t.shape, t.stride(), t.dtype, t.device, aligned(t)) for t in tensors]
    except (AttributeError, RuntimeError):  # not a tensor, or one without strides (sparse)
        return None
    return (*metas, *settings)


class Plans:
    """A launcher's plans per call layout. A decode step calls each kernel once per layer with the
    same layout, so whatever follows from the layout alone (the structural checks, grid, sizes,
    strides, meta-parameters) is worked out on the layout's first call and looked up after:
    ``plan = plans.get(key)``, then ``plans.put(key, plan)`` once the inputs passed their checks.
    An unhashable setting (a list where an int belongs) is never cached."""

    MAX_PLANS = 4096

    def __init__(self):
        self.plans: dict = {}

    def get(self, key):
        if key is None:
            return None
        try:
            return self.plans.get(key)
        except TypeError:
            return None

    def put(self, key, plan):
        if key is not None:
            if len(self.plans) >= self.MAX_PLANS:
                self.plans.clear()
            try:
                self.plans[key] = plan
            except TypeError:  # unhashable: this layout is planned on every call
                pass
        return plan


class Launcher:
    """Launch a ``@triton.jit`` kernel, skipping Triton's per-call binding once a call was seen.

    ``launcher(key, grid, args, **meta)`` runs ``kernel[grid](*args, **meta)``. ``args`` are the
    kernel's run-time arguments in signature order, ``meta`` its ``tl.constexpr`` parameters and
    launch options (``num_warps``). ``key`` must determine everything Triton specialises a binary
    on: the dtypes of the tensors, the 16-byte alignment of every pointer, the integer arguments
    (their exact values will do) and ``meta`` (``call_key`` builds one); the launcher adds the
    device. ``grid`` is a tuple, or a function of the arguments by name and the meta-parameters
    (the config's included, for ``TunedLauncher``), as Triton calls it; the key must then fix the
    grid too (it does when it holds every int argument). The first call of a key goes through
    Triton (compiling if needed) and keeps the compiled kernel; later calls of that key pass the
    arguments to its C launcher directly. In the interpreter, or with ``FAST = False``, every call
    goes through Triton; Triton settings that change its binaries at run time (``knobs``'
    debug or instrumentation modes) are seen by a key's first call only. Returns Triton's
    compiled kernel (None in the interpreter)."""

    MAX_KEYS = 4096  # distinct calls kept per kernel; past it the cache starts over

    def __init__(self, fn):
        self.fn = fn
        self.cache: dict = {}

    def __call__(self, key, grid, args, **meta):
        if not (device.GPU_MODE and FAST):
            return self.fn[grid](*args, **meta)
        dev = torch.cuda.current_device()
        hit = self.cache.get((dev, key))
        # A profiler's launch hooks (Proton, for one) want Triton's own path and its metadata.
        hooks = knobs.runtime.launch_enter_hook.calls or knobs.runtime.launch_exit_hook.calls
        if hit is None or hooks:
            return self._first(dev, key, grid, args, meta)
        compiled, tail, launch_grid, config = hit
        if config is not None:  # what the autotuner would have set: the config chosen last
            self.fn.best_config = config
        if callable(grid):
            grid = launch_grid  # worked out on the key's first call: the key fixes every size
        try:
            compiled.run(
                grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                torch._C._cuda_getCurrentRawStream(dev), compiled.function,
                compiled.packed_metadata, None, None, None, *args, *tail,
            )  # fmt: skip
        except (TypeError, SystemError):
            # The C launcher refused the arguments (it parses them before launching anything):
            # go through Triton, which compiles for them or raises a clear error.
            del self.cache[(dev, key)]
            return self._first(dev, key, grid, args, meta)
        return compiled

    def _first(self, dev, key, grid, args, meta):
        compiled = self.fn[grid](*args, **meta)
        self._keep(dev, key, compiled, grid, args, meta)
        return compiled

    def _keep(self, dev, key, compiled, grid, args, meta, config=None):
        jit = self._jit()
        if jit is None or compiled is None:
            return  # e.g. @triton.heuristics in between: its values are not in meta; no fast path
        # The C launcher takes every parameter in signature order, constexprs included (it skips
        # them): keep the constexpr values (or their defaults) to append after the run-time args.
        params = jit.params
        assert not any(p.is_constexpr for p in params[: len(args)]), (
            f"{jit.__name__}: run-time arguments must precede the constexpr parameters"
        )
        tail = tuple(meta[p.name] if p.name in meta else p.default for p in params[len(args) :])
        if callable(grid):  # called as Triton calls it: every argument by name, then the meta
            grid = grid({**{p.name: a for p, a in zip(params, args)}, **meta})
        if len(self.cache) >= self.MAX_KEYS:
            self.cache.clear()
        self.cache[(dev, key)] = (compiled, tail, grid, config)

    def _jit(self):
        """The ``@triton.jit`` function whose binaries are kept, or None (no fast path)."""
        return self.fn if hasattr(self.fn, "params") else None


class TunedLauncher(Launcher):
    """A ``Launcher`` for an ``@triton.autotune`` kernel. The first call of a key goes through the
    autotuner (which benchmarks its configs the first time it meets its own tuning key) and keeps
    the binary of the config it chose; later calls of the key launch that binary directly, with
    the config's meta-parameters (``grid`` may be a function of them). A config with a
    ``pre_hook`` is never cached: every such call goes through the autotuner. ``launcher(grid,
    args, **meta)`` builds its key with ``call_key``; ``launcher.fixed(grid, args, **meta)`` runs
    the kernel at the one config ``meta`` names (its tile and warps), skipping the autotuner."""

    def __init__(self, tuner):
        super().__init__(tuner)
        self.plain = Launcher(tuner.fn)

    def __call__(self, grid, args, **meta):
        return super().__call__(call_key(args, meta), grid, args, **meta)

    def fixed(self, grid, args, **meta):
        return self.plain(call_key(args, meta), grid, args, **meta)

    def keyed(self, key, grid, args, **meta):
        """The same launch with a key the caller built (``Launcher``'s rules): a caller that
        caches its own plan per input layout skips ``call_key``'s walk over the arguments."""
        return Launcher.__call__(self, key, grid, args, **meta)

    def _first(self, dev, key, grid, args, meta):
        compiled = self.fn[grid](*args, **meta)
        config = self.fn.best_config
        if config.pre_hook is None:
            self._keep(dev, key, compiled, grid, args, {**meta, **config.all_kwargs()}, config)
        return compiled

    def _jit(self):
        # Over @triton.heuristics (not a jit function) there is no fast path: the heuristics'
        # values depend on arguments the key may not hold.
        return self.fn.fn if hasattr(self.fn.fn, "params") else None


@functools.cache
def tuned(kernel) -> TunedLauncher:
    """The one ``TunedLauncher`` of an ``@triton.autotune`` kernel (made on first use)."""
    return TunedLauncher(kernel)
