"""kernels.launch's fast launch, with stand-ins for Triton (no GPU needed): the first call of a key
goes through Triton, later calls hand every argument straight to the compiled kernel's launcher."""

from types import SimpleNamespace

import pytest
import torch

from kernels import launch


class Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, calls):
        self.calls = calls

    def run(self, *a):
        if "bad" in a:
            raise TypeError("launcher refused")
        self.calls.append(("fast", a))


class Fn:
    """A ``@triton.jit`` function's stand-in: parameters x, n, then the constexprs."""

    __name__ = "fake_kernel"

    def __init__(self, calls, constexprs=("BLOCK", "FLAG")):
        self.calls = calls
        names = [("x", False), ("n", False)] + [(c, True) for c in constexprs]
        self.params = [SimpleNamespace(name=n, is_constexpr=c) for n, c in names]

    def __getitem__(self, grid):
        def launch_(*args, **meta):
            self.calls.append(("triton", grid, args, meta))
            return Compiled(self.calls)

        return launch_


class Tuner:
    """An ``@triton.autotune`` object's stand-in: picks BLOCK=128 (warps 8) on every call."""

    def __init__(self, calls, pre_hook=None):
        self.calls = calls
        self.fn = Fn(calls, constexprs=("FLAG", "BLOCK"))
        self.config = SimpleNamespace(
            pre_hook=pre_hook, all_kwargs=lambda: {"BLOCK": 128, "num_warps": 8}
        )

    def __getitem__(self, grid):
        def launch_(*args, **meta):
            self.best_config = self.config
            if callable(grid):
                named = {p.name: a for p, a in zip(self.fn.params, args)}
                resolved = grid({**named, **meta, **self.config.all_kwargs()})
            else:
                resolved = grid
            self.calls.append(("autotune", resolved, args, meta))
            return Compiled(self.calls)

        return launch_


@pytest.fixture
def gpu_mode(monkeypatch):
    monkeypatch.setattr(launch.device, "GPU_MODE", True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda dev: 7, raising=False)


def test_launcher_binds_once_then_calls_the_compiled_kernel(gpu_mode):
    calls = []
    launcher = launch.Launcher(Fn(calls))
    launcher(("k",), (3,), ("X", 5), FLAG=True, BLOCK=64, num_warps=4)
    launcher(("k",), (3,), ("X", 5), FLAG=True, BLOCK=64, num_warps=4)
    launcher(("k",), (2, 4), ("Y", 6), FLAG=True, BLOCK=64, num_warps=4)
    assert calls[0] == ("triton", (3,), ("X", 5), {"FLAG": True, "BLOCK": 64, "num_warps": 4})
    # Constexprs follow the run-time arguments in signature order (BLOCK, then FLAG).
    assert calls[1] == ("fast", (3, 1, 1, 7, "fn", "meta", None, None, None, "X", 5, 64, True))
    assert calls[2] == ("fast", (2, 4, 1, 7, "fn", "meta", None, None, None, "Y", 6, 64, True))
    # A launcher that refuses the arguments sends the call back through Triton.
    launcher(("k",), (1,), ("X", "bad"), FLAG=True, BLOCK=64, num_warps=4)
    assert calls[-1][0] == "triton" and calls[-1][2] == ("X", "bad")
    # A different key (new sizes, say) goes through Triton first, as Triton may specialise on it.
    launcher(("k2",), (3,), ("X", 5), FLAG=True, BLOCK=64, num_warps=4)
    assert calls[-1][0] == "triton"


def test_tuned_launcher_launches_the_chosen_config_directly(gpu_mode):
    calls = []
    tuner = Tuner(calls)
    launcher = launch.TunedLauncher(tuner)

    def grid(meta):  # the grid depends on the tile the autotuner chose
        return (1024 // meta["BLOCK"], 2)

    launcher(grid, ("X", 5), FLAG=False)
    assert calls[-1] == ("autotune", (8, 2), ("X", 5), {"FLAG": False})
    tuner.best_config = None
    launcher(grid, ("X", 5), FLAG=False)
    # The chosen config's BLOCK and the grid it implies; FLAG then BLOCK in signature order.
    assert calls[-1] == ("fast", (8, 2, 1, 7, "fn", "meta", None, None, None, "X", 5, False, 128))
    assert tuner.best_config is tuner.config  # "the config chosen last" stays true
    # Another int value is another key: through the autotuner again.
    launcher(grid, ("X", 6), FLAG=False)
    assert calls[-1][0] == "autotune"
    # A fixed config skips the autotuner: the plain jit function at the tile given.
    launcher.fixed((3,), ("X", 5), FLAG=False, BLOCK=32, num_warps=2)
    assert calls[-1] == ("triton", (3,), ("X", 5), {"FLAG": False, "BLOCK": 32, "num_warps": 2})
    launcher.fixed((3,), ("X", 5), FLAG=False, BLOCK=32, num_warps=2)
    assert calls[-1] == ("fast", (3, 1, 1, 7, "fn", "meta", None, None, None, "X", 5, False, 32))


def test_tuned_launcher_never_caches_a_config_with_a_pre_hook(gpu_mode):
    calls = []
    launcher = launch.TunedLauncher(Tuner(calls, pre_hook=lambda kwargs: None))
    for _ in range(2):
        launcher((4,), ("X", 5), FLAG=True)
        assert calls[-1][0] == "autotune"


def test_call_key_holds_what_triton_specialises_on():
    a = torch.zeros(8)
    b = torch.zeros(9)[1:]  # 4 bytes past an aligned base: not 16-byte aligned
    key = launch.call_key((a, b, 16, 1, None, 0.5, True), {"BLOCK": 64, "A": 1})
    assert key == ((torch.float32, True), (torch.float32, False), 16, 1, None, float, (bool, True),
                   ("A", 1), ("BLOCK", 64))  # fmt: skip
    # Floats are never specialised on: another scale is the same key.
    assert launch.call_key((a, 0.25), {}) == launch.call_key((a, 0.5), {})
    assert launch.call_key((a, 16), {}) != launch.call_key((a, 17), {})
    assert launch.call_key((a,), {}) != launch.call_key((a.half(),), {})
    assert launch.call_key((a, 1), {}) != launch.call_key((a, True), {})


def test_layout_key_and_plans():
    a, b = torch.zeros(4, 8), torch.zeros(8, 4).t()  # the same shape, other strides
    ka, kb = launch.layout_key((a,), 2), launch.layout_key((b,), 2)
    assert ka != kb and launch.layout_key((a,), 2) == ka
    assert launch.layout_key((a, [1]), 2) is None  # not a tensor: no plan, the checks speak
    off = torch.zeros(9)[1:]  # 4 bytes past an aligned base: Triton's other binary
    assert launch.layout_key((off,), 2) != launch.layout_key((torch.zeros(8),), 2)
    plans = launch.Plans()
    assert plans.get(ka) is None and plans.put(ka, "plan") == "plan" and plans.get(ka) == "plan"
    unhashable = launch.layout_key((a,), [2])
    assert plans.get(unhashable) is None and plans.put(unhashable, "p") == "p"
    assert plans.get(unhashable) is None


def test_a_grid_function_sees_the_arguments_by_name_on_every_call(gpu_mode):
    # As Triton calls it: run-time arguments by name and the meta-parameters (a tutorial grid
    # reads the size). The fast path reuses the grid the key's first call worked out.
    calls = []
    launcher = launch.TunedLauncher(Tuner(calls))

    def grid(m):
        return (m["n"] * 64 // m["BLOCK"],)

    for _ in range(2):
        launcher(grid, ("X", 512), FLAG=True)
    assert calls[-1][0] == "fast" and calls[-1][1][:3] == (256, 1, 1)


def test_no_fast_path_over_heuristics_or_with_launch_hooks(gpu_mode, monkeypatch):
    calls = []
    tuner = Tuner(calls)
    tuner.fn = SimpleNamespace(fn=tuner.fn)  # @triton.heuristics between tuner and jit: no params
    launcher = launch.TunedLauncher(tuner)
    for _ in range(2):
        launcher((4,), ("X", 5), FLAG=True)
        assert calls[-1][0] == "autotune"
    # A profiler's exit hook alone also wants Triton's own path.
    hooks = SimpleNamespace(launch_enter_hook=SimpleNamespace(calls=[]),
                            launch_exit_hook=SimpleNamespace(calls=[print]))  # fmt: skip
    plain = launch.Launcher(Fn(calls))
    plain(("k",), (1,), ("X", 5), FLAG=True, BLOCK=8)
    monkeypatch.setattr(launch, "knobs", SimpleNamespace(runtime=hooks))
    plain(("k",), (1,), ("X", 5), FLAG=True, BLOCK=8)
    assert calls[-1][0] == "triton"


def test_a_constexpr_left_at_its_default_is_passed_to_the_fast_path(gpu_mode):
    calls = []
    fn = Fn(calls)
    fn.params[-1].default = False  # FLAG defaults to False and the caller leaves it out
    launcher = launch.Launcher(fn)
    for _ in range(2):
        launcher(("k",), (2,), ("X", 5), BLOCK=8)
    assert calls[-1] == ("fast", (2, 1, 1, 7, "fn", "meta", None, None, None, "X", 5, 8, False))


def test_blocks_per_sm_takes_the_tightest_limit():
    """Threads, registers (allocated 8 a thread at a time) and shared memory (plus 1 KiB a block)."""
    assert launch.blocks_per_sm(256, 40) == 6  # 40 registers: 10,240 a block, 6 in 65,536
    assert launch.blocks_per_sm(256, 58) == 4  # rounded up to 64
    assert launch.blocks_per_sm(256, 16) == 8  # threads bind: 2,048 / 256
    assert launch.blocks_per_sm(128, 32, 50_000) == 3  # 167,936 / 51,024
    assert launch.blocks_per_sm(1024, 255) == 1  # never below one
