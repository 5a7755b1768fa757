"""variants/rope_scaling.py, RoPE past the trained length (model.rope_scaling=linear|ntk|yarn): each
scaling against its paper's formula, applied to a trained checkpoint as it is (tools/eval_lengths.py,
sample.py), and refused without RoPE."""
import math

import pytest
import torch

from attention import rope_table
from helpers import save_tiny_checkpoint
from helpers import variant_model as make
from rules import UserError
from variants import rope_scaling


def test_each_rope_scaling_is_its_formula_and_factor_one_is_none():
    d, base, s, L = 16, 10000.0, 4.0, 64
    theta = [base ** (-2 * j / d) for j in range(d // 2)]
    assert torch.allclose(rope_scaling.linear(d, base, s, L)[0], torch.tensor(theta) / s)
    assert torch.allclose(rope_scaling.ntk(d, base, s, L)[0],
                          torch.tensor([(base * s ** (d / (d - 2))) ** (-2 * j / d) for j in range(d // 2)]))
    yarn = []
    for t in theta:
        r = L * t / (2 * math.pi)  # turns within the original length
        gamma = min(1.0, max(0.0, (r - 1) / (32 - 1)))
        yarn.append(gamma * t + (1 - gamma) * t / s)
    yarn_theta, temperature = rope_scaling.yarn(d, base, s, L)
    assert torch.allclose(yarn_theta, torch.tensor(yarn)) and temperature == pytest.approx(0.1 * math.log(s) + 1)
    cos_sin = rope_table(d, 5, base, theta=yarn_theta, mscale=temperature)
    assert torch.allclose(cos_sin.square().sum(-1).sqrt(), torch.full((5, d // 2), temperature))  # on top of a rotation
    plain = make(block_size=16).rope
    for kind in ("linear", "ntk", "yarn"):
        assert torch.equal(make(block_size=16, rope_scaling=kind).rope, plain)  # factor 1: no scaling
        assert not torch.equal(make(block_size=16, rope_scaling=kind, rope_scaling_factor=s).rope, plain)


def test_rope_scaling_without_rope_is_ignored_and_said():
    from model import GPTConfig
    alibi = GPTConfig(vocab_size=40, n_layer=1, n_head=2, n_embd=16, pos="alibi", rope_scaling="yarn", rope_scaling_factor=2)
    assert alibi.ignored[0].startswith("model.rope_scaling='yarn' has no effect unless model.pos=rope: ignored")
    plain = GPTConfig(vocab_size=40, n_layer=1, n_head=2, n_embd=16, rope_scaling_factor=4)
    assert plain.ignored == ["model.rope_scaling_factor=4 has no effect unless model.rope_scaling is set: ignored "
                             "(its default is 1.0)"]
    assert torch.equal(make(block_size=16, rope_scaling_factor=4).rope, make(block_size=16).rope)


def test_rope_scaling_applies_to_a_trained_checkpoint_as_it_is(tmp_path):
    """The same checkpoint evaluated past its length with YaRN: other numbers than unscaled, and at
    factor 1 exactly the unscaled ones."""
    from helpers import compose_cfg
    from tools.eval_lengths import eval_lengths
    ckpt = save_tiny_checkpoint(tmp_path, block_size=16)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    base = [f"ckpt={ckpt}", f"text={text}", "lengths=[64]", "out=null"]
    plain = eval_lengths(compose_cfg("eval_lengths", base))["rows"][0]["loss"]
    one = eval_lengths(compose_cfg("eval_lengths", base + ["rope_scaling=yarn", "rope_scaling_factor=1"]))["rows"][0]["loss"]
    yarn = eval_lengths(compose_cfg("eval_lengths", base + ["rope_scaling=yarn", "rope_scaling_factor=4"]))["rows"][0]["loss"]
    assert one == plain and yarn != plain


def test_sample_py_generates_with_a_scaled_rope_over_the_longer_context(tmp_path):
    """sample.py rope_scaling=ntk rope_scaling_factor=4 on a checkpoint trained at 16: the model it builds
    has NTK's frequencies (the formula written out), a context of 64 before the cache slides, and
    greedy generation equal to recomputing that model over the whole text at every step."""
    from lab.checkpoint import load_checkpoint, model_from_checkpoint, with_rope_scaling
    from helpers import compose_cfg
    from sample import sample
    ckpt = save_tiny_checkpoint(tmp_path, block_size=16)
    cfg = compose_cfg("sample", [f"ckpt={ckpt}", "prompt=the quick", "max_new_tokens=40", "temperature=0", "device=cpu",
                                 "kv_dtype=float32", "rope_scaling=ntk", "rope_scaling_factor=4"])
    text = sample(cfg, out=open(tmp_path / "out.txt", "w"))[0]
    state = load_checkpoint(ckpt)
    model = model_from_checkpoint(with_rope_scaling(state, "ntk", 4.0, longer=True)).eval()
    assert model.config.block_size == 64 and model.config.rope_original_length == 16
    d = model.config.head_dim
    base = model.config.rope_base * 4 ** (d / (d - 2))
    assert torch.allclose(model.rope_theta()[0], 1.0 / base ** (torch.arange(0, d, 2).float() / d))
    chars = sorted(" .abcdefghijklmnopqrstuvwxyz")
    idx = torch.tensor([[chars.index(ch) for ch in "the quick"]])
    with torch.no_grad():
        for _ in range(40):  # 49 tokens in all: within the 64 the scaled context holds, so nothing slides
            idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert text == "".join(chars[i] for i in idx[0].tolist())
    with pytest.raises(UserError, match="rope_scaling=ntk does nothing without rope_scaling_factor"):
        sample(compose_cfg("sample", [f"ckpt={ckpt}", "prompt=abc", "rope_scaling=ntk", "device=cpu"]))
    with pytest.raises(UserError, match="rope_scaling applies to RoPE models"):
        sample(compose_cfg("sample", [f"ckpt={save_tiny_checkpoint(tmp_path / 'l', block_size=16, pos='learned')}",
                                      "prompt=abc", "rope_scaling=ntk", "rope_scaling_factor=4", "device=cpu"]))
