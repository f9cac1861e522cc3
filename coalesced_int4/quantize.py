"""Dense weights to the coalesced INT4 format, and back.

Contract (docs/format.md states it in full):

* ``quantize_weight(w, qparams=...)`` takes a 2-D floating weight ``(N, K)`` on any device,
  ``K`` a multiple of 32, and returns the five stored tensors of :class:`PackedInt4`, sized
  for ``stored_k(K)`` columns: a K that is not a multiple of 256 is padded with zero columns
  to whole super-blocks (they quantize to zero codes and zero values). Two ways to choose the
  scales and zero points (``QPARAMS``):

  - ``"minmax"``: bit-identical to torchao's asymmetric ``min_max`` quantizer
    (``choose_qparams_affine`` + ``quantize_affine`` with quant range [0, 15], bf16 scale and
    zero point) of the padded weight followed by the per-256 "superscale" encoder, on every
    device;
  - ``"mse"`` (the default): per group of 32, the clipped range, then the scale and
    fractional zero point, that minimise the squared weight error, searched again among
    the neighbouring stored codes after the superscale encoding; a super-block keeps the
    min-max encoding wherever that has the smaller error, so no super-block, hence no weight,
    has a larger squared error than ``"minmax"`` gives it.
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
QPARAMS = ("mse", "minmax")
"""How scales and zero points are chosen; the first is the default."""
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
"""``"mse"``: the fractions of each group's range tried as its clipped range."""
LEAST_SQUARES_STEPS = 4
"""``"mse"``: refits of (scale, zero point) to the codes by least squares."""
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
    weight: torch.Tensor, group_size: int = GROUP_SIZE, qparams: str = QPARAMS[0]
) -> PackedInt4:
    """Quantize a dense ``(N, K)`` weight; the result lives on the weight's device."""
    if group_size != GROUP_SIZE:
        raise ValueError(f"group_size must be {GROUP_SIZE}, got {group_size}")
    if qparams not in QPARAMS:
        raise ValueError(f"unknown qparams {qparams!r}; supported: {QPARAMS}")
    reason = unpackable_reason(weight)
    if reason is not None:
        raise ValueError(f"cannot quantize weight: {reason}")
    k = weight.shape[1]
    if stored_k(k) != k:
        weight = F.pad(weight, (0, stored_k(k) - k))
    quantizer = _quantize_mse if qparams == "mse" else _quantize_min_max
    return PackedInt4(*quantizer(weight))


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


@torch.library.custom_op("coalesced_int4::quantize_mse", mutates_args=())
def _quantize_mse(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The five stored tensors of ``weight`` with least-squares scales and zero points (the
    ``"mse"`` contract above). An op of its own for the reason ``_quantize_min_max`` is."""
    minmax = PackedInt4(*_quantize_min_max(weight))  # raises on NaN or Inf
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    scale, zero = _least_squares_qparams(groups)
    scale_codes, scale_step = encode_superscale(scale)
    zero_codes, zero_step = encode_superscale(zero)
    q, scale_codes, zero_codes = _best_neighbouring_codes(groups, scale_codes, scale_step, zero_codes, zero_step)
    mse = PackedInt4(pack_nibbles(q.reshape(n, k)), scale_codes, scale_step, zero_codes, zero_step)
    return _per_super_block_better(weight, mse, minmax)


def _register_fake_quantizer(op) -> None:
    @op.register_fake
    def _(weight: torch.Tensor):
        n, k = weight.shape
        codes = lambda columns: weight.new_empty((n, columns), dtype=torch.uint8)  # noqa: E731
        step = weight.new_empty((n, k // SUPER_BLOCK), dtype=torch.float16)
        return codes(k // 2), codes(k // GROUP_SIZE), step, codes(k // GROUP_SIZE), step.clone()


_register_fake_quantizer(_quantize_min_max)
_register_fake_quantizer(_quantize_mse)


def _codes(groups, scale, zero):
    """clamp(round(w / scale + zero), 0, 15) per group, as float."""
    return torch.clamp(torch.round(groups / scale[..., None] + zero[..., None]), 0, QUANT_MAX)


def _squared_error(groups, q, scale, zero):
    return ((q - zero[..., None]) * scale[..., None] - groups).square().sum(-1)


def _keep_better(best: list, candidate: list) -> list:
    """Elementwise: each entry of ``candidate`` where its error (first entry) is lower."""
    better = candidate[0] < best[0]
    return [torch.where(better.reshape(better.shape + (1,) * (b.dim() - better.dim())), c, b)
            for b, c in zip(best, candidate)]


def _least_squares_qparams(groups: torch.Tensor):
    """Per group (fp32 [N, G, 32]): the (scale, zero point) of the least squared error among
    the clipped ranges ``CLIP_RATIOS`` (zero points fractional), refitted to their codes by
    least squares ``LEAST_SQUARES_STEPS`` times. Zero points stay >= 0 (the format's zero
    codes and steps are unsigned)."""
    low = groups.amin(-1).clamp(max=0.0)
    high = groups.amax(-1).clamp(min=0.0)
    best = None
    for ratio in CLIP_RATIOS:
        scale = ((high - low) * ratio / QUANT_MAX).clamp(min=_SCALE_EPS)
        zero = -low * ratio / scale
        candidate = [_squared_error(groups, _codes(groups, scale, zero), scale, zero), scale, zero]
        best = candidate if best is None else _keep_better(best, candidate)
    for _ in range(LEAST_SQUARES_STEPS):
        _, scale, zero = best
        q = _codes(groups, scale, zero)
        q_mean, w_mean = q.mean(-1), groups.mean(-1)
        q_var = (q - q_mean[..., None]).square().sum(-1)
        covariance = ((q - q_mean[..., None]) * (groups - w_mean[..., None])).sum(-1)
        # w ~ scale * q - scale * zero: the regression of the weights on their codes.
        fitted = torch.where(q_var > 0, covariance / q_var.clamp(min=_STEP_FLOOR), scale).clamp(min=_SCALE_EPS)
        fitted_zero = ((fitted * q_mean - w_mean) / fitted).clamp(min=0.0)
        candidate = [_squared_error(groups, _codes(groups, fitted, fitted_zero), fitted, fitted_zero), fitted,
                     fitted_zero]
        best = _keep_better(best, candidate)
    return best[1], best[2]


def _best_neighbouring_codes(groups, scale_codes, scale_step, zero_codes, zero_step):
    """The encoded scale and zero of each group moved by -1, 0 or +1 code (nine pairs), the
    weight codes recomputed from the decoded values: the pair with the least squared error,
    and its codes (weight codes as uint8 [N, G, 32])."""
    scale_unit = scale_step.float().repeat_interleave(GROUPS_PER_SUPER_BLOCK, dim=1)
    zero_unit = zero_step.float().repeat_interleave(GROUPS_PER_SUPER_BLOCK, dim=1)

    def decoded(scale_code, zero_code):
        scale, zero = scale_code * scale_unit, zero_code * zero_unit
        return _codes(groups, scale.clamp(min=_STEP_FLOOR), zero), scale, zero

    best = None
    for scale_move in (-1, 0, 1):
        for zero_move in (-1, 0, 1):
            scale_code = (scale_codes.float() + scale_move).clamp(0, CODE_MAX)
            zero_code = (zero_codes.float() + zero_move).clamp(0, CODE_MAX)
            candidate = [_squared_error(groups, *decoded(scale_code, zero_code)), scale_code, zero_code]
            best = candidate if best is None else _keep_better(best, candidate)
    _, scale_code, zero_code = best
    q = decoded(scale_code, zero_code)[0]  # the winners' codes, computed once
    return q.to(torch.uint8), scale_code.to(torch.uint8), zero_code.to(torch.uint8)


def _per_super_block_better(weight: torch.Tensor, first: PackedInt4, second: PackedInt4):
    """Per row and super-block, the encoding of ``first`` or ``second`` with the smaller
    squared error against ``weight`` (exact fp32 values of each), ``second`` on ties."""
    n, k = weight.shape
    blocks = weight.float().reshape(n, k // SUPER_BLOCK, SUPER_BLOCK)

    def error(packed):
        values = dequantize_packed(packed, torch.float32).reshape(n, k // SUPER_BLOCK, SUPER_BLOCK)
        return (values - blocks).square().sum(-1)

    take_first = error(first) < error(second)  # [N, K/256]
    return tuple(torch.where(take_first.repeat_interleave(a.shape[1] // take_first.shape[1], dim=1), a, b)
                 for a, b in zip(first, second))


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
