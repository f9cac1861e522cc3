"""Global scratch for kernels that make tensor descriptors on the device.

A Triton kernel that calls ``tl.make_tensor_descriptor`` writes each program's descriptor to
global memory, which Triton's launcher asks an allocator for at every launch. That allocator
is a context variable (``triton.set_allocator``), unset by default, and a library should not
set it for the whole process. So ``with_scratch(device, launch)`` runs ``launch`` in a copy of
the caller's context in which the allocator hands out torch tensors on ``device``: from the
caching allocator, so scratch is stream-ordered like any other buffer, and from the graph's
pool while a CUDA graph is captured. The caller's own allocator, if any, is untouched.

Traced launches do not need it: Inductor's launcher sets its own allocator, and
AOTInductor's generated code allocates each kernel's scratch itself.
"""

from __future__ import annotations

import contextvars
from typing import Callable, TypeVar

import torch
import triton

Result = TypeVar("Result")


def with_scratch(device: torch.device, launch: Callable[[], Result]) -> Result:
    """``launch()`` with Triton's allocator handing out int8 tensors on ``device``."""

    def run() -> Result:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device=device))
        return launch()

    return contextvars.copy_context().run(run)
