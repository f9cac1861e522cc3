"""The quantizer: ``"minmax"`` is bit-exact against an independent NumPy implementation and
against torchao's own min_max primitives, on random weights and on the format's edge cases;
``"mse"`` is never worse than it on any super-block and comes close to a 4-bit grid the weight
lies on."""

import functools

import numpy as np
import pytest
import torch
from torchao.quantization.quant_primitives import (
    MappingType,
    choose_qparams_affine,
    quantize_affine,
)

from coalesced_int4.quantize import (
    QPARAMS,
    PackedInt4,
    dequantize_packed,
    encode_superscale,
    pack_nibbles,
    quantize_weight,
    unpack_nibbles,
)
from tests.helpers import random_weight


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (round half to even), returned as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32)


def _encode(values: np.ndarray):
    """Superscale encoder, one super-block at a time."""
    n, groups = values.shape
    codes = np.zeros((n, groups), np.uint8)
    steps = np.zeros((n, groups // 8), np.float16)
    for row in range(n):
        for b in range(groups // 8):
            block = values[row, 8 * b : 8 * b + 8].astype(np.float32)
            block_max = max(np.float32(block.max()), np.float32(1e-30))
            step = np.float16(np.float32(block_max) / np.float32(255))
            divisor = max(np.float32(step), np.float32(1e-30))
            codes[row, 8 * b : 8 * b + 8] = np.clip(np.rint(block / divisor), 0, 255)
            steps[row, b] = step
    return codes, steps


def slow_reference_quantize(w: torch.Tensor) -> PackedInt4:
    """Group by group in NumPy float32: min/max including zero, fp32 scale clamped to eps,
    zero point from the fp32 scale, codes from the bf16 scale through a bf16 reciprocal."""
    x = w.float().numpy()
    n, k = x.shape
    eps = np.float32(np.finfo(np.float32).eps)
    q = np.zeros((n, k), np.uint8)
    scales = np.zeros((n, k // 32), np.float32)
    zeros = np.zeros((n, k // 32), np.float32)
    for row in range(n):
        for g in range(k // 32):
            group = x[row, 32 * g : 32 * g + 32]
            lo, hi = min(group.min(), np.float32(0)), max(group.max(), np.float32(0))
            scale = max(np.float32(hi - lo) / np.float32(15), eps)
            zero = np.clip(np.float32(0) - np.rint(lo / scale), 0, 15)
            scale_bf16 = _bf16(np.array([scale]))[0]
            reciprocal = _bf16(np.array([np.float32(1) / scale_bf16]))[0]
            q[row, 32 * g : 32 * g + 32] = np.clip(np.rint(group * reciprocal) + zero, 0, 15)
            scales[row, g], zeros[row, g] = scale_bf16, zero
    scale_codes, scale_step = _encode(scales)
    zero_codes, zero_step = _encode(zeros)
    packed = q[:, 0::2] | (q[:, 1::2] << 4)
    return PackedInt4(*(torch.from_numpy(a) for a in (packed, scale_codes, scale_step, zero_codes, zero_step)))


def _edge_case_weight() -> torch.Tensor:
    # Its own generator: the rows' random values set each super-block's scale step, so the
    # global generator's state would make the tests below depend on which tests ran first.
    w = torch.randn(6, 512, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    w[0] = 0.0  # all-zero row
    w[1, :32] = 3.5  # constant positive group
    w[1, 32:64] = -2.25  # constant negative group
    w[1, 64:96] = 0.0  # zero group beside non-zero ones
    w[2, :256] *= 1e-4  # tiny groups ...
    w[2, 224:256] *= 1e5  # ... in a super-block with one large group
    w[3] = torch.linspace(-1, 1, 512)  # exact ties between codes
    w[4] *= 1e-6
    w[5, 256:] = 7.0
    return w


@pytest.mark.parametrize("source", ["random", "edge_cases"])
def test_codes_are_bit_exact_against_an_independent_implementation(source):
    w = random_weight(16, 768, seed=5) if source == "random" else _edge_case_weight()
    got = quantize_weight(w, qparams="minmax")
    want = slow_reference_quantize(w)
    for name, a, b in zip(PackedInt4._fields, got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), f"{name} differs at {(a != b).nonzero()[:5].tolist()}"


def test_codes_match_torchao_min_max_primitives():
    w = random_weight(32, 1024, seed=11, dtype=torch.float32)
    block = [1, 32]
    scale, zero = choose_qparams_affine(
        w, MappingType.ASYMMETRIC, block, torch.int8, quant_min=0, quant_max=15,
        scale_dtype=torch.bfloat16, zero_point_dtype=torch.bfloat16,
    )
    q = quantize_affine(w, block, scale, zero, torch.int8, quant_min=0, quant_max=15)
    packed = quantize_weight(w, qparams="minmax")
    assert torch.equal(packed.qdata, pack_nibbles(q.to(torch.uint8)))
    assert torch.equal(packed.scale, encode_superscale(scale)[0])
    assert torch.equal(packed.zero_point, encode_superscale(zero)[0])


def test_edge_cases_dequantize_as_the_format_promises():
    w = _edge_case_weight()
    dense = dequantize_packed(quantize_weight(w, qparams="minmax"), torch.float32)
    assert torch.equal(dense[0], torch.zeros(512))  # all-zero row is exactly zero
    # A constant group comes back within half a step of its scale code (up to 0.6 % where
    # its scale is a third of the super-block's largest) and bf16's roundings: 1 %. The
    # worst of 1000 random rows was 0.86 %.
    assert torch.allclose(dense[1, :32], torch.full((32,), 3.5), rtol=1e-2)
    assert torch.allclose(dense[1, 32:64], torch.full((32,), -2.25), rtol=1e-2)
    assert torch.equal(dense[1, 64:96], torch.zeros(32))
    # Groups far below their super-block's max lose their scale code: they decode to zero.
    assert torch.equal(dense[2, :32], torch.zeros(32))


def test_superscale_encoder_worked_example():
    scales = torch.tensor(
        [[0.05005, 0.1001, 0.1299, 0.2002, 0.01575, 0.3008, 0.06982, 0.001099]]
    ).to(torch.bfloat16)
    codes, step = encode_superscale(scales)
    assert step.item() == np.float16(0.30078125 / 255)
    assert codes.tolist() == [[42, 85, 110, 170, 13, 255, 59, 1]]
    zeros = torch.tensor([[15.0, 8, 0, 0, 0, 0, 0, 0]])
    codes, step = encode_superscale(zeros)
    assert step.item() == 0.058837890625 and codes[0, 1].item() == 136


def test_dequantize_evaluates_the_format_formula():
    packed = quantize_weight(random_weight(8, 512, seed=2))
    q = unpack_nibbles(packed.qdata).double()
    scale = packed.scale.double() * packed.scale_step.double().repeat_interleave(8, 1)
    zero = packed.zero_point.double() * packed.zero_point_step.double().repeat_interleave(8, 1)
    expected = (q - zero.repeat_interleave(32, 1)) * scale.repeat_interleave(32, 1)
    assert torch.allclose(dequantize_packed(packed, torch.float32).double(), expected, rtol=1e-6, atol=0)


def test_nibble_order_puts_even_k_in_the_low_nibble():
    q = torch.arange(16, dtype=torch.uint8).repeat(2, 2)
    packed = pack_nibbles(q)
    assert packed[0, 0].item() == 0x10 and packed[0, 1].item() == 0x32
    assert torch.equal(unpack_nibbles(packed), q)


@pytest.mark.parametrize("qparams", QPARAMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.bfloat16])
def test_any_float_dtype_quantizes_like_its_fp32_value(dtype, qparams):
    w = random_weight(4, 256, seed=3, dtype=dtype)
    assert all(torch.equal(a, b) for a, b in zip(quantize_weight(w, qparams=qparams),
                                                 quantize_weight(w.float(), qparams=qparams)))


def test_quantization_error_is_small():
    w = torch.randn(64, 1024)
    dense = dequantize_packed(quantize_weight(w), torch.float32)
    assert ((dense - w).abs().mean() / w.abs().mean()).item() < 0.1


@pytest.mark.parametrize(
    "weight, message",
    [
        (torch.randn(8, 300), r"multiple of 32, got shape \(N=8, K=300\)"),
        (torch.randn(256), r"2-D \(N, K\), got shape \(256,\)"),
        (torch.randn(2, 4, 256), r"2-D \(N, K\), got shape \(2, 4, 256\)"),
        (torch.randn(0, 256), r"must not be empty, got shape \(0, 256\)"),
        (torch.ones(4, 256, dtype=torch.int32), "floating point, got torch.int32"),
        (torch.full((4, 256), float("nan")), r"shape \(4, 256\): it contains NaN or Inf"),
        (torch.full((4, 256), float("inf")), r"shape \(4, 256\): it contains NaN or Inf"),
    ],
)
def test_bad_weights_are_rejected_with_the_rule_and_the_shape(weight, message):
    with pytest.raises(ValueError, match=message):
        quantize_weight(weight)


def test_unsupported_group_size_and_method_are_rejected():
    with pytest.raises(ValueError, match="group_size must be 32, got 64"):
        quantize_weight(torch.randn(4, 256), group_size=64)
    with pytest.raises(ValueError, match="unknown qparams 'hqq'"):
        quantize_weight(torch.randn(4, 256), qparams="hqq")


@pytest.mark.parametrize("qparams", QPARAMS)
def test_the_compiled_quantizer_gives_eagers_bits(qparams):
    weight = random_weight(1024, 1024, seed=7)
    eager = quantize_weight(weight, qparams=qparams)
    compiled = torch.compile(functools.partial(quantize_weight, qparams=qparams), fullgraph=True)(weight)
    for name, a, b in zip(eager._fields, eager, compiled):
        assert torch.equal(a, b), name


def _super_block_errors(w, packed):
    values = dequantize_packed(packed, torch.float32)[:, : w.shape[1]]
    padded = torch.nn.functional.pad((values - w.float()).square(), (0, packed.qdata.shape[1] * 2 - w.shape[1]))
    return padded.reshape(w.shape[0], -1, 256).sum(-1)


@pytest.mark.parametrize("source", ["random", "edge_cases", "gaussian", "padded"])
def test_mse_qparams_are_never_worse_than_min_max_on_any_super_block(source):
    w = {"random": lambda: random_weight(16, 768, seed=5), "edge_cases": _edge_case_weight,
         "gaussian": lambda: torch.randn(64, 1024, generator=torch.Generator().manual_seed(1)),
         "padded": lambda: torch.randn(64, 576, generator=torch.Generator().manual_seed(2))}[source]()
    mse, minmax = quantize_weight(w), quantize_weight(w, qparams="minmax")
    assert (_super_block_errors(w, mse) <= _super_block_errors(w, minmax)).all()
    if source == "gaussian":  # off any 4-bit grid: a fifth less squared error
        assert _super_block_errors(w, mse).sum() < 0.85 * _super_block_errors(w, minmax).sum()


def test_mse_qparams_recover_a_weight_on_a_group_32_grid():
    """A weight stored as 4-bit codes with an fp16 scale and minimum per 32 (llama.cpp's Q4_1):
    min-max, whose range must include zero and whose zero point is an integer, misses the
    grid; the least-squares fit comes far closer (a seventh of the squared error here)."""
    generator = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (64, 1024), generator=generator).float().reshape(64, 32, 32)
    scale = (torch.rand(64, 32, 1, generator=generator) * 0.002 + 0.008).half().float()
    minimum = (-torch.rand(64, 32, 1, generator=generator) * 0.1).half().float()
    w = (codes * scale + minimum).reshape(64, 1024)
    mse, minmax = (_super_block_errors(w, quantize_weight(w, qparams=q)).sum() for q in QPARAMS)
    assert mse < 0.25 * minmax
