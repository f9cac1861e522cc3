"""How fast one SM runs the W4A16 kernel's tensor-core instruction, with nothing else to do.

A Gluon kernel loops over one 128-deep dot a trip, ``acc[64, N] += a[64, 128] @ b[128, N]``,
the shape of the W4A16 main loop's dot (64 weight rows, N activation rows), issued
asynchronously and waited for ``OUTSTANDING`` trips later. The left operand comes from
registers (RS: multiplied by 1 or 2 each trip, one bf16x2 multiply a pair, so it is
rebuilt in registers like the decoded weights) or from shared memory (SS); the right operand
sits in shared memory. P programs per SM share it. Printed: nanoseconds per
``HGMMA.64xNx16`` per SM and the TFLOPS that makes, for N = 16..256 and P = 1..4.

    python tools/perf/wgmma_rate.py [--trips 4000]

Gluon rather than Triton: the operand layouts are written out, so the loop is the dot and
the multiply and nothing else (Triton moved a loop-carried left operand through shared
memory every trip); ``tests/test_wgmma_rate.py`` checks offline that the loop's tensor-core
instructions are ``HGMMA.64xNx16`` with the left operand in registers (RS) or in shared
memory (SS).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

ROWS = gl.constexpr(64)
"""The dot's M: one warp group's rows, the W4A16 tile's weight rows."""
DEPTH = gl.constexpr(128)
"""The dot's K a trip: the W4A16 tile's BLOCK_K."""


@gluon.jit
def wgmma_loop(a_ptr, b_ptr, out_ptr, trips, N: gl.constexpr, REGISTER_A: gl.constexpr, OUTSTANDING: gl.constexpr):
    """``trips`` dots into one accumulator. N: the dot's N (activation rows). REGISTER_A: the
    left operand in registers, rebuilt each trip (else read from shared memory).
    OUTSTANDING: dots left in flight at each wait (0: each trip waits for its own dot)."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    loads: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    shared: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    depth = gl.arange(0, DEPTH, layout=gl.SliceLayout(0, loads))
    b_rows = gl.arange(0, N, layout=gl.SliceLayout(1, loads))
    a_rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, loads))
    b = gl.load(b_ptr + gl.expand_dims(b_rows, 1) * DEPTH + gl.expand_dims(depth, 0))
    a = gl.load(a_ptr + gl.expand_dims(a_rows, 1) * DEPTH + gl.expand_dims(depth, 0))
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [N, DEPTH], shared, b)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [ROWS, DEPTH], shared, a)
    fence_async_shared()
    a_registers = gl.convert_layout(a, a_layout)
    acc = gl.zeros([ROWS, N], gl.float32, mma)
    for trip in range(trips):
        if REGISTER_A:
            acc = warpgroup_mma(a_registers * (1 + trip % 2).to(gl.bfloat16), b_smem.permute((1, 0)), acc,
                                is_async=True)
        else:
            acc = warpgroup_mma(a_smem, b_smem.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=OUTSTANDING, deps=(acc,))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
    columns = gl.arange(0, N, layout=gl.SliceLayout(0, mma))
    gl.store(out_ptr + gl.program_id(0) * ROWS * N + gl.expand_dims(rows, 1) * N + gl.expand_dims(columns, 0), acc)


def ns_per_instruction(n: int, register_a: bool, outstanding: int, programs_per_sm: int, trips: int) -> float:
    """Nanoseconds per ``HGMMA.64xNx16`` per SM: ``programs_per_sm`` programs on every SM,
    each running ``trips`` dots of ``DEPTH // 16`` instructions (``triton.testing.do_bench``,
    as ``l2_bandwidth.py`` times its kernel)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = sms * programs_per_sm
    a = torch.randn(ROWS.value, DEPTH.value, device="cuda", dtype=torch.bfloat16) * 1e-3
    b = torch.randn(n, DEPTH.value, device="cuda", dtype=torch.bfloat16) * 1e-3
    out = torch.empty(grid, ROWS.value, n, device="cuda", dtype=torch.float32)
    ms = triton.testing.do_bench(lambda: wgmma_loop[(grid,)](a, b, out, trips, N=n, REGISTER_A=register_a,
                                                             OUTSTANDING=outstanding, num_warps=4),
                                 warmup=50, rep=200)
    return ms * 1e6 / (trips * (DEPTH.value // 16) * programs_per_sm)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trips", type=int, default=4000)
    args = parser.parse_args(argv)
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}; ns per HGMMA per SM (TFLOPS)")
    print("| left operand | dots in flight | N | P = 1 | P = 2 | P = 3 | P = 4 |")
    print("|---|---|---|---|---|---|---|")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for register_a in (True, False):
        for outstanding in (0, 1):
            for n in (16, 32, 64, 128, 256):
                cells = []
                for programs in (1, 2, 3, 4):
                    ns = ns_per_instruction(n, register_a, outstanding, programs, args.trips)
                    tflops = 2 * ROWS.value * n * 16 * sms / ns / 1e3
                    cells.append(f"{ns:.1f} ({tflops:.0f})")
                print(f"| {'registers' if register_a else 'shared'} | {outstanding + 1} | {n} | "
                      + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
