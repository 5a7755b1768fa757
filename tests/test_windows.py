"""Sliding windows (model.attn.window, window_pattern): the mask on every path against an explicit
band, local/global patterns, and a windowed layer's cache against recomputation."""
import pytest
import torch

from helpers import plain_attention
from helpers import variant_model as make
from variants import attention


@pytest.mark.parametrize("impl", ["sdpa", "reference", "tiled"])
def test_window_masks_equal_an_explicit_band(impl):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 33, 8), torch.randn(2, 2, 33, 8), torch.randn(2, 2, 33, 8)
    got = attention(q, k, v, 0.5, impl=impl, window=7, block=8)
    assert torch.allclose(got.double(), plain_attention(q, k, v, 0.5, True, 7), atol=1e-5)


def test_a_local_global_pattern_windows_only_the_local_layers():
    model = make(n_layer=4, attn={"window": 3, "window_pattern": "LLG"})
    assert [b.attn.window for b in model.blocks] == [3, 3, None, 3]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_windowed_cache_holds_the_window_and_equals_recomputation(static):
    """A local layer's cache holds W positions; decoding step by step past W (and past a prompt longer
    than W) gives the logits of the whole sequence run at once with the same windows."""
    model = make(n_layer=3, block_size=64, attn={"window": 6, "window_pattern": "LG"})
    idx = torch.randint(40, (2, 30))
    with torch.no_grad():
        full = model(idx)
        cache = model.new_kv_cache(2, 64, static=static)
        assert [c.length for c in cache] == [6, 64, 6]
        steps = [model(idx[:, :9], cache=cache, pos=0)]  # a prefill longer than the window
        for t in range(9, 30):
            pos = torch.tensor([t]) if static else t
            steps.append(model(idx[:, t:t + 1], cache=cache, pos=pos))
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


@pytest.mark.parametrize("attn,needle", [
    ({"window_pattern": "LX", "window": 4}, "model.attn.window_pattern=LX is invalid"),
    ({"kind": "rnn"}, "model.attn.kind='rnn' is unknown"),
])
def test_options_that_cannot_work_are_refused_in_one_line(attn, needle):
    from model import GPTConfig
    from rules import UserError
    with pytest.raises(UserError, match=needle) as e:
        GPTConfig(vocab_size=40, n_layer=2, n_head=4, n_embd=32, attn=attn)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("attn,line", [
    ({"kind": "linear", "impl": "tiled"}, "model.attn.impl='tiled' has no effect unless a layer is softmax or mla"),
    ({"kind": "linear", "scale": "none"}, "model.attn.scale='none' has no effect unless"),
    ({"kind": "linear", "window": 4}, "model.attn.window=4 has no effect unless"),
    ({"window_pattern": "LG"}, "model.attn.window_pattern='LG' has no effect unless model.attn.window=W"),
])
def test_options_without_effect_are_ignored_and_said(attn, line):
    """Set where they cannot act, they are ignored (the model is the one without them) and listed in
    one line each, which train.py and the tools warn and record."""
    from model import GPT, GPTConfig
    fields = dict(vocab_size=40, n_layer=2, n_head=4, n_embd=32)
    cfg = GPTConfig(**fields, attn=attn)
    assert len(cfg.ignored) == 1 and cfg.ignored[0].startswith(line) and cfg.ignored[0].endswith(")")
    bare = GPTConfig(**fields, attn={"kind": attn.get("kind", "softmax")})
    torch.manual_seed(0)
    a = GPT(cfg)
    torch.manual_seed(0)
    b = GPT(bare)
    idx = torch.randint(40, (2, 16))
    assert bare.ignored == [] and torch.equal(a(idx), b(idx))
