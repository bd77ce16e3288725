"""scripts/run_gpu_notebooks.py's parallel runner (``--parallel``, ``--passes``): which notebook gets
which GPUs, in what order, and that no GPU ever runs two notebooks at once. No GPU needed: the
launcher is a stand-in that records what it was given."""

import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "run_gpu_notebooks", ROOT / "scripts" / "run_gpu_notebooks.py"
)
rgn = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = rgn  # dataclasses look their module up there
_spec.loader.exec_module(rgn)


class Recorder:
    """A launcher that holds its GPUs for ``hold`` seconds and checks none is held twice."""

    def __init__(self, hold=0.02, fail=()):
        self.hold, self.fail = hold, set(fail)
        self.busy, self.order, self.given, self.clash = set(), [], {}, []
        self.lock = threading.Lock()

    def __call__(self, job, gpus):
        with self.lock:
            if self.busy & set(gpus):
                self.clash.append((job.path.name, gpus))
            self.busy |= set(gpus)
            self.order.append(job.path.name)
            self.given[job.path.name] = list(gpus)
        time.sleep(self.hold)
        with self.lock:
            self.busy -= set(gpus)
        if job.path.name in self.fail:
            raise RuntimeError("kernel died")
        return True


def _jobs(*specs):
    return [rgn.Job(Path(name), gpus, seconds) for name, gpus, seconds in specs]


def test_no_gpu_runs_two_notebooks_and_every_notebook_runs():
    jobs = _jobs(*[(f"nb{i:02d}", 1, 10 + i) for i in range(12)], ("multi", 2, 5))
    rec = Recorder()
    passed = rgn.run_parallel(jobs, ["0", "1", "2"], rec, stagger=0)
    assert rec.clash == []
    assert set(passed) == {j.path for j in jobs} and all(passed.values())
    assert sorted(rec.order) == sorted(j.path.name for j in jobs)


def test_multi_gpu_notebooks_first_then_the_longest():
    jobs = _jobs(("short", 1, 5), ("long", 1, 200), ("scaling", 8, 90), ("pair", 2, 30))
    rec = Recorder()
    rgn.run_parallel(jobs, ["0", "1", "2", "3"], rec, stagger=0)
    assert rec.order[:2] == ["scaling", "pair"]
    assert rec.given["scaling"] == ["0", "1", "2", "3"]  # eight asked, four there
    assert len(rec.given["pair"]) == 2
    assert rec.order.index("long") < rec.order.index("short")


def test_a_notebook_that_fails_is_reported_and_the_rest_still_run():
    jobs = _jobs(("a", 1, 3), ("b", 1, 2), ("c", 1, 1))
    passed = rgn.run_parallel(jobs, ["0", "1"], Recorder(fail={"b"}), stagger=0)
    assert passed == {Path("a"): True, Path("b"): False, Path("c"): True}


def test_one_slot_runs_them_one_after_another():
    jobs = _jobs(("a", 1, 3), ("b", 2, 2), ("c", 1, 1))
    rec = Recorder()
    rgn.run_parallel(jobs, ["0,1"], rec, stagger=0)
    assert rec.clash == [] and all(g == ["0,1"] for g in rec.given.values())


def test_no_gpus_is_an_error():
    with pytest.raises(ValueError, match="gpus"):
        rgn.run_parallel(_jobs(("a", 1, 1)), [], Recorder())


def test_job_reads_the_gpu_count_and_the_last_run_time(tmp_path):
    def cell(start, end):
        run = {"iopub.execute_input": start, "shell.execute_reply": end}
        return {"cell_type": "code", "metadata": {"execution": run}, "source": "", "outputs": []}

    nb = {
        "metadata": {"gpu_brrr": {"gpus": 2}},
        "cells": [
            cell("2026-12-06T06:00:00.000Z", "2026-12-06T06:00:10.000Z"),
            cell("2026-12-06T06:00:10.500Z", "2026-12-06T06:01:40.000Z"),
        ],
    }
    path = tmp_path / "05x.ipynb"
    path.write_text(json.dumps(nb))
    job = rgn.job_for(path)
    assert job.gpus == 2 and job.seconds == pytest.approx(100.0)
    path.write_text(json.dumps({"metadata": {}, "cells": []}))
    assert rgn.job_for(path) == rgn.Job(path, 1, 60.0)


def test_the_multi_gpu_labs_say_how_many_gpus_they_use():
    """Act 5's labs time NCCL over several GPUs: ``--parallel`` must give them more than one."""
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        job = rgn.job_for(path)
        needs = json.loads(path.read_text())["cells"][0]["source"]
        text = "".join(needs)
        assert (job.gpus > 1) == ("CUDA GPUs" in text), (path.name, job.gpus)
        assert job.seconds > 0


def test_passes_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        rgn.main(["--passes", "0"])
    assert "--passes must be at least 1" in capsys.readouterr().err


def test_the_launcher_runs_this_script_on_one_notebook_with_its_gpus(tmp_path, capsys):
    """The child process gets the notebook, its GPUs and a log of its own. Here (no GPU, or a GPU
    id that does not exist) it must refuse, and the runner must count that as a failure."""
    path = ROOT / "notebooks" / "01a-gpu-hierarchy.ipynb"
    launch = rgn.subprocess_launcher(60, tmp_path / "out", tmp_path)
    passed = rgn.run_parallel([rgn.Job(path)], ["no-such-gpu"], launch, stagger=0)
    assert passed == {path: False}
    log = (tmp_path / "01a-gpu-hierarchy.log").read_text()
    assert "no CUDA device" in log
    assert "01a-gpu-hierarchy.ipynb" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()  # nothing executed, nothing written
