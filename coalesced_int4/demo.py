"""``python -m coalesced_int4 demo``: the whole workflow on a small built-in decoder.

Builds the seeded demo decoder in bf16, quantizes a copy, saves it, reloads it into a model
built on the meta device (logits must match bit for bit), generates greedily eager and under
``torch.compile``, and prints a report: weight bytes saved, agreement of the quantized logits
with bf16, tokens/s, and which linear path ran (the Triton INT4 kernels on a GPU, the dequant
fallback on a CPU). Runs offline on any machine; a few tens of seconds on two CPU cores.
"""

from __future__ import annotations

import collections
import copy
import tempfile
import time
from typing import Callable

import torch
import torch.nn.functional as F

from coalesced_int4.config import int4_config, quantize_
from coalesced_int4.decoder import DEMO, Decoder, build_decoder, decode_step, generate
from coalesced_int4.serialization import load_quantized, save_quantized
from coalesced_int4.tensor import CudaCoalescedInt4Tensor
from coalesced_int4.torch_internals import TorchDispatchMode

PROMPT_LEN = 16


class _OpCounter(TorchDispatchMode):
    """Counts the ATen/custom ops a region runs."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def linear_paths(model: Decoder, token: torch.Tensor, position: torch.Tensor) -> str:
    """Which path the quantized linears took in one eager decode step."""
    quantized = sum(
        isinstance(m.weight, CudaCoalescedInt4Tensor)
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    )
    with torch.no_grad(), _OpCounter() as counter:
        decode_step(model, token, position)
    kernels = {op: n for op, n in counter.counts.items() if "int4_quantized_gemm" in op}
    fallback = quantized - sum(kernels.values())
    parts = [f"Triton INT4 GEMM {op.split('.')[-1]} x{n}" for op, n in sorted(kernels.items())]
    if fallback:
        parts.append(f"dequant + F.linear fallback x{fallback}")
    return ", ".join(parts) + f" (of {quantized} quantized linears per step)"


def _tokens_per_second(run: Callable[[], torch.Tensor], new_tokens: int, batch: int) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return batch * new_tokens / (time.perf_counter() - start)


def run_demo(new_tokens: int = 32, compile: bool = True, device=None, out=print) -> dict:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = DEMO
    out(f"coalesced-int4 demo on {device}: decoder with {config.n_layers} layers, dim "
        f"{config.dim}, vocab {config.vocab_size}; {new_tokens} new tokens")
    dense = build_decoder(config, seed=0, device=device)
    generator = torch.Generator(device="cpu").manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (1, PROMPT_LEN), generator=generator).to(device)

    dense_tokens, _ = generate(dense, prompt, new_tokens)
    dense_tps = _tokens_per_second(lambda: generate(dense, prompt, new_tokens), new_tokens, 1)

    model = copy.deepcopy(dense)
    quant_config = int4_config()
    quantize_(model, quant_config)
    out(f"quantized: {quant_config.report.summary()}")

    with tempfile.TemporaryDirectory() as directory:
        files = save_quantized(model, directory)
        on_disk = sum(f.stat().st_size for f in files)
        with torch.device("meta"):
            reloaded = Decoder(config).to(torch.bfloat16)
        load_quantized(reloaded, directory, device=device)
    out(f"checkpoint: {len(files)} file(s), {on_disk / 2**20:.2f} MiB on disk")

    # Teacher-forced logits over the bf16 model's own continuation.
    sequence = torch.cat([prompt, dense_tokens], dim=1)
    positions = torch.arange(sequence.shape[1], device=device)
    with torch.no_grad():
        for m in (dense, model, reloaded):
            m.setup_cache(1)
        dense_logits = dense(sequence, positions)
        quant_logits = model(sequence, positions)
        reloaded_logits = reloaded(sequence, positions)
    identical = torch.equal(quant_logits, reloaded_logits)
    agreement = (dense_logits.argmax(-1) == quant_logits.argmax(-1)).float().mean().item()
    cosine = F.cosine_similarity(dense_logits, quant_logits, dim=-1).mean().item()
    out(f"reloaded from meta device: logits {'bit-identical' if identical else 'DIFFER'}")
    out(f"logits vs bf16: top-1 agreement {agreement:.3f}, mean cosine {cosine:.5f}")

    model.setup_cache(1)
    path = linear_paths(model, prompt[:, -1:], torch.tensor([PROMPT_LEN], device=device))
    out(f"linear path: {path}")

    eager_tokens, _ = generate(model, prompt, new_tokens)
    eager_tps = _tokens_per_second(lambda: generate(model, prompt, new_tokens), new_tokens, 1)
    report = {
        "device": str(device),
        "bytes_before": quant_config.report.bytes_before,
        "bytes_after": quant_config.report.bytes_after,
        "reload_identical": identical,
        "top1_agreement": agreement,
        "cosine": cosine,
        "dense_tokens_per_s": dense_tps,
        "eager_tokens_per_s": eager_tps,
        "path": path,
    }
    out(f"tokens/s: bf16 eager {dense_tps:.1f}, int4 eager {eager_tps:.1f}")
    if compile:
        mode = "reduce-overhead" if device.type == "cuda" else None
        step = torch.compile(decode_step, fullgraph=True, mode=mode)
        start = time.perf_counter()
        compiled_tokens, _ = generate(model, prompt, new_tokens, step=step)
        compile_s = time.perf_counter() - start
        compiled_tps = _tokens_per_second(
            lambda: generate(model, prompt, new_tokens, step=step), new_tokens, 1
        )
        same = torch.equal(compiled_tokens, eager_tokens)
        out(f"tokens/s: int4 compiled {compiled_tps:.1f} (first run with compile "
            f"{compile_s:.1f} s); compiled tokens {'match' if same else 'DIFFER from'} eager")
        report.update(compiled_tokens_per_s=compiled_tps, compiled_matches_eager=same)
    return report
