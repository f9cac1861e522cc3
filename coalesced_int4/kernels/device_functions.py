"""Triton device functions shared by the kernels: register-tile reshapes, and bf16 rounding and
dots that give the same values on the GPU and in Triton's interpreter.

The interpreter converts fp32 to bf16 by truncation, does bf16 arithmetic on raw bits and
computes a bf16 ``tl.dot`` wrongly; kernels that must match the GPU there round with
``to_bf16``, dot bf16 tiles with ``bf16_dot``, and do bf16 math in fp32 (exact for the values
they combine) when ``INTERPRET`` is set.
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


@triton.jit
def bf16_dot(a, b, INTERPRET: tl.constexpr):
    """fp32 ``a @ b`` of bf16 tiles (operands widened to fp32 under the interpreter: the
    products of bf16 values are exact in fp32 either way)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def repeat_columns(values, TIMES: tl.constexpr):
    """[R, C] -> [R, C * TIMES]: each column repeated ``TIMES`` times in place (no data leaves
    a thread's registers), e.g. a per-group scale spread over its group's weights."""
    rows: tl.constexpr = values.shape[0]
    columns: tl.constexpr = values.shape[1]
    return tl.reshape(tl.broadcast_to(values[:, :, None], [rows, columns, TIMES]), [rows, columns * TIMES])
