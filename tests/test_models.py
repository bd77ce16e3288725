import math

import pytest
import torch
import torch.nn.functional as F

from kernels import device, models

DEV = device.DEVICE


def _mlp_ref(block: models.MLPBlock, x: torch.Tensor) -> torch.Tensor:
    """The MLP block written from its parameters, in fp64."""
    p = {k: v.double() for k, v in block.state_dict().items()}
    xd = x.double()
    mean = xd.mean(-1, keepdim=True)
    var = ((xd - mean) ** 2).mean(-1, keepdim=True)
    h = (xd - mean) / torch.sqrt(var + block.eps) * p["norm.weight"] + p["norm.bias"]
    h = h @ p["fc1.weight"].T + p["fc1.bias"]
    h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    return xd + h @ p["fc2.weight"].T + p["fc2.bias"]


def _attention_ref(attn: models.CausalSelfAttention, x: torch.Tensor) -> torch.Tensor:
    p = {k: v.double() for k, v in attn.state_dict().items()}
    b, s, d = x.shape
    hd = d // attn.n_heads
    qkv = x.double() @ p["qkv.weight"].T + p["qkv.bias"]
    q, k, v = (t.reshape(b, s, attn.n_heads, hd).transpose(1, 2) for t in qkv.split(d, dim=-1))
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
    return y @ p["out.weight"].T + p["out.bias"]


@pytest.mark.parametrize("shape, d_ff", [((7, 48), 80), ((5, 3, 64), None), ((1, 1, 1, 16), 3)])
@pytest.mark.parametrize("decomposed", [False, True])
def test_mlp_block_matches_reference(shape, d_ff, decomposed):
    torch.manual_seed(0)
    block = models.MLPBlock(shape[-1], d_ff, decomposed=decomposed, device=DEV)
    x = torch.randn(shape, device=DEV)
    out = block(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), _mlp_ref(block, x), rtol=1e-5, atol=1e-5)


def test_decomposed_is_the_same_function_in_bf16():
    torch.manual_seed(0)
    block = models.MLPBlock(96, dtype=torch.bfloat16, device=DEV)
    x = torch.randn(13, 96, device=DEV, dtype=torch.bfloat16)
    fused = block(x)
    block.decomposed = True
    # bf16 storage, the decomposed GELU rounds after each of its elementary ops.
    torch.testing.assert_close(block(x), fused, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused.double(), _mlp_ref(block, x), rtol=2e-2, atol=2e-2)


def test_mlp_block_dims_dtype_device():
    block = models.MLPBlock(32, dtype=torch.bfloat16, device=DEV)
    assert block.d_ff == 128
    assert block.fc1.weight.shape == (128, 32) and block.fc2.weight.shape == (32, 128)
    assert {p.dtype for p in block.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in block.parameters()} == {DEV.type}


def test_mlp_stack_applies_layers_in_order():
    torch.manual_seed(0)
    stack = models.MLPStack(3, 24, 40, device=DEV)
    x = torch.randn(5, 24, device=DEV)
    expected = x
    for layer in stack.layers:
        expected = layer(expected)
    torch.testing.assert_close(stack(x), expected, rtol=0, atol=0)
    assert len(stack.layers) == 3 and stack.layers[0].d_ff == 40


@pytest.mark.parametrize("b, s, d, heads", [(2, 13, 24, 3), (1, 1, 16, 1), (3, 33, 64, 8)])
def test_attention_matches_reference(b, s, d, heads):
    torch.manual_seed(0)
    attn = models.CausalSelfAttention(d, heads, device=DEV)
    x = torch.randn(b, s, d, device=DEV)
    torch.testing.assert_close(attn(x).double(), _attention_ref(attn, x), rtol=1e-4, atol=1e-5)


def test_attention_is_causal():
    torch.manual_seed(0)
    attn = models.CausalSelfAttention(32, 4, device=DEV)
    x = torch.randn(2, 10, 32, device=DEV)
    changed = x.clone()
    changed[:, 6:] = torch.randn(2, 4, 32, device=DEV)  # the future of position 5
    a, b = attn(x), attn(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_decoder_block_composition():
    torch.manual_seed(0)
    block = models.DecoderBlock(48, 6, 96, device=DEV)
    x = torch.randn(2, 11, 48, device=DEV)
    h = x + block.attn(F.layer_norm(x, (48,), block.norm.weight, block.norm.bias))
    torch.testing.assert_close(block(x), block.mlp(h), rtol=1e-6, atol=1e-6)
    assert block.mlp.d_ff == 96


@pytest.mark.parametrize(
    "build, err, match",
    [
        (lambda: models.MLPBlock(0), ValueError, "d_model must be a positive int"),
        (lambda: models.MLPBlock(8, -1), ValueError, "d_ff must be a positive int"),
        (lambda: models.MLPBlock(8.0), ValueError, "d_model"),
        (lambda: models.MLPStack(0, 8), ValueError, "n_layers"),
        (lambda: models.CausalSelfAttention(30, 4), ValueError, "n_heads must divide"),
        (lambda: models.CausalSelfAttention(32, 0), ValueError, "n_heads must be a positive"),
    ],
)
def test_bad_construction(build, err, match):
    with pytest.raises(err, match=match):
        build()


@pytest.mark.parametrize(
    "module, x, err, match",
    [
        (models.MLPBlock(16), torch.zeros(4, 15), ValueError, "last dimension d_model=16"),
        (models.MLPBlock(16), torch.zeros(()), ValueError, "x must have last dimension"),
        (models.MLPBlock(16), [[0.0] * 16], TypeError, "x must be a torch.Tensor"),
        (models.CausalSelfAttention(16, 2), torch.zeros(4, 16), ValueError, "x must be 3-D"),
        (models.DecoderBlock(16, 2), torch.zeros(1, 4, 8), ValueError, "d_model=16"),
    ],
)
def test_bad_input(module, x, err, match):
    with pytest.raises(err, match=match):
        module(x)


def test_napkin_helpers():
    assert models.mlp_flops(10, 4) == 2 * 2 * 10 * 4 * 16
    assert models.mlp_flops(10, 4, 6) == 2 * 2 * 10 * 4 * 6
    assert models.mlp_weight_bytes(4) == 2 * 4 * 16 * 2
    assert models.mlp_weight_bytes(4, 6, torch.float32) == 2 * 4 * 6 * 4
    block = models.MLPBlock(4, 6, dtype=torch.float32)
    weights = block.fc1.weight.numel() + block.fc2.weight.numel()
    assert models.mlp_weight_bytes(4, 6, torch.float32) == 4 * weights
