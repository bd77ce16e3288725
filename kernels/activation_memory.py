"""Activation memory: what a training step keeps for its backward pass, measured layer by layer.

**What is measured.** ``SavedTensorCounter`` installs ``torch.autograd.graph.saved_tensors_hooks``:
every tensor an autograd node saves for backward passes through its pack hook, which records the
tensor's *storage* (the bytes actually held: a saved view keeps its whole base alive) once, however
many nodes save it or views of it, and skips the parameters (they are model state, not
activations). The count is device-independent: on a CPU it is the same number of bytes a GPU run
of the same ops keeps. What it does not see, and ``torch.cuda.memory_stats`` /
``max_memory_allocated`` would add: temporaries that die within the forward or backward pass
(the peak of a step includes the largest of them), the gradients and optimizer state, the
allocator's rounding (blocks of 512 bytes) and fragmentation, cuBLAS / cuDNN workspaces, and
tensors a kernel keeps outside autograd. ``profile_step`` measures both on a GPU, layer by layer,
and times the step (``scripts/gpu/activation_probe.py`` and Lab 5d print it).

**The model.** The course's decoder (``kernels.decoder.Decoder``, inference-only) is run for
training through its own layer function, ``Decoder._layer``, with gradients enabled:
RMSNorm, fused QKV projection, rotary embeddings, grouped-query attention through
``scaled_dot_product_attention`` (a FlashAttention-style kernel that keeps no score matrix), fused
gate/up projection, SwiGLU, no dropout, no biases.

**Closed form for this decoder** (``decoder_layer_bytes``; ``e`` bytes per activation element,
``a`` query heads and ``g`` kv heads of ``d = h/a``, MLP width ``f``), per layer, counted op by op:

- each of the two RMSNorms (PyTorch's composite ``F.rms_norm``, the CPU path): the input cast to
  fp32 ``4 sbh`` (the input itself when it is already fp32), ``x · rstd`` in fp32 ``4 sbh``, the
  fp32 ``rstd`` ``4 sb``, and its output, the next matmul's input, ``e·sbh``; a fused RMSNorm
  (``norm="fused"``) keeps its input, ``rstd`` and output: ``2e·sbh + 4 sb``;
- attention: the rotated q and k ``e·sb·d(a + g)``, the QKV projection's output ``e·sb·d(a + 2g)``
  (v is a view of it, so all of it stays), the attention output ``e·sbh`` (the output projection's
  input is a view of it) and its log-sum-exp ``4 sba``;
- SwiGLU MLP: the gate/up projection's output ``2e·sbf`` (the SiLU's and the product's input),
  ``silu(gate)`` ``e·sbf``, and the product ``e·sbf`` (the down projection's input): ``4e·sbf``.

Korthikanti et al.'s ``sbh(34 + 5as/h)`` {cite}`korthikanti2022activation`
(``planner.activation_bytes_per_layer``) counts a GPT layer in 2-byte activations with LayerNorm,
a ``4h`` GELU MLP, dropout and attention that materialises the ``s × s`` scores; it is shown as the
reference point, not the prediction for this decoder.

**Recomputation** (``recompute=``; ``torch.utils.checkpoint``):

- ``"selective"``: the attention core (the SDPA call) is recomputed in backward; only its inputs
  stay. With a FlashAttention-style kernel the scores were never kept, so this saves only the
  log-sum-exp: the decoder already *is* selective recomputation, the paper's point.
- ``"full"``: each layer is recomputed from its input in backward: ``e·sbh`` per layer.

The measurement uses re-entrant checkpointing (``use_reentrant=True``), whose saved inputs pass
through the pack hook, so what is kept is counted; the non-re-entrant form keeps the same inputs
through Python references that no hook sees.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable

import torch
from torch.utils.checkpoint import checkpoint

from kernels import bench, planner
from kernels import decoder as dec
from kernels import perfmodel as pm

RECOMPUTE = planner.RECOMPUTE  # ("none", "selective", "full")
NORMS = ("composite", "fused")


# ----------------------------------------------------------------------------- the counter


class SavedTensorCounter:
    """Bytes of the distinct storages autograd saves for backward, attributed to a label.

    ``with counter:`` installs the hooks; ``counter.label = "layer 3"`` sets where newly seen
    storages are attributed (a storage is counted once, under the label active when it is first
    saved). ``exclude``: tensors (parameters) whose storages are not activations."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: dict[tuple, str] = {}
        self.bytes: dict[str, int] = {}
        # By the autograd node that produced the tensor (``"input"`` for leaves and tensors made
        # outside autograd): where the bytes come from, for a breakdown table.
        self.by_producer: dict[str, int] = {}
        self.label = "other"
        self._hooks = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self._exclude and st.nbytes() > 0:
            key = (ptr, t.device)
            if key not in self._seen:
                self._seen[key] = self.label
                self.bytes[self.label] = self.bytes.get(self.label, 0) + st.nbytes()
                fn = type(t.grad_fn).__name__.removesuffix("Backward0") if t.grad_fn else "input"
                self.by_producer[fn] = self.by_producer.get(fn, 0) + st.nbytes()
        return t

    def __enter__(self) -> SavedTensorCounter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.bytes.values())


# ----------------------------------------------------------------------------- the decoder, training


def trainable(model: dec.Decoder) -> dec.Decoder:
    """Turn the (inference-only) decoder's parameters into trainable ones, in place."""
    for p in model.parameters():
        p.requires_grad_(True)
    return model


@contextlib.contextmanager
def _selective_attention():
    """Make ``kernels.decoder``'s attention call recompute in backward (checkpoint around SDPA)."""
    original = dec._sdpa

    def wrapped(q, k, v, **kw):
        return checkpoint(lambda q, k, v: original(q, k, v, **kw), q, k, v, use_reentrant=True)

    dec._sdpa = wrapped
    try:
        yield
    finally:
        dec._sdpa = original


def forward_train(
    model: dec.Decoder,
    tokens: torch.Tensor,
    recompute: str = "none",
    counter: SavedTensorCounter | None = None,
    on_mark: Callable[[str], None] | None = None,
) -> torch.Tensor:
    """Logits ``[B, T, vocab]`` with autograd on, through the decoder's own ``_layer``;
    ``counter.label`` is set to ``"embed"``, ``"0"`` … ``"L-1"`` and ``"head"`` as the pass goes,
    and ``on_mark(label)`` is called at each (a GPU probe reads the allocator there)."""
    planner._check_recompute(recompute)
    ctx = model._full_context(tokens)  # the decoder's own, as its forward_full builds it

    def mark(label):
        if counter is not None:
            counter.label = label
        if on_mark is not None:
            on_mark(label)

    mark("embed")
    x = model.embed[tokens]
    with _selective_attention() if recompute == "selective" else contextlib.nullcontext():
        for i, layer in enumerate(model.layers):
            mark(str(i))
            if recompute == "full":
                x = checkpoint(
                    lambda x, i=i, layer=layer: model._layer(i, layer, x, None, ctx),
                    x,
                    use_reentrant=True,
                )
            else:
                x = model._layer(i, layer, x, None, ctx)
    mark("head")
    return model._head(x)


def _loss(logits: torch.Tensor) -> torch.Tensor:
    # A scalar that needs every logit's gradient (no labels needed: the weights are random).
    return logits.float().logsumexp(-1).mean()


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Saved-for-backward bytes of one forward pass: per layer, and around the layers."""

    per_layer: list[int]
    embed: int
    head: int

    @property
    def total(self) -> int:
        return sum(self.per_layer) + self.embed + self.head


def measure(model: dec.Decoder, tokens: torch.Tensor, recompute: str = "none") -> Measurement:
    """Run one training forward pass of ``model`` (parameters made trainable) on ``tokens`` and
    count what it keeps for backward (then run the backward, so the graph is exercised and freed)."""
    trainable(model)
    counter = SavedTensorCounter(exclude=model.parameters())
    with counter:
        logits = forward_train(model, tokens, recompute, counter)
    _loss(logits).backward()
    n = model.cfg.n_layers
    by = counter.bytes
    return Measurement([by.get(str(i), 0) for i in range(n)], by.get("embed", 0), by.get("head", 0))


# ----------------------------------------------------------------------------- closed forms


def decoder_layer_bytes(
    cfg: pm.TransformerConfig,
    s: int,
    b: int,
    dtype: torch.dtype = torch.bfloat16,
    recompute: str = "none",
    norm: str = "composite",
) -> int:
    """Bytes one layer of ``kernels.decoder`` keeps for backward (see the module docstring), for
    ``b`` sequences of ``s`` tokens. ``norm``: PyTorch's composite RMSNorm (the CPU path) or a
    fused one. The formula lives in ``planner.decoder_activation_bytes_per_layer`` (with tensor
    and sequence parallelism), which the planner uses for ``Model(activations="decoder")``;
    ``decoder_layer_terms`` splits it by op."""
    return sum(decoder_layer_terms(cfg, s, b, dtype, recompute, norm).values())


def decoder_layer_terms(
    cfg: pm.TransformerConfig,
    s: int,
    b: int,
    dtype: torch.dtype = torch.bfloat16,
    recompute: str = "none",
    norm: str = "composite",
) -> dict[str, int]:
    """``decoder_layer_bytes`` term by term (``planner.decoder_activation_terms``): norms,
    attention, log-sum-exp and MLP, or the layer input under full recomputation (the planner
    checks ``recompute``)."""
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {NORMS}, got {norm!r}")
    e = torch.empty((), dtype=dtype).element_size()
    terms = planner.decoder_activation_terms(
        s, b, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, recompute=recompute,
        bytes_per_element=e, norm=norm,
    )  # fmt: skip
    return {k: int(v) for k, v in terms.items()}


def rope_table_bytes(cfg: pm.TransformerConfig, s: int, b: int, dtype=torch.bfloat16) -> int:
    """The rotary cos and sin rows of the batch (``[b, s, 1, d]`` each), saved by every layer's
    rotation but stored once: the measurement charges them to the first layer that saves them."""
    return 2 * b * s * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def paper_layer_bytes(cfg: pm.TransformerConfig, s: int, b: int, recompute: str = "none") -> float:
    """Korthikanti et al.'s count for a GPT layer of the same ``s, b, h, a`` (2-byte activations):
    the reference point (``planner.activation_bytes_per_layer``)."""
    return planner.activation_bytes_per_layer(s, b, cfg.d_model, cfg.n_heads, recompute=recompute)


# ----------------------------------------------------------------------------- one step, profiled


def profile_step(
    model: dec.Decoder,
    tokens: torch.Tensor,
    recompute: str = "none",
    *,
    time_step: bool = True,
    rep_ms: float = 100,
) -> dict:
    """Everything the course measures about one training step of ``model`` on ``tokens`` under
    one recomputation policy, as a JSON-ready dict (``scripts/gpu/activation_probe.py`` and Lab 5d
    print it):

    - ``saved_per_layer``, ``saved_embed``, ``saved_head``: bytes saved for backward
      (``measure``: the saved-tensor counter, device-independent);
    - ``closed_composite``, ``closed_fused``: ``decoder_layer_bytes`` per layer with PyTorch's
      composite RMSNorm and with a fused one (a GPU build may fuse ``F.rms_norm``; the one the
      counter matches says which path ran); ``rope_tables`` (held once, by the first layer);
      ``paper``: Korthikanti et al.'s count for the same ``s, b, h, a``;
    - on CUDA, from the caching allocator, with a mark at each layer boundary:
      ``allocated_per_layer`` (``memory_allocated`` after a layer's forward minus before it: what
      the layer leaves allocated, its saved tensors plus its output minus the input it frees),
      ``peak_per_layer`` (``max_memory_allocated`` during the layer minus the allocation at its
      start: the held bytes plus its largest transient buffers), ``fwd_peak_bytes`` /
      ``fwd_held_bytes`` (the forward's peak and what it leaves, above the allocation before it)
      and ``step_peak_bytes`` (the peak through the backward pass as well);
    - ``step_ms`` (``time_step``): the median forward+backward time (``bench.measure``, ``rep_ms``
      of repetitions on a GPU; a CPU time on a CPU).
    """
    cfg, (b, s) = model.cfg, tokens.shape
    m = measure(model, tokens, recompute)
    row = {
        "recompute": recompute,
        "saved_per_layer": m.per_layer,
        "saved_embed": m.embed,
        "saved_head": m.head,
        "closed_composite": decoder_layer_bytes(cfg, s, b, model.dtype, recompute, "composite"),
        "closed_fused": decoder_layer_bytes(cfg, s, b, model.dtype, recompute, "fused"),
        "rope_tables": rope_table_bytes(cfg, s, b, model.dtype),
        "paper": paper_layer_bytes(cfg, s, b, recompute),
    }
    if tokens.is_cuda:
        row |= _allocator_profile(model, tokens, recompute)
    if time_step:

        def step():
            _loss(forward_train(model, tokens, recompute)).backward()

        row["step_ms"] = bench.measure(step, rep_ms=rep_ms).ms
        model.zero_grad(set_to_none=True)
    return row


def _allocator_profile(model: dec.Decoder, tokens: torch.Tensor, recompute: str) -> dict:
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    starts: dict[str, int] = {}
    peaks: dict[str, int] = {}
    order: list[str] = []

    def close_segment() -> None:  # the peak since the last mark, relative to its start
        if order:
            peaks[order[-1]] = torch.cuda.max_memory_allocated() - starts[order[-1]]

    def on_mark(label: str) -> None:
        # The allocator's counters move when a kernel is *launched* (allocation is host-side), so
        # reading them needs no synchronisation.
        close_segment()
        order.append(label)
        starts[label] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()

    logits = forward_train(model, tokens, recompute, on_mark=on_mark)
    close_segment()
    end = torch.cuda.memory_allocated()
    fwd_peak = max(starts[k] + peaks[k] for k in order) - before
    layers = [str(i) for i in range(model.cfg.n_layers)]
    bounds = [*layers, "head"]
    out = {
        "allocated_per_layer": [starts[n] - starts[c] for c, n in zip(bounds, bounds[1:])],
        "peak_per_layer": [peaks[c] for c in layers],
        "fwd_peak_bytes": fwd_peak,
        "fwd_held_bytes": end - before,
    }
    torch.cuda.reset_peak_memory_stats()
    _loss(logits).backward()
    torch.cuda.synchronize()
    out["step_peak_bytes"] = max(fwd_peak, torch.cuda.max_memory_allocated() - before)
    del logits
    model.zero_grad(set_to_none=True)
    return out
