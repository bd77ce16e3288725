"""GPU specifications from ``hardware.yaml``: one table, every figure with the bib key of its source."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

HARDWARE_YAML = Path(__file__).with_name("hardware.yaml")
FIGURES = (
    "sm_count",
    "l2_mb",
    "memory_gb",
    "mem_bw_gbps",
    "tflops_float32",
    "tflops_tf32",
    "tflops_float16",
    "tflops_bfloat16",
    "tflops_fp8",
    "tflops_fp4",
)


@dataclass(frozen=True)
class GPUSpec:
    key: str
    vendor: str
    architecture: str
    year: int
    compute_capability: str | None
    match: tuple[str, ...]
    figures: dict[str, tuple[float | None, str]]  # name -> (value, bib key)

    def get(self, figure: str) -> float | None:
        """The value of ``figure`` or None when the source does not publish it."""
        if figure not in FIGURES:
            raise KeyError(f"unknown figure {figure!r}; known: {FIGURES}")
        return self.figures.get(figure, (None, ""))[0]

    def source(self, figure: str) -> str | None:
        return self.figures[figure][1] if figure in self.figures else None

    def ridge_point(self, dtype: str = "bfloat16") -> float | None:
        """FLOP per byte at which the datasheet roof turns from memory- to compute-bound."""
        tf, bw = self.get(f"tflops_{dtype}"), self.get("mem_bw_gbps")
        return tf * 1e12 / (bw * 1e9) if tf and bw else None


@functools.lru_cache(maxsize=1)
def load() -> dict[str, GPUSpec]:
    raw = yaml.safe_load(HARDWARE_YAML.read_text())
    specs = {}
    for key, d in raw.items():
        figures = {}
        for name, pair in d["figures"].items():
            if name not in FIGURES:
                raise ValueError(f"{key}: unknown figure {name!r}")
            value, source = pair
            figures[name] = (value, source)
        specs[key] = GPUSpec(
            key=key,
            vendor=d["vendor"],
            architecture=d["architecture"],
            year=d["year"],
            compute_capability=d.get("compute_capability"),
            match=tuple(d["match"]),
            figures=figures,
        )
    return specs


def lookup(device_name: str) -> GPUSpec | None:
    """The spec whose ``match`` strings best fit a device name (the longest match wins, so
    'NVIDIA H100 PCIe' picks H100-PCIe, not H100-SXM); None for an unknown GPU or a CPU."""
    best, best_len = None, 0
    for spec in load().values():
        for m in spec.match:
            # Whole words only: "A10" must not claim an A10G or an A100, nor "L4" an L40S.
            if re.search(rf"\b{re.escape(m)}\b", device_name, re.IGNORECASE) and len(m) > best_len:
                best, best_len = spec, len(m)
    return best


def for_device() -> GPUSpec | None:
    from kernels import device

    return lookup(device.capabilities().name) if device.GPU_MODE else None
