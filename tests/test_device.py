import os

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


def test_newest_forced_caps_log_passes_every_notebook():
    # Issue 20's rehearsal of a T4 (make gpu-forced-caps) is kept as a log: its newest one must show
    # every notebook of the book passing on its fallbacks (the last result of each, when one was
    # re-run after a fix). A new notebook needs a new run.
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    logs = sorted((root / "results" / "gpu-test").glob("*-forced-caps.log"))
    assert logs, "no forced-caps log in results/gpu-test/: run make gpu-forced-caps on a GPU"
    text = logs[-1].read_text()
    assert "GPU_BRRR_FORCE_CAPS=no-bf16,no-tma,no-fp8" in text
    last = {}
    for name, result in re.findall(r"^#\s+(\d\d[a-z]-[\w-]+)\s+(passed|FAILED)\s", text, re.M):
        last[name] = result
    notebooks = {p.stem for p in (root / "notebooks").glob("*.ipynb")}
    assert notebooks <= set(last), f"not in {logs[-1].name}: {sorted(notebooks - set(last))}"
    assert all(last[n] == "passed" for n in notebooks), {n: last[n] for n in notebooks}
