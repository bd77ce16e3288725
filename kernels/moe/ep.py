"""Expert parallelism: the experts split across ranks, tokens sent to them and back with all-to-all.

Each rank holds its own tokens (the attention before the MoE layer is data parallel) and a
contiguous slice of the experts (``expert_bounds``). One layer's forward is three phases:

1. **dispatch**: route and ``permute`` the local tokens by *global* expert id. Experts are
   contiguous per rank, so the rows bound for rank ``r`` are one contiguous slice of ``x_sorted``.
   The per-expert counts are exchanged first (``all_to_all_single`` of ``n_experts`` integers) so
   every rank knows how many rows it will receive from whom, for which of its experts; then the
   rows themselves (``all_to_all_single`` with those split sizes). NCCL's all-to-all takes its
   split sizes as host integers, so the counts are read on the host here: one sync per layer,
   which dispatch libraries (DeepEP, Mega MoE) avoid by doing the exchange inside their kernels.
2. **experts**: the received rows are grouped by source rank, then by local expert: a second
   ``permute`` (one choice per row) sorts them by local expert, ``expert_ffn`` runs the grouped
   GEMMs, and ``unpermute`` puts the results back in arrival order.
3. **combine**: the inverse all-to-all sends each row's result home, where ``unpermute`` sums a
   token's ``top_k`` results weighted by its routing weights.

The result equals the single-device ``moe_layer`` on all tokens: the same rows meet the same
weights, and each token's k results are summed in the same order. Communication per rank and
direction is ``rows sent x D x bytes`` (those that stay on the rank are a local copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels.moe.layer import expert_ffn, router_logits
from kernels.moe.routing import Permutation, permute, route, unpermute


def expert_bounds(n_experts: int, world: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of the experts each rank owns: contiguous, equal (n_experts % world == 0)."""
    if n_experts % world:
        raise ValueError(f"n_experts ({n_experts}) must be a multiple of the world size ({world})")
    per = n_experts // world
    return [(r * per, (r + 1) * per) for r in range(world)]


@dataclass
class Dispatched:
    """One rank's state between the phases."""

    recv: torch.Tensor  # [R, D] rows received, by source rank then by local expert
    recv_counts: torch.Tensor  # int64 [world, experts per rank]: rows per (source, local expert)
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    handle: Permutation  # the local permute of this rank's tokens
    weights: torch.Tensor  # fp32 [T, top_k] routing weights of this rank's tokens

    @property
    def n_rows(self) -> int:
        """T * top_k: the rows this rank sent, and gets back."""
        return self.handle.n_rows


def dispatch(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    n_experts: int,
    group=None,
) -> Dispatched:
    """Phase 1: sort this rank's token copies by expert and send each to the rank owning it."""
    world = dist.get_world_size(group)
    per = n_experts // world
    x_sorted, offsets, handle = permute(x, expert_ids, n_experts)
    counts = (offsets[1:] - offsets[:-1]).to(torch.int64)  # rows per global expert
    recv_counts = torch.empty(world * per, dtype=torch.int64, device=x.device)
    dist.all_to_all_single(recv_counts, counts, group=group)  # equal splits: `per` each
    # NCCL takes split sizes on the host: the one sync of the layer.
    send_splits = counts.view(world, per).sum(1).tolist()
    recv_counts = recv_counts.view(world, per)
    recv_splits = recv_counts.sum(1).tolist()
    recv = x.new_empty(sum(recv_splits), x.shape[1])
    dist.all_to_all_single(recv, x_sorted, recv_splits, send_splits, group=group)
    return Dispatched(recv, recv_counts, send_splits, recv_splits, handle, weights)


def run_experts(d: Dispatched, w_gate, w_up, w_down, trans_b: bool = False) -> torch.Tensor:
    """Phase 2: this rank's experts on the rows it received; results in arrival order."""
    world, per = d.recv_counts.shape
    local = torch.arange(per, device=d.recv.device).repeat(world)
    # output_size: the row count is known on the host (no second sync to size the result).
    local_ids = torch.repeat_interleave(
        local, d.recv_counts.reshape(-1), output_size=d.recv.shape[0]
    )[:, None]
    xs, offsets, handle = permute(d.recv, local_ids, per)
    ys = expert_ffn(xs, offsets, w_gate, w_up, w_down, trans_b)
    return unpermute(ys, handle)  # one choice per row, no weights: back to arrival order


def combine(d: Dispatched, y_recv: torch.Tensor, group=None) -> torch.Tensor:
    """Phase 3: send every result home and sum each token's copies, weighted."""
    y_sorted = y_recv.new_empty(d.n_rows, y_recv.shape[1])
    dist.all_to_all_single(y_sorted, y_recv, d.send_splits, d.recv_splits, group=group)
    return unpermute(y_sorted, d.handle, d.weights)


def ep_moe_forward(
    x: torch.Tensor,
    router_w: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    norm_topk: bool = True,
    router_bias: torch.Tensor | None = None,
    trans_b: bool = False,
    group=None,
) -> torch.Tensor:
    """The MoE layer forward with experts split across the ranks of ``group``.

    ``x: [T_rank, D]``: this rank's tokens (any count, 0 included); ``router_w: [E, D]`` (every rank
    the same); ``w_gate, w_up, w_down``: this rank's experts ``expert_bounds(E, world)[rank]``, laid
    out as in ``moe_layer``. Returns ``[T_rank, D]``, equal to ``moe_layer`` of all tokens."""
    n_experts = router_w.shape[0]
    world = dist.get_world_size(group)
    if w_gate.shape[0] * world != n_experts:
        raise ValueError(
            f"w_gate must hold this rank's n_experts / world = {n_experts // world} experts, "
            f"got {w_gate.shape[0]}"
        )
    ids, weights = route(router_logits(x, router_w, router_bias), top_k, scoring, norm_topk)
    d = dispatch(x, ids, weights, n_experts, group)
    return combine(d, run_experts(d, w_gate, w_up, w_down, trans_b), group)


def cross_rank_rows(d: Dispatched, rank: int) -> tuple[int, int]:
    """(rows this rank sends to other ranks, rows it receives from them): what crosses the links."""
    sent = sum(s for r, s in enumerate(d.send_splits) if r != rank)
    got = sum(s for r, s in enumerate(d.recv_splits) if r != rank)
    return sent, got
