"""kernels.cuda.fa_ws_bwd: the warp-specialised FlashAttention backward in CUDA C++.

On a CPU with nvcc the kernels are compiled for sm_90a and their instructions checked: the five
products on the tensor cores (three m64n64, two m64n128 with A from registers), dQ by TMA
reductions, registers traded, nothing spilled. On a Hopper GPU the gradients are compared with an
fp32 autograd reference at odd shapes, causal and not."""

import math
import re

import pytest
import torch

from kernels import device
from kernels.cuda import fa_ws, fa_ws_bwd, hgemm_check

NVCC = hgemm_check.find_tool("nvcc")
BF16 = torch.bfloat16
HOPPER = fa_ws.unavailable_reason() is None


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    return fa_ws_bwd.compile_check(tmp_path_factory.mktemp("fawsbwd"))


@pytest.mark.skipif(NVCC is None, reason="nvcc not installed")
def test_compiles_for_sm90a_into_its_instructions(compiled):
    assert not compiled.problems(), compiled.problems()
    if not compiled.sass:
        pytest.skip("no cuobjdump to disassemble with")
    kernels = {
        n: s for n, s in hgemm_check.sass_by_kernel(compiled.sass).items() if "bwd_kernelILb" in n
    }
    # causal or not, two or three ring slots, each schedule
    assert len(kernels) == 4 * len(fa_ws_bwd.VARIANTS)
    for name, sass in kernels.items():
        small = re.findall(r"HGMMA\.64x64x16\.F32\.BF16 ([^;]*);", sass)
        wide = re.findall(r"HGMMA\.64x128x16\.F32\.BF16 ([^;]*);", sass)
        # S^T, dP^T (8 k16 slices each over d) and dQ (8 over keys), all from shared memory; dV and
        # dK (4 slices each over the 64 queries) with A from registers.
        assert len(small) >= 24 and all(re.match(r"R\d+, gdesc", h) for h in small), (name, small)
        assert len(wide) >= 8 and all(re.match(r"R\d+, R\d+, gdesc", h) for h in wide), (name, wide)
        for op in ("UTMALDG", "UTMAREDG", "USETMAXREG.TRY_ALLOC", "USETMAXREG.DEALLOC"):
            assert op in sass, (name, op)
        assert not re.search(r"\b(LDL|STL|RED|ATOM)\b", sass), name  # no spills, no scalar atomics


def _reference(q, k, v, do, causal):
    """fp32 gradients through autograd of fa_ws.attention_ref."""
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    o, _ = fa_ws.attention_ref(*leaves, causal=causal)
    o.backward(do.float())
    return [t.grad for t in leaves]


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a) and nvcc")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "b, h, n",
    [(1, 1, 128), (1, 1, 64), (2, 3, 264), (1, 2, 1000), (1, 1, 1), (2, 2, 77), (1, 1, 1001)],
)
def test_gradients_match_fp32_reference(b, h, n, causal):
    # Lengths that end mid-tile (keys past N are the next head's rows in the flattened view: they
    # must add nothing), one token, several heads.
    g = torch.Generator(device=device.DEVICE).manual_seed(n + 7 * h)
    q, k, v, do = (torch.randn(b, h, n, 128, generator=g, device=device.DEVICE, dtype=BF16)
                   for _ in range(4))  # fmt: skip
    o, lse = fa_ws.attention(q, k, v, causal=causal)
    grads = fa_ws_bwd.backward(q, k, v, o, lse, do, causal=causal)
    for name, got, want in zip("qkv", grads, _reference(q, k, v, do, causal)):
        assert got.shape == want.shape and got.dtype == BF16, name
        # Relative to the gradient's size, or to an rms of 1e-3 where it is zero: with one token
        # P = 1 and dS = dP - delta = 0, so dQ and dK are rounding noise (rms 0.05-0.2 elsewhere).
        scale = max(want.norm().item(), 1e-3 * want.numel() ** 0.5)
        err = (got.float() - want).norm().item() / scale
        assert err < 2e-2, (name, err)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a) and nvcc")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("stages, group_heads", [(2, 0), (3, 0), (2, 4), (3, 4), (2, 1)])
def test_variants_match_the_default(stages, group_heads, causal):
    # 2 x 3 heads: groups of 4 leave a last group of 2. dK and dV add in the same order whatever
    # the block order; dQ's reductions arrive in another order, so it may differ by rounding.
    g = torch.Generator(device=device.DEVICE).manual_seed(5)
    q, k, v, do = (torch.randn(2, 3, 264, 128, generator=g, device=device.DEVICE, dtype=BF16)
                   for _ in range(4))  # fmt: skip
    o, lse = fa_ws.attention(q, k, v, causal=causal)
    want = fa_ws_bwd.backward(q, k, v, o, lse, do, causal=causal)
    got = fa_ws_bwd.backward(q, k, v, o, lse, do, causal=causal, stages=stages,
                             group_heads=group_heads)  # fmt: skip
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=1e-2, atol=1e-3)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a) and nvcc")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", [v for v in fa_ws_bwd.VARIANTS if v])  # each against 0
def test_schedules_match_the_first(variant, causal):
    # The schedule changes when the loop waits and who issues dQ's reductions, not the arithmetic:
    # dK and dV bit for bit, dQ (its reductions may land in another order) up to rounding.
    g = torch.Generator(device=device.DEVICE).manual_seed(9)
    q, k, v, do = (torch.randn(2, 3, 333, 128, generator=g, device=device.DEVICE, dtype=BF16)
                   for _ in range(4))  # fmt: skip
    o, lse = fa_ws.attention(q, k, v, causal=causal)
    want = fa_ws_bwd.backward(q, k, v, o, lse, do, causal=causal, variant=0)
    got = fa_ws_bwd.backward(q, k, v, o, lse, do, causal=causal, variant=variant)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    torch.testing.assert_close(got[2], want[2], rtol=0, atol=0)
    torch.testing.assert_close(got[0].float(), want[0].float(), rtol=1e-2, atol=1e-3)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a) and nvcc")
def test_matches_the_triton_backward():
    from kernels import flash_attention as fa

    g = torch.Generator(device=device.DEVICE).manual_seed(11)
    q, k, v, do = (torch.randn(2, 4, 1024, 128, generator=g, device=device.DEVICE, dtype=BF16)
                   for _ in range(4))  # fmt: skip
    for causal in (False, True):
        o, lse = fa_ws.attention(q, k, v, causal=causal)
        ours = fa_ws_bwd.backward(q, k, v, o, lse, do, causal=causal)
        triton = fa._backward(q, k, v, o, lse, do, causal, 1 / math.sqrt(128))
        for a, b in zip(ours, triton):
            torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90a) and nvcc")
@pytest.mark.parametrize("causal", [False, True])
def test_attention_is_differentiable(causal):
    # Through autograd, with a gradient that is not contiguous (the transpose of a weight's).
    g = torch.Generator(device=device.DEVICE).manual_seed(3)
    q, k, v = (torch.randn(1, 3, 200, 128, generator=g, device=device.DEVICE, dtype=BF16)
               for _ in range(3))  # fmt: skip
    w = torch.randn(1, 3, 128, 200, generator=g, device=device.DEVICE, dtype=BF16).transpose(-1, -2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    (fa_ws_bwd.attention(*leaves, causal=causal).float() * w.float()).sum().backward()
    want = _reference(q, k, v, w, causal)
    for name, got, ref in zip("qkv", (t.grad for t in leaves), want):
        err = (got.float() - ref).norm().item() / ref.norm().item()
        assert err < 2e-2, (name, err)


def test_rejects_bad_input():
    q = torch.zeros(1, 1, 8, 128, dtype=BF16)
    lse = torch.zeros(1, 1, 8)
    with pytest.raises(ValueError, match="o must be"):
        fa_ws_bwd.backward(q, q, q, q.float(), lse, q)
    with pytest.raises(ValueError, match="lse must be"):
        fa_ws_bwd.backward(q, q, q, q, lse[..., :4], q)
    with pytest.raises(ValueError, match="stages must be"):
        fa_ws_bwd.backward(q, q, q, q, lse, q, stages=4)
    with pytest.raises(ValueError, match="group_heads must be"):
        fa_ws_bwd.backward(q, q, q, q, lse, q, group_heads=-1)
    with pytest.raises(ValueError, match="variant must be"):
        fa_ws_bwd.backward(q, q, q, q, lse, q, variant=8)
    with pytest.raises(ValueError, match="head dimension"):
        x = torch.zeros(1, 1, 8, 64, dtype=BF16)
        fa_ws_bwd.backward(x, x, x, x, lse, x)
