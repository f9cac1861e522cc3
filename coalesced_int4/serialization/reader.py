"""Reading checkpoints written by ``save_quantized`` (or the converter), shard by shard.

``path`` is a directory holding ``model.safetensors.index.json`` (sharded) or
``model.safetensors``, or a single ``.safetensors`` file. Every header is read and checked
before any tensor data, so a bad file or a key mismatch fails before the model is touched.
Tensors are then read one entry at a time and handed over at once: peak host memory is about
one tensor beyond what the model holds, and no dense copy of a quantized weight is built.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch
from safetensors import SafetensorError, safe_open

from coalesced_int4.serialization.format import (
    CheckpointError,
    build_entry,
    check_file_metadata,
    stored_keys,
    stored_shape,
)
from coalesced_int4.serialization.writer import INDEX_FILE, SINGLE_FILE
from coalesced_int4.tensor import CudaCoalescedInt4Tensor
from coalesced_int4.torch_internals import IncompatibleKeys


@dataclasses.dataclass
class _File:
    path: Path
    names: List[str]  # state-dict names stored in this file
    metadata: Dict[str, str]
    shapes: Dict[str, Tuple[int, ...]]  # of each state-dict entry


def checkpoint_files(path: Union[str, Path]) -> List[Path]:
    """The safetensors files of a checkpoint, in index order."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint file or directory")
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = list(dict.fromkeys(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"{index}: unreadable index ({error})")
        for name in names:
            if not (path / name).is_file():
                example = next(k for k, v in weight_map.items() if v == name)
                raise CheckpointError(
                    f"{index}: shard {name} is missing (it holds {example!r} and more)"
                )
        return [path / name for name in names]
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    raise CheckpointError(f"{path}: holds neither {INDEX_FILE} nor {SINGLE_FILE}")


def _read_headers(path: Union[str, Path]) -> List[_File]:
    files = []
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt") as handle:
                metadata = handle.metadata() or {}
                names = check_file_metadata(str(file), metadata)
                keys = set(handle.keys())
                shapes = {}
                for name in names:
                    for component, key in stored_keys(str(file), name, metadata):
                        if key not in keys:
                            raise CheckpointError(
                                f"{file}: tensor {key!r} of {name!r} is missing"
                            )
                    shapes[name] = stored_shape(str(file), name, metadata, handle)
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{file}: not a readable safetensors file ({error})")
        files.append(_File(file, names, metadata, shapes))
    seen: Dict[str, Path] = {}
    for file in files:
        for name in file.names:
            if name in seen:
                raise CheckpointError(f"{file.path}: tensor {name!r} is also in {seen[name]}")
            seen[name] = file.path
    return files


def _read_entries(
    files: List[_File], device, wanted: Optional[set] = None
) -> Iterator[Tuple[Path, str, torch.Tensor]]:
    for file in files:
        try:
            with safe_open(str(file.path), framework="pt", device="cpu") as handle:
                for name in file.names:
                    if wanted is not None and name not in wanted:
                        continue
                    components = {
                        component: handle.get_tensor(key)
                        for component, key in stored_keys(str(file.path), name, file.metadata)
                    }
                    value = build_entry(str(file.path), name, file.metadata, components)
                    yield file.path, name, value.to(device)
        except SafetensorError as error:
            raise CheckpointError(f"{file.path}: damaged safetensors data ({error})")


def load_state_dict(path: Union[str, Path], device="cpu") -> Dict[str, torch.Tensor]:
    """Every entry of a checkpoint, quantized weights as ``CudaCoalescedInt4Tensor``."""
    return {name: value for _, name, value in _read_entries(_read_headers(path), device)}


def load_quantized(
    model: torch.nn.Module, path: Union[str, Path], device=None, strict: bool = True
):
    """Load a checkpoint into ``model`` by assignment, entry by entry.

    Works on a model built on the meta device (nothing is materialised but what is read), a
    dense one, or an already quantized one: each parameter or buffer is replaced by the stored
    tensor, placed on ``device`` (default: where the model's tensor is, or the CPU for meta).
    With ``strict``, missing or unexpected keys raise before anything is loaded; otherwise they
    are returned like ``nn.Module.load_state_dict`` does. Returns the model's
    ``IncompatibleKeys(missing_keys, unexpected_keys)``.
    """
    files = _read_headers(path)
    expected = set(model.state_dict(keep_vars=True))
    stored = {name: file.path for file in files for name in file.names}
    missing = sorted(expected - stored.keys())
    unexpected = sorted(stored.keys() - expected)
    if strict and (missing or unexpected):
        lines = [f"{path}: checkpoint and model disagree"]
        lines += [f"  missing from the checkpoint: {name!r}" for name in missing]
        lines += [f"  unexpected in {stored[name]}: {name!r}" for name in unexpected]
        raise CheckpointError("\n".join(lines))
    for file in files:  # every shape is checked before any data is read
        for name in file.names:
            if name in expected:
                _check_shape(model, file, name)
    for file_path, name, value in _read_entries(files, "cpu", wanted=expected):
        _assign(model, name, value, device)
    return IncompatibleKeys(missing, unexpected)


def _owner(model: torch.nn.Module, name: str):
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    current = module._parameters.get(attr)
    if current is None:
        current = module._buffers.get(attr)
    return module_name, module, attr, current


def _check_shape(model: torch.nn.Module, file: _File, name: str) -> None:
    module_name, _, _, current = _owner(model, name)
    shape = file.shapes[name]
    if tuple(current.shape) != shape:
        raise CheckpointError(
            f"{file.path}: tensor {name!r} has shape {list(shape)} but module "
            f"{module_name or '<root>'!r} expects {list(current.shape)}"
        )


def _assign(model: torch.nn.Module, name: str, value: torch.Tensor, device) -> None:
    _, module, attr, current = _owner(model, name)
    target = device if device is not None else current.device
    if torch.device(target).type == "meta":
        target = "cpu"
    value = value.to(target)
    if attr in module._parameters:
        trainable = current.requires_grad and not isinstance(value, CudaCoalescedInt4Tensor)
        module._parameters[attr] = torch.nn.Parameter(value, requires_grad=trainable)
    else:
        module._buffers[attr] = value
