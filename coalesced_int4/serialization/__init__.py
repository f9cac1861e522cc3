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
    """
    if isinstance(model_or_state_dict, torch.nn.Module):
        state_dict = model_or_state_dict.state_dict()
    else:
        state_dict = model_or_state_dict
    with ShardWriter(path, max_shard_size, metadata) as writer:
        for name, value in tqdm(state_dict.items(), desc="saving", unit="tensor", disable=None):
            writer.add(name, value)
        return writer.commit()


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
