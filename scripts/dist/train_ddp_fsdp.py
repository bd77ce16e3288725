"""Worker: DDP against FSDP (``fully_shard``) training the same small transformer.

    python -m torch.distributed.run --nproc_per_node=P scripts/dist/train_ddp_fsdp.py --modes ddp fsdp --out r.json

Each mode trains ``kernels.distributed.TinyGPT`` from the same initial weights on the same per-rank
batches with AdamW, and reports the seconds per step (barrier-synchronised median of the slowest
rank), the host's share of it (the median seconds the Python call of one step takes to return,
the GPU left to finish on its own: a step whose host time nears its step time is host-bound),
tokens per second over all ranks, the peak GPU memory of the step (``max_memory_allocated``)
and the bytes of parameters, gradients and optimizer state each rank holds. On more than one rank it
then measures gradient accumulation under DDP, all-reducing after every micro-batch and with
``no_sync`` on all but the last, counting the bytes DDP hands to its all-reduce through a comm hook.
Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from kernels import collectives as C  # noqa: E402
from kernels import distributed as D  # noqa: E402

try:  # torch >= 2.6
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch 2.4 / 2.5
    from torch.distributed._composable.fsdp import fully_shard


def build(mode: str, w: D.Worker, a) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank and in every mode
    model = D.TinyGPT(a.vocab, a.d_model, a.layers, a.heads, a.seq, device=w.device)
    if mode == "ddp":
        model = DDP(model, device_ids=[w.local_rank] if w.gpu else None)
    elif mode == "fsdp":
        for block in model.blocks:  # one all-gather / reduce-scatter unit per transformer block
            fully_shard(block)
        fully_shard(model)  # embeddings, final norm and head form the root unit
    else:
        raise ValueError(f"mode must be 'ddp' or 'fsdp', got {mode!r}")
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def batch(w: D.Worker, a) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=w.device).manual_seed(100 + w.rank)  # each rank its own data
    idx = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=gen, device=w.device)
    return idx[:, :-1].contiguous(), idx[:, 1:].contiguous()


def loss_fn(model, idx, tgt, w: D.Worker, vocab: int) -> torch.Tensor:
    amp = torch.autocast("cuda", torch.bfloat16) if w.gpu else contextlib.nullcontext()
    with amp:
        logits = model(idx)
    return F.cross_entropy(logits.float().view(-1, vocab), tgt.view(-1))


def train(mode: str, w: D.Worker, a) -> dict:
    model, opt = build(mode, w, a)
    idx, tgt = batch(w, a)
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)  # grads stay allocated after the step: counted below
        loss = loss_fn(model, idx, tgt, w, a.vocab)
        loss.backward()
        opt.step()
        losses.append(loss.detach())

    step()  # first step: optimizer state is created, DDP builds its buckets
    if w.gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds = C.time_collective(step, w.device, warmup=a.warmup, reps=a.steps)
    peak = torch.cuda.max_memory_allocated() if w.gpu else None
    host_seconds = C.time_collective(step, w.device, warmup=0, reps=a.steps, host=True)
    state = D.model_state_bytes(model, opt)
    loss = torch.stack(losses).float()
    dist.all_reduce(loss)  # mean over ranks: the loss of the global batch
    loss = (loss / w.world).tolist()
    tokens = w.world * a.batch * a.seq
    return {
        "mode": mode,
        "world": w.world,
        "seconds": seconds,
        "host_seconds": host_seconds,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / seconds,
        "peak_bytes": peak,
        "state": state,
        "losses": loss,
    }


def accumulation(w: D.Worker, a) -> list[dict]:
    """DDP with ``a.accum`` micro-batches per optimizer step, with and without ``no_sync``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def counting_allreduce(state, bucket):
        buf = bucket.buffer()
        state["calls"] += 1
        state["bytes"] += buf.numel() * buf.element_size()
        return default_hooks.allreduce_hook(None, bucket)

    rows = []
    for no_sync in (False, True):
        model, opt = build("ddp", w, a)
        counts = {"calls": 0, "bytes": 0}
        model.register_comm_hook(counts, counting_allreduce)
        idx, tgt = batch(w, a)

        def step(model=model, opt=opt, no_sync=no_sync, idx=idx, tgt=tgt):
            opt.zero_grad(set_to_none=True)
            for j in range(a.accum):
                skip = no_sync and j < a.accum - 1
                with model.no_sync() if skip else contextlib.nullcontext():
                    (loss_fn(model, idx, tgt, w, a.vocab) / a.accum).backward()
            opt.step()

        step()
        before = dict(counts)
        seconds = C.time_collective(step, w.device, warmup=1, reps=a.accum_steps)
        calls = counts["calls"] - before["calls"]
        sent = counts["bytes"] - before["bytes"]
        runs = 1 + a.accum_steps  # time_collective's warm-up call plus its timed calls
        rows.append(
            {
                "no_sync": no_sync,
                "accum": a.accum,
                "seconds": seconds,
                "allreduce_calls_per_step": calls / runs,
                "allreduce_bytes_per_step": sent / runs,
                "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", nargs="+", default=["ddp", "fsdp"])
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--accum", type=int, default=4, help="micro-batches per step (0: skip)")
    p.add_argument("--accum-steps", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args()

    w = D.init_worker()
    rows = []
    for mode in a.modes:
        rows.append(train(mode, w, a))
        gc.collect()  # DDP's and FSDP's hooks hold reference cycles to the finished model
        if w.gpu:  # hand its memory back before the next model is measured
            torch.cuda.empty_cache()
    if len(rows) == 2:  # same weights, same data, same optimizer: the same losses
        tol = 2e-2 if w.gpu else 1e-4
        torch.testing.assert_close(rows[0]["losses"], rows[1]["losses"], rtol=tol, atol=tol)
    accum = accumulation(w, a) if (w.world > 1 and a.accum > 1) else []
    config = {k: getattr(a, k) for k in ("vocab", "d_model", "layers", "heads", "seq", "batch")}
    config["params"] = D.gpt_params(a.vocab, a.d_model, a.layers, a.seq)
    D.finish(w, {"rows": rows, "accumulation": accum, "config": config}, a.out)


if __name__ == "__main__":
    main()
