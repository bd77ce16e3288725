"""Worker: the tensor-parallel MLP block with and without sequence parallelism, checked, then timed.

    python -m torch.distributed.run --nproc_per_node=P scripts/dist/sp_mlp.py [--check-only] --out r.json

The block is ``x + gelu(LayerNorm(x) @ w1 + b1) @ w2 + b2`` on ``x: [s, b, h]``
(``kernels.sequence_parallel``). Every rank builds the same full weights (same seed) and keeps its
shard. The check runs forward and backward in float64 and asserts that TP and TP+SP give the
single-device output and gradients. Then, per width, forward+backward is timed for TP (all-reduce;
the norm and residual on all ``s`` tokens) and TP+SP (all-gather + reduce-scatter; norm and residual
on ``s/P`` tokens), and the memory each keeps is measured two ways: the bytes saved for backward
(``activation_memory.SavedTensorCounter``, device-independent, next to the count
``sequence_parallel.activation_elements``) and, on a GPU, the peak allocated during the forward
pass above what was allocated before it. Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from kernels import activation_memory as AM  # noqa: E402
from kernels import collectives as C  # noqa: E402
from kernels import distributed as D  # noqa: E402
from kernels import sequence_parallel as SP  # noqa: E402


def weights(h: int, d_ff: int, dtype, device, seed: int = 7):
    gen = torch.Generator(device=device).manual_seed(seed)  # the same on every rank

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * scale

    return (
        1 + rand(h, scale=0.1),
        rand(h, scale=0.1),
        rand(h, d_ff, scale=h**-0.5),
        rand(d_ff, scale=0.1),
        rand(d_ff, h, scale=d_ff**-0.5),
        rand(h, scale=0.1),
    )


def check(w: D.Worker) -> int:
    """TP and TP+SP equal the single-device block, forward and every gradient (float64)."""
    cases = 0
    for s, b, h, d_ff in [(2 * w.world, 1, 16, 37), (3 * w.world, 2, 48, 96)]:
        full = weights(h, d_ff, torch.float64, w.device)
        gen = torch.Generator(device=w.device).manual_seed(11)
        x = torch.randn(s, b, h, generator=gen, device=w.device, dtype=torch.float64)
        dy = torch.randn(s, b, h, generator=gen, device=w.device, dtype=torch.float64)
        leaves = [t.clone().requires_grad_() for t in (x, *full)]
        ref = SP.block_ref(*leaves)
        ref.backward(dy)
        n, lo_hi = s // w.world, C.chunk_bounds(d_ff, w.world)[w.rank]
        mine = slice(w.rank * n, (w.rank + 1) * n)
        for sp in (False, True):
            ln = [t.clone().requires_grad_() for t in full[:2]]
            shards = [t.clone().requires_grad_() for t in D.shard_mlp(*full[2:], w.rank, w.world)]
            xs = (x[mine] if sp else x).clone().requires_grad_()
            out = (SP.sp_block if sp else SP.tp_block)(xs, *ln, *shards)
            out.backward(dy[mine] if sp else dy)
            if sp:
                SP.reduce_replicated_grads([ln[0], ln[1], shards[3]])
            torch.testing.assert_close(out, ref.detach()[mine] if sp else ref.detach())
            torch.testing.assert_close(xs.grad, leaves[0].grad[mine] if sp else leaves[0].grad)
            lo, hi = lo_hi
            expect = [
                leaves[1].grad,
                leaves[2].grad,
                leaves[3].grad[:, lo:hi],
                leaves[4].grad[lo:hi],
                leaves[5].grad[lo:hi],
                leaves[6].grad,
            ]
            for got, exp in zip([*ln, *shards], expect):
                torch.testing.assert_close(got.grad, exp)
            cases += 1
    return cases


def measure_width(w: D.Worker, h: int, s: int, b: int, reps: int) -> dict:
    dtype = torch.bfloat16 if w.gpu else torch.float32
    d_ff = 4 * h
    full = weights(h, d_ff, dtype, w.device)
    ln = [t.requires_grad_() for t in full[:2]]
    shards = [t.requires_grad_() for t in D.shard_mlp(*full[2:], w.rank, w.world)]
    gen = torch.Generator(device=w.device).manual_seed(3)
    x = torch.randn(s, b, h, generator=gen, device=w.device, dtype=dtype)
    n = s // w.world
    inputs = {
        "tp": x.requires_grad_(),
        "sp": x.detach()[w.rank * n : (w.rank + 1) * n].clone().requires_grad_(),
    }
    fns = {"tp": SP.tp_block, "sp": SP.sp_block}
    row = {"h": h, "d_ff": d_ff, "s": s, "b": b, "dtype": str(dtype).replace("torch.", "")}
    for name, fn in fns.items():
        xi = inputs[name]
        dy = torch.ones_like(xi)

        def step(fn=fn, xi=xi, dy=dy):
            fn(xi, *ln, *shards).backward(dy)

        row[f"{name}_ms"] = C.time_collective(step, w.device, reps=reps) * 1e3
        counter = AM.SavedTensorCounter(exclude=[*ln, *shards])
        if w.gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(w.device)
            before = torch.cuda.memory_allocated(w.device)
        with counter:
            out = fn(xi, *ln, *shards)
        if w.gpu:
            torch.cuda.synchronize()
            row[f"{name}_fwd_peak_bytes"] = torch.cuda.max_memory_allocated(w.device) - before
            row[f"{name}_held_bytes"] = torch.cuda.memory_allocated(w.device) - before
        out.backward(torch.ones_like(out))
        row[f"{name}_saved_bytes"] = counter.total
        row[f"{name}_count_bytes"] = (
            SP.activation_elements(s, b, h, w.world, name == "sp") * x.element_size()
        )
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--widths", type=int, nargs="*", default=None, help="h values")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out")
    a = p.parse_args()

    w = D.init_worker()
    widths = a.widths or ([2048, 4096, 8192] if w.gpu else [64, 128])
    seq = a.seq or (8192 if w.gpu else 32 * w.world)
    if seq % w.world:
        raise SystemExit(f"--seq {seq} must divide by the number of ranks {w.world}")
    result = {"checks": check(w), "rows": []}
    if not a.check_only:
        result["rows"] = [measure_width(w, h, seq, a.batch, a.reps) for h in widths]
        if w.rank == 0:
            print(f"{'h':>6} {'TP ms':>9} {'SP ms':>9} {'TP saved MB':>12} {'SP saved MB':>12}")
            for r in result["rows"]:
                print(
                    f"{r['h']:>6} {r['tp_ms']:>9.3f} {r['sp_ms']:>9.3f} "
                    f"{r['tp_saved_bytes'] / 2**20:>12.2f} {r['sp_saved_bytes'] / 2**20:>12.2f}"
                )
    D.finish(w, result, a.out)


if __name__ == "__main__":
    main()
