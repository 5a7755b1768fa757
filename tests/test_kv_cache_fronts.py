"""The KV cache's fronts: multi-head latent attention (MLA), an int8 cache, eviction that keeps
attention sinks (StreamingLLM), and the gates and sinks that decide whether a model needs them. Each
against its formula written out, or a recomputation."""
import math

import pytest
import torch

from attention import Int8KVCache, LatentCache, SinkKVCache, attention, rope_freqs, rotate
from common import UserError
from counting import count_params, kv_cache_bytes
from helpers import variant_model as make
from model import GPTConfig


def causal_softmax_attention(q, k, v, scale, sink=None):
    """softmax(q·kᵀ·scale + causal mask) v written out in float64 (the sink, per head, as one more
    logit with a zero value)."""
    q, k, v = q.double(), k.double(), v.double()
    T = q.size(-2)
    s = (q @ k.transpose(-2, -1)) * scale
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    if sink is not None:
        s = torch.cat([sink.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1), s], dim=-1)
        return torch.softmax(s, dim=-1)[..., 1:] @ v
    return torch.softmax(s, dim=-1) @ v


# ----------------------------------------------------------------------------- MLA

@pytest.mark.parametrize("q_lora", [None, 16], ids=["q-from-x", "q-latent"])
def test_mla_equals_attention_from_the_latent_with_its_up_projections_written_out(q_lora):
    model = make(attn={"kind": "mla", "q_lora_rank": q_lora, "kv_lora_rank": 12, "rope_head_dim": 4})
    attn = model.blocks[0].attn
    B, T, C, nh, hs, dc, dr = 2, 11, 32, 4, 8, 12, 4
    x = torch.randn(B, T, C)
    rope = rope_freqs(dr, T, 10000.0)
    with torch.no_grad():
        h = attn.q_norm(attn.q_down(x)) if q_lora else x
        q = (h @ attn.q_up.weight.T).view(B, T, nh, hs + dr)
        qc, qr = q[..., :hs], rotate(q[..., hs:], rope)
        latent = x @ attn.kv_down.weight.T
        c = attn.kv_norm(latent[..., :dc])  # the cached latent
        kr = rotate(latent[..., dc:].unsqueeze(2), rope)  # the one RoPE key, shared by the heads
        kc = (c @ attn.k_up.weight.T).view(B, T, nh, hs)
        v = (c @ attn.v_up.weight.T).view(B, T, nh, hs)
        qh = torch.cat([qc, qr], -1).transpose(1, 2)
        kh = torch.cat([kc, kr.expand(B, T, nh, dr)], -1).transpose(1, 2)
        y = causal_softmax_attention(qh, kh, v.transpose(1, 2), 1 / math.sqrt(hs + dr))
        want = y.transpose(1, 2).reshape(B, T, nh * hs).float() @ attn.c_proj.weight.T
        got = attn(x, rope=rope)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("pos", ["rope", "none"])
def test_mla_naive_and_absorbed_decoding_equal_the_whole_sequence(pos):
    """Absorbed (W_uk folded into the query, attention over the latents, W_uv after) equals naive
    (keys and values expanded from the latents) equals running the whole sequence, step by step."""
    model = make(block_size=32, pos=pos, attn={"kind": "mla"})
    idx = torch.randint(40, (2, 32))
    with torch.no_grad():
        full = model(idx)
        for absorbed in (False, True):
            cache = model.new_kv_cache(2, 32, absorbed=absorbed)
            steps = [model(idx[:, :5], kv_cache=cache, pos=0)]
            steps += [model(idx[:, t:t + 1], kv_cache=cache, pos=t) for t in range(5, 32)]
            assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5), absorbed


def test_mla_cache_holds_only_the_latent_and_the_rope_key():
    model = make(block_size=32, attn={"kind": "mla", "kv_lora_rank": 12, "rope_head_dim": 4})
    cache = model.new_kv_cache(3, 32)
    assert all(isinstance(c, LatentCache) and c.k.shape == (3, 1, 32, 12 + 4) for c in cache)
    assert sum(c.nbytes() for c in cache) == kv_cache_bytes(model.config, 32, 3, 4) == 2 * 3 * 32 * 16 * 4
    mha = make(block_size=32)  # the same shape with per-head K and V: 2 x 4 heads x 8 = 64 numbers a token
    assert sum(c.nbytes() for c in mha.new_kv_cache(3, 32)) == kv_cache_bytes(mha.config, 32, 3, 4) == 2 * 2 * 4 * 8 * 4 * 32 * 3


def test_mla_counts_equal_the_built_model():
    for attn in ({"kind": "mla"}, {"kind": "mla", "q_lora_rank": 16, "gate": "channel", "sink": "learned"}):
        model = make(bias=True, attn=attn)
        assert count_params(model.config)["total"] == model.num_params()


@pytest.mark.parametrize("attn,n_kv,needle", [
    ({"kind": "mla"}, 2, "model.n_kv_head=2 has no effect with model.attn.kind=mla"),
    ({"kind": "mla", "qk_norm": True}, None, "qk_norm=true with model.attn.kind=mla is not implemented"),
    ({"kv_lora_rank": 8}, None, "model.attn.kv_lora_rank=8 has no effect unless model.attn.kind=mla"),
    ({"kind": "linear", "sink": "zero"}, None, "model.attn.sink='zero' has no effect unless model.attn.kind is softmax or mla"),
])
def test_latent_and_sink_options_that_would_do_nothing_are_refused(attn, n_kv, needle):
    with pytest.raises(UserError, match=needle):
        GPTConfig(vocab_size=40, n_layer=2, n_head=4, n_embd=32, n_kv_head=n_kv, attn=attn)


# ----------------------------------------------------------------------------- int8

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
            steps = [model(seq[:, :3], kv_cache=cache, pos=0)[:, -1]]
            steps += [model(seq[:, t:t + 1], kv_cache=cache, pos=t)[:, -1] for t in range(3, 40)]
            out[dtype] = torch.stack(steps)
    assert (out[torch.int8] - out[torch.float32]).abs().max() < 0.05 * out[torch.float32].abs().max()


# ----------------------------------------------------------------------------- sinks and eviction

def test_sink_eviction_equals_attention_over_exactly_the_kept_positions():
    """One layer, decoding far past the cache: each step's logits equal the model run on just the kept
    tokens (the first 4, then the latest) at positions 0..n-1, which is what attending to them with
    in-cache positions means."""
    model = make(n_layer=1, block_size=12)
    ids = torch.randint(40, (1, 50))
    cache = model.new_kv_cache(1, 12, sinks=4)
    assert all(isinstance(c, SinkKVCache) for c in cache)
    with torch.no_grad():
        model(ids[:, :3], kv_cache=cache, pos=0)
        for t in range(3, 50):
            got = model(ids[:, t:t + 1], kv_cache=cache, pos=t)[0, -1]
            kept = list(range(t + 1)) if t < 12 else [0, 1, 2, 3] + list(range(t - 7, t + 1))
            want = model(ids[:, kept])[0, -1]
            assert torch.allclose(got, want, atol=1e-5), t


def test_eval_stream_reports_every_policy(tmp_path):
    """tools/eval_stream.py on a checkpoint and a text: every policy's loss within and past the cache,
    equal within it (nothing is evicted yet)."""
    from helpers import compose_cfg, save_tiny_checkpoint
    from tools.eval_stream import eval_stream
    ckpt = save_tiny_checkpoint(tmp_path, block_size=16)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 10)
    r = eval_stream(compose_cfg("eval_stream", [f"ckpt={ckpt}", f"text={text}", "tokens=80", "out=null"]))
    within = [p["within"] for p in r["policies"].values()]
    assert set(r["policies"]) == {"recompute", "ring", "sinks"} and max(within) - min(within) < 1e-4
    assert all(len(p["losses"]) == 79 and math.isfinite(p["past"]) for p in r["policies"].values())


def test_eval_stream_compares_cache_dtypes_against_a_recomputation(tmp_path):
    """kv_dtypes=: each dtype's bytes are cost.py's, its logit error and argmax agreement are those of
    decoding the text step by step through that cache (recomputed here), and the greedy texts first
    differ where sample.generate's do."""
    from helpers import compose_cfg, save_tiny_checkpoint
    from checkpoint import load_checkpoint, model_from_checkpoint
    from sample import generate
    from tools.eval_stream import eval_stream, stream_tokens
    ckpt = save_tiny_checkpoint(tmp_path, block_size=16)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 10)
    cfg = compose_cfg("eval_stream", [f"ckpt={ckpt}", f"text={text}", "tokens=60", "policies=[ring]", "greedy=40",
                                      "kv_dtypes=[float32,bfloat16,int8]", "out=null"])
    rows = eval_stream(cfg)["kv_dtypes"]
    state = load_checkpoint(ckpt)
    model = model_from_checkpoint(state).eval()
    ids = stream_tokens(state, cfg, 60)
    logits = {}
    with torch.no_grad():
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("int8", torch.int8)):
            cache = model.new_kv_cache(1, 16, dtype=dtype)
            logits[name] = torch.stack([model(ids[None, t:t + 1], kv_cache=cache, pos=t)[0, -1] for t in range(59)])
            assert rows[name]["bytes"] == kv_cache_bytes(model.config, 16, 1, dtype.itemsize if name != "int8" else 1,
                                                         int8=name == "int8")
    greedy = {n: generate(model, ids[None, :8], 40, temperature=0, kv_dtype=d)[0, 8:]
              for n, d in (("float32", torch.float32), ("int8", torch.int8))}
    for name in ("bfloat16", "int8"):
        err = (logits[name].float() - logits["float32"]).abs()
        assert rows[name]["max_logit_error"] == pytest.approx(err.max().item(), abs=1e-6) and err.max() > 0
        agree = (logits[name].argmax(-1) == logits["float32"].argmax(-1)).float().mean().item()
        assert rows[name]["argmax_agreement"] == pytest.approx(agree)
    assert rows["float32"]["max_logit_error"] == 0 and rows["float32"]["first_difference"] is None
    differ = (greedy["int8"] != greedy["float32"]).nonzero()
    assert rows["int8"]["first_difference"] == (None if differ.numel() == 0 else int(differ[0, 0]))


# ----------------------------------------------------------------------------- gates and sinks

@pytest.mark.parametrize("impl", ["sdpa", "reference", "tiled"])
def test_a_sink_is_one_more_logit_with_a_zero_value(impl):
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 4, 13, 8), torch.randn(2, 4, 13, 8), torch.randn(2, 4, 13, 8)
    sink = torch.tensor([-1.0, 0.0, 2.0, 5.0])
    got = attention(q, k, v, 0.3, impl=impl, sink=sink, block=4)
    assert torch.allclose(got.double(), causal_softmax_attention(q, k, v, 0.3, sink), atol=1e-5)


@pytest.mark.parametrize("gate", ["head", "channel"])
def test_a_gate_scales_each_head_output_by_sigmoid_of_the_layer_input(gate):
    model = make(attn={"gate": gate})
    attn = model.blocks[0].attn
    x = torch.randn(2, 9, 32)
    rope = rope_freqs(8, 9, 10000.0)
    with torch.no_grad():
        q, k, v = attn.qkv(x, rope)
        y = causal_softmax_attention(q, k, v, attn.scale).float()  # (B, nh, T, hs)
        g = torch.sigmoid(x @ attn.gate.weight.T).view(2, 9, 4, -1).transpose(1, 2)
        want = (y * g).transpose(1, 2).reshape(2, 9, 32) @ attn.c_proj.weight.T
        assert torch.allclose(attn(x, rope=rope), want, atol=1e-5)


def test_with_the_gate_at_one_and_no_sink_the_model_is_todays():
    gated, plain = make(attn={"gate": "channel"}), make()
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if "gate" not in k})
    for b in gated.blocks:  # sigmoid(+40) is 1.0 in fp32
        b.attn.gate.register_forward_hook(lambda m, args, out: torch.full_like(out, 40.0))
    idx = torch.randint(40, (2, 16))
    assert torch.equal(gated(idx), plain(idx))


def test_the_probe_logs_sink_mass_and_the_largest_activation():
    from attnstats import AttentionProbe
    model = make(attn={"sink": "learned"})
    with torch.no_grad():
        for b in model.blocks:
            b.attn.sink_logit.fill_(50.0)  # a sink that takes (nearly) everything
    stats = AttentionProbe(torch.randint(40, (2, 16))).run(model)
    assert stats["attn_sink/L0"] > 0.99 and stats["attn_sink/L1/H3"] > 0.99
    assert "act_max/L0" in stats and stats["act_max/max"] == max(stats["act_max/L0"], stats["act_max/L1"])
    plain = AttentionProbe(torch.randint(40, (2, 16))).run(make())
    assert not any(k.startswith("attn_sink") for k in plain)


def test_compiled_decoding_refuses_what_its_static_cache_cannot_hold():
    from sample import generate
    model = make()
    for kw in ({"kv_dtype": torch.int8}, {"kv_sinks": 2}):
        with pytest.raises(UserError, match="compiled decode step"):
            generate(model, torch.zeros(1, 1, dtype=torch.long), 20, temperature=0, compile=True, **kw)
    with pytest.raises(UserError, match="MLA's latent cache supports neither"):
        generate(make(attn={"kind": "mla"}), torch.zeros(1, 1, dtype=torch.long), 4, temperature=0, compile=True)
