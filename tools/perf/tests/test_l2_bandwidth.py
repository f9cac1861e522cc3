"""``benchmarks/l2_bandwidth.py`` counts every byte of its tiles as read from L2. That holds
only if its kernel reads each tile it counts and nothing is folded away: checked in Triton's
interpreter against the same tiles xor-ed in torch."""

import functools
import sys

import torch

from tests.helpers import BENCHMARKS, PERF_TOOLS

sys.path[:0] = [PERF_TOOLS, BENCHMARKS]
from l2_bandwidth import ROWS, TILE_WORDS, l2_read  # noqa: E402


def test_each_program_folds_exactly_the_tiles_it_is_counted_for():
    row_words, programs, trips = 4 * TILE_WORDS, 3, 6  # trips wrap around the buffer's 4 tiles
    x = torch.randint(-2**31, 2**31 - 1, (ROWS, row_words), dtype=torch.int32,
                      generator=torch.Generator().manual_seed(0))
    tiles = x.view(ROWS, row_words // TILE_WORDS, TILE_WORDS)
    expected = torch.stack([
        functools.reduce(torch.bitwise_xor, [tiles[:, (p + t) % tiles.shape[1]] for t in range(trips)])
        for p in range(programs)
    ])
    assert torch.equal(l2_read(x, programs, trips), expected)
