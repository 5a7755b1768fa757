"""Attention maps of one text, for people: a PNG grid of heatmaps and a self-contained HTML viewer.

The weights come from attnstats.attention_maps (the model's own q and k through its probe hook, one
reference softmax), never from a second implementation of the model. visualize.py writes them for
any prompt; train.py writes them for the probe text at the end of a run.

The HTML file holds its data and script inline (no network, no CDN; it opens from disk in any
browser). The weights travel as 16-bit fixed point (w * 65535, error below 1e-5) of the lower
triangle only, base64 encoded: 36 heads x 256 tokens is about 3 MB.
"""
import base64
import json
from pathlib import Path

import torch

from attnstats import attention_maps

LABEL_TOKENS = 40  # the PNG labels its axes with the tokens up to this prompt length
VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍"}


# ----------------------------------------------------------------------------- tokens

def token_pieces(tok, ids) -> list:
    """The text of each token on its own. A byte-level BPE token can be part of a UTF-8
    character: its stray bytes are shown as \\xNN rather than as one replacement character."""
    enc = getattr(tok, "enc", None)  # a tiktoken encoding
    if enc is None:
        return [tok.decode([i]) for i in ids]
    return [enc.decode_single_token_bytes(int(i)).decode("utf-8", errors="backslashreplace") for i in ids]


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
    """For each layer and head, the k keys the query gives most weight: [[(weight, j), ...]] (L, nh)."""
    weights = maps[:, :, query, : query + 1]  # (L, nh, query + 1)
    values, index = weights.topk(min(k, query + 1), dim=-1)
    return [[list(zip(values[l, h].tolist(), index[l, h].tolist())) for h in range(maps.size(1))]
            for l in range(maps.size(0))]


def format_top_keys(maps, labels, query: int, k: int) -> str:
    """The lines visualize.py prints: one per head, its top-k keys as weight 'token'@position."""
    lines = [f"query {query} {labels[query]!r} (of {len(labels)} tokens): top {min(k, query + 1)} keys per head"]
    for l, heads in enumerate(top_keys(maps, query, k)):
        for h, keys in enumerate(heads):
            lines.append(f"L{l} H{h}  " + "  ".join(f"{w:.3f} {labels[j]!r}@{j}" for w, j in keys))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- PNG

def write_png(maps, stats, labels, path, title=""):
    """A layer x head grid of heatmaps (query rows, key columns; above the diagonal, which no query
    may see, in grey), each titled with its head's mean entropy; token labels when short."""
    from matplotlib.colors import PowerNorm

    from plots import plt

    L, nh, T, _ = maps.shape
    labelled = T <= LABEL_TOKENS
    size = 2.0 + 0.07 * T if labelled else 2.1  # inches a panel: room for each token's label
    font = 8 if T <= 24 else 7
    fig, axes = plt.subplots(L, nh, figsize=(size * nh + 1.2, size * L + 0.6), squeeze=False,
                             layout="constrained")
    cmap = plt.get_cmap("viridis").with_extremes(bad="#e6e6e6")  # grey: keys no query may see
    masked = maps.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("nan")).numpy()
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)  # small weights stay visible; one scale for all
    for l in range(L):
        for h in range(nh):
            ax = axes[l][h]
            im = ax.imshow(masked[l, h], cmap=cmap, norm=norm, interpolation="nearest")
            ax.set_title(f"L{l} H{h}  entropy {stats['entropy'][l, h]:.2f}", fontsize=8)
            if labelled:
                ticks = range(T)
                ax.set_xticks(ticks, [labels[j] for j in ticks], fontsize=font, rotation=90, family="monospace")
                ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=font, family="monospace")
            else:
                ax.set_xticks([])
                ax.set_yticks([])
            if l == L - 1:
                ax.set_xlabel("key", fontsize=7)
            if h == 0:
                ax.set_ylabel("query", fontsize=7)
    fig.suptitle(title or "attention weights", fontsize=10)
    fig.colorbar(im, ax=axes, shrink=min(0.6, 1.5 / L + 0.2), label="weight (square-root scale)")
    fig.savefig(path, dpi=100 if labelled else 80)
    plt.close(fig)
    return Path(path)


# ----------------------------------------------------------------------------- HTML

def pack_weights(maps) -> str:
    """The lower triangles of maps (L, nh, T, T), row by row, as base64 little-endian uint16 w * 65535."""
    T = maps.size(-1)
    rows, cols = torch.tril_indices(T, T)  # row-major: (0,0), (1,0), (1,1), (2,0), ...
    fixed = (maps[..., rows, cols].double() * 65535).round().clamp(0, 65535).to(torch.int32).numpy()
    return base64.b64encode(fixed.astype("<u2").tobytes()).decode("ascii")


def write_html(maps, stats, pieces, path, title="", meta="", query=None):
    """The viewer: attention.html with data and script inline (see HTML below)."""
    L, nh, T, _ = maps.shape
    data = {"title": title or "attention", "meta": meta, "n_layer": L, "n_head": nh,
            "tokens": [{"text": p, "label": label(p)} for p in pieces],
            "weights": pack_weights(maps),
            "stats": {name: [[round(float(v), 4) for v in row] for row in t.tolist()] for name, t in stats.items()},
            "initial": {"layer": L - 1, "head": 0, "query": T - 1 if query is None else query}}
    blob = json.dumps(data, ensure_ascii=False).replace("<", "\\u003c")  # no "</script>" or "<!--" in the script
    html = HTML.replace("__DATA__", blob, 1).replace("__TITLE__", _escape(data["title"]), 1)
    Path(path).write_text(html, encoding="utf-8")
    return Path(path)


def _escape(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_views(model, idx, tok, out_dir, title="", meta="", query=None) -> dict:
    """attention.png and attention.html for the token ids idx (1, T) in out_dir; returns their paths,
    the weights (L, nh, T, T), the statistics and the token labels."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    maps, stats = attention_maps(model, idx)
    ids = idx[0].tolist()
    pieces = token_pieces(tok, ids)
    labels = [label(p) for p in pieces]
    png = write_png(maps, stats, labels, out_dir / "attention.png", title)
    html = write_html(maps, stats, pieces, out_dir / "attention.html", title, meta, query)
    return {"png": png, "html": html, "maps": maps, "stats": stats, "labels": labels}


HTML = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>__TITLE__</title>
<style>
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:16px 20px;color:#222;background:#fff}
h1{font-size:18px;margin:0 0 2px}
h2{font-size:15px;margin:18px 0 6px}
.meta{color:#666;margin-bottom:10px}
.controls{display:flex;gap:14px;align-items:center;flex-wrap:wrap;margin:6px 0 10px}
.hint{color:#888;font-size:12px}
#views{display:flex;flex-wrap:wrap;gap:14px}
.panel{border:1px solid #ddd;border-radius:4px;padding:6px 8px;flex:1 1 560px;max-width:100%;box-sizing:border-box}
.pbody{display:flex;gap:12px;align-items:flex-start}
.panel h3{font-size:13px;margin:0 0 4px;font-weight:600}
.panel h3 span{font-weight:400;color:#666}
.text{position:relative;flex:1 1 auto;font:15px/2 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;white-space:pre-wrap;word-break:break-all;max-height:300px;overflow:auto}
.tok{border-radius:2px;cursor:pointer;box-shadow:inset 0 0 0 1px #ececec}
.tok.q{outline:2px solid #c00;outline-offset:0}
.tok.later{color:#c4c4c4}
.ws{color:#aaa}
canvas{border:1px solid #ccc;cursor:crosshair;width:260px;flex:0 0 260px;display:block}
.below{display:flex;gap:28px;flex-wrap:wrap;align-items:flex-start}
.below>div{flex:0 1 auto}
table{border-collapse:collapse;margin-top:4px}
td,th{border:1px solid #ddd;padding:2px 7px;font:12px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;text-align:right}
th{background:#f6f6f6;font-weight:600}
#numbers{max-height:420px;overflow:auto;display:inline-block}
td.tk{text-align:left;white-space:pre}
.cell,.rowhead{cursor:pointer}
.cell.sel{outline:2px solid #c00;outline-offset:-2px}
.cell small{display:block;color:#555;font-size:10px;line-height:1.3}
.cell b{font-size:13px}
</style></head>
<body>
<h1 id="title"></h1>
<div class="meta" id="meta"></div>
<div class="controls">
  <label>layer <select id="layer"></select></label>
  <label>head <select id="head"></select></label>
  <span id="qinfo"></span>
  <span class="hint">hover a token to see where it looks (earlier tokens shaded by weight); click to pin it, click again to release; &larr; &rarr; move the query</span>
</div>
<div id="views"></div>
<div class="below">
<div><h2>Weights of the selected query</h2>
<div id="topline" class="meta"></div>
<div id="numbers"></div></div>
<div><h2>Head statistics for this text</h2>
<div class="controls"><label>colour by <select id="metric"></select></label></div>
<div class="hint">means over queries i &ge; 1: prev = weight on token i&minus;1, first = on token 0 (a sink),<br>self = on token i, dist = &Sigma;<sub>j</sub> p<sub>ij</sub>(i&minus;j) in tokens. Click a cell to view that head,<br>a layer name for all its heads.</div>
<table id="stats"></table></div>
</div>
<script id="data" type="application/json">__DATA__</script>
<script>
"use strict";
const D = JSON.parse(document.getElementById("data").textContent);
const L = D.n_layer, H = D.n_head, T = D.tokens.length, TRI = T * (T + 1) / 2;
const bin = atob(D.weights), bytes = new Uint8Array(bin.length);
for (let i = 0; i < bin.length; i++) bytes[i] = bin.charCodeAt(i);
const words = new DataView(bytes.buffer);
function weight(l, h, i, j) { return words.getUint16(2 * ((l * H + h) * TRI + i * (i + 1) / 2 + j), true) / 65535; }
function row(l, h, i) { const r = new Float64Array(i + 1); for (let j = 0; j <= i; j++) r[j] = weight(l, h, i, j); return r; }
const METRICS = [["entropy", "entropy (nats)"], ["prev", "prev"], ["first", "first (sink)"], ["self", "self"], ["dist", "dist (tokens)"]];
const $ = id => document.getElementById(id);
const el = (tag, cls, text) => { const e = document.createElement(tag); if (cls) e.className = cls; if (text !== undefined) e.textContent = text; return e; };
const fmt = (v, d) => v.toFixed(d === undefined ? 3 : d);

// viridis at square-root scale, the PNG's colours
const VIR = [[68,1,84],[72,40,120],[62,74,137],[49,104,142],[38,130,142],[31,158,137],[53,183,121],[109,205,89],[180,222,44],[253,231,37]];
function color(w) {
  const x = Math.sqrt(Math.max(0, Math.min(1, w))) * (VIR.length - 1), i = Math.min(VIR.length - 2, Math.floor(x)), f = x - i;
  return VIR[i].map((c, k) => Math.round(c + f * (VIR[i + 1][k] - c)));
}
const shade = w => "rgba(255,120,0," + fmt(Math.sqrt(w), 3) + ")";

const state = {layer: D.initial.layer, head: D.initial.head, query: D.initial.query, pinned: false};
(function readHash() {  // #L1H2q14 or #L1Hallq14: a view to link to
  const m = /^#L(\d+)H(\d+|all)q(\d+)$/.exec(location.hash);
  if (!m) return;
  state.layer = Math.min(L - 1, +m[1]); state.head = m[2] === "all" ? "all" : Math.min(H - 1, +m[2]);
  state.query = Math.min(T - 1, +m[3]); state.pinned = true;
})();
const heads = () => state.head === "all" ? [...Array(H).keys()] : [state.head];

$("title").textContent = D.title;
$("meta").textContent = (D.meta || `${L} layers × ${H} heads`) + ` · ${T} tokens`;
for (let l = 0; l < L; l++) $("layer").append(new Option("L" + l, l));
for (let h = 0; h < H; h++) $("head").append(new Option("H" + h, h));
$("head").append(new Option("all heads", "all"));
for (const [k, name] of METRICS) $("metric").append(new Option(name, k));
$("layer").onchange = e => { state.layer = +e.target.value; build(); };
$("head").onchange = e => { state.head = e.target.value === "all" ? "all" : +e.target.value; build(); };
$("metric").onchange = () => buildStats();

function tokenSpan(t, i) {
  const s = el("span", "tok");
  s.dataset.i = i;
  if (t.text === "\n") { s.append(el("span", "ws", "↵")); s.append("\n"); }
  else if (/^\s+$/.test(t.text)) s.append(el("span", "ws", t.label));
  else s.textContent = t.text;
  return s;
}

function build() {  // the panels of the selected layer and head(s)
  $("layer").value = state.layer; $("head").value = state.head;
  const views = $("views");
  views.replaceChildren();
  for (const h of heads()) {
    const p = el("div", "panel");
    p.dataset.head = h;
    const h3 = el("h3", "", `L${state.layer} H${h} `);
    const s = k => D.stats[k][state.layer][h];
    h3.append(el("span", "", `entropy ${fmt(s("entropy"), 2)} · prev ${fmt(s("prev"), 2)} · first ${fmt(s("first"), 2)} · self ${fmt(s("self"), 2)} · dist ${fmt(s("dist"), 1)}`));
    p.append(h3);
    const body = el("div", "pbody");
    p.append(body);
    const text = el("div", "text");
    D.tokens.forEach((t, i) => text.append(tokenSpan(t, i)));
    text.addEventListener("mouseover", e => { const i = e.target.closest(".tok"); if (i && !state.pinned) select(+i.dataset.i, false); });
    text.addEventListener("click", e => { const i = e.target.closest(".tok"); if (!i) return;
      state.pinned = !(state.pinned && state.query === +i.dataset.i); select(+i.dataset.i, false); });
    const c = el("canvas");
    c.width = T * SCALE; c.height = T * SCALE;
    c.title = "query rows, key columns: click a row to pin that query";
    c.addEventListener("click", e => { const r = c.getBoundingClientRect(); state.pinned = true;
      select(Math.min(T - 1, Math.floor((e.clientY - r.top) / r.height * T))); });
    body.append(c, text);  // the map on the left, the text beside it
    p.map = mapImage(h);
    views.append(p);
  }
  buildStats();
  select(state.query);
}

const SCALE = Math.max(1, Math.floor(600 / T));  // canvas pixels per map cell: crisp when scaled down

function mapImage(h) {  // the head's T x T map as an offscreen canvas, drawn once per build
  const off = document.createElement("canvas");
  off.width = T; off.height = T;
  const ctx = off.getContext("2d"), img = ctx.createImageData(T, T);
  for (let i = 0; i < T; i++) for (let j = 0; j < T; j++) {
    const o = 4 * (i * T + j), c = j <= i ? color(weight(state.layer, h, i, j)) : [230, 230, 230];
    img.data[o] = c[0]; img.data[o + 1] = c[1]; img.data[o + 2] = c[2]; img.data[o + 3] = 255;
  }
  ctx.putImageData(img, 0, 0);
  return off;
}

function drawMap(canvas, map, q) {  // the map, the query's row outlined in red
  const ctx = canvas.getContext("2d");
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(map, 0, 0, T * SCALE, T * SCALE);
  ctx.strokeStyle = "#e00"; ctx.lineWidth = Math.max(2, SCALE / 4);
  ctx.strokeRect(0, q * SCALE, (q + 1) * SCALE, SCALE);
}

function select(q, reveal = true) {  // shade the earlier tokens of every panel by the query's weights; fill the numbers
  state.query = Math.max(0, Math.min(T - 1, q));
  const i = state.query;
  $("qinfo").textContent = `query ${i} “${D.tokens[i].label}”` + (state.pinned ? " (pinned)" : "");
  for (const p of $("views").children) {
    const h = +p.dataset.head, r = row(state.layer, h, i);
    p.querySelectorAll(".tok").forEach((s, j) => {
      s.classList.toggle("q", j === i); s.classList.toggle("later", j > i);
      s.style.background = j <= i ? shade(r[j]) : "";
      s.title = j <= i ? `${j} “${D.tokens[j].label}”: ${fmt(r[j], 4)}` : `${j}: after the query`;
    });
    const text = p.querySelector(".text"), span = text.children[i];
    if (reveal && (span.offsetTop < text.scrollTop || span.offsetTop > text.scrollTop + text.clientHeight - 20))
      text.scrollTop = span.offsetTop - text.clientHeight / 2;  // bring the query into view
    drawMap(p.querySelector("canvas"), p.map, i);
  }
  numbers();
  try { history.replaceState(null, "", `#L${state.layer}H${state.head}q${i}`); } catch (e) { /* some file:// setups */ }
}

function numbers() {  // every earlier key's weight, nearest first, one column per head
  const i = state.query, hs = heads(), rows = hs.map(h => row(state.layer, h, i));
  const tb = el("table"), head = el("tr");
  head.append(el("th", "", "key"), el("th", "", "token"));
  hs.forEach(h => head.append(el("th", "", `L${state.layer} H${h}`)));
  tb.append(head);
  for (let j = i; j >= 0; j--) {
    const tr = el("tr");
    tr.append(el("td", "", j), el("td", "tk", D.tokens[j].label));
    rows.forEach((r, k) => { const td = el("td", "w", fmt(r[j], 4)); td.dataset.head = hs[k]; td.style.background = shade(r[j]); tr.append(td); });
    tb.append(tr);
  }
  const sum = el("tr");
  sum.append(el("th", "", "Σ"), el("th", "", ""));
  rows.forEach(r => sum.append(el("th", "sum", fmt(r.reduce((a, b) => a + b, 0), 4))));
  tb.append(sum);
  $("numbers").replaceChildren(tb);
  $("numbers").dataset.query = i; $("numbers").dataset.layer = state.layer; $("numbers").dataset.head = state.head;
  $("topline").textContent = rows.map((r, k) => `H${hs[k]}: ` + [...r.keys()].sort((a, b) => r[b] - r[a]).slice(0, 3)
    .map(j => `${fmt(r[j], 2)} “${D.tokens[j].label}”@${j}`).join(", ")).join("   ·   ");
}

function buildStats() {  // layer x head table; colour by the chosen statistic
  const m = $("metric").value, vals = D.stats[m].flat(), max = Math.max(1e-9, ...vals.map(Math.abs));
  const tb = $("stats");
  tb.replaceChildren();
  const head = el("tr");
  head.append(el("th", "", "layer \\ head"));
  for (let h = 0; h < H; h++) head.append(el("th", "", "H" + h));
  tb.append(head);
  for (let l = 0; l < L; l++) {
    const tr = el("tr"), th = el("th", "rowhead", "L" + l);
    th.title = `all heads of layer ${l}`;
    th.onclick = () => { state.layer = l; state.head = "all"; build(); };
    tr.append(th);
    for (let h = 0; h < H; h++) {
      const td = el("td", "cell");
      td.dataset.layer = l; td.dataset.head = h;
      const v = D.stats[m][l][h], s = k => D.stats[k][l][h];
      td.append(el("b", "", fmt(v, m === "dist" || m === "entropy" ? 2 : 3)));
      td.append(el("small", "", `H ${fmt(s("entropy"), 2)} prev ${fmt(s("prev"), 2)}`));
      td.append(el("small", "", `first ${fmt(s("first"), 2)} self ${fmt(s("self"), 2)} dist ${fmt(s("dist"), 1)}`));
      const c = color(Math.abs(v) / max);
      td.style.background = `rgba(${c[0]},${c[1]},${c[2]},0.35)`;
      td.classList.toggle("sel", l === state.layer && (state.head === "all" || state.head === h));
      td.onclick = () => { state.layer = l; state.head = h; build(); };
      tr.append(td);
    }
    tb.append(tr);
  }
}

document.addEventListener("keydown", e => {
  if (e.target.tagName === "SELECT") return;
  if (e.key === "ArrowLeft" || e.key === "ArrowRight") { state.pinned = true; select(state.query + (e.key === "ArrowLeft" ? -1 : 1)); e.preventDefault(); }
});
build();
document.body.dataset.ready = "1";
</script>
</body></html>
"""
