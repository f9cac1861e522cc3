"""The launch choices of the INT4 GEMMs: the autotune config spaces and their prune rule, the
split-K and other launch-parameter candidates, the balanced-grid rule and the activation rows
a W4A16 launch multiplies. The ops, the autotuner, the benchmarks and the tests read them
from here.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import triton

from coalesced_int4.kernels.autotune.launch_params import InvalidLaunchParam
from coalesced_int4.kernels.ops.validation import SUPPORTED_BUCKETS, W4A8_BUCKETS, W4A16_BUCKETS
from coalesced_int4.quantize import GROUP_SIZE, SUPER_BLOCK, stored_k

SPLIT_K_CANDIDATES = (1, 2, 4, 8, 16)
"""Split-K values timed for the W4A8 buckets."""
PREQUANTIZE_CANDIDATES = (False, True)
"""Whether the W4A8 buckets' activations are quantized inside the GEMM, by every program
(one launch), or once by a kernel of their own (a second launch, and a shorter GEMM main
loop): timed with the split-K."""
TILE_SPLIT_K_CANDIDATES = (1, 2, 3, 4, 5, 8, 16, 32)
"""Split-K values timed for the W4A16 buckets: the reference's powers of two (narrow N keeps
gaining from more splits), and 3 and 5, which spread N = 6656's 104 tiles of 64 rows more
evenly over an H100/H200's 132 SMs than any power of two."""
BALANCED_CANDIDATES = (False, True)
"""Whether a W4A16 launch runs its split on a balanced grid (``balanced_short_columns``), timed
with the split: the plain grid first, so near ties keep it."""

W4A8_TILES = ((16, 32, 4), (8, 64, 4), (32, 16, 4))
"""(BLOCK_N, GROUPS, num_warps): output columns per program, groups of 32 weights per
main-loop trip, warps per program: the winners of a tile sweep at M = 1 and 4, kept few
because each config costs seconds of compile per bucket on a cold start."""
W4A8_STAGES = (1, 2)
W4A8_PREFETCH = (False, True)
W4A16_TILES = ((64, 256, 4), (128, 256, 8), (64, 128, 4))
"""(BLOCK_N, BLOCK_K, num_warps): one warp group per 64 weight rows (the tensor-core
instruction's M): the two whole-super-block tiles that placed in a tile sweep, and a
half-super-block tile that halves the shared memory a stage (docs/decisions.md)."""
BALANCE_ROWS = min(block_n for block_n, _, _ in W4A16_TILES)
"""Weight rows of the tile a balanced grid counts programs in: the W4A16 space's narrowest
BLOCK_N."""
BALANCE_COLUMNS = max(block_n for block_n, _, _ in W4A16_TILES)
"""Short columns come in multiples of the space's widest BLOCK_N, so that they are whole tiles
under every config."""
W4A16_STAGES = (2, 3)
W4A16_TMA_STAGES = (2,)
"""The depths at which the W4A16 kernel copies its activation tile by TMA (``TMA_ACTIVATIONS``)
rather than by pointers. Three stages keep pointer copies: there the descriptor's barriers
cost the (64, 128, 4) program its fourth slot on an SM, and Triton's pipeline gave wrong tiles
wherever three programs with 64-row dots shared an SM (docs/decisions.md)."""
W4A16_REGISTER_CAPS = {(64, 128, 4, 2): 96}
"""(BLOCK_N, BLOCK_K, num_warps, stages) -> a register cap (``maxnreg``) that the config is
also tried with. Copying activations by TMA leaves the (64, 128, 4) two-stage program 107
registers; capped at 96 it fits five programs an SM instead of four, which puts
39936x6656's 624 tiles in one wave."""


def balanced_short_columns(n: int, split_k: int, sms: Optional[int]) -> int:
    """The columns at the start of N whose tiles a balanced grid splits ``split_k - 1`` ways
    (``split_k.split_program``), so that ``split_k``'s programs of ``BALANCE_ROWS`` rows fill
    ``sms`` SMs evenly: where they number ``p * sms + e``, about ``e`` tiles (a whole count of
    ``BALANCE_COLUMNS``) each give up a program and every SM holds ``p``, one of them longer.
    Raises ``InvalidLaunchParam`` where ``split_k`` has no such grid. Example: 6656x4096 at
    split 4 on 132 SMs is 416 programs, 20 SMs holding four and the rest three; balanced,
    20 tiles take 3 splits and every SM holds three."""
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


DEFAULT_TILE_ROWS = {"w4a8": 16, "w4a16": 64}
"""Weight rows per program the default launch rule counts tiles in: the most common tuned
BLOCK_N of each family (the Triton autotuner still picks the tile at the rule's split)."""
DEFAULT_MIN_SPLIT_K = 1024
"""The least K a split is left by the default launch rule: shorter splits pay the reduction's
extra launch and partial-sum traffic for too little of the main loop."""
DEFAULT_WAVES = {"w4a8": 1.0, "w4a16": 1.9}
"""Programs per SM the default launch rule asks for: W4A8 programs are one weight stream each,
and one an SM reads at the memory's rate; W4A16 programs share an SM two or more at a time,
and timed on an H200 (4096 x 4096 and 14336 x 4096, M = 8-64) the split nearest two an SM was
within 7 % of the best there."""
DEFAULT_PREQUANTIZE_WEIGHTS = 32 * 2**20
"""At M = 2 the default launch quantizes activations in a kernel of their own only for weights
of at least this many elements (timed on an H200: 14336 x 4096 gains, 4096 x 4096 loses); from
M = 3 on it always does."""


EAGER_PROGRAM_WEIGHTS = 64 * 4096
"""The most weights one program of an unsplit launch (``DEFAULT_TILE_ROWS`` rows by the
stored K) may stream for an eager call to run as one launch (``eager_one_launch``). On an
H100 an eager call costs the host about 19 µs; 64 programs of 64 rows by 4096 ran unsplit
within that (4096 x 4096, M = 16), 64 by 14336 took 55 µs, twice their split launch."""


def eager_one_launch(k: int, family: str) -> bool:
    """Whether an eager call of this K runs as one launch, however few programs that makes:
    where an unsplit program is short (``EAGER_PROGRAM_WEIGHTS``), the GPU finishes it within
    the host time of the call, while each further launch (a reduction, a separate activation
    quantization) adds host time to every call."""
    return stored_k(k) * DEFAULT_TILE_ROWS[family] <= EAGER_PROGRAM_WEIGHTS


def default_split_k(n: int, k: int, family: str, candidates: Sequence[int], sms: Optional[int]) -> int:
    """The split-K an untuned launch runs with: the smallest candidate whose programs
    (``DEFAULT_TILE_ROWS`` a tile) number ``DEFAULT_WAVES`` an SM, without a split shorter than
    ``DEFAULT_MIN_SPLIT_K`` (past that, the largest that keeps it). Where the SM count is not
    known (no CUDA device), 1."""
    if sms is None:
        return 1
    tiles = triton.cdiv(n, DEFAULT_TILE_ROWS[family])
    longest = max(1, stored_k(k) // DEFAULT_MIN_SPLIT_K)
    chosen = 1
    for split in sorted(candidates):
        if split > longest:
            break
        chosen = split
        if tiles * split >= DEFAULT_WAVES[family] * sms:
            break
    return chosen


def default_prequantize(m_bucket: int, n: int, k: int) -> bool:
    """Whether an untuned W4A8 launch quantizes its activations in a kernel of their own
    (``DEFAULT_PREQUANTIZE_WEIGHTS``)."""
    return m_bucket >= 3 or (m_bucket == 2 and n * k >= DEFAULT_PREQUANTIZE_WEIGHTS)


def w4a16_batch_rows(bucket: int, m) -> int:
    """The activation rows the W4A16 kernel multiplies for M rows at ``bucket``: three
    quarters of bucket 64 (48: a dot of 32 rows and one of 16) where M is static and at most
    48, else the whole bucket. A symbolic M, however bounded, gets the whole bucket, so that
    one compiled binary serves its range (``m`` None: a launch for a symbolic M). Bucket 32
    keeps one dot: its quarter (8 rows) would compile to ``mma.sync``, whose operand layout
    lengthens the loop."""
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
        return max(1, triton.cdiv(triton.cdiv(k, config.kwargs.get("BLOCK_K", SUPER_BLOCK)), split_k))
    groups = triton.cdiv(stored_k(k) // SUPER_BLOCK, split_k) * (SUPER_BLOCK // GROUP_SIZE)
    return max(1, triton.cdiv(groups, config.kwargs["GROUPS"]))


def prune_int4_configs(configs: Sequence[triton.Config], named_args: dict, **kwargs) -> list:
    """Triton ``early_config_prune``: keep configs whose pipeline depth fits the main loop
    (``STAGES <= trips``); if none does, the one with the fewest stages."""
    args = {**named_args, **kwargs}
    k, split_k = args["K"], args.get("split_k", 1)
    kept = [c for c in configs if c.kwargs.get("STAGES", 1) <= main_loop_trips(c, k, split_k)]
    return kept or [min(configs, key=lambda c: c.kwargs.get("STAGES", 1))]
