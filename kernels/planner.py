"""A parallelism planner on paper: per-GPU memory and step time for DP/ZeRO, TP(+SP), PP, CP and EP.

``plan(model, cluster, parallel, global_batch_tokens)`` answers "how much memory does each GPU need,
and how long does a training step take" for one configuration; ``search`` enumerates every valid
configuration for a GPU count and ranks them by step time; ``validate`` rebuilds the measured Act 5
DDP/FSDP runs (``results/nvidia-h200.jsonl``) and compares, and ``validate_lab5d`` does the same
for Lab 5d's recomputation steps, ring attention and sequence parallelism.

Reused, not re-derived: parameter counts and forward FLOPs per token come from
``kernels.perfmodel`` (``TransformerConfig``, ``flops_per_token``), the pipeline bubble and the
micro-batches a pipeline stage holds from ``kernels.distributed`` (``bubble_fraction``,
``peak_in_flight``), GPU peaks and memory from ``kernels.hardware`` (``hardware.yaml``).

Assumptions (each also where it is used):

- **Memory.** Mixed-precision Adam keeps ``weight + grad + optimizer`` bytes per parameter
  (``Precision``); ZeRO-1 shards the optimizer states over the data-parallel group, ZeRO-2 also the
  gradients, ZeRO-3 (FSDP) also the weights {cite}`rajbhandari2020zero`. The sharding group is
  ``dp · cp`` (context-parallel ranks hold the same weights). TP and PP divide every parameter
  evenly (embedding and head included; real first/last stages are a little heavier).
- **Activations** follow Korthikanti et al.'s closed form {cite}`korthikanti2022activation` for
  2-byte activations of a GPT layer (MLP ``4h``, dropout): per layer ``sbh(34 + 5as/h)`` bytes
  without recomputation, ``34 sbh`` with selective recomputation (the attention scores are
  recomputed, which FlashAttention does anyway), ``2 sbh`` (the layer input) with full
  recomputation; tensor parallelism divides the ``24 sbh`` of the matmul inputs and the scores by
  ``t``, sequence parallelism the remaining ``10 sbh`` too. For Llama-style layers (SwiGLU, GQA, no
  dropout) the same count is an approximation; ``Model(activations="decoder")`` uses instead the
  count measured on the course's decoder (``decoder_activation_bytes_per_layer``). The last stage also holds the logits
  (``b · s · v / t`` elements in bf16 plus an fp32 copy for the loss).
- **Compute** time is training FLOPs (3 × forward; 4 × with full recomputation; selective adds the
  attention-core forward) over ``peak × mfu``, split evenly over all GPUs; causal attention costs
  half the full ``s × s`` (the kernel skips masked blocks).
- **Optimizer** step is memory-bound: ``Precision.update`` bytes per local parameter at the HBM
  bandwidth of ``hardware.yaml``.
- **Communication** uses the ring alpha-beta model: an all-reduce over ``n`` ranks costs
  ``2(n-1)`` latencies plus ``2(n-1)/n · bytes`` over the per-GPU bus bandwidth; all-gather,
  reduce-scatter and all-to-all half that. Ranks are placed TP innermost, then CP, DP, PP
  (Megatron-LM's order); a group that fits in one node uses the intra-node bandwidth, otherwise
  the inter-node one. TP/SP collectives and PP sends sit on the critical path (exposed); DP/ZeRO
  and CP traffic is hidden behind compute by the fraction ``overlap`` (default 0: nothing hidden,
  the setting the validation uses). ZeRO-3 gathers the weights in forward and again in backward
  and reduce-scatters the gradients for every micro-batch (PyTorch FSDP's default).
- **Pipeline** bubble: ``(p - 1)/(m + p - 1)`` of a stage's time for GPipe and 1F1B, divided by the
  number of virtual stages ``v`` for the interleaved schedule {cite}`narayanan2021megatron`.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import hardware
from kernels.distributed import bubble_fraction, gpt_params, peak_in_flight
from kernels.perfmodel import TransformerConfig, flops_per_token

RECOMPUTE = ("none", "selective", "full")
ACTIVATION_FORMS = ("paper", "decoder")  # Model.activations: which closed form counts a layer
SCHEDULES = ("gpipe", "1f1b", "interleaved")
MEMORY_HEADROOM = 0.9  # a plan fits if it needs at most 90% of the GPU's memory (allocator slack)


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def _positive(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
        raise ValueError(f"{name} must be a positive number, got {v!r}")
    return v


# ----------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter: ``weight`` (the copy forward/backward use), ``grad``, ``optimizer``
    (fp32 master copy if separate, Adam's m and v) and ``update`` (what the optimizer step reads and
    writes per parameter)."""

    name: str
    weight: float
    grad: float
    optimizer: float
    update: float


# bf16 weights and gradients, fp32 master weights and Adam moments: 2 + 2 + 12 = 16 bytes per
# parameter (the ZeRO paper's K = 12). The step reads master, m, v and the gradient, writes
# master, m, v and the bf16 weights: 12 + 2 + 12 + 2 = 28 bytes.
BF16_ADAM = Precision("bf16 weights, fp32 master + Adam", 2, 2, 12, 28)
# Act 5's runs: fp32 weights and gradients, bf16 autocast, AdamW (m, v in fp32): 4 + 4 + 8 bytes;
# the step reads p, g, m, v and writes p, m, v: 28 bytes.
FP32_AUTOCAST_ADAM = Precision("fp32 weights + bf16 autocast, AdamW", 4, 4, 8, 28)


@dataclass(frozen=True)
class Model:
    """A decoder-only transformer to train: ``layers`` × (attention with ``heads`` query and
    ``kv_heads`` key/value heads, an MLP of width ``ffn``), vocabulary ``vocab``, sequences of
    ``seq`` tokens. ``experts > 0`` makes every MLP a mixture of ``experts`` experts with ``top_k``
    active per token. ``params`` overrides the parameter count (for models with biases or learned
    positions that ``TransformerConfig`` does not count); dense models only. ``activations``:
    count a layer's activations with Korthikanti et al.'s GPT form (``"paper"``) or with the form
    measured on the course's Llama-style decoder (``"decoder"``, ``decoder_activation_bytes_per_layer``
    with a fused RMSNorm)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    experts: int = 0
    top_k: int = 0
    gated_mlp: bool = True
    params: int | None = None
    activations: str = "paper"

    def __post_init__(self):
        if self.activations not in ACTIVATION_FORMS:
            raise ValueError(
                f"model.activations must be one of {ACTIVATION_FORMS}, got {self.activations!r}"
            )
        for name in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"):
            _positive_int(f"model.{name}", getattr(self, name))
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"model.heads ({self.heads}) must divide hidden ({self.hidden}) and be a multiple "
                f"of kv_heads ({self.kv_heads})"
            )
        if self.experts:
            _positive_int("model.experts", self.experts)
            if not (isinstance(self.top_k, int) and 1 <= self.top_k <= self.experts):
                raise ValueError(f"model.top_k must be in [1, experts], got {self.top_k!r}")
            if self.params is not None:
                raise ValueError("model.params overrides dense models only")
        elif self.top_k:
            raise ValueError(f"model.top_k needs model.experts > 0, got top_k={self.top_k}")
        if self.params is not None:
            _positive_int("model.params", self.params)

    @classmethod
    def from_config(cls, cfg: TransformerConfig, seq: int) -> Model:
        """The dense model of a ``perfmodel.TransformerConfig`` (the course's decoder shapes),
        trained on sequences of ``seq`` tokens."""
        return cls(
            cfg.name,
            cfg.n_layers,
            cfg.d_model,
            cfg.n_heads,
            cfg.n_kv_heads,
            cfg.d_ff,
            cfg.vocab,
            seq,
            gated_mlp=cfg.gated_mlp,
        )

    @property
    def config(self) -> TransformerConfig:
        return TransformerConfig(
            self.name,
            d_model=self.hidden,
            n_layers=self.layers,
            n_heads=self.heads,
            n_kv_heads=self.kv_heads,
            d_ff=self.ffn,
            vocab=self.vocab,
            gated_mlp=self.gated_mlp,
        )

    def param_split(self) -> dict[str, int]:
        """``dense`` (every GPU of a TP·PP shard holds them) and ``expert`` (split by EP) counts.
        A mixture of experts has ``experts`` copies of the MLP and a router (``hidden × experts``
        per layer)."""
        b = self.config.param_breakdown()
        if not self.experts:
            return {"dense": self.params or sum(b.values()), "expert": 0}
        router = self.layers * self.hidden * self.experts
        return {"dense": sum(b.values()) - b["mlp"] + router, "expert": b["mlp"] * self.experts}

    @property
    def total_params(self) -> int:
        return sum(self.param_split().values())

    def forward_flops_per_token(self) -> float:
        """Forward FLOPs per token (``perfmodel.flops_per_token`` at context ``seq/2``: causal
        attention over the mean context), plus the ``top_k - 1`` extra experts a token visits."""
        f = flops_per_token(self.config, self.seq / 2)
        if self.experts:
            f += 2 * (self.top_k - 1) * self.config.param_breakdown()["mlp"]
        return f

    def train_flops_per_token(self, recompute: str = "none") -> float:
        """Forward + backward (2 × forward) + what ``recompute`` runs again."""
        _check_recompute(recompute)
        fwd = self.forward_flops_per_token()
        if recompute == "full":
            return 4 * fwd
        extra = 0.0
        if recompute == "selective":  # q·kᵀ and scores·v again, over the mean causal context
            extra = 4 * self.layers * (self.seq / 2) * self.hidden
        return 3 * fwd + extra


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")


# Dense model shapes of the Llama 3 family's 8B, 70B and 405B models (layers, width, heads, 8 KV
# heads, SwiGLU width, 128K vocabulary), trained with 8K-token sequences {cite}`grattafiori2024llama3`.
MODEL_8B = Model("8B-class", 32, 4096, 32, 8, 14336, 128256, 8192)
MODEL_70B = Model("70B-class", 80, 8192, 64, 8, 28672, 128256, 8192)
MODEL_405B = Model("405B-class", 126, 16384, 128, 8, 53248, 128256, 8192)
PRESETS = {m.name: m for m in (MODEL_8B, MODEL_70B, MODEL_405B)}


@dataclass(frozen=True)
class Cluster:
    """``n_gpus`` GPUs of type ``gpu`` (a hardware.yaml key), ``gpus_per_node`` to a node.

    ``intra_gbps`` / ``inter_gbps``: the bus bandwidth (GB/s per GPU) a ring collective reaches
    inside a node and across nodes; ``latency_us``: the alpha of one ring step. Defaults:
    ``intra_gbps = 340`` is the NCCL all-reduce bus bandwidth measured on 4 H200s in Act 5 (NVLink 4,
    the H100 SXM's link too); ``inter_gbps = 50`` assumes one 400 Gb/s NIC per GPU;
    ``latency_us = 5`` is an assumption. ``dtype`` names the peak used for compute."""

    gpu: str
    n_gpus: int
    gpus_per_node: int = 8
    intra_gbps: float = 340.0
    inter_gbps: float = 50.0
    latency_us: float = 5.0
    dtype: str = "bfloat16"

    def __post_init__(self):
        specs = hardware.load()
        if self.gpu not in specs:
            raise ValueError(
                f"cluster.gpu must be a hardware.yaml key {sorted(specs)}, got {self.gpu!r}"
            )
        _positive_int("cluster.n_gpus", self.n_gpus)
        _positive_int("cluster.gpus_per_node", self.gpus_per_node)
        for name in ("intra_gbps", "inter_gbps"):
            _positive(f"cluster.{name}", getattr(self, name))
        if isinstance(self.latency_us, bool) or not self.latency_us >= 0:
            raise ValueError(f"cluster.latency_us must be >= 0, got {self.latency_us!r}")
        for fig in (f"tflops_{self.dtype}", "memory_gb", "mem_bw_gbps"):
            if self.spec.get(fig) is None:
                raise ValueError(f"cluster.gpu {self.gpu!r} has no {fig} in hardware.yaml")

    @property
    def spec(self) -> hardware.GPUSpec:
        return hardware.load()[self.gpu]

    @property
    def peak_flops(self) -> float:
        return self.spec.get(f"tflops_{self.dtype}") * 1e12

    @property
    def memory_bytes(self) -> float:
        return self.spec.get("memory_gb") * 1e9

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.spec.get("mem_bw_gbps") * 1e9


@dataclass(frozen=True)
class Parallel:
    """How the GPUs are split: ``dp · tp · pp · cp`` must equal the GPU count.

    ``zero``: 0 (plain DP), 1, 2 or 3 (= FSDP). ``sp``: sequence parallelism on the TP group.
    ``schedule``: 'gpipe', '1f1b' or 'interleaved' (with ``virtual_stages`` model chunks per GPU).
    ``micro_batch``: sequences per micro-batch. ``ep``: expert parallelism, carved out of the
    ``dp · cp`` ranks (it must divide them), so it adds no factor to the GPU count."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"
    micro_batch: int = 1
    virtual_stages: int = 1

    def __post_init__(self):
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batch", "virtual_stages"):
            _positive_int(f"parallel.{name}", getattr(self, name))
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise ValueError(f"parallel.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"parallel.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            raise ValueError("parallel.virtual_stages > 1 needs schedule='interleaved'")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"parallel.ep ({self.ep}) must divide dp·cp ({self.dp * self.cp})")

    @property
    def n_gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def label(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}" + ("+sp" if self.sp else ""), f"pp{self.pp}"]
        parts += [f"cp{self.cp}"] + ([f"ep{self.ep}"] if self.ep > 1 else [])
        z = "fsdp" if self.zero == 3 else f"zero{self.zero}"
        sched = f" {self.schedule}" + (f"×{self.virtual_stages}" if self.virtual_stages > 1 else "")
        return " ".join(parts) + f" {z} mb{self.micro_batch}" + (sched if self.pp > 1 else "")


def check(model: Model, cluster: Cluster, parallel: Parallel, global_batch_tokens: int) -> int:
    """Raise ValueError (naming the argument) if the configuration cannot run; return the number
    of micro-batches per data-parallel rank per step."""
    p = parallel
    if p.n_gpus != cluster.n_gpus:
        raise ValueError(
            f"parallel: dp·tp·pp·cp = {p.n_gpus} must equal cluster.n_gpus = {cluster.n_gpus}"
        )
    if p.tp > cluster.gpus_per_node:
        raise ValueError(f"parallel.tp ({p.tp}) must fit in a node ({cluster.gpus_per_node} GPUs)")
    if model.heads % p.tp or model.ffn % p.tp:
        raise ValueError(
            f"parallel.tp ({p.tp}) must divide model.heads ({model.heads}) and ffn ({model.ffn})"
        )
    if model.layers % (p.pp * p.virtual_stages):
        raise ValueError(
            f"parallel.pp·virtual_stages ({p.pp * p.virtual_stages}) must divide "
            f"model.layers ({model.layers})"
        )
    if model.seq % (2 * p.cp) and p.cp > 1:  # the zig-zag split cuts each sequence in 2·cp pieces
        raise ValueError(f"parallel.cp: 2·cp ({2 * p.cp}) must divide model.seq ({model.seq})")
    if p.ep > 1 and (not model.experts or model.experts % p.ep):
        raise ValueError(f"parallel.ep ({p.ep}) must divide model.experts ({model.experts})")
    _positive_int("global_batch_tokens", global_batch_tokens)
    if global_batch_tokens % model.seq:
        raise ValueError(
            f"global_batch_tokens ({global_batch_tokens}) must be a multiple of model.seq ({model.seq})"
        )
    seqs = global_batch_tokens // model.seq
    if seqs % (p.dp * p.micro_batch):
        raise ValueError(
            f"global_batch_tokens: {seqs} sequences do not split into dp ({p.dp}) × "
            f"micro_batch ({p.micro_batch})"
        )
    m = seqs // (p.dp * p.micro_batch)
    if p.schedule == "interleaved" and p.pp > 1 and m % p.pp:
        raise ValueError(
            f"parallel: interleaved needs micro-batches ({m}) divisible by pp ({p.pp})"
        )
    return m


# ----------------------------------------------------------------------------- memory


def activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    s_kv: int | None = None,
) -> float:
    """Korthikanti et al.'s activation bytes of one layer for a micro-batch of ``b`` sequences of
    ``s`` tokens, width ``h``, ``a`` heads, tensor-parallel degree ``t`` (with or without sequence
    parallelism), per GPU:

    - none: ``sbh(10 + 24/t + 5as/(ht))``, with SP ``sbh(34 + 5as/h)/t``;
    - selective: ``sbh(10 + 24/t)``, with SP ``34 sbh/t``;
    - full: ``2 sbh`` (the layer input), with SP ``2 sbh/t``.

    ``s_kv`` (default ``s``): the keys each query sees; with context parallelism a rank holds
    ``s/cp`` queries against all ``s`` keys, so its score term is ``5 a (s/cp) s b / t``.
    """
    _check_recompute(recompute)
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    unsharded = 10 * sbh / (t if sp else 1)  # norms, dropout masks, residuals
    sharded = 24 * sbh / t  # inputs of the sharded matmuls, attention internals
    scores = 5 * a * s * (s if s_kv is None else s_kv) * b / t if recompute == "none" else 0.0
    return unsharded + sharded + scores


def decoder_activation_terms(
    s: int,
    b: int,
    h: int,
    a: int,
    kv_heads: int,
    ffn: int,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    *,
    bytes_per_element: int = 2,
    norm: str = "fused",
) -> dict[str, float]:
    """``decoder_activation_bytes_per_layer`` term by term, per GPU: ``{"norms", "attention",
    "log-sum-exp", "MLP"}`` (the log-sum-exp is 0 under selective recomputation), or
    ``{"layer input"}`` under full recomputation. Their sum is the layer's bytes."""
    _check_recompute(recompute)
    if norm not in ("fused", "composite"):
        raise ValueError(f"norm must be 'fused' or 'composite', got {norm!r}")
    e, sb = bytes_per_element, s * b
    if recompute == "full":
        return {"layer input": e * sb * h / (t if sp else 1)}
    d = h // a
    one_norm = (2 * e if norm == "fused" else 8 + e) * sb * h + 4 * sb
    # rotated q and k; the QKV output (v views it); the attention output
    attention = e * sb * d * (a + kv_heads) + e * sb * d * (a + 2 * kv_heads) + e * sb * h
    return {
        "norms": 2 * one_norm / (t if sp else 1),
        "attention": attention / t,
        "log-sum-exp": (4 * sb * a if recompute == "none" else 0) / t,
        "MLP": 4 * e * sb * ffn / t,
    }


def decoder_activation_bytes_per_layer(
    s: int,
    b: int,
    h: int,
    a: int,
    kv_heads: int,
    ffn: int,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    *,
    bytes_per_element: int = 2,
    norm: str = "fused",
) -> float:
    """The same count for a Llama-style layer as the course's decoder computes it (RMSNorm, GQA
    with ``kv_heads``, SwiGLU of width ``ffn``, no dropout, FlashAttention-style attention that keeps
    no score matrix), op by op; ``kernels.activation_memory`` measures it exactly on the CPU. With
    ``e = bytes_per_element`` and ``d = h/a``:

    - two RMSNorms, each ``2e·sbh + 4 sb`` fused (input, output, fp32 rstd) or, PyTorch's
      composite ``F.rms_norm`` (``norm="composite"``), ``(8 + e)·sbh + 4 sb`` (fp32 copies);
    - attention ``e·sb·d(a + g) + e·sb·d(a + 2g) + e·sbh`` (rotated q and k, the QKV output that v
      views, the output) plus the fp32 log-sum-exp ``4 sba``, which selective recomputation drops;
    - MLP ``4e·sbf`` (gate/up output, SiLU output, product).

    Tensor parallelism divides attention and MLP by ``t`` (heads and ``ffn`` split; assumes ``t``
    divides ``kv_heads``); the norms only with sequence parallelism. Full recomputation keeps the
    layer input, ``e·sbh`` (``/t`` with SP). ``decoder_activation_terms`` gives the terms."""
    terms = decoder_activation_terms(
        s, b, h, a, kv_heads, ffn, t, sp, recompute, bytes_per_element=bytes_per_element, norm=norm
    )
    return sum(terms.values())


def memory(
    model: Model,
    parallel: Parallel,
    micro_batches: int,
    precision: Precision = BF16_ADAM,
    recompute: str = "selective",
) -> dict[str, float]:
    """Per-GPU bytes: weights, grads, optimizer, activations (on the busiest pipeline stage) and
    their total, plus the activations under every recomputation policy."""
    p = parallel
    split = model.param_split()
    shard = p.dp * p.cp  # ZeRO shards over the ranks holding the same weights
    dense = split["dense"] / (p.tp * p.pp)
    expert = split["expert"] / (p.tp * p.pp * p.ep)

    def per_gpu(stage: int) -> float:  # ZeRO stage >= `stage` shards this state
        return dense / (shard if p.zero >= stage else 1) + expert / (
            shard // p.ep if p.zero >= stage else 1
        )

    out = {
        "weights": per_gpu(3) * precision.weight,
        "grads": per_gpu(2) * precision.grad,
        "optimizer": per_gpu(1) * precision.optimizer,
    }
    acts = {r: _activations(model, p, micro_batches, r) for r in RECOMPUTE}
    out["activations"] = acts[recompute]
    out["total"] = sum(out.values())
    out |= {f"activations_{r}": v for r, v in acts.items()}
    return out


def _activations(model: Model, p: Parallel, m: int, recompute: str) -> float:
    s = model.seq // p.cp
    if model.activations == "decoder":  # a token visits top_k experts' MLPs
        ffn = model.ffn * max(1, model.top_k)
        per_layer = decoder_activation_bytes_per_layer(
            s, p.micro_batch, model.hidden, model.heads, model.kv_heads, ffn, p.tp, p.sp, recompute
        )
    else:
        per_layer = activation_bytes_per_layer(
            s, p.micro_batch, model.hidden, model.heads, p.tp, p.sp, recompute, s_kv=model.seq
        )
    layers = model.layers // p.pp
    logits = p.micro_batch * s * model.vocab / p.tp * (2 + 4)  # bf16 logits + fp32 copy
    if p.pp == 1:
        return per_layer * layers * 1 + logits
    sched = "gpipe" if p.schedule == "gpipe" else "1f1b"
    first = peak_in_flight(sched, p.pp, m, 0)
    last = peak_in_flight(sched, p.pp, m, p.pp - 1)
    if p.schedule == "interleaved":  # Korthikanti et al.: the first stage holds (1 + (p-1)/(pv))×
        first_layers = layers * first * (1 + (p.pp - 1) / (p.pp * p.virtual_stages))
    else:
        first_layers = layers * first
    return max(per_layer * first_layers, per_layer * layers * last + logits)


# ----------------------------------------------------------------------------- time


def collective_s(kind: str, nbytes: float, n: int, gbps: float, latency_us: float = 0.0) -> float:
    """Ring alpha-beta time of one collective over ``n`` ranks; ``nbytes`` is the full tensor (the
    all-reduced buffer, the gathered result, the scattered input, all tokens of an all-to-all)."""
    if kind not in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"):
        raise ValueError(f"kind must be a collective name, got {kind!r}")
    if n == 1:
        return 0.0
    if kind == "send":
        return latency_us * 1e-6 + nbytes / (gbps * 1e9)
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    return steps * latency_us * 1e-6 + ring_bytes(kind, nbytes, n) / (gbps * 1e9)


def ring_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes each rank sends: ``2(n-1)/n · bytes`` for an all-reduce, ``(n-1)/n · bytes`` for an
    all-gather, a reduce-scatter or an all-to-all."""
    return (2 if kind == "all_reduce" else 1) * (n - 1) / n * nbytes


def tp_block_comm_s(
    act_bytes: float,
    tp: int,
    gbps: float,
    latency_us: float = 0.0,
    *,
    sp: bool = False,
    recompute: str = "none",
) -> float:
    """Exposed communication of one tensor-parallel block (attention or MLP) for one micro-batch,
    forward and backward. TP all-reduces the activation (``act_bytes``, the whole ``[b, s, h]``)
    once in forward, after the row-parallel matmul, and once in backward, for the block input's
    gradient; once more when the forward is recomputed in full. With SP every all-reduce becomes a
    reduce-scatter and an all-gather of the same tensor: the same bytes and ring steps. Not
    charged: SP's backward all-gather of the column-parallel matmul's input for its weight
    gradient, which Megatron-LM overlaps with the input-gradient matmul."""
    _check_recompute(recompute)
    if sp:
        one = collective_s("reduce_scatter", act_bytes, tp, gbps, latency_us)
        one += collective_s("all_gather", act_bytes, tp, gbps, latency_us)
    else:
        one = collective_s("all_reduce", act_bytes, tp, gbps, latency_us)
    return (3 if recompute == "full" else 2) * one


def cp_layer_comm_s(kv_bytes: float, cp: int, gbps: float, latency_us: float = 0.0) -> float:
    """Ring attention's communication for one layer and one micro-batch: the K/V block a rank
    holds (``kv_bytes``: K and V of its ``s/cp`` tokens) goes ``cp - 1`` hops round the ring in
    forward; in backward the blocks go round again with their gradients: ``3 (cp - 1)`` sends of
    ``kv_bytes`` between neighbours. The course's ring (``kernels.context_parallel``) sends more:
    its ``dK, dV`` accumulators are fp32, twice a 16-bit block, and take ``cp`` hops, the last one
    home."""
    return 3 * (cp - 1) * collective_s("send", kv_bytes, 2, gbps, latency_us)


def _group_gbps(cluster: Cluster, inner: int, size: int) -> float:
    """Bandwidth of a group of ``size`` ranks whose stride is ``inner`` (the product of the
    parallel degrees placed inside it)."""
    return cluster.intra_gbps if inner * size <= cluster.gpus_per_node else cluster.inter_gbps


@dataclass(frozen=True)
class Plan:
    """What ``plan`` returns: the inputs, per-GPU bytes and step seconds by part."""

    model: Model
    cluster: Cluster
    parallel: Parallel
    recompute: str
    micro_batches: int
    memory: dict[str, float]
    time: dict[str, float]
    mfu: float
    fits: bool

    @property
    def step_s(self) -> float:
        return self.time["total"]

    @property
    def comm_s(self) -> float:
        """The step's exposed communication: the sum of its ``comm_*`` parts."""
        return sum(v for k, v in self.time.items() if k.startswith("comm_"))

    def summary(self) -> str:
        gb = self.memory["total"] / 1e9
        t, comm = self.time, self.comm_s
        return (
            f"{self.parallel.label()} recompute={self.recompute}: {gb:.1f} GB/GPU"
            f"{'' if self.fits else ' (does not fit)'}, step {t['total']:.3f} s = compute "
            f"{t['compute']:.3f} + optimizer {t['optimizer']:.3f} + comm {comm:.3f} + bubble "
            f"{t['bubble']:.3f}"
        )


def plan(
    model: Model,
    cluster: Cluster,
    parallel: Parallel,
    global_batch_tokens: int,
    *,
    recompute: str = "selective",
    precision: Precision = BF16_ADAM,
    mfu: float = 0.4,
    overlap: float = 0.0,
) -> Plan:
    """Per-GPU memory and step time of one configuration (assumptions: the module docstring).

    ``mfu``: the fraction of the datasheet peak the matmuls reach. The default 0.4 is an
    assumption for large bf16 models, not a measurement; ``validate`` calibrates it on a real run.
    ``overlap``: the fraction of DP/ZeRO and CP communication hidden behind compute."""
    _check_recompute(recompute)
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1], got {overlap!r}")
    m = check(model, cluster, parallel, global_batch_tokens)
    p, c = parallel, cluster
    mem = memory(model, p, m, precision, recompute)

    flops = model.train_flops_per_token(recompute) * global_batch_tokens / c.n_gpus
    compute = flops / (c.peak_flops * mfu)
    split = model.param_split()
    # Per GPU: dense parameters (shared by the dp·cp ranks) and expert parameters (shared by the
    # dp·cp/ep ranks that hold the same experts), each with its data-parallel group size.
    n_dp = p.dp * p.cp
    groups = [(split["dense"] / (p.tp * p.pp), n_dp)]
    if split["expert"]:
        groups.append((split["expert"] / (p.tp * p.pp * p.ep), n_dp // p.ep))
    updated = sum(n / (g if p.zero >= 1 else 1) for n, g in groups)
    optimizer = updated * precision.update / c.hbm_bytes_per_s

    alpha = c.latency_us
    s = model.seq // p.cp
    act = p.micro_batch * s * model.hidden * 2  # one bf16 [b, s/cp, h] activation
    layers = model.layers // p.pp  # per GPU
    # TP: two blocks a layer (attention, MLP), each all-reducing one activation forward and back
    # (SP: reduce-scatter + all-gather, the same bytes), once more under full recomputation.
    tp_gbps = _group_gbps(c, 1, p.tp)
    comm_tp = (
        layers * m * 2 * tp_block_comm_s(act, p.tp, tp_gbps, alpha, sp=p.sp, recompute=recompute)
    )
    # CP: K/V blocks travel cp - 1 hops per layer in forward, K/V and their gradients in backward.
    hop = p.micro_batch * s * 2 * (model.kv_heads * model.hidden // model.heads) // p.tp * 2
    comm_cp = layers * m * cp_layer_comm_s(hop, p.cp, _group_gbps(c, p.tp, p.cp), alpha)
    # EP: dispatch and combine all-to-alls, forward and backward, of top_k copies of each token.
    comm_ep = 0.0
    if p.ep > 1:
        tokens = act * model.top_k
        comm_ep = (
            layers
            * m
            * 4
            * collective_s("all_to_all", tokens, p.ep, _group_gbps(c, p.tp, p.ep), alpha)
        )
    # PP: each micro-batch's activation forward and its gradient back (sharded by TP).
    comm_pp = 0.0
    if p.pp > 1:
        pp_gbps = _group_gbps(c, p.tp * p.cp * p.dp, p.pp)
        comm_pp = 2 * m * p.virtual_stages * collective_s("send", act / p.tp, 2, pp_gbps, alpha)
    # DP / ZeRO over the ranks holding the same weights.
    comm_dp = 0.0
    for n_params, g in groups:
        gbps = _group_gbps(c, p.tp, g)
        w_bytes, g_bytes = n_params * precision.weight, n_params * precision.grad
        if p.zero == 0:
            comm_dp += collective_s("all_reduce", g_bytes, g, gbps, alpha)
        elif p.zero < 3:  # reduce-scatter the gradients, all-gather the updated weights
            comm_dp += collective_s("reduce_scatter", g_bytes, g, gbps, alpha)
            comm_dp += collective_s("all_gather", w_bytes, g, gbps, alpha)
        else:  # every micro-batch: gather for forward, gather again for backward, reduce-scatter
            comm_dp += m * 2 * collective_s("all_gather", w_bytes, g, gbps, alpha)
            comm_dp += m * collective_s("reduce_scatter", g_bytes, g, gbps, alpha)

    busy = compute + comm_tp + comm_ep + comm_pp
    bubble = 0.0
    if p.pp > 1:
        f = bubble_fraction(p.pp, m)  # idle share of the whole step; (p-1)/m of the busy time
        bubble = busy * f / (1 - f) / p.virtual_stages
    time = {
        "compute": compute,
        "optimizer": optimizer,
        "bubble": bubble,
        "comm_dp": comm_dp * (1 - overlap),
        "comm_tp": comm_tp,
        "comm_pp": comm_pp,
        "comm_cp": comm_cp * (1 - overlap),
        "comm_ep": comm_ep,
    }
    time["total"] = sum(time.values())
    fits = mem["total"] <= MEMORY_HEADROOM * c.memory_bytes
    return Plan(model, cluster, parallel, recompute, m, mem, time, mfu, fits)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(
    model: Model,
    cluster: Cluster,
    global_batch_tokens: int,
    *,
    micro_batches=(1, 2, 4),
    cps=(1, 2, 4, 8, 16),
    recomputes=RECOMPUTE,
    keep: int | None = 10,
    **kwargs,
) -> list[Plan]:
    """Every configuration that passes ``check`` and fits in memory, fastest first (then the least
    memory). TP with SP whenever ``tp > 1``; ZeRO 0-3; the 1F1B schedule; EP = 1 for dense models
    and every divisor of the experts that divides ``dp · cp`` otherwise. ``kwargs`` go to ``plan``.
    """
    n = cluster.n_gpus
    found = []
    tps = [t for t in _divisors(cluster.gpus_per_node) if n % t == 0]
    for tp, pp, cp in itertools.product(tps, _divisors(model.layers), cps):
        if n % (tp * pp * cp):
            continue
        dp = n // (tp * pp * cp)
        eps = [e for e in _divisors(model.experts) if (dp * cp) % e == 0] if model.experts else [1]
        for ep, zero, mb, rc in itertools.product(eps, range(4), micro_batches, recomputes):
            try:  # skip shapes that cannot run; a bad argument of plan still raises below
                par = Parallel(
                    dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, sp=tp > 1, micro_batch=mb
                )
                check(model, cluster, par, global_batch_tokens)
            except ValueError:
                continue
            pl = plan(model, cluster, par, global_batch_tokens, recompute=rc, **kwargs)
            if pl.fits:
                found.append(pl)
    found.sort(key=lambda q: (q.step_s, q.memory["total"]))
    return found[:keep] if keep else found


# ----------------------------------------------------------------------------- validation

RESULTS = Path(__file__).resolve().parents[1] / "results" / "nvidia-h200.jsonl"
# The Act 5 DDP/FSDP runs (notebooks/05c-scaling.ipynb, scripts/dist/train_ddp_fsdp.py) trained
# TinyGPT with these; a record's shape gives [global batch, seq, d_model, layers] only.
ACT5_VOCAB, ACT5_HEADS = 32768, 12


def load_records(path: str | Path = RESULTS) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _allreduce_busbw(records: list[dict], n: int) -> float:
    """Bus bandwidth (GB/s) of the largest NCCL all-reduce measured on ``n`` GPUs."""
    rows = [
        r
        for r in records
        if r["bench"] == "collectives_all_reduce" and r["variant"] == f"nccl x{n}"
    ]
    if not rows:
        raise ValueError(f"records: no NCCL all-reduce measured on {n} GPUs")
    return max(rows, key=lambda r: (r["shape"][0], r["gbps"]))["gbps"]


def _runs(records: list[dict]) -> list[list[dict]]:
    """The records split into runs of Lab 5c. A run appends its all-reduces, then its DDP/FSDP
    steps, so a new run begins where an all-reduce follows a step, or where the date changes (two
    runs of one day are two runs: a date alone does not tell them apart)."""
    runs: list[list[dict]] = []
    stepped = False
    for r in records:
        new = not runs or r.get("date") != runs[-1][-1].get("date")
        new = new or (stepped and r["bench"] == "collectives_all_reduce")
        if new:
            runs.append([])
            stepped = False
        runs[-1].append(r)
        stepped = stepped or r["bench"] == "ddp_fsdp_step"
    return runs


def _one_run(records: list[dict]) -> list[dict]:
    """The records of one run (``_runs``): the one whose DDP/FSDP steps cover the most GPU counts
    (the newest on a tie) and that measured the all-reduce of each of them. A later run on fewer
    GPUs must not pair its steps with an earlier run's one-GPU baseline and bandwidths: timings
    compare within one run only."""
    whole = []
    for run in _runs(records):
        ns = {_n_gpus(r["variant"]) for r in run if r["bench"] == "ddp_fsdp_step"}
        measured = {r["variant"] for r in run if r["bench"] == "collectives_all_reduce"}
        if ns and all(f"nccl x{n}" in measured for n in ns - {1}):
            whole.append((len(ns), len(whole), run))
    if not whole:
        raise ValueError("records: no run measured its DDP/FSDP steps and their all-reduces")
    return max(whole, key=lambda t: t[:2])[2]


def validate(records: list[dict], gpu: str = "H200-SXM") -> dict:
    """Predict the measured Act 5 DDP/FSDP steps and compare.

    Model: TinyGPT (LayerNorm, fused QKV, GELU MLP of width 4d, learned positions, untied head;
    parameters from ``distributed.gpt_params``), fp32 weights with bf16 autocast and AdamW
    (``FP32_AUTOCAST_ADAM``), one micro-batch, DDP = ZeRO-0, FSDP = ZeRO-3, nothing overlapped.
    The one calibrated constant is the ``mfu`` of this GPU, fitted so that the 1-GPU DDP step is
    reproduced exactly; the bandwidth of each GPU count is the measured NCCL all-reduce bus
    bandwidth there (an input, not a fit). Everything comes from one run (``_one_run``). Returns
    ``{"mfu": .., "date": .., "rows": [{variant, gpus, measured_ms, predicted_ms, error}]}``.
    """
    steps = [r for r in records if r["bench"] == "ddp_fsdp_step"]
    if not steps:
        raise ValueError("records: no ddp_fsdp_step records")
    records = _one_run(records)
    steps = [r for r in records if r["bench"] == "ddp_fsdp_step"]
    one = steps[0]
    global_batch, seq, d, layers = one["shape"]
    n0 = int(one["variant"].split("x")[1])
    model = Model(
        "TinyGPT (Act 5)",
        layers,
        d,
        ACT5_HEADS,
        ACT5_HEADS,
        4 * d,
        ACT5_VOCAB,
        seq,
        gated_mlp=False,
        params=gpt_params(ACT5_VOCAB, d, layers, seq),
    )
    per_gpu_batch = global_batch // n0
    ddp1_ms = next(r["baseline_ms"] for r in steps if r["variant"].startswith("ddp"))

    def predict(mode: str, n: int, mfu: float) -> Plan:
        bw = _allreduce_busbw(records, n) if n > 1 else 1.0
        cluster = Cluster(gpu, n, gpus_per_node=max(n, 1), intra_gbps=bw)
        par = Parallel(dp=n, zero=0 if mode == "ddp" else 3, micro_batch=per_gpu_batch)
        return plan(
            model,
            cluster,
            par,
            per_gpu_batch * n * seq,
            # SDPA's flash kernel keeps no score matrix and recomputes it in backward: what
            # selective recomputation counts (memory and FLOPs)
            recompute="selective",
            precision=FP32_AUTOCAST_ADAM,
            mfu=mfu,
        )

    # Calibrate: compute time = measured 1-GPU DDP step - the optimizer step (memory-bound).
    probe = predict("ddp", 1, 1.0)
    mfu = probe.time["compute"] / (ddp1_ms / 1e3 - probe.time["optimizer"])
    rows = []
    cases = {("ddp", 1): ddp1_ms}
    cases[("fsdp", 1)] = next(r["baseline_ms"] for r in steps if r["variant"].startswith("fsdp"))
    for r in steps:
        mode, n = r["variant"].split(" x")
        cases[(mode, int(n))] = r["ms"]
    for (mode, n), measured in cases.items():
        predicted = predict(mode, n, mfu).step_s * 1e3
        rows.append(
            {
                "variant": f"{mode} x{n}",
                "gpus": n,
                "measured_ms": measured,
                "predicted_ms": predicted,
                "error": predicted / measured - 1,
            }
        )
    return {"mfu": mfu, "gpu": gpu, "date": one["date"], "rows": rows}


# Lab 5d (notebooks/05d-context-and-memory.ipynb) on two GPUs of the same file: its step times of
# the course's decoder under each recomputation policy, ring attention against one GPU, and
# tensor-parallel blocks with sequence parallelism against TP alone.


def _row(what: str, gpus: int, measured: float, predicted: float, unit: str) -> dict:
    """One validation row; ``error`` is ``predicted / measured - 1`` (positive: the planner is
    slower than the measurement)."""
    return {
        "variant": what,
        "gpus": gpus,
        "measured": measured,
        "predicted": predicted,
        "unit": unit,
        "error": predicted / measured - 1,
    }


def _latest(records: list[dict], bench: str) -> list[dict]:
    """The records of ``bench``, the last one of each variant and shape (a later run replaces an
    earlier one), in the order they were first recorded."""
    last = {(r["variant"], tuple(r["shape"])): r for r in records if r["bench"] == bench}
    return list(last.values())


def _measured_cluster(records: list[dict], gpu: str, n: int) -> Cluster:
    """``n`` GPUs in one node at the NCCL all-reduce bus bandwidth measured on ``n`` GPUs."""
    return Cluster(gpu, n, gpus_per_node=n, intra_gbps=_allreduce_busbw(records, n))


def _n_gpus(variant: str) -> int:
    return int(variant.rsplit("x", 1)[1])  # "tp+sp x2", "zigzag ring x2"


def validate_recompute(records: list[dict], gpu: str = "H200-SXM") -> dict:
    """Predict Lab 5d's selective and full recomputation steps from the step without.

    ``activation_step`` records: forward+backward of the course's decoder (``kernels.decoder``'s
    configuration named by the variant, ``shape = [b, s]``) on one GPU, no optimizer step, so
    the prediction is ``plan``'s step less its optimizer. What ``plan`` charges recomputation is
    ``train_flops_per_token(recompute)`` (and, under TP, the recomputed forward's all-reduces:
    none on one GPU). The one calibrated constant is the ``mfu`` that reproduces the
    ``recompute=none`` step. Returns ``{"mfu", "model", "rows"}``."""
    from kernels import decoder  # its model shapes (imported here: it loads Triton kernels)

    steps = _latest(records, "activation_step")
    if not steps:
        raise ValueError("records: no activation_step records")
    name = steps[-1]["variant"].rsplit(" recompute=", 1)[0]
    runs = {r["variant"].rsplit("=", 1)[1]: r for r in steps if r["variant"].startswith(f"{name} ")}
    configs = {c.name: c for c in (decoder.BRRR_2B, decoder.TINY)}
    if name not in configs or "none" not in runs:
        raise ValueError(f"records: no recompute=none step of a known decoder, got {name!r}")
    b, s = runs["none"]["shape"]
    model = Model.from_config(configs[name], s)

    def fwd_bwd_s(recompute: str, mfu: float) -> float:
        pl = plan(
            model, Cluster(gpu, 1), Parallel(micro_batch=b), b * s, recompute=recompute, mfu=mfu
        )
        return pl.step_s - pl.time["optimizer"]

    mfu = fwd_bwd_s("none", 1.0) / (runs["none"]["ms"] / 1e3)  # compute scales as 1/mfu
    rows = [
        _row(f"{name} step, recompute={rc}", 1, r["ms"], fwd_bwd_s(rc, mfu) * 1e3, "ms")
        for rc, r in runs.items()
    ]
    return {"mfu": mfu, "model": name, "rows": rows}


def validate_ring(records: list[dict], gpu: str = "H200-SXM", overlap: float = 0.0) -> list[dict]:
    """Predict Lab 5d's ring attention on ``n`` GPUs from one GPU's time at the same length.

    ``ring_attention`` records: forward+backward of one causal attention ``shape = [b, H, N, d]``
    (H heads with their own K and V), zig-zag split over ``n`` GPUs (``ms``) and on one GPU over
    the whole sequence (``baseline_ms``). The planner's CP terms: the compute split evenly over
    the ``n`` ranks (the zig-zag ring gives each exactly ``1/n`` of the causal FLOPs:
    ``context_parallel.step_flops``), plus ``cp_layer_comm_s`` for one layer's K/V blocks at the
    NCCL all-reduce bus bandwidth measured on ``n`` GPUs, ``1 - overlap`` of it exposed (0, the
    planner's validation setting: nothing hidden)."""
    if not 0 <= overlap <= 1:
        raise ValueError(f"overlap must be in [0, 1], got {overlap!r}")
    rows = []
    for r in _latest(records, "ring_attention"):
        n = _n_gpus(r["variant"])
        b, heads, seq, d = r["shape"]
        cluster = _measured_cluster(records, gpu, n)
        kv = 2 * b * (seq // n) * heads * d * getattr(torch, r["dtype"]).itemsize
        comm = cp_layer_comm_s(kv, n, cluster.intra_gbps, cluster.latency_us)
        predicted = r["baseline_ms"] / n + (1 - overlap) * comm * 1e3
        rows.append(_row(f"ring attention, N = {seq}", n, r["ms"], predicted, "ms"))
    return rows


def validate_sp(records: list[dict], gpu: str = "H200-SXM") -> list[dict]:
    """Predict Lab 5d's TP+SP / TP time ratio of one tensor-parallel block.

    ``sequence_parallel_mlp`` / ``sequence_parallel_attention`` records: forward+backward of the
    block on ``shape = [s, b, h]`` over ``n`` GPUs with SP (``ms``) and without (``baseline_ms``).
    The TP time anchors the block's compute (the TP time less its ``tp_block_comm_s``); with SP the
    same compute runs with SP's ``tp_block_comm_s``, at the NCCL all-reduce bus bandwidth measured
    on ``n`` GPUs. The planner charges both the same bytes, so it predicts a ratio of 1."""
    rows = []
    for block, name in (("mlp", "MLP"), ("attention", "attention")):
        for r in _latest(records, f"sequence_parallel_{block}"):
            n = _n_gpus(r["variant"])
            s, b, h = r["shape"]
            cluster = _measured_cluster(records, gpu, n)
            act = s * b * h * getattr(torch, r["dtype"]).itemsize
            tp, sp = (
                tp_block_comm_s(act, n, cluster.intra_gbps, cluster.latency_us, sp=x) * 1e3
                for x in (False, True)
            )
            tp_ms = r["baseline_ms"]
            what = f"{name} block, h = {h}: TP+SP / TP time"
            rows.append(_row(what, n, r["ms"] / tp_ms, (tp_ms - tp + sp) / tp_ms, "ratio"))
    return rows


def validate_lab5d(records: list[dict], gpu: str = "H200-SXM") -> dict:
    """Lab 5d's rows: ``validate_recompute``, ``validate_ring`` and ``validate_sp``. Returns
    ``{"mfu", "model", "gbps": {n: all-reduce bus bandwidth used}, "rows"}``."""
    rc = validate_recompute(records, gpu)
    rows = rc["rows"] + validate_ring(records, gpu) + validate_sp(records, gpu)
    gbps = {r["gpus"]: _allreduce_busbw(records, r["gpus"]) for r in rows if r["gpus"] > 1}
    return {"mfu": rc["mfu"], "model": rc["model"], "gbps": gbps, "rows": rows}


def scaling_table(
    models=(MODEL_8B, MODEL_70B, MODEL_405B),
    counts=(8, 64, 256, 1024),
    gpu: str = "H100-SXM",
    global_batch_tokens: int = 2**22,
    **kwargs,
) -> list[dict]:
    """The fastest fitting configuration of each model on each GPU count (None where none fits)."""
    rows = []
    for model, n in itertools.product(models, counts):
        best = search(model, Cluster(gpu, n), global_batch_tokens, keep=1, **kwargs)
        b = best[0] if best else None
        rows.append(
            {
                "model": model.name,
                "gpus": n,
                "config": b.parallel.label() if b else None,
                "recompute": b.recompute if b else None,
                "memory_gb": b.memory["total"] / 1e9 if b else None,
                "step_s": b.step_s if b else None,
                "plan": b,
            }
        )
    return rows


def scaling_cells(rows: list[dict]) -> list[list[str]]:
    """``scaling_table`` rows as the cells of a table: model, GPUs, the layout, recompute, GB per
    GPU, step seconds, compute / comm / bubble seconds ("nothing fits" and blanks where none fits).
    ``markdown_table`` and the book's ``planner-scaling`` table both print these."""
    out = []
    for r in rows:
        pl = r["plan"]
        head = [r["model"], str(r["gpus"])]
        if pl is None:
            out.append([*head, "nothing fits", "", "", "", ""])
            continue
        t = pl.time
        out.append(
            [
                *head,
                pl.parallel.label(),
                pl.recompute,
                f"{pl.memory['total'] / 1e9:.1f}",
                f"{pl.step_s:.2f}",
                f"{t['compute']:.2f} / {pl.comm_s:.2f} / {t['bubble']:.2f}",
            ]
        )
    return out


def markdown_table(rows: list[dict]) -> str:
    """``scaling_table`` rows as a Markdown table (for a glued chapter table)."""
    lines = [
        "| model | GPUs | fastest fitting configuration | recompute | GB / GPU | step (s) |"
        " compute / comm / bubble (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for cells in scaling_cells(rows):
        lines.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
    return "\n".join(lines)
