"""mixer.py: a new kind is one class and one row of variants.KINDS. A toy kind registered from this
file, with no other edit anywhere, is built, counted (parameters, MACs measured by torch's FLOP counter,
state bytes against the built cache), decoded from its own state as the whole sequence computes, and
drawn by the probe (its effective attention against its output); the auxiliary-loss path of the base
adds a term's gradient without changing the loss's value."""
import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

import variants
from lab.attnstats import layer_maps
from lab.counting import count_params, kv_cache_bytes, macs_per_token, state_bytes
from mixer import Mixer, WithGradient, aux_metrics, with_aux_losses
from model import GPT, GPTConfig
from sample import generate


class FastWeights(Mixer):
    """Linear attention without a feature map or a normaliser (Schlag et al. 2021's fast weights):
    y_t = Σ_{s≤t} (q_t·k_s) v_s, a state S = Σ k vᵀ (hs x hs per head) in generation."""
    recurrent = True

    def make_projections(self, config):
        d = config.n_embd
        self.c_attn = nn.Linear(d, 3 * d, bias=config.bias)
        self.c_proj = nn.Linear(d, d, bias=config.bias)

    def forward(self, x, *, rope=None, cache=None, pos=0, window=None, ve=None):
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, self.head_dim).unbind(2)
        q, k, v = (h(t).transpose(1, 2) for h, t in ((self.hook_q, q), (self.hook_k, k), (self.hook_v, v)))
        if cache is None:  # training: the masked quadratic form
            y = (q @ k.transpose(-1, -2)).tril() @ v
        else:  # generation: the state, one token at a time
            ys = []
            for t in range(T):
                cache.S = cache.S + k[:, :, t, :, None] @ v[:, :, t, None, :]
                ys.append(q[:, :, t, None] @ cache.S)
            y = torch.cat(ys, dim=2)
        return self.project(x, y.transpose(1, 2))

    def new_cache(self, batch_size, length, *, device=None, dtype=torch.float32, **_):
        state = type("State", (), {})()
        state.S = torch.zeros(batch_size, self.n_head, self.head_dim, self.head_dim, device=device)
        state.nbytes = lambda: state.S.numel() * state.S.element_size()
        return state

    def effective_attention(self, x, q, k, *, rope=None):
        return (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)).tril()

    @classmethod
    def projections(cls, c):
        d = c.n_embd
        return {"q": d * d, "k": d * d, "v": d * d, "o": d * d}

    @classmethod
    def params(cls, c):
        return {"matrices": 4 * c.n_embd ** 2, "other": int(c.bias) * 4 * c.n_embd}

    @classmethod
    def mixing_macs(cls, c, seq_len, keys):
        return seq_len * c.n_embd, seq_len * c.n_embd  # the full table's convention, as softmax attention's

    @classmethod
    def state_numbers(cls, c):
        return c.n_head * c.head_dim ** 2


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(variants.KINDS, "fastweights", FastWeights)
    return lambda **kw: GPTConfig(vocab_size=40, block_size=16, n_layer=3, n_head=2, n_embd=16, pos="none", **kw)


def test_a_kind_registered_from_a_test_is_built_and_counted(toy):
    c = toy(bias=True, attn={"layer_kinds": ["fastweights", "softmax", "fastweights"]})
    torch.manual_seed(0)
    model = GPT(c)
    assert [type(b.attn).__name__ for b in model.blocks] == ["FastWeights", "CausalSelfAttention", "FastWeights"]
    assert count_params(c)["total"] == model.num_params()
    B, N = 2, c.block_size
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, c.vocab_size, (B, N)))
    flops = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    m = macs_per_token(toy(bias=True, attn={"kind": "fastweights"}), N)  # per token of a fastweights layer
    assert flops["GPT.blocks.0.attn"] == 2 * B * N * (m["proj"] + m["attn"])  # the matmuls torch counted
    caches = model.new_kv_cache(B, N)
    assert state_bytes(c, B) == caches[0].nbytes() + caches[2].nbytes()
    assert kv_cache_bytes(c, N, B) == caches[1].nbytes()  # only the softmax layer caches per token


def test_a_registered_kind_decodes_from_its_state_as_the_whole_sequence(toy):
    """Step by step from its state, each position's logits are the whole sequence's (and they depend on the
    mixer: zeroing its state's update moves them), and greedy generation gives the same tokens either way."""
    torch.manual_seed(1)
    model = GPT(toy(attn={"kind": "fastweights"})).eval()
    idx = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        whole = model(idx)
        cache = model.new_kv_cache(2, 12)
        stepped = torch.cat([model(idx[:, :3], cache=cache, pos=0)]
                            + [model(idx[:, t:t + 1], cache=cache, pos=t) for t in range(3, 12)], dim=1)
        torch.testing.assert_close(stepped, whole, atol=1e-5, rtol=1e-5)
        for block in model.blocks:  # the fastweights layers' output projections off: the logits must move
            if isinstance(block.attn, FastWeights):
                block.attn.c_proj.weight.zero_()
        assert (model(idx) - whole).abs().max() > 1e-3
    model = GPT(toy(attn={"kind": "fastweights"})).eval()
    prompt = idx[:, :3]
    assert torch.equal(generate(model, prompt, 10, temperature=0.0, kv_cache=True),
                       generate(model, prompt, 10, temperature=0.0, kv_cache=False))


def test_the_probe_draws_a_registered_kind_by_its_effective_attention(toy):
    torch.manual_seed(2)
    model = GPT(toy(attn={"kind": "fastweights"})).eval()
    idx = torch.randint(0, 40, (1, 12))
    seen = {}
    model.blocks[1].attn.hook_v.register_forward_hook(lambda m, a, out: seen.__setitem__("v", out))
    model.blocks[1].attn.hook_z.register_forward_hook(lambda m, a, out: seen.__setitem__("z", out))
    maps, stats, notes = layer_maps(model, idx)
    assert maps.shape == (3, 2, 12, 12)
    z = maps[1] @ seen["v"][0].transpose(0, 1).float()  # (nh, T, hs): A @ v, the output the layer gave
    torch.testing.assert_close(z, seen["z"][0].transpose(0, 1).float(), rtol=1e-4, atol=1e-5)
    assert all(note is not None for note in notes[1])  # signed rows: no entropy, and a note says why


def test_the_auxiliary_loss_path_adds_a_gradient_not_a_value():
    """with_aux_losses: the loss's value unchanged; its gradient reaches each term as if added."""
    w = torch.tensor(2.0, requires_grad=True)

    class Aux(nn.Module):
        def aux_loss(self):
            return "square", (w ** 2)

        def aux_metrics(self):
            return {"square": torch.tensor(3.0)}

    assert Mixer.aux_loss(None) is None and Mixer.aux_metrics(None) == {}  # the base's: none
    loss = (w * 5).sum()
    total = with_aux_losses(loss, [Aux()])
    assert total.item() == 10.0
    total.backward()
    assert w.grad.item() == 5 + 2 * 2  # d(5w)/dw + d(w²)/dw
    assert aux_metrics([Aux(), Aux()]) == {"square": torch.tensor(3.0)}
    assert WithGradient.apply(loss.detach().requires_grad_(), w ** 2).item() == 10.0


def test_a_hybrid_checkpoint_with_the_unused_sink_of_its_recurrent_layers_loads():
    """A hybrid's checkpoint whose gdn layer, under a learned sink, holds a sink logit that layer never uses
    (zero) loads; a nonzero one is refused, never silently dropped."""
    from lab.parallel import load_weights
    from rules import UserError
    c = GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16, attn={"layer_kinds": ["gdn", "softmax"],
                                                                                      "sink": "learned"})
    torch.manual_seed(3)
    model = GPT(c)
    old = {**model.state_dict(), "blocks.0.attn.sink_logit": torch.zeros(2)}
    fresh = GPT(c)
    load_weights(fresh, old)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    with pytest.raises(UserError, match="unexpected"):
        load_weights(fresh, {**old, "blocks.0.attn.sink_logit": torch.ones(2)})


def test_a_softmax_kind_registered_from_a_test_takes_windows_sinks_and_selections(monkeypatch):
    """The options ask the kinds' flags, not their names: a new subclass of the softmax layer is windowed, gets
    its sink and its selection, and none of them is reported as ignored."""
    from attention import CausalSelfAttention

    class Mine(CausalSelfAttention):
        pass
    monkeypatch.setitem(variants.KINDS, "mine", Mine)
    c = GPTConfig(vocab_size=40, block_size=32, n_layer=2, n_head=2, n_embd=16,
                  attn={"kind": "mine", "window": 8, "sink": "learned"})
    assert c.ignored == []
    layer = GPT(c).blocks[0].attn
    assert type(layer) is Mine and layer.window == 8 and isinstance(layer.sink_logit, nn.Parameter)
    s = GPTConfig(vocab_size=40, block_size=64, n_layer=2, n_head=2, n_embd=16,
                  attn={"kind": "mine", "select": "moba", "select_block": 8, "select_topk": 2})
    assert s.ignored == [] and GPT(s).blocks[0].attn.select is not None


def test_a_softmax_kind_registered_as_the_docstring_says_takes_qk_norm_and_gate_and_records_nothing_ignored(
        monkeypatch):
    """One row in KINDS: a softmax subclass with qk_norm=true and gate=head is built with both (its q and k
    normed: every logit within scale·hs; its gate's weights in the layer), records nothing as ignored, and
    two runs that differ in either key stay two arms in a report."""
    from attention import CausalSelfAttention
    from lab.arms import inert_keys
    from lab.attnstats import logit_bound, reading_qk
    from lab.config import check_train_config

    class Mine(CausalSelfAttention):
        pass
    monkeypatch.setitem(variants.KINDS, "mine", Mine)
    c = GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16,
                  attn={"kind": "mine", "qk_norm": True, "gate": "head"})
    assert c.ignored == []
    model = GPT(c).eval()
    layer = model.blocks[0].attn
    assert type(layer) is Mine and layer.gate is not None and layer.norm_kind == "rms"
    with torch.no_grad():
        model.wte.weight.mul_(1000)  # logits would grow with the input without the norm
    seen = {}
    with reading_qk(model, lambda i, attn, q, k: seen.setdefault(i, attn.scores(q, k)[0])):
        model(torch.randint(0, 40, (2, 16)))
    peak = max(s[torch.isfinite(s)].abs().max().item() for s in seen.values())
    assert peak <= logit_bound(layer) * (1 + 1e-5) and logit_bound(layer) == pytest.approx(layer.scale * 8)
    from helpers import compose_cfg
    cfg = compose_cfg(overrides=["model=debug", "model.attn.kind=mine", "model.attn.qk_norm=true",
                                 "model.attn.gate=head"])
    assert check_train_config(cfg) == []  # what run_info.json's ignored_settings records
    flat = {"model.attn.kind": "mine", "model.attn.qk_norm": True, "model.attn.gate": "head",
            "model.attn.qk_norm_type": "rms", "model.attn.window": None, "model.attn.select": "none"}
    assert not {"model.attn.qk_norm", "model.attn.gate"} & inert_keys(flat)  # they act: runs differing in them are two arms


def test_a_mixer_that_builds_the_gate_but_takes_no_qk_norm_records_only_qk_norm_as_ignored(toy, monkeypatch):
    class GatedFastWeights(FastWeights):
        takes_gate = True
    monkeypatch.setitem(variants.KINDS, "gatedfw", GatedFastWeights)
    c = toy(attn={"kind": "gatedfw", "qk_norm": True, "gate": "head"})
    assert c.ignored == ["model.attn.qk_norm=True has no effect unless a layer's kind takes it (model.attn.kind or "
                         "model.attn.layer_kinds: softmax, linear; MLA's keys come from its latent, gdn normalises q "
                         "and k itself): ignored (its default is False)"]
    model = GPT(c)
    assert all(b.attn.gate is not None for b in model.blocks)  # the gate it takes is built ...
    assert count_params(c)["total"] == model.num_params()  # ... and counted by the gate itself
    plain = toy(attn={"kind": "fastweights", "gate": "head"})
    assert [line.split(" has no effect")[0] for line in plain.ignored] == ["model.attn.gate='head'"]
    assert all(b.attn.gate is None for b in GPT(plain).blocks)  # a kind that does not take it gets none
