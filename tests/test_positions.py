"""Position schemes past the trained length: ALiBi against the paper's formula, RoPE scaling (position
interpolation, NTK, YaRN) against theirs, the length evaluation against train.py's own val loss, and a
resume that lengthens the context."""
import json
import math

import pytest
import torch

from attention import alibi_slopes, attention, rope_freqs, rope_theta
from common import UserError
from helpers import save_tiny_checkpoint, variant_model as make


# ----------------------------------------------------------------------------- ALiBi

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
    got = attention(q, k, v, 0.35, impl=impl, alibi=(m, i, i), block=4)
    kk, vv = (t.double().repeat_interleave(2, dim=1) for t in (k, v))
    s = q.double() @ kk.transpose(-2, -1) * 0.35 - m.double().view(1, 6, 1, 1) * (i[:, None] - i[None, :])
    s = s.masked_fill(i[None, :] > i[:, None], float("-inf"))
    assert torch.allclose(got.double(), torch.softmax(s, -1) @ vv, atol=1e-5)


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


# ----------------------------------------------------------------------------- RoPE scaling

def test_each_rope_scaling_is_its_formula_and_factor_one_is_none():
    d, base, s, L = 16, 10000.0, 4.0, 64
    theta = [base ** (-2 * j / d) for j in range(d // 2)]
    assert torch.allclose(rope_theta(d, base, "linear", s, L), torch.tensor(theta) / s)
    assert torch.allclose(rope_theta(d, base, "ntk", s, L), torch.tensor([(base * s ** (d / (d - 2))) ** (-2 * j / d)
                                                                         for j in range(d // 2)]))
    yarn = []
    for t in theta:
        r = L * t / (2 * math.pi)  # turns within the original length
        gamma = min(1.0, max(0.0, (r - 1) / (32 - 1)))
        yarn.append(gamma * t + (1 - gamma) * t / s)
    assert torch.allclose(rope_theta(d, base, "yarn", s, L), torch.tensor(yarn))
    cos_sin = rope_freqs(d, 5, base, scaling="yarn", factor=s, original=L)
    plain = rope_freqs(d, 5, base, scaling="yarn", factor=s, original=L) / (0.1 * math.log(s) + 1)
    assert torch.allclose(cos_sin.square().sum(-1).sqrt(), torch.full((5, d // 2), 0.1 * math.log(s) + 1))
    assert torch.allclose(plain.square().sum(-1), torch.ones(5, d // 2))  # YaRN's temperature on top of a rotation
    for kind in ("linear", "ntk", "yarn"):
        assert torch.equal(rope_freqs(d, 9, base, scaling=kind, factor=1.0, original=L), rope_freqs(d, 9, base))


def test_rope_scaling_is_refused_without_rope():
    from model import GPTConfig
    with pytest.raises(UserError, match="model.rope_scaling='yarn' has no effect unless model.pos=rope"):
        GPTConfig(vocab_size=40, n_layer=1, n_head=2, n_embd=16, pos="alibi", rope_scaling="yarn", rope_scaling_factor=2)
    with pytest.raises(UserError, match="model.rope_scaling_factor=4 has no effect unless model.rope_scaling is set"):
        GPTConfig(vocab_size=40, n_layer=1, n_head=2, n_embd=16, rope_scaling_factor=4)


# ----------------------------------------------------------------------------- the evaluation

def test_loss_at_block_size_is_train_pys_whole_val_split_loss(train_cfg, tmp_path):
    from helpers import compose_cfg
    from tools.eval_lengths import eval_lengths
    from train import train
    result = train(train_cfg("train.max_iters=6", "train.eval_interval=3"))
    r = eval_lengths(compose_cfg("eval_lengths", [f"ckpt={tmp_path / 'run' / 'ckpt_0000006.pt'}", "lengths=[32,64]",
                                                  "tokens=1000000", "out=null"]))
    assert r["rows"][0]["loss"] == pytest.approx(result["val_loss_full"], abs=1e-5)
    assert sum(r["rows"][0]["per_position"]) / 32 == pytest.approx(r["rows"][0]["loss"], rel=1e-6)
    assert len(r["rows"][1]["per_position"]) == 64 and math.isfinite(r["rows"][1]["copy_loss"])


def test_runs_of_a_sweep_are_evaluated_and_grouped_into_arms(train_cfg, tmp_path):
    """runs=: every run's checkpoint evaluated, runs differing only in their seed one arm: its mean, sd
    and 95% interval at each length are those of the per-checkpoint losses (t(0.975, 1) = 12.706)."""
    from helpers import compose_cfg
    from tools.eval_lengths import eval_lengths
    from train import train
    for seed in (1, 2):
        train(train_cfg("train.max_iters=4", "train.eval_interval=4", f"seed={seed}",
                        f"out_dir={tmp_path / 'sweep' / f'seed{seed}'}"))
    args = ["lengths=[32,64]", "tokens=2000", "out=null"]
    one = [eval_lengths(compose_cfg("eval_lengths", [f"ckpt={tmp_path / 'sweep' / f'seed{s}'}", *args]))
           for s in (1, 2)]
    r = eval_lengths(compose_cfg("eval_lengths", [f"runs=[{tmp_path / 'sweep'}]", *args,
                                                  f"out={tmp_path / 'arms.png'}"]))
    assert len(r["arms"]) == 1 and len(r["arms"][0]["runs"]) == 2
    for i, L in enumerate((32, 64)):
        a, b = (o["rows"][i]["loss"] for o in one)
        d = r["arms"][0]["loss"][L]
        assert a != b and d["n"] == 2 and d["mean"] == pytest.approx((a + b) / 2, abs=1e-9)
        assert d["sd"] == pytest.approx(abs(a - b) / math.sqrt(2), rel=1e-9)
        assert d["half"] == pytest.approx(12.706 * d["sd"] / math.sqrt(2), rel=1e-3)
    assert (tmp_path / "arms.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(UserError, match="ckpt= and runs= both given"):
        eval_lengths(compose_cfg("eval_lengths", [f"runs=[{tmp_path / 'sweep'}]", "ckpt=x.pt", *args]))


def test_absolute_tables_are_not_extrapolated(tmp_path, capsys):
    from helpers import compose_cfg
    from tools.eval_lengths import eval_lengths
    ckpt = save_tiny_checkpoint(tmp_path, pos="learned", block_size=16)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    r = eval_lengths(compose_cfg("eval_lengths", [f"ckpt={ckpt}", f"text={text}", "lengths=[16,32]", "out=null"]))
    assert "loss" in r["rows"][0] and r["rows"][1] == {"length": 32, "skipped": True}
    assert "L=32: skipped: model.pos=learned has a table of 16 positions" in capsys.readouterr().out


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
    from checkpoint import load_checkpoint, model_from_checkpoint, with_rope_scaling
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
    assert torch.allclose(rope_theta(d, model.config.rope_base, "ntk", 4.0, 16),
                          1.0 / base ** (torch.arange(0, d, 2).float() / d))
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


# ----------------------------------------------------------------------------- lengthening the context

def test_a_resume_may_lengthen_the_context_keeping_every_weight_and_nothing_else(train_cfg, tmp_path):
    import checkpoint as ck
    import train as train_module
    train_module.train(train_cfg("train.max_iters=4", "train.eval_interval=2"))
    before = ck.load_checkpoint(tmp_path / "run" / "ckpt_0000004.pt")
    longer = ["model.block_size=64", "model.rope_scaling=yarn", "model.rope_scaling_factor=2", "resume=true"]
    with pytest.raises(UserError, match="model.n_head is 4 here but 2"):
        train_module.train(train_cfg("train.max_iters=6", *longer, "model.n_head=4"))  # any other change is refused
    run = train_module.setup(train_cfg("train.max_iters=6", *longer))
    try:  # the resumed model: every weight as saved, the longer block with YaRN from the trained 32
        assert all(torch.equal(before["model"][k], v) for k, v in run.model.state_dict().items())
        c = run.model.config
        assert (c.block_size, c.rope_scaling, c.rope_scaling_factor, c.rope_original_length) == (64, "yarn", 2.0, 32)
    finally:
        run.tracker.close()
        run.lock.close()
    train_module.train(train_cfg("train.max_iters=6", *longer))
    after = ck.load_checkpoint(tmp_path / "run" / "ckpt_0000006.pt")  # stated in the checkpoint
    ext = after["context_extensions"]
    assert len(ext) == 1 and ext[0]["step"] == 4 and ext[0]["block_size"] == [32, 64]
    assert ext[0]["rope_scaling"] == ["none", "yarn"] and after["model_config"]["rope_original_length"] == 32


def test_lengthening_another_runs_context_is_a_new_run_that_leaves_the_first_as_it_was(train_cfg, tmp_path):
    """Was: resume=OTHER_RUN/ckpt with a longer block and hydra.run.dir=NEW trained in OTHER_RUN, rewrote its
    config.yaml and metrics, replaced its best.pt and pruned its checkpoints. A fine-tune now runs in
    the dir it is given, from the other run's weights, and the other run is left byte for byte."""
    from train import train
    train(train_cfg("train.max_iters=4", "train.eval_interval=2"))
    first = tmp_path / "run"
    before = {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()}
    new = tmp_path / "finetune"
    longer = ["model.block_size=64", "model.rope_scaling=ntk", "model.rope_scaling_factor=2"]
    result = train(train_cfg("train.max_iters=6", *longer, f"resume={first / 'ckpt_0000004.pt'}", f"out_dir={new}"))
    assert result["out_dir"] == str(new) and result["steps"] == 6
    assert {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()} == before
    import checkpoint as ck
    state = ck.load_checkpoint(new / "ckpt_0000006.pt")
    assert state["model_config"]["block_size"] == 64 and state["context_extensions"][0]["block_size"] == [32, 64]
    assert [json.loads(line)["step"] for line in (new / "metrics.jsonl").read_text().splitlines()][0] >= 4
    with pytest.raises(UserError, match="already holds a run"):  # and never into a dir that holds another run
        train(train_cfg("train.max_iters=6", *longer, f"resume={first / 'ckpt_0000004.pt'}", f"out_dir={new}"))


def test_a_position_table_cannot_be_lengthened(train_cfg):
    from train import train
    train(train_cfg("train.max_iters=2", "train.eval_interval=2", "model.pos=learned"))
    with pytest.raises(UserError, match="model.pos=learned has a table of 32 positions"):
        train(train_cfg("train.max_iters=4", "model.pos=learned", "model.block_size=64", "resume=true"))
