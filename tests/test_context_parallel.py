"""Ring attention (kernels.context_parallel) against single-process attention: the zig-zag split,
the log-sum-exp merge, the torch engine's backward, then forward and gradients over gloo with 2 and
3 CPU processes (one launch per world size, every case inside it), the Triton engine on one tiny
case, bad input.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kernels import context_parallel as CP
from kernels import device
from kernels import distributed as D


def _full(b, h, n, d, dtype, seed=0):
    rand = D.seeded_randn("cpu", torch.float32, seed)  # every rank builds the same full tensors
    return [rand(b, h, n, d).to(dtype) for _ in range(4)]


def _shards(x: torch.Tensor, world: int, causal: bool, layout: str) -> list[torch.Tensor]:
    if causal and layout == "zigzag":
        return CP.zigzag_split(x, world)
    return [c.contiguous() for c in x.chunk(world, dim=2)]


# ----------------------------------------------------------------------------- in the processes


def _ring_case(b, h, n_local, d, causal, layout, impl, dtype, atol, rtol, scale=None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, do = _full(b, h, n_local * world, d, dtype, seed=n_local + 31 * d)
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = CP.attention_ref(*ref_in, causal=causal, sm_scale=scale)
    ref.backward(do.double())

    def mine(x):
        return _shards(x, world, causal, layout)[rank]

    local = [mine(t).requires_grad_() for t in (q, k, v)]
    out = CP.ring_attention(*local, causal=causal, sm_scale=scale, impl=impl, layout=layout)
    out.backward(mine(do))
    assert out.dtype == dtype and out.shape == local[0].shape
    case = (b, h, n_local, d, causal, layout, impl, world)
    torch.testing.assert_close(
        out.double(), mine(ref.detach()), atol=atol, rtol=rtol, msg=lambda m: f"{case}: {m}"
    )
    for name, t, r in zip("qkv", local, ref_in):
        torch.testing.assert_close(
            t.grad.double(),
            mine(r.grad),
            atol=atol,
            rtol=rtol,
            msg=lambda m, name=name: f"d{name} {case}: {m}",
        )


def _subgroup_case() -> None:
    # A ring of one (plain attention, nothing sent): every rank must create the group.
    alone = dist.new_group([0])
    if dist.get_rank() == 0:
        q, k, v, do = _full(1, 2, 6, 8, torch.float32, seed=9)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        CP.ring_attention(*leaves, True, group=alone).backward(do)
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        CP.attention_ref(*ref_leaves, causal=True).backward(do)
        for a, r in zip(leaves, ref_leaves):
            torch.testing.assert_close(a.grad, r.grad)
    # A ring over a subgroup whose ranks are not 0..k-1: neighbours go through get_global_rank.
    world = dist.get_world_size()
    members = [world - 1, 0] if world > 2 else [0, 1]
    sub = dist.new_group(sorted(members))
    if dist.get_rank() not in members:
        return
    r, n = dist.get_rank(sub), dist.get_world_size(sub)
    q, k, v, _ = _full(1, 2, 4 * n, 8, torch.float32, seed=5)
    out = CP.ring_attention(*(CP.zigzag_split(t, n)[r] for t in (q, k, v)), True, group=sub)
    torch.testing.assert_close(out, CP.zigzag_split(CP.attention_ref(q, k, v, True), n)[r])


def _worker() -> None:
    torch.set_num_threads(1)
    fp32 = (torch.float32, 1e-5, 1e-5)
    cases = [
        # b, h, n_local, d, causal, layout
        (1, 1, 7, 16, False, "zigzag"),  # odd per-rank length
        (2, 3, 5, 8, False, "zigzag"),
        (2, 3, 6, 8, True, "zigzag"),  # chunks of 3
        (1, 2, 10, 24, True, "zigzag"),
        (1, 2, 5, 8, True, "contiguous"),
    ]
    for b, h, n_local, d, causal, layout in cases:
        _ring_case(b, h, n_local, d, causal, layout, "torch", *fp32)
    _ring_case(1, 2, 4, 8, True, "zigzag", "torch", *fp32, scale=0.3)
    _subgroup_case()
    if dist.get_world_size() == 2 and device.INTERPRET:
        # The Triton kernels in the interpreter (slow: one tiny case). fp16 inputs, fp32 inside;
        # the reference sees the same fp16 values in float64.
        _ring_case(1, 1, 24, 64, True, "zigzag", "triton", torch.float16, 2e-3, 2e-3)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_attention_matches_one_process(world):
    D.spawn(_worker, world)


# ----------------------------------------------------------------------------- no processes


@pytest.mark.parametrize("world, n", [(1, 6), (2, 12), (3, 18), (4, 8)])
def test_zigzag_split_and_merge(world, n):
    x = torch.arange(2 * 3 * n).reshape(2, 3, n, 1)
    shards = CP.zigzag_split(x, world)
    assert len(shards) == world and all(s.is_contiguous() for s in shards)
    c = n // (2 * world)
    for r, s in enumerate(shards):  # rank r holds chunks r and 2·world - 1 - r
        pos = s[0, 0, :, 0].tolist()
        assert pos == list(range(r * c, (r + 1) * c)) + list(
            range((2 * world - 1 - r) * c, (2 * world - r) * c)
        )
    assert torch.equal(CP.zigzag_merge(shards), x)
    with pytest.raises(ValueError, match="divisible by 2 \\* world"):
        CP.zigzag_split(torch.ones(1, 1, 10, 2), 3)
    with pytest.raises(ValueError, match="world must be a positive int"):
        CP.zigzag_split(x, 0)


@pytest.mark.parametrize("n_q, split", [(5, 3), (9, 4), (1, 7)])
def test_merge_of_two_key_sets_is_exact(n_q, split):
    gen = torch.Generator().manual_seed(n_q)
    q = torch.randn(2, 3, n_q, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 3, n_q + split, 8, generator=gen, dtype=torch.float64) for _ in "kv")
    s = 0.4
    full, lse = CP.attention_lse_torch(q, k, v, False, s)
    o1, l1 = CP.attention_lse_torch(q, k[:, :, :split], v[:, :, :split], False, s)
    o2, l2 = CP.attention_lse_torch(q, k[:, :, split:], v[:, :, split:], False, s)
    o, lm = CP.merge(o1, l1, o2, l2)
    torch.testing.assert_close(o.double(), full, atol=1e-6, rtol=1e-6)  # fp32 inside the engine
    torch.testing.assert_close(lm.double(), lse.double(), atol=1e-6, rtol=1e-6)
    # The order does not matter, and a key set a row did not see (lse = -inf) adds nothing.
    o_sw, _ = CP.merge(o2, l2, o1, l1)
    torch.testing.assert_close(o_sw, o)
    none = torch.full_like(l1, float("-inf"))
    o_n, l_n = CP.merge(o1, l1, torch.zeros_like(o1), none)
    torch.testing.assert_close(o_n, o1.float())
    torch.testing.assert_close(l_n, l1.float())
    both, l_b = CP.merge(torch.zeros_like(o1), none, torch.zeros_like(o1), none)
    assert torch.isneginf(l_b).all() and not both.isnan().any() and not both.any()


@pytest.mark.parametrize("n, causal", [(7, False), (6, True)])
def test_torch_engine_backward_matches_autograd(n, causal):
    gen = torch.Generator().manual_seed(1)
    q, k, v, do = (torch.randn(1, 2, n, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = CP.attention_ref(*leaves, causal=causal, sm_scale=0.5)
    ref.backward(do)
    o, lse = CP.attention_lse_torch(q, k, v, causal, 0.5)
    grads = CP.attention_bwd_torch(q, k, v, o, lse, do, causal, 0.5)
    for g, leaf in zip(grads, leaves):
        torch.testing.assert_close(g.double(), leaf.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "world, rank, src, causal, layout, expect",
    [
        (2, 0, 0, True, "zigzag", [(0, 8, 0, 8, True)]),
        (2, 1, 0, True, "zigzag", [(0, 8, 0, 4, False)]),  # earlier rank: its first chunk
        (2, 0, 1, True, "zigzag", [(4, 8, 0, 8, False)]),  # later rank: my second chunk
        (3, 0, 2, True, "contiguous", []),
        (3, 2, 0, True, "contiguous", [(0, 8, 0, 8, False)]),
        (3, 1, 2, False, "zigzag", [(0, 8, 0, 8, False)]),
    ],
)
def test_visible_pieces(world, rank, src, causal, layout, expect):
    got = [
        (qs.start, qs.stop, ks.start, ks.stop, c)
        for qs, ks, c in CP._pieces(rank, src, 8, causal, layout)
    ]
    assert got == expect


def test_zigzag_balances_work():
    # Count the visible (query, key) pairs each rank computes, from the pieces: with the zig-zag
    # split every rank does the same work; with contiguous slices rank r does r whole blocks more than rank 0.
    n, n_loc = 4, 8

    def work(layout):
        out = []
        for r in range(n):
            pairs = 0
            for src in range(n):
                for qs, ks, c in CP._pieces(r, src, n_loc, True, layout):
                    nq, nk = qs.stop - qs.start, ks.stop - ks.start
                    pairs += nq * (nq + 1) // 2 if c else nq * nk
            out.append(pairs)
        return out

    zz, cont = work("zigzag"), work("contiguous")
    assert len(set(zz)) == 1 and sum(zz) == sum(cont) == (n * n_loc) * (n * n_loc + 1) // 2
    # Contiguous: rank r sees r whole blocks and its diagonal one.
    assert cont == [r * n_loc**2 + n_loc * (n_loc + 1) // 2 for r in range(n)]


def test_bad_input():
    x = torch.ones(1, 2, 4, 8)
    with pytest.raises(TypeError, match="q must have dtype"):
        CP.ring_attention(x.long(), x, x)
    with pytest.raises(ValueError, match="k must be contiguous"):
        CP.ring_attention(x, x.transpose(2, 3).contiguous().transpose(2, 3), x)
    with pytest.raises(ValueError, match="q and k must have the same shape"):
        CP.ring_attention(x, torch.ones(1, 2, 5, 8), x)
    with pytest.raises(ValueError, match="layout must be one of"):
        CP.ring_attention(x, x, x, True, layout="striped")
    with pytest.raises(ValueError, match="impl must be one of"):
        CP.ring_attention(x, x, x, impl="cuda")
    with pytest.raises(TypeError, match="fp16 or bf16 for impl='triton'"):
        CP.ring_attention(x, x, x, impl="triton")
    with pytest.raises(ValueError, match="must be even for the zig-zag"):
        CP.ring_attention(*(torch.ones(1, 1, 5, 8),) * 3, True)
    with pytest.raises(ValueError, match="sm_scale must be"):
        CP.ring_attention(x, x, x, sm_scale=-1.0)
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        CP.ring_attention(x, x, x)


def test_torchrun_worker_checks_and_times():
    # The notebook's path on gloo: the check against one process, then the timing table's rows.
    r = D.torchrun(
        "ring_attention.py", 2, ["--seqs", 16, "--reps", 2], backend="gloo", timeout=180,
        verbose=False,
    )  # fmt: skip
    assert r["impl"] == "torch" and r["world"] == 2
    assert max(r["check"]["ring_err"].values()) < 1e-5
    (row,) = r["rows"]
    assert row["n"] == 16 and all(row[k] > 0 for k in ("ring_ms", "compute_ms", "comm_ms"))
    assert row["kv_bytes_per_step"] == 2 * 2 * 8 * 16 * 4  # k and v: 2 heads, 8 rows, d 16, fp32


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_step_flops_add_up_to_one_device(world):
    from kernels import flash_attention as fa

    b, h, n_loc, d = 2, 3, 64, 128
    n = world * n_loc
    for causal in (False, True):
        total = world * CP.step_flops(b, h, n_loc, d, world, causal)
        assert total == pytest.approx(fa.fwd_flops(b, h, n, n, d, causal))
