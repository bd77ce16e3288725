import pytest
import torch

from kernels import device, memory


@pytest.mark.parametrize("n", [1, 100, 2048, 2049, 10_007])
@pytest.mark.parametrize("passes", [1, 3])
def test_read_passes_sums_every_element_passes_times(n, passes):
    x = torch.randn(n, device=device.DEVICE)
    got = memory.read_passes(x, passes, block=1024)
    torch.testing.assert_close(got, memory.read_passes_ref(x, passes), rtol=1e-5, atol=1e-3)


def test_read_passes_reads_the_tail():
    # Every element is 1: any skipped or double-read chunk changes the count.
    x = torch.ones(5 * 1024 + 3, device=device.DEVICE)
    assert memory.read_passes(x, 2, block=1024).item() == 2 * x.numel()


def test_read_passes_fp16():
    x = torch.randn(3001, device=device.DEVICE, dtype=torch.float16)
    torch.testing.assert_close(
        memory.read_passes(x), memory.read_passes_ref(x), rtol=1e-4, atol=1e-2
    )


@pytest.mark.parametrize(
    "args, err, match",
    [
        ((torch.zeros(2, 2),), ValueError, "x must be 1-D"),
        ((torch.zeros(4), 0), ValueError, "passes"),
        ((torch.zeros(4, dtype=torch.int64),), TypeError, "x must have dtype"),
    ],
)
def test_read_passes_rejects_bad_input(args, err, match):
    with pytest.raises(err, match=match):
        memory.read_passes(*args)
