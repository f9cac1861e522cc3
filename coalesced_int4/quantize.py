"""Dense weights to the coalesced INT4 format, and back.

Contract (docs/format.md states it in full):

* ``quantize_weight(w)`` takes a 2-D floating weight ``(N, K)`` on any device, ``K`` a
  multiple of 32, and returns the five stored tensors of :class:`PackedInt4`, sized for
  ``stored_k(K)`` columns: a K that is not a multiple of 256 is padded with zero columns to
  whole super-blocks (they quantize to zero codes and zero values). The codes are
  bit-identical to torchao's asymmetric ``min_max`` quantizer (``choose_qparams_affine`` +
  ``quantize_affine`` with quant range [0, 15], bf16 scale and zero point) of the padded
  weight followed by the per-256 "superscale" encoder, on every device.
* ``dequantize_packed(packed, dtype)`` evaluates
  ``w[n,k] = (q - zc*zs) * (sc*ss)`` with every product rounded to ``dtype`` over the stored
  columns (the caller drops the padding); in fp32 this is the exact value of the format, in
  bf16 it is the rounding chain the W4A16 kernels and the dequant fallback share.
* Bad input raises ``ValueError`` naming the rule and the shape.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import torch
import torch.nn.functional as F

GROUP_SIZE = 32
"""Weights per (scale code, zero code) pair along K."""
SUPER_BLOCK = 256
"""Weights per fp16 step along K; the stored K is a multiple of it (``stored_k``)."""
GROUPS_PER_SUPER_BLOCK = SUPER_BLOCK // GROUP_SIZE
QUANT_MAX = 15
CODE_MAX = 255
METHODS = ("min_max",)
# torchao clamps the fp32 scale to the fp32 machine epsilon, so an all-zero group gets a
# tiny positive scale instead of zero.
_SCALE_EPS = torch.finfo(torch.float32).eps
# The superscale encoder keeps its max and its step away from zero the same way.
_STEP_FLOOR = 1e-30


def stored_k(k: int) -> int:
    """The columns a weight of K columns is stored with: K rounded up to whole super-blocks.
    The one padding rule of the format, read by the quantizer, the tensor, the kernels'
    argument rule and the checkpoint reader."""
    return -(-k // SUPER_BLOCK) * SUPER_BLOCK


class PackedInt4(NamedTuple):
    """The five stored tensors of one weight, in storage order (Ks = ``stored_k(K)``)."""

    qdata: torch.Tensor  # uint8 (N, Ks/2): k=2j in the low nibble of byte j, k=2j+1 high
    scale: torch.Tensor  # uint8 (N, Ks/32) scale codes
    scale_step: torch.Tensor  # float16 (N, Ks/256)
    zero_point: torch.Tensor  # uint8 (N, Ks/32) zero codes
    zero_point_step: torch.Tensor  # float16 (N, Ks/256)


def unpackable_reason(weight: torch.Tensor) -> str | None:
    """Why ``weight`` cannot be stored in this format, or None if it can.

    Checks only the structural rules (rank, dtype, shape); the values (NaN/Inf) are checked
    when quantizing, since that needs a pass over the data.
    """
    if weight.dim() != 2:
        return f"weight must be 2-D (N, K), got shape {tuple(weight.shape)}"
    if not weight.is_floating_point():
        return f"weight must be floating point, got {weight.dtype}"
    n, k = weight.shape
    if n == 0 or k == 0:
        return f"weight must not be empty, got shape {tuple(weight.shape)}"
    if k % GROUP_SIZE:
        return (
            f"K (in_features) must be a multiple of {GROUP_SIZE}, "
            f"got shape (N={n}, K={k})"
        )
    return None


def quantize_weight(
    weight: torch.Tensor, group_size: int = GROUP_SIZE, method: str = "min_max"
) -> PackedInt4:
    """Quantize a dense ``(N, K)`` weight; the result lives on the weight's device."""
    if group_size != GROUP_SIZE:
        raise ValueError(f"group_size must be {GROUP_SIZE}, got {group_size}")
    if method not in METHODS:
        raise ValueError(f"unknown quantization method {method!r}; supported: {METHODS}")
    reason = unpackable_reason(weight)
    if reason is not None:
        raise ValueError(f"cannot quantize weight: {reason}")
    k = weight.shape[1]
    if stored_k(k) != k:
        weight = F.pad(weight, (0, stored_k(k) - k))
    return PackedInt4(*_quantize_min_max(weight))


@torch.library.custom_op("coalesced_int4::quantize_min_max", mutates_args=())
def _quantize_min_max(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                      torch.Tensor]:
    """The five stored tensors of ``weight``. An op of its own, so that torch.compile calls it
    as it is: Inductor would fuse its bf16 and fp16 round trips into fp32 expressions and give
    other codes than eager."""
    if not torch.isfinite(weight).all():
        raise ValueError(
            f"cannot quantize weight of shape {tuple(weight.shape)}: "
            "it contains NaN or Inf"
        )
    q, scale, zero = _min_max_int4(weight)
    scale_codes, scale_step = encode_superscale(scale)
    zero_codes, zero_step = encode_superscale(zero)
    return pack_nibbles(q), scale_codes, scale_step, zero_codes, zero_step


@_quantize_min_max.register_fake
def _(weight: torch.Tensor):
    n, k = weight.shape
    codes = lambda columns: weight.new_empty((n, columns), dtype=torch.uint8)  # noqa: E731
    step = weight.new_empty((n, k // SUPER_BLOCK), dtype=torch.float16)
    return codes(k // 2), codes(k // GROUP_SIZE), step, codes(k // GROUP_SIZE), step.clone()


def _min_max_int4(weight: torch.Tensor):
    """torchao asymmetric min_max per group of 32: codes (N, K) uint8, scale and zero
    (N, K/32) bf16. Every operation mirrors torchao's, so the bits match it."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    min_neg = groups.amin(dim=-1).clamp(max=0.0)
    max_pos = groups.amax(dim=-1).clamp(min=0.0)
    scale_fp32 = _divide(max_pos - min_neg, QUANT_MAX).clamp(min=_SCALE_EPS)
    # The zero point comes from the fp32 scale ...
    zero = (0.0 - torch.round(min_neg / scale_fp32)).clamp(0, QUANT_MAX)
    zero = zero.to(torch.bfloat16)
    scale = scale_fp32.to(torch.bfloat16)
    # ... the codes from the bf16 scale, through a reciprocal that is itself rounded to bf16.
    reciprocal = torch.reciprocal(scale.float()).to(torch.bfloat16).float()
    q = torch.round(groups * reciprocal[..., None]) + zero.float()[..., None]
    q = q.clamp(0, QUANT_MAX).to(torch.uint8).reshape(n, k)
    return q, scale, zero


def encode_superscale(values: torch.Tensor):
    """Encode non-negative per-group values ``(N, K/32)`` as uint8 codes times an fp16 step
    per 8 groups: ``step = fp16(max/255)``, ``code = round_half_even(value/step)`` in [0, 255].
    """
    n, n_groups = values.shape
    blocks = values.float().reshape(n, n_groups // GROUPS_PER_SUPER_BLOCK, -1)
    block_max = blocks.amax(dim=-1).clamp(min=_STEP_FLOOR)
    step = _divide(block_max, CODE_MAX).to(torch.float16)
    divisor = step.float().clamp(min=_STEP_FLOOR)
    codes = torch.round(blocks / divisor[..., None]).clamp(0, CODE_MAX).to(torch.uint8)
    return codes.reshape(n, n_groups), step


def _divide(values: torch.Tensor, divisor: int) -> torch.Tensor:
    """IEEE division by a constant on every device. (On CUDA, dividing by a Python scalar
    multiplies by its rounded reciprocal instead, which changes the last bit.)"""
    return values / torch.full_like(values, float(divisor))


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) codes in [0, 15] -> (N, K/2) uint8, even k in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(qdata: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) uint8 codes in k order."""
    low = qdata & 0x0F
    high = qdata >> 4
    return torch.stack((low, high), dim=-1).reshape(qdata.shape[0], -1)


def dequantize_packed(packed: PackedInt4, dtype: torch.dtype) -> torch.Tensor:
    """``(q - zc*zs) * (sc*ss)`` with each step rounded to ``dtype``; returns (N, K)."""
    q = unpack_nibbles(packed.qdata).to(dtype)
    n, k = q.shape
    scale = _decode_superscale(packed.scale, packed.scale_step, dtype)
    zero = _decode_superscale(packed.zero_point, packed.zero_point_step, dtype)
    groups = q.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    return ((groups - zero[..., None]) * scale[..., None]).reshape(n, k)


def _decode_superscale(codes: torch.Tensor, step: torch.Tensor, dtype: torch.dtype):
    per_group_step = step.to(dtype).repeat_interleave(GROUPS_PER_SUPER_BLOCK, dim=1)
    return codes.to(dtype) * per_group_step
