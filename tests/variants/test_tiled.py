"""variants/tiled.py, FlashAttention's algorithm (model.attn.impl=tiled): forward and gradients
against the formula written out in float64, the model on the tiled path against the reference path,
and the O(N) memory it keeps for the backward."""
import pytest
import torch

from helpers import grads, plain_attention, saved_bytes
from helpers import variant_model as make
from variants import attention


@pytest.mark.parametrize("B,nh,nkv,Tq,Tk,block,causal,window", [
    (2, 4, 4, 37, 37, 8, True, None),   # MHA, a length no multiple of the block
    (2, 4, 2, 37, 37, 16, True, None),  # GQA
    (1, 4, 1, 29, 29, 7, False, None),  # MQA, no mask
    (2, 2, 2, 5, 41, 8, True, None),    # queries after a cached prefix (Tq < Tk)
    (2, 4, 2, 45, 45, 8, True, 10),     # a window
], ids=["mha", "gqa", "mqa-full", "suffix", "window"])
def test_tiled_forward_and_gradients_equal_the_plain_formula(B, nh, nkv, Tq, Tk, block, causal, window):
    torch.manual_seed(0)
    q, k, v = torch.randn(B, nh, Tq, 16), torch.randn(B, nkv, Tk, 16), torch.randn(B, nkv, Tk, 16)
    tiled = grads(lambda q, k, v: attention(q, k, v, 0.3, causal=causal, impl="tiled", window=window, block=block),
                  q, k, v)
    plain = grads(lambda q, k, v: plain_attention(q, k, v, 0.3, causal, window), q.double(), k.double(), v.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), tiled, plain):
        d = (a.double() - b).abs()
        assert d.max() < 1e-5, f"{name}: max {d.max():.2e}, mean {d.mean():.2e}"


def test_tiled_model_equals_the_reference_model_in_loss_and_every_gradient():
    idx = torch.randint(40, (2, 16))
    models = [make(attn={"impl": "tiled", "block": 5}), make(attn={"impl": "reference"})]
    losses, grads_ = [], []
    for m in models:
        m.train()
        _, loss = m(idx, idx)
        loss.backward()
        losses.append(loss.item())
        grads_.append({n: p.grad for n, p in m.named_parameters()})
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    for name in grads_[1]:
        assert torch.allclose(grads_[0][name], grads_[1][name], atol=1e-5), name


def test_tiled_memory_grows_linearly_and_the_reference_quadratically():
    """FlashAttention's claim (O(N) memory, the same N² dot products): what one attention call keeps
    for its backward, at N and 4N. 4x the length costs ~4x (tiled) against ~16x (the reference's N x N
    weights); generous bounds."""
    def kept(impl, N):
        q, k, v = (torch.randn(1, 4, N, 32, requires_grad=True) for _ in range(3))
        return saved_bytes(lambda: attention(q, k, v, 0.2, impl=impl, block=64)) - 3 * q.numel() * 4
    ratio = {impl: kept(impl, 1024) / kept(impl, 256) for impl in ("tiled", "reference")}
    assert ratio["tiled"] < 6 and ratio["reference"] > 12, ratio
    assert kept("reference", 1024) > 20 * kept("tiled", 1024)


def test_tiled_refuses_dropout_in_one_line():
    from model import GPTConfig
    from rules import UserError
    with pytest.raises(UserError, match="model.attn.impl=tiled does not drop attention weights") as e:
        GPTConfig(vocab_size=40, n_layer=2, n_head=4, n_embd=32, dropout=0.1, attn={"impl": "tiled"})
    assert "\n" not in str(e.value)
