"""variants/int8_cache.py, the int8 KV cache (sample.py kv_dtype=int8): each token's key and value
within half a scale, its bytes as lab/counting.py says, and decoding that follows the fp32 cache."""
import torch

from lab.counting import kv_cache_bytes
from helpers import variant_model as make
from variants.int8_cache import Int8KVCache


def test_int8_cache_dequantises_within_half_a_scale_and_weighs_what_cost_py_says():
    torch.manual_seed(0)
    cache = Int8KVCache(2, 4, 16, 8)
    k, v = torch.randn(2, 4, 10, 8) * 3, torch.randn(2, 4, 10, 8)
    got_k, got_v, _ = cache.update(0, k, v)
    for x, got, scale in ((k, got_k, cache.k_scale[:, :, :10]), (v, got_v, cache.v_scale[:, :, :10])):
        assert torch.allclose(scale, x.abs().amax(-1, keepdim=True) / 127)  # per token and head
        assert ((got - x).abs() <= scale / 2 + 1e-6).all()
    model = make(block_size=16)
    caches = model.new_kv_cache(3, 16, dtype=torch.int8)
    assert sum(c.nbytes() for c in caches) == kv_cache_bytes(model.config, 16, 3, int8=True) == 2 * 2 * 3 * 4 * 16 * (8 + 4)


def test_int8_decoding_follows_the_fp32_cache():
    """Step by step past block_size, an int8 cache's logits stay within a few percent of the largest
    fp32 logit, and greedy generation from the same prompt mostly agrees (the figures for trained
    models are in docs/kv_cache.md)."""
    from sample import generate
    model = make(block_size=16)
    prompt = torch.randint(40, (2, 4))
    fp32 = generate(model, prompt, 30, temperature=0, kv_dtype=torch.float32)
    int8 = generate(model, prompt, 30, temperature=0, kv_dtype=torch.int8)
    assert (fp32 == int8).float().mean() > 0.8
    seq = torch.randint(40, (2, 40))
    with torch.no_grad():
        out = {}
        for dtype in (torch.float32, torch.int8):
            cache = model.new_kv_cache(2, 16, dtype=dtype)
            steps = [model(seq[:, :3], cache=cache, pos=0)[:, -1]]
            steps += [model(seq[:, t:t + 1], cache=cache, pos=t)[:, -1] for t in range(3, 40)]
            out[dtype] = torch.stack(steps)
    assert (out[torch.int8] - out[torch.float32]).abs().max() < 0.05 * out[torch.float32].abs().max()
