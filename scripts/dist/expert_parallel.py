"""Worker: expert parallelism for the MoE layer, checked against one process, then timed by phase.

    python -m torch.distributed.run --nproc_per_node=P scripts/dist/expert_parallel.py \
        [--check-only] [--tokens 4096 --hidden 7168 --width 2048 --experts 256 --top-k 8] \
        --out r.json

Every rank builds the same full weights (same seed) and keeps its experts (``kernels.moe.ep``). The
check runs in fp32: each rank's output of ``ep_moe_forward`` must equal its tokens' rows of the
single-process ``moe_layer`` over every rank's tokens (uneven token counts, a rank whose experts
get no rows): bit for bit on CPUs, within 1e-5 on GPUs (where the router GEMM of a rank's rows may
run another cuBLAS algorithm than that of all rows). The timing (bf16 on GPUs) splits one layer's
forward into

- dispatch: route, permute, the counts exchange and the all-to-all of the rows;
- experts: the local permute, the two grouped GEMMs, the un-permute;
- combine: the all-to-all back and the weighted combine;

and measures, in the same run, ``all_to_all_single`` with equal splits on a buffer of the same size:
the bandwidth the dispatch's bytes are held against (``a2a_ratio`` = measured dispatch all-to-all
time / (bytes crossing ranks / that bandwidth)). Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kernels import collectives as C  # noqa: E402
from kernels import distributed as D  # noqa: E402
from kernels import moe  # noqa: E402
from kernels.moe import ep  # noqa: E402


def problem(tokens: list[int], d, f, n_experts, dtype, device, seed=5):
    """The full problem every rank builds: all tokens, router, every expert's weights."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype) * scale

    x = rand(sum(tokens), d)
    router_w = rand(n_experts, d, scale=d**-0.5)
    w_gate, w_up = rand(n_experts, d, f, scale=d**-0.5), rand(n_experts, d, f, scale=d**-0.5)
    w_down = rand(n_experts, f, d, scale=f**-0.5)
    return x, router_w, w_gate, w_up, w_down


def check(w: D.Worker) -> int:
    """ep_moe_forward equals moe_layer on all tokens (fp32); returns cases passed."""
    cases = 0
    for tokens, d, f, n_experts, top_k, empty in [
        ([5, 7, 3, 6][: w.world] or [5], 24, 20, 2 * w.world, 2, False),
        ([4] * w.world, 16, 12, 2 * w.world, 1, True),
    ]:
        x, router_w, wg, wu, wd = problem(tokens, d, f, n_experts, torch.float32, w.device)
        bias = None
        if empty:  # the last rank's experts are never chosen: it receives nothing
            bias = torch.zeros(n_experts, device=w.device)
            bias[-(n_experts // w.world) :] = moe.workloads.EMPTY_LOGIT
        with torch.no_grad():
            full = moe.moe_layer(x, router_w, wg, wu, wd, top_k, router_bias=bias)
            lo, hi = ep.expert_bounds(n_experts, w.world)[w.rank]
            t0 = sum(tokens[: w.rank])
            mine = x[t0 : t0 + tokens[w.rank]]
            out = ep.ep_moe_forward(mine, router_w, wg[lo:hi], wu[lo:hi], wd[lo:hi], top_k,
                                    router_bias=bias)  # fmt: skip
        want = full[t0 : t0 + tokens[w.rank]]
        if w.gpu:  # cuBLAS may pick another algorithm for the router GEMM of fewer rows
            torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(out, want), f"EP != single: case {cases}"
        cases += 1
    return cases


def timing(w: D.Worker, a) -> dict:
    dtype = torch.bfloat16 if w.gpu else torch.float32
    n, per = a.experts, a.experts // w.world
    lo, hi = ep.expert_bounds(n, w.world)[w.rank]
    # Build only this rank's experts (the full DeepSeek-V3 layer would not fit one GPU twice).
    x, _, wg, wu, wd = problem([a.tokens], a.hidden, a.width, per, dtype, w.device, seed=5 + w.rank)
    g = torch.Generator(device=w.device).manual_seed(9)  # the router: the same on every rank
    router_w = torch.randn(n, a.hidden, generator=g, device=w.device, dtype=dtype) * a.hidden**-0.5
    bias = moe.skewed_bias(n, zipf=a.skew, n_empty=n // 32).to(w.device) if a.skew else None
    kw = dict(router_bias=bias)
    with torch.no_grad():
        ids, weights = moe.route(moe.router_logits(x, router_w, bias), a.top_k)
        d = ep.dispatch(x, ids, weights, n)
        y_recv = ep.run_experts(d, wg, wu, wd)
        out = ep.combine(d, y_recv)
        assert out.shape == x.shape and torch.isfinite(out).all()

        def phase_dispatch():
            i, wt = moe.route(moe.router_logits(x, router_w, bias), a.top_k)
            ep.dispatch(x, i, wt, n)

        x_sorted = moe.permute(x, ids, n)[0]
        recv = d.recv

        def a2a_rows():
            dist.all_to_all_single(recv, x_sorted, d.recv_splits, d.send_splits)

        t = {
            "dispatch": C.time_collective(phase_dispatch, w.device, reps=a.reps),
            "dispatch_a2a": C.time_collective(a2a_rows, w.device, reps=a.reps),
            "experts": C.time_collective(
                lambda: ep.run_experts(d, wg, wu, wd), w.device, reps=a.reps
            ),  # fmt: skip
            "combine": C.time_collective(lambda: ep.combine(d, y_recv), w.device, reps=a.reps),
            "layer": C.time_collective(
                lambda: ep.ep_moe_forward(x, router_w, wg, wu, wd, a.top_k, **kw),
                w.device,
                reps=a.reps,
            ),
        }
        # The all-to-all bandwidth, same run: equal splits on a buffer of the dispatch's size.
        numel = max(w.world, x_sorted.numel() // w.world * w.world)
        src = torch.zeros(numel, device=w.device, dtype=dtype)
        dst = torch.empty_like(src)
        t_a2a = C.time_collective(lambda: dist.all_to_all_single(dst, src), w.device, reps=a.reps)
    elem = x.element_size() * a.hidden
    sent, got = ep.cross_rank_rows(d, w.rank)
    # The slowest rank bounds the step: take the largest cross-rank volume.
    vol = torch.tensor([max(sent, got) * elem], dtype=torch.float64, device=w.device)
    dist.all_reduce(vol, op=dist.ReduceOp.MAX)
    a2a_cross = numel * src.element_size() * (w.world - 1) / w.world  # bytes leaving each rank
    bw = a2a_cross / t_a2a  # bytes per second per rank, one direction
    predicted = vol.item() / bw
    return {
        "tokens_per_rank": a.tokens, "hidden": a.hidden, "width": a.width, "experts": n,
        "top_k": a.top_k, "dtype": str(dtype).replace("torch.", ""), "skew": a.skew,
        **{f"{k}_ms": v * 1e3 for k, v in t.items()},
        "rows_sent_cross": sent, "rows_recv_cross": got, "cross_bytes_max": vol.item(),
        "a2a_equal_bytes": numel * src.element_size(), "a2a_equal_ms": t_a2a * 1e3,
        "a2a_bw_gbps": bw / 1e9, "dispatch_a2a_predicted_ms": predicted * 1e3,
        "a2a_ratio": t["dispatch_a2a"] / predicted if predicted > 0 else None,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--width", type=int, default=None, help="expert intermediate size")
    p.add_argument("--experts", type=int, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--skew", type=float, default=0.0, help="Zipf exponent of expert popularity")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out")
    a = p.parse_args()

    w = D.init_worker()
    s = moe.MODEL_SHAPES["deepseek-v3"]
    gpu_default = (4096, s.hidden, s.expert_width, s.n_experts, s.top_k)
    cpu_default = (32, 32, 32, 4 * w.world, 2)
    defaults = gpu_default if w.gpu else cpu_default
    for name, v in zip(("tokens", "hidden", "width", "experts", "top_k"), defaults):
        if getattr(a, name) is None:
            setattr(a, name, v)
    result = {"checks": check(w), "timing": None}
    if not a.check_only:
        result["timing"] = timing(w, a)
    D.finish(w, result, a.out)


if __name__ == "__main__":
    main()
