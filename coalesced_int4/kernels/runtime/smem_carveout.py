"""Shared memory against L1: the carveout a W4A16 GEMM launch asks the driver for.

An SM's unified data cache is split between shared memory and L1. Triton asks for the largest
share of shared memory (228 KB on the H100/H200, leaving about 28 KB of L1) for any kernel
that uses more than 48 KB, as most bucket-64 configs do. The W4A16 main loop reads each
weight row's scale and zero codes and steps through L1, every trip, from lines that the
program's later trips read again (its codes and activations are asynchronous copies that
bypass L1). Two programs an SM touch about 40 KB of such lines and three about 60 KB, so with
28 KB every trip fetched them from L2 again.

So a launch of such a binary asks for the least shared memory that still holds the programs
its grid puts on an SM (``carveout_percent``), and L1 gets the rest; at four programs an SM
that is all 228 KB. The binary, and so every result bit, is the same. Binaries
of 48 KB or less (most configs of buckets 8-32) keep the carveout the driver picks for them.
The fitted carveout also bounds where a GEMM launched early by the split-K reduction
(``dependent_launch``) is placed: no SM takes more of its programs than the grid puts on one.

How: the W4A16 kernel reports its grid through Triton's ``launch_metadata`` (``report_grid``),
and ``fitted_to_grid()``, around the W4A16 launcher's launches (tuning included), installs a
launch hook that sets the compiled function's preferred carveout wherever the grid wants
another one than the last set. A CUDA graph keeps the carveout a launch was captured under,
so one graph may hold launches of a binary at different grids. The
hook is installed only around those launches: a launch hook left installed would turn off
Inductor's static launcher for every compiled kernel in the process. A replayed eager call
(``recorded_call``) sets the carveout its recorded launch had (``Fitter.set``). Launches that
Inductor or AOTInductor make load functions of their own and keep Triton's carveout.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import math
import threading

import torch
import triton

from coalesced_int4.kernels.runtime.device import multiprocessors

_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81
_CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK = 111
CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
"""The attribute a carveout is set as: percent of the SM's largest shared memory, which the
driver rounds up to a size the SM supports."""

TRITON_PREFERS_SHARED_ABOVE = 49152
"""Bytes of shared memory above which Triton, loading a kernel, asks for the largest shared
memory (``CU_FUNC_CACHE_PREFER_SHARED``). At or below it the driver picks the carveout, and
``fitted_to_grid`` leaves its choice, which fitting did not improve on."""

_GRID = "coalesced_int4_grid"
"""The key ``report_grid`` adds to a launch's metadata."""


@dataclasses.dataclass(frozen=True)
class SharedMemory:
    """One device's shared memory per SM and its SM count."""

    sms: int
    per_sm: int
    """Bytes: the most shared memory an SM's programs can have together."""
    reserved_per_program: int
    """Bytes the driver keeps per program on top of the program's own."""


def carveout_percent(programs: int, occupancy: int, shared: int, memory: SharedMemory) -> int:
    """The carveout that holds the programs a grid of ``programs`` puts on an SM (spread
    evenly, at most ``occupancy``, the most an SM can hold), each using ``shared`` bytes: the
    least percent of ``memory.per_sm`` that is not below their shared memory."""
    per_sm = max(1, min(occupancy, -(-programs // memory.sms)))
    return min(100, -(-100 * per_sm * (shared + memory.reserved_per_program) // memory.per_sm))


def report_grid(grid, metadata, args) -> dict:
    """Triton ``launch_metadata`` of a kernel whose launches ``fitted_to_grid`` fits: its
    programs, its shared memory and its threads a program."""
    return {_GRID: (math.prod(grid), metadata.shared, metadata.num_warps * 32)}


@functools.lru_cache(maxsize=None)
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _driver(name: str, *args) -> None:
    result = getattr(_libcuda(), name)(*args)
    if result != 0:
        raise RuntimeError(f"shared memory carveout: {name} failed with CUresult {result}")


@functools.lru_cache(maxsize=None)
def shared_memory(device_index: int) -> SharedMemory:
    """CUDA device ``device_index``'s, asked once (the SM count as the balanced grids ask it)."""
    device = ctypes.c_int()
    _driver("cuDeviceGet", ctypes.byref(device), ctypes.c_int(device_index))

    def attribute(code: int) -> int:
        value = ctypes.c_int()
        _driver("cuDeviceGetAttribute", ctypes.byref(value), ctypes.c_int(code), device)
        return value.value

    return SharedMemory(sms=multiprocessors(torch.device("cuda", device_index)),
                        per_sm=attribute(_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR),
                        reserved_per_program=attribute(_CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK))


def occupancy(function: int, threads: int, shared: int) -> int:
    """How many programs of a compiled function an SM holds (the driver's occupancy
    calculator); asked once per function, before ``fitted_to_grid`` changes its carveout."""
    programs = ctypes.c_int()
    _driver("cuOccupancyMaxActiveBlocksPerMultiprocessor", ctypes.byref(programs), ctypes.c_void_p(function),
            ctypes.c_int(threads), ctypes.c_size_t(shared))
    return programs.value


def set_carveout(function: int, percent: int) -> None:
    """Ask the driver to give a compiled function's launches ``percent`` of the largest shared
    memory (rounded up to a size the SM has)."""
    _driver("cuFuncSetAttribute", ctypes.c_void_p(function),
            ctypes.c_int(CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT), ctypes.c_int(percent))


def preferred_carveout(function: int) -> int:
    """The carveout a compiled function has now (-1: none asked for)."""
    value = ctypes.c_int()
    _driver("cuFuncGetAttribute", ctypes.byref(value), ctypes.c_int(CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT),
            ctypes.c_void_p(function))
    return value.value


class Fitter:
    """The launch hook, and what it knows of each compiled function (handles are per device)."""

    def __init__(self):
        self.occupancy = {}
        self.carveout = {}
        self.lock = threading.Lock()
        self.users = 0

    def __call__(self, launch) -> None:
        if _GRID not in launch.data and not any(report is report_grid for report, _ in launch.extras):
            return  # another kernel
        programs, shared, threads = launch.get()[_GRID]
        if shared <= TRITON_PREFERS_SHARED_ABOVE:
            return
        function = launch.data["function"]
        if function not in self.occupancy:
            self.occupancy[function] = occupancy(function, threads, shared)
        # Triton launches on the current device, whose function handle this is.
        self.set(function, carveout_percent(programs, self.occupancy[function], shared,
                                            shared_memory(torch.cuda.current_device())))

    def set(self, function: int, percent: int) -> None:
        """Give ``function`` the carveout ``percent``, asking the driver only where it has another."""
        if self.carveout.get(function) != percent:
            set_carveout(function, percent)
            self.carveout[function] = percent


FITTER = Fitter()


@contextlib.contextmanager
def fitted_to_grid():
    """While open, each launch of a kernel with ``launch_metadata=report_grid`` first sets its
    function's carveout for its grid. Nests, and may be open in several threads at once."""
    hooks = triton.knobs.runtime.launch_enter_hook
    with FITTER.lock:
        FITTER.users += 1
        if FITTER.users == 1:
            hooks.add(FITTER)
    try:
        yield
    finally:
        with FITTER.lock:
            FITTER.users -= 1
            if FITTER.users == 0:
                hooks.remove(FITTER)
