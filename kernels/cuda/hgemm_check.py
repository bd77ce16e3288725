"""Checking the Hopper rungs (``hgemm_*.cu``) without trusting them: the compiler's view and the GPU's.

- **The compiler's view** needs nvcc only, no GPU: ``compile_steps`` builds each step for ``sm_90a``
  (in parallel, one nvcc per step) and reports what ptxas says (registers, spills, barriers) and how
  often the instructions of each step's idea occur in its PTX (``PTX_OPS``) and, where a
  ``cuobjdump`` is found (the CUDA toolkit's, or the one in Triton's wheel), its SASS (``SASS_OPS``).
  A step that compiles has not necessarily got its idea: no ``HGMMA`` means no tensor cores, ``LDL``
  / ``STL`` mean registers spilled to local memory.
- **The GPU's view** runs each step in a *child process with a timeout* (``run_check``,
  ``run_timing``, ``run_ncu``): a wrong mbarrier phase does not fail, it hangs the GPU, and a
  notebook or a probe must survive that. The child is this module (``python -m
  kernels.cuda.hgemm_check --check 12``); it prints one JSON line, which the parent reads.

scripts/gpu/hgemm_probe.py, tests/test_hgemm.py and notebooks/04f-hopper-gemm.ipynb use these: one
home for the shapes, the error bound and the instruction lists.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels import cuda as ladder
from kernels import numerics

ROOT = ladder.HERE.parents[1]  # the repository: the child runs from here
# Odd shapes (M, N, K): single elements, edge tiles in M and N, K not a multiple of 8 (padded), K of
# several tiles with a partial last one (the ring wraps), the odd benchmark shape, and step
# 12's case of more cluster tiles than clusters with fewer k-tiles than stages.
CHECK_SHAPES = [(1, 1, 8), (127, 255, 64), (64, 8, 200), (129, 257, 100), (1000, 1000, 1000),
                (4000, 3000, 5000), (2177, 4104, 72)]  # fmt: skip
# torch's extension build defines these; the kernels must not rely on implicit bf16 conversions.
TORCH_DEFINES = (
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
)
# What each step's idea puts in the PTX, by a label a reader knows.
PTX_OPS = {
    "wgmma": r"\bwgmma\.mma_async\b",
    "cp.async 16B": r"\bcp\.async\.cg\.shared\.global\b",
    "TMA load": r"\bcp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global\b",
    "TMA store": r"\bcp\.async\.bulk\.tensor\.\dd\.global\.shared::cta\b",
    "multicast": r"\.multicast::cluster\b",
    "setmaxnreg": r"\bsetmaxnreg\.(?:inc|dec)\b",
    "mbarrier wait": r"\bmbarrier\.try_wait\b",
}
# ... and in the SASS: HGMMA (wgmma), UTMALDG / UTMASTG (TMA load / store, MULTICAST its multicast
# form), USETMAXREG (setmaxnreg), UCGABAR_ARV (barrier.cluster), LDGSTS (cp.async), SYNCS (mbarrier
# operations), WARPGROUP (wgmma.fence / wait), LDL / STL (local memory: should be 0).
SASS_OPS = ["HGMMA", "UTMALDG", "UTMASTG", "MULTICAST", "USETMAXREG", "UCGABAR_ARV", "LDGSTS",
            "SYNCS", "WARPGROUP", "LDL", "STL"]  # fmt: skip
# What each kernel's SASS must contain (at least once), by a part of its name.
SASS_WANT = {
    "wgmma": ["HGMMA", "LDGSTS"],
    "tma": ["HGMMA", "UTMALDG"],
    "warpspec": ["HGMMA", "UTMALDG", "USETMAXREG"],
    "persistent": ["HGMMA", "UTMALDG", "MULTICAST", "UTMASTG", "UCGABAR_ARV", "USETMAXREG"],
}


# ----------------------------------------------------------------------------- the compiler's view


def find_tool(name: str) -> str | None:
    """A CUDA tool (nvcc, cuobjdump, ncu, compute-sanitizer): on the PATH, in $CUDA_HOME/bin or
    /usr/local/cuda/bin; for cuobjdump and nvdisasm also the copies in Triton's wheel, which
    disassemble sm_90a without a toolkit."""
    places = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    found = shutil.which(name) or next(
        (str(p) for d in places if d and (p := Path(d) / "bin" / name).exists()), None
    )
    if found is None and name in ("cuobjdump", "nvdisasm"):
        try:
            import triton

            p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
            found = str(p) if p.exists() else None
        except ImportError:
            pass
    return found


def compile_unavailable_reason() -> str | None:
    """Why the steps cannot be compiled here (None when nvcc is there: no GPU needed)."""
    if find_tool("nvcc") is None:
        return "nvcc (the CUDA toolkit) is not installed, so the steps cannot be compiled here"
    return None


def step_file(step: int) -> str:
    """The source file of a step (``hgemm_11_warpspec.cu``)."""
    return next(f for f in ladder.HGEMM_SOURCES if f.startswith(f"hgemm_{step:02d}_"))


def step_source(step: int) -> str:
    """What nvcc compiles for one step on its own: ``hgemm_common.cuh``, then the step's file."""
    return (
        (ladder.HERE / "hgemm_common.cuh").read_text()
        + "\n"
        + (ladder.HERE / step_file(step)).read_text()
    )


_USED = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(log: str) -> dict[str, int | None]:
    """``ptxas -v`` output of one kernel -> registers, barriers, spill stores and loads (bytes)."""
    used = _USED.findall(log)
    spills = _SPILLS.findall(log)
    return {
        "registers": max((int(r) for r, _ in used), default=None),
        "barriers": max((int(b or 0) for _, b in used), default=None),
        "spill_stores": sum(int(s) for s, _ in spills) if spills else None,
        "spill_loads": sum(int(ld) for _, ld in spills) if spills else None,
    }


def count_ops(text: str, ops: dict[str, str] | list[str]) -> dict[str, int]:
    """Occurrences per instruction: ``ops`` is PTX_OPS-like (label -> regex) or a list of SASS
    opcodes, matched as whole words (``MULTICAST`` inside ``UTMALDG.2D.MULTICAST``)."""
    pats = ops if isinstance(ops, dict) else {op: rf"\b{op}\b" for op in ops}
    return {label: len(re.findall(pat, text)) for label, pat in pats.items()}


def sass_by_kernel(sass: str) -> dict[str, str]:
    """``cuobjdump -sass`` output -> {short kernel name: its SASS}."""
    out = {}
    for block in re.split(r"\n\s*Function : ", sass)[1:]:
        name = block.split("\n", 1)[0].strip()
        short = re.sub(r"^_Z\d+", "", name).split("14CUtensorMap")[0].split("iii")[0]
        out[short] = block
    return out


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def loop_mixes(sass: str) -> list[dict[str, int]]:
    """The instruction mix of every loop of one kernel's SASS that issues tensor-core MMAs: for
    each backward branch whose body holds an HGMMA, the count of each opcode (without its
    modifiers) from the branch target to the branch, in address order. A body's total is the
    instructions one thread issues per trip (the loop body of a FlashAttention kernel: per key
    tile)."""
    ins = [(int(a, 16), op.split(".")[0], args) for a, op, args in _SASS_LINE.findall(sass)]
    index = {addr: i for i, (addr, _, _) in enumerate(ins)}
    mixes = []
    for i, (addr, op, args) in enumerate(ins):
        target = re.search(r"0x([0-9a-f]+)", args) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr and int(target.group(1), 16) in index:
            body = [o for _, o, _ in ins[index[int(target.group(1), 16)] : i + 1]]
            if "HGMMA" in body:
                mixes.append(dict(sorted(Counter(body).items(), key=lambda kv: -kv[1])))
    return mixes


def disassemble(binary: str | Path) -> str:
    """``cuobjdump -sass`` of an object file or shared library ('' without cuobjdump)."""
    tool = find_tool("cuobjdump")
    if tool is None:
        return ""
    proc = subprocess.run([tool, "-sass", str(binary)], capture_output=True, text=True, timeout=120)
    return proc.stdout


def missing_sass(kernel: str, counts: dict[str, int]) -> list[str]:
    """The instructions of SASS_WANT that a kernel's SASS lacks, plus LDL/STL if it has any."""
    want = next((w for part, w in SASS_WANT.items() if part in kernel), ["HGMMA"])
    return [op for op in want if counts.get(op, 0) < 1] + [
        op for op in ("LDL", "STL") if counts.get(op, 0)
    ]


@dataclass
class CompiledStep:
    """One step compiled for sm_90a by nvcc, as the compiler sees it."""

    step: int
    returncode: int
    seconds: float
    log: str  # nvcc's output, ptxas -v included
    ptx: str
    sass: str = ""  # '' when no cuobjdump was found
    ptxas: dict = field(default_factory=dict)  # parse_ptxas(log)
    ptx_counts: dict = field(default_factory=dict)  # count_ops(ptx, PTX_OPS)
    sass_counts: dict = field(default_factory=dict)  # count_ops(sass, SASS_OPS); {} without SASS

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def warnings(self) -> list[str]:
        return ptxas_warnings(self.log)


def ptxas_warnings(log: str) -> list[str]:
    """ptxas's signs in a build log that a kernel silently lost its idea: wgmma serialised
    (accumulators touched while in flight) or setmaxnreg ignored (C7508)."""
    return [w for w in ("serialized", "C7508") if w in log]


def compile_step(
    step: int, workdir: str | Path, *, sass: bool = True, defines: tuple[str, ...] = ()
) -> CompiledStep:
    """Compile ``hgemm_common.cuh`` + one step's file for sm_90a with ``-Xptxas -v``, keeping the PTX
    (and disassembling the object when ``sass`` and a cuobjdump is found). ``defines`` ("NAME=1")
    are passed as -D flags (the probe's A/B builds). Needs nvcc, no GPU."""
    nvcc = find_tool("nvcc")
    if nvcc is None:
        raise RuntimeError(compile_unavailable_reason())
    if step not in ladder.HGEMM_STEPS:
        raise ValueError(f"step must be one of {sorted(ladder.HGEMM_STEPS)}, got {step!r}")
    work = Path(workdir) / f"step{step}"
    work.mkdir(parents=True, exist_ok=True)
    src = work / f"hgemm_{step}.cu"
    src.write_text(step_source(step))
    obj = work / f"hgemm_{step}.o"
    t0 = time.perf_counter()
    proc = subprocess.run(
        [nvcc, "-std=c++17", "-O3", *ladder.HGEMM_ARCH_FLAGS, *TORCH_DEFINES, "-Xptxas", "-v"]
        + [f"-D{d}" for d in defines]
        + ["-keep", "-keep-dir", str(work), "-c", str(src), "-o", str(obj)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    seconds = time.perf_counter() - t0
    log = proc.stderr + proc.stdout
    ptx = "\n".join(p.read_text() for p in sorted(work.glob("*.ptx")))
    text = disassemble(obj) if sass and proc.returncode == 0 else ""
    return CompiledStep(
        step=step,
        returncode=proc.returncode,
        seconds=seconds,
        log=log,
        ptx=ptx,
        sass=text,
        ptxas=parse_ptxas(log),
        ptx_counts=count_ops(ptx, PTX_OPS),
        sass_counts=count_ops(text, SASS_OPS) if text else {},
    )


def compile_steps(
    steps: list[int] | None = None, workdir: str | Path | None = None, *, sass: bool = True
) -> dict[int, CompiledStep]:
    """``compile_step`` for every step (default: all), one nvcc per step in parallel (they are
    independent files). Without ``workdir`` the build files go to a temporary directory that is
    removed afterwards (the results keep the PTX, SASS and logs)."""
    steps = sorted(ladder.HGEMM_STEPS) if steps is None else list(steps)
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="gpubrrr-hgemm-") as tmp:
            return compile_steps(steps, tmp, sass=sass)
    with ThreadPoolExecutor(min(len(steps), max(2, os.cpu_count() or 1))) as pool:
        done = pool.map(lambda s: compile_step(s, workdir, sass=sass), steps)
        return dict(zip(steps, done))


# ----------------------------------------------------------------------------- the GPU's view


def _bound(ref: torch.Tensor) -> torch.Tensor:
    """The error each output element may have (``bound_ratio`` says why)."""
    return 2**-7 * ref.abs() + 1e-3 * ref.abs().max()


def bound_ratio(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(worst error / allowed error, relative Frobenius error) of a bf16 ``hgemm`` output against
    ``hgemm_ref``: each element may be off by one bf16 rounding (2^-8 relative, allowed 2^-7) plus
    accumulation-order differences (1e-3 of max |ref|); a wrong swizzle, descriptor or barrier
    gives errors of the order of |ref| itself. The bound of tests/test_hgemm.py."""
    out = out.float()
    err = (out - ref).abs()
    ratio = (err / _bound(ref)).max().item() if torch.isfinite(out).all() else float("inf")
    return ratio, numerics.rel_error(out, ref)


def bad_blocks(out: torch.Tensor, ref: torch.Tensor, block: int = 128) -> list[list[int]]:
    """[row block, column block] of the ``block x block`` pieces of the output with an error over
    the bound (at most 16): where a wrong tile index, multicast half or edge store shows."""
    out = out.float()
    bad = ((out - ref).abs() > _bound(ref)) | ~torch.isfinite(out)
    m, n = bad.shape
    found = []
    for i in range(0, m, block):
        for j in range(0, n, block):
            if bad[i : i + block, j : j + block].any():
                found.append([i // block, j // block])
                if len(found) == 16:
                    return found
    return found


def diagnose(step: int) -> dict:
    """With A = I (128 x 128) the product is B exactly, with B = I it is A: report which output
    rows / columns equal which input rows / columns, so a swizzle, descriptor or fragment-layout
    mistake shows as a permutation instead of a number."""
    n = 128
    eye = torch.eye(n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    report = {}
    for name, a, b, want in [("A=I", eye, x, x), ("B=I", x, eye, x)]:
        out = ladder.hgemm(a, b.t().contiguous().t(), step)
        exact = (out == want).float().mean().item()
        rows = torch.cdist(out.float(), want.float()).argmin(1).tolist()
        cols = torch.cdist(out.float().t(), want.float().t()).argmin(1).tolist()
        report[name] = {
            "exact_fraction": round(exact, 4),
            "rows_moved": [(i, r) for i, r in enumerate(rows) if i != r][:16],
            "cols_moved": [(j, c) for j, c in enumerate(cols) if j != c][:16],
        }
    return report


def _needs_hopper() -> None:
    if reason := ladder.hgemm_unavailable_reason():
        raise RuntimeError(reason)


def check_step(step: int, shapes: list[tuple[int, int, int]] | None = None) -> dict:
    """In this process (the child's job): ``hgemm`` of one step against ``hgemm_ref`` at every
    shape, B both as a K-major view and row-major; on failure, the bad blocks and a diagnosis."""
    _needs_hopper()
    torch.manual_seed(0)
    rows, ok = [], True
    for m, n, k in shapes or CHECK_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for layout, b in (("w.t()", w.t()), ("row-major", w.t().contiguous())):
            out = ladder.hgemm(a, b, step)
            torch.cuda.synchronize()
            ref = ladder.hgemm_ref(a, b)
            ratio, rel = bound_ratio(out, ref)
            good = ratio <= 1 and rel < ladder.HGEMM_BENCH_TOLERANCE
            ok &= good
            rows.append({"shape": [m, n, k], "b": layout, "ratio": ratio, "rel": rel, "ok": good})
            if not good:
                rows[-1]["bad_blocks"] = bad_blocks(out, ref)
    result = {"step": step, "ok": ok, "cases": rows}
    if not ok:
        result["diagnosis"] = diagnose(step)
    return result


def time_steps(
    steps: list[int], shapes: list[tuple[int, int, int]] | None = None, *, verbose: bool = True
) -> dict:
    """In this process: the measured bf16 matmul peak, then per shape cuBLAS (``a @ b``) and every
    step, all with ``bench.measure`` in the same run. B is the transpose of a contiguous ``[N, K]``
    tensor, so neither side copies. A step is checked against ``hgemm_ref`` at the shape before it
    is timed; a wrong one gets a row with its error and no time. Returns {"peak": TFLOP/s, "rows":
    [...], "records": [bench.record rows for results/]}."""
    from kernels import bench, roofline

    _needs_hopper()
    peak = roofline.matmul_peak("bfloat16")
    if verbose:
        print(f"bf16 matmul peak (cuBLAS 8192^3, measured): {peak.value:.0f} TFLOP/s", flush=True)
    rows, records = [], []
    ceiling = (peak.name, peak.value)
    for m, n, k in shapes or ladder.HGEMM_BENCH_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        flops = 2 * m * n * k
        cublas = bench.measure(lambda a=a, b=b: a @ b, flops=flops)
        records.append(
            bench.record("hgemm", "cublas", (m, n, k), "bfloat16", cublas, ceiling=ceiling)
        )
        shape_rows = [{"shape": [m, n, k], "variant": "cublas", "ms": cublas.ms,
                       "tflops": cublas.tflops, "vs_cublas": 1.0,
                       "vs_peak": cublas.tflops / peak.value}]  # fmt: skip
        ref = ladder.hgemm_ref(a, b)
        for step in steps:
            rel = numerics.rel_error(ladder.hgemm(a, b, step), ref)
            if not rel < ladder.HGEMM_BENCH_TOLERANCE:
                shape_rows.append({"shape": [m, n, k], "variant": f"step{step}", "rel": rel})
                continue
            t = bench.measure(lambda a=a, b=b, s=step: ladder.hgemm(a, b, s), flops=flops)
            name = ladder.HGEMM_STEPS[step].name.replace(" ", "-")
            records.append(bench.record("hgemm", f"step{step}-{name}", (m, n, k), "bfloat16", t,
                                        baseline=("cublas", cublas), ceiling=ceiling))  # fmt: skip
            shape_rows.append({"shape": [m, n, k], "variant": f"step{step}", "ms": t.ms,
                               "tflops": t.tflops, "vs_cublas": cublas.ms / t.ms,
                               "vs_peak": t.tflops / peak.value, "rel": rel})  # fmt: skip
        del ref
        rows += shape_rows
        if verbose:
            for r in shape_rows:
                shape = "x".join(map(str, r["shape"]))
                if "ms" not in r:
                    print(f"{shape:>16} {r['variant']:>7} NOT TIMED: relative error {r['rel']:.3g}")
                    continue
                print(f"{shape:>16} {r['variant']:>7} {r['ms']:8.3f} ms {r['tflops']:6.0f} TFLOP/s "
                      f"{r['vs_cublas']:5.2f}x cuBLAS {r['vs_peak']:5.1%} of peak", flush=True)  # fmt: skip
    return {"peak": peak.value, "rows": rows, "records": records}


def _run_from_root(cmd: list[str], timeout: float) -> subprocess.CompletedProcess | None:
    """``cmd`` from the repository root with it first on PYTHONPATH (so the child imports this
    checkout's ``kernels``), output captured; None when it ran past ``timeout``."""
    path = os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + (os.pathsep + path if path else ""))
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
        )
    except subprocess.TimeoutExpired:
        return None


def _run_child(args: list[str], timeout: float, prefix: list[str] | None = None) -> dict:
    """Run this module as a child; its last JSON line is the result. Never raises: a timeout, a
    crash or a non-zero exit becomes {"ok": False, "error": ...}."""
    cmd = [*(prefix or []), sys.executable, "-m", "kernels.cuda.hgemm_check", *args]
    t0 = time.time()
    p = _run_from_root(cmd, timeout)
    if p is None:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s (a barrier deadlock?)"}
    last = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    res = json.loads(last[-1]) if last else {"ok": False}
    res["seconds"] = round(time.time() - t0, 1)
    if p.returncode != 0:
        res["ok"] = False
        res["error"] = f"exit {p.returncode}: " + (p.stderr + p.stdout)[-3000:]
    return res


def run_check(step: int, timeout: float = 180, sanitize: str | None = None) -> dict:
    """``check_step`` in a child process with a timeout (a hang becomes a failed result); with
    ``sanitize`` ('memcheck', 'synccheck') under compute-sanitizer."""
    prefix = None
    if sanitize:
        tool = find_tool("compute-sanitizer") or "compute-sanitizer"
        prefix = [tool, "--tool", sanitize, "--error-exitcode", "3"]
    return {"step": step, **_run_child(["--check", str(step)], timeout, prefix)}


def run_timing(steps: list[int], timeout: float = 300) -> dict:
    """``time_steps`` in a child process with a timeout: {"ok", "peak", "rows", "records"} or
    {"ok": False, "error"}. Only steps that passed ``run_check`` should be given."""
    res = _run_child(["--time", *map(str, steps)], timeout)
    res.setdefault("ok", "rows" in res)
    return res


# ----------------------------------------------------------------------------- Nsight Compute

NCU_SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "LaunchStats"]
NCU_ROWS = ["Duration", "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput",
            "Executed Ipc Active", "Warp Cycles Per Issued Instruction", "Registers Per Thread",
            "Grid Size", "Cluster Size", "Waves Per SM", "Dynamic Shared Memory Per Block"]  # fmt: skip
# Raw metrics, picked by name from what this ncu knows (``ncu --query-metrics``), so that no
# unknown name can fail the run: the tensor pipes' active cycles (% of peak) and the average number
# of warps stalled for each reason per issued instruction (the "stall reasons").
TENSOR_PIPE = re.compile(r"^sm__pipe_tensor_op_\w*_cycles_active$|^sm__pipe_tensor_cycles_active$")
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+)_per_issue_active$")


def ncu_metric_names(chip: str = "gh100") -> list[str]:
    """The base metric names ``ncu --query-metrics --chip CHIP`` lists ([] without ncu)."""
    tool = find_tool("ncu")
    if tool is None:
        return []
    cmd = [tool, "--query-metrics", "--chip", chip]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return [ln.split()[0] for ln in p.stdout.splitlines() if ln.strip().startswith(("sm", "smsp"))]


def ncu_raw_metrics(names: list[str]) -> dict[str, str]:
    """{short name: full metric} of the tensor-pipe and stall metrics among ``names``."""
    out = {}
    for name in names:
        if TENSOR_PIPE.match(name):
            out["tensor " + name.split("__pipe_")[1].replace("_cycles_active", "")] = (
                name + ".avg.pct_of_peak_sustained_active"
            )
        elif m := STALL.match(name):
            out["stall " + m.group(1)] = name + ".ratio"
    return out


def parse_ncu(text: str, raw: dict[str, str]) -> dict:
    """ncu ``--csv --page details`` output -> {"rows": section rows of NCU_ROWS, "tensor": {pipe: %
    active}, "stalls": {reason: warps per issue}, highest first}."""
    start = text.find('"ID"')
    short = {v: k for k, v in raw.items()}
    rows, tensor, stalls = {}, {}, {}
    for r in csv.DictReader(io.StringIO(text[start:] if start >= 0 else "")):
        name, value = r.get("Metric Name", ""), r.get("Metric Value", "")
        if name in NCU_ROWS:
            rows[name] = f"{value} {r.get('Metric Unit', '')}".strip()
        elif name in short:
            try:
                v = float(value.replace(",", ""))
            except ValueError:
                continue
            kind, what = short[name].split(" ", 1)
            (tensor if kind == "tensor" else stalls)[what] = v
    stalls = dict(sorted(stalls.items(), key=lambda kv: -kv[1]))
    return {"rows": rows, "tensor": tensor, "stalls": stalls}


def run_ncu(step: int, timeout: float = 600, out: Path | None = None) -> dict:
    """Nsight Compute on one ``hgemm`` of 4096^3 (a child process): the sections of NCU_SECTIONS
    and the tensor-pipe and stall metrics. Never raises: {"error": why} when ncu is missing, the
    counters are locked or the run fails. ``out``: a folder for the raw CSV."""
    tool = find_tool("ncu")
    if tool is None:
        return {"error": "ncu (Nsight Compute) is not installed"}
    raw = ncu_raw_metrics(ncu_metric_names())
    sections = [arg for name in NCU_SECTIONS for arg in ("--section", name)]
    metrics = ["--metrics", ",".join(raw.values())] if raw else []
    cmd = [tool, "--kernel-name", "regex:hgemm_", "--launch-count", "1", *sections, *metrics,
           "--csv", "--page", "details", sys.executable, "-m", "kernels.cuda.hgemm_check",
           "--ncu-target", str(step)]  # fmt: skip
    p = _run_from_root(cmd, timeout)
    if p is None:
        return {"error": f"ncu timed out after {timeout:.0f} s"}
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"hgemm_ncu_step{step}.csv").write_text(p.stdout + p.stderr)
    res = parse_ncu(p.stdout, raw)
    if res["rows"] or res["tensor"] or res["stalls"]:
        return res
    log = p.stdout + p.stderr
    if "ERR_NVGPUCTRPERM" in log:
        return {"error": "the GPU's performance counters are locked (ERR_NVGPUCTRPERM)"}
    return {"error": f"exit {p.returncode}: " + log[-2000:]}


def _ncu_target(step: int) -> None:
    """What ncu profiles: one hgemm of 4096^3 (the extension is already built and cached)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16).t()
    ladder.hgemm(a, b, step)
    torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m kernels.cuda.hgemm_check", description=__doc__)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--check", type=int, metavar="STEP", help="check_step, printed as JSON")
    g.add_argument("--time", type=int, nargs="+", metavar="STEP", help="time_steps, as JSON")
    g.add_argument("--ncu-target", type=int, metavar="STEP", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.check is not None:
        print(json.dumps(check_step(args.check)), flush=True)
    elif args.time:
        print(json.dumps({"ok": True, **time_steps(args.time)}), flush=True)
    else:
        _ncu_target(args.ncu_target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
