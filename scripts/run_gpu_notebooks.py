"""Execute the course notebooks in place on a GPU machine, then record the benchmarks.

    python scripts/run_gpu_notebooks.py                 # every notebook, then python -m kernels.bench
    python scripts/run_gpu_notebooks.py notebooks/01a-gpu-hierarchy.ipynb --no-bench
    python scripts/run_gpu_notebooks.py --out-dir /tmp/run --no-bench   # leave notebooks/ as it is

Each notebook is run top to bottom by nbclient with the current Python as its kernel, and written back
with its fresh outputs: those outputs are what the published book shows (``--out-dir`` writes the
executed copies there instead). With GPU_BRRR_FORCE_CAPS set (scripts/run_forced_caps.sh) the
outputs are not this GPU's, so the script refuses to write them in place. Needs nbclient, nbformat and
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
    args = p.parse_args(argv)

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
