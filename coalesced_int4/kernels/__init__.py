"""Triton INT4 GEMMs for decode-sized M, the ``coalesced_int4`` torch ops that run them, and
their autotuning. ``INT4_QUANTIZED_GEMM.op(b)`` is the op of bucket ``b``.

    ops/               the torch ops (one per bucket) and the rules they enforce:
                       validation.py (which arguments a bucket takes), configs.py (config
                       spaces, launch-parameter candidates, grid rules), family.py (the op
                       registry), int4_gemm.py (the family of INT4 GEMM ops and ``launch``)
    gemm/              the Triton kernels with their launchers: w4a8.py (M = 1-4, dp4a),
                       w4a16.py (M = 8-64, tensor cores), split_k.py (split bounds, the
                       reduction, the shared launch path)
    runtime/           what a launch sets up around a kernel: dependent_launch.py,
                       smem_carveout.py, tma_scratch.py, device.py (SM count)
    autotune/          config and launch-parameter timing, persistent picks
    device_functions.py   Triton helpers shared by the kernels
    decode_attention.py   the built-in decoder's one-token attention op and kernel
"""

from coalesced_int4.kernels.autotune.launch_params import (
    InvalidLaunchParam,
    autotune_launch_params,
    clear_launch_param_cache,
)
from coalesced_int4.kernels.ops.configs import (
    SPLIT_K_CANDIDATES,
    TILE_SPLIT_K_CANDIDATES,
    int4_autotune_configs,
    prune_int4_configs,
)
from coalesced_int4.kernels.ops.int4_gemm import BUCKET_KERNELS, INT4_QUANTIZED_GEMM, launch
from coalesced_int4.kernels.ops.validation import (
    SUPPORTED_BUCKETS,
    W4A8_BUCKETS,
    W4A16_BUCKETS,
    check_split_k,
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
