"""quantize_(model, int4_config()): every packable linear is quantized, others stay dense with
one log line per reason, the report counts both, and both quantize_ spellings are one function."""

import copy
import logging

import pytest
import torch
import torchao.quantization

import coalesced_int4 as ci4
from coalesced_int4 import CudaCoalescedInt4Tensor, Int4Config, int4_config


def _model():
    return torch.nn.Sequential(
        torch.nn.Linear(512, 256),   # quantized
        torch.nn.Linear(256, 100),   # quantized (K=256)
        torch.nn.Linear(100, 300),   # K=100: left dense
        torch.nn.Linear(300, 256),   # K=300: left dense
    ).to(torch.bfloat16)


def test_torchaos_quantize_runs_the_same_handler_as_ours_on_an_untied_model():
    torch.manual_seed(0)
    ours = _model()
    theirs = copy.deepcopy(ours)
    ci4.quantize_(ours, int4_config())
    torchao.quantization.quantize_(theirs, int4_config())
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        if isinstance(a, CudaCoalescedInt4Tensor):
            assert all(torch.equal(x, y) for x, y in zip(a.packed, b.packed)), name
        else:
            assert torch.equal(a, b), name


def test_packable_linears_are_quantized_and_the_rest_stay_dense(caplog):
    model = _model()
    config = int4_config()
    with caplog.at_level(logging.WARNING, logger="coalesced_int4.config"):
        ci4.quantize_(model, config)
    kinds = [isinstance(m.weight, CudaCoalescedInt4Tensor) for m in model]
    assert kinds == [True, True, False, False]
    assert not model[0].weight.requires_grad
    report = config.report
    assert report.quantized == 2 and len(report.skipped) == 2
    assert report.bytes_before == (512 * 256 + 256 * 100) * 2
    assert report.bytes_after == int((512 * 256 + 256 * 100) * 4.625 / 8)
    messages = [r.getMessage() for r in caplog.records]
    assert any("(300, 100)" in m and "multiple of 32" in m for m in messages)
    assert any("(256, 300)" in m and "multiple of 32" in m for m in messages)
    assert "2 linear weights quantized, 2 left dense" in report.summary()


def test_a_skip_reason_is_logged_once(caplog):
    model = torch.nn.Sequential(*(torch.nn.Linear(100, 64) for _ in range(3)))
    config = int4_config()
    with caplog.at_level(logging.WARNING, logger="coalesced_int4.config"):
        ci4.quantize_(model, config)
    assert len(caplog.records) == 1 and len(config.report.skipped) == 3


def test_quantizing_twice_leaves_quantized_weights_alone_and_the_report_counts_them():
    model = _model()
    ci4.quantize_(model, int4_config())
    first = model[0].weight
    config = int4_config()
    ci4.quantize_(model, config)
    assert model[0].weight is first and config.report.quantized == 0
    assert config.report.already_quantized == 2
    assert "0 linear weights quantized, 2 already quantized, 2 left dense" in config.report.summary()


def test_quantized_model_output_is_close_to_bf16():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    model = model.to(torch.bfloat16)
    x = torch.randn(4, 512, dtype=torch.bfloat16)
    dense = model(x).float()
    ci4.quantize_(model, int4_config())
    out = model(x).float()
    assert ((out - dense).abs().mean() / dense.abs().mean()).item() < 0.15


@pytest.mark.parametrize(
    "options, message",
    [({"group_size": 64}, "group_size must be 32, got 64"),
     ({"qparams": "gptq"}, "unknown qparams 'gptq'"),
     ({"activation_dtype": torch.float16}, "activation_dtype must be one of \\(torch.bfloat16,\\)")],
)
def test_bad_options_are_rejected(options, message):
    with pytest.raises(ValueError, match=message):
        int4_config(**options)


def test_config_is_a_torchao_config():
    assert isinstance(int4_config(), torchao.core.config.AOBaseConfig)
    assert isinstance(int4_config(), Int4Config)
