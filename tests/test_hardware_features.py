"""hardware.yaml's matrix formats and features: sourced, consistent with compute capability, and
consistent with what kernels.device reads off a real GPU."""

import re
from dataclasses import replace
from pathlib import Path

import pytest

from kernels import device, hardware

ROOT = Path(__file__).resolve().parents[1]
SPECS = hardware.load()


def bib_keys() -> set[str]:
    return set(re.findall(r"@\w+\s*\{\s*([^,\s]+)\s*,", (ROOT / "references.bib").read_text()))


def test_every_format_and_feature_names_a_source():
    keys = bib_keys()
    missing = [
        f"{s.key}.{name} -> {src}"
        for s in SPECS.values()
        for name, src in {**s.matrix_formats, **s.features}.items()
        if src not in keys
    ]
    assert missing == []


def test_every_gpu_lists_formats_and_features():
    for s in SPECS.values():
        assert s.matrix_formats and s.features, s.key
        # every GPU's matrix units take a 16-bit float; the table's tflops agree with its formats
        assert s.supports("fp16"), s.key
        for fmt, fig in [("fp8", "tflops_fp8"), ("fp4", "tflops_fp4"), ("tf32", "tflops_tf32")]:
            if s.get(fig) is not None:
                assert s.supports(fmt), f"{s.key}: {fig} given but {fmt} not listed"


def _cc(s):
    return tuple(int(p) for p in s.compute_capability.split("."))


@pytest.mark.parametrize("spec", [s for s in SPECS.values() if s.vendor == "NVIDIA"], ids=str)
def test_nvidia_features_follow_compute_capability(spec):
    cc = _cc(spec)
    assert spec.has("warp_mma") == (cc >= (7, 0))
    assert spec.has("cp_async") == (cc >= (8, 0))
    assert spec.has("tma") == spec.has("clusters") == (cc >= (9, 0))
    assert spec.has("wgmma") == (cc == (9, 0))  # sm_90a only: Blackwell replaced it
    assert spec.has("tcgen05") == spec.has("tmem") == (cc >= (10, 0))
    assert spec.supports("fp8") == (cc >= (8, 9))  # the rule kernels.device uses
    assert spec.supports("fp4") == (cc >= (10, 0))
    assert not spec.has("mfma")


def test_known_generations():
    assert set(SPECS["V100-SXM2"].matrix_formats) == {"fp16"}
    h100 = SPECS["H100-SXM"]
    assert h100.supports("fp8") and not h100.supports("int4") and not h100.supports("fp4")
    b200 = SPECS["B200"]
    assert b200.supports("fp4") and b200.supports("fp6") and b200.has("block_scaling")
    assert not b200.has("wgmma")
    mi = SPECS["MI300X"]
    assert mi.has("mfma") and mi.supports("fp32") and not mi.has("tma")


def test_unknown_names_rejected():
    with pytest.raises(KeyError, match="unknown matrix format"):
        SPECS["T4"].supports("fp12")
    with pytest.raises(KeyError, match="unknown feature"):
        SPECS["T4"].has("warp_specialization")


def test_load_rejects_unknown_format(tmp_path, monkeypatch):
    bad = tmp_path / "hw.yaml"
    bad.write_text(
        "X:\n  vendor: NVIDIA\n  architecture: Y\n  year: 2020\n  match: [X]\n"
        "  figures: {}\n  matrix_formats: {fp12: somekey}\n"
    )
    monkeypatch.setattr(hardware, "HARDWARE_YAML", bad)
    hardware.load.cache_clear()
    try:
        with pytest.raises(ValueError, match="unknown matrix formats"):
            hardware.load()
    finally:
        monkeypatch.undo()
        hardware.load.cache_clear()


def test_support_table():
    table = hardware.support_table("formats", ["V100-SXM2", "B200"])
    lines = table.splitlines()
    assert lines[0].startswith("| format | V100-SXM2 (2017) | B200 (2024) | sources |")
    fp4 = next(line for line in lines if line.startswith("| fp4 |"))
    assert fp4.split("|")[2].strip() == "" and fp4.split("|")[3].strip() == "✓"
    assert not any(line.startswith("| int4 |") for line in lines)  # neither GPU has it
    feats = hardware.support_table("features")
    assert "`tcgen05`" in feats and "`mfma`" in feats
    with pytest.raises(ValueError, match="kind must"):
        hardware.support_table("dtypes")
    with pytest.raises(KeyError, match="not in hardware.yaml"):
        hardware.support_table("formats", ["H900"])


def _caps(**kw):
    base = device.Capabilities(
        name="NVIDIA H100 80GB HBM3",
        vendor="NVIDIA",
        compute_capability=(9, 0),
        sm_count=132,
        l2_bytes=50 * 2**20,
        memory_bytes=80 * 2**30,
        n_gpus=1,
        bf16=True,
        fp8=True,
        tensor_cores=True,
        tma=True,
    )
    return replace(base, **kw)


def test_check_against_device():
    assert hardware.check_against_device(SPECS["H100-SXM"], _caps()) == []
    problems = hardware.check_against_device(SPECS["H100-SXM"], _caps(tma=False))
    assert len(problems) == 1 and problems[0].startswith("tma")
    a100 = _caps(compute_capability=(8, 0), fp8=False, tma=False)
    assert hardware.check_against_device(SPECS["A100-SXM4-80GB"], a100) == []


def test_check_against_device_leaves_forced_flags_out(capsys):
    t4_flags = _caps(fp8=False, tma=False, bf16=False)  # an H100 with GPU_BRRR_FORCE_CAPS=t4
    assert len(hardware.check_against_device(SPECS["H100-SXM"], t4_flags, frozenset())) == 2
    forced = frozenset({"fp8", "tma", "bf16"})
    assert hardware.check_against_device(SPECS["H100-SXM"], t4_flags, forced) == []
    assert "fp8, tma forced off" in capsys.readouterr().out
    # A flag that is not forced is still compared.
    no_tc = _caps(fp8=False, tma=False, tensor_cores=False)
    problems = hardware.check_against_device(SPECS["H100-SXM"], no_tc, forced)
    assert len(problems) == 1 and problems[0].startswith("tensor_cores")


@pytest.mark.gpu
@pytest.mark.skipif(not device.GPU_MODE, reason="needs a GPU")
def test_this_gpu_agrees_with_the_table():
    spec = hardware.for_device()
    if spec is None:
        pytest.skip("this GPU is not in hardware.yaml")
    assert hardware.check_against_device(spec, device.capabilities()) == []


def test_support_table_cites_and_chapter_copy_is_current():
    short = ["V100-SXM2", "A100-SXM4-80GB", "H100-SXM", "B200", "MI300X"]
    cited = hardware.support_table("features", short, cite=True)
    assert "{cite:p}`tran2025tcgen05`" in cited
    # The Act 1.5 chapter pastes both short tables; regenerate them there when the YAML changes.
    path = ROOT / "acts" / "act1-5-moving-target.md"
    if not path.exists():
        pytest.skip("the Act 1.5 chapter is parked until its GPU run")
    chapter = path.read_text(encoding="utf-8")
    for kind in ("formats", "features"):
        assert hardware.support_table(kind, short, cite=True) in chapter, kind
