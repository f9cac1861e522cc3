"""Shared test helpers. GPU tests use ``requires_cuda`` and skip cleanly without CUDA."""

import os

import pytest
import torch

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def random_weight(n: int, k: int, seed: int = 0, dtype=torch.bfloat16, device="cpu"):
    """Gaussian rows whose magnitudes span 1e-3 .. 1e2 (one magnitude per row)."""
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-3, 2, n, dtype=torch.float64)[torch.randperm(n, generator=generator)]
    w = torch.randn(n, k, generator=generator, dtype=torch.float64) * magnitudes[:, None]
    return w.to(dtype).to(device)
