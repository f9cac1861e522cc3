"""Autotune benchmark: the time to tune (split-K and tile config) every INT4 linear of a
Llama-3-8B-shaped model at every bucket, cold with serial compiles, cold with the parallel
precompile, and warm from the caches the cold run left (persistent picks + Triton's binaries).

Each mode runs in a fresh process with its own ``TRITON_CACHE_DIR`` and
``COALESCED_INT4_CACHE_DIR``; a mode tunes one launch per (linear shape, bucket) inside
``autotune_launch_params()``, on random packed weights, and reports wall seconds and how many
split-K decisions it timed or restored.

    python benchmarks/bench_autotune.py [--buckets 1,2,3,4,8,16,32,64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import List, Optional

import torch
from bench_gemm import random_int4_weights, write_json  # this script's folder is on sys.path

from coalesced_int4.decoder import LLAMA3_8B, Decoder
from coalesced_int4.kernels import SUPPORTED_BUCKETS, autotune_launch_params, launch
from coalesced_int4.kernels.autotune import tuner

MODES = ("cold, serial compile", "cold, parallel compile", "warm")


def linear_shapes(config=LLAMA3_8B) -> List[tuple]:
    """The distinct (N, K) of the decoder's linear layers, built on the meta device."""
    with torch.device("meta"):
        model = Decoder(config)
    return sorted({(m.out_features, m.in_features) for m in model.modules() if isinstance(m, torch.nn.Linear)})


def tune_everything(buckets: List[int], serial: bool) -> dict:
    if serial:
        tuner.parallel_compile_available = lambda: False
    weights = {shape: random_int4_weights(*shape, copies=1)[0] for shape in linear_shapes()}
    torch.cuda.synchronize()
    start = time.perf_counter()
    with autotune_launch_params() as stats:
        for (n, k), packed in weights.items():
            for bucket in buckets:
                launch(bucket, torch.randn(bucket, k, dtype=torch.bfloat16, device="cuda"), *packed, 32)
    torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - start, "measured": stats.measured, "restored": stats.restored,
            "parallel": not serial and tuner.parallel_compile_available()}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--buckets", default=",".join(map(str, SUPPORTED_BUCKETS)))
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", choices=("serial", "parallel"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    buckets = [int(b) for b in args.buckets.split(",")]
    if args.child:
        print(json.dumps(tune_everything(buckets, serial=args.child == "serial")))
        return 0
    shapes = linear_shapes()
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}; shapes {shapes}; buckets {buckets}",
          flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as serial_dir, tempfile.TemporaryDirectory() as parallel_dir:
        for mode, child, directory in zip(MODES, ("serial", "parallel", "parallel"),
                                          (serial_dir, parallel_dir, parallel_dir)):
            env = {**os.environ, "TRITON_CACHE_DIR": os.path.join(directory, "triton"),
                   "COALESCED_INT4_CACHE_DIR": os.path.join(directory, "picks")}
            run = subprocess.run([sys.executable, __file__, "--child", child, "--buckets", args.buckets],
                                 env=env, capture_output=True, text=True, check=True)
            rows.append({"mode": mode, **json.loads(run.stdout.strip().splitlines()[-1])})
            print(f"| {mode} | {rows[-1]['seconds']:.1f} s | split-K timed {rows[-1]['measured']}, "
                  f"restored {rows[-1]['restored']} | parallel {rows[-1]['parallel']} |", flush=True)
    if args.json:
        write_json(args.json, shapes=shapes, buckets=buckets, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
