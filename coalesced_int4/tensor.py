"""``CudaCoalescedInt4Tensor``: an ``(N, K)`` weight stored in the coalesced INT4 format.

The tensor is a torchao ``TorchAOBaseTensor`` wrapper whose dtype is the activation dtype
(bf16 by default) and whose data are the five tensors of :class:`~coalesced_int4.quantize.PackedInt4`
(layout in docs/format.md). It is an inference format: ``requires_grad`` is always False.

Ops it handles (the table below is complete):

* ``F.linear`` / ``aten.linear``: the bucketed INT4 GEMM or the dequant fallback
  (``coalesced_int4.dispatch``);
* ``detach``, ``alias``, ``clone``, ``contiguous``, ``_to_copy`` (``.to(device)``), ``copy_``
  between tensors of equal metadata: applied to the five stored tensors (torchao's defaults);
* ``slice`` (so ``narrow`` too), ``split`` and ``split_with_sizes`` (so ``chunk`` too) along
  N at any row, and along K from a multiple of 256 to a multiple of 256 or K's end, returning
  views; ``cat`` along N, or along K where every part but the last holds whole super-blocks;
  ``view`` as its own shape; ``t``: a ``TransposedInt4Weight`` (``transposed.py``), which
  ``mm`` runs as the linear. These are what DTensor sharding (tensor parallelism) asks of a
  weight.

Any other op raises ``NotImplementedError`` naming it and pointing at ``dequantize()``.
"""

from __future__ import annotations

import hashlib
import math
import operator
from typing import List, Optional

import torch
import torch.nn.functional as F
from torchao.utils import TorchAOBaseTensor, fill_defaults

from coalesced_int4.dispatch import quantized_linear
from coalesced_int4.quantize import (
    GROUP_SIZE,
    QPARAMS,
    SUPER_BLOCK,
    PackedInt4,
    dequantize_packed,
    encode_superscale,
    quantize_weight,
    stored_k,
)
from coalesced_int4.source_hash import source_hash
from coalesced_int4.torch_internals import c10d_functional, return_and_correct_aliasing

__all__ = ["CudaCoalescedInt4Tensor"]

aten = torch.ops.aten


class CudaCoalescedInt4Tensor(TorchAOBaseTensor):
    """INT4 codes with per-32 uint8 scale/zero codes and per-256 fp16 steps.

    ``w[n, k] = (q[n,k] - zero_point[n,g] * zero_point_step[n,b]) * (scale[n,g] * scale_step[n,b])``
    with ``g = k // 32`` and ``b = k // 256``. The shape is the logical ``(N, K)``; the data
    hold ``stored_k(K)`` columns, the padding past K zero.
    """

    ACTIVATION_DTYPES = (torch.bfloat16,)
    """The activation dtypes a quantized weight may declare: the dtype its kernels take."""

    tensor_data_names = list(PackedInt4._fields)
    tensor_attribute_names = ["block_size", "shape"]
    optional_tensor_attribute_names = ["activation_dtype"]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # F.linear, which every quantized nn.Linear calls, goes straight to its handler (every
        # eager call pays this lookup); everything else through the torch-function table.
        if func is F.linear:
            return _linear(func, types, args, kwargs or {})
        return super().__torch_function__(func, types, args, kwargs)

    def __new__(
        cls,
        qdata: torch.Tensor,
        scale: torch.Tensor,
        scale_step: torch.Tensor,
        zero_point: torch.Tensor,
        zero_point_step: torch.Tensor,
        block_size: List[int],
        shape: torch.Size,
        activation_dtype: Optional[torch.dtype] = None,
    ):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            shape,
            device=qdata.device,
            dtype=activation_dtype or torch.bfloat16,
            requires_grad=False,
        )

    def __init__(
        self,
        qdata: torch.Tensor,
        scale: torch.Tensor,
        scale_step: torch.Tensor,
        zero_point: torch.Tensor,
        zero_point_step: torch.Tensor,
        block_size: List[int],
        shape: torch.Size,
        activation_dtype: Optional[torch.dtype] = None,
    ):
        super().__init__()
        self.qdata = qdata
        self.scale = scale
        self.scale_step = scale_step
        self.zero_point = zero_point
        self.zero_point_step = zero_point_step
        self.block_size = list(block_size)
        self.activation_dtype = activation_dtype or torch.bfloat16

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_packed(
        cls, packed: PackedInt4, activation_dtype: Optional[torch.dtype] = None, k: Optional[int] = None
    ) -> "CudaCoalescedInt4Tensor":
        """The tensor of ``packed``, whose logical K is ``k`` (default: every stored column)."""
        n, k_half = packed.qdata.shape
        k = 2 * k_half if k is None else k
        if stored_k(k) != 2 * k_half or k % GROUP_SIZE:
            raise ValueError(f"K={k} is not stored in {2 * k_half} columns: K must be a multiple of {GROUP_SIZE} "
                             f"stored padded to whole super-blocks of {SUPER_BLOCK}")
        return cls(
            *packed,
            block_size=[1, GROUP_SIZE],
            shape=torch.Size((n, k)),
            activation_dtype=activation_dtype,
        )

    @classmethod
    def from_stored(cls, qdata, scale, scale_step, zero_point, zero_point_step, block_size: List[int],
                    shape, activation_dtype: Optional[torch.dtype] = None) -> "CudaCoalescedInt4Tensor":
        """The tensor of a checkpoint's stored tensors and metadata (how torchao's safetensors
        loading, and so transformers', builds it). transformers' tensor-parallel loading hands
        each rank its shard of every stored tensor, sliced along the weight's sharded dimension,
        with the whole weight's metadata: the shape is then the shard's, read from the stored
        tensors. Raises where they disagree with each other (a shard of K that splits a
        super-block), or where a shard of K cannot be told from padding (K is not a multiple of
        256, so the last shard holds the padding)."""
        stored = PackedInt4(qdata, scale, scale_step, zero_point, zero_point_step)
        n, k = shape
        rows = {t.shape[0] for t in stored}
        columns = {2 * qdata.shape[1], GROUP_SIZE * scale.shape[1], GROUP_SIZE * zero_point.shape[1],
                   SUPER_BLOCK * scale_step.shape[1], SUPER_BLOCK * zero_point_step.shape[1]}
        if len(rows) != 1 or len(columns) != 1:
            raise ValueError(
                f"the stored tensors of a ({n}, {k}) quantized weight disagree on its rows {sorted(rows)} or "
                f"columns {sorted(columns)}: a shard of K must hold whole super-blocks of {SUPER_BLOCK}"
            )
        (local_n,), (local_stored_k,) = rows, columns
        if local_stored_k != stored_k(k):
            if local_stored_k > stored_k(k) or k % SUPER_BLOCK:
                raise ValueError(
                    f"a ({n}, {k}) quantized weight's stored tensors hold {local_stored_k} columns: a shard of K "
                    f"is taken only where K is a multiple of {SUPER_BLOCK} (the last shard would hold the padding)"
                )
            k = local_stored_k
        return cls(*stored, block_size=block_size, shape=torch.Size((local_n, k)), activation_dtype=activation_dtype)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        group_size: int = GROUP_SIZE,
        qparams: str = QPARAMS[0],
        activation_dtype: Optional[torch.dtype] = None,
    ) -> "CudaCoalescedInt4Tensor":
        """Quantize a dense 2-D float weight (any device; the result stays there); ``qparams``:
        how scales and zero points are chosen (``quantize.QPARAMS``)."""
        return cls.from_packed(
            quantize_weight(weight.detach(), group_size, qparams), activation_dtype, k=weight.shape[1]
        )

    @classmethod
    def from_int4_tensor(cls, weight) -> "CudaCoalescedInt4Tensor":
        """Re-encode a torchao ``Int4Tensor`` whose dequantization is
        ``scale * (q - zero_point)`` with integer zero points in [0, 15] (the asymmetric
        min_max convention): transpose scale and zero to ``(N, K/32)``, superscale-encode
        both, keep ``qdata`` byte for byte."""
        n, k = weight.shape
        group_size = int(weight.block_size[-1])
        if weight.qdata.dim() != 2 or group_size != GROUP_SIZE or k % SUPER_BLOCK:
            raise ValueError(
                "from_int4_tensor needs a 2-D Int4Tensor with block_size [1, 32] and K a "
                f"multiple of {SUPER_BLOCK}, got shape {tuple(weight.shape)} and "
                f"block_size {list(weight.block_size)}"
            )
        zero = weight.zero_point.float()
        if ((zero != zero.round()) | (zero < 0) | (zero > 15)).any():
            raise ValueError(
                "from_int4_tensor needs integer zero points in [0, 15] "
                "(dequantization scale * (q - zero_point)); this Int4Tensor uses another "
                "convention"
            )
        scale_codes, scale_step = encode_superscale(weight.scale.t())
        zero_codes, zero_step = encode_superscale(weight.zero_point.t())
        packed = PackedInt4(
            weight.qdata.contiguous(), scale_codes, scale_step, zero_codes, zero_step
        )
        return cls.from_packed(packed)

    # ------------------------------------------------------------------ views of the data
    @property
    def packed(self) -> PackedInt4:
        return PackedInt4._make(_STORED_TENSORS(self))

    @property
    def group_size(self) -> int:
        return self.block_size[-1]

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The dense ``(N, K)`` weight, computed exactly in fp32 and cast to ``dtype``."""
        return dequantize_packed(self.packed, torch.float32)[:, : self.shape[1]].to(dtype)

    def _stable_hash_for_caching(self) -> str:
        """Cache identity for torch.compile's AOTAutograd cache where torch asks for one (2.13
        does; 2.11 pickles ``__getstate__`` instead): the metadata, not the data, and this
        package's source (``source.source_hash``). The cache keys a graph before the
        tensor's ops are traced, so without the source a graph compiled by another version
        of the package (another dispatch, another kernel) was served."""
        parts = [type(self).__qualname__, str(self.block_size), str(tuple(self.shape)),
                 str(self.activation_dtype), source_hash()]
        for t in self.packed:
            parts.append(f"{t.dtype}{tuple(t.shape)}{t.stride()}{t.storage_offset()}{t.device.type}")
        return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()

    def __getstate__(self) -> dict:
        """The pickled state: the attributes and this package's source hash. A torch without
        ``_stable_hash_for_caching`` (2.11) keys AOTAutograd's cache on this state instead;
        loading drops the hash again (``_setstate_without_source``). torch clears the
        unpicklable caches from the tensor's ``__dict__`` after taking the state, expecting
        the dict itself; this state is a copy, so they are cleared first."""
        self._clear_non_serializable_cached_data()
        return {**self.__dict__, _SOURCE_STATE: source_hash()}

    def _quantization_type(self) -> str:
        return (
            f"shape={tuple(self.shape)}, block_size={self.block_size}, "
            f"device={self.device}, activation_dtype={self.activation_dtype}"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._quantization_type()})"

    SUPPORTED_OPS = ("linear, detach, alias, clone, contiguous, _to_copy (.to), copy_, slice/narrow/split/chunk, "
                     "cat, view as its own shape, t")
    """What ``__torch_dispatch__``'s refusal lists."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch_from_table(cls, func, types, args, kwargs)


def dispatch_from_table(cls, func, types, args, kwargs):
    """Run ``func`` from the class's ``implements`` table, or raise naming it, the class's
    ``SUPPORTED_OPS`` and ``dequantize()``."""
    table = cls._ATEN_OP_TABLE[cls]
    if func not in table:
        raise NotImplementedError(f"{cls.__name__} does not implement {func}; supported: {cls.SUPPORTED_OPS}. "
                                  "Call .dequantize() for a dense tensor first.")
    return table[func](func, types, args, kwargs or {})


_SOURCE_STATE = "_coalesced_int4_source"
"""The key of the package's source hash in a pickled tensor's state."""
_torchao_setstate = CudaCoalescedInt4Tensor.__setstate__


def _setstate_without_source(self, state: dict) -> None:
    """torchao's ``__setstate__`` (installed on every subclass when it is created, hence
    replaced here rather than overridden in the class) on the state less the source hash,
    which belongs to the code that pickled it."""
    _torchao_setstate(self, {k: v for k, v in state.items() if k != _SOURCE_STATE})


CudaCoalescedInt4Tensor.__setstate__ = _setstate_without_source
_STORED_TENSORS = operator.attrgetter(*CudaCoalescedInt4Tensor.tensor_data_names)
"""A weight's stored tensors in order, read in one C call (``packed`` is read on every eager
call)."""

implements = CudaCoalescedInt4Tensor.implements
implements_torch_function = CudaCoalescedInt4Tensor.implements_torch_function


@implements(aten.linear.default)
@implements_torch_function([aten.linear, aten.linear.default])  # F.linear: __torch_function__
def _linear(func, types, args, kwargs):
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    return quantized_linear(args[0], args[1], bias)


def _with_tensors(weight: CudaCoalescedInt4Tensor, packed, shape) -> CudaCoalescedInt4Tensor:
    """A tensor of ``weight``'s kind (block size, activation dtype) on other stored tensors."""
    return CudaCoalescedInt4Tensor(*packed, block_size=weight.block_size, shape=torch.Size(shape),
                                   activation_dtype=weight.activation_dtype)


def _rows(weight: CudaCoalescedInt4Tensor, start: int, end: int) -> CudaCoalescedInt4Tensor:
    """Rows ``[start, end)`` (any range of N), a view."""
    return _with_tensors(weight, (t[start:end] for t in weight.packed), (end - start, weight.shape[1]))


def _columns(weight: CudaCoalescedInt4Tensor, start: int, end: int) -> CudaCoalescedInt4Tensor:
    """Columns ``[start, end)`` of K, a view: whole super-blocks, from a multiple of 256 to a
    multiple of 256 or K's end (the only ranges whose steps and padding the format holds)."""
    n, k = weight.shape
    if start % SUPER_BLOCK or (end % SUPER_BLOCK and end != k):
        raise NotImplementedError(
            f"{type(weight).__name__} takes K from a multiple of {SUPER_BLOCK} to a multiple of "
            f"{SUPER_BLOCK} or K's end, got [{start}, {end}) of K={k}"
        )

    def take(t: torch.Tensor) -> torch.Tensor:
        per_column = stored_k(k) // t.shape[1]  # 2 for qdata, 32 for codes, 256 for steps
        return t[:, start // per_column : stored_k(end) // per_column]

    return _with_tensors(weight, map(take, weight.packed), (n, end - start))


def _part(weight: CudaCoalescedInt4Tensor, dim: int, start: int, end: int) -> CudaCoalescedInt4Tensor:
    return _rows(weight, start, end) if dim % 2 == 0 else _columns(weight, start, end)


@implements(aten.slice.Tensor)
def _slice(func, types, args, kwargs):
    weight, dim, start, end, step = fill_defaults(args, 5, [0, None, None, 1])
    start, end, _ = slice(start, end).indices(weight.shape[dim])
    if step != 1:
        raise NotImplementedError(
            f"{type(weight).__name__} slices with step 1 only, got step={step}"
        )
    return return_and_correct_aliasing(func, args, kwargs, _part(weight, dim, start, end))


def _sections(weight: CudaCoalescedInt4Tensor, sizes, dim: int) -> list:
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    if bounds[-1] != weight.shape[dim]:
        raise RuntimeError(f"split sizes {list(sizes)} do not add up to {weight.shape[dim]} (dimension {dim})")
    return [_part(weight, dim, start, end) for start, end in zip(bounds, bounds[1:])]


@implements(aten.split.Tensor)
def _split(func, types, args, kwargs):
    weight, size, dim = fill_defaults(args, 3, [0])
    length = weight.shape[dim]
    sizes = [min(size, length - start) for start in range(0, length, size)] or [0]
    return _sections(weight, sizes, dim)


@implements(aten.split_with_sizes.default)
def _split_with_sizes(func, types, args, kwargs):
    weight, sizes, dim = fill_defaults(args, 3, [0])
    return _sections(weight, sizes, dim)


@implements(aten.cat.default)
def _cat(func, types, args, kwargs):
    """Weights joined along N (equal K), or along K where every part but the last holds whole
    super-blocks (a part's padding can only be at the end of the whole)."""
    weights, dim = fill_defaults(args, 2, [0])
    first = weights[0]
    kinds = {(type(w), tuple(w.block_size), w.activation_dtype, w.device) for w in weights}
    if len(kinds) != 1:
        raise NotImplementedError(f"cat of quantized weights needs one kind (class, block size, activation "
                                  f"dtype, device), got {sorted(map(str, kinds))}")
    dim = dim % 2
    if dim == 0:
        if len({w.shape[1] for w in weights}) != 1:
            raise RuntimeError(f"cat along N needs equal K, got {[tuple(w.shape) for w in weights]}")
        shape = (sum(w.shape[0] for w in weights), first.shape[1])
    else:
        if len({w.shape[0] for w in weights}) != 1:
            raise RuntimeError(f"cat along K needs equal N, got {[tuple(w.shape) for w in weights]}")
        if any(w.shape[1] % SUPER_BLOCK for w in weights[:-1]):
            raise NotImplementedError(f"cat along K needs every part but the last to hold whole super-blocks of "
                                      f"{SUPER_BLOCK}, got K = {[w.shape[1] for w in weights]}")
        shape = (first.shape[0], sum(w.shape[1] for w in weights))
    packed = (torch.cat(parts, dim=dim) for parts in zip(*(w.packed for w in weights)))
    return _with_tensors(first, packed, shape)


@implements(aten.t.default)
def _t(func, types, args, kwargs):
    from coalesced_int4.transposed import TransposedInt4Weight  # which imports this module

    return TransposedInt4Weight.of(args[0])  # another class: aliasing is not tracked across classes


def _gather(func, types, args, kwargs):
    """The collectives DTensor runs to gather a sharded weight (``full_tensor()``, a
    redistribution to ``Replicate``; the wait and the autograd wrapper are identities), run on
    each stored tensor. An all-gather concatenates along N, the first dimension of all five;
    DTensor gathers a shard of K that way too, then chunks it along N and joins the chunks
    along K (``split``, ``cat``)."""
    weight, *rest = args
    packed = [func(t, *rest, **kwargs) for t in weight.packed]
    return _with_tensors(weight, packed, (packed[0].shape[0], weight.shape[1]))


if torch.distributed.is_available():  # the collectives' ops exist where torch has distributed support
    implements([c10d_functional.all_gather_into_tensor.default, c10d_functional.wait_tensor.default,
                c10d_functional._wrap_tensor_autograd.default])(_gather)


@implements(aten.empty_like.default)
def _empty_like(func, types, args, kwargs):
    raise NotImplementedError(
        f"{type(args[0]).__name__} does not implement {func}: a quantized weight has no uninitialised form. "
        "DTensor asks for one to scatter a weight from one rank; every rank holds the same quantized weights, "
        "so shard without communication: parallelize_module(..., src_data_rank=None) or "
        "distribute_tensor(..., src_data_rank=None)."
    )


def check_own_shape_view(tensor: torch.Tensor, shape) -> None:
    """Raise unless ``view(shape)`` (one dimension may be -1) asks for ``tensor``'s own shape,
    the only view the format has."""
    resolved = list(shape)
    if -1 in resolved:
        rest = math.prod(d for d in resolved if d != -1)
        resolved[resolved.index(-1)] = tensor.numel() // rest if rest else 0
    if torch.Size(resolved) != tensor.shape:
        raise NotImplementedError(f"{type(tensor).__name__} views only as its own shape {tuple(tensor.shape)}, "
                                  f"got {tuple(shape)}: the format has no other layout")


@implements(aten.view.default)
def _view(func, types, args, kwargs):
    weight = args[0]
    check_own_shape_view(weight, args[1])
    return return_and_correct_aliasing(func, args, kwargs, _with_tensors(weight, weight.packed, weight.shape))


torch.serialization.add_safe_globals([CudaCoalescedInt4Tensor])
