"""attention.py against independent references: the reference path against softmax written out, sdpa
against the reference, RoPE against explicit rotation matrices; the attention logit scale and QK-Norm:
the variance arithmetic, path parity, bounds, errors."""
import math

import pytest
import torch

from rules import UserError
from attention import apply_rope, attention_scores, qk_normalize, resolve_scale, rope_table
from lab.attnstats import logit_bound, reading_qk
from helpers import diff, plain_attention
from model import GPT, GPTConfig
from variants import attention


# ----------------------------------------------------------------------------- the paths: reference and sdpa

@pytest.mark.parametrize("Tq,Tk", [(7, 7), (1, 9), (3, 10)])
def test_reference_path_equals_hand_written_softmax(Tq, Tk):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, Tq, 8), torch.randn(2, 3, Tk, 8), torch.randn(2, 3, Tk, 8)
    scale = 1 / math.sqrt(8)
    got = attention(q.double(), k.double(), v.double(), scale, impl="reference")
    want = plain_attention(q, k, v, scale)
    assert torch.allclose(got, want, atol=1e-12), diff(got, want)


@pytest.mark.parametrize("Tq,Tk", [(16, 16), (1, 16), (5, 16)])
@pytest.mark.parametrize("scale", [1 / math.sqrt(16), 1.0, 1 / 16, 0.37])
def test_fast_path_equals_reference(Tq, Tk, scale):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, Tq, 16), torch.randn(2, 4, Tk, 16), torch.randn(2, 4, Tk, 16)
    fast = attention(q, k, v, scale, impl="sdpa")
    ref = attention(q, k, v, scale, impl="reference")
    assert torch.allclose(fast, ref, atol=1e-5), diff(fast, ref)


def test_scale_is_passed_explicitly_to_sdpa():
    # SDPA's hidden default is 1/sqrt(hs); a different explicit scale must change the result
    torch.manual_seed(2)
    q, k, v = torch.randn(1, 1, 6, 8) * 3, torch.randn(1, 1, 6, 8) * 3, torch.randn(1, 1, 6, 8)
    unscaled = attention(q, k, v, 1.0, impl="sdpa")
    assert torch.allclose(unscaled, plain_attention(q, k, v, 1.0).float(), atol=1e-5)
    assert not torch.allclose(unscaled, attention(q, k, v, 1 / math.sqrt(8), impl="sdpa"), atol=1e-3)


# ----------------------------------------------------------------------------- the logit scale

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


@pytest.mark.parametrize("value,expected", [("sqrt_dk", 1 / 8), ("none", 1.0), ("dk", 1 / 64), ("0.25", 0.25), (2, 2.0)])
def test_scale_values(value, expected):
    assert resolve_scale(value, 64) == pytest.approx(expected)


# ----------------------------------------------------------------------------- RoPE

def rotate_reference(x, pos, base=10000.0):
    """RoPE by explicit 2x2 rotation matrices on pairs (2j, 2j+1), float64: x (hs,) at position pos."""
    hs = x.numel()
    out = torch.empty(hs, dtype=torch.float64)
    for j in range(hs // 2):
        angle = pos * base ** (-2 * j / hs)
        c, s = math.cos(angle), math.sin(angle)
        a, b = x[2 * j].item(), x[2 * j + 1].item()
        out[2 * j], out[2 * j + 1] = c * a - s * b, s * a + c * b
    return out


@pytest.mark.parametrize("real", [False, True], ids=["complex (eager)", "real (compiled)"])
def test_rope_matches_rotation_matrices_and_keeps_norms(real):
    torch.manual_seed(3)
    hs, T = 16, 12
    x = torch.randn(T, hs)
    rotated = apply_rope(x, rope_table(hs, T, 10000.0), real=real)  # position t for row t
    for t in range(T):
        want = rotate_reference(x[t], t)
        assert torch.allclose(rotated[t].double(), want, atol=1e-5), diff(rotated[t].double(), want)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)


def test_rope_dot_product_depends_only_on_offset():
    torch.manual_seed(4)
    hs = 32
    q, k = torch.randn(hs), torch.randn(hs)
    freqs = rope_table(hs, 200, 10000.0)

    def score(m, n):
        return (apply_rope(q, freqs[m]) @ apply_rope(k, freqs[n])).item()

    for m, n in [(5, 2), (9, 9), (3, 40)]:
        for shift in (1, 17, 150):
            assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=1e-4)
    assert abs(score(5, 2) - score(5, 3)) > 1e-3  # and it does depend on the offset


def test_rope_never_touches_v():
    # v is the third of c_attn's output, untouched: compare with a manual projection
    torch.manual_seed(5)
    model = GPT(GPTConfig(vocab_size=11, block_size=8, n_layer=1, n_head=2, n_embd=16))
    attn = model.blocks[0].attn
    x = torch.randn(2, 8, 16)
    _, _, v = attn.qkv(x, model.rope_at(0, 8))
    v_manual = (x @ attn.c_attn.weight[32:].T).view(2, 8, 2, 8)  # (B, T, n_kv, hs), as qkv gives it
    assert torch.allclose(v, v_manual, atol=1e-6)


# ----------------------------------------------------------------------------- QK-Norm, with every scale
SCALES = ["sqrt_dk", "none", "dk", "0.5"]
NORMS = [dict(qk_norm=False)] + [dict(qk_norm=True, qk_norm_type=t, qk_norm_gain=g)
                                  for t in ("rms", "layer", "l2") for g in ("none", "head", "channel")]


def label(d):
    return ",".join(f"{k}={v}" for k, v in d.items())


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


# ----------------------------------------------------------------------------- errors

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



@pytest.mark.parametrize("norm", [n for n in NORMS if n.get("qk_norm_gain", "none") != "none"], ids=label)
def test_a_fresh_models_qk_gains_are_one_so_its_logit_bound_is_the_gainless_one(norm):
    """A gain drawn like a weight (N(0, 0.02)) would start every gained run with uniform attention."""
    kw = dict(vocab_size=30, block_size=16, n_layer=2, n_head=2, n_embd=32)
    gained = GPT(GPTConfig(**kw, attn=dict(**norm)))
    gainless = GPT(GPTConfig(**kw, attn=dict(norm, qk_norm_gain="none")))
    for block, plain in zip(gained.blocks, gainless.blocks):
        assert torch.equal(block.attn.q_gain, torch.ones_like(block.attn.q_gain))
        assert torch.equal(block.attn.k_gain, torch.ones_like(block.attn.k_gain))
        assert logit_bound(block.attn) == logit_bound(plain.attn) == pytest.approx(
            block.attn.scale * (1.0 if norm["qk_norm_type"] == "l2" else 16))  # scale · hs (hs = 16)
