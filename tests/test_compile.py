"""Every Triton kernel in kernels/ compiles ahead of time for Hopper (sm_90) and Turing (sm_75),
without a GPU. Kernels run in the interpreter elsewhere in the tests; this catches what only the real
compiler rejects (type errors in tl.dot, unsupported dtypes, shared-memory overflows).

Each kernel module lists ``COMPILE_SPECS`` (kernel, signature, constexprs); the test also fails when a
``@triton.jit`` function in a module has no spec, so a new kernel cannot slip past it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TARGETS = [("cuda", 90, 32), ("cuda", 75, 32)]
# A CPU check: on a GPU machine (make gpu-test) every kernel compiles and runs for real in the other
# tests, and this ahead-of-time pass would only add minutes of compiling.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU CI compiles ahead of time; a GPU runs them"
)

SCRIPT = r"""
import importlib, json, pkgutil, sys
import triton
from triton.backends.compiler import GPUTarget
import kernels

targets = json.loads(sys.argv[1])
report = {"uncovered": [], "compiled": [], "failed": []}
done = set()  # a package re-exports its modules' specs: compile each spec once
for info in pkgutil.walk_packages(kernels.__path__, "kernels."):
    mod = importlib.import_module(info.name)
    # Kernels are the @triton.jit functions named *_kernel (autotuned ones wrap theirs in .fn);
    # other jit functions are device helpers that compile as part of a kernel.
    jitted = {}
    for n, f in vars(mod).items():
        f = getattr(f, "fn", None) if isinstance(f, triton.runtime.Autotuner) else f
        if isinstance(f, triton.runtime.JITFunction) and n.endswith("_kernel"):
            jitted[n] = f
    specs = getattr(mod, "COMPILE_SPECS", [])
    covered = {id(s["kernel"]) for s in specs}
    report["uncovered"] += [f"{info.name}.{n}" for n, f in jitted.items() if id(f) not in covered]
    for spec in specs:
        if id(spec) in done:
            continue
        done.add(id(spec))
        sig = dict(spec["signature"])
        sig.update({k: "constexpr" for k in spec["constexprs"]})
        for backend, cc, warp in targets:
            if cc < spec.get("min_cc", 0):
                continue
            name = f"{info.name[len('kernels.'):]}.{spec['kernel'].fn.__name__}{list(spec['signature'].values())}@sm_{cc}"
            src = triton.compiler.ASTSource(fn=spec["kernel"], signature=sig, constexprs=spec["constexprs"])
            try:
                triton.compile(src, target=GPUTarget(backend, cc, warp), options=spec.get("options"))
                report["compiled"].append(name)
            except Exception as e:
                report["failed"].append(f"{name}: {type(e).__name__}: {str(e)[:400]}")
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    # TRITON_INTERPRET=0: real JIT functions even on a machine without a GPU.
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(TARGETS)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kernel_has_a_compile_spec(report):
    assert report["uncovered"] == []


def test_kernels_compile_for_sm90_and_sm75(report):
    assert report["failed"] == []
    # At least the vector add, the read probe and the matmuls, for both targets.
    assert sum("@sm_90" in c for c in report["compiled"]) >= 7
    assert sum("@sm_75" in c for c in report["compiled"]) >= 6
