"""The config sweep's tile selection (``benchmarks/sweep_configs.py --tiles``): a sweep of a
few tiles times exactly their entries, and a tile the grid lacks is refused by name rather than
leaving a sweep that times nothing."""

import sys

import pytest

from tests.helpers import BENCHMARKS, PERF_TOOLS

sys.path[:0] = [PERF_TOOLS, BENCHMARKS]
from sweep_configs import GRIDS, select_grid  # noqa: E402


def test_tiles_keep_every_depth_of_the_named_tiles_and_nothing_else():
    selected = select_grid("w4a16", "64x128x4,64x128x8")
    assert sorted((e["BLOCK_N"], e["BLOCK_K"], e["num_warps"], e["STAGES"]) for e in selected) == [
        (64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3)]


def test_a_w4a8_tile_is_named_by_its_groups():
    selected = select_grid("w4a8", "16x32x4")
    assert sorted((e["BLOCK_N"], e["GROUPS"], e["num_warps"], e["STAGES"], e["PREFETCH"]) for e in selected) == [
        (16, 32, 4, 1, False), (16, 32, 4, 1, True), (16, 32, 4, 2, False), (16, 32, 4, 2, True)]


def test_no_tiles_is_the_whole_grid():
    assert select_grid("w4a16") is GRIDS["w4a16"]


def test_a_tile_outside_the_grid_is_refused_by_name():
    with pytest.raises(ValueError, match=r"--tiles: 64x128x16 not in the w4a16 grid \(.*64x128x4"):
        select_grid("w4a16", "64x128x4,64x128x16")
