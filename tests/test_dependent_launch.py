"""When the GEMM family's kernels are launched with programmatic dependent launch
(``dependent_launch.options``); test_sass_census checks what such a kernel compiles to, and
test_gpu that back-to-back launches still read each other's outputs."""

import pytest
import torch
from torch._library.triton import set_wrap_triton_enabled

from coalesced_int4.kernels import dependent_launch, family

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


def _eager_options(device):
    """The options inside an eager launch (``int4_gemm.launch`` turns wrap_triton off for
    real inputs)."""
    with set_wrap_triton_enabled(False):
        return dependent_launch.options(device)


@pytest.mark.parametrize("capability, expected", [((9, 0), ON), ((10, 0), ON), ((8, 9), OFF)])
def test_eager_launches_on_sm90_and_newer_are_dependent_launches(compiled_kernels, capability, expected):
    compiled_kernels.setattr(torch.cuda, "get_device_capability", lambda device: capability)
    assert _eager_options(torch.device("cuda", 0)) == expected


def test_traced_launches_and_other_devices_are_ordinary_launches(compiled_kernels):
    compiled_kernels.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    with set_wrap_triton_enabled(True):
        assert dependent_launch.options(torch.device("cuda", 0)) == OFF
    assert _eager_options(torch.device("cpu")) == OFF


def test_the_interpreter_runs_ordinary_launches(monkeypatch):
    monkeypatch.setattr(family, "INTERPRETER", True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert _eager_options(torch.device("cuda", 0)) == OFF


def test_the_capability_is_asked_once_per_device(compiled_kernels):
    asked = []
    compiled_kernels.setattr(torch.cuda, "get_device_capability", lambda device: asked.append(device) or (9, 0))
    for _ in range(3):
        assert _eager_options(torch.device("cuda", 0)) == ON
    assert asked == [torch.device("cuda", 0)]
