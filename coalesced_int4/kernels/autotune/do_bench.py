"""``autotune_do_bench``: the timer of every INT4 ``triton.autotune``.

Inside ``cuda_graph_timing()`` and on a side stream (a graph cannot be captured on the legacy
default stream) a config is timed by ``time_with_cuda_graph_us``, which a busy CPU cannot
distort; anywhere else by ``triton.testing.do_bench`` with short warm-up and repetition
windows (decode kernels last microseconds: 5 ms / 20 ms already hold thousands of calls). If a
graph timing fails, the config is timed the ordinary way and a warning says so, once.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import torch
import triton

from coalesced_int4.kernels.autotune import cuda_graph_timing as graph_timing

logger = logging.getLogger(__name__)

AUTOTUNE_WARMUP_MS = 5
AUTOTUNE_REP_MS = 20
_graph_timing_fallback_warned = False
_state = threading.local()


@contextlib.contextmanager
def cuda_graph_timing():
    """While active (nestable, per thread), INT4 autotuners time configs in CUDA graphs."""
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1


def graph_timing_active() -> bool:
    return getattr(_state, "depth", 0) > 0


def autotune_do_bench(kernel_call, quantiles=None):
    global _graph_timing_fallback_warned
    if graph_timing_active() and torch.cuda.current_stream().cuda_stream != 0:
        try:
            ms = graph_timing.time_with_cuda_graph_us(kernel_call) / 1000.0
            return ms if quantiles is None else [ms] * len(quantiles)
        except Exception as error:  # a config that cannot be captured: time it plainly
            if not _graph_timing_fallback_warned:
                _graph_timing_fallback_warned = True
                logger.warning("CUDA-graph autotune timing failed (%s); timing with "
                               "triton.testing.do_bench instead", error)
    return triton.testing.do_bench(
        kernel_call, warmup=AUTOTUNE_WARMUP_MS, rep=AUTOTUNE_REP_MS, quantiles=quantiles
    )
