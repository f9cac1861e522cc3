"""Accuracy on a real model and real text (SmolLM2-135M-Instruct, gensim's news text), every
linear quantized: the default quantizer against dense and min-max, and the decode path (W4A8,
one token at a time) against the prefill path."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import coalesced_int4 as ci4
from coalesced_int4 import CudaCoalescedInt4Tensor, accuracy, hf_tools
from coalesced_int4.quantize import dequantize_packed, quantize_weight

WINDOW = 64
WINDOWS = 4


@pytest.fixture(scope="module")
def text():
    import gensim

    return (Path(gensim.__file__).parent / "test" / "test_data" / "lee_background.cor").read_text()


@pytest.fixture(scope="module")
def models(smollm2, smollm2_quantized):
    """The dense model, and the same quantized by each quantizer (the default's is the
    session's model quantized at load)."""
    directory, tokenizer = smollm2
    dense = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    minmax = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    ci4.quantize_(minmax, ci4.int4_config(qparams="minmax"))
    mse = AutoModelForCausalLM.from_pretrained(smollm2_quantized, dtype=torch.bfloat16).eval()
    return dense, {"mse": mse, "minmax": minmax}, tokenizer


def _perplexity(model, tokenizer, text, windows=WINDOWS):
    return hf_tools.perplexity(model, tokenizer, text, WINDOW, WINDOW, windows)


def test_the_default_quantizer_stays_near_dense_and_halves_min_maxs_gap(models, text):
    dense, quantized, tokenizer = models
    base = _perplexity(dense, tokenizer, text)
    mse, minmax = (_perplexity(quantized[q], tokenizer, text) for q in ("mse", "minmax"))
    assert mse < 1.10 * base
    assert mse - base <= 0.5 * (minmax - base), (base, mse, minmax)


def test_the_decode_path_scores_within_one_percent_of_the_prefill_path(models, text):
    _, quantized, tokenizer = models
    model = quantized["mse"]
    # Two windows of 128 tokens: over fewer, one token's log-likelihood moves the ratio by
    # more than the paths differ.
    prefill = hf_tools.perplexity(model, tokenizer, text, 128, 128, max_windows=2)
    decode = accuracy.decode_perplexity(model, tokenizer, text, 128, max_windows=2)
    assert abs(decode / prefill - 1) < 0.01, (prefill, decode)


def test_no_layers_weight_error_exceeds_min_maxs(models):
    dense, quantized, _ = models
    weights = dict(dense.named_parameters())
    for name, module in quantized["mse"].named_modules():
        if isinstance(module, torch.nn.Linear) and isinstance(module.weight, CudaCoalescedInt4Tensor):
            w = weights[f"{name}.weight"].float()
            minmax = dequantize_packed(quantize_weight(w, qparams="minmax"), torch.float32)[:, : w.shape[1]]
            assert (module.weight.dequantize(torch.float32) - w).square().sum() <= (minmax - w).square().sum(), name


def test_layer_output_errors_on_the_texts_activations_are_lower_for_the_default(models, text):
    dense, quantized, tokenizer = models
    mse, minmax = (accuracy.layer_output_errors(quantized[q], tokenizer, text, dense, max_tokens=64)
                   for q in ("mse", "minmax"))
    assert len(mse) == 210 and sum(mse.values()) < sum(minmax.values())
