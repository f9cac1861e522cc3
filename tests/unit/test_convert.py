"""coalesced-int4 quantize / inspect on synthetic Hugging Face-style checkpoints: what is
quantized and what is copied, side files, the summary, peak memory, and the CLI's errors."""

import json
import subprocess
import sys
import textwrap

import torch
from safetensors.torch import save_file

import coalesced_int4 as ci4
from coalesced_int4 import CudaCoalescedInt4Tensor
from coalesced_int4.cli import main
from coalesced_int4.quantize import quantize_weight


def write_hf_checkpoint(directory, shards, seed=0, rows=256):
    """``shards`` files of a Llama-ish layer each, with an index; returns the dense tensors."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    dense, weight_map = {}, {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {
            f"model.layers.{i}.mlp.up_proj.weight": torch.randn(rows, 512, generator=generator).to(torch.bfloat16),
            f"model.layers.{i}.self_attn.o_proj.weight": torch.randn(256, 256, generator=generator),
            f"model.layers.{i}.mlp.down_proj.weight": torch.randn(64, 576, generator=generator).to(torch.bfloat16),
            f"model.layers.{i}.input_layernorm.weight": torch.ones(512, dtype=torch.float16),
            f"model.layers.{i}.odd_proj.weight": torch.randn(64, 100, generator=generator).half(),
        }
        if i == 0:
            tensors["model.embed_tokens.weight"] = torch.randn(128, 512, generator=generator).to(torch.bfloat16)
        save_file(tensors, str(directory / name))
        dense.update(tensors)
        weight_map.update({k: name for k in tensors})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text('{"model_type": "llama"}')
    (directory / "tokenizer.json").write_text("{}")
    (directory / "pytorch_model.bin").write_bytes(b"not copied")
    return dense


def test_converter_quantizes_linear_weights_and_copies_the_rest(tmp_path):
    dense = write_hf_checkpoint(tmp_path / "src", shards=3)
    code = main(["quantize", str(tmp_path / "src"), str(tmp_path / "dst"), "--max-shard-size", "100KB"])
    assert code == 0
    state = ci4.load_state_dict(tmp_path / "dst")
    assert state.keys() == dense.keys()
    for name, value in state.items():
        quantize = name.endswith(("up_proj.weight", "o_proj.weight", "down_proj.weight"))
        assert isinstance(value, CudaCoalescedInt4Tensor) == quantize, name
        if quantize:  # K = 576 stored padded to 768, keeping its logical shape
            assert value.shape == dense[name].shape, name
            assert all(torch.equal(a, b) for a, b in zip(value.packed, quantize_weight(dense[name])))
        else:
            assert value.dtype == dense[name].dtype and torch.equal(value, dense[name])
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["quantization_config"]["quant_method"] == "torchao"
    assert config["quantization_config"]["quant_type"]["default"]["_type"] == "Int4Config"
    assert (tmp_path / "dst" / "tokenizer.json").exists()
    assert not (tmp_path / "dst" / "pytorch_model.bin").exists()
    assert (tmp_path / "dst" / "model.safetensors.index.json").exists()


def test_include_and_exclude_patterns(tmp_path):
    write_hf_checkpoint(tmp_path / "src", shards=1)
    main(["quantize", str(tmp_path / "src"), str(tmp_path / "dst"), "--exclude", "*o_proj*", "--exclude", "*embed*"])
    state = ci4.load_state_dict(tmp_path / "dst")
    assert isinstance(state["model.layers.0.mlp.up_proj.weight"], CudaCoalescedInt4Tensor)
    assert not isinstance(state["model.layers.0.self_attn.o_proj.weight"], CudaCoalescedInt4Tensor)


def test_summary_and_inspect_report(tmp_path, capsys):
    write_hf_checkpoint(tmp_path / "src", shards=2)
    main(["quantize", str(tmp_path / "src"), str(tmp_path / "dst")])
    summary = capsys.readouterr().out
    assert "6 tensors quantized, 5 copied" in summary and "MiB ->" in summary
    assert main(["inspect", str(tmp_path / "dst"), "--error", str(tmp_path / "src")]) == 0
    report = capsys.readouterr().out
    assert "format_version 1" in report and "quantized weights: 6" in report
    # 4.625 bits per stored weight; down_proj's K of 576 is stored as 768
    stored, logical = 256 * 512 + 256 * 256 + 64 * 768, 256 * 512 + 256 * 256 + 64 * 576
    assert f"{4.625 * stored / logical:.4f} bits per weight" in report and "plain tensors: 5" in report
    snr_lines = [line for line in report.splitlines() if line.strip().endswith("dB")]
    assert len(snr_lines) == 6 and all(15 < float(line.split()[-2]) < 30 for line in snr_lines)


def test_cli_errors_name_the_file_and_exit_2(tmp_path, capsys):
    (tmp_path / "model.safetensors").write_bytes(b"garbage" * 100)
    assert main(["inspect", str(tmp_path)]) == 2
    assert f"{tmp_path / 'model.safetensors'}: not a readable safetensors file" in capsys.readouterr().err


PEAK_SCRIPT = textwrap.dedent("""
    import resource, sys
    from coalesced_int4.serialization.convert import convert_checkpoint
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    convert_checkpoint(sys.argv[1], sys.argv[2], max_shard_size="8MB")
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
""")


def test_converter_peak_memory_stays_near_one_shard(tmp_path):
    # 8 source shards of 16 MiB each (128 MiB in all): the conversion must not hold them all.
    src = tmp_path / "src"
    src.mkdir()
    generator = torch.Generator().manual_seed(0)
    for i in range(8):
        tensors = {f"layers.{i}.proj{j}.weight": torch.randn(1024, 1024, generator=generator) for j in range(4)}
        save_file(tensors, str(src / f"part{i}.safetensors"))
    shard_bytes = 4 * 1024 * 1024 * 4
    result = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(src), str(tmp_path / "dst")],
                            capture_output=True, text=True, check=True)
    growth = int(result.stdout.strip().splitlines()[-1])
    assert growth < 2.5 * shard_bytes, f"peak RSS grew by {growth / 2**20:.0f} MiB"
    assert len(list((tmp_path / "dst").glob("model-*.safetensors"))) > 1
