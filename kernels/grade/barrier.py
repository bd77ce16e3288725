"""Grade a grid barrier (Act 8): the learner's ``arrive`` and ``wait``, two ``@triton.jit`` helpers.

The barrier is the megakernel's: two int32 words in global memory, ``sync[0]`` counts arrivals and
``sync[1]`` is the generation. ``arrive(sync_ptr, n_programs)`` reads the generation, counts its
program in with an atomic add, and the last program to arrive resets the count and bumps the
generation; it returns the generation it read. ``wait(sync_ptr, gen, max_polls)`` spins until the
generation differs from ``gen``, giving up after ``max_polls`` polls; it returns True if the barrier
opened. ``arrive`` must be written without ``if`` on its values (use ``mask=`` on the atomics).

Triton's CPU interpreter runs a grid's programs one after another, so a barrier across several
programs would spin forever there. The checks are built around that:

1. *Many programs arrive at once* (runs anywhere). One program of ``N`` lanes calls ``arrive`` with
   ``N`` copies of the pointer: each lane stands for one program, and every atomic is a single
   operation on ``N`` identical addresses, so the lanes see each other's increments exactly as
   ``N`` simultaneous programs would. A counter updated with a load and a store loses all but one
   increment here, as it does on a GPU, and the check names that. Two barriers in a row check that
   the count is reset and the generation bumped once per barrier.
2. *A closed barrier keeps waiting, an open one lets go* (runs anywhere): ``wait`` on a generation
   that has not moved must give up after ``max_polls``; on one that has moved it must return at once.
3. *One program through several barriers* (runs anywhere): ``arrive`` then ``wait`` in a loop.
4. *The race* (GPU only): one program per SM writes its slot, passes the barrier, reads its
   neighbour's slot, passes it again, for many rounds; any value read before it was written, or any
   barrier that gave up, fails. A barrier that only works in the interpreter fails here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import device

LANES = (8, 3)  # a power of two, and a count that is not (the lanes past it sit out)


@triton.jit
def _arrive_lanes_kernel(sync_ptr, gens_ptr, n, N: tl.constexpr, ARRIVE: tl.constexpr):
    # Lanes [0, n) are n programs arriving at the same instant; the rest point at a scratch word
    # (sync_ptr + 2) so that they change nothing.
    lanes = tl.arange(0, N)
    ptrs = sync_ptr + tl.where(lanes < n, 0, 2)
    gen = ARRIVE(ptrs, n)
    tl.store(gens_ptr + lanes, gen, mask=lanes < n)


@triton.jit
def _wait_kernel(sync_ptr, ok_ptr, gen, max_polls, WAIT: tl.constexpr):
    tl.store(ok_ptr, WAIT(sync_ptr, gen, max_polls).to(tl.int32))


@triton.jit
def _one_program_kernel(sync_ptr, ok_ptr, max_polls, ROUNDS: tl.constexpr,
                        ARRIVE: tl.constexpr, WAIT: tl.constexpr):  # fmt: skip
    for r in tl.static_range(ROUNDS):
        gen = ARRIVE(sync_ptr, 1)
        tl.store(ok_ptr + r, WAIT(sync_ptr, gen, max_polls).to(tl.int32))


@triton.jit
def _exchange_kernel(buf_ptr, out_ptr, sync_ptr, timeout_ptr, n_programs, max_polls,
                     ROUNDS: tl.constexpr, ARRIVE: tl.constexpr, WAIT: tl.constexpr):  # fmt: skip
    # The CTA-wide syncs (debug_barrier) are the grader's: they make every thread of this program
    # finish its stores before the arrival, which the learner's helpers cannot see. Loads of other
    # programs' slots are volatile (not served from this SM's L1), so the check tests the barrier.
    # After its first time-out a program polls no more (0 polls per wait): a barrier that never
    # opens would otherwise spin max_polls (seconds) at each of the 2 * ROUNDS barriers, minutes
    # before the report. The first time-out is already the verdict.
    pid = tl.program_id(0)
    failed = tl.full([], 0, tl.int32)
    for r in range(ROUNDS):
        tl.store(buf_ptr + pid, r * n_programs + pid)
        tl.debug_barrier()
        polls = tl.where(failed > 0, 0, max_polls)
        ok = WAIT(sync_ptr, ARRIVE(sync_ptr, n_programs), polls)
        tl.debug_barrier()
        failed = tl.maximum(failed, (ok == 0).to(tl.int32))
        tl.atomic_max(timeout_ptr, (ok == 0).to(tl.int32))
        v = tl.load(buf_ptr + (pid + 1) % n_programs, volatile=True)
        tl.store(out_ptr + r * n_programs + pid, v)
        tl.debug_barrier()
        polls = tl.where(failed > 0, 0, max_polls)
        ok = WAIT(sync_ptr, ARRIVE(sync_ptr, n_programs), polls)  # nobody overwrites early
        tl.debug_barrier()
        failed = tl.maximum(failed, (ok == 0).to(tl.int32))
        tl.atomic_max(timeout_ptr, (ok == 0).to(tl.int32))


def _sync(words=(0, 0)) -> torch.Tensor:
    return torch.tensor([*words, 0, 0], dtype=torch.int32, device=device.DEVICE)


def _run(what: str, launch) -> None:
    try:
        launch()
        device.synchronize()
    except Exception as e:  # the learner's code: reported with the check that ran it
        raise AssertionError(f"{what}: your barrier raised {type(e).__name__}: {e}") from e


def _check_lanes(arrive, n: int) -> None:
    sync = _sync()
    where = f"{n} programs arriving at once"
    for barrier in (1, 2):
        gens = torch.full((8,), -1, dtype=torch.int32, device=device.DEVICE)
        _run(where, lambda g=gens: _arrive_lanes_kernel[(1,)](sync, g, n, N=8, ARRIVE=arrive))
        count, gen = sync[0].item(), sync[1].item()
        seen = sorted(set(gens[:n].tolist()))
        at = f"{where}, barrier {barrier}: the count is {count} and the generation {gen}"
        want = f"(expected count 0, generation {barrier})"
        if count == 1 and n > 1 and gen == barrier - 1:
            raise AssertionError(
                f"{at} {want}. {n} programs arrived but the count went up by one: they read the "
                "count at the same time and each wrote back its own +1 (a load, then a store). "
                "Count with tl.atomic_add, which adds and returns the old value in one step."
            )
        if count == n and gen == barrier - 1:
            raise AssertionError(
                f"{at} {want}. Every arrival was counted but no program saw itself last: "
                "tl.atomic_add returns the count *before* its own add, so the last program sees "
                "n_programs - 1."
            )
        if count != 0:
            raise AssertionError(
                f"{at} {want}. The last program must reset the count to 0 (tl.atomic_xchg), or the "
                "next barrier starts from a stale count."
            )
        if gen != barrier:
            raise AssertionError(
                f"{at} {want}. The last program must bump the generation by exactly one "
                "(tl.atomic_add on sync_ptr + 1, only where last): that is what opens the barrier."
            )
        if seen != [barrier - 1]:
            raise AssertionError(
                f"{where}, barrier {barrier}: arrive returned generations {seen}, expected "
                f"[{barrier - 1}] for every program: read the generation *before* counting in, or "
                "a program can read the bumped value and then wait for a barrier that has opened."
            )


def _check_wait(wait) -> None:
    ok = torch.zeros(1, dtype=torch.int32, device=device.DEVICE)
    sync = _sync((3, 5))  # three programs have arrived at generation 5: the barrier is closed
    _run("wait at a closed barrier", lambda: _wait_kernel[(1,)](sync, ok, 5, 16, WAIT=wait))
    if ok.item():
        raise AssertionError(
            "wait at a closed barrier (generation still equal to gen) returned True after at most "
            "16 polls: it must keep polling while sync_ptr[1] == gen and report False when it "
            "gives up"
        )
    if sync[:2].tolist() != [3, 5]:
        raise AssertionError(
            f"wait changed the barrier words from [3, 5] to {sync[:2].tolist()}: poll with an "
            "atomic that adds 0 (or a volatile load), never write"
        )
    _run("wait at an open barrier", lambda: _wait_kernel[(1,)](sync, ok, 4, 16, WAIT=wait))
    if not ok.item():
        raise AssertionError(
            "wait for generation 4 when the generation is already 5 gave up: the barrier is open; "
            "spin only while the generation equals gen"
        )


def _check_one_program(arrive, wait, rounds: int = 3) -> None:
    sync = _sync()
    ok = torch.zeros(rounds, dtype=torch.int32, device=device.DEVICE)
    _run(
        f"one program through {rounds} barriers",
        lambda: _one_program_kernel[(1,)](sync, ok, 64, ROUNDS=rounds, ARRIVE=arrive, WAIT=wait),
    )
    if not ok.all() or sync[:2].tolist() != [0, rounds]:
        raise AssertionError(
            f"one program through {rounds} barriers: wait returned {ok.tolist()} (1 = opened) "
            f"and the words are {sync[:2].tolist()} (expected all 1 and [0, {rounds}])"
        )


def _check_race(arrive, wait, rounds: int = 64) -> None:
    n = device.capabilities().sm_count  # one program per SM: all resident, so spinning is safe
    buf = torch.full((n,), -1, dtype=torch.int32, device=device.DEVICE)
    out = torch.full((rounds, n), -1, dtype=torch.int32, device=device.DEVICE)
    sync, timeout = _sync(), torch.zeros(1, dtype=torch.int32, device=device.DEVICE)
    _run(
        f"{n} programs exchanging values for {rounds} rounds",
        lambda: _exchange_kernel[(n,)](
            buf, out, sync, timeout, n, 2**22, ROUNDS=rounds, ARRIVE=arrive, WAIT=wait, num_warps=4
        ),  # fmt: skip
    )
    pid = torch.arange(n, device=device.DEVICE)
    want = torch.arange(rounds, device=device.DEVICE)[:, None] * n + (pid + 1) % n
    if timeout.item():
        raise AssertionError(
            f"{n} programs (one per SM) through {2 * rounds} barriers: a program gave up waiting, "
            f"the barrier never opened (words now {sync[:2].tolist()}): arrivals were lost or the "
            "last program was never recognised"
        )
    wrong = (out != want).nonzero()
    if wrong.numel():
        r, p = wrong[0].tolist()
        raise AssertionError(
            f"{n} programs (one per SM), round {r}: program {p} read {out[r, p].item()} from its "
            f"neighbour's slot, expected {want[r, p].item()} ({len(wrong)} of {out.numel()} reads "
            "wrong): it went through the barrier before the neighbour had written"
        )


def check_grid_barrier(arrive, wait) -> int:
    """Grade ``arrive`` and ``wait`` (both ``@triton.jit``); raise AssertionError naming the first
    check they fail. On a GPU the race check runs too. Returns the number of checks passed."""
    for name, fn in (("arrive", arrive), ("wait", wait)):
        if not isinstance(fn, triton.runtime.KernelInterface):  # JIT, or interpreted on a CPU
            raise TypeError(f"{name} must be a @triton.jit function, got {type(fn).__name__}")
    for n in LANES:
        _check_lanes(arrive, n)
    _check_wait(wait)
    _check_one_program(arrive, wait)
    checks = len(LANES) + 2
    if device.GPU_MODE:
        _check_race(arrive, wait)
        checks += 1
        where = "GPU, race check included"
    else:
        where = "CPU interpreter: the race check needs a GPU"
    print(f"all {checks} barrier checks pass ({where})")
    return checks


# ----------------------------------------------------------------------------- compile check

# tests/test_compile.py compiles every kernel for sm_90 and sm_75. The grader's kernels take the
# learner's helpers as constexpr arguments; these are the course's (kernels/megakernel.py's
# barrier, in the exercise's two-function form), so the check covers what a GPU will compile.


@triton.jit
def _course_arrive(sync_ptr, n_programs):
    gen = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
    arrived = tl.atomic_add(sync_ptr, 1, sem="acq_rel")
    last = arrived == n_programs - 1
    tl.atomic_xchg(sync_ptr, 0, mask=last, sem="relaxed")
    tl.atomic_add(sync_ptr + 1, 1, mask=last, sem="release")
    return gen


@triton.jit
def _course_wait(sync_ptr, gen, max_polls):
    polls = 0
    while (tl.atomic_add(sync_ptr + 1, 0, sem="acquire") == gen) & (polls < max_polls):
        polls += 1
    return polls < max_polls


_HELPERS = {"ARRIVE": _course_arrive, "WAIT": _course_wait}
COMPILE_SPECS = [
    dict(
        kernel=_arrive_lanes_kernel,
        signature={"sync_ptr": "*i32", "gens_ptr": "*i32", "n": "i32"},
        constexprs={"N": 8, "ARRIVE": _course_arrive},
    ),
    dict(
        kernel=_wait_kernel,
        signature={"sync_ptr": "*i32", "ok_ptr": "*i32", "gen": "i32", "max_polls": "i32"},
        constexprs={"WAIT": _course_wait},
    ),
    dict(
        kernel=_one_program_kernel,
        signature={"sync_ptr": "*i32", "ok_ptr": "*i32", "max_polls": "i32"},
        constexprs={"ROUNDS": 3, **_HELPERS},
    ),
    dict(
        kernel=_exchange_kernel,
        signature={"buf_ptr": "*i32", "out_ptr": "*i32", "sync_ptr": "*i32",
                   "timeout_ptr": "*i32", "n_programs": "i32", "max_polls": "i32"},
        constexprs={"ROUNDS": 64, **_HELPERS},
    ),
]  # fmt: skip
