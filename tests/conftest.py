"""Test session setup: Triton's interpreter without a GPU, and a private pick store. Shared
helpers live in ``tests/helpers.py``."""

import os

import pytest
import torch

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from local directories only
if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run in Triton's interpreter (set before they import).
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def private_autotune_cache(tmp_path_factory):
    """Tests never read or write the user's persistent autotune picks."""
    os.environ["COALESCED_INT4_CACHE_DIR"] = str(tmp_path_factory.mktemp("autotune-picks"))
    yield
