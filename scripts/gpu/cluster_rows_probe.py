"""The thread-block cluster row kernels (kernels.cuda.cluster_rows) against the Triton kernels and
PyTorch, on wide rows: device time as a fraction of the copy bandwidth (tests/test_cluster_rows.py
checks the kernels against an fp64 reference).

Each case is timed three ways in one process: the cluster kernels, the Triton kernels (the cluster
path turned off through ``kernels.rows.CLUSTER_ABOVE_COLS``) and PyTorch. Forward traffic is 2 passes
(read x, write y), backward 3 (read x or y and dy, write dx): the cases and their traffic are
kernels.shapes' own.

With ``--tiles``, the 16-bit cases also time each of cluster_rows.CANDIDATE_TILES (columns
``e64/o4`` and the like: E values a thread, an occupancy target of OCC CTAs an SM) against the
default tile (``cluster``), in the same process: the measurement that decides cluster_rows.TILES;
and every dtype's forwards also run as persistent clusters (column ``loop``: cluster_rows.LOOP_FWD).
Without it, ``cluster`` is the tile the library runs (TILES' entry where there is one).

    python scripts/gpu/cluster_rows_probe.py [--quick] [--tiles] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout
from kernels import roofline, rows, shapes  # noqa: E402
from kernels.cuda import cluster_rows  # noqa: E402

CALLS = {}


def _count(name):
    inner = getattr(cluster_rows, name)

    def wrapped(*a, **k):
        CALLS[name] = CALLS.get(name, 0) + 1
        return inner(*a, **k)

    setattr(cluster_rows, name, wrapped)


for _name in ("norm_forward", "norm_backward", "softmax_forward", "softmax_backward"):
    _count(_name)


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiles", action="store_true", help="16-bit cases: time the candidate tiles")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()
    cluster_rows.module()
    print(f"build/load: {time.time() - t0:.1f} s", flush=True)
    assert cluster_rows.unavailable_reason() is None
    # Every op and dtype on the cluster kernels (WINS is what this probe measures), any row count.
    cluster_rows.WINS = {op: set(rows.SUPPORTED_DTYPES) for op in cluster_rows.WINS}
    rows.CLUSTER_MIN_ROWS, rows.CLUSTER_ABOVE_COLS = 1, 8192

    copy = roofline.copy_bandwidth().value  # GB/s
    print(f"copy bandwidth: {copy:.0f} GB/s", flush=True)
    cases = [(torch.bfloat16, 4096, 65536), (torch.float32, 4096, 65536), (torch.bfloat16, 8192, 32768),
             (torch.bfloat16, 16384, 16384), (torch.bfloat16, 512, 65536), (torch.float16, 4096, 65536)]  # fmt: skip
    if args.quick:  # 4096 x 65536 in each dtype
        cases = [c for c in cases if c[1:] == (4096, 65536)]
    recs = []
    library_tiles, library_loop = cluster_rows.TILES, cluster_rows.LOOP_FWD
    for dtype, r, w in cases:
        # The sweep's own six cases of this layout (kernels.shapes): softmax, RMSNorm and
        # LayerNorm, forward and backward, each with its PyTorch call and its minimum traffic.
        row_cases = list(shapes._row_cases([r], [w], [dtype]))
        ms = {c.op: {} for c in row_cases}
        # The cluster path first: a Triton layout, once timed, has a C++ replay plan that later
        # calls of the same layout take (kernels.replay), whatever the cluster setting.
        CALLS.clear()
        # With --tiles the cluster column is the default tile, the candidates' baseline; without,
        # the tile the library runs (TILES).
        cluster_rows.TILES = {} if args.tiles else library_tiles
        for c in row_cases:
            ours, theirs = c.setup()[:2]
            ms[c.op]["cluster"], ms[c.op]["torch"] = bench_ms(ours), bench_ms(theirs)
            ours = theirs = None
        assert len(CALLS) == 4, CALLS  # every op took the cluster path
        if args.tiles and dtype != torch.float32:
            for c in row_cases:
                for e, occ in cluster_rows.CANDIDATE_TILES.get(c.op, []):
                    cluster_rows.TILES = {c.op: {dtype: (e, occ)}}
                    ours = c.setup()[0]
                    ms[c.op][f"e{e}/o{occ}"] = bench_ms(ours)
                    ours = None
        if args.tiles:  # the persistent forwards (column loop), at the default tile, every dtype
            cluster_rows.TILES = {}
            for c in row_cases:
                if c.op in cluster_rows.LOOP_OPS:
                    cluster_rows.LOOP_FWD = {c.op: {dtype}}
                    ours = c.setup()[0]
                    ms[c.op]["loop"] = bench_ms(ours)
                    ours = None
            cluster_rows.LOOP_FWD = library_loop
        cluster_rows.TILES = library_tiles
        rows.CLUSTER_ABOVE_COLS, keep = 1 << 40, rows.CLUSTER_ABOVE_COLS
        CALLS.clear()
        for c in row_cases:
            triton_fn = c.setup()[0]
            ms[c.op]["triton"] = bench_ms(triton_fn)
            triton_fn = None
        assert not CALLS, CALLS
        rows.CLUSTER_ABOVE_COLS = keep
        for c in row_cases:
            frac = {k: round(c.bytes / (v * 1e-3) / 1e9 / copy, 3) for k, v in ms[c.op].items()}
            rec = dict(op=c.op, dtype=str(dtype)[6:], shape=[r, w], ms=ms[c.op], frac=frac)
            recs.append(rec)
            print(rec["op"], rec["dtype"], rec["shape"], rec["frac"], flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                dict(copy_gbps=copy, gpu=torch.cuda.get_device_name(), records=recs), f, indent=1
            )
    print("\nfraction of copy bandwidth (device time, median of do_bench)")
    keys = ["cluster", "triton", "torch"]
    keys += sorted({k for rec in recs for k in rec["frac"]} - set(keys))
    print(f"{'op':16s} {'dtype':9s} {'shape':14s} " + " ".join(f"{k:>11s}" for k in keys))
    for rec in recs:
        cells = " ".join(
            f"{rec['frac'][k]:11.3f}" if k in rec["frac"] else f"{'':11s}" for k in keys
        )
        print(f"{rec['op']:16s} {rec['dtype']:9s} {str(rec['shape']):14s} {cells}")


if __name__ == "__main__":
    main()
