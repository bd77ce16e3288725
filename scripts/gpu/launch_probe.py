"""Host time per call of the decode-step kernels, through kernels.launch's fast path and through
Triton's own launch (``launch.FAST = False``), against the PyTorch call they replace.

At batch 1 these kernels run for a few µs on the GPU; the rest of a call is the host's. Each row
times back-to-back calls (``kernels.shapes.host_time``: wall time over the count, median of 5
loops) and the device time alone (``kernels.bench.measure(..., device_only=True)``), in one
run, on one GPU. The backward rows time ``torch.autograd.grad`` over one kept forward; the last
row is autograd's own floor: a Python ``autograd.Function`` that launches nothing.

    python scripts/gpu/launch_probe.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout
from kernels import bench, launch, mla, norms, paged_attention, quant, shapes, softmax  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16


def cases():
    """(name, ours, torch's) callables at decode shapes."""
    q, k, v, kc, vc, table, lens = paged_attention.decode_case(1, 1024, dtype=BF16)
    yield (
        "paged_decode b1 32h/8kv 1024 tok",
        lambda: paged_attention.paged_decode(q, kc, vc, table, lens),
        lambda: paged_attention.sdpa_decode(q, k, v),
    )
    ql, qr, kv, mt, ml = mla.decode_case([4096], 128, 512, 64, dtype=BF16)
    yield (
        "mla_decode b1 128h 4096 tok",
        lambda: mla.mla_decode(ql, qr, kv, mt, ml),
        lambda: mla.mla_decode_eager(ql, qr, kv, mt, ml),
    )
    for bits in (4, 8):
        w = torch.randn(4096, 4096, device=DEV, dtype=BF16) * 4096**-0.5
        qw, x = quant.quantize(w, bits, 128), torch.randn(1, 4096, device=DEV, dtype=BF16)
        w16 = quant.dequantize(qw, BF16)
        yield (
            f"gemv int{bits} 1x4096x4096 default",
            lambda qw=qw, x=x: quant.gemv(x, qw),
            lambda w16=w16, x=x: torch.matmul(x, w16.t()),
        )
    x = torch.randn(1, 4096, device=DEV, dtype=BF16)
    wt = torch.ones(4096, device=DEV, dtype=BF16)
    yield (
        "rms_norm fwd 1x4096",
        lambda: norms.rms_norm(x, wt),
        lambda: torch.nn.functional.rms_norm(x, (4096,), wt, 1e-6),
    )
    yield ("softmax fwd 1x4096", lambda: softmax.softmax(x), lambda: torch.softmax(x, -1))
    # The backward passes go through autograd: ours through a Python autograd.Function, whose
    # backward the engine calls on its device thread (taking the GIL), PyTorch's through C++ nodes.
    dy = torch.randn(1, 4096, device=DEV, dtype=BF16)
    xg, wg = x.clone().requires_grad_(), wt.clone().requires_grad_()
    yield (
        "rms_norm bwd 1x4096 (autograd.grad)",
        shapes.grad_call(lambda: norms.rms_norm(xg, wg), [xg, wg], dy),
        shapes.grad_call(lambda: torch.nn.functional.rms_norm(xg, (4096,), wg, 1e-6), [xg, wg], dy),
    )
    yield (
        "softmax bwd 1x4096 (autograd.grad)",
        shapes.grad_call(lambda: softmax.softmax(xg), [xg], dy),
        shapes.grad_call(lambda: torch.softmax(xg, -1), [xg], dy),
    )
    # The floor under both: a Python autograd.Function whose backward does nothing, against a C++
    # node that does nothing either (a view's backward).
    yield (
        "empty autograd.Function bwd (vs view)",
        shapes.grad_call(lambda: _Identity.apply(xg), [xg], dy),
        shapes.grad_call(lambda: xg.view_as(xg), [xg], dy),
    )


class _Identity(torch.autograd.Function):
    """A Python autograd node that launches nothing: what autograd alone costs per backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    rows = []
    for name, ours, theirs in cases():
        row = {"case": name}
        for fast in (True, False):
            launch.FAST = fast
            ours()  # first call of the key: autotune / compile
            torch.cuda.synchronize()
            row["fast_host_us" if fast else "triton_host_us"] = shapes.host_time(ours).ms * 1e3
        launch.FAST = True
        # Device time with the host's launch cost kept out (a GPU spin ahead of each repetition).
        row["device_us"] = bench.measure(ours, device_only=True).ms * 1e3
        row["torch_host_us"] = shapes.host_time(theirs).ms * 1e3
        row["torch_device_us"] = bench.measure(theirs, device_only=True).ms * 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
    )
    print(
        f"{'case':34} {'fast':>7} {'triton':>7} {'torch':>7}   host µs/call; device µs ours/torch"
    )
    for r in rows:
        print(
            f"{r['case']:34} {r['fast_host_us']:7.1f} {r['triton_host_us']:7.1f} "
            f"{r['torch_host_us']:7.1f}   {r['device_us']:6.1f} / {r['torch_device_us']:6.1f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
