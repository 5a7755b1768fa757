"""tools/patch.py: each entry checked against the same patch written out here (a hook that copies the clean
run's head output or residual position, the head's weights computed by plain math from hook_q and hook_k,
the metric and the recovery formula recomputed from the logits), and patching everything of the clean run
(the whole stream; every head, every MLP and the embedding's difference) giving the clean logits."""
import json

import pytest
import torch

from helpers import compose_cfg, one_line, save_tiny_checkpoint, variant_model
from rules import UserError
from lab.interventions import Patching, Prompts, components, drawn_prompts, patch_all, record
from tools.patch import patch

VARIANTS = {
    "default": {},
    "gqa": {"n_kv_head": 2},
    "mla": {"attn": {"kind": "mla"}},
    "sink": {"attn": {"sink": "learned"}},
    "gate": {"attn": {"gate": "head"}},
    "gdn-softmax": {"attn": {"layer_kinds": ["gdn", "softmax"]}},
}
T, N = 12, 3  # tokens per prompt (two copies of 6), prompts


def model_of(variant):
    """A tiny model of the variant in float64 (so entries compare to 1e-9), a sink with a real share."""
    model = variant_model(block_size=16, **VARIANTS[variant]).double()
    with torch.no_grad():
        for b in model.blocks:
            if isinstance(getattr(b.attn, "sink_logit", None), torch.nn.Parameter):  # a softmax layer's sink
                b.attn.sink_logit.copy_(torch.linspace(-1, 2, b.attn.n_head))
    return model


def prompts(metric="loss", seed=0):
    """Random [r, r] and [o, r]: the second copy the same, the first not."""
    g = torch.Generator().manual_seed(seed)
    r, o = torch.randint(40, (N, T // 2), generator=g), torch.randint(40, (N, T // 2), generator=g)
    return Prompts(torch.cat([r, r], 1), torch.cat([o, r], 1), metric, scored=T // 2)


def hand_metric(logits, p: Prompts, answers=None):
    """Cross-entropy of the clean tokens from p.scored on, or the answers' logit difference at the end."""
    if p.metric == "loss":
        logp = torch.log_softmax(logits.double(), -1)[:, p.scored:-1]
        return -logp.gather(-1, p.clean[:, p.scored + 1:, None]).mean().item()
    last = logits[:, -1].double()
    return (last.gather(-1, answers[:, :1]) - last.gather(-1, answers[:, 1:])).mean().item()


def hand_answers(model, p: Prompts):
    """The clean run's top token, and the corrupted run's best token that is not it."""
    with torch.no_grad():
        clean, corrupted = model(p.clean)[:, -1], model(p.corrupted)[:, -1]
    a = clean.argmax(-1)
    ranked = corrupted.argsort(-1, descending=True)
    b = torch.stack([row[row != x][0] for row, x in zip(ranked, a)])
    return torch.stack([a, b], 1)


def run_with(model, idx, hooks):
    """Logits of idx with forward hooks {module: fn} attached."""
    handles = [m.register_forward_hook(fn) for m, fn in hooks.items()]
    try:
        with torch.no_grad():
            return model(idx)
    finally:
        for h in handles:
            h.remove()


def read(model, idx, modules):
    """Outputs of the modules in one forward of idx, through hooks written here."""
    seen = {}
    run_with(model, idx, {m: (lambda mod, a, out, m=m: seen.__setitem__(m, out)) for m in modules})
    return seen


def by_hand(model, p):
    """(answers, m -> its recovery): the answers for logit_diff, and the recovery formula over the clean
    and corrupted runs' metric computed here."""
    answers = hand_answers(model, p) if p.metric == "logit_diff" else None
    with torch.no_grad():
        clean, corrupted = hand_metric(model(p.clean), p, answers), hand_metric(model(p.corrupted), p, answers)
    return answers, lambda m: (m - corrupted) / (clean - corrupted)


# ----------------------------------------------------------------------------- patching everything

@pytest.mark.parametrize("variant", VARIANTS)
def test_patching_all_of_the_clean_run_gives_the_clean_logits(variant):
    """Two ways to carry the whole clean run into the corrupted one. The stream of any layer (or after the
    last) at every position: the clean logits, recovery 1. And, for a Pre-LN model whose stream is the
    embedding plus what each attention and MLP adds, the tool's per-head sites for every head of every
    layer with every MLP's output and the embeddings' difference added at the end: the clean logits too,
    so the head sites together cover each head's whole output. A gated layer (gate=head, a gdn layer's
    own gated norm) is the exception: hook_z is the gate's input and the gate still reads the corrupted
    stream."""
    model, p = model_of(variant), prompts()
    L, nh = model.config.n_layer, model.config.n_head
    with torch.no_grad():
        clean = model(p.clean)
    names = [f"blocks.{l}.{h}" for l in range(L) for h in ("hook_resid_pre", "attn.hook_z", "hook_mlp_out")]
    cache, _ = record(model, p.clean, names + [f"blocks.{L - 1}.hook_resid_post"])
    result = patch_all(model, p)
    for l in range(L + 1):
        name = f"blocks.{l}.hook_resid_pre" if l < L else f"blocks.{L - 1}.hook_resid_post"
        with Patching(model, cache, [(name, (slice(None),))]), torch.no_grad():
            logits = model(p.corrupted)
        assert torch.allclose(logits, clean, atol=1e-10), (l, (logits - clean).abs().max())
        m = hand_metric(logits, p)
        assert (m - result["corrupted"]) / (result["clean"] - result["corrupted"]) == pytest.approx(1, abs=1e-9)
    heads = [s for kind, *_, sites in components(L, nh, T, []) if kind == "head" for s in sites]
    assert len(heads) == L * nh
    mlps = [(f"blocks.{l}.hook_mlp_out", (slice(None),)) for l in range(L)]
    embedding_difference = model.wte(p.clean) - model.wte(p.corrupted)  # positions (RoPE here) are the same
    last = {model.blocks[-1].hook_resid_post: lambda m, a, out: out + embedding_difference}
    with Patching(model, cache, heads + mlps):
        logits = run_with(model, p.corrupted, last)
    if any(b.attn.gate is not None for b in model.blocks):  # gate=head, and gdn's own output gate
        assert (logits - clean).abs().max() > 1e-3
    else:
        assert torch.allclose(logits, clean, atol=1e-9), (logits - clean).abs().max()
    with Patching(model, cache, heads[1:] + mlps):  # one head short: not clean
        assert (run_with(model, p.corrupted, last) - clean).abs().max() > 1e-3


# ----------------------------------------------------------------------------- each entry by hand

@pytest.mark.parametrize("metric", ["loss", "logit_diff"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_heads_entry_equals_its_output_copied_by_hand(variant, metric):
    model, p = model_of(variant), prompts(metric)
    result = patch_all(model, p)
    answers, recovery = by_hand(model, p)
    assert recovery(result["clean"]) == pytest.approx(1, abs=1e-9)
    assert recovery(result["corrupted"]) == pytest.approx(0, abs=1e-9)
    for l, block in enumerate(model.blocks):
        clean_z = read(model, p.clean, [block.attn.hook_z])[block.attn.hook_z]  # (B, T, nh, hs)
        for h in range(model.config.n_head):
            def copy_head(module, args, z, h=h):
                z = z.clone()
                z[:, :, h] = clean_z[:, :, h]
                return z
            m = hand_metric(run_with(model, p.corrupted, {block.attn.hook_z: copy_head}), p, answers)
            assert result["grids"]["head"][l][h] == pytest.approx(recovery(m), abs=1e-9), (l, h)


def weights_by_hand(attn, q, k):
    """softmax(q·kᵀ·scale + causal mask) per query head, kv head h // (nh / n_kv), a sink as one more
    logit: q (B, T, nh, d), k (B, T, n_kv, d) -> (B, nh, T, T)."""
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    s = q @ k.transpose(-2, -1) * attn.scale
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if attn.sink_logit is None:
        return torch.softmax(s, -1)
    sink = attn.sink_logit.view(1, -1, 1, 1).expand(*s.shape[:-1], 1).to(s.dtype)
    return torch.softmax(torch.cat([sink, s], -1), -1)[..., 1:]


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_pattern_entry_equals_the_clean_weights_written_out(variant):
    """The clean run's weights of head h, computed here from the q and k at its hook points, times the
    corrupted run's values of that head, as the head's output: the tool's pattern entry. Layers without
    softmax weights are blank and named."""
    model, p = model_of(variant), prompts()
    result = patch_all(model, p)
    _, recovery = by_hand(model, p)
    for l, block in enumerate(model.blocks):
        attn = block.attn
        if not attn.softmax:
            assert result["grids"]["pattern"][l] == [None] * model.config.n_head
            assert [l, "gdn"] in result["no_pattern"]
            continue
        qk = read(model, p.clean, [attn.hook_q, attn.hook_k])
        weights = weights_by_hand(attn, qk[attn.hook_q], qk[attn.hook_k])  # (B, nh, T, T)
        for h in range(model.config.n_head):
            seen = {}

            def keep_v(module, args, v):
                seen["v"] = v  # (B, T, n_kv, hs): read before hook_z in the same forward

            def clean_weights(module, args, z, h=h):
                z = z.clone()
                v = seen["v"][:, :, h // (attn.n_head // seen["v"].size(2))]  # (B, T, hs)
                z[:, :, h] = weights[:, h] @ v
                return z
            logits = run_with(model, p.corrupted, {attn.hook_v: keep_v, attn.hook_z: clean_weights})
            assert result["grids"]["pattern"][l][h] == pytest.approx(recovery(hand_metric(logits, p)), abs=1e-9), (l, h)
    assert result["no_pattern"] == ([[0, "gdn"]] if variant == "gdn-softmax" else [])


@pytest.mark.parametrize("variant", ["default", "gdn-softmax"])
def test_each_residual_entry_equals_one_position_copied_by_hand(variant):
    model, p = model_of(variant), prompts()
    result = patch_all(model, p)
    _, recovery = by_hand(model, p)
    L = model.config.n_layer
    points = [b.hook_resid_pre for b in model.blocks] + [model.blocks[-1].hook_resid_post]
    clean = read(model, p.clean, points)
    assert len(result["grids"]["resid"]) == L + 1
    for l, point in enumerate(points):
        for pos in range(T):
            def copy_position(module, args, x, point=point, pos=pos):
                x = x.clone()
                x[:, pos] = clean[point][:, pos]
                return x
            m = hand_metric(run_with(model, p.corrupted, {point: copy_position}), p)
            assert result["grids"]["resid"][l][pos] == pytest.approx(recovery(m), abs=1e-9), (l, pos)
    assert result["grids"]["resid"][0][T // 2:] == pytest.approx([0.0] * (T // 2), abs=1e-12)  # same tokens there


# ----------------------------------------------------------------------------- the prompts and the command

class Drawn:
    n, span, seed, metric = 5, 6, 3, "loss"


@pytest.mark.parametrize("metric", ["loss", "logit_diff"])
def test_drawn_prompts_are_a_span_twice_and_another_span_then_it(metric):
    ids = torch.randint(30, (400,), generator=torch.Generator().manual_seed(1))
    cfg = Drawn()
    cfg.metric = metric
    p = drawn_prompts(ids, cfg, block=16)
    windows = ids.unfold(0, 6, 1)  # every span of 6 tokens of the text

    def in_text(span):
        return bool((windows == span).all(1).any())
    full = torch.cat([p.clean, p.answer[:, None]], 1) if metric == "logit_diff" else p.clean
    full_corrupted = torch.cat([p.corrupted, p.answer[:, None]], 1) if metric == "logit_diff" else p.corrupted
    assert full.shape == (5, 12) and p.clean.shape == p.corrupted.shape
    for clean, corrupted in zip(full, full_corrupted):
        r, o = clean[:6], corrupted[:6]
        assert in_text(r) and in_text(o) and not torch.equal(r, o)
        assert torch.equal(clean[6:], r) and torch.equal(corrupted[6:], r)
    assert p.copy == 6 and (p.scored == 6 if metric == "loss" else p.answer is not None)
    again, other = drawn_prompts(ids, cfg, 16), drawn_prompts(ids, type("C", (Drawn,), {"seed": 4})(), 16)
    assert torch.equal(again.clean, p.clean) and not torch.equal(other.clean[:, :6], full[:, :6])
    with_bos = drawn_prompts(ids, cfg, 16, bos=30)
    assert (with_bos.clean[:, 0] == 30).all()
    assert torch.equal(with_bos.clean[:, 1:], p.clean[:, :with_bos.clean.size(1) - 1])


TEXT = "the quick brown fox jumps over the lazy dog. a stitch in time saves nine. " * 12


@pytest.fixture
def run(tmp_path):
    ckpt = save_tiny_checkpoint(tmp_path, block_size=16, n_kv_head=2)
    (tmp_path / "t.txt").write_text(TEXT)
    return ckpt, tmp_path / "t.txt"


def test_the_command_prints_sorted_rows_and_writes_its_files(run, tmp_path, capsys):
    from lab.checkpoint import load_checkpoint, model_from_checkpoint
    ckpt, text = run
    result = patch(compose_cfg("patch", [f"ckpt={ckpt}", f"text={text}", "n=3", "span=5", f"out={tmp_path / 'o'}"]))
    model = model_from_checkpoint(load_checkpoint(ckpt)).eval()
    assert result["prompts"] == 3 and result["tokens"] == 10 and result["copy"] == 5
    example = result["example"]
    assert example["clean"][:5] == example["clean"][5:] == example["corrupted"][5:] and example["clean"][:5] in TEXT
    assert example["corrupted"][:5] in TEXT and example["corrupted"][:5] != example["clean"][:5]
    for kind in ("head", "resid", "pattern"):
        values = [r["recovery"] for r in result["rows"] if r["kind"] == kind]
        assert values == sorted(values, reverse=True) and len(values) == {"resid": 3 * 10}.get(kind, 8)
    assert json.loads((tmp_path / "o" / "patch.json").read_text())["rows"] == result["rows"]
    assert (tmp_path / "o" / "patch.png").stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "head outputs (hook_z" in printed and f"{result['rows'][0]['recovery']:+.4f}" in printed
    typed = patch(compose_cfg("patch", [f"ckpt={ckpt}", "clean=fox. the fox.", "corrupted=cat. the fox.",
                                        "metric=logit_diff", "out=null"]))
    tok_clean = torch.tensor([[" .abcdefghijklmnopqrstuvwxyz".index(c) for c in "fox. the fox."]])
    with torch.no_grad():
        assert typed["answers"][0][0] == model(tok_clean)[0, -1].argmax().item()
    assert typed["prompts"] == 1 and typed["seed"] is None


@pytest.mark.parametrize("over,needle", [
    (["clean=abc abc", "corrupted=ab ab"], "clean= is 7 tokens and corrupted= is 5: patching copies each position"),
    (["clean=abc abc"], "clean= is set but corrupted= is not: give both prompts"),
    (["clean=abc abc", "corrupted=abc abc"], "clean= and corrupted= are the same tokens"),
    (["clean=ab", "corrupted=ba"], "clean= is 2 tokens: metric=loss scores its second half"),
    (["span=9"], "span=9: the prompts are two copies, 18 tokens, more than the model's block_size=16: use span <= 8"),
])
def test_bad_prompts_are_one_line(run, over, needle):
    ckpt, text = run
    with pytest.raises(UserError) as e:
        patch(compose_cfg("patch", [f"ckpt={ckpt}", f"text={text}", "out=null", *over]))
    assert needle in one_line(e)
