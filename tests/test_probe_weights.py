"""The attention probe and the viewer ask each layer what it attends to: the weights they report times
the layer's values are its own output (hook_z, computed by its fast path), for every kind, add-on and
combination; and a windowed layer's logged entropy is that of weights that are zero outside its
window."""
import math

import pytest
import torch

from attention import repeat_kv
from lab.attnstats import AttentionProbe, attention_maps
from helpers import variant_model as make

VARIANTS = {
    "default": {},
    "gqa": {"n_kv_head": 2},
    "mqa-tiled": {"n_kv_head": 1, "attn": {"impl": "tiled", "block": 5}},
    "window": {"attn": {"window": 4}},
    "local-global": {"n_layer": 3, "attn": {"window": 3, "window_pattern": "LG"}},
    "window-tiled-gqa": {"n_kv_head": 2, "attn": {"window": 5, "impl": "tiled", "block": 4}},
    "sink-zero": {"attn": {"sink": "zero"}},
    "sink-learned-window": {"attn": {"sink": "learned", "window": 6}},
    "alibi": {"pos": "alibi"},
    "alibi-sink-tiled-gqa": {"pos": "alibi", "n_kv_head": 2, "attn": {"sink": "learned", "impl": "tiled", "block": 4}},
    "alibi-window": {"pos": "alibi", "attn": {"window": 5}},
    "gate-head": {"attn": {"gate": "head"}},
    "gate-channel-sink": {"attn": {"gate": "channel", "sink": "learned"}},
    "qk-norm-gain": {"attn": {"qk_norm": True, "qk_norm_gain": "channel"}},
    "mla": {"attn": {"kind": "mla"}},
    "mla-gate-sink-window": {"attn": {"kind": "mla", "gate": "head", "sink": "learned", "window": 5}},
    "mla-alibi": {"pos": "alibi", "attn": {"kind": "mla", "q_lora_rank": 16}},
}


def layer_outputs(model, idx):
    """{layer: (v (B, nh, T, hs) repeated per query head, z (B, nh, T, hs))}: what each layer's values and
    its heads' outputs were in a forward of idx, read at its hook points."""
    seen = {}
    handles = []
    for l, b in enumerate(model.blocks):
        a = b.attn
        handles += [a.hook_v.register_forward_hook(lambda m, i, v, l=l, a=a: seen.setdefault(l, {}).update(
                        v=repeat_kv(v.transpose(1, 2), a.n_head))),
                    a.hook_z.register_forward_hook(lambda m, i, z, l=l: seen[l].update(z=z.transpose(1, 2)))]
    with torch.no_grad():
        model(idx)
    for h in handles:
        h.remove()
    return {l: (d["v"], d["z"]) for l, d in seen.items()}


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_the_maps_weights_times_the_values_are_the_layers_own_output(variant):
    model = make(block_size=16, **variant)
    with torch.no_grad():  # sinks that take a real share, so a mistake in them shows
        for b in model.blocks:
            if isinstance(b.attn.sink_logit, torch.nn.Parameter):
                b.attn.sink_logit.copy_(torch.linspace(-1, 2, b.attn.n_head))
    idx = torch.randint(40, (1, 16))
    maps, _ = attention_maps(model, idx)
    for l, (v, z) in layer_outputs(model, idx).items():
        got = maps[l].unsqueeze(0).double() @ v.double()
        assert torch.allclose(got, z.double(), atol=1e-5), f"L{l}: max diff {(got - z).abs().max():.2e}"
        window = model.blocks[l].attn.window
        if window is not None:  # and nothing outside the window, exactly
            i, j = torch.arange(16)[:, None], torch.arange(16)[None, :]
            assert (maps[l][..., (j <= i - window) | (j > i)] == 0).all()


@pytest.mark.parametrize("variant", ["window", "local-global", "sink-learned-window", "alibi-window"])
def test_a_windowed_runs_logged_entropy_is_that_of_its_windowed_weights(variant):
    """The probe's attn_entropy per head is the mean over rows of -Σ p ln p of the weights the layer
    uses (a sink counted as one more choice), computed here from the maps and the sink's share."""
    model = make(block_size=16, **VARIANTS[variant])
    idx = torch.randint(40, (2, 16))
    stats = AttentionProbe(idx, induction=False).run(model)
    for l in range(len(model.blocks)):
        ents = []
        for b in range(2):
            p = attention_maps(model, idx[b:b + 1])[0][l].double()  # (nh, T, T)
            sink = 1 - p.sum(-1)  # the sink's share of each row (0 without one)
            plogp = torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)
            ent = -(plogp + torch.where(sink > 1e-12, sink * sink.clamp_min(1e-300).log(), torch.zeros_like(sink)))
            ents.append(ent.mean(-1))  # (nh,): mean over the rows
        want = torch.stack(ents).mean(0)
        for h in range(model.config.n_head):
            assert stats[f"attn_entropy/L{l}/H{h}"] == pytest.approx(want[h].item(), abs=1e-5), (l, h)
    window = model.blocks[0].attn.window  # at most ln(keys it sees), a sink one more
    assert stats["attn_entropy/L0"] <= math.log(window + ("sink" in variant)) + 1e-6
