"""Expert parallelism on 2 gloo processes: the all-to-all dispatch, the local experts and the combine
give the single-process ``moe_layer`` (fp32; kernels in the interpreter on a CPU, and on a GPU
machine both processes share its GPU), for uneven token counts per rank, ranks that receive
nothing, and both weight layouts; plus the torchrun script."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from kernels import device, moe
from kernels import distributed as D
from kernels.moe import ep

# (tokens per rank, D, F, n_experts, top_k, router bias making some experts empty, trans_b)
CASES = [
    ((5, 7), 24, 20, 4, 2, None, False),
    ((3, 0), 16, 12, 6, 3, None, True),
    ((6, 4), 16, 20, 4, 1, [0.0, 0.0, -1e4, -1e4], False),  # rank 1's experts get no rows
]


def _case(tokens, d, f, n_experts, top_k, bias, trans_b) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(5)  # every rank builds the same full problem
    x = torch.randn(sum(tokens), d, generator=g)
    router_w = torch.randn(n_experts, d, generator=g)
    shape_in = (n_experts, f, d) if trans_b else (n_experts, d, f)
    shape_out = (n_experts, d, f) if trans_b else (n_experts, f, d)
    w_gate = torch.randn(shape_in, generator=g) * d**-0.5
    w_up = torch.randn(shape_in, generator=g) * d**-0.5
    w_down = torch.randn(shape_out, generator=g) * f**-0.5
    router_bias = None if bias is None else torch.tensor(bias)
    # On a GPU machine both processes run the kernels on its GPU and gloo carries CUDA tensors.
    x, router_w, w_gate, w_up, w_down = (
        t.to(device.DEVICE) for t in (x, router_w, w_gate, w_up, w_down)
    )
    router_bias = None if router_bias is None else router_bias.to(device.DEVICE)
    kw = dict(top_k=top_k, router_bias=router_bias, trans_b=trans_b)
    with torch.no_grad():
        full = moe.moe_layer(x, router_w, w_gate, w_up, w_down, **kw)
        lo_t = sum(tokens[:rank])
        lo, hi = ep.expert_bounds(n_experts, world)[rank]
        out = ep.ep_moe_forward(
            x[lo_t : lo_t + tokens[rank]], router_w, w_gate[lo:hi], w_up[lo:hi],
            w_down[lo:hi], **kw,
        )  # fmt: skip
    want = full[lo_t : lo_t + tokens[rank]]
    if device.INTERPRET:  # same rows, same weights, same order of the k-sum: equal to the bit
        assert torch.equal(out, want), (tokens, n_experts, top_k)
    else:  # cuBLAS may pick another kernel for the router's smaller GEMM: the last bits differ
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def _worker() -> None:
    torch.set_num_threads(1)
    for case in CASES:
        _case(*case)
    with pytest.raises(ValueError, match="w_gate must hold"):
        ep.ep_moe_forward(torch.ones(2, 8), torch.ones(4, 8), *(torch.ones(4, 8, 8),) * 3, 1)


def test_expert_parallel_matches_single_process():
    D.spawn(_worker, 2)


_NUMPY = tuple(int(p) for p in np.__version__.split(".")[:2])


@pytest.mark.skipif(
    device.GPU_MODE and _NUMPY >= (2, 4),
    reason="gloo workers hide the GPU and run Triton's interpreter, which needs numpy < 2.4 "
    f"(requirements.txt pins it; this machine has {np.__version__}); the two-GPU NCCL run of "
    "scripts/dist/expert_parallel.py checks the same on GPUs",
)
def test_torchrun_script_checks_and_times():
    r = D.torchrun(
        "expert_parallel.py", 2, ["--check-only"], backend="gloo", timeout=120, verbose=False
    )
    assert r["world"] == 2 and r["backend"] == "gloo" and r["checks"] >= 2


def test_expert_bounds():
    assert ep.expert_bounds(8, 2) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="multiple of the world size"):
        ep.expert_bounds(6, 4)
