"""``PersistentAutotuner``: Triton's autotuner, with picks kept across processes, untuned
shapes compiled in parallel, and tuned shapes traced with their pick alone.

- Before tuning a key it looks the key up in its own ``PickStore`` (its ``name`` and the GPU;
  ``pick``); a stored pick still in its config space is installed as if it had just been
  timed. After a key is tuned, the pick is stored. The store is named per autotuner, not
  per JIT function: autotuners of one kernel that differ in constexpr arguments outside the
  key (one per bucket) have different best configs for the same key.
- An untuned key on real tensors first compiles every pruned config at once on a thread pool
  through Triton's async compile (``precompile_untuned_configs``), since a cold start is
  compile-bound; only where CPython's ``ast`` is thread safe (3.11.8+ / 3.12.2+). A failing
  precompile is logged and the configs compile one by one as usual.
- ``compile_every_candidate_at_once()`` widens that to a launch-parameter prepass: while it is
  open, launches only queue their compiles (untuned configs through ``PersistentAutotuner``,
  fixed-config kernels such as the split-K reduction through ``launch_or_queue``) into one
  pool, which finishes them all on exit, so every split candidate compiles in parallel before
  any is timed.
- ``tuned_kernel`` hands tracing (torch.compile, AOTInductor) a single-config autotuner for a
  tuned key, one object per config around the same JIT function, so Inductor compiles only
  the pick and does not time again; an untuned key gets the full autotuner.
- ``tuning_key`` reproduces the key Triton's ``Autotuner.run`` caches its pick under (the
  ``key`` arguments' values, then the dtype of every argument that has one).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch
import triton

from coalesced_int4.kernels.autotune.persistent import PickStore, config_to_json, matching_config
from coalesced_int4.kernels.runtime import recorded_call
from coalesced_int4.torch_internals import is_fake

try:
    from triton.runtime import _async_compile
except ImportError:  # a Triton without async compile compiles serially
    _async_compile = None

logger = logging.getLogger(__name__)
_queuing_only = contextvars.ContextVar("coalesced_int4_queuing_only", default=False)


def tuning_key(autotuner: triton.runtime.Autotuner, args, kwargs) -> tuple:
    named = {**dict(zip(autotuner.arg_names, args)), **kwargs}
    named = {name: value for name, value in named.items() if name in autotuner.arg_names}
    key = [named[name] for name in autotuner.keys if name in named]
    key += [str(value.dtype) for value in named.values() if hasattr(value, "dtype")]
    return tuple(key)


class PersistentAutotuner(triton.runtime.Autotuner):
    def __init__(self, *args, name: Optional[str] = None, **kwargs):
        """Triton's arguments, and ``name``: the name of its stored picks (None: not stored)."""
        super().__init__(*args, **kwargs)
        self.name = name

    def pick(self, key: tuple, args) -> Optional[triton.Config]:
        """The config ``key`` runs: this process's pick, else a stored one (installed as if it
        had just been timed), else None (untuned)."""
        if key not in self.cache:
            store = _store_for(self.name, args)
            stored = store.get(key) if store is not None else None
            config = matching_config(self.configs, stored) if stored else None
            if config is not None:
                self.cache[key] = config
        return self.cache.get(key)

    def run(self, *args, **kwargs):
        key = tuning_key(self, args, kwargs) if len(self.configs) > 1 else None
        picked = self.pick(key, args) if key is not None else None
        tuning = key is not None and picked is None
        if queuing_only():  # compile what the real launch will run: every config, or the pick
            _queue_compiles(self if picked is None else single_config(self, picked), args, kwargs)
            return None
        if tuning:
            precompile_untuned_configs(self, args, kwargs)
        result = super().run(*args, **kwargs)
        if tuning and key in self.cache:
            store = _store_for(self.name, args)
            if store is not None:
                store.put(key, config_to_json(self.cache[key]))
        return result


@functools.lru_cache(maxsize=None)
def single_config(autotuner: triton.runtime.Autotuner, config: triton.Config):
    """An autotuner of ``config`` alone around ``autotuner``'s JIT function (compiled binaries
    are shared); one object per (autotuner, config)."""
    return PersistentAutotuner(autotuner.fn, autotuner.fn.arg_names, [config], autotuner.keys,
                               reset_to_zero=None, restore_value=None)


def tuned_kernel(autotuner: PersistentAutotuner, args, kwargs):
    """The single-config autotuner of this key's pick, or ``autotuner`` if it is untuned."""
    if len(autotuner.configs) <= 1:
        return autotuner
    config = autotuner.pick(tuning_key(autotuner, args, kwargs), args)
    return autotuner if config is None else single_config(autotuner, config)


@functools.lru_cache(maxsize=None)
def parallel_compile_available() -> bool:
    """Triton has async compile, and CPython's ast is thread safe (3.11.8+, 3.12.2+)."""
    if _async_compile is None:
        return False
    version = tuple(sys.version_info[:3])
    return (3, 11, 8) <= version < (3, 12) or version >= (3, 12, 2)


@contextlib.contextmanager
def compile_pool():
    """Triton's async compile on a thread pool. A compile that fails in the pool is dropped
    there; the kernel's own launch then compiles it again and raises where it is used."""
    workers = max(1, min(32, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as executor, \
            _async_compile.AsyncCompileMode(executor, ignore_errors=True):
        yield


def queuing_only() -> bool:
    """Whether launches only queue their compiles (inside ``compile_every_candidate_at_once``)."""
    return _queuing_only.get()


@contextlib.contextmanager
def compile_every_candidate_at_once():
    """Yields whether the launches inside only queue their compiles. Where parallel compile is
    available, one pool receives every compile those launches would do, nothing is launched,
    and leaving finishes every compile; elsewhere (gated off) no pool opens and the launches
    run as usual."""
    if not parallel_compile_available():
        yield False
        return
    with compile_pool():
        token = _queuing_only.set(True)
        try:
            yield True
        finally:
            _queuing_only.reset(token)


def launch_or_queue(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, or only its compile while queuing."""
    if queuing_only():
        kernel.warmup(*args, grid=grid, **kwargs)
    else:
        recorded_call.run_kernel(kernel, grid, *args, **kwargs)


def _queue_compiles(autotuner, args, kwargs) -> None:
    """Submit every pruned config's compile to the active pool, without launching. A failure
    is logged; the launch then compiles config by config."""
    # Launch-only keywords (kernel[grid](...) passes grid and warmup to Autotuner.run).
    meta = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
    try:
        autotuner.warmup(*args, grid=(1,), **meta)
    except Exception as error:
        logger.warning("parallel precompile of %s failed: %s", autotuner.base_fn.__name__, error)


def precompile_untuned_configs(autotuner, args, kwargs) -> None:
    """Compile every pruned config of an untuned key in parallel, without launching."""
    if not parallel_compile_available() or len(autotuner.configs) <= 1:
        return
    if any(isinstance(a, torch.Tensor) and is_fake(a) for a in args):
        return
    if tuning_key(autotuner, args, kwargs) in autotuner.cache:
        return
    with compile_pool():
        _queue_compiles(autotuner, args, kwargs)


def _store_for(name: Optional[str], args):
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if name is None or device is None or device.type != "cuda":
        return None
    return PickStore(name, torch.cuda.get_device_name(device))


def persistent_autotune(configs, key, prune_configs_by, do_bench, name: str):
    """Like ``triton.autotune(...)``, building a ``PersistentAutotuner`` whose picks are stored
    under ``name`` (one name per autotuner)."""
    def decorate(fn):
        return PersistentAutotuner(
            fn, fn.arg_names, configs, key, reset_to_zero=None, restore_value=None,
            prune_configs_by=prune_configs_by, do_bench=do_bench, name=name,
        )
    return decorate
