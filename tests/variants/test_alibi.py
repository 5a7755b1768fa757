"""variants/alibi.py, ALiBi (model.pos=alibi): the paper's slopes, the biased softmax on every path
written out, and cached generation (which gives the bias each key's position in the cache) against
recomputation."""
import pytest
import torch

from helpers import plain_attention, variant_model as make
from variants import attention
from variants.alibi import alibi_bias, alibi_slopes


def test_alibi_slopes_are_the_papers_geometric_sequences():
    """Press et al. 2021: 8 heads get 1/2, 1/4, ..., 1/256; a non-power of two n takes the slopes of
    the largest power of two below it, then every other slope of twice that."""
    assert alibi_slopes(8).tolist() == [2.0 ** -k for k in range(1, 9)]
    assert torch.allclose(alibi_slopes(16), torch.tensor([2.0 ** (-k / 2) for k in range(1, 17)]))
    four, eight = [2.0 ** (-2 * k) for k in range(1, 5)], [2.0 ** -k for k in range(1, 9)]
    assert alibi_slopes(6).tolist() == four + eight[0::2][:2]  # 1/4 .. 1/256, then 1/2, 1/8


@pytest.mark.parametrize("impl", ["sdpa", "reference", "tiled"])
def test_alibi_attention_is_the_biased_softmax_written_out(impl):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 19, 8), torch.randn(2, 3, 19, 8), torch.randn(2, 3, 19, 8)
    m = alibi_slopes(6)
    i = torch.arange(19)
    got = attention(q, k, v, 0.35, impl=impl, bias=alibi_bias(m, i, i), block=4)
    want = plain_attention(q, k, v, 0.35, bias=-m.double().view(6, 1, 1) * (i[:, None] - i[None, :]))
    assert torch.allclose(got.double(), want, atol=1e-5)


def test_alibi_cached_generation_equals_recomputation_within_and_past_the_block():
    from sample import generate
    model = make(pos="alibi", n_head=6, n_embd=48)
    prompt = torch.randint(40, (2, 4))
    assert torch.equal(generate(model, prompt, 10, temperature=0), generate(model, prompt, 10, temperature=0,
                                                                              kv_cache=False))
    one = make(pos="alibi", n_layer=1)  # past block_size the cache slides: one layer computes the same function
    a, b = (generate(one, prompt, 40, temperature=0, kv_cache=c) for c in (True, False))
    assert a.shape == (2, 44) and torch.equal(a, b)
    compiled = generate(one, prompt, 40, temperature=0, compile=True)
    assert torch.equal(compiled, b)
