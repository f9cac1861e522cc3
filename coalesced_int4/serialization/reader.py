"""Reading checkpoints written by ``save_quantized`` (or the converter), shard by shard.

``path`` is a directory holding ``model.safetensors.index.json`` (sharded) or
``model.safetensors``, the index file itself, or a single ``.safetensors`` file. An index may
only name plain file names in its own directory. Every header is read and checked before any
tensor data (names, shapes, a plain tensor's dtype against the model's, no tensor that no entry
claims), so a bad file or a key mismatch fails before the model is touched. With ``verify``,
every stored tensor's CRC-32 is checked against the one recorded at save.
Tensors are then read one entry at a time and handed over at once: peak host memory is about
one tensor beyond what the model holds, and no dense copy of a quantized weight is built.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch
from safetensors import SafetensorError, safe_open

from coalesced_int4.serialization.format import (
    CheckpointError,
    build_entry,
    check_file_metadata,
    recorded_checksums,
    stored_keys,
    stored_shape,
)
from coalesced_int4.serialization.writer import INDEX_FILE, SINGLE_FILE, is_plain_file_name, tensor_checksum
from coalesced_int4.tensor import CudaCoalescedInt4Tensor

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _File:
    path: Path
    names: List[str]  # state-dict names stored in this file
    metadata: Dict[str, str]
    shapes: Dict[str, Tuple[int, ...]]  # of each state-dict entry
    plain_dtypes: Dict[str, Optional[torch.dtype]]  # of each plain entry, as stored


_SAFETENSORS_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def checkpoint_files(path: Union[str, Path]) -> List[Path]:
    """The safetensors files of a checkpoint, in index order."""
    path = Path(path)
    if path.is_file() and path.name == INDEX_FILE:
        path = path.parent
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path}: not a checkpoint (expected a directory, {INDEX_FILE} or a "
                                  f".safetensors file)")
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
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: weight_map must be a non-empty object of tensor key -> file name")
        for key, name in weight_map.items():
            if not (isinstance(name, str) and is_plain_file_name(name) and name.endswith(".safetensors")):
                raise CheckpointError(f"{index}: tensor {key!r} maps to {name!r}; index entries must be plain "
                                      f".safetensors file names inside the checkpoint directory")
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
                shapes, plain_dtypes, claimed = {}, {}, set()
                for name in names:
                    for component, key in stored_keys(str(file), name, metadata):
                        if key not in keys:
                            raise CheckpointError(
                                f"{file}: tensor {key!r} of {name!r} is missing"
                            )
                        claimed.add(key)
                        if not component:
                            plain_dtypes[name] = _SAFETENSORS_DTYPES.get(handle.get_slice(key).get_dtype())
                    shapes[name] = stored_shape(str(file), name, metadata, handle)
                unclaimed = sorted(keys - claimed)
                if unclaimed:
                    raise CheckpointError(f"{file}: tensor {unclaimed[0]!r} is stored but its header lists no "
                                          f"entry it belongs to ({len(unclaimed)} such tensors)")
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{file}: not a readable safetensors file ({error})")
        files.append(_File(file, names, metadata, shapes, plain_dtypes))
    seen: Dict[str, Path] = {}
    for file in files:
        for name in file.names:
            if name in seen:
                raise CheckpointError(f"{file.path}: tensor {name!r} is also in {seen[name]}")
            seen[name] = file.path
    return files


def _read_entries(
    files: List[_File], device, wanted: Optional[set] = None, verify: bool = False
) -> Iterator[Tuple[Path, str, torch.Tensor]]:
    for file in files:
        checksums = recorded_checksums(str(file.path), file.metadata) if verify else {}
        try:
            with safe_open(str(file.path), framework="pt", device="cpu") as handle:
                for name in file.names:
                    if wanted is not None and name not in wanted:
                        continue
                    components = {}
                    for component, key in stored_keys(str(file.path), name, file.metadata):
                        components[component] = handle.get_tensor(key)
                        if verify:
                            _verify(file.path, key, name, components[component], checksums)
                    value = build_entry(str(file.path), name, file.metadata, components)
                    yield file.path, name, value.to(device)
        except SafetensorError as error:
            raise CheckpointError(f"{file.path}: damaged safetensors data ({error})")


def _verify(path: Path, key: str, name: str, tensor: torch.Tensor, checksums: Dict[str, str]) -> None:
    if key not in checksums:
        raise CheckpointError(f"{path}: tensor {key!r} of {name!r} has no recorded checksum")
    actual = tensor_checksum(tensor)
    if actual != checksums[key]:
        raise CheckpointError(f"{path}: tensor {key!r} of {name!r} fails its checksum (recorded "
                              f"{checksums[key]}, read {actual}): the file is damaged")


def verify_checkpoint(path: Union[str, Path]) -> int:
    """Check every stored tensor's CRC-32; returns how many tensors were checked."""
    checked = 0
    for file in _read_headers(path):
        for _ in _read_entries([file], "cpu", verify=True):
            pass
        checked += sum(1 for name in file.names for _ in stored_keys(str(file.path), name, file.metadata))
    return checked


def load_state_dict(path: Union[str, Path], device="cpu", verify: bool = False) -> Dict[str, torch.Tensor]:
    """Every entry of a checkpoint, quantized weights as ``CudaCoalescedInt4Tensor``; with
    ``verify``, every stored tensor's checksum is checked as it is read."""
    return {name: value for _, name, value in _read_entries(_read_headers(path), device, verify=verify)}


def load_quantized(
    model: torch.nn.Module, path: Union[str, Path], device=None, strict: bool = True,
    cast: bool = False, verify: bool = False,
):
    """Load a checkpoint into ``model`` by assignment, entry by entry.

    Works on a model built on the meta device (nothing is materialised but what is read), a
    dense one, or an already quantized one: each parameter or buffer is replaced by the stored
    tensor, placed on ``device`` (default: where the model's tensor is, or the CPU for meta).
    With ``strict``, missing or unexpected keys raise before anything is loaded; otherwise they
    are logged as a warning and skipped. A plain tensor stored in another dtype than the model's
    tensor is an error naming it, unless ``cast`` (then it is cast to the model's dtype).
    ``verify`` checks every stored tensor's checksum as it is read. Returns ``model``.

    A tensor the model holds, or declares, under several names (a head tied to the embedding)
    needs one of them in the checkpoint, as transformers saves it, and is one tensor after
    loading: every name is pointed at what was loaded.

    A tensor still on the meta device afterwards (a key the checkpoint lacks, or a
    non-persistent buffer such as a rotary ``inv_freq``, which checkpoints never hold) would
    crash the first forward, so it is an error naming it: build such models with buffers on a
    real device (accelerate's ``init_empty_weights()`` does, ``torch.device("meta")`` does not).
    """
    files = _read_headers(path)
    state = model.state_dict(keep_vars=True)
    expected = set(state)
    tied = _tied_names(model, state)
    stored = {name: file.path for file in files for name in file.names}
    missing = sorted(name for name in expected if not any(alias in stored for alias in tied[name]))
    unexpected = sorted(stored.keys() - expected)
    if strict and (missing or unexpected):
        lines = [f"{path}: checkpoint and model disagree"]
        lines += [f"  missing from the checkpoint: {name!r}" for name in missing]
        lines += [f"  unexpected in {stored[name]}: {name!r}" for name in unexpected]
        raise CheckpointError("\n".join(lines))
    # Every shape, then every plain dtype, is checked before any data is read.
    for check in (_check_shape, *(() if cast else (_check_plain_dtype,))):
        for file in files:
            for name in file.names:
                if name in expected:
                    check(model, file, name)
    if missing or unexpected:
        logger.warning("%s: loaded with strict=False; missing from the checkpoint: %s; unexpected: %s",
                       path, missing, unexpected)
    for file_path, name, value in _read_entries(files, "cpu", wanted=expected, verify=verify):
        _assign(model, name, value, device, cast)
        for alias in tied[name]:
            if alias != name:
                _tie(model, alias, name)
    left_on_meta = [name for name, tensor in [*model.named_parameters(), *model.named_buffers()] if tensor.is_meta]
    if left_on_meta:
        raise CheckpointError(
            f"{path}: after loading, {len(left_on_meta)} tensors of the model are still on the meta device "
            f"(first: {left_on_meta[0]!r}); the checkpoint does not hold them, so build the model with them "
            f"on a real device (e.g. accelerate's init_empty_weights(), which keeps buffers real)")
    return model


def _tied_names(model: torch.nn.Module, state: Dict[str, torch.Tensor]) -> Dict[str, Tuple[str, ...]]:
    """Each state-dict name -> every name of one tensor (itself included): the names of one
    tensor object, joined with the pairs the model declares tied (transformers'
    ``all_tied_weights_keys``, target -> source: a model built under accelerate's
    ``init_empty_weights`` is not tied yet)."""
    groups: Dict[str, set] = {}

    def join(a: str, b: str) -> None:
        merged = groups.get(a, {a}) | groups.get(b, {b})
        for name in merged:
            groups[name] = merged

    first_name: Dict[int, str] = {}
    for name, tensor in state.items():
        join(first_name.setdefault(id(tensor), name), name)
    for target, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        if target in state and source in state:
            join(target, source)
    return {name: tuple(sorted(groups[name])) for name in state}


def _tie(model: torch.nn.Module, name: str, source: str) -> None:
    """Point ``name`` at the tensor ``source`` now holds."""
    _, module, attr, _ = _owner(model, name)
    value = _owner(model, source)[3]
    if attr in module._parameters:
        module._parameters[attr] = value
    else:
        module._buffers[attr] = value


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


def _check_plain_dtype(model: torch.nn.Module, file: _File, name: str) -> None:
    if name not in file.plain_dtypes:
        return
    module_name, _, _, current = _owner(model, name)
    stored = file.plain_dtypes[name]
    if isinstance(current, CudaCoalescedInt4Tensor) or stored == current.dtype:
        return
    raise CheckpointError(
        f"{file.path}: tensor {name!r} is stored as {stored} but module {module_name or '<root>'!r} holds "
        f"{current.dtype}; pass cast=True to load it cast to the module's dtype")


def _assign(model: torch.nn.Module, name: str, value: torch.Tensor, device, cast: bool) -> None:
    _, module, attr, current = _owner(model, name)
    target = device if device is not None else current.device
    if torch.device(target).type == "meta":
        target = "cpu"
    if cast and not isinstance(value, CudaCoalescedInt4Tensor) and not isinstance(current, CudaCoalescedInt4Tensor):
        value = value.to(current.dtype)
    value = value.to(target)
    if attr in module._parameters:
        trainable = current.requires_grad and not isinstance(value, CudaCoalescedInt4Tensor)
        module._parameters[attr] = torch.nn.Parameter(value, requires_grad=trainable)
    else:
        module._buffers[attr] = value
