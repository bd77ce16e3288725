"""MLA decode and DeepSeek sparse attention on a GPU, in one command: correctness at DeepSeek-V3's
sizes in bf16 (fp8 indexer where the GPU has FP8) against the fp32 references, then a fixed-tile
sweep of mla_decode, then the `mla_decode` and `dsa` benchmarks with their roofs and baselines.

    python scripts/gpu/mla_probe.py            # everything (about 5-10 minutes on an H100)
    python scripts/gpu/mla_probe.py --check    # correctness only
    python scripts/gpu/mla_probe.py --save     # also append the benchmark records to results/

Prints the split counts and the tiles the autotuner chose, so a later session can tune the lists
in kernels/mla.py and kernels/dsa.py from what it sees.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import bench, device, dsa, mla, roofline  # noqa: E402
from kernels.numerics import rel_error as rel_err  # noqa: E402

V3 = mla.DEEPSEEK_V3
H, R, ROPE = V3["n_heads"], V3["r"], V3["d_rope"]
HI, DI, TOPK = dsa.DEEPSEEK_V32["n_idx_heads"], dsa.DEEPSEEK_V32["d_idx"], dsa.DEEPSEEK_V32["topk"]
DTYPE = torch.bfloat16
LONG, MID, SHORT = 32768, 8192, 4097  # context lengths of the correctness checks


def check(name: str, err: float, tol: float) -> None:
    status = "ok  " if err < tol else "FAIL"
    print(f"  {status} {name:<58} rel err {err:.2e} (tol {tol:.0e})", flush=True)
    if err >= tol:
        raise SystemExit(f"{name}: relative error {err:.3e} >= {tol:.0e}")


def correctness() -> None:
    print("\n== correctness (bf16 against the fp32 references) ==")
    bf16 = DTYPE
    for heads in (H, 16, 3, 1):
        lens = [1, 100, SHORT, 0, LONG] if heads == H else [77, 0, SHORT // 2]
        q, qr, kv, table, sl = mla.decode_case(lens, heads, R, ROPE, dtype=bf16, seed=heads)
        ref = mla.mla_decode_ref(q, qr, kv, table, sl)
        for splits in (None, 1, 7):
            out = mla.mla_decode(q, qr, kv, table, sl, num_splits=splits)
            assert not out.isnan().any(), "NaN in mla_decode"
            assert out[lens.index(0)].abs().max() == 0, "an empty sequence must give zeros"
            check(f"mla_decode H={heads} lens={lens} splits={splits}", rel_err(out, ref), 1e-2)
        print(f"    splits by default: {mla.default_num_splits(len(lens), table.shape[1] * 64)}, "
              f"tile chosen: {mla.chosen_config()}")  # fmt: skip
    eager = mla.mla_decode_eager(q, qr, kv, table, sl)
    check("mla_decode_eager (baseline)", rel_err(eager, ref), 1e-2)

    idx_dtype = dsa.indexer_dtype()
    print(f"  indexer dtype on this GPU: {idx_dtype}")
    c = dsa.dsa_case([MID, 3000, 1], H, R, ROPE, HI, DI, dtype=bf16, idx_dtype=idx_dtype)
    args = (c["q_idx"], c["k_idx_cache"], c["w"], c["block_table"], c["positions"])
    scores = dsa.lightning_indexer(*args)
    ref_scores = dsa.lightning_indexer_ref(*args)  # on the same (quantised) values, in fp32
    fin = torch.isfinite(ref_scores)
    assert torch.equal(torch.isfinite(scores), fin), "causal mask differs"
    # Hopper's FP8 MMA accumulates with fewer bits than fp32 (DeepSeek-V3's report measures
    # about 14): a looser bound there.
    tol = 1e-2 if idx_dtype == torch.float8_e4m3fn else 1e-3
    err = rel_err(scores[fin], ref_scores[fin])
    check("lightning_indexer (decode) vs fp32 on the same inputs", err, tol)
    print(f"    indexer tile chosen: {dsa._indexer_kernel.best_config}")
    idx = dsa.topk_indices(scores, TOPK, c["positions"])
    ref_idx = dsa.topk_indices(ref_scores, TOPK, c["positions"])
    for b in range(3):
        got = set(idx[b, 0][idx[b, 0] >= 0].tolist())
        want = set(ref_idx[b, 0][ref_idx[b, 0] >= 0].tolist())
        overlap = len(got & want) / max(1, len(want))
        print(f"    top-{TOPK} overlap with the fp32 reference, sequence {b}: {overlap:.4f}")
        assert overlap > 0.95, "top-k sets differ by more than near-ties"
    q, qr = c["q_latent"][:, 0], c["q_rope"][:, 0]
    for splits in (None, 1):
        out = dsa.sparse_mla(q, qr, c["kv_cache"], c["block_table"], idx[:, 0], num_splits=splits)
        ref = dsa.sparse_mla_ref(q, qr, c["kv_cache"], c["block_table"], idx[:, 0])
        check(f"sparse_mla decode k={TOPK} splits={splits}", rel_err(out, ref), 1e-2)
    print(f"    sparse tile chosen: {mla.chosen_config(dsa._sparse_mla_kernel)}")

    c = dsa.dsa_case([SHORT, 300], H, R, ROPE, HI, DI, n_queries=64, dtype=bf16,
                     idx_dtype=idx_dtype, seed=3)  # fmt: skip
    keys = ("q_latent", "q_rope", "kv_cache", "q_idx", "k_idx_cache", "w", "block_table")
    out = dsa.dsa_prefill(*[c[k] for k in keys], c["positions"], topk=TOPK, query_chunk=16)
    n_ctx = int(c["positions"].max()) + 1  # as dsa_prefill: ties then break the same way
    names = ("q_idx", "k_idx_cache", "w", "block_table", "positions")
    scores = dsa.lightning_indexer(*[c[k] for k in names], n_ctx)
    ind = dsa.topk_indices(scores, TOPK, c["positions"])
    ref = dsa.sparse_mla_ref(c["q_latent"], c["q_rope"], c["kv_cache"], c["block_table"], ind)
    check("dsa_prefill (64 queries, chunks of 16) vs sparse_mla_ref", rel_err(out, ref), 1e-2)


def sweep() -> None:
    """Each fixed tile of mla_decode (and 1 / default / 2x splits) at two shapes, against eager."""
    print("\n== mla_decode tile sweep (bf16, 128 heads, r 512, rope 64, pages of 64) ==")
    copy = roofline.copy_bandwidth().value
    peak = roofline.matmul_peak("bfloat16").value
    print(f"  measured roofs: copy {copy:,.0f} GB/s, bf16 matmul {peak:,.0f} TFLOP/s")
    for batch, ctx in ((8, 32768), (64, 8192), (128, 4096)):
        sweep_shape(batch, ctx, copy, peak)
        torch.cuda.empty_cache()


def sweep_shape(batch: int, ctx: int, copy: float, peak: float) -> None:
    q, qr, kv, table, sl = mla.decode_case(
        [ctx] * batch, H, R, ROPE, dtype=DTYPE, spare_blocks=0, exact_table=True
    )
    nbytes = mla.mla_decode_bytes(batch, ctx)
    roof_s, which = mla.mla_decode_roof_s(batch, ctx, copy, peak)
    eager = bench.measure(lambda: mla.mla_decode_eager(q, qr, kv, table, sl), bytes=nbytes)
    default = mla.default_num_splits(batch, ctx)
    print(f"\n  batch {batch}, context {ctx}: roof {roof_s * 1e6:,.0f} us ({which}-bound), "
          f"intensity {mla.mla_decode_intensity(batch, ctx):.0f} FLOP/B, eager "
          f"{eager.ms * 1e3:,.0f} us, default splits {default}")  # fmt: skip
    rows = []
    for cfg in mla._CONFIGS:
        for splits in sorted({1, default, 2 * default}):

            def fn(c=cfg, s=splits):
                return mla.mla_decode(q, qr, kv, table, sl, num_splits=s, config=c)

            try:
                rows.append((cfg, splits, bench.measure(fn, bytes=nbytes)))
            except Exception as e:  # noqa: BLE001 - a tile that does not fit is reported
                print(f"    {cfg} splits {splits}: {type(e).__name__} {str(e)[:80]}")
    for cfg, splits, m in sorted(rows, key=lambda r: r[2].ms)[:8]:
        print(f"    tile {cfg} splits {splits:>3}: {m.ms * 1e3:8.1f} us  "
              f"{m.gbps:7,.0f} GB/s  {roof_s * 1e3 / m.ms:5.2f} of roof  "
              f"{eager.ms / m.ms:5.2f}x eager")  # fmt: skip


def benchmarks(save: bool) -> None:
    print("\n== benchmarks (kernels.bench: mla_decode, dsa) ==", flush=True)
    recs = []
    for name, fn in (("mla_decode", mla._bench_mla_decode), ("dsa", dsa._bench_dsa)):
        t0 = time.perf_counter()
        got = fn(False)
        print(f"  {name}: {len(got)} records in {time.perf_counter() - t0:.0f} s", flush=True)
        print(f"    mla_decode tile: {mla.chosen_config()}, sparse tile: "
              f"{mla.chosen_config(dsa._sparse_mla_kernel)}, indexer tile: "
              f"{getattr(dsa._indexer_kernel, 'best_config', None)}")  # fmt: skip
        recs += got
        torch.cuda.empty_cache()
    print(bench.format_table(recs))
    if save:
        print(f"appended {len(recs)} records to {bench.append_records(recs)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="correctness only")
    p.add_argument("--save", action="store_true", help="append benchmark records to results/")
    args = p.parse_args()
    if not device.GPU_MODE:
        sys.exit("mla_probe checks and times GPU kernels: run it on a GPU")
    print(device.describe())
    correctness()
    if args.check:
        return
    sweep()
    benchmarks(args.save)


if __name__ == "__main__":
    main()
