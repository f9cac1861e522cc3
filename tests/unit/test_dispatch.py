"""F.linear on a quantized weight: the dequant fallback is right for every input the kernels
cannot take (CPU, other dtypes, M > 64, N-D, bias), chunks very tall weights, and compiles."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from coalesced_int4 import CudaCoalescedInt4Tensor
from coalesced_int4.dispatch import linear as dispatch_linear
from coalesced_int4.quantize import dequantize_packed
from tests.helpers import run_compiling_python


def _reference(x, weight, bias=None):
    """fp32 linear with the exact fp32 dequantized weight."""
    dense = dequantize_packed(weight.packed, torch.float32)
    return F.linear(x.float(), dense, None if bias is None else bias.float())


def _mean_rel(out, ref):
    return ((out.float() - ref).abs().mean() / ref.abs().mean()).item()


@pytest.fixture
def weight():
    return CudaCoalescedInt4Tensor.from_float(torch.randn(320, 512))


@pytest.mark.parametrize("m", [1, 5, 130])
def test_fallback_matches_the_fp32_dequant_reference(weight, m):
    x = torch.randn(m, 512, dtype=torch.bfloat16)
    out = F.linear(x, weight)
    assert out.shape == (m, 320) and out.dtype == torch.bfloat16
    assert _mean_rel(out, _reference(x, weight)) < 0.01


def test_three_d_input_and_bias(weight):
    x = torch.randn(2, 7, 512, dtype=torch.bfloat16)
    bias = torch.randn(320, dtype=torch.bfloat16)
    out = F.linear(x, weight, bias)
    assert out.shape == (2, 7, 320)
    assert _mean_rel(out, _reference(x, weight, bias)) < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_other_activation_dtypes_take_the_fallback_in_their_dtype(weight, dtype):
    x = torch.randn(3, 512, dtype=dtype)
    out = torch.nn.functional.linear(x, weight)
    assert out.dtype == dtype and _mean_rel(out, _reference(x, weight)) < 0.01


def test_non_contiguous_activation(weight):
    x = torch.randn(512, 4, dtype=torch.bfloat16).t()
    assert _mean_rel(F.linear(x, weight), _reference(x, weight)) < 0.01


def test_aten_linear_routes_like_f_linear(weight):
    x = torch.randn(2, 512, dtype=torch.bfloat16)
    assert torch.equal(torch.ops.aten.linear(x, weight), F.linear(x, weight))


def test_tall_weights_are_dequantized_in_chunks_with_the_same_result(monkeypatch, weight):
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    whole = F.linear(x, weight)
    monkeypatch.setattr(dispatch_linear, "DEQUANT_N_THRESHOLD", 100)
    monkeypatch.setattr(dispatch_linear, "DEQUANT_N_CHUNK", 64)
    seen = []
    original = dispatch_linear.dequantize_packed
    monkeypatch.setattr(dispatch_linear, "dequantize_packed",
                        lambda p, d: seen.append(p.qdata.shape[0]) or original(p, d))
    chunked = F.linear(x, weight)
    assert seen == [64, 64, 64, 64, 64]
    assert torch.equal(chunked, whole)


def test_quantized_model_compiles_fullgraph_on_cpu():
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.SiLU(), torch.nn.Linear(512, 256))
    model = model.to(torch.bfloat16)
    for layer in (model[0], model[2]):
        layer.weight = torch.nn.Parameter(CudaCoalescedInt4Tensor.from_float(layer.weight), requires_grad=False)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True)(x)
    assert _mean_rel(compiled, eager.float()) < 0.01


_PASTED_SOURCES = """
from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code as source
from coalesced_int4.kernels.decode_attention import _decode_attention_kernel
from coalesced_int4.kernels.gemm.split_k import _splitk_reduce_kernel
from coalesced_int4.kernels.gemm.w4a8 import _quantize_kernel, _w4a8_kernel
from coalesced_int4.kernels.gemm.w4a16 import _w4a16_kernel
for kernel in (_w4a8_kernel, _quantize_kernel, _w4a16_kernel, _splitk_reduce_kernel, _decode_attention_kernel):
    for line in source(kernel).splitlines():
        if chr(92) in line:
            print(kernel.__name__, line.strip())
"""


def test_kernel_sources_survive_being_pasted_into_a_compiled_module():
    """torch.compile pastes each user kernel's source, with its jit helpers and constexpr
    globals, into its generated module inside a non-raw triple-quoted string, where every
    backslash escape is read once more. An escaped newline in an inline-asm constant made
    every compiled W4A16 call fail to import on torch 2.11, so no kernel source may hold a
    backslash."""
    result = run_compiling_python(_PASTED_SOURCES)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "", result.stdout


@pytest.mark.parametrize("short_programs", [True, False])
def test_plain_eager_calls_validate_once_per_signature_and_redecide_after_a_new_pick(
        weight, monkeypatch, short_programs):
    """The eager plan (no CUDA here: the rule and the launches are stand-ins that count): one
    launch where unsplit programs are short, else the decided launch, decided again (and the
    call recorded again) once tuning picks something."""
    from coalesced_int4.kernels.autotune import launch_params
    from coalesced_int4.kernels.ops import int4_gemm
    from coalesced_int4.kernels.runtime import recorded_call

    rules, decisions, launches, recordings = [], [], [], []
    monkeypatch.setattr(dispatch_linear, "_plain_eager", lambda x: True)
    monkeypatch.setattr(dispatch_linear, "select_bucket", lambda x, args: rules.append(x.shape[0]) or 4)
    monkeypatch.setattr(int4_gemm, "eager_one_launch", lambda k, family: short_programs)
    monkeypatch.setattr(int4_gemm, "decided_launch", lambda bucket, x, *w: decisions.append(bucket) or {"split_k": 2})
    monkeypatch.setattr(int4_gemm, "launch_decided", lambda bucket, x, w, params: launches.append((bucket, params))
                        or torch.zeros(x.shape[0], 320, dtype=torch.bfloat16))
    monkeypatch.setattr(recorded_call, "record",
                        lambda x, w, call, **views: recordings.append(x.shape[0]) or (call(), None))
    params = {"split_k": 1, "prequantize": False} if short_programs else {"split_k": 2}
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    for _ in range(3):
        F.linear(x, weight)
    assert rules == [3] and launches == [(4, params)] * 3
    assert decisions == ([] if short_programs else [4])
    assert recordings == [3] * dispatch_linear.RECORDINGS  # then, with no replay, plain launches
    F.linear(x[:2], weight)  # another signature: its own plan
    assert rules == [3, 2]
    recordings.clear()
    launch_params._remember(("a new pick",), {})  # tuning picked something
    F.linear(x, weight)
    assert rules == [3, 2] and recordings == [3] and launches[-1] == (4, params)
    assert decisions == ([] if short_programs else [4, 4, 4])
    launch_params.clear_launch_param_cache()


@pytest.mark.parametrize("value, tuning", [("1", True), ("0", False)])
def test_the_environment_variable_turns_tuning_on_for_the_process(value, tuning):
    code = "from coalesced_int4.kernels.autotune.launch_params import tuning_stats; print(tuning_stats() is not None)"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "COALESCED_INT4_AUTOTUNE": value})
    assert child.returncode == 0 and child.stdout.strip().splitlines()[-1] == str(tuning), child.stderr[-2000:]
