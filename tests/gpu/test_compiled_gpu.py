"""Quantized models compiled, exported, packaged and captured (GPU; skipped without CUDA):
torch.compile of the decoder for decode and prefill, dynamic M, a prequantized launch compiled
into CUDA graphs, an AOTInductor package loaded
in a fresh process, each of bucket 64's activation load paths compiled, packaged and captured,
CUDA-graph replay, and a KV-cache decode that gives the same tokens eager
and compiled."""

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import coalesced_int4 as ci4
from coalesced_int4.decoder import DEMO, build_decoder, decode_step, generate
from coalesced_int4.kernels import (
    autotune_launch_params,
    clear_launch_param_cache,
    int4_autotune_configs,
    prune_int4_configs,
)
from coalesced_int4.kernels.autotune import launch_params
from coalesced_int4.kernels.autotune.tuner import single_config
from coalesced_int4.kernels.ops import int4_gemm
from tests.helpers import requires_cuda

pytestmark = requires_cuda


def _quantized_decoder():
    model = build_decoder(DEMO, seed=0, device="cuda")
    ci4.quantize_(model, ci4.int4_config())
    return model


def _rel(a, b):
    return ((a.float() - b.float()).abs().mean() / b.float().abs().mean()).item()


def test_compiled_decoder_matches_eager_for_decode_and_prefill():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _quantized_decoder()
    compiled = torch.compile(model, fullgraph=True)
    for length in (1, 64, 200):  # bucket 1, bucket 64, fallback
        tokens = torch.randint(0, DEMO.vocab_size, (1, length), device="cuda")
        positions = torch.arange(length, device="cuda")
        with torch.no_grad():
            model.setup_cache(1)
            eager = model(tokens, positions)
            model.setup_cache(1)
            out = compiled(tokens, positions)
        # Inductor fuses the norms, rope and softmax in fp32 where eager rounds to bf16 between
        # ops, and the W4A8 buckets re-quantize those activations to int8: about 1 % apart at
        # the logits after 2 layers. A wrong kernel or layout is off by about 100 %.
        assert _rel(out, eager) < 0.03, length


def test_the_compiled_code_launches_the_int4_kernels():
    torch._dynamo.reset()
    model = _quantized_decoder()
    model.setup_cache(1)
    tokens = torch.randint(0, DEMO.vocab_size, (1, 1), device="cuda")
    with torch.no_grad():
        _, code = torch._inductor.utils.run_and_get_code(
            torch.compile(model, fullgraph=True), tokens, torch.tensor([0], device="cuda"))
    source = "\n".join(code)
    assert "_w4a8_kernel" in source


def test_a_dynamic_m_compiles_once_per_bucket_range():
    torch._dynamo.reset()
    weight = ci4.CudaCoalescedInt4Tensor.from_float(torch.randn(512, 1024, device="cuda"))
    compiled = torch.compile(lambda x: F.linear(x, weight), fullgraph=True)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for m in (2, 3, 4):
        x = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
        torch._dynamo.mark_dynamic(x, 0, min=2, max=4)
        assert _rel(compiled(x), F.linear(x.float(), weight.dequantize(torch.float32))) < 0.03
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - frames == 1


def test_a_prequantized_pick_runs_compiled_in_cuda_graphs_with_eager_bits(tmp_path, monkeypatch):
    """When the timing prefers quantizing the activations by a kernel of their own, the
    compiled code launches that kernel before the GEMM and gives eager's bits."""
    monkeypatch.setenv("COALESCED_INT4_CACHE_DIR", str(tmp_path))  # nothing restored
    monkeypatch.setattr(launch_params, "time_calls_us",
                        lambda calls: 1.0 if calls[0].keywords["prequantize"] else 2.0)
    clear_launch_param_cache()
    torch._dynamo.reset()
    weight = ci4.CudaCoalescedInt4Tensor.from_float(torch.randn(512, 1024, device="cuda"))
    x = torch.randn(3, 1024, dtype=torch.bfloat16, device="cuda")
    compiled = torch.compile(lambda x: F.linear(x, weight), mode="reduce-overhead", fullgraph=True)
    try:
        with torch.no_grad(), autotune_launch_params() as stats:
            eager = F.linear(x, weight)
            out, code = torch._inductor.utils.run_and_get_code(compiled, x)
    finally:
        clear_launch_param_cache()
    assert stats.choices and all(choice["prequantize"] for choice in stats.choices)
    assert "_quantize_kernel" in "\n".join(code)
    assert torch.equal(out, eager)


AOTI_LOAD = textwrap.dedent("""
    import sys, torch
    import coalesced_int4  # registers the coalesced_int4 ops the package calls
    runner = torch._inductor.aoti_load_package(sys.argv[1])
    x = torch.load(sys.argv[2])
    torch.save(runner(x), sys.argv[3])
""")


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(1024, 2048, bias=False)
        self.down = torch.nn.Linear(2048, 1024, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.up(x)))


def _run_package_in_a_fresh_process(model, x, directory):
    """(process result, output path) of an AOTInductor package of ``model`` run on ``x``."""
    package = torch._inductor.aoti_compile_and_package(
        torch.export.export(model, (x,)), package_path=str(directory / "model.pt2"))
    torch.save(x, directory / "x.pt")
    child = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", AOTI_LOAD, package, str(directory / "x.pt"),
         str(directory / "y.pt")], capture_output=True, text=True, timeout=600)
    return child, directory / "y.pt"


@pytest.fixture(scope="session")
def aoti_platform_failure(tmp_path_factory):
    """Why this machine's AOTInductor cannot run even a plain bf16 package in a fresh process,
    or None: asked once, so that the package tests tell the platform's failure from ours
    without compiling a package of their own first."""
    directory = tmp_path_factory.mktemp("plain_bf16")
    plain = torch.nn.Linear(256, 8, bias=False).to(torch.bfloat16).cuda()
    child, _ = _run_package_in_a_fresh_process(plain, torch.randn(4, 256, dtype=torch.bfloat16, device="cuda"),
                                               directory)
    if child.returncode == 0:
        return None
    return f"exit {child.returncode}: {child.stderr[-600:]}"


def _packaged_output(model, x, tmp_path, platform_failure):
    """``model(x)`` run from an AOTInductor package in a fresh process."""
    if platform_failure:
        pytest.skip(f"this machine's AOTInductor cannot run a plain bf16 package in a fresh process ({platform_failure})")
    child, output = _run_package_in_a_fresh_process(model, x, tmp_path)
    assert child.returncode == 0, child.stderr[-4000:]
    loaded = torch.load(output)
    return loaded[0] if isinstance(loaded, (list, tuple)) else loaded


def test_an_aoti_package_runs_in_a_fresh_process(tmp_path, aoti_platform_failure):
    model = _Mlp().to(torch.bfloat16).cuda()
    ci4.quantize_(model, ci4.int4_config())
    x = torch.randn(4, 1024, dtype=torch.bfloat16, device="cuda")
    program = torch.export.export(model, (x,))
    assert sum("int4_quantized_gemm_m4" in str(n.target) for n in program.graph.nodes) == 2
    loaded = _packaged_output(model, x, tmp_path, aoti_platform_failure)
    with torch.no_grad():
        assert _rel(loaded, model(x)) < 0.01


W4A16_LOAD_PATHS = [c for c in int4_autotune_configs(64) if c.kwargs["BLOCK_N"] == 64 and c.kwargs["BLOCK_K"] == 128]
"""Bucket 64's (64, 128, 4) configs: activations by pointer copies (three stages), by TMA (two),
and by TMA under a register cap."""


@pytest.fixture(params=W4A16_LOAD_PATHS, ids=str)
def w4a16_load_path(request, monkeypatch):
    """Bucket 64 runs one of ``W4A16_LOAD_PATHS`` alone, eager and traced."""
    kernels = int4_gemm.BUCKET_KERNELS
    monkeypatch.setitem(kernels, 64, single_config(kernels[64], request.param))
    torch._dynamo.reset()
    linear = torch.nn.Linear(1024, 512, bias=False).to(torch.bfloat16).cuda()
    ci4.quantize_(linear, ci4.int4_config())
    return linear, torch.randn(64, 1024, dtype=torch.bfloat16, device="cuda")


def test_each_w4a16_load_path_gives_eager_bits_compiled_and_captured(w4a16_load_path):
    """The TMA configs make their descriptors in global scratch: eager launches allocate it
    themselves (``scratch.with_scratch``), Inductor's launcher sets its own allocator, and a
    CUDA graph captures the scratch from its pool. No allocator is set here."""
    linear, x = w4a16_load_path
    with torch.no_grad():
        eager = linear(x)
        compiled = torch.compile(linear, fullgraph=True)(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = linear(x)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(compiled, eager)
    assert torch.equal(captured, eager)


def test_each_w4a16_load_path_runs_from_an_aoti_package(w4a16_load_path, tmp_path, aoti_platform_failure):
    """AOTInductor's generated code allocates the descriptors' scratch itself."""
    linear, x = w4a16_load_path
    with torch.no_grad():
        assert torch.equal(_packaged_output(linear, x, tmp_path, aoti_platform_failure), linear(x))


def test_cuda_graph_replay_of_a_warmed_up_model_is_bit_identical():
    model = _quantized_decoder()
    model.setup_cache(1)
    token = torch.randint(0, DEMO.vocab_size, (1, 1), device="cuda")
    position = torch.tensor([3], device="cuda")
    with torch.no_grad():
        eager = decode_step(model, token, position)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                decode_step(model, token, position)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = decode_step(model, token, position)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, eager)


def test_compiled_kv_cache_decoding_follows_eager_step_by_step():
    # A random-weight model has near-ties among its top logits, so a free-running comparison
    # would diverge at the first tie the ~1 % compile-vs-eager difference flips. The compiled
    # steps are therefore fed eager's tokens (their KV cache then holds the same history) and
    # must give eager's logits at every step, with eager's next token among their top 3 (a
    # strict argmax agreement threshold is a coin toss here).
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _quantized_decoder()
    prompt = torch.randint(0, DEMO.vocab_size, (1, 16), device="cuda")
    eager_tokens, eager_logits = generate(model, prompt, 24)
    step = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        model.setup_cache(1)
        model(prompt, torch.arange(16, device="cuda"))
        compiled_logits = [step(model, eager_tokens[:, i:i + 1], torch.tensor([16 + i], device="cuda")).clone()
                           for i in range(23)]
    compiled_logits = torch.stack(compiled_logits, dim=1)
    for i in range(23):
        assert _rel(compiled_logits[:, i], eager_logits[:, i + 1]) < 0.03, i
    top3 = compiled_logits.topk(3, dim=-1).indices
    in_top3 = (top3 == eager_tokens[:, 1:, None]).any(-1)
    agreement = (compiled_logits.argmax(-1) == eager_tokens[:, 1:]).float().mean().item()
    assert bool(in_top3.all()), f"eager's token outside the compiled top 3 at steps {in_top3.logical_not().nonzero()}"
    assert agreement >= 0.5, agreement


@pytest.mark.parametrize("config", prune_int4_configs(int4_autotune_configs(64), {"K": 1024, "split_k": 1}), ids=str)
def test_every_bucket_64_config_serves_a_dynamic_m_compiled(config, monkeypatch):
    """Not only the pick: each config, compiled for a symbolic M in (32, 64], gives at M = 40
    and 64 the bits of the eager launch of the same config."""
    kernels = int4_gemm.BUCKET_KERNELS
    monkeypatch.setitem(kernels, 64, single_config(kernels[64], config))
    torch._dynamo.reset()
    weight = ci4.CudaCoalescedInt4Tensor.from_float(torch.randn(512, 1024, device="cuda"))
    compiled = torch.compile(lambda x: F.linear(x, weight), fullgraph=True)
    for m in (40, 64):
        x = torch.randn(m, 1024, dtype=torch.bfloat16, device="cuda")
        torch._dynamo.mark_dynamic(x, 0, min=33, max=64)
        assert torch.equal(compiled(x), F.linear(x, weight)), m
