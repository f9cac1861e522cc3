"""Time the split-K reduction alone, the second launch of every GEMM with split_k > 1.

For each N, M and split: fp32 partials ``[split, M, N]`` (L2-resident, as right after the
GEMM that wrote them) reduced into bf16 ``[M, N]`` by ``_splitk_reduce_kernel`` with the
launch ``launch_split_k_gemm`` uses (``reduction_launch``) at every width of
``REDUCE_WIDTHS``, the one ``reduce_width`` picks marked with *, timed with
``triton.testing.do_bench_cudagraph`` (a CUDA graph of back-to-back launches); an empty
kernel timed the same way gives the floor. The reductions run without dependent launch
(``DEPENDENT_LAUNCH=False``), so that one does not overlap the next.

    python tools/perf/bench_reduce.py --ns 8448,4096,14336,256 --ms 16,64 --splits 2,4,8,16
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import List, Optional

import benchmarks_on_path  # noqa: F401  (benchmarks/ on sys.path)
import torch
import triton
from bench_gemm import empty_kernel
from triton.testing import do_bench_cudagraph

from coalesced_int4.kernels.gemm.split_k import REDUCE_WIDTHS, _splitk_reduce_kernel, reduce_width, reduction_launch


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ns", default="8448,4096,14336,256")
    parser.add_argument("--ms", default="16,64")
    parser.add_argument("--splits", default="2,4,8,16")
    args = parser.parse_args(argv)
    empty_us = do_bench_cudagraph(lambda: empty_kernel[(1,)](DEPENDENT_LAUNCH=False), rep=200) * 1e3
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"an empty kernel: {empty_us:.2f} us")
    widths = " | ".join(f"{w} columns us" for w in REDUCE_WIDTHS)
    print(f"| N | M | split | {widths} |\n|---|---|---|{'---|' * len(REDUCE_WIDTHS)}")
    for n in (int(v) for v in args.ns.split(",")):
        for m in (int(v) for v in args.ms.split(",")):
            for split in (int(v) for v in args.splits.split(",")):
                partials = torch.randn(split, m, n, device="cuda")
                out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                picked = reduce_width(n, m, split)
                times = []
                for width in REDUCE_WIDTHS:
                    grid, launch_args, meta = reduction_launch(partials, out, m, width=width)
                    meta = {**meta, "DEPENDENT_LAUNCH": False}
                    meta.pop("launch_pdl", None)
                    reduce = functools.partial(_splitk_reduce_kernel[grid], *launch_args, **meta)
                    times.append(f"{do_bench_cudagraph(reduce, rep=200) * 1e3:.2f}{'*' if width == picked else ''}")
                print(f"| {n} | {m} | {split} | {' | '.join(times)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
