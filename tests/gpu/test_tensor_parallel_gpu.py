"""torchao's tensor-parallel test case on our tensor (skipped without CUDA): a quantized
up projection sharded column-wise and a down projection row-wise, run eagerly and compiled,
with their shards on the GPU. Two ranks share one GPU over gloo (NCCL needs a GPU a rank), so
the case runs on a one-GPU machine; the projections' K (1024, 2048) split in two holds whole
super-blocks of 256."""

import torch
from torchao.testing import utils as torchao_testing

import coalesced_int4 as ci4
from coalesced_int4 import CudaCoalescedInt4Tensor
from tests.helpers import requires_cuda


# The base class is reached through its module so that pytest collects only this subclass.
@requires_cuda
class TestOurTensorParallel(torchao_testing.TorchAOTensorParallelTestCase):
    TENSOR_SUBCLASS = CudaCoalescedInt4Tensor
    QUANT_METHOD_FN = staticmethod(ci4.int4_config)
    test_tp_float32 = test_tp_float16 = None
    """bf16 only: a quantized weight's dtype is bf16 (the kernels' activations), and DTensor's
    shape propagation refuses ``mm`` of fp32 or fp16 activations with it."""

    @property
    def world_size(self) -> int:
        return 2

    @property
    def backend(self) -> str:
        return "gloo"

    def quantize(self, m: torch.nn.Module) -> torch.nn.Module:
        ci4.quantize_(m, ci4.int4_config())
        return m
