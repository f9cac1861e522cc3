"""Tensor-parallel decode benchmark: the built-in decoder at Llama-3-8B shapes, quantized
(ours), sharded over the ranks it is launched with (``coalesced_int4.decoder.parallelize``:
heads and MLP columns per rank, NCCL all-reduces), each block compiled and every step captured
in a CUDA graph as ``bench_decode.py`` does: decode tokens/s per batch size.

Run it once per tensor-parallel size; every rank builds the same seeded model, quantizes it
and cuts its shard, and rank 0 prints the table (and writes ``--json``). Needs as many GPUs as
ranks:

    python benchmarks/bench_tp.py [--batches 1,16] [--rounds 3] [--json tp1.json]
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py [--batches 1,16] [--json tp2.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import List, Optional

import torch
import torch.distributed as dist
from bench_decode import GraphedGeneration, compile_regions, generate_once
from bench_gemm import write_json

import coalesced_int4 as ci4
from coalesced_int4.decoder import LLAMA3_8B, build_decoder, parallelize


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rounds", type=int, default=3, help="timed generations per batch")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    start = time.perf_counter()
    model = build_decoder(LLAMA3_8B, seed=0, device="cuda")
    ci4.quantize_(model, ci4.int4_config())
    if ranks > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("nccl")
        parallelize(model, init_device_mesh("cuda", (ranks,)))
    compile_regions(model)
    if rank == 0:
        print(f"# TP {ranks}: built, quantized and sharded in {time.perf_counter() - start:.1f} s", flush=True)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        run = GraphedGeneration(model, batch, f"TP {ranks} rank {rank}")
        rates = [generate_once(run)["tokens_per_s"] for _ in range(args.rounds)]
        rows.append({"tp": ranks, "batch": batch, "tokens_per_s": statistics.median(rates),
                     "tokens_per_s_rounds": rates})
        if rank == 0:
            print(f"| {ranks} | {batch} | {rows[-1]['tokens_per_s']:.1f} |", flush=True)
    if rank == 0 and args.json:
        write_json(args.json, rows=rows)
    if ranks > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
