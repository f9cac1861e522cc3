"""``benchmarks/gluon_w4a16.py`` times bucket 64's loop restructured in Gluon against the shipped
kernel. Its numbers mean that only if its loop is what it claims: checked offline on the sm_90
SASS (Triton's bundled ptxas, no GPU needed)."""

import pytest
import torch

from coalesced_int4.kernels.ops import family
from coalesced_int4.kernels.runtime import dependent_launch
from tests.helpers import PERF_TOOLS, sm90_main_loop

POINTERS = {"x_ptr": "*bf16", "q_ptr": "*i32", "sc_ptr": "*i32", "ss_ptr": "*i16", "zc_ptr": "*i32",
            "zs_ptr": "*i16", "out_ptr": "*bf16"}


@pytest.mark.parametrize("groups_ahead, words_ahead", [(False, False), (True, False), (True, True)])
def test_a_trip_is_one_fenced_dot_left_in_flight_with_no_shared_memory_layout_round_trip(groups_ahead,
                                                                                          words_ahead):
    constants = {"STAGES": 3, "PARTIAL": False, "GROUPS_AHEAD": groups_ahead, "WORDS_AHEAD": words_ahead,
                 "DEPENDENT_LAUNCH": True}
    loop = sm90_main_loop("gluon_w4a16", "gluon_w4a16_kernel", POINTERS, constants)
    dots = [i for i, text in enumerate(loop) if "GMMA" in text]
    # One 128-deep dot on the decoded weights in registers, behind a single fence.
    assert len(dots) == 8 and all(loop[i].startswith("HGMMA.64x64x16.F32.BF16 R") for i in dots)
    assert sum(text == "WARPGROUP.ARRIVE" for text in loop) == 1
    # Left in flight: the trip waits only for the previous trip's dot.
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in loop and "WARPGROUP.DEPBAR.LE gsb0, 0x0" not in loop
    # Every layout step of the decode in registers: nothing stored to shared memory.
    assert not [text for text in loop if text.startswith("STS")]
    # The group values' quad shuffles: after this trip's dot when made for the next trip,
    # before it otherwise.
    shuffles = [i for i, text in enumerate(loop) if text.startswith("SHFL")]
    assert len(shuffles) == 8
    if groups_ahead:
        assert min(shuffles) > max(dots)
    else:
        assert max(shuffles) < min(dots)


class _RecordedLaunches:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the keyword arguments."""

    def __init__(self):
        self.kwargs = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kwargs.append(kwargs)


def test_the_experiment_and_its_reduction_launch_with_dependent_launch_as_the_shipped_kernel_does(monkeypatch):
    monkeypatch.syspath_prepend(PERF_TOOLS)
    import gluon_w4a16  # the benchmarks folder is on the path only for this test

    gemm, reduction = _RecordedLaunches(), _RecordedLaunches()
    monkeypatch.setattr(gluon_w4a16, "gluon_w4a16_kernel", gemm)
    monkeypatch.setattr(gluon_w4a16, "_splitk_reduce_kernel", reduction)
    # A GPU with griddepcontrol, compiled rather than interpreted: what the H200 runs.
    monkeypatch.setattr(dependent_launch, "has_griddepcontrol", lambda device: True)
    monkeypatch.setattr(family, "INTERPRETER", False)
    n, k = 64, 256
    u8 = lambda *shape: torch.zeros(shape, dtype=torch.uint8)  # noqa: E731
    steps = torch.zeros((n, k // 256), dtype=torch.float16)
    gluon_w4a16.launch(torch.zeros((64, k), dtype=torch.bfloat16), u8(n, k // 2), u8(n, k // 32), steps,
                       u8(n, k // 32), steps, split_k=2)
    for launched in (gemm, reduction):
        assert len(launched.kwargs) == 1
        assert launched.kwargs[0]["DEPENDENT_LAUNCH"] and launched.kwargs[0]["launch_pdl"]
