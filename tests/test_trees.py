import numpy as np
import pytest
import torch

from kernels import device, trees

DEV = device.DEVICE


def _data(n, f, seed=0):
    return torch.randn(n, f, generator=torch.Generator().manual_seed(seed)).to(DEV)


@pytest.fixture(scope="module")
def fitted():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((1500, 5)).astype(np.float32)
    y = np.sin(2 * X[:, 0]) * X[:, 1] + 0.5 * (X[:, 2] > 0.3) + 0.05 * rng.standard_normal(1500)
    ens, history = trees.fit_gbdt(X, y, n_trees=25, depth=4, learning_rate=0.2)
    return ens, history, X, y


def test_fit_gbdt_reduces_training_error(fitted):
    ens, history, X, y = fitted
    assert ens.n_trees == 25 and ens.depth == 4 and ens.n_features == 5
    assert history[-1] < 0.5 * np.var(y), "boosting did not fit the signal"
    assert all(b <= a + 1e-12 for a, b in zip(history, history[1:])), "training error went up"
    # The ensemble's own prediction agrees with the training loop's bookkeeping.
    pred, _ = trees.predict_torch(ens, torch.from_numpy(X))
    mse = float(np.mean((y - pred.double().numpy()) ** 2))
    assert abs(mse - history[-1]) < 1e-4


@pytest.mark.parametrize("n_rows", [1, 37, 300])
def test_three_evaluators_agree_on_a_fitted_model(fitted, n_rows):
    ens, _, X, _ = fitted
    ens = ens.to(DEV)
    Xt = torch.from_numpy(X[:n_rows]).to(DEV)
    p_loop, l_loop = trees.predict_loop(ens, Xt)
    p_torch, l_torch = trees.predict_torch(ens, Xt)
    p_triton, l_triton = trees.predict_triton(ens, Xt)
    # The leaves reached are exact; the sums differ only in the order of fp32 additions.
    assert torch.equal(l_loop, l_torch) and torch.equal(l_loop, l_triton)
    ref = trees.predict_ref(ens, Xt)
    for p in (p_loop, p_torch, p_triton):
        torch.testing.assert_close(p.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "n_rows, n_trees, depth, n_features, block_r, block_t",
    [(1, 1, 1, 1, 16, 8), (50, 7, 3, 4, 16, 8), (129, 20, 5, 9, 64, 8), (33, 3, 6, 2, 32, 16)],
)
def test_random_ensembles_odd_shapes(n_rows, n_trees, depth, n_features, block_r, block_t):
    X = _data(n_rows, n_features, seed=n_rows)
    ens = trees.random_ensemble(n_trees, depth, n_features, X=X, seed=depth)
    _, l_loop = trees.predict_loop(ens, X)
    p, leaves = trees.predict_triton(ens, X, block_r=block_r, block_t=block_t)
    assert torch.equal(leaves, l_loop)
    assert leaves.min() >= 0 and leaves.max() < 2**depth
    torch.testing.assert_close(p.double(), trees.predict_ref(ens, X), rtol=1e-5, atol=1e-6)
    p2, none = trees.predict_triton(ens, X, return_leaves=False, block_r=block_r, block_t=block_t)
    assert none is None and torch.equal(p2, p)


def test_ties_go_left():
    # x == threshold goes left (LightGBM's "<=" rule): the leaf index is exact, not approximate.
    feature = torch.zeros(1, 1, dtype=torch.int32)
    threshold = torch.tensor([[0.5]])
    leaf = torch.tensor([[1.0, 2.0]])
    ens = trees.Ensemble(feature, threshold, leaf, 0.25, 1).to(DEV)
    X = torch.tensor([[0.5], [0.50000006], [-1.0]], device=DEV)
    for fn in (trees.predict_loop, trees.predict_torch, trees.predict_triton):
        p, leaves = fn(ens, X)
        assert leaves.flatten().tolist() == [0, 1, 0]
        assert p.tolist() == [1.25, 2.25, 1.25]


def test_unsplittable_node_sends_everything_left():
    feature = torch.zeros(1, 3, dtype=torch.int32)
    threshold = torch.tensor([[float("inf"), 0.0, 0.0]])
    leaf = torch.arange(4, dtype=torch.float32)[None, :]
    ens = trees.Ensemble(feature, threshold, leaf, 0.0, 1).to(DEV)
    X = torch.tensor([[-1.0], [1.0], [1e30]], device=DEV)
    _, leaves = trees.predict_triton(ens, X)
    assert leaves.flatten().tolist() == [0, 1, 1]


def test_empty_input():
    ens = trees.random_ensemble(3, 2, 4, seed=0)
    p, leaves = trees.predict_triton(ens, torch.empty(0, 4, device=DEV))
    assert p.shape == (0,) and leaves.shape == (0, 3)


@pytest.mark.parametrize(
    "make, err, match",
    [
        (
            lambda: trees.Ensemble(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4), 0.0, 1),
            TypeError,
            "feature must have dtype",
        ),
        (
            lambda: trees.Ensemble(
                torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 4), torch.zeros(2, 5), 0.0, 1
            ),
            ValueError,
            "2\\*\\*depth - 1",
        ),
        (
            lambda: trees.Ensemble(
                torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 3), torch.zeros(2, 3), 0.0, 1
            ),
            ValueError,
            "leaf must have shape",
        ),
        (
            lambda: trees.Ensemble(
                torch.full((2, 3), 5, dtype=torch.int32),
                torch.zeros(2, 3),
                torch.zeros(2, 4),
                0.0,
                5,
            ),
            ValueError,
            "feature indices",
        ),
        (lambda: trees.random_ensemble(0, 3, 4), ValueError, "n_trees must be"),
        (lambda: trees.random_ensemble(2, 17, 4), ValueError, "depth must be at most"),
    ],
)
def test_ensemble_rejects_bad_arrays(make, err, match):
    with pytest.raises(err, match=match):
        make()


@pytest.mark.parametrize(
    "X, kw, err, match",
    [
        (torch.zeros(4, 3), {}, ValueError, "4 features"),
        (torch.zeros(4, 4, dtype=torch.float64), {}, TypeError, "X must have dtype"),
        (torch.zeros(4, 4).t(), {}, ValueError, "X must be contiguous"),
        (torch.zeros(4, 4), {"block_r": 48}, ValueError, "block_r"),
        (torch.zeros(4, 4), {"block_t": 4}, ValueError, "block_t must be at least 8"),
    ],
)
def test_predict_rejects_bad_input(X, kw, err, match):
    ens = trees.random_ensemble(3, 2, 4, seed=0)
    with pytest.raises(err, match=match):
        trees.predict_triton(ens, X.to(DEV), **kw)


@pytest.mark.skipif(not device.GPU_MODE, reason="GPU-size check")
def test_large_ensemble_on_gpu():
    X = _data(100_003, 32)
    ens = trees.random_ensemble(256, 8, 32, X=X, seed=1)
    p_torch, l_torch = trees.predict_torch(ens, X)
    p, leaves = trees.predict_triton(ens, X)
    assert torch.equal(leaves, l_torch)
    torch.testing.assert_close(p.double(), trees.predict_ref(ens, X), rtol=1e-5, atol=1e-5)
    _, l_loop = trees.predict_loop(ens.to("cpu"), X[:64].cpu())
    assert torch.equal(l_loop, leaves[:64].cpu())


def test_compiled_python_trees_match_the_loop(fitted):
    ens, _, X, _ = fitted
    Xt = torch.from_numpy(X[:200])
    src = trees.python_source(ens)
    assert src.count("def tree_") == ens.n_trees
    p_loop, l_loop = trees.predict_loop(ens, Xt)
    p_comp, l_comp = trees.compile_python(ens)(Xt)
    assert torch.equal(l_comp, l_loop)
    torch.testing.assert_close(p_comp, p_loop, rtol=0, atol=0)
