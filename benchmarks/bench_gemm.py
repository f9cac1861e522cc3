"""Kernel benchmark: our INT4 GEMM against bf16 F.linear (cuBLAS), torch's tinygemm int4
(group 32) and gemlite 0.6 (int4, group 32, bf16), per (N, K, M).

Method: each method gets enough copies of its weights to exceed twice the L2
cache, a CUDA graph of many calls rotating over the copies is captured, and its replays are
timed with CUDA events: weights come from HBM and launch overhead is out. Before anything is
timed the process's fast graph captures are used up (``settle_launch_state``). A shape's
methods are timed in alternation, ``--rounds`` times, each round starting with the next
method, and each cell reports its median (``time_in_rounds``). Our split-K (and, at M <= 4,
whether the activations are quantized by a kernel of their own first) is the library's own
pick (``autotune_launch_params``), our tile config its autotuner's pick. The
memory floor is (weight + activation + output bytes) / the HBM read bandwidth measured here.

    python benchmarks/bench_gemm.py [--shapes 8448x6656,4096x4096] [--ms 1,4,16] [--rounds 3] [--json out.json]
        [--markdown table.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

import coalesced_int4.kernels as our_kernels
from coalesced_int4.kernels import SUPPORTED_BUCKETS, launch
from coalesced_int4.kernels.autotune.cuda_graph_timing import copies_beyond_l2, time_back_to_back_us
from coalesced_int4.kernels.runtime import dependent_launch
from coalesced_int4.kernels.runtime.dependent_launch import let_next_kernel_launch, wait_for_previous_kernel
from coalesced_int4.kernels.runtime.device import multiprocessors
from coalesced_int4.quantize import stored_k

MODEL_SHAPES = ((8448, 6656), (6656, 4096), (39936, 6656), (6656, 19968), (256, 6656))
LLAMA3_8B_SHAPES = ((4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336), (128256, 4096))
M_VALUES = (1, 2, 3, 4, 8, 16, 32, 64)
INT4_BYTES_PER_WEIGHT = 4.625 / 8


def bucket_for(m: int) -> int:
    """The bucket dispatch runs for M (the smallest that covers it)."""
    return next(b for b in SUPPORTED_BUCKETS if b >= m)


def l2_bytes() -> int:
    return torch.cuda.get_device_properties(0).L2_cache_size


def hbm_read_bandwidth() -> float:
    """Bytes/s of a large reduction (reads 4 GiB, writes nothing worth counting)."""
    data = torch.randn(2**31 // 2, device="cuda", dtype=torch.bfloat16).view(-1, 2**20)
    out = torch.empty(data.shape[0], device="cuda", dtype=torch.float32)
    fn = lambda: torch.sum(data, dim=1, out=out)  # noqa: E731
    us = time_back_to_back_us([fn], min_calls=20)
    return data.numel() * data.element_size() / (us * 1e-6)


def random_int4_weights(n: int, k: int, copies: int):
    """``copies`` random weights of K columns, stored as the format stores them (``stored_k``)."""
    stored = stored_k(k)
    out = []
    for _ in range(copies):
        out.append((
            torch.randint(0, 256, (n, stored // 2), dtype=torch.uint8, device="cuda"),
            torch.randint(0, 256, (n, stored // 32), dtype=torch.uint8, device="cuda"),
            (torch.rand(n, stored // 256, device="cuda") * 1e-3).half(),
            torch.randint(0, 256, (n, stored // 32), dtype=torch.uint8, device="cuda"),
            (torch.rand(n, stored // 256, device="cuda") * 0.06).half(),
        ))
    return out


def tuned_launch_params(bucket, x, weights, kernels=our_kernels) -> dict:
    """The launch parameters (split-K; for buckets 1-4 also ``prequantize``, for 8-64
    ``balanced``) our launch runs ``x`` on ``weights`` with: tuned now, or restored from the
    pick caches (the tile config is tuned or restored alongside). ``kernels``: the package's
    ``kernels`` module, or another source tree's (``ab_trees.py``)."""
    with kernels.autotune_launch_params() as stats:
        kernels.launch(bucket, x, *weights, 32)
    return stats.choices[-1]


def last_config(bucket, kernels=our_kernels) -> str:
    """The tile config of the bucket's last launch, e.g. ``BLOCK_N=16 GROUPS=32 ... warps=4``,
    and its register cap where it has one."""
    config = kernels.BUCKET_KERNELS[bucket].best_config
    cap = f" maxnreg={config.maxnreg}" if config.maxnreg else ""
    return " ".join(f"{key}={value}" for key, value in config.kwargs.items()) + f" warps={config.num_warps}{cap}"


Calls = Dict[int, List[Callable[[], object]]]
"""A method's calls at each M: one a weight copy, for ``time_back_to_back_us`` to rotate over."""


def ours_calls(n, k, ms, results) -> Calls:
    """Our launches, each M's launch parameters and tile config tuned (or restored) now and
    recorded in ``results``."""
    copies = random_int4_weights(n, k, copies_beyond_l2(n * k * INT4_BYTES_PER_WEIGHT))
    calls = {}
    for m in ms:
        bucket = bucket_for(m)
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        params = tuned_launch_params(bucket, x, copies[0])
        results[(n, k, m)].update(**params, config=last_config(bucket), bucket=bucket)
        calls[m] = [lambda w=w, x=x, bucket=bucket, params=params: launch(bucket, x, *w, 32, **params)
                    for w in copies]
    return calls


def bf16_calls(n, k, ms, results=None) -> Calls:
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
               for _ in range(copies_beyond_l2(n * k * 2))]
    calls = {}
    for m in ms:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        calls[m] = [lambda w=w, x=x: F.linear(x, w) for w in weights]
    return calls


def tinygemm_calls(n, k, ms, results=None) -> Calls:
    copies = []
    for _ in range(copies_beyond_l2(n * k * (0.5 + 4 / 32))):
        codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        packed = torch.ops.aten._convert_weight_to_int4pack(codes, 8)
        scales_zeros = (torch.rand(k // 32, n, 2, device="cuda") * 0.01).to(torch.bfloat16)
        copies.append((packed, scales_zeros))
    calls = {}
    for m in ms:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        calls[m] = [lambda p=p, s=s, x=x: torch.ops.aten._weight_int4pack_mm(x, p, 32, s) for p, s in copies]
    return calls


def gemlite_calls(n, k, ms, results=None) -> Calls:
    from gemlite import DType, GemLiteLinear

    layers = []
    for _ in range(copies_beyond_l2(n * k * (0.5 + 4 / 32))):
        layer = GemLiteLinear(W_nbits=4, group_size=32, in_features=k, out_features=n,
                              input_dtype=DType.BF16, output_dtype=DType.BF16)
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, device="cuda")
        scales = (torch.rand(n, k // 32, device="cuda") * 0.01).to(torch.bfloat16)
        zeros = torch.randint(0, 16, (n, k // 32), device="cuda").to(torch.bfloat16)
        layer.pack(codes, scales, zeros, bias=None)
        layers.append(layer)
    calls = {}
    for m in ms:
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        calls[m] = [lambda layer=layer, x=x: layer(x) for layer in layers]
    return calls


METHODS = {"ours": ours_calls, "bf16": bf16_calls, "tinygemm": tinygemm_calls, "gemlite": gemlite_calls}


SETTLING_CAPTURES = 8
"""Graphs of an empty kernel captured and timed, of each kind, before anything is timed: a
process's first few graphs of a kind replay faster than its later ones (up to seven with
dependent launch), which would favour whichever method is timed first."""


@triton.jit
def empty_kernel(DEPENDENT_LAUNCH: tl.constexpr):
    """Nothing, with dependent launch's wait and trigger where it is on: the settling graphs'
    kernel, and bench_reduce.py's floor."""
    wait_for_previous_kernel(DEPENDENT_LAUNCH)
    let_next_kernel_launch(DEPENDENT_LAUNCH)


def settle_launch_state(device: torch.device,
                        timer: Callable[[List[Callable[[], object]]], float] = time_back_to_back_us) -> None:
    """Use up the process's fast graph captures (``SETTLING_CAPTURES``), first those with
    dependent launch where the device has it, then those without, so that every method is
    timed in the state a process that has captured a few graphs stays in."""
    kinds = [dependent_launch.options(torch.empty(0, device=device))]
    if kinds[0]["DEPENDENT_LAUNCH"]:
        kinds.append({"DEPENDENT_LAUNCH": False})
    for options in kinds:
        call = lambda options=options: empty_kernel[(multiprocessors(device),)](**options)  # noqa: E731
        for _ in range(SETTLING_CAPTURES):
            timer([call])


def time_in_rounds(methods: Dict[str, Calls], rounds: int,
                   timer: Callable[[List[Callable[[], object]]], float] = time_back_to_back_us
                   ) -> Tuple[Dict[str, Dict[int, List[float]]], Dict[str, Exception]]:
    """Each method's µs at each of its M, once a round, and the methods that failed (an
    anchor that cannot run a shape is reported, not fatal: it loses its readings and its
    later turns). Within a round the methods take turns, and each round starts one method
    later than the last, so that no method is always timed first (the first few graphs timed
    in a process can read faster than the later ones)."""
    names = list(methods)
    times = {name: {m: [] for m in calls} for name, calls in methods.items()}
    failures: Dict[str, Exception] = {}
    for index in range(rounds):
        for turn in range(len(names)):
            name = names[(index + turn) % len(names)]
            if name in failures:
                continue
            try:
                for m, calls in methods[name].items():
                    times[name][m].append(timer(calls))
            except Exception as error:
                failures[name] = error
                del times[name]
    return times, failures


def environment_stamp() -> str:
    """One line naming what a table was measured on: GPU (or CPU), torch, Triton and the commit
    (``$COMMIT``, else ``git rev-parse``; "uncommitted" is added where the tree has changes)."""
    commit = os.environ.get("COMMIT")
    if not commit:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        try:
            commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, check=True).stdout.strip()
            if subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                              capture_output=True, text=True).stdout.strip():
                commit += " (uncommitted changes)"
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    return f"{device_name()}, torch {torch.__version__}, triton {triton.__version__}, commit {commit}"


def device_name() -> str:
    """The GPU a measurement ran on, or the CPU where there is none."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({os.cpu_count()} cores)"


def write_json(path: str, **content) -> None:
    """``content`` as JSON, with the device and torch version it was measured on."""
    with open(path, "w") as handle:
        json.dump({"device": device_name(), "torch": torch.__version__, **content}, handle, indent=1)


def read_json_rows(path: str, **expected) -> List[dict]:
    """The rows of a JSON that ``write_json`` wrote with ``rows=``, refused unless it was
    measured on this device with ``expected``'s values (the model depth, say)."""
    with open(path) as handle:
        content = json.load(handle)
    measured = {"device": content["device"], **{key: content.get(key) for key in expected}}
    wanted = {"device": device_name(), **expected}
    if measured != wanted:
        raise ValueError(f"{path}: measured with {measured}, this run has {wanted}: its rows would not compare")
    return content["rows"]


def write_markdown(path: str, table: List[str]) -> None:
    """The table as Markdown, under its environment stamp and the command that made it."""
    command = " ".join(["python", *[arg if " " not in arg else repr(arg) for arg in sys.argv]])
    with open(path, "w") as handle:
        handle.write(f"{environment_stamp()}; `{command}`\n\n" + "\n".join(table) + "\n")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=None, help="NxK,... (default: model and Llama-3-8B shapes)")
    parser.add_argument("--ms", default=None, help="M values, comma separated")
    parser.add_argument("--methods", default="ours,bf16,tinygemm,gemlite")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--markdown", default=None, help="write the table, stamped with its environment, here")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times each method is timed at each M, in alternation (the median is reported)")
    args = parser.parse_args(argv)
    shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
              if args.shapes else list(MODEL_SHAPES + LLAMA3_8B_SHAPES))
    ms = [int(v) for v in args.ms.split(",")] if args.ms else list(M_VALUES)
    bandwidth = hbm_read_bandwidth()
    settle_launch_state(torch.device("cuda"))
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"HBM read bandwidth {bandwidth / 1e12:.2f} TB/s, L2 {l2_bytes() / 2**20:.0f} MiB",
          flush=True)
    results: Dict[tuple, dict] = {}
    errors = []
    header = ("| N x K | M | ours µs | bf16 µs | tinygemm µs | gemlite µs | vs bf16 | of floor | split "
              "| prequantized |")
    table = [header, "|" + "---|" * (header.count("|") - 1)]
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else "-"  # noqa: E731
    # Rows and JSON are written shape by shape, so that a run cut off by a time limit keeps the
    # shapes it finished.
    for shape_index, (n, k) in enumerate(shapes):
        for m in ms:
            floor = (n * k * INT4_BYTES_PER_WEIGHT + 2 * m * k + 2 * m * n) / bandwidth * 1e6
            results[(n, k, m)] = {"N": n, "K": k, "M": m, "floor_us": floor}
        prepared, unprepared = {}, {}
        for name in args.methods.split(","):
            start = time.perf_counter()
            try:
                prepared[name] = METHODS[name](n, k, ms, results)
            except Exception as error:  # an anchor that fails on a shape is reported, not fatal
                unprepared[name] = error
            print(f"# {name} {n}x{k}: prepared in {time.perf_counter() - start:.1f} s", flush=True)
        times, failures = time_in_rounds(prepared, args.rounds)
        for name, error in {**unprepared, **failures}.items():
            errors.append(f"{name} {n}x{k}: {type(error).__name__}: {error}")
            print(f"# {errors[-1]}", file=sys.stderr, flush=True)
        for name, by_m in times.items():
            for m, series in by_m.items():
                results[(n, k, m)].update({f"{name}_us": statistics.median(series), f"{name}_us_rounds": series})
        del prepared
        torch.cuda.empty_cache()
        if shape_index == 0:
            print("\n".join(table))
        for m in ms:
            r = results[(n, k, m)]
            ours, bf16 = r.get("ours_us"), r.get("bf16_us")
            speedup = f"{bf16 / ours:.2f}x" if ours and bf16 else "-"
            floor = f"{r['floor_us'] / ours:.0%}" if ours else "-"
            table.append(f"| {n}x{k} | {m} | {fmt(ours)} | {fmt(bf16)} | "
                         f"{fmt(r.get('tinygemm_us'))} | {fmt(r.get('gemlite_us'))} | {speedup} | {floor} | "
                         f"{r.get('split_k', '-')}{' balanced' if r.get('balanced') else ''} | "
                         f"{'yes' if r.get('prequantize') else '-'} |")
            print(table[-1], flush=True)
        if args.markdown:
            write_markdown(args.markdown, table)
        if args.json:
            write_json(args.json, hbm_read_bandwidth=bandwidth, results=list(results.values()), errors=errors)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
