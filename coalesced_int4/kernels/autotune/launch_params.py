"""Choosing launch parameters (split-K, prequantized activations) per shape:
``autotune_launch_param``.

A launcher decorated with ``@autotune_launch_param(split_k=(1, 2, 4), prequantize=(False,
True), default=rule)`` runs with the values passed explicitly, else this process's pick for
the shape, else a pick from the persistent pick store (below), else, while tuning is off, the
values ``rule(*args)`` names (a heuristic from the shapes; without a rule, each parameter's
first value). Tuning is on inside an ``autotune_launch_params()`` context (exported as
``coalesced_int4.autotune()``) and in every process started with ``COALESCED_INT4_AUTOTUNE=1``.
While it is on, the first call for a shape with no pick times every combination of the values
of the parameters not passed (a candidate) on random stand-ins of the arguments (real tensors
even while tracing with fake ones): every candidate
first queues its compiles into one pool (``compile_every_candidate_at_once``; where parallel
compile is off they simply run), then each runs once (letting its Triton autotuner pick a
config, timed in CUDA graphs on a side stream; an illegal one raises
``InvalidLaunchParam`` and is skipped), then ``ROUNDS`` interleaved rounds are timed, each a
CUDA graph of the candidate run back to back over copies of the stand-ins that exceed twice
the L2 (as a model's layers run: ``time_back_to_back_us``), and the candidate with the
smallest median wins, ties within 2 % going to the smaller values (the smaller split, then
quantization inside the GEMM). The pick is cached per (decorated function, GPU, argument
shapes/strides/dtypes and scalar arguments), in memory and, on CUDA, in the persistent pick
store, from which every later process on that GPU restores it, tuning or not; the
``LaunchParamStats`` of the tuning in effect record what happened.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import itertools
import logging
import os
import statistics
import threading
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch

from coalesced_int4.kernels.autotune.cuda_graph_timing import copies_beyond_l2, time_back_to_back_us
from coalesced_int4.kernels.autotune.do_bench import cuda_graph_timing
from coalesced_int4.kernels.autotune.persistent import PickStore
from coalesced_int4.kernels.autotune.tuner import compile_every_candidate_at_once
from coalesced_int4.torch_internals import disable_current_modes, set_wrap_triton_enabled, unset_fake_temporarily

logger = logging.getLogger(__name__)

ROUNDS = 3
TIE_RATIO = 1.02
ROTATION_CALLS = 200
"""Calls in one timed graph of a candidate (its copies in turn, repeated)."""


class InvalidLaunchParam(ValueError):
    """A launch parameter value that is illegal for these arguments (e.g. too many splits)."""


@dataclasses.dataclass
class LaunchParamPick:
    """One timed decision. ``times_us`` and ``rejected`` are keyed by the tuple of a
    candidate's values, in the order of ``params``; ``choice`` maps each to its value."""
    function: str
    params: Tuple[str, ...]
    times_us: Dict[Tuple[Any, ...], float]
    rejected: Dict[Tuple[Any, ...], str]
    choice: Dict[str, Any]


@dataclasses.dataclass
class LaunchParamStats:
    measured: int = 0
    cache_hits: int = 0
    restored: int = 0  # picks read from the persistent cache instead of timed
    out_of_memory: int = 0
    picks: List[LaunchParamPick] = dataclasses.field(default_factory=list)  # the timed ones
    choices: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    """The launch parameters each tuned launch ran with, in order, however they were decided
    (timed, cached in this process, restored from the persistent cache, or passed)."""


TUNE_ENV = "COALESCED_INT4_AUTOTUNE"
"""``COALESCED_INT4_AUTOTUNE=1``: tune every shape with no pick on first use, in the whole process."""

_TUNE_FROM_ENVIRONMENT = os.environ.get(TUNE_ENV) == "1"


class _TuningState(threading.local):
    stats = None
    """Each thread's innermost ``autotune_launch_params`` statistics (a class default, so that
    reading it costs no failed lookup: eager calls read it every time)."""


_state = _TuningState()
_cache: Dict[tuple, Any] = {}
"""Picks of this process: timed, or restored from the persistent store."""
_generation = 0
"""Counts the changes of ``_cache``: a decision remembered elsewhere (``decided_values``) holds
while it is unchanged and tuning is off."""
_defaults: Dict[tuple, Any] = {}
"""Shapes with no pick anywhere, and the rule's values they run with while tuning is off (so
the store is read once per shape, and tuning later still times them)."""
_process_stats = LaunchParamStats()
"""What tuning did in a process tuned by ``TUNE_ENV``."""
_lock = threading.RLock()


@contextlib.contextmanager
def autotune_launch_params():
    """Tune launch parameters while active; yields the ``LaunchParamStats``. Nestable."""
    previous = _state.stats
    _state.stats = stats = LaunchParamStats()
    try:
        yield stats
    finally:
        _state.stats = previous


def tuning_stats():
    """The statistics of the tuning in effect (the innermost context's, or the process's
    under ``TUNE_ENV``), or None where tuning is off."""
    stats = _state.stats
    if stats is None and _TUNE_FROM_ENVIRONMENT:
        return _process_stats
    return stats


def generation() -> int:
    """The count of changes of this process's picks (``_generation``)."""
    return _generation


def _remember(key, choice) -> None:
    global _generation
    _cache[key] = choice
    _generation += 1


def clear_launch_param_cache() -> None:
    global _generation
    with _lock:
        _cache.clear()
        _defaults.clear()
        _generation += 1


def _hint(value):
    """A SymInt's example value (its hint); anything else as it is."""
    if isinstance(value, torch.SymInt):
        node = value.node
        return int(node.hint) if node.hint is not None else int(node.shape_env.size_hint(node.expr))
    return value


def _arg_key(value) -> Any:
    if isinstance(value, torch.Tensor):
        return (tuple(_hint(s) for s in value.shape), tuple(_hint(s) for s in value.stride()),
                str(value.dtype))
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _stand_in(value):
    """A real tensor with the shape, strides, dtype and device of ``value``, random data."""
    if not isinstance(value, torch.Tensor):
        return _hint(value)
    shape = [_hint(s) for s in value.shape]
    stride = [_hint(s) for s in value.stride()]
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    flat = torch.empty(span, dtype=value.dtype, device=value.device)
    if value.dtype.is_floating_point:
        flat.normal_(0.0, 0.5)
    elif value.dtype == torch.bool:
        flat.zero_()
    else:
        info = torch.iinfo(value.dtype)
        flat.random_(max(info.min, -128), min(info.max, 127) + 1)
    return flat.as_strided(shape, stride)


def autotune_launch_param(default: Callable[..., Dict[str, Any]] = None, **space: Sequence[Any]):
    """``@autotune_launch_param(split_k=(1, 2, 4), prequantize=(False, True), default=rule)``:
    the launcher's keyword parameters named here are launch parameters. A candidate is one
    value of each parameter not passed explicitly (a dict); near ties go to the smaller
    candidate, compared parameter by parameter in the order declared here. ``rule``, called
    with the launcher's positional arguments, names the values an untuned shape runs with
    while tuning is off (a value outside the space, or a parameter it leaves out, takes the
    parameter's first value)."""
    if not space:
        raise ValueError("autotune_launch_param needs at least one parameter")
    for param, values in space.items():
        if not values:
            raise ValueError(f"autotune_launch_param needs at least one candidate for {param}")
    space = {param: tuple(values) for param, values in space.items()}

    def decorate(fn: Callable) -> Callable:
        name = f"{fn.__module__}.{fn.__qualname__}"
        signature = inspect.signature(fn)
        for param in space:
            if param not in signature.parameters:
                raise TypeError(f"{name} has no parameter '{param}'")
        token = object()

        def untuned(free, args) -> Dict[str, Any]:
            """The rule's values for the free parameters (a value outside the space, or none,
            is the parameter's first)."""
            named = default(*args) if default is not None else {}
            return {p: named[p] if named.get(p) in space[p] else space[p][0] for p in free}

        def decide(stats, free, args, kwargs):
            """The candidate to run with: this process's pick, a stored one, one timed now
            (``stats`` given: tuning is on), or the rule's (tuning is off)."""
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if not tensors:
                raise ValueError("autotune_launch_param needs a tensor argument to time on")
            device = tensors[0].device
            device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
            key = (token, device_name,
                   tuple(_arg_key(a) for a in args),
                   tuple(sorted((k, _arg_key(v)) for k, v in kwargs.items())))
            with _lock:
                if key in _cache:
                    if stats is not None:
                        stats.cache_hits += 1
                    return _cache[key]
                if stats is None and key in _defaults:
                    return _defaults[key]
                candidates = [dict(zip(free, values)) for values in itertools.product(*(space[p] for p in free))]
                store = pick_store(device, device_name)
                stored_key = [name, *key[2:]]
                choice = store.get(stored_key) if store is not None else None
                if choice in candidates:
                    if stats is not None:
                        stats.restored += 1
                elif stats is None:
                    _defaults[key] = untuned(free, args)
                    return _defaults[key]
                else:
                    choice = _measure(fn, name, free, candidates, args, kwargs, stats)
                    if choice is None:  # out of memory twice: untuned, not cached
                        return untuned(free, args)
                    if store is not None:
                        store.put(stored_key, choice)
                _remember(key, choice)
                return choice

        def decided_values(*args, **kwargs) -> Dict[str, Any]:
            """The values of the parameters not passed that a call with these arguments runs
            with (deciding them as a call would)."""
            free = tuple(p for p in space if p not in kwargs)
            if all(len(space[p]) == 1 for p in free):
                return {p: space[p][0] for p in free}
            return decide(tuning_stats(), free, args, kwargs)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            values = decided_values(*args, **kwargs)
            stats = tuning_stats()
            if stats is not None:
                stats.choices.append({p: kwargs.get(p, values.get(p)) for p in space})
            return fn(*args, **kwargs, **values)

        wrapper.decided_values = decided_values
        return wrapper

    return decorate


def pick_store(device: torch.device, device_name: str):
    """Where the launch-parameter picks of a CUDA device persist (None elsewhere)."""
    return PickStore("launch_params", device_name) if device.type == "cuda" else None


def _describe(candidate: Dict[str, Any]) -> str:
    return ", ".join(f"{param}={value}" for param, value in candidate.items())


def time_calls_us(calls) -> float:
    """Device microseconds per call of ``calls`` (one candidate on each copy of its arguments)
    run back to back (tests replace this)."""
    return time_back_to_back_us(calls, min_calls=ROTATION_CALLS, samples=1)


def _argument_sets_beyond_l2(args, kwargs, device: torch.device) -> list:
    """``(args, kwargs)`` and enough random copies of their tensors that together they exceed
    twice the L2, so that a rotation over them reads every call's data from HBM (one set
    where there is no L2 to defeat)."""
    sets = [(args, kwargs)]
    if device.type != "cuda":
        return sets
    tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
    size = sum(t.numel() * t.element_size() for t in tensors)
    for _ in range(copies_beyond_l2(size, device) - 1):
        sets.append(([_stand_in(a) for a in args], {k: _stand_in(v) for k, v in kwargs.items()}))
    return sets


@contextlib.contextmanager
def _timing_stream(device: torch.device):
    """On CUDA: a side stream ordered after the current one, with graph timing active for
    the Triton autotuners (graphs cannot be captured on the legacy default stream)."""
    if device.type != "cuda":
        yield
        return
    outer = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(outer)
    with torch.cuda.stream(side), cuda_graph_timing():
        yield
    outer.wait_stream(side)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _measure(fn, name, params, candidates, args, kwargs, stats):
    """Time every candidate; the pick, or None after running out of memory twice."""
    for _ in range(2):
        try:
            with unset_fake_temporarily(), disable_current_modes(), set_wrap_triton_enabled(False):
                real_args = [_stand_in(a) for a in args]
                real_kwargs = {k: _stand_in(v) for k, v in kwargs.items()}
                device = next(a for a in real_args if isinstance(a, torch.Tensor)).device
                with _timing_stream(device):
                    copies = _argument_sets_beyond_l2(real_args, real_kwargs, device)
                    legal, rejected = [], {}
                    with compile_every_candidate_at_once() as queued:
                        for candidate in candidates:
                            try:
                                fn(*real_args, **real_kwargs, **candidate)
                                legal.append(candidate)
                            except InvalidLaunchParam as error:
                                rejected[tuple(candidate.values())] = str(error)
                    if not legal:
                        raise ValueError(f"{name}: no legal {', '.join(params)} among "
                                         f"{[_describe(c) for c in candidates]}: {rejected}")
                    for candidate in legal if queued else ():  # compiled above; now each one runs
                        fn(*real_args, **real_kwargs, **candidate)
                    samples = [[] for _ in legal]
                    for _ in range(ROUNDS):
                        for candidate, times in zip(legal, samples):
                            times.append(time_calls_us([functools.partial(fn, *a, **kw, **candidate)
                                                        for a, kw in copies]))
            break
        except torch.OutOfMemoryError:
            _free_memory()
    else:
        logger.warning("%s: out of device memory while timing %s candidates; using %s",
                       name, ", ".join(params), _describe(candidates[0]))
        stats.out_of_memory += 1
        return None
    medians = [statistics.median(times) for times in samples]
    fastest = min(medians)
    choice = min((c for c, t in zip(legal, medians) if t <= fastest * TIE_RATIO),
                 key=lambda c: tuple(c.values()))
    times_us = {tuple(c.values()): t for c, t in zip(legal, medians)}
    stats.measured += 1
    stats.picks.append(LaunchParamPick(name, params, times_us, rejected, choice))
    logger.info("%s: %s (%s)", name, _describe(choice),
                "; ".join(f"{_describe(c)}: {t:.1f} us" for c, t in zip(legal, medians)))
    return choice
