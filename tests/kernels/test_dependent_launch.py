"""When the GEMM family's kernels are launched with programmatic dependent launch
(``dependent_launch.options``); test_sass_census checks what such a kernel compiles to, and
test_gpu that back-to-back launches still read each other's outputs."""

import types

import pytest
import torch
from torch._library.triton import set_wrap_triton_enabled
from torch._subclasses.fake_tensor import FakeTensorMode

from coalesced_int4.kernels.ops import family
from coalesced_int4.kernels.runtime import dependent_launch

OFF = {"DEPENDENT_LAUNCH": False}
ON = {"DEPENDENT_LAUNCH": True, "launch_pdl": True}


@pytest.fixture(autouse=True)
def fresh_capability_answers():
    """Each test's stand-in capability is asked afresh (the answer is cached per device)."""
    dependent_launch.has_griddepcontrol.cache_clear()
    yield
    dependent_launch.has_griddepcontrol.cache_clear()


@pytest.fixture
def compiled_kernels(monkeypatch):
    """As on a GPU machine: kernels compiled, not interpreted."""
    monkeypatch.setattr(family, "INTERPRETER", False)
    return monkeypatch


def _real(device: str):
    """Stands in for a real tensor on ``device`` (this machine may have no GPU)."""
    return types.SimpleNamespace(device=torch.device(device))


@pytest.mark.parametrize("capability, expected", [((9, 0), ON), ((10, 0), ON), ((8, 9), OFF)])
def test_launches_on_real_tensors_of_sm90_and_newer_are_dependent_launches(compiled_kernels, capability, expected):
    compiled_kernels.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    assert dependent_launch.options(_real("cuda:0")) == expected


def test_a_launcher_called_outside_the_op_still_gets_dependent_launch(compiled_kernels):
    """Outside the op torch leaves wrap_triton enabled; what decides is the tensor, not that."""
    compiled_kernels.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    for enabled in (True, False):
        with set_wrap_triton_enabled(enabled):
            assert dependent_launch.options(_real("cuda:0")) == ON


def test_traced_launches_and_other_devices_are_ordinary_launches(compiled_kernels):
    compiled_kernels.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    with FakeTensorMode():
        fake = torch.empty(1, device="cuda")
    assert dependent_launch.options(fake) == OFF
    assert dependent_launch.options(torch.empty(1)) == OFF


def test_the_interpreter_runs_ordinary_launches(monkeypatch):
    monkeypatch.setattr(family, "INTERPRETER", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert dependent_launch.options(_real("cuda:0")) == OFF


def test_the_capability_is_asked_once_per_device(compiled_kernels):
    asked = []
    compiled_kernels.setattr(torch.cuda, "get_device_capability", lambda device: asked.append(device) or (9, 0))
    for _ in range(3):
        assert dependent_launch.options(_real("cuda:0")) == ON
    assert asked == [torch.device("cuda", 0)]
