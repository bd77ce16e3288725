"""Paged decode attention at 32k context: fixed tiles and split counts against cuDNN / flash SDPA on a
contiguous cache, in the same run (the notebook 06a comparison, without the autotuner).

    python scripts/gpu/paged_probe.py
"""

import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import bench, device  # noqa: E402
from kernels import paged_attention as pa  # noqa: E402

SEQ = 32768
TILES = [(n, w, s) for n, w, s in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4, 5))
         if not (n == 128 and w == 2)]  # fmt: skip
SPLITS = (4, 8, 16, 0)  # 0: the default


def probe(batch: int, tiles: list, t0: float) -> list:
    q, k, v, kc, vc, table, lens = pa.decode_case(batch, SEQ)
    nbytes = pa.kv_read_bytes([SEQ] * batch, 8, 128, torch.bfloat16)
    ref = pa.sdpa_decode(q, k, v).float()
    base = {}
    for b in pa.sdpa_backends():
        base[b] = bench.measure(lambda b=b: pa.sdpa_decode(q, k, v, b), bytes=nbytes)
    auto = bench.measure(lambda: pa.paged_decode(q, kc, vc, table, lens), bytes=nbytes)
    best_b = min(base, key=lambda b: base[b].ms)
    rows = []
    for tile, sp in itertools.product(tiles, SPLITS):

        def fn(t=tile, s=sp):
            return pa.paged_decode(q, kc, vc, table, lens, num_splits=s or None, config=t)

        try:
            torch.testing.assert_close(fn().float(), ref, rtol=2e-2, atol=2e-2)
            rows.append((tile, sp, bench.measure(fn, bytes=nbytes)))
        except Exception as e:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
            print("  failed", tile, sp, type(e).__name__, str(e)[:80])
    ok = sorted(rows, key=lambda r: r[2].ms)
    sd = ", ".join(f"sdpa-{b} {m.ms * 1e3:.0f} us {m.gbps:,.0f} GB/s" for b, m in base.items())
    print(f"\nbatch {batch}: {sd}; ours autotuned {auto.ms * 1e3:.0f} us "
          f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    for tile, sp, m in ok[:10]:
        print(f"  tile {tile} splits {sp or 'default':>7}: {m.ms * 1e3:7.1f} us {m.gbps:7,.0f} GB/s"
              f"  {base[best_b].ms / m.ms:5.3f}x sdpa-{best_b}")  # fmt: skip
    return list(dict.fromkeys(t for t, _, _ in ok[:8]))


def main() -> None:
    if not device.GPU_MODE:
        sys.exit("paged_probe times GPU kernels: run it on a GPU")
    t0 = time.perf_counter()
    top = probe(8, TILES, t0)
    for batch in (16, 32):
        torch.cuda.empty_cache()
        probe(batch, top, t0)


if __name__ == "__main__":
    main()
