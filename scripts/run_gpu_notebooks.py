"""Execute the course notebooks in place on a GPU machine, then record the benchmarks.

    python scripts/run_gpu_notebooks.py                 # every notebook, then python -m kernels.bench
    python scripts/run_gpu_notebooks.py notebooks/01a-gpu-hierarchy.ipynb --no-bench

Each notebook is run top to bottom by nbclient with the current Python as its kernel, and written back
with its fresh outputs: those outputs are what the published book shows. Needs nbclient, nbformat and
ipykernel next to torch; the README's contributor section says how to add them to a GPU machine that
has no Jupyter.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def execute(path: Path, timeout: int) -> float:
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
    client.execute()
    nbformat.write(nb, path)
    return time.perf_counter() - t0


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
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: the committed outputs must come from a GPU run; stopping.")
        return 2
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    failed = []
    for path in paths:
        print(f"executing {path} ...", flush=True)
        try:
            print(f"  done in {execute(path.resolve(), args.timeout):.0f} s", flush=True)
        except Exception as e:  # nbclient's CellExecutionError carries the cell and traceback
            if not args.keep_going:
                raise
            print(f"  FAILED ({type(e).__name__}); left unchanged:\n{str(e)[-3000:]}", flush=True)
            failed.append(path.name)
    if failed:
        print(f"failed: {', '.join(failed)}")
        return 1
    if not args.no_bench:
        subprocess.run([sys.executable, "-m", "kernels.bench"], cwd=ROOT, check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
