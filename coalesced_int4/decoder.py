"""A small Llama-style decoder for the demo and the decode benchmark (gpt-fast style).

RMSNorm, rotary attention with grouped KV heads and a static bf16 KV cache, SwiGLU MLP, tied
nothing. On CUDA a decode step's attention (one new token, a cache of up to 512 positions)
runs ``decode_attention``, a Triton kernel for one query row; prefill, longer caches and CPU
runs use ``F.scaled_dot_product_attention``. Every linear has K a multiple of 256 so all of
them quantize. Weights are random and seeded: the model is for measuring speed and
agreement, not for reading its text.

``generate(model, prompt, new_tokens)`` runs one prefill step and then one decode step per
token (greedy); ``decode_step`` is the function to compile. ``parallelize(model, mesh)``
shards its blocks over a device mesh (tensor parallelism), dense or quantized.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from coalesced_int4.kernels import decode_attention


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int = 2048
    dim: int = 256
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    intermediate_size: int = 768
    max_seq_len: int = 256
    rope_base: float = 500_000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


DEMO = DecoderConfig()
LLAMA3_8B = DecoderConfig(
    vocab_size=128_256,
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    intermediate_size=14_336,
    max_seq_len=512,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class KVCache(nn.Module):
    def __init__(self, batch: int, kv_heads: int, config: DecoderConfig, dtype: torch.dtype, device):
        super().__init__()
        shape = (batch, kv_heads, config.max_seq_len, config.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), False)

    def fits(self, batch: int, like: torch.Tensor) -> bool:
        """Whether this cache holds ``batch`` sequences of ``like``'s dtype and device."""
        return self.k.shape[0] == batch and self.k.dtype == like.dtype and self.k.device == like.device

    def update(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        self.k.index_copy_(2, positions, k)
        self.v.index_copy_(2, positions, v)
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        # The heads this module computes: all of them, or a rank's share (``parallelize``).
        self.n_heads, self.n_kv_heads = config.n_heads, config.n_kv_heads
        qkv_dim = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.wqkv = nn.Linear(config.dim, qkv_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x, rope, mask, positions):
        head_dim = self.config.head_dim
        batch, seq, _ = x.shape
        q_dim, kv_dim = self.n_heads * head_dim, self.n_kv_heads * head_dim
        q, k, v = self.wqkv(x).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = apply_rope(q.view(batch, seq, self.n_heads, head_dim), rope).transpose(1, 2)
        k = apply_rope(k.view(batch, seq, self.n_kv_heads, head_dim), rope).transpose(1, 2)
        v = v.view(batch, seq, self.n_kv_heads, head_dim).transpose(1, 2)
        k, v = self.kv_cache.update(positions, k, v)
        if decode_attention.serves(seq, k):
            # The decode step: the causal mask's row is "positions <= positions[0]", which
            # the kernel applies from the position itself.
            out = decode_attention.decode_attention(q[:, :, 0], k, v, positions)
            return self.wo(out.reshape(batch, seq, q_dim))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=self.n_heads != self.n_kv_heads
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, q_dim))


class FeedForward(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.w13 = nn.Linear(config.dim, 2 * config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, rope, mask, positions):
        h = x + self.attention(self.attention_norm(x), rope, mask, positions)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.register_buffer("rope", None, persistent=False)
        self.register_buffer("causal_mask", None, persistent=False)

    def setup_cache(self, batch: int) -> None:
        """A zeroed KV cache per layer for ``batch`` sequences, and the rotary table and causal
        mask, on the device of the embeddings (call after loading weights). Buffers that
        already fit are reused (the caches zeroed in place), so compiled CUDA graphs keep
        their addresses from one generation to the next."""
        c, weight = self.config, self.tok_embeddings.weight
        if self.rope is None or self.rope.device != weight.device:
            self.rope = rope_table(c).to(weight.device)
            mask = torch.ones(c.max_seq_len, c.max_seq_len, dtype=torch.bool, device=weight.device)
            self.causal_mask = mask.tril()
        for layer in self.layers:
            cache = layer.attention.kv_cache
            if cache is not None and cache.fits(batch, weight):
                cache.k.zero_()
                cache.v.zero_()
            else:
                layer.attention.kv_cache = KVCache(batch, layer.attention.n_kv_heads, c, weight.dtype, weight.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits (fp32) for ``tokens`` (batch, seq) at ``positions`` (seq,); needs
        ``setup_cache`` first."""
        mask = self.causal_mask[None, None, positions]
        rope = self.rope[positions]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, rope, mask, positions)
        return self.output(self.norm(x)).float()


def rope_table(config: DecoderConfig) -> torch.Tensor:
    half = config.head_dim // 2
    freqs = 1.0 / (config.rope_base ** (torch.arange(half).float() / half))
    angles = torch.outer(torch.arange(config.max_seq_len).float(), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)  # (seq, half, 2)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    rope = rope.view(1, pairs.size(1), 1, pairs.size(3), 2)
    real = pairs[..., 0] * rope[..., 0] - pairs[..., 1] * rope[..., 1]
    imag = pairs[..., 1] * rope[..., 0] + pairs[..., 0] * rope[..., 1]
    return torch.stack([real, imag], dim=-1).flatten(3).type_as(x)


def build_decoder(
    config: DecoderConfig = DEMO,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device="cpu",
) -> Decoder:
    """A decoder with seeded random weights (std 0.02 linears, unit norms)."""
    with torch.device(device):
        model = Decoder(config).to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.02, generator=generator)
    return model.eval()


def parallelize(model: Decoder, mesh) -> Decoder:
    """Shard ``model``'s blocks over the one-dimensional device mesh ``mesh``, in place
    (Megatron style, PyTorch's ``parallelize_module``): each rank computes its share of the
    attention heads and of the MLP's columns (the fused projections column-wise, ``wo`` and
    ``w2`` row-wise, summed across ranks) and its share of the head's rows (the logits
    gathered); the embedding and the norms stay whole on every rank. Every rank must hold the
    same weights, dense or quantized: each cuts its own shard. Call ``setup_cache`` afterwards
    (each rank caches its own KV heads)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    c, ranks = model.config, mesh.size()
    if c.n_heads % ranks or c.n_kv_heads % ranks or c.intermediate_size % ranks:
        raise ValueError(f"{ranks} ranks must divide the heads ({c.n_heads}), the KV heads ({c.n_kv_heads}) and "
                         f"the MLP's width ({c.intermediate_size})")
    q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    plan = {"attention.wqkv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w13": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()}
    for layer in model.layers:
        _group_by_rank(layer.attention.wqkv, (q_dim, kv_dim, kv_dim), ranks)
        _group_by_rank(layer.feed_forward.w13, (c.intermediate_size,) * 2, ranks)
        parallelize_module(layer, mesh, plan, src_data_rank=None)
        layer.attention.n_heads //= ranks
        layer.attention.n_kv_heads //= ranks
        layer.attention.kv_cache = None
    parallelize_module(model, mesh, {"output": ColwiseParallel(output_layouts=Replicate())}, src_data_rank=None)
    return model


def _group_by_rank(linear: nn.Linear, sections, ranks: int) -> None:
    """Reorder a fused projection's rows ``[a | b | c]`` as ``[a0 b0 c0 | a1 b1 c1 | ...]``
    (``x_r``: rank r's even share of section x), so that a row-wise shard of the whole is each
    rank's share of every section, in the order the forward splits them."""
    parts = [part.chunk(ranks, dim=0) for part in linear.weight.detach().split(list(sections), dim=0)]
    grouped = torch.cat([part[rank] for rank in range(ranks) for part in parts], dim=0)
    linear.weight = nn.Parameter(grouped, requires_grad=False)


def decode_step(model: Decoder, token: torch.Tensor, position: torch.Tensor):
    """Logits of the next token for ``token`` (batch, 1) at ``position`` (1,)."""
    return model(token, position)[:, -1]


@torch.no_grad()
def generate(model: Decoder, prompt: torch.Tensor, new_tokens: int, step=decode_step):
    """Greedy tokens (batch, new_tokens) after ``prompt`` (batch, len); ``step`` runs each
    decode step (pass a compiled ``decode_step``). Returns tokens and the per-step logits."""
    batch, length = prompt.shape
    device = prompt.device
    model.setup_cache(batch)
    logits = model(prompt, torch.arange(length, device=device))[:, -1]
    tokens, all_logits = [], [logits]
    token = logits.argmax(-1, keepdim=True)
    for i in range(new_tokens - 1):
        tokens.append(token)
        position = torch.tensor([length + i], device=device)
        # Cloned: a step compiled with CUDA graphs reuses its output buffer on the next call.
        logits = step(model, token, position).clone()
        all_logits.append(logits)
        token = logits.argmax(-1, keepdim=True)
    tokens.append(token)
    return torch.cat(tokens, dim=1), torch.stack(all_logits, dim=1)
