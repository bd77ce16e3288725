"""GPU specifications from ``hardware.yaml``: one table, every figure with the bib key of its source.

Besides the numeric figures, each GPU lists the input formats its matrix units multiply
(``matrix_formats``) and its data-movement / matrix-instruction machinery (``features``), again each
with a source, so Act 1.5 can draw "what changed between generations" from data, not from prose.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
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
# Input formats of the matrix units, from widest to narrowest (fp8 = e4m3/e5m2, fp6 = e2m3/e3m2,
# fp4 = e2m1; kernels/numerics.py has their bit layouts).
MATRIX_FORMATS = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "fp6", "fp4", "int8", "int4")
# Data-movement and matrix-instruction features, in roughly the order they arrived.
FEATURES = {
    "warp_mma": "warp-level tensor-core MMA (wmma, mma.sync)",
    "sparsity": "2:4 structured sparsity in the matrix units",
    "cp_async": "async global-to-shared copies (cp.async)",
    "tma": "Tensor Memory Accelerator: bulk async tensor copies",
    "clusters": "thread block clusters, distributed shared memory",
    "wgmma": "warpgroup async MMA reading shared memory (wgmma)",
    "tcgen05": "single-thread-issued MMA, SM pairs (tcgen05.mma)",
    "tmem": "tensor memory: accumulators off the register file",
    "block_scaling": "block-scaled fp8/fp6/fp4 MMA (MXFP8, MXFP4, NVFP4)",
    "mfma": "AMD matrix cores: MFMA instructions",
}


@dataclass(frozen=True)
class GPUSpec:
    key: str
    vendor: str
    architecture: str
    year: int
    compute_capability: str | None
    match: tuple[str, ...]
    figures: dict[str, tuple[float | None, str]]  # name -> (value, bib key)
    matrix_formats: dict[str, str] = field(default_factory=dict)  # format -> bib key
    features: dict[str, str] = field(default_factory=dict)  # feature -> bib key

    def get(self, figure: str) -> float | None:
        """The value of ``figure`` or None when the source does not publish it."""
        if figure not in FIGURES:
            raise KeyError(f"unknown figure {figure!r}; known: {FIGURES}")
        return self.figures.get(figure, (None, ""))[0]

    def source(self, figure: str) -> str | None:
        return self.figures[figure][1] if figure in self.figures else None

    def supports(self, fmt: str) -> bool:
        """Whether the matrix units take ``fmt`` (one of MATRIX_FORMATS) as input."""
        if fmt not in MATRIX_FORMATS:
            raise KeyError(f"unknown matrix format {fmt!r}; known: {MATRIX_FORMATS}")
        return fmt in self.matrix_formats

    def has(self, feature: str) -> bool:
        """Whether the GPU has ``feature`` (one of FEATURES)."""
        if feature not in FEATURES:
            raise KeyError(f"unknown feature {feature!r}; known: {tuple(FEATURES)}")
        return feature in self.features

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
        formats = dict(d.get("matrix_formats") or {})
        features = dict(d.get("features") or {})
        if unknown := set(formats) - set(MATRIX_FORMATS):
            raise ValueError(f"{key}: unknown matrix formats {sorted(unknown)}")
        if unknown := set(features) - set(FEATURES):
            raise ValueError(f"{key}: unknown features {sorted(unknown)}")
        specs[key] = GPUSpec(
            key=key,
            vendor=d["vendor"],
            architecture=d["architecture"],
            year=d["year"],
            compute_capability=d.get("compute_capability"),
            match=tuple(d["match"]),
            figures=figures,
            matrix_formats=formats,
            features=features,
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


def support_table(kind: str, gpus: list[str] | None = None, *, cite: bool = False) -> str:
    """A Markdown table of ``kind`` ("formats" or "features") x GPU: a cell is ✓ or blank.

    ``gpus`` are hardware.yaml keys (default: every GPU, in file order). The last column lists the
    bib keys the ticks come from, so the table can be checked against its sources; ``cite=True``
    writes them as a MyST ``{cite:p}`` role, for a table glued into a chapter.
    """
    if kind not in ("formats", "features"):
        raise ValueError(f"kind must be 'formats' or 'features', got {kind!r}")
    specs = load()
    gpus = list(specs) if gpus is None else gpus
    if missing := [g for g in gpus if g not in specs]:
        raise KeyError(f"gpus not in hardware.yaml: {missing}")
    names = MATRIX_FORMATS if kind == "formats" else tuple(FEATURES)
    head = ["format" if kind == "formats" else "feature"] + [f"{g} ({specs[g].year})" for g in gpus]
    lines = ["| " + " | ".join(head + ["sources"]) + " |", "|" + "---|" * (len(head) + 1)]
    for name in names:
        have = {
            g: getattr(specs[g], "matrix_formats" if kind == "formats" else "features")
            for g in gpus
        }
        if not any(name in h for h in have.values()):
            continue
        label = name if kind == "formats" else f"`{name}`: {FEATURES[name]}"
        cells = ["✓" if name in have[g] else "" for g in gpus]
        sources = ",".join(sorted({have[g][name] for g in gpus if name in have[g]}))
        sources = f"{{cite:p}}`{sources}`" if cite else sources.replace(",", ", ")
        lines.append("| " + " | ".join([label, *cells, sources]) + " |")
    return "\n".join(lines)


def check_against_device(spec: GPUSpec, cap, forced: frozenset[str] | None = None) -> list[str]:
    """Where the table and the device's own capability flags (kernels.device) disagree.

    Only flags that map one-to-one are compared: fp8 matrix inputs, TMA, and having matrix units
    at all. (torch reports bf16 as supported on GPUs that only emulate it, so bf16 is not compared.)
    Flags forced off (``forced``, by default GPU_BRRR_FORCE_CAPS's) are left out, with a printed
    line: the device says False on purpose there.
    """
    from kernels import device

    forced = device.forced_off() if forced is None else forced
    problems = []
    pairs = [
        ("fp8", cap.fp8, spec.supports("fp8")),
        ("tma", cap.tma, spec.has("tma")),
        ("tensor_cores", cap.tensor_cores, bool(spec.matrix_formats)),
    ]
    if skipped := [name for name, _, _ in pairs if name in forced]:
        print(
            f"{', '.join(skipped)} forced off ({device.FORCE_CAPS_ENV}): not compared with the table"
        )
    pairs = [p for p in pairs if p[0] not in forced]
    for name, device_says, table_says in pairs:
        if bool(device_says) != table_says:
            problems.append(
                f"{name}: device reports {device_says}, hardware.yaml says {table_says}"
            )
    return problems
