"""Autotune picks that outlive the process, so a second run on the same GPU skips timing.

Picks (the Triton config an autotuner chose, the split-K a launcher chose) are stored as JSON,
one file per (kind, GPU name, Triton version, hash of this package's kernel sources), in
``$COALESCED_INT4_CACHE_DIR``, else ``$XDG_CACHE_HOME/coalesced_int4``, else
``~/.cache/coalesced_int4``. ``COALESCED_INT4_AUTOTUNE_CACHE=0`` turns it off. Any change of
GPU, Triton or kernel code selects another file; a file that is unreadable, corrupt or whose
recorded identity does not match is ignored (debug log) and rewritten by the next pick.
Writes are atomic (temporary file + rename), so concurrent processes never read half a file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

import triton

from coalesced_int4.source_hash import source_hash

logger = logging.getLogger(__name__)

DIRECTORY_ENV = "COALESCED_INT4_CACHE_DIR"
SWITCH_ENV = "COALESCED_INT4_AUTOTUNE_CACHE"
FORMAT_VERSION = 1


def cache_directory() -> Optional[Path]:
    """Where picks are kept, or None when the cache is turned off."""
    if os.environ.get(SWITCH_ENV, "1") == "0":
        return None
    if os.environ.get(DIRECTORY_ENV):
        return Path(os.environ[DIRECTORY_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "coalesced_int4"


def kernel_source_hash() -> str:
    """Hash of every source file of ``coalesced_int4.kernels``: a kernel change is a miss."""
    return source_hash("kernels")


class PickStore:
    """The picks of one kind on one GPU: ``get(key)`` / ``put(key, value)``, JSON values."""

    def __init__(self, kind: str, gpu_name: str):
        self.identity = {
            "format": FORMAT_VERSION,
            "kind": kind,
            "gpu": gpu_name,
            "triton": triton.__version__,
            "kernels": kernel_source_hash(),
        }
        tag = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:16]
        directory = cache_directory()
        self.path = None if directory is None else directory / f"{kind}-{tag}.json"

    def _read(self) -> dict:
        if self.path is None or not self.path.exists():
            return {}
        try:
            content = json.loads(self.path.read_text())
            if content.get("identity") != self.identity or not isinstance(content.get("picks"), dict):
                raise ValueError("identity mismatch or no picks")
            return content["picks"]
        except (OSError, ValueError, AttributeError) as error:
            logger.debug("ignoring autotune cache %s: %s", self.path, error)
            return {}

    def get(self, key: Any) -> Optional[Any]:
        return self._read().get(_text(key))

    def put(self, key: Any, value: Any) -> None:
        if self.path is None:
            return
        picks = self._read()
        picks[_text(key)] = value
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temp = tempfile.mkstemp(dir=self.path.parent, prefix=".picks.", suffix=".tmp")
            with os.fdopen(handle, "w") as out:
                json.dump({"identity": self.identity, "picks": picks}, out)
            os.replace(temp, self.path)
        except OSError as error:  # a read-only home must not break a launch
            logger.debug("could not write autotune cache %s: %s", self.path, error)


def _text(key: Any) -> str:
    return json.dumps(key, default=str)


def config_to_json(config: triton.Config) -> dict:
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps,
            "num_stages": config.num_stages, "maxnreg": config.maxnreg}


def matching_config(configs, stored: dict) -> Optional[triton.Config]:
    """The config of ``configs`` equal to a stored one (a stored pick outside the current
    space, from an older space, is not trusted)."""
    return next((c for c in configs if config_to_json(c) == stored), None)
