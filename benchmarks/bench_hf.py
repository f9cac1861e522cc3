"""Hugging Face ``generate`` benchmark: a Llama-3-8B-shaped ``LlamaForCausalLM`` (32 layers,
hidden 4096, 32 heads / 8 KV heads, MLP 14336, vocab 128256, untied head; seeded random bf16
weights built from a config on the GPU), greedy generation after a 16-token prompt, as a
transformers user runs it:

- compiled: ``generate(..., cache_implementation="static")``, which makes transformers compile
  the decode step (and replay it in CUDA graphs); two untimed generations first compile and
  capture each batch size;
- eager: ``generate`` with transformers' default dynamic cache, nothing compiled.

Per method (bf16; ours, ``coalesced_int4.quantize_``; torchao
``Int4WeightOnlyConfig(group_size=32)``, each quantizing every linear, the head included) and
batch size: decode tokens/s (the new tokens after the first, over the time after the first),
time to first token (a one-token generation), peak GPU memory of the generation, and the
weights' bytes. All methods run in one process on one GPU, one model at a time (a quantized
copy is made from the bf16 model, measured, and freed), each phase printed as it ends.

Eager generation runs at ``--eager-batches`` (default batch 1: what eager users run). A run
may be split over processes (one method each, say): ``--include-json`` puts the rows of
earlier runs' JSON files (same GPU) into this run's table, so the bf16 column of "vs bf16"
can come from another run; the JSON is rewritten after every row.

    python benchmarks/bench_hf.py [--methods bf16,ours,torchao] [--batches 1,4,16] [--eager-batches 1]
        [--new-tokens 64] [--eager-tokens 16] [--layers 32] [--include-json earlier.json ...]
        [--json out.json] [--markdown table.md]
"""

from __future__ import annotations

import argparse
import copy
import time
from typing import Dict, List, Optional

import torch
from bench_gemm import read_json_rows, write_json, write_markdown

import coalesced_int4 as ci4
from coalesced_int4.hf_tools import weight_bytes

PROMPT = 16


def llama3_8b(layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128_256, hidden_size=4096, intermediate_size=14_336, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=1024,
                         rope_theta=500_000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    # A random model may sample its end-of-sequence token at any step: none is set, so every
    # generation runs its full length.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def quantized(base: torch.nn.Module, method: str) -> torch.nn.Module:
    if method == "bf16":
        return base
    model = copy.deepcopy(base)
    if method == "ours":
        ci4.quantize_(model, ci4.int4_config())
    elif method == "torchao":
        from torchao.quantization import Int4WeightOnlyConfig, quantize_

        quantize_(model, Int4WeightOnlyConfig(group_size=32))
    else:
        raise ValueError(f"unknown method {method!r}")
    return model


def _generate_seconds(model, ids, new_tokens: int, static: bool) -> float:
    options = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if static:
        options["cache_implementation"] = "static"
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **options)
    torch.cuda.synchronize()
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - start


def measure(model, batch: int, new_tokens: int, static: bool) -> Dict[str, float]:
    """Decode tokens/s, time to first token and peak memory of one batch size."""
    ids = torch.randint(0, 128_256, (batch, PROMPT), generator=torch.Generator().manual_seed(batch)).cuda()
    if static:  # compile and capture this batch size's prefill and decode step
        _generate_seconds(model, ids, new_tokens, static)
        _generate_seconds(model, ids, new_tokens, static)
    torch.cuda.reset_peak_memory_stats()
    first = min(_generate_seconds(model, ids, 1, static) for _ in range(3))
    whole = _generate_seconds(model, ids, new_tokens, static)
    return {"tokens_per_s": batch * (new_tokens - 1) / (whole - first), "ttft_ms": 1e3 * first,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="bf16,ours,torchao")
    parser.add_argument("--batches", default="1,4,16", help="batch sizes of compiled generation (empty: none)")
    parser.add_argument("--eager-batches", default="1", help="batch sizes of eager generation (empty: none)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens a compiled generation makes")
    parser.add_argument("--eager-tokens", type=int, default=16, help="tokens an eager generation makes")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--include-json", nargs="*", default=[], help="earlier runs' JSON files to tabulate too")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None, help="write the table, stamped with its environment, here")
    args = parser.parse_args(argv)
    # A graph per (method, batch, prefill or decode): above dynamo's default limits, later
    # measurements would silently run eager.
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    batches = {static: [int(b) for b in value.split(",") if b]  # "": none of that mode
               for static, value in ((True, args.batches), (False, args.eager_batches))}
    rows = [row for path in args.include_json for row in read_json_rows(path, layers=args.layers)]
    base = llama3_8b(args.layers)
    for method in args.methods.split(","):
        start = time.perf_counter()
        model = quantized(base, method)
        print(f"# {method}: quantized in {time.perf_counter() - start:.1f} s", flush=True)
        size = weight_bytes(model)
        for static, tokens in ((True, args.new_tokens), (False, args.eager_tokens)):
            mode = "compiled" if static else "eager"
            for batch in batches[static]:
                start = time.perf_counter()
                row = {"method": method, "mode": mode, "batch": batch, "weight_gib": size / 2**30,
                       **measure(model, batch, tokens, static)}
                rows.append(row)
                print(f"# {method} {mode} batch {batch}: {row['tokens_per_s']:.1f} tokens/s, TTFT "
                      f"{row['ttft_ms']:.1f} ms ({time.perf_counter() - start:.1f} s)", flush=True)
                if args.json:  # after every row: a run stopped by a time cap keeps what it measured
                    write_json(args.json, layers=args.layers, rows=rows)
        if model is not base:
            del model
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    bf16 = {(r["mode"], r["batch"]): r["tokens_per_s"] for r in rows if r["method"] == "bf16"}
    table = ["| method | mode | batch | tokens/s | vs bf16 | TTFT ms | peak GiB | weight GiB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base_rate = bf16.get((r["mode"], r["batch"]))
        vs_bf16 = f"{r['tokens_per_s'] / base_rate:.2f}x" if base_rate else "-"
        table.append(f"| {r['method']} | {r['mode']} | {r['batch']} | {r['tokens_per_s']:.1f} | {vs_bf16} "
                     f"| {r['ttft_ms']:.1f} | {r['peak_gib']:.1f} | {r['weight_gib']:.2f} |")
    print("\n".join(table))
    if args.markdown:
        write_markdown(args.markdown, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
