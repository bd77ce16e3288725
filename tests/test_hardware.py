import re
from pathlib import Path

import pytest

from kernels import hardware

ROOT = Path(__file__).resolve().parents[1]


def bib_keys() -> set[str]:
    text = (ROOT / "references.bib").read_text()
    return set(re.findall(r"@\w+\s*\{\s*([^,\s]+)\s*,", text))


def test_at_least_ten_gpus_from_several_generations():
    specs = hardware.load()
    assert len(specs) >= 10
    assert len({s.architecture for s in specs.values()}) >= 5
    assert {"NVIDIA", "AMD"} <= {s.vendor for s in specs.values()}


def test_every_figure_names_a_source_in_the_bibliography():
    keys = bib_keys()
    missing = [
        f"{s.key}.{fig} -> {src}"
        for s in hardware.load().values()
        for fig, (_, src) in s.figures.items()
        if src not in keys
    ]
    assert missing == []


def test_core_figures_present_and_plausible():
    for s in hardware.load().values():
        assert 100 <= s.get("mem_bw_gbps") <= 20_000, s.key
        assert 8 <= s.get("memory_gb") <= 300, s.key
        assert s.get("tflops_float32") > 1, s.key
        # Matrix units beat plain FP32 on every GPU in the table.
        half = s.get("tflops_bfloat16") or s.get("tflops_float16")
        assert half > s.get("tflops_float32"), s.key


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM"),
        ("NVIDIA H100 PCIe", "H100-PCIe"),
        ("Tesla T4", "T4"),
        ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"),
        ("NVIDIA A10G", None),  # not an A10: different SM count and clocks
        ("NVIDIA L40S", None),  # not an L4
        ("CPU (x86_64)", None),
    ],
)
def test_lookup(name, key):
    spec = hardware.lookup(name)
    assert (spec.key if spec else None) == key


def test_ridge_point_h100():
    # 989.4 TFLOP/s over 3.35 TB/s: about 295 FLOP/byte.
    assert hardware.load()["H100-SXM"].ridge_point("bfloat16") == pytest.approx(295.3, rel=1e-3)


def test_unknown_figure_rejected():
    with pytest.raises(KeyError):
        hardware.load()["T4"].get("tflops_bf16")
