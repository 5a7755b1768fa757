"""tools/ablate.py: removing a head's output, checked against the same model with that head's columns
of the output projection changed by hand (zero: the columns zeroed; mean: zeroed, with what they added
on average moved into the bias), and the loss and in-context gain recomputed from the logits."""
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lab.checkpoint import load_checkpoint, model_from_checkpoint
from helpers import compose_cfg, save_tiny_checkpoint
from rules import UserError

TEXT = "the quick brown fox jumps over the lazy dog. a stitch in time saves nine. " * 12


@pytest.fixture
def run(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path, block_size=16, bias=True, n_kv_head=2)
    (tmp_path / "t.txt").write_text(TEXT)
    return ckpt, tmp_path / "t.txt"


def by_hand(model, x, y):
    """The loss over the windows and the in-context gain of [r, r] (r: each window's first half), from
    the logits: cross-entropy written out."""
    with torch.no_grad():
        logp = F.log_softmax(model(x).float(), -1)
        loss = -logp.gather(-1, y[..., None]).mean().item()
        r = x[:, : x.size(1) // 2]
        seq = torch.cat([r, r], 1)
        nll = -F.log_softmax(model(seq).float(), -1)[:, :-1].gather(-1, seq[:, 1:, None]).squeeze(-1)
        n = r.size(1)
    return loss, (nll[:, : n - 1].mean() - nll[:, n:].mean()).item()


def heads_removed(ckpt, heads, means=None):
    """The checkpoint's model with heads' columns of c_proj zeroed; with means, W_cols @ mean added to the
    bias (what the head's mean output contributed)."""
    model = model_from_checkpoint(load_checkpoint(ckpt)).eval()
    hs = model.config.head_dim
    with torch.no_grad():
        for layer, head in heads:
            proj = model.blocks[layer].attn.c_proj
            cols = slice(head * hs, (head + 1) * hs)
            if means is not None:
                proj.bias += proj.weight[:, cols] @ means[layer][head]
            proj.weight[:, cols] = 0
    return model


@pytest.mark.parametrize("heads", [None, ["L1H2", "L0H0"]], ids=["each", "together"])
def test_ablations_equal_the_heads_removed_by_hand(run, heads, tmp_path):
    from lab.interventions import head_means
    from lab.heldout import windows
    from tools.ablate import ablate, parse_head
    ckpt, text = run
    over = [f"ckpt={ckpt}", f"text={text}", "batches=2", "batch_size=4", f"out={tmp_path / 'out'}"]
    result = ablate(compose_cfg("ablate", over + ([f"heads=[{','.join(heads)}]"] if heads else [])))
    model = model_from_checkpoint(load_checkpoint(ckpt)).eval()
    from data.tokenizer import tokenizer_from_dict
    ids = torch.as_tensor(tokenizer_from_dict(load_checkpoint(ckpt)["tokenizer"]).encode(TEXT)).long()
    x, y = windows(ids, 16, 8)
    base = by_hand(model, x, y)
    assert result["base"]["loss"] == pytest.approx(base[0], abs=1e-5)
    assert result["base"]["gain"] == pytest.approx(base[1], abs=1e-5)
    means = head_means(model, x, 4)
    rows = {r["heads"]: r for r in result["rows"]}
    assert len(rows) == (1 if heads else 8)
    for name, row in list(rows.items())[:3]:
        chosen = [parse_head(h) for h in name.split(",")]
        for how, m in (("zero", None), ("mean", means)):
            loss, gain = by_hand(heads_removed(ckpt, chosen, m), x, y)
            assert row[f"{how}_dloss"] == pytest.approx(loss - base[0], abs=1e-5), (name, how)
            assert row[f"{how}_dgain"] == pytest.approx(gain - base[1], abs=1e-5), (name, how)
    assert [r["zero_dloss"] for r in result["rows"]] == sorted((r["zero_dloss"] for r in result["rows"]), reverse=True)
    assert json.loads((tmp_path / "out" / "ablate.json").read_text())["rows"] == result["rows"]
    assert (tmp_path / "out" / "ablate.csv").read_text().splitlines()[0].startswith("heads,zero_dloss")
    assert (tmp_path / "out" / "ablate.png").exists() == (heads is None)


def test_the_mean_ablation_keeps_what_a_head_always_adds(run):
    """A head's mean over the windows is what mean ablation puts back: measured on those windows, a
    head whose output never changes costs nothing to mean-ablate and something to zero."""
    from lab.interventions import Ablation, head_means, measure
    ckpt, _ = run
    model = model_from_checkpoint(load_checkpoint(ckpt)).eval()
    x = torch.randint(model.config.vocab_size, (6, 17))
    x, y = x[:, :-1], x[:, 1:]
    with torch.no_grad():  # head 1 of layer 0 made constant: its value columns zero, its bias not
        attn = model.blocks[0].attn
        hs, nh, nkv = attn.head_dim, attn.n_head, attn.n_kv_head
        v_rows = slice((nh + nkv) * hs + (1 // (nh // nkv)) * hs, (nh + nkv) * hs + (1 // (nh // nkv) + 1) * hs)
        attn.c_attn.weight[v_rows] = 0  # kv head 0 feeds query heads 0 and 1: both constant
    base = measure(model, x, y, 3)["loss"]
    means = head_means(model, x, 3)
    with Ablation(model, [(0, 1)], means):
        assert measure(model, x, y, 3)["loss"] == pytest.approx(base, abs=1e-6)
    with Ablation(model, [(0, 1)]):
        assert abs(measure(model, x, y, 3)["loss"] - base) > 1e-4


def test_a_checkpoint_without_its_runs_data_config_asks_for_a_text(run, tmp_path):
    """Without text=, the tools make the run's own val split again from the config the checkpoint saved: a
    checkpoint without one (saved by hand) is one line naming text=, not a KeyError."""
    from tools.ablate import ablate
    ckpt, _ = run
    state = torch.load(ckpt, weights_only=True)
    state.pop("config", None)
    bare = tmp_path / "bare.pt"
    torch.save(state, bare)
    with pytest.raises(UserError, match="no data config .* give text=FILE") as e:
        ablate(compose_cfg("ablate", [f"ckpt={bare}", "out=null"]))
    assert "\n" not in str(e.value)


def test_a_head_the_model_does_not_have_is_one_line(run):
    from tools.ablate import ablate
    ckpt, text = run
    with pytest.raises(UserError, match=r"heads: L2H0 is not in this model \(2 layers of 4 heads\)") as e:
        ablate(compose_cfg("ablate", [f"ckpt={ckpt}", f"text={text}", "heads=[L2H0]", "out=null"]))
    assert "\n" not in str(e.value)


def test_a_second_call_with_the_default_out_keeps_the_first_calls_files(run, tmp_path, monkeypatch, capsys):
    """`python tools/ablate.py ckpt=A; python tools/ablate.py ckpt=B` with no out=: each call writes into
    a new outputs/ablate/<time>/ and names it; A's files are still there, unchanged, after B's call."""
    from tools.ablate import ablate
    ckpt, text = run
    other = save_tiny_checkpoint(tmp_path / "b", block_size=16, bias=True, n_kv_head=2, seed=1)
    monkeypatch.chdir(tmp_path)
    base = [f"text={text}", "batches=1", "batch_size=2", "heads=[L0H0]"]
    first = ablate(compose_cfg("ablate", [f"ckpt={ckpt}", *base]))
    made = sorted((tmp_path / "outputs" / "ablate").iterdir())
    assert len(made) == 1 and f"wrote {Path('outputs', 'ablate', made[0].name, 'ablate.json')}" in capsys.readouterr().err
    kept = {f.name: f.read_bytes() for f in made[0].iterdir()}
    second = ablate(compose_cfg("ablate", [f"ckpt={other}", *base]))
    assert first["rows"] != second["rows"]  # two models: the second call's files would differ
    dirs = sorted((tmp_path / "outputs" / "ablate").iterdir())
    assert len(dirs) == 2 and dirs[0] == made[0]  # the newest (`ls outputs/ablate | tail -1`) is the latest call's
    assert {f.name: f.read_bytes() for f in dirs[0].iterdir()} == kept
    assert json.loads((dirs[0] / "ablate.json").read_text())["ckpt"] == str(ckpt)
    assert json.loads((dirs[1] / "ablate.json").read_text())["ckpt"] == str(other)


@pytest.mark.parametrize("variant", [{}, {"n_kv_head": 2}, {"attn": {"kind": "mla"}}, {"attn": {"sink": "learned"}},
                                     {"attn": {"gate": "head"}}, {"attn": {"layer_kinds": ["gdn", "softmax"]}},
                                     {"attn": {"layer_kinds": ["linear", "softmax"]}}],
                         ids=["default", "gqa", "mla", "sink", "gate", "gdn-softmax", "linear-softmax"])
@pytest.mark.parametrize("layer", [0, 1])
def test_zeroing_every_head_of_a_layer_removes_its_attention(variant, layer):
    """Every head of one layer zero-ablated at hook_z = the model with that layer's attention output
    replaced by zero (its whole module's output, not the heads'), whatever the kind of layer."""
    from lab.interventions import Ablation
    from helpers import variant_model

    model = variant_model(n_layer=2, **variant).eval()
    idx = torch.randint(40, (2, 12))
    with Ablation(model, [(layer, h) for h in range(model.config.n_head)]), torch.no_grad():
        ablated = model(idx)
    handle = model.blocks[layer].attn.register_forward_hook(lambda m, a, out: torch.zeros_like(out))
    with torch.no_grad():
        removed = model(idx)
    handle.remove()
    with torch.no_grad():
        intact = model(idx)
    assert torch.allclose(ablated, removed, atol=1e-5), (ablated - removed).abs().max()
    assert not torch.allclose(ablated, intact, atol=1e-4)


@pytest.mark.parametrize("variant", [{}, {"n_kv_head": 2}, {"attn": {"kind": "mla"}}, {"attn": {"sink": "learned"}},
                                     {"attn": {"gate": "head"}}, {"attn": {"layer_kinds": ["gdn", "softmax"]}},
                                     {"attn": {"layer_kinds": ["linear", "softmax"]}},
                                     {"attn": {"layer_kinds": ["mamba2", "softmax"]}}],
                         ids=["default", "gqa", "mla", "sink", "gate", "gdn", "linear", "mamba2"])
def test_one_head_zeroed_at_hook_z_is_its_projection_columns_zeroed_except_where_a_norm_spans_the_heads(variant):
    """Zeroing head 1 of layer 0 at hook_z = the layer's own output gate and projection applied to its
    heads' outputs with that head's zeroed (recomputed from the layer's input and hook_z). That equals
    zeroing the head's columns of the output projection wherever the gate acts head by head (softmax,
    GQA, MLA, sinks, a sigmoid gate, gdn's per-head norm, linear); mamba2's gated norm spans all the
    heads, so there the other heads are rescaled and the two differ (docs/looking_inside.md says so)."""
    from lab.interventions import Ablation
    from helpers import variant_model

    torch.manual_seed(0)
    model = variant_model(n_layer=2, **variant).eval()
    attn, hs, h = model.blocks[0].attn, model.config.head_dim, 1
    idx = torch.randint(40, (2, 12))
    seen = {}
    hooks = [attn.register_forward_pre_hook(lambda m, args: seen.update(x=args[0])),
             attn.hook_z.register_forward_hook(lambda m, args, out: seen.update(z=out.clone()))]
    with torch.no_grad():
        model(idx)
    for hook in hooks:
        hook.remove()
    z = seen["z"].clone()
    z[:, :, h] = 0
    with torch.no_grad():
        y = z if attn.gate is None else attn.gate.transform(seen["x"], z)
        recomputed = attn.c_proj(y.reshape(*y.shape[:2], -1))
    hook = attn.register_forward_hook(lambda m, args, out: recomputed)
    with torch.no_grad():
        reference = model(idx)
    hook.remove()
    with Ablation(model, [(0, h)]), torch.no_grad():
        ablated = model(idx)
    assert torch.allclose(ablated, reference, atol=1e-5), (ablated - reference).abs().max()
    with torch.no_grad():
        attn.c_proj.weight[:, h * hs:(h + 1) * hs] = 0
        columns = model(idx)
    spans_heads = variant.get("attn", {}).get("layer_kinds", [None])[0] == "mamba2"
    assert torch.allclose(ablated, columns, atol=1e-5) != spans_heads, (ablated - columns).abs().max()
