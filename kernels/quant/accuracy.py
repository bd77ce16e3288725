"""Accuracy experiments: heavy-tailed weights, fake quantization of weights and activations, and a
small decoder-like MLP stack whose logits show how far each scheme drifts (Act 7's second notebook)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels import numerics
from kernels.quant.formats import dequantize, quantize
from kernels.quant.fp8 import FP8_MAX


def student_t(
    shape: tuple[int, ...], df: float = 4.0, std: float = 0.02, *, seed: int = 0, device=None
) -> torch.Tensor:
    """Heavy-tailed fp32 "weights": Student-t with ``df`` degrees of freedom, rescaled to ``std``.

    Trained weights have heavier tails than a Gaussian; a few large values per row set each
    absmax scale and leave the bulk of the values on a few quantization levels. Smaller ``df`` is
    heavier (``df=inf`` would be Gaussian); ``df`` must exceed 2 for the variance to exist.
    """
    if not df > 2:
        raise ValueError(f"df must be > 2 (finite variance), got {df!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        t = torch.distributions.StudentT(float(df)).sample(shape)
    t = t * (std / math.sqrt(df / (df - 2)))
    return t.to(device or "cpu")


WEIGHT_SCHEMES = ("bf16", "fp8-row", "int8", "int4-g32", "int4-g128", "int4")
ACT_SCHEMES = (None, "fp8-token", "int8-token", "int8-tensor")


def fake_quantize_weight(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """``w: [N, K]`` rounded through ``scheme`` and back to fp32 (see WEIGHT_SCHEMES).

    "int8" and "int4" are per output channel; "int4-gG" has one scale per G values; "fp8-row" is
    e4m3 with one scale per output channel (numerics.fake_quantize with a block of a whole row).
    """
    if scheme == "bf16":
        return w.to(torch.bfloat16).float()
    if scheme == "fp8-row":
        return numerics.fake_quantize(w.float(), "fp8_e4m3", block=w.shape[1])
    if scheme in ("int8", "int4") or scheme.startswith("int4-g"):
        bits = 8 if scheme == "int8" else 4
        group = int(scheme.split("-g")[1]) if "-g" in scheme else None
        return dequantize(quantize(w, bits, group))
    raise ValueError(f"scheme must be one of {WEIGHT_SCHEMES}, got {scheme!r}")


def fake_quantize_act(a: torch.Tensor, scheme: str | None) -> torch.Tensor:
    """Activations ``a: [T, D]`` rounded through ``scheme`` (see ACT_SCHEMES; None: unchanged):
    int8 or fp8 with one dynamic absmax scale per token (row) or for the whole tensor."""
    if scheme is None:
        return a
    if scheme not in ACT_SCHEMES:
        raise ValueError(f"scheme must be one of {ACT_SCHEMES}, got {scheme!r}")
    kind, gran = scheme.split("-")
    amax = a.abs().amax() if gran == "tensor" else a.abs().amax(dim=-1, keepdim=True)
    if kind == "fp8":
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return numerics.round_to(a / s, "fp8_e4m3", saturate=True) * s
    s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    return torch.clamp(torch.round(a / s), -127, 127) * s


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """‖approx − exact‖ / ‖exact‖ in fp64 (Frobenius)."""
    exact = exact.double()
    return ((approx.double() - exact).norm() / exact.norm().clamp_min(1e-300)).item()


@dataclass(frozen=True)
class MLPStack:
    """A decoder-like stack of pre-norm MLP blocks with a residual stream and an output head:
    ``h += W_down @ gelu(W_up @ rms_norm(h))`` per layer, then ``logits = W_head @ rms_norm(h)``.
    Random heavy-tailed weights, no training: a controlled place to watch rounding errors grow."""

    ups: tuple[torch.Tensor, ...]  # [f, d] each
    downs: tuple[torch.Tensor, ...]  # [d, f] each
    head: torch.Tensor  # [vocab, d]


def mlp_stack(
    d: int = 512, f: int = 1536, n_layers: int = 4, vocab: int = 2048, *, df: float = 4.0, seed=0
) -> MLPStack:
    """Build an ``MLPStack`` with Student-t weights scaled like a standard initialisation."""
    ups = tuple(student_t((f, d), df, d**-0.5, seed=seed + 2 * i) for i in range(n_layers))
    downs = tuple(
        student_t((d, f), df, f**-0.5 / math.sqrt(n_layers), seed=seed + 2 * i + 1)
        for i in range(n_layers)
    )
    return MLPStack(ups, downs, student_t((vocab, d), df, d**-0.5, seed=seed + 999))


def activations(
    tokens: int, d: int, *, outlier_channels: int = 4, outlier_scale: float = 30.0, seed: int = 1
) -> torch.Tensor:
    """Residual-stream inputs ``[tokens, d]``: Gaussian, with a few channels ``outlier_scale``
    times larger in every token, the "massive activation" pattern LLM.int8() and SmoothQuant
    describe, which is what makes activation quantization harder than weight quantization."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d, generator=g)
    idx = torch.randperm(d, generator=g)[:outlier_channels]
    x[:, idx] *= outlier_scale
    return x


def _rms_norm(h: torch.Tensor) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def mlp_forward(
    stack: MLPStack, x: torch.Tensor, weights: str = "bf16", acts: str | None = None
) -> torch.Tensor:
    """Logits of ``x: [T, d]`` through ``stack`` in fp32 with the MLP weights rounded through the
    ``weights`` scheme and each matmul's input through the ``acts`` scheme. The head stays fp32
    (as most quantization recipes keep it in high precision)."""
    h = x.float()
    for up, down in zip(stack.ups, stack.downs):
        wu = fake_quantize_weight(up.to(h.device), weights)
        wd = fake_quantize_weight(down.to(h.device), weights)
        a = fake_quantize_act(_rms_norm(h), acts)
        u = torch.nn.functional.gelu(a @ wu.T)
        h = h + fake_quantize_act(u, acts) @ wd.T
    return _rms_norm(h) @ stack.head.to(h.device).T


def divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> dict[str, float]:
    """How far a quantized model's outputs are from the reference's: mean KL(p_ref || p) in nats
    per token (a loss proxy: the extra cross-entropy against the reference's own predictions),
    top-1 agreement, and the logits' relative error."""
    lp_ref = torch.log_softmax(ref_logits.double(), -1)
    lp = torch.log_softmax(logits.double(), -1)
    kl = (lp_ref.exp() * (lp_ref - lp)).sum(-1).mean().item()
    top1 = (ref_logits.argmax(-1) == logits.argmax(-1)).double().mean().item()
    return {"kl": kl, "top1": top1, "rel": relative_error(logits, ref_logits)}
