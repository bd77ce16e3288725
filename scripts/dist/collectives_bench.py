"""Worker: time the library's collectives and the course's ring all-reduce over message sizes.

notebooks/05a-collectives.ipynb launches it through ``kernels.distributed.torchrun``:

    python -m torch.distributed.run --nproc_per_node=P scripts/dist/collectives_bench.py \
        --sizes 1024 4096 ... --out result.json

First the ring all-reduce is checked against ``dist.all_reduce`` (odd sizes, sizes below the number
of ranks, integers exactly, floats within rounding, every rank holding the same bits); then every
operation is timed at every size with ``kernels.collectives.time_collective`` (warm-up, a barrier
before each sample, CUDA events, the slowest rank's median). Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kernels import collectives as C  # noqa: E402
from kernels.distributed import Worker, finish, init_worker  # noqa: E402


def same_on_every_rank(t: torch.Tensor) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, t)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def check_ring(w: Worker, big_numel: int) -> int:
    """Ring all-reduce against dist.all_reduce; returns how many cases passed (asserts otherwise)."""
    n = w.world
    gen = torch.Generator(device=w.device).manual_seed(1234 + w.rank)
    sizes = sorted({1, max(n - 1, 1), n, n + 1, 1000, 12345, 2**16 + 3, big_numel})
    dtypes = [torch.int32, torch.float32] + ([torch.bfloat16] if w.gpu else [])
    cases = 0
    for numel in sizes:
        for dtype in dtypes:
            for sub in (C.DEFAULT_SUB_CHUNK_BYTES, 4096):  # one sub-chunk, and pipelined
                if dtype.is_floating_point:
                    x = torch.randn(numel, generator=gen, device=w.device).to(dtype)
                else:
                    x = torch.randint(
                        -1000, 1000, (numel,), generator=gen, dtype=dtype, device=w.device
                    )
                ref = C.ring_all_reduce_ref(x)
                out = x.clone()
                assert C.ring_all_reduce(out, sub_chunk_bytes=sub) is out
                if dtype.is_floating_point and n > 2:
                    tol = 1.6e-2 if dtype is torch.bfloat16 else 1e-5
                    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * n)
                else:  # integers, and any two-term sum, must match exactly
                    assert torch.equal(out, ref), f"ring != all_reduce: {dtype}, numel {numel}"
                assert same_on_every_rank(out), f"ranks disagree: {dtype}, numel {numel}"
                cases += 1
    return cases


def busbw_op(op: str) -> str:
    return "all_reduce" if op == "ring_all_reduce" else op


def time_size(w: Worker, nbytes: int, reps: int, warmup: int) -> list[dict]:
    n, dev = w.world, w.device
    numel = max(n, nbytes // 4 // n * n)  # fp32, a multiple of n for all-gather / reduce-scatter
    size = numel * 4
    right, left = (w.rank + 1) % n, (w.rank - 1) % n
    x = torch.zeros(numel, device=dev)  # zeros: repeated sums stay finite; speed is data-blind
    y = torch.zeros(numel, device=dev)
    part = torch.zeros(numel // n, device=dev)

    def send_recv():
        ops = [dist.P2POp(dist.isend, x, right), dist.P2POp(dist.irecv, y, left)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    ops = {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_gather": lambda: C.all_gather(y, part),
        "reduce_scatter": lambda: C.reduce_scatter(part, x),
        "all_to_all": lambda: dist.all_to_all_single(y, x),
        "send_recv": send_recv,
        "ring_all_reduce": lambda: C.ring_all_reduce(x),
    }
    inner = max(1, min(20, (8 << 20) // size))  # back-to-back calls per sample at small sizes
    rows = []
    for op, fn in ops.items():
        t = C.time_collective(fn, dev, warmup=warmup, reps=reps, inner=inner)
        algbw, busbw = C.bandwidths(busbw_op(op), size, t, n)
        rows.append({"op": op, "bytes": size, "seconds": t, "algbw": algbw, "busbw": busbw})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", required=True, help="message sizes, bytes")
    p.add_argument("--sweep-sizes", type=int, nargs="*", default=[], help="sizes for the sweep")
    p.add_argument("--sub-chunks", type=int, nargs="*", default=[], help="sub_chunk_bytes values")
    p.add_argument("--check-numel", type=int, default=4099, help="largest ring check, elements")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out")
    a = p.parse_args()

    w = init_worker()
    checks = check_ring(w, a.check_numel)
    rows = []
    for nbytes in a.sizes:
        rows += time_size(w, nbytes, a.reps, a.warmup)
    sweep = []
    for nbytes in a.sweep_sizes:
        numel = max(w.world, nbytes // 4)
        x = torch.zeros(numel, device=w.device)
        for sub in a.sub_chunks:
            t = C.time_collective(
                lambda x=x, sub=sub: C.ring_all_reduce(x, sub_chunk_bytes=sub),
                w.device,
                warmup=a.warmup,
                reps=a.reps,
            )
            _, busbw = C.bandwidths("all_reduce", numel * 4, t, w.world)
            sweep.append({"bytes": numel * 4, "sub_chunk_bytes": sub, "seconds": t, "busbw": busbw})
    result = {
        "rows": rows,
        "sweep": sweep,
        "checks": checks,
        "default_sub_chunk_bytes": C.DEFAULT_SUB_CHUNK_BYTES,
    }
    finish(w, result, a.out)


if __name__ == "__main__":
    main()
