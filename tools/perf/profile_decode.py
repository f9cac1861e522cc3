"""Where a compiled decode step's time goes, kernel by kernel (bench_decode.py's model, batch
and CUDA graphs).

Per method: the decode step's CUDA-graph replay time (events around ``--steps`` replays), and
the kernels of the same step run without its graph under ``torch.profiler`` (the same
compiled code and binaries; the graph only closes the launch gaps), summed per kind: our INT4
GEMMs, our split-K reductions, other GEMMs (cuBLAS, torchao's tinygemm), attention, and
everything else (norms, rotary, KV-cache writes, argmax, copies). Replay time above the
kernel sum is time between kernels inside the graph.

    python tools/perf/profile_decode.py [--methods ours,bf16] [--batch 1] [--steps 8] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import sys
from typing import Dict, List, Optional

import benchmarks_on_path  # noqa: F401  (benchmarks/ on sys.path)
import torch
from bench_decode import GraphedGeneration, compiled_models
from torch.profiler import ProfilerActivity, profile

KINDS = (  # (kind, substrings of the kernel name), first match wins
    ("INT4 GEMM (ours)", ("_w4a8_kernel", "_w4a16_kernel")),
    ("split-K reduction (ours)", ("_splitk_reduce",)),
    ("other GEMM (cuBLAS, tinygemm)", ("gemm", "gemv", "nvjet", "xmma", "cutlass")),
    ("attention", ("attention", "flash", "fmha")),
)
OTHER = "everything else"


def kind_of(kernel: str) -> str:
    lowered = kernel.lower()
    for kind, parts in KINDS:
        if any(part in lowered for part in parts):
            return kind
    return OTHER


def replay_us(run: GraphedGeneration, steps: int) -> float:
    """Microseconds per decode-step replay, after a fresh prefill."""
    run.restart()
    run.prefill_graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        run.decode_graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / steps


def kernel_us(run: GraphedGeneration, steps: int) -> Dict[str, List[float]]:
    """Per kernel name: [device microseconds per step, launches per step]."""
    run.restart()
    run.prefill_graph.replay()
    run.decode()  # outside the profile: nothing left to compile or tune
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            run.decode()
        torch.cuda.synchronize()
    totals: Dict[str, List[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name][0] += event.time_range.elapsed_us() / steps
            totals[event.name][1] += 1 / steps
    return dict(totals)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="ours,bf16")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args(argv)
    for method, model in compiled_models(args.methods.split(",")).items():
        run = GraphedGeneration(model, args.batch, method)
        step_us = replay_us(run, args.steps)
        kernels = kernel_us(run, args.steps)
        total = sum(us for us, _ in kernels.values())
        print(f"# {method} batch {args.batch}: decode step {step_us:.0f} us as a graph replay; kernels "
              f"{total:.0f} us per step ({sum(n for _, n in kernels.values()):.0f} launches)", flush=True)
        by_kind: Dict[str, List[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        for name, (us, launches) in kernels.items():
            by_kind[kind_of(name)][0] += us
            by_kind[kind_of(name)][1] += launches
        print("| method | kind | us per step | launches per step | share of the replay |")
        print("|---|---|---|---|---|")
        for kind, (us, launches) in sorted(by_kind.items(), key=lambda item: -item[1][0]):
            print(f"| {method} | {kind} | {us:.0f} | {launches:.0f} | {us / step_us:.0%} |")
        print(f"| {method} | between kernels (replay - kernel sum) | {step_us - total:.0f} | | "
              f"{(step_us - total) / step_us:.0%} |")
        print("| method | kernel | us per step | launches per step |")
        print("|---|---|---|---|")
        for name, (us, launches) in sorted(kernels.items(), key=lambda item: -item[1][0])[:args.top]:
            print(f"| {method} | {name[:90]} | {us:.1f} | {launches:.0f} |", flush=True)
        del run
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
