"""What launches ask of the device, once per device."""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch


@functools.lru_cache(maxsize=None)
def multiprocessors(device: torch.device) -> Optional[int]:
    """The SMs a grid spreads over: a CUDA device's count; None elsewhere or where no CUDA
    driver answers (a fake CUDA tensor traced on a machine without a GPU). Asked of the driver
    once per device: every untuned launch and every W4A16 launch on a balanced grid reads it."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count



@functools.lru_cache(maxsize=None)
def compute_capability(device: torch.device) -> Optional[Tuple[int, int]]:
    """A CUDA device's (major, minor) compute capability; None off CUDA or where no CUDA
    driver answers (a fake CUDA tensor traced on a machine without a GPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)
