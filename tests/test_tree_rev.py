"""scripts/tree_rev.sh, which names the code a dated GPU log ran on (scripts/gpu_test.sh and
scripts/run_forced_caps.sh put it in their headers)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tree_rev.sh"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(repo)}  # fmt: skip
    return subprocess.run(["git", *args], cwd=repo, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


def _rev(repo: Path, env: dict | None = None) -> str:
    script = str(repo / "scripts" / "tree_rev.sh")
    out = subprocess.run(["bash", script], check=True, capture_output=True, text=True, env=env)
    return out.stdout.strip()


def test_names_the_commit_and_says_when_the_tree_differs(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "tree_rev.sh")
    (tmp_path / "kernel.py").write_text("x = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-qm", "first")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert _rev(tmp_path) == head
    (tmp_path / "notes.txt").write_text("untracked files do not count\n")
    assert _rev(tmp_path) == head
    (tmp_path / "kernel.py").write_text("x = 2\n")  # the copy a GPU machine received, say
    assert _rev(tmp_path) == f"{head} + 1 changed tracked file(s)"


def test_outside_a_repository_it_says_so(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "tree_rev.sh")
    # GIT_CEILING_DIRECTORIES: git must not find a repository above tmp_path either.
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path.parent)}
    assert _rev(tmp_path, env) == "?"
