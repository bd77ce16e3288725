import os

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
