"""The grader: it passes correct kernels and rejects wrong ones with the right diagnosis."""

from __future__ import annotations

import re

import pytest
import torch
import triton
import triton.language as tl

from kernels import device, grade
from kernels.matmul import matmul, matmul_ref
from kernels.softmax import softmax, softmax_ref
from kernels.vector_add import add, add_ref


def _fail(fn, ref, cases) -> str:
    """The message of the AssertionError ``check`` must raise."""
    with pytest.raises(AssertionError) as info:
        grade.check(fn, ref, cases)
    return str(info.value)


# ----------------------------------------------------------------------------- right answers


@pytest.mark.parametrize(
    "fn, ref, cases",
    [
        (add, add_ref, grade.cases.vector_add),
        (softmax, softmax_ref, grade.cases.softmax),
        (matmul, matmul_ref, grade.cases.matmul),
        (lambda x: torch.softmax(x, -1), softmax_ref, grade.cases.softmax),
    ],
    ids=["vector_add", "softmax", "matmul", "torch-softmax"],
)
def test_check_passes_the_course_kernels(fn, ref, cases, capsys):
    c = cases()
    assert grade.check(fn, ref, c) == len(c)
    assert f"all {len(c)} cases pass" in capsys.readouterr().out


def test_cases_cover_odd_sizes_dtypes_and_large_rows():
    names = [c.name for c in grade.cases.softmax()]
    assert any("float16" in n for n in names) and any("float32" in n for n in names)
    assert any("rows offset by +-1000" in n for n in names)
    sizes = [c.make()[0].numel() for c in grade.cases.vector_add()]
    assert 1 in sizes and all(n == 1 or n % 64 for n in sizes)  # no size a multiple of a block


def test_check_takes_plain_callables_and_refuses_no_cases():
    def three():
        return (torch.ones(3), torch.ones(3))

    assert grade.check(torch.add, add_ref, [three]) == 1
    with pytest.raises(ValueError, match="at least one case"):
        grade.check(torch.add, add_ref, [])


# ----------------------------------------------------------------------------- wrong answers


@triton.jit
def _add_off_by_one_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements - 1  # the mistake: the last element is never written
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


def add_off_by_one(x, y):
    out = torch.zeros_like(x)
    _add_off_by_one_kernel[(triton.cdiv(x.numel(), 256),)](x, y, out, x.numel(), BLOCK_SIZE=256)
    return out


def test_off_by_one_mask_is_caught_at_the_last_element():
    msg = _fail(add_off_by_one, add_ref, grade.cases.vector_add())
    assert "case 'vector_add n=1000 float32'" in msg
    assert "1 of 1000 elements are out of tolerance" in msg
    assert "largest absolute error" in msg and "at index (999,)" in msg
    assert re.search(r"largest relative error 0\.99\d* at index \(999,\)", msg)
    assert "first wrong element at index (999,)" in msg
    assert "last 1 of 1000 elements" in msg and "mask" in msg


def test_dropped_last_column_is_caught_in_that_column():
    def softmax_drops_last_column(x):
        y = torch.softmax(x[:, :-1].float(), dim=-1).to(x.dtype)
        return torch.cat([y, torch.zeros_like(x[:, -1:])], dim=-1)

    # The first case is ordinary rows of an odd width (sizes differ on a GPU).
    cases = grade.cases.softmax()
    cols = int(re.search(r"\[\d+, (\d+)\]", cases[0].name).group(1))
    msg = _fail(softmax_drops_last_column, softmax_ref, cases)
    assert f"case '{cases[0].name}'" in msg
    assert re.search(rf"largest absolute error \S+ at index \(\d+, {cols - 1}\)", msg)
    assert f"last 1 of {cols} elements" in msg


def test_softmax_without_max_subtraction_overflows_on_large_rows():
    def naive_softmax(x):
        e = torch.exp(x)
        return e / e.sum(dim=-1, keepdim=True)

    cases = grade.cases.softmax()
    offset = next(c for c in cases if "rows offset by +-1000" in c.name)
    msg = _fail(naive_softmax, softmax_ref, cases)
    # Ordinary rows pass: the case that fails is the one with rows offset by +-1000, and in it
    # exactly the rows whose exp overflows (+1000) or underflows to 0/0 (-1000) are wrong, whole.
    (x,) = offset.make()
    bad_rows = (~torch.isfinite(naive_softmax(x))).all(dim=-1).nonzero().flatten().tolist()
    assert bad_rows and len(bad_rows) < x.shape[0]
    assert f"case '{offset.name}'" in msg
    assert "got nan" in msg
    assert f"{len(bad_rows)} whole rows are wrong (rows {bad_rows[:4]}" in msg
    assert "NaN or inf" in msg and "subtract the row max" in msg
    if not device.GPU_MODE:  # the CPU's case: 8 rows, of which rows 1, 2, 5 and 6 shifted up
        assert offset.name == "softmax [8, 129] float32, rows offset by +-1000"
        assert "at index (1, 0)" in msg and "4 whole rows are wrong (rows [1, 2, 5, 6]" in msg


def test_wrong_dtype_shape_and_type_are_named():
    fp16 = [c for c in grade.cases.vector_add() if "float16" in c.name]
    msg = _fail(lambda x, y: x.float() + y.float(), add_ref, fp16)
    assert "case 'vector_add n=1000 float16'" in msg
    assert "wrong dtype: got float32, expected float16" in msg
    msg = _fail(lambda x, y: (x + y)[:-1], add_ref, grade.cases.vector_add())
    assert "wrong shape: got [999], expected [1000]" in msg
    msg = _fail(lambda x, y: (x + y).tolist(), add_ref, grade.cases.vector_add())
    assert "returned list, not a tensor" in msg


def test_an_exception_is_reported_with_its_case():
    def broken(x, y):
        raise RuntimeError("BLOCK_SIZE must be a power of two")

    with pytest.raises(AssertionError) as info:
        grade.check(broken, add_ref, grade.cases.vector_add())
    msg = str(info.value)
    assert "case 'vector_add n=1000 float32' (inputs float32[1000], float32[1000])" in msg
    assert "raised RuntimeError: BLOCK_SIZE must be a power of two" in msg
    assert isinstance(info.value.__cause__, RuntimeError)


def test_the_reference_sees_the_inputs_as_they_were_before_fn_ran():
    def clobbers_x(x, y):
        x.zero_()  # writing into an input must not make the reference agree with a wrong answer
        return x + y

    assert "out of tolerance" in _fail(clobbers_x, add_ref, grade.cases.vector_add())


def test_an_output_never_written_is_recognised():
    msg = _fail(lambda x, y: torch.zeros_like(x), add_ref, grade.cases.vector_add())
    assert "1000 of 1000 elements" in msg
    assert "every element is wrong. The output is all zeros" in msg


def test_tolerance_follows_dtype_and_reduction_length():
    slightly_off = lambda x, y: ((x.float() + y.float()) * (1 + 1e-4)).to(x.dtype)  # noqa: E731
    fp32 = [c for c in grade.cases.vector_add() if "float32" in c.name]
    fp16 = [c for c in grade.cases.vector_add() if "float16" in c.name]
    assert "out of tolerance" in _fail(slightly_off, add_ref, fp32)  # 1e-4 is too much for fp32
    assert grade.check(slightly_off, add_ref, fp16) == len(fp16)  # and below fp16's rounding
    assert grade.check(slightly_off, add_ref, fp32, rtol=1e-3) == len(fp32)
    atol1, rtol1 = grade.tolerance(torch.float32, 1)
    atol100, _ = grade.tolerance(torch.float32, 100)
    assert atol100 == pytest.approx(10 * atol1) and rtol1 == 1e-5
    assert grade.tolerance(torch.bfloat16)[1] == 1e-2


# ----------------------------------------------------------------------------- score


def test_score_vector_add_against_the_copy_roof(capsys):
    x, y = torch.randn(4096, device=device.DEVICE), torch.randn(4096, device=device.DEVICE)
    s = grade.score(add, "vector_add", args=(x, y))
    assert s.bytes == 3 * 4096 * 4 and s.flops == 4096
    assert s.roof.name == "copy"
    assert s.fraction() == pytest.approx(s.yours.gbps / s.roof.value)
    assert s.fraction() > 0 and s.pytorch_fraction > 0 and s.course_fraction > 0
    assert "copy bandwidth" in s.verdict and "PyTorch" in s.verdict
    assert "course's kernel" in s.verdict
    assert ("NOT GPU numbers" in s.verdict) == (not device.GPU_MODE)
    assert capsys.readouterr().out.strip() == s.verdict


def test_score_matmul_against_the_dtype_peak_and_plot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a = torch.randn(32, 48, dtype=torch.float16, device=device.DEVICE)
    b = torch.randn(48, 40, dtype=torch.float16, device=device.DEVICE)
    s = grade.score(torch.matmul, "matmul", args=(a, b), course=torch.matmul)
    assert s.roof.name == "matmul_float16" and s.flops == 2 * 32 * 48 * 40
    assert "float16 matmul peak" in s.verdict
    assert s.fraction() == pytest.approx(s.yours.tflops / s.roof.value) and s.fraction() > 0
    ax = s.plot()
    labels = {t.get_text().strip() for t in ax.texts}
    assert {"yours", "PyTorch", "course"} <= labels
    assert ("CPU interpreter" in ax.get_title()) == (not device.GPU_MODE)
    plt.close(ax.figure)


def test_score_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        grade.score(torch.add, "convolution")


def test_an_unwritten_output_element_fails_even_on_recycled_memory():
    # The output's last element is never written. Without the poison, torch.empty may hand back
    # memory that already held the right value (here: a freed output of the same computation), and
    # the mistake would pass; inside check, fresh memory is NaN.
    def leaves_the_last_element(x, y):
        torch.empty_like(x).copy_(x + y)  # a right answer, freed at once: the allocator keeps it
        out = torch.empty_like(x)
        out[:-1] = (x + y)[:-1]
        return out

    fill = torch.utils.deterministic.fill_uninitialized_memory
    msg = _fail(leaves_the_last_element, add_ref, grade.cases.vector_add())
    assert "first wrong element at index (999,)" in msg
    # The deterministic-mode settings the poison borrows are back as they were.
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory == fill


def test_poisoned_empty_restores_the_settings_it_found():
    from kernels.grade.core import poisoned_empty

    torch.use_deterministic_algorithms(True)
    try:
        with poisoned_empty():
            assert torch.empty(4).isnan().all()
            assert torch.empty(2, dtype=torch.int32).eq(torch.iinfo(torch.int32).max).all()
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
    finally:
        torch.use_deterministic_algorithms(False)
