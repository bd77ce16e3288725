"""The shapes sweep: every public kernel against its PyTorch counterpart, at the shapes models use.

The course's other benchmarks time each kernel on tensors big enough to reach the roof. A model
calls the same kernels on one decode token (a ``[1, 4096]`` row), on a training batch of 65,536
tokens, through autograd, with transposed weights. This sweep covers that range, one record per
case, ``bench = "shapes/<op>"``, against the PyTorch call a user would otherwise write (named in
``baseline``), with ``speedup = baseline_ms / ms`` and the kernel's fraction of its roof: the copy
bandwidth measured in the same run for memory-bound ops, the measured matmul peak of the dtype for
matmuls and attention.

Host overhead gets records of its own (``shapes/<op>/host``, every op but the causal attention):
the wall time of ``HOST_CALLS`` back-to-back calls at the size of a decode step (``host_cases``),
divided by the count. The GPU finishes most of those small kernels faster than the host can
launch the next, so the figure is the host's cost per call; the baseline is the same loop over the
PyTorch op. For matmul the figure is likely not the host's cost alone: one row against a 4,096 x
4,096 weight reads 32 MiB, about as long on the device as a launch takes the host (page 3.4). So
the log also gives each side's time until its calls are issued (``issue_time``), which the device
does not lengthen.

A case slower than its baseline (``RETIME_BELOW``), and every host-time case, is timed
``RETIMES`` times, both sides, and recorded at the median of each side, so that one slow timing
of a few-µs call decides nothing.

A memory-bound case over ``DEVICE_ABOVE_BYTES`` is also timed on the device alone, its host work
hidden, and the printed log gives both fractions of the copy bandwidth: the call's, which the goal
is set on, and the kernel's; and the kernel's fraction of what a copy as large reaches
(``Roofs.same_size_copy``), which says how much of a shortfall is the size's rather than the
kernel's.

A case whose kernel raises is recorded as an error row (``ms`` None, the message in ``error``)
instead of stopping the sweep. ``python -m kernels.bench --only shapes`` runs it;
``python -m kernels.shapes --ops softmax_fwd,rms_norm_bwd`` runs a subset;
``python -m kernels.shapes --report`` times nothing and sets the latest sweep in this GPU's results
file against the goals (``goals``).

Each record is appended as soon as it is made, so a sweep cut short keeps its rows; the same command
with ``--resume`` then times only the cases that file has no record of today (error rows are timed
again). A full sweep that outlasts one sitting (a lent machine's 10-minute call, say) is finished
that way, within one date, which is what notebook 03b reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import bench, device, norms, roofline, softmax, vector_add

# Token counts a model calls a row-wise op with (decode batches to a long training batch), the
# hidden sizes of real models, and the widest rows (a vocabulary's logits), at fewer row counts.
ROWS = [1, 8, 64, 512, 4096, 16384, 65536]
WIDTHS = [1024, 4096, 8192]
WIDE, WIDE_ROWS = 65536, [1, 64, 4096]
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# No input tensor above this: 65,536 x 8,192 fp32 is 2 GiB, and a backward case holds five such.
MAX_TENSOR_BYTES = 2**31
# Matmul: decode to prefill token counts x (K, N) of real models' projections (Llama-3-8B's
# attention and MLP, Llama-3-70B's MLP), then odd sizes (M, K, N) no tile divides.
MATMUL_M = [1, 8, 64, 512, 4096]
MATMUL_KN = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]
MATMUL_ODD = [(4000, 3000, 5000), (1000, 4096, 11008)]
# Attention: head dims x sequence lengths; the batch makes every case ATTN_ROWS query rows.
ATTN_HEAD_DIMS = [64, 128]
ATTN_SEQS = [512, 2048, 8192]
ATTN_HEADS = 16
ATTN_ROWS = 16 * 16384  # batch x heads x sequence
# Paged decode (sequences, tokens each), quantized GEMV (M, N, K), megakernel (M, D, layers).
PAGED = [(1, 1024), (16, 1024), (64, 4096)]
GEMV = [(1, 4096, 4096), (1, 14336, 4096), (8, 4096, 4096)]
MEGA = [(1, 1024, 8), (8, 4096, 8)]
HOST_CALLS = 200
# Per-measurement time: enough repetitions for a stable median of a µs kernel, short enough that
# the sweep of ~600 cases runs in minutes.
TIMING = dict(warmup_ms=10, rep_ms=40)
# A case slower than its baseline is timed twice more at once, both sides, and recorded at the
# median of its three timings on each side (all three go to the log, ``retimed``). A one-off slow
# timing is the run (clocks, the host, another process), not the kernel: matmul sweeps have shown
# one case 2-10x slow per run, a different one each time, with cuBLAS beside it normal; the 12-05
# sweep recorded the fp16 RMSNorm backward at 8 x 1,024 at 0.15x, which a sweep later that day put
# at 1.12x. A slow kernel is slow all three times, so the median keeps it; the threshold covers the
# goal's 0.9 and the cases just above it. The check is one-sided: a one-off slow baseline that
# lifted a case from below 0.9 to 1.0 or more (a timing 11% slow or worse) would stand. The host
# cases, a fraction of a second each, are timed three times whatever their speed-up: the 12-07
# sweep recorded SDPA's forward at 26.5 µs a call against 14.6-14.9 on a recheck, and ours at
# 3.4x instead of about 2. On a GPU only: in the interpreter every case is slow.
RETIME_BELOW = 1.0
RETIMES = 3


def _retime_below() -> float | None:
    return RETIME_BELOW if device.GPU_MODE else None


# A memory-bound case that moves more than this is also timed on the device alone (``device``: its
# ms and fraction of the copy bandwidth, kernels.bench.measure's device_only). The sweep's own time
# counts the host's work beyond the L2 flush that precedes each call, as a model calling the op pays
# it: a backward's autograd call costs the host about as long as the flush, so at a few hundred MB
# the two times can differ by tens of µs. Set side by side, they say whether a case below its goal
# is the kernel's or the host's. On a GPU only.
DEVICE_ABOVE_BYTES = 32 * 2**20


def _device_above() -> int | None:
    return DEVICE_ABOVE_BYTES if device.GPU_MODE else None


# What a record may carry beyond kernels/bench.py's fields: the configuration a matmul ran, a
# slow case's three timings, a large case's device time and a host case's time until issued. They
# go to the printed log; the results files keep the common fields.
EXTRAS = ("config", "retimed", "device", "issued")


def _common(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in EXTRAS}


@dataclass
class Case:
    """One comparison: ``setup()`` builds the inputs and returns ``(ours, theirs)``, two
    zero-argument callables, or ``(ours, theirs, config)`` where ``config()``, called after the
    timing, names what ours ran (kept in the record: a case that tunes itself says what it chose);
    ``bytes`` or ``flops`` is the minimum work of one call."""

    op: str
    shape: list
    dtype: torch.dtype
    baseline: str
    setup: Callable[[], tuple[Callable, Callable]]
    bytes: int | None = None
    flops: int | None = None
    roof: str = "copy"  # or "matmul"


def _fits(*shape_dtype) -> bool:
    rows, cols, dtype = shape_dtype
    return rows * cols * dtype.itemsize <= MAX_TENSOR_BYTES


def _randn(*shape, dtype, scale=1.0):
    return torch.randn(*shape, device=device.DEVICE, dtype=dtype) * scale


def grad_call(f: Callable, leaves: list, dy: torch.Tensor) -> Callable:
    """The backward of ``f`` alone: one forward kept, its graph walked again on every call. The
    kept forward is the second of the layout, as in every training step after the first: an op
    that plans a layout on its first call (``kernels.replay``) has done so."""
    for t in leaves:
        t.requires_grad_()
    f()
    y = f()
    return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)


# ----------------------------------------------------------------------------- the cases


def _row_cases(rows_list, widths, dtypes) -> Iterator[Case]:
    for dtype in dtypes:
        for w in widths:
            for r in rows_list:
                if not _fits(r, w, dtype):
                    continue
                yield from _softmax_cases(r, w, dtype)
                yield from _norm_cases(r, w, dtype)


def _softmax_cases(r: int, w: int, dtype: torch.dtype) -> Iterator[Case]:
    nbytes = r * w * dtype.itemsize

    def fwd():
        x = _randn(r, w, dtype=dtype, scale=4.0)
        return lambda: softmax.softmax(x), lambda: torch.softmax(x, dim=-1)

    def bwd():
        x, dy = _randn(r, w, dtype=dtype, scale=4.0), _randn(r, w, dtype=dtype)
        ours = grad_call(lambda: softmax.softmax(x), [x], dy)
        return ours, grad_call(lambda: torch.softmax(x, dim=-1), [x], dy)

    yield Case("softmax_fwd", [r, w], dtype, "torch.softmax", fwd, bytes=2 * nbytes)
    yield Case("softmax_bwd", [r, w], dtype, "torch.softmax backward", bwd, bytes=3 * nbytes)


def _norm_cases(r: int, w: int, dtype: torch.dtype) -> Iterator[Case]:
    nbytes = r * w * dtype.itemsize
    for kind in ("rms_norm", "layer_norm"):
        fn = getattr(torch.nn.functional, kind)
        baseline = f"torch.nn.functional.{kind}"

        def inputs(kind=kind):
            x, wt, b, dy = norms.make_inputs(r, w, dtype)
            return x, wt, (b if kind == "layer_norm" else None), dy

        def ours_theirs(x, wt, b, kind=kind, fn=fn):
            if kind == "rms_norm":
                return lambda: norms.rms_norm(x, wt), lambda: fn(x, (w,), wt, 1e-6)
            return lambda: norms.layer_norm(x, wt, b), lambda: fn(x, (w,), wt, b, 1e-5)

        def fwd(inputs=inputs, ours_theirs=ours_theirs):
            x, wt, b, _ = inputs()
            return ours_theirs(x, wt, b)

        def bwd(inputs=inputs, ours_theirs=ours_theirs):
            x, wt, b, dy = inputs()
            leaves = [t for t in (x, wt, b) if t is not None]
            ours, theirs = ours_theirs(x, wt, b)
            return grad_call(ours, leaves, dy), grad_call(theirs, leaves, dy)

        yield Case(f"{kind}_fwd", [r, w], dtype, baseline, fwd, bytes=2 * nbytes)
        yield Case(f"{kind}_bwd", [r, w], dtype, f"{baseline} backward", bwd, bytes=3 * nbytes)


def _add_cases(sizes, dtypes) -> Iterator[Case]:
    for dtype in dtypes:
        for n in sizes:

            def setup(n=n, dtype=dtype):
                x, y = _randn(n, dtype=dtype), _randn(n, dtype=dtype)
                return lambda: vector_add.add(x, y), lambda: torch.add(x, y)

            yield Case("add", [n], dtype, "torch.add", setup, bytes=3 * n * dtype.itemsize)


def _matmul_cases(mkn, dtypes) -> Iterator[Case]:
    from kernels import matmul

    for dtype in dtypes:
        for m, k, n in mkn:

            def setup(m=m, k=k, n=n, dtype=dtype):
                # A model's linear layer: activations [M, K] times a weight stored [N, K].
                x, w = _randn(m, k, dtype=dtype), _randn(n, k, dtype=dtype, scale=k**-0.5)
                return (
                    lambda: matmul.matmul(x, w.t()),
                    lambda: torch.matmul(x, w.t()),
                    lambda: matmul.describe(x, w.t()),
                )

            yield Case("matmul", [m, k, n], dtype, "torch.matmul (w.t())", setup,
                       flops=2 * m * k * n, roof="matmul")  # fmt: skip


def _attention_cases(head_dims, seqs, dtypes, heads=16, total_rows=None) -> Iterator[Case]:
    from kernels import flash_attention

    sdpa = torch.nn.functional.scaled_dot_product_attention
    for dtype in dtypes:
        for d in head_dims:
            for n in seqs:
                for causal in (False, True):
                    b = max(1, (total_rows or 0) // (n * heads))
                    shape = [b, heads, n, d]
                    flops = 4 * b * heads * n * n * d // (2 if causal else 1)

                    def fwd(shape=shape, causal=causal, dtype=dtype):
                        q, k, v = (_randn(*shape, dtype=dtype) for _ in range(3))
                        ours = lambda: flash_attention.attention(q, k, v, causal=causal)  # noqa: E731
                        return ours, lambda: sdpa(q, k, v, is_causal=causal)

                    def bwd(shape=shape, causal=causal, dtype=dtype):
                        q, k, v = (_randn(*shape, dtype=dtype) for _ in range(3))
                        dy = _randn(*shape, dtype=dtype)
                        ours = grad_call(
                            lambda: flash_attention.attention(q, k, v, causal=causal), [q, k, v], dy
                        )
                        return ours, grad_call(
                            lambda: sdpa(q, k, v, is_causal=causal), [q, k, v], dy
                        )

                    op = "attention_causal" if causal else "attention"
                    base = f"scaled_dot_product_attention(is_causal={causal})"
                    yield Case(f"{op}_fwd", shape, dtype, base, fwd, flops=flops, roof="matmul")
                    # The backward does 2.5 times the forward's matmul work (five matmuls to two).
                    yield Case(f"{op}_bwd", shape, dtype, f"{base} backward", bwd,
                               flops=flops * 5 // 2, roof="matmul")  # fmt: skip


def _paged_cases(cases, dtype, head_dim, n_heads, n_kv, block) -> Iterator[Case]:
    from kernels import paged_attention as pa

    for batch, seq in cases:

        def setup(batch=batch, seq=seq):
            q, k, v, kc, vc, table, lens = pa.decode_case(
                batch, seq, n_heads=n_heads, n_kv=n_kv, head_dim=head_dim, block_size=block,
                dtype=dtype,
            )  # fmt: skip
            return lambda: pa.paged_decode(q, kc, vc, table, lens), lambda: pa.sdpa_decode(q, k, v)

        nbytes = pa.kv_read_bytes([seq] * batch, n_kv, head_dim, dtype)
        yield Case("paged_decode", [batch, n_heads, seq, head_dim], dtype,
                   "scaled_dot_product_attention (contiguous cache)", setup, bytes=nbytes)  # fmt: skip


def _gemv_cases(cases, dtype) -> Iterator[Case]:
    from kernels import quant

    for m, n, k in cases:
        for bits in (4, 8):

            def setup(m=m, n=n, k=k, bits=bits):
                w = _randn(n, k, dtype=dtype, scale=k**-0.5)
                qw, x = quant.quantize(w, bits, 128), _randn(m, k, dtype=dtype)
                w16 = quant.dequantize(qw, dtype)
                return lambda: quant.gemv(x, qw), lambda: torch.matmul(x, w16.t())

            yield Case(f"gemv_int{bits}", [m, n, k], dtype, "torch.matmul (16-bit weight)", setup,
                       bytes=quant.gemv_bytes(m, n, k, bits, 128))  # fmt: skip


def _megakernel_cases(cases, dtype) -> Iterator[Case]:
    from kernels import megakernel as mk

    for m, d, layers in cases:

        def setup(m=m, d=d, layers=layers):
            w, b = mk.make_weights(layers, d, dtype=dtype)
            x = _randn(m, d, dtype=dtype)
            return lambda: mk.fused_mlp_stack(x, w, b), lambda: mk.mlp_stack_eager(x, w, b)

        yield Case("fused_mlp_stack", [m, d, layers], dtype, "mlp_stack_eager (F.linear, relu)",
                   setup, bytes=mk.weight_bytes(layers, d, dtype))  # fmt: skip


def cases(quick: bool) -> list[Case]:
    """Every case of the sweep; ``quick`` (and the CPU interpreter): one tiny shape per op."""
    low = device.preferred_dtype(torch.bfloat16)
    if quick:
        dtypes = [torch.float32] if not device.GPU_MODE else [low]
        out = list(_add_cases([1000], dtypes))
        out += list(_row_cases([5], [123], dtypes))
        out += list(_matmul_cases([(8, 64, 48)], [low]))
        out += list(_attention_cases([64], [16], [low], heads=1))
        out += list(_paged_cases([(2, 48)], low, head_dim=64, n_heads=4, n_kv=2, block=16))
        out += list(_gemv_cases([(1, 64, 128)], low))
        out += list(_megakernel_cases([(1, 64, 2)], low))
        return out
    out = list(_add_cases([2**10, 2**16, 2**20, 2**24, 2**28], DTYPES))
    out += list(_row_cases(ROWS, WIDTHS, DTYPES))
    out += list(_row_cases(WIDE_ROWS, [WIDE], DTYPES))
    mkn = [(m, k, n) for m in MATMUL_M for k, n in MATMUL_KN] + MATMUL_ODD
    # bf16 where the GPU has it; fp16 otherwise (preferred_dtype said so above).
    out += list(_matmul_cases(mkn, list(dict.fromkeys([low, torch.float16]))))
    out += list(_attention_cases(ATTN_HEAD_DIMS, ATTN_SEQS, [low], ATTN_HEADS, ATTN_ROWS))
    out += list(_paged_cases(PAGED, low, head_dim=128, n_heads=32, n_kv=8, block=16))
    out += list(_gemv_cases(GEMV, low))
    out += list(_megakernel_cases(MEGA, low))
    return out


# ----------------------------------------------------------------------------- running


class Roofs:
    """The ceilings, measured once per run: copy bandwidth and the matmul peak of each dtype; and,
    for the device-alone timings, the bandwidth of a copy as large as a case."""

    def __init__(self):
        self.copy = roofline.copy_bandwidth().value
        self._peaks: dict = {}

    def same_size_copy(self, nbytes: int) -> float:
        """GB/s of a device-to-device copy that moves ``nbytes`` in all (half read, half written),
        timed as the device-alone cases are (``device_only``); ``roofline.copy_bandwidth`` keeps
        one measurement per size. The goal's roof is the 1-GiB copy of ``copy``; set beside it,
        this says how much of a shortfall a copy of that size has too: at tens of MiB a kernel's
        launch and its last wave weigh more than at 1 GiB (the 12-06 sweep had torch.add over 2^24
        bf16 values, 96 MiB, at 0.85 of the 1-GiB copy)."""
        return roofline.copy_bandwidth(nbytes // 2, device_only=True).value

    def __call__(self, case: Case) -> tuple[str, float]:
        if case.roof == "copy":
            return "copy", self.copy
        name = bench.dtype_name(case.dtype)
        if name not in self._peaks:
            self._peaks[name] = roofline.matmul_peak(name).value
        return f"matmul_{name}", self._peaks[name]


def error_record(case: Case, err: BaseException) -> dict:
    """The row of a case that raised: the record's fields with no timings, and the error."""
    cap, v = device.capabilities(), device.versions()
    rec = dict.fromkeys(
        ["bench", "variant", "shape", "dtype", "ms", "gbps", "tflops", "baseline", "baseline_ms",
         "speedup", "ceiling", "ceiling_frac"],
    )  # fmt: skip
    rec |= dict(bench=f"shapes/{case.op}", variant="triton", shape=list(case.shape))
    rec |= dict(dtype=bench.dtype_name(case.dtype), baseline=case.baseline)
    rec |= dict(gpu=cap.name, torch=v["torch"], triton=v["triton"], cuda=v["cuda"])
    rec["date"] = datetime.date.today().isoformat()
    rec["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"
    return rec


def _median(timings: list[bench.Measurement]) -> bench.Measurement:
    """The timing with the median time (of an odd count)."""
    return sorted(timings, key=lambda t: t.ms)[len(timings) // 2]


def _timed_pair(
    time_ours: Callable[[], bench.Measurement],
    time_theirs: Callable[[], bench.Measurement],
    always: bool = False,
) -> tuple[bench.Measurement, bench.Measurement, dict | None]:
    """One timing of each side; where ours is below ``RETIME_BELOW`` of the baseline's speed (or
    ``always``, on a GPU), ``RETIMES`` timings of each, alternating, and the median of each side.
    Returns (ours, theirs, the retimed ms of both sides or None). The device cases and the host
    cases share it; the host cases take ``always``."""
    m, base = time_ours(), time_theirs()
    below = _retime_below()
    if below is None or (base.ms / m.ms >= below and not always):
        return m, base, None
    mine, their = [m], [base]
    for _ in range(RETIMES - 1):
        mine.append(time_ours())
        their.append(time_theirs())
    retimed = {"ms": [round(t.ms, 6) for t in mine],
               "baseline_ms": [round(t.ms, 6) for t in their]}  # fmt: skip
    return _median(mine), _median(their), retimed


def run_case(case: Case, roofs: Roofs) -> dict:
    """Time one case (ours, then the baseline) into a record; an error row if anything raises."""
    try:
        ours, theirs, *config = case.setup()
        work = dict(bytes=case.bytes, flops=case.flops)
        m, base, retimed = _timed_pair(
            lambda: bench.measure(ours, **work, **TIMING),
            lambda: bench.measure(theirs, **work, **TIMING),
        )
        rec = bench.record(f"shapes/{case.op}", "triton", case.shape, case.dtype, m,
                           baseline=(case.baseline, base), ceiling=roofs(case))  # fmt: skip
        if config:
            rec["config"] = config[0]()
        if retimed:
            rec["retimed"] = retimed
        above = _device_above()
        if above is not None and case.roof == "copy" and (case.bytes or 0) > above:
            alone = bench.measure(ours, **work, device_only=True, **TIMING)
            frac = rec["ceiling_frac"] * rec["ms"] / alone.ms if rec["ceiling_frac"] else None
            same = case.bytes / (alone.ms * 1e-3) / 1e9 / roofs.same_size_copy(case.bytes)
            rec["device"] = {
                "ms": round(alone.ms, 6),
                "frac": float(f"{frac:.4g}") if frac else None,
                "same_size_copy_frac": float(f"{same:.4g}"),
            }
        return rec
    except Exception as e:  # noqa: BLE001  (any failure becomes the case's error row)
        return error_record(case, e)
    finally:
        ours = theirs = config = None
        gc.collect()
        if device.GPU_MODE:
            torch.cuda.empty_cache()


def host_loops(fn: Callable, calls: int, loops: int, clock: Callable = time.perf_counter) -> list:
    """Host ms per call of ``fn`` in each of ``loops`` loops of ``calls`` back-to-back calls, by
    ``clock`` (one call first; each loop ends with a synchronize). With ``time.process_time`` it
    counts the CPU time of every thread (the autograd engine's included), which a shared host
    disturbs less than wall time."""
    fn()
    if device.GPU_MODE:
        torch.cuda.synchronize()
    out = []
    for _ in range(loops):
        t0 = clock()
        for _ in range(calls):
            fn()
        if device.GPU_MODE:
            torch.cuda.synchronize()
        out.append((clock() - t0) * 1e3 / calls)
    return out


def host_time(fn: Callable, calls: int | None = None) -> bench.Measurement:
    """Host time per call of ``fn``: ``calls`` back-to-back calls, wall time over the count (the
    median of 5 such loops). On a GPU, kernels this small finish before the next launch, so this
    is what the host spends per call."""
    loops = host_loops(fn, calls or device.pick(HOST_CALLS, 2), 5)
    ms = sorted(loops)[2]
    return bench.Measurement(ms, min(loops), max(loops), None, None, device.GPU_MODE)


def issue_time(fn: Callable, calls: int | None = None) -> float:
    """Host ms per call of ``fn`` until its calls are issued, the GPU not waited for
    (``bench.host_launch_ms``, which matmul's tuner charges too; the least of 5 loops): the host's
    cost alone, for the log beside ``host_time``. The two agree where the host is the slower side;
    where a call keeps the GPU busier than its launch keeps the host (matmul's one row against a
    32-MiB weight), only this one is the host's, as long as the launch queue has room (about a
    thousand launches, as observed; not documented) and no call synchronizes."""
    return bench.host_launch_ms(fn, calls or device.pick(HOST_CALLS, 2), rounds=5)


def host_cases(quick: bool) -> list[Case]:
    """One call of every op at the size of a decode step (one row, one token, one sequence), for
    ``host_time``: there the host's work per call, not the kernel, decides the time. The causal
    attention cases are left out: at one short sequence they launch what the others do."""
    dtype = device.preferred_dtype(torch.bfloat16)
    if quick:
        out = list(_add_cases([1000], [dtype]))
        out += list(_row_cases([1], [123], [dtype]))
        out += list(_matmul_cases([(1, 64, 48)], [dtype]))
        out += list(_attention_cases([64], [16], [dtype], heads=1))
        out += list(_paged_cases([(1, 48)], dtype, head_dim=64, n_heads=4, n_kv=2, block=16))
        out += list(_gemv_cases([(1, 64, 128)], dtype))
        out += list(_megakernel_cases([(1, 64, 2)], dtype))
    else:
        out = list(_add_cases([4096], [dtype]))
        out += list(_row_cases([1], [4096], [dtype]))
        out += list(_matmul_cases([(1, 4096, 4096)], [dtype]))
        out += list(_attention_cases([128], [128], [dtype], ATTN_HEADS))
        out += list(_paged_cases(PAGED[:1], dtype, head_dim=128, n_heads=32, n_kv=8, block=16))
        out += list(_gemv_cases(GEMV[:1], dtype))
        out += list(_megakernel_cases(MEGA[:1], dtype))
    return [c for c in out if not c.op.startswith("attention_causal")]


def host_records(
    quick: bool, wanted: Callable[..., bool] = lambda case, suffix="": True
) -> list[dict]:
    """The host-time records of ``host_cases`` that ``wanted(case, "/host")`` keeps."""
    recs = []
    for case in (c for c in host_cases(quick) if wanted(c, "/host")):
        try:
            ours, theirs, *_ = case.setup()
            m, base, retimed = _timed_pair(
                lambda f=ours: host_time(f), lambda f=theirs: host_time(f), always=True
            )
            rec = bench.record(f"shapes/{case.op}/host", "triton", case.shape, case.dtype, m,
                               baseline=(case.baseline, base))  # fmt: skip
            rec["issued"] = {"ms": issue_time(ours), "baseline_ms": issue_time(theirs)}
            recs.append(rec | ({"retimed": retimed} if retimed else {}))
        except Exception as e:  # noqa: BLE001
            recs.append(error_record(dataclasses.replace(case, op=f"{case.op}/host"), e))
    return recs


def case_key(bench_name: str, shape, dtype) -> tuple[str, tuple, str]:
    """What identifies a case across records: ``(bench, shape, dtype)``, e.g.
    ``("shapes/matmul", (64, 4096, 4096), "bfloat16")``."""
    return bench_name, tuple(shape), bench.dtype_name(dtype)


def recorded_today(path: Path, today: str | None = None) -> set[tuple[str, tuple, str]]:
    """The cases that ``path`` (a JSONL results file) already has a timed record of, dated today:
    what ``--resume`` skips. Error rows do not count, so a resumed sweep retries them."""
    if not path.exists():
        return set()
    today = today or datetime.date.today().isoformat()
    return {
        case_key(r["bench"], r["shape"], r["dtype"])
        for r in bench.load_records(path)
        if r.get("bench", "").startswith("shapes/") and r.get("date") == today and "error" not in r
    }


def run(
    quick: bool,
    ops: set[str] | None = None,
    *,
    dtypes: set[str] | None = None,
    progress: bool = False,
    sink: Callable[[dict], object] | None = None,
    done: set[tuple[str, tuple, str]] = frozenset(),
) -> list[dict]:
    """The sweep's records (only the ``ops`` and ``dtypes`` named, if given, and not the cases
    in ``done``, keys as ``case_key`` makes them), host-time records first; ``sink`` receives each
    record as it is made (a long sweep cut short keeps its rows)."""

    def wanted(case: Case, suffix: str = "") -> bool:  # suffix "/host": the host-time record
        dtype = bench.dtype_name(case.dtype)
        return (
            (ops is None or case.op in ops)
            and (dtypes is None or dtype in dtypes)
            and case_key(f"shapes/{case.op}{suffix}", case.shape, dtype) not in done
        )

    roofs = Roofs()
    recs = host_records(quick, wanted)
    for rec in recs:
        if sink:
            sink(rec)
        if progress:
            host = f"  host µs a call: {_us(rec['ms'])}, torch {_us(rec['baseline_ms'])}"
            if "issued" in rec:
                issued = rec["issued"]
                host += f"; until issued {_us(issued['ms'])}, torch {_us(issued['baseline_ms'])}"
            print(_line(rec, host + _retimed_note(rec)), flush=True)
    for case in filter(wanted, cases(quick)):
        t0 = time.perf_counter()
        rec = run_case(case, roofs)
        if sink:
            sink(rec)
        if progress:
            # The case's wall time (compiles and autotuning included): where a sweep's minutes go.
            extra = f"  ({time.perf_counter() - t0:.1f} s)"
            extra += f"  [{rec['config']}]" if "config" in rec else ""
            extra += _retimed_note(rec)
            if "device" in rec:
                alone = rec["device"]
                extra += f"  copy: {rec['ceiling_frac']}, device alone {alone['frac']}"
                extra += f" ({alone['same_size_copy_frac']} of a copy as large)"
            print(_line(rec, extra), flush=True)
        recs.append(rec)
    return recs


def _retimed_note(rec: dict) -> str:
    """The log's note on a case timed ``RETIMES`` times: each timing's speed-up."""
    if "retimed" not in rec:
        return ""
    r = rec["retimed"]
    each = ", ".join(f"{b / o:.3f}x" for o, b in zip(r["ms"], r["baseline_ms"]))
    return f"  timed {RETIMES} times: {each} (median recorded)"


def _us(ms: float | None) -> str:
    return "-" if ms is None else f"{ms * 1e3:.1f}"


def _line(rec: dict, extra: str) -> str:
    """One record of the printed log: case, shape, dtype, speed-up (or the error), then ``extra``."""
    speed = "ERROR " + rec["error"] if "error" in rec else f"{rec['speedup']}x"
    return f"{rec['bench']:28s} {str(rec['shape']):24s} {rec['dtype']:9s} {speed}{extra}"


@bench.register("shapes")
def _bench_shapes(quick: bool) -> list[dict]:
    # kernels.bench appends what this returns to the results file: the common fields only, as
    # main()'s sink writes them (the extras go to the printed log).
    return [_common(r) for r in run(quick, progress=True)]


def slowest(records: list[dict]) -> dict | None:
    """The timed case with the lowest speed-up against its baseline."""
    timed = [r for r in records if r.get("speedup") is not None]
    return min(timed, key=lambda r: r["speedup"]) if timed else None


# The issue's goals on the sweep: every case at least this fast as its PyTorch call, every
# memory-bound case over DEVICE_ABOVE_BYTES at least this fraction of the copy bandwidth, and every
# op's host cost within HOST_GOAL_US of PyTorch's.
SPEEDUP_GOAL = 0.9
COPY_GOAL = 0.9
HOST_GOAL_US = 2.0


def latest_sweep(records: list[dict]) -> tuple[str | None, list[dict]]:
    """The shapes records of the latest date in ``records``, one per case (the last written wins:
    a case timed twice that day shows its later timing), as notebook 03b reads them."""
    recs = [r for r in records if r.get("bench", "").startswith("shapes/")]
    latest = max((r["date"] for r in recs), default=None)
    by_case = {case_key(r["bench"], r["shape"], r["dtype"]): r for r in recs if r["date"] == latest}
    return latest, list(by_case.values())


def _timed_and_host(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """A sweep's timed cases (a speed-up) and its host rows (a time), error rows in neither."""
    host = [r for r in records if r["bench"].endswith("/host") and r.get("ms")]
    timed = [r for r in records if not r["bench"].endswith("/host") and r.get("speedup")]
    return timed, host


def goals(records: list[dict]) -> dict[str, list[dict]]:
    """The records of one sweep that miss a goal, worst first: ``"speedup"`` (a timed case below
    ``SPEEDUP_GOAL`` x PyTorch), ``"copy"`` (a memory-bound case over ``DEVICE_ABOVE_BYTES`` below
    ``COPY_GOAL`` of the copy bandwidth), ``"host"`` (a host row more than ``HOST_GOAL_US`` above
    PyTorch's), ``"error"`` (a case that raised)."""
    timed, host = _timed_and_host(records)

    def moved(r: dict) -> float:  # bytes the case moves, from its (rounded) GB/s and time
        return (r.get("gbps") or 0) * r["ms"] * 1e6

    # 1% of slack: a case of exactly 32 MiB, read back from rounded figures, is not over it.
    big = [r for r in timed if r.get("ceiling") == "copy" and moved(r) > 1.01 * DEVICE_ABOVE_BYTES]
    return {
        "speedup": sorted((r for r in timed if r["speedup"] < SPEEDUP_GOAL),
                          key=lambda r: r["speedup"]),
        "copy": sorted((r for r in big if r["ceiling_frac"] < COPY_GOAL),
                       key=lambda r: r["ceiling_frac"]),
        "host": sorted((r for r in host if (r["ms"] - r["baseline_ms"]) * 1e3 > HOST_GOAL_US),
                       key=lambda r: r["baseline_ms"] - r["ms"]),
        "error": [r for r in records if r.get("error")],
    }  # fmt: skip


def report(path: Path) -> str:
    """The latest sweep in the results file ``path`` against the goals: counts, then every miss."""
    date, recs = latest_sweep(bench.load_records(path) if path.exists() else [])
    if date is None:
        return f"no shapes records in {path}"
    miss = goals(recs)
    timed, host = map(len, _timed_and_host(recs))
    out = [f"{path.name}, sweep of {date}: {len(recs)} records, {timed} timed, {host} host rows",
           f"below {SPEEDUP_GOAL}x PyTorch: {len(miss['speedup'])} of {timed}"]  # fmt: skip
    out += [_line(r, "") for r in miss["speedup"]]
    out.append(
        f"over {DEVICE_ABOVE_BYTES >> 20} MiB and below {COPY_GOAL} of copy: {len(miss['copy'])}"
    )
    out += [_line(r, f"  copy {r['ceiling_frac']}") for r in miss["copy"]]
    out.append(
        f"host cost more than {HOST_GOAL_US} µs above PyTorch's: {len(miss['host'])} of {host}"
    )
    out += [
        _line(r, f"  host µs {_us(r['ms'])}, torch {_us(r['baseline_ms'])}") for r in miss["host"]
    ]
    out.append(f"errors: {len(miss['error'])}")
    out += [_line(r, "") for r in miss["error"]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kernels.shapes", description=__doc__.split("\n")[0])
    p.add_argument("--ops", help="comma-separated ops (softmax_fwd, rms_norm_bwd, matmul, ...)")
    p.add_argument("--dtypes", help="comma-separated dtypes (float16, bfloat16, float32)")
    p.add_argument("--quick", action="store_true", help="one tiny shape per op")
    p.add_argument("--out", help="append the records to this JSONL file instead of results/")
    p.add_argument(
        "--resume",
        action="store_true",
        help="skip the cases the output file already has a record of today (finish a cut sweep)",
    )
    p.add_argument(
        "--report",
        nargs="?",
        const="",
        metavar="FILE",
        help="time nothing: the latest sweep in FILE (default: this GPU's results file) against "
        "the goals",
    )
    args = p.parse_args(argv)
    if args.report is not None:
        print(report(Path(args.report) if args.report else bench.results_path()))
        return 0
    ops = set(args.ops.split(",")) if args.ops else None
    dtypes = set(args.dtypes.split(",")) if args.dtypes else None
    print(device.describe(), flush=True)
    out = Path(args.out) if args.out else bench.results_path()
    done = set()
    if args.resume:
        done = recorded_today(out)
        print(f"resume: {len(done)} cases already recorded today in {out}", flush=True)
    sink = (lambda r: bench.append_records([_common(r)], out)) if device.GPU_MODE else None
    quick = args.quick or not device.GPU_MODE
    recs = run(quick, ops, dtypes=dtypes, progress=True, sink=sink, done=done)
    print(bench.format_table(recs))
    worst = slowest(recs)
    if worst:
        print(f"slowest: {worst['bench']} {worst['shape']} {worst['dtype']} {worst['speedup']}x")
    if device.GPU_MODE:
        print(f"appended {len(recs)} records to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
