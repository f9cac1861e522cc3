"""Decode benchmark: the built-in decoder at Llama-3-8B shapes (32 layers, hidden 4096, 32
heads / 8 KV heads, MLP 14336, vocab 128256; seeded random weights; bf16 KV cache), greedy
generation of 128 tokens after a 16-token prompt, the decode step compiled with
``torch.compile(mode="reduce-overhead", fullgraph=True)`` (CUDA graphs).

Per method (bf16, ours, torchao ``Int4WeightOnlyConfig(group_size=32,
int4_packing_format="tile_packed_to_4d")``) and batch size: tokens/s over the 128 decode steps
(after a warm-up generation that compiles), time to first token (the compiled prefill), and the
weight bytes. All methods run in one process on one GPU.

    python benchmarks/bench_decode.py [--methods bf16,ours,torchao] [--batches 1,4,16] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Dict, List, Optional

import torch

import coalesced_int4 as ci4
from coalesced_int4.kernels import autotune_launch_params
from coalesced_int4.decoder import LLAMA3_8B, build_decoder, decode_step, generate

PROMPT = 16
NEW_TOKENS = 128


def weight_bytes(model: torch.nn.Module) -> int:
    total = 0
    for tensor in model.state_dict().values():
        inner = getattr(tensor, "tensor_data_names", None)
        parts = [getattr(tensor, name) for name in inner] if inner else [tensor]
        total += sum(p.numel() * p.element_size() for p in parts if p is not None)
    return total


def quantized(model, method: str):
    model = copy.deepcopy(model)
    if method == "ours":
        ci4.quantize_(model, ci4.int4_config())
    elif method == "torchao":
        from torchao.quantization import Int4WeightOnlyConfig, quantize_

        quantize_(model, Int4WeightOnlyConfig(group_size=32, int4_packing_format="tile_packed_to_4d"))
    return model


def measure(model, batch: int) -> Dict[str, float]:
    generator = torch.Generator(device="cpu").manual_seed(batch)
    prompt = torch.randint(0, model.config.vocab_size, (batch, PROMPT), generator=generator).cuda()
    step = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
    prefill = torch.compile(model, fullgraph=True)
    positions = torch.arange(PROMPT, device="cuda")
    # Eager steps first, with split-K timing on: every INT4 shape is tuned before tracing, so
    # the compiled graphs get each shape's picked config and split alone (docs/design.md,
    # "Tracing picks").
    with torch.no_grad(), autotune_launch_params():
        start = time.perf_counter()
        generate(model, prompt, 2)
        torch.cuda.synchronize()
        tuned = time.perf_counter()
        model.setup_cache(batch)
        for _ in range(2):
            prefill(prompt, positions)
        generate(model, prompt, 8, step=step)  # compiles the decode step
        torch.cuda.synchronize()
        print(f"# batch {batch}: eager warm-up and tuning {tuned - start:.1f} s, "
              f"compile {time.perf_counter() - tuned:.1f} s", flush=True)
    with torch.no_grad():
        model.setup_cache(batch)
        start = time.perf_counter()
        prefill(prompt, positions)
        torch.cuda.synchronize()
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        tokens, _ = generate(model, prompt, NEW_TOKENS, step=step)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return {"tokens_per_s": batch * NEW_TOKENS / seconds, "ttft_ms": ttft * 1e3,
            "first_tokens": tokens[0, :8].tolist()}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="bf16,ours,torchao")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    base = build_decoder(LLAMA3_8B, seed=0, device="cuda")
    rows = []
    for method in args.methods.split(","):
        start = time.perf_counter()
        model = base if method == "bf16" else quantized(base, method)
        print(f"# {method}: quantized in {time.perf_counter() - start:.1f} s", flush=True)
        size = weight_bytes(model)
        for batch in batches:
            result = measure(model, batch)
            rows.append({"method": method, "batch": batch, "weight_bytes": size, **result})
            print(f"{method:8s} batch {batch:3d}: {result['tokens_per_s']:8.1f} tok/s, "
                  f"TTFT {result['ttft_ms']:.1f} ms, weights {size / 2**30:.2f} GiB", flush=True)
        if model is not base:
            del model
            torch.cuda.empty_cache()
    by_batch = {r["batch"]: r["tokens_per_s"] for r in rows if r["method"] == "bf16"}
    for row in rows:
        if row["batch"] in by_batch:
            row["vs_bf16"] = row["tokens_per_s"] / by_batch[row["batch"]]
    print("| method | batch | tokens/s | vs bf16 | TTFT ms | weight GiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['batch']} | {r['tokens_per_s']:.1f} | {r.get('vs_bf16', float('nan')):.2f}x "
              f"| {r['ttft_ms']:.1f} | {r['weight_bytes'] / 2**30:.2f} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "rows": rows}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
