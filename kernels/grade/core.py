"""The grader's core: ``Case``, ``check`` (is it right?) and ``score`` (how close to the roof?).

See ``kernels.grade`` for how a learner calls them.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kernels import bench, device, plotstyle, roofline

# ----------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One test input of an exercise: ``make()`` returns the positional arguments of the function.

    ``reduce_len`` is how many values each output element sums over (a softmax row's width, a
    matmul's K): the tolerance grows with its square root. ``hint`` is said when this case's output
    holds NaN or inf where the reference is finite (e.g. why large rows break a softmax).
    """

    name: str
    make: Callable[[], tuple]
    reduce_len: int = 1
    hint: str | None = None
    #: The dtype the output must have; None: the first tensor input's (a kernel keeps its dtype).
    out_dtype: torch.dtype | None = None
    #: Bit-exact comparison (a rounding or an integer unpack has one right answer).
    exact: bool = False
    #: ``diagnose(out, ref, args) -> list[str]``: the exercise's own hints, from the pattern of the
    #: wrong output (e.g. "this is what truncation gives"); called only when the case fails.
    diagnose: Callable[[torch.Tensor, torch.Tensor, tuple], list[str]] | None = None
    #: Replaces the absolute tolerance's factor (a fraction of max|ref|) where rounding that the
    #: exercise prescribes exceeds fp32 accumulation error (e.g. attention's 16-bit P).
    atol_factor: float | None = None


def _randn(
    shape: Sequence[int], dtype: torch.dtype, seed: int, offsets: torch.Tensor | None = None
):
    """Seeded N(0, 1) values (the same on every machine), each row shifted by ``offsets``."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    if offsets is not None:
        x += offsets[:, None]
    return x.to(device=device.DEVICE, dtype=dtype)


def _float_dtypes() -> list[torch.dtype]:
    """fp32, fp16, and bf16 where the device computes in it (the interpreter's bf16 is wrong)."""
    return [torch.float32, torch.float16] + (
        [torch.bfloat16] if device.GPU_MODE and device.capabilities().bf16 else []
    )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def vector_add_cases() -> list[Case]:
    """Lengths not a multiple of any block: a last block of one element (4097), a prime, a large
    one, and a single element last (so a boundary mistake shows first where it has a pattern)."""
    sizes = device.pick([1000, 4097, 1237, 98_305, 2**24 + 1, 1], [1000, 4097, 127, 1])
    out = []
    for dtype in _float_dtypes():
        for i, n in enumerate(sizes):
            make = lambda n=n, d=dtype, s=i: (_randn([n], d, s), _randn([n], d, s + 100))
            out.append(Case(f"vector_add n={n} {_name(dtype)}", make))
    return out


_OVERFLOW_HINT = (
    "this case has rows of large magnitude (offsets of +-1000): exp(x) overflows to inf unless you "
    "subtract the row max first (softmax(x) = softmax(x - max(x)))"
)


def _offset_rows(rows: int, cols: int, dtype: torch.dtype, seed: int) -> tuple:
    """Rows of N(0, 1) shifted by 0, +1000, -1000, 30, ...: softmax does not change, exp overflows."""
    offsets = torch.tensor([0.0, 1000.0, -1000.0, 30.0])[torch.arange(rows) % 4]
    return (_randn([rows, cols], dtype, seed, offsets),)


def softmax_cases() -> list[Case]:
    """Odd widths (1, a prime, one past a power of two), several rows, and large-magnitude rows."""
    shapes = device.pick(
        [(7, 1237), (4096, 1000), (33, 4097), (3, 65_537), (16_384, 4096), (1, 1)],
        [(5, 123), (33, 1000), (3, 4097), (1, 1)],
    )
    big = device.pick((64, 8192), (8, 129))
    out = []
    for dtype in _float_dtypes():
        for i, (r, c) in enumerate(shapes):
            make = lambda r=r, c=c, d=dtype, s=i: (_randn([r, c], d, s),)
            out.append(Case(f"softmax [{r}, {c}] {_name(dtype)}", make, reduce_len=c))
        make = lambda d=dtype: _offset_rows(*big, d, 7)
        name = f"softmax [{big[0]}, {big[1]}] {_name(dtype)}, rows offset by +-1000"
        out.append(Case(name, make, reduce_len=big[1], hint=_OVERFLOW_HINT))
    return out


def matmul_cases() -> list[Case]:
    """16-bit operands (what tensor cores take) of odd sizes: one row, primes, not tile multiples."""
    shapes = device.pick(
        [(127, 257, 509), (1000, 1000, 1000), (4000, 3000, 5000), (1, 4096, 4096)],
        [(17, 33, 47), (64, 100, 72), (1, 16, 16)],
    )
    dtypes = [d for d in _float_dtypes() if d is not torch.float32]
    out = []
    for dtype in dtypes:
        for i, (m, n, k) in enumerate(shapes):
            make = lambda m=m, n=n, k=k, d=dtype, s=i: (
                _randn([m, k], d, s),
                _randn([k, n], d, s + 1),
            )
            name = f"matmul M={m} N={n} K={k} {_name(dtype)}"
            out.append(Case(name, make, reduce_len=k, diagnose=_matmul_diagnose))
    return out


def _matmul_diagnose(out: torch.Tensor, ref: torch.Tensor, args: tuple) -> list[str]:
    """Recognise a K loop that stops early: the output is A[:, :k] @ B[:k] for a tile multiple k."""
    a, b = (t.double() for t in args[:2])
    k = a.shape[1]
    got = out.double()
    for tile in (16, 32, 64, 128):
        kk = k // tile * tile
        if 0 < kk < k and torch.allclose(got, a[:, :kk] @ b[:kk], rtol=1e-2, atol=1e-2):
            return [
                f"your result is the product over the first {kk} of K = {k}: the K loop drops "
                f"the last, partial tile of {k - kk}. Loop over range(0, K, BLOCK_K) and mask "
                "the loads at K (other=0.0) instead"
            ]
    return []


# The case sets are gathered, with the exercises', in ``kernels.grade.cases``.

# ----------------------------------------------------------------------------- check

# Relative tolerance per output dtype: a few fp32 roundings; one to two bf16 ulps (2**-8 to 2**-7
# relative) for both 16-bit types, so a kernel may round through either on the way.
RTOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def tolerance(dtype: torch.dtype, reduce_len: int = 1) -> tuple[float, float]:
    """``(atol_factor, rtol)``: an element passes when ``|out - ref| <= atol_factor * max|ref| +
    rtol * |ref|``. The absolute part is fp32 accumulation error, which grows like the square root of
    the number of terms summed; it lets elements near zero (a matmul's cancellations) pass."""
    return 1e-5 * math.sqrt(max(reduce_len, 1)), RTOL.get(dtype, 1e-5)


def _describe_args(args: tuple) -> str:
    parts = [
        f"{_name(a.dtype)}{list(a.shape)}" if isinstance(a, torch.Tensor) else repr(a) for a in args
    ]
    return ", ".join(parts)


def _as_case(c: Case | Callable[[], tuple]) -> Case:
    return c if isinstance(c, Case) else Case(getattr(c, "__name__", "case"), c)


def _index(flat: int, shape: torch.Size) -> tuple[int, ...]:
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), shape))


def _tail_start(rel: torch.Tensor) -> int | None:
    """The first column of a wrong tail: every column from there on has relative errors more than
    ten times the largest one before it (a last block that was dropped or written past)."""
    col = rel.reshape(-1, rel.shape[-1]).amax(dim=0)
    n = col.numel()
    if n < 2:
        return None
    before = torch.cummax(col, dim=0).values[:-1]  # max of columns [0, s)
    after = torch.flip(torch.cummin(torch.flip(col, [0]), dim=0).values, [0])[1:]  # min of [s, n)
    ok = (after > 10 * before) & (after > 0)
    hits = ok.nonzero()
    return int(hits[0]) + 1 if hits.numel() else None


def _hints(out: torch.Tensor, ref: torch.Tensor, bad: torch.Tensor, rel: torch.Tensor, case: Case):
    """Plain-words guesses at the mistake, from the pattern of the wrong elements."""
    hints = []
    s = _tail_start(rel) if out.ndim else None
    if s is not None:
        n = out.shape[-1]
        hints.append(
            f"the errors sit in the last {n - s} of {n} elements along the last dimension (from "
            f"index {s} on; ten times larger there than anywhere before): the last, partial "
            "block. Check the mask (offsets < n) and the grid (triton.cdiv)."
        )
    if out.ndim >= 2:
        rows = bad.reshape(-1, out.shape[-1])
        whole = rows.all(dim=1)
        if whole.any() and not whole.all() and not rows[~whole].any():
            first = whole.nonzero().flatten()[:4].tolist()
            hints.append(
                f"{int(whole.sum())} whole rows are wrong (rows {first}...) and every other row is "
                "right: a per-row reduction (its max or its sum) overflowed or went wrong."
            )
    nonfinite = ~torch.isfinite(out) & torch.isfinite(ref)
    if nonfinite.any():
        at = _index(int(nonfinite.flatten().nonzero()[0]), out.shape)
        hints.append(f"the output holds NaN or inf where the reference is finite (first at {at}).")
        if case.hint:
            hints.append(case.hint)
    if bad.all() and bad.numel() > 1:
        zero = " The output is all zeros." if not out.any() else ""
        hints.append(
            f"every element is wrong.{zero} Does the kernel store (tl.store) into the tensor you "
            "return, over the whole grid?"
        )
    return hints


def _compare(out, ref: torch.Tensor, case: Case, args: tuple, atol, rtol) -> None:
    """Raise AssertionError naming the case, the worst element and a hint if ``out`` is wrong."""
    where = f"case '{case.name}' (inputs {_describe_args(args)})"
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"{where}: your function returned {type(out).__name__}, not a tensor")
    first = next((a.dtype for a in args if isinstance(a, torch.Tensor)), out.dtype)
    want_dtype = case.out_dtype or first
    if out.shape != ref.shape:
        raise AssertionError(
            f"{where}: wrong shape: got {list(out.shape)}, expected {list(ref.shape)}"
        )
    if out.dtype != want_dtype:
        raise AssertionError(
            f"{where}: wrong dtype: got {_name(out.dtype)}, expected {_name(want_dtype)}"
            + (
                " (the inputs' dtype: compute in fp32, round once when you store)"
                * (want_dtype == first)
            )
        )
    atol_factor, default_rtol = tolerance(out.dtype, case.reduce_len)
    if case.atol_factor is not None:
        atol_factor = case.atol_factor
    if case.exact:
        atol_factor, default_rtol = 0.0, 0.0
    rtol = default_rtol if rtol is None else rtol
    raw = out
    got = out.detach().to(torch.float64)  # compared where it lives: a GPU output can be large
    ref = ref.detach().to(device=got.device, dtype=torch.float64)
    finite = ref[torch.isfinite(ref)]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    atol = atol_factor * scale if atol is None else atol
    err = (got - ref).abs().nan_to_num(nan=math.inf)
    same = (got == ref) | (torch.isnan(got) & torch.isnan(ref))  # inf or NaN where it is expected
    err = torch.where(same, 0.0, err)
    bad = ~same & ~(err <= atol + rtol * ref.abs())  # 0 * inf is NaN: compare only the rest
    if not bad.any():
        return
    worst = _index(int(err.flatten().argmax()), got.shape)
    # Relative to |ref| + atol: elements near zero do not make every relative error infinite.
    rel = err / (ref.abs() + (atol if atol > 0 else 1e-30))
    worst_rel = _index(int(rel.flatten().argmax()), got.shape)
    first = _index(int(bad.flatten().nonzero()[0]), got.shape)
    lines = [
        f"{where}: {int(bad.sum())} of {bad.numel()} elements are out of tolerance "
        f"(atol={atol:.3g}, rtol={rtol:.3g}).",
        f"  largest absolute error {err[worst].item():.4g} at index {worst}: "
        f"got {got[worst].item():.6g}, expected {ref[worst].item():.6g}",
        f"  largest relative error {rel[worst_rel].item():.4g} at index {worst_rel}; "
        f"first wrong element at index {first}",
    ]
    hints = list(case.diagnose(raw, ref, args)) if case.diagnose else []
    lines += [f"  hint: {h}" for h in hints + _hints(got, ref, bad, rel, case)]
    raise AssertionError("\n".join(lines))


@contextlib.contextmanager
def poisoned_empty():
    """Inside, ``torch.empty`` and its kin return memory filled with NaN (integers: their largest
    value), through PyTorch's ``fill_uninitialized_memory`` switch of its deterministic mode. An
    output element the learner's kernel never writes then fails every time, instead of passing
    when the caching allocator happens to hand back memory that held the right value (a freed
    output of the same size, say). Operations without a deterministic implementation still run
    (``warn_only``), their warnings silenced; both settings are restored on the way out."""
    was_on = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_fill = torch.utils.deterministic.fill_uninitialized_memory
    # A learner who turned strict determinism on keeps it; otherwise nondeterministic ops only warn.
    torch.use_deterministic_algorithms(True, warn_only=was_warn_only if was_on else True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*determinis", category=UserWarning)
            yield
    finally:
        torch.use_deterministic_algorithms(was_on, warn_only=was_warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = was_fill


def check(
    fn: Callable,
    ref: Callable,
    cases: Sequence[Case | Callable[[], tuple]],
    *,
    atol: float | None = None,
    rtol: float | None = None,
) -> int:
    """Run ``fn`` and ``ref`` on every case; raise AssertionError at the first case ``fn`` gets wrong.

    ``ref`` is called on float64 copies of the inputs (higher precision than any kernel's). Returns
    the number of cases that passed (all of them) after printing one line saying so.
    """
    cases = [_as_case(c) for c in cases]
    if not cases:
        raise ValueError("cases must hold at least one case")
    for case in cases:
        args = case.make()
        # float64 copies, made before fn runs: a function that writes into its inputs cannot
        # change the reference.
        wide = tuple(
            a.to(torch.float64, copy=True)
            if isinstance(a, torch.Tensor) and a.is_floating_point()
            else a
            for a in args
        )
        try:
            with poisoned_empty():
                out = fn(*args)
                device.synchronize()  # an asynchronous GPU error surfaces here, with its case
        except Exception as e:  # the learner's code: report it with the case that triggered it
            raise AssertionError(
                f"case '{case.name}' (inputs {_describe_args(args)}): your function raised "
                f"{type(e).__name__}: {e}"
            ) from e
        _compare(out, ref(*wide), case, args, atol, rtol)
    print(f"all {len(cases)} cases pass ({device.capabilities().mode})")
    return len(cases)


# ----------------------------------------------------------------------------- score


@dataclass(frozen=True)
class Kind:
    """What ``score`` needs to know about an exercise: its roof ("copy" or "matmul"), default
    inputs, the bytes it must move and the FLOPs it must do, PyTorch's op and the course's kernel."""

    roof: str
    make_args: Callable[[], tuple]
    bytes: Callable[[tuple], float]
    flops: Callable[[tuple], float]
    torch_op: Callable
    # Imported when needed (the course kernel's module is heavy); may return None where the course
    # has no kernel to compare with on this device.
    course_op: Callable[[], Callable | None]


def _course(module: str, name: str) -> Callable[[], Callable]:
    def load():
        import importlib

        return getattr(importlib.import_module(module), name)

    return load


def _vector_add_args() -> tuple:
    n = device.pick(2**26, 2**14)
    return _randn([n], torch.float32, 0), _randn([n], torch.float32, 1)


def _softmax_args() -> tuple:
    shape = device.pick([16_384, 4096], [64, 256])
    dtype = device.preferred_dtype(torch.bfloat16) if device.GPU_MODE else torch.float32
    return (_randn(shape, dtype, 0),)


def _matmul_args() -> tuple:
    n = device.pick(4096, 64)
    dtype = device.preferred_dtype(torch.bfloat16) if device.GPU_MODE else torch.float16
    return _randn([n, n], dtype, 0), _randn([n, n], dtype, 1)


def _matmul_bytes(args: tuple) -> float:
    a, b = args[:2]
    return (a.numel() + b.numel() + a.shape[0] * b.shape[1]) * a.element_size()


KINDS: dict[str, Kind] = {
    # Read x and y, write x + y: 3 elements moved per FLOP.
    "vector_add": Kind(
        "copy",
        _vector_add_args,
        lambda a: 3 * a[0].numel() * a[0].element_size(),
        lambda a: a[0].numel(),
        torch.add,
        _course("kernels.vector_add", "add"),
    ),
    # Read x once, write y once; about 5 FLOPs an element (max, subtract, exp, sum, scale).
    "softmax": Kind(
        "copy",
        _softmax_args,
        lambda a: 2 * a[0].numel() * a[0].element_size(),
        lambda a: 5 * a[0].numel(),
        lambda x: torch.softmax(x, dim=-1),
        _course("kernels.softmax", "softmax"),
    ),
    # Read A and B, write C (the least traffic possible); 2 M N K FLOPs.
    "matmul": Kind(
        "matmul",
        _matmul_args,
        _matmul_bytes,
        lambda a: 2 * a[0].shape[0] * a[0].shape[1] * a[1].shape[1],
        torch.matmul,
        _course("kernels.matmul", "matmul"),
    ),
}

# The matmul roof of an input dtype. fp32 maps to TF32: Triton's tl.dot on fp32 uses it by default.
_PEAK_DTYPE = {torch.float32: "tf32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _peak_dtype(dtype: torch.dtype) -> str:
    if dtype not in _PEAK_DTYPE:
        raise TypeError(f"args must be float32, float16 or bfloat16 tensors, got {_name(dtype)}")
    return _PEAK_DTYPE[dtype]


@dataclass(frozen=True)
class Score:
    """Your kernel, PyTorch's and the course's, timed on one input against one measured roof."""

    kind: str
    roof: roofline.Ceiling  # copy bandwidth (GB/s) or the dtype's matmul peak (TFLOP/s)
    yours: bench.Measurement
    pytorch: bench.Measurement
    course: bench.Measurement | None
    flops: float
    bytes: float
    dtype: torch.dtype

    def _achieved(self, m: bench.Measurement) -> float:
        return m.gbps if self.roof.name == "copy" else m.tflops

    def fraction(self, m: bench.Measurement | None = None) -> float:
        """The fraction of the roof ``m`` (default: yours) reaches."""
        return self._achieved(m or self.yours) / self.roof.value

    @property
    def pytorch_fraction(self) -> float:
        return self.fraction(self.pytorch)

    @property
    def course_fraction(self) -> float | None:
        return None if self.course is None else self.fraction(self.course)

    @property
    def roof_label(self) -> str:
        v = self.roof.value
        value = f"{v:,.0f}" if v >= 100 else f"{v:.3g}"
        if self.roof.name == "copy":
            return f"copy bandwidth ({value} GB/s)"
        return f"{self.roof.dtype} matmul peak ({value} TFLOP/s)"

    @property
    def verdict(self) -> str:
        where = "this GPU's" if self.yours.gpu_timing else "this CPU's"
        text = f"{self.fraction():.2f} of {where} {self.roof_label}; PyTorch: {self.pytorch_fraction:.2f}"
        if self.course is not None:
            text += f"; the course's kernel: {self.course_fraction:.2f}"
        if not self.yours.gpu_timing:
            text += " (CPU interpreter timings at tiny sizes: NOT GPU numbers)"
        return text

    def __str__(self) -> str:
        return self.verdict

    def plot(self, ax=None):
        """Your point, PyTorch's and the course's on this device's roofline (copy bandwidth and the
        dtype's matmul peak, both measured in this process). Returns the axes."""
        if ax is None:
            _, ax = plotstyle.figure()
        copy = roofline.copy_bandwidth()
        peak = roofline.matmul_peak(_peak_dtype(self.dtype))
        intensity = self.flops / self.bytes
        named = [("yours", self.yours), ("PyTorch", self.pytorch), ("course", self.course)]
        points = [(label, intensity, m.tflops) for label, m in named if m is not None]
        roofline.plot_roofline(
            ax, bandwidth_gbps=copy.value, peak_tflops=peak.value, points=points, label="measured"
        )
        plotstyle.title(
            ax, f"{self.kind}: your kernel on the roofline", gpu=plotstyle.gpu_name(),
            dtype=_name(self.dtype),
        )  # fmt: skip
        return ax


def score(
    fn: Callable,
    kind: str,
    *,
    args: tuple | None = None,
    baseline: Callable | None = None,
    course: Callable | None = None,
) -> Score:
    """Time ``fn(*args)`` against the roof of ``kind``, PyTorch and the course's kernel; print the
    verdict and return the Score.

    ``kind`` is one of ``KINDS`` ("vector_add", "softmax", "matmul", and the exercises'); ``args`` default to the kind's
    real sizes on a GPU (tiny ones on a CPU). ``baseline`` replaces the PyTorch op and ``course``
    the course's kernel, for an exercise whose reference is another function.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {sorted(KINDS)}, got {kind!r}")
    spec = KINDS[kind]
    args = spec.make_args() if args is None else tuple(args)
    dtype = args[0].dtype
    work = dict(bytes=spec.bytes(args), flops=spec.flops(args))
    roof = (
        roofline.copy_bandwidth()
        if spec.roof == "copy"
        else roofline.matmul_peak(_peak_dtype(dtype))
    )
    torch_fn = baseline or spec.torch_op
    course_fn = course or spec.course_op()
    mine = bench.measure(lambda: fn(*args), **work)
    base = bench.measure(lambda: torch_fn(*args), **work)
    ours = None if course_fn is None else bench.measure(lambda: course_fn(*args), **work)
    result = Score(kind, roof, mine, base, ours, work["flops"], work["bytes"], dtype)
    print(result.verdict)
    return result
