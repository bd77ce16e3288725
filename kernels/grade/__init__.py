"""Grade your own kernel: is it right, and how close is it to what this GPU can do?

Two steps, in this order::

    from kernels import grade
    from kernels.vector_add import add_ref

    grade.check(my_add, add_ref, grade.cases.vector_add())   # raises AssertionError if wrong
    s = grade.score(my_add, "vector_add")                    # prints a one-line verdict
    s.plot()                                                 # your point on this GPU's roofline

``check`` runs your function on every case of an exercise (odd sizes, every dtype the device has,
inputs chosen to break the usual mistakes) and compares it with the reference, which it calls on
float64 copies of the inputs. Tolerances follow the dtype (fp32 1e-5, fp16/bf16 1e-2 relative) and
grow with the square root of the reduction length. On the first failing case it raises an
``AssertionError`` that names the case, says where the largest error is, and gives a hint when the
mistake has a recognisable shape (a wrong last block: a mask; NaN in whole rows: an overflow).

``score`` times your function with ``kernels.bench.measure`` against the roof that bounds it (the
copy bandwidth for memory-bound kinds, the matmul peak of the dtype for matmuls, both measured in
this process), against PyTorch and against the course's own kernel. On a CPU (Triton's interpreter)
it runs at tiny sizes and says that its numbers are not GPU numbers. ``score`` does not check
results: run ``check`` first.

The package: ``core`` holds ``Case``, ``check`` and ``score`` and the first case sets;
``exercises`` the cases, references and score kinds of the labs' graded exercises (one per act);
``ring`` grades a ring all-reduce step on gloo processes (``check_ring_step``) and ``barrier`` a
grid barrier (``check_grid_barrier``), two exercises that a single function call cannot exercise.
"""

from types import SimpleNamespace

from kernels.grade import core, exercises
from kernels.grade.barrier import check_grid_barrier
from kernels.grade.core import (
    KINDS,
    RTOL,
    Case,
    Kind,
    Score,
    check,
    matmul_cases,
    score,
    softmax_cases,
    tolerance,
    vector_add_cases,
)
from kernels.grade.exercises import (
    bf16_round_cases,
    bf16_round_ref,
    flash_attention_cases,
    flash_attention_ref,
    forest_cases,
    forest_ref,
    gelu_chain_cases,
    gelu_chain_ref,
    int4_unpack_cases,
    int4_unpack_ref,
    paged_gather_cases,
    paged_gather_ref,
)
from kernels.grade.ring import check_ring_step

#: Ready-made case sets: ``grade.cases.vector_add()``, ``.softmax()``, ``.matmul()`` and one per
#: exercise of the labs.
cases = SimpleNamespace(
    vector_add=vector_add_cases,
    softmax=softmax_cases,
    matmul=matmul_cases,
    bf16_round=bf16_round_cases,
    gelu_chain=gelu_chain_cases,
    flash_attention=flash_attention_cases,
    paged_gather=paged_gather_cases,
    int4_unpack=int4_unpack_cases,
    forest=forest_cases,
)

#: The references the exercises are graded against, by the same names.
refs = SimpleNamespace(
    bf16_round=bf16_round_ref,
    gelu_chain=gelu_chain_ref,
    flash_attention=flash_attention_ref,
    paged_gather=paged_gather_ref,
    int4_unpack=int4_unpack_ref,
    forest=forest_ref,
)

__all__ = [
    "KINDS",
    "RTOL",
    "Case",
    "Kind",
    "Score",
    "cases",
    "check",
    "check_grid_barrier",
    "check_ring_step",
    "core",
    "exercises",
    "refs",
    "score",
    "tolerance",
]
