"""fp32 -> bf16 rounding that is the same on the GPU and in Triton's interpreter.

The interpreter converts fp32 to bf16 by truncation and does bf16 arithmetic on raw bits;
kernels that must match the GPU bit for bit there round with ``to_bf16`` and do bf16 math in
fp32 (exact for the values they combine) when ``INTERPRET`` is set.
"""

import triton
import triton.language as tl


@triton.jit
def to_bf16(x, INTERPRET: tl.constexpr):
    """Round fp32 ``x`` to bf16, to nearest with ties to even."""
    if INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(tl.bfloat16)
