"""Multi-process plumbing and the parallelism pieces of Act 5.

Launching (the notebooks and tests use these):

- ``plan()`` decides how to run: NCCL with one process per GPU when there are two or more GPUs,
  otherwise gloo with two CPU processes at small sizes.
- ``torchrun(script, nproc, args, backend=...)`` runs ``python -m torch.distributed.run`` on a worker
  script in ``scripts/dist/``; rank 0 writes its results as JSON to a temporary file and the call
  returns them as a dict. The environment is inherited (NCCL settings included) plus what gloo needs.
- ``init_worker()`` and ``finish()`` are the first and last lines of every worker script;
  ``worker_parser`` starts its command line (``--check-only``, ``--reps``, ``--out``) and
  ``seeded_randn`` draws the inputs every rank builds alike.
- ``spawn(fn, nprocs, *args)`` runs ``fn(*args)`` on ``nprocs`` gloo processes started with
  ``torch.multiprocessing`` (the tests use it: no second interpreter to start per launch).
- ``chunk_bounds`` (how ``numel`` elements split across ranks) and ``barrier`` (every rank waits,
  on the device it works on) are the process-group helpers ``kernels.collectives`` builds on: this
  module imports nothing from it, so the two do not import each other.

Parallelism:

- Tensor parallelism: ``shard_mlp`` and ``tp_mlp`` split a transformer MLP the Megatron-LM way, the
  first weight by columns and the second by rows, with one all-reduce in the forward pass and one in
  the backward pass (``mlp_ref`` is the single-device function it must equal).
- Pipeline parallelism: ``stage_order`` lists what each stage does under GPipe or 1F1B,
  ``simulate`` plays a schedule out in time, ``bubble_fraction`` is the closed form
  ``(p - 1) / (m + p - 1)``, ``plot_timeline`` draws it.
- ``TinyGPT``: a small decoder-only transformer built from ``kernels.models.DecoderBlock`` for the
  DDP / FSDP comparison, and ``model_state_bytes`` to count what a rank holds.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts" / "dist"
BACKEND_ENV = "GPU_BRRR_DIST_BACKEND"

# ----------------------------------------------------------------------------- launching


# ----------------------------------------------------------------------------- process-group helpers


def chunk_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``parts`` contiguous pieces of ``numel`` elements, sizes differing by at
    most one (the first ``numel % parts`` pieces get the extra element)."""
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    if numel < 0:
        raise ValueError(f"numel must be non-negative, got {numel}")
    base, extra = divmod(numel, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def barrier(device: torch.device, group=None) -> None:
    """Every rank waits here for every other: a one-element all-reduce that the host waits for.
    (``dist.barrier`` on NCCL guesses a device and warns; this uses the one we work on.)"""
    flag = torch.zeros(1, device=device)
    dist.all_reduce(flag, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    else:
        flag.item()


@dataclass(frozen=True)
class Plan:
    backend: str  # "nccl" or "gloo"
    nproc: int
    device_type: str  # "cuda" or "cpu"
    note: str

    @property
    def gpu(self) -> bool:
        return self.device_type == "cuda"


def plan() -> Plan:
    """NCCL with one process per GPU when this machine has two or more GPUs; otherwise gloo with two
    CPU processes (small sizes; the timings are then CPU and loopback numbers, not GPU ones)."""
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpus >= 2:
        name = torch.cuda.get_device_name(0)
        return Plan("nccl", n_gpus, "cuda", f"{n_gpus} x {name}: NCCL, one process per GPU")
    why = "one GPU" if n_gpus == 1 else "no GPU"
    return Plan(
        "gloo",
        2,
        "cpu",
        f"{why}: gloo with 2 CPU processes at small sizes; the timings are CPU numbers, "
        "NOT GPU interconnect numbers",
    )


def cli_args(cfg: dict) -> list:
    """A worker's command line from a dict: ``{"d_model": 64, "micros": [1, 2]}`` becomes
    ``["--d-model", 64, "--micros", 1, 2]`` (``torchrun`` turns the values into strings)."""
    out = []
    for k, v in cfg.items():
        out += [f"--{k.replace('_', '-')}", *(v if isinstance(v, list) else [v])]
    return out


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(backend: str) -> dict[str, str]:
    # Inherit everything (a GPU host's NCCL settings must reach the workers), add what we need.
    env = dict(os.environ)
    env[BACKEND_ENV] = backend
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, set here to skip its banner
    if backend == "gloo":
        # CPU processes: hide any GPU, so that every worker (and kernels.device in it) is in CPU mode.
        env["CUDA_VISIBLE_DEVICES"] = ""
        if sys.platform.startswith("linux"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all processes are on this host
    return env


def torchrun(
    script: str | Path,
    nproc: int,
    args: Sequence[str] = (),
    *,
    backend: str,
    timeout: float = 600,
    verbose: bool = True,
) -> dict:
    """Run ``script`` (a path, or a name in ``scripts/dist/``) on ``nproc`` processes with torchrun;
    return the JSON that rank 0 wrote to the ``--out`` file the script is given."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive int, got {nproc!r}")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    path = Path(script)
    if not path.is_file():
        path = SCRIPTS / script
    if not path.is_file():
        raise FileNotFoundError(f"script not found: {script} (looked in {SCRIPTS})")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(path),
            *map(str, args),
            "--out",
            str(out),
        ]
        if verbose:
            shown = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
            print("$ python", *cmd[1:6], shown, *map(str, args), flush=True)
        proc = subprocess.run(
            cmd, env=_env(backend), capture_output=True, text=True, timeout=timeout, cwd=ROOT
        )
        if proc.returncode != 0 or not out.is_file():
            text = proc.stdout + proc.stderr
            first = text.find("Traceback")  # a worker's own traceback, before torchrun's summary
            raise RuntimeError(
                f"{path.name} failed (exit {proc.returncode}):\n{text[max(first, 0) :][:6000]}"
            )
        return json.loads(out.read_text())


@dataclass(frozen=True)
class Worker:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"


def init_worker(timeout_s: float = 300) -> Worker:
    """Join the process group torchrun describes in the environment; one GPU per process on NCCL.

    The backend comes from ``GPU_BRRR_DIST_BACKEND`` (set by ``torchrun`` above), else NCCL when
    there is a GPU for every local process, else gloo. A first all-reduce creates the communicator
    with every rank present, which NCCL's batched send/recv expects."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
    backend = os.environ.get(BACKEND_ENV)
    if backend is None:
        enough = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
        backend = "nccl" if enough else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    dist.all_reduce(torch.zeros(1, device=device))
    return Worker(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def worker_parser(doc: str, reps: int = 20) -> argparse.ArgumentParser:
    """A worker script's argument parser, described by the first line of ``doc`` (its module
    docstring), with the options every worker takes: ``--check-only`` (skip the timings),
    ``--reps`` (timed repetitions) and ``--out`` (where rank 0 writes the JSON)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--reps", type=int, default=reps)
    p.add_argument("--out")
    return p


def seeded_randn(device: torch.device, dtype: torch.dtype, seed: int) -> Callable:
    """``rand(*shape, scale=1.0)``: normal samples times ``scale`` from one generator seeded with
    ``seed``, so every rank that draws the same shapes in the same order holds the same tensors."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * scale

    return rand


def finish(worker: Worker, result: dict, out: str | Path | None) -> None:
    """Rank 0 writes ``result`` (plus the run's provenance) as JSON; everyone leaves the group."""
    if worker.rank == 0 and out:
        result = dict(result)
        result.setdefault("world", worker.world)
        result.setdefault("backend", worker.backend)
        result.setdefault(
            "device", torch.cuda.get_device_name(worker.device) if worker.gpu else "CPU"
        )
        result.setdefault("torch", torch.__version__.split("+")[0])
        if worker.backend == "nccl":
            v = torch.cuda.nccl.version()
            result.setdefault("nccl", ".".join(map(str, v)) if isinstance(v, tuple) else str(v))
        tmp = Path(str(out) + ".tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(out)
    barrier(worker.device)
    dist.destroy_process_group()


def _spawn_entry(rank: int, fn: Callable, world: int, port: int, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)  # nprocs processes share the machine's cores
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    try:
        fn(*args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, nprocs: int, *args) -> None:
    """Run ``fn(*args)`` on ``nprocs`` CPU processes in one gloo group (``fn`` must be importable:
    a module-level function). An exception in any process is raised here, with its traceback."""
    import multiprocessing

    import torch.multiprocessing as mp

    # A fork server imports torch once and forks every worker from that clean process: much faster
    # than a fresh interpreter per worker, and safe, unlike forking a parent whose thread pools ran.
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", __name__])
    mp.start_processes(
        _spawn_entry,
        args=(fn, nprocs, free_port(), args),
        nprocs=nprocs,
        join=True,
        start_method=method,
    )


# ----------------------------------------------------------------------------- tensor parallelism


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce backward (each rank's branch contributes part of dL/dx)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (sum the partial products); identity backward."""

    @staticmethod
    def forward(ctx, y, group):
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def mlp_ref(x, w1, b1, w2, b2) -> torch.Tensor:
    """The single-device MLP: ``gelu(x @ w1 + b1) @ w2 + b2``; ``w1: [d_model, d_ff]``,
    ``w2: [d_ff, d_model]`` (weights stored input-major so the splits read as column/row splits)."""
    return F.gelu(x @ w1 + b1) @ w2 + b2


def shard_mlp(w1, b1, w2, b2, rank: int, world: int):
    """This rank's shard: columns of ``w1`` and ``b1``, the same rows of ``w2``, all of ``b2``.
    ``d_ff`` need not divide by ``world``: shards differ by at most one column."""
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    d_ff = w1.shape[1]
    if w2.shape[0] != d_ff or b1.shape != (d_ff,):
        raise ValueError(
            f"w1 {tuple(w1.shape)}, b1 {tuple(b1.shape)}, w2 {tuple(w2.shape)} disagree"
        )
    lo, hi = chunk_bounds(d_ff, world)[rank]
    return (
        w1[:, lo:hi].contiguous(),
        b1[lo:hi].contiguous(),
        w2[lo:hi, :].contiguous(),
        b2,
    )


def tp_mlp(x, w1_shard, b1_shard, w2_shard, b2, group=None) -> torch.Tensor:
    """Tensor-parallel MLP: every rank holds all of ``x`` and one shard of the weights.

    Column split: ``h_r = gelu(x @ w1[:, cols_r] + b1[cols_r])`` needs no communication, because GELU
    acts element by element on columns the rank owns. Row split: ``h_r @ w2[cols_r, :]`` is a partial
    sum of the output, so one all-reduce completes it. In the backward pass the roles swap: the
    gradient of ``x`` is the sum of every rank's branch, one all-reduce again."""
    x = _CopyToTP.apply(x, group)
    h = F.gelu(x @ w1_shard + b1_shard)
    return _ReduceFromTP.apply(h @ w2_shard, group) + b2


# ----------------------------------------------------------------------------- pipeline schedules


SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class PipeOp:
    stage: int
    kind: str  # "F" (forward) or "B" (backward)
    micro: int
    start: float
    end: float


def _check_pipe(schedule: str, p: int, m: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    for name, v in (("p", p), ("m", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


def stage_order(schedule: str, p: int, m: int, stage: int) -> list[tuple[str, int]]:
    """What ``stage`` of ``p`` does, in order, for ``m`` micro-batches: ``[("F", 0), ...]``.

    GPipe runs every forward, then every backward. 1F1B (PipeDream-Flush, Megatron-LM's default) runs
    ``p - stage - 1`` warm-up forwards, then alternates one forward and one backward, then drains the
    remaining backwards, so a stage never holds more than ``p - stage`` micro-batches' activations."""
    _check_pipe(schedule, p, m)
    if not 0 <= stage < p:
        raise ValueError(f"stage must be in [0, {p}), got {stage}")
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(p - stage - 1, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    order += [("B", i) for i in range(m - warm, m)]
    return order


def simulate(
    schedule: str, p: int, m: int, t_f: float = 1.0, t_b: float = 2.0, t_comm: float = 0.0
) -> list[PipeOp]:
    """Play a schedule out in time: each stage runs its ops in order, an op starts when its stage is
    free and its input has arrived (``t_comm`` after the op it depends on ended). ``F(s, i)`` needs
    ``F(s - 1, i)``; ``B(s, i)`` needs ``B(s + 1, i)`` (the last stage's needs its own ``F``)."""
    _check_pipe(schedule, p, m)
    if min(t_f, t_b) <= 0 or t_comm < 0:
        raise ValueError(f"need t_f, t_b > 0 and t_comm >= 0, got {t_f}, {t_b}, {t_comm}")
    orders = [stage_order(schedule, p, m, s) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    pos, free, ops = [0] * p, [0.0] * p, []
    while len(ops) < 2 * p * m:
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                if kind == "F":
                    dep, comm = (("F", s - 1, i), t_comm) if s > 0 else (None, 0.0)
                else:
                    dep, comm = (("B", s + 1, i), t_comm) if s < p - 1 else (("F", s, i), 0.0)
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] + comm if dep else 0.0)
                end = start + (t_f if kind == "F" else t_b)
                done[(kind, s, i)] = free[s] = end
                ops.append(PipeOp(s, kind, i, start, end))
                pos[s] += 1
                progressed = True
        if not progressed:  # cannot happen for the two schedules here; guards future ones
            raise RuntimeError(f"{schedule} deadlocks for p={p}, m={m}")
    return sorted(ops, key=lambda o: (o.stage, o.start))


def makespan(ops: Sequence[PipeOp]) -> float:
    return max(o.end for o in ops) - min(o.start for o in ops)


def idle_fraction(ops: Sequence[PipeOp]) -> float:
    """Fraction of stage-time spent idle between the first op's start and the last op's end."""
    stages = {o.stage for o in ops}
    busy = sum(o.end - o.start for o in ops)
    return 1.0 - busy / (len(stages) * makespan(ops))


def bubble_fraction(p: int, m: int) -> float:
    """The pipeline bubble of GPipe and 1F1B with equal stages and free communication:
    ``(p - 1) / (m + p - 1)`` of every stage's time is idle."""
    _check_pipe("gpipe", p, m)
    return (p - 1) / (m + p - 1)


def peak_in_flight(schedule: str, p: int, m: int, stage: int) -> int:
    """Most micro-batches whose forward is done and backward is not, on ``stage``: activations held."""
    held = peak = 0
    for kind, _ in stage_order(schedule, p, m, stage):
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def plot_timeline(ax, ops: Sequence[PipeOp], title: str = "", unit: str = "") -> None:
    """Draw ops as bars, one row per stage (stage 0 on top); forwards light, backwards dark.

    The book's style (``kernels.plotstyle``): two blues of its palette, micro-batch numbers at its
    smallest font size, written only on the bars wide enough to hold them (size ``ax`` first)."""
    from kernels import plotstyle

    colors = {"F": plotstyle.PALETTE[5], "B": plotstyle.PALETTE[0]}  # sky blue, blue
    t0 = min(o.start for o in ops)
    p = max(o.stage for o in ops) + 1
    span = makespan(ops)
    # Points per unit of time on this axes (constrained layout narrows it a little: hence 0.9), and
    # the width a number needs: a digit is about 0.65 em, plus a little room on either side.
    pt_per_unit = 0.9 * ax.get_window_extent().width * 72 / ax.figure.dpi / span
    for o in ops:
        y = p - 1 - o.stage
        ax.broken_barh([(o.start - t0, o.end - o.start)], (y - 0.4, 0.8), color=colors[o.kind])
        if (o.end - o.start) * pt_per_unit > 0.65 * plotstyle.SMALL_PT * len(str(o.micro)) + 3:
            ax.text(
                (o.start + o.end) / 2 - t0,
                y,
                str(o.micro),
                ha="center",
                va="center",
                fontsize=plotstyle.SMALL_PT,
                color="black" if o.kind == "F" else "white",
            )
    ax.set_yticks(range(p), [f"stage {s}" for s in reversed(range(p))])
    ax.set_xlabel(f"time{f' ({unit})' if unit else ''}")
    ax.set_xlim(0, span)
    if title:
        ax.set_title(title)
    ax.grid(False)


# ----------------------------------------------------------------------------- a model to train


class TinyGPT(nn.Module):
    """Decoder-only transformer: token + position embeddings, ``n_layers`` pre-norm
    ``DecoderBlock``s, a final LayerNorm and an untied output projection to ``vocab`` logits."""

    def __init__(
        self,
        vocab: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        max_seq: int,
        *,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        from kernels.models import DecoderBlock

        self.tok = nn.Embedding(vocab, d_model, device=device)
        self.pos = nn.Embedding(max_seq, d_model, device=device)
        self.blocks = nn.ModuleList(
            DecoderBlock(d_model, n_heads, device=device) for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model, device=device)
        self.head = nn.Linear(d_model, vocab, bias=False, device=device)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def gpt_params(vocab: int, d_model: int, n_layers: int, max_seq: int) -> int:
    """Parameter count of ``TinyGPT``: about ``12 d^2`` per layer plus the embeddings and head."""
    per_layer = 12 * d_model**2 + 13 * d_model  # qkv, out, fc1, fc2 weights and biases; 2 norms
    return n_layers * per_layer + (2 * vocab + max_seq) * d_model + 2 * d_model


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Bytes of parameters, gradients and optimizer state that *this rank* holds (a sharded
    DTensor counts only its local shard)."""

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = sum(local(p) for p in model.parameters())
    grads = sum(local(p.grad) for p in model.parameters() if p.grad is not None)
    opt = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            opt += sum(local(v) for v in state.values() if isinstance(v, torch.Tensor) and v.ndim)
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}
