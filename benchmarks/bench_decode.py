"""Decode benchmark: the built-in decoder at Llama-3-8B shapes (32 layers, hidden 4096, 32
heads / 8 KV heads, MLP 14336, vocab 128256; seeded random weights; bf16 KV cache), greedy
generation of 128 tokens after a 16-token prompt, compiled region by region: each transformer
block, the final norm and the LM head are compiled with ``torch.compile(mode="reduce-overhead",
fullgraph=True, dynamic=False)`` (CUDA graphs), and the ops between them (embedding lookup,
last-position slice, argmax) run eager. Why regions: compiling the whole step took more than
2 minutes per graph on the H200 machine (2026-11-30: one prefill graph was not done after
125 s), and the benchmark needs a prefill and a decode graph per method and batch size; the
blocks share their compiled code (PyTorch's regional compilation), so each graph is one
block's worth of compile.

Per method (bf16, ours, torchao ``Int4WeightOnlyConfig(group_size=32,
int4_packing_format="tile_packed_to_4d")``) and batch size: tokens/s over the 128 decode steps
(after a warm-up generation that compiles), time to first token (the compiled prefill), and the
weight bytes. All methods run in one process on one GPU, batch by batch, each phase's time
printed as it ends.

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
from coalesced_int4.decoder import LLAMA3_8B, build_decoder, generate

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


class Phases:
    """Prints how long each phase of a measurement took, as it ends (a run cut short by its
    time cap still shows where the time went)."""

    def __init__(self, label: str):
        self.label = label
        self.start = time.perf_counter()

    def done(self, phase: str) -> None:
        torch.cuda.synchronize()
        now = time.perf_counter()
        print(f"# {self.label}: {phase} {now - self.start:.1f} s", flush=True)
        self.start = now


def compile_regions(model) -> None:
    """Replace each block, the final norm and the LM head by its compiled module (see the
    module docstring). Static shapes: each batch size gets its own graphs, as a server
    compiles per batch size; automatic dynamic shapes would make M symbolic and unbounded
    (M > 64 falls back). (``Module.compile`` in place is not used: on an ``nn.Linear`` with an
    INT4 weight, Dynamo failed to trace the subclass's ``__torch_function__`` table lookup with
    torch 2.13.)"""
    def compiled(region):
        return torch.compile(region, mode="reduce-overhead", fullgraph=True, dynamic=False)

    for i, layer in enumerate(model.layers):
        model.layers[i] = compiled(layer)
    model.norm = compiled(model.norm)
    model.output = compiled(model.output)


def measure(model, batch: int, label: str) -> Dict[str, float]:
    generator = torch.Generator(device="cpu").manual_seed(batch)
    prompt = torch.randint(0, model.config.vocab_size, (batch, PROMPT), generator=generator).cuda()
    positions = torch.arange(PROMPT, device="cuda")
    # Eager steps first, with split-K timing on: every INT4 shape is tuned before tracing, so
    # the compiled graphs get each shape's picked config and split alone (docs/design.md,
    # "Tracing picks").
    with torch.no_grad(), autotune_launch_params():
        phase = Phases(f"{label} batch {batch}")
        with torch.compiler.set_stance("force_eager"):
            generate(model, prompt, 2)
        phase.done("eager warm-up and tuning")
        model.setup_cache(batch)
        for _ in range(3):  # compile, record the CUDA graphs, replay
            model(prompt, positions)
        phase.done("prefill compile")
        generate(model, prompt, 8)
        phase.done("decode-step compile")
    with torch.no_grad():
        model.setup_cache(batch)
        start = time.perf_counter()
        model(prompt, positions)
        torch.cuda.synchronize()
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        tokens, _ = generate(model, prompt, NEW_TOKENS)
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
    # A graph per (method, batch, prefill or decode) for each region's code: above dynamo's
    # default limits, later measurements would silently run eager.
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    base = build_decoder(LLAMA3_8B, seed=0, device="cuda")
    models = {}
    for method in args.methods.split(","):
        start = time.perf_counter()
        models[method] = base if method == "bf16" else quantized(base, method)
        print(f"# {method}: quantized in {time.perf_counter() - start:.1f} s", flush=True)
    for model in models.values():  # after every copy of the base model is made
        compile_regions(model)
    rows = []
    # Batch by batch, every method in turn: a run cut short still compares the methods.
    for batch in batches:
        for method, model in models.items():
            size = weight_bytes(model)
            result = measure(model, batch, method)
            rows.append({"method": method, "batch": batch, "weight_bytes": size, **result})
            print(f"{method:8s} batch {batch:3d}: {result['tokens_per_s']:8.1f} tok/s, "
                  f"TTFT {result['ttft_ms']:.1f} ms, weights {size / 2**30:.2f} GiB", flush=True)
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
