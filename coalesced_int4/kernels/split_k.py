"""The launch skeleton shared by every INT4 GEMM, and the deterministic split-K reduction.

With ``split_k > 1`` a GEMM's programs write fp32 partial sums ``[split_k, bucket, N]`` (sized
by the bucket, not M, so the strides stay static when M is symbolic; rows >= M are never
read) and ``_splitk_reduce_kernel`` adds them in split order: the same bits on every run, no
atomics anywhere. Splits partition K's super-blocks evenly (``split_bounds``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._library.triton import is_wrap_triton_enabled

from coalesced_int4.kernels import dependent_launch, family
from coalesced_int4.kernels.autotune.tuner import launch_or_queue, tuned_kernel
from coalesced_int4.kernels.dependent_launch import let_next_kernel_launch, wait_for_previous_kernel
from coalesced_int4.kernels.rounding import to_bf16

REDUCE_WIDTHS = (128, 512)
"""Columns a reduction program sums (``reduce_width`` picks one)."""
REDUCE_PROGRAMS_WANTED = 128
"""About one reduction program per SM of an H100/H200 (132 SMs): wide programs only where
they still make this many."""
REDUCE_WIDE_SPLITS = 4
"""The most splits a wide program sums: each split is one more load and add for every
column, so a wide program's latency grows with the split while a narrow grid spreads it."""


def reduce_width(n: int, bucket: int, split_k: int) -> int:
    """Columns per reduction program for ``split_k`` partials of ``bucket`` rows of N columns:
    512 where at most ``REDUCE_WIDE_SPLITS`` splits are summed and 512-column programs (one
    per 512 columns of each row) still number ``REDUCE_PROGRAMS_WANTED``, else 128. Measured
    on the H200 (bench_reduce.py, docs/benchmarks.md): at M = 64 and 2-4 splits programs of
    128 columns are too fine (4224 of them on N = 8448) and the wide ones take half the time;
    at 16 splits, or with few programs (N = 256), the wide ones are slower."""
    narrow, wide = REDUCE_WIDTHS
    fills = triton.cdiv(n, wide) * bucket >= REDUCE_PROGRAMS_WANTED
    return wide if split_k <= REDUCE_WIDE_SPLITS and fills else narrow


@triton.jit
def split_bounds(split, split_k, super_blocks):
    """(first super-block, count) of ``split``: the first ``super_blocks % split_k`` splits
    take one more than the others."""
    base = super_blocks // split_k
    extra = super_blocks % split_k
    return split * base + tl.minimum(split, extra), base + (split < extra).to(tl.int32)


@triton.jit
def _splitk_reduce_kernel(
    partial_ptr, out_ptr, N, stride_s, stride_pm, stride_om,
    SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRET: tl.constexpr, DEPENDENT_LAUNCH: tl.constexpr,
):
    """Program (N tile, row): out[row, n] = bf16(sum_s partial[s, row, n]), s ascending.
    DEPENDENT_LAUNCH: launched with programmatic dependent launch (``dependent_launch``)."""
    wait_for_previous_kernel(DEPENDENT_LAUNCH)
    offs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.program_id(1)
    mask = offs < N
    total = tl.zeros((BLOCK_N,), tl.float32)
    for s in tl.static_range(SPLIT_K):
        total += tl.load(partial_ptr + s * stride_s + row * stride_pm + offs, mask=mask, other=0.0)
    let_next_kernel_launch(DEPENDENT_LAUNCH)
    tl.store(out_ptr + row * stride_om + offs, to_bf16(total, INTERPRET), mask=mask)


def reduction_launch(partials, out, m, width=None):
    """The grid, arguments and meta-parameters of ``_splitk_reduce_kernel`` summing the first
    ``m`` rows of fp32 ``partials`` [split_k, bucket, N] into bf16 ``out`` [m, N], ``width``
    columns a program (default ``reduce_width``; benchmarks time the others)."""
    split_k, bucket, n = partials.shape
    width = width or reduce_width(n, bucket, split_k)
    grid = (triton.cdiv(n, width), m)
    args = (partials, out, n, partials.stride(0), partials.stride(1), out.stride(0))
    return grid, args, dict(SPLIT_K=split_k, BLOCK_N=width, INTERPRET=family.INTERPRETER, num_warps=4,
                            **dependent_launch.options(out.device))


def launch_split_k_gemm(kernel, *, bucket, m, k, split_k, activations, activation_strides, weights,
                        constants=None):
    """Launch a GEMM of either family on the grid (N tiles, split_k) and reduce its partials
    if split_k > 1. Both kernels take ``(*activations, qdata, scale, scale_step, zero_point,
    zero_point_step, out, M, N, K, *activation_strides, row strides of qdata, of the codes
    and of the steps, split_k, stride_s, stride_m, PARTIAL, BUCKET, INTERPRET,
    DEPENDENT_LAUNCH)`` and the family's own ``constants``, the weights
    as the family's launcher views them (strides in the view's elements). The split count is
    a runtime argument so every split shares one binary."""
    qdata, scale, scale_step, zero_point, zero_point_step = weights
    n = qdata.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16, device=qdata.device)
    if split_k == 1:
        target, stride_s = out, 0
    else:
        target = torch.empty((split_k, bucket, n), dtype=torch.float32, device=qdata.device)
        stride_s = target.stride(0)

    def grid(meta):
        return (triton.cdiv(n, meta["BLOCK_N"]), split_k)

    args = (*activations, qdata, scale, scale_step, zero_point, zero_point_step,
            target, m, n, k, *activation_strides, qdata.stride(0), scale.stride(0),
            scale_step.stride(0), split_k, stride_s, target.stride(-2))
    kwargs = {"PARTIAL": split_k > 1, "BUCKET": bucket, "INTERPRET": family.INTERPRETER,
              **dependent_launch.options(qdata.device), **(constants or {})}
    if is_wrap_triton_enabled():  # tracing: a tuned shape compiles its pick alone
        kernel = tuned_kernel(kernel, args, kwargs)
    family.launchable(kernel)[grid](*args, **kwargs)
    if split_k > 1:
        grid, args, meta = reduction_launch(target, out, m)
        launch_or_queue(family.launchable(_splitk_reduce_kernel), grid, *args, **meta)
    return out
