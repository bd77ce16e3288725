"""Worker: ring attention (context parallelism) checked against one device, then timed.

    python -m torch.distributed.run --nproc_per_node=P scripts/dist/ring_attention.py --out r.json

``kernels.context_parallel.ring_attention``, causal with the zig-zag split. Every rank builds the same
full ``q, k, v, dO: [1, H, N, D]`` (same seed) and keeps its shard.

1. Check (``--check-n``): the ring's output and gradients against an fp32 single-process reference,
   next to the single-device kernel's own error on the same inputs: in bf16 on GPUs (the Triton
   engine), in fp32 with the torch engine on CPUs. The ring must be as close as one device is.
2. Timings at each ``--seqs`` N: forward+backward of the ring, of one device on the whole sequence
   (the same FlashAttention kernels; every rank times its own device, rank 0's is reported), and of
   the ring's two halves alone: compute only (every step's attention on the local block, no
   transfer) and communication only (the K/V exchanges and dK/dV accumulators, no attention).
   The ring hides its communication when ``ring ≈ compute only``.

Rank 0 prints a table and writes the JSON. On CPUs (gloo) the sizes shrink and the numbers are CPU
and loopback numbers: that mode is for testing the script.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from kernels import bench  # noqa: E402
from kernels import collectives as C  # noqa: E402
from kernels import context_parallel as CP  # noqa: E402
from kernels import distributed as D  # noqa: E402
from kernels import flash_attention as fa  # noqa: E402
from kernels.numerics import rel_error  # noqa: E402


def inputs(n: int, heads: int, d: int, dtype, device, seed: int = 0):
    rand = D.seeded_randn(device, dtype, seed)  # the same on every rank
    return [rand(1, heads, n, d) for _ in range(4)]


def check(w: D.Worker, n: int, heads: int, d: int, impl: str, dtype) -> dict:
    """Errors of the ring and of one device against fp32, output and the three gradients."""
    q, k, v, do = inputs(n, heads, d, dtype, w.device, seed=1)
    leaves = [t.to(torch.float32, copy=True).requires_grad_() for t in (q, k, v)]
    ref = fa.attention_ref(*leaves, causal=True)
    ref.backward(do.float())
    refs = [ref.detach(), *(t.grad for t in leaves)]

    def shard(x):
        return CP.zigzag_split(x, w.world)[w.rank]

    local = [shard(t).requires_grad_() for t in (q, k, v)]
    out = CP.ring_attention(*local, causal=True, impl=impl)
    out.backward(shard(do))
    ring = [out.detach(), *(t.grad for t in local)]
    ring_errs = [rel_error(g, shard(r)) for g, r in zip(ring, refs)]

    if impl == "triton":  # one device, the same kernels, on the whole sequence
        one = [t.clone().requires_grad_() for t in (q, k, v)]
        o1 = fa.attention(*one, causal=True)
        o1.backward(do)
        single = [o1.detach(), *(t.grad for t in one)]
    else:
        o1, lse = CP.attention_lse_torch(q, k, v, True, d**-0.5)
        single = [o1, *CP.attention_bwd_torch(q, k, v, o1, lse, do, True, d**-0.5)]
    single_errs = [rel_error(shard(g), shard(r)) for g, r in zip(single, refs)]
    names = ["o", "dq", "dk", "dv"]
    for name, e_ring, e_one in zip(names, ring_errs, single_errs):
        # As close to fp32 as one device is (bf16 rounding differs in the order of the sums).
        assert e_ring <= 2 * e_one + (1e-3 if dtype != torch.float32 else 1e-6), (
            f"{name}: ring error {e_ring:.2e} vs one device {e_one:.2e}"
        )
    return {
        "n": n,
        "ring_err": dict(zip(names, ring_errs)),
        "single_err": dict(zip(names, single_errs)),
    }


def time_n(w: D.Worker, n: int, heads: int, d: int, impl: str, dtype, reps: int) -> dict:
    q, k, v, do = inputs(n, heads, d, dtype, w.device)
    scale = d**-0.5
    loc = [CP.zigzag_split(t, w.world)[w.rank] for t in (q, k, v, do)]
    ql, kl, vl, dol = loc
    args = (True, scale, None, impl, "zigzag")

    # The ring, forward + backward through autograd.
    leaves = [t.clone().requires_grad_() for t in (ql, kl, vl)]

    def ring_step():
        CP.ring_attention(*leaves, causal=True, impl=impl).backward(dol)

    # Its halves: compute only, communication only (the same schedule otherwise).
    o_loc, lse_loc = CP.ring_forward(ql, kl, vl, *args)

    def part(which):
        def run():
            CP.ring_forward(ql, kl, vl, *args, parts=which)
            CP.ring_backward(ql, kl, vl, o_loc, lse_loc, dol, *args, parts=which)

        return run

    row = {"n": n, "heads": heads, "d": d, "dtype": str(dtype).replace("torch.", "")}
    row["ring_ms"] = C.time_collective(ring_step, w.device, reps=reps, warmup=2) * 1e3
    row["compute_ms"] = C.time_collective(part("compute"), w.device, reps=reps, warmup=2) * 1e3
    row["comm_ms"] = C.time_collective(part("comm"), w.device, reps=reps, warmup=2) * 1e3

    # One device, the whole sequence (no collectives: each rank measures alone).
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    if impl == "triton":

        def single_step():
            fa.attention(*full, causal=True).backward(do)

    else:

        def single_step():
            o, lse = CP.attention_lse_torch(q, k, v, True, scale)
            CP.attention_bwd_torch(q, k, v, o, lse, do, True, scale)

    row["single_ms"] = bench.measure(single_step).ms
    row["speedup"] = row["single_ms"] / row["ring_ms"]
    shape = (1, heads, n, n, d)
    flops = fa.fwd_flops(*shape, causal=True) + fa.bwd_flops(*shape, causal=True)
    row["ring_tflops_per_gpu"] = flops / w.world / (row["ring_ms"] * 1e-3) / 1e12
    row["kv_bytes_per_step"] = 2 * ql.numel() * ql.element_size()
    return row


def main() -> None:
    p = D.worker_parser(__doc__, reps=10)
    p.add_argument("--seqs", type=int, nargs="*", default=None, help="total sequence lengths N")
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--check-n", type=int, default=None)
    a = p.parse_args()

    w = D.init_worker()
    gpu = w.gpu
    impl, dtype = ("triton", torch.bfloat16) if gpu else ("torch", torch.float32)
    heads = a.heads or (16 if gpu else 2)
    d = a.head_dim or (128 if gpu else 16)
    seqs = a.seqs or ([32768, 65536, 131072] if gpu else [16 * w.world, 32 * w.world])
    check_n = a.check_n or (4096 if gpu else 12 * w.world)
    for n in [check_n, *seqs]:
        if n % (2 * w.world):
            raise SystemExit(f"N = {n} must divide by 2 * ranks = {2 * w.world} (zig-zag split)")

    result = {"impl": impl, "check": check(w, check_n, min(heads, 4), d, impl, dtype), "rows": []}
    if not a.check_only:
        result["rows"] = [time_n(w, n, heads, d, impl, dtype, a.reps) for n in seqs]
    if w.rank == 0:
        c = result["check"]
        print(f"check N={c['n']}: rel. error vs fp32, ring / one device:")
        for name in c["ring_err"]:
            print(f"  {name}: {c['ring_err'][name]:.2e} / {c['single_err'][name]:.2e}")
        print(
            f"{'N':>7} {'one dev ms':>11} {'ring ms':>9} {'speed-up':>9} {'compute ms':>11} "
            f"{'comm ms':>9} {'TFLOP/s/GPU':>12}"
        )
        for r in result["rows"]:
            print(
                f"{r['n']:>7} {r['single_ms']:>11.2f} {r['ring_ms']:>9.2f} {r['speedup']:>8.2f}x "
                f"{r['compute_ms']:>11.2f} {r['comm_ms']:>9.2f} {r['ring_tflops_per_gpu']:>12.1f}"
            )
    D.finish(w, result, a.out)


if __name__ == "__main__":
    main()
