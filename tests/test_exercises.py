"""The labs' graded exercises: each grader accepts the notebook's own reference solution and rejects a
realistic wrong answer with a message that points at the mistake.

The solutions are read from the notebooks (the cell after the skeleton, tagged ``hide-input``), so
the notebook and this test cannot drift apart; each wrong answer is that solution with one
realistic edit, which must still apply (a test fails loudly if the solution changes under it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import kernels  # noqa: F401  (sets TRITON_INTERPRET; conftest imports it before any test module)
from kernels import device, grade
from kernels.grade import barrier

ROOT = Path(__file__).resolve().parents[1]
LABS = {
    "01a": "01a-gpu-hierarchy",
    "01c": "01c-numerics-lab",
    "02a": "02a-roofline",
    "03b": "03b-torch-compile",
    "04b": "04b-triton-matmul",
    "04d": "04d-flash-attention",
    "05a": "05a-collectives",
    "06a": "06a-kv-cache-paged-attention",
    "07a": "07a-quantized-gemv",
    "08a": "08a-megakernel",
    "09a": "09a-tree-inference",
}


def _source(cell: dict) -> str:
    src = cell["source"]
    return "".join(src) if isinstance(src, list) else src


def exercise(lab: str) -> dict[str, str]:
    """The exercise's cells: its markdown, then skeleton, folded solution and grading cell."""
    nb = json.loads((ROOT / "notebooks" / f"{LABS[lab]}.ipynb").read_text(encoding="utf-8"))
    cells = nb["cells"]
    starts = [
        i
        for i, c in enumerate(cells)
        if c["cell_type"] == "markdown" and _source(c).startswith("### Exercise:")
    ]
    assert len(starts) == 1, f"{lab}: want one '### Exercise:' cell, found {len(starts)}"
    code = [c for c in cells[starts[0] + 1 :] if c["cell_type"] == "code"][:3]
    skeleton, solution, grading = code
    assert _source(skeleton).startswith("# Exercise skeleton"), lab
    assert _source(solution).startswith("# Reference solution"), lab
    assert "hide-input" in solution.get("metadata", {}).get("tags", []), lab
    assert _source(grading).startswith("# Grade"), lab
    return {
        "text": _source(cells[starts[0]]),
        "skeleton": _source(skeleton),
        "solution": _source(solution),
        "grade": _source(grading),
    }


def run(lab: str, tmp_path: Path, *sources: str) -> dict:
    """Execute cell sources in one namespace, from a file (Triton's jit reads a kernel's source)."""
    ns: dict = {"__name__": f"lab_{lab}"}
    for i, src in enumerate(sources):
        path = tmp_path / f"lab_{lab}_{i}.py"
        path.write_text(src)
        exec(compile(src, str(path), "exec"), ns)
    return ns


def edit(src: str, old: str, new: str) -> str:
    """The solution with one mistake put in; ``old`` must be in it (or the test is out of date)."""
    assert src.count(old) == 1, f"the reference solution no longer contains {old!r} once"
    return src.replace(old, new)


def fails(fn, *args, **kw) -> str:
    with pytest.raises(AssertionError) as info:
        fn(*args, **kw)
    return str(info.value)


# ----------------------------------------------------------------------------- every exercise


@pytest.mark.parametrize("lab", LABS)
def test_skeleton_runs_and_solution_passes_the_grading_cell(lab, tmp_path, capsys):
    ex = exercise(lab)
    assert "How it is graded" in ex["text"]
    run(lab, tmp_path, ex["skeleton"])  # defines, calls nothing: must not raise
    ns = run(lab, tmp_path, ex["skeleton"], ex["solution"], ex["grade"])
    out = capsys.readouterr().out
    assert re.search(r"all \d+ (\w+ )?(cases|checks) pass", out), out
    if "grade.score(" in ex["grade"]:
        score = next(v for v in ns.values() if isinstance(v, grade.Score))
        assert score.fraction() > 0 and score.verdict in out


# ----------------------------------------------------------------------------- wrong answers


def _wrong(lab, tmp_path, *edits: tuple[str, str]) -> dict:
    """The lab's skeleton, then its solution with each ``(old, new)`` edit put in, run."""
    ex = exercise(lab)
    src = ex["solution"]
    for old, new in edits:
        src = edit(src, old, new)
    return run(lab, tmp_path, ex["skeleton"], src)


def test_grid_stride_without_the_loop_misses_the_tail(tmp_path):
    ns = _wrong(
        "01a",
        tmp_path,
        (
            "range(pid * BLOCK_SIZE, n_elements, n_programs * BLOCK_SIZE)",
            "range(pid * BLOCK_SIZE, (pid + 1) * BLOCK_SIZE, BLOCK_SIZE)",  # one block per program
        ),
    )
    msg = fails(grade.check, ns["add_grid_stride"], ns["add_ref"], grade.cases.vector_add())
    assert "the last, partial block" in msg
    if not device.GPU_MODE:  # four programs of 128 cover the first 512 elements, and no more
        assert "case 'vector_add n=1000 float32'" in msg
        assert "last 488 of 1000 elements" in msg and "(from index 512 on" in msg


def test_grid_stride_off_by_one_mask(tmp_path):
    ns = _wrong("01a", tmp_path, ("offsets < n_elements", "offsets < n_elements - 1"))
    msg = fails(grade.check, ns["add_grid_stride"], ns["add_ref"], grade.cases.vector_add())
    assert "first wrong element at index (999,)" in msg and "last 1 of 1000" in msg


@pytest.mark.parametrize(
    "old, new, case, says",
    [
        ("(bits + 0x7FFF + lsb) >> 16", "bits >> 16", "ties, overflow", "truncation"),
        ("(bits + 0x7FFF + lsb) >> 16", "(bits + 0x8000) >> 16", "ties, overflow", "ties to even"),
        ("torch.where(x.isnan(), 0x7FC0, top)", "top", "ties, overflow", "a NaN input came out"),
    ],
    ids=["truncates", "ties-away", "loses-nan"],
)
def test_bf16_rounding_mistakes_are_named(tmp_path, old, new, case, says):
    ns = _wrong("01c", tmp_path, (old, new))
    msg = fails(grade.check, ns["to_bf16"], grade.refs.bf16_round, grade.cases.bf16_round())
    assert f"case 'bf16 rounding: {case}" in msg and says in msg


def test_softmax_without_the_max_overflows(tmp_path):
    ns = _wrong("02a", tmp_path, ("tl.exp(x - tl.max(x, axis=0))", "tl.exp(x)"))
    msg = fails(grade.check, ns["softmax_rows"], ns["softmax_ref"], grade.cases.softmax())
    assert "rows offset by +-1000" in msg and "subtract the row max" in msg


def test_gelu_chain_indexing_w_by_row_is_caught(tmp_path):
    ns = _wrong("03b", tmp_path, ("col = offsets % n_cols", "col = offsets // n_cols"))
    msg = fails(
        grade.check, ns["gelu_chain_fused"], grade.refs.gelu_chain, grade.cases.gelu_chain()
    )
    assert f"case '{grade.cases.gelu_chain()[0].name}'" in msg and "out of tolerance" in msg


def test_gelu_chain_diagnoses_w_read_at_the_flat_offset():
    # What loading w and b at the flat offset gives (built in torch: the kernel itself would read
    # past the end of w): row 0 right, the others with whatever lies past w.
    case = grade.cases.gelu_chain()[0]
    x, w, b = case.make()
    bad = grade.refs.gelu_chain(x, w, b)
    bad[1:] = grade.refs.gelu_chain(x[1:], w * 0, b * 0)
    msg = fails(grade.check, lambda *a: bad, grade.refs.gelu_chain, [case])
    assert "row 0 is right and every other row is wrong" in msg and "offsets % n_cols" in msg


def test_matmul_that_drops_the_last_k_tile(tmp_path):
    ns = _wrong("04b", tmp_path, ("range(0, K, BLOCK_K)", "range(0, K - BLOCK_K + 1, BLOCK_K)"))
    msg = fails(grade.check, ns["tiled_matmul"], ns["matmul_ref"], grade.cases.matmul())
    assert f"case '{grade.cases.matmul()[0].name}'" in msg
    assert "the K loop drops the last, partial tile" in msg
    if not device.GPU_MODE:  # BLOCK_K = 16 in the interpreter
        assert "product over the first 32 of K = 47" in msg and "partial tile of 15" in msg


def test_flash_without_the_max_overflows(tmp_path):
    ns = _wrong(
        "04d",
        tmp_path,
        ("m_new = tl.maximum(m, tl.max(s, axis=1))", "m_new = m * 0"),
        ('m = tl.full((BLOCK_M,), -float("inf"), dtype=tl.float32)',
         "m = tl.zeros((BLOCK_M,), dtype=tl.float32)"),
    )  # fmt: skip
    cases = grade.cases.flash_attention()
    msg = fails(grade.check, ns["flash_attention"], grade.refs.flash_attention, cases)
    # In the interpreter the +-100s case is the first to overflow; on a GPU the long case whose
    # scores grow along the keys overflows first. Either way the grader names the missing max.
    assert "NaN or inf" in msg and "subtract the running max" in msg
    if not device.GPU_MODE:
        assert "scores of +-100s" in msg


def test_flash_without_the_rescale_is_caught_on_many_tiles(tmp_path):
    ns = _wrong(
        "04d",
        tmp_path,
        ("l_i = l_i * alpha +", "l_i = l_i +"),
        ("acc = acc * alpha[:, None] +", "acc = acc +"),
    )
    cases = grade.cases.flash_attention()
    msg = fails(grade.check, ns["flash_attention"], grade.refs.flash_attention, cases)
    assert f"case '{cases[1].name}'" in msg  # the first case, a single tile, passed
    assert "rescale the old l and acc by alpha" in msg


def test_ring_step_with_a_wrong_chunk_index_fails_on_three_ranks(tmp_path):
    ns = _wrong(
        "05a",
        tmp_path,
        ("send_chunk = (rank - step) % world", "send_chunk = (rank + step) % world"),
        ("recv_chunk = (rank - step - 1) % world", "recv_chunk = (rank + step - 1) % world"),
    )
    msg = fails(grade.check_ring_step, ns["reduce_scatter_step"])
    # Two ranks cannot tell (r + s) % 2 from (r - s) % 2: the failure is on three.
    assert "reduce-scatter steps on 3 ranks (12 elements)" in msg
    assert re.search(
        r"rank \d must hold chunk \d .* but element \d+ holds the values of ranks", msg
    )
    assert "sends chunk (r - s) % world" in msg


def test_ring_step_that_raises_is_reported_with_its_rank(tmp_path):
    ns = _wrong("05a", tmp_path, ("flat[r0:r1] += incoming", "flat[r0:r1] += incoming[1:]"))
    msg = fails(grade.check_ring_step, ns["reduce_scatter_step"], worlds=(2,))
    assert "on 2 ranks, your step raised on rank" in msg and "RuntimeError" in msg


def test_paged_gather_without_the_table_lookup(tmp_path):
    old = "block = tl.load(table_ptr + seq * stride_tb + pos // BLOCK_SIZE, mask=mask, other=0)"
    ns = _wrong("06a", tmp_path, (old, "block = pos // BLOCK_SIZE"))
    msg = fails(
        grade.check, ns["paged_gather"], grade.refs.paged_gather, grade.cases.paged_gather()
    )
    assert f"case '{grade.cases.paged_gather()[0].name}'" in msg
    assert "look the block up in the table" in msg


@pytest.mark.parametrize(
    "edits, says",
    [
        (
            [
                ("scales_ptr + row * n_groups + j // group_size", "scales_ptr + row * n_groups + (2 * j) // group_size"),
                ("(j + half) // group_size", "(2 * j + 1) // group_size"),
                ("out_ptr + row * K + j,", "out_ptr + row * K + 2 * j,"),
                ("out_ptr + row * K + half + j,", "out_ptr + row * K + 2 * j + 1,"),
            ],
            "neighbour-pair layout",
        ),
        ([("lo = (byte & 0xF)", "lo = (byte >> 4)"), ("hi = (byte >> 4)", "hi = (byte & 0xF)")],
         "swapped"),
        ([("(byte & 0xF).to(tl.int32) - 8", "(byte & 0xF).to(tl.int32)"),
          ("(byte >> 4).to(tl.int32) - 8", "(byte >> 4).to(tl.int32)")],
         "subtract 8"),
    ],
    ids=["neighbour-pairs", "swapped-nibbles", "no-offset"],
)  # fmt: skip
def test_int4_unpack_mistakes_are_named(tmp_path, edits, says):
    ns = _wrong("07a", tmp_path, *edits)
    msg = fails(grade.check, ns["int4_unpack"], grade.refs.int4_unpack, grade.cases.int4_unpack())
    assert f"case '{grade.cases.int4_unpack()[0].name}'" in msg and says in msg


def test_forest_walk_that_sends_ties_right(tmp_path):
    ns = _wrong("09a", tmp_path, ("(x > thr)", "(x >= thr)"))
    msg = fails(grade.check, ns["forest_predict"], grade.refs.forest, grade.cases.forest())
    assert f"case '{grade.cases.forest()[0].name}'" in msg and "what >= gives" in msg


_ARRIVE_LOAD_STORE = """
@triton.jit
def arrive(sync_ptr, n_programs):
    gen = tl.load(sync_ptr + 1, volatile=True)
    arrived = tl.load(sync_ptr, volatile=True)
    tl.store(sync_ptr, arrived + 1)  # the race: two programs read the same count
    last = arrived == n_programs - 1
    tl.store(sync_ptr, arrived * 0, mask=last)
    tl.store(sync_ptr + 1, gen + 1, mask=last)
    return gen
"""


def test_barrier_without_the_atomic_loses_arrivals(tmp_path):
    ex = exercise("08a")
    ns = run("08a", tmp_path, ex["skeleton"], ex["solution"], _ARRIVE_LOAD_STORE)
    msg = fails(grade.check_grid_barrier, ns["arrive"], ns["wait"])
    assert "8 programs arriving at once, barrier 1: the count is 1" in msg
    assert "tl.atomic_add" in msg and "a load, then a store" in msg


@pytest.mark.parametrize(
    "old, new, says",
    [
        ("last = arrived == n_programs - 1", "last = arrived == n_programs", "no program saw itself last"),
        ('tl.atomic_xchg(sync_ptr, 0, mask=last, sem="relaxed")', "", "reset the count to 0"),
        ("== gen) & (polls < max_polls)", "!= gen) & (polls < max_polls)", "wait at a closed barrier"),
    ],
    ids=["last-off-by-one", "no-reset", "wait-inverted"],
)  # fmt: skip
def test_barrier_mistakes_are_named(tmp_path, old, new, says):
    ns = _wrong("08a", tmp_path, (old, new))
    assert says in fails(grade.check_grid_barrier, ns["arrive"], ns["wait"])


def test_barrier_exercise_states_the_interpreter_limit(tmp_path, capsys):
    text = " ".join(exercise("08a")["text"].split())
    assert "one after" in text and "spin forever" in text and "only there" in text
    if not device.GPU_MODE:
        ex = exercise("08a")
        ns = run("08a", tmp_path, ex["skeleton"], ex["solution"])
        assert grade.check_grid_barrier(ns["arrive"], ns["wait"]) == 4
        assert "the race check needs a GPU" in capsys.readouterr().out


@triton.jit
def _counting_wait(sync_ptr, gen, max_polls):
    polls = 0
    while (tl.atomic_add(sync_ptr + 1, 0) == gen) & (polls < max_polls):
        tl.atomic_add(sync_ptr + 3, 1)
        polls += 1
    return polls < max_polls


def test_race_check_stops_polling_after_the_first_time_out():
    """A barrier that never opens must fail the race check after one wait's max_polls, not after
    2 * ROUNDS of them (minutes on a GPU). Here two programs are expected and one arrives; the
    wait counts its polls in the spare word sync[3]."""
    rounds, max_polls = 3, 7
    sync, timeout = barrier._sync(), torch.zeros(1, dtype=torch.int32, device=device.DEVICE)
    buf = torch.zeros(2, dtype=torch.int32, device=device.DEVICE)
    out = torch.zeros(rounds, 2, dtype=torch.int32, device=device.DEVICE)
    barrier._exchange_kernel[(1,)](
        buf, out, sync, timeout, 2, max_polls, ROUNDS=rounds, ARRIVE=barrier._course_arrive,
        WAIT=_counting_wait,
    )  # fmt: skip
    assert timeout.item() == 1
    assert sync[3].item() == max_polls


@pytest.mark.gpu
@pytest.mark.skipif(not device.GPU_MODE, reason="the race check needs a GPU")
def test_barrier_race_check_runs_on_a_gpu(tmp_path, capsys):
    ex = exercise("08a")
    ns = run("08a", tmp_path, ex["skeleton"], ex["solution"])
    assert grade.check_grid_barrier(ns["arrive"], ns["wait"]) == 5
    assert "race check included" in capsys.readouterr().out
