"""Device time of calls, measured from CUDA graphs so the CPU cannot distort it.

Event timings of a few-microsecond kernel are bimodal when every CPU core is busy (an
Inductor compile, say): the host falls behind and the launch gap lands inside the interval.
``time_with_cuda_graph_us(fn)`` captures ``calls`` repetitions of [flush L2, event, fn(), event]
into one graph and replays it once, so launches are back to back and only device time is
measured; it returns the fastest call in microseconds (cold L2 each time).

The flush reads twice the L2 rather than writing it: a written flush leaves the L2 full of
dirty lines that the timed kernel must write back to HBM while it streams its weights , which a decode GEMM never pays in a model, where
the L2 holds clean lines of the previous layer.

``time_back_to_back_us(calls)`` times the calls the way a model's layers run in a graph: one
after another with no flush between them, each reading its own copy of the data (copies that
together exceed the L2 come from HBM). A launch of several kernels (split-K's reduction, the
activations' quantization) pays its extra launches here as it does in a model; timed alone
between events, each extra kernel reads about a microsecond longer than back to back, which
on a microsecond-sized GEMM is enough to rank its candidates differently.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Dict, Optional, Sequence

import torch

TARGET_GRAPH_US = 2000.0
MIN_CALLS, MAX_CALLS = 4, 32
_FLUSH: Dict[int, Callable[[], object]] = {}


def _l2_flush(device: torch.device) -> Callable[[], object]:
    """A call that reads twice the L2's size into a one-element sum, evicting every line."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _FLUSH:
        l2_bytes = torch.cuda.get_device_properties(index).L2_cache_size
        data = torch.zeros(max(2 * l2_bytes, 4) // 4, dtype=torch.int32, device=device)
        sink = torch.empty((), dtype=torch.int64, device=device)
        _FLUSH[index] = lambda: torch.sum(data, dim=0, out=sink)
    return _FLUSH[index]


def time_with_cuda_graph_us(fn: Callable[[], object]) -> float:
    """Microseconds of the fastest of several graph-captured calls of ``fn``."""
    if torch.cuda.current_stream().cuda_stream == 0:
        raise RuntimeError("cannot capture on the legacy default CUDA stream")
    device = torch.device("cuda", torch.cuda.current_device())
    flush = _l2_flush(device)
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    flush()
    start.record()
    fn()
    end.record()
    end.synchronize()
    estimate_us = max(start.elapsed_time(end) * 1000.0, 1.0)
    calls = min(MAX_CALLS, max(MIN_CALLS, math.ceil(TARGET_GRAPH_US / estimate_us)))
    events = [
        (torch.cuda.Event(enable_timing=True, external=True),
         torch.cuda.Event(enable_timing=True, external=True))
        for _ in range(calls)
    ]
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for before, after in events:
                flush()
                before.record()
                fn()
                after.record()
        graph.replay()
        events[-1][1].synchronize()
        return min(before.elapsed_time(after) for before, after in events) * 1000.0
    finally:
        graph.reset()


def copies_beyond_l2(bytes_per_copy: float, device: Optional[torch.device] = None) -> int:
    """How many copies of a call's data ``time_back_to_back_us`` needs so that the rotation
    reads each call's copy from HBM: together at least twice the L2 (its replacement is not
    strictly LRU), plus the one the first call reads. ``device``: the current one if None."""
    l2_bytes = torch.cuda.get_device_properties(device or torch.cuda.current_device()).L2_cache_size
    return math.ceil(2 * l2_bytes / max(bytes_per_copy, 1)) + 1


def time_back_to_back_us(calls: Sequence[Callable[[], object]], min_calls: int = 300, samples: int = 5) -> float:
    """Microseconds per call of a CUDA graph that runs ``calls`` in turn, back to back, at
    least ``min_calls`` calls in all (median of ``samples`` replays). Captured on a stream of
    its own, so any stream may call it."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    rounds = max(1, math.ceil(min_calls / len(calls)))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            for _ in range(rounds):
                for call in calls:
                    call()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(samples):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0 / (rounds * len(calls)))
        return statistics.median(times)
    finally:
        graph.reset()
