"""PNG plots from metrics.jsonl files, no W&B needed: one run's curves, or several runs compared."""
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

from attnstats import entropy_grid  # noqa: E402
from tracking import read_metrics  # noqa: E402


def save_figure(fig, path):
    """Write a figure as a PNG and free it (pyplot keeps every open figure alive)."""
    fig.tight_layout()
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
    layers = sorted({int(k.split("/")[1][1:]) for m in probes for k in m
                     if k.startswith("attn_entropy/L") and k.count("/") == 1})
    fig, (ax, hx) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for l in layers:
        steps, values = series(probes, f"attn_entropy/L{l}")
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


def head_keys(probes, name) -> list:
    """[(layer, head, key)] of the per-head metric attn_{name}/L{l}/H{h} in the probe lines."""
    found = {(int(m.group(1)), int(m.group(2)), key) for p in probes for key in p
             for m in [re.fullmatch(rf"attn_{name}/L(\d+)/H(\d+)", key)] if m}
    return sorted(found)


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
