"""The rules of the INT4 GEMM ops, each written once: which arguments a bucket takes
(``unsupported_reason``), which split-K is legal (``check_split_k``), the autotune config
spaces and their prune rule. The kernels, the op family, the dispatch and the tests all call
these functions.
"""

from __future__ import annotations

import functools
from typing import List, Optional, Sequence

import torch
import triton
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.symbolic_shapes import statically_known_true

from coalesced_int4.kernels.autotune.launch_params import InvalidLaunchParam
from coalesced_int4.quantize import GROUP_SIZE, SUPER_BLOCK

SUPPORTED_BUCKETS = (1, 2, 3, 4, 8, 16, 32, 64)
W4A8_BUCKETS = (1, 2, 3, 4)
"""Decode buckets: activations quantized to int8, dot products on dp4a."""
W4A16_BUCKETS = (8, 16, 32, 64)
"""Small-batch buckets: weights decoded to bf16, dot products on tensor cores."""
SPLIT_K_CANDIDATES = (1, 2, 4, 8, 16)
"""Split-K values timed for the W4A8 buckets."""
PREQUANTIZE_CANDIDATES = (False, True)
"""Whether the W4A8 buckets' activations are quantized inside the GEMM, by every program
(one launch), or once by a kernel of their own (a second launch, and a GEMM main loop about
40 % shorter at M = 4): timed with the split-K."""
TILE_SPLIT_K_CANDIDATES = (1, 2, 3, 4, 5, 8, 16, 32)
"""Split-K values timed for the W4A16 buckets: the reference's powers of two (narrow N keeps
gaining from more splits), and 3 and 5, which spread N = 6656's 104 tiles of 64 rows more
evenly over an H100/H200's 132 SMs than any power of two (docs/design.md, "Split-K")."""
BALANCED_CANDIDATES = (False, True)
"""Whether a W4A16 launch runs its split on a balanced grid (``balanced_short_columns``), timed
with the split: the plain grid first, so near ties keep it."""

CODE_WORD = torch.int32
"""The kernels read the byte-wide codes (qdata, and W4A16 the scale and zero codes) as words of
this dtype: each row holds whole words since K % 256 == 0, and each tensor must start on a
word."""

TMA_ALIGNMENT = 16
"""Bytes: the tensor memory accelerator reads a tensor that starts on this boundary (its rows,
K bf16 with K % 256 == 0, always do)."""

_ALLOWED_DTYPES = (
    ("activation", 0, (torch.bfloat16,)),
    ("qdata", 1, (torch.uint8, torch.int8)),
    ("scale codes", 2, (torch.uint8,)),
    ("zero codes", 4, (torch.uint8,)),
    ("scale_step", 3, (torch.float16,)),
    ("zero_point_step", 5, (torch.float16,)),
)


def unsupported_reason(
    bucket: int,
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    scale_step: torch.Tensor,
    zero_point: torch.Tensor,
    zero_point_step: torch.Tensor,
    group_size: int,
) -> Optional[str]:
    """Why ``int4_quantized_gemm_m{bucket}`` cannot take these arguments, or None. Rules are
    checked in a fixed order and the first failing one is reported; never raises."""
    tensors = (x, qdata, scale, scale_step, zero_point, zero_point_step)
    if x.dim() != 2 or qdata.dim() != 2:
        return "expects a rank-2 activation and qdata"
    for name, index, allowed in _ALLOWED_DTYPES:
        dtype = tensors[index].dtype
        if dtype not in allowed:
            names = "/".join(str(d).removeprefix("torch.") for d in allowed)
            return f"{name} must be {names}, got {str(dtype).removeprefix('torch.')}"
    if group_size != GROUP_SIZE:
        return f"group_size must be {GROUP_SIZE}, got {group_size}"
    m, k = x.shape
    if not isinstance(k, int):
        return "K must be static"
    if k % SUPER_BLOCK:
        return f"K must be a multiple of {SUPER_BLOCK}, got {k}"
    if isinstance(m, int):
        if not 1 <= m <= bucket:
            return f"static M must be within [1, {bucket}], got {m}"
    elif not (statically_known_true(m >= 1) and statically_known_true(m <= bucket)):
        return f"dynamic M is not provably within [1, {bucket}]"
    if not all(t.is_contiguous() for t in tensors):
        return "inputs must be contiguous"
    for name, t in (("qdata", qdata), ("scale codes", scale), ("zero codes", zero_point)):
        if t.storage_offset() % CODE_WORD.itemsize:
            return (f"{name} must start on a {CODE_WORD.itemsize}-byte boundary (the kernels read it as "
                    f"{str(CODE_WORD).removeprefix('torch.')} words), got storage offset {t.storage_offset()}")
    if bucket in W4A16_BUCKETS and x.storage_offset() % (TMA_ALIGNMENT // x.element_size()):
        return (f"activation must start on a {TMA_ALIGNMENT}-byte boundary (the W4A16 kernels copy its "
                f"tiles by TMA), got storage offset {x.storage_offset()}")
    if not (x.is_cuda or is_fake(x)):
        return "activation must be on a CUDA device (or fake while tracing)"
    if any(t.device != x.device for t in tensors[1:]):
        return "activation and weights must be on the same device"
    n = qdata.shape[0]
    if qdata.shape[1] * 2 != k:
        return f"qdata K/2 mismatch: x K={k}, qdata K/2={qdata.shape[1]}"
    if tuple(scale.shape) != (n, k // GROUP_SIZE) or tuple(zero_point.shape) != (n, k // GROUP_SIZE):
        return "scale/zero shape does not match [N, K/32]"
    if tuple(scale_step.shape) != (n, k // SUPER_BLOCK) or tuple(zero_point_step.shape) != (
        n,
        k // SUPER_BLOCK,
    ):
        return "step shape does not match [N, K/256]"
    return None


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> Optional[int]:
    """The SMs a grid spreads over: a CUDA device's count, None elsewhere. Asked of the driver
    once per device: every W4A16 launch on a balanced grid reads it."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None


def balanced_short_columns(n: int, split_k: int, sms: Optional[int]) -> int:
    """The columns at the start of N whose tiles a balanced grid splits ``split_k - 1`` ways
    (``split_k.split_program``), so that ``split_k``'s programs of ``BALANCE_ROWS`` rows fill
    ``sms`` SMs evenly: where they number ``p * sms + e``, about ``e`` tiles (a whole count of
    ``BALANCE_COLUMNS``) each give up a program and every SM holds ``p``, one of them longer.
    Raises ``InvalidLaunchParam`` where ``split_k`` has no such grid.

    6656x4096 at M = 64 on the H200 (132 SMs): split 4 is 416 programs, 20 SMs holding four
    of 8 trips and the others three; on the balanced grid 20 tiles take 3 splits of 10-11
    trips, and every SM three programs: 16.5-16.9 µs against 18.7-19.2 for splits 3 and 4
    (docs/benchmarks.md, session 27)."""
    if sms is None:
        raise InvalidLaunchParam("a balanced grid needs the SM count of a CUDA device")
    if split_k < 2:
        raise InvalidLaunchParam("split_k=1 has no balanced grid: a tile cannot be split one way fewer")
    programs = triton.cdiv(n, BALANCE_ROWS) * split_k
    per_sm, excess = divmod(programs, sms)
    if per_sm == 0 or excess == 0:
        raise InvalidLaunchParam(f"split_k={split_k} on N={n} makes {programs} programs for {sms} SMs: "
                                 f"{'fewer than one an SM' if per_sm == 0 else 'already as many on every SM'}")
    short_columns = -(-excess * BALANCE_ROWS // BALANCE_COLUMNS) * BALANCE_COLUMNS
    if short_columns > n // BALANCE_COLUMNS * BALANCE_COLUMNS:
        raise InvalidLaunchParam(f"split_k={split_k} on N={n} has {excess} programs past {per_sm} an SM, "
                                 f"more than N's whole tiles can give up")
    if short_columns // BALANCE_ROWS * (split_k - 1) > sms:
        raise InvalidLaunchParam(f"split_k={split_k} on N={n}: the short tiles' longer programs outnumber "
                                 f"the {sms} SMs, so some SMs would hold two")
    return short_columns


def check_split_k(split_k: int, k: int, unit: int = SUPER_BLOCK) -> None:
    """A split needs at least one super-block of K: ``1 <= split_k <= K // 256``."""
    if not 1 <= split_k <= k // unit:
        raise InvalidLaunchParam(f"split_k={split_k} needs K >= {split_k * unit}, got K={k}")


# ------------------------------------------------------------------ autotune config spaces
W4A8_TILES = ((16, 32, 4), (8, 64, 4), (32, 16, 4))
"""(BLOCK_N, GROUPS, num_warps): output columns per program, groups of 32 weights per
main-loop trip, warps per program. The tiles that won a sweep of 9 tiles x 2 stages on the
H200 at M = 1 and 4 (docs/benchmarks.md); kept small because each config costs seconds of
compile per bucket on a cold start."""
W4A8_STAGES = (1, 2)
W4A8_PREFETCH = (False, True)
W4A16_TILES = ((64, 256, 4), (128, 256, 8), (64, 128, 4))
"""(BLOCK_N, BLOCK_K, num_warps): one warp group per 64 weight rows (the tensor-core
instruction's M). (64, 4) and (128, 8) with whole super-blocks are the tiles that placed in a
sweep of six on the H200 at M = 8, 16 and 64 (docs/benchmarks.md); the half-super-block tile
halves the shared memory per stage, and won the H200 sweep at M = 32 and 64 on 8448x6656
(28.4 and 34.6 us against 32.2 and 40.8)."""
BALANCE_ROWS = min(block_n for block_n, _, _ in W4A16_TILES)
"""Weight rows of the tile a balanced grid counts programs in: the W4A16 space's narrowest
BLOCK_N."""
BALANCE_COLUMNS = max(block_n for block_n, _, _ in W4A16_TILES)
"""Short columns come in multiples of the space's widest BLOCK_N, so that they are whole tiles
under every config."""
W4A16_STAGES = (2, 3)
W4A16_TMA_STAGES = (2,)
"""The depths at which the W4A16 kernel copies its activation tile by TMA (``TMA_ACTIVATIONS``)
rather than by pointers. At two stages it was as fast as two-stage pointer copies or faster in
13 of 14 cells timed on the H200 (docs/benchmarks.md, session 24), with the same bits. At three,
the descriptor's barriers take the (64, 128, 4) program 24 bytes past a quarter of the SM's
shared memory (three programs an SM, not four), and it gave wrong tiles, differently from run
to run, wherever three programs with 64-row dots shared an SM (docs/benchmarks.md, session 25;
the cause is not found)."""
W4A16_REGISTER_CAPS = {(64, 128, 4, 2): 96}
"""(BLOCK_N, BLOCK_K, num_warps, stages) -> a register cap (``maxnreg``) that the config is
also tried with. Copying activations by TMA leaves the (64, 128, 4) two-stage program 107
registers; capped at 96 it fits five programs an SM instead of four, which puts
39936x6656's 624 tiles in one wave (124 against 141 µs at M = 64, session 24; at M = 49, once
the descriptor stopped zero-filling the rows past M, 128 against 133 for pointers: session 26)."""


def w4a16_batch_rows(bucket: int, m) -> int:
    """The activation rows the W4A16 kernel multiplies for M rows at ``bucket``: three
    quarters of bucket 64 (48: a dot of 32 rows and one of 16) where M is static and at most
    48, else the whole bucket. A symbolic M, however bounded, gets the whole bucket, so that
    one compiled binary serves its range. On the H200 the 48 rows took 6-14 % off bucket 64
    at M = 33-48 on SPEC's shapes, with the same bits (same-process A/B, µs: 14336x4096 at
    M = 33, split 4, 30.8 -> 27.1; 4096x4096 at M = 41 11.2 -> 10.6; 8448x6656 at M = 33
    27.4-27.8 -> 23.6-23.7). Two dots of 32 rows at M = 49-64 gained nothing, and at bucket
    32 the quarter's dot (8 rows) falls back to ``mma.sync``, whose operand layout lengthens
    the loop from 268 to 463 instructions a trip (offline sm_90): both keep one dot
    (docs/benchmarks.md, session 20)."""
    three_quarters = 3 * bucket // 4
    if bucket == 64 and isinstance(m, int) and m <= three_quarters:
        return three_quarters
    return bucket


def kernel_config(num_warps: int, maxnreg: Optional[int] = None, **meta) -> triton.Config:
    """A kernel config whose compile-time pipeline depth (``num_stages``) is its ``STAGES``,
    the depth its main loop is written for; ``maxnreg`` caps its registers a thread."""
    return triton.Config(meta, num_warps=num_warps, num_stages=meta["STAGES"], maxnreg=maxnreg)


def w4a16_configs(block_n: int, block_k: int, num_warps: int, stages: int) -> List[triton.Config]:
    """The W4A16 configs of one tile and depth: activations by TMA where
    ``W4A16_TMA_STAGES`` says, and again with its register cap if it has one."""
    meta = dict(BLOCK_N=block_n, BLOCK_K=block_k, STAGES=stages, TMA_ACTIVATIONS=stages in W4A16_TMA_STAGES)
    cap = W4A16_REGISTER_CAPS.get((block_n, block_k, num_warps, stages))
    return [kernel_config(num_warps, **meta)] + ([kernel_config(num_warps, maxnreg=cap, **meta)] if cap else [])


def int4_autotune_configs(bucket: int) -> List[triton.Config]:
    """The autotune space of a bucket. W4A8: every tile of ``W4A8_TILES`` x stages x
    prefetch.
    W4A16: one tile holds every activation row the kernel multiplies (``w4a16_batch_rows``),
    so the weights are decoded once, x every tile of ``W4A16_TILES`` x stages
    (``w4a16_configs``)."""
    if bucket in W4A8_BUCKETS:
        return [
            kernel_config(w, BLOCK_N=n, GROUPS=g, STAGES=s, PREFETCH=p)
            for n, g, w in W4A8_TILES
            for s in W4A8_STAGES
            for p in W4A8_PREFETCH
        ]
    if bucket in W4A16_BUCKETS:
        return [config for n, k, w in W4A16_TILES for s in W4A16_STAGES for config in w4a16_configs(n, k, w, s)]
    raise ValueError(f"no autotune space for bucket {bucket}; buckets are {SUPPORTED_BUCKETS}")


def main_loop_trips(config: triton.Config, k: int, split_k: int) -> int:
    """Trips of a program's K loop in the largest split: W4A8 splits super-blocks and walks
    their groups of 32 GROUPS at a time; W4A16 splits its trips of BLOCK_K."""
    if "GROUPS" not in config.kwargs:
        return max(1, -(-(k // config.kwargs.get("BLOCK_K", SUPER_BLOCK)) // split_k))
    groups = -(-(k // SUPER_BLOCK) // split_k) * (SUPER_BLOCK // GROUP_SIZE)
    return max(1, -(-groups // config.kwargs["GROUPS"]))


def prune_int4_configs(configs: Sequence[triton.Config], named_args: dict, **kwargs) -> list:
    """Triton ``early_config_prune``: keep configs whose pipeline depth fits the main loop
    (``STAGES <= trips``); if none does, the one with the fewest stages."""
    args = {**named_args, **kwargs}
    k, split_k = args["K"], args.get("split_k", 1)
    kept = [c for c in configs if c.kwargs.get("STAGES", 1) <= main_loop_trips(c, k, split_k)]
    return kept or [min(configs, key=lambda c: c.kwargs.get("STAGES", 1))]
