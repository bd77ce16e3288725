"""scripts/gpu/*.py run as the pages say, `python scripts/gpu/<name>.py` from a checkout, also where
the package was not installed with setup.md's `pip install -e .` (a fresh Colab or cloud machine):
each script that imports ``kernels`` puts the checkout first on ``sys.path`` before it does."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts" / "gpu").glob("*.py"))
INSERT = "sys.path.insert(0, str(Path(__file__).resolve().parents[2]))"


def _top_level_kernels_import(tree: ast.Module) -> int | None:
    """The line of the module's first top-level ``import kernels...`` / ``from kernels...``."""
    for node in tree.body:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        module = node.module if isinstance(node, ast.ImportFrom) else None
        if (module or "").split(".")[0] == "kernels" or any(
            n.split(".")[0] == "kernels" for n in names
        ):
            return node.lineno
    return None


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_gpu_script_finds_kernels_from_a_checkout(path):
    text = path.read_text(encoding="utf-8")
    line = _top_level_kernels_import(ast.parse(text))
    if line is None:
        pytest.skip("imports no kernels module at the top")
    before = "\n".join(text.splitlines()[: line - 1])
    assert re.search(rf"^{re.escape(INSERT)}", before, re.M), (
        f"{path.name}: add `{INSERT}` before its first kernels import"
    )
