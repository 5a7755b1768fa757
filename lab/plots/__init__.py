"""Every figure attnlab draws, from metrics.jsonl files and attention weights (no W&B needed):
one run's curves, several runs compared (tools/report.py), and the attention maps of one text as a
PNG grid of heatmaps and a self-contained HTML viewer (train.py at the end of a run, tools/visualize.py).

The maps come from attnstats.layer_maps (the model's own q and k through its hook points, one
reference softmax; for a layer without softmax its effective attention, the matrix A with y = A v),
never from a second implementation of the model. Weights in [0, 1] are drawn in viridis at
square-root scale; a signed matrix (Gated DeltaNet, Mamba-2, linear attention with RoPE) in a
diverging map, blue below zero and red above, at signed square-root scale over ±max|A| of its layer.
The viewer is viewer.html with its data filled in inline (no network, no CDN; it opens from disk in
any browser): each layer's map travels as 16-bit fixed point over its range (weights: [0, 1], w *
65535, error below 1e-5) of the lower triangle only, base64 encoded; 36 heads x 256 tokens is about
3 MB.
"""
import base64
import json
from pathlib import Path

import matplotlib
import numpy as np
import torch

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from lab.attnstats import entropy_grid, head_keys, layer_keys, layer_kinds, layer_maps  # noqa: E402
from lab.tracking import read_metrics  # noqa: E402

VIEWER = Path(__file__).with_name("viewer.html")  # the viewer's page; write_html fills in the data


def save_figure(fig, path):
    """Write a figure as a PNG (its folder made if missing) and free it (pyplot keeps every open figure alive)."""
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def series(metrics, key, require=None):
    """(steps, values) of `key` over the lines that have it (and `require`, if given)."""
    rows = [m for m in metrics if key in m and (require is None or require in m)]
    return [m["step"] for m in rows], [m[key] for m in rows]


def plot_run(run_dir) -> list:
    """loss.png (train and val loss vs step) and, if probed, attn_entropy.png in the run dir."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir)
    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    steps, train = series([m for m in metrics if "val/loss" not in m], "train/loss")
    ax.plot(steps, train, lw=1, alpha=0.6, label="train (batch)")
    steps, val = series(metrics, "val/loss")
    ax.plot(steps, val, "o-", label="val")
    steps, train_eval = series(metrics, "train/loss", require="val/loss")
    ax.plot(steps, train_eval, "s--", label="train (eval batches)")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=f"loss: {run_dir.name}")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, run_dir / "loss.png")
    written.append(run_dir / "loss.png")

    probes = [m for m in metrics if "attn_entropy/mean" in m]
    if probes:
        path = run_dir / "attn_entropy.png"
        plot_attention(probes, path, title=run_dir.name)
        written.append(path)
    if any("attn_prev/L0" in m for m in probes):
        path = run_dir / "attn_heads.png"
        plot_head_roles(probes, path, title=run_dir.name)
        written.append(path)
    return written


def plot_attention(probes, path, title=""):
    """Left: mean entropy per layer vs step. Right: layer x head entropy at the last probe."""
    fig, (ax, hx) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for l, key in layer_keys(probes, "entropy"):
        steps, values = series(probes, key)
        ax.plot(steps, values, "o-", ms=3, label=f"layer {l}")
    ax.set(xlabel="step", ylabel="attention entropy (nats, mean over heads)", title=f"attention entropy: {title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    grid = entropy_grid(probes[-1])
    im = hx.imshow(grid, cmap="viridis", aspect="auto")
    hx.set(xlabel="head", ylabel="layer", title=f"entropy (nats) at step {probes[-1]['step']}",
           xticks=range(len(grid[0])), yticks=range(len(grid)))
    fig.colorbar(im, ax=hx)
    save_figure(fig, path)
    return path


HEAD_ROLES = [("induction", "induction score: weight on t-n+1 (a text span, twice)"),
              ("prev", "weight on the previous token"), ("first", "weight on the first token (sink)"),
              ("self", "weight on the query itself"), ("dist", "mean attention distance (tokens)")]


def plot_head_roles(probes, path, title=""):
    """What each head does, vs step: the induction score per head and the in-context gain (loss on
    a text span's first copy minus its second), then the weight each head puts on the previous
    token, the first token and itself, and its mean attention distance. One line per head, one
    colour per layer; the heads that end highest are named."""
    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    colors = plt.cm.tab10.colors
    gain_ax, panels = axes[0][1], [axes[0][0]] + list(axes[0][2:]) + list(axes[1])
    for ax, (name, label) in zip(panels, HEAD_ROLES):
        keys = head_keys(probes, name)
        finals = []
        for l, h, key in keys:
            steps, values = series(probes, key)
            ax.plot(steps, values, "-", lw=1.2, color=colors[l % 10], alpha=0.85, label=f"layer {l}" if h == 0 else None)
            finals.append((values[-1], l, h, steps[-1]))
        for v, l, h, step in sorted(finals, reverse=True)[:2 if name != "dist" else 0]:
            ax.annotate(f"L{l}H{h}", (step, v), fontsize=7, xytext=(3, 0), textcoords="offset points")
        ax.set(xlabel="step", title=label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if not keys:
            ax.text(0.5, 0.5, "not measured", ha="center", transform=ax.transAxes, color="grey")
    panels[0].legend(fontsize=7)
    for key, style, label in (("incontext/gain", "o-", "gain (first - second)"),
                              ("incontext/loss_first", "--", "loss on the first copy"),
                              ("incontext/loss_second", ":", "loss on the second copy")):
        steps, values = series(probes, key)
        if steps:
            gain_ax.plot(steps, values, style, ms=3, label=label)
    gain_ax.axhline(0, color="grey", lw=0.8)
    gain_ax.set(xlabel="step", ylabel="nats/token", title="in-context gain on a text span seen twice")
    gain_ax.grid(alpha=0.3)
    gain_ax.legend(fontsize=7)
    fig.suptitle(f"what the heads do: {title}" if title else "what the heads do", fontsize=11)
    save_figure(fig, path)
    return path


def plot_head_roles_compare(rows, path):
    """Several runs: the strongest induction head, the in-context gain, and the largest
    previous-token and first-token weight of any head, vs step (report.py)."""
    panels = [("induction", "largest induction score of any head"), ("gain", "in-context gain (nats/token)"),
              ("prev", "largest previous-token weight of any head"), ("first", "largest first-token (sink) weight of any head")]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.5))
    colors = plt.cm.tab10.colors
    for ax, (name, title) in zip(axes, panels):
        for i, r in enumerate(rows):
            probes = [m for m in r["metrics"] if "attn_entropy/mean" in m]
            if name == "gain":
                steps, values = series(probes, "incontext/gain")
            else:
                keys = [k for _, _, k in head_keys(probes, name)]
                lines = [m for m in probes if keys and all(k in m for k in keys)]
                steps, values = [m["step"] for m in lines], [max(m[k] for k in keys) for m in lines]
            ax.plot(steps, values, "o-", ms=3, color=colors[i % 10], label=r["run"])
        ax.set(xlabel="step", title=title)
        if name != "gain":
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    save_figure(fig, path)
    return path


def plot_bands(lines, path, panels, reference=None, xlabel="step", xscale="linear"):
    """Curves with bands, one panel per (title, ylabel): lines [(label, panel index, x, mean, lo,
    hi)], lo/hi None where no interval exists (one run). reference: a y value drawn as a grey line."""
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5), squeeze=False)
    colors = {}
    for label, panel, steps, mean, lo, hi in lines:
        color = colors.setdefault(label, plt.cm.tab10.colors[len(colors) % 10])
        ax = axes[0][panel]
        ax.plot(steps, mean, "o-", ms=3, color=color, label=label)
        if lo is not None:
            ax.fill_between(steps, lo, hi, color=color, alpha=0.2, lw=0)
    for ax, (title, ylabel) in zip(axes[0], panels):
        if reference is not None:
            ax.axhline(reference, color="grey", lw=0.8)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=title, xscale=xscale)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return save_figure(fig, path)


# ----------------------------------------------------------------------------- attention maps of one text

LABEL_TOKENS = 40  # the PNG labels its axes with the tokens up to this prompt length
VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}


def token_pieces(tok, ids) -> list:
    """The text of each token on its own. A byte-level BPE token can be part of a UTF-8
    character: its stray bytes are shown as \\xNN rather than as one replacement character."""
    enc, bos = getattr(tok, "enc", None), getattr(tok, "bos", None)  # a tiktoken encoding; data.bos's token
    if enc is None:
        return ["<bos>" if i == bos else tok.decode([i]) for i in ids]
    return ["<bos>" if i == bos else enc.decode_single_token_bytes(int(i)).decode("utf-8", errors="backslashreplace")
            for i in ids]


def label(piece: str) -> str:
    """A token's text with whitespace and control characters made visible: ␣ ↵ ⇥, \\x07."""
    out = []
    for c in piece:
        if c in VISIBLE:
            out.append(VISIBLE[c])
        elif not c.isprintable():
            out.append(repr(c)[1:-1])
        else:
            out.append(c)
    return "".join(out) or "∅"


def top_keys(maps, query: int, k: int) -> list:
    """For each layer and head, the k keys the query gives most weight (largest |weight|: a signed
    effective attention's negative weights count): [[(weight, j), ...]] (L, nh)."""
    weights = maps[:, :, query, : query + 1]  # (L, nh, query + 1)
    index = weights.abs().topk(min(k, query + 1), dim=-1).indices
    values = weights.gather(-1, index)
    return [[list(zip(values[l, h].tolist(), index[l, h].tolist())) for h in range(maps.size(1))]
            for l in range(maps.size(0))]


def format_top_keys(maps, labels, query: int, k: int, kinds=None, effective=None) -> str:
    """The lines visualize.py prints: one per head, its top-k keys as weight 'token'@position, a layer
    drawn as its effective attention (effective: a flag per layer) its kind after the head, a layer
    with no map one line that says so."""
    lines = [f"query {query} {labels[query]!r} (of {len(labels)} tokens): top {min(k, query + 1)} keys per head"]
    for l, heads in enumerate(top_keys(maps, query, k)):
        if torch.isnan(maps[l]).all():
            lines.append(f"L{l}  {kinds[l] if kinds else ''} attention: no softmax weights")
            continue
        kind = f" ({kinds[l]})" if kinds and effective and effective[l] else ""
        for h, keys in enumerate(heads):
            lines.append(f"L{l} H{h}{kind}  " + "  ".join(f"{w:.3f} {labels[j]!r}@{j}" for w, j in keys))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- PNG

def layer_labels(model) -> list:
    """What each layer is, for the maps: its kind (attnstats.layer_kinds) and for the kinds of softmax
    attention what narrows it: "softmax", "softmax, window 64", "softmax, moba", "mla (softmax)";
    a kind without softmax (drawn as its effective attention, y = A v) by its name alone."""
    from variants import SELECTS
    selects = {cls: name for name, cls in SELECTS.items() if cls is not None}
    out = []
    for kind, block in zip(layer_kinds(model), model.blocks):
        attn = block.attn
        if not attn.softmax:
            out.append(kind)
            continue
        parts = ["softmax" if kind == "softmax" else f"{kind} (softmax)"]
        if getattr(attn, "window", None) is not None:
            parts.append(f"window {attn.window}")
        if getattr(attn, "select", None) is not None:
            parts.append(selects.get(type(attn.select), type(attn.select).__name__))
        out.append(", ".join(parts))
    return out


def value_range(layer_map, tol: float = 1e-4):
    """(lo, hi) a layer's map (nh, T, T) is drawn and packed over: (0, 1) when every value is a weight
    in [0, 1] (softmax, linear attention without RoPE) or the map is NaN (no map), else (-m, m) for a
    signed or larger matrix, m its largest |value|."""
    finite = layer_map[~layer_map.isnan()]
    if finite.numel() == 0 or (finite.min() >= -tol and finite.max() <= 1 + tol):
        return 0.0, 1.0
    m = finite.abs().max().item()
    return -m, m


def entropy_text(stats, notes, l: int, h: int) -> str:
    """A head's entropy as the maps show it, or n/a and why (attnstats.effective_stats' note)."""
    note = notes[l][h] if notes else None
    return f"entropy n/a: {note}" if note else f"entropy {stats['entropy'][l, h]:.2f}"


def write_png(maps, stats, labels, path, title="", kinds=None, notes=None, effective=None):
    """A layer x head grid of heatmaps (query rows, key columns; above the diagonal, which no query
    may see, in grey), each titled with its layer's kind (kinds: one label per layer) and its head's
    mean entropy or why it has none (notes, as attnstats.layer_maps gives them); token labels when
    short. Weights in [0, 1] share one viridis scale; a signed layer (value_range) has its own diverging
    one. A layer with no map (NaN) says so. The layers' kinds are also in the PNG's metadata (Layers)."""
    from matplotlib.colors import FuncNorm, PowerNorm
    L, nh, T, _ = maps.shape
    labelled = T <= LABEL_TOKENS
    size = 2.0 + 0.07 * T if labelled else 2.1  # inches a panel: room for each token's label
    font = 8 if T <= 24 else 7
    fig, axes = plt.subplots(L, nh, figsize=(size * nh + 1.2, size * L + 0.8), squeeze=False,
                             layout="constrained")
    kinds = kinds or ["softmax"] * L
    masked = maps.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("nan")).numpy()
    weights_cmap = plt.get_cmap("viridis").with_extremes(bad="#e6e6e6")  # grey: keys no query may see
    signed_cmap = plt.get_cmap("RdBu_r").with_extremes(bad="#e6e6e6")  # blue < 0 < red, white at 0
    signed_sqrt = (lambda x: np.sign(x) * np.sqrt(np.abs(x)), lambda y: np.sign(y) * y ** 2)
    ranges = [value_range(maps[l]) for l in range(L)]
    shared = all(r == (0.0, 1.0) for r in ranges)  # one colour bar for all, else one per layer
    for l in range(L):
        lo, hi = ranges[l]
        if (lo, hi) == (0.0, 1.0):  # small weights stay visible; one scale for all weights
            cmap, norm, bar = weights_cmap, PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0), "weight (square-root scale)"
        else:
            cmap, norm, bar = signed_cmap, FuncNorm(signed_sqrt, vmin=lo, vmax=hi), "A (signed square-root scale)"
        for h in range(nh):
            ax = axes[l][h]
            im = ax.imshow(masked[l, h], cmap=cmap, norm=norm, interpolation="nearest")
            what = f"{kinds[l]}, effective" if effective and effective[l] else kinds[l]
            ax.set_title(f"L{l} H{h} {what}\n{entropy_text(stats, notes, l, h)}", fontsize=7)
            if torch.isnan(maps[l, h]).all():  # a kind with no map
                ax.set_title(f"L{l} H{h}  {kinds[l]}", fontsize=8)
                ax.text(0.5, 0.5, "no softmax weights", transform=ax.transAxes, ha="center", va="center", fontsize=8)
            # the tokens along the outer panels' axes only (every panel's are the same; ticks on all of them
            # took more than a second to draw for a small model's grid)
            ticks = range(T)
            if labelled and l == L - 1:
                ax.set_xticks(ticks, [labels[j] for j in ticks], fontsize=font, rotation=90, family="monospace")
            else:
                ax.set_xticks([])
            if labelled and h == 0:
                ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=font, family="monospace")
            else:
                ax.set_yticks([])
            if l == L - 1:
                ax.set_xlabel("key", fontsize=7)
            if h == 0:
                ax.set_ylabel("query", fontsize=7)
        if not shared:
            fig.colorbar(im, ax=list(axes[l]), shrink=0.9, label=bar)
    fig.suptitle(title or "attention weights", fontsize=10)
    if shared:
        fig.colorbar(im, ax=axes, shrink=min(0.6, 1.5 / L + 0.2), label="weight (square-root scale)")
    fig.savefig(path, dpi=100 if labelled else 80,
                metadata={"Layers": ", ".join(f"L{l} {kind}" for l, kind in enumerate(kinds))})
    plt.close(fig)
    return Path(path)


# ----------------------------------------------------------------------------- HTML

def pack_weights(maps, ranges=None) -> str:
    """The lower triangles of maps (L, nh, T, T), row by row, as base64 little-endian uint16 (w - lo) /
    (hi - lo) * 65535 over each layer's range (lo, hi) in ranges (default (0, 1): w * 65535)."""
    T = maps.size(-1)
    rows, cols = torch.tril_indices(T, T)  # row-major: (0,0), (1,0), (1,1), (2,0), ...
    lo, hi = torch.tensor(ranges or [(0.0, 1.0)] * maps.size(0), dtype=torch.float64).view(-1, 1, 1, 2).unbind(-1)
    unit = (maps[..., rows, cols].double().nan_to_num(0.0) - lo) / (hi - lo)
    fixed = (unit * 65535).round().clamp(0, 65535).to(torch.int32).numpy()
    return base64.b64encode(fixed.astype("<u2").tobytes()).decode("ascii")


def write_html(maps, stats, pieces, path, title="", meta="", query=None, kinds=None, notes=None, effective=None):
    """The viewer: attention.html, the page viewer.html with the data inline. kinds: each layer's
    label (the viewer names it; layer_labels); notes: why a head has no entropy (layer_maps')."""
    L, nh, T, _ = maps.shape
    weighted = [l for l in range(L) if not torch.isnan(maps[l]).all()]
    ranges = [value_range(maps[l]) for l in range(L)]
    kinds = kinds or ["softmax"] * L
    data = {"title": title or "attention", "meta": meta, "n_layer": L, "n_head": nh,
            "tokens": [{"text": p, "label": label(p)} for p in pieces],
            "weights": pack_weights(maps, ranges), "ranges": ranges, "kinds": kinds,
            "effective": list(effective or [False] * L), "notes": notes or [[None] * nh] * L,
            "weighted": [l in weighted for l in range(L)],
            "stats": {name: [[None if v != v else round(float(v), 4) for v in row] for row in t.tolist()]
                      for name, t in stats.items()},  # NaN (no weights) as null: JSON has no NaN
            "initial": {"layer": weighted[-1] if weighted else L - 1, "head": 0, "query": T - 1 if query is None else query}}
    blob = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")  # no "</script>" or "<!--" in the script
    html = VIEWER.read_text(encoding="utf-8").replace("__DATA__", blob, 1).replace("__TITLE__", _escape(data["title"]), 1)
    Path(path).write_text(html, encoding="utf-8")
    return Path(path)


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_views(model, idx, tok, out_dir, title="", meta="", query=None) -> dict:
    """attention.png and attention.html for the token ids idx (1, T) in out_dir; returns their paths,
    the weights (L, nh, T, T) (a layer without softmax: its effective attention), the statistics, the
    notes on entropy, the token labels, the layers' kinds and their labels (layer_labels)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    maps, stats, notes = layer_maps(model, idx)
    ids = idx[0].tolist()
    pieces = token_pieces(tok, ids)
    labels = [label(p) for p in pieces]
    kinds, described = layer_kinds(model), layer_labels(model)
    effective = [not block.attn.softmax for block in model.blocks]  # drawn as its effective attention A
    png = write_png(maps, stats, labels, out_dir / "attention.png", title, described, notes, effective)
    html = write_html(maps, stats, pieces, out_dir / "attention.html", title, meta, query, described, notes, effective)
    return {"png": png, "html": html, "maps": maps, "stats": stats, "notes": notes, "labels": labels,
            "kinds": kinds, "described": described, "effective": effective}
