"""coalesced-int4: INT4 weight-only quantization for LLM decode on NVIDIA GPUs.

    import coalesced_int4 as ci4
    ci4.quantize_(model, ci4.int4_config())       # nn.Linear weights -> CudaCoalescedInt4Tensor
    ci4.save_quantized(model, "ckpt/")            # sharded safetensors with an index
    ci4.load_quantized(meta_model, "ckpt/", device="cuda")  # fills meta_model in place
    with ci4.autotune(): model(x)                 # time each GEMM shape's launch once; kept on disk
"""

from coalesced_int4 import huggingface
from coalesced_int4.config import Int4Config, QuantizeReport, int4_config, quantize_
from coalesced_int4.kernels.autotune.launch_params import autotune_launch_params as autotune
from coalesced_int4.serialization import load_quantized, load_state_dict, save_quantized
from coalesced_int4.tensor import CudaCoalescedInt4Tensor

__all__ = [
    "CudaCoalescedInt4Tensor",
    "Int4Config",
    "QuantizeReport",
    "autotune",
    "int4_config",
    "load_quantized",
    "load_state_dict",
    "quantize_",
    "save_quantized",
]
__version__ = "0.1.0"

huggingface.register()
