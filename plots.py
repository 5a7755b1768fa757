"""PNG plots from metrics.jsonl files, no W&B needed: one run's curves, or several runs compared."""
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
