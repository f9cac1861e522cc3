"""Hardware-counter profile of our INT4 GEMM launches, for Nsight Compute.

Per (N, K, M): the launch is tuned first (split-K and tile config, as the benchmark does),
then run once inside an NVTX range named ``profile``, so that ncu profiles exactly the kernels
of one tuned launch (the GEMM, and the split-K reduction when split > 1) and nothing of the
tuning. ``benchmarks/gpu_checks.sh profile`` runs it twice with one fresh pick cache: alone
(tuning and printing the picks; timings taken under ncu are not the real ones), then under ncu,
where every pick is restored from that cache instead of timed.

    ncu --clock-control none --nvtx --nvtx-include "profile/" python tools/perf/profile_gemm.py

``--tile BLOCK_N,BLOCK_K,WARPS,STAGES --split S`` (W4A16 buckets) skips the tuning and runs
that config at that split, so that programs per SM can be set through the grid: N / BLOCK_N
tiles times S programs, e.g. 8448 columns of 64 is one program on each of 132 SMs.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import benchmarks_on_path  # noqa: F401  (benchmarks/ on sys.path)
import torch
from bench_gemm import bucket_for, last_config, random_int4_weights, tuned_launch_params

from coalesced_int4.kernels import W4A16_BUCKETS, launch
from coalesced_int4.kernels.ops.configs import w4a16_configs


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="8448x6656")
    parser.add_argument("--ms", default="1,4,16,64")
    parser.add_argument("--tile", help="BLOCK_N,BLOCK_K,WARPS,STAGES of a W4A16 config to run untuned")
    parser.add_argument("--split", type=int, help="split-K of the --tile config (default 1)")
    args = parser.parse_args(argv)
    if args.split is not None and not args.tile:
        parser.error("--split applies to a --tile config; without --tile the split is tuned")
    split = args.split or 1
    tile = tuple(int(v) for v in args.tile.split(",")) if args.tile else None
    if tile is not None and len(tile) != 4:
        parser.error(f"--tile takes BLOCK_N,BLOCK_K,WARPS,STAGES, got {args.tile!r}")
    ms = [int(v) for v in args.ms.split(",")]
    if tile is not None and any(bucket_for(m) not in W4A16_BUCKETS for m in ms):
        parser.error(f"--tile sets a W4A16 config (buckets {W4A16_BUCKETS}); --ms {args.ms} runs others")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        weights = random_int4_weights(n, k, copies=1)[0]
        for m in ms:
            bucket = bucket_for(m)
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            if tile:
                block_n, block_k, warps, stages = tile
                params = {"split_k": split,
                          "config": w4a16_configs(block_n, block_k, warps, stages)[0]}
                launch(bucket, x, *weights, 32, **params)  # compiled outside the profiled range
                described = f"split_k={split}, config {args.tile} (BLOCK_N,BLOCK_K,warps,stages)"
            else:
                params = tuned_launch_params(bucket, x, weights)
                described = f"{params}, config {last_config(bucket)}"
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("profile")
            launch(bucket, x, *weights, 32, **params)
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            print(f"# profile {n}x{k} M={m}: bucket {bucket}, {described}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
