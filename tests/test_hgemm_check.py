"""kernels.cuda.hgemm_check: the parsers of ptxas, cuobjdump and Nsight Compute output on real
text, the error bound, and the child-process machinery that keeps a hanging or crashing step from
taking the caller down (the compile itself is tested in test_hgemm.py)."""

import pytest
import torch

from kernels import device
from kernels.cuda import hgemm_check as check

PTXAS_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z23hgemm_persistent_kernel14CUtensorMap_stS_S_iii' for 'sm_90a'
ptxas info    : Function properties for _Z23hgemm_persistent_kernel14CUtensorMap_stS_S_iii
    0 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers
ptxas info    : Compile time = 129.425 ms
"""

SASS = """
	code for sm_90a
		Function : _Z23hgemm_persistent_kernel14CUtensorMap_stS_S_iii
        /*03e0*/                   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe8 ;
        /*1cc0*/                   @!UP0 UTMASTG.2D [UR16], [UR6] ;
        /*2dd0*/                   UTMALDG.2D [UR16], [UR6] ;
        /*2eb0*/                   UTMALDG.2D.MULTICAST [UR16], [UR6], UR4 ;
        /*2f00*/                   HGMMA.64x256x16.F32.BF16 R24, gdesc[UR12], R24 ;
        /*2fa0*/                   UCGABAR_ARV ;
		Function : _Z16hgemm_tma_kernel14CUtensorMap_S_P13__nv_bfloat16iii
        /*0100*/                   STL [R1], R2 ;
        /*0200*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24 ;
"""


def test_parse_ptxas():
    assert check.parse_ptxas(PTXAS_LOG) == {
        "registers": 168,
        "barriers": 16,
        "spill_stores": 8,
        "spill_loads": 4,
    }
    assert check.parse_ptxas("nvcc fatal") == dict.fromkeys(
        ("registers", "barriers", "spill_stores", "spill_loads")
    )


def test_sass_counts_and_what_is_missing():
    kernels = check.sass_by_kernel(SASS)
    assert list(kernels) == ["hgemm_persistent_kernel", "hgemm_tma_kernel"]
    step12 = check.count_ops(kernels["hgemm_persistent_kernel"], check.SASS_OPS)
    # MULTICAST is a whole word inside UTMALDG.2D.MULTICAST; both loads count as UTMALDG.
    assert (step12["UTMALDG"], step12["MULTICAST"], step12["UTMASTG"], step12["HGMMA"]) == (
        2,
        1,
        1,
        1,
    )
    assert check.missing_sass("hgemm_persistent_kernel", step12) == []
    step10 = check.count_ops(kernels["hgemm_tma_kernel"], check.SASS_OPS)
    assert check.missing_sass("hgemm_tma_kernel", step10) == ["UTMALDG", "STL"]


def test_ptx_ops_tell_loads_stores_and_multicast_apart():
    ptx = """
    cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%r1], [%rd1, {%r2, %r3}], [%r4];
    cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster [%r5], [%rd2, {%r2, %r6}], [%r4], %rs1;
    cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%rd3, {%r7, %r8}], [%r9];
    setmaxnreg.dec.sync.aligned.u32 40;
    wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {%f1}, %rd9, %rd10, p, 1, 1, 0, 0;
    """
    got = check.count_ops(ptx, check.PTX_OPS)
    assert got["TMA load"] == 2 and got["TMA store"] == 1 and got["multicast"] == 1
    assert got["setmaxnreg"] == 1 and got["wgmma"] == 1 and got["cp.async 16B"] == 0


def test_bound_ratio_and_bad_blocks():
    torch.manual_seed(0)
    ref = torch.randn(300, 260) * 10
    ratio, rel = check.bound_ratio(ref.to(torch.bfloat16), ref)
    assert ratio <= 1 and rel < 1e-2
    wrong = ref.clone()
    wrong[130:140, 200:210] += 5  # one spot in block (1, 1)
    ratio, _ = check.bound_ratio(wrong.to(torch.bfloat16), ref)
    assert ratio > 1
    assert check.bad_blocks(wrong.to(torch.bfloat16), ref) == [[1, 1]]
    wrong[0, 0] = float("nan")
    assert check.bound_ratio(wrong, ref) == (float("inf"), float("inf"))
    assert check.bad_blocks(wrong, ref) == [[0, 0], [1, 1]]


def test_ncu_metric_selection_and_parsing():
    names = [
        "sm__pipe_tensor_op_gmma_cycles_active",
        "sm__pipe_fma_cycles_active",
        "smsp__average_warps_issue_stalled_barrier_per_issue_active",
        "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active",
    ]
    raw = check.ncu_raw_metrics(names)
    assert raw == {
        "tensor tensor_op_gmma": "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
        "stall barrier": "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
        "stall long_scoreboard": (
            "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"
        ),
    }
    head = '"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
    rows = [
        ("GPU Speed Of Light Throughput", "Duration", "us", "1,234.5"),
        ("Command line profiler metrics", raw["tensor tensor_op_gmma"], "%", "71.2"),
        ("Command line profiler metrics", raw["stall barrier"], "", "0.40"),
        ("Command line profiler metrics", raw["stall long_scoreboard"], "", "1.25"),
    ]
    text = "==PROF== noise\n" + head
    text += "".join(f'"0","hgemm_x","{s}","{n}","{u}","{v}"\n' for s, n, u, v in rows)
    got = check.parse_ncu(text, raw)
    assert got["rows"] == {"Duration": "1,234.5 us"}
    assert got["tensor"] == {"tensor_op_gmma": 71.2}
    assert list(got["stalls"].items()) == [("long_scoreboard", 1.25), ("barrier", 0.4)]
    assert check.parse_ncu("no table", raw) == {"rows": {}, "tensor": {}, "stalls": {}}


def test_a_child_that_hangs_or_fails_becomes_a_result():
    # A timeout is what a wrong barrier phase looks like from the parent.
    res = check._run_child(["--check", "9"], timeout=0.01)
    assert res["ok"] is False and "timed out" in res["error"]
    if device.GPU_MODE:
        pytest.skip("on a GPU the child would run for real")
    # Without a GPU the child raises hgemm's "needs" error: exit 1, reported, not raised.
    res = check.run_check(9, timeout=120)
    assert res["step"] == 9 and res["ok"] is False
    assert "needs" in res["error"] and "exit 1" in res["error"]


def test_compile_reason_and_bad_step(monkeypatch):
    monkeypatch.setattr(check, "find_tool", lambda name: None)
    assert "nvcc" in check.compile_unavailable_reason()
    with pytest.raises(RuntimeError, match="nvcc"):
        check.compile_step(9, "/nonexistent")
    monkeypatch.setattr(check, "find_tool", lambda name: "/bin/true")
    with pytest.raises(ValueError, match="step"):
        check.compile_step(8, "/nonexistent")


def test_loop_mixes_counts_the_bodies_of_mma_loops():
    # A synthetic SASS listing: a loop with an HGMMA (0x10-0x40), one without (0x50-0x60), and a
    # forward branch; only the first is counted, opcodes without their modifiers.
    sass = "\n".join(
        [
            "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
            "        /*0010*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24 ;",
            "        /*0020*/                   MUFU.EX2 R3, R3 ;",
            "        /*0030*/              @!P0 FFMA R4, R3, R5, R6 ;",
            "        /*0040*/               @P1 BRA 0x10 ;",
            "        /*0050*/                   FADD R1, R1, R2 ;",
            "        /*0060*/                   BRA 0x50 ;",
            "        /*0070*/                   BRA 0x90 ;",
        ]
    )
    assert check.loop_mixes(sass) == [{"HGMMA": 1, "MUFU": 1, "FFMA": 1, "BRA": 1}]
