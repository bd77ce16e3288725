"""Fusion by compiler: an element-wise chain, eager versus ``torch.compile``, and its byte count.

``gelu_chain(x, w, b) = gelu(x * w + b) * sigmoid(x) + x`` with ``x: [rows, d]`` and per-channel
``w, b: [d]``. Eager PyTorch runs it as six kernels, each reading its inputs from HBM and writing a
full-size result back; Inductor fuses it into one kernel that reads ``x`` once and writes ``y`` once.
``CHAIN_OPS`` lists the six ops with the full-size tensors each reads and writes, so the byte counts
(``eager_bytes``, ``fused_bytes``) come from the same table the book shows.

``python -m kernels.bench --only fusion`` times both against the measured copy bandwidth.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kernels import _validate, bench, device, roofline

# (op, full-size tensors read, full-size tensors written). The [d] vectors w and b are negligible.
CHAIN_OPS: list[tuple[str, int, int]] = [
    ("t1 = x * w", 1, 1),
    ("t2 = t1 + b", 1, 1),
    ("t3 = gelu(t2)", 1, 1),
    ("t4 = sigmoid(x)", 1, 1),
    ("t5 = t3 * t4", 2, 1),
    ("y = t5 + x", 2, 1),
]


def _check(x, w, b):
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    _validate.tensor("x", x, dtypes=dtypes, ndim=2)
    _validate.tensor("w", w, dtypes=dtypes, ndim=1)
    _validate.tensor("b", b, dtypes=dtypes, ndim=1)
    _validate.same("w", w, "b", b)
    _validate.same("x", x, "w", w, shape=False)
    if w.shape[0] != x.shape[1]:
        raise ValueError(f"w must have x.shape[1]={x.shape[1]} elements, got {w.shape[0]}")


def gelu_chain(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``gelu(x * w + b) * sigmoid(x) + x``, op by op (six kernels in eager mode)."""
    _check(x, w, b)  # under torch.compile these checks become guards, not run-time work
    return F.gelu(x * w + b) * torch.sigmoid(x) + x


def gelu_chain_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The reference in fp32, rounded once to ``x.dtype``."""
    _check(x, w, b)
    xf, wf, bf = x.float(), w.float(), b.float()
    return (F.gelu(xf * wf + bf) * torch.sigmoid(xf) + xf).to(x.dtype)


@functools.cache
def compiled_gelu_chain():
    """``torch.compile(gelu_chain)``, built once per process (compiles on the first call)."""
    return torch.compile(gelu_chain)


def eager_bytes(numel: int, element_size: int) -> int:
    """HBM bytes of the eager chain: every op reads and writes full-size tensors."""
    return sum(r + w for _, r, w in CHAIN_OPS) * numel * element_size


def fused_bytes(numel: int, element_size: int) -> int:
    """HBM bytes of a fused chain: read x once, write y once."""
    return 2 * numel * element_size


def make_inputs(rows: int, d: int, dtype=torch.bfloat16, dev=None, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    dev = dev or device.DEVICE
    x = torch.randn(rows, d, generator=g).to(dev, dtype)
    w = torch.randn(d, generator=g).to(dev, dtype)
    b = torch.randn(d, generator=g).to(dev, dtype)
    return x, w, b


@bench.register("fusion")
def _bench_fusion(quick: bool) -> list[dict]:
    copy = roofline.copy_bandwidth()
    dtype = device.preferred_dtype(torch.bfloat16)
    shapes = [(2**14, 2**12)] if quick else [(2**14, 2**12), (2**16, 2**12)]
    if not device.GPU_MODE:
        shapes = [(64, 256)]
    fused = compiled_gelu_chain()
    recs = []
    for rows, d in shapes:
        x, w, b = make_inputs(rows, d, dtype)
        ref = gelu_chain_ref(x, w, b)
        torch.testing.assert_close(fused(x, w, b), ref, rtol=2e-2, atol=2e-2)
        n, es = x.numel(), x.element_size()
        # Each variant's GB/s counts the bytes *it* moves, so both can be compared with the copy.
        eager = bench.measure(lambda: gelu_chain(x, w, b), bytes=eager_bytes(n, es))  # noqa: B023
        comp = bench.measure(lambda: fused(x, w, b), bytes=fused_bytes(n, es))  # noqa: B023
        ceil = ("copy", copy.value)
        recs.append(
            bench.record(
                "fusion",
                "compiled",
                [rows, d],
                dtype,
                comp,
                baseline=("eager", eager),
                ceiling=ceil,
            )
        )
        recs.append(bench.record("fusion", "eager", [rows, d], dtype, eager, ceiling=ceil))
    return recs
