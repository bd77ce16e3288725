import os
import re
from pathlib import Path

import pytest
import torch

from kernels import device


def test_mode_is_consistent():
    cap = device.capabilities()
    if device.GPU_MODE:
        assert cap.sm_count > 0 and cap.n_gpus >= 1 and cap.compute_capability
    else:
        # Without a GPU the package must have switched Triton to its interpreter.
        assert os.environ.get("TRITON_INTERPRET") == "1" and device.INTERPRET
        assert not (cap.bf16 or cap.fp8 or cap.tensor_cores or cap.tma)
        assert cap.mode == "CPU interpreter"


def test_describe_names_device_versions_and_mode():
    text = device.describe()
    assert "device" in text and "torch" in text and "triton" in text
    assert ("GPU" in text) if device.GPU_MODE else ("NOT GPU numbers" in text)


def test_pick():
    assert device.pick("big", "small") == ("big" if device.GPU_MODE else "small")


def test_capabilities_are_cached():
    # Launchers ask on every call: the second answer must come from the cache, not the driver.
    assert device.capabilities() is device.capabilities()


def _h100_like() -> device.Capabilities:
    return device.Capabilities(
        name="NVIDIA H100 80GB HBM3", vendor="NVIDIA", compute_capability=(9, 0), sm_count=132,
        l2_bytes=50 * 2**20, memory_bytes=80 * 2**30, n_gpus=1,
        bf16=True, fp8=True, tensor_cores=True, tma=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    "spec, off",
    [
        (None, set()),
        ("", set()),
        (" , ", set()),
        ("no-bf16", {"bf16"}),
        ("no-bf16,no-tma,no-fp8", {"bf16", "tma", "fp8"}),
        (" NO-TMA , no-fp8 ", {"tma", "fp8"}),
        ("t4", {"bf16", "tma", "fp8"}),
        ("t4,no-tensor-cores", {"bf16", "tma", "fp8", "tensor_cores"}),
    ],
)
def test_parse_forced(spec, off):
    assert device.parse_forced(spec) == off


@pytest.mark.parametrize("spec", ["no-bf17", "bf16", "no-bf16;no-tma", "no-bf16,yes-tma", "t5"])
def test_parse_forced_rejects_unknown_flags(spec):
    with pytest.raises(ValueError, match="GPU_BRRR_FORCE_CAPS: unknown flag .*accepted: no-bf16"):
        device.parse_forced(spec)


def test_forcing_turns_off_only_the_named_features(monkeypatch):
    # The effect on a GPU's answer, without a GPU: capabilities() forces what _query() reports.
    monkeypatch.setattr(device, "_query", _h100_like)
    monkeypatch.setenv(device.FORCE_CAPS_ENV, "no-bf16,no-tma,no-fp8")
    device.capabilities.cache_clear()
    try:
        cap = device.capabilities()
        assert (cap.bf16, cap.tma, cap.fp8) == (False, False, False)
        # What the forcing does not name is the device's own answer (a T4 has tensor cores).
        assert cap.tensor_cores and cap.name == "NVIDIA H100 80GB HBM3"
        assert cap.compute_capability == (9, 0) and cap.sm_count == 132
        assert device.forced_off() == {"bf16", "tma", "fp8"}
        monkeypatch.setenv(device.FORCE_CAPS_ENV, "")
        device.capabilities.cache_clear()
        assert device.capabilities() == _h100_like()
    finally:
        device.capabilities.cache_clear()


def test_forced_bf16_makes_preferred_dtype_fall_back(monkeypatch, capsys):
    monkeypatch.setattr(device, "_query", _h100_like)
    monkeypatch.setattr(device, "GPU_MODE", True)
    monkeypatch.setenv(device.FORCE_CAPS_ENV, "t4")
    device.capabilities.cache_clear()
    try:
        assert device.preferred_dtype(torch.bfloat16) is torch.float16
        assert "no bf16" in capsys.readouterr().out
        assert device.preferred_dtype(torch.float32) is torch.float32
        monkeypatch.delenv(device.FORCE_CAPS_ENV)
        device.capabilities.cache_clear()
        assert device.preferred_dtype(torch.bfloat16) is torch.bfloat16
    finally:
        device.capabilities.cache_clear()


def test_describe_says_what_is_forced(monkeypatch):
    monkeypatch.setenv(device.FORCE_CAPS_ENV, "no-fp8")
    assert "forced : GPU_BRRR_FORCE_CAPS reports fp8 as absent" in device.describe()
    monkeypatch.setenv(device.FORCE_CAPS_ENV, "no-fp9")
    with pytest.raises(ValueError, match="no-fp9"):
        device.describe()
    monkeypatch.delenv(device.FORCE_CAPS_ENV)
    assert "forced" not in device.describe()


def test_kernels_honour_forced_flags(monkeypatch):
    """The code paths that read the hardware take the T4 branch when the flags are forced off:
    the bf16 PTX unpacking of the quantized GEMV and the persistent TMA matmul."""
    import types

    from kernels import matmul
    from kernels.quant import qgemv

    monkeypatch.setattr(device, "_query", _h100_like)
    monkeypatch.setattr(device, "GPU_MODE", True)
    hopper = types.SimpleNamespace(major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: hopper)
    monkeypatch.setattr(torch.version, "hip", None)

    def answers(spec):
        monkeypatch.setenv(device.FORCE_CAPS_ENV, spec)
        device.capabilities.cache_clear()
        qgemv._use_asm.cache_clear()
        monkeypatch.setattr(matmul, "_TMA_CAPABLE", {})
        return qgemv._use_asm(torch.bfloat16), qgemv._use_asm(torch.float16), matmul._tma_capable(0)

    try:
        assert answers("") == (True, True, True)
        assert answers("t4") == (False, True, False)
        assert answers("no-tma") == (True, True, False)
    finally:
        device.capabilities.cache_clear()
        qgemv._use_asm.cache_clear()


T4_FLAGS = "GPU_BRRR_FORCE_CAPS=no-bf16,no-tma,no-fp8"
RESULT_LINE = re.compile(r"^#\s+(\d\d[a-z]-[\w-]+)\s+(passed|FAILED)\s", re.M)


def forced_caps_results(logs) -> dict[str, str]:
    """Each notebook's newest result over the T4 rehearsal logs (``scripts/run_forced_caps.sh``),
    oldest log first: a later run that re-ran a few notebooks after a fix overrides their results."""
    last = {}
    for log in sorted(
        logs, key=lambda p: re.sub(r"-forced-caps(?=\.log)", "-forced-caps-0000", p.name)
    ):
        text = log.read_text()
        if T4_FLAGS in text:  # runs with other flags rehearse other GPUs
            last.update(RESULT_LINE.findall(text))
    return last


def test_forced_caps_logs_pass_every_notebook():
    # Issue 20's rehearsal of a T4 (make gpu-forced-caps), kept as logs: every notebook of the book
    # passes on its fallbacks in its newest run. A new notebook needs a run of its own.
    root = Path(__file__).resolve().parent.parent
    logs = list((root / "results" / "gpu-test").glob("*-forced-caps*.log"))
    assert logs, "no forced-caps log in results/gpu-test/: run make gpu-forced-caps on a GPU"
    last = forced_caps_results(logs)
    notebooks = {p.stem for p in (root / "notebooks").glob("*.ipynb")}
    assert notebooks <= set(last), f"never rehearsed: {sorted(notebooks - set(last))}"
    assert all(last[n] == "passed" for n in notebooks), {n: last[n] for n in notebooks}


def test_forced_caps_results_take_each_notebooks_newest_run(tmp_path):
    head = f"# {T4_FLAGS}, 1 GPU(s)\n"
    (tmp_path / "2026-01-01-g-forced-caps-0900.log").write_text(
        head + "#   01a-x   passed   3\n#   07b-y   FAILED   -\n"
    )
    (tmp_path / "2026-01-01-g-forced-caps-1000.log").write_text(head + "#   07b-y   passed   5\n")
    (tmp_path / "2026-01-02-g-forced-caps-0800.log").write_text(
        "# GPU_BRRR_FORCE_CAPS=no-tma\n#   01a-x   FAILED   -\n"  # other flags: not counted
    )
    assert forced_caps_results(list(tmp_path.iterdir())) == {"01a-x": "passed", "07b-y": "passed"}
