"""Ring attention: context parallelism over torch.distributed, on the course's FlashAttention.

A sequence too long for one GPU's activations is split along its length over the ``n`` ranks of a
process group: each rank holds ``q, k, v: [B, H, N/n, D]``, a slice of the sequence. Attention needs
every query to meet every key, so the key/value blocks travel around a ring: at step ``i`` rank
``r`` holds the block that started on rank ``r - i`` and attends its own queries to it, while the
next block is already on its way (the exchange for step ``i + 1`` is issued *before* step ``i``'s
attention, so on a GPU the transfer, which NCCL runs on its own stream, hides behind the compute).
After ``n`` steps every query has met every key, and no rank ever held more than two K/V blocks.

**Merging partial results.** Attention over a block of keys returns an output ``o_i`` normalised
over that block only and the natural-log log-sum-exp ``lse_i`` of its scaled scores
(``flash_attention.attention_with_lse``). Two partial results over disjoint key sets combine
exactly (``merge``)::

    lse = log(exp(lse_1) + exp(lse_2)),   o = exp(lse_1 - lse) · o_1 + exp(lse_2 - lse) · o_2

**Causal and the zig-zag split.** With a causal mask, the rank holding the end of the sequence has
``n`` blocks of keys to visit and the first rank one: contiguous slices leave most ranks idle most of
the time. The zig-zag split cuts the sequence into ``2n`` chunks and gives rank ``r`` chunks ``r``
and ``2n - 1 - r`` (``zigzag_split``, ``zigzag_merge``). Then every step costs every rank the same:
its own block is one causal attention (the two chunks are in order, so the plain causal mask is
right); a block from an earlier rank ``s < r`` is seen in full by all local queries but only its
first chunk is visible (``q × k[:c]``); a block from a later rank ``s > r`` is seen only by the
local second chunk, but in full (``q[c:] × k``). Both are ``c × 2c``, half a block.

**Backward.** FlashAttention's backward needs, per query row, the *global* output and log-sum-exp
(its ``P = exp(s - lse)`` must be the probability over all keys, and ``delta = rowsum(dO ∘ O)`` the
global one). With those saved from the forward, the backward runs the same ring: K/V travel again,
and with each block travels an fp32 accumulator of its ``dK, dV``, to which every rank adds its
queries' contribution; after ``n`` steps each accumulator has been once around the ring and one
more hop brings it home. ``dQ`` stays local.

Two attention engines (``impl``): ``"triton"`` (``kernels.flash_attention``'s forward and backward
kernels: fp16/bf16, head dim 64 or 128) and ``"torch"`` (the same maths in fp32 torch, any dtype and
head dim: in the CPU interpreter the Triton kernels are slow, so tests use it for most cases).
Default: Triton for CUDA tensors, torch otherwise.

Every rank must call ``ring_attention`` with tensors of the same shape (ranks exchange blocks of
that shape without checking each other).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from kernels import _validate
from kernels import flash_attention as fa
from kernels.launch import LOG2E

IMPLS = ("triton", "torch")
LAYOUTS = ("zigzag", "contiguous")


# ----------------------------------------------------------------------------- the split


def zigzag_split(x: torch.Tensor, world: int, dim: int = 2) -> list[torch.Tensor]:
    """Cut ``x`` along ``dim`` into ``2·world`` equal chunks and return the ``world`` shards of the
    zig-zag layout: shard ``r`` is chunks ``r`` and ``2·world - 1 - r``, concatenated (contiguous
    copies). ``x.shape[dim]`` must divide by ``2·world``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    n = x.shape[dim]
    if n % (2 * world):
        raise ValueError(f"x.shape[{dim}] = {n} must be divisible by 2 * world = {2 * world}")
    chunks = x.chunk(2 * world, dim=dim)
    return [
        torch.cat((chunks[r], chunks[2 * world - 1 - r]), dim=dim).contiguous()
        for r in range(world)
    ]


def zigzag_merge(shards: list[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """The inverse of ``zigzag_split``: the full sequence from every rank's shard."""
    world = len(shards)
    if world == 0:
        raise ValueError("shards must hold at least one tensor")
    halves = [s.chunk(2, dim=dim) for s in shards]
    order = [halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))]
    return torch.cat(order, dim=dim)


def _pieces(rank: int, src: int, n_local: int, causal: bool, layout: str):
    """The attention calls rank ``rank`` makes against the K/V block of rank ``src``: a list of
    ``(query slice, key slice, causal)``. See the module docstring for why these are the visible
    parts; every call is causal only on a square block whose queries and keys are in order."""
    every = slice(0, n_local)
    if not causal:
        return [(every, every, False)]
    if src == rank:
        return [(every, every, True)]
    if layout == "contiguous":
        return [(every, every, False)] if src < rank else []
    c = n_local // 2
    if src < rank:  # all my queries come after its first chunk and before its second
        return [(every, slice(0, c), False)]
    return [(slice(c, n_local), every, False)]  # only my second chunk is after both of its chunks


# ----------------------------------------------------------------------------- attention engines


def merge(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over two disjoint key sets: ``o_i: [..., N, D]`` normalised over set ``i``
    and ``lse_i: [..., N]`` its natural-log log-sum-exp. Returns ``(o, lse)`` over the union, o in
    fp32. A row that saw no key in a set has ``lse_i = -inf`` and weight 0; a row that saw none at
    all keeps ``lse = -inf`` and ``o = 0``."""
    lse = torch.logaddexp(lse1.float(), lse2.float())
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w1 = torch.exp(lse1.float() - safe).unsqueeze(-1)
    w2 = torch.exp(lse2.float() - safe).unsqueeze(-1)
    return o1.float() * w1 + o2.float() * w2, lse


def _scores(q, k, causal: bool, scale: float, dt: torch.dtype = torch.float32) -> torch.Tensor:
    s = (q.to(dt) @ k.to(dt).transpose(-2, -1)) * scale
    if causal:  # top-left aligned: query i sees keys 0..i
        s = s.masked_fill(fa._causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return s


def attention_lse_torch(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch engine's forward: ``(o in q's dtype, lse fp32 natural log)``, fp32 inside."""
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.exp(s - lse.unsqueeze(-1)) @ v.float()
    return o.to(q.dtype), lse


def attention_bwd_torch(q, k, v, o, lse, do, causal: bool, scale: float):
    """The torch engine's backward, FlashAttention's equations with a given (global) ``o`` and
    ``lse``: ``P = exp(S - lse)``, ``dV = Pᵀ dO``, ``dS = P ∘ (dO Vᵀ - rowsum(dO ∘ O))``,
    ``dQ = dS K · scale``, ``dK = dSᵀ Q · scale``. Returns fp32 ``(dq, dk, dv)``."""
    p = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))
    do32 = do.float()
    delta = (do32 * o.float()).sum(-1, keepdim=True)
    ds = p * (do32 @ v.float().transpose(-2, -1) - delta)
    return (
        ds @ k.float() * scale,
        ds.transpose(-2, -1) @ q.float() * scale,
        p.transpose(-2, -1) @ do32,
    )


def _attn_fwd(impl: str, q, k, v, causal: bool, scale: float):
    if impl == "torch":
        return attention_lse_torch(q, k, v, causal, scale)
    return fa.attention_with_lse(q, k, v, causal, scale)  # lse in natural log


def _attn_bwd(impl: str, q, k, v, o, lse, do, causal: bool, scale: float):
    if impl == "torch":
        return attention_bwd_torch(q, k, v, o, lse, do, causal, scale)
    # The kernels keep the log-sum-exp in base 2 (log2 of the sum of exp2 of the scaled scores).
    lse2 = (lse * LOG2E).contiguous()
    return fa._backward(q, k, v, o, lse2, do, causal, scale)


# ----------------------------------------------------------------------------- the ring


def _rows(*tensors):
    """``rows(sl)``: contiguous copies of ``t[:, :, sl]`` for each tensor, made once per slice (the
    query-side slices are the same at every step; the kernels need contiguous operands)."""
    cache: dict[tuple, list] = {}

    def rows(sl: slice) -> list[torch.Tensor]:
        key = (sl.start, sl.stop)
        if key not in cache:
            cache[key] = [
                t if sl == slice(0, t.shape[2]) else t[:, :, sl].contiguous() for t in tensors
            ]
        return cache[key]

    return rows


class _Ring:
    """Neighbours in a process group and the one exchange the ring needs: send to the right,
    receive from the left, as one ``batch_isend_irecv`` whose two operations every rank mirrors
    (its right neighbour receives from it what it sends), which NCCL requires."""

    def __init__(self, group):
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.n = dist.get_rank(self.group), dist.get_world_size(self.group)
        # Peers are global ranks: a subgroup's rank i need not be global rank i.
        self.right = dist.get_global_rank(self.group, (self.rank + 1) % self.n)
        self.left = dist.get_global_rank(self.group, (self.rank - 1) % self.n)

    def start(self, send: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Issue the exchange; returns the receive buffer and the works to wait on (NCCL: a wait
        makes the current stream wait for the transfer, no host sync; gloo: it blocks)."""
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.right, self.group),
            dist.P2POp(dist.irecv, recv, self.left, self.group),
        ]
        return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(works: list) -> None:
        for w in works:
            w.wait()


def ring_forward(q, k, v, causal, scale, group, impl, layout, *, parts: str = "all"):
    """The forward ring; returns ``(o in q's dtype, lse fp32)``. ``parts`` is for timing
    breakdowns: ``"compute"`` runs every step's attention on the local block without sending,
    ``"comm"`` only the exchanges."""
    ring = _Ring(group)
    B, H, n_loc, D = q.shape
    o = torch.zeros(B, H, n_loc, D, device=q.device, dtype=torch.float32)
    lse = torch.full((B, H, n_loc), float("-inf"), device=q.device, dtype=torch.float32)
    kv = torch.stack((k, v))  # one buffer: one transfer per step
    q_rows = _rows(q)
    for step in range(ring.n):
        src = (ring.rank - step) % ring.n
        pending = None
        if step + 1 < ring.n and parts != "compute":
            pending = ring.start(kv)  # issued before this step's attention: it overlaps
        if parts != "comm":
            for qs, ks, c in _pieces(ring.rank, src, n_loc, causal, layout):
                (qq,) = q_rows(qs)
                kk, vv = kv[0, :, :, ks].contiguous(), kv[1, :, :, ks].contiguous()
                o_p, lse_p = _attn_fwd(impl, qq, kk, vv, c, scale)
                o[:, :, qs], lse[:, :, qs] = merge(o[:, :, qs], lse[:, :, qs], o_p, lse_p)
        if pending is not None:
            recv, works = pending
            ring.wait(works)
            kv = recv
    return o.to(q.dtype), lse


def ring_backward(q, k, v, o, lse, do, causal, scale, group, impl, layout, *, parts: str = "all"):
    """The backward ring; returns ``(dq, dk, dv)`` in q's dtype. K/V travel as in the forward; the
    fp32 ``dK, dV`` accumulator of each block travels one step behind its block (it can leave only
    once this rank's contribution is added), overlapping the next step's compute."""
    ring = _Ring(group)
    n_loc = q.shape[2]
    dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    kv = torch.stack((k, v))
    q_rows = _rows(q, o, do, lse.unsqueeze(-1))
    dkv = None  # the accumulator of the block this rank holds, once it has arrived
    dkv_pending = None
    for step in range(ring.n):
        src = (ring.rank - step) % ring.n
        kv_pending = None
        if step + 1 < ring.n and parts != "compute":
            kv_pending = ring.start(kv)
        local = torch.zeros(kv.shape, device=q.device, dtype=torch.float32)
        if parts != "comm":
            for qs, ks, c in _pieces(ring.rank, src, n_loc, causal, layout):
                qq, oo, dd, ll = q_rows(qs)
                ll = ll.squeeze(-1)
                kk, vv = kv[0, :, :, ks].contiguous(), kv[1, :, :, ks].contiguous()
                dq_p, dk_p, dv_p = _attn_bwd(impl, qq, kk, vv, oo, ll, dd, c, scale)
                dq[:, :, qs] += dq_p
                local[0, :, :, ks] += dk_p
                local[1, :, :, ks] += dv_p
        if dkv_pending is not None:  # the accumulator of this step's block, from the left
            recv, works = dkv_pending
            ring.wait(works)
            local += recv
        dkv = local
        if parts != "compute" and ring.n > 1:
            # Every step's accumulator moves right; after step n-1 the hop takes it home.
            dkv_pending = ring.start(dkv)
        if kv_pending is not None:
            recv, works = kv_pending
            ring.wait(works)
            kv = recv
    if dkv_pending is not None:
        recv, works = dkv_pending
        ring.wait(works)
        dkv = recv
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    """Saves the local q, k, v, the local slice of the global output and its log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, group, impl, layout):
        o, lse = ring_forward(q, k, v, causal, scale, group, impl, layout)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, scale, group, impl, layout)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(q, k, v, o, lse, do.contiguous(), *ctx.args)
        return dq, dk, dv, None, None, None, None, None


def _check(q, k, v, causal, sm_scale, impl, layout) -> tuple[float, str]:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _validate.tensor(name, t, dtypes=(torch.float16, torch.bfloat16, torch.float32), ndim=4)
    _validate.same("q", q, "k", k)
    _validate.same("k", k, "v", v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    impl = ("triton" if q.is_cuda else "torch") if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "triton":
        if q.dtype not in fa.SUPPORTED_DTYPES:
            raise TypeError(f"q must be fp16 or bf16 for impl='triton', got {q.dtype}")
        if q.shape[3] not in fa.SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {fa.SUPPORTED_HEAD_DIMS}, got {q.shape[3]}")
    if q.shape[2] == 0:
        raise ValueError("q must hold at least one position per rank")
    if causal and layout == "zigzag" and q.shape[2] % 2:
        raise ValueError(
            f"q.shape[2] = {q.shape[2]} must be even for the zig-zag layout (two chunks per rank)"
        )
    scale = _validate.sm_scale(sm_scale, q.shape[3])
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("ring_attention needs torch.distributed.init_process_group first")
    return scale, impl


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    sm_scale: float | None = None,
    *,
    group: dist.ProcessGroup | None = None,
    impl: str | None = None,
    layout: str = "zigzag",
) -> torch.Tensor:
    """Attention of this rank's queries over the whole sequence, whose slices are spread over
    ``group``; differentiable in ``q, k, v``.

    ``q, k, v: [B, H, N/n, D]`` are this rank's slice (same shape on every rank): the ``r``-th
    contiguous slice without ``causal``; with ``causal``, shard ``r`` of ``zigzag_split`` (or, with
    ``layout="contiguous"``, the ``r``-th contiguous slice: correct but unbalanced, for comparison).
    Returns this rank's slice of ``softmax(q kᵀ · sm_scale [+ causal mask]) v`` in q's dtype.
    """
    scale, impl = _check(q, k, v, causal, sm_scale, impl, layout)
    return RingAttention.apply(q, k, v, causal, scale, group, impl, layout)


# ----------------------------------------------------------------------------- references


def attention_ref(q, k, v, causal: bool = False, sm_scale: float | None = None) -> torch.Tensor:
    """Single-process attention over the full sequence, in fp64 for fp64 inputs and fp32 otherwise
    (returned in that precision; differentiable, for reference gradients)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    return torch.softmax(_scores(q, k, causal, scale, dt), dim=-1) @ v.to(dt)


def step_flops(b: int, h: int, n_local: int, d: int, world: int, causal: bool) -> float:
    """Forward FLOPs one rank does in a ring pass: ``world`` blocks of ``n_local²`` scores each,
    or with the zig-zag causal split one half-masked block plus ``world - 1`` half blocks."""
    per_block = 4 * b * h * n_local * n_local * d
    return per_block * (world if not causal else 0.5 + 0.5 * (world - 1))
