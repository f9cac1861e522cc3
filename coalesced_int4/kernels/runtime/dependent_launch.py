"""Programmatic dependent launch (Hopper's PDL) for the GEMM family's kernels.

Launched with ``launch_pdl``, a kernel's programs may start while the kernel before it on the
stream is still running: its launch and set-up overlap that kernel's last programs, instead
of waiting for them to exit.

Every kernel launched with ``options(device)`` keeps this contract:

- it calls ``wait_for_previous_kernel`` before its first global memory access, read or
  write: the previous kernel's outputs are complete only after the wait, and the previous
  kernel may still read memory that the caching allocator has handed to this one;
- it calls ``let_next_kernel_launch`` where the next kernel's programs can take their SM
  slots without holding up this one. The GEMMs and the activation quantizer call it once
  their loads are done, so that the next kernel is launched while they store (called at a
  GEMM's start, the next kernel's programs would hold SM slots in their own wait while the
  GEMM still computes). The split-K reduction, a short pass with little state, calls it right
  after its wait, so that the next GEMM's programs are placed and waiting by the time the
  sums are stored; this relies on the W4A16 launches' shared memory being fitted to their
  grid (``smem_carveout``), without which an early GEMM lands four programs to an SM on half
  the SMs (docs/decisions.md).

Dependent launch is used for eager launches on sm_90 and newer, CUDA graphs captured from
them included. Traced launches (torch.compile, AOTInductor) and Triton's interpreter compile
the kernels without it, and there the two calls compile to nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from coalesced_int4.kernels.ops import family
from coalesced_int4.torch_internals import is_fake

MIN_CAPABILITY = (9, 0)
"""``griddepcontrol`` is PTX for sm_90 and newer."""


@functools.lru_cache(maxsize=None)
def has_griddepcontrol(device: torch.device) -> bool:
    """Whether ``device`` runs ``griddepcontrol``, asked of the driver once per device: a GEMM
    call launches up to three kernels, and each launch reads this."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


def options(tensor: torch.Tensor) -> dict:
    """The kernel arguments of a launch that reads or writes ``tensor``: ``DEPENDENT_LAUNCH``
    for the kernel, and ``launch_pdl`` for Triton's launcher where it is on. On for a real
    tensor on a device with ``griddepcontrol``, whoever launches (the op, its autotuner's
    timing, a benchmark calling a launcher itself); off for a fake one (tracing records the
    launch) and under the interpreter."""
    enabled = not family.INTERPRETER and not is_fake(tensor) and has_griddepcontrol(tensor.device)
    return {"DEPENDENT_LAUNCH": enabled, "launch_pdl": True} if enabled else {"DEPENDENT_LAUNCH": False}


@triton.jit
def wait_for_previous_kernel(DEPENDENT_LAUNCH: tl.constexpr):
    """Block until the previous kernel on the stream has finished and its writes are visible."""
    if DEPENDENT_LAUNCH:
        tl.extra.cuda.gdc_wait()


@triton.jit
def let_next_kernel_launch(DEPENDENT_LAUNCH: tl.constexpr):
    """Allow the next kernel on the stream to launch once every program has called this (or
    exited)."""
    if DEPENDENT_LAUNCH:
        tl.extra.cuda.gdc_launch_dependents()
