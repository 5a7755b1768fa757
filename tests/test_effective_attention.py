"""Effective attention (effective_attention of variants/linear.py, gdn.py, mamba2.py): the matrix A a layer
without softmax mixes its values with. A @ v against the layer's own output at hook_z (with and without
RoPE, GQA, an output gate, the convolution, the gates and the skip; T below, at, across and not a multiple
of the chunk of 64); A against the layer's response to one-hot values (every entry measured); A against its
formula written out as loops; rows that are distributions where that holds (linear attention without
RoPE) and entropy only there; and the maps of hybrid stacks, in the PNG, the HTML's data and the viewer
in headless Chromium, with every layer labelled by its kind and the values of effective_attention."""
import base64
import dataclasses
import io
import json
import math
import re
import struct

import pytest
import torch
import torch.nn.functional as F

from attention import repeat_kv
from lab.attnstats import attention_maps, effective_stats
from lab.checkpoint import save_checkpoint
from data.tokenizer import CharTokenizer
from helpers import VOCAB, compose_cfg, variant_model



def pass_through(conv):
    """The short convolution as the identity (then only SiLU acts): the layer without its convolution."""
    conv.weight.zero_()
    conv.weight[..., -1] = 1.0


def no_gates(attn):
    """Gated DeltaNet without its gates: α = 1 (e^A = 0) and β = σ(50) = 1 in float64, the plain delta rule."""
    attn.A_log.fill_(-math.inf)
    attn.beta_proj.weight.zero_()
    attn.beta_proj.bias.fill_(50.0)


CASES = {  # name: (GPTConfig fields, a change to the layer)
    "linear-rope": ({"attn": {"kind": "linear"}}, None),
    "linear-nope": ({"attn": {"kind": "linear"}, "pos": "none"}, None),
    "linear-gqa": ({"attn": {"kind": "linear"}, "n_head": 4, "n_kv_head": 2}, None),
    "linear-gate-qknorm": ({"attn": {"kind": "linear", "gate": "head", "qk_norm": True}}, None),
    "gdn": ({"attn": {"kind": "gdn"}, "bias": True}, None),
    "gdn-no-conv": ({"attn": {"kind": "gdn"}, "bias": True}, lambda a: pass_through(a.conv)),
    "gdn-no-gates": ({"attn": {"kind": "gdn"}, "bias": True}, no_gates),
    "mamba2": ({"attn": {"kind": "mamba2"}}, None),
    "mamba2-no-conv": ({"attn": {"kind": "mamba2"}}, lambda a: pass_through(a.conv)),
    "mamba2-no-skip-no-decay": ({"attn": {"kind": "mamba2"}}, lambda a: (a.D.zero_(), a.A_log.fill_(-math.inf))),
    "mamba2-state8": ({"attn": {"kind": "mamba2", "state_dim": 8}}, None),
}


def layer(case, seed=0):
    """The attention module of a one-layer float64 model of CASES[case] (trained-looking weights), and the
    model (for its RoPE table)."""
    fields, change = CASES[case]
    model = variant_model(seed=seed, **{"block_size": 256, "n_layer": 1, "n_head": 2, "n_embd": 32, **fields}).double()
    attn = model.blocks[0].attn
    if change is not None:
        with torch.no_grad():
            change(attn)
    return attn, model


def run(attn, x, rope, values=None):
    """One forward of the attention module alone on x (B, T, C): what it read at hook_q, hook_k, hook_v and
    hook_z. values: what hook_v gives instead of the layer's own v (a forward hook that replaces it)."""
    seen, hooks = {}, []
    if values is not None:
        hooks.append(attn.hook_v.register_forward_hook(lambda m, a, out: values))
    for name in ("hook_q", "hook_k", "hook_v", "hook_z"):
        hooks.append(getattr(attn, name).register_forward_hook(lambda m, a, out, n=name: seen.__setitem__(n, out)))
    with torch.no_grad():
        attn(x, rope=rope)
    for h in hooks:
        h.remove()
    return seen


def inputs(model, T, B=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, model.config.n_embd, generator=g, dtype=torch.float64), model.rope_at(0, T)


def diff(a, b) -> str:
    d = (a - b).abs()
    return f"max diff {d.max():.2e}, mean {d.mean():.2e} (largest |value| {b.abs().max():.2e})"


# ----------------------------------------------------------------------------- A @ v is the layer's output

@pytest.mark.parametrize("T", [7, 64, 70, 130])
@pytest.mark.parametrize("case", CASES)
def test_effective_attention_times_v_is_the_layers_output_at_hook_z(case, T):
    """The output of every head before the output gate and projection (hook_z) is A @ v for the v read at
    hook_v (each query head its kv head's), and A is causal: exactly zero above the diagonal."""
    attn, model = layer(case)
    x, rope = inputs(model, T)
    seen = run(attn, x, rope)
    with torch.no_grad():
        A = attn.effective_attention(x, seen["hook_q"], seen["hook_k"], rope=rope)
    assert A.shape == (2, attn.n_head, T, T) and attn.n_head == model.config.n_head
    v = repeat_kv(seen["hook_v"].transpose(1, 2), attn.n_head)  # (B, nh, T, hs)
    z = seen["hook_z"].transpose(1, 2)
    assert torch.allclose(A @ v, z, rtol=0, atol=1e-10 * max(1.0, z.abs().max().item())), diff(A @ v, z)
    assert (A.triu(1) == 0).all(), "A has weight on a later key"


@pytest.mark.parametrize("case", ["linear-rope", "linear-gqa", "gdn", "mamba2"])
def test_every_entry_of_A_is_the_layers_response_to_a_one_hot_value(case):
    """A measured from the layer itself: with every value replaced (at hook_v) by zeros except a 1 in
    channel c at position s, head h's channel c of the output at t is A[h, t, s]. T = 70 (two chunks, the
    second ragged); ceil(T / hs) forwards measure every column."""
    attn, model = layer(case)
    T = 70
    x, rope = inputs(model, T)
    seen = run(attn, x, rope)
    v = seen["hook_v"]  # (B, T, heads, hs)
    hs = v.size(-1)
    measured = torch.zeros(2, attn.n_head, T, T, dtype=torch.float64)
    for first in range(0, T, hs):
        onehot = torch.zeros_like(v)
        cols = range(first, min(first + hs, T))
        for c, s in enumerate(cols):
            onehot[:, s, :, c] = 1.0
        z = run(attn, x, rope, values=onehot)["hook_z"]  # (B, T, nh, hs)
        for c, s in enumerate(cols):
            measured[..., s] = z[:, :, :, c].transpose(1, 2)
    with torch.no_grad():
        A = attn.effective_attention(x, seen["hook_q"], seen["hook_k"], rope=rope)
    assert torch.allclose(A, measured, rtol=0, atol=1e-10 * max(1.0, measured.abs().max().item())), diff(A, measured)


# ----------------------------------------------------------------------------- the formulas written out

def rotate_pairs(x, rope):
    """RoPE on x (B, h, T, d) by hand: each channel pair (2j, 2j+1) at position t turned by the angle whose
    cos and sin are rope[t, j]."""
    cos, sin = rope[..., 0].double(), rope[..., 1].double()  # (T, d/2)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


@pytest.mark.parametrize("case", ["linear-rope", "linear-gqa"])
def test_linear_attention_weights_written_out(case):
    """A_ij = rope(φ(q_i))·rope(φ(k_j)) / Σ_{j'≤i} φ(q_i)·φ(k_j'), φ = elu + 1, one entry at a time."""
    attn, model = layer(case)
    T = 7
    x, rope = inputs(model, T)
    seen = run(attn, x, rope)
    q = seen["hook_q"].transpose(1, 2)  # (B, nh, T, hs)
    k = seen["hook_k"].transpose(1, 2)  # (B, n_kv, T, hs)
    group = attn.n_head // attn.n_kv_head
    want = torch.zeros(2, attn.n_head, T, T, dtype=torch.float64)
    for h in range(attn.n_head):
        fq, fk = F.elu(q[:, h]) + 1, F.elu(k[:, h // group]) + 1  # (B, T, hs)
        rq, rk = rotate_pairs(fq, rope), rotate_pairs(fk, rope)
        for i in range(T):
            den = sum((fq[:, i] * fk[:, j]).sum(-1) for j in range(i + 1))
            for j in range(i + 1):
                want[:, h, i, j] = (rq[:, i] * rk[:, j]).sum(-1) / den
    with torch.no_grad():
        A = attn.effective_attention(x, seen["hook_q"], seen["hook_k"], rope=rope)
    assert torch.allclose(A, want, rtol=0, atol=1e-12), diff(A, want)


@pytest.mark.parametrize("case", ["gdn", "gdn-no-conv"])
def test_gated_deltanet_weights_are_the_unrolled_delta_rule(case):
    """A_ts = q_tᵀ α_t (I - β_t k_t k_tᵀ) ⋯ α_{s+1} (I - β_{s+1} k_{s+1} k_{s+1}ᵀ) β_s k_s as hs x hs
    matrices multiplied out, with β = σ(x W_β + b) and α = exp(-e^{A_log} softplus(x W_α + b_dt)) from the
    layer's parameters."""
    attn, model = layer(case)
    T = 7
    x, rope = inputs(model, T)
    seen = run(attn, x, rope)
    q, k = seen["hook_q"].transpose(1, 2), seen["hook_k"].transpose(1, 2)  # (B, nh, T, hs)
    beta = torch.sigmoid(x @ attn.beta_proj.weight.T + attn.beta_proj.bias).transpose(1, 2)  # (B, nh, T)
    rate = F.softplus(x @ attn.alpha_proj.weight.T + attn.dt_bias).transpose(1, 2)  # (B, nh, T)
    alpha = torch.exp(-attn.A_log.exp()[:, None] * rate)
    eye = torch.eye(q.size(-1), dtype=torch.float64)
    want = torch.zeros(2, attn.n_head, T, T, dtype=torch.float64)
    for b in range(2):
        for h in range(attn.n_head):
            for t in range(T):
                for s in range(t + 1):
                    P = eye
                    for r in range(s + 1, t + 1):  # P = M_t ⋯ M_{s+1}
                        kr = k[b, h, r][:, None]
                        P = (alpha[b, h, r] * (eye - beta[b, h, r] * kr @ kr.T)) @ P
                    want[b, h, t, s] = q[b, h, t] @ P @ (beta[b, h, s] * k[b, h, s])
    with torch.no_grad():
        A = attn.effective_attention(x, seen["hook_q"], seen["hook_k"], rope=rope)
    assert torch.allclose(A, want, rtol=0, atol=1e-12), diff(A, want)


@pytest.mark.parametrize("case", ["mamba2", "mamba2-state8"])
def test_mamba2_weights_are_the_ssd_matrix(case):
    """A_tj = exp(Σ_{j<m≤t} Δ_m a) (C_t·B_j) Δ_j + D δ_tj, a = -e^{A_log}, Δ = softplus(x W_Δ + b_Δ + b_dt)
    (the last nh outputs of in_proj), C and B read at hook_q and hook_k: the SSD paper's M = L ∘ (C Bᵀ)
    with Δ and the skip folded in, one entry at a time."""
    attn, model = layer(case)
    T = 7
    x, rope = inputs(model, T)
    seen = run(attn, x, rope)
    Cm, Bm = seen["hook_q"][:, :, 0], seen["hook_k"][:, :, 0]  # (B, T, ds)
    nh = attn.n_head
    bias = None if attn.in_proj.bias is None else attn.in_proj.bias[-nh:]
    dt = F.softplus(F.linear(x, attn.in_proj.weight[-nh:], bias) + attn.dt_bias)  # (B, T, nh)
    a = -attn.A_log.exp()
    want = torch.zeros(2, nh, T, T, dtype=torch.float64)
    for b in range(2):
        for h in range(nh):
            for t in range(T):
                for j in range(t + 1):
                    decay = math.exp(sum(dt[b, m, h].item() * a[h].item() for m in range(j + 1, t + 1)))
                    want[b, h, t, j] = decay * (Cm[b, t] @ Bm[b, j]) * dt[b, j, h] + (attn.D[h] if t == j else 0.0)
    with torch.no_grad():
        A = attn.effective_attention(x, seen["hook_q"], seen["hook_k"], rope=rope)
    assert torch.allclose(A, want, rtol=0, atol=1e-12), diff(A, want)


# ----------------------------------------------------------------------------- rows and entropy

def test_linear_attention_rows_are_distributions_and_only_they_get_an_entropy():
    """Without RoPE each row of linear attention's A is nonnegative and sums to 1, and effective_stats gives
    its entropy -Σ p ln p; with RoPE (the numerator rotated) weights can be negative and rows sum to other
    values, and Gated DeltaNet's are signed: entropy NaN, with the reason."""
    attn, model = layer("linear-nope")
    x, rope = inputs(model, 70)
    seen = run(attn, x, rope)
    with torch.no_grad():
        A = attn.effective_attention(x, seen["hook_q"], seen["hook_k"], rope=rope)
    assert (A >= 0).all() and torch.allclose(A.sum(-1), torch.ones(2, 2, 70, dtype=torch.float64), atol=1e-12)
    stats, notes = effective_stats(A)
    rows = [[-sum(p * math.log(p) for p in A[b, h, i, :i + 1].tolist() if p > 0) for i in range(70)]
            for b in range(2) for h in range(2)]
    want = torch.tensor([sum(rows[h]) + sum(rows[2 + h]) for h in range(2)]) / 140  # mean over batch and rows
    assert notes == [None, None] and torch.allclose(stats["entropy"].double(), want.double(), atol=1e-9)

    for case, why in (("linear-rope", r"signed \(min -|rows sum \d"), ("gdn", r"signed \(min -")):
        attn, model = layer(case)
        seen = run(attn, x, model.rope_at(0, 70))
        with torch.no_grad():
            A = attn.effective_attention(x, seen["hook_q"], seen["hook_k"], rope=model.rope_at(0, 70))
        stats, notes = effective_stats(A)
        assert stats["entropy"].isnan().all() and all(re.match(why, n) for n in notes), (case, notes)
        assert not stats["prev"].isnan().any()  # the weight on the previous key is still a number


# ----------------------------------------------------------------------------- hybrids in the maps

HYBRIDS = {"gdn-softmax": ["gdn", "softmax"], "linear-mamba2-softmax": ["linear", "mamba2", "softmax"]}
PROMPT = "ROMEO: But soft what light through yonder window"  # over 40 tokens: a PNG without token labels, faster


def hybrid_checkpoint(path, kinds):
    model = variant_model(vocab=len(VOCAB), block_size=64, n_layer=len(kinds), n_head=2, n_embd=32,
                          attn={"layer_kinds": kinds})
    state = {"model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
             "tokenizer": CharTokenizer(VOCAB).to_dict(), "step": 3}
    save_checkpoint(path, state)
    return model


def methods_maps(model, idx) -> dict:
    """{layer: A (nh, T, T)} of every layer without softmax: effective_attention of the input, q and k the
    layer had in a forward of idx, captured here with hooks of the test's own."""
    seen, out, hooks = {}, {}, []
    for l, block in enumerate(model.blocks):
        attn = block.attn
        if attn.softmax:
            continue
        hooks += [attn.register_forward_pre_hook(lambda m, a, kw, l=l: seen.__setitem__((l, "x"), (a[0], kw["rope"])),
                                                 with_kwargs=True),
                  attn.hook_q.register_forward_hook(lambda m, a, o, l=l: seen.__setitem__((l, "q"), o)),
                  attn.hook_k.register_forward_hook(lambda m, a, o, l=l: seen.__setitem__((l, "k"), o))]
    with torch.no_grad():
        model(idx)
        for h in hooks:
            h.remove()
        for l, block in enumerate(model.blocks):
            if not block.attn.softmax:
                x, rope = seen[(l, "x")]
                out[l] = block.attn.effective_attention(x, seen[(l, "q")], seen[(l, "k")], rope=rope)[0]
    return out


def viewer_data(html: str) -> dict:
    return json.loads(re.search(r'<script id="data" type="application/json">(.*?)</script>', html, re.S).group(1))


def unpack(data) -> torch.Tensor:
    """The viewer's maps (L, nh, T, T) decoded from its data as the page decodes them: 16-bit fixed point
    over each layer's range, lower triangles row by row."""
    L, nh, T = data["n_layer"], data["n_head"], len(data["tokens"])
    raw = base64.b64decode(data["weights"])
    u = torch.tensor(struct.unpack(f"<{len(raw) // 2}H", raw), dtype=torch.float64).view(L, nh, -1) / 65535
    lo, hi = torch.tensor(data["ranges"], dtype=torch.float64).view(L, 1, 2, 1).unbind(2)
    maps = torch.zeros(L, nh, T, T, dtype=torch.float64)
    rows, cols = torch.tril_indices(T, T)
    maps[..., rows, cols] = lo + (hi - lo) * u
    return maps


@pytest.mark.parametrize("hybrid", HYBRIDS)
def test_visualize_maps_every_layer_of_a_hybrid_labelled_with_its_kind(tmp_path, hybrid):
    """tools/visualize.py on a hybrid: the PNG and the HTML exist, the PNG's metadata and the viewer's data
    name each layer's kind, and the maps the viewer carries are effective_attention's values for the layers
    without softmax (within the 16-bit packing) and the softmax weights for the others; stdout's top keys
    say the kind."""
    from tools.visualize import visualize
    kinds = HYBRIDS[hybrid]
    model = hybrid_checkpoint(tmp_path / "run" / "best.pt", kinds)
    cfg = compose_cfg("visualize", [f"ckpt={tmp_path / 'run'}", f"prompt={PROMPT}", "top_k=2",
                                    f"out={tmp_path / 'maps'}", "device=cpu"])
    out = io.StringIO()
    views = visualize(cfg, out=out)
    png, html = tmp_path / "maps" / "attention.png", tmp_path / "maps" / "attention.html"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and html.exists()
    import PIL.Image
    assert PIL.Image.open(png).text["Layers"] == ", ".join(f"L{l} {k}" for l, k in enumerate(kinds))

    data = viewer_data(html.read_text(encoding="utf-8"))
    assert data["kinds"] == kinds and all(data["weighted"])
    assert data["effective"] == [k != "softmax" for k in kinds]
    idx = torch.as_tensor(CharTokenizer(VOCAB).encode(PROMPT))[None]
    shown, softmax = unpack(data), attention_maps(model, idx)[0].double()
    for l, A in methods_maps(model, idx).items():
        lo, hi = data["ranges"][l]
        assert torch.allclose(shown[l], A.double(), rtol=0, atol=(hi - lo) / 65535 + 1e-6), (l, diff(shown[l], A))
        assert torch.allclose(views["maps"][l].double(), A.double(), atol=1e-6)
    for l, kind in enumerate(kinds):
        if kind == "softmax":
            assert torch.allclose(shown[l], softmax[l], rtol=0, atol=1e-5), diff(shown[l], softmax[l])
    lines = out.getvalue().splitlines()[1:]
    heads = [line.split("  ")[0] for line in lines]
    tags = ["" if k == "softmax" else f" ({k})" for k in kinds]
    assert heads == [f"L{l} H{h}{tags[l]}" for l in range(len(kinds)) for h in range(2)]
    for l, A in methods_maps(model, idx).items():  # the keys of largest |A| for the last query, largest first
        for h in range(2):
            got = [int(j) for j in re.findall(r"@(\d+)", lines[2 * l + h])]
            assert got == A[h, -1].abs().topk(2).indices.tolist(), lines[2 * l + h]


def test_viewer_shows_effective_attention_in_headless_chromium(tmp_path, chromium):
    """The viewer of a [gdn, softmax] stack in a real browser: the layer menu names every layer's kind, the
    gdn layer's panel says it shows effective attention, its numbers are A's row of the query (nearest key
    first), its entropy is n/a with the reason, its map is drawn, and its top key is the largest |A|."""
    from lab.plots import write_views
    model = variant_model(vocab=len(VOCAB), block_size=64, n_layer=2, n_head=2, n_embd=32,
                          attn={"layer_kinds": ["gdn", "softmax"]})
    tok = CharTokenizer(VOCAB)
    idx = torch.as_tensor(tok.encode("ROMEO: But soft, what light"))[None]
    views = write_views(model, idx, tok, tmp_path, title="hybrid")
    A = methods_maps(model, idx)[0]  # (nh, T, T)
    top = A[0, 6, :7].abs().argmax()
    assert A[0, 6, top] < 0, "pick a query whose largest |A| is negative: a sort by value would miss it"
    dom = chromium(str(tmp_path / "profile"), "--dump-dom", views["html"].resolve().as_uri() + "#L0H0q6")
    assert 'data-ready="1"' in dom, "the script did not run to its end"
    assert '<option value="0">L0 (gdn)</option>' in dom and '<option value="1">L1 (softmax)</option>' in dom
    assert "L0 H0 gdn: effective attention A, output = A·v" in dom
    weights = [float(w) for w in re.findall(r'<td class="w"[^>]*>(-?[0-9.]+)</td>', dom)]
    assert weights == pytest.approx(A[0, 6, :7].flip(0).tolist(), abs=2e-4)
    assert "entropy n/a: signed (min -" in dom and "<canvas" in dom
    first = re.search(r'id="topline"[^>]*>H0: (-?[0-9.]+) “.”@(\d+)', dom)  # the largest |A| of the row first
    assert int(first.group(2)) == top.item() and float(first.group(1)) < 0, first.group(0)
