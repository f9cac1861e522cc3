"""Default launches against tuned ones: what a user gets without ``coalesced_int4.autotune()``.

Per (N, K, M), in one process whose pick store starts empty (a fresh temporary directory):

1. default, empty store: our GEMM launched as an untuned process launches it (the launch
   parameters from the default rule, ``configs.default_split_k``; the tile config from the
   Triton autotuner at that split), timed as bench_gemm times (a CUDA graph rotating over
   weight copies beyond the L2);
2. tuned: the same inside ``autotune()`` (every launch-parameter candidate timed, the pick
   stored), timed the same way; every candidate's time is kept in the JSON;
3. default, warm store: the in-memory picks dropped (as a new process starts), launched again
   outside ``autotune()``, so the stored picks are restored.

The table gives each time and the ratios default / tuned (the worst is the headline). The JSON
is rewritten after every row; ``--include-json`` puts the rows of earlier runs on the same GPU
first in this run's table, so that shapes measured in separate processes (each with its own
empty store) make one table.

    python benchmarks/bench_defaults.py [--shapes 4096x4096,...] [--ms 1,2,4,8,16,32,64]
        [--include-json earlier.json ...] [--json out.json] [--markdown table.md]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import List, Optional

import torch
from bench_gemm import (
    INT4_BYTES_PER_WEIGHT,
    LLAMA3_8B_SHAPES,
    bucket_for,
    random_int4_weights,
    read_json_rows,
    settle_launch_state,
    write_json,
    write_markdown,
)

import coalesced_int4 as ci4
from coalesced_int4.kernels import BUCKET_KERNELS, clear_launch_param_cache, launch
from coalesced_int4.kernels.autotune.cuda_graph_timing import copies_beyond_l2, time_back_to_back_us
from coalesced_int4.kernels.ops.int4_gemm import decided_launch

M_VALUES = (1, 2, 4, 8, 16, 32, 64)
SHAPES = tuple(shape for shape in LLAMA3_8B_SHAPES if shape != (6144, 4096))


def _params(choice: dict) -> str:
    return ", ".join(f"{name} {value}" for name, value in choice.items())


def _line(row: dict) -> str:
    return (f"| {row['N']}x{row['K']} | {row['M']} | {row['default_us']:.1f} | {row['tuned_us']:.1f} "
            f"| {row['default_us'] / row['tuned_us']:.2f} | {row['warm_us'] / row['tuned_us']:.2f} "
            f"| {_params(row['default_choice'])} | {_params(row['tuned_choice'])} |")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES))
    parser.add_argument("--ms", default=",".join(map(str, M_VALUES)))
    parser.add_argument("--include-json", nargs="*", default=[], help="earlier runs' JSON files to tabulate too")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None, help="write the table, stamped with its environment, here")
    args = parser.parse_args(argv)
    # The pick store is found through the environment at each lookup: an empty one from here on.
    os.environ["COALESCED_INT4_CACHE_DIR"] = tempfile.mkdtemp(prefix="coalesced-int4-picks-")

    def timed(bucket, x, copies) -> float:
        return time_back_to_back_us([lambda w=w: launch(bucket, x, *w, 32) for w in copies])

    settle_launch_state(torch.device("cuda"))
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.ms.split(",")]
    table = ["| N x K | M | default µs (empty store) | tuned µs | default / tuned | warm store / tuned "
             "| default launch | tuned launch |", "|---|---|---|---|---|---|---|---|"]
    rows = [row for path in args.include_json for row in read_json_rows(path)]
    table += [_line(row) for row in rows]
    print("\n".join(table), flush=True)
    for n, k in shapes:
        copies = random_int4_weights(n, k, copies_beyond_l2(n * k * INT4_BYTES_PER_WEIGHT))
        for m in ms:
            bucket = bucket_for(m)
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            default = decided_launch(bucket, x, *copies[0])  # no pick yet: the default rule's
            default_us = timed(bucket, x, copies)
            with ci4.autotune() as stats:
                tuned_us = timed(bucket, x, copies)
            pick = stats.picks[-1] if stats.picks else None
            clear_launch_param_cache()
            for kernel in BUCKET_KERNELS.values():
                kernel.cache.clear()
            warm_us = timed(bucket, x, copies)
            row = {"N": n, "K": k, "M": m, "default_us": default_us, "tuned_us": tuned_us, "warm_us": warm_us,
                   "default_choice": default, "tuned_choice": stats.choices[-1],
                   "candidates_us": {str(c): t for c, t in pick.times_us.items()} if pick else {}}
            rows.append(row)
            table.append(_line(row))
            print(table[-1], flush=True)
            if args.json:
                write_json(args.json, rows=rows)
    worst = max(r["default_us"] / r["tuned_us"] for r in rows)
    warm = max(r["warm_us"] / r["tuned_us"] for r in rows)
    table.append("")
    table.append(f"Worst default / tuned: {worst:.2f} (empty store), {warm:.2f} (warm store).")
    print(table[-1])
    if args.markdown:
        write_markdown(args.markdown, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
