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

``--define HGEMM12_CLUSTER_RELEASE=1`` runs all of it on a build with that define: step 12's
earlier cluster-scope release/acquire on its empty barriers (MEMBAR.ALL.GPU in every k-step of its
SASS) instead of CUTLASS's default semantics, the default build's; ``--steps 11 12 --define ...``
puts it beside step 11 and cuBLAS in the same run.

The checks, the child processes and the instruction lists live in kernels/cuda/hgemm_check.py, which
notebooks/04f-hopper-gemm.ipynb uses too.

Writes $OUT/hgemm_probe.json, $OUT/hgemm_sass/<kernel>.sass and $OUT/hgemm_ncu_step<N>.csv when OUT
is set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import cuda as ladder  # noqa: E402
from kernels import device  # noqa: E402
from kernels.cuda import hgemm_check as check  # noqa: E402

OUT = Path(os.environ["OUT"]) if os.environ.get("OUT") else None


def sass_report() -> dict:
    """HGMMA / UTMALDG / ... counts per kernel in the built extension's SASS."""
    from torch.utils.cpp_extension import _get_build_directory

    so = next(Path(_get_build_directory(ladder.hgemm_extension_name(), False)).glob("*.so"), None)
    if so is None or check.find_tool("cuobjdump") is None:
        return {"error": f"no .so ({so}) or no cuobjdump"}
    report = {}
    for short, block in check.sass_by_kernel(check.disassemble(so)).items():
        report[short] = check.count_ops(block, check.SASS_OPS)
        if OUT:
            (OUT / "hgemm_sass").mkdir(parents=True, exist_ok=True)
            (OUT / "hgemm_sass" / f"{short}.sass").write_text(block)
    return report


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, nargs="+", default=sorted(ladder.HGEMM_STEPS))
    p.add_argument("--timeout", type=float, default=180, help="seconds per correctness child")
    p.add_argument("--sanitize", action="store_true", help="also run each check under memcheck")
    p.add_argument("--ncu", action="store_true", help="Nsight Compute sections per passing step")
    p.add_argument("--tests", action="store_true", help="run the GPU tests of test_hgemm.py")
    p.add_argument("--define", nargs="+", default=[], metavar="NAME=VALUE",
                   help="build every step with these preprocessor defines (an A/B experiment, e.g. "
                        "HGEMM12_CLUSTER_RELEASE=1); the checks' child processes inherit them")  # fmt: skip
    args = p.parse_args()
    if args.define:
        os.environ[ladder.HGEMM_DEFINES_ENV] = " ".join(args.define)
        print(f"defines: {args.define} (extension {ladder.hgemm_extension_name()})", flush=True)
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
        if missing := check.missing_sass(kernel, ops):
            print(f"WARNING {kernel}: missing or unwanted {missing}")

    passed = []
    report["checks"] = []
    for step in args.steps:
        res = check.run_check(step, args.timeout)
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
                s = check.run_check(step, 10 * args.timeout, sanitize=tool)
                report["checks"].append({**s, "sanitizer": tool})
                print(f"step {step} {tool}: {'clean' if s['ok'] else s.get('error', 'WRONG')}",
                      flush=True)  # fmt: skip

    report["timings"] = check.time_steps(passed)["rows"] if passed else []
    if args.ncu:
        report["ncu"] = {}
        for step in passed:
            report["ncu"][step] = check.run_ncu(step, 10 * args.timeout, OUT)
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
