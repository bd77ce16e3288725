"""The Hopper rungs (kernels/cuda/hgemm_*.cu) on an H100, in one call: build, SASS sanity check,
correctness at odd shapes, then timings against cuBLAS. Written before any of it ran on a GPU, so it
is defensive: every step is first checked in a child process with a timeout (a wrong mbarrier parity
hangs the GPU instead of failing), and only steps that passed are timed.

    PYTHONUNBUFFERED=1 python scripts/gpu/hgemm_probe.py [--sanitize] [--ncu] [--tests] [--steps 9 10 11 12]

1. build the extension (sm_90a) and report the time;
2. ``cuobjdump -sass`` of the built .so: per kernel the counts of HGMMA (wgmma), UTMALDG (TMA
   loads), LDGSTS (cp.async), SYNCS (mbarrier operations), and LDL/STL (local memory: should be 0);
   step 12's kernel also UTMASTG (TMA store), MULTICAST (UTMALDG.2D.MULTICAST) and UCGABAR_ARV
   (barrier.cluster); a step whose SASS lacks its instruction did not get its idea;
3. per step, in a child with a timeout: hgemm against hgemm_ref at odd shapes, both layouts of B;
   on failure, the wrong 128 x 128 blocks of the output (step 12: a multicast mistake shows in the
   second 128 columns of every 256, a store mistake at the M / N edges) and a diagnosis with
   identity operands (which rows / columns came out permuted);
   ``--sanitize`` runs the same check under compute-sanitizer memcheck and synccheck;
4. TFLOP/s of cuBLAS (torch.matmul) and each passing step at 4096^3, 8192^3 and 4000 x 3000 x 5000
   (B as the transpose of a contiguous [N, K] tensor: no copy on either side), as a fraction of
   cuBLAS and of the measured bf16 matmul peak (kernels.roofline.matmul_peak);
5. ``--ncu``: Nsight Compute sections SpeedOfLight, ComputeWorkloadAnalysis, WarpStateStats and
   LaunchStats of each passing step at 4096^3 (one launch), a few headline rows printed (step 12's
   grid and cluster size among them: the clusters cudaOccupancyMaxActiveClusters allowed), the CSV
   kept;
6. ``--tests``: the GPU tests of tests/test_hgemm.py.

Writes $OUT/hgemm_probe.json, $OUT/hgemm_sass/<kernel>.sass and $OUT/hgemm_ncu_step<N>.csv when OUT
is set.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import bench, device, roofline  # noqa: E402
from kernels import cuda as ladder  # noqa: E402

CHECK_SHAPES = [(1, 1, 8), (127, 255, 64), (64, 8, 200), (129, 257, 100), (1000, 1000, 1000),
                (4000, 3000, 5000), (2177, 4104, 72)]  # fmt: skip
TIME_SHAPES = ladder.HGEMM_BENCH_SHAPES
NCU_SECTIONS = ["SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "LaunchStats"]
NCU_ROWS = ["Duration", "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput",
            "Executed Ipc Active", "Warp Cycles Per Issued Instruction", "Registers Per Thread",
            "Grid Size", "Cluster Size", "Waves Per SM", "Dynamic Shared Memory Per Block"]  # fmt: skip
SASS_OPS = ["HGMMA", "UTMALDG", "UTMASTG", "MULTICAST", "UCGABAR_ARV", "LDGSTS", "SYNCS",
            "WARPGROUP", "LDL", "STL"]  # fmt: skip
# What each kernel's SASS must contain (at least once), by a part of its name.
SASS_WANT = {
    "wgmma": ["HGMMA", "LDGSTS"],
    "tma": ["HGMMA", "UTMALDG"],
    "warpspec": ["HGMMA", "UTMALDG"],
    "persistent": ["HGMMA", "UTMALDG", "MULTICAST", "UTMASTG", "UCGABAR_ARV"],
}
OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None


def _bound_ratio(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(worst error / allowed error, relative Frobenius error); allowed as in tests/test_hgemm.py."""
    out = out.float()
    err = (out - ref).abs()
    bound = 2**-7 * ref.abs() + 1e-3 * ref.abs().max()
    return (err / bound).max().item(), ((out - ref).norm() / ref.norm()).item()


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
        # row i of out is closest to which row of want? (and the same for columns)
        rows = torch.cdist(out.float(), want.float()).argmin(1).tolist()
        cols = torch.cdist(out.float().t(), want.float().t()).argmin(1).tolist()
        report[name] = {
            "exact_fraction": round(exact, 4),
            "rows_moved": [(i, r) for i, r in enumerate(rows) if i != r][:16],
            "cols_moved": [(j, c) for j, c in enumerate(cols) if j != c][:16],
        }
    return report


def bad_blocks(out: torch.Tensor, ref: torch.Tensor, block: int = 128) -> list[list[int]]:
    """[row block, column block] of the block x block pieces of the output with an error over the
    bound (at most 16): where a wrong tile index, multicast half or edge store shows."""
    out = out.float()
    bound = 2**-7 * ref.abs() + 1e-3 * ref.abs().max()
    bad = ((out - ref).abs() > bound) | ~torch.isfinite(out)
    m, n = bad.shape
    found = []
    for i in range(0, m, block):
        for j in range(0, n, block):
            if bad[i : i + block, j : j + block].any():
                found.append([i // block, j // block])
                if len(found) == 16:
                    return found
    return found


def check_step(step: int) -> dict:
    """Run in a child process: correctness of one step at every CHECK_SHAPES case."""
    torch.manual_seed(0)
    rows = []
    ok = True
    for m, n, k in CHECK_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for layout, b in (("w.t()", w.t()), ("row-major", w.t().contiguous())):
            out = ladder.hgemm(a, b, step)
            torch.cuda.synchronize()
            ref = ladder.hgemm_ref(a, b)
            ratio, rel = _bound_ratio(out, ref)
            good = ratio <= 1 and rel < 1e-2
            ok &= good
            rows.append({"shape": [m, n, k], "b": layout, "ratio": ratio, "rel": rel, "ok": good})
            if not good:
                rows[-1]["bad_blocks"] = bad_blocks(out, ref)
    result = {"step": step, "ok": ok, "cases": rows}
    if not ok:
        result["diagnosis"] = diagnose(step)
    return result


def run_child(step: int, timeout: float, sanitize: str | None = None) -> dict:
    cmd = [sys.executable, __file__, "--child", str(step)]
    if sanitize:
        tool = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
        cmd = [tool, "--tool", sanitize, "--error-exitcode", "3", *cmd]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"step": step, "ok": False, "error": f"timed out after {timeout:.0f} s (deadlock?)"}
    last = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    res = json.loads(last[-1]) if last else {"step": step, "ok": False}
    res["seconds"] = round(time.time() - t0, 1)
    if p.returncode != 0:
        res["ok"] = False
        res["error"] = f"exit {p.returncode}: " + (p.stderr + p.stdout)[-3000:]
    return res


def ncu_child(step: int) -> None:
    """Run in a child under ncu: one hgemm of 4096^3 (the extension is already built and cached)."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16).t()
    ladder.hgemm(a, b, step)
    torch.cuda.synchronize()


def ncu_step(step: int, timeout: float) -> dict:
    tool = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not Path(tool).exists():
        return {"error": "ncu not found"}
    sections = [arg for name in NCU_SECTIONS for arg in ("--section", name)]
    cmd = [tool, "--kernel-name", "regex:hgemm_", "--launch-count", "1", *sections, "--csv",
           "--page", "details", sys.executable, __file__, "--ncu-child", str(step)]  # fmt: skip
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"ncu timed out after {timeout:.0f} s"}
    text = p.stdout[p.stdout.find('"ID"') :] if '"ID"' in p.stdout else ""
    if OUT:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"hgemm_ncu_step{step}.csv").write_text(p.stdout + p.stderr)
    rows = {}
    for r in csv.DictReader(io.StringIO(text)):
        name = r.get("Metric Name", "")
        if name in NCU_ROWS or "Tensor" in name:
            rows[name] = f"{r.get('Metric Value', '')} {r.get('Metric Unit', '')}".strip()
    return rows or {"error": f"exit {p.returncode}: " + (p.stderr + p.stdout)[-2000:]}


def sass_report() -> dict:
    """HGMMA / UTMALDG / ... counts per kernel in the built extension's SASS."""
    from torch.utils.cpp_extension import _get_build_directory

    so = next(Path(_get_build_directory("gpu_brrr_hgemm", False)).glob("*.so"), None)
    tool = shutil.which("cuobjdump") or "/usr/local/cuda/bin/cuobjdump"
    if so is None or not Path(tool).exists():
        return {"error": f"no .so ({so}) or no cuobjdump ({tool})"}
    sass = subprocess.run([tool, "-sass", str(so)], capture_output=True, text=True).stdout
    report = {}
    for block in re.split(r"\n\s*Function : ", sass)[1:]:
        name = block.split("\n", 1)[0].strip()
        short = re.sub(r"^_Z\d+", "", name).split("14CUtensorMap")[0].split("iii")[0]
        report[short] = {op: len(re.findall(rf"\b{op}\b", block)) for op in SASS_OPS}
        if OUT:
            (OUT / "hgemm_sass").mkdir(parents=True, exist_ok=True)
            (OUT / "hgemm_sass" / f"{short}.sass").write_text(block)
    return report


def time_steps(steps: list[int]) -> list[dict]:
    peak = roofline.matmul_peak("bfloat16")
    print(f"bf16 matmul peak (cuBLAS 8192^3, measured): {peak.value:.0f} TFLOP/s", flush=True)
    rows = []
    for m, n, k in TIME_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16).t()
        flops = 2 * m * n * k
        cublas = bench.measure(lambda a=a, b=b: a @ b, flops=flops)
        rows.append({"shape": [m, n, k], "variant": "cublas", "ms": cublas.ms,
                     "tflops": cublas.tflops, "vs_cublas": 1.0,
                     "vs_peak": cublas.tflops / peak.value})  # fmt: skip
        for step in steps:
            t = bench.measure(lambda a=a, b=b, s=step: ladder.hgemm(a, b, s), flops=flops)
            rows.append({"shape": [m, n, k], "variant": f"step{step}", "ms": t.ms,
                         "tflops": t.tflops, "vs_cublas": cublas.ms / t.ms,
                         "vs_peak": t.tflops / peak.value})  # fmt: skip
        for r in rows[-1 - len(steps) :]:
            print(f"{'x'.join(map(str, r['shape'])):>16} {r['variant']:>7} {r['ms']:8.3f} ms "
                  f"{r['tflops']:6.0f} TFLOP/s {r['vs_cublas']:5.2f}x cuBLAS {r['vs_peak']:5.1%} of peak",
                  flush=True)  # fmt: skip
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ncu-child", type=int, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, nargs="+", default=sorted(ladder.HGEMM_STEPS))
    p.add_argument("--timeout", type=float, default=180, help="seconds per correctness child")
    p.add_argument("--sanitize", action="store_true", help="also run each check under memcheck")
    p.add_argument("--ncu", action="store_true", help="Nsight Compute sections per passing step")
    p.add_argument("--tests", action="store_true", help="run the GPU tests of test_hgemm.py")
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(check_step(args.child)), flush=True)
        return 0
    if args.ncu_child is not None:
        ncu_child(args.ncu_child)
        return 0
    reason = ladder.hgemm_unavailable_reason()
    if reason:
        print(reason)
        return 1
    print(device.describe().splitlines()[0], flush=True)
    report: dict = {"gpu": device.capabilities().name}
    t0 = time.time()
    ladder.hgemm_build()
    report["build_s"] = round(time.time() - t0, 1)
    print(f"built in {report['build_s']} s", flush=True)
    report["sass"] = sass_report()
    print(json.dumps(report["sass"], indent=1), flush=True)
    for kernel, ops in report["sass"].items():
        if not isinstance(ops, dict):
            continue
        want = next((w for part, w in SASS_WANT.items() if part in kernel), ["HGMMA"])
        missing = [op for op in want if ops[op] < 1]
        if missing or ops["LDL"] or ops["STL"]:
            print(
                f"WARNING {kernel}: missing {missing}, local memory LDL {ops['LDL']} STL {ops['STL']}"
            )

    passed = []
    report["checks"] = []
    for step in args.steps:
        res = run_child(step, args.timeout)
        report["checks"].append(res)
        worst = max((c["ratio"] for c in res.get("cases", [])), default=float("nan"))
        print(f"step {step}: {'ok' if res['ok'] else 'WRONG'} (worst error / bound {worst:.3g})"
              + (f"\n  {res['error']}" if "error" in res else "")
              + (f"\n  diagnosis {json.dumps(res['diagnosis'])}" if "diagnosis" in res else ""),
              flush=True)  # fmt: skip
        if res["ok"]:
            passed.append(step)
        if args.sanitize:
            for tool in ("memcheck", "synccheck"):
                s = run_child(step, 10 * args.timeout, sanitize=tool)
                report["checks"].append({**s, "sanitizer": tool})
                print(f"step {step} {tool}: {'clean' if s['ok'] else s.get('error', 'WRONG')}",
                      flush=True)  # fmt: skip

    report["timings"] = time_steps(passed) if passed else []
    if args.ncu:
        report["ncu"] = {}
        for step in passed:
            report["ncu"][step] = ncu_step(step, 10 * args.timeout)
            print(f"step {step} ncu: {json.dumps(report['ncu'][step], indent=1)}", flush=True)
    if args.tests:
        t = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_hgemm.py"],
                           capture_output=True, text=True)  # fmt: skip
        report["tests"] = t.stdout[-3000:]
        print(report["tests"], flush=True)
    if OUT:
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "hgemm_probe.json").write_text(json.dumps(report, indent=1))
    return 0 if len(passed) == len(args.steps) else 2


if __name__ == "__main__":
    sys.exit(main())
