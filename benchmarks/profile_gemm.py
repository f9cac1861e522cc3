"""Hardware-counter profile of our INT4 GEMM launches, for Nsight Compute.

Per (N, K, M): the launch is tuned first (split-K and tile config, as the benchmark does),
then run once inside an NVTX range named ``profile``, so that ncu profiles exactly the kernels
of one tuned launch (the GEMM, and the split-K reduction when split > 1) and nothing of the
tuning. ``benchmarks/gpu_checks.sh profile`` runs it twice with one fresh pick cache: alone
(tuning and printing the picks; timings taken under ncu are not the real ones), then under ncu,
where every pick is restored from that cache instead of timed.

    ncu --clock-control none --nvtx --nvtx-include "profile/" python benchmarks/profile_gemm.py
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import torch
from bench_gemm import bucket_for, last_config, random_int4_weights, tuned_launch_params  # this script's folder is on sys.path

from coalesced_int4.kernels import launch


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="8448x6656")
    parser.add_argument("--ms", default="1,4,16,64")
    args = parser.parse_args(argv)
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        weights = random_int4_weights(n, k, copies=1)[0]
        for m in (int(v) for v in args.ms.split(",")):
            bucket = bucket_for(m)
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            params = tuned_launch_params(bucket, x, weights)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("profile")
            launch(bucket, x, *weights, 32, **params)
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            print(f"# profile {n}x{k} M={m}: bucket {bucket}, {params}, "
                  f"config {last_config(bucket)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
