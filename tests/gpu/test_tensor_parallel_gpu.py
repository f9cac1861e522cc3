"""torchao's tensor-parallel test case on our tensor (skipped without CUDA): a quantized
up projection sharded column-wise and a down projection row-wise, run eagerly and compiled,
with their shards on the GPU. Two ranks share one GPU over gloo (NCCL needs a GPU a rank), so
the case runs on a one-GPU machine; the projections' K (1024, 2048) split in two holds whole
super-blocks of 256."""

import torch
from torch.distributed.device_mesh import DeviceMesh
from torchao.testing import utils as torchao_testing

import coalesced_int4 as ci4
from coalesced_int4 import CudaCoalescedInt4Tensor
from tests.helpers import requires_cuda


class _MeshTakingItsDeviceType(DeviceMesh):
    """torchao's case builds its mesh for the CPU (fewer GPUs than ranks) and then assigns
    ``mesh.device_type = "cuda"``, which DeviceMesh's read-only property refuses (torch 2.11
    and later): this mesh takes the assignment."""

    @property
    def device_type(self) -> str:
        return self._device_type

    @device_type.setter
    def device_type(self, value: str) -> None:
        self._device_type = value


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

    def build_device_mesh(self) -> DeviceMesh:
        mesh = super().build_device_mesh()
        mesh.__class__ = _MeshTakingItsDeviceType
        return mesh

    def quantize(self, m: torch.nn.Module) -> torch.nn.Module:
        ci4.quantize_(m, ci4.int4_config())
        return m
