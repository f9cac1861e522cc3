"""Helpers shared by the test suite: the GPU skip marker, reference computations, weights,
and child processes that compile kernels for a GPU target. GPU tests use ``requires_cuda`` and
skip cleanly without CUDA."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def run_compiling_python(code: str, *args: str, path=()) -> subprocess.CompletedProcess:
    """``python -c code args`` in a process without Triton's interpreter, whose kernels have
    their source and compile for a GPU target (this process's kernels are interpreted on a
    CPU). ``path``: folders put first on the child's PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if path:
        env["PYTHONPATH"] = os.pathsep.join([*path, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=600)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
"""The benchmark scripts' folder: tests of a script put it on ``sys.path`` (the scripts import
each other by module name, as they do when run from there)."""
PERF_TOOLS = os.path.join(ROOT, "tools", "perf")
"""The performance instruments' folder (the offline SASS census among them), likewise."""

_SM90_MAIN_LOOP = textwrap.dedent("""
    import importlib, json, sys
    from sass_census import compile_offline, main_loop, sass_of
    module, kernel, pointers, constants, warps = json.loads(sys.argv[1])
    compiled = compile_offline(getattr(importlib.import_module(module), kernel), pointers, constants, warps=warps)
    print(json.dumps(main_loop(sass_of(compiled)[0])))
""")


def sm90_main_loop(module: str, kernel: str, pointers: dict, constants: dict, warps: int = 4):
    """The main loop of ``tools/perf/<module>.py``'s ``kernel`` compiled offline for sm_90
    (``sass_census.compile_offline``, in a child process: this one runs the interpreter),
    one instruction a line without its ``;`` and encoding."""
    child = run_compiling_python(_SM90_MAIN_LOOP, json.dumps([module, kernel, pointers, constants, warps]),
                                 path=(ROOT, BENCHMARKS, PERF_TOOLS))
    assert child.returncode == 0, child.stderr[-3000:]
    return [text.split(";")[0].strip() for text in json.loads(child.stdout.strip().splitlines()[-1])]


def tma_and_pointer_configs(bucket: int):
    """Each W4A16 config of ``bucket``'s space that copies activations by TMA, paired with the
    config of the same tile that copies them by pointers."""
    from coalesced_int4.kernels import int4_autotune_configs

    configs = int4_autotune_configs(bucket)

    def tile(config):
        return config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"], config.num_warps

    pointers = {tile(c): c for c in configs if not c.kwargs["TMA_ACTIVATIONS"]}
    return [(c, pointers[tile(c)]) for c in configs if c.kwargs["TMA_ACTIVATIONS"]]


def random_weight(n: int, k: int, seed: int = 0, dtype=torch.bfloat16, device="cpu"):
    """Gaussian rows whose magnitudes span 1e-3 .. 1e2 (one magnitude per row)."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-3, 2, n, dtype=torch.float64)[torch.randperm(n, generator=generator)]
    w = torch.randn(n, k, generator=generator, dtype=torch.float64) * magnitudes[:, None]
    return w.to(dtype).to(device)


def packed_weight(n: int, k: int, seed: int = 0, device="cpu", qparams: str = "mse"):
    """The five stored tensors of a quantized Gaussian bf16 weight (``qparams``: the
    quantizer, ``quantize.QPARAMS``), and the dense weight."""
    from coalesced_int4.quantize import quantize_weight

    generator = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    return tuple(t.to(device) for t in quantize_weight(dense, qparams=qparams)), dense.to(device)


def dequant_matmul_reference(x, packed):
    """The reference system's check: weights dequantized with every step rounded to bf16
    (the W4A16 kernels' chain), then a bf16 ``F.linear``; computed in fp32 here."""
    from coalesced_int4.quantize import PackedInt4, dequantize_packed

    dense = dequantize_packed(PackedInt4(*packed), torch.bfloat16)[:, : x.shape[1]]
    return (x.float() @ dense.float().t())


def assert_close_to_reference(out, ref, rtol=0.03, atol=8.0, mean_rel=0.02):
    """The reference test's tolerance: finite, elementwise rtol/atol, and mean relative error."""
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)
    error = (out.float() - ref.float()).abs().mean() / ref.float().abs().mean()
    assert error.item() < mean_rel, error.item()


def rewrite_safetensors(path, edit_tensors=None, edit_meta=None):
    """Rewrite a safetensors file after editing its tensors (a dict) and header metadata."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        meta = handle.metadata()
    if edit_tensors:
        edit_tensors(tensors)
    if edit_meta:
        edit_meta(meta)
    save_file(tensors, str(path), metadata=meta)
