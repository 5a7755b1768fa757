"""The hook points carry TransformerLens' names and mean what its hooks mean: the residual stream
before, between and after a block's two halves, what each half adds, and the softmax's weights
(hook_pattern), which a hook can read or replace. Checked against the stream added up by hand, plain
math attention written out here, and (tests/tools/test_export_clients.py) TransformerLens itself."""
import pytest
import torch

from attention import repeat_kv
from helpers import plain_attention, variant_model as make

BLOCK_HOOKS = ("hook_resid_pre", "hook_resid_mid", "hook_resid_post", "hook_attn_out", "hook_mlp_out")
ATTN_HOOKS = ("hook_q", "hook_k", "hook_v", "hook_pattern", "hook_z")
VARIANTS = {
    "default": {},
    "gqa": {"n_kv_head": 2},
    "window": {"attn": {"window": 5}},
    "sink-learned": {"attn": {"sink": "learned"}},
    "alibi": {"pos": "alibi"},
    "gate": {"attn": {"gate": "head"}},
    "moba": {"attn": {"select": "moba", "select_block": 4, "select_topk": 1}},
    "tiled": {"attn": {"impl": "tiled", "block": 4}},
    "mla": {"attn": {"kind": "mla"}},
    "post-ln": {"norm_position": "post"},
}


def record(model, idx, names):
    """{name: tensor} read at the named hook points in a forward of idx."""
    seen, modules = {}, dict(model.named_modules())
    handles = [modules[n].register_forward_hook(lambda m, a, out, n=n: seen.__setitem__(n, out)) for n in names]
    try:
        with torch.no_grad():
            logits = model(idx)
    finally:
        for h in handles:
            h.remove()
    return seen, logits


def test_every_layer_has_the_transformer_lens_names():
    model = make(n_layer=3)
    names = set(dict(model.named_modules()))
    want = {f"blocks.{l}.{h}" for l in range(3) for h in BLOCK_HOOKS} | \
           {f"blocks.{l}.attn.{h}" for l in range(3) for h in ATTN_HOOKS}
    assert want <= names, f"missing: {sorted(want - names)}"


@pytest.mark.parametrize("variant", [{}, {"n_kv_head": 2, "attn": {"gate": "head"}}, {"attn": {"kind": "mla"}},
                                     {"attn": {"layer_kinds": ["gdn", "softmax"]}}],
                         ids=["default", "gqa-gate", "mla", "gdn-softmax"])
def test_the_stream_adds_up_as_the_names_say(variant):
    """resid_mid = resid_pre + attn_out, resid_post = resid_mid + mlp_out, one block's post is the next
    one's pre, and the final norm and unembedding of the last post are the logits."""
    model = make(n_layer=2, **variant).eval()
    names = [f"blocks.{l}.{h}" for l in range(2) for h in BLOCK_HOOKS]
    seen, logits = record(model, torch.randint(40, (2, 12)), names)
    for l in range(2):
        h = {n: seen[f"blocks.{l}.{n}"] for n in BLOCK_HOOKS}
        assert torch.allclose(h["hook_resid_mid"], h["hook_resid_pre"] + h["hook_attn_out"], atol=1e-6)
        assert torch.allclose(h["hook_resid_post"], h["hook_resid_mid"] + h["hook_mlp_out"], atol=1e-6)
    assert torch.equal(seen["blocks.0.hook_resid_post"], seen["blocks.1.hook_resid_pre"])
    assert torch.allclose(model.lm_head(model.ln_f(seen["blocks.1.hook_resid_post"])), logits, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_reading_the_pattern_changes_nothing_and_reads_the_layers_weights(variant):
    """With a hook on hook_pattern the layer attends by the written-out path: the logits stay those of
    its own path, and the weights read are softmax(q·kᵀ/√d + mask) of the q and k it read (the scale,
    window, sink and bias of the layer; GQA's keys repeated), times v its heads' outputs."""
    model = make(block_size=16, **variant).eval()
    with torch.no_grad():
        for b in model.blocks:  # a sink with a real share, so a mistake in it shows
            if isinstance(b.attn.sink_logit, torch.nn.Parameter):
                b.attn.sink_logit.copy_(torch.linspace(-1, 2, b.attn.n_head))
    idx = torch.randint(40, (2, 16))
    with torch.no_grad():
        plain = model(idx)
    names = [f"blocks.{l}.attn.{h}" for l in range(2) for h in ATTN_HOOKS]
    seen, hooked = record(model, idx, names)
    assert torch.allclose(hooked, plain, atol=1e-5), (hooked - plain).abs().max()
    for l, b in enumerate(model.blocks):
        a, at = b.attn, lambda n: seen[f"blocks.{l}.attn.{n}"]
        pattern, z = at("hook_pattern"), at("hook_z").transpose(1, 2)  # (B, nh, T, T), (B, nh, T, hs)
        assert pattern.shape == (2, a.n_head, 16, 16)
        assert torch.allclose(pattern @ repeat_kv(at("hook_v").transpose(1, 2), a.n_head), z, atol=1e-5)
        if a.bias is None and a.select is None and "mla" not in variant.get("attn", {}).get("kind", ""):
            q, k, v = (at(n).transpose(1, 2).double() for n in ("hook_q", "hook_k", "hook_v"))
            k, v = repeat_kv(k, a.n_head), repeat_kv(v, a.n_head)
            sink = None if a.sink_logit is None else a.sink_logit.double()
            want = plain_attention(q, k, torch.eye(16, dtype=torch.float64).expand(*q.shape[:2], 16, 16), a.scale,
                                   window=a.window, sink=sink)  # weights @ I: the weights themselves
            assert torch.allclose(pattern.double(), want, atol=1e-5)


def test_a_pattern_replaced_by_a_hook_is_the_one_the_layer_uses():
    """A hook that returns uniform causal weights makes each head's output the running mean of its
    values (written out), and changes the logits."""
    model = make(block_size=12, n_kv_head=2).eval()
    idx = torch.randint(40, (1, 12))
    with torch.no_grad():
        before = model(idx)
    T = 12
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1).view(-1, 1)
    a = model.blocks[1].attn
    names = ["blocks.1.attn.hook_v", "blocks.1.attn.hook_z"]
    handle = a.hook_pattern.register_forward_hook(lambda m, args, w: uniform.expand_as(w).to(w.dtype))
    try:
        seen, after = record(model, idx, names)
    finally:
        handle.remove()
    v = repeat_kv(seen["blocks.1.attn.hook_v"].transpose(1, 2), a.n_head)  # (1, nh, T, hs)
    running_mean = v.cumsum(2) / torch.arange(1, T + 1).view(1, 1, -1, 1)
    assert torch.allclose(seen["blocks.1.attn.hook_z"].transpose(1, 2), running_mean, atol=1e-6)
    assert not torch.allclose(before, after, atol=1e-4)
