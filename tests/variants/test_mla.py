"""variants/mla.py, multi-head latent attention (model.attn.kind=mla): the layer against its
up-projections written out, naive and absorbed decoding against the whole sequence, what its cache
holds (the latent and the RoPE key, in any of the KV caches: plain, fixed-shape, int8, sink-keeping),
counts, and the options it refuses. Its sink-keeping cache is tests/variants/test_sink_cache.py's."""
import math

import pytest
import torch

from attention import apply_rope, rope_table
from lab.counting import count_params, kv_cache_bytes
from helpers import plain_attention
from helpers import variant_model as make
from model import GPTConfig
from rules import UserError
from variants.int8_cache import Int8KVCache


@pytest.mark.parametrize("q_lora", [None, 16], ids=["q-from-x", "q-latent"])
def test_mla_equals_attention_from_the_latent_with_its_up_projections_written_out(q_lora):
    model = make(attn={"kind": "mla", "q_lora_rank": q_lora, "kv_lora_rank": 12, "rope_head_dim": 4})
    attn = model.blocks[0].attn
    B, T, C, nh, hs, dc, dr = 2, 11, 32, 4, 8, 12, 4
    x = torch.randn(B, T, C)
    rope = rope_table(dr, T, 10000.0)
    with torch.no_grad():
        h = attn.q_norm(attn.q_down(x)) if q_lora else x
        q = (h @ attn.q_up.weight.T).view(B, T, nh, hs + dr)
        qc, qr = q[..., :hs], apply_rope(q[..., hs:], rope, dim=1)
        latent = x @ attn.kv_down.weight.T
        c = attn.kv_norm(latent[..., :dc])  # the cached latent
        kr = apply_rope(latent[..., dc:].unsqueeze(2), rope, dim=1)  # the one RoPE key, shared by the heads
        kc = (c @ attn.k_up.weight.T).view(B, T, nh, hs)
        v = (c @ attn.v_up.weight.T).view(B, T, nh, hs)
        qh = torch.cat([qc, qr], -1).transpose(1, 2)
        kh = torch.cat([kc, kr.expand(B, T, nh, dr)], -1).transpose(1, 2)
        y = plain_attention(qh, kh, v.transpose(1, 2), 1 / math.sqrt(hs + dr))
        want = y.transpose(1, 2).reshape(B, T, nh * hs).float() @ attn.c_proj.weight.T
        got = attn(x, rope=rope)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def decode(model, idx, prefill, **cache_options):
    """The logits of idx decoded through a cache: a prefill of `prefill` tokens, then one at a time."""
    cache = model.new_kv_cache(idx.size(0), idx.size(1), **cache_options)
    static = cache_options.get("static", False)
    steps = [model(idx[:, :prefill], cache=cache, pos=0)]
    steps += [model(idx[:, t:t + 1], cache=cache, pos=torch.tensor([t]) if static else t)
              for t in range(prefill, idx.size(1))]
    return torch.cat(steps, 1)


@pytest.mark.parametrize("pos", ["rope", "none"])
@pytest.mark.parametrize("absorbed", [False, True], ids=["naive", "absorbed"])
@pytest.mark.parametrize("static", [False, True], ids=["eager", "fixed-shape"])
def test_mla_decoding_equals_the_whole_sequence(pos, absorbed, static):
    """Absorbed (W_uk folded into the query, attention over the latents, W_uv after) equals naive
    (keys and values expanded from the latents) equals running the whole sequence, step by step, in
    the plain cache and in the fixed-shape one a compiled decode step uses."""
    model = make(block_size=32, pos=pos, attn={"kind": "mla"})
    idx = torch.randint(40, (2, 32))
    with torch.no_grad():
        got = decode(model, idx, 5, absorbed=absorbed, static=static)
        assert torch.allclose(got, model(idx), atol=1e-5)


def test_mla_cache_holds_only_the_latent_and_the_rope_key():
    model = make(block_size=32, attn={"kind": "mla", "kv_lora_rank": 12, "rope_head_dim": 4})
    cache = model.new_kv_cache(3, 32)
    assert all(c.k.shape == (3, 1, 32, 4) and c.v.shape == (3, 1, 32, 12) for c in cache)  # RoPE key, latent
    assert sum(c.nbytes() for c in cache) == kv_cache_bytes(model.config, 32, 3, 4) == 2 * 3 * 32 * 16 * 4
    mha = make(block_size=32)  # the same shape with per-head K and V: 2 x 4 heads x 8 = 64 numbers a token
    assert sum(c.nbytes() for c in mha.new_kv_cache(3, 32)) == kv_cache_bytes(mha.config, 32, 3, 4) == 2 * 2 * 4 * 8 * 4 * 32 * 3


@pytest.mark.parametrize("absorbed", [False, True], ids=["naive", "absorbed"])
def test_an_int8_latent_cache_stays_within_its_rounding(absorbed):
    """MLA with kv_dtype=int8: the latent and the RoPE key stored per token with one scale each, read
    back within half a scale; decoding then follows the fp32 latent cache within the rounding of what
    it reads (the attention over n latents moves each logit by at most |q̃| times the latent's error)."""
    model = make(block_size=32, attn={"kind": "mla", "kv_lora_rank": 12, "rope_head_dim": 4})
    idx = torch.randint(40, (2, 32))
    with torch.no_grad():
        caches = model.new_kv_cache(2, 32, dtype=torch.int8, absorbed=absorbed)
        assert all(isinstance(c, Int8KVCache) and c.k.dtype == c.v.dtype == torch.int8 for c in caches)
        kr, c = model.blocks[0].attn.latents(model.wte(idx[:, :7]), rope_table(4, 7, 10000.0))
        got_kr, got_c, _ = caches[0].update(0, kr, c)
        for x, got, scale in ((kr, got_kr, caches[0].k_scale[:, :, :7]), (c, got_c, caches[0].v_scale[:, :, :7])):
            assert torch.allclose(scale, x.abs().amax(-1, keepdim=True) / 127)
            assert ((got - x).abs() <= scale / 2 + 1e-6).all()
        full, int8 = decode(model, idx, 5, absorbed=absorbed), decode(model, idx, 5, dtype=torch.int8, absorbed=absorbed)
    assert (int8 - full).abs().max() < 0.05 * full.abs().max()
    assert (int8 - full).abs().max() > 0  # it did quantise
    assert sum(c.nbytes() for c in caches) == kv_cache_bytes(model.config, 32, 2, int8=True) \
        == 2 * 2 * 32 * (12 + 4 + 2 * 4)  # layers x batch x tokens x (latent + RoPE key + two fp32 scales)


def test_mla_counts_equal_the_built_model():
    for attn in ({"kind": "mla"}, {"kind": "mla", "q_lora_rank": 16, "gate": "channel", "sink": "learned"}):
        model = make(bias=True, attn=attn)
        assert count_params(model.config)["total"] == model.num_params()


@pytest.mark.parametrize("attn,needle", [
    ({"kind": "mla", "qk_norm": True}, "qk_norm=true with model.attn.kind=mla is not implemented"),
    ({"kind": "mla", "rope_head_dim": 3}, "MLA's RoPE part .* is 3, odd"),
])
def test_latent_options_that_cannot_work_are_refused(attn, needle):
    with pytest.raises(UserError, match=needle) as e:
        GPTConfig(vocab_size=40, n_layer=2, n_head=4, n_embd=32, attn=attn)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("attn,n_kv,line", [
    ({"kind": "mla"}, 2, "model.n_kv_head=2 has no effect on a mla layer (every head reads the one shared latent): "
                         "ignored"),
    ({"kv_lora_rank": 8}, None, "model.attn.kv_lora_rank=8 has no effect unless a layer is mla (model.attn.kind or "
                                "model.attn.layer_kinds): ignored (its default is None)"),
])
def test_latent_options_without_effect_are_ignored_and_said(attn, n_kv, line):
    cfg = GPTConfig(vocab_size=40, n_layer=2, n_head=4, n_embd=32, n_kv_head=n_kv, attn=attn)
    assert cfg.ignored == [line] and cfg.n_kv_head == 4  # MLA: every head reads the latent
