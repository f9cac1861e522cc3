"""Bucket 64's W4A16 main loop written in Gluon, timed against the shipped Triton kernel.

An experiment, not a kernel the library runs. It asked whether the shipped kernel's trip can be
shortened by what Triton's pipeliner does not allow. Timed on the H200, no: its best variant,
``11``, gave the shipped bits and ran slower than the shipped kernel (docs/decisions.md). What
it tried:

- **One fence and one whole 128-deep dot a trip, left in flight across the back-edge**
  (``warpgroup_mma_wait(1)``). The shipped kernel issues its dot in eight 16-deep pieces,
  each waiting for the warp group to arrive.
- **Layouts written out**, so that every conversion between the codes, their pairs and the
  tensor-core operand stays in registers: the codes replicated over a quad (``WORDS3``),
  pairs in the operand's order (``PAIRS``), group values per pair (``GROUPS3``).
- **GROUPS_AHEAD:** the next trip's group values made at the end of this trip, while the dot
  runs, instead of at the head of the decode that needs them.
- **WORDS_AHEAD:** the next trip's codes read from shared memory at the end of this trip.

The decode is the shipped kernel's PTX (``w4a16._GROUP_BY_QUAD``, ``w4a16._DECODE_PAIR``), so
the outputs are the shipped kernel's bits. It covers 64 weight rows x 128 K a trip, 4 warps,
M = 64 only, and split-K through the shipped reduction. It is launched as the shipped kernel
is, with dependent launch where the GPU has it (``dependent_launch``).

    python tools/perf/gluon_w4a16.py --cases 4096x4096:4:3,14336x4096:1:3 --variants 00,10,11

A case is NxK:split:stages; a variant is GROUPS_AHEAD and WORDS_AHEAD as two digits. To see
where a variant's warps wait, profile its first launch (the bits check, outside the timing's
CUDA graphs) and summarize it with ``stall_lines.py``:

    ncu --clock-control none -k regex:gluon_w4a16_kernel --launch-count 1 --set full -o gl \
        python tools/perf/gluon_w4a16.py --variants 10 --cases 16896x4096:1:3
``tests/test_gluon_w4a16.py`` checks the loop's structure offline on sm_90 SASS.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

import benchmarks_on_path  # noqa: F401  (benchmarks/ on sys.path)
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait

from coalesced_int4.kernels.gemm import w4a16
from coalesced_int4.kernels.gemm.split_k import _splitk_reduce_kernel, reduction_launch
from coalesced_int4.kernels.runtime import dependent_launch

ROWS = 64
"""Weight rows a program multiplies, and activation rows (bucket 64)."""
DEPTH = 128
"""Weights of K a trip: 16 int32 code words a row, 4 groups, half a super-block."""

GROUP_BY_QUAD = gl.constexpr(w4a16._GROUP_BY_QUAD.value)
DECODE_PAIR = gl.constexpr(w4a16._DECODE_PAIR.value)
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
OPERAND = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=MMA.value, k_width=2))
"""The decoded weights [64, 128] as the tensor core reads them from registers: thread
(warp w, lane 4g + t) holds rows 16w + g and 16w + g + 8, and k = 16j + 2t (+1) and
16j + 8 + 2t (+1) for j < 8."""
_LANES = [[0, 0, 1], [0, 0, 2], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
_WARPS = [[16, 0, 0], [32, 0, 0]]
PAIRS = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[8, 0], [0, 4], [0, 8], [0, 16], [0, 32]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 64]))
"""[64 rows, 64 pairs of weights]: ``OPERAND`` with each pair in one register, pairs 4c + t."""
WORDS3 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[8, 0, 0], [0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0]], lane_bases=_LANES, warp_bases=_WARPS,
    block_bases=[], shape=[64, 16, 4]))
"""[64 rows, 16 words, 4 bytes]: the thread's rows, every word, byte t. Sliced over bytes it
is the codes as every lane of a quad holds them; reshaped to [64, 64], ``PAIRS``."""
GROUPS3 = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[8, 0, 0], [0, 0, 4], [0, 0, 8], [0, 1, 0], [0, 2, 0]], lane_bases=_LANES, warp_bases=_WARPS,
    block_bases=[], shape=[64, 4, 16]))
"""[64 rows, 4 groups, 16 pairs of a group] (pair 16g + i): sliced over pairs, the group
values as every lane of a quad holds them; reshaped to [64, 64], ``PAIRS``."""
COPY_X = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
"""Who copies what of a [64, 128] bf16 activation tile: 16 bytes a thread."""
COPY_Q = gl.constexpr(gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0]))
"""Who copies what of the [64, 16] code words of a trip: 16 bytes a thread."""
X_SHARED = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
Q_SHARED = gl.constexpr(gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]))


@gluon.jit
def _trip_meta(sc_ptr, ss_ptr, zc_ptr, zs_ptr, rows, stride_cn, stride_sn, trip):
    """``rows``' scale and zero code words (four groups each) and fp16 steps for ``trip``."""
    return (gl.load(sc_ptr + rows * stride_cn + trip), gl.load(ss_ptr + rows * stride_sn + trip // 2),
            gl.load(zc_ptr + rows * stride_cn + trip), gl.load(zs_ptr + rows * stride_sn + trip // 2))


@gluon.jit
def _group_values(meta, group, selectors):
    """The trip's four groups' values [64, 4] (``w4a16._group_values``: each lane of a quad
    makes one group and takes the others by a shuffle)."""
    scale_codes, scale_step, zero_codes, zero_step = meta
    return gl.inline_asm_elementwise(
        GROUP_BY_QUAD, "=r,r,r,h,h,r,r",
        [gl.expand_dims(scale_codes, 1).broadcast_to(64, 4), gl.expand_dims(zero_codes, 1).broadcast_to(64, 4),
         gl.expand_dims(scale_step, 1).broadcast_to(64, 4), gl.expand_dims(zero_step, 1).broadcast_to(64, 4),
         group, selectors],
        dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _decode(words, groups, byte_of_pair):
    """Code words [64, 16] and their group values [64, 4], both as a quad holds them -> the
    trip's bf16 weights in ``OPERAND``; every layout step stays in a thread's registers."""
    pair_words = gl.convert_layout(gl.reshape(gl.expand_dims(words, 2).broadcast_to(64, 16, 4), [64, 64]), PAIRS)
    pair_groups = gl.convert_layout(gl.reshape(gl.expand_dims(groups, 2).broadcast_to(64, 4, 16), [64, 64]), PAIRS)
    bits = gl.inline_asm_elementwise(DECODE_PAIR, "=r,r,r,r", [pair_words, byte_of_pair, pair_groups],
                                     dtype=gl.int32, is_pure=True, pack=1)
    low = bits.to(gl.int16).to(gl.bfloat16, bitcast=True)
    high = (bits >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.convert_layout(gl.reshape(gl.join(low, high), [64, 128]), OPERAND)


@gluon.jit
def _issue_copies(x_smem, q_smem, x_ptr, q_ptr, x_offsets, q_offsets, trip):
    """One commit group: the activation tile and the code words of ``trip``."""
    async_copy.async_copy_global_to_shared(x_smem, x_ptr + x_offsets + trip * 128)
    async_copy.async_copy_global_to_shared(q_smem, q_ptr + q_offsets + trip * 16)
    async_copy.commit_group()


@gluon.jit
def _codes_of_stage(q_smem, stage, STAGES: gl.constexpr):
    """Wait for the oldest copy group, make it visible to every warp, read its code words."""
    async_copy.wait_group(STAGES - 2)
    gl.thread_barrier()
    return q_smem.index(stage).load(gl.SliceLayout(2, WORDS3))


@gluon.jit
def _grid_dependency(instruction: gl.constexpr, DEPENDENT_LAUNCH: gl.constexpr):
    """``griddepcontrol.wait`` or ``.launch_dependents`` (``dependent_launch``'s contract)."""
    if DEPENDENT_LAUNCH:
        gl.inline_asm_elementwise("griddepcontrol." + instruction + "; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def gluon_w4a16_kernel(x_ptr, q_ptr, sc_ptr, ss_ptr, zc_ptr, zs_ptr, out_ptr, N, K, stride_xm, stride_qn,
                       stride_cn, stride_sn, split_k, stride_os, stride_om, STAGES: gl.constexpr,
                       PARTIAL: gl.constexpr, GROUPS_AHEAD: gl.constexpr, WORDS_AHEAD: gl.constexpr,
                       DEPENDENT_LAUNCH: gl.constexpr):
    """Programs (N tiles of 64, split_k). STAGES: copy groups in the ring, issued STAGES - 1
    trips ahead. PARTIAL: fp32 partials [split_k, 64, N] for the shipped reduction."""
    _grid_dependency("wait", DEPENDENT_LAUNCH)
    pid_n = gl.program_id(0)
    pid_s = gl.program_id(1)
    base = (K // 256) // split_k  # split_k.split_bounds, which Gluon cannot call (a Triton function)
    extra = (K // 256) % split_k
    first_trip = 2 * (pid_s * base + gl.minimum(pid_s, extra))
    last_trip = first_trip + 2 * (base + (pid_s < extra).to(gl.int32)) - 1

    x_rows = gl.arange(0, 64, layout=gl.SliceLayout(1, COPY_X))
    x_columns = gl.arange(0, 128, layout=gl.SliceLayout(0, COPY_X))
    x_offsets = gl.expand_dims(x_rows, 1) * stride_xm + gl.expand_dims(x_columns, 0)
    q_rows = gl.minimum(pid_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, COPY_Q)), N - 1)
    q_offsets = gl.expand_dims(q_rows, 1) * stride_qn + gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(0, COPY_Q)), 0)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, 64, 128], X_SHARED)
    q_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 64, 16], Q_SHARED)
    for s in gl.static_range(STAGES - 1):
        _issue_copies(x_smem.index(s), q_smem.index(s), x_ptr, q_ptr, x_offsets, q_offsets,
                      gl.minimum(first_trip + s, last_trip))

    group_layout: gl.constexpr = gl.SliceLayout(2, GROUPS3)
    meta_rows = gl.minimum(pid_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, group_layout)), N - 1)
    group = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, group_layout)), 0).broadcast_to(64, 4)
    selectors = gl.inline_asm_elementwise(  # w4a16._quad_lane_selectors
        "{ .reg .b32 lane; mov.u32 lane, %laneid; and.b32 lane, lane, 3; mad.lo.u32 $0, lane, 0x11, 0x40; }",
        "=r,r", [group], dtype=gl.int32, is_pure=True, pack=1)
    byte_of_pair = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, PAIRS)) % 4 * 0x101, 0).broadcast_to(64, 64)
    meta = _trip_meta(sc_ptr, ss_ptr, zc_ptr, zs_ptr, meta_rows, stride_cn, stride_sn, first_trip)
    if GROUPS_AHEAD:
        groups = _group_values(meta, group, selectors)
    if WORDS_AHEAD:
        words = _codes_of_stage(q_smem, 0, STAGES)

    acc = gl.zeros([64, 64], gl.float32, MMA)
    for trip in range(first_trip, last_trip + 1):
        stage = (trip - first_trip) % STAGES
        if not GROUPS_AHEAD:
            groups = _group_values(meta, group, selectors)
        meta = _trip_meta(sc_ptr, ss_ptr, zc_ptr, zs_ptr, meta_rows, stride_cn, stride_sn,
                          gl.minimum(trip + 1, last_trip))
        if not WORDS_AHEAD:
            words = _codes_of_stage(q_smem, stage, STAGES)
        acc = warpgroup_mma(_decode(words, groups, byte_of_pair), x_smem.index(stage).permute((1, 0)), acc,
                            is_async=True)
        if GROUPS_AHEAD:
            groups = _group_values(meta, group, selectors)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # the previous trip's dot is done
        _issue_copies(x_smem.index((stage + STAGES - 1) % STAGES), q_smem.index((stage + STAGES - 1) % STAGES),
                      x_ptr, q_ptr, x_offsets, q_offsets, gl.minimum(trip + STAGES - 1, last_trip))
        if WORDS_AHEAD:
            words = _codes_of_stage(q_smem, (stage + 1) % STAGES, STAGES)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    async_copy.wait_group(0)
    _grid_dependency("launch_dependents", DEPENDENT_LAUNCH)
    rows = pid_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, MMA))
    columns = gl.arange(0, 64, layout=gl.SliceLayout(0, MMA))
    pointers = out_ptr + pid_s * stride_os + gl.expand_dims(columns, 0) * stride_om + gl.expand_dims(rows, 1)
    mask = gl.expand_dims(rows < N, 1) & gl.expand_dims(columns < 64, 0)
    if PARTIAL:
        gl.store(pointers, acc, mask=mask)
    else:
        gl.store(pointers, acc.to(gl.bfloat16), mask=mask)


def launch(x, qdata, scale, scale_step, zero_point, zero_point_step, *, split_k=1, stages=3, groups_ahead=False,
           words_ahead=False):
    """``x`` [64, K] bf16 times the packed weights (the shipped kernel's five tensors)."""
    m, k = x.shape
    if m != ROWS or k % 256:
        raise ValueError(f"this experiment multiplies 64 activation rows and K a multiple of 256, got x {tuple(x.shape)}")
    n = qdata.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    target = out if split_k == 1 else torch.empty((split_k, ROWS, n), dtype=torch.float32, device=x.device)
    codes, scale_codes, zero_codes = (t.view(torch.int32) for t in (qdata, scale, zero_point))
    scale_steps, zero_steps = scale_step.view(torch.int16), zero_point_step.view(torch.int16)
    gluon_w4a16_kernel[(triton.cdiv(n, ROWS), split_k)](
        x, codes, scale_codes, scale_steps, zero_codes, zero_steps, target, n, k, x.stride(0), codes.stride(0),
        scale_codes.stride(0), scale_steps.stride(0), split_k, 0 if split_k == 1 else target.stride(0),
        target.stride(-2), STAGES=stages, PARTIAL=split_k > 1, GROUPS_AHEAD=groups_ahead,
        WORDS_AHEAD=words_ahead, num_warps=4, **dependent_launch.options(x))
    if split_k > 1:
        grid, args, meta = reduction_launch(target, out, m)
        _splitk_reduce_kernel[grid](*args, **meta)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    from bench_gemm import INT4_BYTES_PER_WEIGHT, random_int4_weights

    from coalesced_int4.kernels import launch as shipped_launch
    from coalesced_int4.kernels.autotune.cuda_graph_timing import copies_beyond_l2, time_back_to_back_us
    from coalesced_int4.kernels.ops.configs import w4a16_configs

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="4096x4096:4:3,14336x4096:1:3,6656x4096:2:3,8448x6656:4:3")
    parser.add_argument("--variants", default="00,10,11")
    args = parser.parse_args(argv)
    variants = [(v[0] == "1", v[1] == "1") for v in args.variants.split(",")]
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}; M = 64, µs (shipped / Gluon)")
    print("| N x K | split | stages | shipped | " + " | ".join(f"ahead {v}" for v in args.variants.split(",")) + " |")
    print("|---|---|---|---|" + "---|" * len(variants))
    for case in args.cases.split(","):
        shape, split, stages = case.split(":")
        n, k = (int(v) for v in shape.split("x"))
        split, stages = int(split), int(stages)
        copies = random_int4_weights(n, k, copies_beyond_l2(n * k * INT4_BYTES_PER_WEIGHT))
        x = torch.randn(ROWS, k, dtype=torch.bfloat16, device="cuda")
        config = w4a16_configs(ROWS, DEPTH, 4, stages)[0]
        shipped = shipped_launch(64, x, *copies[0], 32, split_k=split, config=config)
        shipped_us = time_back_to_back_us(
            [lambda c=c: shipped_launch(64, x, *c, 32, split_k=split, config=config) for c in copies])
        cells = []
        for groups_ahead, words_ahead in variants:
            options = dict(split_k=split, stages=stages, groups_ahead=groups_ahead, words_ahead=words_ahead)
            same = torch.equal(shipped.nan_to_num(), launch(x, *copies[0], **options).nan_to_num())
            us = time_back_to_back_us([lambda c=c: launch(x, *c, **options) for c in copies])
            cells.append(f"{us:.2f} ({shipped_us / us:.2f}x{'' if same else ', OTHER BITS'})")
        print(f"| {n}x{k} | {split} | {stages} | {shipped_us:.2f} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
