"""Worker: the tensor-parallel MLP and attention blocks with and without sequence parallelism.

    python -m torch.distributed.run --nproc_per_node=P scripts/dist/sp_mlp.py [--check-only] --out r.json

The MLP block is ``x + gelu(LayerNorm(x) @ w1 + b1) @ w2 + b2`` on ``x: [s, b, h]``, the attention
block ``x + attention(LayerNorm(x))`` with causal multi-head attention, heads split over the ranks
(``kernels.sequence_parallel``). Every rank builds the same full weights (same seed) and keeps its
shard. The check runs forward and backward in float64 and asserts that TP and TP+SP give the
single-device output and gradients. Then, per block and width, forward+backward is timed for TP
(all-reduce; the norm and residual on all ``s`` tokens) and TP+SP (all-gather + reduce-scatter;
norm and residual on ``s/P`` tokens), and the memory each keeps is measured two ways: the bytes
saved for backward (``activation_memory.SavedTensorCounter``, device-independent; for the MLP next
to the count ``sequence_parallel.activation_elements``) and, on a GPU, the peak allocated during
the forward pass above what was allocated before it. Rank 0 writes the JSON.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from kernels import activation_memory as AM  # noqa: E402
from kernels import collectives as C  # noqa: E402
from kernels import device  # noqa: E402
from kernels import distributed as D  # noqa: E402
from kernels import sequence_parallel as SP  # noqa: E402


def weights(h: int, d_ff: int, dtype, device, seed: int = 7):
    rand = D.seeded_randn(device, dtype, seed)  # the same on every rank
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


def attention_weights(h: int, dtype, device, seed: int = 5):
    rand = D.seeded_randn(device, dtype, seed)  # the same on every rank
    return (
        1 + rand(h, scale=0.1),
        rand(h, scale=0.1),
        rand(h, 3 * h, scale=h**-0.5),
        rand(3 * h, scale=0.1),
        rand(h, h, scale=h**-0.5),
        rand(h, scale=0.1),
    )


def check_attention(w: D.Worker) -> int:
    """The attention block: TP and TP+SP equal one device (float64), output and input gradient."""
    s, b, head_dim, heads = 3 * w.world, 2, 8, w.world + 1
    h = heads * head_dim
    full = attention_weights(h, torch.float64, w.device)
    gen = torch.Generator(device=w.device).manual_seed(13)
    x = torch.randn(s, b, h, generator=gen, device=w.device, dtype=torch.float64)
    dy = torch.randn(s, b, h, generator=gen, device=w.device, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    ref = SP.attention_block_ref(xr, *full, head_dim=head_dim)
    ref.backward(dy)
    shards = SP.shard_attention(*full[2:], heads, w.rank, w.world)
    n = s // w.world
    mine = slice(w.rank * n, (w.rank + 1) * n)
    for sp in (False, True):
        xs = (x[mine] if sp else x).clone().requires_grad_()
        fn = SP.sp_attention_block if sp else SP.tp_attention_block
        out = fn(xs, *full[:2], *shards[:3], full[5], head_dim=head_dim)
        out.backward(dy[mine] if sp else dy)
        torch.testing.assert_close(out, ref.detach()[mine] if sp else ref.detach())
        torch.testing.assert_close(xs.grad, xr.grad[mine] if sp else xr.grad)
    return 2


def measure_width(w: D.Worker, h: int, s: int, b: int, reps: int, block: str) -> dict:
    # bf16 on GPUs that have it; fp16 (with a printed line) on those that do not, as tp_mlp.py does.
    dtype = device.preferred_dtype(torch.bfloat16) if w.gpu else torch.float32
    row = {"block": block, "h": h, "s": s, "b": b, "dtype": str(dtype).replace("torch.", "")}
    if block == "mlp":
        row["d_ff"] = 4 * h
        full = weights(h, 4 * h, dtype, w.device)
        shards = list(D.shard_mlp(*full[2:], w.rank, w.world))
        fns = {"tp": SP.tp_block, "sp": SP.sp_block}
    else:
        head_dim = 128 if w.gpu else 16
        row["heads"], row["head_dim"] = h // head_dim, head_dim
        full = attention_weights(h, dtype, w.device)
        shards = list(SP.shard_attention(*full[2:], h // head_dim, w.rank, w.world))
        fns = {
            "tp": functools.partial(SP.tp_attention_block, head_dim=head_dim),
            "sp": functools.partial(SP.sp_attention_block, head_dim=head_dim),
        }
    ln = [t.requires_grad_() for t in full[:2]]
    shards = [t.requires_grad_() for t in shards]
    gen = torch.Generator(device=w.device).manual_seed(3)
    x = torch.randn(s, b, h, generator=gen, device=w.device, dtype=dtype)
    inputs = {
        "tp": x.requires_grad_(),
        "sp": SP.shard_sequence(x.detach()).clone().requires_grad_(),
    }
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
        if block == "mlp":
            count = SP.activation_elements(s, b, h, w.world, name == "sp")
            row[f"{name}_count_bytes"] = count * x.element_size()
    return row


def main() -> None:
    p = D.worker_parser(__doc__, reps=20)
    p.add_argument("--widths", type=int, nargs="*", default=None, help="h values")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument(
        "--blocks", nargs="*", default=["mlp", "attention"], choices=["mlp", "attention"]
    )
    a = p.parse_args()

    w = D.init_worker()
    widths = a.widths or ([2048, 4096, 8192] if w.gpu else [64, 128])
    seq = a.seq or (8192 if w.gpu else 32 * w.world)
    if seq % w.world:
        raise SystemExit(f"--seq {seq} must divide by the number of ranks {w.world}")
    result = {"checks": check(w) + check_attention(w), "rows": []}
    if not a.check_only:
        result["rows"] = [
            measure_width(w, h, seq, a.batch, a.reps, block) for block in a.blocks for h in widths
        ]
        if w.rank == 0:
            print(
                f"{'block':>9} {'h':>6} {'TP ms':>9} {'SP ms':>9} {'TP saved MiB':>13} "
                f"{'SP saved MiB':>13}"
            )
            for r in result["rows"]:
                print(
                    f"{r['block']:>9} {r['h']:>6} {r['tp_ms']:>9.3f} {r['sp_ms']:>9.3f} "
                    f"{r['tp_saved_bytes'] / 2**20:>13.2f} {r['sp_saved_bytes'] / 2**20:>13.2f}"
                )
    D.finish(w, result, a.out)


if __name__ == "__main__":
    main()
