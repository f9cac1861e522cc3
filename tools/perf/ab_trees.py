"""In-process A/B of the INT4 GEMMs of source trees (a baseline and its variants): same
weights, same activations, same tile config and split-K, timed in alternation, outputs checked
bit for bit.

Why in one process: a cell timed in two processes moves by a few percent on its own, as much
as a kernel change worth making. Here each tree's
``coalesced_int4`` is copied under a name of its own (``ci4_tree0``, ``ci4_tree1``, ...; every
mention of the package renamed, so its modules and its torch op namespace register apart),
each case is tuned once by the baseline (the first tree), and its pick (tile config and launch
parameters) runs on every tree, so the comparison is of the kernel code alone and the outputs
must be bit-identical. In each round of a case the trees and bf16 ``F.linear`` take turns,
each round starting with the next of them (``bench_gemm.time_in_rounds``); the report gives
each tree's median over the rounds, its ratio to the baseline's (median and round by round),
and bf16's median for scale; the exit status is 1 where any output's bits differ.
Timing is bench_gemm's (CUDA graphs rotating over weight copies beyond twice the L2),
after the process's fast graph captures are used up (``bench_gemm.settle_launch_state``).

    python tools/perf/ab_trees.py BASELINE VARIANT [VARIANT ...] [--cases 4096x4096x64,...] [--rounds 3] [--json F]

A tree is a folder holding ``coalesced_int4/``, e.g. ``git archive BRANCH coalesced_int4 | tar
x -C FOLDER``. A variant's kernels must take the baseline's config names.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import benchmarks_on_path  # noqa: F401  (benchmarks/ on sys.path)
import torch
from bench_gemm import (  # noqa: E402
    INT4_BYTES_PER_WEIGHT,
    bf16_calls,
    bucket_for,
    last_config,
    random_int4_weights,
    settle_launch_state,
    time_in_rounds,
    tuned_launch_params,
)

from coalesced_int4.kernels.autotune.cuda_graph_timing import copies_beyond_l2  # noqa: E402

PACKAGE = "coalesced_int4"
# The cells nearest bf16 at M = 49-64, 39936x6656 at M = 64 (the capped
# TMA config's pick), and one of each other W4A16 bucket on the same shapes, so that a change
# for bucket 64 is seen not to cost the others.
DEFAULT_CASES = ("4096x4096x49,4096x4096x56,4096x4096x64,6144x4096x64,6656x4096x64,"
                 "14336x4096x49,14336x4096x56,8448x6656x64,4096x14336x64,39936x6656x64,"
                 "4096x4096x8,4096x4096x16,14336x4096x16,4096x4096x32,14336x4096x32")


def export_kernels(tree: Path, name: str, into: Path):
    """Copy ``tree``'s package into ``into`` as ``name`` (every mention of the package renamed)
    and import its ``kernels``."""
    source = tree / PACKAGE
    if not (source / "__init__.py").is_file():
        raise FileNotFoundError(f"{tree} holds no {PACKAGE}/__init__.py")
    target = into / name
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    mention = re.compile(rf"\b{PACKAGE}\b")
    for path in target.rglob("*.py"):
        path.write_text(mention.sub(name, path.read_text()))
    if str(into) not in sys.path:
        sys.path.insert(0, str(into))
    return importlib.import_module(f"{name}.kernels")


def parse_cases(text: str) -> List[Tuple[int, int, int]]:
    """``NxKxM,...`` -> [(N, K, M), ...]."""
    cases = []
    for item in text.split(","):
        n, k, m = (int(v) for v in item.split("x"))
        cases.append((n, k, m))
    return cases


def run_case(trees: Sequence, n: int, k: int, m: int, rounds: int) -> dict:
    """One case: each tree's µs per round, bf16's median µs (the trees and bf16 take turns,
    ``time_in_rounds``), and which trees' outputs are bit-identical to the first tree's."""
    bucket = bucket_for(m)
    copies = random_int4_weights(n, k, copies_beyond_l2(n * k * INT4_BYTES_PER_WEIGHT))
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    baseline = trees[0]
    params = tuned_launch_params(bucket, x, copies[0], baseline)
    pick = dict(params, config=baseline.BUCKET_KERNELS[bucket].best_config)
    described = " ".join(f"{key}={value}" for key, value in params.items()) + " " + last_config(bucket, baseline)
    outputs = [kernels.launch(bucket, x, *copies[0], 32, **pick) for kernels in trees]
    labels = [f"tree{index}" for index in range(len(trees))]
    methods = {label: {m: [lambda w=w, kernels=kernels: kernels.launch(bucket, x, *w, 32, **pick) for w in copies]}
               for label, kernels in zip(labels, trees)}
    methods["bf16"] = bf16_calls(n, k, [m])
    times, failures = time_in_rounds(methods, rounds)
    if failures:
        raise next(iter(failures.values()))
    del copies, methods
    torch.cuda.empty_cache()
    return {"N": n, "K": k, "M": m, "bucket": bucket, "pick": described,
            "us": [times[label][m] for label in labels], "bf16_us": statistics.median(times["bf16"][m]),
            "bit_identical": [torch.equal(outputs[0], out) for out in outputs]}


def report_rows(result: dict, labels: Sequence[str]) -> List[str]:
    """One row a tree: its median µs, against the first tree's (median and round by round)
    and against bf16."""
    base = result["us"][0]
    rows = []
    for label, series, same in zip(labels, result["us"], result["bit_identical"]):
        us = statistics.median(series)
        rounds = " ".join(f"{b / a:.3f}" for a, b in zip(base, series))
        rows.append(f"| {result['N']}x{result['K']} | {result['M']} | {label} | {us:.2f} | "
                    f"{us / statistics.median(base):.3f} | {rounds} | {result['bf16_us'] / us:.2f}x | "
                    f"{'same' if same else 'DIFFER'} |")
    return rows


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trees", type=Path, nargs="+", help="the baseline tree, then one or more variants")
    parser.add_argument("--cases", default=DEFAULT_CASES, help="NxKxM,... (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if len(args.trees) < 2:
        parser.error("give a baseline tree and at least one variant")
    into = Path(tempfile.mkdtemp(prefix="ab_trees-"))
    trees = [export_kernels(tree.resolve(), f"ci4_tree{index}", into) for index, tree in enumerate(args.trees)]
    labels = [str(tree) for tree in args.trees]
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}; trees {', '.join(labels)} "
          f"(the first is the baseline and tunes each case); {args.rounds} rounds", flush=True)
    header = "| N x K | M | tree | us | / baseline | / baseline per round | vs bf16 | bits |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1), flush=True)
    settle_launch_state(torch.device("cuda"))
    results = []
    for n, k, m in parse_cases(args.cases):
        results.append(run_case(trees, n, k, m, args.rounds))
        print(f"# {n}x{k} M={m}: bf16 {results[-1]['bf16_us']:.2f} us; pick {results[-1]['pick']}")
        print("\n".join(report_rows(results[-1], labels)), flush=True)
        if args.json:  # case by case, so that a run cut off by a time limit keeps what it timed
            Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                                   "trees": labels, "results": results}, indent=1))
    return 0 if all(all(result["bit_identical"]) for result in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
