"""variants/sinks.py, attention sinks (model.attn.sink=zero|learned): one more logit with a zero value
on every path, and the probe's sink mass."""
import pytest
import torch

from helpers import plain_attention
from helpers import variant_model as make
from variants import attention


@pytest.mark.parametrize("impl", ["sdpa", "reference", "tiled"])
def test_a_sink_is_one_more_logit_with_a_zero_value(impl):
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 4, 13, 8), torch.randn(2, 4, 13, 8), torch.randn(2, 4, 13, 8)
    sink = torch.tensor([-1.0, 0.0, 2.0, 5.0])
    got = attention(q, k, v, 0.3, impl=impl, sink=sink, block=4)
    assert torch.allclose(got.double(), plain_attention(q, k, v, 0.3, sink=sink), atol=1e-5)


def test_the_probe_logs_sink_mass_and_the_largest_activation():
    from lab.attnstats import AttentionProbe
    model = make(attn={"sink": "learned"})
    with torch.no_grad():
        for b in model.blocks:
            b.attn.sink_logit.fill_(50.0)  # a sink that takes (nearly) everything
    stats = AttentionProbe(torch.randint(40, (2, 16))).run(model)
    assert stats["attn_sink/L0"] > 0.99 and stats["attn_sink/L1/H3"] > 0.99
    assert "act_max/L0" in stats and stats["act_max/max"] == max(stats["act_max/L0"], stats["act_max/L1"])
    plain = AttentionProbe(torch.randint(40, (2, 16))).run(make())
    assert not any(k.startswith("attn_sink") for k in plain)


def test_a_sink_on_linear_attention_is_ignored_and_said():
    from model import GPTConfig
    cfg = GPTConfig(vocab_size=40, n_layer=2, n_head=4, n_embd=32, attn={"kind": "linear", "sink": "zero"})
    assert cfg.ignored[0].startswith("model.attn.sink='zero' has no effect unless a layer is softmax or mla")
