"""W4A16 GEMM for small batches (buckets 8-64): weights decoded to bf16, tensor-core dot.

A program reads its weight rows' codes as int32 words of 8 weights (byte b of a word holds
weights 2b and 2b + 1, low nibble first), decodes them with the reference's bf16 rounding chain
``w = bf16(bf16(q - zero) * scale)``, where ``scale = bf16(sc * ss)`` and
``zero = bf16(zc * zs)``, and accumulates ``acc[BLOCK_N, rows] += w @ x^T`` in fp32. The
weights are the left operand (M of the MMA is BLOCK_N >= 32), the activations the right one
(N of the MMA is the bucket, 8..64, or at bucket 64 and M <= 48 two dots of 32 and 16 rows:
``configs.w4a16_batch_rows``): at these batch sizes this keeps the tensor cores busy without
padding M, and every activation row is covered by one tile so each weight is decoded exactly
once.

The decode works on pairs of weights, the unit in which the tensor-core layouts hold the left
operand (two consecutive k in one 32-bit register). On the GPU one block of inline PTX
(``_DECODE_PAIR``, four instructions) turns a pair's byte into that register: the byte's two
nibbles are moved to the two bf16 halves, where as bit patterns they are subnormal multiples
of ``q`` (no int-to-float conversion), and the chain's subtraction and multiplication run on
both weights at once, each rounded on its own. The group values carry powers of two (``FOLD``)
that make the subtraction one fused multiply-add with the nibbles' scaling and leave every
rounding as the reference's. A thread then never unpacks weights it does not hold, whatever
layout Triton picks for the dot.

The scale and zero codes are read as int32 words too (four groups each), one trip ahead. The
four threads of a quad hold the same weight rows in both tensor-core layouts, and all of a
trip's groups, so each converts one group of the four (``_GROUP_BY_QUAD``) and takes the
others from its neighbours by a shuffle: the group values a thread uses arrive as one
register per group, scale and zero together.
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl

from coalesced_int4.kernels.device_functions import bf16_dot, repeat_columns, to_bf16
from coalesced_int4.kernels.gemm.split_k import launch_split_k_gemm, split_bounds, split_program
from coalesced_int4.kernels.ops.configs import balanced_short_columns, w4a16_batch_rows
from coalesced_int4.kernels.ops.validation import CODE_WORD
from coalesced_int4.kernels.runtime.dependent_launch import let_next_kernel_launch, wait_for_previous_kernel
from coalesced_int4.kernels.runtime.device import multiprocessors
from coalesced_int4.kernels.runtime.smem_carveout import fitted_to_grid, report_grid
from coalesced_int4.kernels.runtime.tma_scratch import with_scratch

FOLD = tl.constexpr(64.0)
"""The power of two folded into the group values: the GPU decode works on ``q / FOLD``
(``_DECODE_PAIR``), so each group carries ``FOLD * scale`` and ``-zero / FOLD``. Rounding to
bf16 commutes with a power of two while values stay in bf16's normal range, which fp16 steps
(>= 2**-24) and uint8 codes keep them in. 64 is the smallest such fold for which one bf16
multiplier, 2**133 / FOLD, brings a nibble's subnormal bit pattern to ``q / FOLD``."""


def _f32_bits(value: float) -> int:
    """The bits of ``value`` rounded to fp32."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


def _ptx_f32(value: float) -> str:
    """``value`` as a PTX fp32 immediate (exact bits)."""
    return "0f%08X" % _f32_bits(value)


def _ptx_bf16x2(low: float, high: float) -> str:
    """Two bf16-exact values as the bits of one bf16x2 register, ``low`` in the low half."""
    return "%#010x" % (_f32_bits(high) & 0xFFFF0000 | _f32_bits(low) >> 16)


@triton.jit
def _trip_meta(sc_ptr, ss_ptr, zc_ptr, zs_ptr, rows, stride_cn, stride_sn, trip, BLOCK_K: tl.constexpr):
    """The scale codes, scale step, zero codes and zero step of ``rows`` for main-loop trip
    ``trip``: codes as int32 words [R, BLOCK_K // 128] (four groups each), steps [R]."""
    codes = rows[:, None] * stride_cn + trip * (BLOCK_K // 128) + tl.arange(0, BLOCK_K // 128)[None, :]
    step = rows * stride_sn + trip * BLOCK_K // 256
    return tl.load(sc_ptr + codes), tl.load(ss_ptr + step), tl.load(zc_ptr + codes), tl.load(zs_ptr + step)


@triton.jit
def _interpreted_group_values(code_words, byte, step, factor: tl.constexpr):
    """The interpreter's ``bf16(bf16(code) * bf16(factor * step))`` of byte ``byte`` of each
    word, as bf16 bits in an int32 (the product of an 8-bit integer and a bf16 is exact in
    fp32)."""
    codes = ((code_words >> (8 * byte)) & 0xFF).to(tl.float32)
    step = to_bf16(step.to(tl.float32) * factor, INTERPRET=True).to(tl.float32)
    value = to_bf16(codes * step[:, None], INTERPRET=True)
    return value.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


_GROUP_BY_QUAD = tl.constexpr(
    "{ .reg .b32 codes, code, own, steps; .reg .b16 scale, zero; .reg .f32 scale_step, zero_step; "
    "prmt.b32 codes, $1, $2, $6; "
    "bfe.u32 code, codes, 0, 8; "
    "cvt.rn.bf16.u32 scale, code; "
    "bfe.u32 code, codes, 8, 8; "
    "cvt.rn.bf16.u32 zero, code; "
    "mov.b32 own, {scale, zero}; "
    "cvt.f32.f16 scale_step, $3; "
    "cvt.f32.f16 zero_step, $4; "
    f"mul.rn.f32 scale_step, scale_step, {_ptx_f32(FOLD.value)}; "
    f"mul.rn.f32 zero_step, zero_step, {_ptx_f32(-1 / FOLD.value)}; "
    "cvt.rn.bf16x2.f32 steps, zero_step, scale_step; "
    "mul.rn.bf16x2 own, own, steps; "
    "shfl.sync.idx.b32 $0, own, $5, 0x1c1f, 0xFFFFFFFF; }"
)
"""$1, $2: the words of four scale codes and of four zero codes that hold this element's
group; $3, $4: the row's fp16 scale and zero steps; $5: the group's byte in its words (0-3);
$6: this lane's ``prmt`` selector (``_quad_lane_selectors``). Lane ``l`` of a quad brings
byte ``l % 4`` of both words together, converts them and multiplies them by the steps: each
lane makes one group's values. Every lane then takes its element's group from the quad lane
that made it (``shfl`` in segments of four lanes, ``c = 0x1c1f``). This relies on the four
lanes of a quad holding the same weight rows in the same register, which both tensor-core
layouts give (rows by ``lane // 4``); the GPU tests compare every tile's decoded weights
with the reference bit for bit, at every bucket. $0: the group's ``FOLD * scale`` (low half)
and ``-zero / FOLD`` (high half), each ``bf16(bf16(code) * bf16(factor * step))`` with factor
``FOLD`` and ``-1 / FOLD``."""


@triton.jit
def _quad_lane_selectors(like, INTERPRET: tl.constexpr):
    """int32 shaped like ``like``: ``_GROUP_BY_QUAD``'s ``prmt`` selector,
    ``0x40 + 0x11 * (lane % 4)``, in every element a thread holds. Made once, before the main
    loop: read inside it, the lane id came back every trip (``S2R``, a long-latency read at
    the head of the group values' chain). The interpreter has no lanes (zeros, unused)."""
    if INTERPRET:
        return tl.zeros(like.shape, tl.int32)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 lane; mov.u32 lane, %laneid; and.b32 lane, lane, 3; mad.lo.u32 $0, lane, 0x11, 0x40; }",
            "=r,r", [like], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _group_values(scale_codes, scale_step, zero_codes, zero_step, selectors, INTERPRET: tl.constexpr):
    """Words of four groups' uint8 codes each, low byte first [R, G // 4], and their
    super-block's fp16 steps [R] -> int32 [R, G]: each group's ``FOLD * scale`` (the scale
    ``bf16(bf16(code) * bf16(step))``) in the low half and its ``-zero / FOLD`` in the high
    half. ``selectors``: ``_quad_lane_selectors`` of a tensor of this result's shape."""
    GROUPS: tl.constexpr = 4 * scale_codes.shape[1]
    byte = tl.arange(0, GROUPS)[None, :] % 4
    scale_words = repeat_columns(scale_codes, 4)
    zero_words = repeat_columns(zero_codes, 4)
    if INTERPRET:
        return (_interpreted_group_values(scale_words, byte, scale_step, FOLD)
                | (_interpreted_group_values(zero_words, byte, zero_step, -1 / FOLD) << 16))
    else:
        return tl.inline_asm_elementwise(
            _GROUP_BY_QUAD, "=r,r,r,h,h,r,r",
            [scale_words, zero_words, scale_step[:, None], zero_step[:, None], byte, selectors],
            dtype=tl.int32, is_pure=True, pack=1,
        )


_DECODE_PAIR = tl.constexpr(
    "{ .reg .b32 t, unit, zero, scale; .reg .b16 scale_half, zero_half; "
    f"mov.b32 unit, {_ptx_bf16x2(2.0**133 / FOLD.value, 2.0**129 / FOLD.value)}; "
    "mov.b32 {scale_half, zero_half}, $3; "
    "mov.b32 zero, {zero_half, zero_half}; "
    "mov.b32 scale, {scale_half, scale_half}; "
    "prmt.b32 t, $1, $1, $2; "
    "and.b32 t, t, 0x00F0000F; "
    "fma.rn.bf16x2 t, t, unit, zero; "
    "mul.rn.bf16x2 $0, t, scale; }"
)
"""$1: the word holding the pair; $2: the PRMT selector that copies its byte b to bytes 0
and 2, so that after the mask the low nibble q0 is bits 0-3 of the low half and the high
nibble q1 bits 4-7 of the high half. Bit patterns below 0x100 are bf16 values ``p * 2**-133``
(subnormals, and then the first normal binade, are evenly spaced), so the halves hold
``q0 * 2**-133`` and ``q1 * 2**-129``, and ``unit`` (2**133 / FOLD low, 2**129 / FOLD high)
brings both to ``q / FOLD`` exactly. $3: the group's ``FOLD * scale`` (low half) and
``-zero / FOLD`` (high half). The ``fma`` rounds ``(q - zero) / FOLD`` once, which is
``bf16(q - zero) / FOLD``, and the product with ``FOLD * scale`` is the chain's
``bf16(bf16(q - zero) * scale)``.
$0: the decoded pair, the low-k weight in the low half. One line with no escapes:
torch.compile copies the kernel's globals into a generated module as text inside a string
literal, where an escaped newline becomes a real one."""


@triton.jit
def _decode(words, groups, INTERPRET: tl.constexpr):
    """Words [R, W] of 8 codes and their groups' values (``_group_values``)
    [R, W // 4] -> the weights, bf16 [R, 8 * W] in k order. Pair p is byte p % 4 of word
    p // 4. The interpreter has no inline asm: there the nibbles are shifted out one by one
    and the same steps run in fp32, rounded to bf16 after each (every fp32 intermediate is
    exact: the same values)."""
    R: tl.constexpr = words.shape[0]
    W: tl.constexpr = words.shape[1]
    word = repeat_columns(words, 4)
    byte = tl.arange(0, 4 * W)[None, :] % 4
    groups = repeat_columns(groups, 16)
    if INTERPRET:
        scale = (groups << 16).to(tl.float32, bitcast=True)
        negative_zero = (groups & -65536).to(tl.float32, bitcast=True)  # -65536 = 0xFFFF0000
        low = ((word >> (8 * byte)) & 0xF).to(tl.float32)
        high = ((word >> (8 * byte + 4)) & 0xF).to(tl.float32)
        pair = tl.join(low, high) * (1 / FOLD) + negative_zero[:, :, None]
        pair = to_bf16(to_bf16(pair, INTERPRET).to(tl.float32) * scale[:, :, None], INTERPRET)
    else:
        bits = tl.inline_asm_elementwise(
            _DECODE_PAIR, "=r,r,r,r", [word, byte * 0x101, groups], dtype=tl.int32, is_pure=True, pack=1,
        )
        pair = tl.join(bits.to(tl.int16).to(tl.bfloat16, bitcast=True),
                       (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True))
    return tl.reshape(pair, [R, 8 * W])


WAITED_DOT_MAX_ROWS = tl.constexpr(32)
"""The most activation rows a dot of a program writing bf16 outputs may have and still
complete within its trip; a split-K program's (``PARTIAL``) dots always do. Triton
pipelines a dot whose left operand is in registers across trips by splitting it into 16-wide
pieces of K, each with its own fence, wait and shared-memory descriptor (bucket 8's
``mma.sync`` dot is never split). Waiting for the whole dot at the end of its trip costs the
tensor cores' time for it instead, which grows with its rows: it pays up to 32 rows, and for
64 rows only in split-K programs, whose partials are stored in place
(``IN_PLACE_PARTIALS_BUCKET``; docs/decisions.md)."""


@triton.constexpr_function
def dot_waited_within_trip(rows, partial):
    """Whether a dot of ``rows`` activation rows completes within its trip
    (``WAITED_DOT_MAX_ROWS``): the kernel's rule, read by the SASS census tests too."""
    return rows <= WAITED_DOT_MAX_ROWS.value or partial


@triton.jit
def batch_rows(offs_m, M, BUCKET: tl.constexpr, BATCH_ROWS: tl.constexpr, WINDOWS: tl.constexpr):
    """(row, stored): the batch row each accumulator row ``offs_m`` stands for, and whether
    its output is stored. Without ``WINDOWS``, row r stands for batch row r, stored below M.
    With ``WINDOWS`` (the TMA copies, ``activation_windows``), the first ``BUCKET // 2``
    accumulator rows (a window) stand for the batch's first rows and the others for its last
    ``BATCH_ROWS - BUCKET // 2`` rows, which store only the rows the first window missed:
    wherever dispatch runs a bucket (M more than half of it) both windows lie inside the
    batch, so TMA copies each as a box without zero fill (a zero-filled box was slower). The
    pointer copies keep rows r >= M reading row r - M, which measured faster for them than
    windows."""
    if WINDOWS:
        WINDOW: tl.constexpr = BUCKET // 2
        row = offs_m + tl.where(offs_m < WINDOW, 0, M - BATCH_ROWS)
        stored = tl.where(offs_m < WINDOW, offs_m < M, row >= WINDOW)
    else:
        row = offs_m
        stored = offs_m < M
    return row, stored


@triton.jit
def activation_rows(offs_m, M, BUCKET: tl.constexpr, BATCH_ROWS: tl.constexpr, WINDOWS: tl.constexpr):
    """The activation row each accumulator row reads: its batch row (``batch_rows``), or
    where that lies outside the batch (a row that is never stored) a row inside it: r - M
    below 2M, so that each row is read at most twice wherever dispatch runs a bucket (rows
    that all read row M - 1 queue up to 31 copies of one row a trip)."""
    row, _ = batch_rows(offs_m, M, BUCKET, BATCH_ROWS, WINDOWS)
    row = tl.where(row < 0, offs_m, row)
    return tl.minimum(tl.where(row < M, row, row - M), M - 1)


@triton.jit
def activation_windows(x_ptr, M, K, stride_xm, BUCKET: tl.constexpr, BATCH_ROWS: tl.constexpr,
                       HEAD_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """A tensor descriptor of the head dot's activation rows, ``batch_rows``'s two windows:
    [windows, BUCKET // 2, K], window 0 the batch's first rows and window 1 (where the head
    has two) its last rows, the same rows of x under a second stride. A window or row that
    lies past the batch (only below dispatch's range of M) is zero-filled; its outputs are
    not stored."""
    WINDOW: tl.constexpr = BUCKET // 2
    WINDOWS: tl.constexpr = HEAD_ROWS // WINDOW
    second = M - BATCH_ROWS + WINDOW
    windows = 1 + (WINDOWS - 1) * (second > 0).to(tl.int32)
    return tl.make_tensor_descriptor(x_ptr, shape=[windows, tl.minimum(M, WINDOW), K],
                                     strides=[tl.maximum(second, 1) * stride_xm, stride_xm, 1],
                                     block_shape=[WINDOWS, WINDOW, BLOCK_K])


@triton.jit
def _completed(acc, INTERPRET: tl.constexpr):
    """``acc`` unchanged, through a register move that Triton's pipeliner cannot see through
    (ptxas removes it): read at the top of a trip, it makes the previous trip's dot into
    ``acc`` complete before the trip starts, so that the pipeliner leaves that dot whole."""
    if INTERPRET:
        return acc
    else:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [acc], dtype=tl.float32, is_pure=True,
                                         pack=1)


@triton.jit
def _activation_tile(x_ptr, x_rows, stride_xm, k0, columns, K, MASK_K: tl.constexpr):
    """Activation rows ``x_rows``, K columns ``k0 + columns``: bf16 [rows, BLOCK_K]; where K is
    not a multiple of 256 (``MASK_K``), zeros past K."""
    ptrs = x_ptr + x_rows[:, None] * stride_xm + k0 + columns[None, :]
    if MASK_K:
        return tl.load(ptrs, mask=(k0 + columns < K)[None, :], other=0.0)
    else:
        return tl.load(ptrs)


IN_PLACE_PARTIALS_BUCKET = tl.constexpr(64)
"""The bucket whose split-K partials each thread stores from the accumulator's own registers
(``_store_in_place``) where its activations come by pointers. ``tl.store`` first moves the
accumulator to a store-friendly layout through shared memory (stores, barriers, loads), and
the loop's schedule follows its epilogue. In place is faster at bucket 64 with pointer
copies and slower with TMA copies and at smaller buckets (docs/decisions.md), hence this one
bucket."""


@triton.constexpr_function
def partials_stored_in_place(bucket, windows):
    """Whether a split-K program of ``bucket`` stores its partials in place (``_store_in_place``);
    ``windows``: its activations come by TMA (``batch_rows``). The kernel's rule, read by the
    SASS census tests too."""
    return bucket == IN_PLACE_PARTIALS_BUCKET.value and not windows


@triton.jit
def _store_rows(acc, out_ptr, first_row, offs_n, n_mask, M, stride_om, BUCKET: tl.constexpr,
                BATCH_ROWS: tl.constexpr, WINDOWS: tl.constexpr, PARTIAL: tl.constexpr, INTERPRET: tl.constexpr):
    """Store ``acc`` [BLOCK_N, R], accumulator rows ``first_row`` .. ``first_row + R - 1``,
    to their batch rows where ``batch_rows`` stores them: bf16 outputs, or fp32 partials
    where ``PARTIAL`` (in place where ``partials_stored_in_place`` says; the interpreter has
    no inline PTX)."""
    rows, stored = batch_rows(first_row + tl.arange(0, acc.shape[1]), M, BUCKET, BATCH_ROWS, WINDOWS)
    ptrs = out_ptr + rows[None, :] * stride_om + offs_n[:, None]
    mask = n_mask[:, None] & stored[None, :]
    if not PARTIAL:
        tl.store(ptrs, to_bf16(acc, INTERPRET), mask=mask)
    elif partials_stored_in_place(BUCKET, WINDOWS) and not INTERPRET:
        _store_in_place(ptrs, acc, mask)
    else:
        tl.store(ptrs, acc, mask=mask)


@triton.jit
def _store_in_place(ptrs, values, mask):
    """``tl.store(ptrs, values, mask=mask)`` of fp32 ``values``, each element stored by the
    thread that holds it, in the layout it has: one predicated ``st.global.f32`` an element.
    A warp's stores still fill whole 32-byte sectors (in the tensor-core accumulator's layout a
    quad holds eight consecutive columns of a batch row)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred stored; setp.ne.b32 stored, $3, 0; @stored st.global.f32 [$1], $2; mov.b32 $0, 0; }",
        "=r,l,r,r", [ptrs.to(tl.int64), values, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit(launch_metadata=report_grid)
def _w4a16_kernel(
    x_ptr, q_ptr, sc_ptr, ss_ptr, zc_ptr, zs_ptr, out_ptr,
    M, N, K, stride_xm, stride_qn, stride_cn, stride_sn, split_k, short_columns, stride_os, stride_om,
    PARTIAL: tl.constexpr,
    BUCKET: tl.constexpr,
    BATCH_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    TMA_ACTIVATIONS: tl.constexpr,
    BALANCED: tl.constexpr,
    MASK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr,
):
    """Programs: (N tiles, split_k), each tile split ``split_k`` ways over the main loop's
    trips, or where ``BALANCED`` a 1-D grid whose first ``short_columns`` one way fewer
    (``split_program``); every program multiplies BATCH_ROWS activation rows
    (``configs.w4a16_batch_rows``: the bucket, or three quarters of it), which stand for the
    batch's M rows as ``batch_rows`` says.
    Row strides of the codes (qn) and scale/zero codes (cn), both in int32 words, and of the
    steps (sn) are passed apart from K so that Triton's divisibility specialization proves
    their alignment.

    BATCH_ROWS: the bucket's rows in one dot, or three quarters of them in two: a dot of
    BUCKET / 2 rows (``HEAD_ROWS``) and one of BUCKET / 4 (``TAIL_ROWS``) on the same decoded
    weights, for a quarter less tensor-core work and activation traffic. BLOCK_N: weight rows
    per program. BLOCK_K: weights of K per main-loop trip, a super-block (256) or half of one
    (128: half the shared memory per pipeline stage and half the decoded tile's registers,
    for more programs per SM at large buckets). STAGES: software-pipelining depth over trips.
    TMA_ACTIVATIONS: the head dot's activation tile is copied by the tensor memory
    accelerator from a tensor descriptor made here (``activation_windows``) instead of by
    per-thread pointer copies: one copy instruction a trip for eight, and about 20 fewer
    registers (``configs.W4A16_TMA_STAGES`` says where it is used). The descriptor is written
    to global scratch that the launch allocates (``tma_scratch.with_scratch``).
    BALANCED: the 1-D grid of a balanced split (``short_columns`` not 0; the launch,
    ``split_k.launch_split_k_gemm``, sets it with the grid). The plain grid takes
    its tile and split from the program ids, which the compiler reads again for free where
    it needs them; the 1-D grid's are divisions by the runtime split held through the loop,
    which costs registers and spills, so only balanced launches use it.
    MASK_K: K (the activations' columns) is not a multiple of 256; the weights hold
    ``stored_k(K)`` columns, zero past K, and the trips run to the first BLOCK_K past K, their
    activations past K read as zeros (TMA copies zero-fill past the descriptor's K anyway).
    INTERPRET: bf16 arithmetic and dot operands in fp32 (exact for these values), since the
    interpreter computes bf16 math on raw bits. PARTIAL: write fp32 partials
    [split_k, BUCKET, N] (split_k > 1) instead of bf16 outputs. DEPENDENT_LAUNCH: launched
    with programmatic dependent launch (``dependent_launch``).
    """
    tl.static_assert(BATCH_ROWS == BUCKET or 4 * BATCH_ROWS == 3 * BUCKET,
                     "BATCH_ROWS is the bucket or three quarters of it")
    HEAD_ROWS: tl.constexpr = BUCKET if BATCH_ROWS == BUCKET else BUCKET // 2
    TAIL_ROWS: tl.constexpr = BATCH_ROWS - HEAD_ROWS
    wait_for_previous_kernel(DEPENDENT_LAUNCH)
    if BALANCED:
        pid_n, pid_s, splits = split_program(tl.program_id(0), split_k, short_columns, BLOCK_N)
    else:
        pid_n, pid_s, splits = tl.program_id(0), tl.program_id(1), split_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.where(n_mask, offs_n, 0)
    words_of_trip = tl.arange(0, BLOCK_K // 8)
    columns = tl.arange(0, BLOCK_K)
    head_rows = activation_rows(tl.arange(0, HEAD_ROWS), M, BUCKET, BATCH_ROWS, TMA_ACTIVATIONS)
    first_trip, trips = split_bounds(pid_s, splits, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros((BLOCK_N, HEAD_ROWS), tl.float32)
    if TAIL_ROWS > 0:
        tail_rows = activation_rows(HEAD_ROWS + tl.arange(0, TAIL_ROWS), M, BUCKET, BATCH_ROWS, TMA_ACTIVATIONS)
        tail_acc = tl.zeros((BLOCK_N, TAIL_ROWS), tl.float32)
    # A trip's scale and zero codes and steps are a few bytes per row. Loaded in the trip that
    # uses them, they stalled it on global memory and reached the decode's layout through
    # shared memory behind a barrier; given to the pipeliner as words, they came back as 64
    # four-byte copies a trip (offline sm_90). So they are loaded by hand one trip ahead, a
    # loop-carried value the pipeliner leaves alone, straight into the decode's registers.
    meta = _trip_meta(sc_ptr, ss_ptr, zc_ptr, zs_ptr, rows, stride_cn, stride_sn, first_trip, BLOCK_K)
    selectors = _quad_lane_selectors(repeat_columns(meta[0], 4), INTERPRET)
    last_trip = first_trip + trips - 1
    if TMA_ACTIVATIONS:
        head_windows = activation_windows(x_ptr, M, K, stride_xm, BUCKET, BATCH_ROWS, HEAD_ROWS, BLOCK_K)
    for trip in tl.range(first_trip, last_trip + 1, num_stages=STAGES):
        if dot_waited_within_trip(HEAD_ROWS, PARTIAL):
            acc = _completed(acc, INTERPRET)
        if TAIL_ROWS > 0:  # a quarter of the bucket, always within WAITED_DOT_MAX_ROWS
            tail_acc = _completed(tail_acc, INTERPRET)
        k0 = trip * BLOCK_K
        words = tl.load(q_ptr + rows[:, None] * stride_qn + k0 // 8 + words_of_trip[None, :])
        scale_codes, scale_step, zero_codes, zero_step = meta
        meta = _trip_meta(sc_ptr, ss_ptr, zc_ptr, zs_ptr, rows, stride_cn, stride_sn,
                          tl.minimum(trip + 1, last_trip), BLOCK_K)
        groups = _group_values(scale_codes, scale_step, zero_codes, zero_step, selectors, INTERPRET)
        w = _decode(words, groups, INTERPRET)
        if TMA_ACTIVATIONS:
            head = tl.reshape(head_windows.load([0, 0, k0]), [HEAD_ROWS, BLOCK_K])
        else:
            head = _activation_tile(x_ptr, head_rows, stride_xm, k0, columns, K, MASK_K)
        acc += bf16_dot(w, tl.trans(head), INTERPRET)
        if TAIL_ROWS > 0:
            tail = _activation_tile(x_ptr, tail_rows, stride_xm, k0, columns, K, MASK_K)
            tail_acc += bf16_dot(w, tl.trans(tail), INTERPRET)
    let_next_kernel_launch(DEPENDENT_LAUNCH)
    out_ptr += pid_s * stride_os
    _store_rows(acc, out_ptr, 0, offs_n, n_mask, M, stride_om, BUCKET, BATCH_ROWS, TMA_ACTIVATIONS, PARTIAL,
                INTERPRET)
    if TAIL_ROWS > 0:
        _store_rows(tail_acc, out_ptr, HEAD_ROWS, offs_n, n_mask, M, stride_om, BUCKET, BATCH_ROWS, TMA_ACTIVATIONS,
                    PARTIAL, INTERPRET)


def launch_w4a16(bucket, x, weights, *, split_k: int, balanced: bool, kernel, dynamic_m: bool):
    """Run ``kernel`` on bf16 ``x``, reading the codes, the scale codes and the zero codes as
    ``CODE_WORD`` words, on the activation rows ``w4a16_batch_rows`` gives (for a symbolic M,
    ``dynamic_m``, the rows of any M of the bucket, also where ``x`` is a concrete stand-in
    being timed: the timed kernel is the one the traced graph compiles), split ``split_k``
    ways on the plain grid or a ``balanced`` one (``configs.balanced_short_columns``), with
    global scratch for the configs that make tensor descriptors and each launch's shared
    memory carveout fitted to its grid (``smem_carveout``)."""
    qdata, scale, scale_step, zero_point, zero_point_step = weights
    short_columns = balanced_short_columns(qdata.shape[0], split_k, multiprocessors(x.device)) if balanced else 0
    words = (qdata.view(CODE_WORD), scale.view(CODE_WORD), scale_step, zero_point.view(CODE_WORD), zero_point_step)
    m = x.shape[0]
    with fitted_to_grid():
        return with_scratch(x.device, lambda: launch_split_k_gemm(
            kernel, bucket=bucket, m=m, k=x.shape[1], split_k=split_k, short_columns=short_columns,
            activations=(x,), activation_strides=(x.stride(0),), weights=words,
            constants={"BATCH_ROWS": w4a16_batch_rows(bucket, None if dynamic_m else m)},
        ))
