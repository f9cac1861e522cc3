"""Hugging Face transformers on the GPU (skipped without CUDA): a tiny Llama whose hidden size
is not a multiple of 256 (K stored padded), quantized at load, runs the INT4 kernels, and its
compiled static-cache generation (what ``coalesced-int4 generate`` runs) is deterministic and
agrees with the same generation uncompiled."""

import pytest
import torch

import coalesced_int4 as ci4
from coalesced_int4 import hf_tools
from tests.helpers import requires_cuda

pytestmark = requires_cuda
transformers = pytest.importorskip("transformers")


def _tiny_llama(tmp_path):
    config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                                      num_attention_heads=9, num_key_value_heads=3, vocab_size=1000,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)
    quantization = transformers.TorchAoConfig(quant_type=ci4.int4_config())
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization,
                                                              dtype=torch.bfloat16)
    model.generation_config.eos_token_id = None
    return model.to("cuda").eval()


def test_a_quantized_hf_model_runs_the_kernels_and_compiled_generation_matches_eager(tmp_path):
    from coalesced_int4.demo import linear_paths

    model = _tiny_llama(tmp_path)
    ids = torch.tensor([[1, 5, 9, 200, 7, 3, 600, 2]], device="cuda")
    assert "fallback" not in linear_paths(model, ids[:, :1])
    options = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        eager = model.generate(ids, cache_implementation="static", disable_compile=True, **options)
        compiled = model.generate(ids, cache_implementation="static", **options)
        again = model.generate(ids, cache_implementation="static", **options)
    assert torch.equal(compiled.sequences, again.sequences)
    # The compiled step runs the same kernels as eager; Inductor fuses the rest (norms, rotary,
    # softmax) in its own order, so the first step's scores agree closely, not bit for bit.
    first_eager, first_compiled = eager.scores[0].float(), compiled.scores[0].float()
    assert (first_compiled - first_eager).norm() < 0.02 * first_eager.norm()
    assert hf_tools.weight_bytes(model) < 0.6 * sum(p.numel() * 2 for p in model.parameters())
