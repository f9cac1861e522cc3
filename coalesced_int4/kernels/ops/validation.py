"""Which arguments each INT4 GEMM bucket op takes, written once.

``unsupported_reason`` is the one argument rule: dispatch asks it before choosing a bucket,
each op checks it, and the tests call it; it includes each family's least compute capability,
so a GPU the kernels do not compile for takes the other family or the fallback.
``check_split_k`` is the one split-K legality rule.
"""

from __future__ import annotations

from typing import Optional

import torch

from coalesced_int4.kernels.autotune.launch_params import InvalidLaunchParam
from coalesced_int4.kernels.runtime.device import compute_capability
from coalesced_int4.quantize import GROUP_SIZE, SUPER_BLOCK, stored_k
from coalesced_int4.torch_internals import is_fake, statically_known_true

SUPPORTED_BUCKETS = (1, 2, 3, 4, 8, 16, 32, 64)
W4A8_BUCKETS = (1, 2, 3, 4)
"""Decode buckets: activations quantized to int8, dot products on dp4a."""
W4A16_BUCKETS = (8, 16, 32, 64)
"""Small-batch buckets: weights decoded to bf16, dot products on tensor cores."""
MIN_CAPABILITY = {**{b: (8, 0) for b in W4A8_BUCKETS}, **{b: (9, 0) for b in W4A16_BUCKETS}}
"""The least compute capability each bucket's kernel compiles for. The W4A16 decode's inline
PTX (``cvt`` to bf16 pairs from u32, ``mul.bf16x2``) and its TMA activation copies exist on
sm_90 only; the W4A8 kernel's dp4a and fp32 math compile for sm_80."""

CODE_WORD = torch.int32
"""The kernels read the byte-wide codes (qdata, and W4A16 the scale and zero codes) as words of
this dtype: each row holds whole words since the stored K is a multiple of 256, and each tensor
must start on a word."""

TMA_ALIGNMENT = 16
"""Bytes: the tensor memory accelerator reads a tensor that starts on this boundary (its rows,
K bf16 with K % 32 == 0, always do)."""

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
    if k % GROUP_SIZE:
        return f"K must be a multiple of {GROUP_SIZE}, got {k}"
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
    capability = compute_capability(x.device)
    if capability is not None and capability < MIN_CAPABILITY[bucket]:
        family = "W4A8" if bucket in W4A8_BUCKETS else "W4A16"
        return (f"the {family} kernels need compute capability {'.'.join(map(str, MIN_CAPABILITY[bucket]))} or "
                f"newer, the device has {'.'.join(map(str, capability))}")
    n, stored = qdata.shape[0], stored_k(k)
    if qdata.shape[1] * 2 != stored:
        return f"qdata must hold K={k} in {stored // 2} bytes a row (K padded to {stored}), got {qdata.shape[1]}"
    if tuple(scale.shape) != (n, stored // GROUP_SIZE) or tuple(zero_point.shape) != (n, stored // GROUP_SIZE):
        return f"scale/zero shape does not match [N, {stored}/32]"
    if tuple(scale_step.shape) != (n, stored // SUPER_BLOCK) or tuple(zero_point_step.shape) != (
        n,
        stored // SUPER_BLOCK,
    ):
        return f"step shape does not match [N, {stored}/256]"
    return None


def check_split_k(split_k: int, k: int, unit: int = SUPER_BLOCK) -> None:
    """A split needs at least one super-block of the stored K: ``1 <= split_k <= stored_k(K) // 256``."""
    if not 1 <= split_k <= stored_k(k) // unit:
        raise InvalidLaunchParam(f"split_k={split_k} needs K >= {split_k * unit}, got K={k}")

