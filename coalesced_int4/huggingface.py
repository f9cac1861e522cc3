"""Taking part in Hugging Face transformers' torchao integration.

transformers quantizes at load with ``TorchAoConfig(quant_type=...)``, serialises the config
with torchao's ``config_to_dict`` / ``config_from_dict`` and the weights with torchao's
safetensors flattening, and reads a pre-quantized checkpoint back through its torchao
quantizer. Each of those steps admits only what torchao's allowlists name, so ``register()``
(run by ``import coalesced_int4``) adds this package to them:

- ``torchao.core.config.ALLOWED_AO_MODULES`` gets ``coalesced_int4``, where ``Int4Config``
  (and the ``QuantizeReport`` it carries) are found by name;
- ``torchao.prototype.safetensors.safetensors_utils.ALLOWED_CLASSES`` and
  ``ALLOWED_TENSORS_SUBCLASSES`` get ``CudaCoalescedInt4Tensor``, built by
  ``CudaCoalescedInt4Tensor.from_stored``, which reads a shard's shape from its stored tensors
  (transformers' tensor-parallel loading, ``tp_plan``, slices each stored tensor and keeps the
  whole weight's metadata).

transformers' torchao quantizer also lists the stored suffixes of a quantized weight it
collects when loading (``serialized_names``: ``_weight_qdata``, ``_weight_scale``, ...); ours
add ``_weight_scale_step`` and ``_weight_zero_point_step``. ``register()`` extends that list on
``TorchAoHfQuantizer`` when ``transformers.quantizers.quantizer_torchao`` is imported (now, if it
already is), without importing transformers itself.

The files ``save_pretrained`` writes hold the same tensors and per-weight metadata as
``save_quantized``'s (docs/checkpoints.md), so ``load_quantized`` and ``inspect`` read them too.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

from torchao.core import config as torchao_config
from torchao.prototype.safetensors import safetensors_utils

from coalesced_int4.tensor import CudaCoalescedInt4Tensor

TRANSFORMERS_TORCHAO_QUANTIZER = "transformers.quantizers.quantizer_torchao"
EXTRA_SUFFIXES = tuple(name for name in CudaCoalescedInt4Tensor.tensor_data_names
                       if name not in ("qdata", "scale", "zero_point"))
"""Components of ours that transformers' torchao quantizer does not collect by itself."""


def register() -> None:
    """Add this package to torchao's allowlists and transformers' stored suffixes (idempotent)."""
    torchao_config.ALLOWED_AO_MODULES.add("coalesced_int4")
    name = CudaCoalescedInt4Tensor.__name__
    safetensors_utils.ALLOWED_CLASSES[name] = CudaCoalescedInt4Tensor.from_stored
    if name not in safetensors_utils.ALLOWED_TENSORS_SUBCLASSES:
        safetensors_utils.ALLOWED_TENSORS_SUBCLASSES.append(name)
    if TRANSFORMERS_TORCHAO_QUANTIZER in sys.modules:
        _extend_serialized_names(sys.modules[TRANSFORMERS_TORCHAO_QUANTIZER])
    elif not any(isinstance(finder, _ExtendOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ExtendOnImport())


def _extend_serialized_names(module) -> None:
    quantizer = module.TorchAoHfQuantizer
    original = quantizer.serialized_names
    if getattr(original.fget, "_coalesced_int4", False):
        return

    def serialized_names(self):
        names = original.fget(self)
        return {param: [*stored, *(f"_{param}_{suffix}" for suffix in EXTRA_SUFFIXES)]
                for param, stored in names.items()}

    extended = property(serialized_names)
    extended.fget._coalesced_int4 = True
    quantizer.serialized_names = extended


class _ExtendOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when transformers' torchao quantizer module is first imported, it
    lets the usual finder load it and then extends its ``serialized_names``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TRANSFORMERS_TORCHAO_QUANTIZER:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_extend(module):
            exec_module(module)
            _extend_serialized_names(module)

        spec.loader.exec_module = exec_and_extend
        return spec
