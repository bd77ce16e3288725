"""Routing, and the two data movements around the experts: permute (tokens sorted by expert) and
unpermute (the k expert outputs of each token combined with its routing weights).

``route(logits, top_k)`` picks each token's ``top_k`` experts. ``permute`` copies every (token,
choice) pair's row into one buffer ordered by expert, so that expert ``e`` owns the contiguous rows
``offsets[e] : offsets[e + 1]``: the ragged groups the grouped GEMM walks. ``unpermute`` reads the
expert outputs back and writes, per token, ``sum_j weights[t, j] * y_sorted[pos[t, j]]``.

Both movements are one Triton kernel each that reads every byte once and writes it once:

- ``_gather_rows_kernel`` (permute): sorted row ``s`` reads token row ``order[s] // top_k``. The
  same kernel is the backward of the combine, where it also scales each row by its routing weight
  and forms the weight's gradient (a row dot product) in the same pass.
- ``_combine_kernel`` (unpermute): token row ``t`` reads its ``top_k`` sorted rows and sums them,
  weighted, in fp32, in a fixed order: no atomics, so the result is deterministic. With no weights
  it is the backward of permute (the gradient of a token is the sum over its copies).

The sort itself is PyTorch's: ``torch.sort(stable=True)`` of ``T * top_k`` small integer keys is a
device radix sort (CUB) that is deterministic, and a sort is a kernel of its own that this lesson is
not about; ``torch.searchsorted`` of the sorted keys gives the ``n_experts + 1`` offsets without
atomics. A permute is therefore one sort, one searchsorted and one Triton launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import _validate, device
from kernels.launch import cdiv, next_power_of_2

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCORINGS = ("softmax", "sigmoid")

# Rows per program and the width of one pass over a row. On a GPU 4 rows x 1024 values are 32
# values (a 16-byte vector of bf16, four times) per thread of 4 warps: wide, coalesced loads.
_ROWS_GPU, _COLS_GPU = 4, 1024
_ROWS_CPU, _COLS_CPU = 4, 64  # the interpreter: small blocks, few wasted (masked) lanes


def _blocks(width: int) -> tuple[int, int]:
    rows, cols = (_ROWS_CPU, _COLS_CPU) if device.INTERPRET else (_ROWS_GPU, _COLS_GPU)
    return rows, min(cols, next_power_of_2(max(width, 16)))


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _gather_rows_kernel(
    # pointers: order int64 [M] (flat (token, choice) index of sorted row s); x [T, D] (token rows);
    # out [M, D]; pos int32 [T * TOP_K] (written: sorted row of each flat index); scale fp32
    # [T * TOP_K] (routing weights); y [M, D] and dscale fp32 [T * TOP_K] (the backward's dot)
    order_ptr,
    x_ptr,
    out_ptr,
    pos_ptr,
    scale_ptr,
    y_ptr,
    dscale_ptr,
    # sizes
    M,
    D,
    # strides (elements; the last dimension of x, out and y is contiguous)
    stride_xm,
    stride_om,
    stride_ym,
    # meta-parameters
    TOP_K: tl.constexpr,
    WRITE_POS: tl.constexpr,  # permute: record the inverse permutation for unpermute
    HAS_SCALE: tl.constexpr,  # combine backward: out = scale * x[token]
    DOT: tl.constexpr,  # combine backward: dscale = <x[token], y[s]>, the weight's gradient
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Reads M * D values of x (each token row once per choice) and writes M * D: one pass.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < M
    flat = tl.load(order_ptr + rows, mask=row_ok, other=0)
    token = flat // TOP_K
    if WRITE_POS:
        tl.store(pos_ptr + flat, rows.to(tl.int32), mask=row_ok)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + flat, mask=row_ok, other=0.0)
    dot = tl.zeros([BLOCK_R], dtype=tl.float32)
    src = x_ptr + token.to(tl.int64)[:, None] * stride_xm
    dst = out_ptr + rows.to(tl.int64)[:, None] * stride_om
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        ok = row_ok[:, None] & (cols < D)[None, :]
        v = tl.load(src + cols[None, :], mask=ok, other=0.0)
        if DOT:
            # other=0.0: on a GPU a masked lane without it holds whatever the register held (the
            # interpreter gives 0), and 0 * NaN would poison the row's dot.
            y = tl.load(
                y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], mask=ok, other=0.0
            )
            dot += tl.sum(v.to(tl.float32) * y.to(tl.float32), 1)
        if HAS_SCALE:
            v = v.to(tl.float32) * scale[:, None]
        tl.store(dst + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=ok)
    if DOT:
        tl.store(dscale_ptr + flat, dot, mask=row_ok)


@triton.jit
def _combine_kernel(
    # pointers: pos int32 [T, TOP_K] (sorted row of each copy); y [M, D]; weights fp32 [T, TOP_K];
    # out [T, D]
    pos_ptr,
    y_ptr,
    w_ptr,
    out_ptr,
    # sizes
    T,
    D,
    # strides (elements; last dimensions contiguous)
    stride_ym,
    stride_om,
    # meta-parameters
    TOP_K: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Reads T * TOP_K rows of y, writes T rows: the k copies are summed in registers, in fp32, in
    # the order j = 0 .. k-1 (deterministic: no atomics, no dependence on the schedule).
    toks = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok_ok = toks < T
    ok = tok_ok[:, None] & (cols < D)[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        p = tl.load(pos_ptr + toks * TOP_K + j, mask=tok_ok, other=0)
        v = tl.load(y_ptr + p.to(tl.int64)[:, None] * stride_ym + cols[None, :], mask=ok, other=0.0)
        if HAS_WEIGHTS:
            w = tl.load(w_ptr + toks * TOP_K + j, mask=tok_ok, other=0.0)
            acc += v.to(tl.float32) * w[:, None]
        else:
            acc += v.to(tl.float32)
    out = out_ptr + toks.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- routing


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def route(
    logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    norm_topk: bool = True,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: ``(expert_ids int32 [T, top_k], weights fp32 [T, top_k])``.

    ``logits: [T, n_experts]`` (any float dtype; scored in fp32). ``scoring="softmax"`` (Mixtral,
    Qwen-MoE) turns each row into probabilities; ``"sigmoid"`` (DeepSeek-V3) scores each expert on
    its own. The ``top_k`` highest scores pick the experts; ``norm_topk`` rescales the chosen scores
    to sum to 1 per token (Mixtral and DeepSeek-V3 do; Qwen1.5-MoE does not). ``bias: [n_experts]``
    is added to the scores for the *choice only*, not the weights: DeepSeek-V3's auxiliary-loss-free
    load balancing, and how the benchmarks make routing skewed. The weights are differentiable
    (plain PyTorch), so a router trained through ``moe_layer`` gets its gradient from them.
    """
    _validate.tensor("logits", logits, dtypes=FLOAT_DTYPES, ndim=2)
    n_experts = logits.shape[1]
    _positive_int("top_k", top_k)
    if top_k > n_experts:
        raise ValueError(f"top_k must be at most n_experts ({n_experts}), got {top_k}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
    scores = logits.float()
    scores = torch.softmax(scores, -1) if scoring == "softmax" else torch.sigmoid(scores)
    if bias is None:
        ids = torch.topk(scores, top_k, dim=-1).indices
    else:
        _validate.tensor("bias", bias, dtypes=FLOAT_DTYPES, ndim=1)
        if bias.shape[0] != n_experts or bias.device != logits.device:
            raise ValueError(
                f"bias must be [n_experts] = [{n_experts}] on {logits.device}, got "
                f"{tuple(bias.shape)} on {bias.device}"
            )
        ids = torch.topk(scores.detach() + bias.float(), top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
    return ids.to(torch.int32), weights


# ----------------------------------------------------------------------------- permute


@dataclass(frozen=True)
class Permutation:
    """What ``permute`` did, for ``unpermute`` and the backward passes.

    ``order`` int64 [M]: sorted row ``s`` holds copy ``order[s] % top_k`` of token ``order[s] //
    top_k`` (M = n_tokens * top_k); ``sorted_pos`` int32 [n_tokens, top_k], its inverse;
    ``offsets`` int32 [n_experts + 1]: expert ``e`` owns sorted rows ``offsets[e] : offsets[e+1]``.
    """

    order: torch.Tensor
    sorted_pos: torch.Tensor
    offsets: torch.Tensor
    n_tokens: int
    top_k: int
    n_experts: int

    @property
    def n_rows(self) -> int:
        return self.n_tokens * self.top_k


def _check_ids(expert_ids, n_tokens: int, n_experts: int, dev) -> None:
    _validate.tensor("expert_ids", expert_ids, dtypes=(torch.int32, torch.int64), ndim=2)
    if expert_ids.shape[0] != n_tokens:
        raise ValueError(
            f"expert_ids must have one row per token of x ({n_tokens}), got "
            f"{tuple(expert_ids.shape)}"
        )
    if expert_ids.device != dev:
        raise ValueError(f"expert_ids must be on {dev} with x, got {expert_ids.device}")
    if expert_ids.numel() and _validate.check_values(expert_ids):
        lo, hi = int(expert_ids.min()), int(expert_ids.max())
        if lo < 0 or hi >= n_experts:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"expert_ids holds expert {bad}, outside [0, n_experts) = [0, {n_experts})"
            )


def _check_rows(name: str, t) -> None:
    _validate.tensor(name, t, dtypes=FLOAT_DTYPES, ndim=2)
    if device.GPU_MODE and not t.is_cuda:
        raise ValueError(f"{name} must be on a CUDA device, got {t.device}")


def permute(
    x: torch.Tensor, expert_ids: torch.Tensor, n_experts: int
) -> tuple[torch.Tensor, torch.Tensor, Permutation]:
    """Sort the rows of ``x: [T, D]`` by expert: returns ``(x_sorted [T * top_k, D], offsets int32
    [n_experts + 1], handle)``. Copy ``j`` of token ``t`` goes to expert ``expert_ids[t, j]``; within
    an expert, rows keep token order (a stable sort), so the layout is deterministic."""
    _check_rows("x", x)
    _positive_int("n_experts", n_experts)
    T, D = x.shape
    _check_ids(expert_ids, T, n_experts, x.device)
    top_k = expert_ids.shape[1]
    M = T * top_k
    keys, order = torch.sort(expert_ids.reshape(-1), stable=True)
    bounds = torch.arange(n_experts + 1, device=x.device, dtype=keys.dtype)
    offsets = torch.searchsorted(keys, bounds).to(torch.int32)
    x_sorted = torch.empty(M, D, device=x.device, dtype=x.dtype)
    sorted_pos = torch.empty(T, top_k, device=x.device, dtype=torch.int32)
    if M:
        rows, cols = _blocks(D)
        _gather_rows_kernel[(cdiv(M, rows),)](
            order, x, x_sorted, sorted_pos, order, order, order, M, D,
            x.stride(0), x_sorted.stride(0), 0,
            TOP_K=top_k, WRITE_POS=True, HAS_SCALE=False, DOT=False, BLOCK_R=rows, BLOCK_D=cols,
        )  # fmt: skip
    return x_sorted, offsets, Permutation(order, sorted_pos, offsets, T, top_k, n_experts)


def _check_handle(handle) -> None:
    if not isinstance(handle, Permutation):
        raise TypeError(f"handle must be the Permutation permute returned, got {type(handle)}")


def _check_weights(weights, handle: Permutation, dev) -> None:
    _validate.tensor("weights", weights, dtypes=(torch.float32,), ndim=2)
    if tuple(weights.shape) != (handle.n_tokens, handle.top_k) or weights.device != dev:
        raise ValueError(
            f"weights must be [n_tokens, top_k] = [{handle.n_tokens}, {handle.top_k}] on {dev}, "
            f"got {tuple(weights.shape)} on {weights.device}"
        )


def unpermute(
    y_sorted: torch.Tensor, handle: Permutation, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Combine: ``out[t] = sum_j weights[t, j] * y_sorted[sorted_pos[t, j]]``, ``[n_tokens, D]`` in
    y_sorted's dtype, summed in fp32. ``weights`` fp32 ``[n_tokens, top_k]`` (the routing weights);
    ``None`` sums the copies unweighted (the gradient of ``permute``)."""
    _check_rows("y_sorted", y_sorted)
    _check_handle(handle)
    if y_sorted.shape[0] != handle.n_rows:
        raise ValueError(
            f"y_sorted must have n_tokens * top_k = {handle.n_rows} rows (as permuted), got "
            f"{tuple(y_sorted.shape)}"
        )
    if weights is not None:
        _check_weights(weights, handle, y_sorted.device)
    T, D = handle.n_tokens, y_sorted.shape[1]
    out = torch.empty(T, D, device=y_sorted.device, dtype=y_sorted.dtype)
    if T and D:
        rows, cols = _blocks(D)
        w = weights if weights is not None else handle.sorted_pos
        _combine_kernel[(cdiv(T, rows), cdiv(D, cols))](
            handle.sorted_pos, y_sorted, w, out, T, D, y_sorted.stride(0), out.stride(0),
            TOP_K=handle.top_k, HAS_WEIGHTS=weights is not None, BLOCK_R=rows, BLOCK_D=cols,
        )  # fmt: skip
    return out


def unpermute_backward(
    grad_out: torch.Tensor, y_sorted: torch.Tensor, handle: Permutation, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of ``unpermute(y_sorted, handle, weights)`` in one pass: ``(grad_y_sorted [M,
    D], grad_weights fp32 [n_tokens, top_k])``, with ``grad_y[s] = w * grad_out[token]`` and
    ``grad_w = <grad_out[token], y_sorted[s]>``."""
    M, D = y_sorted.shape
    grad_y = torch.empty_like(y_sorted)
    grad_w = torch.empty(handle.n_tokens, handle.top_k, device=y_sorted.device)
    if M:
        rows, cols = _blocks(D)
        _gather_rows_kernel[(cdiv(M, rows),)](
            handle.order, grad_out, grad_y, grad_w, weights, y_sorted, grad_w, M, D,
            grad_out.stride(0), grad_y.stride(0), y_sorted.stride(0),
            TOP_K=handle.top_k, WRITE_POS=False, HAS_SCALE=True, DOT=True,
            BLOCK_R=rows, BLOCK_D=cols,
        )  # fmt: skip
    return grad_y, grad_w


# ----------------------------------------------------------------------------- references


def permute_ref(x: torch.Tensor, expert_ids: torch.Tensor, n_experts: int):
    """``(x_sorted, offsets)`` by plain indexing: the reference for ``permute``."""
    flat = expert_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    offsets = torch.zeros(n_experts + 1, dtype=torch.int32, device=x.device)
    offsets[1:] = counts.cumsum(0)
    return x[order // expert_ids.shape[1]], offsets


def unpermute_ref(y_sorted: torch.Tensor, handle: Permutation, weights: torch.Tensor | None):
    """fp32 reference for ``unpermute``: index the copies, weight them, sum over k."""
    y = y_sorted.float()[handle.sorted_pos.long()]  # [T, k, D]
    if weights is not None:
        y = y * weights.float()[:, :, None]
    return y.sum(1)


COMPILE_SPECS = [
    dict(
        kernel=_gather_rows_kernel,
        signature={
            "order_ptr": "*i64",
            "x_ptr": f"*{t}",
            "out_ptr": f"*{t}",
            "pos_ptr": "*i32" if not bwd else "*fp32",
            "scale_ptr": "*fp32",
            "y_ptr": f"*{t}",
            "dscale_ptr": "*fp32",
            **{n: "i32" for n in ("M", "D", "stride_xm", "stride_om", "stride_ym")},
        },
        constexprs={
            "TOP_K": 8,
            "WRITE_POS": not bwd,
            "HAS_SCALE": bwd,
            "DOT": bwd,
            "BLOCK_R": _ROWS_GPU,
            "BLOCK_D": _COLS_GPU,
        },  # fmt: skip
    )
    for t in ("bf16",)
    for bwd in (False, True)
] + [
    dict(
        kernel=_combine_kernel,
        signature={
            "pos_ptr": "*i32",
            "y_ptr": f"*{t}",
            "w_ptr": "*fp32",
            "out_ptr": f"*{t}",
            **{n: "i32" for n in ("T", "D", "stride_ym", "stride_om")},
        },
        constexprs={
            "TOP_K": 8,
            "HAS_WEIGHTS": True,
            "BLOCK_R": _ROWS_GPU,
            "BLOCK_D": _COLS_GPU,
        },  # fmt: skip
    )
    for t in ("bf16",)
]
