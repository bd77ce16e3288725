"""Mixture of experts: routing, permute/unpermute, the grouped GEMM and the fused SwiGLU MoE layer.

A mixture-of-experts layer sends each token to ``top_k`` of ``E`` expert MLPs. Routing makes the
work *ragged*: expert ``e`` gets however many rows the router gave it, from none to thousands, and
the counts change every batch. The package computes the layer without a launch per expert and
without padding groups in memory:

- ``routing``: ``route`` (softmax or sigmoid top-k, normalised weights), ``permute`` (rows sorted
  by expert, with the expert offsets) and ``unpermute`` (the weighted combine), each one Triton pass;
- ``grouped``: ``grouped_matmul`` (a persistent grouped GEMM whose programs walk every expert's
  tiles), ``grouped_swiglu`` (gate and up projections in one launch, activation in the epilogue),
  ``grouped_matmul_dw`` (the weight gradient, ragged in its reduction), references and baselines
  (the per-expert loop, ``torch._grouped_mm``);
- ``layer``: ``moe_layer`` (forward and backward), ``moe_layer_loop`` (the eager baseline),
  ``moe_layer_ref`` (fp32);
- ``workloads``: the shapes of DeepSeek-V3, Mixtral-8x7B and Qwen1.5-MoE-A2.7B, and seeded skewed
  routing (heavy experts, empty experts);
- ``ep``: expert parallelism over ``torch.distributed`` (all-to-all dispatch and combine);
- ``benchmark``: the ``moe`` benchmark of ``python -m kernels.bench``.
"""

from kernels.moe import benchmark, ep, grouped, layer, routing, workloads
from kernels.moe.grouped import (
    grouped_matmul,
    grouped_matmul_add_,
    grouped_matmul_dw,
    grouped_matmul_dw_ref,
    grouped_matmul_loop,
    grouped_matmul_ref,
    grouped_matmul_torch,
    grouped_swiglu,
    grouped_swiglu_backward,
    torch_grouped_mm_available,
)
from kernels.moe.layer import expert_ffn, moe_layer, moe_layer_loop, moe_layer_ref, router_logits
from kernels.moe.routing import (
    Permutation,
    permute,
    permute_ref,
    route,
    unpermute,
    unpermute_backward,
    unpermute_ref,
)
from kernels.moe.workloads import MODEL_SHAPES, MoEShape, counts, skewed_bias, skewed_routing

# Every Triton kernel of the package, for tests/test_compile.py.
COMPILE_SPECS = routing.COMPILE_SPECS + grouped.COMPILE_SPECS

__all__ = [
    "MODEL_SHAPES", "MoEShape", "Permutation", "benchmark", "counts", "ep", "expert_ffn",
    "grouped", "grouped_matmul", "grouped_matmul_add_", "grouped_matmul_dw",
    "grouped_matmul_dw_ref", "grouped_matmul_loop", "grouped_matmul_ref", "grouped_matmul_torch",
    "grouped_swiglu", "grouped_swiglu_backward", "layer", "moe_layer", "moe_layer_loop",
    "moe_layer_ref", "permute", "permute_ref", "route", "router_logits", "routing", "skewed_bias",
    "skewed_routing", "torch_grouped_mm_available", "unpermute", "unpermute_backward",
    "unpermute_ref", "workloads",
]  # fmt: skip
