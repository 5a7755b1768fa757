"""The attention logit scale and QK-Norm: the variance arithmetic, path parity, bounds, errors."""

import pytest
import torch

from rules import UserError
from attention import apply_rope, attention_scores, qk_normalize, resolve_scale
from attnstats import logit_bound, reading_qk
from model import GPT, GPTConfig
from variants import attention

SCALES = ["sqrt_dk", "none", "dk", "0.5"]
NORMS = [dict(qk_norm=False)] + [dict(qk_norm=True, qk_norm_type=t, qk_norm_gain=g)
                                  for t in ("rms", "layer", "l2") for g in ("none", "head", "channel")]


def label(d):
    return ",".join(f"{k}={v}" for k, v in d.items())


@pytest.mark.parametrize("d_k,std", [(8, 2.83), (128, 11.31), (1024, 32.0)])
def test_raw_score_variance_is_dk_and_sqrt_dk_scaling_makes_it_one(d_k, std):
    g = torch.Generator().manual_seed(d_k)
    q = torch.randn(1, 1, 4000, d_k, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 50, d_k, generator=g, dtype=torch.float64)
    raw = attention_scores(q, k, scale=resolve_scale("none", d_k))
    scaled = attention_scores(q, k, scale=resolve_scale("sqrt_dk", d_k))
    assert raw.std().item() == pytest.approx(std, rel=0.03)
    assert scaled.var().item() == pytest.approx(1.0, rel=0.05)


def test_softmax_peak_of_six_scores_unscaled_vs_scaled():
    # rows of 6 scores with std ~11.3 (d_k = 128): peak ~0.92 unscaled, ~0.42 after / sqrt(128)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(20000, 1, 1, 128, generator=g)
    k = torch.randn(20000, 1, 6, 128, generator=g)
    v = torch.eye(6).expand(20000, 1, 6, 6)  # attention @ I = the weights themselves
    for scale, peak in [("none", 0.92), ("sqrt_dk", 0.42)]:
        weights = attention(q, k, v, resolve_scale(scale, 128), causal=False, impl="reference")
        assert weights.amax(-1).mean().item() == pytest.approx(peak, abs=0.02), scale


@pytest.mark.parametrize("norm", NORMS, ids=label)
@pytest.mark.parametrize("scale", SCALES)
def test_every_combination_reference_equals_sdpa(scale, norm):
    torch.manual_seed(0)
    kw = dict(vocab_size=30, block_size=16, n_layer=2, n_head=2, n_embd=32)
    fast = GPT(GPTConfig(**kw, attn=dict(scale=scale, **norm))).eval()
    ref = GPT(GPTConfig(**kw, attn=dict(scale=scale, impl="reference", **norm))).eval()
    with torch.no_grad():
        for name, p in fast.named_parameters():
            if "gain" in name:
                p.uniform_(0.5, 2.0)
    ref.load_state_dict(fast.state_dict())
    idx = torch.randint(30, (3, 16))
    a, b = fast(idx), ref(idx)
    d = (a - b).abs()
    assert d.max() < 1e-4, f"max diff {d.max():.2e}, mean diff {d.mean():.2e}"


@pytest.mark.parametrize("norm", NORMS[1:], ids=label)
def test_qk_norm_bounds_logits_for_any_input_magnitude(norm):
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=30, block_size=16, n_layer=1, n_head=2, n_embd=32, attn=dict(**norm))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gain" in name:
                p.uniform_(0.5, 3.0)
        model.wte.weight.mul_(1000)  # inputs 1000x larger
    attn = model.blocks[0].attn
    seen = {}
    with reading_qk(model, lambda layer, attn, q, k: seen.update(logits=attn.scores(q, k)[0])):
        model(torch.randint(30, (2, 16)))
    logits = seen["logits"][torch.isfinite(seen["logits"])]
    bound = logit_bound(attn)
    assert logits.abs().max().item() <= bound * (1 + 1e-5)
    assert logits.abs().max().item() > 0.2 * bound  # the bound is not vacuous


def test_without_qk_norm_logits_grow_with_the_input():
    torch.manual_seed(2)
    model = GPT(GPTConfig(vocab_size=30, block_size=16, n_layer=1, n_head=2, n_embd=32)).eval()
    idx = torch.randint(30, (2, 16))
    peaks = []
    for factor in (1, 1000):
        seen = {}
        model.blocks[0].ln_1.weight.data.fill_(factor)  # the attention input, factor x larger
        with reading_qk(model, lambda layer, attn, q, k: seen.update(m=attn.scores(q, k)[0].nan_to_num(0, 0, 0).abs().max())):
            model(idx)
        peaks.append(seen["m"].item())
    assert logit_bound(model.blocks[0].attn) is None
    assert peaks[1] > 1e5 * peaks[0]


def test_qk_norm_comes_before_rope():
    """Pinned order: q = rope(gain * norm(q_raw)). With a per-channel gain this differs from
    gain * norm(rope(q_raw))."""
    torch.manual_seed(3)
    model = GPT(GPTConfig(vocab_size=30, block_size=8, n_layer=1, n_head=2, n_embd=32,
                          attn=dict(qk_norm=True, qk_norm_type="rms", qk_norm_gain="channel")))
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.q_gain.uniform_(0.2, 3.0)
    x = torch.randn(1, 8, 32)
    freqs = model.rope_at(0, 8)
    q, _, _ = attn.qkv(x, freqs)  # (1, T, nh, hs)
    q_raw = (x @ attn.c_attn.weight[:32].T).view(1, 8, 2, 16)  # (1, T, nh, hs)
    gain = attn.q_gain.view(2, 16)
    norm_then_rope = apply_rope(gain * qk_normalize(q_raw, "rms"), freqs, dim=1)
    rope_then_norm = gain * qk_normalize(apply_rope(q_raw, freqs, dim=1), "rms")
    assert torch.allclose(q, norm_then_rope, atol=1e-5)
    assert not torch.allclose(q, rope_then_norm, atol=1e-2)


def test_normalised_vectors_have_the_documented_norms():
    x = torch.randn(5, 64) * 50 + 3
    assert torch.allclose(qk_normalize(x, "rms").norm(dim=-1), torch.full((5,), 8.0), atol=1e-3)
    assert torch.allclose(qk_normalize(x, "layer").norm(dim=-1), torch.full((5,), 8.0), atol=1e-3)
    assert torch.allclose(qk_normalize(x, "layer").mean(-1), torch.zeros(5), atol=1e-5)
    assert torch.allclose(qk_normalize(x, "l2").norm(dim=-1), torch.ones(5), atol=1e-6)


@pytest.mark.parametrize("value,expected", [("sqrt_dk", 1 / 8), ("none", 1.0), ("dk", 1 / 64), ("0.25", 0.25), (2, 2.0)])
def test_scale_values(value, expected):
    assert resolve_scale(value, 64) == pytest.approx(expected)


@pytest.mark.parametrize("override,needle", [
    ("model.attn.scale=-1", "model.attn.scale=-1"),
    ("model.attn.scale=banana", "model.attn.scale=banana is invalid"),
    ("model.attn.scale=0", "model.attn.scale"),
    ("model.attn.qk_norm_type=batch", "qk_norm_type='batch'"),
    ("model.attn.qk_norm_gain=row", "qk_norm_gain='row'"),
])
def test_invalid_attention_options_are_one_line_errors(train_cfg, override, needle):
    from train import train
    with pytest.raises(UserError, match=needle) as e:
        train(train_cfg(override))
    assert "\n" not in str(e.value)
