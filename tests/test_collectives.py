"""Act 5: the ring all-reduce against dist.all_reduce, the tensor-parallel MLP against one device,
the pipeline-schedule simulator against its closed form, bandwidth bookkeeping, bad input.

The multi-process checks run on gloo over CPU processes started with torch.multiprocessing (one
launch per world size, every check inside it); the rest is plain Python.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from kernels import collectives as C
from kernels import distributed as D

# Odd sizes, sizes below every world size tested, and a 3-D tensor.
RING_SHAPES = [(1,), (2,), (3,), (5,), (7,), (1000,), (4099,), (5, 13, 7)]


# ----------------------------------------------------------------------------- in the processes


def _same_on_every_rank(t: torch.Tensor, group=None) -> bool:
    gathered = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, t, group=group)
    return all(torch.equal(g, gathered[0]) for g in gathered)


def _ring_cases(group=None, shapes=RING_SHAPES, dtypes=(torch.int64, torch.float32)) -> None:
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(100 + rank)
    for shape in shapes:
        for dtype in dtypes:
            # One sub-chunk per chunk, and several pipelined ones (for the larger shapes).
            for sub in (C.DEFAULT_SUB_CHUNK_BYTES, 2048):
                if dtype.is_floating_point:
                    x = torch.randn(shape, generator=gen, dtype=dtype)
                else:
                    x = torch.randint(-(2**40), 2**40, shape, generator=gen, dtype=dtype)
                ref = C.ring_all_reduce_ref(x, group)
                out = x.clone()
                assert C.ring_all_reduce(out, group, sub_chunk_bytes=sub) is out
                if dtype.is_floating_point and n > 2:  # the ring adds in another order
                    torch.testing.assert_close(out, ref)
                else:
                    assert torch.equal(out, ref), (shape, dtype, sub)
                assert _same_on_every_rank(out, group), (shape, dtype, sub)


def _bad_input_cases() -> None:
    x = torch.ones(8)
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        C.ring_all_reduce([1.0, 2.0])
    with pytest.raises(TypeError, match="tensor must have dtype"):
        C.ring_all_reduce(torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="tensor must be contiguous"):
        C.ring_all_reduce(torch.ones(4, 6).t())
    with pytest.raises(ValueError, match="sub_chunk_bytes must be positive"):
        C.ring_all_reduce(x, sub_chunk_bytes=0)
    with pytest.raises(TypeError, match="sub_chunk_bytes must be an int"):
        C.ring_all_reduce(x, sub_chunk_bytes=1.5)
    assert torch.equal(x, torch.ones(8))  # nothing was sent, nothing changed
    empty = torch.ones(0)
    assert C.ring_all_reduce(empty) is empty


def _tp_cases() -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    for tokens, d_model, d_ff in [(5, 16, 37), (3, 8, n - 1 if n > 1 else 1), (7, 12, 64)]:
        gen = torch.Generator().manual_seed(7)  # every rank builds the same full weights and input
        w1 = torch.randn(d_model, d_ff, generator=gen, dtype=torch.float64)
        b1 = torch.randn(d_ff, generator=gen, dtype=torch.float64)
        w2 = torch.randn(d_ff, d_model, generator=gen, dtype=torch.float64)
        b2 = torch.randn(d_model, generator=gen, dtype=torch.float64)
        x = torch.randn(tokens, d_model, generator=gen, dtype=torch.float64)
        grad_out = torch.randn(tokens, d_model, generator=gen, dtype=torch.float64)

        full = [t.clone().requires_grad_() for t in (x, w1, b1, w2, b2)]
        ref = D.mlp_ref(*full)
        ref.backward(grad_out)

        shards = [t.requires_grad_() for t in D.shard_mlp(w1, b1, w2, b2, rank, n)]
        xs = x.clone().requires_grad_()
        out = D.tp_mlp(xs, *shards)
        out.backward(grad_out)
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(xs.grad, full[0].grad)  # needs the backward all-reduce
        lo, hi = C.chunk_bounds(d_ff, n)[rank]
        torch.testing.assert_close(shards[0].grad, full[1].grad[:, lo:hi])
        torch.testing.assert_close(shards[1].grad, full[2].grad[lo:hi])
        torch.testing.assert_close(shards[2].grad, full[3].grad[lo:hi])
        torch.testing.assert_close(shards[3].grad, full[4].grad)


def _worker() -> None:
    torch.set_num_threads(1)
    _ring_cases()
    n = dist.get_world_size()
    if n >= 3:  # a subgroup whose global ranks are not 0..k-1: peers go through get_global_rank
        members = [1, n - 1]
        sub = dist.new_group(members)
        if dist.get_rank() in members:
            _ring_cases(sub, shapes=[(1,), (3,), (4099,)], dtypes=(torch.int64,))
    _bad_input_cases()
    _tp_cases()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_all_reduce_and_tp_mlp(world):
    D.spawn(_worker, world)


# ----------------------------------------------------------------------------- torchrun path


def test_torchrun_worker_script_returns_json():
    # The notebooks' path: torchrun a script of scripts/dist/, read back rank 0's JSON.
    r = D.torchrun("tp_mlp.py", 2, ["--check-only"], backend="gloo", timeout=120, verbose=False)
    assert r["world"] == 2 and r["backend"] == "gloo" and r["checks"] >= 3


def test_ddp_fsdp_worker_reports_the_host_share_of_its_step():
    # Lab 5c's training worker: both modes train (their losses asserted equal inside), and each row
    # carries the host's time to issue a step next to the step's time. On a CPU the host does the
    # work itself, so the two are of one size; on a GPU the host time is what tells a host-bound
    # step (FSDP's at one GPU) from a GPU-bound one.
    r = D.torchrun(
        "train_ddp_fsdp.py", 2, ["--accum", "0"], backend="gloo", timeout=200, verbose=False
    )
    assert [row["mode"] for row in r["rows"]] == ["ddp", "fsdp"]
    for row in r["rows"]:
        assert row["world"] == 2 and row["seconds"] > 0
        assert 0.2 * row["seconds"] < row["host_seconds"] < 5 * row["seconds"], row


def test_torchrun_rejects_bad_arguments():
    with pytest.raises(ValueError, match="nproc must be a positive int"):
        D.torchrun("tp_mlp.py", 0, backend="gloo")
    with pytest.raises(ValueError, match="backend must be"):
        D.torchrun("tp_mlp.py", 2, backend="mpi")
    with pytest.raises(FileNotFoundError, match="no_such_script"):
        D.torchrun("no_such_script.py", 2, backend="gloo")


# ----------------------------------------------------------------------------- no processes


def test_ring_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        C.ring_all_reduce(torch.ones(4))
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        C.ring_all_reduce("not a tensor")


@pytest.mark.parametrize("numel, parts", [(0, 3), (1, 4), (10, 3), (12, 4), (4099, 7)])
def test_chunk_bounds(numel, parts):
    b = C.chunk_bounds(numel, parts)
    sizes = [hi - lo for lo, hi in b]
    assert len(b) == parts and b[0][0] == 0 and b[-1][1] == numel
    assert all(b[i][1] == b[i + 1][0] for i in range(parts - 1))
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_ring_schedule_sums_every_chunk(n):
    # Play the schedule with numbers: chunk c of rank r starts as 10**r so sums are readable.
    data = [[10**r] * n for r in range(n)]
    schedules = [C.ring_schedule(n, r) for r in range(n)]
    assert all(len(s) == 2 * (n - 1) for s in schedules)
    for step in range(2 * (n - 1)):
        sent = [data[r][schedules[r][step][1]] for r in range(n)]
        for r in range(n):
            phase, _, recv = schedules[r][step]
            left = (r - 1) % n
            assert schedules[left][step][1] == recv, "a rank receives what its left neighbour sends"
            data[r][recv] = data[r][recv] + sent[left] if phase == "reduce-scatter" else sent[left]
        if step == n - 2:  # end of reduce-scatter: rank r owns the full sum of chunk r + 1
            assert all(data[r][(r + 1) % n] == sum(10**q for q in range(n)) for r in range(n))
    assert all(v == sum(10**q for q in range(n)) for row in data for v in row)


def test_busbw_factors_follow_nccl_tests():
    assert C.busbw_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert C.busbw_factor("all_gather", 8) == C.busbw_factor("reduce_scatter", 8) == 7 / 8
    assert C.busbw_factor("all_to_all", 2) == 0.5 and C.busbw_factor("send_recv", 5) == 1
    algbw, busbw = C.bandwidths("all_reduce", 1e9, 0.01, 2)
    assert algbw == pytest.approx(100) and busbw == pytest.approx(100)
    with pytest.raises(ValueError, match="op must be one of"):
        C.busbw_factor("all_sum", 2)
    with pytest.raises(ValueError, match="n must be a positive int"):
        C.busbw_factor("all_reduce", 0)
    with pytest.raises(ValueError, match="seconds must be positive"):
        C.bandwidths("all_reduce", 1, 0, 2)


def test_alpha_beta_model_and_fit():
    alpha, beta, n = 8e-6, 1 / 300e9, 4
    sizes = [2**k for k in range(10, 31, 2)]
    times = [C.ring_cost("all_reduce", s, n, alpha, beta) for s in sizes]
    assert times[0] == pytest.approx(2 * (n - 1) * alpha, rel=1e-3)  # tiny messages: latency
    assert sizes[-1] / times[-1] * C.busbw_factor("all_reduce", n) == pytest.approx(
        1 / beta, rel=1e-2
    )  # huge messages: bus bandwidth -> the link bandwidth
    fit = C.fit_alpha_beta("all_reduce", sizes, times, n)
    assert fit == pytest.approx((alpha, beta), rel=1e-6)
    # A tree's latency grows as log2(n), a ring's as n: at 64 ranks and 1 KB the tree wins.
    assert C.tree_all_reduce_cost(1024, 64, alpha, beta) < C.ring_cost(
        "all_reduce", 1024, 64, alpha, beta
    )
    assert C.ring_cost("all_gather", 1e6, n, alpha, beta) == pytest.approx(
        C.ring_cost("all_reduce", 1e6, n, alpha, beta) / 2
    )


# ----------------------------------------------------------------------------- pipeline schedules


@pytest.mark.parametrize("schedule", D.SCHEDULES)
@pytest.mark.parametrize("p, m", [(1, 1), (2, 1), (2, 4), (3, 5), (4, 8), (4, 3), (8, 32)])
def test_schedule_bubble_matches_formula(schedule, p, m):
    t_f, t_b = 1.0, 2.0
    ops = D.simulate(schedule, p, m, t_f, t_b)
    assert len(ops) == 2 * p * m
    assert D.makespan(ops) == pytest.approx((m + p - 1) * (t_f + t_b))
    assert D.idle_fraction(ops) == pytest.approx(D.bubble_fraction(p, m))
    assert D.bubble_fraction(p, m) == pytest.approx((p - 1) / (m + p - 1))
    done = {(o.kind, o.stage, o.micro): o for o in ops}
    for o in ops:  # dependencies hold and no stage runs two ops at once
        if o.kind == "F" and o.stage > 0:
            assert done["F", o.stage - 1, o.micro].end <= o.start
        if o.kind == "B":
            before = (
                done["B", o.stage + 1, o.micro] if o.stage < p - 1 else done["F", o.stage, o.micro]
            )
            assert before.end <= o.start
    for s in range(p):
        mine = sorted((o for o in ops if o.stage == s), key=lambda o: o.start)
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 2)])
def test_1f1b_holds_fewer_activations(p, m):
    for s in range(p):
        assert D.peak_in_flight("gpipe", p, m, s) == m
        assert D.peak_in_flight("1f1b", p, m, s) == min(p - s, m)
        order = D.stage_order("1f1b", p, m, s)
        assert sorted(order) == sorted(D.stage_order("gpipe", p, m, s))


def test_schedule_communication_and_bad_input():
    slow = D.makespan(D.simulate("1f1b", 4, 8, 1.0, 2.0, t_comm=0.5))
    assert slow > D.makespan(D.simulate("1f1b", 4, 8, 1.0, 2.0))
    with pytest.raises(ValueError, match="schedule must be one of"):
        D.simulate("zero-bubble", 2, 2)
    with pytest.raises(ValueError, match="m must be a positive int"):
        D.simulate("gpipe", 2, 0)
    with pytest.raises(ValueError, match="p must be a positive int"):
        D.bubble_fraction(0, 4)
    with pytest.raises(ValueError, match="stage must be in"):
        D.stage_order("1f1b", 2, 2, 2)
    with pytest.raises(ValueError, match="t_f, t_b > 0"):
        D.simulate("gpipe", 2, 2, t_f=0.0)


def test_tp_shard_bad_input():
    w1, b1, w2, b2 = torch.ones(4, 6), torch.ones(6), torch.ones(6, 4), torch.ones(4)
    with pytest.raises(ValueError, match="rank must be in"):
        D.shard_mlp(w1, b1, w2, b2, 2, 2)
    with pytest.raises(ValueError, match="disagree"):
        D.shard_mlp(w1, b1, torch.ones(5, 4), b2, 0, 2)
    shards = [D.shard_mlp(w1, b1, w2, b2, r, 4) for r in range(4)]
    assert sum(s[0].shape[1] for s in shards) == 6 and math.isclose(D.bubble_fraction(1, 9), 0)


def test_tiny_gpt_and_state_bytes():
    model = D.TinyGPT(vocab=50, d_model=16, n_layers=2, n_heads=2, max_seq=8)
    assert sum(p.numel() for p in model.parameters()) == D.gpt_params(50, 16, 2, 8)
    idx = torch.randint(0, 50, (3, 8))
    assert model(idx).shape == (3, 8, 50)
    opt = torch.optim.AdamW(model.parameters())
    model(idx).float().logsumexp(-1).mean().backward()
    opt.step()
    b = D.model_state_bytes(model, opt)
    assert b["params"] == b["grads"] == b["optimizer"] / 2 == 4 * D.gpt_params(50, 16, 2, 8)


def test_notebook_helpers_for_the_workers():
    from kernels.notebook import fmt_bytes

    assert D.cli_args({"d_model": 64, "micros": [1, 2]}) == ["--d-model", 64, "--micros", 1, 2]
    assert [fmt_bytes(b) for b in (1024, 3 * 2**19, 2**30)] == ["1 KiB", "1.5 MiB", "1 GiB"]
