"""Autotuning machinery: CUDA-graph timing and launch-parameter (split-K) timing."""

from coalesced_int4.kernels.autotune.cuda_graph_timing import time_with_cuda_graph_us
from coalesced_int4.kernels.autotune.launch_params import (
    InvalidLaunchParam,
    LaunchParamPick,
    LaunchParamStats,
    autotune_launch_param,
    autotune_launch_params,
    clear_launch_param_cache,
)

__all__ = [
    "InvalidLaunchParam",
    "LaunchParamPick",
    "LaunchParamStats",
    "autotune_launch_param",
    "autotune_launch_params",
    "clear_launch_param_cache",
    "time_with_cuda_graph_us",
]
