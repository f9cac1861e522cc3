"""``TransposedInt4Weight``: ``w.t()`` of a ``CudaCoalescedInt4Tensor``, for code that writes
``linear`` as ``t`` then ``mm``.

DTensor (PyTorch's tensor parallelism) runs ``F.linear(x, w)`` on each rank's shard as
``aten.t(w)`` followed by ``aten.mm(x, w_t)`` (``aten.addmm`` with a bias). The format has no
column-major form, so the transposed weight keeps the five stored tensors as they are and only
its shape is ``(K, N)``. Ops it handles (the table is complete):

* ``mm`` / ``matmul`` with it on the right, and ``addmm`` (``beta`` and ``alpha`` 1): the
  quantized linear of the weight it transposes (kernels or fallback, as ``F.linear``);
* ``t``: that weight back;
* ``detach``, ``alias``, ``clone``, ``view`` as its own shape.

Anything else raises ``NotImplementedError`` naming the op.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torchao.utils import TorchAOBaseTensor

from coalesced_int4.dispatch import quantized_linear
from coalesced_int4.quantize import PackedInt4
from coalesced_int4.tensor import CudaCoalescedInt4Tensor, check_own_shape_view, dispatch_from_table
from coalesced_int4.torch_internals import return_and_correct_aliasing

__all__ = ["TransposedInt4Weight"]

aten = torch.ops.aten


class TransposedInt4Weight(TorchAOBaseTensor):
    """The ``(K, N)`` transpose of an ``(N, K)`` quantized weight, on the same stored tensors."""

    tensor_data_names = list(PackedInt4._fields)
    tensor_attribute_names = ["block_size", "shape"]
    optional_tensor_attribute_names = ["activation_dtype"]

    def __new__(cls, qdata, scale, scale_step, zero_point, zero_point_step, block_size: List[int],
                shape: torch.Size, activation_dtype: Optional[torch.dtype] = None):
        return torch.Tensor._make_wrapper_subclass(cls, shape, device=qdata.device,
                                                   dtype=activation_dtype or torch.bfloat16, requires_grad=False)

    def __init__(self, qdata, scale, scale_step, zero_point, zero_point_step, block_size: List[int],
                 shape: torch.Size, activation_dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.qdata, self.scale, self.scale_step = qdata, scale, scale_step
        self.zero_point, self.zero_point_step = zero_point, zero_point_step
        self.block_size = list(block_size)
        self.activation_dtype = activation_dtype or torch.bfloat16

    @classmethod
    def of(cls, weight: CudaCoalescedInt4Tensor) -> "TransposedInt4Weight":
        n, k = weight.shape
        transposed = cls(*weight.packed, block_size=weight.block_size, shape=torch.Size((k, n)),
                         activation_dtype=weight.activation_dtype)
        # The weight object itself, so that mm reaches the eager plans (keyed by the weight)
        # that every earlier call of it made, not a new tensor's empty ones.
        transposed._of = weight
        return transposed

    @property
    def weight(self) -> CudaCoalescedInt4Tensor:
        """The ``(N, K)`` weight this transposes: the weight object ``of`` was given, where
        there is one."""
        of = getattr(self, "_of", None)
        return of if of is not None else self.transposed_back()

    def transposed_back(self) -> CudaCoalescedInt4Tensor:
        """A new ``(N, K)`` weight on the same stored tensors."""
        k, n = self.shape
        return CudaCoalescedInt4Tensor(*(getattr(self, name) for name in self.tensor_data_names),
                                       block_size=self.block_size, shape=torch.Size((n, k)),
                                       activation_dtype=self.activation_dtype)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return self.weight.dequantize(dtype).t()

    SUPPORTED_OPS = ("mm, addmm, matmul with it on the right (it is a quantized weight's t()), t, detach, alias, "
                     "clone, view as its own shape")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch_from_table(cls, func, types, args, kwargs)


implements = TransposedInt4Weight.implements


@implements([aten.mm.default, aten.matmul.default])
def _mm(func, types, args, kwargs):
    x, transposed = args
    return quantized_linear(x, transposed.weight)


@implements(aten.addmm.default)
def _addmm(func, types, args, kwargs):
    bias, x, transposed = args[:3]
    if kwargs.get("beta", 1) != 1 or kwargs.get("alpha", 1) != 1:
        raise NotImplementedError(f"TransposedInt4Weight: addmm with beta=1 and alpha=1 only, got {kwargs}")
    return quantized_linear(x, transposed.weight, bias)


@implements(aten.t.default)
def _t(func, types, args, kwargs):
    return args[0].transposed_back()  # another class: aliasing is not tracked across classes


@implements(aten.view.default)
def _view(func, types, args, kwargs):
    transposed = args[0]
    check_own_shape_view(transposed, args[1])
    return return_and_correct_aliasing(func, args, kwargs, TransposedInt4Weight.of(transposed.weight))


torch.serialization.add_safe_globals([TransposedInt4Weight])
