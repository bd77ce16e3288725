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
shard, n_shards = int(sys.argv[2]), int(sys.argv[3])  # this process compiles every n-th job
report = {"uncovered": [], "compiled": [], "failed": []}
done = set()  # a package re-exports its modules' specs: compile each spec once
job = -1
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
            job += 1
            if job % n_shards != shard:
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


# Compiling is CPU-bound and every kernel is independent: one process per core (at most 4) takes
# every n-th (kernel, target) job, which halves this test's minutes on a two-core CI machine.
SHARDS = max(1, min(4, os.cpu_count() or 1))


@pytest.fixture(scope="module")
def report():
    # TRITON_INTERPRET=0: real JIT functions even on a machine without a GPU.
    env = dict(os.environ, TRITON_INTERPRET="0")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, json.dumps(TARGETS), str(i), str(SHARDS)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(SHARDS)
    ]
    merged = {"uncovered": [], "compiled": [], "failed": []}
    for i, proc in enumerate(procs):
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        part = json.loads(out.strip().splitlines()[-1])
        merged["compiled"] += part["compiled"]
        merged["failed"] += part["failed"]
        if i == 0:  # every shard walks every module: the uncovered list is the same in each
            merged["uncovered"] = part["uncovered"]
    return merged


def test_every_kernel_has_a_compile_spec(report):
    assert report["uncovered"] == []


def test_kernels_compile_for_sm90_and_sm75(report):
    assert report["failed"] == []
    # At least the vector add, the read probe and the matmuls, for both targets.
    assert sum("@sm_90" in c for c in report["compiled"]) >= 7
    assert sum("@sm_75" in c for c in report["compiled"]) >= 6
