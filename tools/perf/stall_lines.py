"""Where a profiled kernel's warps wait, instruction by instruction: a summary of Nsight
Compute's warp-state samples per SASS line.

Input: the CSV of ``ncu -i REPORT --page source --print-source sass --csv`` for a report
taken with the SourceCounters section (``gpu_checks.sh profile`` writes it as
``profile-sass.csv``). For each profiled kernel it prints the main loop (the instructions
executed most often), the share of all samples taken there, the samples of each stall reason
in it, and its most sampled instructions with their leading reasons.

ncu's per-line columns leave out some reasons its kernel-wide metrics have (on sm_90 the
warp group's arrival at a tensor-core instruction and the tensor-core wait). Samples a line
took for those are counted as ``unlisted``, so that every sample is in some column.

    python tools/perf/stall_lines.py profile-sass.csv [--top 20]
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from typing import Dict, List, Optional, Tuple

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
REASON_PREFIX = "stall_"


def kernels(text: str) -> List[Tuple[str, List[Dict[str, str]]]]:
    """The CSV's kernels: (name, one dict per SASS line), in the report's order. Each kernel's
    block starts with a ``"Kernel Name",NAME`` line, then its header and lines."""
    result: List[Tuple[str, List[str]]] = []
    for line in text.splitlines():
        if line.startswith('"Kernel Name"'):
            result.append((next(csv.reader([line]))[1], []))
        elif result and line.strip():
            result[-1][1].append(line)
    return [(name, list(csv.DictReader(lines))) for name, lines in result]


def samples(line: Dict[str, str]) -> int:
    """All of a line's warp-state samples (an empty cell is none)."""
    return int(line[SAMPLES] or 0)


def reasons(line: Dict[str, str]) -> Counter:
    """A line's samples by stall reason (issued samples under ``selected``), with the samples
    no listed reason covers under ``unlisted``."""
    counts = Counter({column[len(REASON_PREFIX):]: int(value or 0) for column, value in line.items()
                      if column.startswith(REASON_PREFIX) and "Not Issued" not in column})
    counts["unlisted"] = samples(line) - sum(counts.values())
    return +counts


def main_loop(lines: List[Dict[str, str]]) -> range:
    """The longest run of consecutive lines executed as often as the most executed line."""
    executed = [int(line[EXECUTED] or 0) for line in lines]
    most = max(executed, default=0)
    best, start = range(0), None
    for index, count in enumerate([*executed, -1]):
        if count == most and start is None:
            start = index
        elif count != most and start is not None:
            best = max(best, range(start, index), key=len)
            start = None
    return best


def summary(name: str, lines: List[Dict[str, str]], top: int) -> List[str]:
    loop = main_loop(lines)
    total = sum(samples(line) for line in lines)
    in_loop = sum((reasons(lines[i]) for i in loop), Counter())
    out = [f"# {name}: main loop = lines {loop.start}-{loop.stop - 1} ({len(loop)} instructions), "
           f"{sum(in_loop.values())} of {total} samples",
           "# loop samples by reason: " + ", ".join(f"{reason} {count}" for reason, count in in_loop.most_common())]
    ranked = sorted(loop, key=lambda i: samples(lines[i]), reverse=True)[:top]
    for index in sorted(ranked):
        leading = ", ".join(f"{reason} {count}" for reason, count in reasons(lines[index]).most_common(3))
        out.append(f"{index:5d} {samples(lines[index]):6d}  {lines[index]['Source'].strip()[:64]:64s}  {leading}")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    with open(args.csv) as f:
        for name, lines in kernels(f.read()):
            print("\n".join(summary(name, lines, args.top)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
