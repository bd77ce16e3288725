"""The CUDA FlashAttention forward's schedules (kernels/cuda/fa_ws.py ``SCHEDULES``) against cuDNN at
the shapes sweep's attention rows, on a Hopper GPU:

    python scripts/gpu/fa_schedules_probe.py           # 512 .. 8,192 tokens, causal and not

bf16, head dim 128, 16 heads, 16,384 tokens a call. Each schedule's output is first checked against
the default's; then every case is timed (kernels.bench.measure: L2 flushed, median) ROUNDS times,
the implementations alternated, and the table gives the median over the rounds. The result behind
``fa_ws.default_schedule``: results/profiles/2026-12-06-nvidia-h100-80gb-hbm3-fa-schedules.txt and
results/profiles/2026-12-07-nvidia-h100-80gb-hbm3-fa-schedules-early.txt.
"""

import functools
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from fa_forward_timing import inputs, shape_for  # noqa: E402

from kernels import bench  # noqa: E402
from kernels import flash_attention as fa  # noqa: E402
from kernels.cuda import fa_ws  # noqa: E402

SEQS = (512, 1024, 2048, 8192)
ROUNDS = 3
NAMES = [*fa_ws.SCHEDULES, "cudnn"]


def main() -> None:
    times: dict[tuple, list[float]] = {}
    for rnd in range(ROUNDS):
        for n in SEQS:
            q, k, v = inputs(shape_for(n), seed=n)  # the other forward probes' inputs
            for causal in (False, True):
                fns = {
                    s: functools.partial(fa_ws.attention, q, k, v, causal, schedule=s)
                    for s in fa_ws.SCHEDULES
                }
                fns["cudnn"] = functools.partial(fa.sdpa, q, k, v, causal, backend="cudnn")
                if rnd == 0:
                    ref = fa_ws.attention(q, k, v, causal)[0].float()
                    for s in fa_ws.SCHEDULES:
                        got = fa_ws.attention(q, k, v, causal, schedule=s)[0].float()
                        err = (got - ref).abs().max().item()
                        assert err < 2e-2, f"schedule {s} differs from the default by {err}"
                with torch.no_grad():
                    for name, fn in fns.items():
                        times.setdefault((n, causal, name), []).append(bench.measure(fn).ms * 1e3)
    print(f"{'N':>5} {'causal':<6} " + " ".join(f"{s:>11}" for s in NAMES) + "  best/cudnn")
    for n in SEQS:
        for causal in (False, True):
            med = {s: statistics.median(times[(n, causal, s)]) for s in NAMES}
            best = min(fa_ws.SCHEDULES, key=med.get)
            default = fa_ws.default_schedule(causal)
            print(
                f"{n:>5} {causal!s:<6} " + " ".join(f"{med[s]:>9.1f}us" for s in NAMES)
                + f"  {best} {med['cudnn'] / med[best]:.3f}x"
                + f"  default {default} {med['cudnn'] / med[default]:.3f}x"
            )  # fmt: skip


if __name__ == "__main__":
    main()
