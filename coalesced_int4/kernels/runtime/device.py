"""What launches ask of the device, once per device."""

from __future__ import annotations

import functools
from typing import Optional

import torch


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> Optional[int]:
    """The SMs a grid spreads over: a CUDA device's count, None elsewhere. Asked of the driver
    once per device: every W4A16 launch on a balanced grid reads it."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None

