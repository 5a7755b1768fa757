"""variants/gates.py, gated attention (model.attn.gate=head|channel): the gate written out, and a gate
held at one is the model without it."""
import pytest
import torch

from attention import rope_table
from helpers import plain_attention
from helpers import variant_model as make


@pytest.mark.parametrize("gate", ["head", "channel"])
def test_a_gate_scales_each_head_output_by_sigmoid_of_the_layer_input(gate):
    model = make(attn={"gate": gate})
    attn = model.blocks[0].attn
    x = torch.randn(2, 9, 32)
    rope = rope_table(8, 9, 10000.0)
    with torch.no_grad():
        q, k, v = (t.transpose(1, 2) for t in attn.qkv(x, rope))
        y = plain_attention(q, k, v, attn.scale).float().transpose(1, 2)  # (B, T, nh, hs)
        g = torch.sigmoid(x @ attn.gate.weight.T).view(2, 9, 4, -1)
        want = (y * g).reshape(2, 9, 32) @ attn.c_proj.weight.T
        assert torch.allclose(attn(x, rope=rope), want, atol=1e-5)


def test_with_the_gate_at_one_and_no_sink_the_model_is_the_plain_one():
    gated, plain = make(attn={"gate": "channel"}), make()
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if "gate" not in k})
    for b in gated.blocks:  # sigmoid(+40) is 1.0 in fp32
        b.attn.gate.register_forward_hook(lambda m, args, out: torch.full_like(out, 40.0))
    idx = torch.randint(40, (2, 16))
    assert torch.equal(gated(idx), plain(idx))
