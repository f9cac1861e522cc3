"""``Int4Config``: the torchao ``quantize_`` workflow that turns ``nn.Linear`` weights into
``CudaCoalescedInt4Tensor``.

``quantize_(model, int4_config())`` (torchao's function, also exported as
``coalesced_int4.quantize_``) calls the handler below once per ``nn.Linear``. A weight the
format cannot hold (K not a multiple of 256, not 2-D, not floating point, empty) stays dense;
each distinct (shape, reason) is logged once at WARNING. A weight that is already quantized is
left alone. ``config.report`` accumulates what happened: layers quantized and skipped (with
reasons) and the weight bytes before and after.

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

from coalesced_int4.quantize import GROUP_SIZE, METHODS, unpackable_reason
from coalesced_int4.tensor import CudaCoalescedInt4Tensor

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class QuantizeReport:
    """What one or more ``quantize_`` calls with a config did."""

    quantized: int = 0
    skipped: List[Tuple[Tuple[int, ...], str]] = dataclasses.field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0

    def summary(self) -> str:
        saved = self.bytes_before - self.bytes_after
        return (
            f"{self.quantized} linear weights quantized, {len(self.skipped)} left dense; "
            f"quantized weights {self.bytes_before / 2**20:.1f} MiB -> "
            f"{self.bytes_after / 2**20:.1f} MiB ({saved / 2**20:.1f} MiB saved)"
        )


@dataclasses.dataclass
class Int4Config(AOBaseConfig):
    """Options of the coalesced INT4 weight-only workflow.

    group_size: weights per scale/zero code along K; the format has 32 only.
    method: how codes are chosen; ``"min_max"`` (torchao asymmetric min/max).
    activation_dtype: dtype of the activations the kernels take (and of the wrapper tensor).
    device: where to quantize each weight and keep it; None keeps the weight's device.
    """

    group_size: int = GROUP_SIZE
    method: str = "min_max"
    activation_dtype: torch.dtype = torch.bfloat16
    device: Optional[torch.device] = None
    report: QuantizeReport = dataclasses.field(
        default_factory=QuantizeReport, compare=False, repr=False
    )

    def __post_init__(self):
        if self.group_size != GROUP_SIZE:
            raise ValueError(f"group_size must be {GROUP_SIZE}, got {self.group_size}")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; supported: {METHODS}")
        if self.activation_dtype not in CudaCoalescedInt4Tensor.ACTIVATION_DTYPES:
            raise ValueError(
                f"activation_dtype must be one of {CudaCoalescedInt4Tensor.ACTIVATION_DTYPES}, "
                f"got {self.activation_dtype}"
            )
        if self.device is not None:
            self.device = torch.device(self.device)


def int4_config(**options) -> Int4Config:
    """``Int4Config(**options)``; see its fields."""
    return Int4Config(**options)


@register_quantize_module_handler(Int4Config)
def _quantize_linear(module: torch.nn.Module, config: Int4Config, **_) -> torch.nn.Module:
    weight = module.weight
    if isinstance(weight, CudaCoalescedInt4Tensor):
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
        method=config.method,
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
