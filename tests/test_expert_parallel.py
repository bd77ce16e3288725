"""Expert parallelism on 2 gloo CPU processes: the all-to-all dispatch, the local experts and the
combine give the single-process ``moe_layer`` (fp32, kernels in the interpreter), for uneven token
counts per rank, ranks that receive nothing, and both weight layouts; plus the torchrun script, on
gloo here and on NCCL where there are two GPUs."""

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
    kw = dict(top_k=top_k, router_bias=router_bias, trans_b=trans_b)
    with torch.no_grad():
        full = moe.moe_layer(x, router_w, w_gate, w_up, w_down, **kw)
        lo_t = sum(tokens[:rank])
        lo, hi = ep.expert_bounds(n_experts, world)[rank]
        out = ep.ep_moe_forward(
            x[lo_t : lo_t + tokens[rank]], router_w, w_gate[lo:hi], w_up[lo:hi],
            w_down[lo:hi], **kw,
        )  # fmt: skip
    # Same rows, same weights, same order of the k-sum: equal to the bit.
    assert torch.equal(out, full[lo_t : lo_t + tokens[rank]]), (tokens, n_experts, top_k)


def _worker() -> None:
    torch.set_num_threads(1)
    for case in CASES:
        _case(*case)
    with pytest.raises(ValueError, match="w_gate must hold"):
        ep.ep_moe_forward(torch.ones(2, 8), torch.ones(4, 8), *(torch.ones(4, 8, 8),) * 3, 1)


@pytest.mark.skipif(
    device.GPU_MODE,
    reason="forked workers cannot use a GPU the parent process has initialised, and kernels on CPU "
    "tensors need the interpreter: on GPUs test_torchrun_script_on_gpus checks the same over NCCL",
)
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
    # --check-only: each rank's output against the single-process layer (fp32, uneven tokens, a
    # rank whose experts get no rows); the timing path runs on GPUs (the test below).
    r = D.torchrun(
        "expert_parallel.py", 2, ["--check-only"], backend="gloo", timeout=120, verbose=False
    )
    assert r["world"] == 2 and r["backend"] == "gloo" and r["checks"] >= 2


def test_expert_bounds():
    assert ep.expert_bounds(8, 2) == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="multiple of the world size"):
        ep.expert_bounds(6, 4)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_torchrun_script_on_gpus():
    r = D.torchrun(
        "expert_parallel.py", 2, ["--tokens", 256, "--hidden", 512, "--width", 256, "--experts", 8,
        "--top-k", 2, "--reps", 3], backend="nccl", timeout=300, verbose=False,
    )  # fmt: skip
    assert r["world"] == 2 and r["backend"] == "nccl" and r["checks"] >= 2
    t = r["timing"]
    assert t["layer_ms"] > 0 and t["dispatch_ms"] > 0 and t["a2a_bw_gbps"] > 0
