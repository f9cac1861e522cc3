"""Hugging Face transformers end to end on a tiny Llama (CPU, the dequantize fallback):
quantize at load with ``TorchAoConfig(quant_type=Int4Config())``, ``save_pretrained``,
``from_pretrained`` of the result, our reader on transformers' files, and transformers on the
converter's output."""

import json
import re
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, TorchAoConfig

import coalesced_int4 as ci4
from coalesced_int4 import CudaCoalescedInt4Tensor
from coalesced_int4.cli import main
from tests.helpers import run_compiling_python

TOKENS = torch.tensor([[1, 5, 9, 200, 7, 3, 600, 2]])


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    """A dense bf16 Llama with hidden 256 (every projection's K a multiple of 256), untied head."""
    directory = tmp_path_factory.mktemp("dense")
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return directory


def _quantized_at_load(directory):
    return AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=TorchAoConfig(quant_type=ci4.int4_config()), dtype=torch.bfloat16)


def _linear_weights(model):
    return {name: module.weight for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}


def _quantize_all_but_head(model):
    ci4.quantize_(model, ci4.int4_config(), filter_fn=lambda m, fqn: isinstance(m, torch.nn.Linear) and fqn != "lm_head")
    return model


def test_from_pretrained_quantizes_every_block_linear_at_load_as_quantize_does(dense_dir):
    model = _quantized_at_load(dense_dir)
    weights = _linear_weights(model)
    # transformers' torchao integration keeps the output embedding (lm_head) dense by default.
    assert not isinstance(weights.pop("lm_head"), CudaCoalescedInt4Tensor)
    assert len(weights) == 2 * 7 and all(isinstance(w, CudaCoalescedInt4Tensor) for w in weights.values())
    reference = _quantize_all_but_head(AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.bfloat16))
    for name, weight in weights.items():
        assert all(torch.equal(a, b) for a, b in zip(weight.packed, _linear_weights(reference)[name].packed)), name
    assert torch.equal(model(TOKENS).logits, reference(TOKENS).logits)


def test_include_input_output_embeddings_quantizes_the_head_and_keeps_the_embedding_dense(dense_dir):
    config = TorchAoConfig(quant_type=ci4.int4_config(), include_input_output_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(dense_dir, quantization_config=config, dtype=torch.bfloat16)
    assert isinstance(model.lm_head.weight, CudaCoalescedInt4Tensor)
    assert not isinstance(model.model.embed_tokens.weight, CudaCoalescedInt4Tensor)
    assert torch.isfinite(model(TOKENS).logits).all()


def test_save_pretrained_then_from_pretrained_gives_the_same_quantized_model(dense_dir, tmp_path):
    model = _quantized_at_load(dense_dir)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert config["quant_type"]["default"]["_type"] == "Int4Config"
    assert "report" not in config["quant_type"]["default"]["_data"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert isinstance(reloaded.model.layers[1].mlp.down_proj.weight, CudaCoalescedInt4Tensor)
    assert torch.equal(reloaded(TOKENS).logits, model(TOKENS).logits)


def test_a_model_loaded_from_a_quantized_checkpoint_saves_again_under_the_names_it_holds(dense_dir, tmp_path):
    """transformers 5.25's default save_pretrained of such a model fails (its torchao loading
    conversion has no reverse); save_original_format=False, the documented way, writes what
    from_pretrained reads."""
    _quantized_at_load(dense_dir).save_pretrained(tmp_path / "first")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "first", dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError):
        loaded.save_pretrained(tmp_path / "default")
    loaded.save_pretrained(tmp_path / "again", save_original_format=False)
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again", dtype=torch.bfloat16)
    assert isinstance(again.model.layers[1].mlp.down_proj.weight, CudaCoalescedInt4Tensor)
    assert torch.equal(again(TOKENS).logits, loaded(TOKENS).logits)


def test_our_reader_loads_what_save_pretrained_wrote(dense_dir, tmp_path, capsys):
    model = _quantized_at_load(dense_dir)
    model.save_pretrained(tmp_path)
    state = ci4.load_state_dict(tmp_path)
    assert isinstance(state["model.layers.0.mlp.up_proj.weight"], CudaCoalescedInt4Tensor)
    expected = model.state_dict()
    for name, value in state.items():
        if isinstance(value, CudaCoalescedInt4Tensor):
            assert all(torch.equal(a, b) for a, b in zip(value.packed, expected[name].packed)), name
        else:
            assert torch.equal(value, expected[name]), name
    assert main(["inspect", str(tmp_path)]) == 0
    assert "quantized weights: 14" in capsys.readouterr().out


def test_the_converters_output_loads_with_from_pretrained(dense_dir, tmp_path):
    assert main(["quantize", str(dense_dir), str(tmp_path / "q")]) == 0
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.bfloat16)
    # The converter quantizes every linear weight, the head included.
    assert all(isinstance(w, CudaCoalescedInt4Tensor) for w in _linear_weights(converted).values())
    reference = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.bfloat16)
    ci4.quantize_(reference, ci4.int4_config())
    assert torch.equal(converted(TOKENS).logits, reference(TOKENS).logits)


def test_registration_works_when_transformers_was_imported_first():
    child = run_compiling_python(textwrap.dedent("""
        import transformers.quantizers.quantizer_torchao as hf
        import coalesced_int4
        quantizer = hf.TorchAoHfQuantizer.__new__(hf.TorchAoHfQuantizer)
        quantizer.pre_quantized = True
        quantizer.metadata = {}
        print(sorted(quantizer.serialized_names["weight"]))
    """))
    assert child.returncode == 0, child.stderr[-2000:]
    names = child.stdout.strip().splitlines()[-1]
    assert "'_weight_scale_step'" in names and "'_weight_zero_point_step'" in names


def test_a_head_tied_to_the_embedding_stays_dense_and_tied(tmp_path):
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    quant = ci4.int4_config()
    ci4.quantize_(model, quant)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not isinstance(model.lm_head.weight, CudaCoalescedInt4Tensor)
    assert quant.report.quantized == 7
    assert any("tied across model.embed_tokens, lm_head" in reason for _, reason in quant.report.skipped)
    # The report counts only what was quantized: the tied head's bytes are not claimed as saved.
    assert quant.report.bytes_before == sum(
        w.numel() * 2 for name, w in _linear_weights(model).items() if name != "lm_head")
    model.tie_weights()  # what transformers does after loading: nothing to undo
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, CudaCoalescedInt4Tensor)
    assert torch.isfinite(model(TOKENS).logits).all()


def test_gpt2_conv1d_layers_are_reported_as_left_dense():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=1, n_head=4, vocab_size=1000, n_positions=64))
    model = model.to(torch.bfloat16)
    quant = ci4.int4_config()
    ci4.quantize_(model, quant)
    reasons = [reason for _, reason in quant.report.skipped]
    assert sum("is a transformers Conv1D" in reason for reason in reasons) == 4
    assert any("tied across transformer.wte, lm_head" in reason for reason in reasons)
    assert quant.report.quantized == 0 and torch.isfinite(model(TOKENS).logits).all()


def _continue(model, tokenizer, prompt="The capital of Germany is", tokens=6):
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False)
    return tokenizer.decode(out[0][ids.shape[1]:])


def test_smollm2_knows_berlin_dense_quantized_and_after_a_round_trip(smollm2, smollm2_quantized):
    dense_dir, tokenizer = smollm2
    dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.bfloat16)
    assert "Berlin" in _continue(dense, tokenizer)
    quant = ci4.int4_config()
    ci4.quantize_(dense, quant)
    # Every projection of the 30 layers (K = 576 stored padded to 768, the down projections'
    # K = 1536); the head is tied to the embedding and stays dense.
    assert quant.report.quantized == 210 and len(quant.report.skipped) == 1
    assert "Berlin" in _continue(dense, tokenizer)
    reloaded = AutoModelForCausalLM.from_pretrained(smollm2_quantized, dtype=torch.bfloat16)
    assert isinstance(reloaded.model.layers[3].mlp.down_proj.weight, CudaCoalescedInt4Tensor)
    assert all(torch.equal(a, b) for a, b in zip(reloaded.model.layers[3].mlp.down_proj.weight.packed,
                                                  dense.model.layers[3].mlp.down_proj.weight.packed))
    assert "Berlin" in _continue(reloaded, tokenizer)


TEXT = ("The city council met on Tuesday to discuss the new budget. Members argued about the cost of "
        "repairing the old bridge, which has been closed since the spring floods. The mayor said the "
        "work would start next month and take about a year. Local shops hope the reopening will bring "
        "back the visitors they lost when the road was cut. ") * 3


def test_a_converted_checkpoint_generates_and_a_gguf_file_quantizes_at_load(smollm2, tmp_path, capsys):
    """``quantize`` converts SmolLM2 (K = 576, stored padded to 768) into a checkpoint that
    ``generate`` continues a prompt from; ``eval --quantize`` takes the GGUF file itself, which
    is written as a dense checkpoint first (transformers takes no quantization config with a
    GGUF file) and quantized as it loads."""
    from coalesced_int4 import hf_tools

    assert main(["quantize", str(smollm2[0]), str(tmp_path / "int4")]) == 0
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "int4"), "--prompt", "The capital of Germany is", "--max-new-tokens", "6",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "Berlin" in out and "tokens/s" in out
    weights_mib = float(re.search(r"weights ([0-9.]+) MiB", out).group(1))
    assert weights_mib < 160  # quantized: 256.6 MiB dense, 127.2 with every linear but the tied head in int4
    (tmp_path / "text.txt").write_text(TEXT)
    assert main(["eval", str(hf_tools.smollm2_gguf()), "--quantize", "--text", str(tmp_path / "text.txt"), "--window", "64",
                 "--stride", "64", "--max-windows", "1", "--device", "cpu"]) == 0
    assert float(re.search(r"perplexity ([0-9.]+)", capsys.readouterr().out).group(1)) < 100


def test_strided_perplexity_matches_one_window_and_the_eval_command_runs(smollm2, smollm2_quantized, tmp_path,
                                                                        capsys):
    from coalesced_int4 import hf_tools

    dense_dir, tokenizer = smollm2
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.bfloat16)
    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        whole = float(torch.exp(model(ids, labels=ids).loss))
    assert hf_tools.perplexity(model, tokenizer, TEXT, window=ids.shape[1], stride=ids.shape[1]) == pytest.approx(
        whole, rel=1e-6)
    strided = hf_tools.perplexity(model, tokenizer, TEXT, window=64, stride=32)
    assert 1.0 < strided < 100 and strided > whole * 0.9  # less context a token: no better than one window
    (tmp_path / "text.txt").write_text(TEXT)
    assert main(["eval", str(smollm2_quantized), "--text", str(tmp_path / "text.txt"), "--window", "64",
                 "--stride", "32", "--max-windows", "2", "--device", "cpu"]) == 0
    assert "perplexity " in capsys.readouterr().out


def test_weight_bytes_count_a_tied_storage_once():
    from coalesced_int4 import hf_tools

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    unique = {id(p): p for p in model.parameters()}
    expected = sum(p.numel() * p.element_size() for p in unique.values()) + sum(
        b.untyped_storage().nbytes() for b in model.buffers())
    assert hf_tools.weight_bytes(model) == expected


def test_the_converter_decides_by_structure_and_leaves_gpt2_conv1d_and_embeddings_dense(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=256, n_layer=1, n_head=4, vocab_size=1000, n_positions=64))
    model = model.to(torch.bfloat16).eval()
    model.save_pretrained(tmp_path / "gpt2")
    assert main(["quantize", str(tmp_path / "gpt2"), str(tmp_path / "q")]) == 0
    state = ci4.load_state_dict(tmp_path / "q")
    # By name alone c_attn.weight (256 x 768), wte and wpe would have been quantized.
    assert not any(isinstance(value, CudaCoalescedInt4Tensor) for value in state.values())
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.bfloat16)
    assert torch.equal(converted(TOKENS).logits, model(TOKENS).logits)


def _tiny(architecture):
    """A tiny randomly initialised model of ``architecture`` (hidden 96: K = 96 and 160 are
    stored padded to 256), bf16."""
    import transformers

    sizes = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=320, max_position_embeddings=128)
    configs = {
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {}),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 24}),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 24}),
        "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    }
    config_class, model_class, extra = configs[architecture]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**sizes, **extra)
    return getattr(transformers, model_class)(config).to(torch.bfloat16).eval()


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "phi3"])
def test_each_architecture_quantizes_at_load_saves_reloads_and_generates(architecture, tmp_path):
    dense = _tiny(architecture)
    dense.save_pretrained(tmp_path / "dense")
    model = _quantized_at_load(tmp_path / "dense").eval()
    linears = _linear_weights(model)
    head = linears.pop("lm_head")
    assert linears and all(isinstance(w, CudaCoalescedInt4Tensor) for w in linears.values())
    assert not isinstance(head, CudaCoalescedInt4Tensor)
    with torch.no_grad():
        logits = model(TOKENS % 320).logits
        dense_logits = dense(TOKENS % 320).logits
    assert torch.isfinite(logits).all()
    # Quantization moves the logits, but no further than its own weight error explains.
    assert (logits - dense_logits).float().norm() < 0.5 * dense_logits.float().norm()
    model.save_pretrained(tmp_path / "quantized")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "quantized", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(TOKENS % 320).logits, logits)
    out = reloaded.generate(TOKENS[:, :4] % 320, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 8)


def test_load_quantized_fills_a_meta_model_whose_head_is_tied_and_keeps_the_tie(tmp_path):
    """transformers saves a tied head as the embedding alone; loading our converted checkpoint
    into a meta-built model (whose tie transformers declares but has not made) fills both
    names with the one loaded tensor."""
    from accelerate import init_empty_weights

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "dense")
    assert main(["quantize", str(tmp_path / "dense"), str(tmp_path / "q")]) == 0
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "q", dtype=torch.bfloat16)
    with init_empty_weights():  # parameters on the meta device (not tied yet), buffers (rotary inv_freq) real
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert ci4.load_quantized(model, tmp_path / "q") is model
    assert model.lm_head.weight is model.model.embed_tokens.weight and not model.lm_head.weight.is_meta
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, CudaCoalescedInt4Tensor)
    assert torch.equal(model(TOKENS).logits, reference(TOKENS).logits)
