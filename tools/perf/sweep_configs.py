"""Config sweep: time every (tile config, split-K, launch variant) of a grid, beyond the shipped autotune space,
to choose that space and to A/B kernel variants (run once per source tree on PYTHONPATH).

Each (N, K, M, config, split) is timed with bench_gemm's method (a CUDA graph of many calls
rotating over weight copies that exceed twice the L2). The grid's binaries are compiled first
by a pool of processes sharing Triton's cache, so the timing phase compiles nothing. Prints,
per (N, K, M), the fastest entries and the shipped autotuner's own pick; JSON has every time.

    python tools/perf/sweep_configs.py --family w4a8 --shapes 8448x6656 --ms 1,4 [--json out.json]
    python tools/perf/sweep_configs.py --family w4a16 --shapes 4096x4096 --ms 64 --tiles 64x128x4,64x128x8
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import multiprocessing
import os
import sys
import time
from typing import List, Optional

import benchmarks_on_path  # noqa: F401  (benchmarks/ on sys.path)
import torch
from bench_gemm import INT4_BYTES_PER_WEIGHT, bucket_for, last_config, random_int4_weights, tuned_launch_params  # noqa: I001

from coalesced_int4.kernels import check_split_k, launch
from coalesced_int4.kernels.autotune.cuda_graph_timing import copies_beyond_l2, time_back_to_back_us
from coalesced_int4.kernels.ops.configs import (
    PREQUANTIZE_CANDIDATES,
    SPLIT_K_CANDIDATES,
    TILE_SPLIT_K_CANDIDATES,
    W4A16_TMA_STAGES,
    kernel_config,
)
from coalesced_int4.kernels.ops.validation import W4A8_BUCKETS

GRIDS = {
    # BLOCK_N x GROUPS x warps x stages x prefetch. The wide tiles (BLOCK_N 64-128) share each
    # row's activation quantization among more weights (fewer instructions per weight at
    # bucket 4 by sass_census.py); the deep ones (GROUPS 64 with 8 warps) put twice the bytes
    # of a trip in flight, for the small-N, long-K shapes where M = 1 has two programs per SM.
    "w4a8": [dict(BLOCK_N=n, GROUPS=g, num_warps=w, STAGES=s, PREFETCH=p)
             for n, g, w in ((4, 32, 2), (8, 16, 2), (8, 32, 4), (8, 64, 4), (16, 16, 4), (16, 32, 4),
                             (16, 32, 8), (32, 16, 4), (32, 32, 8), (64, 16, 4), (64, 16, 8), (128, 8, 8),
                             (16, 64, 8), (32, 64, 8))
             for s in (1, 2) for p in (False, True)],
    # BLOCK_N x BLOCK_K x warps x stages (activations by TMA at the depths the space uses it)
    "w4a16": [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, STAGES=s, TMA_ACTIVATIONS=s in W4A16_TMA_STAGES)
              for n, w in ((32, 4), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8)) for k in (128, 256)
              for s in (2, 3)],
}

VARIANTS = {"w4a8": [{"prequantize": p} for p in PREQUANTIZE_CANDIDATES], "w4a16": [{}]}
"""The family's launch parameters other than the split, each combination timed per entry."""


def tile_of(entry: dict) -> str:
    """A grid entry's tile as ``--tiles`` names it: BLOCK_NxBLOCK_Kxwarps (w4a16) or
    BLOCK_NxGROUPSxwarps (w4a8)."""
    return f"{entry['BLOCK_N']}x{entry.get('BLOCK_K', entry.get('GROUPS'))}x{entry['num_warps']}"


def select_grid(family: str, tiles: Optional[str] = None) -> List[dict]:
    """The family's grid, or its entries (every depth and variant) of the comma-separated
    ``tiles``; a named tile the grid lacks raises ValueError naming it."""
    grid = GRIDS[family]
    if tiles is None:
        return grid
    wanted = set(tiles.split(","))
    available = {tile_of(entry) for entry in grid}
    missing = sorted(wanted - available)
    if missing:
        raise ValueError(f"--tiles: {', '.join(missing)} not in the {family} grid ({', '.join(sorted(available))})")
    return [entry for entry in grid if tile_of(entry) in wanted]


def compile_one(job) -> Optional[str]:
    """Compile (by launching once, on a small N) one entry at one (bucket, split, variant)."""
    entry, k, bucket, split, variant = job
    try:
        x = torch.randn(bucket, k, dtype=torch.bfloat16, device="cuda")
        launch(bucket, x, *random_int4_weights(256, k, copies=1)[0], 32, split_k=split, config=kernel_config(**entry),
               **variant)
        torch.cuda.synchronize()
        return None
    except Exception as error:  # an entry that does not compile is reported and skipped later
        return f"{entry} bucket {bucket} split {split} {variant}: {type(error).__name__}: {error}"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=sorted(GRIDS), required=True)
    parser.add_argument("--shapes", default="8448x6656")
    parser.add_argument("--ms", default="1,4")
    parser.add_argument("--splits", default=None, help="split-K values (default: the family's candidates <= 8)")
    parser.add_argument("--tiles", default=None, help="only these tiles of the grid, comma-separated: "
                        "BLOCK_NxBLOCK_Kxwarps (w4a16) or BLOCK_NxGROUPSxwarps (w4a8)")
    parser.add_argument("--label", default="")
    parser.add_argument("--top", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(v) for v in args.ms.split(",")]
    candidates = SPLIT_K_CANDIDATES if args.family == "w4a8" else TILE_SPLIT_K_CANDIDATES
    splits = [int(v) for v in args.splits.split(",")] if args.splits else [s for s in candidates if s <= 8]
    try:
        grid = select_grid(args.family, args.tiles)
    except ValueError as error:
        parser.error(str(error))
    for m in ms:
        if (bucket_for(m) in W4A8_BUCKETS) != (args.family == "w4a8"):
            parser.error(f"M={m} runs bucket {bucket_for(m)}, not the {args.family} family")

    start = time.perf_counter()
    # Binaries differ by bucket, by split 1 vs > 1 (output vs partials; 1 is specialized) and
    # K's divisibility, which every shape here shares; one small-N launch per kind compiles it.
    variants = VARIANTS[args.family]
    jobs = [(entry, shapes[0][1], bucket, split, variant) for entry in grid
            for bucket in sorted({bucket_for(m) for m in ms}) for split in (1, 2) for variant in variants]
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=min(12, os.cpu_count() or 1), mp_context=context) as pool:
        failures = [f for f in pool.map(compile_one, jobs) if f]
    for failure in failures:
        print(f"# compile failed: {failure}", flush=True)
    print(f"# {args.label} {args.family}: compiled {len(jobs)} binaries in {time.perf_counter() - start:.0f} s",
          flush=True)

    rows = []
    for n, k in shapes:
        copies = random_int4_weights(n, k, copies_beyond_l2(n * k * INT4_BYTES_PER_WEIGHT))
        for m in ms:
            bucket = bucket_for(m)
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            times = []
            for entry, split, variant in itertools.product(grid, splits, variants):
                try:
                    check_split_k(split, k)
                    config = kernel_config(**entry)
                    us = time_back_to_back_us([lambda w=w: launch(bucket, x, *w, 32, split_k=split, config=config, **variant)
                                     for w in copies])
                except Exception:  # illegal split or a config that failed to compile
                    continue
                times.append({"us": us, "split": split, **variant, **entry})
            pick = tuned_launch_params(bucket, x, copies[0])
            pick_us = time_back_to_back_us([lambda w=w: launch(bucket, x, *w, 32, **pick) for w in copies])
            pick_config = last_config(bucket)
            times.sort(key=lambda t: t["us"])
            rows.append({"N": n, "K": k, "M": m, "pick_us": pick_us, "pick_params": pick,
                         "pick_config": pick_config, "times": times})
            best = ", ".join(f"{t['us']:.1f} us " + " ".join(f"{key}={v}" for key, v in t.items() if key != "us")
                             for t in times[:args.top])
            print(f"| {args.label} | {n}x{k} | {m} | shipped pick {pick_us:.1f} us ({pick}, {pick_config}) | "
                  f"best: {best} |", flush=True)
        del copies
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"label": args.label, "family": args.family, "rows": rows, "failures": failures}, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
