"""The on-disk form of a state dict (docs/checkpoints.md is the prose version).

A quantized weight named ``<module>.<param>`` is stored as five plain tensors
``<module>._<param>_<component>`` (torchao's safetensors naming), component in
``qdata, scale, scale_step, zero_point, zero_point_step``; a plain tensor keeps its name. Each
file's header metadata holds:

* ``format`` = ``pt`` (the safetensors convention transformers requires) and
  ``coalesced_int4_version`` = ``1``; files written before that header hold ``format`` =
  ``coalesced_int4`` and ``format_version`` instead, and files that transformers'
  ``save_pretrained`` writes hold ``format`` = ``pt`` and no version (read as version 1);
* ``tensor_names``: JSON list of the state-dict names stored in this file;
* ``checksums``: JSON object, stored tensor key -> CRC-32 of its bytes (8 hex digits);
* per name, JSON ``{"_type": "CudaCoalescedInt4Tensor", "_data": {attributes},
  "_tensor_data_names": [...]}`` or ``{"_type": "torch.Tensor"}``.

This module turns state-dict entries into stored tensors plus metadata and back, and checks
every stored component against the attributes (dtype, shape, and steps that are finite and
non-negative), raising ``CheckpointError`` that names the file and the tensor.
"""

from __future__ import annotations

import json
import re
from typing import Dict, Iterator, Mapping, Tuple

import torch

from coalesced_int4.quantize import GROUP_SIZE, SUPER_BLOCK, PackedInt4, stored_k
from coalesced_int4.tensor import CudaCoalescedInt4Tensor

FORMAT_NAME = "coalesced_int4"
FORMAT_VERSION = 1
VERSION_KEY = "coalesced_int4_version"
SAFETENSORS_FORMAT = "pt"
QUANTIZED_TYPE = CudaCoalescedInt4Tensor.__name__
PLAIN_TYPE = torch.Tensor.__name__
RESERVED_METADATA = ("format", "format_version", VERSION_KEY, "tensor_names", "checksums")
STEP_COMPONENTS = ("scale_step", "zero_point_step")


class CheckpointError(ValueError):
    """A checkpoint file or directory that cannot be loaded as it is."""


def component_key(name: str, component: str) -> str:
    """``a.b.weight`` + ``qdata`` -> ``a.b._weight_qdata`` (torchao's convention)."""
    module, _, param = name.rpartition(".")
    prefix = f"{module}." if module else ""
    return f"{prefix}_{param}_{component}"


def flatten_entry(name: str, value: torch.Tensor) -> Tuple[Dict[str, torch.Tensor], str]:
    """The stored tensors of one state-dict entry and its JSON metadata."""
    if isinstance(value, CudaCoalescedInt4Tensor):
        meta = {
            "_type": QUANTIZED_TYPE,
            "_data": {
                "block_size": list(value.block_size),
                "shape": list(value.shape),
                "activation_dtype": {
                    "_type": "torch.dtype",
                    "_data": str(value.activation_dtype).removeprefix("torch."),
                },
            },
            "_tensor_data_names": list(PackedInt4._fields),
        }
        stored = {component_key(name, c): t for c, t in zip(PackedInt4._fields, value.packed)}
        return stored, json.dumps(meta)
    if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
        raise TypeError(
            f"cannot save {name!r}: tensors of type {type(value).__name__} are not supported"
        )
    return {name: value}, json.dumps({"_type": PLAIN_TYPE})


def file_metadata(names, entry_meta: Mapping[str, str], user: Mapping[str, str], checksums: Mapping[str, str]):
    clash = [key for key in user if key in RESERVED_METADATA or key in entry_meta]
    if clash:
        raise ValueError(f"metadata keys {clash} are reserved by the checkpoint format")
    return {
        **{str(k): str(v) for k, v in user.items()},
        "format": SAFETENSORS_FORMAT,
        VERSION_KEY: str(FORMAT_VERSION),
        "tensor_names": json.dumps(list(names)),
        "checksums": json.dumps(dict(checksums)),
        **entry_meta,
    }


def recorded_checksums(file: str, metadata: Mapping[str, str]) -> Dict[str, str]:
    """The stored key -> CRC-32 map of a file; raises where it has none to verify against."""
    try:
        checksums = json.loads(metadata["checksums"])
    except (KeyError, ValueError) as error:
        raise CheckpointError(f"{file}: no readable checksums to verify against ({error}); it was saved "
                              f"without them or its header is damaged")
    if not isinstance(checksums, dict):
        raise CheckpointError(f"{file}: checksums must be a JSON object, got {type(checksums).__name__}")
    return checksums


def written_by_this_library(metadata: Mapping[str, str] | None) -> bool:
    """Whether a file's header is one ``save_quantized`` or the converter wrote."""
    metadata = metadata or {}
    return VERSION_KEY in metadata or metadata.get("format") == FORMAT_NAME


def holds_quantized_weights(metadata: Mapping[str, str] | None) -> bool:
    """Whether a file's header describes any ``CudaCoalescedInt4Tensor`` entry."""
    for value in (metadata or {}).values():
        try:
            if json.loads(value).get("_type") == QUANTIZED_TYPE:
                return True
        except (ValueError, TypeError, AttributeError):
            continue
    return False


def check_file_metadata(file: str, metadata: Mapping[str, str] | None) -> list:
    """The state-dict names a file holds; raises if it is not our format or is newer."""
    metadata = metadata or {}
    if metadata.get("format") == FORMAT_NAME:
        key, version = "format_version", metadata.get("format_version", "")
    elif metadata.get("format") == SAFETENSORS_FORMAT and "tensor_names" in metadata:
        key, version = VERSION_KEY, metadata.get(VERSION_KEY, str(FORMAT_VERSION))
    else:
        raise CheckpointError(
            f"{file}: not a {FORMAT_NAME} checkpoint (header metadata format={metadata.get('format')!r} "
            f"without tensor_names)"
        )
    if not re.fullmatch(r"[0-9]+", version):
        raise CheckpointError(f"{file}: unreadable {key} {version!r}")
    if int(version) > FORMAT_VERSION:
        raise CheckpointError(
            f"{file}: {key} {version} is newer than this library reads "
            f"({FORMAT_VERSION}); upgrade coalesced-int4"
        )
    try:
        names = json.loads(metadata["tensor_names"])
    except (KeyError, ValueError) as error:
        raise CheckpointError(f"{file}: missing or corrupt tensor_names ({error})")
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise CheckpointError(f"{file}: tensor_names must be a JSON list of strings")
    return names


def stored_keys(file: str, name: str, metadata: Mapping[str, str]) -> Iterator[Tuple[str, str]]:
    """(component, stored key) pairs of one state-dict entry; component '' for a plain one."""
    meta = _entry_meta(file, name, metadata)
    if meta["_type"] == PLAIN_TYPE:
        yield "", name
        return
    for component in PackedInt4._fields:
        yield component, component_key(name, component)


def stored_shape(file: str, name: str, metadata: Mapping[str, str], handle) -> Tuple[int, ...]:
    """The state-dict shape of ``name``: from its attributes, or the plain tensor's header."""
    meta = _entry_meta(file, name, metadata)
    if meta["_type"] == PLAIN_TYPE:
        return tuple(handle.get_slice(name).get_shape())
    try:
        return tuple(int(d) for d in meta["_data"]["shape"])
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"{file}: tensor {name!r} has no readable shape ({error})")


def build_entry(
    file: str, name: str, metadata: Mapping[str, str], components: Mapping[str, torch.Tensor]
) -> torch.Tensor:
    """The state-dict value of ``name`` from its stored tensors, every component checked."""
    meta = _entry_meta(file, name, metadata)
    if meta["_type"] == PLAIN_TYPE:
        return components[""]
    attrs = meta.get("_data", {})
    allowed = {str(d).removeprefix("torch."): d for d in CudaCoalescedInt4Tensor.ACTIVATION_DTYPES}
    try:
        n, k = (int(d) for d in attrs["shape"])
        block_size = [int(b) for b in attrs["block_size"]]
        dtype_name = attrs["activation_dtype"]["_data"]
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise CheckpointError(f"{file}: tensor {name!r} has corrupt attributes {attrs} ({error})")
    if dtype_name not in allowed:
        raise CheckpointError(f"{file}: tensor {name!r} declares activation_dtype {dtype_name!r}; a quantized "
                              f"weight's activation dtype must be one of {sorted(allowed)}")
    if block_size != [1, GROUP_SIZE] or k % GROUP_SIZE or n <= 0 or k <= 0:
        raise CheckpointError(
            f"{file}: tensor {name!r} has shape {[n, k]} and block_size {block_size}; "
            f"the format needs block_size [1, {GROUP_SIZE}] and K a multiple of {GROUP_SIZE}"
        )
    stored = stored_k(k)
    expected = {
        "qdata": (torch.uint8, (n, stored // 2)),
        "scale": (torch.uint8, (n, stored // GROUP_SIZE)),
        "scale_step": (torch.float16, (n, stored // SUPER_BLOCK)),
        "zero_point": (torch.uint8, (n, stored // GROUP_SIZE)),
        "zero_point_step": (torch.float16, (n, stored // SUPER_BLOCK)),
    }
    for component, (want_dtype, want_shape) in expected.items():
        got = components[component]
        if got.dtype != want_dtype or tuple(got.shape) != want_shape:
            raise CheckpointError(
                f"{file}: tensor {component_key(name, component)!r} of {name!r} is "
                f"{got.dtype} {tuple(got.shape)}, expected {want_dtype} {want_shape}"
            )
    for component in STEP_COMPONENTS:
        if not steps_are_finite_and_non_negative(components[component]):
            raise CheckpointError(
                f"{file}: tensor {component_key(name, component)!r} of {name!r} holds NaN, Inf or negative "
                f"steps; steps are finite and non-negative (zero where a super-block is all zero)")
    packed = PackedInt4(*(components[c] for c in PackedInt4._fields))
    return CudaCoalescedInt4Tensor.from_packed(packed, activation_dtype=allowed[dtype_name], k=k)


LARGEST_FINITE_FP16_BITS = 0x7BFF


def steps_are_finite_and_non_negative(steps: torch.Tensor) -> bool:
    """fp16 steps that are finite and >= +0: as int16 bit patterns exactly those in
    [0, 0x7BFF] (a set sign bit reads negative, an all-ones exponent above 0x7BFF), so one
    min/max pass over the raw bits decides it."""
    if steps.numel() == 0:
        return True
    low, high = torch.aminmax(steps.view(torch.int16))
    return bool(low >= 0) and bool(high <= LARGEST_FINITE_FP16_BITS)


def _entry_meta(file: str, name: str, metadata: Mapping[str, str]) -> dict:
    try:
        meta = json.loads(metadata[name])
        kind = meta["_type"]
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{file}: tensor {name!r} has no readable metadata entry")
    if kind not in (PLAIN_TYPE, QUANTIZED_TYPE):
        raise CheckpointError(f"{file}: tensor {name!r} has unknown type {kind!r}")
    return meta
