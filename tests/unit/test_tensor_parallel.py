"""Tensor parallelism with PyTorch's DTensor on the CPU: two processes over gloo, each rank
holding its shard of quantized weights, against the same quantized model unsharded.

One two-process job (``_job``) runs every case and writes each rank's findings to JSON; the
tests read them. Sharded outputs add partial sums across ranks in bf16, so they equal the
unsharded ones within bf16 rounding, not bit for bit; gathered weights equal bit for bit."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

WORLD = 2
HIDDEN, INTERMEDIATE = 512, 1024
"""Every row-wise shard of K (HIDDEN / 2, INTERMEDIATE / 2) holds whole super-blocks of 256."""
BF16_TOLERANCE = 2 ** -6
"""Largest difference allowed, relative to the output's largest magnitude."""


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down = torch.nn.Linear(INTERMEDIATE, HIDDEN, bias=True)

    def forward(self, x):
        return self.down(F.relu(self.up(x)))


def _quantized_mlp():
    import coalesced_int4 as ci4

    torch.manual_seed(0)
    model = _MLP().to(torch.bfloat16)
    ci4.quantize_(model, ci4.int4_config())
    return model


def _relative_error(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _job(rank: int, port: int, directory: str) -> None:
    """Every case, on one rank; findings to ``directory/rank{rank}.json``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import AutoModelForCausalLM, TorchAoConfig

    import coalesced_int4 as ci4

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    found = {}
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    # parallelize_module: the up projection column-wise, the down projection row-wise.
    model = _quantized_mlp()
    want = model(x)
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}, src_data_rank=None)
    found["mlp_local_shapes"] = [list(model.up.weight.to_local().shape), list(model.down.weight.to_local().shape)]
    found["mlp_error"] = _relative_error(model(x), want)

    # Each placement of one weight, built from this rank's part.
    weight = _quantized_mlp().up.weight.detach()
    want = F.linear(x, weight)
    rows, columns = INTERMEDIATE // WORLD, HIDDEN // WORLD
    parts = {"Shard(0)": (weight[rank * rows:(rank + 1) * rows], Shard(0), Replicate()),
             "Shard(1)": (weight[:, rank * columns:(rank + 1) * columns], Shard(1), Shard(1)),
             "Replicate": (weight, Replicate(), Replicate())}
    for name, (local, placement, x_placement) in parts.items():
        sharded = DTensor.from_local(local, mesh, [placement])
        x_local = x if x_placement == Replicate() else x[:, rank * columns:(rank + 1) * columns]
        out = F.linear(DTensor.from_local(x_local, mesh, [x_placement]), sharded)
        found[f"{name}_error"] = _relative_error(out.full_tensor(), want)
        found[f"{name}_gathered_bits"] = all(torch.equal(a, b) for a, b in zip(sharded.full_tensor().packed,
                                                                                weight.packed))

    # A sharded model saves whole and loads unsharded.
    parallel = _quantized_mlp()
    parallelize_module(parallel, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()}, src_data_rank=None)
    written = ci4.save_quantized(parallel, Path(directory) / "saved")
    found["files_written"] = len(written)
    dist.barrier()
    with torch.device("meta"):
        reloaded = _MLP().to(torch.bfloat16)
    reloaded = ci4.load_quantized(reloaded, Path(directory) / "saved")
    original = _quantized_mlp()
    found["reloaded_bits"] = all(torch.equal(a, b) for a, b in zip(reloaded.down.weight.packed,
                                                                    original.down.weight.packed))

    # Without src_data_rank=None DTensor would scatter from one rank, which needs an empty
    # quantized weight: refused, saying how to shard.
    try:
        parallelize_module(_quantized_mlp(), mesh, {"up": ColwiseParallel()})
        found["scatter_refusal"] = ""
    except NotImplementedError as error:
        found["scatter_refusal"] = str(error)

    # The built-in decoder, quantized, then sharded: a prefill and greedy decode steps.
    from coalesced_int4.decoder import DecoderConfig, build_decoder, generate, parallelize

    config = DecoderConfig(vocab_size=256, dim=HIDDEN, n_layers=2, n_heads=8, n_kv_heads=4,
                           intermediate_size=INTERMEDIATE, max_seq_len=32)
    decoder = build_decoder(config, seed=3)
    ci4.quantize_(decoder, ci4.int4_config())
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(4))
    want_tokens, want_logits = generate(decoder, prompt, 4)
    parallelize(decoder, mesh)
    tokens, logits = generate(decoder, prompt, 4)
    found["decoder_local_rows"] = [decoder.layers[0].attention.wqkv.weight.to_local().shape[0],
                                   decoder.output.weight.to_local().shape[0]]
    found["decoder_error"] = _relative_error(logits, want_logits)
    found["decoder_tokens_equal"] = torch.equal(tokens, want_tokens)

    # A Hugging Face Llama with tp_plan="auto": a quantized checkpoint sharded at load, and a
    # dense one quantized at load shard by shard.
    ids = torch.randint(0, 512, (1, 7), generator=torch.Generator().manual_seed(2))
    quantized_dir, dense_dir = Path(directory) / "llama-int4", Path(directory) / "llama"
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(quantized_dir, dtype=torch.bfloat16)(ids).logits
        sharded = AutoModelForCausalLM.from_pretrained(quantized_dir, dtype=torch.bfloat16, tp_plan="auto")
        down = sharded.model.layers[0].mlp.down_proj.weight
        found["hf_down_placements"] = str(getattr(down, "placements", None))
        found["hf_error"] = _relative_error(sharded(ids).logits, want)
        at_load = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.bfloat16, tp_plan="auto",
                                                       quantization_config=TorchAoConfig(quant_type=ci4.int4_config()))
        found["hf_at_load_error"] = _relative_error(at_load(ids).logits, want)
    (Path(directory) / f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def findings(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, TorchAoConfig

    import coalesced_int4 as ci4

    directory = tmp_path_factory.mktemp("tensor-parallel")
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory / "llama")
    AutoModelForCausalLM.from_pretrained(directory / "llama", dtype=torch.bfloat16,
                                         quantization_config=TorchAoConfig(quant_type=ci4.int4_config())
                                         ).save_pretrained(directory / "llama-int4")
    port = _free_port()
    code = ("import sys; from tests.unit.test_tensor_parallel import _job; "
            f"_job(int(sys.argv[1]), {port}, {str(directory)!r})")
    root = Path(__file__).resolve().parents[2]
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(rank)], cwd=root, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(WORLD)]
    outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    for rank, output in zip(ranks, outputs):
        assert rank.returncode == 0, output[-3000:]
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_a_quantized_mlp_sharded_column_then_row_wise_matches_the_unsharded_one(findings):
    for found in findings:
        assert found["mlp_local_shapes"] == [[INTERMEDIATE // WORLD, HIDDEN], [HIDDEN, INTERMEDIATE // WORLD]]
        assert found["mlp_error"] <= BF16_TOLERANCE


@pytest.mark.parametrize("placement", ["Shard(0)", "Shard(1)", "Replicate"])
def test_each_placement_of_a_quantized_weight_runs_its_shard_and_gathers_bit_for_bit(findings, placement):
    for found in findings:
        assert found[f"{placement}_error"] <= BF16_TOLERANCE
        assert found[f"{placement}_gathered_bits"]


def test_a_sharded_model_is_saved_whole_by_rank_0_and_loads_unsharded(findings):
    assert [found["files_written"] for found in findings] == [1, 0]
    assert all(found["reloaded_bits"] for found in findings)


def test_sharding_with_a_scatter_from_one_rank_is_refused_naming_src_data_rank_none(findings):
    assert all("src_data_rank=None" in found["scatter_refusal"] for found in findings)


def test_the_built_in_decoder_sharded_after_quantizing_decodes_as_unsharded(findings):
    head_dim = HIDDEN // 8
    for found in findings:
        assert found["decoder_local_rows"] == [(8 + 2 * 4) * head_dim // WORLD, 256 // WORLD]
        assert found["decoder_error"] <= BF16_TOLERANCE and found["decoder_tokens_equal"]


def test_a_hugging_face_llama_with_tp_plan_auto_matches_the_unsharded_quantized_model(findings):
    for found in findings:
        assert found["hf_down_placements"] == "(Shard(dim=1),)"
        assert found["hf_error"] <= BF16_TOLERANCE and found["hf_at_load_error"] <= BF16_TOLERANCE
