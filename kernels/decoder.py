"""A small Llama-style decoder with random weights and a paged KV cache: the model Act 6 serves.

No weights are downloaded: every parameter is drawn from a seeded generator on the device. The shape
is a ``kernels.perfmodel.TransformerConfig`` (so the napkin maths of Act 2 counts its FLOPs and
bytes): RMSNorm, rotary position embeddings, grouped-query attention, a SwiGLU MLP and an untied
output head. ``BRRR_2B`` is eight layers of Llama-2-7B's shape (width 4096, MLP 11008) with
grouped-query attention (32 query heads, 8 kv heads of 128): 1.7 B parameters, 3.4 GB in bf16.
A decode step on an H100 has to stream 3.1 GB of matmul weights, about a millisecond at full
bandwidth, which dwarfs both its arithmetic and the GPU time of its few hundred small kernels:
reading memory sets its speed. ``TINY`` is the same architecture at a size the CPU interpreter
runs in seconds.

``Decoder.forward(tokens, cache, slots, start)`` runs ``tokens: [B, T]`` for the sequences in rows
``slots`` of a ``paged_attention.PagedKVCache``, each of which already holds ``start[b]`` tokens.
It writes the new keys and values into the cache and attends over the cache:

- ``T == 1`` (a decode step): ``paged_attention.paged_decode``, the split-K Triton kernel. Nothing
  in this path synchronises with the host or depends on tensor values for its shapes, so a decode
  step can be recorded once in a CUDA graph (``GraphedDecodeStep``) and replayed.
- ``T > 1`` with nothing cached yet (a prefill): causal ``scaled_dot_product_attention`` over the
  new tokens.
- ``T > 1`` after a prefix (a chunked prefill, or verifying speculated tokens): the prefix is
  gathered from the pages and attended to with a mask.

``forward_full`` is the same model without a cache (every position recomputed): the reference the
cache path is checked against.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right

from kernels import bench, device, roofline
from kernels import paged_attention as pa
from kernels import perfmodel as pm

BRRR_2B = pm.TransformerConfig(
    "brrr-1.7B", d_model=4096, n_layers=8, n_heads=32, n_kv_heads=8, d_ff=11008, vocab=32000
)
TINY = pm.TransformerConfig(
    "tiny", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=160, vocab=256
)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _default_device() -> torch.device:
    return device.DEVICE


def default_config() -> pm.TransformerConfig:
    """``BRRR_2B`` on a GPU, ``TINY`` in the CPU interpreter."""
    return device.pick(BRRR_2B, TINY)


# ----------------------------------------------------------------------------- napkin maths


def decode_cost(cfg: pm.TransformerConfig, batch: int, context: int, dtype="bf16") -> pm.Cost:
    """One decode step of ``batch`` sequences after ``context`` cached tokens: every matmul weight
    read once, each sequence's KV cache read and one token's K and V written (Act 2's model)."""
    return pm.decode_step(cfg, batch, context, dtype, dtype)


def prefill_cost(cfg: pm.TransformerConfig, batch: int, prompt: int, dtype="bf16") -> pm.Cost:
    """A prefill of ``batch`` prompts of ``prompt`` tokens that computes logits for the last token
    only (``pm.prefill`` counts the output head for every token)."""
    c = pm.prefill(cfg, batch, prompt, dtype, dtype)
    head = 2 * cfg.vocab * cfg.d_model * batch * (prompt - 1)
    return pm.Cost(c.name, c.flops - head, c.bytes)


# ----------------------------------------------------------------------------- the model


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half form, on ``x: [B, T, heads, hd]`` with ``cos, sin: [B, T, 1,
    hd]`` in x's dtype (as most Llama implementations do: five small kernels)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _sdpa(q, k, v, *, causal=False, mask=None):
    """SDPA on ``[B, heads, T, hd]``; kv heads are repeated for GQA when there are fewer."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        if mask is None:
            try:  # no copy: the flash backend reads each kv head once for its whole group
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            except (TypeError, RuntimeError):
                pass
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


class DecoderLayer(nn.Module):
    """Pre-norm Llama layer with fused projections: ``wqkv`` (q, k, v) and ``w13`` (gate, up)."""

    def __init__(self, cfg: pm.TransformerConfig, *, dtype, device, generator, out_scale=1.0):
        super().__init__()
        d, hd, f = cfg.d_model, cfg.head_dim, cfg.d_ff
        n_qkv = (cfg.n_heads + 2 * cfg.n_kv_heads) * hd

        def w(out_f, in_f, scale=1.0):
            t = torch.randn(out_f, in_f, generator=generator, device=device, dtype=torch.float32)
            return nn.Parameter((t * (scale / math.sqrt(in_f))).to(dtype), requires_grad=False)

        self.attn_norm = nn.Parameter(
            torch.ones(d, device=device, dtype=dtype), requires_grad=False
        )
        self.mlp_norm = nn.Parameter(torch.ones(d, device=device, dtype=dtype), requires_grad=False)
        self.wqkv = w(n_qkv, d)
        # out_scale multiplies what the layer adds to the residual stream (the speculative-decoding
        # knob: a layer with out_scale 0 is the identity).
        self.wo = w(d, cfg.n_heads * hd, out_scale)
        self.w13 = w(2 * f, d)
        self.w2 = w(d, f, out_scale)


class Decoder(nn.Module):
    """A Llama-style decoder (see the module docstring). Inference only: no gradients.

    ``tail_from`` / ``tail_scale``: the layers from index ``tail_from`` on have their residual
    contributions multiplied by ``tail_scale``. With ``draft = model.truncated(tail_from)`` the
    target is exactly ``draft``'s layers plus ``tail_scale`` times the rest: at 0 the two models
    compute the same function, and the larger the scale, the more they disagree.
    """

    def __init__(
        self,
        cfg: pm.TransformerConfig,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        seed: int = 0,
        max_position: int = 16384,
        tail_from: int | None = None,
        tail_scale: float = 1.0,
        rope_theta: float = 10000.0,
    ):
        super().__init__()
        if not isinstance(cfg, pm.TransformerConfig):
            raise TypeError(f"cfg must be a perfmodel.TransformerConfig, got {type(cfg).__name__}")
        if dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype must be one of {SUPPORTED_DTYPES}, got {dtype}")
        if cfg.head_dim not in pa.SUPPORTED_HEAD_DIMS:
            raise ValueError(
                f"head_dim must be one of {pa.SUPPORTED_HEAD_DIMS}, got {cfg.head_dim}"
            )
        if not cfg.gated_mlp:
            raise ValueError("cfg.gated_mlp must be True: the decoder's MLP is SwiGLU")
        if tail_from is not None and not 0 <= tail_from <= cfg.n_layers:
            raise ValueError(f"tail_from must be in [0, {cfg.n_layers}], got {tail_from!r}")
        dev = torch.device(device) if device is not None else _default_device()
        self.cfg, self.dtype, self.eps = cfg, dtype, 1e-5
        # One seed per tensor group, so that layer i is the same whatever the other settings are.
        base = 1_000_003 * seed + 17
        g = torch.Generator(device=dev)
        g.manual_seed(base)
        d = cfg.d_model
        self.embed = nn.Parameter(
            torch.randn(cfg.vocab, d, generator=g, device=dev).to(dtype), requires_grad=False
        )
        layers = []
        for i in range(cfg.n_layers):
            g.manual_seed(base + 1 + i)
            scale = tail_scale if tail_from is not None and i >= tail_from else 1.0
            layers.append(DecoderLayer(cfg, dtype=dtype, device=dev, generator=g, out_scale=scale))
        self.layers = nn.ModuleList(layers)
        self.norm = nn.Parameter(torch.ones(d, device=dev, dtype=dtype), requires_grad=False)
        g.manual_seed(base + 10_000)  # not the embedding's: the head is untied
        head = torch.randn(cfg.vocab, d, generator=g, device=dev) / math.sqrt(d)
        self.lm_head = nn.Parameter(head.to(dtype), requires_grad=False)
        # Rotary tables: angle = position / theta^(2i / hd), each angle for both halves.
        hd = cfg.head_dim
        inv = 1.0 / rope_theta ** (torch.arange(0, hd, 2, device=dev, dtype=torch.float32) / hd)
        ang = torch.outer(torch.arange(max_position, device=dev, dtype=torch.float32), inv)
        ang = torch.cat((ang, ang), dim=-1)
        self.register_buffer("rope_cos", ang.cos().to(dtype), persistent=False)
        self.register_buffer("rope_sin", ang.sin().to(dtype), persistent=False)
        self.decode_attention = "triton"  # or "torch": gather the pages and call SDPA

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def max_position(self) -> int:
        return self.rope_cos.shape[0]

    def truncated(self, n_layers: int) -> Decoder:
        """A draft model sharing this model's embedding, first ``n_layers`` layers, final norm and
        output head (no copy): the model the early-exit draft of speculative decoding runs."""
        if not 1 <= n_layers <= self.cfg.n_layers:
            raise ValueError(f"n_layers must be in [1, {self.cfg.n_layers}], got {n_layers!r}")
        draft = object.__new__(Decoder)
        nn.Module.__init__(draft)
        name = f"{self.cfg.name}[:{n_layers}]"
        draft.cfg = dataclasses.replace(self.cfg, name=name, n_layers=n_layers)
        draft.dtype, draft.eps = self.dtype, self.eps
        draft.embed, draft.norm, draft.lm_head = self.embed, self.norm, self.lm_head
        draft.layers = nn.ModuleList(list(self.layers)[:n_layers])
        draft.register_buffer("rope_cos", self.rope_cos, persistent=False)
        draft.register_buffer("rope_sin", self.rope_sin, persistent=False)
        draft.decode_attention = self.decode_attention
        return draft

    def weight_bytes(self) -> int:
        """Bytes of every parameter (the embedding table included)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    # ------------------------------------------------------------------------- the cache

    def new_cache(
        self,
        max_seqs: int,
        max_tokens: int,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        contiguous: bool = True,
    ) -> pa.PagedKVCache:
        """A paged cache with ``max_seqs`` sequence slots of up to ``max_tokens`` tokens.

        ``num_blocks`` defaults to enough for every slot at full length (plus the null block).
        With ``contiguous`` every slot is given its blocks now, in order: the layout of a
        preallocated cache, for generation and benchmarks; a server allocates as sequences grow."""
        per_seq = -(-max_tokens // block_size)
        if num_blocks is None:
            num_blocks = max_seqs * per_seq + 1
        cache = pa.PagedKVCache.allocate(
            self.cfg.n_layers,
            self.cfg.n_kv_heads,
            self.cfg.head_dim,
            num_blocks=num_blocks,
            block_size=block_size,
            max_seqs=max_seqs,
            max_blocks_per_seq=per_seq,
            dtype=self.dtype,
            device=self.device,
        )
        if contiguous:
            for s in range(max_seqs):
                cache.ensure(s, max_tokens)
            cache.sync()
        return cache

    # ------------------------------------------------------------------------- forward

    def _check_forward(self, tokens, cache, slots, start):
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2 or tokens.dtype != torch.long:
            raise ValueError(
                f"tokens must be an int64 tensor [batch, T], got "
                f"{getattr(tokens, 'dtype', type(tokens).__name__)} {tuple(getattr(tokens, 'shape', ()))}"
            )
        if tokens.shape[1] == 0:
            raise ValueError("tokens must hold at least one token per sequence (T >= 1)")
        if not isinstance(cache, pa.PagedKVCache):
            raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
        if cache.k.shape[0] != self.cfg.n_layers or cache.k.dtype != self.dtype:
            raise ValueError(
                f"cache must have {self.cfg.n_layers} layers of {self.dtype}, got "
                f"{cache.k.shape[0]} of {cache.k.dtype}"
            )
        for name, t in (("slots", slots), ("start", start)):
            if not isinstance(t, torch.Tensor) or t.shape != (tokens.shape[0],):
                raise ValueError(f"{name} must be a tensor of shape [{tokens.shape[0]}]")
            if t.dtype not in (torch.int32, torch.int64) or t.device != self.device:
                raise ValueError(f"{name} must be an int32/int64 tensor on {self.device}")

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: pa.PagedKVCache,
        slots: torch.Tensor,
        start: torch.Tensor,
        *,
        prefix: int | None = None,
        all_logits: bool = False,
        paged: bool = False,
    ) -> torch.Tensor:
        """Logits after ``tokens: int64[B, T]`` for the sequences in rows ``slots`` of ``cache``,
        which already hold ``start[b]`` tokens (positions ``start[b] … start[b] + T - 1`` are
        written). ``prefix`` is ``max(start)`` if the caller knows it (else it is read from the
        device, a synchronisation; decode steps never need it). Returns ``[B, vocab]`` for the
        last position, or ``[B, T, vocab]`` with ``all_logits``.

        ``paged``: run ``T > 1`` tokens through the decode attention, each new token a query of its
        own over its sequence's pages up to and including itself (all ``T`` tokens' keys are written
        first). No host synchronisation and no shape that depends on the context length, so the
        pass can be captured in a CUDA graph (speculative verification, a draft's catch-up); the
        attention is the decode step's kernel, so it rounds as a decode step does."""
        self._check_forward(tokens, cache, slots, start)
        b, t = tokens.shape
        start = start.long()
        pos = start[:, None] + torch.arange(t, device=tokens.device)  # [B, T]
        table = cache.block_table[slots.long()]  # [B, max_blocks] int32
        bs = cache.block_size
        blocks = table.gather(1, pos // bs).long()  # physical block of each new token
        offs = pos % bs
        ctx = {
            "table": table,
            "blocks": blocks,
            "offs": offs,
            "cos": self.rope_cos[pos][:, :, None, :],
            "sin": self.rope_sin[pos][:, :, None, :],
        }
        if t == 1 or paged:
            ctx["mode"], ctx["lens"] = "decode", (pos + 1).reshape(-1).to(torch.int32)
            if t > 1:  # one query per new token, each over its own sequence's row of the table
                ctx["qtable"] = table.repeat_interleave(t, 0)
                ctx["splits"] = pa.default_num_splits(b, self.cfg.n_kv_heads, table.shape[1] * bs)
        else:
            prefix = int(start.max()) if prefix is None else prefix
            ctx["mode"] = "prefill" if prefix == 0 else "extend"
            ctx["length"] = prefix + t
            ctx["pos"] = pos
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, cache, ctx)
        return self._head(x if all_logits else x[:, -1])

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the last layer's output ``x``: the final RMSNorm, then the LM head."""
        return F.linear(F.rms_norm(x, (self.cfg.d_model,), self.norm, self.eps), self.lm_head)

    def _layer(self, i: int, layer: DecoderLayer, x, cache, ctx):
        cfg = self.cfg
        b, t, _ = x.shape
        hd, nh, nkv = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        h = F.rms_norm(x, (cfg.d_model,), layer.attn_norm, self.eps)
        qkv = F.linear(h, layer.wqkv).view(b, t, nh + 2 * nkv, hd)
        qk = _rope(qkv[:, :, : nh + nkv], ctx["cos"], ctx["sin"])  # q and k rotated together
        q, k, v = qk[:, :, :nh], qk[:, :, nh:], qkv[:, :, nh + nkv :]
        if cache is not None:
            kc, vc = cache.k[i], cache.v[i]
            kc[ctx["blocks"], :, ctx["offs"], :] = k  # advanced indices first: [B, T, nkv, hd]
            vc[ctx["blocks"], :, ctx["offs"], :] = v
        mode = ctx["mode"]
        if mode == "decode":
            table = ctx.get("qtable", ctx["table"])  # [B * T, max_blocks]
            qq = q[:, 0] if t == 1 else q.reshape(b * t, nh, hd)
            if self.decode_attention == "triton":
                o = pa.paged_decode(qq, kc, vc, table, ctx["lens"], num_splits=ctx.get("splits"))
            else:  # gather the whole block table's width: static shapes, mask past each length
                length = table.shape[1] * cache.block_size
                kk, vv = pa.gather_kv(kc, table, length), pa.gather_kv(vc, table, length)
                keep = torch.arange(length, device=x.device)[None, :] < ctx["lens"][:, None]
                o = _sdpa(qq[:, :, None], kk, vv, mask=keep[:, None, None, :]).squeeze(2)
            o = o.reshape(b, t, nh * hd)
        elif mode in ("prefill", "full"):
            o = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
            o = o.transpose(1, 2).reshape(b, t, nh * hd)
        else:  # extend: the new tokens attend to the cached prefix and causally to each other
            length = ctx["length"]
            kk, vv = pa.gather_kv(kc, ctx["table"], length), pa.gather_kv(vc, ctx["table"], length)
            if b == 1:
                # One sequence whose new tokens are the last ``t`` of ``length``: the mask is the
                # bottom-right-aligned causal one, which SDPA dispatches to the flash or
                # memory-efficient kernel without building a [t, length] mask (and without the
                # generic masked dispatch, which may pick a backend that plans per shape).
                rep = nh // nkv
                if rep > 1:
                    kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
                bias = causal_lower_right(t, length)
                o = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=bias)
            else:
                keep = (
                    torch.arange(length, device=x.device)[None, None, :] <= ctx["pos"][:, :, None]
                )
                o = _sdpa(q.transpose(1, 2), kk, vv, mask=keep[:, None])
            o = o.transpose(1, 2).reshape(b, t, nh * hd)
        x = x + F.linear(o, layer.wo)
        h = F.rms_norm(x, (cfg.d_model,), layer.mlp_norm, self.eps)
        gate, up = F.linear(h, layer.w13).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.w2)

    @torch.inference_mode()
    def forward_full(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of every position, without a cache: the reference."""
        ctx = self._full_context(tokens)
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            x = self._layer(i, layer, x, None, ctx)
        return self._head(x)

    def _full_context(self, tokens: torch.Tensor) -> dict:
        """The ``_layer`` context of a cache-less pass over all of ``tokens: int64[B, T]``
        (checked): positions ``0 .. T-1`` and their rotary rows."""
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2 or tokens.dtype != torch.long:
            raise ValueError("tokens must be an int64 tensor [batch, T]")
        b, t = tokens.shape
        pos = torch.arange(t, device=tokens.device)[None].expand(b, t)
        return {
            "mode": "full",
            "cos": self.rope_cos[pos][:, :, None],
            "sin": self.rope_sin[pos][:, :, None],
        }

    # ------------------------------------------------------------------------- generation

    @torch.inference_mode()
    def generate(
        self, prompts: torch.Tensor, max_new: int, *, block_size: int = 16
    ) -> torch.Tensor:
        """Greedy generation for ``prompts: int64[B, P]`` (one length): prefill, then one decode
        step per token. Returns the ``[B, max_new]`` new tokens."""
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"max_new must be a positive int, got {max_new!r}")
        b, p = prompts.shape
        if p + max_new > self.max_position:
            raise ValueError(f"prompt + max_new ({p + max_new}) exceeds max_position")
        cache = self.new_cache(b, p + max_new, block_size=block_size)
        slots = torch.arange(b, device=self.device)
        start = torch.zeros(b, dtype=torch.long, device=self.device)
        nxt = self(prompts, cache, slots, start, prefix=0).argmax(-1)
        out = [nxt]
        for i in range(max_new - 1):
            nxt = self(nxt[:, None], cache, slots, start + p + i).argmax(-1)
            out.append(nxt)
        return torch.stack(out, 1)


# ----------------------------------------------------------------------------- CUDA graphs


class GraphedDecodeStep:
    """A decode step of a fixed batch recorded in a CUDA graph, greedy sampling included.

    ``step(tokens, start)`` copies ``tokens: int64[B]`` (the last token of each sequence) and
    ``start: [B]`` (tokens already cached) into the graph's static inputs, replays it, and returns
    the static ``[B]`` buffer of next tokens (clone what you keep: the next replay overwrites it).
    ``slots`` are the cache rows of the batch, fixed at capture. Without a GPU it runs eagerly.

    The warm-up before the capture runs the step at ``warmup_start`` cached tokens per sequence:
    the attention kernel's autotuner picks its tile shape then, and a representative length makes
    it pick well. The warm-up writes position ``warmup_start`` of every slot (or of the null block,
    for slots without blocks), so capture before filling the cache."""

    def __init__(
        self,
        model: Decoder,
        cache: pa.PagedKVCache,
        slots: torch.Tensor,
        *,
        warmup_start: int = 0,
        warmup: int = 2,
    ):
        self.model, self.cache = model, cache
        self.slots = slots.to(model.device).long()
        n = self.slots.shape[0]
        self.tokens = torch.zeros(n, 1, dtype=torch.long, device=model.device)
        self.start = torch.full((n,), warmup_start, dtype=torch.long, device=model.device)
        self.graph = None
        if not device.GPU_MODE:
            return
        # Warm up on a side stream (autotuning and lazy initialisation happen outside the capture),
        # then record.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits, self.next_tokens = self._forward()

    def _forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.model(self.tokens, self.cache, self.slots, self.start)
        return logits, logits.argmax(-1)

    def _run(self) -> torch.Tensor:
        """The same step, eagerly (kernel by kernel from Python): the baseline of the graph."""
        return self._forward()[1]

    def replay(self) -> torch.Tensor:
        """Run the step; returns the next tokens (``self.logits`` holds the logits)."""
        if self.graph is None:
            self.logits, self.next_tokens = self._forward()
        else:
            self.graph.replay()
        return self.next_tokens

    def __call__(self, tokens: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        self.tokens[:, 0].copy_(tokens, non_blocking=True)
        self.start.copy_(start, non_blocking=True)
        return self.replay()


# ----------------------------------------------------------------------------- benchmark


@bench.register("decoder")
def _bench_decoder(quick: bool) -> list[dict]:
    """Prefill (TFLOP/s against the bf16 matmul peak) and CUDA-graph decode steps (GB/s of weights
    plus KV cache against the copy bandwidth) of ``BRRR_2B``; eager decode is the baseline."""
    dtype = device.preferred_dtype(torch.bfloat16)
    cfg = default_config()
    model = Decoder(cfg, dtype=dtype)
    copy = roofline.copy_bandwidth()
    peak = roofline.matmul_peak("bfloat16" if dtype is torch.bfloat16 else "float16")
    dname = "bf16" if dtype is torch.bfloat16 else "fp16"
    recs = []
    prompt = device.pick(2048, 32)
    tokens = torch.randint(cfg.vocab, (1, prompt), device=model.device)
    cache = model.new_cache(1, prompt)
    zero = torch.zeros(1, dtype=torch.long, device=model.device)  # slot 0, nothing cached
    cost = prefill_cost(cfg, 1, prompt, dname)
    m = bench.measure(lambda: model(tokens, cache, zero, zero, prefix=0), flops=cost.flops)
    recs.append(
        bench.record(
            "decoder_prefill", cfg.name, [1, prompt], dtype, m, ceiling=(peak.name, peak.value)
        )
    )
    ctx = device.pick(1024, 16)
    for batch in device.pick([1] if quick else [1, 8, 32], [2]):
        cache = model.new_cache(batch, ctx + 1)
        slots = torch.arange(batch, device=model.device)
        step = GraphedDecodeStep(model, cache, slots, warmup_start=ctx)
        cost = decode_cost(cfg, batch, ctx, dname)
        graphed = bench.measure(step.replay, bytes=cost.bytes)
        eager = bench.measure(step._run, bytes=cost.bytes)
        recs.append(
            bench.record(
                "decoder_decode", f"{cfg.name}-graph", [batch, ctx], dtype, graphed,
                baseline=("eager", eager), ceiling=("copy", copy.value),
            )
        )  # fmt: skip
    return recs
