"""W4A8 GEMM for decode (buckets 1-4): int8 activations x INT4 weights on dp4a.

Cost model: at M <= 4 a linear layer is the time to read
its weights, 0.578 bytes per weight. Decoding a weight to a float costs an int->float
conversion (a quarter-rate instruction) plus an FMA, per weight and per row. Quantizing the
activations to int8 instead lets one ``dp4a`` multiply-add 4 weights with 4 activations in
int32, so the per-weight work is two bit masks per 8 weights plus M/4 dp4a; the scales and
zero points are applied once per group of 32 in fp32:

    y[m, n] = sum_g (dot_g - asum_g * wz_g) * xs_g * ws_g
    dot_g   = sum_{i<32} q[n, 32g+i] * qa[m, 32g+i]   (int32, dp4a)
    asum_g  = sum_{i<32} qa[m, 32g+i]
    ws_g    = sc[n,g] * ss[n,g//8]   wz_g = zc[n,g] * zs[n,g//8]   (fp32)

The GEMM, ``_w4a8_kernel``: each program owns ``BLOCK_N`` weight rows and walks its split of
K ``GROUPS`` groups at a time, loading each group's 16 bytes of codes as four int32 words. Its
activations arrive one of two ways, the same bits either way (``launch_w4a8``'s
``prequantize``, timed per shape with the split-K):
- bf16: each program quantizes the trip's activations itself (``_quantize_groups``: per 32,
  an fp32 scale and an int32 sum) and reuses the int8 words for all the weight rows it holds.
  One launch, which wins where a second launch's fill and drain is a large share of the GEMM
  (M = 1 on most shapes);
- int32 words of ``_quantize_kernel``, quantized once for every program: the per-row
  quantization and its exchanges leave the main loop, which wins at M = 2-4 on all but the
  smallest shapes.
One fp32 accumulator per activation row (up to 4), one partial sum per group lane, reduced
across lanes once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice

from coalesced_int4.kernels.autotune.tuner import launch_or_queue
from coalesced_int4.kernels.device_functions import repeat_columns, to_bf16
from coalesced_int4.kernels.gemm.split_k import launch_split_k_gemm, split_bounds
from coalesced_int4.kernels.ops import family
from coalesced_int4.kernels.ops.validation import CODE_WORD
from coalesced_int4.kernels.runtime import dependent_launch, recorded_call
from coalesced_int4.kernels.runtime.dependent_launch import let_next_kernel_launch, wait_for_previous_kernel

_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: y + M rounds |y| < 2**22 to even
_MAGIC_BITS = tl.constexpr(0x4B400000)  # the bits of M: bits(y + M) - bits(M) = round(y)
_INVERSE_LIMIT = tl.constexpr(2.0**126)  # 1 / scale of a group of denormals overflows
WORDS_PER_GROUP = tl.constexpr(12)
"""A prequantized group of 32 activations (``_quantize_kernel``): 4 int32 words of its even-k
bytes, 4 of its odd-k bytes (``_quantize_groups``' order), then its fp32 scale (as bits), its
int32 sum and two zero words, so that each part is one aligned 16-byte load."""


@triton.jit
def _dp4a(a, b, c, INTERPRET: tl.constexpr):
    """c + sum over 4 bytes of unsigned(a_byte) * signed(b_byte), int32, elementwise."""
    if INTERPRET:  # no inline asm there: the same sum, one byte at a time
        total = c
        for byte in tl.static_range(4):
            ua = (a >> (8 * byte)) & 0xFF
            sb = (b << (24 - 8 * byte)) >> 24
            total += ua * sb
        return total
    else:
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
            dtype=tl.int32, is_pure=True, pack=1,
        )


@triton.jit
def _group_words(words, GROUPS: tl.constexpr):
    """[R, 4 * GROUPS] int32 -> four [R, GROUPS]: words 0, 2, 1 and 3 of each group. A group's
    words sit in one thread's registers, so this moves no data."""
    low, high = tl.split(tl.reshape(words, [words.shape[0], GROUPS, 2, 2]))
    w0, w2 = tl.split(low)
    w1, w3 = tl.split(high)
    return w0, w2, w1, w3


@triton.jit
def _in_dot_layout(per_group, GROUPS: tl.constexpr):
    """[R, GROUPS] -> the same values as ``_group_words`` leaves the dot products: spread to
    the four words of each group and split, so that the per-group data meets each row's dot
    products where they are computed (moved once a trip, not once a row)."""
    return _group_words(repeat_columns(per_group, 4), GROUPS)[0]


@triton.jit
def _dot4(w, x, total, INTERPRET: tl.constexpr):
    """``total`` plus the dp4a of the four word pairs of ``w`` and ``x`` (``_group_words``
    tuples), chained through dp4a's accumulator: no separate sum of the four products."""
    total = _dp4a(w[0], x[0], total, INTERPRET)
    total = _dp4a(w[1], x[1], total, INTERPRET)
    total = _dp4a(w[2], x[2], total, INTERPRET)
    return _dp4a(w[3], x[3], total, INTERPRET)


@triton.jit
def _product_rn(a, b, INTERPRET: tl.constexpr):
    """a * b rounded to fp32 on its own: a ``mul.rn`` that ptxas may not fuse with the add
    that follows into one FMA, which would round the exact product to an integer instead of
    rounding the fp32 product (the reference's ``round(v * inv)``)."""
    if INTERPRET:  # no libdevice there; numpy rounds every product
        return a * b
    else:
        return libdevice.mul_rn(a, b)


@triton.jit
def _quantize_groups(v, INTERPRET: tl.constexpr):
    """[G, 32] fp32 activations -> int8 per group of 32: (even-k words [G, 4], odd-k words
    [G, 4], fp32 scales [G], int32 sums [G]). scale = amax / 127 and
    q = clamp(round_half_even(v * (1 / scale)), -127, 127), except in a group of denormals
    (amax < 127 * 2**-126), whose 1 / scale overflows: there the inverse is cut to 2**126
    (the reference's v * inf is undefined). Word j of a group holds the bytes of
    k = 8j, 8j + 2, 8j + 4, 8j + 6 (even) or k = 8j + 1, ... (odd), lining up with the low and
    high nibbles of the group's weight word j."""
    amax = tl.max(tl.abs(v), axis=1)
    scale = amax / 127.0
    inverse = tl.where(amax > 0, tl.minimum(1.0 / scale, _INVERSE_LIMIT), 0.0)
    # |v * inverse| <= 127 * (1 + 2 ulp) < 127.5 whenever 1 / scale is below the limit, and
    # < 127 when it is cut to it (amax < 127 / limit): the clamp to [-127, 127] never acts, so
    # none is done. Adding the magic rounds half to even and leaves q + 0x4B400000 in the bits.
    y = _product_rn(v, inverse[:, None], INTERPRET)
    q = (y + _ROUND_MAGIC).to(tl.int32, bitcast=True) - _MAGIC_BITS
    # k = 8 word + 2 byte + parity: [G, 32] -> [G, word, byte, parity]; bytes are disjoint,
    # so their shifted sum is their concatenation.
    parts = tl.reshape(q & 0xFF, [v.shape[0], 4, 4, 2])
    shifts = 8 * tl.arange(0, 4)
    even, odd = tl.split(tl.sum(parts << shifts[None, None, :, None], axis=2))
    return even, odd, scale, tl.sum(q, axis=1)


@triton.jit
def _quantize_kernel(x_ptr, out_ptr, K, stride_xm, stride_om, GROUPS: tl.constexpr, INTERPRET: tl.constexpr,
                     DEPENDENT_LAUNCH: tl.constexpr):
    """Program (block of GROUPS groups, row): bf16 activations -> ``WORDS_PER_GROUP`` int32
    words a group of 32, the same values the GEMM's own quantization makes.
    DEPENDENT_LAUNCH: launched with programmatic dependent launch (``dependent_launch``)."""
    wait_for_previous_kernel(DEPENDENT_LAUNCH)
    row = tl.program_id(1)
    group_idx = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    mask = (group_idx < K // 32)[:, None]
    k = group_idx[:, None] * 32 + tl.arange(0, 32)[None, :]
    v = tl.load(x_ptr + row * stride_xm + k, mask=mask, other=0.0)
    even, odd, scale, sums = _quantize_groups(v.to(tl.float32), INTERPRET)
    word = tl.arange(0, 4)[None, :]
    meta = tl.where(word == 0, scale.to(tl.int32, bitcast=True)[:, None], tl.where(word == 1, sums[:, None], 0))
    let_next_kernel_launch(DEPENDENT_LAUNCH)
    ptrs = out_ptr + row * stride_om + group_idx[:, None] * WORDS_PER_GROUP + word
    tl.store(ptrs, even, mask=mask)
    tl.store(ptrs + 4, odd, mask=mask)
    tl.store(ptrs + 8, meta, mask=mask)


QUANTIZE_GROUPS = 16
"""Groups of 32 per ``_quantize_kernel`` program."""


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """bf16 [M, K] -> int32 [M, K / 32 * WORDS_PER_GROUP], for the GEMM to read."""
    m, k = x.shape
    out = recorded_call.empty((m, k // 32 * WORDS_PER_GROUP), torch.int32, x.device)
    launch_or_queue(family.launchable(_quantize_kernel), (triton.cdiv(k // 32, QUANTIZE_GROUPS), m),
                    x, out, k, x.stride(0), out.stride(0), GROUPS=QUANTIZE_GROUPS,
                    INTERPRET=family.INTERPRETER, num_warps=4, **dependent_launch.options(x))
    return out


@triton.jit
def _activation_groups(group_idx, end_group, K, MASK_K: tl.constexpr):
    """Which groups of a trip hold activations: those before the split's end and, where the
    weight's K is padded (``MASK_K``), before K; the others read zeros."""
    if MASK_K:
        return (group_idx < end_group) & (group_idx < K // 32)
    else:
        return group_idx < end_group


@triton.jit
def _quantized_row(x_ptr, row, stride_xm, g0, end_group, K,
                   GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, MASK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """One activation row's trip, quantized here from bf16 (L2): its even-k and odd-k words
    (``_group_words`` tuples), group sums and scales, broadcast to the weights' layout.
    Groups past the split or past K read zeros."""
    group_idx = g0 + tl.arange(0, GROUPS)
    k = group_idx[:, None] * 32 + tl.arange(0, 32)[None, :]
    v = tl.load(x_ptr + row * stride_xm + k, mask=_activation_groups(group_idx, end_group, K, MASK_K)[:, None],
                other=0.0)
    even, odd, xs, asum = _quantize_groups(v.to(tl.float32), INTERPRET)
    # Everything per group of the row is broadcast to the weights' layout in two exchanges
    # (the int8 words; the sum and scale), then split like the weight words.
    words = tl.broadcast_to(tl.reshape(tl.join(even, odd), [8 * GROUPS])[None, :], [BLOCK_N, 8 * GROUPS])
    x_even, x_odd = tl.split(tl.reshape(words, [BLOCK_N, 4 * GROUPS, 2]))
    per_group = tl.broadcast_to(tl.join(asum.to(tl.float32), xs)[None, :, :], [BLOCK_N, GROUPS, 2])
    asum_f, xs = tl.split(per_group)
    return _group_words(x_even, GROUPS), _group_words(x_odd, GROUPS), asum_f, xs


@triton.jit
def _rows_alike(values, BLOCK_N: tl.constexpr):
    return tl.broadcast_to(values[None, :], [BLOCK_N, values.shape[0]])


@triton.jit
def _prequantized_row(x_ptr, row, M, stride_xm, g0, end_group, K,
                      GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, MASK_K: tl.constexpr):
    """``_quantized_row`` from ``_quantize_kernel``'s words (groups past the split or past K,
    and rows >= M, read zeros). Each part is loaded once as a row vector and broadcast to the weight
    rows: outside branches (``_add_row``), the pipeliner stages these loads in shared memory
    and reads them out straight into the dot products' layout, so nothing is exchanged."""
    cols = tl.arange(0, 4 * GROUPS)
    group = g0 + cols // 4
    ptrs = x_ptr + row * stride_xm + group * WORDS_PER_GROUP + cols % 4
    mask = _activation_groups(group, end_group, K, MASK_K) & (row < M)
    x_even = _group_words(_rows_alike(tl.load(ptrs, mask=mask, other=0), BLOCK_N), GROUPS)
    x_odd = _group_words(_rows_alike(tl.load(ptrs + 4, mask=mask, other=0), BLOCK_N), GROUPS)
    scale_bits, _, asum, _ = _group_words(_rows_alike(tl.load(ptrs + 8, mask=mask, other=0), BLOCK_N), GROUPS)
    return x_even, x_odd, asum.to(tl.float32), scale_bits.to(tl.float32, bitcast=True)


@triton.jit
def _w4a8_row(
    w_low, w_high, ws, wz, x_ptr, row, M, stride_xm, g0, end_group, K,
    GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, PREQUANTIZED: tl.constexpr, MASK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One activation row's contribution for one trip: [BLOCK_N, GROUPS] fp32, from bf16
    activations quantized here (once per program and trip, so a decode GEMM is one kernel)
    or from int32 words that ``_quantize_kernel`` wrote (``PREQUANTIZED``)."""
    if PREQUANTIZED:
        x_even, x_odd, asum_f, xs = _prequantized_row(x_ptr, row, M, stride_xm, g0, end_group, K, GROUPS, BLOCK_N,
                                                      MASK_K)
    else:
        x_even, x_odd, asum_f, xs = _quantized_row(x_ptr, row, stride_xm, g0, end_group, K, GROUPS, BLOCK_N,
                                                   MASK_K, INTERPRET)
    # High nibbles are read in place (x16), so their sum is exact in 16ths: shifted down
    # before the low nibbles' products are chained onto it.
    dot16 = _dot4(w_high, x_odd, tl.zeros((BLOCK_N, GROUPS), tl.int32), INTERPRET)
    dot = _dot4(w_low, x_even, dot16 >> 4, INTERPRET).to(tl.float32)
    return (dot - asum_f * wz) * (xs * ws)


@triton.jit
def _add_row(
    acc, w_low, w_high, ws, wz, x_ptr, row: tl.constexpr, M, stride_xm, g0, end_group, K,
    GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, PREQUANTIZED: tl.constexpr, MASK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """``acc`` plus row ``row``'s trip where row < M. Prequantized, a missing row reads zeros
    instead of being branched around, so that every row's loads sit outside branches, where
    Triton's pipeliner stages them in shared memory and reads them out in the dot products'
    layout (in a branch, each would be loaded once per weight row a thread holds)."""
    if PREQUANTIZED or M > row:
        acc += _w4a8_row(w_low, w_high, ws, wz, x_ptr, row, M, stride_xm, g0, end_group, K,
                         GROUPS, BLOCK_N, PREQUANTIZED, MASK_K, INTERPRET)
    return acc


@triton.jit
def _load_trip(q_ptr, sc_ptr, ss_ptr, zc_ptr, zs_ptr, rows, stride_qn, stride_cn, stride_sn,
               g0, end_group, GROUPS: tl.constexpr):
    """The weights of the trip at group ``g0``, as stored: code words [BLOCK_N, 4 * GROUPS],
    scale and zero codes and their steps [BLOCK_N, GROUPS]; zeros for groups past
    ``end_group``. Group g's 16 code bytes are words 4g..4g+3 of its row (word j holds
    k = 32g + 8j .. 32g + 8j + 7)."""
    group_idx = g0 + tl.arange(0, GROUPS)
    word_idx = 4 * g0 + tl.arange(0, 4 * GROUPS)
    codes = tl.load(q_ptr + rows[:, None] * stride_qn + word_idx[None, :],
                    mask=(word_idx < 4 * end_group)[None, :], other=0)
    meta = rows[:, None] * stride_cn + group_idx[None, :]
    mask = (group_idx < end_group)[None, :]
    # One step per row and super-block, loaded once and repeated for its 8 groups (trips
    # start on super-blocks: splits are whole super-blocks and GROUPS a multiple of 8).
    tl.static_assert(GROUPS % 8 == 0, "a trip covers whole super-blocks")
    sb_idx = g0 // 8 + tl.arange(0, GROUPS // 8)
    steps = rows[:, None] * stride_sn + sb_idx[None, :]
    sb_mask = (sb_idx < end_group // 8)[None, :]
    return (codes, tl.load(sc_ptr + meta, mask=mask, other=0),
            repeat_columns(tl.load(ss_ptr + steps, mask=sb_mask, other=0.0), 8),
            tl.load(zc_ptr + meta, mask=mask, other=0),
            repeat_columns(tl.load(zs_ptr + steps, mask=sb_mask, other=0.0), 8))


@triton.jit
def _w4a8_kernel(
    x_ptr, q_ptr, sc_ptr, ss_ptr, zc_ptr, zs_ptr, out_ptr,
    M, N, K, stride_xm, stride_qn, stride_cn, stride_sn, split_k, stride_os, stride_om,
    PARTIAL: tl.constexpr,
    BUCKET: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUPS: tl.constexpr,
    STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
    MASK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    DEPENDENT_LAUNCH: tl.constexpr,
):
    """Programs: (N tiles, split_k). BUCKET (1-4) rows of accumulators; rows >= M skipped.
    K: the activations' columns; the weights hold ``stored_k(K)``, whole super-blocks.
    ``x_ptr``: bf16 activations, or the int32 words of ``quantize_activations`` (the pointer's
    type is part of the signature, so each compiles apart; ``PREQUANTIZED`` below is read
    from it). Row strides: activations (xm), weight code words (qn), codes (cn) and steps
    (sn). They are passed apart from K so that Triton's divisibility specialization proves
    the 16-byte alignment of every row.

    BLOCK_N: weight rows (outputs) per program. GROUPS: groups of 32 per main-loop trip.
    STAGES: software-pipelining depth of the main loop. PREFETCH: hold the next trip's
    weights in registers, loaded before this trip's arithmetic (more bytes in flight per
    thread, more registers: it wins at M = 1 and loses at M = 4, so it is timed like the
    tile). MASK_K: K is not a multiple of 256, so activation loads past K read zeros (the
    weights' padding is zero too). INTERPRET: portable dp4a and bf16 rounding for Triton's
    interpreter (inline PTX otherwise). PARTIAL: write fp32 partials [split_k, BUCKET, N] (split_k > 1)
    instead of bf16 outputs. DEPENDENT_LAUNCH: launched with programmatic dependent launch
    (``dependent_launch``).
    """
    PREQUANTIZED: tl.constexpr = x_ptr.dtype.element_ty == tl.int32
    wait_for_previous_kernel(DEPENDENT_LAUNCH)
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.where(n_mask, offs_n, 0)  # clamp: out-of-range rows read row 0, never stored
    first_sb, sb_count = split_bounds(pid_s, split_k, tl.cdiv(K, 256))
    first_group = first_sb * 8
    end_group = first_group + sb_count * 8
    acc0 = tl.zeros((BLOCK_N, GROUPS), tl.float32)
    acc1 = tl.zeros((BLOCK_N, GROUPS), tl.float32)
    acc2 = tl.zeros((BLOCK_N, GROUPS), tl.float32)
    acc3 = tl.zeros((BLOCK_N, GROUPS), tl.float32)
    if PREFETCH:
        trip = _load_trip(q_ptr, sc_ptr, ss_ptr, zc_ptr, zs_ptr, rows, stride_qn, stride_cn,
                          stride_sn, first_group, end_group, GROUPS)
    for g0 in tl.range(first_group, end_group, GROUPS, num_stages=STAGES):
        if PREFETCH:
            # The next trip's weights are requested before this trip's arithmetic so that
            # their memory latency overlaps it (past the split they are masked: no traffic).
            w, scale_codes, scale_steps, zero_codes, zero_steps = trip
            trip = _load_trip(q_ptr, sc_ptr, ss_ptr, zc_ptr, zs_ptr, rows, stride_qn, stride_cn,
                              stride_sn, g0 + GROUPS, end_group, GROUPS)
        else:
            w, scale_codes, scale_steps, zero_codes, zero_steps = _load_trip(
                q_ptr, sc_ptr, ss_ptr, zc_ptr, zs_ptr, rows, stride_qn, stride_cn, stride_sn,
                g0, end_group, GROUPS)
        w_low = _group_words(w & 0x0F0F0F0F, GROUPS)
        w_high = _group_words(w & -252645136, GROUPS)  # 0xF0F0F0F0
        ws = scale_codes.to(tl.float32) * scale_steps.to(tl.float32)
        wz = zero_codes.to(tl.float32) * zero_steps.to(tl.float32)
        # Moved once to serve every row; a single quantized row's products move instead.
        if BUCKET > 1 or PREQUANTIZED:
            ws = _in_dot_layout(ws, GROUPS)
            wz = _in_dot_layout(wz, GROUPS)
        acc0 += _w4a8_row(w_low, w_high, ws, wz, x_ptr, 0, M, stride_xm, g0, end_group, K,
                          GROUPS, BLOCK_N, PREQUANTIZED, MASK_K, INTERPRET)
        if BUCKET > 1:
            acc1 = _add_row(acc1, w_low, w_high, ws, wz, x_ptr, 1, M, stride_xm, g0, end_group, K,
                            GROUPS, BLOCK_N, PREQUANTIZED, MASK_K, INTERPRET)
        if BUCKET > 2:
            acc2 = _add_row(acc2, w_low, w_high, ws, wz, x_ptr, 2, M, stride_xm, g0, end_group, K,
                            GROUPS, BLOCK_N, PREQUANTIZED, MASK_K, INTERPRET)
        if BUCKET > 3:
            acc3 = _add_row(acc3, w_low, w_high, ws, wz, x_ptr, 3, M, stride_xm, g0, end_group, K,
                            GROUPS, BLOCK_N, PREQUANTIZED, MASK_K, INTERPRET)
    let_next_kernel_launch(DEPENDENT_LAUNCH)
    base = out_ptr + pid_s * stride_os + offs_n
    _store_row(base, tl.sum(acc0, axis=1), n_mask, PARTIAL, INTERPRET)
    if BUCKET > 1:
        _store_row(base + stride_om, tl.sum(acc1, axis=1), n_mask & (M > 1), PARTIAL, INTERPRET)
    if BUCKET > 2:
        _store_row(base + 2 * stride_om, tl.sum(acc2, axis=1), n_mask & (M > 2), PARTIAL, INTERPRET)
    if BUCKET > 3:
        _store_row(base + 3 * stride_om, tl.sum(acc3, axis=1), n_mask & (M > 3), PARTIAL, INTERPRET)


@triton.jit
def _store_row(ptrs, values, mask, PARTIAL: tl.constexpr, INTERPRET: tl.constexpr):
    if not PARTIAL:
        tl.store(ptrs, to_bf16(values, INTERPRET), mask=mask)
    else:
        tl.store(ptrs, values, mask=mask)


def launch_w4a8(bucket, x, weights, *, split_k: int, prequantize: bool, kernel):
    """Run ``kernel`` (the bucket's autotuner or a single-config one) on bf16 ``x``,
    quantized inside the GEMM or first by ``quantize_activations`` (``prequantize``)."""
    m, k = x.shape
    qdata, *meta = weights
    if prequantize:
        x = quantize_activations(x)
    return launch_split_k_gemm(
        kernel, bucket=bucket, m=m, k=k, split_k=split_k,
        activations=(x,), activation_strides=(x.stride(0),), weights=(qdata.view(CODE_WORD), *meta),
    )
