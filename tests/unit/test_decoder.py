"""The built-in decoder's KV-cache set-up (CPU)."""

import torch

from coalesced_int4.decoder import DEMO, build_decoder, generate


def test_setup_cache_zeroes_and_reuses_buffers_that_fit():
    model = build_decoder(DEMO, seed=0)
    prompt = torch.randint(0, DEMO.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    first, _ = generate(model, prompt, 4)
    caches = [(layer.attention.kv_cache.k, layer.attention.kv_cache.v) for layer in model.layers]
    rope, mask = model.rope, model.causal_mask
    assert any(k.abs().sum() > 0 for k, _ in caches)  # generation wrote the caches
    model.setup_cache(2)
    for layer, (k, v) in zip(model.layers, caches):
        assert layer.attention.kv_cache.k is k and layer.attention.kv_cache.v is v
        assert not k.any() and not v.any()
    assert model.rope is rope and model.causal_mask is mask
    again, _ = generate(model, prompt, 4)  # a reused cache gives the same tokens
    assert torch.equal(first, again)


def test_setup_cache_builds_new_caches_for_another_batch():
    model = build_decoder(DEMO, seed=0)
    model.setup_cache(1)
    k = model.layers[0].attention.kv_cache.k
    model.setup_cache(3)
    cache = model.layers[0].attention.kv_cache
    assert cache.k is not k and cache.k.shape[0] == 3 and not cache.k.any()
