"""Attention of one new token over a KV cache: ``torch.ops.coalesced_int4.decode_attention``.

``(q (B, H, D) bf16, k_cache, v_cache (B, KVH, S, D) bf16, position (1,) int64) -> (B, H, D)
bf16``: each query head h attends to cache positions ``0..position`` of its KV head
``h // (H // KVH)`` (grouped-query attention), softmax scaled by ``1 / sqrt(D)``, exactly the
causal attention of a query at ``position``. The position is read on the device, so a CUDA
graph of a decode step replays it at every position; for the same reason it is not checked
against the cache: it must be below S (the decoder's cache write fails first otherwise).

One program per (sequence, KV head) holds all of that head's query heads as the rows of one
tensor-core tile, so each cached key and value is read once, and streams the cache in blocks
of ``BLOCK_POSITIONS`` with an online softmax (fp32 running max, sum and output). It exists
because cuDNN's SDPA, which PyTorch picks for a one-row query with a boolean mask, is several
times slower at short caches (docs/decisions.md).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from coalesced_int4.kernels.device_functions import bf16_dot, to_bf16
from coalesced_int4.kernels.ops.family import INTERPRETER, NAMESPACE
from coalesced_int4.torch_internals import is_fake, set_wrap_triton_enabled

BLOCK_POSITIONS = 64
STAGES = 3
"""Positions per trip and pipeline depth: with 4 warps, the fastest of a sweep of 32-128
positions, 2-4 stages and 4-8 warps at most of its batch and position points."""
MIN_DOT_ROWS = 16
"""A tensor-core dot needs at least 16 rows; a KV head's query heads are padded to it."""
MAX_CACHE_POSITIONS = 512
"""The longest cache the kernel is used for: one program per (sequence, KV head) streams all
of it, so its time grows with the position where SDPA's barely does; longer caches keep SDPA
until a split over positions is measured."""


def serves(query_length: int, k_cache: torch.Tensor) -> bool:
    """Whether a decoder's attention step goes to this kernel: one new token per sequence,
    a CUDA cache (real, or fake while compiling) of at most ``MAX_CACHE_POSITIONS``."""
    return query_length == 1 and k_cache.is_cuda and k_cache.shape[2] <= MAX_CACHE_POSITIONS


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, position_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh,
    GROUP: tl.constexpr,
    GROUP_ROWS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK_POSITIONS: tl.constexpr,
    STAGES: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Programs: (sequence, KV head). GROUP: query heads per KV head; GROUP_ROWS: GROUP
    padded to a dot's rows (the padding rows are zero queries, never stored). HEAD_DIM: the
    head size, a power of two. SCALE: the scores' factor, 1 / sqrt(HEAD_DIM) (a
    constant: a float argument reaches Inductor's launch as an fp64, which would turn the
    softmax into fp64). BLOCK_POSITIONS: cache positions per trip. STAGES: software
    pipelining depth over trips. INTERPRET: dots in fp32 and bf16 rounding by bits."""
    batch = tl.program_id(0)
    kv_head = tl.program_id(1)
    rows = tl.arange(0, GROUP_ROWS)
    dims = tl.arange(0, HEAD_DIM)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    q = tl.load(q_ptr + batch * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=row_mask[:, None], other=0.0)
    k_base = k_ptr + batch * stride_kb + kv_head * stride_kh
    v_base = v_ptr + batch * stride_vb + kv_head * stride_vh
    length = tl.load(position_ptr).to(tl.int32) + 1
    running_max = tl.full((GROUP_ROWS,), float("-inf"), tl.float32)
    running_sum = tl.zeros((GROUP_ROWS,), tl.float32)
    acc = tl.zeros((GROUP_ROWS, HEAD_DIM), tl.float32)
    for start in tl.range(0, length, BLOCK_POSITIONS, num_stages=STAGES):
        positions = start + tl.arange(0, BLOCK_POSITIONS)
        valid = positions < length
        k = tl.load(k_base + positions[:, None] * stride_ks + dims[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_base + positions[:, None] * stride_vs + dims[None, :], mask=valid[:, None], other=0.0)
        scores = tl.where(valid[None, :], bf16_dot(q, tl.trans(k), INTERPRET) * SCALE, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        correction = tl.exp(running_max - new_max)
        weights = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(weights, 1)
        acc = acc * correction[:, None] + bf16_dot(to_bf16(weights, INTERPRET), v, INTERPRET)
        running_max = new_max
    out = acc / running_sum[:, None]
    tl.store(out_ptr + batch * stride_ob + heads[:, None] * stride_oh + dims[None, :],
             to_bf16(out, INTERPRET), mask=row_mask[:, None])


def _check(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, position: torch.Tensor) -> None:
    """Raise a ValueError naming the tensor and the rule each argument breaks."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"decode_attention: q must be (B, H, D) and k_cache, v_cache one (B, KVH, S, D) "
                         f"shape; got q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, "
                         f"v_cache {tuple(v_cache.shape)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.bfloat16 or t.stride(-1) != 1:
            raise ValueError(f"decode_attention: {name} must be bf16 with unit stride in D, "
                             f"got {t.dtype} with strides {t.stride()}")
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if k_cache.shape[0] != batch or k_cache.shape[3] != head_dim or heads % kv_heads:
        raise ValueError(f"decode_attention: k_cache {tuple(k_cache.shape)} does not serve q "
                         f"{tuple(q.shape)} (same B and D, H a multiple of KVH)")
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"decode_attention: D must be a power of two >= 16, got {head_dim}")
    if position.shape != (1,) or position.dtype != torch.int64 or position.device != q.device:
        raise ValueError(f"decode_attention: position must be one int64 on q's device, got "
                         f"{position.dtype} {tuple(position.shape)} on {position.device}")


@triton_op(f"{NAMESPACE}::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     position: torch.Tensor) -> torch.Tensor:
    """Attention of ``q`` (one token per sequence) over cache positions ``0..position``."""
    _check(q, k_cache, v_cache, position)
    batch, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    # Tracing records the launch through wrap_triton; eager launches run the kernel itself
    # (torch 2.11's wrap_triton refuses an interpreted kernel even where it would return it).
    with set_wrap_triton_enabled(is_fake(q)):
        kernel = wrap_triton(_decode_attention_kernel) if is_fake(q) else _decode_attention_kernel
        kernel[(batch, kv_heads)](
            q, k_cache, v_cache, out, position,
            q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            out.stride(0), out.stride(1),
            GROUP=group, GROUP_ROWS=max(MIN_DOT_ROWS, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
            SCALE=1.0 / math.sqrt(head_dim), BLOCK_POSITIONS=BLOCK_POSITIONS, STAGES=STAGES,
            INTERPRET=INTERPRETER, num_warps=4,
        )
    return out


@decode_attention.register_fake
def _(q, k_cache, v_cache, position):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
