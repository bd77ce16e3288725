"""Tree-ensemble inference, three ways: a Python loop, vectorised torch, and one Triton kernel.

A gradient-boosted ensemble here is ``T`` *complete* binary trees of one depth ``d``. Complete trees
need no child pointers: internal node ``i`` has children ``2i + 1`` (left) and ``2i + 2`` (right), so
a tree is three flat arrays,

- ``feature: int32[T, 2**d - 1]`` and ``threshold: float32[T, 2**d - 1]`` for the internal nodes (go
  right when ``x[feature] > threshold``, as LightGBM's ``<=`` goes left), and
- ``leaf: float32[T, 2**d]``, the value each leaf adds to the prediction,

and every row takes exactly ``d`` steps through every tree: ``node = 2 * node + 1 + (x > t)``. There
is no branch to diverge on, which is what makes the traversal a good fit for a GPU. A fitted tree
whose node has nothing left to split is still complete: the node's threshold is +inf (everything goes
left) and both subtrees carry the same values.

``fit_gbdt`` fits a small least-squares boosting model in numpy (histogram splits on quantile bins,
no sklearn or LightGBM needed); ``random_ensemble`` builds a large random one for timing.
``predict_loop`` is the literal interpretation, ``predict_torch`` gathers level by level over a
``[rows, trees]`` tensor, ``predict_triton`` walks a ``[BLOCK_R rows, BLOCK_T trees]`` tile of paths
in registers and sums the leaves in fp32. All three return the leaf each row reached in each tree,
which must agree exactly; the sums agree to fp32 rounding (the order of the additions differs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kernels import _validate, bench, device, roofline
from kernels.launch import cdiv

DEFAULT_BLOCK_R = 32
DEFAULT_BLOCK_T = 32
# Measured on an H100 with Triton 3.6: BLOCK_R = 256, BLOCK_T = 4 returned the right leaf indices but
# wrong row sums (a miscompiled 4-wide reduction), so tiles narrower than 8 trees are refused.
MIN_BLOCK_T = 8
DEFAULT_NUM_WARPS = 4
MAX_DEPTH = 16


@triton.jit
def _forest_kernel(
    # pointers
    x_ptr,
    feature_ptr,
    threshold_ptr,
    leaf_ptr,
    out_ptr,
    leaves_ptr,
    # sizes
    n_rows,
    n_features,
    n_trees,
    base,
    # meta-parameters
    DEPTH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_T: tl.constexpr,
    STORE_LEAVES: tl.constexpr,
):
    # One program: BLOCK_R rows through every tree, BLOCK_T trees at a time. Each step of a path
    # gathers a node's feature and threshold (tiny arrays: L1/L2 hits) and one value of the row
    # (128 B for 32 fp32 features: read from HBM once, then L1). Per row the kernel reads the row
    # and writes one fp32; the node arrays are shared by all rows.
    N_INTERNAL: tl.constexpr = (1 << DEPTH) - 1
    pid = tl.program_id(axis=0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_mask = rows < n_rows
    x_row = x_ptr + rows.to(tl.int64) * n_features
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for t0 in range(0, n_trees, BLOCK_T):
        trees = t0 + tl.arange(0, BLOCK_T)
        mask = row_mask[:, None] & (trees < n_trees)[None, :]
        node = tl.zeros((BLOCK_R, BLOCK_T), dtype=tl.int32)
        for _ in tl.static_range(DEPTH):
            at = trees[None, :] * N_INTERNAL + node
            f = tl.load(feature_ptr + at, mask=mask, other=0)
            t = tl.load(threshold_ptr + at, mask=mask, other=0.0)
            v = tl.load(x_row[:, None] + f, mask=mask, other=0.0)
            node = 2 * node + 1 + (v > t).to(tl.int32)
        leaf = node - N_INTERNAL
        # Masked lanes (rows or trees past the end) add 0.
        val = tl.load(leaf_ptr + trees[None, :] * (N_INTERNAL + 1) + leaf, mask=mask, other=0.0)
        acc += tl.sum(val, axis=1)
        if STORE_LEAVES:
            dst = leaves_ptr + rows.to(tl.int64)[:, None] * n_trees + trees[None, :]
            tl.store(dst, leaf, mask=mask)
    tl.store(out_ptr + rows, acc + base, mask=row_mask)


# ----------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Ensemble:
    """``T`` complete trees of depth ``depth`` over ``n_features`` features, plus a base score."""

    feature: torch.Tensor  # int32 [T, 2**depth - 1]
    threshold: torch.Tensor  # float32 [T, 2**depth - 1]
    leaf: torch.Tensor  # float32 [T, 2**depth]
    base: float
    n_features: int

    def __post_init__(self):
        _validate.tensor("feature", self.feature, dtypes=(torch.int32,), ndim=2)
        _validate.tensor("threshold", self.threshold, dtypes=(torch.float32,), ndim=2)
        _validate.tensor("leaf", self.leaf, dtypes=(torch.float32,), ndim=2)
        n_trees, n_internal = self.feature.shape
        depth = (n_internal + 1).bit_length() - 1
        if n_internal < 1 or (1 << depth) - 1 != n_internal or depth > MAX_DEPTH:
            raise ValueError(
                f"feature must be [n_trees, 2**depth - 1] with 1 <= depth <= {MAX_DEPTH}, "
                f"got {tuple(self.feature.shape)}"
            )
        if tuple(self.threshold.shape) != (n_trees, n_internal):
            raise ValueError(f"threshold must have shape {(n_trees, n_internal)}")
        if tuple(self.leaf.shape) != (n_trees, n_internal + 1):
            raise ValueError(f"leaf must have shape {(n_trees, n_internal + 1)}")
        if not (self.feature.device == self.threshold.device == self.leaf.device):
            raise ValueError("feature, threshold and leaf must be on one device")
        if n_trees and (int(self.feature.min()) < 0 or int(self.feature.max()) >= self.n_features):
            raise ValueError(f"feature indices must lie in [0, n_features={self.n_features})")

    @property
    def n_trees(self) -> int:
        return self.feature.shape[0]

    @property
    def depth(self) -> int:
        return self.feature.shape[1].bit_length()

    @property
    def device(self) -> torch.device:
        return self.feature.device

    def to(self, dev) -> Ensemble:
        return Ensemble(
            self.feature.to(dev),
            self.threshold.to(dev),
            self.leaf.to(dev),
            self.base,
            self.n_features,
        )

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.feature, self.threshold, self.leaf))


def random_ensemble(
    n_trees: int,
    depth: int,
    n_features: int,
    *,
    X: torch.Tensor | None = None,
    seed: int = 0,
    dev=None,
) -> Ensemble:
    """Random complete trees. Thresholds are values of random rows of ``X`` (standard normal draws
    without it), so splits are roughly balanced; leaf values are small, as in a boosted model."""
    for name, v in (("n_trees", n_trees), ("depth", depth), ("n_features", n_features)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if depth > MAX_DEPTH:
        raise ValueError(f"depth must be at most {MAX_DEPTH}, got {depth}")
    g = torch.Generator().manual_seed(seed)
    n_internal = (1 << depth) - 1
    feature = torch.randint(0, n_features, (n_trees, n_internal), generator=g, dtype=torch.int32)
    if X is None:
        threshold = torch.randn(n_trees, n_internal, generator=g)
    else:
        Xc = X.detach().float().cpu()
        rows = torch.randint(0, Xc.shape[0], (n_trees, n_internal), generator=g)
        threshold = Xc[rows, feature.long()]
    leaf = torch.randn(n_trees, n_internal + 1, generator=g) * 0.05
    ens = Ensemble(feature, threshold.contiguous(), leaf, 0.0, n_features)
    return ens.to(dev if dev is not None else device.DEVICE)


def fit_gbdt(
    X: np.ndarray,
    y: np.ndarray,
    *,
    n_trees: int = 50,
    depth: int = 4,
    learning_rate: float = 0.1,
    n_bins: int = 32,
    min_leaf: int = 8,
) -> tuple[Ensemble, list[float]]:
    """Least-squares gradient boosting in numpy: each tree fits the residuals ``y - prediction``
    with greedy level-wise splits over per-feature quantile bins. Returns the ensemble (on the CPU)
    and the training mean squared error after each tree."""
    X = np.ascontiguousarray(X, dtype=np.float32)
    y = np.asarray(y, dtype=np.float64)
    if X.ndim != 2 or y.shape != (X.shape[0],):
        raise ValueError(f"X must be [n, F] and y [n], got {X.shape} and {y.shape}")
    n, n_features = X.shape
    n_internal = (1 << depth) - 1
    # Candidate thresholds: interior quantiles of each feature. bin <= j  <=>  x <= edges[j].
    qs = np.linspace(0, 1, n_bins + 1)[1:-1]
    edges = np.quantile(X, qs, axis=0).T.astype(np.float32)  # [F, n_bins - 1]
    bins = np.stack([np.searchsorted(edges[f], X[:, f], side="left") for f in range(n_features)], 1)
    offsets = np.arange(n_features) * n_bins
    features = np.zeros((n_trees, n_internal), np.int32)
    thresholds = np.full((n_trees, n_internal), np.inf, np.float32)
    leaves = np.zeros((n_trees, n_internal + 1), np.float32)
    base = float(y.mean())
    pred = np.full(n, base)
    history = []
    for t in range(n_trees):
        r = y - pred
        node = np.zeros(n, np.int64)
        for level in range(depth):
            for i in range((1 << level) - 1, (1 << (level + 1)) - 1):
                s = np.flatnonzero(node == i)
                if len(s) < 2 * min_leaf:
                    continue  # threshold stays +inf: every row goes left
                flat = (bins[s] + offsets).ravel()
                cnt = np.bincount(flat, minlength=n_features * n_bins).reshape(n_features, n_bins)
                tot = np.bincount(flat, np.repeat(r[s], n_features), n_features * n_bins)
                tot = tot.reshape(n_features, n_bins)
                nl, sl = np.cumsum(cnt, 1)[:, :-1], np.cumsum(tot, 1)[:, :-1]
                nr, sr = len(s) - nl, r[s].sum() - sl
                with np.errstate(divide="ignore", invalid="ignore"):
                    gain = sl**2 / nl + sr**2 / nr
                gain[(nl < min_leaf) | (nr < min_leaf)] = -np.inf
                f, j = np.unravel_index(np.argmax(gain), gain.shape)
                if np.isfinite(gain[f, j]):
                    features[t, i], thresholds[t, i] = f, edges[f, j]
            go_right = X[np.arange(n), features[t, node]] > thresholds[t, node]
            node = 2 * node + 1 + go_right
        leaf = node - n_internal
        sums = np.bincount(leaf, r, n_internal + 1)
        counts = np.bincount(leaf, minlength=n_internal + 1)
        leaves[t] = learning_rate * np.divide(
            sums, counts, out=np.zeros_like(sums), where=counts > 0
        )
        pred += leaves[t][leaf]
        history.append(float(np.mean((y - pred) ** 2)))
    ens = Ensemble(
        torch.from_numpy(features),
        torch.from_numpy(thresholds),
        torch.from_numpy(leaves),
        base,
        n_features,
    )
    return ens, history


# ----------------------------------------------------------------------------- three evaluators


def _check_x(ens: Ensemble, X: torch.Tensor):
    _validate.tensor("X", X, dtypes=(torch.float32,), ndim=2)
    if X.shape[1] != ens.n_features:
        raise ValueError(f"X must have {ens.n_features} features (columns), got {X.shape[1]}")
    if X.device != ens.device:
        raise ValueError(f"X and the ensemble must be on one device, got {X.device}, {ens.device}")


def predict_loop(ens: Ensemble, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The literal algorithm in plain Python: for each row, for each tree, walk ``depth`` nodes.
    Returns (predictions float32 [n], leaf indices int32 [n, T]). Python floats are doubles, and
    every compared value is an exact float32, so each comparison is the kernel's comparison."""
    _check_x(ens, X)
    feature, threshold = ens.feature.tolist(), ens.threshold.tolist()
    leaf_value = ens.leaf.tolist()
    depth, n_internal = ens.depth, (1 << ens.depth) - 1
    preds, leaves = [], []
    for row in X.tolist():
        total, reached = ens.base, []
        for feat, thr, val in zip(feature, threshold, leaf_value):
            node = 0
            for _ in range(depth):
                node = 2 * node + (2 if row[feat[node]] > thr[node] else 1)
            k = node - n_internal
            reached.append(k)
            total += val[k]
        preds.append(total)
        leaves.append(reached)
    n_trees = ens.n_trees
    return (
        torch.tensor(preds, dtype=torch.float32, device=X.device),
        torch.tensor(leaves, dtype=torch.int32, device=X.device).reshape(len(preds), n_trees),
    )


def python_source(ens: Ensemble) -> str:
    """The ensemble compiled to Python source, one function per tree: nested ``if``s with the
    features and thresholds written in as constants, each leaf a ``return (index, value)``. This is
    what lleaves does with LLVM IR and machine code, here in miniature: the tree becomes control flow
    instead of data that a loop walks."""
    feature, threshold, leaf = ens.feature.tolist(), ens.threshold.tolist(), ens.leaf.tolist()
    n_internal = (1 << ens.depth) - 1
    lines = []

    def emit(t, node, indent):
        pad = "    " * indent
        if node >= n_internal:
            k = node - n_internal
            lines.append(f"{pad}return {k}, {leaf[t][k]!r}")
            return
        thr = threshold[t][node]
        thr = "INF" if thr == float("inf") else ("-INF" if thr == float("-inf") else repr(thr))
        lines.append(f"{pad}if x[{feature[t][node]}] > {thr}:")
        emit(t, 2 * node + 2, indent + 1)
        lines.append(f"{pad}else:")
        emit(t, 2 * node + 1, indent + 1)

    for t in range(ens.n_trees):
        lines.append(f"def tree_{t}(x):")
        emit(t, 0, 1)
    lines.append(f"TREES = [{', '.join(f'tree_{t}' for t in range(ens.n_trees))}]")
    return "\n".join(lines) + "\n"


def compile_python(ens: Ensemble):
    """``predict(X) -> (predictions, leaf indices)`` from ``python_source``: the compiled-trees
    counterpart of ``predict_loop``, on the CPU."""
    namespace = {"INF": float("inf")}
    exec(compile(python_source(ens), "<trees>", "exec"), namespace)
    fns, base, n_trees = namespace["TREES"], ens.base, ens.n_trees

    def predict(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _check_x(ens, X)
        preds, leaves = [], []
        for row in X.tolist():
            total, reached = base, []
            for fn in fns:
                k, v = fn(row)
                reached.append(k)
                total += v
            preds.append(total)
            leaves.append(reached)
        return (
            torch.tensor(preds, dtype=torch.float32, device=X.device),
            torch.tensor(leaves, dtype=torch.int32, device=X.device).reshape(len(preds), n_trees),
        )

    return predict


def predict_torch(ens: Ensemble, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised torch: every (row, tree) path advances one level per step, by gathers over a
    ``[n, T]`` index tensor. ``depth`` x (3 gathers + a compare + an update) kernels, each reading and
    writing ``n x T`` elements."""
    _check_x(ens, X)
    n_internal = (1 << ens.depth) - 1
    trees = torch.arange(ens.n_trees, device=X.device)[None, :]
    node = torch.zeros(X.shape[0], ens.n_trees, dtype=torch.long, device=X.device)
    for _ in range(ens.depth):
        f = ens.feature[trees, node].long()
        t = ens.threshold[trees, node]
        node = 2 * node + 1 + (X.gather(1, f) > t).long()
    leaf = node - n_internal
    pred = ens.leaf[trees, leaf].sum(dim=1) + ens.base
    return pred, leaf.to(torch.int32)


def predict_triton(
    ens: Ensemble,
    X: torch.Tensor,
    *,
    return_leaves: bool = True,
    block_r: int = DEFAULT_BLOCK_R,
    block_t: int = DEFAULT_BLOCK_T,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One Triton kernel: a program per ``block_r`` rows, ``block_t`` trees walked side by side.
    Returns (predictions float32 [n], leaf indices int32 [n, T] or None)."""
    _check_x(ens, X)
    for name, v in (("block_r", block_r), ("block_t", block_t), ("num_warps", num_warps)):
        _validate.positive_power_of_two(name, v)
    if block_t < MIN_BLOCK_T:
        raise ValueError(f"block_t must be at least {MIN_BLOCK_T}, got {block_t}")
    n = X.shape[0]
    out = torch.empty(n, dtype=torch.float32, device=X.device)
    leaves = (
        torch.empty(n, ens.n_trees, dtype=torch.int32, device=X.device) if return_leaves else None
    )
    if n == 0:
        return out, leaves
    if ens.n_trees == 0:
        out.fill_(ens.base)
        return out, leaves
    grid = (cdiv(n, block_r),)
    _forest_kernel[grid](
        X,
        ens.feature,
        ens.threshold,
        ens.leaf,
        out,
        leaves if return_leaves else out,  # never written when STORE_LEAVES is False
        n,
        ens.n_features,
        ens.n_trees,
        float(ens.base),
        DEPTH=ens.depth,
        BLOCK_R=block_r,
        BLOCK_T=block_t,
        STORE_LEAVES=return_leaves,
        num_warps=num_warps,
    )
    return out, leaves


def predict_ref(ens: Ensemble, X: torch.Tensor) -> torch.Tensor:
    """The reference prediction in fp64, from the torch path's leaf indices summed in fp64."""
    _, leaf = predict_torch(ens, X)
    trees = torch.arange(ens.n_trees, device=X.device)[None, :]
    return ens.leaf.double()[trees, leaf.long()].sum(dim=1) + ens.base


# Signatures for the ahead-of-time compile check (tests compile every kernel for sm_90 and sm_75).
COMPILE_SPECS = [
    dict(
        kernel=_forest_kernel,
        signature={
            "x_ptr": "*fp32",
            "feature_ptr": "*i32",
            "threshold_ptr": "*fp32",
            "leaf_ptr": "*fp32",
            "out_ptr": "*fp32",
            "leaves_ptr": "*i32",
            "n_rows": "i32",
            "n_features": "i32",
            "n_trees": "i32",
            "base": "fp32",
        },
        constexprs={"DEPTH": 8, "BLOCK_R": 64, "BLOCK_T": 16, "STORE_LEAVES": store},
    )
    for store in (True, False)
]


@bench.register("forest")
def _bench_forest(quick: bool) -> list[dict]:
    """A 256-tree, depth-8 ensemble over 32 features: Triton kernel vs vectorised torch."""
    n_rows = 2**16 if quick else 2**18
    n_trees, depth, n_features = 256, 8, 32
    if not device.GPU_MODE:
        n_rows, n_trees, depth = 256, 8, 4
    X = torch.randn(n_rows, n_features, device=device.DEVICE)
    ens = random_ensemble(n_trees, depth, n_features, X=X, seed=1)
    copy = roofline.copy_bandwidth()
    nbytes = X.numel() * 4 + n_rows * 4  # read the rows once, write one prediction per row
    ours = bench.measure(lambda: predict_triton(ens, X, return_leaves=False), bytes=nbytes)
    base = bench.measure(lambda: predict_torch(ens, X), bytes=nbytes)
    shape = [n_rows, n_features, n_trees, depth]
    ceil = ("copy", copy.value)
    return [
        bench.record(
            "forest", "triton", shape, "float32", ours, baseline=("torch", base), ceiling=ceil
        ),
        bench.record("forest", "torch", shape, "float32", base, ceiling=ceil),
    ]
