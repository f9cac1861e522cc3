"""The INT4 GEMM op family: ``torch.ops.coalesced_int4.int4_quantized_gemm_m{b}``.

``(x (M, K) bf16, qdata, scale, scale_step, zero_point, zero_point_step, group_size) ->
(M, N) bf16`` for M within the bucket b. Buckets 1-4 run the W4A8 kernel (``w4a8.py``),
8-64 the W4A16 kernel (``w4a16.py``). Each bucket has one ``triton.autotune`` object
(``BUCKET_KERNELS[b]``, key N, K, split_k, and for W4A16 its grid and the rows it multiplies) over
``int4_autotune_configs(b)``, pruned by ``prune_int4_configs``, whose picks persist across
processes (``autotune/persistent.py``; each bucket's under its own name).
The split-K, and for W4A8 whether the activations are quantized by a kernel of their own
first (``prequantize``), for W4A16 whether the grid is balanced, are launch parameters:
given, or a pick (timed per shape while tuning is on, or restored from the pick store), or
the default rule (``_default_w4a8``, ``_default_w4a16``: ``configs.default_split_k``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from coalesced_int4.kernels.autotune.do_bench import autotune_do_bench
from coalesced_int4.kernels.autotune.launch_params import autotune_launch_param
from coalesced_int4.kernels.autotune.tuner import persistent_autotune, single_config
from coalesced_int4.kernels.gemm.split_k import _splitk_reduce_kernel
from coalesced_int4.kernels.gemm.w4a8 import _quantize_kernel, _w4a8_kernel, launch_w4a8
from coalesced_int4.kernels.gemm.w4a16 import _w4a16_kernel, launch_w4a16
from coalesced_int4.kernels.ops.configs import (
    BALANCED_CANDIDATES,
    PREQUANTIZE_CANDIDATES,
    SPLIT_K_CANDIDATES,
    TILE_SPLIT_K_CANDIDATES,
    default_prequantize,
    default_split_k,
    eager_one_launch,
    int4_autotune_configs,
    prune_int4_configs,
)
from coalesced_int4.kernels.ops.family import INTERPRETER, QuantizedGemmFamily
from coalesced_int4.kernels.ops.validation import SUPPORTED_BUCKETS, W4A8_BUCKETS, check_split_k, unsupported_reason
from coalesced_int4.kernels.runtime.device import multiprocessors
from coalesced_int4.torch_internals import is_fake, set_wrap_triton_enabled

AUTOTUNE_KEY = ["N", "K", "split_k"]
W4A16_AUTOTUNE_KEY = AUTOTUNE_KEY + ["short_columns", "BATCH_ROWS"]
"""The W4A16 kernel's tile config is also picked per grid (``short_columns``: plain or
balanced) and per count of activation rows it multiplies (``configs.w4a16_batch_rows``)."""


def _jit_kernel(bucket: int):
    return _w4a8_kernel if bucket in W4A8_BUCKETS else _w4a16_kernel


def launched_kernels(bucket: int) -> tuple:
    """Every Triton kernel a launch of ``bucket`` may run: its GEMM, the split-K reduction
    and, for W4A8, the activation quantization."""
    return (_jit_kernel(bucket), _splitk_reduce_kernel, *((_quantize_kernel,) if bucket in W4A8_BUCKETS else ()))


def _autotuner(bucket: int, configs) -> triton.runtime.Autotuner:
    return persistent_autotune(
        configs=configs, key=AUTOTUNE_KEY if bucket in W4A8_BUCKETS else W4A16_AUTOTUNE_KEY,
        do_bench=autotune_do_bench,
        prune_configs_by={"early_config_prune": prune_int4_configs},
        name=f"int4_gemm_bucket{bucket}",
    )(_jit_kernel(bucket))


BUCKET_KERNELS = {b: _autotuner(b, int4_autotune_configs(b)) for b in SUPPORTED_BUCKETS}
"""The autotuner of each bucket (looked up at launch time, so tests may patch entries)."""


def _run(family_launch, bucket, x, weights, split_k: int, config: Optional[triton.Config], **options):
    """Check the split, pick the kernel (the bucket's autotuner, or ``config`` alone), launch."""
    k = x.shape[1]
    check_split_k(split_k, k)
    if config is None and INTERPRETER:
        # The interpreter cannot time configs: run the first one the prune rule keeps (the
        # autotuner's own objects, so its single-config kernel is built once).
        config = prune_int4_configs(BUCKET_KERNELS[bucket].configs, {"K": k, "split_k": split_k})[0]
    kernel = BUCKET_KERNELS[bucket] if config is None else single_config(BUCKET_KERNELS[bucket], config)
    return family_launch(bucket, x, weights, split_k=split_k, kernel=kernel, **options)


def _default_w4a8(bucket, x, qdata, *_) -> dict:
    """An untuned W4A8 launch: the default split and activation quantization."""
    n, k = qdata.shape[0], x.shape[1]
    split_k = default_split_k(n, k, "w4a8", SPLIT_K_CANDIDATES, multiprocessors(x.device))
    return {"split_k": split_k, "prequantize": default_prequantize(bucket, n, k)}


def _default_w4a16(bucket, x, qdata, *_) -> dict:
    """An untuned W4A16 launch: the default split on the plain grid."""
    split_k = default_split_k(qdata.shape[0], x.shape[1], "w4a16", TILE_SPLIT_K_CANDIDATES,
                              multiprocessors(x.device))
    return {"split_k": split_k, "balanced": False}


# One launcher per family, so each times its own split candidates.
@autotune_launch_param(split_k=SPLIT_K_CANDIDATES, prequantize=PREQUANTIZE_CANDIDATES, default=_default_w4a8)
def _launch_w4a8(bucket, x, qdata, scale, scale_step, zero_point, zero_point_step,
                 dynamic_m: bool, *, split_k: int, prequantize: bool,
                 config: Optional[triton.Config] = None):
    weights = (qdata, scale, scale_step, zero_point, zero_point_step)
    return _run(launch_w4a8, bucket, x, weights, split_k, config, prequantize=prequantize)


@autotune_launch_param(split_k=TILE_SPLIT_K_CANDIDATES, balanced=BALANCED_CANDIDATES, default=_default_w4a16)
def _launch_w4a16(bucket, x, qdata, scale, scale_step, zero_point, zero_point_step,
                  dynamic_m: bool, *, split_k: int, balanced: bool, config: Optional[triton.Config] = None):
    weights = (qdata, scale, scale_step, zero_point, zero_point_step)
    return _run(launch_w4a16, bucket, x, weights, split_k, config, balanced=balanced, dynamic_m=dynamic_m)


def launch(bucket: int, x, qdata, scale, scale_step, zero_point, zero_point_step,
           group_size: int, **launch_params) -> torch.Tensor:
    """Run bucket ``bucket`` (no validation: the op validates first). ``launch_params``:
    ``split_k=``, ``prequantize=`` (buckets 1-4), ``balanced=`` (buckets 8-64) and
    ``config=`` (one triton.Config instead of autotuning)."""
    # Whether M is symbolic is read here, before timing swaps in concrete stand-ins, and
    # passed positionally so dynamic and static M are timed and cached apart.
    dynamic_m = not isinstance(x.shape[0], int)
    launcher = _launcher(bucket)
    # Tracing (fake inputs) records the launches through wrap_triton; eager launches call
    # the autotuners themselves, which keep their picks (wrap_triton's eager path would tune
    # a fresh copy on every call, and could not be captured in a CUDA graph).
    with set_wrap_triton_enabled(is_fake(x)):
        return launcher(bucket, x, qdata, scale, scale_step, zero_point, zero_point_step,
                        dynamic_m, **launch_params)


def _launcher(bucket: int):
    return _launch_w4a8 if bucket in W4A8_BUCKETS else _launch_w4a16


def decided_launch(bucket: int, x, qdata, scale, scale_step, zero_point, zero_point_step) -> dict:
    """The launch parameters an eager ``launch`` of these arguments (a static M) runs with."""
    return _launcher(bucket).decided_values(bucket, x, qdata, scale, scale_step, zero_point, zero_point_step, False)


def eager_launch(bucket: int, x, qdata, scale, scale_step, zero_point, zero_point_step) -> dict:
    """The launch parameters an eager call of these arguments runs with: one launch (no split,
    W4A8 activations quantized inside the GEMM) where its unsplit programs are short
    (``configs.eager_one_launch``), else ``decided_launch``'s."""
    family = "w4a8" if bucket in W4A8_BUCKETS else "w4a16"
    if eager_one_launch(x.shape[1], family):
        return {"split_k": 1, "prequantize": False} if family == "w4a8" else {"split_k": 1, "balanced": False}
    return decided_launch(bucket, x, qdata, scale, scale_step, zero_point, zero_point_step)


def launch_decided(bucket: int, x, weights, launch_params: dict) -> torch.Tensor:
    """An eager ``launch`` of a static M with ``decided_launch``'s parameters, deciding nothing
    again (no validation either: the caller validated these arguments' kind)."""
    with set_wrap_triton_enabled(False):
        return _launcher(bucket).__wrapped__(bucket, x, *weights, False, **launch_params)


def _fake(bucket: int, x, qdata, *_):
    return torch.empty((x.shape[0], qdata.shape[0]), dtype=torch.bfloat16, device=x.device)


def _prototype(
    x: torch.Tensor,
    qdata: torch.Tensor,
    scale: torch.Tensor,
    scale_step: torch.Tensor,
    zero_point: torch.Tensor,
    zero_point_step: torch.Tensor,
    group_size: int,
) -> torch.Tensor:
    raise NotImplementedError


INT4_QUANTIZED_GEMM = QuantizedGemmFamily(
    "int4_quantized_gemm", SUPPORTED_BUCKETS, _prototype, launch, _fake, unsupported_reason, launched_kernels
)
