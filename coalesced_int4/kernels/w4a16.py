"""W4A16 GEMM for small batches (buckets 8-64): weights decoded to bf16, tensor-core dot.

Per super-block of 256 weights a program loads 128 code bytes per weight row, splits the
nibbles into k order, decodes ``w = bf16(bf16(q - zero) * scale)`` with
``scale = bf16(sc * ss)`` and ``zero = bf16(zc * zs)`` (the reference's bf16 rounding chain),
and accumulates ``acc[BLOCK_N, BUCKET] += w @ x^T`` in fp32. The weights are the left operand
(M of the MMA is BLOCK_N >= 32), the activations the right one (N of the MMA is the bucket,
8..64): at these batch sizes this keeps the tensor cores busy without padding M, and every
activation row is covered by one tile so each weight is decoded exactly once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coalesced_int4.kernels.rounding import bf16_dot, to_bf16
from coalesced_int4.kernels.split_k import launch_split_k_gemm, split_bounds
from coalesced_int4.kernels.tiles import repeat_columns


@triton.jit
def _bf16_chain(q, zero, scale, INTERPRET: tl.constexpr):
    """bf16(bf16(q - zero) * scale) from 4-bit codes ``q`` (uint8) and bf16 ``zero`` and
    ``scale``. On the GPU the code becomes a bf16 without an int->float conversion (a
    quarter-rate instruction, one per weight): ``0x4300 | q`` is the bf16 bit pattern of
    128 + q, and subtracting 128 is exact. The interpreter does bf16 arithmetic on raw bits,
    so there each step runs in fp32 and is rounded to bf16: the same value, since every fp32
    intermediate here is exact."""
    if INTERPRET:
        diff = to_bf16(q.to(tl.float32) - zero.to(tl.float32), INTERPRET)
        return to_bf16(diff.to(tl.float32) * scale.to(tl.float32), INTERPRET)
    else:
        q_bf16 = (q.to(tl.int16) | 0x4300).to(tl.bfloat16, bitcast=True) - 128.0
        return (q_bf16 - zero) * scale


@triton.jit
def _bf16_product(a, b, INTERPRET: tl.constexpr):
    if INTERPRET:
        return to_bf16(a.to(tl.float32) * b.to(tl.float32), INTERPRET)
    else:
        return a * b


@triton.jit
def _w4a16_kernel(
    x_ptr, q_ptr, sc_ptr, ss_ptr, zc_ptr, zs_ptr, out_ptr,
    M, N, K, stride_xm, stride_qn, stride_cn, stride_sn, split_k, stride_os, stride_om,
    PARTIAL: tl.constexpr,
    BUCKET: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STAGES: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Programs: (N tiles, split_k); every program covers all BUCKET rows (rows >= M masked).
    Row strides of the codes (qn, bytes), scale/zero codes (cn) and steps (sn) are passed
    apart from K so that Triton's divisibility specialization proves their alignment.

    BLOCK_N: weight rows per program. BLOCK_K: weights of K per main-loop trip, a super-block
    (256) or half of one (128: half the shared memory per pipeline stage and half the decoded
    tile's registers, for more programs per SM at large buckets). STAGES: software-pipelining
    depth over trips. INTERPRET: bf16 arithmetic and dot operands in fp32 (exact for these
    values), since the interpreter computes bf16 math on raw bits. PARTIAL: write fp32
    partials [split_k, BUCKET, N] (split_k > 1) instead of bf16 outputs.
    """
    TRIPS_PER_SB: tl.constexpr = 256 // BLOCK_K
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = tl.where(n_mask, offs_n, 0)
    offs_m = tl.arange(0, BUCKET)
    m_mask = offs_m < M
    code_bytes = tl.arange(0, BLOCK_K // 2)
    columns = tl.arange(0, BLOCK_K)
    groups = tl.arange(0, BLOCK_K // 32)
    first_sb, sb_count = split_bounds(pid_s, split_k, K // 256)
    first_trip = first_sb * TRIPS_PER_SB
    last_sb = first_sb + sb_count - 1
    acc = tl.zeros((BLOCK_N, BUCKET), tl.float32)
    # The fp16 steps (one per row and super-block) are too narrow for the pipeliner's async
    # copies, so they are prefetched by hand: the next trip's are requested before this
    # trip's arithmetic instead of stalling every trip on a global load.
    scale_step = tl.load(ss_ptr + rows * stride_sn + first_sb)
    zero_step = tl.load(zs_ptr + rows * stride_sn + first_sb)
    for trip in tl.range(first_trip, first_trip + sb_count * TRIPS_PER_SB, num_stages=STAGES):
        k0 = trip * BLOCK_K
        packed = tl.load(q_ptr + rows[:, None] * stride_qn + k0 // 2 + code_bytes[None, :])
        q = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BLOCK_N, BLOCK_K])
        meta = rows[:, None] * stride_cn + k0 // 32 + groups[None, :]
        scale = _bf16_product(tl.load(sc_ptr + meta).to(tl.float32).to(tl.bfloat16),
                              to_bf16(scale_step.to(tl.float32), INTERPRET)[:, None], INTERPRET)
        zero = _bf16_product(tl.load(zc_ptr + meta).to(tl.float32).to(tl.bfloat16),
                             to_bf16(zero_step.to(tl.float32), INTERPRET)[:, None], INTERPRET)
        next_step = rows * stride_sn + tl.minimum((trip + 1) // TRIPS_PER_SB, last_sb)
        scale_step = tl.load(ss_ptr + next_step)
        zero_step = tl.load(zs_ptr + next_step)
        scale = repeat_columns(scale, 32)
        zero = repeat_columns(zero, 32)
        w = _bf16_chain(q, zero, scale, INTERPRET)
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + k0 + columns[None, :],
                    mask=m_mask[:, None], other=0.0)
        acc += bf16_dot(w, tl.trans(a), INTERPRET)
    ptrs = out_ptr + pid_s * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
    mask = n_mask[:, None] & m_mask[None, :]
    if not PARTIAL:
        tl.store(ptrs, to_bf16(acc, INTERPRET), mask=mask)
    else:
        tl.store(ptrs, acc, mask=mask)


def launch_w4a16(bucket, x, weights, *, split_k: int, kernel):
    return launch_split_k_gemm(
        kernel, bucket=bucket, m=x.shape[0], k=x.shape[1], split_k=split_k,
        activations=(x,), activation_strides=(x.stride(0),), weights=weights, code_dtype=torch.uint8,
    )
