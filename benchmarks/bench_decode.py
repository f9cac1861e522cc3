"""Decode benchmark: the built-in decoder at Llama-3-8B shapes (32 layers, hidden 4096, 32
heads / 8 KV heads, MLP 14336, vocab 128256; seeded random weights; bf16 KV cache), greedy
generation of 128 tokens after a 16-token prompt, compiled and replayed in CUDA graphs.

Compiled region by region: each transformer block, the final norm and the LM head are
compiled with ``torch.compile(fullgraph=True, dynamic=False)``; the blocks share their compiled
code (PyTorch's regional compilation), so each batch size costs one block's worth of compile
(compiling the whole step took minutes per graph). The prefill and the decode step, compiled regions and the eager ops between them
(embedding, last-position slice, argmax, the position update), are then captured in one CUDA
graph each, as a serving engine does: a decode step is one graph launch, with no per-step
host work or synchronization to time.

Per method (bf16, ours, torchao ``Int4WeightOnlyConfig(group_size=32,
int4_packing_format="tile_packed_to_4d")``) and batch size: tokens/s over 128 decode-step
replays, time to first token (one prefill replay) and the weight bytes, and whether the
graphed tokens follow eager generation. All methods run in one process on one GPU, batch by
batch, each phase's time printed as it ends. A batch's graphs are built for every method
first; then ``--rounds`` generations are timed per method, interleaved (the method order
reversed every other round), so a drift of the GPU's speed during the run reaches every
method alike; the table reports each method's median and the range of its per-round ratio
to bf16.

    python benchmarks/bench_decode.py [--methods bf16,ours,torchao] [--batches 1,4,16] [--rounds 3] [--json out.json]
        [--markdown table.md]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from typing import Dict, List, Optional

import torch
from bench_gemm import write_json, write_markdown

import coalesced_int4 as ci4
from coalesced_int4.decoder import LLAMA3_8B, build_decoder, generate
from coalesced_int4.kernels import autotune_launch_params

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
        return torch.compile(region, fullgraph=True, dynamic=False)

    for i, layer in enumerate(model.layers):
        model.layers[i] = compiled(layer)
    model.norm = compiled(model.norm)
    model.output = compiled(model.output)


def capture(step) -> torch.cuda.CUDAGraph:
    """``step`` run twice on a side stream (compiles, Inductor's and Triton's first-call work),
    then captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


class GraphedGeneration:
    """Greedy generation for ``batch`` sequences of a seeded prompt: ``prefill`` and
    ``decode`` are the step functions (compiled regions and the eager ops between them, under
    ``no_grad``),
    ``prefill_graph`` and ``decode_graph`` their CUDA graphs. ``token`` holds each sequence's
    last token, ``position`` its position: every decode replay advances both.

    Built after eager steps with split-K timing on: every INT4 shape is tuned before tracing,
    so the compiled graphs get each shape's picked config and split alone (docs/design.md,
    "Tracing picks"); compiling and capturing stay inside the context, where the picks are
    read back."""

    def __init__(self, model, batch: int, label: str):
        self.model, self.batch = model, batch
        generator = torch.Generator(device="cpu").manual_seed(batch)
        self.prompt = torch.randint(0, model.config.vocab_size, (batch, PROMPT), generator=generator).cuda()
        self.prompt_positions = torch.arange(PROMPT, device="cuda")
        self.token = torch.zeros(batch, 1, dtype=torch.long, device="cuda")
        self.position = torch.zeros(1, dtype=torch.long, device="cuda")
        phase = Phases(f"{label} batch {batch}")
        with autotune_launch_params():
            with torch.compiler.set_stance("force_eager"):
                self.eager_tokens, _ = generate(model, self.prompt, 2)
            phase.done("eager warm-up and tuning")
            model.setup_cache(batch)
            self.prefill_graph = capture(self.prefill)
            phase.done("prefill compile and capture")
            self.decode_graph = capture(self.decode)
            phase.done("decode-step compile and capture")

    @torch.no_grad()
    def prefill(self) -> None:
        logits = self.model(self.prompt, self.prompt_positions)[:, -1]
        self.token.copy_(logits.argmax(-1, keepdim=True))
        self.position.fill_(PROMPT)

    @torch.no_grad()
    def decode(self) -> None:
        self.token.copy_(self.model(self.token, self.position)[:, -1].argmax(-1, keepdim=True))
        self.position.add_(1)

    def restart(self) -> None:
        """An empty KV cache (zeroed in place: the captured addresses stay valid)."""
        self.model.setup_cache(self.batch)


def generate_once(run: GraphedGeneration) -> Dict[str, float]:
    """One graphed generation from an empty cache: TTFT, then 128 timed decode replays."""
    batch = run.batch
    tokens = torch.empty(batch, NEW_TOKENS + 1, dtype=torch.long, device="cuda")
    run.restart()
    torch.cuda.synchronize()
    start = time.perf_counter()
    run.prefill_graph.replay()
    torch.cuda.synchronize()
    ttft = time.perf_counter() - start
    tokens[:, 0:1].copy_(run.token)
    start = time.perf_counter()
    for i in range(1, NEW_TOKENS + 1):
        run.decode_graph.replay()
        tokens[:, i:i + 1].copy_(run.token)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"tokens_per_s": batch * NEW_TOKENS / seconds, "ttft_ms": ttft * 1e3,
            "first_tokens": tokens[0, :8].tolist(),
            "matches_eager": int((tokens[:, :2] == run.eager_tokens).sum()) / run.eager_tokens.numel()}


def measure_batch(models: Dict[str, torch.nn.Module], batch: int, rounds: int) -> Dict[str, List[dict]]:
    """Every method's graphs for ``batch``, then ``rounds`` interleaved generations each: the
    samples per method, each tagged with its round. A method that fails is reported and left
    out of that step; the others still count."""
    def attempt(method, work):
        try:
            return work()
        except Exception as error:
            print(f"{method:8s} batch {batch:3d}: failed: {type(error).__name__}: {error}", flush=True)
            return None

    runs = {method: attempt(method, lambda: GraphedGeneration(model, batch, method))
            for method, model in models.items()}
    runs = {method: run for method, run in runs.items() if run is not None}
    samples = {method: [] for method in runs}
    for round_index in range(rounds):
        order = list(runs) if round_index % 2 == 0 else list(reversed(runs))
        for method in order:
            sample = attempt(method, lambda: generate_once(runs[method]))
            if sample is None:
                continue
            samples[method].append({**sample, "round": round_index})
            print(f"{method:8s} batch {batch:3d} round {round_index + 1}: {sample['tokens_per_s']:8.1f} tok/s, "
                  f"TTFT {sample['ttft_ms']:.1f} ms, first tokens as eager {sample['matches_eager']:.0%}",
                  flush=True)
    return samples


def summarize(method: str, batch: int, size: int, taken: List[dict], bf16: List[dict]) -> dict:
    """A method's row: medians over its rounds; ratios to bf16's sample of the same round."""
    rates = [sample["tokens_per_s"] for sample in taken]
    row = {"method": method, "batch": batch, "weight_bytes": size,
           "tokens_per_s": statistics.median(rates), "tokens_per_s_rounds": rates,
           "ttft_ms": statistics.median(sample["ttft_ms"] for sample in taken),
           "first_tokens": taken[0]["first_tokens"], "matches_eager": taken[0]["matches_eager"]}
    base = {sample["round"]: sample["tokens_per_s"] for sample in bf16}
    ratios = [sample["tokens_per_s"] / base[sample["round"]] for sample in taken if sample["round"] in base]
    if ratios:
        row["vs_bf16_rounds"] = ratios
        row["vs_bf16"] = statistics.median(ratios)
    return row


def compiled_models(methods: List[str]) -> Dict[str, torch.nn.Module]:
    """The Llama-3-8B-shaped decoder per method (one seeded bf16 model, quantized copies),
    each compiled region by region."""
    # A graph per (method, batch, prefill or decode) for each region's code: above dynamo's
    # default limits, later measurements would silently run eager.
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    base = build_decoder(LLAMA3_8B, seed=0, device="cuda")
    models = {}
    for method in methods:
        start = time.perf_counter()
        models[method] = base if method == "bf16" else quantized(base, method)
        print(f"# {method}: quantized in {time.perf_counter() - start:.1f} s", flush=True)
    for model in models.values():  # after every copy of the base model is made
        compile_regions(model)
    return models


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="bf16,ours,torchao")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--rounds", type=int, default=3, help="timed generations per method and batch")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None, help="write the table, stamped with its environment, here")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    models = compiled_models(args.methods.split(","))
    sizes = {method: weight_bytes(model) for method, model in models.items()}
    rows = []
    # Batch by batch, every method in turn: a run cut short still compares the methods.
    for batch in batches:
        samples = measure_batch(models, batch, args.rounds)
        for method, taken in samples.items():
            if taken:
                rows.append(summarize(method, batch, sizes[method], taken, samples.get("bf16", [])))
        torch.cuda.empty_cache()
    table = ["| method | batch | tokens/s (median) | vs bf16 (median, rounds' range) | TTFT ms | weight GiB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ratios = r.get("vs_bf16_rounds")
        vs_bf16 = f"{r['vs_bf16']:.2f}x ({min(ratios):.2f}-{max(ratios):.2f})" if ratios else "-"
        table.append(f"| {r['method']} | {r['batch']} | {r['tokens_per_s']:.1f} | {vs_bf16} "
                     f"| {r['ttft_ms']:.1f} | {r['weight_bytes'] / 2**30:.2f} |")
    print("\n".join(table))
    if args.markdown:
        write_markdown(args.markdown, table)
    if args.json:
        write_json(args.json, rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
