"""Sharded, atomic safetensors writing.

``ShardWriter`` takes state-dict entries one at a time, fills shards up to ``max_shard_size``
(the five tensors of a quantized weight always share a shard), and writes each full shard to a
hidden temporary file in the target directory. Only ``commit()`` gives files their real names:
``model.safetensors`` for one shard, else ``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json`` (Hugging Face layout), renamed last. Leaving the ``with`` block
by an exception deletes the temporaries, so a failed save leaves nothing a load would accept and
never touches a checkpoint already in the directory. After a commit, files of an older
checkpoint in the directory that the new one does not use are removed.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Union

import torch
from safetensors.torch import save_file

from coalesced_int4.serialization.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    file_metadata,
    flatten_entry,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: Union[int, str]) -> int:
    """Bytes from an int or a string like ``"500MB"`` (decimal) or ``"2GiB"`` (binary)."""
    if isinstance(size, int) and size > 0:
        return size
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(size))
    if not match or match.group(2).upper() not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"max_shard_size must be a positive size like 500MB, got {size!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def shard_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


class ShardWriter:
    """Accumulates entries into shards on disk; see the module docstring."""

    def __init__(
        self,
        directory: Union[str, Path],
        max_shard_size: Union[int, str] = "5GB",
        metadata: Optional[Mapping[str, str]] = None,
    ):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_shard_size = parse_size(max_shard_size)
        self.user_metadata = dict(metadata or {})
        self.token = uuid.uuid4().hex[:12]
        self._temps: List[Path] = []
        self._shard_keys: List[List[str]] = []
        self._tensors: Dict[str, torch.Tensor] = {}
        self._names: List[str] = []
        self._meta: Dict[str, str] = {}
        self._bytes = 0
        self.total_bytes = 0

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is not None:
            self.abort()

    def add(self, name: str, value: torch.Tensor) -> None:
        stored, meta = flatten_entry(name, value)
        size = sum(t.numel() * t.element_size() for t in stored.values())
        if self._tensors and self._bytes + size > self.max_shard_size:
            self._flush()
        for key, tensor in stored.items():
            # A private contiguous CPU copy: safetensors refuses views and shared storage.
            self._tensors[key] = tensor.detach().to("cpu", copy=True).contiguous()
        self._names.append(name)
        self._meta[name] = meta
        self._bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        temp = self.directory / f".shard{len(self._temps)}.{self.token}.tmp"
        self._temps.append(temp)
        metadata = file_metadata(self._names, self._meta, self.user_metadata)
        save_file(self._tensors, str(temp), metadata=metadata)
        with open(temp, "rb") as handle:
            os.fsync(handle.fileno())
        self._shard_keys.append(list(self._tensors))
        self._tensors, self._names, self._meta, self._bytes = {}, [], {}, 0

    def commit(self) -> List[Path]:
        """Give the shards their names (and write the index); returns the files written."""
        if self._tensors or not self._temps:
            self._flush()
        old_files = _checkpoint_files_in(self.directory)
        count = len(self._temps)
        if count == 1:
            finals = [self.directory / SINGLE_FILE]
            os.replace(self._temps[0], finals[0])
            _remove(self.directory / INDEX_FILE)
        else:
            finals = [self.directory / shard_name(i + 1, count) for i in range(count)]
            index = {
                "metadata": {
                    "total_size": self.total_bytes,
                    "format": FORMAT_NAME,
                    "format_version": FORMAT_VERSION,
                },
                "weight_map": {
                    key: final.name
                    for keys, final in zip(self._shard_keys, finals)
                    for key in keys
                },
            }
            index_temp = self.directory / f".index.{self.token}.tmp"
            self._temps.append(index_temp)
            index_temp.write_text(json.dumps(index, indent=2))
            # The old index goes first, so no moment exists where it names new shards.
            _remove(self.directory / INDEX_FILE)
            for temp, final in zip(self._temps, finals):
                os.replace(temp, final)
            os.replace(index_temp, self.directory / INDEX_FILE)
            finals.append(self.directory / INDEX_FILE)
        self._temps = []
        for stale in old_files - set(finals):
            _remove(stale)
        return finals

    def abort(self) -> None:
        for temp in self._temps:
            _remove(temp)
        self._temps = []


def _checkpoint_files_in(directory: Path) -> set:
    """The files of the checkpoint currently in ``directory`` (to clean up after a commit)."""
    files = set()
    if (directory / SINGLE_FILE).exists():
        files.add(directory / SINGLE_FILE)
    index = directory / INDEX_FILE
    if index.exists():
        files.add(index)
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
            files.update(
                directory / name
                for name in set(weight_map.values())
                if isinstance(name, str) and name == Path(name).name
            )
        except (OSError, ValueError, AttributeError):
            pass  # an unreadable old index: leave its shards alone
    return files


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
