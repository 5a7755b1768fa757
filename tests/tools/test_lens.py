"""tools/lens.py: the logit lens checked against the model cut after each layer (a copy with its later
blocks removed), and direct logit attribution checked against the model's own logit (the parts must
sum to it) and against one head's share written out by hand from hook_z, the output projection's
columns, the final norm and the unembedding row; on every attention kind and both norms."""
import copy
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from lab.checkpoint import load_checkpoint, model_from_checkpoint
from helpers import TINY, assert_one_line_error, compose_cfg, corpus_text, save_tiny_checkpoint, variant_model
from rules import UserError

KINDS = {"default": {}, "gqa": dict(n_kv_head=2), "mla": dict(attn={"kind": "mla"}),
         "sink": dict(attn={"sink": "learned"}), "gate": dict(attn={"gate": "head"}),
         "gdn+softmax": dict(attn={"layer_kinds": ["gdn", "softmax"]}),
         "linear+softmax": dict(attn={"layer_kinds": ["linear", "softmax"]}),
         "mamba2": dict(attn={"kind": "mamba2"}), "learned positions": dict(pos="learned"),
         "softcap": dict(logit_softcap=3.0)}
NORMS = {"layernorm": dict(norm="layernorm"), "layernorm+bias": dict(norm="layernorm", bias=True),
         "rmsnorm": dict(norm="rmsnorm"), "rmsnorm+bias": dict(norm="rmsnorm", bias=True)}
CHARS = "".join(sorted(" .\nabcdefghijklmnopqrstuvwxyz"))
TEXT = "the quick brown fox jumps over the lazy dog.\na stitch in time saves nine.\n" * 12


def prompt(model, T=12, seed=1):
    return torch.randint(model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(seed))


def cut_after(model, n_blocks: int):
    """The model with only its first n_blocks blocks (0: the embeddings straight into ln_f and lm_head)."""
    cut = copy.deepcopy(model)
    cut.blocks = nn.ModuleList(list(cut.blocks)[:n_blocks])
    return cut


@pytest.mark.parametrize("kw", list(KINDS.values()), ids=list(KINDS))
def test_the_lens_at_each_layer_is_the_model_cut_after_that_layer(kw):
    from lab.interventions import logit_lens
    model = variant_model(**kw)
    idx = prompt(model)
    lens = logit_lens(model, idx)
    assert lens.shape == (model.config.n_layer + 1, 1, 12, model.config.vocab_size)
    with torch.no_grad():
        assert torch.equal(lens[-1], model(idx))  # the last layer's lens is the model's logits, exactly
        for n in range(model.config.n_layer):
            want = cut_after(model, n)(idx)
            err = (lens[n] - want).abs()
            assert err.max() < 1e-5, (n, err.max().item(), err.mean().item())


def test_the_loss_per_layer_is_each_cut_models_cross_entropy():
    from lab.interventions import lens_losses
    model = variant_model(n_layer=3, logit_softcap=4.0)
    x = torch.randint(model.config.vocab_size, (5, 17), generator=torch.Generator().manual_seed(2))
    x, y = x[:, :-1], x[:, 1:]
    got = lens_losses(model, x, y, 2)
    with torch.no_grad():
        for n, loss in enumerate(got["losses"]):
            logp = F.log_softmax(cut_after(model, n)(x).double(), -1)
            assert loss == pytest.approx(-logp.gather(-1, y[..., None]).mean().item(), abs=1e-5), n
        assert got["model_loss"] == pytest.approx(-F.log_softmax(model(x).double(), -1).gather(
            -1, y[..., None]).mean().item(), abs=1e-5)
    assert got["losses"][-1] == pytest.approx(got["model_loss"], abs=1e-6)


def model_logit(model, idx, position, token) -> float:
    """The token's logit at the position from the model's own forward, the soft-cap undone: c atanh(l / c)."""
    with torch.no_grad():
        logit = model(idx)[0, position, token].double().item()
    c = model.config.logit_softcap
    return c * math.atanh(logit / c) if c else logit


@pytest.mark.parametrize("norm", list(NORMS.values()), ids=list(NORMS))
@pytest.mark.parametrize("kw", list(KINDS.values()), ids=list(KINDS))
def test_the_parts_sum_to_the_logit(kw, norm):
    from lab.interventions import attribute
    model = variant_model(**{**kw, **norm})
    idx = prompt(model)
    for position, token in ((11, 3), (4, 17)):
        dla = attribute(model, idx, position, token)
        want = model_logit(model, idx, position, token)
        assert dla["sum"] == pytest.approx(want, abs=1e-4), (dla["sum"] - want, dla["parts"][:3])
        assert dla["logit"] == pytest.approx(want, abs=1e-4)
        assert dla["resid_error"] < 1e-4
        names = [n for n, _ in dla["parts"]]
        c = model.config
        heads = [f"L{l}H{h}" for l in range(c.n_layer) for h in range(c.n_head)]
        assert set(heads) <= set(names) and "embed" in names and ("pos_embed" in names) == (c.pos == "learned")
        assert ("ln_f bias" in names) == (c.bias and c.norm == "layernorm")
        assert ("L0 attn bias" in names) == c.bias and ("L1 mlp" in names)
        sizes = [abs(v) for _, v in dla["parts"]]
        assert sizes == sorted(sizes, reverse=True)


def captured(model, idx):
    """hook_z and the stream before ln_1 of every layer, and the final residual, from one forward."""
    seen = {}
    handles = [model.blocks[-1].hook_resid_post.register_forward_hook(lambda m, a, x: seen.__setitem__("final", x))]
    for l, b in enumerate(model.blocks):
        handles.append(b.attn.hook_z.register_forward_hook(lambda m, a, z, l=l: seen.__setitem__(("z", l), z)))
        handles.append(b.hook_resid_pre.register_forward_hook(lambda m, a, x, l=l: seen.__setitem__(("x", l), x)))
    with torch.no_grad():
        model(idx)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("case", ["layernorm", "rmsnorm", "gqa", "gate"])
def test_one_heads_part_written_out_by_hand(case):
    """Head h of layer l: W_O[:, h*hs:(h+1)*hs] @ z_h (z_h times its sigmoid gate for a gated layer),
    then ln_f with the scale of the full residual frozen (LayerNorm: centred, / sqrt(var + eps);
    RMSNorm: / sqrt(mean square + eps)), times ln_f's weight, dotted with the token's row of lm_head."""
    from lab.interventions import attribute
    kw = {"layernorm": dict(bias=True), "rmsnorm": dict(norm="rmsnorm"), "gqa": dict(n_kv_head=2),
          "gate": dict(attn={"gate": "head"})}[case]
    model = variant_model(n_layer=3, **kw)
    idx, position, token = prompt(model), 9, 5
    seen = captured(model, idx)
    parts = dict(attribute(model, idx, position, token)["parts"])
    hs, nh = model.config.head_dim, model.config.n_head
    final = seen["final"][0, position].double()
    w = model.ln_f.weight.double()
    u = model.lm_head.weight[token].double()
    for l, h in ((0, 0), (1, 2), (2, 3)):
        attn = model.blocks[l].attn
        z = seen[("z", l)][0, position, h].double()  # (hs,)
        if case == "gate":  # HeadGate: sigmoid of the block's normed input times W_g's row for head h
            x = model.blocks[l].ln_1(seen[("x", l)])[0, position].double()
            z = z * torch.sigmoid(attn.gate.weight[h].double() @ x)
        out = attn.c_proj.weight[:, h * hs:(h + 1) * hs].double() @ z  # (C,): what the head writes
        if case == "rmsnorm":
            normed = out / torch.sqrt((final ** 2).mean() + model.ln_f.eps)
        else:
            normed = (out - out.mean()) / torch.sqrt(((final - final.mean()) ** 2).mean() + model.ln_f.eps)
        want = (normed * w) @ u
        assert parts[f"L{l}H{h}"] == pytest.approx(want.item(), abs=1e-6), (l, h)
    assert len([n for n in parts if n.startswith("L1H")]) == nh


def test_a_post_ln_model_is_refused_in_one_line():
    from lab.interventions import attribute
    model = variant_model(norm_position="post")
    with pytest.raises(UserError, match=r"model.norm_position=post normalises the residual stream inside") as e:
        attribute(model, prompt(model), 3, 1)
    assert "\n" not in str(e.value)


@pytest.fixture
def run(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path, chars=CHARS, block_size=16, bias=True,
                                n_kv_head=2, logit_softcap=6.0)
    (tmp_path / "t.txt").write_text(TEXT)
    return ckpt, tmp_path / "t.txt"


def test_the_command_prints_what_it_measured(run, tmp_path, capsys):
    from tools.lens import lens
    ckpt, text = run
    result = lens(compose_cfg("lens", [f"ckpt={ckpt}", f"text={text}", "batches=2", "batch_size=2", "top=3",
                                       "out=null"]))
    printed = capsys.readouterr().out
    assert result["prompt"] == "a stitch in time"  # the first whole line of the text, cut to block_size
    model = model_from_checkpoint(load_checkpoint(ckpt)).eval()
    ids = torch.tensor([[CHARS.index(ch) for ch in result["prompt"]]])  # the char tokenizer: sorted characters
    with torch.no_grad():
        logits = model(ids)
    assert result["position"] == ids.size(1) - 1
    assert result["token"] == logits[0, -1].argmax().item()  # the model's top prediction
    assert result["dla"]["sum"] == pytest.approx(model_logit(model, ids, -1, result["token"]), abs=1e-4)
    assert result["dla"]["parts_sum_to_logit"] and "they agree" in printed and "pre-soft-cap" in printed
    assert len(result["losses"]) == model.config.n_layer + 1 and result["val_windows"] == 4
    assert result["losses"][-1] == pytest.approx(result["model_loss"], abs=1e-6)
    assert len(result["top"]["L1"][0]) == 3 and not (tmp_path / "lens").exists()


def test_bad_prompt_token_and_position_are_one_line(run):
    from tools.lens import lens
    ckpt, text = run
    base = [f"ckpt={ckpt}", f"text={text}", "out=null"]
    for over, needle in ((["prompt=abc", "position=3"], r"position=3 is out of range: the prompt has 3 tokens"),
                         (["prompt=abc", "token=ab"], r"token='ab' is 2 tokens"),
                         (["prompt=" + "a" * 17], r"the prompt is 17 tokens but the model's block_size is 16")):
        with pytest.raises(UserError, match=needle) as e:
            lens(compose_cfg("lens", base + over))
        assert "\n" not in str(e.value)


def test_the_command_on_a_trained_run_and_a_post_ln_checkpoint(tmp_path, cli):
    """End to end as a user runs it: a model trained for 10 steps, then a Post-LN checkpoint (refused)."""
    from train import train
    (tmp_path / "corpus.txt").write_text(corpus_text())
    train(compose_cfg("config", TINY + ["train.max_iters=10", f"out_dir={tmp_path / 'run'}",
                                        f"data.path={tmp_path / 'corpus.txt'}", f"data.cache_dir={tmp_path / 'cache'}"]))
    r = cli("tools/lens.py", f"ckpt={tmp_path / 'run'}", f"out={tmp_path / 'lens'}", "batches=1", "batch_size=2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "they agree" in r.stdout and "val loss per layer on 2 windows" in r.stdout, r.stdout
    written = json.loads((tmp_path / "lens" / "lens.json").read_text())
    assert written["dla"]["parts_sum_to_logit"] and f"the parts sum to {written['dla']['sum']:.6f}" in r.stdout
    assert (tmp_path / "lens" / "lens.png").stat().st_size > 0
    post = save_tiny_checkpoint(tmp_path / "post", norm_position="post")
    r = cli("tools/lens.py", f"ckpt={post}", "prompt=abc", "out=null")
    assert_one_line_error(r, "model.norm_position=post normalises the residual stream inside every block")
