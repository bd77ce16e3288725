"""Napkin maths in code: FLOPs, bytes, arithmetic intensity, roofline time, inference arithmetic.

Two halves, used by Act 2's notebooks and by ``python -m kernels.bench --only roofline_points``:

- **Op costs.** ``Cost`` holds the FLOPs an op must do and the HBM bytes it must move at the least
  (every input read once, every output written once). Its ratio is the arithmetic intensity, and
  ``max(bytes / bandwidth, flops / peak)`` is the roofline's lower bound on its run time. The
  ``*_case`` builders allocate inputs for one op and return its cost with a function to time.
- **Transformer inference.** ``TransformerConfig`` (a Llama-2-style decoder) gives parameter
  counts, FLOPs per token, KV-cache bytes, the cost of a decode step and of a prefill, the batch at
  which decoding turns compute-bound, and ``decoder_layer`` / ``decoder_layer_cost``: the matmuls of
  one decoder layer with random weights, to check the model against a measurement.

Following Chen's *Transformer Inference Arithmetic* and the JAX scaling book, a matmul of
``[m, k] @ [k, n]`` is ``2mnk`` FLOPs (a multiply and an add per term); an elementwise op counts each
arithmetic operation, a transcendental (exp, erf) included, as one FLOP.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import bench, device, roofline

# ----------------------------------------------------------------------------- dtypes

_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "tf32": 4,  # stored as fp32; only the tensor-core multiply is reduced precision
    "float16": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "int4": 0.5,
}


def dtype_bytes(dtype: torch.dtype | str) -> float:
    """Bytes per element of ``dtype``: a torch dtype or one of 'fp32', 'bf16', 'fp8', 'int4' …"""
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    if not isinstance(dtype, str) or dtype.replace("torch.", "") not in _DTYPE_BYTES:
        raise TypeError(
            f"dtype must be a torch.dtype or one of {sorted(_DTYPE_BYTES)}, got {dtype!r}"
        )
    return _DTYPE_BYTES[dtype.replace("torch.", "")]


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"{name} must be a non-negative number, got {value!r}")


# ----------------------------------------------------------------------------- the roofline


@dataclass(frozen=True)
class Cost:
    """The work of one op: FLOPs done and the fewest HBM bytes it can move."""

    name: str
    flops: float
    bytes: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity in FLOP/byte."""
        return self.flops / self.bytes

    def memory_s(self, bandwidth_gbps: float) -> float:
        return self.bytes / (bandwidth_gbps * 1e9)

    def compute_s(self, peak_tflops: float) -> float:
        return self.flops / (peak_tflops * 1e12)

    def time_s(self, bandwidth_gbps: float, peak_tflops: float) -> float:
        """The roofline lower bound: the op can overlap memory and compute, never beat either."""
        return max(self.memory_s(bandwidth_gbps), self.compute_s(peak_tflops))

    def bound(self, bandwidth_gbps: float, peak_tflops: float) -> str:
        """'compute' or 'memory': which term of ``time_s`` is larger."""
        return (
            "compute" if self.compute_s(peak_tflops) >= self.memory_s(bandwidth_gbps) else "memory"
        )

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            f"{self.name} + {other.name}", self.flops + other.flops, self.bytes + other.bytes
        )


def ridge_point(peak_tflops: float, bandwidth_gbps: float) -> float:
    """FLOP/byte where the roof turns from the bandwidth slope to the flat compute ceiling."""
    _positive("peak_tflops", peak_tflops)
    _positive("bandwidth_gbps", bandwidth_gbps)
    return peak_tflops * 1e12 / (bandwidth_gbps * 1e9)


def attainable_tflops(intensity: float, bandwidth_gbps: float, peak_tflops: float) -> float:
    """The roof at ``intensity``: ``min(bandwidth × intensity, peak)`` in TFLOP/s."""
    _positive("intensity", intensity)
    return min(bandwidth_gbps * 1e9 * intensity / 1e12, peak_tflops)


def regime(
    cost: Cost,
    ms: float,
    *,
    bandwidth_gbps: float,
    peak_tflops: float,
    launch_floor_ms: float,
    slack: float = 2.0,
) -> str:
    """Which of the three regimes a measured op is in: 'overhead', 'memory' or 'compute'.

    Overhead-bound: the roofline says the op needs less time than one launch, and it took no more
    than ``slack`` launches. Otherwise the larger term of the roofline names the bound.
    """
    _positive("ms", ms)
    _positive("launch_floor_ms", launch_floor_ms)
    roof_ms = cost.time_s(bandwidth_gbps, peak_tflops) * 1e3
    if roof_ms < launch_floor_ms and ms <= slack * launch_floor_ms:
        return "overhead"
    return cost.bound(bandwidth_gbps, peak_tflops)


# ----------------------------------------------------------------------------- op costs

# FLOPs per element, counting every arithmetic operation and every transcendental as one.
FLOPS_PER_ELEMENT = {
    "add": 1,  # x + y
    "gelu": 5,  # 0.5 * x * (1 + erf(x / sqrt(2))): divide, erf, add, two multiplies
    "softmax": 5,  # max, subtract, exp, sum, divide
    "sum": 1,  # one add per element
}


def elementwise(
    n: int, dtype: torch.dtype | str, *, n_inputs: int = 1, flops_per_element: float = 1, name=""
) -> Cost:
    """``n`` outputs, each computed from ``n_inputs`` inputs of the same dtype."""
    _positive("n", n)
    _positive("n_inputs", n_inputs)
    _non_negative("flops_per_element", flops_per_element)
    b = dtype_bytes(dtype)
    return Cost(name or "elementwise", flops_per_element * n, (n_inputs + 1) * n * b)


def reduction(rows: int, cols: int, dtype: torch.dtype | str, name: str = "sum") -> Cost:
    """Sum each of ``rows`` rows of ``cols`` elements: read ``rows × cols``, write ``rows``."""
    _positive("rows", rows)
    _positive("cols", cols)
    b = dtype_bytes(dtype)
    return Cost(name, FLOPS_PER_ELEMENT["sum"] * rows * cols, (rows * cols + rows) * b)


def softmax(rows: int, cols: int, dtype: torch.dtype | str, name: str = "softmax") -> Cost:
    """Row softmax of ``[rows, cols]``: each element read once and written once."""
    _positive("rows", rows)
    _positive("cols", cols)
    b = dtype_bytes(dtype)
    return Cost(name, FLOPS_PER_ELEMENT["softmax"] * rows * cols, 2 * rows * cols * b)


def matmul(m: int, n: int, k: int, dtype: torch.dtype | str, name: str = "matmul") -> Cost:
    """``[m, k] @ [k, n]``: 2mnk FLOPs; A and B read once, C written once (intensity → n/3 for
    square n × n × n in 2-byte types)."""
    for arg, v in (("m", m), ("n", n), ("k", k)):
        _positive(arg, v)
    b = dtype_bytes(dtype)
    return Cost(name, 2 * m * n * k, (m * k + k * n + m * n) * b)


def attention(
    batch: int,
    heads: int,
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    dtype: torch.dtype | str,
    *,
    causal: bool = False,
    kv_heads: int | None = None,
    name: str = "attention",
) -> Cost:
    """Fused attention ``softmax(q kᵀ) v``: two matmuls of 2·Nq·Nkv·d FLOPs per head.

    Bytes are q, k, v read and o written once each, the minimum a fused (flash) kernel can move;
    the ``[Nq, Nkv]`` score matrix never reaches HBM. ``causal`` halves the FLOPs (and a kernel
    that skips masked tiles does about half the work); ``kv_heads`` < ``heads`` is GQA.
    """
    for arg, v in (("batch", batch), ("heads", heads), ("seq_q", seq_q), ("seq_kv", seq_kv)):
        _positive(arg, v)
    _positive("head_dim", head_dim)
    kv_heads = heads if kv_heads is None else kv_heads
    _positive("kv_heads", kv_heads)
    b = dtype_bytes(dtype)
    flops = 4 * batch * heads * seq_q * seq_kv * head_dim * (0.5 if causal else 1.0)
    qo = 2 * batch * heads * seq_q * head_dim
    kv = 2 * batch * kv_heads * seq_kv * head_dim
    return Cost(name, flops, (qo + kv) * b)


# ----------------------------------------------------------------------------- runnable cases

Case = tuple[Cost, Callable[[], object]]


def _randn(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, device=device.DEVICE, dtype=dtype)


def elementwise_case(op: str, n: int, dtype: torch.dtype) -> Case:
    """``op`` in ('add', 'gelu') on ``n`` elements, writing into a preallocated output."""
    if op not in ("add", "gelu"):
        raise ValueError(f"op must be 'add' or 'gelu', got {op!r}")
    x = _randn(n, dtype=dtype)
    out = torch.empty_like(x)
    name = f"{op} {str(dtype).replace('torch.', '')}"
    if op == "add":
        y = _randn(n, dtype=dtype)
        cost = elementwise(
            n, dtype, n_inputs=2, flops_per_element=FLOPS_PER_ELEMENT["add"], name=name
        )
        return cost, lambda: torch.add(x, y, out=out)
    cost = elementwise(n, dtype, n_inputs=1, flops_per_element=FLOPS_PER_ELEMENT["gelu"], name=name)
    return cost, lambda: torch.nn.functional.gelu(x)


def reduction_case(rows: int, cols: int, dtype: torch.dtype) -> Case:
    x = _randn(rows, cols, dtype=dtype)
    out = torch.empty(rows, device=device.DEVICE, dtype=dtype)
    name = f"sum {str(dtype).replace('torch.', '')}"
    return reduction(rows, cols, dtype, name=name), lambda: torch.sum(x, dim=-1, out=out)


def softmax_case(rows: int, cols: int, dtype: torch.dtype) -> Case:
    x = _randn(rows, cols, dtype=dtype)
    return softmax(rows, cols, dtype, name=f"softmax w={cols}"), lambda: torch.softmax(x, dim=-1)


def matmul_case(n: int, dtype: torch.dtype, m: int | None = None, k: int | None = None) -> Case:
    """``[m, k] @ [k, n]`` with random data (m and k default to n: a square matmul)."""
    m, k = m or n, k or n
    a = _randn(m, k, dtype=dtype)
    b = _randn(k, n, dtype=dtype)
    label = f"matmul {n}" if m == n == k else f"matmul {m}x{k}x{n}"
    return matmul(m, n, k, dtype, name=label), lambda: a @ b


def attention_case(
    batch: int, heads: int, seq: int, head_dim: int, dtype: torch.dtype, causal: bool = False
) -> Case:
    """torch's fused ``scaled_dot_product_attention`` on ``[batch, heads, seq, head_dim]``."""
    q, k, v = (_randn(batch, heads, seq, head_dim, dtype=dtype) for _ in range(3))
    cost = attention(
        batch, heads, seq, seq, head_dim, dtype, causal=causal, name=f"attention {seq}"
    )
    sdpa = torch.nn.functional.scaled_dot_product_attention
    return cost, lambda: sdpa(q, k, v, is_causal=causal)


def launch_floor() -> bench.Measurement:
    """The cheapest launch there is: an in-place add on one element."""
    one = torch.zeros(1, device=device.DEVICE)
    return bench.measure(lambda: one.add_(1.0))


# ----------------------------------------------------------------------------- transformers


@dataclass(frozen=True)
class TransformerConfig:
    """A Llama-style decoder: RMSNorm, attention with ``n_kv_heads`` ≤ ``n_heads`` (GQA), a gated
    (SwiGLU) MLP of width ``d_ff``, untied input embedding and output head."""

    name: str
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    vocab: int
    gated_mlp: bool = True

    def __post_init__(self):
        for f in ("d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "vocab"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{f} must be a positive int, got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def d_kv(self) -> int:
        """Width of the K (and of the V) projection: n_kv_heads × head_dim."""
        return self.n_kv_heads * self.head_dim

    def layer_weight_shapes(self) -> dict[str, tuple[int, int]]:
        """``(out_features, in_features)`` of each matmul weight in one decoder layer."""
        d, f = self.d_model, self.d_ff
        shapes = {"q": (d, d), "k": (self.d_kv, d), "v": (self.d_kv, d), "o": (d, d)}
        if self.gated_mlp:
            shapes |= {"gate": (f, d), "up": (f, d), "down": (d, f)}
        else:
            shapes |= {"up": (f, d), "down": (d, f)}
        return shapes

    @property
    def layer_matmul_params(self) -> int:
        return sum(o * i for o, i in self.layer_weight_shapes().values())

    def param_breakdown(self) -> dict[str, int]:
        """Parameters by role. Norm weights: two per layer and a final one (RMSNorm has no bias)."""
        shapes = self.layer_weight_shapes()
        attn = sum(o * i for n, (o, i) in shapes.items() if n in ("q", "k", "v", "o"))
        return {
            "embedding": self.vocab * self.d_model,
            "attention": self.n_layers * attn,
            "mlp": self.n_layers * (self.layer_matmul_params - attn),
            "norms": (2 * self.n_layers + 1) * self.d_model,
            "lm_head": self.vocab * self.d_model,
        }

    @property
    def params(self) -> int:
        return sum(self.param_breakdown().values())

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matmul for every token: all but the embedding table (a
        row lookup) and the norms (elementwise)."""
        p = self.param_breakdown()
        return p["attention"] + p["mlp"] + p["lm_head"]


LLAMA2_7B = TransformerConfig(
    "Llama-2-7B", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008, vocab=32000
)
LLAMA2_70B = TransformerConfig(
    "Llama-2-70B", d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672, vocab=32000
)


def flops_per_token(cfg: TransformerConfig, context: int) -> float:
    """Forward FLOPs for one token that attends to ``context`` earlier positions.

    ``2 × matmul_params`` for the weight matmuls, plus attention: per layer, ``q·kᵀ`` and
    ``scores·v`` each cost 2 × context × (n_heads × head_dim) FLOPs.
    """
    _non_negative("context", context)
    return 2 * cfg.matmul_params + 4 * cfg.n_layers * context * cfg.n_heads * cfg.head_dim


def kv_bytes_per_token(cfg: TransformerConfig, kv_dtype: torch.dtype | str = "bf16") -> float:
    """K and V for one token in every layer: 2 × n_layers × n_kv_heads × head_dim × bytes."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * dtype_bytes(kv_dtype)


def kv_cache_bytes(
    cfg: TransformerConfig, batch: int, context: int, kv_dtype: torch.dtype | str = "bf16"
) -> float:
    _positive("batch", batch)
    _non_negative("context", context)
    return batch * context * kv_bytes_per_token(cfg, kv_dtype)


def weight_bytes(cfg: TransformerConfig, weight_dtype: torch.dtype | str = "bf16") -> float:
    """Memory the weights occupy (all parameters)."""
    return cfg.params * dtype_bytes(weight_dtype)


def decode_step(
    cfg: TransformerConfig,
    batch: int,
    context: int,
    weight_dtype: torch.dtype | str = "bf16",
    kv_dtype: torch.dtype | str = "bf16",
) -> Cost:
    """One decode step: ``batch`` sequences each produce one token after ``context`` earlier ones.

    Bytes: every matmul weight is read once per step (shared by the whole batch), each sequence
    reads its own KV cache of ``context`` tokens and writes one token's K and V. Activations are
    a few vectors per sequence and are left out.
    """
    _positive("batch", batch)
    _non_negative("context", context)
    flops = batch * flops_per_token(cfg, context)
    kv = kv_bytes_per_token(cfg, kv_dtype)
    nbytes = cfg.matmul_params * dtype_bytes(weight_dtype) + batch * (context + 1) * kv
    return Cost(f"{cfg.name} decode b={batch} ctx={context}", flops, nbytes)


def prefill(
    cfg: TransformerConfig,
    batch: int,
    prompt: int,
    weight_dtype: torch.dtype | str = "bf16",
    kv_dtype: torch.dtype | str = "bf16",
) -> Cost:
    """Process ``batch`` prompts of ``prompt`` tokens in one forward pass (causal attention: token
    t attends to t earlier positions). Bytes: the weights once and the new KV cache written."""
    _positive("batch", batch)
    _positive("prompt", prompt)
    attn = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * prompt * (prompt - 1) / 2
    flops = batch * (2 * cfg.matmul_params * prompt + attn)
    nbytes = cfg.matmul_params * dtype_bytes(weight_dtype) + batch * prompt * kv_bytes_per_token(
        cfg, kv_dtype
    )
    return Cost(f"{cfg.name} prefill b={batch} p={prompt}", flops, nbytes)


def decode_tokens_per_s(
    cfg: TransformerConfig,
    batch: int,
    context: int,
    *,
    bandwidth_gbps: float,
    peak_tflops: float,
    weight_dtype: torch.dtype | str = "bf16",
    kv_dtype: torch.dtype | str = "bf16",
) -> float:
    """Upper bound on generated tokens per second (all sequences together) at this batch."""
    step = decode_step(cfg, batch, context, weight_dtype, kv_dtype)
    return batch / step.time_s(bandwidth_gbps, peak_tflops)


def critical_batch(
    cfg: TransformerConfig,
    context: int,
    *,
    bandwidth_gbps: float,
    peak_tflops: float,
    weight_dtype: torch.dtype | str = "bf16",
    kv_dtype: torch.dtype | str = "bf16",
) -> float | None:
    """The batch at which a decode step turns compute-bound, or None if it never does.

    A step costs ``B·F`` FLOPs and ``W + B·K`` bytes (F FLOPs per token, W weight bytes, K KV bytes
    per sequence). It is compute-bound once ``B·F/P ≥ (W + B·K)/BW``, i.e. for
    ``B ≥ (W/BW) / (F/P − K/BW)``. With no KV cache this is ``ridge × bytes_per_weight / 2``: the
    ridge point itself for bf16 weights. KV reads grow with the batch and have an intensity of
    about one FLOP per byte (MHA), so at long contexts the denominator turns negative: decoding
    stays memory-bound at any batch.
    """
    _non_negative("context", context)
    _positive("bandwidth_gbps", bandwidth_gbps)
    _positive("peak_tflops", peak_tflops)
    one = decode_step(cfg, 1, context, weight_dtype, kv_dtype)
    kv = (context + 1) * kv_bytes_per_token(cfg, kv_dtype)
    w = one.bytes - kv
    bw, peak = bandwidth_gbps * 1e9, peak_tflops * 1e12
    margin = one.flops / peak - kv / bw
    return (w / bw) / margin if margin > 0 else None


def max_batch(
    cfg: TransformerConfig,
    memory_bytes: float,
    context: int,
    weight_dtype: torch.dtype | str = "bf16",
    kv_dtype: torch.dtype | str = "bf16",
) -> int:
    """Most sequences of ``context`` tokens whose KV cache fits beside the weights (0: none)."""
    _positive("memory_bytes", memory_bytes)
    _positive("context", context)
    free = memory_bytes - weight_bytes(cfg, weight_dtype)
    return max(0, math.floor(free / (context * kv_bytes_per_token(cfg, kv_dtype))))


# ----------------------------------------------------------------------------- one decoder layer


def make_layer_weights(
    cfg: TransformerConfig, dtype: torch.dtype = torch.bfloat16, seed: int = 0
) -> dict[str, torch.Tensor]:
    """Random weights shaped like one decoder layer's matmuls (``nn.Linear`` layout: out × in),
    scaled by 1/sqrt(in) so activations stay O(1). Built in code: nothing is downloaded."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for name, (o, i) in cfg.layer_weight_shapes().items():
        w = torch.randn(o, i, generator=g, dtype=torch.float32) / math.sqrt(i)
        out[name] = w.to(device=device.DEVICE, dtype=dtype)
    return out


def decoder_layer(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weight matmuls of one decoder layer on ``x: [batch, d_model]``, in order.

    Attention itself (the part that reads the KV cache) is left out: the ``o`` projection is applied
    to ``q`` in its place, so every weight is read exactly as in a real decode step. The MLP is
    SwiGLU when the weights have a ``gate``.
    """
    lin = torch.nn.functional.linear
    q = lin(x, weights["q"])
    lin(x, weights["k"])  # k and v would be appended to the KV cache
    lin(x, weights["v"])
    h = x + lin(q, weights["o"])
    if "gate" in weights:
        a = torch.nn.functional.silu(lin(h, weights["gate"])) * lin(h, weights["up"])
    else:
        a = torch.nn.functional.gelu(lin(h, weights["up"]))
    return h + lin(a, weights["down"])


def decoder_layer_cost(
    cfg: TransformerConfig, batch: int, dtype: torch.dtype | str = "bf16"
) -> Cost:
    """FLOPs and bytes of ``decoder_layer`` at ``batch``: each matmul reads its weight and input and
    writes its output; the residual adds and the MLP's activation are elementwise passes."""
    _positive("batch", batch)
    total = Cost("", 0, 0)
    for o, i in cfg.layer_weight_shapes().values():
        total = total + matmul(batch, o, i, dtype)
    d, f = cfg.d_model, cfg.d_ff
    total = total + elementwise(2 * batch * d, dtype, n_inputs=2)  # two residual adds
    if cfg.gated_mlp:  # silu(g) then silu(g) * u
        total = total + elementwise(batch * f, dtype, flops_per_element=4)
        total = total + elementwise(batch * f, dtype, n_inputs=2)
    else:
        total = total + elementwise(batch * f, dtype, flops_per_element=FLOPS_PER_ELEMENT["gelu"])
    return Cost(f"{cfg.name} layer b={batch}", total.flops, total.bytes)


# ----------------------------------------------------------------------------- benchmark


@bench.register("roofline_points")
def _bench_roofline_points(quick: bool) -> list[dict]:
    """A few points of Act 2's roofline, each against the ceiling of its side of the ridge.

    Points left of the measured bf16 ridge are reported in GB/s against the copy bandwidth, right
    of it in TFLOP/s against the bf16 matmul peak. Baselines, timed in the same run: a plain copy
    of the same number of bytes for matmul and softmax, SDPA's unfused math backend for attention.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dtype = device.preferred_dtype(torch.bfloat16)
    copy = roofline.copy_bandwidth()
    peak = roofline.matmul_peak("bfloat16" if dtype is torch.bfloat16 else "float16")
    ridge = ridge_point(peak.value, copy.value)

    mm_sizes = device.pick([256, 1024, 4096, 8192], [64, 128])
    sm_widths = device.pick([1024, 8192], [256])
    seqs = device.pick([1024, 4096], [128])
    if quick:
        mm_sizes, sm_widths, seqs = mm_sizes[-1:], sm_widths[:1], seqs[:1]
    elements = device.pick(2**26, 2**14)
    batch, heads, head_dim = device.pick((4, 16, 128), (1, 2, 64))

    def same_bytes_copy(cost: Cost) -> Callable[[], object]:
        src = torch.empty(int(cost.bytes // 2), device=device.DEVICE, dtype=torch.uint8)
        dst = torch.empty_like(src)
        return lambda: dst.copy_(src)  # reads and writes cost.bytes / 2 each

    def math_attention(seq: int) -> Callable[[], object]:
        q, k, v = (_randn(batch, heads, seq, head_dim, dtype=dtype) for _ in range(3))

        def run():
            with sdpa_kernel(SDPBackend.MATH):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)

        return run

    # (bench name, shape recorded, (cost, fn), baseline name, baseline fn)
    points = []
    for n in mm_sizes:
        case = matmul_case(n, dtype)
        points.append(("roofline_matmul", [n, n, n], case, "copy", same_bytes_copy(case[0])))
    for w in sm_widths:
        case = softmax_case(elements // w, w, dtype)
        points.append(
            ("roofline_softmax", [elements // w, w], case, "copy", same_bytes_copy(case[0]))
        )
    for s in seqs:
        case = attention_case(batch, heads, s, head_dim, dtype)
        points.append(
            (
                "roofline_attention",
                [batch, heads, s, head_dim],
                case,
                "sdpa_math",
                math_attention(s),
            )
        )

    recs = []
    for name, shape, (cost, fn), base_name, base_fn in points:
        # The unit follows the side of the ridge: GB/s for memory-bound, TFLOP/s for compute-bound.
        unit = {"bytes": cost.bytes} if cost.intensity < ridge else {"flops": cost.flops}
        ceiling = ("copy", copy.value) if "bytes" in unit else (peak.name, peak.value)
        m = bench.measure(fn, **unit)
        base = bench.measure(base_fn, **unit)
        recs.append(
            bench.record(
                name, "torch", shape, dtype, m, baseline=(base_name, base), ceiling=ceiling
            )
        )
    return recs
