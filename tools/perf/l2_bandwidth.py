"""How fast the SMs can read from L2 the way the W4A16 kernel reads its activations.

Every program of the W4A16 GEMM reads the same activation rows, a few hundred KB that stay in
L2, one [64, 128] bf16 tile (16 KB) a main-loop trip; at bucket 64 these re-reads are about
most of the bytes the SMs take from L2. This kernel does only
that: P programs per SM, each reading ``TRIPS`` tiles of one 64 x 4096 bf16 buffer in K
order, xor-folded into registers so that every byte read reaches the result. Printed: the
bytes the SMs received over the kernel's time, for P = 1..8 and 4 or 8 warps a program. The
plateau is the L2-to-SM read ceiling that the W4A16 kernel's L2 traffic is set against.

    python tools/perf/l2_bandwidth.py [--trips 256]
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import torch
import triton
import triton.language as tl

ROWS = 64
"""Activation rows a tile holds: bucket 64."""
TILE_WORDS = 64
"""int32 words of a tile row: 128 bf16, the W4A16 tile's BLOCK_K."""
ROW_WORDS = 2048
"""int32 words of a buffer row: K = 4096 bf16."""


@triton.jit
def l2_read_kernel(x_ptr, out_ptr, TRIPS: tl.constexpr, ROW_WORDS: tl.constexpr, ROWS: tl.constexpr,
                   TILE_WORDS: tl.constexpr):
    """Program p xors tiles ``(p + t) % (ROW_WORDS // TILE_WORDS)`` of the [ROWS, ROW_WORDS]
    int32 buffer, t < TRIPS, and stores the [ROWS, TILE_WORDS] result at ``out_ptr[p]``.
    Starting each program at its own tile spreads the reads over the buffer as the GEMM's
    programs, out of step with one another, do."""
    program = tl.program_id(0)
    rows = tl.arange(0, ROWS)[:, None]
    words = tl.arange(0, TILE_WORDS)[None, :]
    folded = tl.zeros((ROWS, TILE_WORDS), tl.int32)
    for trip in range(TRIPS):
        first_word = ((program + trip) * TILE_WORDS) % ROW_WORDS
        folded ^= tl.load(x_ptr + rows * ROW_WORDS + first_word + words)
    tl.store(out_ptr + program * ROWS * TILE_WORDS + rows * TILE_WORDS + words, folded)


def l2_read(x: torch.Tensor, programs: int, trips: int, warps: int = 4) -> torch.Tensor:
    """Launch ``l2_read_kernel`` on the [ROWS, ROW_WORDS] int32 ``x``: the folded tiles,
    [programs, ROWS, TILE_WORDS]."""
    out = torch.empty(programs, ROWS, TILE_WORDS, dtype=torch.int32, device=x.device)
    l2_read_kernel[(programs,)](x, out, TRIPS=trips, ROW_WORDS=x.shape[1], ROWS=ROWS, TILE_WORDS=TILE_WORDS,
                                num_warps=warps)
    return out


def read_tb_per_s(programs_per_sm: int, warps: int, trips: int) -> float:
    """TB/s the SMs receive from L2: tile bytes over the kernel's time
    (``triton.testing.do_bench``, CUDA events, the buffer resident in L2 after the warm-up)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = sms * programs_per_sm
    x = torch.randint(-2**31, 2**31 - 1, (ROWS, ROW_WORDS), dtype=torch.int32, device="cuda")
    ms = triton.testing.do_bench(lambda: l2_read(x, programs, trips, warps), warmup=50, rep=200)
    return programs * trips * ROWS * TILE_WORDS * 4 / (ms * 1e-3) / 1e12


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trips", type=int, default=256)
    args = parser.parse_args(argv)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}; L2 -> SM reads, TB/s")
    print("| warps | P = 1 | P = 2 | P = 4 | P = 8 |")
    print("|---|---|---|---|---|")
    for warps in (4, 8):
        cells = [f"{read_tb_per_s(p, warps, args.trips):.2f}" for p in (1, 2, 4, 8)]
        print(f"| {warps} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
