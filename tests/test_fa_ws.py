"""kernels.cuda.fa_ws: the warp-specialised FlashAttention forward in CUDA C++.

On a CPU with nvcc the kernels are compiled for sm_90a and their instructions checked (the two
products run on the tensor cores, P from registers; registers are traded; nothing spills). On a
Hopper GPU the outputs and the log-sum-exp are compared with an fp32 reference at odd shapes."""

import math
import re

import pytest
import torch

from kernels import device
from kernels.cuda import fa_ws, hgemm_check

NVCC = hgemm_check.find_tool("nvcc")
BF16 = torch.bfloat16
HOPPER = fa_ws.unavailable_reason() is None
BIG = torch.zeros(1, 1, 8, 128, dtype=BF16).expand(65536, 1, 8, 128)  # a view: no memory


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return fa_ws.compile_check(tmp_path_factory.mktemp("faws"))


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_compiles_for_sm90a_into_its_instructions(compiled):
    assert not compiled.problems(), compiled.problems()
    if not compiled.sass:
        pytest.skip("no cuobjdump to disassemble with")
    kernels = hgemm_check.sass_by_kernel(compiled.sass)
    # Causal or not: plain, overlapped, persistent (plain on a tile loop) and persistent-early.
    assert len(kernels) == 8
    for name, sass in kernels.items():
        second = re.search(r"ILb[01]ELb1E", name) is not None  # the second template argument
        persistent = "persistent" in name
        overlap, early = second and not persistent, second and persistent
        hgmma = re.findall(r"HGMMA\.64x128x16\.F32\.BF16 ([^;]*);", sass)
        from_smem = [h for h in hgmma if re.match(r"R\d+, gdesc", h)]
        from_regs = [h for h in hgmma if re.match(r"R\d+, R\d+, gdesc", h)]
        # S = Q K^T from shared memory; O += P V with P in registers, eight k16 slices each. The
        # plain schedule has each twice (its loop, and the masked last tile peeled off it); the
        # overlapped one three times (first or last phase, loop, peeled last step); the early
        # persistent one four times (the first S issued before the tile loop and at the end of the
        # last tile; the first tile, alone or with more after it; loop; peeled last tile).
        want = 24 if overlap else 32 if early else 16
        assert len(from_smem) == want and len(from_regs) == want, (name, hgmma)
        # The first slice of every S overwrites the accumulators (scale-d false: "!UPT").
        assert sum("!UPT" in h for h in from_smem) == want // 8, (name, hgmma)
        for op in ("UTMALDG", "USETMAXREG.TRY_ALLOC", "USETMAXREG.DEALLOC", "SYNCS.PHASECHK"):
            assert op in sass, op
        assert not re.search(r"\b(LDL|STL)\b", sass)
        assert ("BAR.ARV" in sass) == overlap  # the ping-pong hands the turn over with bar.arrive
        # The loop over unmasked key tiles (16 HGMMA: S and P V), per thread and key tile of 64
        # scores: 577 instructions when written (938 before the mask left this loop and the scale
        # joined the FFMA), 66 MUFU.EX2 (64 scores, 2 rescale factors), no mask selects.
        body = min((m for m in hgemm_check.loop_mixes(sass) if m.get("HGMMA") == 16),
                   key=lambda m: sum(m.values()))  # fmt: skip
        assert sum(body.values()) <= 600, (name, body)
        assert body.get("MUFU", 0) <= 70 and body.get("FSEL", 0) <= 4, (name, body)


@pytest.mark.parametrize(
    "kw, err, match",
    [
        (dict(q=torch.zeros(1, 1, 8, 128)), TypeError, "q must have dtype bfloat16"),
        (dict(k=torch.zeros(1, 8, 128, dtype=BF16)), ValueError, "k must be 4-D"),
        (dict(v=torch.zeros(1, 1, 16, 128, dtype=BF16)), ValueError, "one shape"),
        (dict(q=torch.zeros(1, 1, 8, 64, dtype=BF16), k=torch.zeros(1, 1, 8, 64, dtype=BF16),
              v=torch.zeros(1, 1, 8, 64, dtype=BF16)), ValueError, "head dimension must be 128"),
        (dict(sm_scale=0.0), ValueError, "sm_scale must be positive"),
        (dict(sm_scale=True), TypeError, "sm_scale must be a number"),
        (dict(q=[1]), TypeError, "q must be a torch.Tensor"),
        (dict(schedule="fast"), ValueError, "schedule must be one of"),
        (dict(q=BIG, k=BIG, v=BIG), ValueError, "at most 65,535"),
    ],
)  # fmt: skip
def test_bad_input_is_named_before_anything_is_built(kw, err, match):
    args = dict(q=torch.zeros(1, 1, 8, 128, dtype=BF16), k=torch.zeros(1, 1, 8, 128, dtype=BF16),
                v=torch.zeros(1, 1, 8, 128, dtype=BF16))  # fmt: skip
    sm_scale = kw.pop("sm_scale", None)
    schedule = kw.pop("schedule", "overlap")
    args.update(kw)
    with pytest.raises(err, match=match):
        fa_ws.attention(args["q"], args["k"], args["v"], sm_scale=sm_scale, schedule=schedule)


@pytest.mark.skipif(HOPPER, reason="on Hopper the kernel runs")
def test_says_what_it_needs_elsewhere():
    q = torch.zeros(1, 1, 8, 128, dtype=BF16)
    with pytest.raises(RuntimeError, match="kernels.cuda"):
        fa_ws.attention(q, q, q)


def test_reference_is_softmax_attention_in_log2_units():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 128, generator=g) for _ in range(3))
    for causal in (False, True):
        o, lse = fa_ws.attention_ref(q, k, v, causal=causal)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(o, want, rtol=1e-5, atol=1e-5)
        s = q @ k.transpose(-1, -2) / math.sqrt(128)
        if causal:
            s = s.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(lse, torch.logsumexp(s, -1) * math.log2(math.e))


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a) and nvcc")
@pytest.mark.parametrize("schedule", fa_ws.SCHEDULES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "b, h, n",
    [
        (1, 1, 128),
        (2, 3, 264),
        (1, 2, 1000),
        (1, 1, 8),
        (1, 2, 2048),
        (1, 1, 1),
        (2, 2, 77),
        (1, 1, 1001),
        (4, 16, 1001),  # 512 tiles: the persistent grid's blocks take several each
    ],
)
def test_matches_fp32_reference(b, h, n, causal, schedule):
    # Sequence lengths that end mid-tile (264, 1000, 8; 1, 77 and 1001: no multiple of 8 needed),
    # heads whose tiles border each other in the flattened [B*H*N, 128] view (keys past N are the
    # next head's rows: masked), a long one.
    g = torch.Generator(device=device.DEVICE).manual_seed(n + h)
    q, k, v = (torch.randn(b, h, n, 128, generator=g, device=device.DEVICE, dtype=BF16)
               for _ in range(3))  # fmt: skip
    o, lse = fa_ws.attention(q, k, v, causal=causal, schedule=schedule)
    o_ref, lse_ref = fa_ws.attention_ref(q, k, v, causal=causal)
    assert o.shape == q.shape and o.dtype == BF16 and lse.shape == (b, h, n)
    torch.testing.assert_close(o.float(), o_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-3, atol=1e-3)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a) and nvcc")
def test_lse_is_the_triton_forwards():
    # The log-sum-exp is kernels.flash_attention's (log2 units), so its backward can take it.
    from kernels import flash_attention as fa

    g = torch.Generator(device=device.DEVICE).manual_seed(3)
    q, k, v = (torch.randn(1, 2, 512, 128, generator=g, device=device.DEVICE, dtype=BF16)
               for _ in range(3))  # fmt: skip
    for causal in (False, True):
        o, lse = fa_ws.attention(q, k, v, causal=causal)
        o_triton, lse_triton = fa._forward(q, k, v, causal, 1 / math.sqrt(128))
        torch.testing.assert_close(lse, lse_triton, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(o.float(), o_triton.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a) and nvcc")
def test_unaligned_views_give_the_same_result():
    # A contiguous view 8 bytes into its storage: TMA needs 16-byte aligned bases, so it is copied.
    shape = (1, 2, 264, 128)
    g = torch.Generator(device=device.DEVICE).manual_seed(5)
    buf = torch.randn(3 * math.prod(shape) + 4, generator=g, device=device.DEVICE, dtype=BF16)
    q, k, v = (buf[4 + i * math.prod(shape) :][: math.prod(shape)].view(shape) for i in range(3))
    assert q.data_ptr() % 16 != 0
    o, lse = fa_ws.attention(q, k, v, causal=True)
    o2, lse2 = fa_ws.attention(q.clone(), k.clone(), v.clone(), causal=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_default_schedule_is_persistent_and_issues_early_with_the_mask():
    # The H100 measurements behind it: page 4.12, results/profiles/*-fa-persistent.txt and
    # *-fa-schedules*.txt (the persistent grid 1.08x plain at 512 tokens without the mask; the
    # early first S 1.006-1.033x the persistent schedule with the mask, level without it).
    assert fa_ws.default_schedule(True) == "persistent-early"
    assert fa_ws.default_schedule(False) == "persistent"
    assert set(map(fa_ws.default_schedule, (True, False))) <= set(fa_ws.SCHEDULES)
