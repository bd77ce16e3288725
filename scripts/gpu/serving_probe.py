"""Act 6 serving probe: old vs new speculative rounds, chunked vs continuous. One device call:

    python scripts/gpu/serving_probe.py            # BRRR_2B on a GPU (TINY on the CPU: not timings)

Prints compact tables:
1. per-shape one-off cost of the old extend path (first vs second call at a fresh length), and the
   SDPA backend flags: tests the hypothesis that masked SDPA plans per shape;
2. speculative decoding, tail_scale x k: ms per round and speed-up of the legacy loop (vs eager
   greedy, as the notebook measured) and of the graphed ``SpeculativeDecoder`` (vs eager and vs
   graphed greedy), acceptance, formula; exactness of the new path vs greedy is reported;
3. a short trace through continuous and chunked policies (tokens/s, TTFT, TPOT).
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from kernels import bench, device  # noqa: E402
from kernels import decoder as dec  # noqa: E402
from kernels import serving as sv  # noqa: E402

GPU = device.GPU_MODE
DTYPE = torch.bfloat16 if GPU else torch.float32
CFG = dec.default_config()
P_LEN, NEW = (64, 96) if GPU else (8, 12)
SCALES, KS = (0.0, 0.05, 0.1), (1, 2, 4)
N_PROMPTS = 3 if GPU else 1


def new_model(**kw):
    m = dec.Decoder(CFG, dtype=DTYPE, **kw)
    if not GPU:
        m.decode_attention = "torch"
    return m


def t0():
    device.synchronize()
    return time.perf_counter()


def extend_one_off(model):
    print(
        f"== extend path: first vs second call at a fresh length (ms); {device.describe().splitlines()[0]}"
    )
    if GPU:
        b = torch.backends.cuda
        print(
            f"   sdp enabled: flash {b.flash_sdp_enabled()} mem_eff {b.mem_efficient_sdp_enabled()} "
            f"math {b.math_sdp_enabled()} cudnn {b.cudnn_sdp_enabled()}"
        )
    cache = model.new_cache(1, 1024)
    slot = torch.zeros(1, dtype=torch.long, device=model.device)
    tok = torch.randint(CFG.vocab, (1, 1024), device=model.device)
    model(tok[:, :300], cache, slot, slot, prefix=0)
    for pre, t in ((301, 5), (333, 5), (517, 200), (611, 77)):
        st = torch.full((1,), pre, device=model.device)
        times = []
        for _ in range(2):
            s = t0()
            model(tok[:, pre : pre + t], cache, slot, st, prefix=pre, all_logits=True)
            times.append((t0() - s) * 1e3)
        s = t0()
        model(tok[:, pre : pre + t], cache, slot, st, all_logits=True, paged=True)
        paged = (t0() - s) * 1e3
        print(
            f"   prefix {pre:4d} + {t:3d}: extend first {times[0]:8.2f}  second {times[1]:7.2f}  paged {paged:7.2f}"
        )


def spec_table():
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(CFG.vocab, (P_LEN,), generator=gen) for _ in range(N_PROMPTS)]
    print(
        "== speculative: draft = layer 0 + head; ms/round; speed-ups over greedy eager (E) / graphed (G)"
    )
    print(
        f"{'scale':>6}{'k':>3}{'alpha':>7}{'tok/rd':>7}{'old ms/rd':>10}{'new ms/rd':>10}"
        f"{'old/E':>7}{'new/E':>7}{'new/G':>7}{'formula':>8}{'new==greedy':>12}"
    )
    c = None
    for scale in SCALES:
        target = new_model(tail_from=1, tail_scale=scale)
        draft = target.truncated(1)
        if c is None:
            cache_t, cache_d = target.new_cache(1, P_LEN + 1), draft.new_cache(1, P_LEN + 1)
            tk = torch.zeros(1, 1, dtype=torch.long, device=target.device)
            st = torch.full((1,), P_LEN, device=target.device)
            sl = torch.zeros(1, dtype=torch.long, device=target.device)
            tt = bench.measure(functools.partial(target, tk, cache_t, sl, st)).ms
            td = bench.measure(functools.partial(draft, tk, cache_d, sl, st)).ms
            c = td / tt
            print(f"   eager steps: target {tt * 1e3:.0f} us, draft {td * 1e3:.0f} us, c = {c:.2f}")
        # Warm-up of every path at this scale (compiles, autotuning, lazy init) before timing.
        sv.greedy_generate(target, prompts[0], NEW)
        if GPU:
            sv.greedy_generate(target, prompts[0], NEW, cuda_graph=True)
        for k in KS:
            sv.speculative_generate_legacy(target, draft, prompts[0], NEW, k)
            runner = sv.SpeculativeDecoder(target, draft, k, P_LEN + NEW)
            runner.generate(prompts[0], NEW)
            te = tg = to = tn = 0.0
            acc = tested = rounds = o_rounds = same = 0
            for p in prompts:
                want, s_e = sv.greedy_generate(target, p, NEW)
                te += s_e
                if GPU:
                    tg += sv.greedy_generate(target, p, NEW, cuda_graph=True)[1]
                _, so = sv.speculative_generate_legacy(target, draft, p, NEW, k)
                got, sn = sv.speculative_generate(target, draft, p, NEW, k, runner=runner)
                to, tn = to + so.seconds, tn + sn.seconds
                o_rounds += so.rounds
                acc, tested, rounds = acc + sn.accepted, tested + sn.tested, rounds + sn.rounds
                same += int(torch.equal(got.cpu(), want.cpu()))
            alpha = acc / tested if tested else float("nan")
            fml = sv.expected_speedup(min(alpha, 1.0), k, c)
            gcol = f"{tg / tn:6.2f}x" if GPU else f"{'-':>7}"
            print(
                f"{scale:>6.2f}{k:>3d}{alpha:>7.2f}{(acc + rounds) / rounds:>7.2f}"
                f"{to / o_rounds * 1e3:>10.2f}{tn / rounds * 1e3:>10.2f}"
                f"{te / to:>6.2f}x{te / tn:>6.2f}x{gcol}{fml:>7.2f}x{same:>8d}/{len(prompts)}"
            )
            del runner
        del target, draft


def chunk_table():
    model = new_model()
    prompt_lens, output_lens = ((32, 1024), (8, 256)) if GPU else ((4, 40), (2, 12))
    n, slots, chunk = (60, 32, 512) if GPU else (6, 3, 16)
    eng = sv.Engine(model, max_batch=slots, max_tokens=prompt_lens[1] + output_lens[1])
    tr = sv.make_trace(
        n,
        vocab=CFG.vocab,
        prompt_lens=prompt_lens,
        output_lens=output_lens,
        rate=40.0 if GPU else 100.0,
        seed=0,
    )
    eng.run(tr[: max(2, n // 6)], "chunked", prefill_chunk=chunk)  # warm-up: shapes, allocator
    eng.run(tr[: max(2, n // 6)], "continuous")
    print(f"== engine: {n} requests, {slots} slots, chunk {chunk}")
    print(
        f"{'policy':>11}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}  (ms)"
    )
    for pol in ("continuous", "chunked", "static"):
        s = eng.run(tr, pol, prefill_chunk=chunk).summary()
        print(
            f"{pol:>11}{s['tokens_per_s']:>9,.0f}{s['ttft_p50'] * 1e3:>10.1f}{s['ttft_p99'] * 1e3:>10.1f}"
            f"{s['tpot_p50'] * 1e3:>10.2f}{s['tpot_p99'] * 1e3:>10.2f}"
        )


if __name__ == "__main__":
    torch.manual_seed(0)
    print(device.describe())
    with torch.inference_mode():
        extend_one_off(new_model())
        spec_table()
        chunk_table()
