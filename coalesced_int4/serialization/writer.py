"""Sharded, crash-safe safetensors writing.

``ShardWriter`` takes state-dict entries one at a time, fills shards up to ``max_shard_size``
(the five tensors of a quantized weight always share a shard), and writes each full shard,
synced, to a hidden temporary file in the target directory. Only ``commit()`` gives files their
real names: ``model.safetensors`` for one shard, else ``model.safetensors.index.json`` (Hugging
Face layout) and shards named ``model-0000i-of-0000n.<save id>.safetensors``, where the save id
is new for every save.

Crash safety: readers take the index when there is one, else ``model.safetensors``. A sharded
save renames its shards to names no earlier save used, then replaces the index in one rename;
a single-file save renames its file over ``model.safetensors`` and then removes the index. So
at every moment the directory loads as the old checkpoint or the new one. Only then are the
old checkpoint's files, and the leftovers of earlier crashed saves, removed.

Ownership: the writer refuses, before writing anything, to save into a directory whose
``model.safetensors`` or index it did not write (a dense Hugging Face checkpoint, say), and it
only ever removes files whose names follow its own patterns: it never deletes or overwrites a
file it did not write.
"""

from __future__ import annotations

import json
import os
import re
import uuid
import zlib
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from coalesced_int4.serialization.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    CheckpointError,
    file_metadata,
    flatten_entry,
    written_by_this_library,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SAVE_ID = r"[0-9a-f]{12}"
_OUR_SHARD = re.compile(rf"model-\d{{5}}-of-\d{{5}}\.{_SAVE_ID}\.safetensors")
_OUR_TEMP = re.compile(rf"\.(shard\d+|index)\.{_SAVE_ID}\.tmp")
"""Names only this writer gives files: shards of a save, and the temporaries of a save."""
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


def shard_name(index: int, count: int, save_id: str) -> str:
    return f"model-{index:05d}-of-{count:05d}.{save_id}.safetensors"


def tensor_checksum(tensor: torch.Tensor) -> str:
    """CRC-32 of a tensor's bytes as 8 hex digits: recorded at save, checked by ``verify``."""
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{zlib.crc32(memoryview(data)):08x}"


class ShardWriter:
    """Accumulates entries into shards on disk; see the module docstring."""

    def __init__(
        self,
        directory: Union[str, Path],
        max_shard_size: Union[int, str] = "5GB",
        metadata: Optional[Mapping[str, str]] = None,
    ):
        self.directory = Path(directory)
        self.max_shard_size = parse_size(max_shard_size)
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: is a file; a checkpoint is saved into a directory")
        refuse_foreign_checkpoint(self.directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.user_metadata = dict(metadata or {})
        self.save_id = uuid.uuid4().hex[:12]
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
        temp = self.directory / f".shard{len(self._temps)}.{self.save_id}.tmp"
        self._temps.append(temp)
        checksums = {key: tensor_checksum(tensor) for key, tensor in self._tensors.items()}
        metadata = file_metadata(self._names, self._meta, self.user_metadata, checksums)
        save_file(self._tensors, str(temp), metadata=metadata)
        with open(temp, "rb") as handle:
            os.fsync(handle.fileno())
        self._shard_keys.append(list(self._tensors))
        self._tensors, self._names, self._meta, self._bytes = {}, [], {}, 0

    def commit(self) -> List[Path]:
        """Give the shards their names (and write the index), then remove what the old
        checkpoint and earlier crashed saves left; returns the files written."""
        if self._tensors or not self._temps:
            self._flush()
        index_path = self.directory / INDEX_FILE
        old_shards = _shards_named_by(index_path)
        if len(self._temps) == 1:
            finals = [self.directory / SINGLE_FILE]
            os.replace(self._temps[0], finals[0])  # an index, if any, still wins: the old loads
            _remove(index_path)  # now the new file loads
        else:
            finals = [self.directory / shard_name(i + 1, len(self._temps), self.save_id)
                      for i in range(len(self._temps))]
            index = {
                "metadata": {"total_size": self.total_bytes, "format": FORMAT_NAME,
                             "format_version": FORMAT_VERSION},
                "weight_map": {key: final.name for keys, final in zip(self._shard_keys, finals) for key in keys},
            }
            index_temp = self.directory / f".index.{self.save_id}.tmp"
            self._temps.append(index_temp)
            index_temp.write_text(json.dumps(index, indent=2))
            with open(index_temp, "rb") as handle:
                os.fsync(handle.fileno())
            for temp, final in zip(self._temps, finals):
                os.replace(temp, final)  # new names: nothing the old checkpoint uses changes
            os.replace(index_temp, index_path)  # the one step from the old checkpoint to the new
            _remove(self.directory / SINGLE_FILE)
            finals.append(index_path)
        self._temps = []
        for leftover in [*old_shards, *self.directory.iterdir()]:
            ours = leftover in old_shards or _OUR_SHARD.fullmatch(leftover.name) or _OUR_TEMP.fullmatch(leftover.name)
            if ours and leftover not in finals:
                _remove(leftover)
        return finals

    def abort(self) -> None:
        for temp in self._temps:
            _remove(temp)
        self._temps = []


def refuse_foreign_checkpoint(directory: Path) -> None:
    """Raise if ``directory`` holds a ``model.safetensors`` or an index this library did not
    write, since saving there would replace or orphan another tool's checkpoint."""
    index = directory / INDEX_FILE
    if index.exists() and _our_index(index) is None:
        raise CheckpointError(
            f"{index}: refusing to save over a checkpoint this library did not write (another tool's or "
            f"unreadable index); save into an empty directory or one of our checkpoints")
    single = directory / SINGLE_FILE
    if single.exists() and not _written_by_us(single):
        raise CheckpointError(
            f"{single}: refusing to overwrite a file this library did not write (another tool's or "
            f"unreadable header); save into an empty directory or one of our checkpoints")


def _our_index(index: Path) -> Optional[dict]:
    """The content of the index at ``index`` if this library wrote it, else None."""
    try:
        content = json.loads(index.read_text())
        return content if content["metadata"]["format"] == FORMAT_NAME else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _shards_named_by(index: Path) -> List[Path]:
    """The shard files our index at ``index`` names, if it is ours: plain file names of
    .safetensors files whose header is ours (a tampered index cannot point it elsewhere)."""
    content = _our_index(index)
    weight_map = content.get("weight_map") if content is not None else None
    if not isinstance(weight_map, dict):
        return []
    return [index.parent / name for name in set(weight_map.values())
            if isinstance(name, str) and is_plain_file_name(name) and _written_by_us(index.parent / name)]


def _written_by_us(file: Path) -> bool:
    """A .safetensors file whose header names this library's format."""
    if file.suffix != ".safetensors":
        return False
    try:
        with safe_open(str(file), framework="pt") as handle:
            return written_by_this_library(handle.metadata())
    except (SafetensorError, OSError):
        return False


def is_plain_file_name(name: str) -> bool:
    """A name that stays inside the directory it is joined to: no separators, not . or .."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
