"""The architecture variants together: GQA/MQA, Post-LN, RMSNorm, an untied head, soft-cap, zero-init and
value embeddings against their formulas written out (the pieces of variants/ have their own files in
tests/variants/), and every variant and combination through the fast and reference paths, the KV
cache and a short training run."""
import math

import pytest
import torch
import torch.nn.functional as F

from rules import UserError
from helpers import variant_model as make  # a model of any variant, trained-looking weights
from lab.counting import flops_per_token
from model import GPT, GPTConfig
from variants import PATHS, attention
from sample import generate

VARIANTS = [
    {},
    {"n_kv_head": 2},
    {"n_kv_head": 1},
    {"norm_position": "post"},
    {"norm": "rmsnorm"},
    {"mlp": "swiglu"},
    {"mlp": "relu2", "d_ff": 96},
    {"pos": "learned"},
    {"pos": "sinusoidal"},
    {"pos": "none"},
    {"tie_embeddings": False},
    {"logit_softcap": 5.0},
    {"zero_init_proj": True},
    {"value_embed": True},  # with GQA/MQA shapes: test_value_embedding_is_added_to_v
    {"norm": "rmsnorm", "mlp": "swiglu", "n_kv_head": 2, "tie_embeddings": False,
     "attn": {"qk_norm": True, "qk_norm_gain": "channel"}},
    {"n_kv_head": 1, "attn": {"qk_norm": True, "qk_norm_type": "l2", "qk_norm_gain": "head", "scale": "4.0"}},
    {"attn": {"impl": "tiled", "block": 5}},
    {"n_kv_head": 2, "attn": {"window": 6}},
    {"attn": {"window": 6, "window_pattern": "LG", "impl": "tiled", "block": 4}},
    {"attn": {"kind": "linear"}},
    {"n_kv_head": 2, "attn": {"kind": "linear", "qk_norm": True}},
    {"attn": {"kind": "mla"}},
    {"attn": {"kind": "mla", "q_lora_rank": 16, "kv_lora_rank": 12, "rope_head_dim": 4, "gate": "head"}},
    {"attn": {"gate": "channel", "sink": "learned"}},
    {"n_kv_head": 2, "attn": {"sink": "zero", "impl": "tiled", "block": 4}},
    {"pos": "alibi"},
    {"pos": "alibi", "n_kv_head": 2, "attn": {"impl": "tiled", "block": 4, "sink": "learned"}},
    {"attn": {"kind": "gdn"}},
    {"attn": {"kind": "mamba2", "state_dim": 8}},
    {"attn": {"layer_kinds": ["gdn", "softmax"]}},
    {"n_layer": 3, "mlp": "none", "n_kv_head": 2, "attn": {"layer_kinds": ["linear", "mamba2", "softmax"], "gate": "head"}},
    {"attn": {"layer_kinds": ["gdn", "mla"]}},
    {"n_kv_head": 2, "attn": {"select": "moba", "select_block": 4, "select_topk": 1, "sink": "learned"}},
    {"attn": {"layer_kinds": ["softmax", "linear"], "select": "oracle", "select_topk": 3, "qk_norm": True}},
    {"n_kv_head": 2, "attn": {"select": "indexer", "select_topk": 3, "indexer_heads": 2, "indexer_dim": 4, "sink": "learned"}},
    {"n_kv_head": 1, "pos": "learned", "attn": {"layer_kinds": ["softmax", "gdn"], "select": "indexer", "select_topk": 4,
                                                "qk_norm": True, "indexer_kl": 0.5}},
]
IDS = [",".join(f"{k}={v}" for k, v in v.items()) or "default" for v in VARIANTS]


def kinds(variant) -> set:
    attn = variant.get("attn", {})
    return set(attn.get("layer_kinds") or [attn.get("kind", "softmax")])


def recurrent(variant) -> bool:
    """A layer keeps a state of the whole context (linear, gdn, mamba2): no second path to compare, and
    no sliding past block_size (cropping the context is another function)."""
    return bool(kinds(variant) & {"linear", "gdn", "mamba2"})


def softmax_free(variant) -> bool:
    return not kinds(variant) & {"softmax", "mla"}


def as_reference(variant) -> dict:
    """The same variant on the plain-math reference path (which has no tiles)."""
    attn = {k: v for k, v in variant.get("attn", {}).items() if k != "block"}
    return {**variant, "attn": {**attn, "impl": "reference"}}


def max_diff(a, b):
    return f"max diff {(a - b).abs().max().item():.2e}, mean {(a - b).abs().mean().item():.2e}"


# ----------------------------------------------------------------------------- formulas

def test_gqa_equals_mha_with_kv_weights_repeated_per_group():
    """A model with n_kv_head=k is an MHA model whose K and V projections repeat each of the k
    heads for its n_head/k query heads."""
    gqa = make(n_kv_head=2, attn={"qk_norm": True, "qk_norm_gain": "channel"})
    mha = make(seed=1, attn={"qk_norm": True, "qk_norm_gain": "channel"})
    nh, nkv, hs, C = 4, 2, 8, 32
    state = gqa.state_dict()
    for l in range(2):
        w = state[f"blocks.{l}.attn.c_attn.weight"]  # ((nh + 2 nkv) hs, C)
        q, k, v = w[:nh * hs], w[nh * hs:(nh + nkv) * hs], w[(nh + nkv) * hs:]
        rep = lambda m: m.view(nkv, hs, C).repeat_interleave(nh // nkv, dim=0).reshape(nh * hs, C)
        state[f"blocks.{l}.attn.c_attn.weight"] = torch.cat([q, rep(k), rep(v)])
        state[f"blocks.{l}.attn.k_gain"] = state[f"blocks.{l}.attn.k_gain"].repeat_interleave(nh // nkv, dim=0)
    mha.load_state_dict(state)
    idx = torch.randint(40, (3, 16))
    for impl in ("sdpa", "reference"):
        for block in (*gqa.blocks, *mha.blocks):
            block.attn.attend = PATHS[impl](128)
        a, b = gqa(idx), mha(idx)
        assert torch.allclose(a, b, atol=1e-4), f"{impl}: {max_diff(a, b)}"


def test_sdpa_gqa_equals_expanded_kv():
    q = torch.randn(2, 6, 10, 8, dtype=torch.float64)
    k, v = torch.randn(2, 2, 10, 8, dtype=torch.float64), torch.randn(2, 2, 10, 8, dtype=torch.float64)
    fast = attention(q, k, v, 0.3, impl="sdpa")  # enable_gqa, no copy
    expanded = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
                                              is_causal=True, scale=0.3)
    assert torch.allclose(fast, expanded, atol=1e-10), max_diff(fast, expanded)


def test_kv_cache_is_n_head_over_n_kv_head_times_smaller():
    sizes = {}
    for nkv in (4, 2, 1):
        cache = make(n_kv_head=nkv).new_kv_cache(batch_size=3, length=16)
        sizes[nkv] = sum(c.k.numel() * c.k.element_size() + c.v.numel() * c.v.element_size() for c in cache)
    # 2 layers x (k, v) x batch 3 x heads x 16 positions x 8 channels x 4 bytes
    assert sizes == {4: 2 * 2 * 3 * 4 * 16 * 8 * 4, 2: 2 * 2 * 3 * 2 * 16 * 8 * 4, 1: 2 * 2 * 3 * 1 * 16 * 8 * 4}


def test_post_ln_block_is_the_formula_written_out():
    model = make(norm_position="post", n_layer=1)
    block, x = model.blocks[0], torch.randn(2, 16, 32)
    freqs = model.rope_at(0, 16)
    h = F.layer_norm(x + block.attn(x, rope=freqs), (32,), block.ln_1.weight, block.ln_1.bias, eps=1e-5)
    want = F.layer_norm(h + block.mlp.c_proj(F.gelu(block.mlp.c_fc(h))), (32,), block.ln_2.weight, block.ln_2.bias,
                        eps=1e-5)
    got = block(x, rope=freqs)
    assert torch.allclose(got, want, atol=1e-5), max_diff(got, want)
    assert isinstance(model.ln_f, torch.nn.Identity)  # no norm after the last Post-LN block


def test_rmsnorm_equals_f_rms_norm_and_the_formula():
    model = make(norm="rmsnorm", n_layer=1)
    x = torch.randn(2, 5, 32)
    norm = model.blocks[0].ln_1
    by_hand = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    assert torch.allclose(norm(x), F.rms_norm(x, (32,), norm.weight, eps=1e-5), atol=1e-6)
    assert torch.allclose(norm(x), by_hand, atol=1e-5), max_diff(norm(x), by_hand)


def test_untied_head_softcap_and_zero_init():
    untied = make(tie_embeddings=False)
    assert untied.lm_head.weight.data_ptr() != untied.wte.weight.data_ptr()
    tied = make()
    assert untied.num_params() == tied.num_params() + 40 * 32
    assert flops_per_token(untied.config) == flops_per_token(tied.config)  # the input lookup does no matmul
    capped = make(logit_softcap=2.0)
    assert capped(torch.randint(40, (2, 16))).abs().max() < 2.0
    torch.manual_seed(0)
    zero = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32, zero_init_proj=True))
    assert all(p.abs().max() == 0 for n, p in zero.named_parameters() if n.endswith("c_proj.weight"))
    x = torch.randint(40, (2, 16))
    # every block starts as the identity: the logits are those of embedding -> final norm -> head
    assert torch.allclose(zero(x), zero.lm_head(zero.ln_f(zero.wte(x))), atol=1e-6)


@pytest.mark.parametrize("n_kv_head", [4, 1])
def test_value_embedding_is_added_to_v(n_kv_head):
    """model.value_embed=true equals the same model without it whose fused projection's v part gets
    E_layer[token] added (a forward hook on each c_attn), on the fast and the reference path; and the
    tables are lookups: no FLOPs counted, AdamW (not Muon) trains them."""
    from lab.optim import split_params
    ve = make(value_embed=True, n_kv_head=n_kv_head)
    plain = make(n_kv_head=n_kv_head)
    state = {k: v for k, v in ve.state_dict().items() if not k.startswith("value_embeds.")}
    plain.load_state_dict(state)
    idx = torch.randint(40, (3, 16))
    nv = n_kv_head * 8

    def add_to_v(layer):
        def hook(module, inputs, out):
            return torch.cat([out[..., :-nv], out[..., -nv:] + ve.value_embeds[layer](idx)], dim=-1)
        return hook

    for layer, block in enumerate(plain.blocks):
        block.attn.c_attn.register_forward_hook(add_to_v(layer))
    for impl in ("sdpa", "reference"):
        for m in (ve, plain):
            for block in m.blocks:
                block.attn.attend = PATHS[impl](128)
        a, b = ve(idx), plain(idx)
        assert torch.allclose(a, b, atol=1e-5), f"{impl}: {max_diff(a, b)}"
    bare = make(n_kv_head=n_kv_head)
    bare.load_state_dict(state)
    assert not torch.allclose(ve(idx), bare(idx), atol=1e-3)  # the tables do change the output
    assert ve.num_params() == plain.num_params() + 2 * 40 * nv and flops_per_token(ve.config) == flops_per_token(plain.config)
    muon, decay, _ = split_params(ve)
    tables = {id(e.weight) for e in ve.value_embeds}
    assert tables <= {id(p) for p in decay} and not tables & {id(p) for p in muon}


# ----------------------------------------------------------------------------- every variant

@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_fast_path_equals_reference_and_is_causal(variant):
    """The variant's path (sdpa or tiled) equals the plain-math reference; linear attention, gdn and
    mamba2 have one path each (their formulas are tests/variants/'s), a hybrid's softmax layers two."""
    fast = make(**variant)
    idx = torch.randint(40, (2, 16))
    a = fast(idx)
    if not softmax_free(variant):
        b = make(**as_reference(variant))(idx)
        assert torch.allclose(a, b, atol=1e-4), max_diff(a, b)
    changed = idx.clone()
    changed[:, 9:] = torch.randint(40, (2, 7))
    assert torch.allclose(fast(changed)[:, :9], a[:, :9], atol=1e-5)  # the future never leaks back


@pytest.mark.parametrize("variant", VARIANTS, ids=IDS)
def test_cached_generation_equals_recomputation(variant):
    """Greedy tokens with the cache equal recomputing the context each step: within one block for
    every variant, and past it where the two paths compute the same function (one layer with a
    sliding cache; any depth with absolute positions, which re-prefill)."""
    model = make(**variant)
    prompt = torch.randint(40, (2, 5))
    within = (generate(model, prompt, 11, temperature=0, kv_cache=True),
              generate(model, prompt, 11, temperature=0, kv_cache=False))
    assert torch.equal(*within)
    if recurrent(variant):  # its state keeps the whole context; cropping to block_size is another function
        return
    past = make(n_layer=1 if model.slides else 2, **variant)
    a = generate(past, prompt, 40, temperature=0, kv_cache=True)
    b = generate(past, prompt, 40, temperature=0, kv_cache=False)
    assert a.shape == (2, 45) and torch.equal(a, b)


# the two combinations of most options train in the fast tier, each option on its own in the slow one
FAST_TRAINING = IDS[15:17]


@pytest.mark.parametrize("variant", [pytest.param(v, id=i, marks=() if i in FAST_TRAINING else pytest.mark.slow)
                                     for v, i in zip(VARIANTS, IDS) if v])
def test_every_variant_trains_probes_and_samples(variant, train_cfg, sample_cfg, tmp_path):
    from sample import sample
    from train import train
    overrides = []
    for k, v in variant.items():
        overrides += [f"model.attn.{a}={b}" for a, b in v.items()] if k == "attn" else [f"model.{k}={v}"]
    result = train(train_cfg(*overrides, "model.n_head=4", "train.max_iters=6", "train.eval_interval=3",
                             "train.log_attn_interval=3"))
    assert math.isfinite(result["val_loss"]) and result["val_loss"] < 10  # a char model starts near ln(vocab) < 5
    probe = result["attn"][-1]
    if softmax_free(variant):  # no softmax weights: the probe logs the in-context losses only
        assert "incontext/gain" in probe and not any(k.startswith("attn_") for k in probe)
    elif len(kinds(variant)) > 1:  # a hybrid: statistics for the softmax layers only
        pattern = variant["attn"]["layer_kinds"]
        layers = [pattern[l % len(pattern)] for l in range(variant.get("n_layer", 2))]
        assert [any(k.startswith(f"attn_entropy/L{l}/") for k in probe) for l in range(len(layers))] == \
            [k in ("softmax", "mla") for k in layers]
    else:
        assert {f"attn_entropy/L1/H{h}" for h in range(4)} <= probe.keys()  # one value per query head
    text = sample(sample_cfg(f"ckpt={tmp_path / 'run'}", "prompt=line", "max_new_tokens=40", "temperature=0"))[0]
    assert text.startswith("line") and len(text) == 44


@pytest.mark.parametrize("override,needle", [
    ("model.n_kv_head=3", "must divide model.n_head"),
    ("model.n_kv_head=0", "model.n_kv_head=0 must be an integer >= 1"),
    ("model.norm=batchnorm", "model.norm='batchnorm' is unknown"),
    ("model.norm_position=middle", "norm_position"),
    ("model.mlp=tanh", "model.mlp"),
    ("model.pos=wavelet", "model.pos"),
    ("model.d_ff=0", "model.d_ff"),
    ("model.logit_softcap=-1", "logit_softcap"),
])
def test_bad_variant_options_are_one_line_errors(override, needle, train_cfg):
    from train import train
    with pytest.raises(UserError, match=needle) as e:
        train(train_cfg(override))
    assert "\n" not in str(e.value)


def test_old_checkpoint_config_without_the_new_keys_builds_the_default_model():
    old = {"vocab_size": 40, "block_size": 16, "n_layer": 2, "n_head": 4, "n_embd": 32, "dropout": 0.0,
           "bias": False, "rope_base": 10000.0, "attn": {"scale": "sqrt_dk"}, "head_dim": 8, "attn_scale": 0.35}
    old = {k: v for k, v in old.items() if k not in ("head_dim", "attn_scale")}
    cfg = GPTConfig(**old)
    assert (cfg.n_kv_head, cfg.norm, cfg.mlp, cfg.pos, cfg.tie_embeddings, cfg.d_ff) == (4, "layernorm", "gelu",
                                                                                        "rope", True, 128)
    torch.manual_seed(0)
    model = GPT(cfg)
    assert sorted(model.state_dict()) == sorted(make().state_dict())


@pytest.mark.parametrize("attn, block, says", [
    ({"select": "moba", "select_block": 64, "select_topk": 4}, 128, "select=moba selects nothing away"),
    ({"select": "moba", "select_block": 64}, 32, "select=moba selects nothing away"),
    ({"select": "moba", "select_block": 8, "select_topk": 3}, 32, "select=moba selects nothing away"),  # 4 blocks
    ({"select": "oracle", "select_topk": 32}, 32, "select=oracle selects nothing away"),
    ({"select": "indexer", "select_topk": 40}, 32, "select=indexer selects nothing away"),
    ({"window": 32}, 32, "windows no layer"),
    ({"window": 4, "window_pattern": "LG", "layer_kinds": ["gdn", "softmax"]}, 32, "windows no layer"),
    ({"select": "moba", "select_block": 8, "select_topk": 2}, 32, None),  # 4 blocks, each query reads 3 at most
    ({"select": "oracle", "select_topk": 31}, 32, None),
    ({"window": 4, "window_pattern": "GL", "layer_kinds": ["gdn", "softmax"]}, 32, None),
])
def test_a_selection_or_window_that_changes_nothing_is_warned(attn, block, says):
    """Counted from the sizes: MoBA reads its own block and select_topk earlier ones of ceil(N/B); the
    oracle and the indexer select_topk keys of N; a window acts on softmax/mla layers marked L, below N."""
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=block, vocab_size=40, attn=attn)
    lines = [line for line in config.ignored if "selects nothing" in line or "windows no layer" in line]
    assert [says in line for line in lines] == ([True] if says else [])


def test_layer_kinds_longer_than_the_model_is_one_line():
    """A kind past the last layer would never be built (a window_pattern may be longer: a depth sweep's
    arms share it, and a window that acts on no layer is warned above)."""
    with pytest.raises(UserError, match=r"model.attn.layer_kinds=\[.*\] names 3 layers but model.n_layer=2") as e:
        GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=40,
                  attn={"layer_kinds": ["gdn", "softmax", "mamba2"]})
    assert "\n" not in str(e.value)


def test_an_odd_head_size_is_refused_only_where_rope_rotates_heads():
    with pytest.raises(UserError, match="RoPE rotates pairs of channels of each softmax head"):
        GPTConfig(n_layer=2, n_head=2, n_embd=30, block_size=32, vocab_size=40)
    for attn, pos in (({"kind": "gdn"}, "rope"), ({"kind": "gdn"}, "none"), ({}, "none"), ({"kind": "mamba2"}, "rope")):
        GPTConfig(n_layer=2, n_head=2, n_embd=30, block_size=32, vocab_size=40, attn=attn, pos=pos)  # builds


def test_an_odd_rope_part_of_mla_is_refused_only_with_rope():
    """MLA's decoupled RoPE part is head_dim/2 by default: 3 at head_dim 6. With RoPE that is refused in one line;
    without positions there is no RoPE part to rotate, and the model (and the cost table, which builds MLA's
    layout for every config) must build."""
    with pytest.raises(UserError, match="MLA's RoPE part"):
        GPTConfig(n_layer=2, n_head=4, n_embd=24, block_size=32, vocab_size=40, attn={"kind": "mla"})
    GPT(GPTConfig(n_layer=2, n_head=4, n_embd=24, block_size=32, vocab_size=40, attn={"kind": "mla"}, pos="none"))
    from lab.counting import cache_table
    rows = cache_table(GPTConfig(n_layer=2, n_head=4, n_embd=24, block_size=32, vocab_size=40, pos="none"), (32,))
    mla = next(r for r in rows if r["kind"].startswith("MLA") and r["dtype"] == "float32")
    assert mla["per_token"] == 2 * (4 * 6 + 0) * 4  # 2 layers x (a latent of 4·hs, no RoPE key) x 4 B
