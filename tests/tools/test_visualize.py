"""tools/visualize.py, attention maps of a prompt: the weights against softmax(QKᵀ·scale + M)
recomputed from the model's own q and k, the PNG and the viewer it writes, the top-k keys on stdout,
and one-line errors for bad input. The viewer itself (lab/plots/) is tested in test_plots.py."""
import dataclasses
import io
import re
import struct

import pytest
import torch

from lab.attnstats import attention_maps
from lab.checkpoint import save_checkpoint
from helpers import VOCAB, compose_cfg, plain_weights, sharp_model
from data.tokenizer import CharTokenizer
from tools.visualize import visualize

VARIANTS = {
    "mha": {},
    "gqa": {"n_head": 4, "n_kv_head": 2},
    "mqa": {"n_head": 4, "n_kv_head": 1},
    "qk_norm": {"attn": {"qk_norm": True, "qk_norm_type": "layer", "qk_norm_gain": "channel"}},
    "scale_none_learned_postln": {"attn": {"scale": "none"}, "pos": "learned", "norm_position": "post"},
}


def save_sharp_checkpoint(path, **over):
    model = sharp_model(**over)
    state = {"model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
             "tokenizer": CharTokenizer(VOCAB).to_dict(), "step": 7}
    return save_checkpoint(path, state)


def independent_maps(model, idx):
    """(L, nh, T, T) float64 weights from each layer's own q, k (CausalSelfAttention.qkv on the
    input the layer received), written out by helpers.plain_weights (query head h reads kv head
    h // (nh / n_kv), a -inf upper triangle, a softmax): no probe, no attention_scores, no repeat_kv."""
    inputs = {}
    hooks = [b.attn.register_forward_pre_hook(lambda mod, args, kw, l=l: inputs.__setitem__(l, (args[0], kw["rope"])),
                                              with_kwargs=True) for l, b in enumerate(model.blocks)]
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    out = []
    for l, block in enumerate(model.blocks):
        attn = block.attn
        with torch.no_grad():
            q, k, _ = (t.transpose(1, 2) for t in attn.qkv(*inputs[l]))  # (1, nh, T, hs), (1, n_kv, T, hs)
        out.append(plain_weights(q, k, attn.scale)[0])  # (nh, T, T)
    return torch.stack(out)


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_maps_equal_softmax_of_the_models_own_q_and_k(variant):
    model = sharp_model(**VARIANTS[variant])
    idx = torch.randint(len(VOCAB), (1, 29), generator=torch.Generator().manual_seed(1))
    maps, stats = attention_maps(model, idx)
    want = independent_maps(model, idx)
    d = (maps.double() - want).abs()
    assert d.max() < 1e-5, f"{variant}: max diff {d.max():.2e}, mean {d.mean():.2e}"
    assert torch.allclose(maps.sum(-1), torch.ones(maps.shape[:-1]), atol=1e-5)  # rows sum to 1
    assert (maps.triu(1) == 0).all()  # nothing above the diagonal
    assert maps.shape == (2, model.config.n_head, 29, 29) and stats["entropy"].shape == (2, model.config.n_head)


def test_visualize_writes_the_grid_and_the_viewer_and_prints_top_keys(tmp_path):
    ckpt = save_sharp_checkpoint(tmp_path / "run" / "best.pt")
    cfg = compose_cfg("visualize", [f"ckpt={tmp_path / 'run'}", "prompt=ROMEO: But soft", f"out={tmp_path / 'maps'}",
                                    "top_k=3", "device=cpu"])
    out = io.StringIO()
    views = visualize(cfg, out=out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("query 14 't' (of 15 tokens): top 3 keys per head")
    assert len(lines) == 1 + 2 * 2 and lines[1].startswith("L0 H0  ") and lines[4].startswith("L1 H1  ")
    maps = views["maps"]
    for line, (l, h) in zip(lines[1:], [(0, 0), (0, 1), (1, 0), (1, 1)]):  # the largest weights of the last row
        got = [(float(w), int(j)) for w, j in re.findall(r"(\d\.\d{3}) '.*?'@(\d+)", line)]
        want = maps[l, h, 14].topk(3)
        assert [j for _, j in got] == want.indices.tolist(), line
        assert [w for w, _ in got] == pytest.approx(want.values.tolist(), abs=6e-4)
    png = (tmp_path / "maps" / "attention.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24])[0] >= 600
    html = (tmp_path / "maps" / "attention.html").read_text(encoding="utf-8")
    # one self-contained file: no external script, style, image or font
    assert not re.search(r"""(src|href)\s*=|https?://|@import|url\(""", html, re.I), "the viewer reaches out"
    assert str(ckpt) in html and html.count("<script") == 2
    cfg.query = 3
    views = visualize(cfg, out=io.StringIO())
    assert views["query"] == 3


def test_end_of_prompt_query_and_negative_query(tmp_path):
    save_sharp_checkpoint(tmp_path / "run" / "best.pt")
    base = [f"ckpt={tmp_path / 'run'}", "prompt=abcdef", f"out={tmp_path / 'maps'}", "device=cpu"]
    assert visualize(compose_cfg("visualize", base + ["query=-2"]), out=io.StringIO())["query"] == 4
    out = io.StringIO()
    visualize(compose_cfg("visualize", base + ["query=0", "top_k=9"]), out=out)
    assert "top 1 keys" in out.getvalue() and "1.000 'a'@0" in out.getvalue()  # token 0 sees only itself


@pytest.mark.parametrize("args,message", [
    (["ckpt={tmp}/nope"], "no checkpoint at"),
    (["prompt=" + "abc" * 20], "the prompt is 60 tokens but the model's block_size is 32"),
    (["prompt_file={tmp}/euro.txt"], "characters outside the vocabulary: '5€'"),
    (["query=15"], "query=15 is out of range: the prompt has 15 tokens"),
    (["top_k=0"], "top_k=0 must be an integer >= 1"),
    (["prompt=null"], "no prompt"),
    (["bogus_key=1"], "bogus_key"),
], ids=["unknown-ckpt", "too-long", "outside-vocab", "query-range", "top-k", "no-prompt", "unknown-key"])
def test_bad_input_is_a_one_line_error(tmp_path, args, message, cli):
    save_sharp_checkpoint(tmp_path / "run" / "best.pt")
    (tmp_path / "euro.txt").write_text("ROMEO: 5 €", encoding="utf-8")
    defaults = {"ckpt": f"ckpt={tmp_path / 'run'}", "prompt": "prompt=ROMEO: But soft", "out": f"out={tmp_path / 'maps'}"}
    given = [a.replace("{tmp}", str(tmp_path)) for a in args]
    for a in given:
        key = a.split("=")[0]
        defaults.pop("prompt" if key == "prompt_file" else key, None)  # a prompt beside prompt_file is refused
    r = cli("tools/visualize.py", *defaults.values(), *given, "device=cpu", timeout=120)
    assert r.returncode == 1, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if line.strip()]
    assert errors[-1].startswith("error:") and message in errors[-1], r.stderr[-2000:]
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert not (tmp_path / "maps").exists()
