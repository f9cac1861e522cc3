"""Offline SASS census of one GEMM kernel config: compiles ``_w4a8_kernel`` or
``_w4a16_kernel`` for sm_90 without a GPU (Triton's bundled ptxas, the divisibility attributes
a launch specializes on) and prints its registers and shared memory, how many programs an SM
holds by each limit, the most frequent instruction classes, the main loop's length per
weight and what comes after the loop (the accumulator's stores), so a change's instruction
and occupancy cost can be read before any device time is spent.

    python tools/perf/sass_census.py w4a8 --bucket 4 --block-n 16 --groups 32 --warps 4 [--stages 2] [--prefetch] [--prequantized]
    python tools/perf/sass_census.py w4a16 --bucket 64 --block-n 64 --block-k 256 --warps 4 --stages 3 [--partial] [--maxnreg 96]
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from typing import Dict, List, Optional, Tuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

from coalesced_int4.kernels.gemm.w4a8 import _w4a8_kernel
from coalesced_int4.kernels.gemm.w4a16 import _w4a16_kernel
from coalesced_int4.kernels.ops.configs import W4A16_TMA_STAGES

POINTERS = {"x_ptr": "*bf16", "q_ptr": "*i32", "sc_ptr": "*u8", "ss_ptr": "*fp16", "zc_ptr": "*u8",
            "zs_ptr": "*fp16", "out_ptr": "*bf16"}  # both families read qdata as int32 words
CODE_WORDS = {"sc_ptr": "*i32", "zc_ptr": "*i32"}
"""W4A16 reads the scale and zero codes as int32 words too."""
DIVISIBLE_BY_16 = ("N", "K", "stride_xm", "stride_qn", "stride_cn", "stride_sn", "stride_os", "stride_om")
"""Integer arguments that are multiples of 16 at every launch on model shapes."""
# sm_90 per-SM limits: registers, shared memory (bytes), threads, and the shared memory the
# driver reserves per program.
SM_REGISTERS, SM_SHARED, SM_THREADS, SHARED_RESERVED = 65536, 233472, 2048, 1024


@dataclasses.dataclass
class Census:
    registers: int
    shared: int
    programs_by: Dict[str, int]
    opcodes: Counter
    main_loop: List[str]
    epilogue: List[str]
    """The instructions after the main loop's back-edge, every path of them (the stores of
    the accumulator and whatever ptxas laid out there)."""
    weights_per_thread: float

    @property
    def programs_per_sm(self) -> int:
        return min(self.programs_by.values())


def cuobjdump(*args: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return subprocess.run([tool, *args], capture_output=True, text=True, check=True).stdout


def compile_offline(kernel, pointers: Dict[str, str], constants: dict, warps: int, stages: int = 1,
                    maxnreg: Optional[int] = None, capability: int = 90):
    """``kernel`` (Triton or Gluon) compiled offline for ``sm_{capability}`` (default sm_90):
    ``pointers`` maps pointer arguments to Triton types, ``constants`` the constexpr ones; every
    other argument is an int32, and pointers and ``DIVISIBLE_BY_16`` arguments are specialized
    as a launch on model shapes does. ``maxnreg``: a config's register cap."""
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: pointers.get(n, "constexpr" if n in constants else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in pointers or n in DIVISIBLE_BY_16}
    source_type = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    source = source_type(kernel, signature, {(names.index(k),): v for k, v in constants.items()}, attrs)
    options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def census(family: str, constants: dict, warps: int, prequantized: bool = False,
           maxnreg: Optional[int] = None) -> Census:
    """Compile one config of ``family``'s kernel for sm_90 as an eager launch on the GPU does
    (``DEPENDENT_LAUNCH``, K a multiple of 256, and for W4A16 the plain grid, unless
    ``constants`` says otherwise) and count what it issues. ``maxnreg``: the config's register cap, if it has one."""
    kernel = {"w4a8": _w4a8_kernel, "w4a16": _w4a16_kernel}[family]
    pointers = {**POINTERS,
                **(CODE_WORDS if family == "w4a16" else {}),
                **({"x_ptr": "*i32"} if prequantized else {}),
                **({"out_ptr": "*fp32"} if constants["PARTIAL"] else {})}  # split-K writes fp32 partials
    launch = {"DEPENDENT_LAUNCH": True, "MASK_K": False, **({"BALANCED": False} if family == "w4a16" else {})}
    compiled = compile_offline(kernel, pointers, {**launch, **constants}, warps, constants["STAGES"], maxnreg)
    body, registers = sass_of(compiled)
    threads = 32 * warps
    allocated = -(-max(registers, 1) // 8) * 8  # registers are granted in steps of 8 per thread
    shared = compiled.metadata.shared
    programs_by = {"registers": SM_REGISTERS // (threads * allocated), "threads": SM_THREADS // threads,
                   "shared memory": SM_SHARED // (shared + SHARED_RESERVED)}
    weights_per_trip = constants["BLOCK_N"] * (constants["GROUPS"] * 32 if family == "w4a8" else constants["BLOCK_K"])
    return Census(registers, shared, programs_by,
                  Counter(opcode(text) for _, text in body), main_loop(body), after_loop(body),
                  weights_per_trip / threads)


def sass_of(compiled) -> Tuple[List[Tuple[int, str]], int]:
    """A compiled kernel's SASS as (address, instruction without its predicate) pairs, e.g.
    ``"/*0ce0*/  @P0 BRA 0x32a0 ;"`` -> ``(0xce0, "BRA 0x32a0 ;")``, and its registers a thread."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = cuobjdump("-sass", cubin.name)
        registers = int(re.search(r"REG:(\d+)", cuobjdump("-res-usage", cubin.name)).group(1))
    body = [(int(m.group(1), 16), m.group(2))
            for m in re.finditer(r"^\s+/\*([0-9a-f]{4})\*/\s*(?:@!?U?P\w+\s+)?(.*)$", sass, re.MULTILINE)]
    return body, registers


def opcode(text: str) -> str:
    """An instruction's opcode without its modifiers: ``"STG.E.128 [R2], R4 ;"`` -> ``"STG"``."""
    return text.split()[0].rstrip(";").split(".")[0]


def main_loop_span(body: List[Tuple[int, str]]) -> Tuple[int, int]:
    """The addresses of the K loop's first instruction and of its back-edge: the longest
    backward branch's target and the branch. A span with an ``EXIT`` in it is a jump back from
    the epilogue into code the loop shares (ptxas lays some out so), not a loop."""
    spans = [(int(m.group(1), 16), address) for address, text in body
             if (m := re.match(r"BRA (0x[0-9a-f]+)", text)) and int(m.group(1), 16) < address]
    loops = [(first, last) for first, last in spans
             if not any(first <= address <= last and text.startswith("EXIT") for address, text in body)]
    return max(loops, key=lambda span: span[1] - span[0])


def main_loop(body: List[Tuple[int, str]]) -> List[str]:
    """The K loop's instructions (``main_loop_span``)."""
    first, last = main_loop_span(body)
    return [text for address, text in body if first <= address <= last]


def after_loop(body: List[Tuple[int, str]]) -> List[str]:
    """The instructions after the K loop's back-edge."""
    last = main_loop_span(body)[1]
    return [text for address, text in body if address > last]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("family", choices=("w4a8", "w4a16"))
    parser.add_argument("--bucket", type=int, required=True)
    parser.add_argument("--block-n", type=int, required=True)
    parser.add_argument("--groups", type=int, default=32, help="w4a8: groups of 32 per trip")
    parser.add_argument("--block-k", type=int, default=256, help="w4a16: weights of K per trip")
    parser.add_argument("--batch-rows", type=int, default=None, help="w4a16: activation rows multiplied (default: the bucket)")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--stages", type=int, default=1)
    parser.add_argument("--prefetch", action="store_true", help="w4a8: the next trip's tile in registers")
    parser.add_argument("--prequantized", action="store_true",
                        help="w4a8: the binary reading quantize_activations' words instead of bf16")
    parser.add_argument("--partial", action="store_true", help="the split-K (> 1) binary")
    parser.add_argument("--maxnreg", type=int, default=None, help="the config's register cap")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    constants = {"PARTIAL": args.partial, "BUCKET": args.bucket, "BLOCK_N": args.block_n,
                 "STAGES": args.stages, "INTERPRET": False}
    if args.family == "w4a8":
        constants.update(GROUPS=args.groups, PREFETCH=args.prefetch)
    else:
        constants.update(BLOCK_K=args.block_k, BATCH_ROWS=args.batch_rows or args.bucket,
                         TMA_ACTIVATIONS=args.stages in W4A16_TMA_STAGES)
    result = census(args.family, constants, args.warps, args.prequantized, args.maxnreg)
    limits = ", ".join(f"{count} by {limit}" for limit, count in result.programs_by.items())
    print(f"{args.family} {constants} warps {args.warps}{' prequantized' if args.prequantized else ''}: "
          f"{result.registers} registers/thread, {result.shared} B shared; programs per SM: {limits} "
          f"-> {result.programs_per_sm} ({result.programs_per_sm * args.warps} warps); "
          f"{sum(result.opcodes.values())} instructions")
    print(", ".join(f"{op} {count}" for op, count in result.opcodes.most_common(args.top)))
    loop = len(result.main_loop)
    print(f"main loop: {loop} instructions a trip for {result.weights_per_thread:.0f} weights a thread "
          f"({loop / result.weights_per_thread:.2f} per weight)")
    stores = Counter(opcode(text) for text in result.epilogue)
    print(f"after the loop: {len(result.epilogue)} instructions, "
          + ", ".join(f"{op} {stores[op]}" for op in ("STS", "LDS", "BAR", "STG") if stores[op]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
