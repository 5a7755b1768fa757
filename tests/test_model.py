"""GPT against independent references and known numbers: causality on both attention paths, the
paths end to end, the loss at init, the init stds, parameters and FLOPs by hand, config errors, a bf16
cast. attention.py's own functions are tested in test_attention.py."""
import math

import pytest
import torch
import torch.nn.functional as F

from rules import UserError
from lab.counting import flops_per_token
from model import GPT, GPTConfig
from helpers import diff
from lab.optim import adamw


def tiny(**kw):
    base = dict(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=32)
    return GPT(GPTConfig(**{**base, **kw}))


@pytest.mark.parametrize("impl", ["sdpa", "reference"])
def test_causality_future_tokens_never_change_earlier_logits(impl):
    torch.manual_seed(6)
    model = tiny(attn={"impl": impl}).eval()
    idx = torch.randint(50, (2, 16))
    logits = model(idx)
    for t in (0, 5, 14):
        changed = idx.clone()
        changed[:, t + 1:] = torch.randint(50, changed[:, t + 1:].shape)
        other = model(changed)
        assert torch.allclose(logits[:, :t + 1], other[:, :t + 1], atol=1e-6), diff(logits[:, :t + 1], other[:, :t + 1])
        assert not torch.allclose(logits[:, t + 1:], other[:, t + 1:])


def test_model_paths_agree_end_to_end():
    torch.manual_seed(7)
    fast = tiny().eval()
    ref = tiny(attn={"impl": "reference"}).eval()
    ref.load_state_dict(fast.state_dict())
    idx = torch.randint(50, (3, 16))
    assert torch.allclose(fast(idx), ref(idx), atol=1e-5), diff(fast(idx), ref(idx))


def test_loss_at_init_is_ln_vocab_and_targets_shift_the_same_pass():
    torch.manual_seed(8)
    model = tiny(vocab_size=64)
    idx, targets = torch.randint(64, (8, 16)), torch.randint(64, (8, 16))
    logits, loss = model(idx, targets)
    assert logits.shape == (8, 16, 64)
    assert loss.item() == pytest.approx(math.log(64), abs=0.1)
    # the loss is the mean cross-entropy over every position of the one forward pass
    want = F.cross_entropy(logits.reshape(-1, 64), targets.reshape(-1))
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)


@pytest.mark.slow  # 300 optimizer steps
def test_tiny_model_overfits_one_batch():
    torch.manual_seed(9)
    model = tiny()
    opt = adamw(model, lr=3e-3, weight_decay=0.0)
    x = torch.randint(50, (4, 16))
    y = torch.randint(50, (4, 16))
    for _ in range(300):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1


def test_init_stds_match_docstring():
    torch.manual_seed(10)
    model = GPT(GPTConfig(vocab_size=500, block_size=16, n_layer=8, n_head=4, n_embd=256))
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[3].mlp.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)
    assert model.lm_head.weight is model.wte.weight


def test_param_count_and_flops_by_hand():
    cfg = GPTConfig(vocab_size=65, block_size=64, n_layer=4, n_head=4, n_embd=128)
    d, L, V = 128, 4, 65
    per_block = 2 * d + (3 * d * d + d * d) + (4 * d * d + 4 * d * d)  # 2 LN weights, attn, mlp
    n = V * d + L * per_block + d  # tied embedding once, final LN
    model = GPT(cfg)
    assert model.num_params() == n
    assert flops_per_token(cfg) == 6 * n + 12 * L * 64 * d


@pytest.mark.parametrize("kw,needle", [
    (dict(n_embd=30, n_head=4), "not divisible"),
    (dict(n_embd=12, n_head=4), "odd"),
    (dict(n_layer=0), "n_layer"),
    (dict(attn={"scale": "banana"}), "model.attn.scale"),
    (dict(attn={"qk_norm_type": "batch"}), "qk_norm_type"),
])
def test_bad_model_config_is_one_line_error(kw, needle):
    with pytest.raises(UserError, match=needle) as e:
        GPTConfig(**{**dict(vocab_size=10, n_layer=2, n_head=2, n_embd=16), **kw})
    assert "\n" not in str(e.value)


def test_a_model_cast_to_bf16_keeps_its_rope_table_in_float32():
    """model.to(torch.bfloat16), as users do for inference, must not cast the RoPE table: complex
    bf16 does not exist (view_as_complex raised) and bf16 cos/sin of large angles are wrong."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=30, block_size=16, n_layer=2, n_head=2, n_embd=32)).eval()
    idx = torch.randint(30, (2, 16))
    want = model(idx)
    half = model.to(torch.bfloat16)
    assert half.rope.dtype == torch.float32 and half.wte.weight.dtype == torch.bfloat16
    got = half(idx)
    assert got.dtype == torch.bfloat16 and (got.float() - want).abs().max() < 0.1
