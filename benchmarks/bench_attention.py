"""Decode attention benchmark: ``decode_attention`` against ``F.scaled_dot_product_attention``
with the causal mask's row, at Llama-3-8B's heads (32 query, 8 KV, head size 128), per batch,
cache length and query position.

Method (bench_gemm's): each call reads its own layer's cache, at least 32 caches and enough
that together they exceed twice the L2 (``copies_beyond_l2``), in turn in a CUDA graph of at least
300 calls run back to back, median of 5 replays, µs per call; the max abs difference of the
two outputs is printed beside.

    python benchmarks/bench_attention.py [--batches 1,4,16] [--caches 512] [--positions 143,511]
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import torch
import torch.nn.functional as F

from coalesced_int4.kernels.autotune.cuda_graph_timing import copies_beyond_l2, time_back_to_back_us
from coalesced_int4.kernels.decode_attention import decode_attention

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 32, 8, 128, 32


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--caches", default="512")
    parser.add_argument("--positions", default="143,511")
    args = parser.parse_args(argv)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| batch | cache | position | caches rotated | ours µs | SDPA µs | SDPA / ours | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in map(int, args.batches.split(",")):
        for cache in map(int, args.caches.split(",")):
            kv_shape = (batch, KV_HEADS, cache, HEAD_DIM)
            count = max(LAYERS, copies_beyond_l2(2 * 2 * batch * KV_HEADS * cache * HEAD_DIM))  # k and v, bf16
            layers = [[torch.randn(shape, device="cuda", dtype=torch.bfloat16)
                       for shape in ((batch, HEADS, HEAD_DIM), kv_shape, kv_shape)] for _ in range(count)]
            for position in (p for p in map(int, args.positions.split(",")) if p < cache):
                at = torch.tensor([position], device="cuda")
                mask = (torch.arange(cache, device="cuda") <= position)[None, None, None]

                def ours(q, k, v):
                    return decode_attention(q, k, v, at)

                def sdpa(q, k, v):
                    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=True)

                diff = (ours(*layers[0]).float() - sdpa(*layers[0])[:, :, 0].float()).abs().max().item()
                ours_us, sdpa_us = (time_back_to_back_us([lambda layer=layer, f=f: f(*layer) for layer in layers])
                                    for f in (ours, sdpa))
                print(f"| {batch} | {cache} | {position} | {count} | {ours_us:.1f} | {sdpa_us:.1f} | "
                      f"{sdpa_us / ours_us:.2f}x | {diff:.4f} |", flush=True)
            del layers
    return 0


if __name__ == "__main__":
    sys.exit(main())
