"""Triton INT4 GEMMs for decode-sized M, the ``coalesced_int4`` torch ops that run them, and
their autotuning. ``INT4_QUANTIZED_GEMM.op(b)`` is the op of bucket ``b``. Also here, for the
built-in decoder: ``decode_attention``, one new token's attention over a KV cache."""

from coalesced_int4.kernels.autotune.launch_params import (
    InvalidLaunchParam,
    autotune_launch_params,
    clear_launch_param_cache,
)
from coalesced_int4.kernels.int4_gemm import BUCKET_KERNELS, INT4_QUANTIZED_GEMM, launch
from coalesced_int4.kernels.rules import (
    SPLIT_K_CANDIDATES,
    SUPPORTED_BUCKETS,
    TILE_SPLIT_K_CANDIDATES,
    W4A8_BUCKETS,
    W4A16_BUCKETS,
    check_split_k,
    int4_autotune_configs,
    prune_int4_configs,
    unsupported_reason,
)

__all__ = [
    "BUCKET_KERNELS",
    "INT4_QUANTIZED_GEMM",
    "InvalidLaunchParam",
    "SPLIT_K_CANDIDATES",
    "SUPPORTED_BUCKETS",
    "TILE_SPLIT_K_CANDIDATES",
    "W4A16_BUCKETS",
    "W4A8_BUCKETS",
    "autotune_launch_params",
    "check_split_k",
    "clear_launch_param_cache",
    "int4_autotune_configs",
    "launch",
    "prune_int4_configs",
    "unsupported_reason",
]
