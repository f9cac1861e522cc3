"""``F.linear(x, w)`` with ``w`` a ``CudaCoalescedInt4Tensor``.

1. ``x`` is checked as dense ``F.linear`` would (``check_activation``) and flattened to
   ``(M, K)``.
2. If the kernels can run on it (``can_launch_triton``), the smallest bucket of
   ``INT4_QUANTIZED_GEMM`` whose op supports the arguments is called: a static ``M`` within
   ``[1, bucket]``, or a symbolic ``M`` provably so. In plain eager use (a real CUDA input,
   not compiling, no dispatch mode watching) the choice is made once per weight and
   activation signature (shape, dtype, device, strides, storage offset) with the launch
   parameters it runs with (``EagerPlan``, ``int4_gemm.eager_launch``: one launch wherever
   the GPU runs it unsplit within the host time of a call, since each further launch costs
   every call host time; else the pick or the default rule); its first call is recorded and
   later calls replay those launches (``recorded_call``: no op dispatch, second validation,
   launch decision or Triton launcher in the way). A CUDA graph captured from eager calls
   holds those same launches, so it gives eager's bits. The plan's launch parameters are
   decided, and its call recorded, again once tuning changes a pick. While tuning is on,
   calls take the op.
3. Otherwise the weight is dequantized exactly (fp32), rounded once to the activation dtype
   and multiplied with ``F.linear``, in chunks of 32,768 rows above 65,536 rows so a huge
   ``lm_head`` never builds a multi-GiB dense temporary. (Rounding every step of the
   dequantization to bf16, as the kernels must, has several times the weight error.)
4. The bias is added in the activation dtype; the output has shape ``(*x.shape[:-1], N)``.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Optional

import torch
import torch.nn.functional as F

from coalesced_int4.kernels.autotune.launch_params import generation, tuning_stats
from coalesced_int4.kernels.ops import int4_gemm
from coalesced_int4.kernels.ops.int4_gemm import INT4_QUANTIZED_GEMM
from coalesced_int4.kernels.runtime import recorded_call
from coalesced_int4.quantize import PackedInt4, dequantize_packed
from coalesced_int4.torch_internals import dispatch_mode_active, is_fake

DEQUANT_N_THRESHOLD = 65_536
DEQUANT_N_CHUNK = 32_768


def quantized_linear(
    x: torch.Tensor, weight, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    if _plain_eager(x):
        out = _eager_linear(x, weight)
    else:
        n, k = weight.shape
        check_activation(x, k)
        x_2d = x.reshape(-1, k)
        weight_args = (*weight.packed, weight.group_size)
        bucket = select_bucket(x_2d, weight_args)
        if bucket is None:
            out = dequant_linear(x_2d, weight.packed, k)
        else:
            out = INT4_QUANTIZED_GEMM.op(bucket)(x_2d, *weight_args)
        out = out.reshape(*x.shape[:-1], n)
    if bias is not None:
        out = out + bias
    return out


@dataclasses.dataclass
class EagerPlan:
    """How eager calls of one weight on one activation signature run: the bucket the rule
    chose (None: the fallback), the launch parameters decided for it, the pick generation
    they were decided at (``launch_params.generation``) and, once a call has been recorded,
    its replay (``recorded_call``)."""

    bucket: Optional[int]
    launch_params: Optional[dict]
    generation: int
    recordings: int = 0
    """Calls recorded so far: a call whose autotuner still timed its configs (it launches
    them all) records nothing replayable, the next one does."""
    replay: Optional[recorded_call.RecordedCall] = None


RECORDINGS = 2
"""Calls of a plan recorded at most, until one gives a replay."""


class _WeightPlans:
    """A weight's shape (read once: a tensor subclass's ``shape`` costs a ``__torch_function__``
    call) and its plans, by activation signature."""

    __slots__ = ("n", "k", "plans")

    def __init__(self, weight):
        self.n, self.k = weight.shape
        self.plans = {}


class _PlansByWeight:
    """weight -> ``_WeightPlans``, by identity; an entry goes with its weight. (torch's
    ``WeakIdKeyDictionary`` builds a weak reference on every lookup, a microsecond of every
    eager call.)"""

    def __init__(self):
        self._entries = {}  # id(weight) -> (weak reference to the weight, its plans)

    def get(self, weight) -> Optional[_WeightPlans]:
        item = self._entries.get(id(weight))
        return item[1] if item is not None and item[0]() is weight else None

    def __getitem__(self, weight) -> _WeightPlans:
        entry = self.get(weight)
        if entry is None:
            raise KeyError(f"no eager plans for this {type(weight).__name__}")
        return entry

    def add(self, weight) -> _WeightPlans:
        key, entries = id(weight), self._entries

        def forget(reference):  # the weight is going: its entry too, unless a newer one took its id
            if entries.get(key, (None,))[0] is reference:
                del entries[key]

        entries[key] = (weakref.ref(weight, forget), _WeightPlans(weight))
        return entries[key][1]


_EAGER_PLANS = _PlansByWeight()


def _plain_eager(x: torch.Tensor) -> bool:
    """A plain CUDA tensor (not fake, functional or another subclass), not compiling or
    tracing, no dispatch mode watching, tuning off."""
    return (type(x) is torch.Tensor and x.is_cuda and not torch.compiler.is_compiling()
            and not dispatch_mode_active() and tuning_stats() is None)


def _eager_linear(x: torch.Tensor, weight) -> torch.Tensor:
    """``quantized_linear`` of a plain eager ``x`` of any rank: the plan of ``x``'s signature
    (shape, dtype, device, strides, storage offset) decided once, its replay given ``x``
    itself and returning the output in its final shape (no reshape on either side)."""
    entry = _EAGER_PLANS.get(weight) or _EAGER_PLANS.add(weight)
    signature = (x.shape, x.dtype, x.device, x.stride(), x.storage_offset())
    plan = entry.plans.get(signature)
    packed = weight.packed
    if plan is not None and plan.replay is not None and plan.generation == generation():
        out = plan.replay(x, packed)
        if out is not None:
            return out
    if plan is None:  # the rule, once per signature
        check_activation(x, entry.k)
        x_2d = x.reshape(-1, entry.k)
        bucket = select_bucket(x_2d, (*packed, weight.group_size))
        launch_params = None if bucket is None else int4_gemm.eager_launch(bucket, x_2d, *packed)
        plan = entry.plans[signature] = EagerPlan(bucket, launch_params, generation())
    else:
        x_2d = x.reshape(-1, entry.k)
        if plan.bucket is not None and plan.generation != generation():  # a new pick
            plan = entry.plans[signature] = EagerPlan(
                plan.bucket, int4_gemm.eager_launch(plan.bucket, x_2d, *packed), generation())
    out_shape = (*x.shape[:-1], entry.n)
    if plan.bucket is None:
        return dequant_linear(x_2d, packed, entry.k).reshape(out_shape)

    def launch():
        return int4_gemm.launch_decided(plan.bucket, x_2d, packed, plan.launch_params)

    if plan.replay is None and plan.recordings < RECORDINGS:
        plan.recordings += 1
        out, plan.replay = recorded_call.record(x, packed, launch, launched_x=x_2d, result_shape=out_shape)
    else:
        out = launch()
    return out.reshape(out_shape)


def check_activation(x: torch.Tensor, k: int) -> None:
    """Raise where dense ``F.linear`` would: a 0-D input, a non-floating-point input (whose
    product with a dequantized weight would be cast to int), or one whose last dimension is not
    the weight's K (even with no rows)."""
    if x.dim() == 0:
        raise RuntimeError("F.linear with a quantized weight: the input is 0-D; it needs at least one dimension (K)")
    if not x.dtype.is_floating_point:
        raise RuntimeError(f"F.linear with a quantized weight: the input is {x.dtype}; it must be floating point "
                           f"(bf16 runs the INT4 kernels)")
    if x.shape[-1] != k:
        raise RuntimeError(f"F.linear with a quantized weight: the input's last dimension is {x.shape[-1]} but the "
                           f"weight's K (in_features) is {k}")


def can_launch_triton(x: torch.Tensor) -> bool:
    """A real CUDA activation, or a fake one while exporting (the exported program runs the
    kernels wherever it is loaded, whatever device the example inputs were on). A CPU model
    under ``torch.compile`` keeps the fallback, which Inductor compiles for the CPU."""
    return x.is_cuda or (is_fake(x) and torch.compiler.is_exporting())


def select_bucket(x_2d: torch.Tensor, weight_args: tuple) -> Optional[int]:
    """The smallest bucket whose op takes these arguments, or None."""
    if not can_launch_triton(x_2d):
        return None
    for bucket in INT4_QUANTIZED_GEMM.buckets:
        if INT4_QUANTIZED_GEMM.supports(bucket, x_2d, *weight_args):
            return bucket
    return None


def dequant_linear(x_2d: torch.Tensor, packed: PackedInt4, k: int) -> torch.Tensor:
    """``F.linear(x, w.dequantize(x.dtype))`` for the weight's first ``k`` columns (its
    logical K; the rest is padding), chunked along N for very tall weights."""
    n = packed.qdata.shape[0]

    def rows(start: int, end: int) -> torch.Tensor:
        part = PackedInt4(*(t[start:end] for t in packed))
        return F.linear(x_2d, dequantize_packed(part, torch.float32)[:, :k].to(x_2d.dtype))

    if n <= DEQUANT_N_THRESHOLD:
        return rows(0, n)
    return torch.cat(
        [rows(s, min(s + DEQUANT_N_CHUNK, n)) for s in range(0, n, DEQUANT_N_CHUNK)],
        dim=-1,
    )
