"""The accuracy benchmark's anchors (``benchmarks/bench_accuracy.py``): group-wise int4 with
bf16 scale and zero point, min-max and HQQ, as dequantized weights of the weight's own shape,
also where K is not a multiple of the group."""

import sys

import pytest
import torch

from tests.helpers import BENCHMARKS

sys.path.insert(0, BENCHMARKS)
from bench_accuracy import grouped_int4  # noqa: E402


def _relative_error(weight, values):
    return float((values.float() - weight.float()).norm() / weight.float().norm())


@pytest.mark.parametrize("group", [32, 128])
def test_grouped_int4_anchors_keep_the_shape_and_hqq_beats_min_max(group):
    weight = torch.randn(64, 576, generator=torch.Generator().manual_seed(group)).to(torch.bfloat16)
    minmax, hqq = (grouped_int4(group, hqq)(weight) for hqq in (False, True))
    assert minmax.shape == hqq.shape == weight.shape and minmax.dtype == torch.bfloat16
    # 4-bit codes over a group's range: a few percent of the weight's norm, less with HQQ.
    assert 0.01 < _relative_error(weight, hqq) < _relative_error(weight, minmax) < 0.2
