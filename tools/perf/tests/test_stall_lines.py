"""``benchmarks/stall_lines.py`` reads Nsight Compute's per-SASS-line CSV: every kernel of the
report, its main loop as the run of most executed lines, and every sample under one reason."""

import sys

from tests.helpers import BENCHMARKS, PERF_TOOLS

sys.path[:0] = [PERF_TOOLS, BENCHMARKS]
from stall_lines import kernels, main_loop, reasons, summary  # noqa: E402

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"stall_long_sb","stall_wait","stall_selected","stall_wait (Not Issued)"')


def csv_of(name, lines):
    rows = [f'"{i:x}","{source}","{samples}","{executed}","{long_sb}","{wait}","{selected}","0"'
            for i, (source, samples, executed, long_sb, wait, selected) in enumerate(lines)]
    return "\n".join([f'"Kernel Name","{name}",', HEADER, *rows])


GEMM = [  # source, samples, executed, long_sb, wait, selected
    ("MOV R1, c[0x0][0x28]", 2, 132, 0, 0, 2),
    ("LDG.E R2, desc[UR4][R4.64]", 1, 4224, 0, 0, 1),
    ("PRMT R3, R2, 0x7610, R3", 40, 4224, 38, 1, 1),
    ("HGMMA.64x64x16.F32.BF16 R24, R56, gdesc[UR16], R24", 30, 4224, 0, 10, 2),
    ("@P0 BRA 0x100", 5, 4224, 4, 0, 1),
    ("STG.E.U16 desc[UR4][R6.64], R3", 3, 132, 0, 0, 3),
    ("EXIT", 0, 132, 0, 0, 0),
]
REDUCE = [("LDG.E R2, desc[UR4][R4.64]", 7, 64, 6, 0, 1), ("EXIT", 0, 64, 0, 0, 0)]


def test_each_kernel_of_the_report_is_read_with_its_lines():
    parsed = kernels(csv_of("_w4a16_kernel", GEMM) + "\n" + csv_of("_splitk_reduce_kernel", REDUCE) + "\n")
    assert [name for name, _ in parsed] == ["_w4a16_kernel", "_splitk_reduce_kernel"]
    assert [line["Source"] for line in parsed[0][1]] == [source for source, *_ in GEMM]


def test_the_main_loop_is_the_longest_run_of_most_executed_lines():
    lines = kernels(csv_of("_w4a16_kernel", GEMM))[0][1]
    assert main_loop(lines) == range(1, 5)


def test_samples_no_listed_reason_covers_are_counted_as_unlisted():
    lines = kernels(csv_of("_w4a16_kernel", GEMM))[0][1]
    assert reasons(lines[3]) == {"wait": 10, "selected": 2, "unlisted": 18}
    assert sum(reasons(lines[2]).values()) == 40


def test_the_summary_counts_the_loops_samples_against_the_kernels():
    name, lines = kernels(csv_of("_w4a16_kernel", GEMM))[0]
    head, by_reason, *ranked = summary(name, lines, top=2)
    assert "lines 1-4 (4 instructions), 76 of 81 samples" in head
    assert by_reason == "# loop samples by reason: long_sb 42, unlisted 18, wait 11, selected 5"
    assert [line.split()[0] for line in ranked] == ["2", "3"]
