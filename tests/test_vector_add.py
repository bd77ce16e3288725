import pytest
import torch

from kernels import device, vector_add

SHAPES = [(1,), (7,), (1000,), (4096,), (4097,), (5, 123, 123), (1823, 781)]
DTYPES = [  # (dtype, rtol, atol): the kernel adds in fp32 and rounds once, like the reference
    (torch.float32, 0.0, 0.0),
    (torch.float16, 0.0, 0.0),
    # bf16: Triton's CPU interpreter rounds bf16 stores differently from the GPU (1 ulp).
    (torch.bfloat16, 0.0 if device.GPU_MODE else 2**-7, 0.0 if device.GPU_MODE else 1e-5),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype, rtol, atol", DTYPES)
def test_add_matches_reference(shape, dtype, rtol, atol):
    x = torch.randn(shape, device=device.DEVICE, dtype=dtype)
    y = torch.randn(shape, device=device.DEVICE, dtype=dtype)
    out = vector_add.add(x, y)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out, vector_add.add_ref(x, y), rtol=rtol, atol=atol)


@pytest.mark.parametrize("block_size, num_warps", [(128, 1), (1024, 4), (8192, 8)])
def test_add_any_launch_config(block_size, num_warps):
    x = torch.randn(3 * block_size + 5, device=device.DEVICE)
    y = torch.randn_like(x)
    out = vector_add.add(x, y, block_size=block_size, num_warps=num_warps)
    torch.testing.assert_close(out, vector_add.add_ref(x, y), rtol=0, atol=0)


@pytest.mark.parametrize(
    "n, dtype, block",
    [
        (1024, torch.float32, 512),  # one 16-byte vector a thread at least
        (1024, torch.bfloat16, 1024),
        (65536, torch.float32, 512),  # 128 programs for 132 SMs, not 16 of 4,096
        (65536, torch.bfloat16, 1024),
        (2**20, torch.float32, 4096),  # enough elements: the large-tensor block
        (2**28, torch.bfloat16, 4096),
    ],
)
def test_default_block_spreads_a_small_tensor_over_the_sms(monkeypatch, n, dtype, block):
    monkeypatch.setattr(vector_add, "sm_count", lambda interpreter=1: 132)  # an H100
    assert vector_add.default_block_size(n, dtype) == block


def test_default_block_runs_each_size_correctly():
    # Sizes that take different default blocks (in the interpreter, 4 "SMs"), one element past a
    # block boundary each.
    for n in (513, 4 * 1024 + 1, 16 * 4096 + 3):
        x = torch.randn(n, device=device.DEVICE)
        y = torch.randn_like(x)
        torch.testing.assert_close(vector_add.add(x, y), vector_add.add_ref(x, y), rtol=0, atol=0)


def test_add_writes_every_element():
    # Inputs first, then a NaN-filled block of the output's size is freed just before the launch:
    # on a GPU the caching allocator hands that block to `out`, so an element the mask wrongly skips
    # keeps its NaN.
    n = 3 * 1024 + 1
    x = torch.randn(n, device=device.DEVICE)
    poison = torch.full((n,), float("nan"), device=device.DEVICE)
    del poison
    out = vector_add.add(x, x, block_size=1024)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, 2 * x)


def test_add_empty():
    x = torch.empty(0, device=device.DEVICE)
    assert vector_add.add(x, x).numel() == 0


@pytest.mark.parametrize(
    "x, y, err, match",
    [
        (torch.zeros(4), torch.zeros(5), ValueError, "same shape"),
        (torch.zeros(4), torch.zeros(4, dtype=torch.float64), TypeError, "y must have dtype"),
        (torch.zeros(4, dtype=torch.int32), torch.zeros(4), TypeError, "x must have dtype"),
        (torch.zeros(4), torch.zeros(4, dtype=torch.float16), TypeError, "same dtype"),
        ([1.0, 2.0], torch.zeros(2), TypeError, "x must be a torch.Tensor"),
        (torch.zeros(4, 4).t(), torch.zeros(4, 4), ValueError, "x must be contiguous"),
    ],
)
def test_add_rejects_bad_input(x, y, err, match):
    with pytest.raises(err, match=match):
        vector_add.add(x, y)


@pytest.mark.parametrize("kw", [{"block_size": 1000}, {"num_warps": 3}, {"block_size": 0}])
def test_add_rejects_bad_launch_config(kw):
    x = torch.zeros(8)
    with pytest.raises(ValueError, match=next(iter(kw))):
        vector_add.add(x, x, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not device.GPU_MODE, reason="needs a GPU")
def test_add_rejects_a_cpu_tensor_on_a_gpu_machine():
    with pytest.raises(ValueError, match="x must be on cuda"):
        vector_add.add(torch.zeros(4), torch.zeros(4))


@pytest.mark.gpu
@pytest.mark.skipif(not device.GPU_MODE, reason="needs a GPU")
def test_add_under_cuda_graph_capture():
    x = torch.randn(5000, device="cuda", dtype=torch.bfloat16)
    y = torch.randn_like(x)
    vector_add.add(x, y)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = vector_add.add(x, y)
    x.normal_()
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, vector_add.add_ref(x, y), rtol=0, atol=0)
