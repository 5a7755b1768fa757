"""variants/positions.py, absolute positions (model.pos=learned|sinusoidal) and none (NoPE): the
sinusoidal table written out, what a one-layer NoPE model cannot tell apart, and tables that end."""
import itertools
import math

import pytest
import torch

from helpers import variant_model as make
from variants.positions import sinusoidal_table


def max_diff(a, b):
    return f"max diff {(a - b).abs().max().item():.2e}"


def test_sinusoidal_table_equals_the_formula():
    table = sinusoidal_table(50, 16)
    for p, i in itertools.product((0, 1, 7, 49), range(8)):
        angle = p / 10000 ** (2 * i / 16)
        assert table[p, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
        assert table[p, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_nope_one_layer_ignores_the_order_of_earlier_tokens():
    """With no positions and one causal layer, the last query attends to a *set* of keys (softmax
    weights and a sum are order-free), so permuting the earlier tokens leaves its logits unchanged.
    This fails from two layers on: an earlier position's layer-1 output depends on which tokens
    precede it (the causal mask is itself a position signal), so the layer-2 keys change."""
    idx = torch.randint(40, (1, 12))
    perm = torch.cat([torch.randperm(11), torch.tensor([11])])
    for pos, changes in (("none", False), ("rope", True), ("learned", True), ("sinusoidal", True)):
        model = make(pos=pos, n_layer=1)
        a, b = model(idx)[0, -1], model(idx[:, perm])[0, -1]
        assert (not torch.allclose(a, b, atol=1e-5)) == changes, f"pos={pos}: {max_diff(a, b)}"
    deep = make(pos="none", n_layer=2)
    assert not torch.allclose(deep(idx)[0, -1], deep(idx[:, perm])[0, -1], atol=1e-5)


def test_absolute_positions_refuse_positions_past_their_table():
    with pytest.raises(ValueError, match="table of 16"):
        make(pos="learned")(torch.randint(40, (1, 4)), cache=make(pos="learned").new_kv_cache(1, 20), pos=14)
