"""Eager cost of one linear, and eager decoding: what a user who does not compile pays.

Per method (ours: ``F.linear`` on a quantized weight; bf16 ``F.linear``; tinygemm:
``torch.ops.aten._weight_int4pack_mm``, torchao's int4 kernel) and M on one weight (default
4096 x 4096), after warm-up: host µs per call (a loop of ``CALLS`` calls timed on the CPU,
synchronized before and after only, so the host's launch work is timed while the GPU runs
behind it) and wall µs per call (the same loop, the GPU's time included). Then eager greedy
decoding of the built-in decoder at Llama-3-8B shapes, batch 1, bf16 and ours: tokens/s, the
best of three generations each, taken in turn.

    python benchmarks/bench_eager.py [--shape 4096x4096] [--ms 1,4,16] [--decode-tokens 32] [--markdown table.md]
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import List, Optional

import torch
import torch.nn.functional as F
from bench_gemm import write_markdown

import coalesced_int4 as ci4
from coalesced_int4.decoder import LLAMA3_8B, build_decoder, generate

CALLS = 200
"""Calls of a timed loop: few enough that the launch queue never fills (which would make the
host wait for the GPU)."""


def per_call_us(call) -> tuple:
    """(host µs, wall µs) per call of ``call`` over a loop of ``CALLS``, best of 5 loops."""
    for _ in range(20):
        call()
    host, wall = [], []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(CALLS):
            call()
        launched = time.perf_counter()
        torch.cuda.synchronize()
        done = time.perf_counter()
        host.append((launched - start) / CALLS * 1e6)
        wall.append((done - start) / CALLS * 1e6)
    return min(host), min(wall)


def linear_calls(n: int, k: int, m: int) -> dict:
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    dense = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
    quantized = ci4.CudaCoalescedInt4Tensor.from_float(dense)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    packed = torch.ops.aten._convert_weight_to_int4pack(codes, 8)
    scales_zeros = (torch.rand(k // 32, n, 2, device="cuda") * 0.01).to(torch.bfloat16)
    return {"ours": lambda: F.linear(x, quantized), "bf16": lambda: F.linear(x, dense),
            "tinygemm": lambda: torch.ops.aten._weight_int4pack_mm(x, packed, 32, scales_zeros)}


def decode_tokens_per_s(models: dict, new_tokens: int, rounds: int = 3) -> dict:
    """Tokens/s of eager greedy decoding per model, best of ``rounds`` generations taken in
    turn (the host's load moves from one generation to the next, so every model sees the
    same moments)."""
    prompt = torch.randint(0, LLAMA3_8B.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).cuda()
    for model in models.values():
        generate(model, prompt, 4)  # warm-up: kernels compiled and picked
    rates = {name: 0.0 for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            generate(model, prompt, new_tokens)
            torch.cuda.synchronize()
            rates[name] = max(rates[name], new_tokens / (time.perf_counter() - start))
    return rates


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="4096x4096")
    parser.add_argument("--ms", default="1,4,16")
    parser.add_argument("--decode-tokens", type=int, default=32, help="0: skip the decoder")
    parser.add_argument("--markdown", default=None, help="write the tables, stamped with their environment, here")
    args = parser.parse_args(argv)
    n, k = (int(v) for v in args.shape.split("x"))
    table = ["| N x K | M | ours host µs | bf16 host µs | tinygemm host µs | ours wall µs | bf16 wall µs "
             "| tinygemm wall µs |", "|---|---|---|---|---|---|---|---|"]
    print("\n".join(table), flush=True)
    for m in (int(v) for v in args.ms.split(",")):
        times = {name: per_call_us(call) for name, call in linear_calls(n, k, m).items()}
        table.append(f"| {n}x{k} | {m} | " + " | ".join(f"{times[name][0]:.1f}" for name in times) + " | "
                     + " | ".join(f"{times[name][1]:.1f}" for name in times) + " |")
        print(table[-1], flush=True)
    if args.decode_tokens:
        dense = build_decoder(LLAMA3_8B, seed=0, device="cuda")
        quantized = copy.deepcopy(dense)
        ci4.quantize_(quantized, ci4.int4_config())
        rates = decode_tokens_per_s({"bf16": dense, "ours": quantized}, args.decode_tokens)
        table += ["", "| built-in decoder, Llama-3-8B shapes, eager | batch | tokens/s |", "|---|---|---|"]
        table += [f"| {name} | 1 | {rate:.1f} |" for name, rate in rates.items()]
        print("\n".join(table[-4:]), flush=True)
    if args.markdown:
        write_markdown(args.markdown, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
