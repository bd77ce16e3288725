"""Execute the course notebooks in place on a GPU machine, then record the benchmarks.

    python scripts/run_gpu_notebooks.py                 # every notebook, then python -m kernels.bench
    python scripts/run_gpu_notebooks.py notebooks/01a-gpu-hierarchy.ipynb --no-bench
    python scripts/run_gpu_notebooks.py --out-dir /tmp/run --no-bench   # leave notebooks/ as it is
    python scripts/run_gpu_notebooks.py --parallel --passes 2           # every GPU at once, twice

Each notebook is run top to bottom by nbclient with the current Python as its kernel, and written back
with its fresh outputs: those outputs are what the published book shows (``--out-dir`` writes the
executed copies there instead). With GPU_BRRR_FORCE_CAPS set (scripts/run_forced_caps.sh) the
outputs are not this GPU's, so the script refuses to write them in place. Needs nbclient, nbformat and
ipykernel next to torch; the README's contributor section says how to add them to a GPU machine that
has no Jupyter.

One after another, the notebooks take about half an hour on an H100. With ``--parallel`` each runs in
its own process on GPUs of its own (``CUDA_VISIBLE_DEVICES``): one GPU, or the number its metadata
asks for (``"gpu_brrr": {"gpus": 2}``, the multi-GPU labs of Act 5; at most every GPU there is),
longest first by the cell timings of its last run, so that on an 8-GPU machine the whole book takes
about as long as its longest notebook. No two notebooks share a GPU, but they do share the host's
CPUs: the host-bound figures (µs of launch overhead per call) are steadier from a run one notebook
at a time. ``--passes 2`` runs everything twice in a row (issue 16: a learner's rerun must
not meet a failed assertion); every pass must pass, and the last one's outputs are kept.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def execute(path: Path, timeout: int, out: Path | None = None) -> float:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    # The kernel inherits this environment. With MPLBACKEND=Agg (common in batch jobs) plt.show()
    # draws nothing, and the pages would keep only the figures that a cell also glues.
    os.environ.pop("MPLBACKEND", None)
    t0 = time.perf_counter()
    # kernel_name "python3" resolves to ipykernel in *this* interpreter (sys.executable).
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    try:
        client.execute()
    finally:
        if out is not None:  # a failed run is written too: its error output is the evidence
            nbformat.write(nb, out)
    if out is None:
        nbformat.write(nb, path)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- parallel runs


@dataclass(frozen=True)
class Job:
    """One notebook to execute: how many GPUs it wants and how long its last run took."""

    path: Path
    gpus: int = 1
    seconds: float = 60.0


def job_for(path: Path) -> Job:
    """The notebook's GPU count (metadata ``gpu_brrr.gpus``, default 1) and the wall time of its
    last run, from nbclient's per-cell timestamps (60 s where it has none)."""
    nb = json.loads(path.read_text())
    gpus = int(nb.get("metadata", {}).get("gpu_brrr", {}).get("gpus", 1))
    stamps = []
    for cell in nb.get("cells", []):
        run = cell.get("metadata", {}).get("execution", {})
        for key in ("iopub.execute_input", "shell.execute_reply"):
            if key in run:
                stamps.append(datetime.datetime.fromisoformat(run[key].replace("Z", "+00:00")))
    seconds = (max(stamps) - min(stamps)).total_seconds() if len(stamps) >= 2 else 60.0
    return Job(path, gpus, seconds)


def run_parallel(
    jobs: Sequence[Job],
    gpus: Sequence[str],
    launch: Callable[[Job, list[str]], bool],
    stagger: float = 3.0,
) -> dict[Path, bool]:
    """Run every job through ``launch(job, its_gpus)`` (which returns whether it passed), no two
    at once on one GPU. Jobs wanting more GPUs start first, then the longest: they get every GPU
    they ask for, at most all of ``gpus``. Starts are ``stagger`` seconds apart (Jupyter kernels
    started at the same moment have raced: "Kernel died before replying to kernel_info")."""
    if not gpus:
        raise ValueError("gpus must name at least one GPU")
    pending = sorted(jobs, key=lambda j: (-min(j.gpus, len(gpus)), -j.seconds, j.path.name))
    free, running, passed = list(gpus), {}, {}
    with ThreadPoolExecutor(max_workers=len(gpus)) as pool:
        while pending or running:
            for job in list(pending):
                need = min(job.gpus, len(gpus))
                if need <= len(free):
                    mine, free = free[:need], free[need:]
                    running[pool.submit(launch, job, mine)] = (job, mine)
                    pending.remove(job)
                    if pending:
                        time.sleep(stagger)
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                job, mine = running.pop(future)
                free = sorted([*free, *mine], key=list(gpus).index)
                try:
                    passed[job.path] = bool(future.result())
                except Exception:  # noqa: BLE001  (a launcher that raised is a failed notebook)
                    passed[job.path] = False
    return passed


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them (ids or UUIDs)."""
    import torch

    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    if named:
        return [g.strip() for g in named.split(",") if g.strip()][: torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


def subprocess_launcher(timeout: int, out_dir: Path | None, log_dir: Path) -> Callable:
    """``launch`` for ``run_parallel``: this script on one notebook, in a child process that sees
    only its GPUs; its output goes to ``log_dir/<notebook>.log``, a summary line to ours."""
    lock = threading.Lock()

    def launch(job: Job, gpus: list[str]) -> bool:
        cmd = [sys.executable, str(Path(__file__).resolve()), str(job.path), "--no-bench"]
        cmd += ["--timeout", str(timeout)] + (["--out-dir", str(out_dir)] if out_dir else [])
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus))
        log = log_dir / f"{job.path.stem}.log"
        t0 = time.perf_counter()
        with log.open("w") as f:
            rc = subprocess.run(
                cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT
            ).returncode
        with lock:
            state = "ok" if rc == 0 else f"FAILED (exit {rc}; {log})"
            print(f"  {job.path.name:45s} GPU {','.join(gpus):8s} "
                  f"{time.perf_counter() - t0:6.0f} s  {state}", flush=True)  # fmt: skip
        return rc == 0

    return launch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/*.ipynb")
    p.add_argument("--no-bench", action="store_true", help="skip python -m kernels.bench")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="after a notebook fails, report it and run the rest (the failed one is left unchanged)",
    )
    p.add_argument(
        "--out-dir",
        type=Path,
        help="write the executed notebooks here (also failed ones) instead of in place",
    )
    p.add_argument(
        "--parallel",
        action="store_true",
        help="run the notebooks at once on every visible GPU, each on GPUs of its own",
    )
    p.add_argument("--passes", type=int, default=1, help="run everything this many times in a row")
    args = p.parse_args(argv)
    if args.passes < 1:
        p.error(f"--passes must be at least 1, got {args.passes}")

    import torch

    sys.path.insert(0, str(ROOT))  # kernels/ from this checkout, installed or not
    from kernels import device

    if device.forced_off() and args.out_dir is None:
        print(f"{device.FORCE_CAPS_ENV} is set: these outputs are not this GPU's; pass --out-dir.")
        return 2

    if not torch.cuda.is_available():
        print("no CUDA device: the committed outputs must come from a GPU run; stopping.")
        return 2
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    failed = []
    if args.parallel or args.passes > 1:
        for n in range(1, args.passes + 1):
            failed = run_pass(paths, args, n)
            if failed:
                print(f"pass {n} of {args.passes} failed")
                break
    else:
        for path in paths:
            print(f"executing {path} ...", flush=True)
            try:
                out = None
                if args.out_dir is not None:
                    args.out_dir.mkdir(parents=True, exist_ok=True)
                    out = args.out_dir / path.name
                print(f"  done in {execute(path.resolve(), args.timeout, out):.0f} s", flush=True)
            except Exception as e:  # nbclient's CellExecutionError carries the cell and traceback
                if not args.keep_going:
                    raise
                print(
                    f"  FAILED ({type(e).__name__}); left unchanged:\n{str(e)[-3000:]}", flush=True
                )
                failed.append(path.name)
    if failed:
        print(f"failed: {', '.join(failed)}")
        return 1
    if not args.no_bench:
        subprocess.run([sys.executable, "-m", "kernels.bench"], cwd=ROOT, check=True)
    return 0


def run_pass(paths: list[Path], args: argparse.Namespace, n: int) -> list[str]:
    """Pass ``n`` of ``--passes``: every notebook, at once on the GPUs with ``--parallel``, else
    one after another in child processes. The names of the notebooks that failed."""
    gpus = visible_gpus() if args.parallel else [",".join(visible_gpus())]
    log_dir = ROOT / "_build" / "gpu-notebooks" / f"pass-{n}"
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"pass {n} of {args.passes}: {len(paths)} notebooks on {len(gpus)} GPU slot(s); "
          f"logs in {log_dir}", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    launch = subprocess_launcher(args.timeout, args.out_dir, log_dir)
    passed = run_parallel([job_for(p.resolve()) for p in paths], gpus, launch)
    print(f"pass {n} took {time.perf_counter() - t0:.0f} s", flush=True)
    return sorted(p.name for p, ok in passed.items() if not ok)


if __name__ == "__main__":
    raise SystemExit(main())
