"""Helpers for the Act 4 matmul notebooks: the ladder's tile arithmetic, the A6000 reference column,
occupancy from register counts, Nsight Compute and PTX inspection, and the plots.

Nothing here launches a kernel of its own. The tile parameters of each SGEMM step are read from the
``.cu`` launchers in ``kernels/cuda/`` (so they follow the code when a step is retuned); the model
intensities below are derived from them:

- ``global_intensity``: FLOPs per byte a kernel *requests* from global memory (A and B tiles; the
  write of C is ignored). L1 and L2 serve part of those requests, so DRAM sees fewer bytes.
- ``smem_intensity``: FLOPs per byte each thread reads from shared memory in the inner loop.

``python -m kernels.ladder_plots --profile 5 8 --n 4096`` runs the given steps once each (and cuBLAS
last): the target of the ``ncu`` command that ``ncu_command`` builds.
"""

from __future__ import annotations

import csv
import io
import math
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Simon Boehm's SGEMM worklog on an RTX A6000 (reading list 003; boehm2022sgemm in references.bib):
# GFLOP/s of each kernel at 4096^3 and its fraction of cuBLAS fp32 on that GPU.
A6000_GFLOPS = {1: 309, 2: 1986, 3: 2980, 4: 8474, 5: 15971, 6: 18237, 7: 19721, 8: 21779}
A6000_OF_CUBLAS = {1: 0.013, 2: 0.085, 3: 0.128, 4: 0.365, 5: 0.687, 6: 0.784, 7: 0.848, 8: 0.937}

CUDA_DIR = Path(__file__).resolve().parent / "cuda"


# ----------------------------------------------------------------------------- tile arithmetic


@dataclass(frozen=True)
class Tiling:
    """The work decomposition of one ladder step (sizes in elements of C, A and B)."""

    step: int
    BM: int  # block tile: rows of C per thread block
    BN: int  # block tile: columns of C per thread block
    BK: int  # K slice staged in shared memory per iteration (0: no shared memory)
    TM: int  # rows of C per thread (per warp sub-tile in step 8)
    TN: int  # columns of C per thread (per warp sub-tile in step 8)
    threads: int  # threads per block
    WMITER: int = 1  # step 8: warp sub-tiles down...
    WNITER: int = 1  # ... and across
    stages: int = 1  # shared-memory buffers (2: double-buffered)
    template: tuple[int, ...] = ()  # the kernel's template arguments (steps 6-8)

    @property
    def outputs_per_thread(self) -> int:
        return self.WMITER * self.TM * self.WNITER * self.TN

    @property
    def smem_bytes(self) -> int:
        """Static shared memory per block: A and B tiles of fp32, per stage."""
        return self.stages * (self.BM + self.BN) * self.BK * 4

    @property
    def global_intensity(self) -> float:
        """FLOPs per byte requested from global memory. Untiled (steps 1-2): each FMA loads one
        float of A and one of B, 2 FLOPs per 8 bytes. Tiled: a BM x BN block reads (BM + BN) floats
        per k and does 2 * BM * BN FLOPs with them."""
        if self.BK == 0:
            return 2 / 8
        return 2 * self.BM * self.BN / (4 * (self.BM + self.BN))

    @property
    def smem_intensity(self) -> float | None:
        """FLOPs per byte one thread reads from shared memory in the inner loop (None: no shared
        memory). Per k a thread loads its WMITER*TM values of A and WNITER*TN of B into registers and
        does every product of them."""
        if self.BK == 0:
            return None
        m, n = self.WMITER * self.TM, self.WNITER * self.TN
        if self.step == 3:  # one output per thread: two shared loads per FMA
            return 2 / 8
        if self.step == 4:  # one value of B reused for TM outputs, each with its own A value
            return 2 * m / (4 * (m + 1))
        return 2 * m * n / (4 * (m + n))


def _launcher(step: int) -> str:
    """The text of ``sgemm_0N.cu`` from its host launcher ``sgemm_0N(`` on."""
    path = next(CUDA_DIR.glob(f"sgemm_{step:02d}_*.cu"))
    text = path.read_text()
    start = text.find(f"LaunchInfo sgemm_{step:02d}(")
    if start < 0:
        raise ValueError(f"no launcher sgemm_{step:02d}( in {path.name}")
    return text[start:]


def _constexprs(text: str) -> dict[str, int]:
    out = {}
    for stmt in re.findall(r"constexpr int ([^;]+);", text):
        for name, value in re.findall(r"(\w+)\s*=\s*(\d+)", stmt):
            out.setdefault(name, int(value))
    return out


def _vectorize(step: int, bm: int, bn: int, bk: int, tm: int, tn: int) -> Tiling:
    return Tiling(step, bm, bn, bk, tm, tn, bm * bn // (tm * tn), template=(bm, bn, bk, tm, tn))


def warptile(config: tuple[int, ...]) -> Tiling:
    """Step 8's tiling for a configuration (BM, BN, BK, WM, WN, WNITER, TM, TN, DB)."""
    bm, bn, bk, wm, wn, wniter, tm, tn, db = config
    nt = (bm // wm) * (bn // wn) * 32
    wmiter = wm * wn // (32 * tm * tn * wniter)
    template = (bm, bn, bk, wm, wn, wniter, tm, tn, nt, db)
    return Tiling(8, bm, bn, bk, tm, tn, nt, wmiter, wniter, 1 + db, template)


def tiling(step: int, config: tuple[int, ...] | None = None) -> Tiling:
    """The tiling of ladder step ``step``. Steps 1-6 are read from their launchers in kernels/cuda/;
    the searched steps 7 and 8 use ``config`` (a tuple of ``kernels.cuda.SEARCH_SPACES[step]``) or,
    by default, the configuration tuned for this GPU."""
    if step in (7, 8):
        if config is None:
            import kernels.cuda as ladder

            config = ladder.SEARCH_SPACES[step][ladder.tuned_config(step)]
        return _vectorize(7, *config) if step == 7 else warptile(config)
    if step in (1, 2):
        bs = _constexprs(_launcher(step)).get("BS", 32)
        return Tiling(step, bs, bs, 0, 1, 1, bs * bs)
    if step == 3:
        bs = _constexprs(_launcher(3))["BS"]
        return Tiling(3, bs, bs, bs, 1, 1, bs * bs)
    if step == 4:
        c = _constexprs(_launcher(4))
        return Tiling(4, c["BM"], c["BN"], c["BK"], c["TM"], 1, c["BM"] * c["BN"] // c["TM"])
    if step == 5:
        c = _constexprs(_launcher(5))
        return Tiling(
            5,
            *(c[k] for k in ("BM", "BN", "BK", "TM", "TN")),
            c["BM"] * c["BN"] // (c["TM"] * c["TN"]),
        )
    if step == 6:
        m = re.search(r"launch_vectorize<(\d+), (\d+), (\d+), (\d+), (\d+)>", _launcher(6))
        return _vectorize(6, *map(int, m.groups()))
    raise ValueError(f"step must be an int in 1..8, got {step!r}")


# ----------------------------------------------------------------------------- occupancy


def theoretical_occupancy(
    regs_per_thread: int,
    threads_per_block: int,
    smem_per_block: int,
    *,
    regs_per_sm: int = 65536,
    max_threads_per_sm: int = 2048,
    smem_per_sm: int = 233472,
    max_blocks_per_sm: int = 32,
    reg_alloc_unit: int = 256,
    smem_reserved_per_block: int = 1024,
) -> tuple[int, float, str]:
    """Blocks resident per SM, the fraction of the SM's warp slots they fill, and the limiting
    resource ('registers', 'shared memory', 'threads' or 'blocks').

    Registers are allocated per warp in units of ``reg_alloc_unit``; since Ampere each block also
    holds ``smem_reserved_per_block`` bytes of shared memory for the system. The defaults are an
    H100's (compute capability 9.0); pass the device's own figures for another GPU.
    """
    for name, v in [("regs_per_thread", regs_per_thread), ("threads_per_block", threads_per_block)]:
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if smem_per_block < 0:
        raise ValueError(f"smem_per_block must be >= 0, got {smem_per_block!r}")
    warps = math.ceil(threads_per_block / 32)
    regs_per_warp = math.ceil(regs_per_thread * 32 / reg_alloc_unit) * reg_alloc_unit
    smem_need = smem_per_block + smem_reserved_per_block
    # On a tie the first name wins: a kernel at full occupancy is 'limited' by threads or blocks.
    limits = {
        "blocks": max_blocks_per_sm,
        "threads": max_threads_per_sm // (warps * 32),
        "registers": regs_per_sm // (regs_per_warp * warps),
        "shared memory": smem_per_sm // smem_need if smem_need else max_blocks_per_sm,
    }
    limiter = min(limits, key=limits.get)
    blocks = limits[limiter]
    return blocks, blocks * warps * 32 / max_threads_per_sm, limiter


def device_limits() -> dict[str, int]:
    """The occupancy inputs of ``theoretical_occupancy`` for GPU 0 (H100 defaults on a CPU)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    p = torch.cuda.get_device_properties(0)
    out = {}
    for key, attr in [
        ("regs_per_sm", "regs_per_multiprocessor"),
        ("max_threads_per_sm", "max_threads_per_multi_processor"),
        ("smem_per_sm", "shared_memory_per_multiprocessor"),
    ]:
        value = getattr(p, attr, None)
        if value:
            out[key] = int(value)
    return out


_RES_USAGE = re.compile(
    r"Function\s+(\S+?):?\s*\n\s*REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", re.M
)


def parse_resource_usage(text: str) -> dict[str, dict[str, int]]:
    """``cuobjdump -res-usage`` output -> {mangled kernel name: {reg, stack, shared, local}}."""
    out = {}
    for name, reg, stack, shared, local in _RES_USAGE.findall(text):
        out[name.rstrip(":")] = {
            "reg": int(reg),
            "stack": int(stack),
            "shared": int(shared),
            "local": int(local),
        }
    return out


_KERNEL_OF_STEP = {
    1: "sgemm_naive_kernel",
    2: "sgemm_coalesce_kernel",
    3: "sgemm_smem_kernel",
    4: "sgemm_blocktile_1d_kernel",
    5: "sgemm_blocktile_2d_kernel",
    6: "sgemm_vectorize_kernel",
    7: "sgemm_vectorize_kernel",
    8: "sgemm_warptile_kernel",
}


def template_args(mangled: str) -> tuple[int, ...]:
    """The int and bool template arguments of an Itanium-mangled name (``ILi128ELi64ELb1EE``)."""
    m = re.search(r"I((?:L[ib]\d+E)+)E", mangled)
    return tuple(int(v) for v in re.findall(r"L[ib](\d+)E", m.group(1))) if m else ()


def step_resources(usage: dict[str, dict[str, int]], step: int, t: Tiling) -> dict | None:
    """The ``cuobjdump`` row of a ladder step's kernel instantiation (None if absent). Steps 6 and
    7 share one template, and steps 7 and 8 have one instantiation per searched configuration:
    ``t.template`` picks the one."""
    base = _KERNEL_OF_STEP[step]
    rows = [(name, r) for name, r in usage.items() if base in name]
    if t.template:
        rows = [(n, r) for n, r in rows if template_args(n) == t.template]
    return rows[0][1] if len(rows) == 1 else None


def resource_usage(shared_object: str | Path) -> dict[str, dict[str, int]]:
    """Registers, stack, static shared and local memory of every kernel in a built extension,
    from ``cuobjdump -res-usage`` (needs the CUDA toolkit, no GPU counters)."""
    tool = shutil.which("cuobjdump")
    if tool is None:
        raise RuntimeError("cuobjdump (part of the CUDA toolkit) is not on the PATH")
    proc = subprocess.run(
        [tool, "-res-usage", str(shared_object)], capture_output=True, text=True, timeout=120
    )
    if proc.returncode != 0:
        raise RuntimeError(f"cuobjdump failed: {proc.stderr.strip()[:300]}")
    return parse_resource_usage(proc.stdout)


# ----------------------------------------------------------------------------- Nsight Compute

# What each column of the profile means; the metric names are Nsight Compute's (sm_70 and later).
NCU_METRICS = {
    "time_us": "gpu__time_duration.sum",
    "gld_requests": "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
    "gld_sectors": "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "l2_bytes": "lts__t_bytes.sum",
    "dram_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "memory_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "fma_pipe_pct": "sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active",
    "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "theoretical_occupancy_pct": "sm__maximum_warps_per_active_cycle_pct",
    "registers": "launch__registers_per_thread",
    "smem_ld_wavefronts": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
    "smem_ld_bank_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "smem_st_bank_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
    "smem_ld_requests": "smsp__inst_executed_op_shared_ld.sum",
}

# The subset seen working on an H100 with Nsight Compute 2025.3: the fallback if a metric of the
# full list is unknown to the ncu at hand.
NCU_METRICS_CORE = (
    "time_us",
    "dram_read_bytes",
    "dram_write_bytes",
    "l2_bytes",
    "dram_pct",
    "memory_pct",
    "sm_pct",
    "achieved_occupancy_pct",
    "theoretical_occupancy_pct",
    "registers",
    "smem_ld_wavefronts",
    "smem_ld_bank_conflicts",
    "smem_st_bank_conflicts",
    "smem_ld_requests",
)

_UNIT_SCALE = {
    "byte": 1,
    "kbyte": 1e3,
    "mbyte": 1e6,
    "gbyte": 1e9,
    "tbyte": 1e12,
    # durations -> microseconds (ncu 2025 prints "ns"; older versions "nsecond")
    "ns": 1e-3,
    "nsecond": 1e-3,
    "us": 1.0,
    "usecond": 1.0,
    "ms": 1e3,
    "msecond": 1e3,
    "s": 1e6,
    "second": 1e6,
}


def ncu_command(
    steps: list[int],
    *,
    n: int = 4096,
    metrics: dict[str, str] | None = None,
    log_file: str = "ladder-ncu.csv",
    python: str | None = None,
) -> list[str]:
    """The Nsight Compute command that profiles one launch of each ladder step in ``steps`` (in
    that order) and cuBLAS last, at ``n x n x n``, writing CSV to ``log_file``. Every kernel whose
    name contains 'gemm' is profiled: ours are sgemm_*_kernel, cuBLAS's contain 'gemm' too."""
    if not steps or any(s not in range(1, 9) for s in steps):
        raise ValueError(f"steps must be a non-empty list of ints in 1..8, got {steps!r}")
    metrics = NCU_METRICS if metrics is None else metrics
    return [
        "ncu",
        "--csv",
        "--print-units",
        "base",
        "--clock-control",
        "none",
        "--kernel-name",
        "regex:gemm",
        "--launch-count",
        str(len(steps) + 1),
        "--metrics",
        ",".join(metrics.values()),
        "--log-file",
        log_file,
        python or sys.executable,
        "-m",
        "kernels.ladder_plots",
        "--profile",
        *map(str, steps),
        "--n",
        str(n),
    ]


def _number(value: str, unit: str) -> float | None:
    value = value.strip().replace(",", "")
    if value in ("", "n/a", "N/A"):
        return None
    try:
        x = float(value)
    except ValueError:
        return None
    return x * _UNIT_SCALE.get(unit.strip().lower(), 1)


def parse_ncu_csv(text: str, metrics: dict[str, str] | None = None) -> list[dict]:
    """Nsight Compute ``--csv`` output (one row per kernel and metric) -> one dict per profiled
    kernel, in launch order: {'kernel': name, <short metric name>: value, ...}. Bytes come out in
    bytes and durations in microseconds whatever unit ncu printed."""
    metrics = NCU_METRICS if metrics is None else metrics
    short = {v: k for k, v in metrics.items()}
    start = text.find('"ID"')
    if start < 0:
        return []
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        kid = row.get("ID")
        name = row.get("Metric Name")
        if kid is None or name not in short:
            continue
        k = kernels.setdefault(kid, {"kernel": row.get("Kernel Name", "")})
        k[short[name]] = _number(row.get("Metric Value", ""), row.get("Metric Unit", ""))
    return [kernels[k] for k in sorted(kernels, key=int)]


@dataclass
class NcuResult:
    command: str  # the command line, as a reader would type it
    rows: list[dict]  # one per profiled kernel (empty when profiling failed)
    message: str  # why it failed, or '' when it worked


def run_ncu(
    steps: list[int],
    *,
    n: int = 4096,
    timeout: float = 180,
    cwd: str | Path | None = None,
    metrics: dict[str, str] | None = None,
) -> NcuResult:
    """Run ``ncu_command`` and parse its CSV. Never raises for a missing or locked profiler: the
    result's ``message`` says what went wrong (no ncu, counters not permitted, a timeout...). If
    ncu fails with the full metric list (a metric this ncu version does not know), it retries once
    with the metrics of ``NCU_METRICS_CORE``, so the basic profile survives."""
    if shutil.which("ncu") is None:
        cmd = ncu_command(steps, n=n, metrics=metrics, python="python", log_file="ladder-ncu.csv")
        return NcuResult(shlex.join(cmd), [], "ncu (Nsight Compute) is not on the PATH")
    root = cwd or Path(__file__).resolve().parents[1]
    attempts = [metrics or NCU_METRICS]
    if metrics is None:
        attempts.append({k: v for k, v in NCU_METRICS.items() if k in NCU_METRICS_CORE})
    why = ""
    for chosen in attempts:
        with tempfile.TemporaryDirectory(prefix="gpubrrr-ncu-") as tmp:
            log = str(Path(tmp) / "ladder-ncu.csv")
            cmd = ncu_command(steps, n=n, metrics=chosen, log_file=log)
            shown = shlex.join(cmd).replace(log, "ladder-ncu.csv").replace(sys.executable, "python")
            try:
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=timeout, cwd=root
                )
            except subprocess.TimeoutExpired:
                return NcuResult(shown, [], f"ncu did not finish within {timeout:.0f} s")
            text = Path(log).read_text() if Path(log).exists() else ""
        rows = parse_ncu_csv(text, chosen)
        if rows:
            return NcuResult(shown, rows, "")
        out = "\n".join([text, proc.stdout, proc.stderr])
        if "ERR_NVGPUCTRPERM" in out:
            why = (
                "the GPU's performance counters are locked for non-admin users (ERR_NVGPUCTRPERM); "
                "typical on Colab and rented containers"
            )
            return NcuResult(shown, [], why)
        tail = [ln for ln in out.strip().splitlines() if ln.strip()][-3:]
        why = f"ncu exited with {proc.returncode} and no metrics: " + " | ".join(tail)
    return NcuResult(shown, [], why)


def _profile_target(steps: list[int], n: int) -> None:
    """The program ncu runs: one call of each step, then cuBLAS (TF32 off)."""
    import torch

    import kernels.cuda as ladder

    ladder.build()
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda")
    for step in steps:
        ladder.sgemm(a, b, step)
    torch.backends.cuda.matmul.allow_tf32 = False
    a @ b
    torch.cuda.synchronize()


# ----------------------------------------------------------------------------- PTX inspection

# PTX mnemonics that show which matrix unit and which copy engine a compiled kernel uses.
PTX_MARKERS = {
    "wgmma (Hopper warpgroup MMA)": r"\bwgmma\.mma_async\b",
    "mma.sync (warp MMA, Ampere-style)": r"\bmma\.sync\b",
    "cp.async (async global->shared)": r"\bcp\.async\.(?:ca|cg)\b",
    "cp.async.bulk.tensor (TMA)": r"\bcp\.async\.bulk\.tensor\b",
    "mbarrier (async barriers)": r"\bmbarrier\.",
    "fma.f32 (scalar FP32 FMA)": r"\bfma\.rn\.f32\b",
    "ld.global.b16 (one 2-byte load per thread)": r"\bld\.global\.b16\b",
}


def count_ptx(ptx: str) -> dict[str, int]:
    """How many times each of PTX_MARKERS occurs in a PTX listing."""
    return {label: len(re.findall(pat, ptx)) for label, pat in PTX_MARKERS.items()}


def ptx_mnemonics(ptx: str, prefix: str) -> list[str]:
    """The distinct full mnemonics starting with ``prefix`` in a PTX listing, e.g. 'wgmma.mma_async'
    -> ['wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16']."""
    found = re.findall(r"(?<![\w.])(" + re.escape(prefix) + r"[\w.:]*)", ptx)
    return sorted(set(found))


_COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from kernels import matmul

tile = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "ALIGN": 1}
# What the JIT compiles for contiguous 16-byte-aligned inputs whose sizes are multiples of 16:
# pointers, sizes and leading strides carry tt.divisibility=16, and unit strides become constants.
fn = matmul._matmul_kernel
sig = {n: "*" + "{dtype}" for n in ("a_ptr", "b_ptr", "c_ptr")}
sig.update({n: "i32" for n in ("M", "N", "K", "stride_am", "stride_bk", "stride_cm")})
unit = {n: 1 for n in ("stride_ak", "stride_bn", "stride_cn")}
div16 = ("a_ptr", "b_ptr", "c_ptr", "M", "N", "K", "stride_am", "stride_bk", "stride_cm")
attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div16}
opts = {"num_warps": 8, "num_stages": 4}
specs = [("_matmul_kernel", fn, sig, {**unit, **tile}, attrs, opts, 0)]
# Sizes and strides that are not multiples of 16 (e.g. K = 5000, N = 3000): only the pointers keep
# their hint. Compiled for one target and dtype, to show what the JIT loses.
ptrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("a_ptr", "b_ptr", "c_ptr")}
specs.append(("_matmul_kernel, odd sizes", fn, sig, {**unit, **tile}, ptrs, opts, 90))
# The same odd sizes with the launcher's ALIGN = 8 (N, K and the strides are multiples of 8): the
# kernel restates them as multiples of 8, and 16-byte vector loads come back.
specs.append(("_matmul_kernel, odd sizes, ALIGN 8", fn, sig, {**unit, **tile, "ALIGN": 8}, ptrs, opts, 90))
tma = [
    s for s in matmul.COMPILE_SPECS
    if s["kernel"] is matmul._matmul_tma_persistent_kernel and not s["constexprs"].get("B_T")
][0]
specs.append(("_matmul_tma_persistent_kernel", tma["kernel"], tma["signature"], tma["constexprs"],
              {}, tma["options"], tma.get("min_cc", 0)))
out = {}
for cc in json.loads(sys.argv[1]):
    for dtype in json.loads(sys.argv[2]):
        for name, kfn, signature, constexprs, at, options, min_cc in specs:
            if cc < min_cc or ("odd sizes" in name and (cc, dtype) != (90, "bf16")):
                continue
            signature = {k: v.replace("{dtype}", dtype).replace("bf16", dtype) for k, v in signature.items()}
            signature.update({k: "constexpr" for k in constexprs})
            src = triton.compiler.ASTSource(fn=kfn, signature=signature, constexprs=constexprs, attrs=at)
            key = f"{name} {dtype} sm_{cc}"
            try:
                k = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
                out[key] = k.asm["ptx"]
            except Exception as e:
                out[key] = "ERROR " + type(e).__name__ + ": " + str(e)[:300]
print(json.dumps(out))
"""


def compile_matmul_ptx(
    ccs: tuple[int, ...] = (90, 80, 75),
    dtypes: tuple[str, ...] = ("bf16", "fp16"),
    timeout: float = 600,
) -> dict[str, str]:
    """PTX of the kernels.matmul kernels for each compute capability in ``ccs`` and 16-bit dtype,
    compiled ahead of time (no GPU needed) as the JIT would compile them for a contiguous matmul
    with sizes that are multiples of 16 (the plain kernel with a 128 x 128 x 64 tile, 4 stages, 8
    warps; the persistent TMA kernel, Hopper only, as in its COMPILE_SPECS entry), plus, for bf16 on
    sm_90, the plain kernel for sizes that are not multiples of 16 (no alignment hints). Runs in a
    subprocess with TRITON_INTERPRET=0, since a notebook on a CPU machine has the interpreter on.
    Keys: 'kernel dtype sm_CC'; a value starting with 'ERROR' is a compile failure."""
    import json
    import os

    env = dict(os.environ, TRITON_INTERPRET="0")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(list(ccs)), json.dumps(list(dtypes))],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"ahead-of-time compile failed: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- plots


def plot_ladder_bars(ax, ours: dict[int, float], *, gpu: str, names: dict[int, str] | None = None):
    """Grouped bars per step: ``ours`` (fraction of this GPU's cuBLAS fp32) next to the A6000
    column of the worklog; a line at cuBLAS (1.0). In the book's style (kernels.plotstyle)."""
    import textwrap

    from kernels import plotstyle

    steps = sorted(set(ours) | set(A6000_OF_CUBLAS))
    x = list(range(len(steps)))
    w = 0.4
    mine = [ours.get(s, 0.0) for s in steps]
    ref = [A6000_OF_CUBLAS.get(s, 0.0) for s in steps]
    b1 = ax.bar([i - w / 2 for i in x], mine, w, label=f"this run: {gpu}", color=plotstyle.color(0))
    ax.bar([i + w / 2 for i in x], ref, w, label="RTX A6000 (Boehm's worklog)", color="0.65")
    for rect, v in zip(b1, mine):
        if v > 0:
            ax.annotate(
                f"{v:.2f}",
                (rect.get_x() + rect.get_width() / 2, v),
                textcoords="offset points",
                xytext=(0, 2),
                ha="center",
                fontsize=plotstyle.SMALL_PT,
            )
    ax.axhline(1.0, color="k", lw=1, ls="--", label="cuBLAS fp32 (each GPU's own)")
    # Names wrapped to the width of a group of bars, so that neighbouring tick labels never touch.
    labels = [
        f"{s}\n" + textwrap.fill((names or {}).get(s, ""), 7, break_long_words=False) for s in steps
    ]
    ax.set_xticks(x, labels)
    ax.set_ylabel("fraction of cuBLAS fp32")
    ax.set_ylim(0, 1.55)  # room above the cuBLAS line for the legend
    ax.legend(loc="upper left", ncols=2)
    ax.grid(False, axis="x")
    return ax


def plot_sweep(ax, sizes: list[int], series: dict[str, list[float]], *, ylabel: str = "TFLOP/s"):
    """One line per series over square sizes (log-2 x axis); cuBLAS dashed in black."""
    from kernels import plotstyle

    i = 0
    for label, ys in series.items():
        if "cuBLAS" in label:
            style = dict(color="k", ls="--", marker="s")
        else:
            style = dict(color=plotstyle.color(i), marker="o")
            i += 1
        ax.semilogx(sizes, ys, label=label, base=2, **style)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("n (n x n x n)")
    ax.set_ylabel(ylabel)
    ax.legend()
    return ax


# ----------------------------------------------------------------------------- the Hopper rungs


def sgemm_ladder_records(
    gpu_name: str, path: Path | None = None, n: int = 4096
) -> tuple[dict[int, float], float, str] | None:
    """The SGEMM ladder as last recorded on ``gpu_name`` (results/<gpu>.jsonl, written by Lab 4a or
    ``python -m kernels.bench --only sgemm_ladder``): ({step: TFLOP/s}, cuBLAS fp32 TFLOP/s, date)
    at ``n``^3, from the latest date that has a cuBLAS row; None when there is no such record."""
    from kernels import bench

    path = path or bench.results_path(gpu_name)
    if not path.exists():
        return None
    rows = bench.load_records(path)
    rows = [r for r in rows if r.get("bench") == "sgemm" and r.get("shape") == [n, n, n]]
    rows = [r for r in rows if r.get("gpu") == gpu_name and r.get("tflops")]
    dates = sorted({r["date"] for r in rows if r["variant"] == "cublas"})
    if not dates:
        return None
    latest = [r for r in rows if r["date"] == dates[-1]]
    steps = {}
    for r in latest:  # a later row of the same day wins
        m = re.match(r"step(\d+)-", r["variant"])
        if m:
            steps[int(m.group(1))] = r["tflops"]
    cublas = [r["tflops"] for r in latest if r["variant"] == "cublas"][-1]
    return steps, cublas, dates[-1]


def plot_hopper_ladder(
    ax,
    hopper: dict[int, float],
    cublas_bf16: float,
    *,
    sgemm: dict[int, float] | None = None,
    cublas_fp32: float | None = None,
    sgemm_label: str = "steps 1-8: fp32 (Lab 4a)",
):
    """The whole ladder on one log axis: TFLOP/s of steps 1-8 (fp32, CUDA cores; optional) and 9-12
    (bf16, tensor cores), each group under its own cuBLAS line (dashed: fp32 without TF32, solid:
    bf16). Bars carry their TFLOP/s."""
    from kernels import plotstyle

    groups = [(sgemm or {}, plotstyle.color(0), sgemm_label), (hopper, plotstyle.color(1), None)]
    for values, colour, label in groups:
        steps = sorted(values)
        if not steps:
            continue
        label = label or f"steps {steps[0]}-{steps[-1]}: bf16, wgmma"
        bars = ax.bar(steps, [values[s] for s in steps], 0.7, color=colour, label=label)
        for rect, s in zip(bars, steps):
            v = values[s]
            ax.annotate(f"{v:.0f}" if v >= 10 else f"{v:.1f}", (rect.get_x() + rect.get_width() / 2, v),
                        textcoords="offset points", xytext=(0, 2), ha="center",
                        fontsize=plotstyle.SMALL_PT)  # fmt: skip
    if sgemm and cublas_fp32:
        lo, hi = min(sgemm) - 0.4, max(sgemm) + 0.4
        ax.hlines(cublas_fp32, lo, hi, colors="k", linestyles="--", lw=1, label="cuBLAS fp32")
    lo = min(hopper, default=9) - 0.4
    ax.hlines(cublas_bf16, lo, max(hopper, default=12) + 0.4, colors="k", lw=1.2,
              label="cuBLAS bf16 (this run)")  # fmt: skip
    ax.set_yscale("log")
    ax.set_ylim(top=4 * max([cublas_bf16, *hopper.values()]))
    ticks = sorted(set(sgemm or {}) | set(hopper))
    ax.set_xticks(ticks, [str(s) for s in ticks])
    ax.set_xlabel("ladder step")
    ax.set_ylabel("TFLOP/s (log scale)")
    ax.legend(loc="upper left", ncols=2)
    ax.grid(False, axis="x")
    return ax


def plot_vs_cublas(
    ax,
    frac: dict[str, dict[int, float]],
    *,
    steps: list[int] | None = None,
    goals: dict[str, float] | None = None,
    goal_step: int | None = None,
):
    """Grouped bars: per step, one bar per shape (``frac[shape label][step]``, the step's throughput
    over cuBLAS bf16's at that shape in the same run); the dashed line at 1.0 is cuBLAS. ``steps``:
    the steps on the x axis (default: those in ``frac``; one without a bar is marked 'not timed').
    ``goals`` ({shape label: fraction}) are short black bars over ``goal_step`` (default the last)."""
    from kernels import plotstyle

    shapes = list(frac)
    steps = sorted(steps or {s for f in frac.values() for s in f})
    goal_step = steps[-1] if goal_step is None and steps else goal_step
    w = 0.8 / max(len(shapes), 1)
    for i, shape in enumerate(shapes):
        xs = [j + (i - (len(shapes) - 1) / 2) * w for j in range(len(steps))]
        ys = [frac[shape].get(s, 0.0) for s in steps]
        ax.bar(xs, ys, w, color=plotstyle.color(i), label=shape)
        for x, y in zip(xs, ys):
            if y > 0:
                ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 2),
                            ha="center", fontsize=plotstyle.SMALL_PT, rotation=90)  # fmt: skip
        if goals and shape in goals and goal_step in steps:
            x = xs[steps.index(goal_step)]
            label = f"goal of step {goal_step}" if i == 0 else None
            ax.hlines(goals[shape], x - w / 2, x + w / 2, colors="k", lw=2.5, label=label)
    for j, s in enumerate(steps):
        if not any(f.get(s) for f in frac.values()):
            ax.text(j, 0.05, "not timed", ha="center", fontsize=plotstyle.SMALL_PT)
    ax.axhline(1.0, color="k", lw=1, ls="--", label="cuBLAS bf16")
    ax.set_xticks(range(len(steps)), [f"step {s}" for s in steps])
    ax.set_ylabel("fraction of cuBLAS bf16")
    ax.set_ylim(0, 1.6)
    ax.legend(loc="upper left", ncols=2)
    ax.grid(False, axis="x")
    return ax


# ----------------------------------------------------------------------------- entry point


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m kernels.ladder_plots", description=__doc__)
    p.add_argument("--profile", type=int, nargs="+", required=True, help="ladder steps to run")
    p.add_argument("--n", type=int, default=4096)
    args = p.parse_args(argv)
    _profile_target(args.profile, args.n)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
