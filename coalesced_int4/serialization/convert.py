"""Converting a Hugging Face safetensors checkpoint, and inspecting one of ours.

``convert_checkpoint(src, dst)`` streams the source one tensor at a time: a tensor is quantized
when it is a 2-D floating ``*.weight`` whose K is a multiple of 32 (stored padded to whole
super-blocks of 256), its name matches an ``include`` pattern and no ``exclude`` pattern
(fnmatch; embeddings are excluded by default), and, where the source has a ``config.json``
that transformers can build a model from (on the meta device), it is the weight of one of that
model's ``nn.Linear`` modules: so GPT-2's ``Conv1D`` weights and position embeddings stay
dense. Everything else is copied as it is. Output shards are flushed as they fill, so peak
memory is about one source shard plus one output shard.
``config.json`` (with a ``quantization_config`` that lets transformers' ``from_pretrained`` read
the output), ``generation_config.json`` and tokenizer files are copied along.

Before anything is written the converter checks that SRC and DST do not overlap, that DST is
not a file, that every source header is readable, that the source is not already one of our
checkpoints, and that copying the side files would overwrite no other file in DST; a tensor it
cannot quantize (NaN or Inf, an fp8 weight) is named with its file.

``inspect_checkpoint(path)`` summarises a checkpoint of ours, and with a dense source
checkpoint, the per-layer dequantization SNR.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import math
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from coalesced_int4.quantize import unpackable_reason
from coalesced_int4.serialization.format import FORMAT_NAME, FORMAT_VERSION, CheckpointError, holds_quantized_weights
from coalesced_int4.serialization.reader import checkpoint_files, load_state_dict, verify_checkpoint
from coalesced_int4.serialization.writer import INDEX_FILE, ShardWriter
from coalesced_int4.tensor import CudaCoalescedInt4Tensor

logger = logging.getLogger(__name__)

DEFAULT_EXCLUDE = ("*embed*",)
QUANTIZABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SIDE_FILES = ("config.json", "generation_config.json", "special_tokens_map.json",
               "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja")


@dataclasses.dataclass
class ConversionSummary:
    quantized: int = 0
    copied: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    files: List[Path] = dataclasses.field(default_factory=list)

    def __str__(self) -> str:
        ratio = self.bytes_in / max(self.bytes_out, 1)
        return (
            f"{self.quantized} tensors quantized, {self.copied} copied; "
            f"{self.bytes_in / 2**20:.1f} MiB -> {self.bytes_out / 2**20:.1f} MiB "
            f"({ratio:.2f}x smaller) in {self.seconds:.1f} s, {len(self.files)} files"
        )


def source_files(src: Path) -> List[Path]:
    """The safetensors files of a Hugging Face checkpoint (file, index, or directory)."""
    if src.is_file():
        return [src]
    if (src / INDEX_FILE).exists():
        return checkpoint_files(src)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{src}: no .safetensors files")
    return files


def linear_weight_names(src: Path) -> Optional[Set[str]]:
    """The names of the ``nn.Linear`` weights of the model ``src/config.json`` describes, built
    on the meta device with transformers (also without the base model's prefix, as checkpoints
    of a base model store them); None (quantize by name) where there is no config, no
    transformers, or a config it cannot build."""
    config_path = src / "config.json" if src.is_dir() else src.parent / "config.json"
    if not config_path.is_file():
        return None
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return None
    try:
        config = AutoConfig.from_pretrained(config_path.parent)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, OSError) as error:
        logger.warning("%s: transformers cannot build the model it describes (%s); quantizing by tensor name",
                       config_path, str(error).splitlines()[0])
        return None
    prefix = f"{model.base_model_prefix}." if model.base_model_prefix else ""
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            names.add(f"{module_name}.weight")
            if prefix and module_name.startswith(prefix):
                names.add(f"{module_name[len(prefix):]}.weight")
    return names


def should_quantize(
    name: str, tensor_shape: Sequence[int], dtype: torch.dtype,
    include: Sequence[str], exclude: Sequence[str], linear_weights: Optional[Set[str]] = None,
) -> bool:
    """A floating ``*.weight`` the format can hold, selected by the patterns, and (where the
    model's structure is known) the weight of an ``nn.Linear``."""
    if not name.endswith(".weight") or dtype not in QUANTIZABLE_DTYPES:
        return False
    if linear_weights is not None and name not in linear_weights:
        return False
    if unpackable_reason(torch.empty(tensor_shape, dtype=dtype, device="meta")) is not None:
        return False
    return selected(name, include, exclude)


def selected(name: str, include: Sequence[str], exclude: Sequence[str]) -> bool:
    """Whether a tensor name matches an ``include`` pattern and no ``exclude`` pattern."""
    matches = lambda patterns: any(fnmatch.fnmatchcase(name, p) for p in patterns)  # noqa: E731
    return matches(include) and not matches(exclude)


def _source_tensors(files: List[Path]) -> Iterator[Tuple[Path, str, "safe_open"]]:
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield file, name, handle
        except SafetensorError as error:
            raise CheckpointError(f"{file}: not a readable safetensors file ({error})")


def _check_paths(src: Path, dst: Path) -> None:
    """SRC exists, DST is not a file, and neither lies inside the other."""
    if not src.exists():
        raise CheckpointError(f"{src}: no such source file or directory")
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst}: is a file; the converter writes into a directory")
    source, target = src.resolve(), dst.resolve()
    if source == target or source in target.parents or target in source.parents:
        raise CheckpointError(f"source {src} and destination {dst} overlap; convert into a separate directory "
                              f"(writing there could overwrite the source)")


def _check_sources(files: List[Path], include: Sequence[str], exclude: Sequence[str]) -> int:
    """Every source header readable and not ours, no fp8 weight selected for quantization;
    returns the number of tensors."""
    total = 0
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                if holds_quantized_weights(handle.metadata()):
                    raise CheckpointError(f"{file}: is already a {FORMAT_NAME} checkpoint; nothing to convert")
                for name in handle.keys():
                    piece = handle.get_slice(name)
                    dtype = piece.get_dtype()
                    fp8_weight = dtype.startswith("F8") and name.endswith(".weight") and len(piece.get_shape()) == 2
                    if fp8_weight and selected(name, include, exclude):
                        raise CheckpointError(f"{file}: tensor {name!r} is {dtype}; the converter quantizes bf16, "
                                              f"fp16 or fp32 weights (dequantize the fp8 checkpoint first)")
                total += len(handle.keys())
        except (SafetensorError, OSError) as error:
            raise CheckpointError(f"{file}: not a readable safetensors file ({error})")
    return total


def hf_quantization_config() -> dict:
    """The ``quantization_config`` of a Hugging Face ``config.json`` that makes
    ``from_pretrained`` read our weights: transformers' ``TorchAoConfig`` with ``Int4Config``."""
    from torchao.core.config import config_to_dict

    from coalesced_int4.config import Int4Config

    return {"quant_method": "torchao", "quant_type": {"default": config_to_dict(Int4Config())},
            "modules_to_not_convert": None, "include_input_output_embeddings": False,
            "untie_embedding_weights": False}


def _side_files(src: Path, dst: Path) -> Dict[str, bytes]:
    """The source's config and tokenizer files as they will be written (``config.json`` with
    our ``quantization_config``); raises if one would overwrite a different file in DST."""
    if not src.is_dir():
        return {}
    sides = {side.name: side.read_bytes() for side in sorted(src.iterdir())
             if side.is_file() and (side.name in _SIDE_FILES or side.name.startswith("tokenizer"))}
    if "config.json" in sides:
        try:
            config = json.loads(sides["config.json"])
        except ValueError as error:
            raise CheckpointError(f"{src / 'config.json'}: unreadable JSON ({error})")
        config["quantization_config"] = hf_quantization_config()
        sides["config.json"] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    for name, content in sides.items():
        target = dst / name
        if target.exists() and target.read_bytes() != content:
            raise CheckpointError(f"{target}: exists and differs from what the conversion writes; "
                                  f"refusing to overwrite it")
    return sides


def convert_checkpoint(
    src: Union[str, Path],
    dst: Union[str, Path],
    include: Sequence[str] = ("*",),
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
    device: Union[str, torch.device] = "cpu",
    max_shard_size: Union[int, str] = "5GB",
) -> ConversionSummary:
    src, dst = Path(src), Path(dst)
    _check_paths(src, dst)
    files = source_files(src)
    total = _check_sources(files, include, exclude)
    linear_weights = linear_weight_names(src)
    sides = _side_files(src, dst)
    summary = ConversionSummary()
    start = time.perf_counter()
    with ShardWriter(dst, max_shard_size, {"source": src.name}) as writer:
        progress = tqdm(total=total, desc="quantizing", unit="tensor", disable=None)
        for file, name, handle in _source_tensors(files):
            tensor = handle.get_tensor(name)
            summary.bytes_in += tensor.numel() * tensor.element_size()
            if should_quantize(name, tensor.shape, tensor.dtype, include, exclude, linear_weights):
                try:
                    quantized = CudaCoalescedInt4Tensor.from_float(tensor.to(device))
                except ValueError as error:
                    raise CheckpointError(f"{file}: tensor {name!r} cannot be quantized: {error}") from None
                writer.add(name, quantized)
                summary.quantized += 1
            else:
                writer.add(name, tensor)
                summary.copied += 1
            progress.update()
        progress.close()
        summary.files = writer.commit()
    summary.bytes_out = writer.total_bytes
    for name, content in sides.items():
        (dst / name).write_bytes(content)
    summary.seconds = time.perf_counter() - start
    return summary


def inspect_checkpoint(path: Union[str, Path], dense_source: Optional[Union[str, Path]] = None,
                       verify: bool = False) -> str:
    """A printable report: format, counts, bytes, bits per weight, optional per-layer SNR;
    ``verify`` checks every stored tensor's checksum first (a mismatch raises)."""
    checked = verify_checkpoint(path) if verify else None
    state = load_state_dict(path)
    quantized = {k: v for k, v in state.items() if isinstance(v, CudaCoalescedInt4Tensor)}
    plain = {k: v for k, v in state.items() if k not in quantized}
    q_bytes = sum(t.numel() * t.element_size() for v in quantized.values() for t in v.packed)
    q_weights = sum(v.shape.numel() for v in quantized.values())
    p_bytes = sum(v.numel() * v.element_size() for v in plain.values())
    lines = [
        f"checkpoint: {path} (format_version {FORMAT_VERSION}, {len(checkpoint_files(path))} files)",
        f"quantized weights: {len(quantized)} ({q_weights:,} weights, {q_bytes / 2**20:.2f} MiB, "
        f"{8 * q_bytes / max(q_weights, 1):.4f} bits per weight)",
        f"plain tensors: {len(plain)} ({p_bytes / 2**20:.2f} MiB)",
        f"total: {(q_bytes + p_bytes) / 2**20:.2f} MiB",
    ]
    if checked is not None:
        lines.append(f"verified: {checked} stored tensors match their checksums")
    if dense_source is not None:
        lines.append("per-layer dequantization SNR against the dense source:")
        for name, snr in layer_snr(quantized, source_files(Path(dense_source))).items():
            lines.append(f"  {name}: {snr:.2f} dB")
    return "\n".join(lines)


def layer_snr(quantized: Dict[str, CudaCoalescedInt4Tensor], dense_files: List[Path]) -> Dict[str, float]:
    """10*log10(|w|^2 / |w - dequant(w)|^2) per quantized weight found in the dense files."""
    result = {}
    for file, name, handle in _source_tensors(dense_files):
        if name in quantized:
            if tuple(handle.get_slice(name).get_shape()) != tuple(quantized[name].shape):
                raise CheckpointError(f"{file}: tensor {name!r} is {handle.get_slice(name).get_shape()} in the dense "
                                      f"source but {list(quantized[name].shape)} in the checkpoint: not its source")
            dense = handle.get_tensor(name).double()
            error = dense - quantized[name].dequantize(torch.float32).double()
            result[name] = 10 * math.log10(dense.pow(2).sum() / error.pow(2).sum().clamp_min(1e-300))
    missing = sorted(set(quantized) - set(result))
    if missing:
        raise CheckpointError(f"dense source lacks {len(missing)} quantized tensors, e.g. {missing[0]!r}")
    return dict(sorted(result.items()))
