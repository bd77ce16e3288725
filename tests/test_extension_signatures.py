"""The CUDA extensions' declared signatures match their definitions, on a CPU.

Each extension is built by ``torch.utils.cpp_extension.load_inline`` from its kernels and
bindings (``cuda_sources``) and a list of declarations (``cpp_sources``) that pybind11 binds. A
declaration that differs from its definition (a parameter added to one and not the other)
compiles, and fails only when the extension loads on a GPU: undefined symbol. Here every build
function runs with ``load_inline`` replaced by a recorder, and each declared function's parameter
list is compared with its definition's."""

import re

import pytest
import torch.utils.cpp_extension

import kernels.cuda as ladder
from kernels.cuda import cluster_rows, fa_ws, fa_ws_bwd
from kernels.quant import cuda_int4

# Each extension's build function, uncached (functools.cache's __wrapped__).
BUILDS = {
    "sgemm": lambda: ladder._module.__wrapped__(),
    "hgemm": lambda: ladder._hgemm_module.__wrapped__(),
    "fa_ws": lambda: fa_ws._module.__wrapped__(),
    "fa_ws_bwd": lambda: fa_ws_bwd._module.__wrapped__(),
    "cluster_rows": lambda: cluster_rows._module(),
    "int4_gemv_mma": lambda: cuda_int4._int4_mma_module.__wrapped__(),
}


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.fixture
def recorded(monkeypatch):
    """The keyword arguments each build passes to load_inline (no compiler runs)."""
    calls = []
    monkeypatch.setattr(
        torch.utils.cpp_extension, "load_inline", lambda **kw: calls.append(kw) or object()
    )
    for module, name in [(ladder, "unavailable_reason"), (ladder, "hgemm_unavailable_reason"),
                         (fa_ws, "unavailable_reason"), (cluster_rows, "unavailable_reason")]:  # fmt: skip
        monkeypatch.setattr(module, name, lambda: None)
    monkeypatch.setattr(ladder, "arch_flags", lambda: ("-gencode=arch=compute_90,code=sm_90",))
    return calls


@pytest.mark.parametrize("ext", sorted(BUILDS))
def test_declarations_match_definitions(recorded, ext):
    BUILDS[ext]()
    assert len(recorded) == 1, ext
    kw = recorded[0]
    functions = kw["functions"] if isinstance(kw["functions"], list) else [kw["functions"]]
    declared = _flat(
        kw["cpp_sources"] if isinstance(kw["cpp_sources"], str) else " ".join(kw["cpp_sources"])
    )
    sources = _flat(
        kw["cuda_sources"] if isinstance(kw["cuda_sources"], str) else " ".join(kw["cuda_sources"])
    )
    for name in functions:
        decl = re.search(rf"\b{name}\(([^)]*)\) ?;", declared)
        assert decl, (ext, name, "not declared")
        defn = re.search(rf"\b{name}\(([^)]*)\) ?\{{", sources)
        assert defn, (ext, name, "not defined")
        assert defn.group(1).strip() == decl.group(1).strip(), (ext, name)
