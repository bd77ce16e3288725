"""Every kernel of the package once, at small odd shapes: the program `make gpu-test` runs under
``compute-sanitizer --tool memcheck`` (out-of-bounds and misaligned accesses, on the real GPU).

    compute-sanitizer --tool memcheck --error-exitcode 1 python scripts/gpu/sanitize_all.py

Each call is also checked against its reference (loosely: the point here is memory safety, the
tests check accuracy), and prints one line. Shapes are off every tile size, so that masked tails,
partial tiles and splits are exercised. Exits 1 if any call raised or was wrong.
"""

import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels import device  # noqa: E402
from kernels.numerics import rel_error  # noqa: E402

DEV = device.DEVICE
BF16 = device.preferred_dtype(torch.bfloat16) if device.GPU_MODE else torch.float16


def close(out, ref, tol=3e-2):
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def rnd(*shape, dtype=torch.float16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def vector_add():
    from kernels import vector_add as va

    # Twice: the second call is launched from C++ (kernels.replay) where the extension builds.
    x, y = rnd(10_007, dtype=torch.float32), rnd(10_007, dtype=torch.float32)
    for _ in range(2):
        close(va.add(x, y), x + y, 1e-6)


def softmax_fwd_bwd():
    from kernels import softmax as sm

    # A fused row and a row wider than the fused block; each layout twice: the second call is
    # launched from C++ (kernels.replay) where the extension builds.
    for shape in [(37, 1000), (3, 70_001)] * 2:
        x = rnd(*shape).requires_grad_()
        xr = x.detach().float().requires_grad_()
        y, yr = sm.softmax(x), torch.softmax(xr, -1)
        close(y, yr)
        dy = rnd(*shape)
        y.backward(dy)
        yr.backward(dy.float())
        close(x.grad, xr.grad)


def norms_fwd_bwd():
    from kernels import norms

    # 37 rows: several programs and the partial sums; 7 rows: one program writes dw and db itself;
    # 16,385 columns: the two-step backward; 40,000: the looped forward too. Each twice: the second
    # call is launched from C++ (kernels.replay) where the extension builds.
    for rows, cols in [(37, 1000), (7, 1000), (3, 16_385), (3, 40_000)] * 2:
        x = rnd(rows, cols).requires_grad_()
        w, b = rnd(cols).requires_grad_(), rnd(cols).requires_grad_()
        for name, fn, args in [("rms", norms.rms_norm, (w,)), ("layer", norms.layer_norm, (w, b))]:
            y = fn(x, *args)
            ref_args = [a.detach().float().requires_grad_() for a in args]
            xr = x.detach().float().requires_grad_()
            ref = (norms.rms_norm_ref if name == "rms" else norms.layer_norm_ref)(xr, *ref_args)
            close(y, ref)
            with torch.no_grad():  # the forward that writes no statistics
                close(fn(x, *args), ref)
            dy = rnd(rows, cols)
            grads = torch.autograd.grad(y, [x, *args], dy)
            grads_ref = torch.autograd.grad(ref, [xr, *ref_args], dy.float())
            for g, gr in zip(grads, grads_ref):
                close(g, gr, 5e-2)


def cluster_rows():
    """Rows split across a thread-block cluster (kernels.cuda.cluster_rows; Hopper and nvcc)."""
    from kernels import norms, softmax
    from kernels import rows as rows_mod
    from kernels.cuda import cluster_rows as cr

    if cr.unavailable_reason() is not None:
        return
    # 256 rows of 16,392 columns: three CTAs a row forward (five backward at E 16, three at 32),
    # the last one mostly padding. The kernels' reach is widened to every op and to these rows,
    # which they would not otherwise be used for (kernels.rows.CLUSTER_ABOVE_COLS,
    # CLUSTER_MIN_ROWS and cr.WINS).
    keep = rows_mod.CLUSTER_ABOVE_COLS, rows_mod.CLUSTER_MIN_ROWS
    keep_cr = cr.WINS, cr.TILES, cr.LOOP_FWD
    rows_mod.CLUSTER_ABOVE_COLS, rows_mod.CLUSTER_MIN_ROWS = 8192, 1
    cr.WINS = {op: set(rows_mod.SUPPORTED_DTYPES) for op in cr.WINS}
    try:
        _cluster_rows(cr, norms, softmax, 256, 16_392)
        # bf16 at the library's tiles: its values are converted from 32-bit words (Packed::at).
        _cluster_rows(cr, norms, softmax, 256, 16_392, torch.bfloat16)
        # Then each fp16 candidate tile once (the tiles scripts/gpu/cluster_rows_probe.py times).
        for i in range(max(len(t) for t in cr.CANDIDATE_TILES.values())):
            cands = cr.CANDIDATE_TILES.items()
            cr.TILES = {op: {torch.float16: t[i]} for op, t in cands if i < len(t)}
            _cluster_rows(cr, norms, softmax, 256, 16_392)
        # And the persistent forwards (cluster_rows.LOOP_FWD), at the default tiles.
        cr.TILES, cr.LOOP_FWD = {}, {op: {torch.float16} for op in cr.LOOP_OPS}
        _cluster_rows(cr, norms, softmax, 256, 16_392)
    finally:
        rows_mod.CLUSTER_ABOVE_COLS, rows_mod.CLUSTER_MIN_ROWS = keep
        cr.WINS, cr.TILES, cr.LOOP_FWD = keep_cr


def _cluster_rows(cr, norms, softmax, rows, cols, dtype=torch.float16):
    x = rnd(rows, cols, dtype=dtype).requires_grad_()
    w, b = (rnd(cols, dtype=dtype).requires_grad_() for _ in range(2))
    assert cr.use(x, "layer_norm_fwd", w, b)
    dy = rnd(rows, cols, dtype=dtype)
    for name in ("softmax", "rms", "layer"):
        xr = x.detach().float().requires_grad_()
        if name == "softmax":
            args, ref_args = (), ()
            y, ref = softmax.softmax(x), torch.softmax(xr, -1)
        else:
            args = (w,) if name == "rms" else (w, b)
            ref_args = [a.detach().float().requires_grad_() for a in args]
            fn = norms.rms_norm if name == "rms" else norms.layer_norm
            ref_fn = norms.rms_norm_ref if name == "rms" else norms.layer_norm_ref
            y, ref = fn(x, *args), ref_fn(xr, *ref_args)
        close(y, ref)
        grads = torch.autograd.grad(y, [x, *args], dy)
        grads_ref = torch.autograd.grad(ref, [xr, *ref_args], dy.float())
        for g, gr in zip(grads, grads_ref):
            close(g, gr, 5e-2)


def matmul():
    from kernels import matmul as mm

    a, b = rnd(123, 200, scale=0.1), rnd(200, 77, scale=0.1)
    close(mm.matmul(a, b), a.float() @ b.float())
    if device.capabilities().tma:  # the persistent TMA kernel: K and N multiples of 8
        b = rnd(200, 80, scale=0.1)
        close(mm.matmul(a, b, persistent=True), a.float() @ b.float())


def attention_fwd_bwd():
    from kernels import flash_attention as fa

    cases = [(False, 33, 70, 64), (True, 45, 45, 128)]
    # The default backward twice: its second call is launched from C++ (kernels.replay) where the
    # extension builds.
    runs = [(c, b) for c in cases for b in (*fa.BACKWARDS, fa.BACKWARDS[0])]
    for (causal, n_q, n_kv, d), backward in runs:
        q, k, v = (rnd(1, 2, n, d).requires_grad_() for n in (n_q, n_kv, n_kv))
        o = fa.attention(q, k, v, causal, backward=backward)
        qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
        ref = fa.attention_ref(qr, kr, vr, causal)
        close(o, ref)
        do = rnd(1, 2, n_q, d)
        for g, gr in zip(
            torch.autograd.grad(o, [q, k, v], do),
            torch.autograd.grad(ref, [qr, kr, vr], do.float()),
        ):
            close(g, gr, 5e-2)


def paged_decode():
    from kernels import _validate
    from kernels import paged_attention as pa

    q, _, _, kc, vc, table, lens = pa.decode_case(
        3, 96, n_heads=8, n_kv=2, head_dim=64, dtype=torch.float16
    )
    lens = torch.tensor([1, 37, 96], dtype=torch.int32, device=DEV)
    ref = pa.paged_decode_ref(q, kc, vc, table, lens)
    for splits in (1, 3):
        close(pa.paged_decode(q, kc, vc, table, lens, num_splits=splits, config=(32, 4, 2)), ref)
    # The default path twice outside debug mode: the second call launches from C++ (kernels.replay).
    # Batch 1 over 512 tokens makes several splits, so the combine runs (a programmatic dependent).
    q, _, _, kc, vc, table, lens = pa.decode_case(
        1, 512, n_heads=8, n_kv=2, head_dim=64, dtype=torch.float16
    )
    one = (q, kc, vc, table, lens.fill_(300))
    assert pa.default_num_splits(1, 2, 512) > 1
    ref = pa.paged_decode_ref(*one)
    was = _validate.debug()
    _validate.debug(False)
    try:
        for _ in range(2):
            close(pa.paged_decode(*one), ref)
    finally:
        _validate.debug(was)


def mla_dsa():
    from kernels import dsa, mla

    q, qr, kv, table, lens = mla.decode_case([1, 0, 97], 5, 48, 16, block_size=16, dtype=BF16)
    ref = mla.mla_decode_ref(q, qr, kv, table, lens)
    for splits in (1, 3):
        close(mla.mla_decode(q, qr, kv, table, lens, num_splits=splits), ref)
    c = dsa.dsa_case([70, 0, 9], 5, 48, 16, 3, 32, n_queries=3, block_size=8, dtype=BF16,
                     idx_dtype=dsa.indexer_dtype())  # fmt: skip
    idx_args = (c["q_idx"], c["k_idx_cache"], c["w"], c["block_table"], c["positions"])
    scores = dsa.lightning_indexer(*idx_args)
    ref = dsa.lightning_indexer_ref(*idx_args)
    fin = torch.isfinite(ref)
    close(scores[fin], ref[fin], 5e-2)
    ind = dsa.topk_indices(scores, 16, c["positions"])
    args = (c["q_latent"], c["q_rope"], c["kv_cache"], c["block_table"], ind)
    ref = dsa.sparse_mla_ref(*args)
    for splits in (1, 2):
        close(dsa.sparse_mla(*args, num_splits=splits), ref)


def topk_select():
    from kernels import topk

    scores = torch.randn(3, 9001, device="cuda")
    positions = torch.tensor([9000, -1, 5000], device="cuda", dtype=torch.int32)
    for k, pos in ((700, None), (700, positions), (12000, positions)):
        got = topk.topk_ids(scores, k, pos)
        if pos is None:
            want = torch.topk(scores, k, dim=-1).indices.sort(-1).values
            assert torch.equal(got, want.to(torch.int32)), "topk_ids differs from torch.topk"


def quant_gemv():
    from kernels import quant

    for bits, group in [(4, 128), (8, None)]:
        qw = quant.quantize(rnd(200, 512, dtype=torch.float32, scale=0.02), bits, group)
        for m, path, split in [(3, "gemv", None), (5, "mma", None), (2, "mma", 2)]:
            x = rnd(m, 512, dtype=BF16)
            close(quant.gemv(x, qw, path=path, split_k=split), quant.gemv_ref(x, qw))
    why = quant.int4_mma_unavailable()
    if why is None:
        qw = quant.quantize(rnd(96, 1024, dtype=torch.float32, scale=0.02), 4, 128)
        for m in (1, 3, 8):
            x = rnd(m, 1024, dtype=torch.bfloat16)
            close(quant.gemv(x, qw, path="cuda"), quant.gemv_ref(x, qw))
    else:
        print(f"   (the CUDA int4 path skipped: {why})")


def quant_fp8():
    from kernels import quant

    if not device.capabilities().fp8:
        print("   (skipped: no fp8 tensor cores)")
        return
    x, w = rnd(33, 256, dtype=torch.bfloat16), rnd(130, 256, dtype=torch.bfloat16, scale=0.02)
    xq, xs = quant.quantize_fp8(x, "block")
    wq, ws = quant.quantize_fp8_weight(w, "block")
    close(quant.fp8_block_matmul(xq, xs, wq, ws), quant.fp8_block_matmul_ref(xq, xs, wq, ws))
    for gran in ("tensor", "row"):
        q, s = quant.quantize_fp8(x, gran)
        close(q.float() * s, x, 0.1)


def sgemm_ladder():
    from kernels import cuda

    why = cuda.unavailable_reason()
    if why:
        print(f"   (skipped: {why})")
        return
    a, b = rnd(130, 70, dtype=torch.float32), rnd(70, 200, dtype=torch.float32)
    for step in cuda.STEPS:
        close(cuda.sgemm(a, b, step), cuda.sgemm_ref(a, b), 1e-3)


def hopper_gemm():
    from kernels import cuda

    why = cuda.hgemm_unavailable_reason()
    if why:
        print(f"   (skipped: {why})")
        return
    # M, N off every 128-row tile, K off the 64-wide k-step and not a multiple of 8 (zero-padded);
    # B in both layouts (the transposed one is what nn.Linear's weight gives).
    a = rnd(200, 100, dtype=BF16)
    b_t = rnd(264, 100, dtype=BF16)  # [N, K]: b = b_t.T, no copy
    for b in (b_t.T.contiguous(), b_t.T):
        ref = a.float() @ b.float()
        for step in cuda.HGEMM_STEPS:
            close(cuda.hgemm(a, b, step), ref, 2e-2)


def hopper_attention():
    from kernels.cuda import fa_ws, fa_ws_bwd

    why = fa_ws.unavailable_reason()
    if why:
        print(f"   (skipped: {why})")
        return
    # 200 tokens: the last key block and query step end mid-tile; two heads, so a tile's spare rows
    # are the next head's.
    q, k, v, do = (rnd(1, 2, 200, 128, dtype=BF16) for _ in range(4))
    for causal in (False, True):
        ref, _ = fa_ws.attention_ref(q.float(), k.float(), v.float(), causal=causal)
        for schedule in fa_ws.SCHEDULES:
            close(fa_ws.attention(q, k, v, causal=causal, schedule=schedule)[0], ref, 2e-2)
        leaves = [t.float().requires_grad_() for t in (q, k, v)]
        fa_ws.attention_ref(*leaves, causal=causal)[0].backward(do.float())
        o, lse = fa_ws.attention(q, k, v, causal=causal)
        for variant in fa_ws_bwd.VARIANTS:  # every schedule of the loop
            grads = fa_ws_bwd.backward(q, k, v, o, lse, do, causal=causal, variant=variant)
            for got, leaf in zip(grads, leaves):
                close(got, leaf.grad, 3e-2)


def megakernel():
    from kernels import megakernel as mk

    w, b = mk.make_weights(3, 200, dtype=torch.float16)
    x = rnd(3, 200)
    ref = mk.mlp_stack_ref(x, w, b, round_each_layer=True)
    close(mk.fused_mlp_stack(x, w, b, persistent=False), ref)
    if device.GPU_MODE:
        close(mk.fused_mlp_stack(x, w, b, persistent=True), ref)
        assert not mk.barrier_timeouts()


def trees():
    from kernels import trees as tr

    X = torch.randn(1000, 13, device=DEV)
    ens = tr.random_ensemble(37, 5, 13, X=X, dev=DEV)
    pred, _ = tr.predict_triton(ens, X)
    close(pred, tr.predict_ref(ens, X), 1e-4)


def moe_fwd_bwd():
    from kernels import moe

    # 37 tokens, top-3 of 12 experts (3 never chosen), widths off every tile: partial row tiles,
    # empty experts, masked K and N edges; both weight layouts; forward and every gradient.
    T, D, F, E, k = 37, 200, 136, 12, 3
    bias = moe.skewed_bias(E, zipf=0.5, n_empty=3).to(DEV)
    for trans_b in (False, True):
        gate = (E, F, D) if trans_b else (E, D, F)
        down = (E, D, F) if trans_b else (E, F, D)
        ins = [rnd(T, D), rnd(E, D, scale=D**-0.5), rnd(*gate, scale=D**-0.5),
               rnd(*gate, scale=D**-0.5), rnd(*down, scale=F**-0.5)]  # fmt: skip
        ins = [t.to(BF16).requires_grad_() for t in ins]
        refs = [t.detach().float().requires_grad_() for t in ins]
        kw = dict(top_k=k, router_bias=bias, trans_b=trans_b)
        out, ref = moe.moe_layer(*ins, **kw), moe.moe_layer_ref(*refs, **kw)
        close(out, ref)
        dy = rnd(T, D, dtype=BF16)
        out.backward(dy)
        ref.backward(dy.float())
        # Norm-wise: a gradient summed over tokens in bf16 can cancel to a small element whose
        # error is large next to it (one router-weight element of 2,400 once missed 5e-2 by 0.02).
        for name, a, b in zip(("x", "router", "gate", "up", "down"), ins, refs):
            err = rel_error(a.grad, b.grad)
            assert err < 2e-2, f"d{name}: relative error {err:.2e}"


STEPS = [vector_add, softmax_fwd_bwd, norms_fwd_bwd, cluster_rows, matmul, attention_fwd_bwd, paged_decode, mla_dsa,
         topk_select, quant_gemv, quant_fp8, sgemm_ladder, hopper_gemm, hopper_attention, megakernel,
         trees, moe_fwd_bwd]  # fmt: skip


def _run_each_candidate_once() -> None:
    """Autotuners run every candidate once instead of timing it: under memcheck a kernel runs
    orders of magnitude slower, so timing (tens of launches a candidate) would take minutes, while
    one run of each candidate still checks every configuration's memory accesses."""
    import importlib
    import pkgutil

    import triton

    import kernels

    def once(kernel_call, quantiles=None, **_):
        kernel_call()
        return [1.0, 1.0, 1.0] if quantiles else 1.0

    for info in pkgutil.walk_packages(kernels.__path__, "kernels."):
        for obj in vars(importlib.import_module(info.name)).values():
            if isinstance(obj, triton.runtime.Autotuner):
                obj._do_bench = once


def main() -> int:
    print(device.describe().splitlines()[0])
    if device.GPU_MODE:
        _run_each_candidate_once()
    failed, skipped = [], []
    skip = set(os.environ.get("SANITIZE_SKIP", "").split())
    only = set(os.environ.get("SANITIZE_ONLY", "").split())
    for step in STEPS:
        if step.__name__ in skip or (only and step.__name__ not in only):
            why = "SANITIZE_SKIP" if step.__name__ in skip else "SANITIZE_ONLY"
            print(f"skip  {step.__name__} ({why})")
            skipped.append(step.__name__)
            continue
        t0 = time.perf_counter()
        torch.manual_seed(0)  # the same inputs on every run: a failure can be replayed
        try:
            step()
            torch.cuda.synchronize() if device.GPU_MODE else None
            print(f"ok    {step.__name__:<18} {time.perf_counter() - t0:6.1f} s", flush=True)
        except Exception:  # noqa: BLE001 - report every kernel, then fail
            failed.append(step.__name__)
            print(f"FAIL  {step.__name__}\n{traceback.format_exc(limit=3)}", flush=True)
    ran = len(STEPS) - len(skipped)
    print(
        f"sanitize_all: {ran - len(failed)}/{ran} ok"
        + (f", {len(skipped)} of {len(STEPS)} skipped" if skipped else "")
        + (f", failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
