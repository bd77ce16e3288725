"""Registers, occupancy and bytes in flight of the thread-block cluster row kernels, from the
compiler alone (no GPU): nvcc compiles kernels/cuda/cluster_rows.cu for sm_90 with ``-Xptxas -v``,
and for each kernel this prints the registers a thread, the spills, the CTAs an SM can hold by
registers (kernels.launch.blocks_per_sm: 256 threads a CTA, registers allocated 8 a thread at a
time, 65,536 an SM, at most 8 CTAs of 256 threads), a CTA's chunks in KB, and the bytes of rows
an SM holds in registers at once (CTAs x chunks): for the norms' backward and the persistent
forwards half of that is the next row, in flight while a row is worked on.

    python scripts/cluster_rows_ptxas.py [--all]    # the tiles in use and the candidates; --all: every one

tests/test_cluster_rows.py uses ``compile_report`` to check that no kernel spills.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

from kernels.cuda.hgemm_check import find_tool
from kernels.launch import blocks_per_sm

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "kernels" / "cuda" / "cluster_rows.cu"
THREADS = 256
DTYPES = {"f": ("fp32", 4), "6__half": ("fp16", 2), "13__nv_bfloat16": ("bf16", 2)}
# Mangled names: kernel(_loop)?<T, E, (RMS, BIAS, STATS | RMS, BIAS), OCC?>.
NAME = re.compile(
    r"_ZN12cluster_rows\d+(?P<kernel>norm_fwd|norm_bwd|softmax_fwd|softmax_bwd)(?P<loop>_loop)?I"
    r"(?P<t>f|6__half|13__nv_bfloat16)Li(?P<e>\d+)E(?P<flags>(?:Lb[01]E)*)(?:Li(?P<occ>\d+)E)?"
)


def compile_report(compiler: str | None = None, source: Path = SOURCE) -> list[dict]:
    """One record per kernel in ``source``: name, op, dtype, e, occ, registers, spill_bytes."""
    compiler = compiler or find_tool("nvcc")
    if compiler is None:
        raise RuntimeError("nvcc not found (the CUDA toolkit)")
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [compiler, "-std=c++17", "-O3", "-gencode=arch=compute_90,code=sm_90", "-Xptxas",
             "-v", "-cubin", str(source), "-o", str(Path(tmp) / "cr.cubin")],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    records, current = [], None
    for line in out.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            current = {"name": m.group(1), "spill_bytes": 0}
            continue
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and current is not None:
            current["spill_bytes"] = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and current is not None:
            current["registers"] = int(m.group(1))
            records.append(_describe(current))
            current = None
    return records


def _describe(rec: dict) -> dict:
    m = NAME.search(rec["name"])
    if m is None:
        return rec
    flags = [f == "Lb1E" for f in re.findall(r"Lb[01]E", m.group("flags"))]
    kernel = m.group("kernel")
    if kernel.startswith("norm"):
        rms, bias = flags[0], flags[1]
        op = ("rms_norm" if rms else "layer_norm") + kernel[len("norm") :]
        op += "" if rms else (" +bias" if bias else "")
    else:
        op = kernel
    loop = m.group("loop") is not None
    op += " loop" if loop else ""
    dtype, size = DTYPES[m.group("t")]
    e = int(m.group("e"))
    # softmax's backward holds two chunks (y and dy), and a persistent forward two (this row's and
    # the next's, in flight); the norms' backward four (x and dy of this row and of the next)
    chunks = 4 if kernel == "norm_bwd" else 2 if kernel.endswith("bwd") or loop else 1
    return dict(rec, op=op, dtype=dtype, e=e, occ=int(m.group("occ") or 0), loop=loop,
                chunk_kb=chunks * e * THREADS * size / 1024)  # fmt: skip


def ctas_per_sm(registers: int) -> int:
    """CTAs an SM holds by threads and registers (shared memory does not bind: a few hundred
    bytes a CTA; the norms' backward's column sums, 16-64 KB, fit beside the 2-3 CTAs its
    registers allow)."""
    return blocks_per_sm(THREADS, registers)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--all", action="store_true", help="every tile, not only the used and candidate ones"
    )
    args = ap.parse_args()
    from kernels.cuda import cluster_rows

    rows = {}
    for r in compile_report():
        if "op" not in r:
            continue
        base = r["op"].split(" ")[0]  # layer_norm_fwd +bias: layer_norm_fwd's tiles
        default = (cluster_rows.E_BWD if base.endswith("bwd") else cluster_rows.E_FWD, 0)
        tile = (r["e"], r["occ"])
        candidate = r["dtype"] != "fp32" and tile in cluster_rows.CANDIDATE_TILES.get(base, [])
        if not (args.all or tile == default or candidate):
            continue
        key = (r["op"], r["dtype"], r["e"], r["occ"])
        rows[key] = max(
            rows.get(key, r), r, key=lambda x: x["registers"]
        )  # STATS or not: the larger
    print(f"{'op':18s} {'dtype':5s} {'E':>3s} {'OCC':>3s} {'regs':>4s} {'spill':>5s} "
          f"{'CTAs/SM':>7s} {'KB/CTA':>6s} {'KB/SM':>5s}")  # fmt: skip
    for (op, dtype, e, occ), r in sorted(rows.items()):
        ctas = ctas_per_sm(r["registers"])
        print(f"{op:18s} {dtype:5s} {e:3d} {occ:3d} {r['registers']:4d} {r['spill_bytes']:5d} "
              f"{ctas:7d} {r['chunk_kb']:6.0f} {ctas * r['chunk_kb']:5.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
