"""The learning-rate view of a sweep: what tools/report.py adds by itself when the runs vary `train.lr`.

An arm is then every setting but the seeds and the lr (`model.attn.qk_norm=true`, say), and each arm
has a curve: final val loss against lr. Its figures:
- The LR sensitivity of Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer
  training instabilities", arXiv 2309.14322): the mean over the lr grid of min(L(lr), L0) - L*, L0 the
  loss at initialisation (the step-0 val loss), L* the arm's best loss over the grid. 0 is an arm that
  reaches its best at every lr; a run that diverged counts at L0. Computed per seed, then the mean with
  its 95% t-interval, and each arm minus the first (paired by seed where both ran the same seeds).
- The best lr (of the mean over seeds) and the basin: the lrs whose mean loss is within BASIN_NATS of
  the best, and its width in decades (log10 of the largest over the smallest).
- Per lr: the mean loss with its interval over seeds, and how many runs diverged.
Plots: loss against lr (diverged runs marked at L0), the largest attention logit against lr, and the
largest logit and the lowest layer entropy over training at one lr.
"""
import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Optional

from lab.intervals import describe, paired_interval, welch_interval

BASIN_NATS = 0.1
LR_KEY = "train.lr"


@dataclass
class Point:
    """One run of an lr sweep: its lr, replicate (seed, data seed), final val loss, step-0 val loss, and
    what its stability watch recorded (results.json, else read from its metrics)."""
    lr: float
    replicate: tuple
    loss: Optional[float]
    loss0: Optional[float]
    diverged: bool
    logit_max: Optional[float]
    entropy_min: Optional[float]
    metrics: list = field(default_factory=list, repr=False)

    @property
    def counted(self) -> Optional[float]:
        """The loss the sensitivity counts: min(L, L0); L0 for a diverged run or one without a finite loss."""
        if self.loss0 is None:
            return None if self.diverged else self.loss
        if self.diverged or self.loss is None or not math.isfinite(self.loss):
            return self.loss0
        return min(self.loss, self.loss0)


def read_results(run_dir) -> dict:
    try:
        return json.loads((run_dir / "results.json").read_text())
    except (OSError, ValueError):
        return {}


def point(run) -> Point:
    """A Point of a report.RunSummary (dir, config, metrics, final, replicate)."""
    res = read_results(run.dir)
    evals = [m for m in run.metrics if "val/loss" in m]
    step0 = next((m["val/loss"] for m in evals if m["step"] == 0), None)
    logits = [v for m in run.metrics for k, v in m.items() if k.startswith("attn_logit_max/L") and finite(v)]
    entropies = [v for m in run.metrics for k, v in m.items()
                 if k.startswith("attn_entropy/L") and k.count("/") == 1 and finite(v)]
    diverged = bool(res.get("diverged")) or any(m.get("diverged") for m in run.metrics)
    return Point(lr=float(run.config[LR_KEY]), replicate=run.replicate, loss=run.final.get("val_loss"),
                 loss0=res.get("val_loss_step0", step0), diverged=diverged,
                 logit_max=res.get("attn_logit_max_run", max(logits) if logits else None),
                 entropy_min=res.get("attn_entropy_min_run", min(entropies) if entropies else None),
                 metrics=run.metrics)


def finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def sensitivity(points: list) -> Optional[float]:
    """Wortsman et al.'s LR sensitivity of one seed's runs over the grid: mean of min(L, L0) - L*."""
    counted = [p.counted for p in points]
    if not counted or any(c is None for c in counted):
        return None
    return statistics.fmean(counted) - min(counted)


@dataclass
class LrArm:
    label: str
    points: list

    @property
    def lrs(self) -> list:
        return sorted({p.lr for p in self.points})

    def at(self, lr) -> list:
        return [p for p in self.points if p.lr == lr]

    def per_seed_sensitivity(self) -> dict:
        """{replicate: its sensitivity} over the lrs that replicate ran."""
        seeds = {}
        for p in self.points:
            seeds.setdefault(p.replicate, []).append(p)
        return {rep: s for rep, pts in seeds.items() for s in [sensitivity(pts)] if s is not None}

    def curve(self) -> list:
        """[(lr, describe(counted losses), diverged runs, runs)] over the grid."""
        return [(lr, describe([p.counted for p in self.at(lr) if p.counted is not None]),
                 sum(p.diverged for p in self.at(lr)), len(self.at(lr))) for lr in self.lrs]

    def best(self):
        """(best lr, its mean loss, (lo, hi) of the basin within BASIN_NATS, width in decades), by the
        mean over seeds; Nones without any loss."""
        means = [(lr, d["mean"]) for lr, d, _, _ in self.curve() if d["mean"] is not None]
        if not means:
            return None, None, (None, None), None
        lr_best, best = min(means, key=lambda x: x[1])
        basin = [lr for lr, m in means if m <= best + BASIN_NATS]
        return lr_best, best, (min(basin), max(basin)), math.log10(max(basin) / min(basin))


def lr_arms(runs: list, arm_key) -> list:
    """The runs (report.RunSummary) grouped into arms by everything but the seeds and train.lr, in the
    order their first run appears; each labelled by what differs between arms."""
    keyed = {}
    for r in runs:
        keyed.setdefault(arm_key(r), []).append(point(r))
    configs = [dict(k) for k in keyed]
    every = set().union(*configs) if configs else set()
    differing = sorted(k for k in every if len({c.get(k, "(unset)") for c in configs}) > 1)
    return [LrArm(", ".join(f"{k}={c.get(k, '(unset)')}".replace("'", "") for k in differing) or "all runs", pts)
            for c, pts in zip(configs, keyed.values())]


def compare_sensitivity(a: LrArm, b: LrArm) -> dict:
    """b minus a in LR sensitivity: paired by seed where both ran the same ones, else Welch's."""
    sa, sb = a.per_seed_sensitivity(), b.per_seed_sensitivity()
    out = {"a": a.label, "b": b.label, "diff": None, "half": None, "p": None, "test": None}
    if not sa or not sb:
        return out
    out["diff"] = statistics.fmean(sb.values()) - statistics.fmean(sa.values())
    if set(sa) == set(sb) and len(sa) >= 2:
        keys = sorted(sa, key=str)
        out.update(paired_interval([sa[k] for k in keys], [sb[k] for k in keys]))
    elif len(sa) >= 2 and len(sb) >= 2:
        out.update(welch_interval(list(sa.values()), list(sb.values())))
    return out


# ----------------------------------------------------------------------------- tables

def fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def interval(d: dict, spec=".3f") -> str:
    if d["mean"] is None:
        return "-"
    return fmt(d["mean"], spec) + (f" ± {d['half']:{spec}}" if d["half"] is not None else "")


def tables(arms: list) -> str:
    grid = sorted({lr for a in arms for lr in a.lrs})
    head = "| arm | " + " | ".join(f"lr {lr:g}" for lr in grid) + " |"
    lines = ["Final val loss per lr (mean ± 95% half-interval over seeds; a diverged run counts at its step-0 "
             "loss, † marks how many diverged):", "", head, "|---|" + "---|" * len(grid)]
    for a in arms:
        cells = {lr: interval(d) + (" †" * div if div <= 3 else f" †×{div}") for lr, d, div, _ in a.curve()}
        lines.append(f"| {a.label} | " + " | ".join(cells.get(lr, "-") for lr in grid) + " |")
    lines += ["", "| arm | seeds | LR sensitivity (mean ± 95%) | best lr | best loss | basin within "
              f"{BASIN_NATS} nats | width (decades) | diverged runs | largest logit (max over runs) |",
              "|---|---|---|---|---|---|---|---|---|"]
    for a in arms:
        sens = describe(list(a.per_seed_sensitivity().values()))
        lr_best, best, (lo, hi), width = a.best()
        logits = [p.logit_max for p in a.points if p.logit_max is not None]
        lines.append(f"| {a.label} | {sens['n']} | {interval(sens)} | {fmt(lr_best, 'g')} | {fmt(best)} | "
                     f"{fmt(lo, 'g')} to {fmt(hi, 'g')} | {fmt(width, '.2f')} | "
                     f"{sum(p.diverged for p in a.points)} of {len(a.points)} | {fmt(max(logits) if logits else None, '.4g')} |")
    if len(arms) > 1:
        lines += ["", "| arm | minus arm | LR sensitivity difference | 95% interval | test |", "|---|---|---|---|---|"]
        for b in arms[1:]:
            c = compare_sensitivity(arms[0], b)
            ci = f"{c['diff'] - c['half']:+.3f} to {c['diff'] + c['half']:+.3f}" if c["half"] is not None else "-"
            lines.append(f"| {b.label} | {arms[0].label} | {fmt(c['diff'], '+.3f')} | {ci} | {c['test'] or '-'} |")
    lines += ["", "LR sensitivity (Wortsman et al. 2023): per seed, the mean over the lr grid of min(L(lr), L0) − L*, "
              "L0 the step-0 val loss, L* the seed's best over the grid; 95% t-intervals over seeds; differences "
              "paired by seed where both arms ran the same seeds, else Welch's."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plots

def plot(arms: list, out) -> list:
    """loss_vs_lr.png (mean with its band, each run a dot, diverged runs an x at L0, largest logit against
    lr) and logit_entropy_steps.png (at one lr: the largest lr no run diverged at, else the smallest)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lab.plots import save_figure

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 5))
    for i, a in enumerate(arms):
        color = plt.cm.tab10.colors[i % 10]
        curve = [(lr, d) for lr, d, _, _ in a.curve() if d["mean"] is not None]
        ax.plot([lr for lr, _ in curve], [d["mean"] for _, d in curve], "o-", color=color, label=a.label)
        band = [(lr, d) for lr, d in curve if d["half"] is not None]
        if band:
            ax.fill_between([lr for lr, _ in band], [d["mean"] - d["half"] for _, d in band],
                            [d["mean"] + d["half"] for _, d in band], color=color, alpha=0.2, lw=0)
        ok = [p for p in a.points if not p.diverged and p.counted is not None]
        bad = [p for p in a.points if p.diverged and p.counted is not None]
        ax.scatter([p.lr for p in ok], [p.counted for p in ok], s=10, color=color, alpha=0.6)
        ax.scatter([p.lr for p in bad], [p.counted for p in bad], s=40, marker="x", color=color)
        logits = sorted((p.lr, p.logit_max) for p in a.points if p.logit_max is not None)
        if logits:
            bx.plot(*zip(*logits), "o", color=color, label=a.label, alpha=0.7)
    ax.set(xscale="log", xlabel="peak learning rate", ylabel="final val loss (nats/token)",
           title="loss vs lr (x: diverged, counted at the step-0 loss)")
    bx.set(xscale="log", yscale="log", xlabel="peak learning rate", ylabel="largest attention logit over the run",
           title="largest attention logit vs lr")
    for x in (ax, bx):
        x.grid(alpha=0.3)
        x.legend(fontsize=8)
    files = [save_figure(fig, out / "loss_vs_lr.png")]

    grid = sorted({lr for a in arms for lr in a.lrs})
    calm = [lr for lr in grid if not any(p.diverged for a in arms for p in a.at(lr))]
    lr = max(calm) if calm else grid[0]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(15, 5))
    for i, a in enumerate(arms):
        color = plt.cm.tab10.colors[i % 10]
        for j, p in enumerate(a.at(lr)):
            steps = [(m["step"], max(v for k, v in m.items() if k.startswith("attn_logit_max/L")),
                      min(v for k, v in m.items() if k.startswith("attn_entropy/L") and k.count("/") == 1))
                     for m in p.metrics if any(k.startswith("attn_logit_max/L") for k in m)]
            if steps:
                s, top, low = zip(*steps)
                ax.plot(s, top, color=color, alpha=0.8, label=a.label if j == 0 else None)
                bx.plot(s, low, color=color, alpha=0.8, label=a.label if j == 0 else None)
    ax.set(yscale="log", xlabel="step", ylabel="largest attention logit", title=f"largest logit over training, lr {lr:g}")
    bx.set(xlabel="step", ylabel="lowest layer-mean entropy (nats)", title=f"lowest layer entropy, lr {lr:g}")
    for x in (ax, bx):
        x.grid(alpha=0.3)
        x.legend(fontsize=8)
    files.append(save_figure(fig, out / "logit_entropy_steps.png"))
    return files


def lr_view(runs: list, arm_key, out) -> dict:
    """The LR view of report.RunSummary runs that vary train.lr: {"arms", "table", "files"}."""
    arms = lr_arms([r for r in runs if r.config.get(LR_KEY) is not None], arm_key)
    return {"arms": arms, "table": tables(arms), "files": plot(arms, out)}
