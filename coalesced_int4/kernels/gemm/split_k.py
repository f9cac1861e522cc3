"""The launch skeleton shared by every INT4 GEMM, and the deterministic split-K reduction.

With ``split_k > 1`` a GEMM's programs write fp32 partial sums ``[split_k, bucket, N]`` (sized
by the bucket, not M, so the strides stay static when M is symbolic; rows >= M are never
read) and ``_splitk_reduce_kernel`` adds them in split order: the same bits on every run, no
atomics anywhere. Splits partition a unit of K evenly (``split_bounds``: super-blocks for
W4A8, main-loop trips for W4A16).

A GEMM's grid is (N tiles, split_k). A balanced W4A16 grid (``configs.balanced_short_columns``,
``short_columns > 0``) is one-dimensional instead (``split_program``): the tiles of the first
``short_columns`` columns are split ``split_k - 1`` ways and their programs come first, the
other tiles ``split_k`` ways. It gives every SM the same count of programs where ``split_k``
alone leaves some SMs one more than the others: the short tiles' longer programs land one on
each of the first SMs filled, beside programs of the full split.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from coalesced_int4.kernels.autotune.tuner import launch_or_queue, tuned_kernel
from coalesced_int4.kernels.device_functions import to_bf16
from coalesced_int4.kernels.ops import family
from coalesced_int4.kernels.runtime import dependent_launch, recorded_call
from coalesced_int4.kernels.runtime.dependent_launch import let_next_kernel_launch, wait_for_previous_kernel
from coalesced_int4.quantize import SUPER_BLOCK
from coalesced_int4.torch_internals import is_wrap_triton_enabled

REDUCE_WIDTHS = (128, 512)
"""Columns a reduction program sums (``reduce_width`` picks one)."""
REDUCE_PROGRAMS_WANTED = 128
"""About one reduction program per SM of an H100/H200 (132 SMs): wide programs only where
they still make this many."""
REDUCE_WIDE_SPLITS = 8
"""The most splits a wide program sums: each split is one more load and add for every
column, so a wide program's latency grows with the split while a narrow grid spreads it; at
16 splits wide programs measured slower."""


def reduce_width(n: int, bucket: int, split_k: int) -> int:
    """Columns per reduction program for ``split_k`` partials of ``bucket`` rows of N columns:
    512 where at most ``REDUCE_WIDE_SPLITS`` splits are summed and 512-column programs (one
    per 512 columns of each row) still number ``REDUCE_PROGRAMS_WANTED``, else 128: at 2-8
    splits narrow programs are too fine, and with few programs wide ones leave SMs idle."""
    narrow, wide = REDUCE_WIDTHS
    fills = triton.cdiv(n, wide) * bucket >= REDUCE_PROGRAMS_WANTED
    return wide if split_k <= REDUCE_WIDE_SPLITS and fills else narrow


@triton.jit
def split_bounds(split, split_k, units):
    """(first unit, count) of ``split`` of ``units``: the first ``units % split_k`` splits take
    one more than the others."""
    base = units // split_k
    extra = units % split_k
    return split * base + tl.minimum(split, extra), base + (split < extra).to(tl.int32)


@triton.jit
def split_program(program, split_k, short_columns, BLOCK_N: tl.constexpr):
    """(tile, split, splits of the tile) of ``program`` in the grid ``split_programs`` sizes:
    the first ``short_columns // BLOCK_N`` tiles are split ``split_k - 1`` ways, their
    programs first, the rest ``split_k`` ways."""
    short_tiles = short_columns // BLOCK_N
    short_splits = tl.maximum(split_k - 1, 1)  # split_k = 1 has no short tiles
    short_programs = short_tiles * short_splits
    short = program < short_programs
    rest = program - short_programs
    tile = tl.where(short, program // short_splits, short_tiles + rest // split_k)
    split = tl.where(short, program % short_splits, rest % split_k)
    return tile, split, tl.where(short, short_splits, split_k)


def split_programs(n: int, split_k: int, short_columns: int, block_n: int) -> int:
    """The programs of a GEMM grid (``split_program``)."""
    return triton.cdiv(n, block_n) * split_k - short_columns // block_n


@triton.jit
def _splitk_reduce_kernel(
    partial_ptr, out_ptr, N, stride_s, stride_pm, stride_om, short_columns,
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr,
):
    """Program (N tile, row): out[row, n] = bf16(sum_s partial[s, row, n]), s ascending; the
    first ``short_columns`` columns were split one way fewer and have no last partial.
    DEPENDENT_LAUNCH: launched with programmatic dependent launch (``dependent_launch``), which
    lets the next kernel launch right after this one's wait."""
    wait_for_previous_kernel(DEPENDENT_LAUNCH)
    let_next_kernel_launch(DEPENDENT_LAUNCH)
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1)
    mask = offs < N
    total = tl.zeros((BLOCK_N,), tl.float32)
    for s in tl.static_range(SPLIT_K):
        written = mask
        if s == SPLIT_K - 1:
            written = mask & (offs >= short_columns)
        total += tl.load(partial_ptr + s * stride_s + row * stride_pm + offs, mask=written, other=0.0)
    tl.store(out_ptr + row * stride_om + offs, to_bf16(total, INTERPRET), mask=mask)


def reduction_launch(partials, out, m, short_columns=0, width=None):
    """The grid, arguments and meta-parameters of ``_splitk_reduce_kernel`` summing the first
    ``m`` rows of fp32 ``partials`` [split_k, bucket, N] into bf16 ``out`` [m, N] (the first
    ``short_columns`` columns, those of a balanced grid's short tiles, without the last
    partial), ``width`` columns a program (default ``reduce_width``; benchmarks time the
    others)."""
    split_k, bucket, n = partials.shape
    width = width or reduce_width(n, bucket, split_k)
    grid = (triton.cdiv(n, width), m)
    args = (partials, out, n, partials.stride(0), partials.stride(1), out.stride(0), short_columns)
    return grid, args, dict(SPLIT_K=split_k, BLOCK_N=width, INTERPRET=family.INTERPRETER, num_warps=4,
                            **dependent_launch.options(out))


def launch_split_k_gemm(kernel, *, bucket, m, k, split_k, activations, activation_strides, weights,
                        short_columns=None, constants=None):
    """Launch a GEMM of either family and reduce its partials if split_k > 1. Both kernels
    take ``(*activations, qdata, scale, scale_step, zero_point, zero_point_step, out, M, N, K,
    *activation_strides, row strides of qdata, of the codes and of the steps, split_k,
    [short_columns,] stride_s, stride_m, PARTIAL, BUCKET, MASK_K, INTERPRET, DEPENDENT_LAUNCH)``
    (K the activations' columns, ``MASK_K`` where it is not a multiple of 256) and
    the family's own ``constants``, the weights as the family's launcher views them (strides
    in the view's elements). W4A16's kernel also takes ``short_columns`` and the constexpr
    ``BALANCED``: where ``short_columns`` is not 0 the grid is the 1-D one ``split_program``
    maps (the first ``short_columns`` columns split one way fewer), else (N tiles, split_k).
    W4A8 passes None and runs on (N tiles, split_k). The split and the short columns are
    runtime arguments so that every split shares one binary (Triton still compiles split 1
    apart: it specializes arguments equal to 1)."""
    qdata, scale, scale_step, zero_point, zero_point_step = weights
    n = qdata.shape[0]
    out = recorded_call.empty((m, n), torch.bfloat16, qdata.device)
    if split_k == 1:
        target, stride_s = out, 0
    else:
        target = recorded_call.empty((split_k, bucket, n), torch.float32, qdata.device)
        stride_s = target.stride(0)

    balanced = bool(short_columns)

    def grid(meta):
        if not balanced:
            return (triton.cdiv(n, meta["BLOCK_N"]), split_k)
        return (split_programs(n, split_k, short_columns, meta["BLOCK_N"]),)

    if short_columns is None:  # W4A8's kernel has no balanced grid
        grid_args, grid_constants = (), {}
    else:
        grid_args, grid_constants = (short_columns,), {"BALANCED": balanced}
    args = (*activations, qdata, scale, scale_step, zero_point, zero_point_step,
            target, m, n, k, *activation_strides, qdata.stride(0), scale.stride(0),
            scale_step.stride(0), split_k, *grid_args, stride_s, target.stride(-2))
    kwargs = {"PARTIAL": split_k > 1, "BUCKET": bucket, "MASK_K": k % SUPER_BLOCK != 0,
              "INTERPRET": family.INTERPRETER, **dependent_launch.options(qdata), **grid_constants, **(constants or {})}
    if is_wrap_triton_enabled():  # tracing: a tuned shape compiles its pick alone
        kernel = tuned_kernel(kernel, args, kwargs)
    recorded_call.run_kernel(family.launchable(kernel), grid, *args, **kwargs)
    if split_k > 1:
        grid, args, meta = reduction_launch(target, out, m, short_columns or 0)
        launch_or_queue(family.launchable(_splitk_reduce_kernel), grid, *args, **meta)
    return out
