"""Grade one step of a ring all-reduce (Act 5): run the learner's step on gloo CPU processes.

The learner writes ``step(flat, rank, world, step)``: step ``step`` (0 .. world-2) of the
reduce-scatter phase on this rank, in place on the flat tensor ``flat``: send one chunk to the right
neighbour, receive one from the left and add it into the local copy of that chunk.
``check_ring_step(step)`` starts ``world`` processes (2, then 3) in one gloo group, runs the
learner's step ``world - 1`` times on every rank and then checks two things:

1. *Which* contributions each chunk holds. Rank ``r`` starts with ``2**r * base`` (``base`` a
   small positive integer per element), so a sum over any set of ranks is exact in float64 and
   ``sum / base`` spells out, bit by bit, which ranks' values it contains. After the phase rank
   ``r`` must hold chunk ``(r + 1) % world`` summed over every rank; the report names the chunk,
   the ranks that are in it and the ranks that are missing.
2. The whole all-reduce: the learner's reduce-scatter, then the course's all-gather
   (``kernels.collectives.ring_schedule``), must equal ``dist.all_reduce`` on random floats.

Two ranks cannot tell a wrong chunk index from a right one ((r - s) % 2 == (r + s) % 2): three can,
so both run. Lengths are not multiples of the world size (chunks of unequal length).

The learner's function lives in the notebook's ``__main__``, which a fresh process cannot import:
its code object is sent with ``marshal`` and rebuilt in each worker with the modules and picklable
values it names (``torch``, ``dist``, ``chunk_bounds``, constants). A closure is refused.
"""

from __future__ import annotations

import datetime
import json
import marshal
import os
import pickle
import sys
import tempfile
import traceback
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from kernels.collectives import ring_schedule
from kernels.distributed import chunk_bounds, free_port

SIZES = (12, 1001, 7)  # an even split first; then unequal chunks; then chunks of 2 or 3
TIMEOUT_S = 20  # a step that never sends makes its neighbour's receive wait this long


def _portable(fn: Callable) -> dict:
    """The function as data a fresh process can rebuild: its code, and for each global name it
    uses, either the module to import or the pickled value (a helper defined next to it in the
    notebook travels the same way)."""
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"step must be a Python function, got {type(fn).__name__}")
    if fn.__closure__:
        raise TypeError(
            "step must not be a closure (it reads local variables of an enclosing function); "
            "define it at the top level of the cell"
        )
    modules, values, helpers = {}, {}, {}
    for name in _global_names(fn.__code__):
        if name not in fn.__globals__:
            continue
        v = fn.__globals__[name]
        if isinstance(v, types.ModuleType):
            modules[name] = v.__name__
        elif isinstance(v, types.FunctionType) and v.__module__ in ("__main__", None):
            helpers[name] = _portable(v)
        else:
            try:
                values[name] = pickle.dumps(v)
            except Exception:  # noqa: BLE001  (what cannot travel is reported when it is used)
                continue
    return dict(
        name=fn.__name__,
        code=marshal.dumps(fn.__code__),
        defaults=fn.__defaults__,
        modules=modules,
        values=values,
        helpers=helpers,
    )


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _rebuild(spec: dict, namespace: dict | None = None) -> Callable:
    import importlib

    g = {"__builtins__": __builtins__, "torch": torch, "dist": dist, "chunk_bounds": chunk_bounds}
    if namespace is not None:
        g = namespace
    for name, module in spec["modules"].items():
        g[name] = importlib.import_module(module)
    for name, blob in spec["values"].items():
        g[name] = pickle.loads(blob)
    for name, helper in spec["helpers"].items():
        g[name] = _rebuild(helper, g)
    code = marshal.loads(spec["code"])
    return types.FunctionType(code, g, spec["name"], spec["defaults"])


def _ranks(mask: int, world: int) -> list[int]:
    return [r for r in range(world) if mask >> r & 1]


def _reduce_scatter(step: Callable, flat: torch.Tensor, rank: int, world: int) -> None:
    for s in range(world - 1):
        step(flat, rank, world, s)


def _all_gather(flat: torch.Tensor, rank: int, world: int) -> None:
    """The ring's second phase (the course's, not the learner's): pass the summed chunks round."""
    chunks = chunk_bounds(flat.numel(), world)
    right, left = (rank + 1) % world, (rank - 1) % world
    for _, send, recv in ring_schedule(world, rank)[world - 1 :]:
        (s0, s1), (r0, r1) = chunks[send], chunks[recv]
        ops = [dist.P2POp(dist.isend, flat[s0:s1].clone(), right),
               dist.P2POp(dist.irecv, flat[r0:r1], left)]  # fmt: skip
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def _check_contributions(step: Callable, numel: int, rank: int, world: int) -> str | None:
    base = 1.0 + torch.arange(numel, dtype=torch.float64) % 5
    flat = base * 2.0**rank
    _reduce_scatter(step, flat, rank, world)
    masks = (flat / base).round().long()
    chunks = chunk_bounds(numel, world)
    want = (rank + 1) % world
    lo, hi = chunks[want]
    full = 2**world - 1
    wrong = (masks[lo:hi] != full).nonzero().flatten()
    if not wrong.numel():
        return None
    i = int(wrong[0])
    have = int(masks[lo + i])
    got = _ranks(have, world) if 0 <= have <= full else f"no set of ranks (value {flat[lo + i]})"
    return (
        f"after the {world - 1} reduce-scatter steps on {world} ranks ({numel} elements), rank "
        f"{rank} must hold chunk {want} (elements {lo}..{hi - 1}) summed over ranks "
        f"{list(range(world))}, but element {lo + i} holds the values of ranks {got}"
    )


def _check_all_reduce(step: Callable, numel: int, rank: int, world: int) -> str | None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
    expected = x.clone()
    dist.all_reduce(expected)
    _reduce_scatter(step, x, rank, world)
    _all_gather(x, rank, world)
    if torch.allclose(x, expected, rtol=1e-12, atol=1e-12):
        return None
    i = int((x - expected).abs().argmax())
    return (
        f"the all-reduce built from your reduce-scatter and the course's all-gather differs from "
        f"dist.all_reduce on {world} ranks ({numel} elements): element {i} on rank {rank} is "
        f"{x[i].item():.6g}, expected {expected[i].item():.6g}"
    )


def _worker(rank: int, world: int, port: int, spec: dict, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S)
    )
    report: dict = {"rank": rank, "problem": None, "error": None}
    try:
        step = _rebuild(spec)
        for numel in SIZES:
            for check in (_check_contributions, _check_all_reduce):
                problem = check(step, numel, rank, world)
                # Every rank stops together: a rank that went on alone would wait forever.
                bad = torch.tensor([problem is not None], dtype=torch.int32)
                dist.all_reduce(bad)
                if problem is not None:
                    report["problem"] = problem
                if bad.item():
                    raise StopIteration
    except StopIteration:
        pass
    except Exception as e:  # noqa: BLE001  (the learner's code: reported with its traceback)
        report["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    if report["error"] is None:
        dist.destroy_process_group()


def _run(spec: dict, world: int) -> list[dict]:
    import multiprocessing

    import torch.multiprocessing as mp

    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    if method == "forkserver":
        # torch only: Python 3.11's fork server imports its preloads before it takes the parent's
        # sys.path, so this module (found through a notebook's sys.path) is imported by each
        # worker instead, after multiprocessing has given it the parent's path.
        multiprocessing.set_forkserver_preload(["torch", "torch.distributed"])
    with tempfile.TemporaryDirectory() as out:
        try:
            mp.start_processes(
                _worker,
                args=(world, free_port(), spec, out),
                nprocs=world,
                join=True,
                start_method=method,
            )
        except Exception as e:  # noqa: BLE001
            reports = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
            if not any(r["error"] or r["problem"] for r in reports):
                raise AssertionError(f"a rank's process failed on {world} ranks: {e}") from e
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


_HINT = (
    "at reduce-scatter step s, rank r sends chunk (r - s) % world to rank (r + 1) % world and "
    "receives chunk (r - s - 1) % world from rank (r - 1) % world, which it adds to its own copy "
    "of that chunk; after world - 1 steps it holds chunk (r + 1) % world summed over every rank"
)


def check_ring_step(step: Callable, worlds: tuple[int, ...] = (2, 3)) -> int:
    """Run ``step`` as the reduce-scatter phase of a ring all-reduce on 2 and 3 gloo processes;
    raise AssertionError naming the first rank, chunk and missing contributions if it is wrong.
    Returns the number of (world, length) cases that passed, after printing one line."""
    spec = _portable(step)
    for world in worlds:
        reports = _run(spec, world)
        # A rank whose step raised leaves its neighbours waiting until they time out: report the
        # first error that is not such a time-out.
        errors = sorted(
            (r for r in reports if r["error"]), key=lambda r: "timeout" in r["error"].lower()
        )
        if errors:
            r = errors[0]
            raise AssertionError(
                f"on {world} ranks, your step raised on rank {r['rank']}: {r['error']}"
            )
        problems = [r for r in reports if r["problem"]]
        if problems:
            raise AssertionError(f"{problems[0]['problem']}\n  hint: {_HINT}")
    n = len(worlds) * len(SIZES)
    print(f"all {n} ring cases pass (worlds {list(worlds)}, lengths {list(SIZES)}; gloo on CPU)")
    return n
