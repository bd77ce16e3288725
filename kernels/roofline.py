"""Measured ceilings (copy bandwidth, matmul peak per dtype) and the roofline plot.

A datasheet gives the roof a vendor promises; the roof a kernel can actually hit is lower. We measure
two ceilings once per process and compare every kernel against them:

- **copy bandwidth**: a large device-to-device ``copy_``, counting bytes read *plus* bytes written;
- **matmul peak**: the library (cuBLAS) matrix product at a large square size, per dtype.

``plot_roofline`` draws the datasheet roof dashed, the measured roof solid and kernels as points;
the plots use the book's style (``kernels.plotstyle``): its palette, text no smaller than
``plotstyle.SMALL_PT`` and point labels placed by ``plotstyle.label_points`` so that none overlaps.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels import bench, device, hardware, plotstyle


@dataclass(frozen=True)
class Ceiling:
    name: str
    value: float  # GB/s for bandwidth, TFLOP/s for compute
    shape: tuple[int, ...]
    dtype: str
    measurement: bench.Measurement


@functools.cache
def copy_bandwidth(n_bytes: int | None = None, device_only: bool = False) -> Ceiling:
    """Device-to-device copy of ``n_bytes`` (default 1 GiB on a GPU, 4 MiB on CPU); with
    ``device_only``, timed with the host's launch cost kept out (``bench.measure``'s)."""
    n_bytes = n_bytes or device.pick(2**30, 2**22)
    n = n_bytes // 4
    src = torch.randn(n, device=device.DEVICE)
    dst = torch.empty_like(src)
    m = bench.measure(lambda: dst.copy_(src), bytes=2 * n * 4, device_only=device_only)
    return Ceiling("copy", m.gbps, (n,), "float32", m)


_MATMUL_DTYPES = {
    "float32": torch.float32,
    "tf32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@functools.cache
def matmul_peak(dtype: str = "bfloat16", n: int | None = None) -> Ceiling:
    """TFLOP/s of ``torch.matmul`` on ``n x n x n`` (default 8192 on a GPU, 256 on CPU).

    ``dtype`` is one of float32 (TF32 off), tf32, float16, bfloat16.
    """
    if dtype not in _MATMUL_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_MATMUL_DTYPES)}, got {dtype!r}")
    n = n or device.pick(8192, 256)
    torch_dtype = _MATMUL_DTYPES[dtype]
    # Random data, not zeros: zeros toggle fewer bits and run measurably faster.
    a = torch.randn(n, n, device=device.DEVICE, dtype=torch_dtype)
    b = torch.randn(n, n, device=device.DEVICE, dtype=torch_dtype)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    try:
        m = bench.measure(lambda: a @ b, flops=2 * n**3)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return Ceiling(f"matmul_{dtype}", m.tflops, (n, n, n), dtype, m)


def fp8_matmul_peak(n: int | None = None) -> Ceiling:
    """TFLOP/s of an fp8 (e4m3) ``n x n x n`` matmul through ``torch._scaled_mm`` (default 8192).

    Per-tensor scales of 1, bf16 output, fast accumulation on: the setting inference kernels use, so
    the roof fp8 work can reach. Needs a GPU with the ``fp8`` capability (Ada, Hopper or newer).
    """
    return _fp8_matmul_peak(n or 8192)


@functools.cache
def _fp8_matmul_peak(n: int) -> Ceiling:
    if not (device.GPU_MODE and device.capabilities().fp8):
        raise RuntimeError(
            "fp8_matmul_peak needs a GPU with the fp8 capability (Ada, Hopper or newer)"
        )
    a, b = fp8_operands(n, n, n)
    one = torch.ones((), device=device.DEVICE, dtype=torch.float32)  # per-tensor scales
    m = bench.measure(lambda: fp8_matmul(a, b, one, one), flops=2 * n**3)
    return Ceiling("matmul_fp8", m.tflops, (n, n, n), "fp8", m)


def fp8_operands(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random fp8 ``a: [m, k]`` (row-major) and ``b: [k, n]`` (column-major, as cuBLASLt wants)."""
    f8 = torch.float8_e4m3fnuz if torch.version.hip else torch.float8_e4m3fn
    a = torch.randn(m, k, device=device.DEVICE).to(f8)
    b = torch.randn(n, k, device=device.DEVICE).to(f8).t()
    return a, b


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor):
    """``(a * scale_a) @ (b * scale_b)`` in fp8 with fp32 accumulation, rounded to bf16."""
    return torch._scaled_mm(
        a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16, use_fast_accum=True
    )


@bench.register("ceilings")
def _bench_ceilings(quick: bool) -> list[dict]:
    """The measured roofs, each against its datasheet figure (ceiling_frac = measured / datasheet)."""
    spec = hardware.for_device()
    recs = []
    c = copy_bandwidth()
    sheet = spec.get("mem_bw_gbps") if spec else None
    recs.append(
        bench.record(
            "ceiling",
            "copy",
            c.shape,
            c.dtype,
            c.measurement,
            ceiling=("datasheet", sheet) if sheet else None,
        )
    )
    for dtype in ["bfloat16"] if quick else ["bfloat16", "float16", "tf32", "float32"]:
        c = matmul_peak(dtype)
        sheet = spec.get(f"tflops_{dtype}") if spec else None
        recs.append(
            bench.record(
                "ceiling",
                f"matmul_{dtype}",
                c.shape,
                dtype,
                c.measurement,
                ceiling=("datasheet", sheet) if sheet else None,
            )
        )
    return recs


def plot_roofline(
    ax,
    *,
    bandwidth_gbps: float,
    peak_tflops: float,
    datasheet_bandwidth_gbps: float | None = None,
    datasheet_tflops: float | None = None,
    points: list[tuple[str, float, float]] = (),
    label: str = "measured",
    color: str = "C0",
):
    """Draw a roofline on ``ax`` (log-log; x = FLOP/byte, y = TFLOP/s).

    ``points`` are ``(label, arithmetic_intensity, achieved_tflops)``.
    """
    import numpy as np

    x = np.logspace(-2, 4, 400)

    def roof(bw, peak):
        return np.minimum(bw * 1e9 * x / 1e12, peak)

    ax.loglog(x, roof(bandwidth_gbps, peak_tflops), color=color, lw=2, label=f"{label} roof")
    if datasheet_bandwidth_gbps and datasheet_tflops:
        ax.loglog(
            x,
            roof(datasheet_bandwidth_gbps, datasheet_tflops),
            color=color,
            ls="--",
            lw=1,
            label="datasheet roof",
        )
    ridge = peak_tflops * 1e12 / (bandwidth_gbps * 1e9)
    ax.axvline(ridge, color=color, ls=":", lw=0.8)
    ax.annotate(
        f"ridge {ridge:.0f} FLOP/B",
        (ridge, peak_tflops),
        textcoords="offset points",
        xytext=(4, -14),
        fontsize=plotstyle.SMALL_PT,
    )
    if points:
        colors = [plotstyle.color(i + 1) for i in range(len(points))]
        for (_, ai, tf), c in zip(points, colors):
            ax.plot([ai], [tf], "o", color=c)
        names, xs, ys = zip(*points)
        plotstyle.label_points(ax, xs, ys, names, colors=colors)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=plotstyle.SMALL_PT)
    return ax


def plot_dtype_roofs(
    ax,
    *,
    bandwidth_gbps: float,
    peaks: dict[str, float],
    datasheet_bandwidth_gbps: float | None = None,
    datasheet_peaks: dict[str, float | None] | None = None,
):
    """One roof per dtype on ``ax`` (log-log): measured solid, datasheet dashed, same colour.

    ``peaks`` maps a label (e.g. 'bf16') to its measured TFLOP/s; ``datasheet_peaks`` the same
    labels to the datasheet figure (None where the source publishes none).
    """
    import numpy as np

    x = np.logspace(-2, 4, 400)
    for i, (label, peak) in enumerate(peaks.items()):
        color = plotstyle.color(i)
        roof = np.minimum(bandwidth_gbps * 1e9 * x / 1e12, peak)
        ax.loglog(x, roof, color=color, lw=2, label=f"{label}: measured {peak:,.0f}")
        sheet = (datasheet_peaks or {}).get(label)
        if sheet and datasheet_bandwidth_gbps:
            roof = np.minimum(datasheet_bandwidth_gbps * 1e9 * x / 1e12, sheet)
            ax.loglog(x, roof, color=color, ls="--", lw=1, label=f"{label}: datasheet {sheet:,.0f}")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=plotstyle.SMALL_PT, ncol=2)
    return ax


def plot_points(
    ax,
    points: list[tuple[str, float, float]],
    *,
    series: str,
    marker: str = "o",
    color: str | None = None,
    annotate: bool = True,
    join: bool = True,
):
    """Add a series of ``(label, arithmetic_intensity, achieved_tflops)`` points to a roofline,
    with one legend entry; ``join`` links them with a thin line (sizes of one op walking along
    the roof), otherwise they stay separate markers (different ops of one family). ``annotate``
    labels the points with ``plotstyle.label_points`` (to place the labels of several series
    together, pass ``annotate=False`` and call ``label_points`` once with all of them)."""
    xs = [p[1] for p in points]
    ys = [p[2] for p in points]
    style = dict(ls="-", lw=0.6) if join else dict(ls="none")
    (line,) = ax.loglog(xs, ys, marker=marker, ms=5, color=color, label=series, **style)
    if annotate and points:
        labels = [p[0] for p in points]
        plotstyle.label_points(ax, xs, ys, labels, colors=[line.get_color()] * len(points))
    return ax
