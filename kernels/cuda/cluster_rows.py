"""Row-wise ops on very wide rows, each row split across a thread-block cluster (Hopper and later).

``softmax``, ``rms_norm`` and ``layer_norm`` need a statistic of the whole row before they write
any of it. Up to 32,768 columns (norms) or 65,536 (softmax) the Triton kernels hold a row in one
program's registers. Wider, a row no longer fits in one SM: the Triton kernels spill or read the row
twice, and at 65,536 columns an H100 measured 0.66-0.85 of the copy bandwidth forward and 0.59-0.64
backward (page 4.5). ``cluster_rows.cu`` splits each row across the S CTAs of a *cluster* (S = the
row's width / 8,192 values, at most 16), which the hardware runs at once on neighbouring SMs. Each
CTA holds its chunk in registers and reduces it, and the S partial sums meet through distributed
shared memory: the row is read once and written once.

The ops in ``kernels.softmax`` and ``kernels.norms`` call ``norm_forward`` / ``norm_backward`` /
``softmax_forward`` / ``softmax_backward`` here for the layouts ``use`` accepts: a GPU of compute
capability 9.0 or more with nvcc; an op and dtype for which the kernels measured faster than the
Triton ones (``WINS``); rows wider than 32,768 values (``kernels.rows.CLUSTER_ABOVE_COLS``, up to
65,536) that are whole 16-byte vectors (width, row stride and data pointer); and at least 1,024
rows, so that the launch's host cost is small beside the kernel. Everything else keeps the Triton path. The
extension is built on first use (about a minute on the lent H100 machine) and cached by torch; a build that
fails warns once and leaves the Triton path in place. ``GPU_BRRR_CLUSTER_ROWS=0`` turns it off.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

import kernels.cuda as ladder
from kernels import device, partial_sums

SOURCES = ["cluster_rows.cu"]
THREADS = 256  # per CTA (cluster_rows.cu's THREADS)
MAX_CLUSTER = 16  # CTAs per cluster: 8 is portable, an H100 allows 16
# Values per thread: 32 (8,192 per CTA) for the forward kernels. The backward kernels hold two
# chunks (x and dy, or y and dy) and default to 16 (4,096 values per CTA; TILES names 32 for some
# 16-bit ones); the norms' backward holds four (this row's and the next's, in flight) and keeps its
# column sums in shared memory (16 KB a CTA at 16, 32 KB with a bias; twice that at 32).
E_FWD = 32
E_BWD = 16
# The norms' backward once held each row in registers, with nothing in flight while a row was
# reduced and exchanged. A ring of 1-3 rows in shared memory, filled with cp.async, measured worse
# in fp32 (results/profiles/2026-12-05-nvidia-h100-80gb-hbm3-cluster-rows-stages.txt; branch
# ring-backward). What it does now, the next row in registers and the column sums in shared
# memory, with the exchange below: fp32 RMSNorm 0.77 -> 0.89 of the copy, LayerNorm 0.62 -> 0.82
# (H100, 4,096 x 65,536; results/profiles/2026-12-07-nvidia-h100-80gb-hbm3-cluster-exchange.txt).
# The packed kernels (both forwards, softmax's backward) also take an occupancy target OCC, the
# CTAs an SM must hold (a cap on registers a thread; 0: the compiler's choice). A tile is (E, OCC).
# An SM holds (CTAs an SM) x (a chunk's bytes) of rows in registers, and with the compiler's choice
# a 16-bit chunk of 8,192 values (16 KB) keeps 4-6 CTAs an SM in the forwards (64-96 KB; fp32:
# 128-160 KB; scripts/cluster_rows_ptxas.py prints the table). For 16-bit types cluster_rows.cu
# builds tiles that hold more without spilling: CANDIDATE_TILES. One runs only where TILES names it
# (op -> dtype -> tile), once scripts/gpu/cluster_rows_probe.py --tiles has measured it faster.
CANDIDATE_TILES = {
    "softmax_fwd": [(64, 4)],  # 56 registers: 4 CTAs x 32 KB (default: 6 x 16 KB)
    "rms_norm_fwd": [(64, 4)],  # 4 x 32 KB (default: 8 x 16 KB)
    "layer_norm_fwd": [(64, 4)],  # 61-64 registers: 4 x 32 KB (default: 5-6 x 16 KB)
    "softmax_bwd": [(32, 0)],  # 80 registers: 3 x 2 x 16 KB (default E 16: 5 x 2 x 8 KB)
    # 121-126 registers (weights re-read from L1 each pass), 2 CTAs an SM with 32 KB of the next
    # row in flight each, 8 CTAs a row at 65,536 (default E 16: 3 x 16 KB, 16 CTAs a row)
    "rms_norm_bwd": [(32, 0)],
    "layer_norm_bwd": [(32, 0)],
}
# Measured on an H100 at 4,096 x 65,536, fractions of the copy bandwidth, bf16 / fp16, default tile
# -> candidate (results/profiles/2026-12-07-nvidia-h100-80gb-hbm3-cluster-bf16-words.txt; bf16: two
# runs within 0.002, fp16: the second run): softmax's backward 0.83 -> 0.91 / 0.82 -> 0.91;
# RMSNorm's backward 0.69 -> 0.80 / 0.70 -> 0.82; LayerNorm's backward 0.61 -> 0.65 / 0.61 -> 0.67;
# softmax's forward 0.74 -> 0.79 / 0.74 -> 0.79; LayerNorm's forward 0.68 -> 0.83 / 0.73 -> 0.83;
# RMSNorm's forward 0.90 -> 0.89 / 0.90 -> 0.89, so it keeps the default, which bf16 values
# converted from 32-bit words brought to 32 registers (8 CTAs an SM; 0.87 at 40 registers before).
# The norms' backward at E 32 then took its values from 32-bit words too, and xhat and dx fused
# multiply-adds: bf16 LayerNorm 0.65 -> 0.67, RMSNorm 0.80 -> 0.80, where fewer instructions a
# value were predicted to give 0.72-0.75 (results/profiles/2026-12-07-nvidia-h100-80gb-hbm3-cluster-
# bwd-ffma.txt). LayerNorm's backward at 32 waits (WINS keeps Triton there, below).
TILES: dict[str, dict[torch.dtype, tuple[int, int]]] = {
    "softmax_fwd": {torch.float16: (64, 4)},
    "softmax_bwd": {torch.bfloat16: (32, 0), torch.float16: (32, 0)},
    "layer_norm_fwd": {torch.bfloat16: (64, 4), torch.float16: (64, 4)},
    "rms_norm_bwd": {torch.bfloat16: (32, 0), torch.float16: (32, 0)},
}
# The forwards can also run as persistent clusters, each walking rows c, c + G, ... with the next
# row's chunk loading while it reduces, exchanges and writes this one (as the norms' backward does):
# a chunk of 8,192 values a CTA in flight beside the one worked on, and no cluster launched per row.
# Built for the tile (E_FWD, 0); it runs for the ops and dtypes named here, once
# scripts/gpu/cluster_rows_probe.py --tiles (column ``loop``) has measured it faster. On the H100 it
# never has against the library's tile (bf16 LayerNorm's default tile, 0.68, it edges at 0.69; the
# library's (64, 4) runs 0.83): one-row clusters at the default tile -> persistent, fp32 / bf16 /
# fp16, results/profiles/2026-12-07-nvidia-h100-80gb-hbm3-cluster-bf16-words.txt: softmax 0.95 ->
# 0.75 / 0.74 -> 0.73 / 0.74 -> 0.73, RMSNorm 0.92 -> 0.76 / 0.90 -> 0.79 / 0.90 -> 0.81, LayerNorm
# 0.85 -> 0.77 / 0.68 -> 0.69 / 0.73 -> 0.60. Two rows in registers cost CTAs an SM (ptxas,
# scripts/cluster_rows_ptxas.py --all: fp32 2 instead of 4-5); our reading is that one cluster's
# reduction and exchange then stall its SMs, where one-row clusters let other CTAs load meanwhile. A
# GPU with more bandwidth an SM may differ.
LOOP_OPS = ("softmax_fwd", "rms_norm_fwd", "layer_norm_fwd")
LOOP_FWD: dict[str, set[torch.dtype]] = {}
# The ops and dtypes for which the cluster kernels beat the Triton ones, measured on an H100 at
# 4,096 x 65,536 (scripts/gpu/cluster_rows_probe.py --tiles; fractions of the copy bandwidth,
# cluster at its best tile / Triton, one run of two:
# results/profiles/2026-12-07-nvidia-h100-80gb-hbm3-cluster-bf16-words.txt).
# fp32: softmax 0.95 / 0.73 forward, 0.93 / 0.63 backward; RMSNorm 0.92 / 0.68 and 0.90 / 0.60;
# LayerNorm 0.85 / 0.67 and 0.83 / 0.60. bf16: softmax's backward 0.91 / 0.65, RMSNorm 0.90 / 0.71
# and 0.80 / 0.59, LayerNorm's forward 0.83 / 0.66; softmax's forward (0.79 at (64, 4) / 0.85)
# keeps Triton. fp16 as bf16, except softmax's forward: the Triton kernel measures 0.65 (ptxas: 216
# bytes of spill stores a thread against bf16's 80) and the cluster kernel 0.79 with its candidate
# tile. LayerNorm's 16-bit backward measured 0.61 (0.65-0.67 at E 32; bf16 0.67 after the words
# and FMAs) against Triton's 0.59 but keeps Triton: a thin margin on one H100, and an H200 measured the cluster kernel at half Triton's
# speed there (0.29-0.31 against 0.59, 2026-12-05, before the exchange and E 32); WINS is one table
# for every Hopper GPU.
_HALF = {torch.float16, torch.bfloat16}
WINS = {
    "softmax_fwd": {torch.float32, torch.float16},
    "softmax_bwd": {torch.float32, *_HALF},
    "rms_norm_fwd": {torch.float32, *_HALF},
    "rms_norm_bwd": {torch.float32, *_HALF},
    "layer_norm_fwd": {torch.float32, *_HALF},
    "layer_norm_bwd": {torch.float32},
}
ENV = "GPU_BRRR_CLUSTER_ROWS"

FUNCTIONS = ["cr_norm_fwd", "cr_norm_bwd", "cr_softmax_fwd", "cr_softmax_bwd"]
SIGNATURE = """
std::vector<torch::Tensor> cr_norm_fwd(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b,
                                       double eps, bool rms, bool stats, int64_t e, int64_t occ,
                                       bool loop);
std::vector<torch::Tensor> cr_norm_bwd(torch::Tensor dy, torch::Tensor x, torch::Tensor w,
                                       c10::optional<torch::Tensor> mean, torch::Tensor rstd, bool bias,
                                       int64_t e, int64_t clusters);
torch::Tensor cr_softmax_fwd(torch::Tensor x, int64_t e, int64_t occ, bool loop);
torch::Tensor cr_softmax_bwd(torch::Tensor y, torch::Tensor dy, int64_t e, int64_t occ);
"""


@functools.cache
def unavailable_reason() -> str | None:
    """Why the cluster kernels cannot run here, or None (asked once per process)."""
    if os.environ.get(ENV, "1") == "0":
        return f"turned off ({ENV}=0)"
    reason = ladder.unavailable_reason()
    if reason:
        return reason
    cc = device.capabilities().compute_capability
    if cc is None or cc < (9, 0):
        return "thread-block clusters need compute capability 9.0 or more (Hopper)"
    return None


def _module():
    return ladder._load(
        unavailable_reason(),
        "gpu_brrr_cluster_rows",
        [*SOURCES, "cluster_rows_bindings.cu"],
        FUNCTIONS,
        SIGNATURE,
        ladder.arch_flags,
    )


@functools.cache
def module():
    """The built extension, or None (with one warning) if the build failed."""
    try:
        return _module()
    except Exception as err:  # noqa: BLE001 (any build failure keeps the Triton path)
        warnings.warn(
            f"kernels.cuda.cluster_rows: build failed, the Triton kernels run instead ({err})",
            stacklevel=3,
        )
        return None


def clusters_for(n_cols: int, e: int) -> int:
    """CTAs per row: the row's width over the values one CTA holds, rounded up."""
    return -(-n_cols // (e * THREADS))


def _rows_fit(t: torch.Tensor) -> bool:
    """Rows of whole, 16-byte aligned vectors: the kernels' loads and stores are 16 bytes wide."""
    v = 16 // t.element_size()
    return (
        t.shape[-1] % v == 0
        and t.stride(-1) == 1
        and (t.ndim == 1 or t.stride(-2) % v == 0)
        and t.data_ptr() % 16 == 0
    )


def use(x: torch.Tensor, op: str, *others: torch.Tensor | None) -> bool:
    """Whether the rows of ``x`` take the cluster kernel of ``op`` (a key of ``WINS``;
    ``others``: the weight and bias, or None). Call it through ``kernels.rows.cluster_path``, the
    one home of the width and row-count thresholds, which it tests first."""
    if x.dtype not in WINS[op] or clusters_for(x.shape[-1], E_BWD) > MAX_CLUSTER or not x.is_cuda:
        return False
    if x.ndim > 2 and not x.is_contiguous():
        return False  # leading dimensions that may not flatten into evenly spaced rows
    if not _rows_fit(x) or any(t is not None and t.data_ptr() % 16 for t in others):
        return False
    return unavailable_reason() is None and module() is not None


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """x as a [rows, n] matrix (a view: ``use`` accepted it)."""
    return x if x.ndim == 2 else x.view(-1, x.shape[-1])


def tile(op: str, x: torch.Tensor) -> tuple[int, int]:
    """(E, OCC) for ``op`` on ``x``'s dtype: TILES' entry, else E_FWD or E_BWD at the compiler's
    own occupancy."""
    default = (E_BWD if op.endswith("_bwd") else E_FWD, 0)
    return TILES.get(op, {}).get(x.dtype, default)


def looped(op: str, x: torch.Tensor, e: int, occ: int) -> bool:
    """Whether the forward ``op`` runs as persistent clusters with the next row in flight (LOOP_FWD
    names it for x's dtype; built for the tile (E_FWD, 0) only)."""
    return x.dtype in LOOP_FWD.get(op, ()) and (e, occ) == (E_FWD, 0)


def norm_forward(x, weight, bias, eps: float, is_rms: bool, stats: bool = True):
    """y, mean, rstd (mean None for RMSNorm; both None without ``stats``) for ``x`` as rows."""
    op = "rms_norm_fwd" if is_rms else "layer_norm_fwd"
    e, occ = tile(op, x)
    y, mean, rstd = module().cr_norm_fwd(
        rows_of(x), weight, bias, float(eps), is_rms, stats, e, occ, looped(op, x, e, occ)
    )
    return (
        y.view(x.shape),
        mean if stats and not is_rms else None,
        rstd if stats else None,
    )


def norm_backward(dy, x, weight, mean, rstd, has_bias: bool):
    """dx, dw, db (db None without a bias): one cluster kernel, then one launch of
    kernels.partial_sums for the columns' sums over the clusters' partial rows."""
    dy2 = _grad_rows(dy)
    e, occ = tile("rms_norm_bwd" if mean is None else "layer_norm_bwd", x)
    if occ:
        raise ValueError(f"TILES: the norms' backward takes no occupancy target, got {occ}")
    dx, partials = module().cr_norm_bwd(dy2, rows_of(x), weight, mean, rstd, has_bias, e, 0)
    sums = partial_sums.sum_stacked(partials, weight.dtype)
    return dx.view(x.shape), sums[0], sums[1] if has_bias else None


def _grad_rows(dy: torch.Tensor) -> torch.Tensor:
    """The upstream gradient as [rows, n] 16-byte vectors: as it is when it already is, else a
    contiguous copy (an expanded gradient from ``.sum().backward()`` has stride 0)."""
    if dy.is_contiguous() and _rows_fit(dy):
        return rows_of(dy)
    if dy.ndim == 2 and dy.stride(0) > 0 and _rows_fit(dy):
        return dy
    return dy.contiguous().view(-1, dy.shape[-1])


def softmax_forward(x: torch.Tensor) -> torch.Tensor:
    e, occ = tile("softmax_fwd", x)
    return (
        module().cr_softmax_fwd(rows_of(x), e, occ, looped("softmax_fwd", x, e, occ)).view(x.shape)
    )


def softmax_backward(y: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    dy2 = _grad_rows(dy)
    return module().cr_softmax_bwd(rows_of(y), dy2, *tile("softmax_bwd", y)).view(y.shape)
