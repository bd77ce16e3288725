"""Serving: request traces, static and continuous batching, KV-cache memory, speculative decoding.

Everything here drives the real model of ``kernels.decoder`` on the device; nothing is simulated
except the arrival clock and, in ``simulate_kv_memory``, the bookkeeping of where KV bytes go.

- ``make_trace``: synthetic requests with heterogeneous prompt and output lengths (log-uniform)
  and Poisson arrivals.
- ``Engine``: a small serving loop over a ``PagedKVCache``. Every iteration it admits requests,
  runs prefills and then one decode step for the whole batch (a CUDA graph on a GPU). The
  scheduling policy is the only difference between runs:

  * ``"static"``: request-level batching. A batch is formed when the engine is idle and runs until
    its *last* request finishes; slots of finished requests idle until then, and requests that
    arrive meanwhile wait.
  * ``"continuous"``: iteration-level scheduling (Orca). A finished request leaves after the step
    that finished it and a waiting one takes its slot at the next iteration. Prompts are prefilled
    whole as soon as their request is admitted, so running requests stall while a long prompt goes
    through.
  * ``"chunked"``: continuous batching with chunked prefill (Sarathi): each iteration prefills at
    most ``prefill_chunk`` prompt tokens, so a long prompt is spread over several iterations and
    the decode steps of the others keep going.

  The clock is the wall clock of the GPU work plus the idle gaps between arrivals, skipped
  instead of slept. Each request records its arrival, first-token and finish times, from which
  ``summarize`` gives throughput and the latency percentiles (time to first token, time per output
  token, end to end).
- ``simulate_kv_memory``: the same kind of trace through three ways of holding KV caches (a
  contiguous slab of the maximum length per request, a contiguous reservation of prompt + maximum
  output, and paged blocks), counting tokens stored against tokens reserved.
- ``speculative_generate``: greedy speculative decoding with a draft model; ``expected_speedup`` is
  the formula of Leviathan et al. that the measurement is compared with.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from kernels import device
from kernels.decoder import Decoder, GraphedDecodeStep

POLICIES = ("static", "continuous", "chunked")

# ----------------------------------------------------------------------------- traces


@dataclass
class Request:
    """One request: ``prompt`` tokens, ``max_new`` tokens to generate (the trace fixes the output
    length, as if the end-of-sequence token came exactly then), arriving ``arrival`` s after the
    trace starts. The engine fills in the rest."""

    rid: int
    arrival: float
    prompt: list[int]
    max_new: int
    first_token_at: float | None = None
    finished_at: float | None = None
    output: list[int] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    def reset(self) -> None:
        self.first_token_at = self.finished_at = None
        self.output = []


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def make_trace(
    n: int,
    *,
    vocab: int,
    prompt_lens: tuple[int, int] = (32, 1024),
    output_lens: tuple[int, int] = (8, 512),
    rate: float | None = None,
    seed: int = 0,
) -> list[Request]:
    """``n`` requests with log-uniform prompt and output lengths in the given inclusive ranges (as
    many short requests as long ones per factor of two: heterogeneous, like real traffic) and
    Poisson arrivals at ``rate`` requests per second (None: all arrive at time 0)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    for name, (lo, hi) in (("prompt_lens", prompt_lens), ("output_lens", output_lens)):
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"{name} must be (lo, hi) ints with 1 <= lo <= hi, got {(lo, hi)!r}")
    if rate is not None and not rate > 0:
        raise ValueError(f"rate must be positive or None, got {rate!r}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if rate is not None and i > 0:
            t += rng.expovariate(rate)
        p = _log_uniform(rng, *prompt_lens)
        out.append(
            Request(i, t, [rng.randrange(vocab) for _ in range(p)], _log_uniform(rng, *output_lens))
        )
    return out


# ----------------------------------------------------------------------------- metrics


def percentile(values, q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation; nan for no values."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(requests: list[Request]) -> dict:
    """Throughput and latency percentiles of a finished run (seconds, tokens per second).

    TTFT: arrival to first token. TPOT: the mean time between a request's later tokens,
    ``(finish - first token) / (output tokens - 1)``. E2E: arrival to last token."""
    done = [r for r in requests if r.finished_at is not None]
    if len(done) != len(requests):
        raise ValueError(f"{len(requests) - len(done)} requests did not finish")
    ttft = [r.first_token_at - r.arrival for r in done]
    tpot = [(r.finished_at - r.first_token_at) / (r.max_new - 1) for r in done if r.max_new > 1]
    e2e = [r.finished_at - r.arrival for r in done]
    span = max(r.finished_at for r in done) - min(r.arrival for r in done)
    tokens = sum(r.max_new for r in done)
    out = {"requests": len(done), "tokens": tokens, "span_s": span, "tokens_per_s": tokens / span}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        out[f"{name}_mean"] = statistics.fmean(xs) if xs else float("nan")
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = percentile(xs, q)
    return out


# ----------------------------------------------------------------------------- the engine


@dataclass
class _Seq:
    req: Request
    slot: int
    prefilled: int = 0  # prompt tokens already in the cache
    cached: int = 0  # tokens in the cache (prompt, then generated tokens but the last)
    done: bool = False


@dataclass
class RunResult:
    policy: str
    requests: list[Request]
    # (time, decode batch size) after every decode step, (time, prompt tokens) after every prefill
    steps: list[tuple[float, int]]
    prefills: list[tuple[float, int]]
    peak_blocks: int

    def summary(self) -> dict:
        return summarize(self.requests) | {"policy": self.policy, "peak_blocks": self.peak_blocks}


class Engine:
    """A serving loop for ``model`` with ``max_batch`` sequence slots of up to ``max_tokens``
    tokens each, in a paged cache of ``block_size``-token blocks (enough blocks for every slot at
    full length, so nothing is ever preempted). On a GPU the decode step of all ``max_batch`` slots
    is one CUDA graph, replayed every iteration; idle slots point at the null block."""

    def __init__(
        self,
        model: Decoder,
        *,
        max_batch: int,
        max_tokens: int,
        block_size: int = 16,
        cuda_graph: bool | None = None,
    ):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be a positive int, got {max_batch!r}")
        if not isinstance(max_tokens, int) or not 1 < max_tokens <= model.max_position:
            raise ValueError(
                f"max_tokens must be an int in (1, {model.max_position}], got {max_tokens!r}"
            )
        self.model, self.max_batch, self.max_tokens = model, max_batch, max_tokens
        self.cache = model.new_cache(max_batch, max_tokens, block_size=block_size, contiguous=False)
        # The decode step reads its own copy of the block table, in which the rows of slots that
        # are not decoding (free, finished, or half-way through a chunked prefill) point at the
        # null block: the step writes a K/V row for every slot, and must not touch their blocks.
        table = torch.zeros_like(self.cache.block_table_cpu)
        self.decode_cache = dataclasses.replace(
            self.cache, block_table=table.to(model.device), block_table_cpu=table
        )
        slots = torch.arange(max_batch, device=model.device)
        use_graph = device.GPU_MODE if cuda_graph is None else cuda_graph
        if use_graph and not device.GPU_MODE:
            raise ValueError("cuda_graph=True needs a GPU")
        self.step = None
        if use_graph:
            # Warm up (and autotune) at a typical length; the table points at the null block.
            half = max_tokens // 2
            self.step = GraphedDecodeStep(model, self.decode_cache, slots, warmup_start=half)
            # A one-token prefill (a prompt, or the tail of a chunked one) is a one-sequence decode:
            # tune that shape now rather than in the middle of a timed run.
            one = slots[:1]
            model(one[:, None], self.decode_cache, one, one + half)
        self._slots = slots

    # --------------------------------------------------------------------------------- steps

    def _decode(self, active: list[_Seq]) -> list[int]:
        """One decode step for every slot (idle ones compute garbage on the null block)."""
        tokens, start = [0] * self.max_batch, [0] * self.max_batch
        for s in active:
            self.cache.ensure(s.slot, s.cached + 1)
            tokens[s.slot], start[s.slot] = s.req.output[-1], s.cached
        rows = torch.tensor([s.slot for s in active], dtype=torch.long)
        table = self.decode_cache.block_table_cpu
        table.zero_()
        table[rows] = self.cache.block_table_cpu[rows]
        self.decode_cache._dirty = True
        self.decode_cache.sync()
        dev = self.model.device
        tokens_d, start_d = torch.tensor(tokens, device=dev), torch.tensor(start, device=dev)
        if self.step is not None:
            nxt = self.step(tokens_d, start_d)
        else:
            nxt = self.model(tokens_d[:, None], self.decode_cache, self._slots, start_d).argmax(-1)
        return nxt.tolist()  # synchronises: the tokens go back to the host, as they would to a user

    def _prefill(self, s: _Seq, n: int) -> int | None:
        """Prefill the next ``n`` prompt tokens of ``s``; the first output token once it is done."""
        req, dev = s.req, self.model.device
        self.cache.ensure(s.slot, s.prefilled + n)
        self.cache.sync()
        toks = torch.tensor([req.prompt[s.prefilled : s.prefilled + n]], device=dev)
        slot = torch.tensor([s.slot], device=dev)
        start = torch.tensor([s.prefilled], device=dev)
        logits = self.model(toks, self.cache, slot, start, prefix=s.prefilled)
        s.prefilled += n
        s.cached = s.prefilled
        if s.prefilled < req.prompt_len:
            return None
        return int(logits.argmax(-1))

    # --------------------------------------------------------------------------------- the loop

    def run(self, trace: list[Request], policy: str = "continuous", *, prefill_chunk: int = 512):
        """Serve ``trace`` (its requests are reset and filled in) under ``policy``."""
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if policy == "chunked" and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk must be a positive int, got {prefill_chunk!r}")
        for r in trace:
            if r.prompt_len + r.max_new > self.max_tokens:
                raise ValueError(
                    f"request {r.rid} needs {r.prompt_len + r.max_new} tokens, more than "
                    f"max_tokens={self.max_tokens}"
                )
            r.reset()
        pending = deque(sorted(trace, key=lambda r: r.arrival))
        waiting: deque[Request] = deque()
        free = list(range(self.max_batch - 1, -1, -1))
        batch: list[_Seq] = []  # admitted sequences, in admission order
        steps, prefills, peak = [], [], 0
        device.synchronize()
        t0, skipped = time.perf_counter(), 0.0

        def now() -> float:
            return time.perf_counter() - t0 + skipped

        while pending or waiting or batch:
            while pending and pending[0].arrival <= now():
                waiting.append(pending.popleft())
            if not waiting and not batch:
                skipped += pending[0].arrival - now()  # idle: jump to the next arrival
                continue
            # Admission. Static: only into an empty engine, a whole batch at once.
            if policy != "static" or not batch:
                while waiting and free:
                    batch.append(_Seq(waiting.popleft(), free.pop()))
            # Prefill: whole prompts, or at most prefill_chunk prompt tokens per iteration.
            budget = prefill_chunk if policy == "chunked" else math.inf
            for s in batch:
                if s.prefilled == s.req.prompt_len or budget <= 0:
                    continue
                n = int(min(budget, s.req.prompt_len - s.prefilled))
                first = self._prefill(s, n)
                budget -= n
                if first is not None:
                    s.req.output.append(first)
                    s.req.first_token_at = now()  # .argmax() -> int synchronised
                    prefills.append((s.req.first_token_at, s.req.prompt_len))
                    if s.req.max_new == 1:
                        s.done, s.req.finished_at = True, s.req.first_token_at
            # One decode step for every sequence that has its first token and more to generate.
            active = [s for s in batch if not s.done and s.req.output]
            if active:
                nxt = self._decode(active)
                t = now()
                steps.append((t, len(active)))
                for s in active:
                    s.cached += 1
                    s.req.output.append(nxt[s.slot])
                    if len(s.req.output) == s.req.max_new:
                        s.done, s.req.finished_at = True, t
            peak = max(peak, self.cache.allocator.num_used)
            # Release. Continuous: each finished sequence at once. Static: the batch, when all done.
            if policy != "static" or all(s.done for s in batch):
                for s in [s for s in batch if s.done]:
                    self.cache.free(s.slot)
                    free.append(s.slot)
                    batch.remove(s)
        return RunResult(policy, trace, steps, prefills, peak)


# ----------------------------------------------------------------------------- KV memory


class _FirstFit:
    """Contiguous allocation over ``[0, capacity)`` tokens: the first free hole that fits."""

    def __init__(self, capacity: int):
        self.holes = [(0, capacity)]  # sorted (start, length)

    def alloc(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self.holes):
            if length >= n:
                self.holes[i : i + 1] = [(start + n, length - n)] if length > n else []
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect(self.holes, (start, 0))
        self.holes.insert(i, (start, n))
        merged = []
        for s, ln in self.holes:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + ln)
            else:
                merged.append((s, ln))
        self.holes = merged


KV_SCHEMES = ("max_len", "reserve", "paged")


def simulate_kv_memory(
    requests: list[tuple[int, int]],
    *,
    capacity_tokens: int,
    scheme: str,
    max_len: int,
    max_new: int,
    block_size: int = 16,
    watermark: float = 0.01,
) -> dict:
    """Serve ``requests`` ((prompt, output) lengths, all waiting at time 0, first come first
    served) with a KV cache of ``capacity_tokens`` tokens, one generated token per running request
    per step, and count where the memory goes.

    ``scheme``: ``"max_len"`` reserves a contiguous ``max_len``-token slab per request (a cache
    preallocated for the model's longest sequence); ``"reserve"`` a contiguous slab of prompt +
    ``max_new`` tokens (the most the request may generate), placed first-fit; ``"paged"`` takes
    ``block_size``-token blocks as tokens arrive, and when the pool runs dry preempts the most
    recently admitted request (its blocks are freed and it is recomputed later, as vLLM does);
    a request is admitted only if ``watermark`` of the pool stays free after its prompt.

    Returns per-step series ``used`` (tokens stored), ``held`` (tokens allocated) and ``running``,
    and ``steps``, ``utilisation`` (stored over allocated), ``fill`` (stored over capacity), both
    averaged over steps, ``mean_running`` and ``preemptions``."""
    if scheme not in KV_SCHEMES:
        raise ValueError(f"scheme must be one of {KV_SCHEMES}, got {scheme!r}")
    for p, o in requests:
        if p + o > max_len or o > max_new or p < 1 or o < 1:
            raise ValueError(
                f"request ({p}, {o}) does not fit max_len={max_len}, max_new={max_new}"
            )
    queue = deque(requests)
    running: list[list] = []  # [prompt, output, generated, held tokens, contiguous start]
    ff = _FirstFit(capacity_tokens)
    free_blocks = capacity_tokens // block_size
    keep_free = int(watermark * free_blocks)
    used, held, n_running, preemptions = [], [], [], 0
    while queue or running:
        # Admission, first come first served: stop at the first request that does not fit. A
        # paged request needs its prompt's blocks now and the rest as it grows.
        while queue:
            p, o = queue[0]
            if scheme == "paged":
                need = -(-p // block_size)
                if need > free_blocks or (running and need + keep_free > free_blocks):
                    break
                free_blocks -= need
                running.append([p, o, 0, need * block_size, None])
            else:
                n = max_len if scheme == "max_len" else p + max_new
                start = ff.alloc(n)
                if start is None:
                    break
                running.append([p, o, 0, n, start])
            queue.popleft()
        if not running:
            raise ValueError(f"capacity_tokens={capacity_tokens} cannot hold a single request")
        # One decode step: every running request stores one more token.
        for r in list(running):
            if r not in running:  # preempted in this step
                continue
            if scheme == "paged" and r[0] + r[2] + 1 > r[3]:
                while free_blocks == 0 and len(running) > 1:
                    victim = running.pop()  # the youngest (maybe r): recompute it later
                    free_blocks += victim[3] // block_size
                    queue.appendleft((victim[0], victim[1]))
                    preemptions += 1
                    if victim is r:
                        break
                if r not in running:
                    continue
                if free_blocks == 0:
                    raise MemoryError(
                        f"capacity_tokens={capacity_tokens} is too small for one request"
                    )
                free_blocks -= 1
                r[3] += block_size
            r[2] += 1
        used.append(sum(r[0] + r[2] for r in running))
        held.append(sum(r[3] for r in running))
        n_running.append(len(running))
        for r in [r for r in running if r[2] == r[1]]:
            running.remove(r)
            if scheme == "paged":
                free_blocks += r[3] // block_size
            else:
                ff.free(r[4], r[3])
    return {
        "scheme": scheme,
        "steps": len(used),
        "used": used,
        "held": held,
        "running": n_running,
        "utilisation": statistics.fmean(u / max(h, 1) for u, h in zip(used, held)),
        "fill": statistics.fmean(u / capacity_tokens for u in used),
        "mean_running": statistics.fmean(n_running),
        "preemptions": preemptions,
        "capacity_tokens": capacity_tokens,
    }


# ----------------------------------------------------------------------------- speculative decoding


def expected_tokens_per_round(alpha: float, k: int) -> float:
    """Tokens a round of speculative decoding yields when each draft token is accepted with
    probability ``alpha`` independently: ``(1 - alpha^(k+1)) / (1 - alpha)``."""
    _check_alpha_k(alpha, k)
    return k + 1.0 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """Leviathan et al.'s expected walltime improvement, ``(1 - a^(k+1)) / ((1 - a)(k c + 1))``:
    tokens per round over the cost of a round (``k`` draft steps of relative cost ``c`` and one
    target pass, in units of a target step)."""
    if not c >= 0:
        raise ValueError(f"c must be >= 0, got {c!r}")
    return expected_tokens_per_round(alpha, k) / (k * c + 1)


def _check_alpha_k(alpha, k):
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive int, got {k!r}")


@dataclass
class SpecStats:
    k: int
    rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    tested: int = 0  # draft tokens the target judged: up to and including the first rejection
    seconds: float = 0.0

    @property
    def alpha(self) -> float:
        """Estimated per-token acceptance rate: accepted over judged (the maximum-likelihood
        estimate when acceptances are independent with one probability)."""
        return self.accepted / self.tested if self.tested else float("nan")

    @property
    def tokens_per_round(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else float("nan")


def _check_spec_call(target, draft, prompt, max_new, k) -> None:
    """The arguments every speculative decoder takes, checked once."""
    _check_alpha_k(0.0, k)
    if not isinstance(prompt, torch.Tensor) or prompt.ndim != 1 or prompt.dtype != torch.long:
        raise ValueError("prompt must be a 1-D int64 tensor")
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise ValueError(f"max_new must be a positive int, got {max_new!r}")
    if draft.cfg.vocab != target.cfg.vocab:
        raise ValueError("draft and target must share the vocabulary")


@torch.inference_mode()
def speculative_generate_legacy(
    target: Decoder, draft: Decoder, prompt: torch.Tensor, max_new: int, k: int
) -> tuple[torch.Tensor, SpecStats]:
    """Greedy speculative decoding of one sequence: the draft proposes ``k`` tokens one at a time,
    the target scores all of them in one pass, and the longest prefix on which the target's own
    greedy choice agrees is kept, plus the target's token at the first disagreement (or after the
    last draft token). The output is therefore the target's greedy output, whatever the draft
    does. Returns the ``max_new`` new tokens and the acceptance statistics.

    The first implementation, kept as the baseline of ``scripts/gpu/serving_probe.py``: eager,
    a host-to-device copy (a synchronisation) for every position tensor, a draft catch-up and a
    verification through the extend path whose shapes change every round, and the acceptance
    decided on the host. ``speculative_generate`` is the same algorithm without those costs."""
    _check_spec_call(target, draft, prompt, max_new, k)
    dev = target.device
    p = prompt.shape[0]
    length = p + max_new + k + 1
    tcache, dcache = target.new_cache(1, length), draft.new_cache(1, length)
    slot = torch.zeros(1, dtype=torch.long, device=dev)
    stats = SpecStats(k)
    device.synchronize()
    t0 = time.perf_counter()

    def at(n):
        return torch.tensor([n], device=dev)

    seq = prompt.to(dev)
    first = target(seq[None], tcache, slot, at(0), prefix=0).argmax(-1)
    draft(seq[None], dcache, slot, at(0), prefix=0)
    seq = torch.cat([seq, first])
    n_t = n_d = p  # tokens in the target's and the draft's caches (all agree with seq)
    while seq.shape[0] - p < max_new:
        s = seq.shape[0]
        # Draft: catch up on the tokens it has not seen, then propose k tokens.
        y = [draft(seq[None, n_d:], dcache, slot, at(n_d), prefix=n_d).argmax(-1)]
        n_d = s
        for _ in range(k - 1):
            y.append(draft(y[-1][None], dcache, slot, at(n_d)).argmax(-1))
            n_d += 1
        ys = torch.cat(y)  # [k]
        # Target: one pass over the last accepted token and the k proposals.
        verify = torch.cat([seq[-1:], ys])[None]
        g = target(verify, tcache, slot, at(n_t), prefix=n_t, all_logits=True).argmax(-1)[0]
        agree = (ys == g[:k]).tolist()  # synchronises: the host decides how many to keep
        a = agree.index(False) if False in agree else k
        seq = torch.cat([seq, ys[:a], g[a : a + 1]])
        n_t = s + a
        n_d = s + min(a, k - 1)
        stats.rounds += 1
        stats.proposed += k
        stats.accepted += a
        stats.tested += min(a + 1, k)
    device.synchronize()
    stats.seconds = time.perf_counter() - t0
    return seq[p : p + max_new], stats


class SpeculativeDecoder:
    """Greedy speculative decoding of one sequence with static shapes: a round is one CUDA graph.

    A round, for a sequence of ``L`` tokens whose last token the target has not yet cached:

    1. the draft runs its last two tokens (positions ``L-2, L-1``; the first is already in its
       cache and is rewritten, so the catch-up always has two tokens, whatever was accepted) and
       then ``k - 1`` decode steps: ``k`` proposals;
    2. the target runs the last token and the ``k`` proposals in one ``paged`` pass (each token a
       decode-kernel query over the pages up to itself);
    3. on the device: ``a``, the number of leading proposals equal to the target's greedy choices,
       and the next round's two last tokens and position.

    The round's new tokens are the target's choices ``g[0..a]`` (the accepted proposals equal
    them), so the output is the target's greedy output. The host reads ``[a, g]`` once per round
    (one synchronisation) and replays. Caches, static buffers and the graph are made once
    (``max_tokens``: prompt + new tokens the decoder will be asked for, at most) and reused by
    ``generate`` for any prompt; capture (warm-up and autotuning included) happens in
    ``__init__``, outside any timing. Without a GPU the round runs eagerly, the same code."""

    def __init__(
        self,
        target: Decoder,
        draft: Decoder,
        k: int,
        max_tokens: int,
        *,
        cuda_graph: bool | None = None,
        warmup: int = 2,
    ):
        _check_alpha_k(0.0, k)
        if draft.cfg.vocab != target.cfg.vocab:
            raise ValueError("draft and target must share the vocabulary")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 2:
            raise ValueError(f"max_tokens must be an int >= 2, got {max_tokens!r}")
        self.target, self.draft, self.k, self.max_tokens = target, draft, k, max_tokens
        dev = target.device
        length = max_tokens + k + 1
        self.tcache, self.dcache = target.new_cache(1, length), draft.new_cache(1, length)
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)
        self.tok2 = torch.zeros(1, 2, dtype=torch.long, device=dev)  # the sequence's last two
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # position of tok2[0]
        self.offs = torch.arange(2, device=dev)
        use_graph = device.GPU_MODE if cuda_graph is None else cuda_graph
        if use_graph and not device.GPU_MODE:
            raise ValueError("cuda_graph=True needs a GPU")
        self.graph = None
        if use_graph:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.inference_mode():
                for _ in range(warmup):
                    self.tok2.zero_()
                    self.pos.zero_()
                    self._round()
            torch.cuda.current_stream().wait_stream(side)
            self.tok2.zero_()
            self.pos.zero_()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), torch.inference_mode():
                self.result = self._round()
            torch.cuda.synchronize()

    def _round(self) -> torch.Tensor:
        """One round on the static buffers; returns ``int64[k + 2]``: ``a`` then ``g[0..k]``."""
        k, slot = self.k, self.slot
        logits = self.draft(self.tok2, self.dcache, slot, self.pos, paged=True)
        y = logits.argmax(-1)  # [1]
        ys = [y]
        for i in range(k - 1):
            y = self.draft(y[:, None], self.dcache, slot, self.pos + (2 + i)).argmax(-1)
            ys.append(y)
        ys = torch.cat(ys)  # [k]
        last = self.tok2[0, 1:]
        verify = torch.cat([last, ys])[None]  # [1, k + 1]
        g = self.target(
            verify, self.tcache, slot, self.pos + 1, all_logits=True, paged=True
        ).argmax(-1)[0]  # [k + 1]
        a = (ys == g[:k]).long().cumprod(0).sum()  # leading agreements
        # Next round: the sequence grew by g[0..a]; its last two tokens are full[a], full[a + 1].
        full = torch.cat([last, g])  # [k + 2]
        self.tok2.copy_(full.gather(0, a + self.offs)[None])
        self.pos.add_(a + 1)
        return torch.cat([a[None], g])

    @torch.inference_mode()
    def generate(self, prompt: torch.Tensor, max_new: int) -> tuple[torch.Tensor, SpecStats]:
        """The ``max_new`` new tokens after ``prompt`` and the acceptance statistics; ``seconds``
        covers the prefills and the rounds (not the construction)."""
        _check_spec_call(self.target, self.draft, prompt, max_new, self.k)
        p, k = prompt.shape[0], self.k
        if p + max_new > self.max_tokens:
            raise ValueError(f"prompt + max_new ({p + max_new}) exceeds max_tokens")
        dev = self.target.device
        stats = SpecStats(k)
        seq = prompt.to(dev)
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        device.synchronize()
        t0 = time.perf_counter()
        first = self.target(seq[None], self.tcache, self.slot, zero, prefix=0).argmax(-1)
        self.draft(seq[None], self.dcache, self.slot, zero, prefix=0)
        # The draft's catch-up rewrites the prompt's last token and adds the first new one.
        self.tok2.copy_(torch.stack([seq[-1], first[0]])[None])
        self.pos.fill_(p - 1)
        out = [first]
        n = 1
        while n < max_new:
            if self.graph is not None:
                self.graph.replay()
                res = self.result
            else:
                res = self._round()
            r = res.tolist()  # the one synchronisation of a round
            a = r[0]
            out.append(res[1 : a + 2].clone())
            n += a + 1
            stats.rounds += 1
            stats.proposed += k
            stats.accepted += a
            stats.tested += min(a + 1, k)
        toks = torch.cat(out)[:max_new]
        device.synchronize()
        stats.seconds = time.perf_counter() - t0
        return toks, stats


@torch.inference_mode()
def speculative_generate(
    target: Decoder,
    draft: Decoder,
    prompt: torch.Tensor,
    max_new: int,
    k: int,
    *,
    runner: SpeculativeDecoder | None = None,
) -> tuple[torch.Tensor, SpecStats]:
    """Greedy speculative decoding of one sequence: the draft proposes ``k`` tokens one at a time,
    the target scores all of them in one pass, and the longest prefix on which the target's own
    greedy choice agrees is kept, plus the target's token at the first disagreement (or after the
    last draft token). The output is therefore the target's greedy output, whatever the draft
    does. Returns the ``max_new`` new tokens and the acceptance statistics.

    Runs a ``SpeculativeDecoder`` (one CUDA graph per round on a GPU); pass ``runner`` to reuse
    one across prompts, else one is built (and captured) here, before the timed region.
    ``speculative_generate_legacy`` is the first, eager implementation."""
    _check_spec_call(target, draft, prompt, max_new, k)
    if runner is None:
        runner = SpeculativeDecoder(target, draft, k, prompt.shape[0] + max_new)
    elif runner.target is not target or runner.draft is not draft or runner.k != k:
        raise ValueError("runner was built for another target, draft or k")
    return runner.generate(prompt, max_new)


@torch.inference_mode()
def greedy_generate(
    model: Decoder, prompt: torch.Tensor, max_new: int, *, cuda_graph: bool = False
) -> tuple[torch.Tensor, float]:
    """The target alone, one decode step per token: ``(tokens, seconds)``. With ``cuda_graph``
    (a GPU) each step is a replay of a ``GraphedDecodeStep`` captured before the timed region:
    the baseline a graphed speculative decoder should be compared with."""
    if not cuda_graph:
        device.synchronize()
        t0 = time.perf_counter()
        out = model.generate(prompt.to(model.device)[None], max_new)[0]
        device.synchronize()
        return out, time.perf_counter() - t0
    if not device.GPU_MODE:
        raise ValueError("cuda_graph=True needs a GPU")
    dev, p = model.device, prompt.shape[0]
    cache = model.new_cache(1, p + max_new)
    slot = torch.zeros(1, dtype=torch.long, device=dev)
    step = GraphedDecodeStep(model, cache, slot, warmup_start=p)
    seq = prompt.to(dev)[None]
    device.synchronize()
    t0 = time.perf_counter()
    nxt = model(seq, cache, slot, slot, prefix=0).argmax(-1)  # slot is 0: nothing cached
    out = [nxt]
    step.start.fill_(p)
    for _ in range(max_new - 1):
        step.tokens[:, 0].copy_(nxt)
        nxt = step.replay().clone()
        step.start.add_(1)
        out.append(nxt)
    toks = torch.cat(out)
    device.synchronize()
    return toks, time.perf_counter() - t0
