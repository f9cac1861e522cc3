"""Safetensors checkpoints of quantized models: ``save_quantized``, ``load_quantized``,
``load_state_dict``, and the Hugging Face converter. The format is in docs/checkpoints.md."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Optional, Union

import torch
from tqdm.auto import tqdm

from coalesced_int4.serialization.format import (
    FORMAT_NAME,
    FORMAT_VERSION,
    CheckpointError,
)
from coalesced_int4.serialization.reader import load_quantized, load_state_dict
from coalesced_int4.serialization.writer import ShardWriter, parse_size


def save_quantized(
    model_or_state_dict: Union[torch.nn.Module, Mapping[str, torch.Tensor]],
    path: Union[str, Path],
    max_shard_size: Union[int, str] = "5GB",
    metadata: Optional[Mapping[str, str]] = None,
):
    """Write a model's state dict (or a state dict) to the directory ``path``.

    Quantized weights are stored as their five tensors, everything else as it is. One file
    ``model.safetensors`` while the total fits ``max_shard_size`` (bytes, or a string such as
    ``"500MB"``), else numbered shards and ``model.safetensors.index.json``. ``metadata``
    (str -> str) is added to every file's header. Atomic: see ``ShardWriter``. Returns the
    paths written.

    A tensor-parallel model (DTensor parameters: ``parallelize_module``, or ``from_pretrained``
    with a ``tp_plan`` of a quantized checkpoint) is saved whole: every rank calls
    ``save_quantized``, each DTensor is gathered (``full_tensor()``) in turn, and rank 0 writes
    the checkpoint the unsharded model gives; the other ranks write nothing and return [].
    """
    if isinstance(model_or_state_dict, torch.nn.Module):
        state_dict = model_or_state_dict.state_dict()
    else:
        state_dict = model_or_state_dict
    sharded = [name for name, value in state_dict.items() if _is_dtensor(value)]
    if sharded and torch.distributed.get_rank() != 0:
        for name in sharded:  # the gathers rank 0 waits for
            state_dict[name].full_tensor()
        return []
    with ShardWriter(path, max_shard_size, metadata) as writer:
        for name, value in tqdm(state_dict.items(), desc="saving", unit="tensor", disable=None):
            writer.add(name, value.full_tensor() if _is_dtensor(value) else value)
        return writer.commit()


def _is_dtensor(value) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "CheckpointError",
    "ShardWriter",
    "load_quantized",
    "load_state_dict",
    "parse_size",
    "save_quantized",
]
