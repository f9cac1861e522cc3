"""The shared memory carveout of W4A16 launches (``kernels/runtime/smem_carveout.py``): the rule on any
machine, the hook with stand-ins for the driver, and on a GPU the attribute an eager launch
leaves, unchanged bits, and launches at two grids captured in one CUDA graph."""

import functools
import types

import pytest
import torch
import triton
from triton.compiler.compiler import LazyDict

from coalesced_int4.kernels import int4_autotune_configs, launch
from coalesced_int4.kernels.gemm.w4a16 import _w4a16_kernel
from coalesced_int4.kernels.runtime import smem_carveout as carveout
from coalesced_int4.kernels.runtime.smem_carveout import SharedMemory, carveout_percent, fitted_to_grid, report_grid
from tests.helpers import packed_weight, requires_cuda

H200 = SharedMemory(sms=132, per_sm=233472, reserved_per_program=1024)
W4A16_PROGRAM = types.SimpleNamespace(shared=57344, num_warps=4)
"""The (64, 128, 4) three-stage program's shared memory (Triton's compiled metadata)."""


def _launch(function, grid, metadata=W4A16_PROGRAM, report=report_grid):
    """The metadata Triton's launcher hands a launch hook (``CompiledKernel.launch_metadata``)."""
    launch_metadata = LazyDict({"name": "kernel", "function": function, "stream": 0})
    if report is not None:
        launch_metadata.add(report, (grid, metadata, {}))
    return launch_metadata


@pytest.mark.parametrize("programs, occupancy, percent", [
    (256, 4, 50),   # 4096x4096 at split 4: two programs an SM
    (396, 4, 75),   # 8448x6656 at split 3: three
    (528, 4, 100),  # 8448x6656 at split 4: four, all of it
    (100, 4, 25),   # fewer programs than SMs: one
    (2000, 3, 75),  # more than the SMs hold at once: as many as they hold
])
def test_a_launch_asks_for_the_shared_memory_of_the_programs_its_grid_puts_on_an_sm(programs, occupancy, percent):
    assert carveout_percent(programs, occupancy, W4A16_PROGRAM.shared, H200) == percent


def test_the_carveout_is_the_least_percent_that_holds_the_programs():
    for shared in (0, 16384, 33792, 57344, 115712):
        for occupancy in range(1, 6):
            for programs in range(1, 1000, 7):
                percent = carveout_percent(programs, occupancy, shared, H200)
                per_sm = max(1, min(occupancy, -(-programs // H200.sms)))
                needed = per_sm * (shared + H200.reserved_per_program)
                assert percent == 100 or percent * H200.per_sm >= 100 * needed
                assert (percent - 1) * H200.per_sm < 100 * needed


@pytest.fixture
def driver(monkeypatch):
    """Stand-ins for the driver: four programs an SM, the H200's shared memory, and a record
    of the carveouts set."""
    sets = []
    monkeypatch.setattr(carveout, "occupancy", lambda function, threads, shared: 4)
    monkeypatch.setattr(carveout, "shared_memory", lambda device_index: H200)
    monkeypatch.setattr(carveout, "set_carveout", lambda function, percent: sets.append((function, percent)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return sets


def test_the_hook_sets_a_functions_carveout_only_when_its_grid_wants_another(driver):
    fitter = carveout.Fitter()
    for grid in ((64, 4, 1), (64, 4, 1), (256, 1, 1), (96, 4, 1), (96, 4, 1)):
        fitter(_launch(function=7, grid=grid))
    fitter(_launch(function=8, grid=(64, 4, 1)))  # another binary, or the same on another GPU
    assert driver == [(7, 50), (7, 75), (8, 50)]


def test_binaries_of_at_most_48_kb_keep_the_drivers_carveout(driver):
    """Triton leaves their carveout to the driver, which gives them L1 already."""
    small = types.SimpleNamespace(shared=carveout.TRITON_PREFERS_SHARED_ABOVE, num_warps=4)
    carveout.Fitter()(_launch(function=7, grid=(64, 4, 1), metadata=small))
    assert driver == []


def test_other_kernels_launches_are_left_alone(driver):
    def must_not_run(*args):
        raise AssertionError("evaluated another kernel's launch metadata")

    carveout.Fitter()(_launch(function=7, grid=(64, 4, 1), report=must_not_run))
    carveout.Fitter()(_launch(function=7, grid=(64, 4, 1), report=None))
    assert driver == []


def test_the_hook_is_installed_only_while_a_fitted_launch_is_open():
    hooks = triton.knobs.runtime.launch_enter_hook
    assert carveout.FITTER not in hooks.calls
    with fitted_to_grid():
        with fitted_to_grid():
            assert hooks.calls.count(carveout.FITTER) == 1
        assert carveout.FITTER in hooks.calls
    assert carveout.FITTER not in hooks.calls
    with pytest.raises(ValueError), fitted_to_grid():
        raise ValueError("a launch that fails")
    assert carveout.FITTER not in hooks.calls


# ------------------------------------------------------------------ on the GPU

def _pointer_config(block_n=64, block_k=128, stages=3):
    return next(c for c in int4_autotune_configs(64) if not c.kwargs["TMA_ACTIVATIONS"]
                and (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["STAGES"]) == (block_n, block_k, stages))


@pytest.fixture
def recorded_sets(monkeypatch):
    """The carveouts fitted launches set from now on, each function's asked afresh."""
    sets = []
    set_for_real = carveout.set_carveout

    def record(function, percent):
        sets.append((function, percent))
        set_for_real(function, percent)

    monkeypatch.setattr(carveout.FITTER, "carveout", {})
    monkeypatch.setattr(carveout, "set_carveout", record)
    return sets


def _compiled(function):
    """The W4A16 binary loaded as ``function`` on the current GPU."""
    kernels = _w4a16_kernel.device_caches[torch.cuda.current_device()][0].values()
    return next(k for k in (k.result() if hasattr(k, "result") else k for k in kernels) if k.function == function)


def _two_grids():
    """Bucket 64's (64, 128, 4) three-stage binary at split 4 on N = 4096 and 6144: on the H200
    two and three programs an SM."""
    x = torch.randn(64, 1024, dtype=torch.bfloat16, device="cuda")
    weights = {n: packed_weight(n, 1024, seed=n, device="cuda")[0] for n in (4096, 6144)}
    return {n: functools.partial(launch, 64, x, *packed, 32, split_k=4, balanced=False,
                                config=_pointer_config())
            for n, packed in weights.items()}


def _wanted(n, function):
    """The carveout ``_two_grids``' launch on N wants from ``function``, by the rule."""
    shared = _compiled(function).metadata.shared
    return carveout_percent(triton.cdiv(n, 64) * 4, carveout.FITTER.occupancy[function], shared,
                            carveout.shared_memory(torch.cuda.current_device()))


@requires_cuda
def test_an_eager_launch_leaves_the_carveout_its_grid_wants_and_the_default_carveouts_bits(recorded_sets):
    for n, gemm in _two_grids().items():
        fitted = gemm()
        function, percent = recorded_sets[-1]
        assert percent == _wanted(n, function)
        assert carveout.preferred_carveout(function) == percent
        carveout.set_carveout(function, -1)  # the hook still holds its own: the next launch keeps -1
        assert torch.equal(gemm(), fitted), n
    assert len({function for function, percent in recorded_sets if percent >= 0}) == 1  # one binary


@requires_cuda
def test_launches_of_one_binary_at_two_grids_replay_from_one_cuda_graph(recorded_sets):
    """The hook sets the carveout while the graph is captured, once for each grid."""
    gemms = _two_grids()
    eager = {n: gemm() for n, gemm in gemms.items()}
    torch.cuda.synchronize()
    carveout.FITTER.carveout.clear()
    recorded_sets.clear()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = {n: gemm() for n, gemm in gemms.items()}
    (function,) = {function for function, _ in recorded_sets}
    wanted = [_wanted(n, function) for n in gemms]
    assert [percent for _, percent in recorded_sets] == sorted(set(wanted), key=wanted.index)
    graph.replay()
    torch.cuda.synchronize()
    for n in gemms:
        assert torch.equal(captured[n], eager[n]), n
