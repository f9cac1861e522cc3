"""The kernel benchmark's timing order (``benchmarks/bench_gemm.py``): the process's fast
graph captures are used up before anything is timed (``settle_launch_state``), a shape's
methods take turns round by round, each round starting with the next method, because on the
H200 the first graphs timed in a process can read faster than the later ones; an anchor that
fails loses its readings without stopping the others; and an earlier run's rows are tabulated
again only when they were measured alike."""

import sys

import pytest
import torch

from tests.helpers import BENCHMARKS

sys.path.insert(0, BENCHMARKS)
import bench_gemm  # noqa: E402
from bench_gemm import SETTLING_CAPTURES, time_in_rounds  # noqa: E402


def _methods():
    """Stand-in calls: each (method, M) has a list object of its own, for a fake timer to name."""
    return {"ours": {1: ["ours@1"], 2: ["ours@2"]}, "bf16": {1: ["bf16@1"]}, "tinygemm": {1: ["tinygemm@1"]}}


def test_methods_take_turns_and_each_round_starts_with_the_next():
    timed = []

    def timer(calls):
        timed.append(calls[0])
        return float(len(timed))

    times, failures = time_in_rounds(_methods(), rounds=3, timer=timer)
    assert failures == {}
    assert timed == ["ours@1", "ours@2", "bf16@1", "tinygemm@1",
                     "bf16@1", "tinygemm@1", "ours@1", "ours@2",
                     "tinygemm@1", "ours@1", "ours@2", "bf16@1"]
    assert times == {"ours": {1: [1.0, 7.0, 10.0], 2: [2.0, 8.0, 11.0]}, "bf16": {1: [3.0, 5.0, 12.0]},
                     "tinygemm": {1: [4.0, 6.0, 9.0]}}


def test_a_method_that_fails_loses_its_readings_and_later_turns_but_not_the_others():
    timed = []

    def timer(calls):
        timed.append(calls[0])
        if calls[0] == "bf16@1":
            raise RuntimeError("cannot run this shape")
        return 1.0

    times, failures = time_in_rounds(_methods(), rounds=2, timer=timer)
    assert list(failures) == ["bf16"] and str(failures["bf16"]) == "cannot run this shape"
    assert timed.count("bf16@1") == 1
    assert times == {"ours": {1: [1.0, 1.0], 2: [1.0, 1.0]}, "tinygemm": {1: [1.0, 1.0]}}


class _RecordingKernel:
    """Stands in for ``bench_gemm.empty_kernel``: records each launch's options."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda **options: self.launches.append(options)


def _settle(monkeypatch, dependent_launch_options):
    kernel = _RecordingKernel()
    monkeypatch.setattr(bench_gemm, "empty_kernel", kernel)
    monkeypatch.setattr(bench_gemm.dependent_launch, "options", lambda tensor: dependent_launch_options)
    timed = []

    def timer(calls):
        timed.append(len(calls))
        for call in calls:
            call()
        return 1.0

    bench_gemm.settle_launch_state(torch.device("cpu"), timer=timer)
    return timed, [options["DEPENDENT_LAUNCH"] for options in kernel.launches]


def test_settling_uses_up_the_dependent_launch_captures_first_then_the_plain_ones(monkeypatch):
    timed, kinds = _settle(monkeypatch, {"DEPENDENT_LAUNCH": True, "launch_pdl": True})
    assert timed == [1] * 2 * SETTLING_CAPTURES
    assert kinds == [True] * SETTLING_CAPTURES + [False] * SETTLING_CAPTURES


def test_settling_without_dependent_launch_captures_only_plain_graphs(monkeypatch):
    timed, kinds = _settle(monkeypatch, {"DEPENDENT_LAUNCH": False})
    assert timed == [1] * SETTLING_CAPTURES and kinds == [False] * SETTLING_CAPTURES


def test_rows_of_an_earlier_run_are_read_back_only_for_the_same_device_and_settings(tmp_path):
    path = str(tmp_path / "earlier.json")
    rows = [{"method": "bf16", "batch": 1, "tokens_per_s": 12.5}]
    bench_gemm.write_json(path, layers=2, rows=rows)
    assert bench_gemm.read_json_rows(path, layers=2) == rows
    with pytest.raises(ValueError, match="would not compare"):
        bench_gemm.read_json_rows(path, layers=32)
    bench_gemm.write_json(path, rows=rows)
    with open(path) as handle:
        other_device = handle.read().replace(bench_gemm.device_name(), "another GPU")
    with open(path, "w") as handle:
        handle.write(other_device)
    with pytest.raises(ValueError, match="another GPU"):
        bench_gemm.read_json_rows(path)
