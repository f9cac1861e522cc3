"""The decode-attention kernel against PyTorch's attention with the causal mask's row. On a
CPU it runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1); with a GPU for real,
where it is also compiled and captured in a CUDA graph."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from coalesced_int4.kernels.decode_attention import BLOCK_POSITIONS, MAX_CACHE_POSITIONS, decode_attention, serves
from tests.helpers import requires_cuda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(batch, heads, kv_heads, max_seq, head_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, head_dim, generator=generator)
    k = torch.randn(batch, kv_heads, max_seq, head_dim, generator=generator)
    v = torch.randn(batch, kv_heads, max_seq, head_dim, generator=generator)
    return [t.to(torch.bfloat16).to(DEVICE) for t in (q, k, v)]


def _reference(q, k, v, position):
    """fp32 attention of q at ``position`` with the causal mask's row (positions <= it)."""
    mask = (torch.arange(k.shape[2], device=k.device) <= position)[None, None, None]
    out = F.scaled_dot_product_attention(q.float()[:, :, None], k.float(), v.float(),
                                         attn_mask=mask, enable_gqa=True)
    return out[:, :, 0]


@pytest.mark.parametrize(
    "batch, heads, kv_heads, head_dim",
    [(2, 8, 2, 64), (1, 4, 4, 32), (3, 32, 8, 128)],  # grouped, one query head per KV head, Llama-3
)
@pytest.mark.parametrize("position", [0, BLOCK_POSITIONS - 1, BLOCK_POSITIONS, 2 * BLOCK_POSITIONS + 5])
def test_decode_attention_matches_masked_attention(batch, heads, kv_heads, head_dim, position):
    max_seq = 3 * BLOCK_POSITIONS
    q, k, v = _inputs(batch, heads, kv_heads, max_seq, head_dim, seed=position)
    out = decode_attention(q, k, v, torch.tensor([position], device=DEVICE))
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    # bf16 output rounding (2^-9 relative) and the bf16 probabilities fed to the value dot.
    torch.testing.assert_close(out.float(), _reference(q, k, v, position), rtol=2e-2, atol=1e-2)


def test_positions_beyond_the_query_position_are_never_read():
    q, k, v = _inputs(1, 8, 2, 2 * BLOCK_POSITIONS, 64)
    position = torch.tensor([BLOCK_POSITIONS + 3], device=DEVICE)
    out = decode_attention(q, k, v, position)
    k[:, :, BLOCK_POSITIONS + 4:] = float("nan")
    v[:, :, BLOCK_POSITIONS + 4:] = float("nan")
    assert torch.equal(decode_attention(q, k, v, position), out)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, p: (q[:, :, None], k, v, p), "q must be"),
        (lambda q, k, v, p: (q.float(), k, v, p), "q must be bf16"),
        (lambda q, k, v, p: (q[:, :7], k, v, p), "H a multiple of KVH"),
        (lambda q, k, v, p: (q[..., :48], k[..., :48], v[..., :48], p), "D must be a power of two"),
        (lambda q, k, v, p: (q, k, v, p.to(torch.int32)), "position must be one int64"),
        (lambda q, k, v, p: (q, k.transpose(2, 3), v, p), "k_cache must be bf16 with unit stride"),
    ],
)
def test_bad_arguments_are_named_with_their_rule(change, message):
    q, k, v = _inputs(1, 8, 2, 64, 64)
    with pytest.raises(ValueError, match=message):
        decode_attention(*change(q, k, v, torch.tensor([3], device=DEVICE)))


@requires_cuda
def test_a_cuda_graph_of_decode_attention_reads_the_position_at_replay():
    q, k, v = _inputs(1, 32, 8, 512, 128)
    position = torch.tensor([0], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_attention(q, k, v, position)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = decode_attention(q, k, v, position)
    for p in (5, 200, 511):
        position.fill_(p)
        graph.replay()
        assert torch.equal(captured, decode_attention(q, k, v, position)), p


@requires_cuda
def test_compiled_decode_attention_gives_eager_bits():
    torch._dynamo.reset()
    q, k, v = _inputs(4, 32, 8, 512, 128)
    position = torch.tensor([300], device="cuda")
    compiled = torch.compile(lambda *args: decode_attention(*args) * 1, fullgraph=True)
    out, code = torch._inductor.utils.run_and_get_code(compiled, q, k, v, position)
    assert "_decode_attention_kernel" in "\n".join(code)
    assert torch.equal(out, decode_attention(q, k, v, position))


def test_the_decoder_sends_only_one_token_steps_on_measured_caches_to_the_kernel():
    with FakeTensorMode():  # a CUDA cache's metadata, without a GPU
        cache = torch.empty(1, 8, MAX_CACHE_POSITIONS, 128, dtype=torch.bfloat16, device="cuda")
        longer = torch.empty(1, 8, MAX_CACHE_POSITIONS + 1, 128, dtype=torch.bfloat16, device="cuda")
        assert serves(1, cache)
        assert not serves(2, cache)  # prefill
        assert not serves(1, longer)
    assert not serves(1, torch.empty(1, 8, 64, 128))  # CPU
