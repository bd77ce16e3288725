"""scripts/gpu/profile_misses.{py,sh}: the evidence behind the "why it misses" sections of the MLA,
grouped-GEMM and Hopper pages (results/profiles/). The GPU run is a lent machine's; here each topic
runs in its CPU smoke mode, the shell script parses, and the Nsight Compute summary reads a raw
page with the columns it names."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu" / "profile_misses.py"
_spec = importlib.util.spec_from_file_location("profile_misses", SCRIPT)
profile_misses = importlib.util.module_from_spec(_spec)
sys.modules["profile_misses"] = profile_misses
_spec.loader.exec_module(profile_misses)


@pytest.mark.parametrize(
    "topic, expected",
    [
        ("mla", ["fixed cost per call", "fixed cost per DSA decode step"]),
        ("moe", ["partial tiles:", "large groups:", "permute at"]),
        ("hgemm", ["hgemm skipped: smoke mode"]),  # no nvcc build on a CPU: the plumbing only
        (
            "fa",
            [
                "would profile: ",
                "fwd-course-64",
                "bwd-course-two_kernels-64",
                "bwd-course-atomic_dq",
            ],
        ),
    ],
)
def test_each_topic_runs_in_smoke_mode(topic, expected):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), topic, "--smoke"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    for text in expected:
        assert text in run.stdout, (text, run.stdout[-2000:])


def test_shell_script_parses():
    sh = ROOT / "scripts" / "gpu" / "profile_misses.sh"
    assert subprocess.run(["bash", "-n", str(sh)], capture_output=True).returncode == 0


def test_summary_reads_a_raw_page(tmp_path, capsys):
    pick = profile_misses._PICK
    cols = ["ID", "Kernel Name", "Grid Size", "Block Size", "NVTX Push/Pop Stack"]
    cols += [pick[k][0] for k in ("us", "dram", "read", "l2", "regs", "local_ld")]
    cols += ["smsp__average_warp_issue_stalled_barrier_per_issue_active.ratio"]
    cols += ["smsp__average_warp_issue_stalled_long_scoreboard_per_issue_active.ratio"]
    units = ["", "", "", "", "", "usecond", "%", "Mbyte", "%", "register/thread", "byte", "", ""]
    row = ["0", "_mla_decode_kernel", "(256, 3, 1)", "(256, 1, 1)", "<0,case:mla-b128-32k>"]
    row += ["11,844.7", "12.5", "4,889.4", "11.8", "210", "0", "2.13", "1.32"]
    csv = [",".join(f'"{c}"' for c in line) for line in (cols, units, row)]
    path = tmp_path / "raw.csv"
    path.write_text("==PROF== noise before the header\n" + "\n".join(csv) + "\n")
    profile_misses.summarize(path)
    out = capsys.readouterr().out
    assert "mla-b128-32k" in out and "_mla_decode_kernel" in out
    assert "11,844.7 us" in out and "DRAM 12.5%" in out and "read 4,889.4 MB" in out
    assert "210 registers/thread" in out and "barrier 2.13, long_scoreboard 1.32" in out
