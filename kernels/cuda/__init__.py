"""The SGEMM ladder: eight CUDA C++ kernels from naive to warp-tiled, one numbered file per step.

``sgemm(a, b, step=8)`` computes ``a @ b`` (fp32, row-major) with the kernel of the given step. The
sources (``sgemm_01_naive.cu`` ... ``sgemm_08_warptile.cu``) are concatenated and built once with
``torch.utils.cpp_extension.load_inline`` for the GPU at hand; the build is cached on disk by torch, so
later runs load it in a second. Building needs a CUDA GPU, nvcc and ninja; without them ``sgemm``
raises ``RuntimeError`` with one line saying so (notebooks print it and move on).

Steps 4-8 use tiles that must divide the matrix: other shapes are zero-padded here (a copy that
costs time, so benchmarks use tile-multiple sizes and the padding is only for correctness).

The Hopper rungs (``hgemm(a, b, step=9..12)``: bf16 in, fp32 accumulate, bf16 out) continue the
ladder on the tensor cores with ``wgmma``, TMA, warp specialisation and, in step 12, a persistent
kernel in clusters that multicast their shared operand and store through TMA. They are built as
their own extension for ``sm_90a`` only (``hgemm_common.cuh``, ``hgemm_09_wgmma.cu`` ...), so the
SGEMM ladder above still builds and runs on any CUDA GPU; on a GPU that is not Hopper ``hgemm``
raises ``RuntimeError`` saying it needs Hopper.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import _validate, device

HERE = Path(__file__).resolve().parent
SOURCES = [
    "sgemm_common.cuh",
    "sgemm_01_naive.cu",
    "sgemm_02_coalesce.cu",
    "sgemm_03_smem.cu",
    "sgemm_04_blocktile_1d.cu",
    "sgemm_05_blocktile_2d.cu",
    "sgemm_06_vectorize.cu",
    "sgemm_07_tuned.cu",
    "sgemm_08_warptile.cu",
]
TUNED_JSON = HERE / "sgemm_tuned.json"  # {gpu name: {"step7": {...}, "step8": {...}}}


@dataclass(frozen=True)
class Step:
    number: int
    name: str
    tile: tuple[int, int, int] | None  # (BM, BN, BK) the sizes must be multiples of; None: any size
    idea: str


STEPS = {
    1: Step(1, "naive", None, "one thread per output, uncoalesced loads"),
    2: Step(2, "coalesce", None, "warp reads consecutive columns: coalesced loads"),
    3: Step(3, "shared memory", None, "32x32 tiles staged in shared memory"),
    4: Step(4, "1D block-tiling", (64, 64, 8), "8 outputs per thread in a column"),
    5: Step(5, "2D block-tiling", (128, 128, 8), "8x8 outputs per thread"),
    6: Step(6, "vectorised", (128, 128, 8), "float4 loads/stores, A transposed in smem"),
    7: Step(7, "tuned", None, "best tile shape from a search over valid configurations"),
    8: Step(8, "warp-tiling", None, "warp tiles between block and thread tiles, double-buffered"),
}


def _search_space(filename: str, macro: str) -> list[tuple[int, ...]]:
    """A searched step's configurations, read from their single home: the X(...) list in its .cu."""
    text = (HERE / filename).read_text()
    body = text[text.index(f"#define {macro}(X)") :].split("// clang-format on")[0]
    return [tuple(map(int, m.split(","))) for m in re.findall(r"X\(([\d, ]+)\)", body)]


TUNE_CONFIGS = _search_space("sgemm_07_tuned.cu", "SGEMM_TUNE_CONFIGS")  # (BM, BN, BK, TM, TN)
# (BM, BN, BK, WM, WN, WNITER, TM, TN, DB): DB = 1 double-buffers shared memory
WARPTILE_CONFIGS = _search_space("sgemm_08_warptile.cu", "SGEMM_WARPTILE_CONFIGS")
SEARCH_SPACES = {7: TUNE_CONFIGS, 8: WARPTILE_CONFIGS}
DEFAULT_CONFIGS = {7: (128, 128, 8, 8, 8), 8: (128, 128, 16, 64, 64, 4, 8, 4, 1)}


@functools.cache
def _tuned_table() -> dict:
    """sgemm_tuned.json, read once (``tune`` clears this cache when it writes the file)."""
    return json.loads(TUNED_JSON.read_text()) if TUNED_JSON.exists() else {}


def tuned_config(step: int = 7, gpu_name: str | None = None) -> int:
    """Index into ``SEARCH_SPACES[step]`` of the best configuration measured on this GPU
    (kernels.cuda.tune), or of the default shape when this GPU has not been tuned."""
    if step not in SEARCH_SPACES:
        raise ValueError(
            f"step must be one of the searched steps {sorted(SEARCH_SPACES)}, got {step!r}"
        )
    name = gpu_name or device.capabilities().name
    entry = _tuned_table().get(name, {}).get(f"step{step}")
    if entry is not None and tuple(entry["config"]) in SEARCH_SPACES[step]:
        return SEARCH_SPACES[step].index(tuple(entry["config"]))
    return SEARCH_SPACES[step].index(DEFAULT_CONFIGS[step])


@functools.cache
def unavailable_reason() -> str | None:
    """Why the CUDA ladder cannot run here, or None when it can (asked once per process: the
    answer cannot change while it runs, and ``shutil.which`` walks the PATH)."""
    if not device.GPU_MODE or torch.version.cuda is None:
        return "kernels.cuda needs an NVIDIA GPU with a CUDA build of PyTorch (none here)"
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        return "kernels.cuda needs nvcc (the CUDA toolkit) to build its kernels"
    return None


@functools.cache
def arch_flags() -> tuple[str, ...]:
    """nvcc flags that build for the current GPU only (``sm_90`` on an H100, ``sm_80`` on an A100),
    passed explicitly to each build: torch's own default reads ``TORCH_CUDA_ARCH_LIST``, and editing
    that process-wide variable would change every later extension build of the process."""
    major, minor = torch.cuda.get_device_capability()
    return (f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}",)


def _read(files: list[str]) -> str:
    return "\n".join((HERE / f).read_text() for f in files)


def source() -> str:
    """All kernel sources in build order (without the torch bindings)."""
    return _read(SOURCES)


def _load(reason: str | None, name: str, files: list[str], function, signature: str, flags):
    """Build (or load from torch's extension cache) the extension ``name`` from ``files`` (the
    kernels, then their torch bindings), exposing ``function`` (a name or a list of names); or raise ``reason``, why it cannot
    run here, without trying. ``flags()`` is called only once the build is going ahead (reading
    the GPU's capability needs a GPU)."""
    from torch.utils.cpp_extension import load_inline

    if reason:
        raise RuntimeError(reason)
    return load_inline(
        name=name,
        cpp_sources=signature,
        cuda_sources=_read(files),
        functions=[function] if isinstance(function, str) else list(function),
        extra_cuda_cflags=["-O3", "-lineinfo", "-std=c++17", *flags()],
        verbose=False,
    )


@functools.cache
def _module():
    return _load(
        unavailable_reason(),
        "gpu_brrr_sgemm",
        [*SOURCES, "sgemm_bindings.cu"],
        "sgemm",
        "torch::Tensor sgemm(torch::Tensor a, torch::Tensor b, int64_t step, int64_t config);",
        arch_flags,
    )


def build() -> None:
    """Compile (or load from torch's extension cache) the ladder now rather than at first use."""
    _module()


def _pad(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if t.shape == (rows, cols):
        return t
    out = torch.zeros(rows, cols, device=t.device, dtype=t.dtype)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def _check_pair(a: torch.Tensor, b: torch.Tensor) -> None:
    """``a[M, K] @ b[K, N]`` is defined: the inner sizes match and both live on one device."""
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"a and b do not chain: a is {tuple(a.shape)}, b is {tuple(b.shape)}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")


def _cuda_sizes(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int, int]:
    """``(M, N, K)`` of ``a[M, K] @ b[K, N]`` (a pair ``_check_pair`` accepted), on a CUDA device."""
    if a.device.type != "cuda":
        raise ValueError(f"a and b must be CUDA tensors, got {a.device}")
    return a.shape[0], b.shape[1], a.shape[1]


def sgemm(
    a: torch.Tensor, b: torch.Tensor, step: int = 8, *, config: int | None = None
) -> torch.Tensor:
    """``a @ b`` for fp32 ``a[M, K]``, ``b[K, N]`` with ladder step ``step`` (1-8).

    ``config`` picks a configuration of a searched step (7 or 8: an index into
    ``SEARCH_SPACES[step]``); default: the one tuned for this GPU.
    """
    _validate.tensor("a", a, dtypes=(torch.float32,), ndim=2)
    _validate.tensor("b", b, dtypes=(torch.float32,), ndim=2)
    _check_pair(a, b)
    if not isinstance(step, int) or step not in STEPS:
        raise ValueError(f"step must be an int in 1..8, got {step!r}")
    if config is not None and (
        step not in SEARCH_SPACES or not 0 <= config < len(SEARCH_SPACES[step])
    ):
        raise ValueError(
            f"config must index SEARCH_SPACES[step] and step must be one of {sorted(SEARCH_SPACES)}; "
            f"got step={step}, config={config!r}"
        )
    M, N, K = _cuda_sizes(a, b)
    if M == 0 or N == 0 or K == 0:
        return torch.zeros(M, N, device=a.device, dtype=a.dtype)
    searched = step in SEARCH_SPACES
    cfg = (tuned_config(step) if config is None else config) if searched else -1
    tile = SEARCH_SPACES[step][cfg][:3] if searched else STEPS[step].tile
    if tile is None:  # steps 1-3 handle any shape themselves
        return _module().sgemm(a, b, step, cfg)
    bm, bn, bk = tile
    mp, np_, kp = -(-M // bm) * bm, -(-N // bn) * bn, -(-K // bk) * bk
    c = _module().sgemm(_pad(a, mp, kp), _pad(b, kp, np_), step, cfg)
    return c[:M, :N] if (mp, np_) != (M, N) else c


def sgemm_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp64 reference, returned as fp32."""
    return (a.double() @ b.double()).float()


def tune(step: int = 7, n: int = 4096, save: bool = True) -> list[dict]:
    """Time every configuration of a searched step (7 or 8) at ``n x n x n`` on this GPU, each
    checked against an fp64 reference first; store the fastest in sgemm_tuned.json under the GPU's
    name. Returns all rows, fastest first."""
    from kernels import bench

    if step not in SEARCH_SPACES:
        raise ValueError(
            f"step must be one of the searched steps {sorted(SEARCH_SPACES)}, got {step!r}"
        )
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda")
    ref = sgemm_ref(a, b)
    rows = []
    for i, cfg in enumerate(SEARCH_SPACES[step]):
        out = sgemm(a, b, step, config=i)
        err = ((out - ref).norm() / ref.norm()).item()
        if not err < 1e-5:
            raise AssertionError(f"step-{step} config {cfg} is wrong: relative error {err:.2e}")
        m = bench.measure(lambda i=i: sgemm(a, b, step, config=i), flops=2 * n**3)
        rows.append({"config": list(cfg), "ms": m.ms, "tflops": m.tflops})
    rows.sort(key=lambda r: r["ms"])
    if save:
        table = json.loads(TUNED_JSON.read_text()) if TUNED_JSON.exists() else {}
        entry = {"size": n, **rows[0], "searched": len(rows)}
        table.setdefault(device.capabilities().name, {})[f"step{step}"] = entry
        TUNED_JSON.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        _tuned_table.cache_clear()
    return rows


# ----------------------------------------------------------------------------- the Hopper rungs

HGEMM_SOURCES = [
    "hgemm_common.cuh",
    "hgemm_09_wgmma.cu",
    "hgemm_10_tma.cu",
    "hgemm_11_warpspec.cu",
    "hgemm_12_persistent.cu",
]
# The block tile (BM, BN, BK) of each step, for reading, not for padding: M and N need no multiple
# (TMA zero-fills / loads are predicated), K is padded to a multiple of HGEMM_K_ALIGN only.
HGEMM_STEPS = {
    9: Step(9, "wgmma", (128, 128, 64), "warpgroup MMA from 128B-swizzled shared memory"),
    10: Step(10, "TMA ring", (128, 128, 64), "TMA copies into a 3-stage mbarrier ring"),
    11: Step(
        11, "warp-specialised", (128, 256, 64), "TMA producer + 2 wgmma consumers, setmaxnreg"
    ),
    12: Step(
        12,
        "persistent",
        (128, 256, 64),
        "persistent grouped tiles, 2-CTA clusters multicasting B, TMA-store epilogue",
    ),
}
# The step ``hgemm`` runs by default: the highest, step 12, since it passed the GPU tests, the
# odd shapes and compute-sanitizer (scripts/gpu/hgemm_probe.py --sanitize --tests) and 200 repeated
# runs bit for bit on an H100 (2026-11-27), and beat step 11 at every timed shape there.
HGEMM_DEFAULT_STEP = 12
# wgmma and setmaxnreg exist only in the architecture-specific sm_90a target (nvcc's -gencode
# form, not -arch=sm_90a).
HGEMM_ARCH_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a",)
# Rows of A and Bt are read in 16-byte pieces (cp.async, TMA's row pitch): K must be a multiple of 8.
HGEMM_K_ALIGN = 8
# Timed shapes (M, N, K): the goals, square powers of two and one odd shape.
HGEMM_BENCH_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (4000, 3000, 5000)]


def hgemm_unavailable_reason() -> str | None:
    """Why the Hopper rungs cannot run here, or None when they can: they need what the SGEMM ladder
    needs and a GPU of compute capability 9.0 exactly (wgmma is not on Blackwell's sm_100 either)."""
    reason = unavailable_reason()
    if reason:
        return reason
    cc = device.capabilities().compute_capability
    if cc != (9, 0):
        got = "unknown" if cc is None else f"{cc[0]}.{cc[1]}"
        return (
            "kernels.cuda.hgemm needs Hopper (sm_90a: wgmma, TMA, setmaxnreg), "
            f"this GPU has compute capability {got}"
        )
    return None


def hgemm_source() -> str:
    """The Hopper kernel sources in build order (without the torch bindings)."""
    return _read(HGEMM_SOURCES)


# Preprocessor defines for an A/B experiment, e.g. "HGEMM12_CLUSTER_RELEASE=1" (space-separated):
# the extension is then built under its own name, so torch's cache keeps the default build too.
HGEMM_DEFINES_ENV = "GPU_BRRR_HGEMM_DEFINES"


def hgemm_extension_name() -> str:
    """The name torch's extension cache keeps the Hopper rungs under (one per set of defines)."""
    defines = os.environ.get(HGEMM_DEFINES_ENV, "").split()
    if not defines:
        return "gpu_brrr_hgemm"
    return "gpu_brrr_hgemm_" + "_".join(re.sub(r"\W", "", d).lower() for d in defines)


@functools.cache
def _hgemm_module():
    defines = os.environ.get(HGEMM_DEFINES_ENV, "").split()
    return _load(
        hgemm_unavailable_reason(),
        hgemm_extension_name(),
        [*HGEMM_SOURCES, "hgemm_bindings.cu"],
        "hgemm",
        "torch::Tensor hgemm(torch::Tensor a, torch::Tensor bt, int64_t step);",
        lambda: (*HGEMM_ARCH_FLAGS, *(f"-D{d}" for d in defines)),
    )


def hgemm_build() -> None:
    """Compile (or load from torch's extension cache) the Hopper rungs now rather than at first use."""
    _hgemm_module()


def _k_major_b(b: torch.Tensor) -> torch.Tensor:
    """``b[K, N]`` as ``Bt[N, K]`` row-major, the K-major layout wgmma reads: free when ``b`` is the
    transpose of a contiguous ``[N, K]`` tensor (``w.t()`` of an nn.Linear weight), else one copy."""
    bt = b.t()
    return bt if bt.is_contiguous() else bt.contiguous()


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """TMA and 16-byte cp.async need 16-byte aligned rows: copy a view that starts off-alignment."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def hgemm(a: torch.Tensor, b: torch.Tensor, step: int = HGEMM_DEFAULT_STEP) -> torch.Tensor:
    """``a @ b`` for bf16 ``a[M, K]``, ``b[K, N]`` on Hopper with ladder step ``step`` (9-12):
    fp32 accumulation in the tensor cores, the result rounded once to bf16 ``[M, N]``.

    The default is step 12 (``HGEMM_DEFAULT_STEP``: persistent, clustered, TMA multicast and TMA
    store), the fastest step at every shape the ladder times on an H100.

    ``b`` may be contiguous (it is transposed once, a copy of ``K * N`` elements) or, at no cost, the
    transpose of a contiguous ``[N, K]`` tensor: the kernels read B as ``Bt[N, K]`` (K-major, what
    ``wgmma`` takes without transposing). Any M and N: edge tiles are predicated (step 9) or
    zero-filled by TMA (steps 10-12; step 12's TMA store clips the output at M and N). K is
    zero-padded to a multiple of 8 when it is not one.
    """
    _validate.tensor("a", a, dtypes=(torch.bfloat16,), ndim=2)
    if not isinstance(b, torch.Tensor):
        raise TypeError(f"b must be a torch.Tensor, got {type(b).__name__}")
    if b.dtype != torch.bfloat16:
        raise TypeError(f"b must have dtype bfloat16, got {b.dtype}")
    if b.ndim != 2:
        raise ValueError(f"b must be 2-D, got shape {tuple(b.shape)}")
    if not (b.is_contiguous() or b.t().is_contiguous()):
        raise ValueError("b must be contiguous or the transpose of a contiguous [N, K] tensor")
    _check_pair(a, b)
    if isinstance(step, bool) or not isinstance(step, int) or step not in HGEMM_STEPS:
        raise ValueError(
            f"step must be an int in {min(HGEMM_STEPS)}..{max(HGEMM_STEPS)}, got {step!r}"
        )
    reason = hgemm_unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    M, N, K = _cuda_sizes(a, b)
    if M == 0 or N == 0 or K == 0:
        return torch.zeros(M, N, device=a.device, dtype=a.dtype)
    bt = _k_major_b(b)
    kp = -(-K // HGEMM_K_ALIGN) * HGEMM_K_ALIGN
    if kp != K:  # zeros in the padded columns of both operands add nothing to the products
        a, bt = _pad(a, M, kp), _pad(bt, N, kp)
    return _hgemm_module().hgemm(_aligned(a), _aligned(bt), step)


def hgemm_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 reference of ``hgemm``: the bf16 inputs are exact in fp64, the product is rounded once to
    fp32 (computed in fp64 so no TF32 setting can change it)."""
    return (a.double() @ b.double()).float()


# Relative Frobenius error above which the benchmark refuses to time a step: bf16 rounding of the
# output alone is ~2^-9 relative; a wrong tile, swizzle or barrier phase gives O(1).
HGEMM_BENCH_TOLERANCE = 1e-2


def _register_benchmark():
    from kernels import bench

    def skipped(name: str, reason: str) -> list[dict]:
        print(f"{name} skipped: {reason}")
        return []

    @bench.register("sgemm_ladder")
    def _bench(quick: bool) -> list[dict]:
        if reason := unavailable_reason():
            return skipped("sgemm_ladder", reason)
        n = 4096
        a = torch.randn(n, n, device="cuda")
        b = torch.randn(n, n, device="cuda")
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # cuBLAS in true fp32, like the ladder
        try:
            cublas = bench.measure(lambda: a @ b, flops=2 * n**3)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
        recs = [bench.record("sgemm", "cublas", (n, n, n), "float32", cublas)]
        for step in [3, 4, 5, 6, 7, 8] if quick else list(STEPS):
            m = bench.measure(lambda s=step: sgemm(a, b, s), flops=2 * n**3)
            recs.append(
                bench.record(
                    "sgemm",
                    f"step{step}-{STEPS[step].name.replace(' ', '-')}",
                    (n, n, n),
                    "float32",
                    m,
                    baseline=("cublas", cublas),
                    ceiling=("cublas_fp32", cublas.tflops),
                )
            )
        return recs

    @bench.register("hgemm")
    def _bench_hgemm(quick: bool) -> list[dict]:
        if reason := hgemm_unavailable_reason():
            return skipped("hgemm", reason)
        from kernels.cuda import hgemm_check  # imports this package: not at the top

        # The same loop as scripts/gpu/hgemm_probe.py: cuBLAS and the peak in the same run, each
        # step checked against hgemm_ref before it is timed (a wrong step gets no record).
        shapes = HGEMM_BENCH_SHAPES[:1] if quick else HGEMM_BENCH_SHAPES
        timed = hgemm_check.time_steps(list(HGEMM_STEPS), shapes, verbose=False)
        for r in timed["rows"]:
            if "ms" not in r:
                m, n, k = r["shape"]
                print(
                    f"hgemm {r['variant']} not timed at {m}x{n}x{k}: relative error {r['rel']:.3g}"
                )
        return timed["records"]


_register_benchmark()
