"""The warp-specialised FlashAttention forward (kernels/flash_attention_ws.py) on a Hopper GPU, in
one command: what the compiler built, correctness in bf16 at head dim 128, then timings against the
course's forward and cuDNN's SDPA, with issue 19's goal checked.

    python scripts/gpu/fa_ws_probe.py            # everything (a few minutes on an H100)
    python scripts/gpu/fa_ws_probe.py --check    # build evidence and correctness only
    python scripts/gpu/fa_ws_probe.py --out ws.jsonl   # also write the timing records there

Timings (kernels.bench.measure, L2 flushed, median) use the same random inputs for every
implementation of a case: the warp-specialised kernel ("ws"), the same kernel and tiles with the
pass off ("ws-off": one 4-warp warpgroup then holds the whole 128-row tile, so expect register
spills; it shows what the pass changes, not a tuned rival), the course's forward
(flash_attention.attention, no autograd) and SDPA's cuDNN and FlashAttention-2 backends where they
run. Issue 19's goal: ws >= 0.9x cuDNN's forward at N >= 4096, d = 128, causal and not. The records
are not appended to results/: this kernel is an experiment until this probe shows it correct and
faster.
"""

import argparse
import functools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fa_forward_timing import SEQS, forward_timings, inputs, sdpa_impls, shape_for  # noqa: E402

from kernels import device  # noqa: E402
from kernels import flash_attention as fa  # noqa: E402
from kernels import flash_attention_ws as ws  # noqa: E402
from kernels.numerics import rel_error as rel_err  # noqa: E402

CHECK_SEQS = [1000, 4097] + SEQS  # two lengths that are not multiples of any tile
TOL = 3e-2  # bf16 output and bf16 P before P·V, as in tests/test_flash_attention.py
COURSE_TOL = 1e-2  # relative error against the course's forward on the same inputs
LSE_TOL = 2e-2  # largest |lse - course's lse| that counts as right


def evidence() -> None:
    print("\n== what the compiler built (sm_90, the configurations the autotuner may pick) ==")
    for causal in (False, True):
        for _, block_n, stages in ws._WS_CONFIGS:
            e = ws.build_evidence(ws.compile_spec(causal, block_n, stages))
            print(f"  causal={causal!s:<5} BLOCK_N={block_n:<3} stages={stages}: {e}")
            assert e["warp_specialize_op"], "the warp-specialisation pass did not fire"


def correctness() -> None:
    print("\n== correctness (bf16, d=128; reference fp32 on the first two heads) ==")
    for n in CHECK_SEQS:
        shape = shape_for(n)
        q, k, v = inputs(shape, seed=n)
        for causal in (False, True):
            o, lse = ws.attention_ws_with_lse(q, k, v, causal)
            assert not o.isnan().any(), "NaN in attention_ws"
            sub = (slice(0, 1), slice(0, 2))  # the fp32 reference's N x N scores fit for two heads
            ref = fa.attention_ref(q[sub], k[sub], v[sub], causal)
            err_ref = rel_err(o[sub], ref)
            o_fa, lse_fa = fa.attention_with_lse(q, k, v, causal)
            err_fa = rel_err(o, o_fa)
            lse_diff = (lse - lse_fa).abs().max().item()
            ok = err_ref < TOL and err_fa < COURSE_TOL and lse_diff < LSE_TOL
            print(f"  {'ok  ' if ok else 'FAIL'} N={n:<6} causal={causal!s:<5} vs fp32 {err_ref:.2e}"
                  f"  vs course {err_fa:.2e}  lse max diff {lse_diff:.1e}"
                  f"  tile {ws._attn_fwd_ws_kernel.best_config}", flush=True)  # fmt: skip
            if lse_diff >= LSE_TOL:
                lse_diagnosis(lse, lse_fa)
            if err_ref >= TOL or err_fa >= COURSE_TOL:
                raise SystemExit(f"attention_ws wrong at N={n} causal={causal}")


def lse_diagnosis(lse: torch.Tensor, lse_fa: torch.Tensor) -> None:
    """Which rows' log-sum-exp came out wrong when the output did not: their share, their position
    inside a 128-row tile, and a few values (a log2/ln slip shows as a constant ratio)."""
    bad = (lse - lse_fa).abs() > LSE_TOL
    rows = bad.nonzero()[:, -1]
    print(
        f"    lse wrong in {bad.float().mean().item():.1%} of rows; row % 128 of the wrong ones: "
        f"{sorted(set((rows % 128).tolist()))[:24]}; rows {rows[:8].tolist()}"
    )
    i = bad.flatten().nonzero()[:4].flatten()
    print(f"    ws {lse.flatten()[i].tolist()}  course {lse_fa.flatten()[i].tolist()}")


def impls() -> dict:
    return {
        "ws": ws.attention_ws,
        "ws-off": functools.partial(ws.attention_ws, warp_specialize=False),
        "course": functools.partial(fa.attention, impl="triton"),
        **sdpa_impls(),
    }


def timings(out_path: str | None) -> None:
    ratios = [("ws/cudnn", "ws", "sdpa-cudnn"), ("ws/course", "ws", "course"),
              ("ws/ws-off", "ws", "ws-off")]  # fmt: skip
    forward_timings(impls(), ratios, "flash_attention_ws", lambda name: name == "ws", out_path,
                    note=lambda: str(ws._attn_fwd_ws_kernel.best_config))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="build evidence and correctness only")
    parser.add_argument("--out", help="write the timing records (JSON Lines) to this file")
    args = parser.parse_args()
    print(device.describe())
    os.environ[ws.UNSAFE_ENV] = "1"  # the probe is what checks the pass the launcher refuses
    if not ws.on_hopper():
        cc = device.capabilities().compute_capability
        raise SystemExit(f"this probe needs a Hopper GPU (compute capability 9.x), got {cc}")
    evidence()
    correctness()
    if not args.check:
        timings(args.out)


if __name__ == "__main__":
    main()
