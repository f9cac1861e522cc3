"""``PersistentAutotuner``: Triton's autotuner, with picks kept across processes.

Before tuning a key it looks the key up in the ``PickStore`` of its kernel and GPU; a stored
pick that is still in its config space is installed as if it had just been timed. After a
key is tuned, the pick is stored. ``tuning_key`` reproduces the key Triton's ``Autotuner.run``
caches its pick under (the ``key`` arguments' values, then the dtype of every argument that has
one), so the two never disagree.
"""

from __future__ import annotations

import torch
import triton

from coalesced_int4.kernels.autotune.persistent import PickStore, config_to_json, matching_config


def tuning_key(autotuner: triton.runtime.Autotuner, args, kwargs) -> tuple:
    named = {**dict(zip(autotuner.arg_names, args)), **kwargs}
    named = {name: value for name, value in named.items() if name in autotuner.arg_names}
    key = [named[name] for name in autotuner.keys if name in named]
    key += [str(value.dtype) for value in named.values() if hasattr(value, "dtype")]
    return tuple(key)


class PersistentAutotuner(triton.runtime.Autotuner):
    def run(self, *args, **kwargs):
        store = key = None
        if len(self.configs) > 1:
            key = tuning_key(self, args, kwargs)
            if key not in self.cache:
                store = _store_for(self.base_fn.__name__, args)
                stored = store.get(key) if store is not None else None
                config = matching_config(self.configs, stored) if stored else None
                if config is not None:
                    self.cache[key] = config
                    store = None
        result = super().run(*args, **kwargs)
        if store is not None and key in self.cache:
            store.put(key, config_to_json(self.cache[key]))
        return result


def _store_for(kernel_name: str, args):
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if device is None or device.type != "cuda":
        return None
    return PickStore(kernel_name, torch.cuda.get_device_name(device))


def persistent_autotune(configs, key, prune_configs_by, do_bench):
    """Like ``triton.autotune(...)``, building a ``PersistentAutotuner``."""
    def decorate(fn):
        return PersistentAutotuner(
            fn, fn.arg_names, configs, key, reset_to_zero=None, restore_value=None,
            prune_configs_by=prune_configs_by, do_bench=do_bench,
        )
    return decorate
