"""``F.linear`` routing for ``CudaCoalescedInt4Tensor`` weights: bucket choice and the
dequant fallback. ``quantized_linear`` never raises for an input the kernels cannot take."""

from coalesced_int4.dispatch.linear import (
    DEQUANT_N_CHUNK,
    DEQUANT_N_THRESHOLD,
    can_launch_triton,
    dequant_linear,
    quantized_linear,
    select_bucket,
)

__all__ = [
    "DEQUANT_N_CHUNK",
    "DEQUANT_N_THRESHOLD",
    "can_launch_triton",
    "dequant_linear",
    "quantized_linear",
    "select_bucket",
]
