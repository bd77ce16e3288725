"""Sequence parallelism (kernels.sequence_parallel): the TP and TP+SP MLP and attention blocks
against the unsharded blocks, forward and every gradient, over gloo with 2 and 3 CPU processes (one launch per
world size); the activations each keeps, measured with saved-tensor hooks against the count."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kernels import activation_memory as AM
from kernels import collectives as C
from kernels import distributed as D
from kernels import sequence_parallel as SP


def _weights(s, b, h, d_ff, seed=3):
    r = D.seeded_randn("cpu", torch.float64, seed)  # every rank builds the same full tensors
    ln_w, ln_b = 1 + 0.1 * r(h), 0.1 * r(h)
    w1, b1, w2, b2 = r(h, d_ff) / h**0.5, r(d_ff), r(d_ff, h) / d_ff**0.5, r(h)
    return r(s, b, h), r(s, b, h), (ln_w, ln_b, w1, b1, w2, b2)


def _block_case(s, b, h, d_ff) -> None:
    rank, t = dist.get_rank(), dist.get_world_size()
    x, dy, full = _weights(s, b, h, d_ff)
    ref_leaves = [p.clone().requires_grad_() for p in (x, *full)]
    ref = SP.block_ref(*ref_leaves)
    ref.backward(dy)
    x_ref_grad = ref_leaves[0].grad
    ln_w_g, ln_b_g, w1_g, b1_g, w2_g, b2_g = (p.grad for p in ref_leaves[1:])
    lo, hi = C.chunk_bounds(d_ff, t)[rank]
    n = s // t
    mine = slice(rank * n, (rank + 1) * n)

    for sp in (False, True):
        ln = [p.clone().requires_grad_() for p in full[:2]]
        shards = [p.clone().requires_grad_() for p in D.shard_mlp(*full[2:], rank, t)]
        xs = (x[mine] if sp else x).clone().requires_grad_()
        fn = SP.sp_block if sp else SP.tp_block
        counter = AM.SavedTensorCounter(exclude=[*ln, *shards])
        with counter:
            out = fn(xs, *ln, *shards)
        out.backward(dy[mine] if sp else dy)
        if sp:
            SP.reduce_replicated_grads([ln[0], ln[1], shards[3]])
        case = (s, b, h, d_ff, t, "sp" if sp else "tp")
        torch.testing.assert_close(out, ref.detach()[mine] if sp else ref.detach(), msg=str(case))
        torch.testing.assert_close(xs.grad, x_ref_grad[mine] if sp else x_ref_grad)
        torch.testing.assert_close(ln[0].grad, ln_w_g)
        torch.testing.assert_close(ln[1].grad, ln_b_g)
        torch.testing.assert_close(shards[0].grad, w1_g[:, lo:hi])
        torch.testing.assert_close(shards[1].grad, b1_g[lo:hi])
        torch.testing.assert_close(shards[2].grad, w2_g[lo:hi])
        torch.testing.assert_close(shards[3].grad, b2_g)
        if d_ff == 4 * h and d_ff % t == 0:  # the count assumes Megatron's 4h MLP, evenly split
            elements = SP.activation_elements(s, b, h, t, sp)
            assert counter.total == elements * 8, (case, counter.total, elements * 8)


def _attention_case(s, b, n_heads, d) -> None:
    rank, t = dist.get_rank(), dist.get_world_size()
    width = n_heads * d + 1  # the model width need not be heads x head_dim
    r = D.seeded_randn("cpu", torch.float64, s + n_heads)
    x, dy = r(s, b, width), r(s, b, width)
    full = (1 + r(width, scale=0.1), r(width, scale=0.1), r(width, 3 * n_heads * d, scale=width**-0.5),
            r(3 * n_heads * d, scale=0.1), r(n_heads * d, width, scale=0.3), r(width, scale=0.1))  # fmt: skip
    leaves = [p.clone().requires_grad_() for p in (x, *full)]
    ref = SP.attention_block_ref(*leaves, head_dim=d)
    ref.backward(dy)
    n = s // t
    mine = slice(rank * n, (rank + 1) * n)
    wqkv_s, bqkv_s, wo_s, _ = SP.shard_attention(*full[2:], n_heads, rank, t)
    lo, hi = C.chunk_bounds(n_heads, t)[rank]
    cols = [c for p in range(3) for c in range(p * n_heads * d + lo * d, p * n_heads * d + hi * d)]
    for sp in (False, True):
        params = [p.clone().requires_grad_() for p in (*full[:2], wqkv_s, bqkv_s, wo_s, full[5])]
        xs = (x[mine] if sp else x).clone().requires_grad_()
        fn = SP.sp_attention_block if sp else SP.tp_attention_block
        out = fn(xs, *params, head_dim=d)
        out.backward(dy[mine] if sp else dy)
        if sp:
            SP.reduce_replicated_grads([params[0], params[1], params[5]])
        torch.testing.assert_close(out, ref.detach()[mine] if sp else ref.detach())
        torch.testing.assert_close(xs.grad, leaves[0].grad[mine] if sp else leaves[0].grad)
        expect = [leaves[1].grad, leaves[2].grad, leaves[3].grad[:, cols], leaves[4].grad[cols],
                  leaves[5].grad[lo * d : hi * d], leaves[6].grad]  # fmt: skip
        for got, exp in zip(params, expect):
            torch.testing.assert_close(got.grad, exp)


def _dropout_case() -> None:
    rank, t = dist.get_rank(), dist.get_world_size()
    x, _, full = _weights(4 * t, 2, 16, 64)
    mine = x[rank * 4 : (rank + 1) * 4]
    shards = D.shard_mlp(*full[2:], rank, t)
    torch.manual_seed(rank)
    out = SP.sp_block(mine, *full[:2], *shards, p_drop=0.5)
    kept_residual_only = (out == mine).double().mean().item()  # dropped elements add nothing
    assert 0.3 < kept_residual_only < 0.7, kept_residual_only


def _worker() -> None:
    torch.set_num_threads(1)
    t = dist.get_world_size()
    for s, b, h, d_ff in [(2 * t, 1, 8, 32), (3 * t, 2, 12, 37), (t, 3, 5, 20)]:
        _block_case(s, b, h, d_ff)
    _attention_case(2 * t, 2, 3, 4)  # three heads: uneven over two ranks
    _attention_case(3 * t, 1, t, 8)
    _dropout_case()
    with pytest.raises(ValueError, match="must divide by the group size"):
        SP.shard_sequence(torch.ones(t + 1, 4))
    assert SP.shard_sequence(torch.arange(2 * t))[0] == 2 * dist.get_rank()


@pytest.mark.parametrize("world", [2, 3])
def test_tp_and_sp_blocks_match_one_process(world):
    D.spawn(_worker, world)


def test_activation_count_and_bad_input():
    # SP divides everything by t; TP alone only the MLP's inside.
    s, b, h, t = 8, 2, 16, 4
    assert SP.activation_elements(s, b, h, t, True) * t == SP.activation_elements(s, b, h, 1, False)
    tp = SP.activation_elements(s, b, h, t, False)
    assert tp == s * b * (2 * h + 2) + 8 * s * b * h / t
    w = torch.ones(4)
    with pytest.raises(ValueError, match="x must be \\[s, ..., h\\]"):
        SP.block_ref(torch.ones(3, 5), w, w, None, None, None, None)
    with pytest.raises(ValueError, match="p_drop must be in"):
        SP.block_ref(torch.ones(3, 4), w, w, None, None, None, None, p_drop=1.0)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        SP.tp_block([1.0], w, w, None, None, None, None)
    wqkv, wo = torch.ones(4, 24), torch.ones(8, 4)
    with pytest.raises(ValueError, match="n_heads \\(2\\) must be at least"):
        SP.shard_attention(wqkv, torch.ones(24), wo, w, 2, 0, 3)
    with pytest.raises(ValueError, match="disagree with n_heads=3"):
        SP.shard_attention(wqkv, torch.ones(24), wo, w, 3, 0, 2)
    with pytest.raises(ValueError, match="rank must be in"):
        SP.shard_attention(wqkv, torch.ones(24), wo, w, 2, 2, 2)


def test_torchrun_worker_measures_tp_and_sp():
    # The notebook's path: the worker checks, times and measures at a tiny width on gloo.
    r = D.torchrun(
        "sp_mlp.py", 2, ["--widths", 32, "--reps", 2], backend="gloo", timeout=180, verbose=False
    )
    assert r["checks"] == 6
    mlp, attention = r["rows"]
    assert mlp["block"] == "mlp" and attention["block"] == "attention" and attention["heads"] == 2
    for row in (mlp, attention):
        assert row["tp_ms"] > 0 and row["sp_ms"] > 0
        assert row["sp_saved_bytes"] < row["tp_saved_bytes"]
    for name in ("tp", "sp"):  # measured saved bytes equal the count, per rank
        assert mlp[f"{name}_saved_bytes"] == mlp[f"{name}_count_bytes"]
