"""Recorded calls: the Triton launches of one GEMM call, replayed without Triton's Python
launcher.

An eager GEMM call decides its launch parameters, asks its autotuner for a config and, for
each kernel it launches, goes through Triton's ``JITFunction.run`` (argument binding, the
specialization key, the cache lookup, launch metadata): many times the host time of a dense
``F.linear``. For one weight and one activation signature (shape, dtype, device, strides,
storage offset) every call launches the same compiled kernels on the same grids with the same
scalar arguments; only the activation, the buffers the call allocates (its output, split-K
partials, quantized activations, tensor-descriptor scratch) and the stream change.

``record(x, weights, call)`` runs ``call()``, an ordinary launch of the GEMM, while every
kernel launch (``run_kernel``) and every buffer allocation (``empty``) of the launchers
reports to it. It returns the call's result and a ``RecordedCall``, or None in its place where
the call cannot be replayed:

- a launch that did not run exactly once (an autotuner timing its configs launches many);
- a tensor argument that is neither ``x`` itself, a view of a weight tensor, nor a buffer the
  call allocated through ``empty`` (a copy of ``x``, say, whose contents a replay would lose);
- a kernel that asks for profiling scratch, or a Triton launcher without the attributes read
  here;
- a result that is not a buffer of the call.

The launches may take a view of ``x`` at its address (``launched_x``: the caller's 2-D rows of
a 3-D activation), and replays may return the result in another shape of the same elements
(``result_shape``), so that a replay needs neither reshape.

``RecordedCall(x, weights)`` allocates the buffers again and hands each compiled kernel's
launcher the recorded arguments with ``x`` and the new buffers in their places, on the current
stream, after setting the shared memory carveout the recorded launch had (``smem_carveout``):
the same kernels, grids and arguments, hence the same bits. Tensor arguments go as their
addresses, which the launcher takes without asking the driver about each. It returns None,
launching nothing, where the weights are not at the addresses recorded (other tensors, or
moved), the current CUDA device is another, ``x`` is not 16-byte aligned, or a launch hook is
installed (a profiler's, or ``fitted_to_grid`` open in another thread): the caller then
launches as usual.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import triton

from coalesced_int4.kernels.runtime.smem_carveout import FITTER
from coalesced_int4.torch_internals import current_device_index, current_raw_stream

_recorder: contextvars.ContextVar = contextvars.ContextVar("coalesced_int4_launch_recorder", default=None)

_HOOKS = triton.knobs.runtime
_ADDRESS = torch.Tensor.data_ptr
ALIGNMENT = 16
"""Bytes to which Triton specializes a pointer argument's alignment when it compiles: a replay
takes only activations aligned so (a kernel recorded on one may assume it)."""


def empty(shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty``, for a buffer a GEMM call allocates and its kernels fill (reported to
    an active recording, whose replays allocate it again)."""
    buffer = torch.empty(shape, dtype=dtype, device=device)
    recorder = _recorder.get()
    if recorder is not None:
        recorder.buffers.append(buffer)
    return buffer


def run_kernel(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)`` (a JIT function or an autotuner), reported to an
    active recording."""
    recorder = _recorder.get()
    if recorder is None:
        kernel[grid](*args, **kwargs)
    else:
        recorder.launch(kernel, grid, args, kwargs)


class NotReplayable(Exception):
    """Why a recorded call cannot be replayed."""


@dataclasses.dataclass(frozen=True)
class _Launch:
    """One recorded launch: the compiled kernel's launcher and everything it was called with."""

    launch: Callable
    """Triton's compiled launch function (the C launcher of one kernel binary)."""
    grid: Tuple[int, int, int]
    function: int
    cooperative: bool
    dependent: bool
    scratch_bytes: int
    """Global scratch bytes of the whole grid (0: none)."""
    arguments: Tuple
    """The launcher's arguments after the scratch pointers, with placeholders where
    ``replaced`` puts this call's tensors."""
    replaced: Tuple[Tuple[int, int], ...]
    """(position in ``arguments``, source): source 0 is ``x``, source i > 0 buffer i - 1."""
    carveout: Optional[int]


class _Recorder:
    def __init__(self, x: torch.Tensor, weights: Sequence[torch.Tensor]):
        self.x = x
        self.weight_storages = {w.untyped_storage().data_ptr() for w in weights}
        self.buffers: List[torch.Tensor] = []
        self.launches: List[_Launch] = []
        self.refused: Optional[str] = None

    def launch(self, kernel, grid, args, kwargs) -> None:
        seen = []

        def recording_grid(bound_args: dict):
            sizes = tuple(grid(bound_args) if callable(grid) else grid)
            seen.append((sizes, tuple(bound_args.values())))
            return sizes

        compiled = kernel[recording_grid](*args, **kwargs)
        if self.refused is not None:
            return
        try:
            if len(seen) != 1:
                raise NotReplayable(f"{getattr(kernel, '__name__', kernel)} launched {len(seen)} times in one call")
            sizes, bound_values = seen[0]
            self.launches.append(self._launch(compiled, sizes, bound_values))
        except NotReplayable as reason:
            self.refused = str(reason)

    def _source(self, value: torch.Tensor) -> Optional[int]:
        """0 for ``x``, i > 0 for buffer i - 1, None for a weight; raises for anything else."""
        if value is self.x:
            return 0
        for index, buffer in enumerate(self.buffers):
            if value is buffer:
                return index + 1
        if value.untyped_storage().data_ptr() in self.weight_storages:
            return None
        raise NotReplayable(f"a {tuple(value.shape)} {value.dtype} argument is neither the activation, "
                            f"a weight nor a buffer of the call")

    def _launch(self, compiled, sizes, bound_values) -> _Launch:
        launcher = compiled.run
        needed = ("launch", "num_ctas", "global_scratch_size", "profile_scratch_size", "launch_cooperative_grid",
                  "launch_pdl")
        if not all(hasattr(launcher, name) for name in needed):
            raise NotReplayable(f"Triton's launcher {type(launcher).__name__} lacks one of {needed}")
        if launcher.profile_scratch_size:
            raise NotReplayable("the kernel asks for profiling scratch")
        grid = (*sizes, 1, 1)[:3]
        arguments = [compiled.packed_metadata, None, None, None]  # launch metadata and hooks: none
        replaced = []
        for value in bound_values:
            if isinstance(value, torch.Tensor):
                source = self._source(value)
                if source is not None:
                    replaced.append((len(arguments), source))
                # A replay passes addresses: the launcher asks the driver about every tensor
                # argument (data_ptr and cuPointerGetAttribute), and takes an int as it is.
                # A weight's address is fixed (the replay holds the weight and checks it is
                # still the weight's); x's and the buffers' are put in by the replay.
                value = value.data_ptr() if source is None else None
            arguments.append(value)
        programs = grid[0] * grid[1] * grid[2]
        return _Launch(
            launch=launcher.launch, grid=grid, function=compiled.function,
            cooperative=launcher.launch_cooperative_grid, dependent=launcher.launch_pdl,
            scratch_bytes=programs * launcher.num_ctas * launcher.global_scratch_size,
            arguments=tuple(arguments),
            replaced=tuple(replaced), carveout=FITTER.carveout.get(compiled.function),
        )


@dataclasses.dataclass(frozen=True)
class RecordedCall:
    """A recorded GEMM call (``record``), replayed by calling it."""

    device_index: int
    """The current CUDA device when recorded: a replay runs only while it is current."""
    device: torch.device
    """The activation's device, where replays allocate their buffers."""
    weights: Tuple[torch.Tensor, ...]
    """The weight tensors recorded, held so that their memory stays theirs: the launches hold
    their addresses, and a replay checks only that the weights it is given are at those
    addresses (a tensor there is a view of the same bytes)."""
    weight_addresses: Tuple[int, ...]
    buffers: Tuple[Tuple[Tuple[int, ...], torch.dtype], ...]
    result: int
    """The index of the buffer returned."""
    launches: Tuple[_Launch, ...]

    def __call__(self, x: torch.Tensor, weights: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
        if _HOOKS.launch_enter_hook.calls or _HOOKS.launch_exit_hook.calls:
            return None
        if tuple(map(_ADDRESS, weights)) != self.weight_addresses or current_device_index() != self.device_index:
            return None
        address = x.data_ptr()
        if address % ALIGNMENT:  # the kernels may be specialized for aligned pointers
            return None
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in self.buffers]
        addresses = [address, *map(_ADDRESS, buffers)]
        stream = current_raw_stream(self.device_index)
        for launch in self.launches:
            arguments = list(launch.arguments)
            for position, source in launch.replaced:
                arguments[position] = addresses[source]
            scratch = torch.empty(launch.scratch_bytes, dtype=torch.int8, device=self.device) if launch.scratch_bytes \
                else None
            if launch.carveout is not None:
                FITTER.set(launch.function, launch.carveout)
            launch.launch(*launch.grid, stream, launch.function, launch.cooperative, launch.dependent,
                          None if scratch is None else scratch.data_ptr(), None, *arguments)
        return buffers[self.result]


def record(x: torch.Tensor, weights: Sequence[torch.Tensor], call: Callable[[], torch.Tensor], *,
           launched_x: Optional[torch.Tensor] = None,
           result_shape: Optional[Tuple[int, ...]] = None) -> Tuple[torch.Tensor, Optional[RecordedCall]]:
    """``call()``'s result, and its launches recorded (None where they cannot be replayed).
    ``launched_x``: the view of ``x`` the launches take (default ``x``); replays are given
    ``x`` itself, so a ``launched_x`` at another address (a copy) records nothing.
    ``result_shape``: the shape replays return the result in (the same elements, contiguous)."""
    launched_x = x if launched_x is None else launched_x
    recorder = _Recorder(launched_x, weights)
    token = _recorder.set(recorder)
    try:
        result = call()
    finally:
        _recorder.reset(token)
    results = [i for i, buffer in enumerate(recorder.buffers) if buffer is result]
    if (recorder.refused is not None or not recorder.launches or not results
            or launched_x.data_ptr() != x.data_ptr()):
        return result, None
    buffers = [(tuple(b.shape), b.dtype) for b in recorder.buffers]
    if result_shape is not None:
        if not result.is_contiguous() or result.numel() != math.prod(result_shape):
            raise ValueError(f"a {tuple(result.shape)} result cannot be returned as {tuple(result_shape)}")
        buffers[results[0]] = (tuple(result_shape), result.dtype)
    return result, RecordedCall(
        device_index=current_device_index(), device=x.device,
        weights=tuple(weights), weight_addresses=tuple(w.data_ptr() for w in weights),
        buffers=tuple(buffers), result=results[0], launches=tuple(recorder.launches),
    )
