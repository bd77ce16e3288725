"""Worker: the tensor-parallel MLP of Act 5, checked against one device, then timed.

    python -m torch.distributed.run --nproc_per_node=P scripts/dist/tp_mlp.py [--check-only] --out r.json

Every rank builds the same full weights (same seed) and keeps its shard (``kernels.distributed``:
``shard_mlp``, ``tp_mlp``). The check runs forward and backward in float64 and asserts that the output,
the input's gradient and every shard's gradient equal the single-device ones. The timing compares, per
width, the whole MLP on one device with the tensor-parallel forward pass, its local matmuls alone and
the one all-reduce it needs. Rank 0 writes the JSON.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kernels import collectives as C  # noqa: E402
from kernels import distributed as D  # noqa: E402


def weights(d_model: int, d_ff: int, dtype, device, seed: int = 7):
    rand = D.seeded_randn(device, dtype, seed)  # the same on every rank
    return (
        rand(d_model, d_ff, scale=d_model**-0.5),
        rand(d_ff, scale=0.1),
        rand(d_ff, d_model, scale=d_ff**-0.5),
        rand(d_model, scale=0.1),
    )


def check(w: D.Worker) -> int:
    """Forward and backward of tp_mlp equal the single-device MLP (float64); returns cases passed."""
    cases = 0
    for tokens, d_model, d_ff in [(5, 16, 37), (3, 8, max(w.world - 1, 1)), (64, 48, 96)]:
        w1, b1, w2, b2 = weights(d_model, d_ff, torch.float64, w.device)
        gen = torch.Generator(device=w.device).manual_seed(11)
        x = torch.randn(tokens, d_model, generator=gen, device=w.device, dtype=torch.float64)
        g = torch.randn(tokens, d_model, generator=gen, device=w.device, dtype=torch.float64)
        full = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
        ref = D.mlp_ref(*full)
        ref.backward(g)
        shards = [t.requires_grad_() for t in D.shard_mlp(w1, b1, w2, b2, w.rank, w.world)]
        xs = x.clone().requires_grad_()
        out = D.tp_mlp(xs, *shards)
        out.backward(g)
        lo, hi = C.chunk_bounds(d_ff, w.world)[w.rank]
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(xs.grad, full[0].grad)
        torch.testing.assert_close(shards[0].grad, full[1].grad[:, lo:hi])
        torch.testing.assert_close(shards[1].grad, full[2].grad[lo:hi])
        torch.testing.assert_close(shards[2].grad, full[3].grad[lo:hi])
        torch.testing.assert_close(shards[3].grad, full[4].grad)
        cases += 1
    return cases


def time_width(w: D.Worker, d_model: int, tokens: int, reps: int) -> dict:
    from kernels import bench, device

    # bf16 on GPUs that have it; fp16 (with a printed line) on those that do not, e.g. two T4s.
    dtype = device.preferred_dtype(torch.bfloat16) if w.gpu else torch.float32
    d_ff = 4 * d_model
    w1, b1, w2, b2 = weights(d_model, d_ff, dtype, w.device)
    gen = torch.Generator(device=w.device).manual_seed(3)  # every rank holds the same input
    x = torch.randn(tokens, d_model, generator=gen, device=w.device, dtype=dtype)
    shards = D.shard_mlp(w1, b1, w2, b2, w.rank, w.world)
    flops = 2 * 2 * tokens * d_model * d_ff
    with torch.no_grad():
        y_tp = D.tp_mlp(x, *shards)
        y_ref = D.mlp_ref(x, w1, b1, w2, b2)
        err = ((y_tp.float() - y_ref.float()).norm() / y_ref.float().norm()).item()
        assert err < (1e-5 if dtype is torch.float32 else 2e-2), f"TP MLP rel. error {err:.2e}"
        # One device, the whole MLP (each rank measures its own GPU; no communication involved).
        single = bench.measure(lambda: D.mlp_ref(x, w1, b1, w2, b2), flops=flops)
        local = bench.measure(
            lambda: torch.nn.functional.gelu(x @ shards[0] + shards[1]) @ shards[2],
            flops=flops / w.world,
        )
        partial = torch.zeros(tokens, d_model, device=w.device, dtype=dtype)
        allreduce = C.time_collective(lambda: dist.all_reduce(partial), w.device, reps=reps)
        tp = C.time_collective(lambda: D.tp_mlp(x, *shards), w.device, reps=reps)
    return {
        "d_model": d_model,
        "d_ff": d_ff,
        "tokens": tokens,
        "dtype": str(dtype).replace("torch.", ""),
        "single_ms": single.ms,
        "local_ms": local.ms,
        "allreduce_ms": allreduce * 1e3,
        "tp_ms": tp * 1e3,
        "allreduce_bytes": tokens * d_model * x.element_size(),
        "flops": flops,
        "rel_err": err,
    }


def main() -> None:
    p = D.worker_parser(__doc__, reps=20)
    p.add_argument("--widths", type=int, nargs="*", default=[64, 128], help="d_model values")
    p.add_argument("--tokens", type=int, default=128)
    a = p.parse_args()

    w = D.init_worker()
    result = {"checks": check(w), "rows": []}
    if not a.check_only:
        result["rows"] = [time_width(w, d, a.tokens, a.reps) for d in a.widths]
    D.finish(w, result, a.out)


if __name__ == "__main__":
    main()
