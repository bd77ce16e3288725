"""MoE shapes of real models, and routing with the skew real routers produce.

Each shape is read from the model's published configuration (its ``config.json`` on the Hugging
Face hub, named in ``source``). Only the routed experts are modelled: DeepSeek-V3 also has one
shared expert and group-limited routing (8 groups, 4 chosen), and Qwen1.5-MoE-A2.7B four shared
experts' worth of a dense MLP; a shared expert is a dense GEMM, ``kernels.matmul``'s business.

A trained router is not uniform: some experts are popular, some rarely chosen, some (in a given
batch) not at all. ``skewed_bias`` makes that reproducible: expert ``e`` gets a logit offset
``log p_e`` with Zipf-like ``p_e ~ 1 / rank_e ** zipf`` (ranks shuffled by the seed) and
``n_empty`` experts an offset so low they are never chosen. Added to logits of unit spread, the
top-k picks follow ``p`` (the Gumbel-top-k construction, with Gaussian instead of Gumbel noise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.moe.routing import route

EMPTY_LOGIT = -1e4  # an offset no unit-spread logit overcomes: the expert is never chosen


@dataclass(frozen=True)
class MoEShape:
    name: str
    hidden: int  # d_model: K of gate/up, N of down
    expert_width: int  # the expert MLP's intermediate size: N of gate/up, K of down
    n_experts: int  # routed experts
    top_k: int
    scoring: str
    norm_topk: bool
    source: str

    def expert_params(self) -> int:
        """Parameters of the routed experts of one layer (gate, up and down)."""
        return 3 * self.n_experts * self.hidden * self.expert_width


MODEL_SHAPES: dict[str, MoEShape] = {
    s.name: s
    for s in (
        MoEShape("deepseek-v3", 7168, 2048, 256, 8, "sigmoid", True,
                 "deepseek-ai/DeepSeek-V3 config.json: hidden_size, moe_intermediate_size, "
                 "n_routed_experts, num_experts_per_tok, scoring_func, norm_topk_prob"),
        MoEShape("mixtral-8x7b", 4096, 14336, 8, 2, "softmax", True,
                 "mistralai/Mixtral-8x7B-v0.1 config.json: hidden_size, intermediate_size, "
                 "num_local_experts, num_experts_per_tok"),
        MoEShape("qwen1.5-moe-a2.7b", 2048, 1408, 60, 4, "softmax", False,
                 "Qwen/Qwen1.5-MoE-A2.7B config.json: hidden_size, moe_intermediate_size, "
                 "num_experts, num_experts_per_tok, norm_topk_prob"),
    )
}  # fmt: skip


def skewed_bias(
    n_experts: int, *, zipf: float = 1.0, n_empty: int = 0, seed: int = 0
) -> torch.Tensor:
    """fp32 ``[n_experts]`` logit offsets: ``log p_e`` with ``p_e ~ 1 / rank ** zipf`` over shuffled
    ranks, and ``EMPTY_LOGIT`` for ``n_empty`` experts (never chosen). ``zipf=0``: uniform."""
    if not 0 <= n_empty < n_experts:
        raise ValueError(f"n_empty must be in [0, n_experts) = [0, {n_experts}), got {n_empty}")
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n_experts, generator=g)
    ranks = torch.empty(n_experts)
    ranks[perm] = torch.arange(1, n_experts + 1, dtype=torch.float32)
    bias = -zipf * torch.log(ranks)
    if n_empty:
        bias[perm[n_experts - n_empty :]] = EMPTY_LOGIT  # the least popular ones
    return bias


def skewed_routing(
    n_tokens: int,
    n_experts: int,
    top_k: int,
    *,
    zipf: float = 1.0,
    n_empty: int = 0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    scoring: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(expert_ids int32 [n_tokens, top_k], weights fp32 [n_tokens, top_k])`` drawn from unit
    Gaussian logits plus ``skewed_bias``: some experts heavy, ``n_empty`` of them empty. Seeded."""
    if top_k > n_experts - n_empty:
        raise ValueError(f"top_k ({top_k}) must be at most n_experts - n_empty")
    g = torch.Generator().manual_seed(seed + 1)
    logits = torch.randn(n_tokens, n_experts, generator=g)
    logits += skewed_bias(n_experts, zipf=zipf, n_empty=n_empty, seed=seed)
    ids, w = route(logits, top_k, scoring)
    return ids.to(device), w.to(device)


def counts(expert_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Rows per expert (int64 ``[n_experts]``)."""
    return torch.bincount(expert_ids.reshape(-1).long(), minlength=n_experts)
