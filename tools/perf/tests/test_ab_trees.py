"""The in-process A/B (``benchmarks/ab_trees.py``) rests on two things checked here: a tree's
package copied under another name imports beside this one with ops of its own, and the copy
computes this package's bits (so a bit difference in an A/B is the variant's, not the copy's)."""

import sys
from pathlib import Path

import pytest
import torch

from coalesced_int4.kernels import int4_autotune_configs, launch, prune_int4_configs
from tests.helpers import BENCHMARKS, PERF_TOOLS, ROOT, packed_weight

sys.path[:0] = [PERF_TOOLS, BENCHMARKS]
from ab_trees import export_kernels, parse_cases, report_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_a_copied_tree_registers_its_own_ops_and_gives_this_packages_bits(tmp_path):
    copy = export_kernels(Path(ROOT), "ci4_ab_test_copy", tmp_path)
    assert copy.__name__ == "ci4_ab_test_copy.kernels" and copy.__file__.startswith(str(tmp_path))
    assert copy.INT4_QUANTIZED_GEMM.op(16)._qualified_op_name == "ci4_ab_test_copy::int4_quantized_gemm_m16"
    packed, _ = packed_weight(37, 512, seed=5, device=DEVICE)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16).to(DEVICE)
    config = prune_int4_configs(int4_autotune_configs(16), {"K": 512, "split_k": 2})[0]
    ours = launch(16, x, *packed, 32, split_k=2, config=config)
    assert torch.equal(copy.launch(16, x, *packed, 32, split_k=2, config=config), ours)


def test_a_folder_without_the_package_is_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} holds no coalesced_int4/__init__.py"):
        export_kernels(tmp_path, "ci4_ab_test_missing", tmp_path / "into")


def test_cases_read_as_n_by_k_by_m():
    assert parse_cases("4096x4096x64,256x6656x8") == [(4096, 4096, 64), (256, 6656, 8)]


def test_each_tree_is_reported_against_the_baseline_round_by_round():
    result = {"N": 4096, "K": 4096, "M": 64, "us": [[12.0, 10.0, 11.0], [11.4, 10.5, 9.9]], "bf16_us": 11.55,
              "bit_identical": [True, False]}
    baseline, variant = report_rows(result, ["main", "variant"])
    assert baseline == "| 4096x4096 | 64 | main | 11.00 | 1.000 | 1.000 1.000 1.000 | 1.05x | same |"
    assert variant == "| 4096x4096 | 64 | variant | 10.50 | 0.955 | 0.950 1.050 0.900 | 1.10x | DIFFER |"
