"""Offline SASS census of the W4A8 kernel: compiles ``_w4a8_kernel`` for sm_90 without a GPU
(Triton's bundled ptxas, the divisibility attributes a launch specializes on) and prints the
registers per thread, the most frequent instruction classes and the main loop's length per
weight of one config, so a change's instruction and occupancy cost can be read before any
device time is spent.

    python benchmarks/sass_w4a8.py --bucket 4 --block-n 16 --groups 32 --warps 4 [--prefetch] [--prequantized]
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from typing import List, Optional, Tuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from coalesced_int4.kernels.w4a8 import _w4a8_kernel

POINTERS = {"x_ptr": "*bf16", "q_ptr": "*i32", "sc_ptr": "*u8", "ss_ptr": "*fp16", "zc_ptr": "*u8",
            "zs_ptr": "*fp16", "out_ptr": "*bf16"}
DIVISIBLE_BY_16 = ("N", "K", "stride_xm", "stride_qn", "stride_cn", "stride_sn", "stride_om")
"""Integer arguments that are multiples of 16 at every launch on model shapes."""


def cuobjdump(*args: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return subprocess.run([tool, *args], capture_output=True, text=True, check=True).stdout


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bucket", type=int, default=1)
    parser.add_argument("--block-n", type=int, default=16)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--prefetch", action="store_true")
    parser.add_argument("--partial", action="store_true", help="the split-K (> 1) binary")
    parser.add_argument("--prequantized", action="store_true",
                        help="the binary reading quantize_activations' words instead of bf16")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    constants = {"PARTIAL": args.partial, "BUCKET": args.bucket, "BLOCK_N": args.block_n, "GROUPS": args.groups,
                 "STAGES": args.stages, "PREFETCH": args.prefetch, "INTERPRET": False}
    names = list(inspect.signature(_w4a8_kernel.fn).parameters)
    pointers = {**POINTERS, **({"x_ptr": "*i32"} if args.prequantized else {}),
                **({"out_ptr": "*fp32"} if args.partial else {})}  # split-K writes fp32 partials
    signature = {n: pointers.get(n, "constexpr" if n in constants else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in pointers or n in DIVISIBLE_BY_16}
    source = ASTSource(_w4a8_kernel, signature, {(names.index(k),): v for k, v in constants.items()}, attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": args.warps, "num_stages": args.stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        sass = cuobjdump("-sass", cubin.name)
        registers = int(re.search(r"REG:(\d+)", cuobjdump("-res-usage", cubin.name)).group(1))
    # (address, instruction without its predicate): "/*0ce0*/  @P0 BRA 0x32a0 ;" -> (0xce0, "BRA 0x32a0 ;")
    body = [(int(m.group(1), 16), m.group(2))
            for m in re.finditer(r"^\s+/\*([0-9a-f]{4})\*/\s*(?:@!?U?P\w+\s+)?(.*)$", sass, re.MULTILINE)]
    opcodes = Counter(text.split()[0].rstrip(";").split(".")[0] for _, text in body)
    threads = 32 * args.warps
    allocated = -(-max(registers, 1) // 8) * 8  # registers are granted in steps of 8 per thread
    programs_per_sm = min(65536 // (threads * allocated), 2048 // threads)
    print(f"{vars(args)}: {registers} registers/thread -> at most {programs_per_sm} programs "
          f"({programs_per_sm * args.warps} warps) per SM by registers; {sum(opcodes.values())} instructions")
    print(", ".join(f"{op} {count}" for op, count in opcodes.most_common(args.top)))
    loop = main_loop(body)
    per_thread = args.block_n * args.groups * 32 / threads
    print(f"main loop: {len(loop)} instructions a trip for {per_thread:.0f} weights a thread "
          f"({len(loop) / per_thread:.2f} per weight)")
    return 0


def main_loop(body: List[Tuple[int, str]]) -> List[Tuple[int, str]]:
    """The instructions from the longest backward branch's target to the branch: the K loop."""
    spans = [(int(m.group(1), 16), address) for address, text in body
             if (m := re.match(r"BRA (0x[0-9a-f]+)", text)) and int(m.group(1), 16) < address]
    first, last = max(spans, key=lambda span: span[1] - span[0])
    return [(address, text) for address, text in body if first <= address <= last]


if __name__ == "__main__":
    sys.exit(main())
