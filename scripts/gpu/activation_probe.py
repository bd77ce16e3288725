"""Probe: activation memory of the course's decoder in training, per layer, and what recomputation
costs in time (kernels/activation_memory.py).

    python scripts/gpu/activation_probe.py [--seq 4096] [--batch 1] [--out probe.json]

For each recomputation policy (none, selective, full) on ``decoder.BRRR_2B`` in bf16:

- the bytes saved for backward per layer (saved-tensor hooks, device-independent) next to the
  closed form for this decoder with PyTorch's composite RMSNorm and with a fused one (a GPU build
  of PyTorch may fuse ``F.rms_norm``: the matching column says which path ran), and Korthikanti et
  al.'s ``sbh(34 + 5as/h)`` as the reference point;
- ``torch.cuda.memory_allocated`` after each layer's forward minus before it (what the layer leaves
  allocated: its saved activations plus its output, the next layer's input), the forward's and the
  whole step's peak above the starting allocation (``max_memory_allocated``: adds the transient
  buffers, workspaces and allocator rounding the hook count does not see);
- the median time of a forward+backward step, and its overhead over no recomputation.

The measurement is ``kernels.activation_memory.profile_step``; this script prints it.

On a CPU it runs the hook count only, at the TINY shape (to test the script).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import activation_memory as AM  # noqa: E402
from kernels import decoder as dec  # noqa: E402
from kernels import device  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--out")
    a = p.parse_args()
    gpu = device.GPU_MODE
    cfg = dec.default_config()
    seq = a.seq or device.pick(4096, 32)
    dtype = torch.bfloat16
    model = AM.trainable(dec.Decoder(cfg, dtype=dtype, max_position=max(seq, 16)))
    tokens = torch.randint(cfg.vocab, (a.batch, seq), device=model.device)
    print(device.describe())
    print(f"{cfg.name}: s={seq}, b={a.batch}, {cfg.n_layers} layers, bf16 (MiB per layer)")
    rows = [AM.profile_step(model, tokens, rc, time_step=gpu) for rc in AM.RECOMPUTE]
    mib = 2**20
    print(f"{'recompute':>10} {'saved/layer MiB':>16} {'composite':>10} {'fused':>8} {'paper':>8}"
          + (f" {'alloc/layer':>12} {'peak/layer':>11} {'fwd peak':>9} {'step peak':>10} {'step ms':>8} {'overhead':>9}"
             if gpu else ""))  # fmt: skip
    base_ms = rows[0].get("step_ms")
    for r in rows:
        mid = r["saved_per_layer"][-1]  # a layer past the first (which also holds the rotary rows)
        line = (
            f"{r['recompute']:>10} {mid / mib:>16.2f} {r['closed_composite'] / mib:>10.2f} "
            f"{r['closed_fused'] / mib:>8.2f} {r['paper'] / mib:>8.2f}"
        )
        if gpu:
            line += (
                f" {r['allocated_per_layer'][-1] / mib:>12.2f} {r['peak_per_layer'][-1] / mib:>11.2f}"
                f" {r['fwd_peak_bytes'] / mib:>9.0f} "
                f"{r['step_peak_bytes'] / mib:>10.0f} {r['step_ms']:>8.2f} "
                f"{r['step_ms'] / base_ms - 1:>8.1%}"
            )
        print(line)
    if a.out:
        info = {"gpu": torch.cuda.get_device_name() if gpu else "CPU", "torch": torch.__version__}
        Path(a.out).write_text(json.dumps({**info, "seq": seq, "batch": a.batch, "rows": rows}))


if __name__ == "__main__":
    main()
