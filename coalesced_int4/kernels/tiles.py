"""Register-tile reshapes shared by the GEMM kernels (no data leaves a thread's registers)."""

import triton
import triton.language as tl


@triton.jit
def repeat_columns(values, TIMES: tl.constexpr):
    """[R, C] -> [R, C * TIMES]: each column repeated ``TIMES`` times in place, e.g. a
    per-group scale spread over its group's weights."""
    rows: tl.constexpr = values.shape[0]
    columns: tl.constexpr = values.shape[1]
    return tl.reshape(tl.broadcast_to(values[:, :, None], [rows, columns, TIMES]), [rows, columns * TIMES])
