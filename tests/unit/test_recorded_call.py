"""Recorded calls (``kernels/runtime/recorded_call.py``) on the CPU: stand-in kernels with
Triton's launch interface compute with torch, so a replay's arguments are checked by what it
computes. The real kernels' replays are tested on the GPU (tests/gpu/test_gpu.py)."""

from types import SimpleNamespace

import pytest
import torch

from coalesced_int4.kernels.runtime import recorded_call

_MEMORY = {}
"""Address -> tensor of every tensor the tests make (the stand-in launchers take addresses, as
Triton's do)."""


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    _MEMORY[tensor.data_ptr()] = tensor
    return tensor


class _Launcher:
    """A compiled kernel's launcher: runs ``compute`` on the kernel arguments, a tensor passed
    as itself or as its address."""

    num_ctas, global_scratch_size, profile_scratch_size = 1, 0, 0
    launch_cooperative_grid, launch_pdl = False, False

    def __init__(self, compute):
        self.compute = compute
        self.addresses_passed = 0

    def launch(self, grid_x, grid_y, grid_z, stream, function, cooperative, dependent, scratch, profile_scratch,
               metadata, launch_metadata, enter_hook, exit_hook, *arguments):
        self.addresses_passed += sum(isinstance(a, int) and a in _MEMORY for a in arguments)
        self.compute(*(_MEMORY.get(a, a) if isinstance(a, int) else a for a in arguments))


class _Kernel:
    """``kernel[grid](*args)`` as Triton runs it: bind the arguments, ask a callable grid
    for its sizes (once per launch), launch the compiled kernel, return it."""

    def __init__(self, compute, launches_per_call=1):
        self.compiled = SimpleNamespace(run=_Launcher(compute), function=7, packed_metadata=(4, 1, 0))
        self.launches_per_call = launches_per_call
        self.__name__ = compute.__name__

    def __getitem__(self, grid):
        def run(*arguments):
            bound = {f"arg{i}": a for i, a in enumerate(arguments)}
            for _ in range(self.launches_per_call):
                sizes = (*(grid(bound) if callable(grid) else grid), 1, 1)[:3]
                self.compiled.run.launch(*sizes, 0, 7, False, False, None, None, (4, 1, 0), None, None, None,
                                         *bound.values())
            return self.compiled

        return run


def _product(x, weight, partial, rows):
    partial.copy_(x[:rows] @ weight.t())


def _doubled(partial, out):
    out.copy_(partial * 2)


PRODUCT, DOUBLED = _Kernel(_product), _Kernel(_doubled)


def _two_kernel_gemm(x, weight, product=PRODUCT, activation=None):
    """A launcher as the GEMMs are written: buffers through ``empty``, launches through
    ``run_kernel``, weights as views."""
    _kept(x), _kept(weight)
    partial = recorded_call.empty((x.shape[0], weight.shape[0]), torch.float32, x.device)
    out = recorded_call.empty((x.shape[0], weight.shape[0]), torch.float32, x.device)
    recorded_call.run_kernel(product, (2,), x if activation is None else activation, weight[:], partial, x.shape[0])
    recorded_call.run_kernel(DOUBLED, lambda meta: (3, 1), partial, out)
    return out


@pytest.fixture(autouse=True)
def _one_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: _kept(empty(*args, **kwargs)))


def test_a_replay_computes_on_its_own_activation_into_fresh_buffers_passing_addresses():
    weight, x = torch.randn(5, 8), torch.randn(3, 8)
    out, replay = recorded_call.record(x, (weight,), lambda: _two_kernel_gemm(x, weight))
    assert torch.allclose(out, 2 * x @ weight.t())
    assert replay is not None and len(replay.launches) == 2
    other = _kept(torch.randn(3, 8))
    passed = PRODUCT.compiled.run.addresses_passed
    replayed = replay(other, (weight,))
    assert torch.allclose(replayed, 2 * other @ weight.t())
    assert replayed.data_ptr() != out.data_ptr() and torch.allclose(out, 2 * x @ weight.t())
    assert PRODUCT.compiled.run.addresses_passed - passed == 3  # x, the weight and the partials


def test_a_replay_declines_an_activation_off_the_alignment_kernels_may_assume():
    weight, x = torch.randn(5, 8), torch.randn(3, 9)
    aligned = x[:, :8]
    _, replay = recorded_call.record(aligned, (weight,), lambda: _two_kernel_gemm(aligned, weight))
    assert replay is not None and replay(x[:, 1:], (weight,)) is None  # 4 bytes past an aligned address


def test_a_call_that_passes_anything_but_the_activation_weights_or_its_buffers_is_not_replayed():
    weight, x = torch.randn(5, 8), torch.randn(3, 8)
    copy = x.clone()  # a replay would pass this call's copy, not the next activation
    out, replay = recorded_call.record(x, (weight,), lambda: _two_kernel_gemm(x, weight, activation=copy))
    assert replay is None and torch.allclose(out, 2 * x @ weight.t())


def test_a_call_whose_kernel_launched_more_than_once_is_not_replayed():
    """An autotuner timing its configs launches its kernel many times in one call."""
    weight, x = torch.randn(5, 8), torch.randn(3, 8)
    timing = _Kernel(_product, launches_per_call=3)
    out, replay = recorded_call.record(x, (weight,), lambda: _two_kernel_gemm(x, weight, product=timing))
    assert replay is None and torch.allclose(out, 2 * x @ weight.t())


def test_a_replay_declines_other_weight_tensors_and_an_installed_launch_hook():
    import triton

    weight, x = torch.randn(5, 8), torch.randn(3, 8)
    _, replay = recorded_call.record(x, (weight,), lambda: _two_kernel_gemm(x, weight))
    assert replay(x, (weight.clone(),)) is None
    hook = lambda metadata: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert replay(x, (weight,)) is None
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert replay(x, (weight,)) is not None
