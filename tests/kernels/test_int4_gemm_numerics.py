"""Kernel numerics on small shapes, against independent references. On a CPU the kernels run
in Triton's interpreter (conftest sets TRITON_INTERPRET=1); with a GPU they run for real."""

import pytest
import torch
import triton
import triton.language as tl
from torch._library.triton import set_wrap_triton_enabled

from coalesced_int4.kernels import InvalidLaunchParam, int4_autotune_configs, launch, prune_int4_configs
from coalesced_int4.kernels.gemm.split_k import (
    REDUCE_WIDTHS,
    _splitk_reduce_kernel,
    reduce_width,
    reduction_launch,
    split_bounds,
    split_program,
    split_programs,
)
from coalesced_int4.kernels.gemm.w4a8 import WORDS_PER_GROUP, quantize_activations
from coalesced_int4.kernels.gemm.w4a16 import activation_rows, batch_rows
from coalesced_int4.kernels.ops.configs import (
    SPLIT_K_CANDIDATES,
    TILE_SPLIT_K_CANDIDATES,
    balanced_short_columns,
    kernel_config,
)
from coalesced_int4.kernels.ops.validation import W4A8_BUCKETS
from coalesced_int4.quantize import PackedInt4, dequantize_packed
from tests.helpers import (
    assert_close_to_reference,
    dequant_matmul_reference,
    packed_weight,
    requires_cuda,
    tma_and_pointer_configs,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALLER_M = {8: 6, 16: 9, 32: 24, 64: 48}


def _x(m, k, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=generator).to(torch.bfloat16).to(DEVICE)


def _sample(configs, count=3):
    """First, middle and last of a config list."""
    return [configs[i] for i in sorted({0, len(configs) // 2, len(configs) - 1})][:count]


_EVEN_K_FIRST = torch.cat([torch.arange(0, 32, 2), torch.arange(1, 32, 2)])
"""The k of a group of 32 in the order of its quantized words' bytes: even k, then odd k."""


def _reference_activation_quantization(x):
    v = x.float().reshape(x.shape[0], -1, 32)
    amax = v.abs().amax(-1)
    scale = amax / 127
    inverse = torch.where(amax > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round((v * inverse[..., None]).clamp(-127, 127)).to(torch.int32)
    as_bytes = (q[..., _EVEN_K_FIRST] & 0xFF).reshape(x.shape[0], -1, 4)
    words = (as_bytes << torch.tensor([0, 8, 16, 24])).sum(-1).to(torch.int64)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.reshape(x.shape[0], -1), scale, q.sum(-1).to(torch.int32)


def _quantize_activations(x):
    """The words, scales and sums of ``quantize_activations``' layout (``WORDS_PER_GROUP`` a
    group: 4 even-k words, 4 odd-k words, the scale's bits, the sum, two zeros), launched as
    the GEMM's eager launches do it (``int4_gemm.launch``: wrap_triton off)."""
    with set_wrap_triton_enabled(False):
        per_group = quantize_activations(x).view(x.shape[0], -1, WORDS_PER_GROUP.value)
    assert (per_group[..., 10:] == 0).all()
    return per_group[..., :8].flatten(1), per_group[..., 8].view(torch.float32), per_group[..., 9]


def test_activation_quantization_per_32_in_even_odd_byte_order():
    x = _x(3, 512, seed=1)
    x[1, :32] = 0  # an all-zero block: scale 0, values 0, sum 0
    words, scale, sums = _quantize_activations(x)
    ref_words, ref_scale, ref_sums = _reference_activation_quantization(x.cpu())
    torch.testing.assert_close(scale.cpu(), ref_scale, rtol=1e-6, atol=0)
    assert scale[1, 0].item() == 0 and sums[1, 0].item() == 0
    mismatched = (words.cpu() != ref_words).float().mean().item()
    assert mismatched == 0 if DEVICE == "cpu" else mismatched < 1e-3
    assert (sums.cpu() - ref_sums).abs().max().item() <= (0 if DEVICE == "cpu" else 1)


def _signed_bytes(words):
    """[..., W] int32 words -> [..., 4 W] their signed bytes, low byte first."""
    return torch.stack([(words << (24 - 8 * i)) >> 24 for i in range(4)], dim=-1).flatten(-2)


def test_activation_quantization_of_a_denormal_block_stays_in_range():
    # amax 1e-37: 1 / scale overflows fp32, so the reference's v * inf is undefined (and 0 *
    # inf is NaN); the kernel cuts the inverse and still maps 0 to 0, signs to signs, |q| <= 127.
    x = _x(1, 256, seed=5)
    x[0, :32] = torch.linspace(-1e-37, 1e-37, 32).to(torch.bfloat16)
    x[0, 7] = 0
    words, scale, sums = _quantize_activations(x)
    q = torch.empty(32, dtype=torch.int32)
    q[_EVEN_K_FIRST] = _signed_bytes(words.cpu()[0, :8])
    v = x[0, :32].float().cpu()
    assert q.abs().max().item() <= 127 and q[7].item() == 0
    assert (torch.sign(q) * torch.sign(v) >= 0).all() and q.abs().max().item() > 0
    assert sums[0, 0].item() == q.sum().item()


@pytest.mark.parametrize("bucket", [1, 2, 3, 4])
def test_w4a8_buckets_match_the_dequant_reference_for_every_m(bucket):
    packed, _ = packed_weight(257, 512, seed=bucket, device=DEVICE)
    for m in range(1, bucket + 1):
        x = _x(m, 512, seed=10 * bucket + m)
        out = launch(bucket, x, *packed, 32)
        assert out.shape == (m, 257) and out.dtype == torch.bfloat16
        assert_close_to_reference(out, dequant_matmul_reference(x, packed))


@pytest.mark.parametrize("bucket", [1, 4])
def test_w4a8_sampled_configs_match(bucket):
    packed, _ = packed_weight(96, 768, seed=7, device=DEVICE)
    x = _x(bucket, 768, seed=3)
    ref = dequant_matmul_reference(x, packed)
    for config in _sample(int4_autotune_configs(bucket)):
        assert_close_to_reference(launch(bucket, x, *packed, 32, split_k=1, config=config), ref)


@pytest.mark.parametrize("prequantize", [False, True])
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("split", [1, 2])
def test_w4a8_trips_past_the_end_of_a_split_add_nothing(split, prefetch, prequantize):
    # 3 super-blocks, 2 per trip: split 1 ends on a half-empty trip, split 2 (2 + 1) on another;
    # a prefetching program also loads (masked) the trip after its last.
    packed, _ = packed_weight(40, 768, seed=17, device=DEVICE)
    x = _x(4, 768, seed=17)
    config = kernel_config(4, BLOCK_N=16, GROUPS=16, STAGES=1, PREFETCH=prefetch)
    out = launch(4, x, *packed, 32, split_k=split, config=config, prequantize=prequantize)
    assert_close_to_reference(out, dequant_matmul_reference(x, packed))


@pytest.mark.parametrize("bucket", [1, 2, 4])
def test_prequantized_activations_give_the_bits_of_quantizing_inside_the_gemm(bucket):
    packed, _ = packed_weight(48, 768, seed=23, device=DEVICE)
    for m in sorted({max(1, bucket - 1), bucket}):  # prequantized, rows >= M read zeros
        x = _x(m, 768, seed=m)
        for split in (1, 2):
            for config in _sample(int4_autotune_configs(bucket), count=2):
                inside = launch(bucket, x, *packed, 32, split_k=split, config=config, prequantize=False)
                first = launch(bucket, x, *packed, 32, split_k=split, config=config, prequantize=True)
                assert torch.equal(inside, first), (m, split, config)


@triton.jit
def _activation_rows_probe(rows_ptr, stored_ptr, M, BUCKET: tl.constexpr, BATCH_ROWS: tl.constexpr,
                           WINDOWS: tl.constexpr):
    offs_m = tl.arange(0, BUCKET)  # BATCH_ROWS may be 48, not a power of two
    batch, stored = batch_rows(offs_m, M, BUCKET, BATCH_ROWS, WINDOWS)
    reads = activation_rows(offs_m, M, BUCKET, BATCH_ROWS, WINDOWS)
    tl.store(rows_ptr + offs_m, reads, mask=offs_m < BATCH_ROWS)
    # A stored row's output goes to the row it read: -1 marks a mismatch.
    tl.store(stored_ptr + offs_m, tl.where(stored, tl.where(batch == reads, 1, -1), 0), mask=offs_m < BATCH_ROWS)


@pytest.mark.parametrize("windows", [False, True])
@pytest.mark.parametrize("bucket, batch_rows", [(8, 8), (16, 16), (32, 32), (64, 64), (64, 48)])
def test_w4a16_accumulator_rows_store_each_row_once_and_spread_their_reads(bucket, batch_rows, windows):
    for m in range(1, batch_rows + 1):
        rows = torch.full((batch_rows,), -1, dtype=torch.int32, device=DEVICE)
        stored = torch.full((batch_rows,), -1, dtype=torch.int32, device=DEVICE)
        _activation_rows_probe[(1,)](rows, stored, m, BUCKET=bucket, BATCH_ROWS=batch_rows, WINDOWS=windows)
        rows, stored = rows.cpu(), stored.cpu()
        assert stored.min() >= 0, (m, rows.tolist(), stored.tolist())
        stored = stored.bool()
        assert 0 <= rows.min() and rows.max() < m, (m, rows.tolist())
        assert sorted(rows[stored].tolist()) == list(range(m)), (m, rows.tolist(), stored.tolist())
        if 2 * m > bucket:  # every M that dispatch runs on this bucket
            assert torch.bincount(rows).max() <= 2, (m, rows.tolist())
            window = bucket // 2
            if windows:  # the batch's first rows, then its last: boxes TMA copies without zero fill
                assert rows[:window].tolist() == list(range(window)), (m, rows.tolist())
                assert rows[window:].tolist() == list(range(m - (batch_rows - window), m)), (m, rows.tolist())
            else:
                assert rows[:m].tolist() == list(range(m)), (m, rows.tolist())


@pytest.mark.parametrize("bucket", [8, 16, 32, 64])
@pytest.mark.parametrize("n", [37, 257])
@pytest.mark.parametrize("k", [256, 512])
def test_w4a16_buckets_match_the_dequant_reference(bucket, n, k):
    packed, _ = packed_weight(n, k, seed=bucket + n + k, device=DEVICE)
    for m in (bucket, SMALLER_M[bucket]):
        x = _x(m, k, seed=m)
        ref = dequant_matmul_reference(x, packed)
        for split in (1, k // 256):
            config = prune_int4_configs(int4_autotune_configs(bucket), {"K": k, "split_k": split})[-1]
            out = launch(bucket, x, *packed, 32, split_k=split, config=config)
            assert out.shape == (m, n)
            assert_close_to_reference(out, ref, rtol=0.02, atol=4.0, mean_rel=0.01)


def test_w4a16_balanced_grid_matches_the_dequant_reference(monkeypatch):
    """A balanced grid (``balanced=True``) on a device counted as 6 SMs: N = 257 at split 4 is
    20 programs of 64 rows, so two tiles (128 columns) are split 3 ways. Under both tile
    widths of the space the outputs match the reference and repeat bit for bit."""
    monkeypatch.setattr("coalesced_int4.kernels.gemm.w4a16.multiprocessors", lambda device: 6)
    assert balanced_short_columns(257, 4, 6) == 128
    packed, _ = packed_weight(257, 1024, seed=9, device=DEVICE)
    x = _x(16, 1024, seed=9)
    ref = dequant_matmul_reference(x, packed)
    configs = prune_int4_configs(int4_autotune_configs(16), {"K": 1024, "split_k": 4})
    for config in {c.kwargs["BLOCK_N"]: c for c in configs}.values():
        out = launch(16, x, *packed, 32, split_k=4, balanced=True, config=config)
        assert_close_to_reference(out, ref, rtol=0.02, atol=4.0, mean_rel=0.01)
        assert torch.equal(out, launch(16, x, *packed, 32, split_k=4, balanced=True, config=config)), config


@pytest.mark.parametrize("m", [33, 48])
def test_w4a16_bucket_64_at_48_rows_gives_the_bits_of_the_whole_bucket(m):
    """At M <= 48 bucket 64 multiplies 48 activation rows, in a dot of 32 and one of 16
    (``w4a16_batch_rows``). Its outputs are the bits of the same rows in a batch padded to
    64, which runs the one 64-row dot, with and without split-K."""
    packed, _ = packed_weight(70, 512, seed=m, device=DEVICE)
    x = _x(m, 512, seed=m)
    padded = torch.cat([x, _x(64 - m, 512, seed=m + 1)])
    for split in (1, 2):
        config = prune_int4_configs(int4_autotune_configs(64), {"K": 512, "split_k": split})[-1]
        narrow = launch(64, x, *packed, 32, split_k=split, config=config)
        assert torch.equal(narrow, launch(64, padded, *packed, 32, split_k=split, config=config)[:m]), split


def _assert_one_hot_rows_pick_the_reference_weights(bucket, packed, configs):
    """One-hot activation rows pick single weights: an output is one weight times 1 plus exact
    zeros, so it must be the reference dequantization's bf16 weight, bit for bit, at every
    column of both super-blocks of K = 512."""
    dense = dequantize_packed(PackedInt4(*packed), torch.bfloat16).to(DEVICE)
    k = dense.shape[1]
    rows = torch.arange(bucket, device=DEVICE)
    for config in configs:
        for start in range(0, 256, bucket):
            x = torch.zeros(bucket, k, dtype=torch.bfloat16, device=DEVICE)
            x[rows, start + 256 * (rows % 2) + rows] = 1  # both super-blocks
            for split in (1, 2):
                out = launch(bucket, x, *packed, 32, split_k=split, config=config)
                assert torch.equal(out, dense[:, start + 256 * (rows % 2) + rows].t()), (config, start, split)


@pytest.mark.parametrize("bucket", [pytest.param(8, marks=requires_cuda), 16,
                                    pytest.param(32, marks=requires_cuda), 64])
def test_w4a16_decodes_the_reference_bf16_weights_bit_for_bit(bucket):
    """The decoded weights are the reference's, bit for bit: this pins the rounding chain (each
    step rounded on its own), which byte and nibble each weight is read from, for each tile
    shape of the space, and on the GPU that each weight got its own group's scale and zero
    from the quad shuffle. Buckets 8 and 32 run on the GPU only: the shuffle is GPU code, and
    the interpreter would take minutes."""
    packed, _ = packed_weight(40, 512, seed=bucket, device=DEVICE)
    tiles = {(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]): c for c in int4_autotune_configs(bucket)}
    _assert_one_hot_rows_pick_the_reference_weights(bucket, packed, tiles.values())


@requires_cuda
@pytest.mark.parametrize("bucket", [8, 64])
def test_w4a16_decode_is_exact_at_the_extremes_of_codes_and_steps(bucket):
    """The GPU decode scales nibbles from bf16 subnormals and folds powers of two into the
    group values (``_DECODE_PAIR``), which is exact only while every intermediate stays in
    bf16's range: checked bit for bit with the smallest and largest fp16 steps (subnormal
    2**-24 and 65504), steps of either sign, and scale and zero codes 0, 1, 128 and 255."""
    packed, _ = packed_weight(40, 512, seed=7, device=DEVICE)
    qdata, scale, scale_step, zero_point, zero_point_step = packed
    generator = torch.Generator().manual_seed(7)
    extremes = torch.tensor([2.0**-24, -(2.0**-24), 6.1e-5, 1.0, -3.0, 65504.0, -65504.0], dtype=torch.float16)
    codes = torch.tensor([0, 1, 255, 128], dtype=torch.uint8)

    def pick(values, like):
        return values[torch.randint(len(values), like.shape, generator=generator)].to(DEVICE)

    packed = (qdata, pick(codes, scale), pick(extremes, scale_step),
              pick(codes, zero_point), pick(extremes, zero_point_step))
    config = int4_autotune_configs(bucket)[0]
    _assert_one_hot_rows_pick_the_reference_weights(bucket, packed, [config])


@pytest.mark.parametrize("bucket, ms", [(8, (8, 5, 3)), (64, (64, 50, 40, 32, 17))])
def test_w4a16_tma_activation_copies_give_the_pointer_copies_bits(bucket, ms):
    """The descriptor's windows give the pointer copies' bits (each output row is the same dot
    of the same activation row, whichever accumulator row holds it): at a full bucket, with
    the two windows overlapping (M = 50, 5), with bucket 64's 48-row pair of dots (the tail
    dot keeps pointer copies), and below dispatch's range (M = 32, 17, 3: zero-filled rows
    against real rows, never stored), at one split and two."""
    packed, _ = packed_weight(96, 768, seed=bucket, device=DEVICE)
    tma, pointers = tma_and_pointer_configs(bucket)[0]
    for m in ms:
        x = _x(m, 768, seed=m)
        for split in (1, 2):
            assert torch.equal(launch(bucket, x, *packed, 32, split_k=split, config=tma),
                               launch(bucket, x, *packed, 32, split_k=split, config=pointers)), (m, split)


def test_w4a16_sampled_configs_match():
    packed, _ = packed_weight(130, 512, seed=5, device=DEVICE)
    x = _x(16, 512, seed=5)
    ref = dequant_matmul_reference(x, packed)
    for config in _sample(int4_autotune_configs(16), count=3):
        assert_close_to_reference(launch(16, x, *packed, 32, split_k=1, config=config), ref,
                                  rtol=0.02, atol=4.0, mean_rel=0.01)


@pytest.mark.parametrize("bucket", [1, 3, 8, 32])
def test_every_legal_split_matches_and_an_illegal_one_is_refused(bucket):
    k = 2048
    packed, _ = packed_weight(64, k, seed=91, device=DEVICE)
    x = _x(bucket, k, seed=91)
    ref = dequant_matmul_reference(x, packed)
    candidates = SPLIT_K_CANDIDATES if bucket in W4A8_BUCKETS else TILE_SPLIT_K_CANDIDATES
    for split in (s for s in candidates if s <= k // 256):
        assert_close_to_reference(launch(bucket, x, *packed, 32, split_k=split), ref)
    with pytest.raises(InvalidLaunchParam, match="split_k=16 needs K >= 4096, got K=2048"):
        launch(bucket, x, *packed, 32, split_k=16)


@pytest.mark.parametrize("bucket", [2, 16])
def test_split_k_reduction_is_bit_identical(bucket):
    packed, _ = packed_weight(257, 1536, seed=4, device=DEVICE)
    x = _x(bucket, 1536, seed=4)
    first = launch(bucket, x, *packed, 32, split_k=4)
    assert torch.equal(first, launch(bucket, x, *packed, 32, split_k=4))


@pytest.mark.parametrize("width", REDUCE_WIDTHS)
@pytest.mark.parametrize("short_columns", [0, 256])
def test_split_k_reduction_sums_in_split_order_at_every_width(width, short_columns):
    """Partials are added in split order; the short columns' last partial, which no program
    writes, is never read (NaN there would show)."""
    generator = torch.Generator().manual_seed(6)
    partials = torch.randn(3, 8, 600, generator=generator)
    partials[0] *= 1e8
    partials[1] = -partials[0]  # splits 0 and 1 cancel exactly only when added first
    in_split_order = (partials[0] + partials[1]) + partials[2]
    in_split_order[:, :short_columns] = partials[0, :, :short_columns] + partials[1, :, :short_columns]
    partials[2, :, :short_columns] = float("nan")
    partials = partials.to(DEVICE)
    out = torch.empty(5, 600, dtype=torch.bfloat16, device=DEVICE)
    grid, args, meta = reduction_launch(partials, out, 5, short_columns, width)
    _splitk_reduce_kernel[grid](*args, **meta)
    assert torch.equal(out.cpu(), in_split_order[:5].to(torch.bfloat16))


def test_reduction_programs_are_wide_only_for_few_splits_that_still_fill_the_gpu():
    assert reduce_width(8448, 64, 2) == reduce_width(4096, 16, 4) == reduce_width(8448, 8, 4) == 512
    assert reduce_width(8448, 64, 8) == reduce_width(14336, 16, 5) == 512
    assert reduce_width(8448, 64, 16) == 128  # each split is one more load a column
    assert reduce_width(256, 64, 2) == reduce_width(4096, 8, 2) == 128  # too few programs


@triton.jit
def _split_program_probe(out_ptr, split_k, short_columns, units, BLOCK_N: tl.constexpr):
    program = tl.program_id(0)
    tile, split, splits = split_program(program, split_k, short_columns, BLOCK_N)
    first, count = split_bounds(split, splits, units)
    row = out_ptr + 5 * program
    tl.store(row, tile)
    tl.store(row + 1, split)
    tl.store(row + 2, splits)
    tl.store(row + 3, first)
    tl.store(row + 4, count)


@pytest.mark.parametrize("n, split_k, short_columns, block_n", [
    (6656, 4, 1280, 64), (6656, 4, 1280, 128), (6656, 4, 0, 64), (257, 4, 128, 64), (300, 2, 256, 128),
    (300, 1, 0, 64),
])
def test_split_programs_cover_every_unit_of_every_tile_once_short_tiles_first(n, split_k, short_columns, block_n):
    """``split_program``'s grid: every unit of K of every tile is one program's, exactly once;
    the tiles of the first ``short_columns`` columns are split one way fewer, and their
    programs come first."""
    units = 32
    programs = split_programs(n, split_k, short_columns, block_n)
    probe = torch.full((programs, 5), -1, dtype=torch.int32, device=DEVICE)
    _split_program_probe[(programs,)](probe, split_k, short_columns, units, BLOCK_N=block_n)
    rows = probe.cpu().tolist()
    covered = sorted((tile, unit) for tile, _, _, first, count in rows for unit in range(first, first + count))
    assert covered == [(tile, unit) for tile in range(triton.cdiv(n, block_n)) for unit in range(units)]
    short_tiles = short_columns // block_n
    assert [splits for _, _, splits, _, _ in rows] == (
        [split_k - 1] * (short_tiles * (split_k - 1)) + [split_k] * (programs - short_tiles * (split_k - 1)))
    assert all((tile < short_tiles) == (splits < split_k) for tile, _, splits, _, _ in rows if split_k > 1)


@triton.jit
def _split_bounds_probe(out_ptr, split_k, super_blocks):
    split = tl.program_id(0)
    first, count = split_bounds(split, split_k, super_blocks)
    tl.store(out_ptr + 2 * split, first)
    tl.store(out_ptr + 2 * split + 1, count)


@pytest.mark.parametrize("super_blocks, split_k", [(26, 8), (3, 3), (16, 16), (26, 1)])
def test_splits_partition_the_super_blocks_evenly(super_blocks, split_k):
    bounds = torch.full((split_k, 2), -1, dtype=torch.int32, device=DEVICE)
    _split_bounds_probe[(split_k,)](bounds, split_k, super_blocks)
    ranges = bounds.cpu().tolist()
    covered = [sb for start, count in ranges for sb in range(start, start + count)]
    assert covered == list(range(super_blocks))
    assert max(c for _, c in ranges) - min(c for _, c in ranges) <= 1


def _activations_before_poison(m, k, seed):
    """``_x(m, k)`` as the first rows of a buffer whose next row and beyond are NaN, so a kernel
    that reads past K (the next row's head, or past the tensor's end) returns NaN or wrong sums."""
    buffer = torch.full(((m + 1) * k,), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    x = buffer[: m * k].view(m, k)
    x.copy_(_x(m, k, seed))
    return x


@pytest.mark.parametrize("bucket", [1, 3, 8, 64])
@pytest.mark.parametrize("k", [96, 576])
def test_a_k_padded_to_whole_super_blocks_gives_the_bits_of_zero_padded_activations(bucket, k):
    """K = 96 and 576 are stored in 256 and 768 columns (zeros past K). The kernels read the
    activations only up to K: every config sampled, at split 1 and (W4A8, whose splits are whole
    super-blocks in both) split 3, gives the bits of the same weights multiplied with
    activations zero-padded to the stored K, which runs the kernels unmasked."""
    from coalesced_int4.quantize import stored_k

    packed, _ = packed_weight(40, k, seed=k + bucket, device=DEVICE)
    assert packed[0].shape == (40, stored_k(k) // 2)
    m = SMALLER_M.get(bucket, bucket)
    x = _activations_before_poison(m, k, seed=bucket)
    padded = torch.nn.functional.pad(x, (0, stored_k(k) - k))
    splits = (1, 3) if bucket in W4A8_BUCKETS and k == 576 else (1,)
    configs = int4_autotune_configs(bucket)
    for split in splits:
        for config in _sample(prune_int4_configs(configs, {"K": k, "split_k": split}), count=2):
            out = launch(bucket, x, *packed, 32, split_k=split, config=config)
            assert torch.equal(out, launch(bucket, padded, *packed, 32, split_k=split, config=config)), (split, config)
            assert_close_to_reference(out, dequant_matmul_reference(x, packed))


@pytest.mark.skipif(DEVICE == "cuda", reason="the emulation follows the interpreter's summation order, not the GPU's")
@pytest.mark.parametrize("k", [256, 576, 2048])
def test_the_torch_emulation_of_the_decode_kernel_gives_the_interpreted_kernels_bits(k):
    """``accuracy.w4a8_linear`` (what decode-path perplexity runs on a CPU) against the W4A8
    kernel at M = 1, split 1, in the interpreter: K within one trip, K padded, two trips."""
    from coalesced_int4 import CudaCoalescedInt4Tensor
    from coalesced_int4.accuracy import w4a8_linear

    weight = CudaCoalescedInt4Tensor.from_float(torch.randn(40, k, generator=torch.Generator().manual_seed(k)))
    config = prune_int4_configs(int4_autotune_configs(1), {"K": k, "split_k": 1})[0]
    for seed in range(3):
        x = _x(1, k, seed=seed)
        x[0, :32] *= 1e-3 if seed == 1 else 1.0  # a quiet group beside loud ones
        kernel = launch(1, x, *weight.packed, 32, split_k=1, prequantize=False, config=config)
        assert torch.equal(w4a8_linear(x, weight, groups_per_trip=config.kwargs["GROUPS"]), kernel), seed
