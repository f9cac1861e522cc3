"""``Int4Config``: the torchao ``quantize_`` workflow that turns ``nn.Linear`` weights into
``CudaCoalescedInt4Tensor``.

``coalesced_int4.quantize_(model, int4_config())`` (torchao's ``quantize_`` plus the
model-wide rules below) calls the handler once per ``nn.Linear``; torchao's own
``quantize_`` and transformers' quantize-at-load call the same handler. A weight the
format cannot hold (K not a multiple of 32, not 2-D, not floating point, empty) stays dense;
each distinct (shape, reason) is logged once at WARNING. A weight that is already quantized is
left alone. ``config.report`` accumulates what happened: layers quantized, already quantized
and skipped (with reasons), and the weight bytes before and after.

With ``device=`` set, each weight is moved there, quantized there, and stays there (the bias
too): a bf16 model on the CPU can be quantized on a GPU one layer at a time, so peak GPU memory
is the packed model plus one dense layer.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import List, Optional, Tuple

import torch
from torchao.core.config import AOBaseConfig
from torchao.quantization.transform_module import register_quantize_module_handler

from coalesced_int4.quantize import GROUP_SIZE, QPARAMS, unpackable_reason
from coalesced_int4.tensor import CudaCoalescedInt4Tensor

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class QuantizeReport:
    """What one or more ``quantize_`` calls with a config did."""

    quantized: int = 0
    skipped: List[Tuple[Tuple[int, ...], str]] = dataclasses.field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    already_quantized: int = 0
    """Linear weights found quantized (by an earlier call) and left as they were."""

    def summary(self) -> str:
        saved = self.bytes_before - self.bytes_after
        already = f", {self.already_quantized} already quantized" if self.already_quantized else ""
        return (
            f"{self.quantized} linear weights quantized{already}, {len(self.skipped)} left dense; "
            f"quantized weights {self.bytes_before / 2**20:.1f} MiB -> "
            f"{self.bytes_after / 2**20:.1f} MiB ({saved / 2**20:.1f} MiB saved)"
        )


@dataclasses.dataclass
class Int4Config(AOBaseConfig):
    """Options of the coalesced INT4 weight-only workflow.

    group_size: weights per scale/zero code along K; the format has 32 only.
    qparams: how scales and zero points are chosen: ``"mse"`` (least squared weight error,
        never worse than min/max on any super-block) or ``"minmax"`` (torchao's asymmetric
        min/max, bit for bit).
    activation_dtype: dtype of the activations the kernels take (and of the wrapper tensor).
    device: where to quantize each weight and keep it; None keeps the weight's device.
    """

    group_size: int = GROUP_SIZE
    qparams: str = QPARAMS[0]
    activation_dtype: torch.dtype = torch.bfloat16
    device: Optional[torch.device] = None

    def __post_init__(self):
        if self.group_size != GROUP_SIZE:
            raise ValueError(f"group_size must be {GROUP_SIZE}, got {self.group_size}")
        if self.qparams not in QPARAMS:
            raise ValueError(f"unknown qparams {self.qparams!r}; supported: {QPARAMS}")
        if self.activation_dtype not in CudaCoalescedInt4Tensor.ACTIVATION_DTYPES:
            raise ValueError(
                f"activation_dtype must be one of {CudaCoalescedInt4Tensor.ACTIVATION_DTYPES}, "
                f"got {self.activation_dtype}"
            )
        if self.device is not None:
            self.device = torch.device(self.device)
        # Private, not a field: what a run did is not one of the options, so a serialised
        # config (torchao's config_to_dict, a Hugging Face config.json) leaves it out.
        self._report = QuantizeReport()
        self._tied: dict = {}  # id(parameter) -> the modules sharing it, set by quantize_ for one call

    @property
    def report(self) -> QuantizeReport:
        """What the ``quantize_`` calls with this config did so far."""
        return self._report


def quantize_(model: torch.nn.Module, config: Int4Config, filter_fn=None, device=None) -> None:
    """torchao's ``quantize_`` with the model-wide rules a per-module handler cannot see.

    - A linear weight that is the same parameter as another module's (a head tied to the input
      embedding) stays dense, so the tie holds and no quantized copy sits beside the dense one;
      the report says so.
    - transformers' ``Conv1D`` layers (GPT-2 style, weight stored as (K, N)) are not
      ``nn.Linear``: they stay dense and the report lists them.
    """
    from torchao.quantization import quantize_ as torchao_quantize_

    owners: dict = {}
    for module_name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module_name or "<root>")
        if type(module).__name__ == "Conv1D":
            _skip(config.report, tuple(module.weight.shape),
                  f"{module_name} is a transformers Conv1D (weight stored as (K, N)), not an nn.Linear")
    config._tied = {key: names for key, names in owners.items() if len(names) > 1}
    try:
        torchao_quantize_(model, config, filter_fn=filter_fn, device=device)
    finally:
        config._tied = {}


def int4_config(**options) -> Int4Config:
    """``Int4Config(**options)``; see its fields."""
    return Int4Config(**options)


@register_quantize_module_handler(Int4Config)
def _quantize_linear(module: torch.nn.Module, config: Int4Config, **_) -> torch.nn.Module:
    weight = module.weight
    if isinstance(weight, CudaCoalescedInt4Tensor):
        config.report.already_quantized += 1
        return module
    if not isinstance(module, torch.nn.Linear):
        # transformers hands embeddings here too (include_input_output_embeddings=True); the
        # format serves F.linear only, so they stay dense.
        _skip(config.report, tuple(weight.shape), f"{type(module).__name__} is not an nn.Linear")
        return module
    tied = config._tied.get(id(weight))
    if tied:
        _skip(config.report, tuple(weight.shape), f"weight tied across {', '.join(tied)}; kept dense so the tie holds")
        return module
    reason = unpackable_reason(weight)
    if reason is not None:
        _skip(config.report, tuple(weight.shape), reason)
        return module
    if config.device is not None:
        weight = weight.to(config.device)
        if module.bias is not None:
            module.bias = torch.nn.Parameter(
                module.bias.detach().to(config.device), requires_grad=False
            )
    quantized = CudaCoalescedInt4Tensor.from_float(
        weight,
        group_size=config.group_size,
        qparams=config.qparams,
        activation_dtype=config.activation_dtype,
    )
    module.weight = torch.nn.Parameter(quantized, requires_grad=False)
    report = config.report
    report.quantized += 1
    report.bytes_before += weight.numel() * weight.element_size()
    report.bytes_after += sum(t.numel() * t.element_size() for t in quantized.packed)
    return module


def _skip(report: QuantizeReport, shape: Tuple[int, ...], reason: str) -> None:
    entry = (shape, reason)
    if entry not in report.skipped:
        logger.warning("left a linear weight of shape %s dense: %s", shape, reason)
    report.skipped.append(entry)
