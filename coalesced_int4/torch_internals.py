"""Every private or experimental torch API the library uses, imported in this one module.

A torch upgrade that moves one of these breaks here, at import, rather than somewhere deep in a
kernel launch; the rest of the package imports them from this module only.
"""

import torch
from torch._library import triton as triton_ops_registry
from torch._library.triton import is_wrap_triton_enabled, set_wrap_triton_enabled
from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils._python_dispatch import TorchDispatchMode, return_and_correct_aliasing
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes
from torch.utils.weak import WeakIdKeyDictionary

c10d_functional = torch.ops._c10d_functional
"""The functional collectives' ops (DTensor gathers through them)."""


def current_device_index() -> int:
    """The current CUDA device's index (``torch.cuda.current_device()`` without its Python
    initialization check, for a caller that already ran on CUDA)."""
    return torch._C._cuda_getDevice()


def current_raw_stream(device_index: int) -> int:
    """The current CUDA stream of a device, as the raw handle Triton's launchers take (what
    Triton itself asks torch for)."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def dispatch_mode_active() -> bool:
    """Whether a ``TorchDispatchMode`` is on the stack (one watches or reroutes the ops run)."""
    return torch._C._len_torch_dispatch_stack() > 0


__all__ = [
    "TorchDispatchMode",
    "WeakIdKeyDictionary",
    "c10d_functional",
    "current_device_index",
    "current_raw_stream",
    "disable_current_modes",
    "dispatch_mode_active",
    "is_fake",
    "is_wrap_triton_enabled",
    "return_and_correct_aliasing",
    "set_wrap_triton_enabled",
    "statically_known_true",
    "triton_ops_registry",
    "unset_fake_temporarily",
]
