"""The GPU / interpreter switch, capability flags and the provenance line of every notebook.

Everything that depends on *where* code runs asks this module: whether a CUDA GPU is present, which
dtypes and features it has, how big a problem to run, and how to describe the machine in a notebook's
first output. Capabilities come from the device itself, never from a hard-coded GPU name.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
from dataclasses import dataclass

import torch
import triton

import kernels  # noqa: F401  (sets TRITON_INTERPRET before triton is imported)

GPU_MODE: bool = torch.cuda.is_available()
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = torch.device("cuda" if GPU_MODE else "cpu")


@dataclass(frozen=True)
class Capabilities:
    """What the current device can do; on CPU every hardware flag is False."""

    name: str
    vendor: str
    compute_capability: tuple[int, int] | None
    sm_count: int
    l2_bytes: int
    memory_bytes: int
    n_gpus: int
    bf16: bool
    fp8: bool
    tensor_cores: bool
    tma: bool

    @property
    def mode(self) -> str:
        if GPU_MODE:
            return "GPU"
        return "CPU interpreter" if INTERPRET else "CPU"


# GPU_BRRR_FORCE_CAPS="no-bf16,no-tma,no-fp8" makes capabilities() report those features as absent
# on any GPU, so one run on an H100 shows every notebook as a T4 (Turing, sm_75) would see it: the
# fallbacks run and say so. "t4" is shorthand for exactly that set. It can only take features away.
FORCE_CAPS_ENV = "GPU_BRRR_FORCE_CAPS"
FORCIBLE = {"no-bf16": "bf16", "no-fp8": "fp8", "no-tma": "tma", "no-tensor-cores": "tensor_cores"}
FORCE_ALIASES = {"t4": ("no-bf16", "no-fp8", "no-tma")}


def parse_forced(spec: str | None) -> frozenset[str]:
    """The Capabilities fields that ``spec`` (the value of GPU_BRRR_FORCE_CAPS) turns off.

    ``spec`` is a comma-separated list of ``no-bf16``, ``no-fp8``, ``no-tma``, ``no-tensor-cores``
    or ``t4``; case and spaces do not matter, an empty value forces nothing. Anything else is a
    ValueError that names the variable and lists what it accepts (a typo must not silently run the
    notebooks with every feature on).
    """
    off: set[str] = set()
    for raw in (spec or "").split(","):
        token = raw.strip().lower()
        if not token:
            continue
        if token in FORCE_ALIASES:
            off.update(FORCIBLE[t] for t in FORCE_ALIASES[token])
        elif token in FORCIBLE:
            off.add(FORCIBLE[token])
        else:
            accepted = ", ".join([*FORCIBLE, *FORCE_ALIASES])
            raise ValueError(
                f"{FORCE_CAPS_ENV}: unknown flag {raw.strip()!r}; accepted: {accepted}"
            )
    return frozenset(off)


def forced_off() -> frozenset[str]:
    """The features this process pretends not to have (from GPU_BRRR_FORCE_CAPS)."""
    return parse_forced(os.environ.get(FORCE_CAPS_ENV))


def apply_forced(cap: Capabilities, off: frozenset[str]) -> Capabilities:
    """``cap`` with the features in ``off`` reported as absent (the device itself is unchanged)."""
    return dataclasses.replace(cap, **{f: False for f in off}) if off else cap


@functools.cache
def capabilities() -> Capabilities:
    """Query the current device (device 0 when several GPUs are present), with the features named
    in GPU_BRRR_FORCE_CAPS turned off. Asked once per process and cached: launchers consult it on
    every call, and a driver query costs about 10 µs."""
    return apply_forced(_query(), forced_off())


def _query() -> Capabilities:
    """What the device reports, before any forcing."""
    if not GPU_MODE:
        return Capabilities(
            name=f"CPU ({platform.processor() or platform.machine()})",
            vendor="none",
            compute_capability=None,
            sm_count=0,
            l2_bytes=0,
            memory_bytes=0,
            n_gpus=0,
            bf16=False,
            fp8=False,
            tensor_cores=False,
            tma=False,
        )
    props = torch.cuda.get_device_properties(0)
    is_amd = torch.version.hip is not None
    cc = (props.major, props.minor)
    return Capabilities(
        name=props.name,
        vendor="AMD" if is_amd else "NVIDIA",
        compute_capability=cc,
        sm_count=props.multi_processor_count,
        l2_bytes=getattr(props, "L2_cache_size", 0),
        memory_bytes=props.total_memory,
        n_gpus=torch.cuda.device_count(),
        # Native bf16 arithmetic arrived with Ampere (8.0). torch.cuda.is_bf16_supported() also says
        # True on a T4 (7.5), where bf16 is emulated and slow: ask the architecture instead.
        bf16=cc >= (8, 0) if not is_amd else torch.cuda.is_bf16_supported(),
        # fp8 tensor-core matmul: Ada (8.9) and Hopper (9.0) onwards on NVIDIA; MI300 (gfx942) on AMD.
        fp8=(cc >= (8, 9)) if not is_amd else "gfx94" in getattr(props, "gcnArchName", ""),
        # Volta (7.0) introduced tensor cores; AMD's matrix cores are there on every CDNA part.
        tensor_cores=cc >= (7, 0) or is_amd,
        # The tensor memory accelerator (bulk async copies) arrived with Hopper.
        tma=(not is_amd) and cc >= (9, 0),
    )


def versions() -> dict[str, str]:
    cuda = torch.version.cuda or (f"HIP {torch.version.hip}" if torch.version.hip else "none")
    return {"torch": torch.__version__.split("+")[0], "triton": triton.__version__, "cuda": cuda}


def describe() -> str:
    """The provenance line printed by every notebook's first cell."""
    cap = capabilities()
    v = versions()
    lines = [f"device : {cap.name}"]
    if GPU_MODE:
        major, minor = cap.compute_capability
        lines.append(
            f"         compute capability {major}.{minor}, {cap.sm_count} SMs, "
            f"L2 {cap.l2_bytes / 2**20:.0f} MiB, memory {cap.memory_bytes / 2**30:.1f} GiB, "
            f"{cap.n_gpus} GPU(s)"
        )
        flags = [f for f in ("bf16", "fp8", "tensor_cores", "tma") if getattr(cap, f)]
        lines.append(
            f"         features: {', '.join(flags) or 'none of bf16/fp8/tensor cores/TMA'}"
        )
    if off := forced_off():
        lines.append(
            f"forced : {FORCE_CAPS_ENV} reports {', '.join(sorted(off))} as absent "
            "(the fallbacks of a GPU without them run)"
        )
    lines.append(f"software: torch {v['torch']}, triton {v['triton']}, CUDA {v['cuda']}")
    if GPU_MODE:
        lines.append("mode   : GPU: real sizes, timings from CUDA events")
    else:
        lines.append(
            "mode   : CPU interpreter (TRITON_INTERPRET=1): small sizes, kernels checked for "
            "correctness; timings are perf_counter on the CPU, NOT GPU numbers"
        )
    return "\n".join(lines)


def pick(gpu, cpu):
    """A problem size (or any setting): the GPU value in GPU mode, the small one otherwise."""
    return gpu if GPU_MODE else cpu


def preferred_dtype(want: torch.dtype = torch.bfloat16) -> torch.dtype:
    """``want`` if the device supports it, else the closest supported 16-bit type (with a note)."""
    if want is torch.bfloat16 and GPU_MODE and not capabilities().bf16:
        print("this GPU has no bf16 support: using float16 instead")
        return torch.float16
    return want


def gpu_slug(name: str | None = None) -> str:
    """A file-name-safe slug of the GPU name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    name = name or capabilities().name
    out = "".join(c.lower() if c.isalnum() else "-" for c in name)
    while "--" in out:
        out = out.replace("--", "-")
    return out.strip("-")


def synchronize() -> None:
    if GPU_MODE:
        torch.cuda.synchronize()
