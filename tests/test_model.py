"""The model against independent references: plain-math attention, explicit rotation matrices,
SDPA, known numbers."""
import math

import pytest
import torch
import torch.nn.functional as F

from rules import UserError
from attention import apply_rope, rope_freqs
from counting import flops_per_token
from model import GPT, GPTConfig
from optim import adamw
from variants import attention


def diff(a, b):
    d = (a - b).abs()
    return f"max diff {d.max().item():.3e}, mean diff {d.mean().item():.3e}"


def hand_attention(q, k, v, scale):
    """softmax(Q Kᵀ * scale + M) V in float64, the mask built element by element (queries are the
    last Tq of Tk positions)."""
    q, k, v = q.double(), k.double(), v.double()
    Tq, Tk = q.size(-2), k.size(-2)
    M = torch.zeros(Tq, Tk, dtype=torch.float64)
    for i in range(Tq):
        for j in range(Tk):
            if j > Tk - Tq + i:
                M[i, j] = float("-inf")
    return torch.softmax(q @ k.transpose(-2, -1) * scale + M, dim=-1) @ v


@pytest.mark.parametrize("Tq,Tk", [(7, 7), (1, 9), (3, 10)])
def test_reference_path_equals_hand_written_softmax(Tq, Tk):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, Tq, 8), torch.randn(2, 3, Tk, 8), torch.randn(2, 3, Tk, 8)
    scale = 1 / math.sqrt(8)
    got = attention(q.double(), k.double(), v.double(), scale, impl="reference")
    want = hand_attention(q, k, v, scale)
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
    assert torch.allclose(unscaled, hand_attention(q, k, v, 1.0).float(), atol=1e-5)
    assert not torch.allclose(unscaled, attention(q, k, v, 1 / math.sqrt(8), impl="sdpa"), atol=1e-3)


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
    rotated = apply_rope(x, rope_freqs(hs, T, 10000.0), real=real)  # position t for row t
    for t in range(T):
        want = rotate_reference(x[t], t)
        assert torch.allclose(rotated[t].double(), want, atol=1e-5), diff(rotated[t].double(), want)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)


def test_rope_dot_product_depends_only_on_offset():
    torch.manual_seed(4)
    hs = 32
    q, k = torch.randn(hs), torch.randn(hs)
    freqs = rope_freqs(hs, 200, 10000.0)

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
