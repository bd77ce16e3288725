"""Worker: a pipeline of P stages (one per process) trained with GPipe and 1F1B schedules.

    python -m torch.distributed.run --nproc_per_node=P scripts/dist/pipeline.py --micros 1 2 4 8 --out r.json

Stage ``s`` owns ``--layers-per-stage`` MLP blocks. Activations travel forward and their gradients
backward as send/recv between neighbouring ranks. The schedule is ``kernels.distributed.stage_order``,
the same one the simulator plays. Activations and gradients travel on two separate process groups
(``Lanes``). NCCL runs each communicator's transfers in order on a stream of its own, so a send of an
activation never queues behind a send of a gradient going the other way, which is what deadlocks two
stages that both send before they receive. Within one lane every transfer goes one way and in the
same order on both ends, so sends and receives pair up one to one.

First the pipeline's parameter gradients are checked against the same model run on one process
(float64). Then each schedule is timed for each micro-batch count; the timeline of one step and each
stage's activation memory (GPU) are recorded, with the per-micro-batch forward and backward times and
one activation's transfer time that the simulator needs. Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from kernels import collectives as C  # noqa: E402
from kernels import device  # noqa: E402
from kernels import distributed as D  # noqa: E402
from kernels.models import MLPBlock  # noqa: E402


class Clock:
    """Timestamps on the device's timeline: CUDA events on a GPU, perf_counter on a CPU."""

    def __init__(self, gpu: bool):
        self.gpu, self.marks = gpu, []

    def mark(self):
        if self.gpu:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def seconds(self, i: int) -> float:  # since mark 0
        if self.gpu:
            torch.cuda.synchronize()
            return self.marks[0].elapsed_time(self.marks[i]) / 1e3
        return self.marks[i] - self.marks[0]


class Lanes:
    """Two process groups over all ranks: one for activations (forward), one for gradients."""

    def __init__(self):
        self.fwd, self.bwd = dist.new_group(), dist.new_group()


def run_step(
    stage: nn.Module,
    schedule: str,
    micro_inputs,
    shape,
    dtype,
    w: D.Worker,
    lanes: Lanes,
    clock=None,
):
    """One training step (forward and backward of every micro-batch) of this rank's stage.
    ``micro_inputs`` are used by stage 0 only. Returns the timeline ``[(kind, micro, start, end)]``
    as clock mark indices when a ``clock`` is given."""
    p, s, m = w.world, w.rank, len(micro_inputs)
    first, last = s == 0, s == p - 1
    saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    sends: list = []  # in flight; each keeps its tensor alive until waited on at the end of the step
    timeline = []

    def recv(src: int, group) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=w.device)
        dist.irecv(buf, src, group=group).wait()  # on a GPU: orders the compute stream after it
        return buf

    for kind, i in D.stage_order(schedule, p, m, s):
        if kind == "F":
            x = micro_inputs[i] if first else recv(s - 1, lanes.fwd).requires_grad_()
            t0 = clock.mark() if clock else None
            y = stage(x)
            t1 = clock.mark() if clock else None
            saved[i] = (x, y)
            if not last:
                sends.append(dist.isend(y.detach(), s + 1, group=lanes.fwd))
        else:
            g = None if last else recv(s + 1, lanes.bwd)
            t0 = clock.mark() if clock else None
            x, y = saved.pop(i)
            if last:
                y.float().pow(2).mean().backward()
            else:
                y.backward(g)
            t1 = clock.mark() if clock else None
            if not first:
                sends.append(dist.isend(x.grad, s - 1, group=lanes.bwd))
        if clock:
            timeline.append((kind, i, t0, t1))
    for work in sends:
        work.wait()
    return timeline


def make_stage(w: D.Worker, d_model: int, layers: int, dtype, seed: int = 0) -> nn.Module:
    """The full model is ``world * layers`` blocks built from one seed; this rank keeps its slice."""
    torch.manual_seed(seed)
    blocks = [MLPBlock(d_model, dtype=dtype, device=w.device) for _ in range(w.world * layers)]
    return nn.Sequential(*blocks[w.rank * layers : (w.rank + 1) * layers])


def check(w: D.Worker, lanes: Lanes) -> int:
    """Pipelined gradients equal those of the whole model on one process (float64)."""
    d, layers, tokens, dtype = 24, 2, 5, torch.float64
    torch.manual_seed(0)
    full = nn.Sequential(
        *[MLPBlock(d, dtype=dtype, device=w.device) for _ in range(w.world * layers)]
    )
    stage = make_stage(w, d, layers, dtype)
    mine = list(range(w.rank * layers, (w.rank + 1) * layers))
    cases = 0
    for schedule in D.SCHEDULES:
        for m in (1, 3, 4):
            gen = torch.Generator(device=w.device).manual_seed(m)
            micro = [
                torch.randn(tokens, d, generator=gen, device=w.device, dtype=dtype)
                for _ in range(m)
            ]
            full.zero_grad()
            for x in micro:
                full(x).float().pow(2).mean().backward()
            stage.zero_grad()
            run_step(stage, schedule, micro, (tokens, d), dtype, w, lanes)
            ref = [p.grad for j in mine for p in full[j].parameters()]
            got = [p.grad for p in stage.parameters()]
            for a, b in zip(got, ref):
                torch.testing.assert_close(a, b)
            cases += 1
    return cases


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers-per-stage", type=int, default=1)
    p.add_argument("--micro-tokens", type=int, default=32)
    p.add_argument("--micros", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--timeline-micros", type=int, default=4)
    p.add_argument("--out")
    a = p.parse_args()

    w = D.init_worker()
    lanes = Lanes()
    result = {"checks": check(w, lanes)}
    # bf16 on GPUs that have it; fp16 (with a printed line) on those that do not, e.g. two T4s.
    dtype = device.preferred_dtype(torch.bfloat16) if w.gpu else torch.float32
    shape = (a.micro_tokens, a.d_model)
    stage = make_stage(w, a.d_model, a.layers_per_stage, dtype)
    gen = torch.Generator(device=w.device).manual_seed(1)
    inputs = [
        torch.randn(shape, generator=gen, device=w.device, dtype=dtype)
        for _ in range(max(a.micros))
    ]

    # Per-micro-batch forward and backward time of one stage, and one activation's transfer time.
    from kernels import bench

    x = inputs[0].clone().requires_grad_()

    def fwd_bwd():
        stage(x).float().pow(2).mean().backward()

    with torch.no_grad():
        t_f = bench.measure(lambda: stage(x)).ms / 1e3
    t_fb = bench.measure(fwd_bwd).ms / 1e3
    act, recv = (
        torch.zeros(shape, dtype=dtype, device=w.device),
        torch.empty(shape, dtype=dtype, device=w.device),
    )

    def exchange():
        ops = [
            dist.P2POp(dist.isend, act, (w.rank + 1) % w.world),
            dist.P2POp(dist.irecv, recv, (w.rank - 1) % w.world),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    t_comm = C.time_collective(exchange, w.device, reps=a.reps) if w.world > 1 else 0.0
    stats = torch.tensor([t_f, t_fb - t_f], dtype=torch.float64, device=w.device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # the slowest stage sets the pace
    result.update(t_f=stats[0].item(), t_b=stats[1].item(), t_comm=t_comm)

    steps, memory, timelines = [], {}, {}
    for schedule in D.SCHEDULES:
        for m in a.micros:

            def step(m=m, schedule=schedule):
                stage.zero_grad(set_to_none=True)
                run_step(stage, schedule, inputs[:m], shape, dtype, w, lanes)

            t = C.time_collective(step, w.device, warmup=1, reps=a.reps)
            steps.append({"schedule": schedule, "micros": m, "seconds": t})
        # One step at the largest micro-batch count: activation memory held by each stage.
        if w.gpu:
            stage.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            run_step(stage, schedule, inputs[: max(a.micros)], shape, dtype, w, lanes)
            torch.cuda.synchronize()
            peak = torch.tensor([torch.cuda.max_memory_allocated() - base], device=w.device)
            peaks = [torch.zeros_like(peak) for _ in range(w.world)]
            dist.all_gather(peaks, peak)
            memory[schedule] = [int(v.item()) for v in peaks]
        # One step's timeline, every stage's clock started just after the same barrier.
        stage.zero_grad(set_to_none=True)
        C.barrier(w.device)
        clock = Clock(w.gpu)
        clock.mark()
        marks = run_step(
            stage, schedule, inputs[: a.timeline_micros], shape, dtype, w, lanes, clock
        )
        ops = [(k, i, clock.seconds(t0), clock.seconds(t1)) for k, i, t0, t1 in marks]
        gathered = [None] * w.world
        dist.all_gather_object(gathered, ops)
        timelines[schedule] = gathered
    result.update(
        steps=steps,
        memory=memory,
        timelines=timelines,
        d_model=a.d_model,
        layers_per_stage=a.layers_per_stage,
        micro_tokens=a.micro_tokens,
        dtype=str(dtype).replace("torch.", ""),
        stage_weight_bytes=sum(q.numel() * q.element_size() for q in stage.parameters()),
    )
    D.finish(w, result, a.out)


if __name__ == "__main__":
    main()
