import dataclasses

import pytest
import torch

from kernels import decoder as dec
from kernels import device
from kernels import serving as sv

FOUR = dataclasses.replace(dec.TINY, name="four", n_layers=4)


@pytest.fixture(scope="module")
def model():
    m = dec.Decoder(dec.TINY, dtype=torch.float32, device=device.DEVICE)
    if not device.GPU_MODE:
        m.decode_attention = "torch"  # the interpreter is slow; the kernel has its own tests
    return m


def _greedy(model, req):
    return model.generate(torch.tensor([req.prompt], device=model.device), req.max_new)[0].tolist()


def test_make_trace():
    tr = sv.make_trace(50, vocab=100, prompt_lens=(3, 40), output_lens=(1, 9), rate=10.0, seed=1)
    assert [r.rid for r in tr] == list(range(50))
    assert all(3 <= r.prompt_len <= 40 and 1 <= r.max_new <= 9 for r in tr)
    assert all(0 <= t < 100 for r in tr for t in r.prompt)
    arrivals = [r.arrival for r in tr]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0 and arrivals[-1] > 0
    same = sv.make_trace(50, vocab=100, prompt_lens=(3, 40), output_lens=(1, 9), rate=10.0, seed=1)
    assert [(r.prompt, r.max_new, r.arrival) for r in same] == [
        (r.prompt, r.max_new, r.arrival) for r in tr
    ]
    assert all(r.arrival == 0 for r in sv.make_trace(5, vocab=10))
    with pytest.raises(ValueError, match="prompt_lens"):
        sv.make_trace(3, vocab=10, prompt_lens=(5, 2))
    with pytest.raises(ValueError, match="rate"):
        sv.make_trace(3, vocab=10, rate=0.0)


def test_summarize():
    reqs = [sv.Request(0, 0.0, [1], 3), sv.Request(1, 1.0, [1, 2], 1)]
    reqs[0].first_token_at, reqs[0].finished_at = 0.5, 1.5
    reqs[1].first_token_at = reqs[1].finished_at = 2.0
    s = sv.summarize(reqs)
    assert s["tokens"] == 4 and s["span_s"] == 2.0 and s["tokens_per_s"] == 2.0
    assert s["ttft_p50"] == 0.75 and s["tpot_p50"] == 0.5 and s["e2e_p99"] == pytest.approx(1.495)
    assert sv.percentile([1, 2, 3, 4], 50) == 2.5
    reqs[1].finished_at = None
    with pytest.raises(ValueError, match="did not finish"):
        sv.summarize(reqs)


@pytest.mark.parametrize("policy", sv.POLICIES)
def test_engine_outputs_are_greedy(model, policy):
    tr = sv.make_trace(
        7, vocab=model.cfg.vocab, prompt_lens=(2, 30), output_lens=(1, 12), rate=500.0, seed=2
    )
    eng = sv.Engine(model, max_batch=3, max_tokens=48, block_size=4)
    res = eng.run(tr, policy, prefill_chunk=8)
    for r in tr:
        assert r.output == _greedy(model, r), r.rid
        assert r.arrival <= r.first_token_at <= r.finished_at
    assert eng.cache.allocator.num_used == 0  # every block came back
    assert sum(n for _, n in res.steps) == sum(r.max_new - 1 for r in tr)
    assert res.summary()["policy"] == policy


def test_static_waits_for_the_whole_batch_continuous_does_not(model):
    # Two slots; a short and a long request first, then a short one. Static batching starts the
    # third only when the long one is done; continuous batching as soon as the short one is.
    def trace():
        return [
            sv.Request(0, 0.0, [1, 2], 2),
            sv.Request(1, 0.0, [3, 4], 12),
            sv.Request(2, 0.0, [5], 2),
        ]

    eng = sv.Engine(model, max_batch=2, max_tokens=16, block_size=4)
    static = eng.run(trace(), "static").requests
    assert static[2].first_token_at >= static[1].finished_at
    cont = eng.run(trace(), "continuous").requests
    assert cont[2].first_token_at < cont[1].finished_at


def test_chunked_prefill_spreads_a_long_prompt(model):
    tr = [sv.Request(0, 0.0, list(range(40)), 3)]
    eng = sv.Engine(model, max_batch=1, max_tokens=48, block_size=8)
    res = eng.run(tr, "chunked", prefill_chunk=16)
    assert len(res.prefills) == 1 and tr[0].output == _greedy(model, tr[0])
    with pytest.raises(ValueError, match="policy"):
        eng.run(tr, "fifo")
    with pytest.raises(ValueError, match="max_tokens"):
        eng.run([sv.Request(0, 0.0, list(range(40)), 9)])


def test_kv_memory_schemes():
    tr = sv.make_trace(120, vocab=10, prompt_lens=(10, 300), output_lens=(5, 200), seed=3)
    reqs = [(r.prompt_len, r.max_new) for r in tr]
    runs = {
        s: sv.simulate_kv_memory(reqs, capacity_tokens=4096, scheme=s, max_len=512, max_new=200)
        for s in sv.KV_SCHEMES
    }
    for r in runs.values():
        assert all(u <= h <= 4096 for u, h in zip(r["used"], r["held"]))
    # The tokens actually stored are the same work; paging wastes least and so runs the most
    # requests at once and drains the queue in the fewest steps.
    assert (
        runs["paged"]["utilisation"]
        > runs["reserve"]["utilisation"]
        > runs["max_len"]["utilisation"]
    )
    assert runs["paged"]["mean_running"] > runs["max_len"]["mean_running"]
    assert runs["paged"]["steps"] < runs["max_len"]["steps"]
    assert runs["max_len"]["mean_running"] <= 4096 // 512
    with pytest.raises(ValueError, match="scheme"):
        sv.simulate_kv_memory(reqs, capacity_tokens=4096, scheme="lru", max_len=512, max_new=200)
    with pytest.raises(ValueError, match="cannot hold"):
        sv.simulate_kv_memory(
            [(300, 5)], capacity_tokens=256, scheme="reserve", max_len=512, max_new=200
        )


def test_paged_pool_preempts_instead_of_failing():
    # Six requests whose prompts fit together but whose outputs do not: the youngest are preempted
    # (and recomputed), every request still finishes, and memory never overflows.
    reqs = [(30, 60)] * 6
    r = sv.simulate_kv_memory(reqs, capacity_tokens=320, scheme="paged", max_len=128, max_new=64,
                              block_size=16, watermark=0.0)  # fmt: skip
    assert r["preemptions"] > 0 and max(r["held"]) <= 320
    assert sum(1 for a, b in zip(r["running"], r["running"][1:]) if b < a) >= 1
    with pytest.raises(MemoryError, match="too small"):
        sv.simulate_kv_memory(
            [(30, 60)], capacity_tokens=64, scheme="paged", max_len=128, max_new=64
        )


def test_first_fit_merges_holes():
    ff = sv._FirstFit(10)
    a, b, c = ff.alloc(3), ff.alloc(3), ff.alloc(3)
    assert (a, b, c) == (0, 3, 6) and ff.alloc(2) is None
    ff.free(a, 3)
    ff.free(c, 3)
    assert ff.alloc(4) == 6  # the hole at 6 merged with the free tail
    ff.free(b, 3)
    assert ff.holes == [(0, 6)]


def test_expected_speedup():
    assert sv.expected_speedup(0.0, 4, 0.1) == pytest.approx(1 / 1.4)  # one token per round
    assert sv.expected_speedup(1.0, 4, 0.0) == 5.0
    assert sv.expected_tokens_per_round(0.8, 4) == pytest.approx((1 - 0.8**5) / 0.2)
    assert sv.expected_speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8**5) / 0.2 / 1.2)
    with pytest.raises(ValueError, match="alpha"):
        sv.expected_speedup(1.5, 4, 0.1)
    with pytest.raises(ValueError, match="k must"):
        sv.expected_speedup(0.5, 0, 0.1)


@pytest.mark.parametrize("scale, k", [(0.0, 3), (0.2, 4), (1.0, 2)])
def test_speculative_output_is_the_targets(scale, k):
    target = dec.Decoder(
        FOUR, dtype=torch.float32, device=device.DEVICE, tail_from=1, tail_scale=scale
    )
    if not device.GPU_MODE:
        target.decode_attention = "torch"
    draft = target.truncated(1)
    prompt = torch.randint(FOUR.vocab, (9,), generator=torch.Generator().manual_seed(5))
    want, _ = sv.greedy_generate(target, prompt, 25)
    got, stats = sv.speculative_generate(target, draft, prompt, 25, k)
    assert torch.equal(got.cpu(), want.cpu())
    assert stats.proposed == k * stats.rounds and stats.accepted <= stats.tested <= stats.proposed
    assert stats.accepted + stats.rounds >= 24  # every round yields its accepted tokens plus one
    if scale == 0.0:  # the draft computes the target's function: every token is accepted
        assert stats.alpha == 1.0 and stats.tokens_per_round == k + 1
    if scale == 1.0:
        assert stats.alpha < 0.9


def test_speculative_runner_reuse_and_legacy_agree():
    target = dec.Decoder(FOUR, dtype=torch.float32, device=device.DEVICE, tail_from=1,
                         tail_scale=0.3)  # fmt: skip
    if not device.GPU_MODE:
        target.decode_attention = "torch"
    draft = target.truncated(1)
    runner = sv.SpeculativeDecoder(target, draft, 3, 40)
    for seed, (p, n) in enumerate([(9, 20), (1, 7), (14, 26)]):
        prompt = torch.randint(FOUR.vocab, (p,), generator=torch.Generator().manual_seed(seed))
        want, _ = sv.greedy_generate(target, prompt, n)
        got, stats = sv.speculative_generate(target, draft, prompt, n, 3, runner=runner)
        old, old_stats = sv.speculative_generate_legacy(target, draft, prompt, n, 3)
        assert torch.equal(got.cpu(), want.cpu()) and torch.equal(old.cpu(), want.cpu())
        assert stats.accepted + stats.rounds >= n - 1
    with pytest.raises(ValueError, match="runner"):
        sv.speculative_generate(target, draft, prompt, 5, 2, runner=runner)


def test_paged_multi_token_pass_matches_extend(model):
    cache_a, cache_b = model.new_cache(1, 32), model.new_cache(1, 32)
    slot = torch.zeros(1, dtype=torch.long, device=model.device)
    toks = torch.randint(model.cfg.vocab, (1, 12), generator=torch.Generator().manual_seed(0))
    toks = toks.to(model.device)
    for c in (cache_a, cache_b):
        model(toks[:, :7], c, slot, slot, prefix=0)
    start = torch.full((1,), 7, device=model.device)
    ext = model(toks[:, 7:], cache_a, slot, start, prefix=7, all_logits=True)
    pgd = model(toks[:, 7:], cache_b, slot, start, all_logits=True, paged=True)
    torch.testing.assert_close(pgd, ext, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache_b.k, cache_a.k)
