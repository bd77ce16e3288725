"""Row-wise ops, vector add, small attention problems and paged decode launched from C++: the host
path PyTorch's own ops take.

A decode step or a small training batch calls a norm or a softmax on a few rows, or attention
on one short sequence, where the kernel takes a few µs and the host's work per call decides the
time. ``kernels.launch.Launcher`` already skips Triton's argument binding; what remains is Python
itself: the checks, the plan lookup, the allocations, and (in the backward) an autograd node
written in Python, which runs on the autograd engine's thread and must take the GIL. Measured on
an H100 host at one row of 4,096 (bf16, host wall time per call,
scripts/gpu/replay_host_probe.py): the RMSNorm forward cost 17.6 µs from Python, 8.8 µs from
here, 13.0 µs as PyTorch's op; a whole backward 139, 86.5 and 105.5 µs.

This module moves that path to C++ (``kernels/cuda/replay.cpp``) without moving any kernel: the
first call of a layout runs the Python path (checks, configuration, Triton compiles), and the op
then hands C++ a *plan*: which tensors to allocate and which compiled kernels to launch with which
parameters, for the forward (with and without the statistics the backward reads) and the
backward. Later calls of that layout go straight to C++, which allocates, launches with
``cuLaunchKernel`` on the current stream, and records a C++ autograd node whose backward never
enters Python. A plan names tensors by *slot*: 0, 1, 2 are the op's inputs (x, weight, bias;
vector add's y sits in slot 1; attention's q, k, v), the others what the plan allocates. An
inference op (paged decode, which no gradient follows) has a plan of one program and as many input
slots as it has inputs (``inference_call``, ``add_inference``). A kernel parameter is a slot's
pointer plus a byte offset, an integer, an fp32, or a null pointer; a launch may be a programmatic
dependent one (``launch_pdl``: the kernel may start while the one before it finishes).

The extension is built on first use (a C++ compile of about a minute, once per machine: torch
caches it). On a CPU, in the interpreter, without a CUDA toolkit, with ``launch.FAST = False``,
or with ``GPU_BRRR_NATIVE=0`` in the environment, every call takes the Python path. A build that
fails warns once and leaves the Python path in place.
"""

from __future__ import annotations

import functools
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import device, launch

# Parameter kinds and allocation kinds: kernels/cuda/replay.cpp reads the same numbers.
PTR, I32, I64, F32, NUL = range(5)
LIKE, NEW, SELECT = range(3)
SAME_DTYPE, FP32 = -1, 0  # a NEW slot's dtype: its source slot's, or fp32
N_SLOTS = 16
# The ops the C++ side keys its plans by (it reads nothing else into them: a new op needs a number
# here, not a change there).
RMS_NORM, LAYER_NORM, SOFTMAX, ADD, ATTENTION, ATTENTION_CAUSAL, PAGED_DECODE = range(7)

ENV = "GPU_BRRR_NATIVE"
NAME = "gpu_brrr_replay"  # the extension's name in torch's build cache
# Set to False to send every call down the Python path again (to measure what this path saves:
# scripts/gpu/norm_bwd_host_probe.py); plans made so far are kept for when it is set back.
ON = True


@dataclass(frozen=True)
class Slot:
    """A kernel argument that is a slot's data pointer, ``offset`` bytes in."""

    index: int
    offset: int = 0


@dataclass(frozen=True)
class Alloc:
    """``slot`` gets a new tensor: ``empty_like(src)`` (LIKE, contiguous), ``empty(shape)`` of
    src's dtype or fp32 on x's device (NEW), or ``src.select(0, index)`` (SELECT)."""

    kind: int
    slot: int
    src: int = 0
    index: int = 0
    dtype: int = SAME_DTYPE
    shape: tuple = ()

    def encode(self) -> list[int]:
        return [self.kind, self.slot, self.src, self.index, self.dtype, *self.shape]


@dataclass
class Step:
    """One launch of a plan: a compiled Triton kernel, its grid, and its run-time arguments in
    signature order (tensors given as ``Slot``)."""

    compiled: object
    grid: tuple
    args: tuple


@dataclass
class Program:
    allocs: list[Alloc]
    steps: list[Step]

    def encode(self) -> tuple[list, list]:
        return [a.encode() for a in self.allocs], [encode_step(s) for s in self.steps]


def _disabled_reason() -> str | None:
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"{ENV}=0"
    if not device.GPU_MODE or device.INTERPRET or torch.version.cuda is None:
        return "no CUDA GPU"
    from kernels import cuda

    return cuda.unavailable_reason()


def _built() -> bool:
    """Whether torch's build cache holds a build of the extension (a guess: it may be stale)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return any(Path(_get_build_directory(NAME, False)).glob(f"{NAME}*.so"))
    except Exception:  # a private helper of torch's: if it moved, say nothing
        return True


@functools.cache
def module():
    """The built extension, or None (this process then keeps the Python path)."""
    reason = _disabled_reason()
    if reason is not None:
        return None
    from torch.utils.cpp_extension import load_inline

    from kernels.cuda import HERE

    try:
        if not _built():
            print("kernels.replay: building the C++ launch path (once per machine, about a minute)")
        return load_inline(
            name=NAME,
            cpp_sources=(HERE / "replay.cpp").read_text(),
            functions=["row_op", "add_plan", "inference_op", "add_inference_plan", "plan_count"],
            with_cuda=True,
            extra_cflags=["-O2"],
            verbose=False,
        )
    except Exception as e:  # a compiler or toolkit problem: keep working, on the Python path
        warnings.warn(
            f"kernels.replay: C++ launch path not built, Python path kept: {e}", stacklevel=2
        )
        return None


def enabled() -> bool:
    """Whether row-wise ops, vector add, small attention problems and paged decode launch from C++
    in this process (building the extension if needed)."""
    return ON and launch.FAST and module() is not None


def wants_grad(*tensors) -> bool:
    """Whether an op's result needs autograd history: grad mode is on and an input requires a
    gradient (anything not a tensor, an absent bias or a bad argument the op's checks will name,
    does not)."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def planning(x: torch.Tensor) -> bool:
    """Whether an op should hand C++ a plan for ``x``'s layout now: the path is on, x is not
    empty and is on the current device (whose binaries the plan holds), and no CUDA graph is
    being captured (loading a binary is not a stream operation capture allows)."""
    return (
        enabled()
        and x.numel() > 0
        and x.device.index == torch.cuda.current_device()
        and not torch.cuda.is_current_stream_capturing()
    )


def build(make_plan, *args) -> None:
    """Run an op's plan builder (``make_plan(*args)`` calls ``add``). A builder that fails (a
    Triton release whose compiled kernels this module does not read, say) turns the C++ path off
    for the process, with one warning, instead of failing the op: its Python path runs on."""
    global ON
    try:
        make_plan(*args)
    except Exception as e:  # noqa: BLE001
        ON = False
        warnings.warn(f"kernels.replay: no plan made ({e!r}); Python path kept", stacklevel=3)


def scale_setting(sm_scale) -> float | None:
    """An attention scale as a plan key's setting: 0 for None (the default scale), a positive
    float or int as itself, None for anything else (a scale C++ could not key exactly, or a bad
    one: such a call takes the Python path, whose checks name what is wrong)."""
    if sm_scale is None:
        return 0.0
    if type(sm_scale) in (float, int) and sm_scale > 0:
        return float(sm_scale)
    return None


def _float_bits(v: float) -> int:
    return struct.unpack("<I", struct.pack("<f", v))[0]


def encode_step(step: Step) -> list[int]:
    """``[function, grid x, y, z, threads, shared bytes, programmatic dependent (0 or 1), (kind,
    slot, value) per parameter]`` for ``replay.cpp``: the parameters Triton's own C launcher would
    pass, in its order (the run-time arguments its signature did not turn into constants, then its
    scratch pointers)."""
    c = step.compiled
    c._init_handles()
    meta = c.metadata
    if getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", False):
        raise NotImplementedError("replay: clusters and cooperative launches are not replayed")
    types = list(c.src.signature.values())
    params = []
    for ty, a in zip(types, step.args):
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            if not isinstance(a, Slot):
                raise TypeError(f"replay: pointer parameter given {a!r}, not a Slot")
            params += [PTR, a.index, a.offset]
        elif ty in ("i1", "i8", "i16", "i32", "u1", "u8", "u16", "u32"):
            params += [I32, 0, int(a)]
        elif ty in ("i64", "u64"):
            params += [I64, 0, int(a)]
        elif ty == "fp32":
            params += [F32, 0, _float_bits(float(a))]
        else:
            raise NotImplementedError(f"replay: parameter type {ty} is not replayed")
    if any(ty != "constexpr" for ty in types[len(step.args) :]):
        raise TypeError("replay: fewer arguments than the kernel's run-time parameters")
    # Triton's scratch buffers (none for these kernels): one pointer each in its launcher's order.
    for name in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(meta, name):
            if getattr(meta, name):
                raise NotImplementedError("replay: kernels that need scratch memory")
            params += [NUL, 0, 0]
    grid = tuple(step.grid) + (1,) * (3 - len(step.grid))
    pdl = int(bool(getattr(meta, "launch_pdl", False)))
    return [c.function, *grid, meta.num_warps * 32, meta.shared, pdl, *params]


def materialize(allocs: list[Alloc], slots: list) -> None:
    """Python's copy of what ``replay.cpp`` allocates, on ``slots`` (a list of N_SLOTS): the
    tensors the plan's kernels are compiled with, so that each binary's pointer alignment is the
    one it will see."""
    x = slots[0]
    for a in allocs:
        if a.kind == LIKE:
            slots[a.slot] = torch.empty_like(slots[a.src], memory_format=torch.contiguous_format)
        elif a.kind == NEW:
            dtype = slots[a.src].dtype if a.dtype == SAME_DTYPE else torch.float32
            slots[a.slot] = torch.empty(a.shape, dtype=dtype, device=x.device)
        else:
            slots[a.slot] = slots[a.src].select(0, a.index)


def compiled_step(kernel, args: tuple, slots: list, grid: tuple, meta: dict) -> Step:
    """One launch of a plan: ``kernel`` (a ``@triton.jit`` function) compiled for the slots'
    tensors (``warmup`` compiles, or finds the binary the Python path compiled, without running)."""
    return Step(kernel.warmup(*real(args, slots), grid=grid, **meta), grid, args)


def real(args: tuple, slots: list) -> tuple:
    """``args`` with each Slot replaced by a tensor whose data pointer is the one it names."""
    out = []
    for a in args:
        if isinstance(a, Slot):
            t = slots[a.index]
            if a.offset:
                t = t.flatten()[a.offset // t.element_size() :]
            out.append(t)
        else:
            out.append(a)
    return tuple(out)


def call(op: int, x, w, b, setting: float):
    """The op's output from C++ if a plan for this layout exists, else None. Arguments C++ cannot
    take (not tensors) also give None: the Python path then says what is wrong with them."""
    m = module()
    if m is None or not (ON and launch.FAST):
        return None
    try:
        return m.row_op(op, x, w, b, setting)
    except TypeError:
        return None


def add(op: int, x, w, b, setting: float, fwd: Program, nograd: Program, bwd: Program,
        y_slot: int, dy_slot: int, saved: list[int], grads: list[int]) -> None:  # fmt: skip
    """Hand C++ the plan for the layout of (x, w, b, setting)."""
    module().add_plan(
        op, x, w, b, float(setting), *fwd.encode(), *nograd.encode(), *bwd.encode(),
        y_slot, dy_slot, saved, grads,
    )  # fmt: skip


def inference_call(op: int, inputs: tuple, setting: float):
    """An inference op's output from C++ if a plan for the layout of ``inputs`` exists, else None
    (as ``call``)."""
    m = module()
    if m is None or not (ON and launch.FAST):
        return None
    try:
        return m.inference_op(op, inputs, setting)
    except TypeError:
        return None


def add_inference(op: int, inputs: tuple, setting: float, prog: Program, y_slot: int) -> None:
    """Hand C++ the plan of an inference op for the layout of ``inputs`` (slots 0, 1, ...)."""
    module().add_inference_plan(op, inputs, float(setting), *prog.encode(), y_slot)
