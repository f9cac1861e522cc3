"""Accuracy of a quantized model on the path decoding runs.

A decode step multiplies one row (M = 1) by every weight: the W4A8 kernel, which quantizes the
activations to int8 per 32 on the fly, while a prefill of many rows takes W4A16 or the exact
fallback. ``decode_perplexity`` scores a text as decoding does, teacher-forced one token at a
time through a KV cache, so every linear runs at M = 1:

- on CUDA the kernels themselves run;
- elsewhere (CPU) ``w4a8_linear`` computes the W4A8 kernel's numbers in torch: the kernel's
  activation quantization (scale ``amax / 127``, round half to even), its exact integer dot
  products per group of 32, its fp32 group terms ``(dot - asum * wz) * (xs * ws)``, summed in
  the kernel's order (per lane of ``GROUPS`` groups over the trips, then across the lanes as
  Triton's interpreter sums, in NumPy) and rounded once to bf16. A test holds it to the
  interpreted kernel's bits.

``linear_inputs`` captures the input each linear of a model sees on some tokens;
``layer_output_errors`` gives each quantized linear's relative output error on them.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from typing import Dict, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from coalesced_int4.kernels.ops.configs import W4A8_TILES
from coalesced_int4.quantize import GROUP_SIZE, GROUPS_PER_SUPER_BLOCK, unpack_nibbles
from coalesced_int4.tensor import CudaCoalescedInt4Tensor
from coalesced_int4.torch_internals import WeakIdKeyDictionary

INVERSE_LIMIT = 2.0**126
"""The W4A8 kernel's cap on ``1 / scale`` of a group (a group of denormals overflows it)."""
DECODE_GROUPS = W4A8_TILES[0][1]
"""Groups of 32 per main-loop trip of the W4A8 config the interpreter runs at M = 1 (the first
tile of the space)."""


def _group_values(weight: CudaCoalescedInt4Tensor):
    """The weight's codes (float [Gs, 32, N]) and per-group fp32 ``ws`` and ``wz`` [Gs, N]:
    group-major, so that a call is one batched product and elementwise work on contiguous
    rows."""
    packed = weight.packed
    n = packed.qdata.shape[0]
    codes = unpack_nibbles(packed.qdata).float().reshape(n, -1, GROUP_SIZE).permute(1, 2, 0).contiguous()
    ws = packed.scale.float() * packed.scale_step.float().repeat_interleave(GROUPS_PER_SUPER_BLOCK, dim=1)
    wz = packed.zero_point.float() * packed.zero_point_step.float().repeat_interleave(GROUPS_PER_SUPER_BLOCK, dim=1)
    return codes, ws.t().contiguous(), wz.t().contiguous()


def w4a8_linear(x: torch.Tensor, weight: CudaCoalescedInt4Tensor, groups_per_trip: int = DECODE_GROUPS,
                unpacked=None) -> torch.Tensor:
    """The W4A8 kernel's bf16 output for ``x`` [M, K] (split 1, in the interpreter's summation
    order); ``unpacked``: ``_group_values(weight)``, where the caller keeps it."""
    codes, ws, wz = unpacked if unpacked is not None else _group_values(weight)
    m, k = x.shape
    groups, _, n = codes.shape
    v = F.pad(x.float(), (0, groups * GROUP_SIZE - k)).reshape(m, groups, GROUP_SIZE)
    amax = v.abs().amax(-1)
    scale = amax / 127.0
    inverse = torch.where(amax > 0, torch.clamp(1.0 / scale, max=INVERSE_LIMIT), torch.zeros_like(scale))
    q = torch.round(v * inverse[..., None])  # fp32 product, then half to even, as the kernel
    asum = q.sum(-1)  # exact: at most 32 * 127
    dot = torch.bmm(q.transpose(0, 1), codes)  # [Gs, M, N]: exact integers in fp32
    terms = (dot - asum.t()[..., None] * wz[:, None]) * (scale.t()[..., None] * ws[:, None])  # [Gs, M, N] fp32
    trips = -(-groups // groups_per_trip)
    lanes = F.pad(terms, (0, 0, 0, 0, 0, trips * groups_per_trip - groups)).reshape(trips, groups_per_trip, m, n)
    accumulated = lanes[0]
    for trip in range(1, trips):  # the lanes add their trips in order
        accumulated = accumulated + lanes[trip]
    total = np.sum(accumulated.permute(1, 2, 0).contiguous().numpy(), axis=-1)  # across the lanes, as NumPy sums
    return torch.from_numpy(total).to(torch.bfloat16)


class _DecodePath(torch.overrides.TorchFunctionMode):
    """Routes ``F.linear`` of one row on a quantized weight (off CUDA) to ``w4a8_linear``."""

    def __init__(self):
        super().__init__()
        self.unpacked = WeakIdKeyDictionary()  # weight -> _group_values(weight)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and isinstance(args[1], CudaCoalescedInt4Tensor) and not args[0].is_cuda:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            rows = x.reshape(-1, x.shape[-1])
            if rows.shape[0] == 1:
                if weight not in self.unpacked:
                    self.unpacked[weight] = _group_values(weight)
                out = w4a8_linear(rows, weight, unpacked=self.unpacked[weight]).to(x.dtype)
                if bias is not None:
                    out = out + bias
                return out.reshape(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)


@torch.no_grad()
def decode_perplexity(model, tokenizer, text: str, window: int = 128, max_windows: int = 0) -> float:
    """exp(mean NLL) of ``text``'s tokens in consecutive windows of ``window`` tokens, each
    scored teacher-forced one token at a time through a KV cache (``max_windows`` > 0: that
    many windows)."""
    ids = tokenizer(text, return_tensors="pt").input_ids.to(model.device)
    starts = list(range(0, ids.shape[1] - 1, window))
    if max_windows:
        starts = starts[:max_windows]
    nll, scored = 0.0, 0
    from transformers import DynamicCache

    # transformers renamed the cache argument (``past_key_values`` before 5.25, ``cache`` after).
    cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    mode = contextlib.nullcontext() if model.device.type == "cuda" else _DecodePath()
    with mode:
        for start in tqdm(starts, desc="decode-path perplexity", unit="window", disable=None):
            chunk = ids[:, start:start + window]
            cache = DynamicCache(config=model.config)
            for position in range(chunk.shape[1] - 1):
                logits = model(chunk[:, position:position + 1], use_cache=True, **{cache_argument: cache}).logits
                nll -= float(torch.log_softmax(logits[0, -1].float(), -1)[chunk[0, position + 1]])
                scored += 1
    if scored == 0:
        raise ValueError("the text has fewer than two tokens")
    return math.exp(nll / scored)


@torch.no_grad()
def linear_inputs(model, ids: torch.Tensor, names: Iterable[str]) -> Dict[str, torch.Tensor]:
    """The input each named linear of ``model`` sees in one forward of ``ids``, as
    ``[tokens, K]``."""
    inputs: Dict[str, torch.Tensor] = {}
    hooks = [model.get_submodule(name).register_forward_pre_hook(
        lambda module, args, name=name: inputs.__setitem__(name, args[0].reshape(-1, args[0].shape[-1])))
        for name in names]
    try:
        model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return inputs


def quantized_linears(model) -> Dict[str, torch.nn.Linear]:
    """The linears of ``model`` whose weight is quantized, by name."""
    return {name: module for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and isinstance(module.weight, CudaCoalescedInt4Tensor)}


@torch.no_grad()
def layer_output_errors(model, tokenizer, text: str, dense: torch.nn.Module, max_tokens: int = 256
                        ) -> Dict[str, float]:
    """Each quantized linear's relative output error ``|x W_q^T - x W^T| / |x W^T|`` on the
    inputs it sees on ``text`` (its first ``max_tokens`` tokens), with W the same layer of
    ``dense`` (the model before quantization)."""
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens].to(model.device)
    inputs = linear_inputs(model, ids, quantized_linears(model))
    dense_weights = dict(dense.named_parameters())
    errors = {}
    for name, x in inputs.items():
        quantized = model.get_submodule(name).weight
        reference = dense_weights[f"{name}.weight"].float()
        x = x.float()
        exact = x @ reference.t()
        errors[name] = float((x @ quantized.dequantize(torch.float32).t() - exact).norm() / exact.norm())
    return errors
