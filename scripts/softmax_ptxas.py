"""Registers and spills of the Triton softmax forward kernel, from the compiler alone (no GPU).

Triton compiles ``kernels.softmax``'s forward kernel for sm_90 at the launch configuration the
library picks for ``[rows, width]`` (``softmax.launch_config``), with the 16-byte alignment hints a
real launch passes, and Triton's own ``ptxas -v`` reports the registers a thread and the bytes it
spills to local memory, for each dtype. Page 4.5 uses it to explain why the fp16 forward at 65,536
columns ran at 0.66 of the copy bandwidth where bf16 ran at 0.85: the same row in registers, more
spills.

    python scripts/softmax_ptxas.py [--rows 4096] [--width 65536]

It compiles real Triton, so it refuses to run under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.nvidia.compiler import get_ptxas
from triton.runtime.jit import JITFunction

from kernels import launch, softmax
from kernels.cuda.hgemm_check import parse_ptxas

ARCH = 90
DTYPES = ("fp16", "bf16", "fp32")


def _jit(kernel) -> JITFunction:
    """The kernel as a JITFunction, also where TRITON_INTERPRET=1 made it an interpreted one."""
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


def forward_report(rows: int, width: int, dtype: str) -> dict:
    """Registers a thread and spill bytes of the forward kernel for ``[rows, width]`` ``dtype``:
    ``softmax.launch_config`` and ``parse_ptxas``'s fields."""
    cfg = softmax.launch_config(rows, width)
    if cfg["kernel"] != "fused":
        raise ValueError(
            f"width {width}: the looped kernel runs there; this script reads the fused one"
        )
    fn = _jit(softmax._softmax_kernel)
    consts = {"BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"]}
    args = [a for a in fn.arg_names if a not in consts]
    spec = dict(
        kernel=fn,
        signature={a: ("*" + dtype if a.endswith("_ptr") else "i32") for a in args},
        constexprs=consts,
        options={"num_warps": cfg["num_warps"]},
    )
    sizes = tuple(n for n, v in (("n_rows", rows), ("n_cols", width)) if v % 16 == 0)
    ptx = launch.ptx_as_launched(spec, cc=ARCH, sizes=sizes)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.ptx"
        path.write_text(ptx)
        out = subprocess.run(
            [get_ptxas(ARCH).path, f"-arch=sm_{ARCH}a", "-v", str(path), "-o", str(path.with_suffix(".cubin"))],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    report = parse_ptxas(out.stderr)
    if report["registers"] is None:
        raise RuntimeError(f"no register report in ptxas's output:\n{out.stderr}")
    return dict(cfg, dtype=dtype, **report)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--width", type=int, default=65536)
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit(
            "softmax_ptxas: unset TRITON_INTERPRET; the interpreter cannot compile for a GPU"
        )
    print(f"softmax forward, [{args.rows}, {args.width}], sm_{ARCH}a, Triton {triton.__version__}")
    print("dtype  BLOCK_N  warps  values/thread  regs  spill stores (B)  spill loads (B)")
    for dtype in DTYPES:
        r = forward_report(args.rows, args.width, dtype)
        per_thread = r["BLOCK_M"] * r["BLOCK_N"] // (32 * r["num_warps"])
        print(
            f"{dtype:5s}  {r['BLOCK_N']:7d}  {r['num_warps']:5d}  {per_thread:13d}  {r['registers']:4d}"
            f"  {r['spill_stores'] or 0:16d}  {r['spill_loads'] or 0:15d}"
        )


if __name__ == "__main__":
    main()
