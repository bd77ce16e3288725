"""kernels.topk: the radix select against a brute-force sort, in the interpreter on a CPU."""

import pytest
import torch

from kernels import device, topk

I32 = torch.int32


def _reference(scores, k, positions=None):
    """Brute force: every id by descending score, ties by ascending id, the first k; then -1 for
    the ids the row does not see and for the slots past the row."""
    out = []
    for r, row in enumerate(scores):
        order = sorted(range(row.numel()), key=lambda i: (-row[i].item(), i))[:k]
        if positions is None:
            seen = [i for i in order if row[i] > float("-inf")]
        else:
            seen = [i for i in order if i <= positions[r]]
        out.append(sorted(seen))
    return out


def _check(scores, k, positions=None):
    got = topk.topk_ids(scores.to(device.DEVICE), k,
                        None if positions is None else positions.to(device.DEVICE)).cpu()  # fmt: skip
    assert got.shape == (scores.shape[0], k) and got.dtype == I32
    for row, want in zip(got, _reference(scores, k, positions)):
        real = row[row >= 0].tolist()
        assert real == want  # the same ids, in ascending order, each once
        assert (row[len(real) :] == -1).all()  # -1 after them: packed, then padded
    return got


@pytest.mark.parametrize("n", [1, 37, 4096, 9001])
@pytest.mark.parametrize("k", [1, 5, 64, 5000])
def test_distinct_scores_match_the_sort(n, k):
    # Rows longer than one chunk (4096), k below, at and above n; negative and positive scores.
    g = torch.Generator().manual_seed(n * 7 + k)
    scores = torch.randn(3, n, generator=g) * 100
    _check(scores, k)


def test_ties_at_the_threshold_go_to_the_lower_ids():
    # Many equal keys straddling the k-th place, across chunk boundaries; -0.0 and +0.0 are two keys.
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(-3, 4, (4, 9000), generator=g).float()
    scores[1] = 1.0  # one value everywhere: the first k ids
    scores[2, ::2] = -0.0
    got = _check(scores, 700)
    assert got[1].tolist() == list(range(700))
    # Deterministic: the same bits on a second call.
    assert torch.equal(topk.topk_ids(scores.to(device.DEVICE), 700).cpu(), got)


def test_positions_and_minus_inf():
    # -inf past each position, as the indexer leaves it; a row that sees nothing (-1); a row with
    # fewer visible ids than k; extreme values (the largest and smallest floats, +-inf).
    n = 5000
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(4, n, generator=g)
    positions = torch.tensor([4999, -1, 30, 4200], dtype=I32)
    scores = scores.masked_fill(torch.arange(n) > positions[:, None], float("-inf"))
    scores[0, 17] = float("inf")
    scores[0, 18] = torch.finfo(torch.float32).max
    scores[3, 5] = torch.finfo(torch.float32).min
    _check(scores, 64, positions)
    _check(scores, 64)  # without positions: -inf marks what the row does not see
    got = _check(scores, 64, positions)
    assert (got[1] == -1).all() and (got[2][:31] >= 0).all() and (got[2][31:] == -1).all()


def test_bad_input():
    s = torch.zeros(2, 5, device=device.DEVICE)
    with pytest.raises(ValueError, match="k must be"):
        topk.topk_ids(s, 0)
    with pytest.raises(ValueError, match="k must be"):
        topk.topk_ids(s, True)
    with pytest.raises(TypeError, match="scores"):
        topk.topk_ids(s.half(), 2)
    with pytest.raises(ValueError, match="scores"):
        topk.topk_ids(s[:, None], 2)
    with pytest.raises(ValueError, match="contiguous"):
        topk.topk_ids(torch.zeros(5, 2, device=device.DEVICE).t(), 2)
    with pytest.raises(ValueError, match="positions"):
        topk.topk_ids(s, 2, torch.zeros(3, dtype=I32, device=device.DEVICE))
    with pytest.raises(TypeError, match="positions"):
        topk.topk_ids(s, 2, torch.zeros(2, device=device.DEVICE))
    assert topk.topk_ids(torch.zeros(0, 5, device=device.DEVICE), 3).shape == (0, 3)


def test_deepseek_sized_rows_match_torch_topk():
    # DeepSeek sparse attention's case: 2,048 of 131,072 tokens per query (32 chunks per row).
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(2, 131072, generator=g)
    got = topk.topk_ids(scores.to(device.DEVICE), 2048).cpu()
    want = torch.topk(scores, 2048, dim=-1).indices.sort(-1).values.to(I32)
    assert torch.equal(got, want)


@pytest.mark.skipif(
    not device.GPU_MODE, reason="the grid limit is the GPU's (the interpreter has none)"
)
def test_more_rows_than_a_grid_axis_allows():
    # A prefill chunk of a large batch: 70,000 query rows, past the 65,535 of a grid's y and z axes.
    g = torch.Generator(device=device.DEVICE).manual_seed(4)
    scores = torch.randn(70_000, 64, generator=g, device=device.DEVICE)
    for k in (8, 64):  # the radix select, and every id
        got = topk.topk_ids(scores, k)
        want = torch.topk(scores, k, dim=-1).indices.sort(-1).values.to(I32)
        assert torch.equal(got, want)
