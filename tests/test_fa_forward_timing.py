"""scripts/gpu/fa_forward_timing.py, the timing table the two FlashAttention forward probes share:
run on the CPU with stand-in implementations whose speeds are known (one sleeps), so the goal check,
the ratios and the records can be checked without a GPU."""

import time

import pytest
from conftest import load_script

from kernels import device

timing = load_script("scripts/gpu/fa_forward_timing.py")


# The stand-ins are slow on the host (a sleep); on a GPU the timing reads CUDA events, which a
# sleep between them need not move: the checks are the CPU's.
pytestmark = pytest.mark.skipif(device.GPU_MODE, reason="stand-ins timed on the CPU only")


def fast(q, k, v, causal):
    return q


def slow(q, k, v, causal):
    time.sleep(2e-3)
    return q


def test_forward_timings_checks_the_goal_and_baselines_the_kernel(tmp_path, capsys):
    fns = {"kernel": fast, "sdpa-cudnn": slow, "course": slow}
    ratios = [("k/cudnn", "kernel", "sdpa-cudnn"), ("k/course", "kernel", "course")]
    out = tmp_path / "r.jsonl"
    rows = timing.forward_timings(fns, ratios, "probe", lambda n: n == "kernel", str(out),
                                  seqs=[4096], heads=1, note=lambda: "tile")  # fmt: skip
    text = capsys.readouterr().out
    assert "MET at every N >= 4096" in text and text.count("  tile") == 2
    assert len(rows) == 6 and len(out.read_text().splitlines()) == 6
    assert [r["variant"] for r in rows[:3]] == ["kernel-fwd", "sdpa-cudnn-fwd", "course-fwd"]
    kernel = [r for r in rows if r["variant"].startswith("kernel")]
    assert all(r["baseline"] == "sdpa-cudnn" and r["speedup"] > 1 for r in kernel)
    assert all(r["baseline"] is None for r in rows if not r["variant"].startswith("kernel"))


def test_forward_timings_reports_a_missed_goal(capsys):
    fns = {"kernel": slow, "sdpa-cudnn": fast}
    timing.forward_timings(fns, [("k/cudnn", "kernel", "sdpa-cudnn")], "probe",
                           lambda n: n == "kernel", seqs=[4096], heads=1)  # fmt: skip
    assert "MISSED at N=4096 causal=False" in capsys.readouterr().out
