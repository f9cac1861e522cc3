"""A fingerprint of every GEMM bucket's outputs, to show that a change left the kernels' bits
alone: each bucket runs fixed configs, splits and launch variants on fixed seeded weights and
activations, and the SHA-256 of each output is written as JSON. Run it once per source tree
(each with its own package first on ``PYTHONPATH``) and compare the files.

    PYTHONPATH=../before python tools/perf/kernel_bits.py before.json
    PYTHONPATH=. python tools/perf/kernel_bits.py after.json
    python tools/perf/kernel_bits.py --compare before.json after.json

It imports only ``coalesced_int4.kernels``' public names and ``coalesced_int4.quantize``, which
every tree since the op family has, so a tree from before a reorganisation runs it unchanged.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Dict, List, Optional

import torch

from coalesced_int4.kernels import W4A8_BUCKETS, int4_autotune_configs, launch
from coalesced_int4.kernels.autotune.persistent import config_to_json
from coalesced_int4.quantize import quantize_weight

N, K = 1536, 2048
"""Shape of the fixed weight: 12 tiles of 128 columns and 8 super-blocks of K."""
SPLITS = (1, 4)


def rows_for(bucket: int) -> List[int]:
    """The M each bucket runs: the bucket itself and one between it and the next smaller one
    (for bucket 64, also 40: the 48-row dot path)."""
    below = {1: [], 2: [], 3: [], 4: [3], 8: [5], 16: [9], 32: [17], 64: [33, 40]}[bucket]
    return below + [bucket]


def configs_for(bucket: int):
    """W4A8: the first config of each prefetch setting; W4A16: a pointer-copy config, a TMA
    config and its register-capped twin."""
    configs = int4_autotune_configs(bucket)
    if bucket in W4A8_BUCKETS:
        return [next(c for c in configs if c.kwargs["PREFETCH"] == p) for p in (False, True)]
    pointer = next(c for c in configs if not c.kwargs["TMA_ACTIVATIONS"])
    tma = [c for c in configs if c.kwargs["TMA_ACTIVATIONS"]]
    return [pointer, *tma]


def fingerprints(buckets, device: str) -> Dict[str, str]:
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(N, K, generator=generator).to(torch.bfloat16)
    weights = [t.to(device) for t in quantize_weight(dense)]
    x_all = torch.randn(64, K, generator=generator).to(torch.bfloat16).to(device)
    out: Dict[str, str] = {}
    for bucket in buckets:
        variants = [{"prequantize": False}, {"prequantize": True}] if bucket in W4A8_BUCKETS else [{"balanced": False}]
        for config in configs_for(bucket):
            for split in SPLITS:
                for variant in variants:
                    for m in rows_for(bucket):
                        y = launch(bucket, x_all[:m].contiguous(), *weights, 32, split_k=split, config=config,
                                   **variant)
                        key = f"bucket={bucket} m={m} split={split} {variant} {json.dumps(config_to_json(config))}"
                        out[key] = hashlib.sha256(y.cpu().view(torch.int16).numpy().tobytes()).hexdigest()
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="the JSON to write, or with --compare the two to compare")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--buckets", default="1,2,3,4,8,16,32,64")
    parser.add_argument("--device", default="cuda", help="cpu runs Triton's interpreter (TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.load(open(path)) for path in args.paths)
        differing = sorted(key for key in before.keys() | after.keys() if before.get(key) != after.get(key))
        for key in differing:
            print(f"differs: {key}")
        print(f"{len(before.keys() & after.keys())} launches in both, {len(differing)} differ or are missing")
        return 1 if differing else 0
    result = fingerprints([int(b) for b in args.buckets.split(",")], args.device)
    with open(args.paths[0], "w") as handle:
        json.dump(result, handle, indent=1, sort_keys=True)
    print(f"{len(result)} launches fingerprinted into {args.paths[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
