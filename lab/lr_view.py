"""The learning-rate view of a sweep: what tools/report.py adds by itself when the runs vary `train.lr`.

An arm is then every setting but the seeds and the lr (`model.attn.qk_norm=true`, say), and each arm
has a curve: final val loss against lr. Its figures:
- The LR sensitivity of Wortsman et al. 2023 ("Small-scale proxies for large-scale Transformer
  training instabilities", arXiv 2309.14322): the mean over the lr grid of min(L(lr), L0) - L*, L0 the
  loss at initialisation (the step-0 val loss), L* the arm's best loss over the grid. 0 is an arm that
  reaches its best at every lr; a run that diverged counts at L0. Computed per seed, then the mean with
  its 95% t-interval, and each arm minus the first (paired by seed where both ran the same seeds).
- The best lr (of the mean over seeds) and the edge lr: per seed, the largest lr whose loss is within
  EDGE_NATS of that seed's best (fixed before any run), interpolated in log-lr where the curve crosses
  best + EDGE_NATS; its mean over seeds (in log-lr) with a 95% interval; "the whole grid" where every
  lr is within EDGE_NATS.
- Per lr: the mean loss with its interval over seeds, and how many runs diverged.
What it cannot know it says instead of printing a number: an arm with fewer than two lrs has no
sensitivity, nor an arm where no lr trains (every run diverged); two arms over different grids are
compared on their common lrs only, and the table says so. A per-run lr floor set as a fixed fraction
of the lr (train.min_lr = lr/10 in each run) keeps runs in one arm (lr_free).
Plots: loss against lr (diverged runs marked at L0), the largest attention logit against lr, and the
largest logit and the lowest layer entropy over training at one lr.
"""
import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Optional

from lab.arms import RunSummary
from lab.intervals import describe, replicate_interval

EDGE_NATS = 0.1  # how far above its best a loss may be and still count as trained well (fixed before the runs)
LR_KEY = "train.lr"


def lr_free(config: dict) -> dict:
    """A run's config without its lr, for grouping runs into arms: a floor train.min_lr is replaced by its
    fraction of the lr (a sweep that sets min_lr = lr/10 per run is one arm, not one per lr)."""
    out = {k: v for k, v in config.items() if k != LR_KEY}
    lr, floor = config.get(LR_KEY), config.get("train.min_lr")
    if isinstance(lr, (int, float)) and isinstance(floor, (int, float)) and lr > 0:
        out["train.min_lr"] = f"{floor / lr:.6g} x lr"
    return out


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
    outcome: str = "finished"  # results.json's: finished, diverged, stopped or unigram (lab/rundir.outcome)

    @property
    def learned(self) -> bool:
        """Did this run learn more than how often each token comes (neither diverged nor at the unigram loss)?"""
        return not self.diverged and self.outcome != "unigram"

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


def point(run: RunSummary) -> Point:
    """A Point of a finished run (lab/arms.py's RunSummary: dir, config, metrics, final, replicate)."""
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
                 metrics=run.metrics, outcome=res.get("outcome", "diverged" if diverged else "finished"))


def finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def sensitivity(points: list) -> Optional[float]:
    """Wortsman et al.'s LR sensitivity of one seed's runs over the grid: mean of min(L, L0) - L*; None
    where it cannot be known (fewer than two lrs, a loss missing, or no run trained)."""
    counted = [p.counted for p in points]
    if len({p.lr for p in points}) < 2 or any(c is None for c in counted) or not any(p.learned for p in points):
        return None
    return statistics.fmean(counted) - min(counted)


def edge(points: list):
    """(log10 of the edge lr, whole grid?) of one seed's runs: the largest lr within EDGE_NATS of the seed's
    best loss, going up the grid from the best, interpolated in log-lr where the loss crosses best +
    EDGE_NATS; (None, False) without a loss at every lr."""
    pts = sorted(points, key=lambda p: p.lr)
    if not pts or any(p.counted is None for p in pts):
        return None, False
    losses = [p.counted for p in pts]
    best = min(losses)
    if max(losses) <= best + EDGE_NATS:
        return math.log10(pts[-1].lr), True
    i = losses.index(best)
    while i + 1 < len(pts) and losses[i + 1] <= best + EDGE_NATS:
        i += 1
    if i + 1 == len(pts):  # within reach up to the grid's top: the edge is at least there
        return math.log10(pts[i].lr), False
    x0, x1, y0, y1 = math.log10(pts[i].lr), math.log10(pts[i + 1].lr), losses[i], losses[i + 1]
    return x0 + (best + EDGE_NATS - y0) / (y1 - y0) * (x1 - x0), False


@dataclass
class LrArm:
    label: str
    points: list

    @property
    def lrs(self) -> list:
        return sorted({p.lr for p in self.points})

    def at(self, lr) -> list:
        return [p for p in self.points if p.lr == lr]

    def seeds(self, lrs=None) -> dict:
        """{replicate: its points} (on the lrs given, else all)."""
        out = {}
        for p in self.points:
            if lrs is None or p.lr in lrs:
                out.setdefault(p.replicate, []).append(p)
        return out

    def per_seed_sensitivity(self, lrs=None) -> dict:
        """{replicate: its sensitivity} over the lrs that replicate ran (of `lrs`, if given)."""
        return {rep: s for rep, pts in self.seeds(lrs).items() for s in [sensitivity(pts)] if s is not None}

    def unknowable(self) -> Optional[str]:
        """Why this arm has no LR sensitivity or edge, in words; None where it has them."""
        if len(self.lrs) < 2:
            return f"one lr ({self.lrs[0]:g}): an LR sensitivity needs two or more" if self.lrs else "no runs"
        if not any(p.learned for p in self.points):
            return "no lr trains here (every run diverged or ended at the unigram loss): no sensitivity, best lr or edge"
        return None

    def edge(self) -> dict:
        """The edge lr over seeds: {"lr", "lo", "hi" (10^ of the mean of log10 and its 95% interval), "n",
        "whole" (seeds whose every lr is within EDGE_NATS)}."""
        found = [edge(pts) for pts in self.seeds().values()]
        logs = [x for x, _ in found if x is not None]
        d = describe(logs)
        out = {"n": d["n"], "whole": sum(w for _, w in found), "lr": None, "lo": None, "hi": None}
        if d["mean"] is not None:
            out["lr"] = 10 ** d["mean"]
            if d["half"] is not None:
                out["lo"], out["hi"] = 10 ** (d["mean"] - d["half"]), 10 ** (d["mean"] + d["half"])
        return out

    def curve(self) -> list:
        """[(lr, describe(counted losses), diverged runs, runs)] over the grid."""
        return [(lr, describe([p.counted for p in self.at(lr) if p.counted is not None]),
                 sum(p.diverged for p in self.at(lr)), len(self.at(lr))) for lr in self.lrs]

    def unigram_at(self, lr) -> int:
        return sum(p.outcome == "unigram" for p in self.at(lr))

    def best(self):
        """(best lr, its mean loss) by the mean over seeds; Nones without any loss or where no lr trains."""
        means = [(lr, d["mean"]) for lr, d, _, _ in self.curve() if d["mean"] is not None]
        if not means or not any(p.learned for p in self.points):
            return None, None
        return min(means, key=lambda x: x[1])


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
    """b minus a in LR sensitivity over the lrs both ran: paired by seed where both ran the same ones, else
    Welch's; "note" says why there is no difference, or that the grids differ."""
    common = sorted(set(a.lrs) & set(b.lrs))
    out = {"a": a.label, "b": b.label, "diff": None, "half": None, "p": None, "test": None, "note": None}
    if len(common) < 2:
        out["note"] = f"{len(common)} lr in common: no comparison"
        return out
    if common != a.lrs or common != b.lrs:
        out["note"] = "on the common lrs only: " + ", ".join(f"{lr:g}" for lr in common)
    sa, sb = a.per_seed_sensitivity(common), b.per_seed_sensitivity(common)
    if not sa or not sb:
        out["note"] = "no sensitivity in " + ("either arm" if not sa and not sb else f"{(a if not sa else b).label}")
        return out
    out["diff"] = statistics.fmean(sb.values()) - statistics.fmean(sa.values())
    out.update(replicate_interval(sa, sb))
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
             "loss, † marks how many diverged, ‡ how many ended at the val split's unigram loss: they learned "
             "token frequencies only):", "", head, "|---|" + "---|" * len(grid)]
    for a in arms:
        cells = {lr: interval(d) + (" †" * div if div <= 3 else f" †×{div}") + (" ‡" * a.unigram_at(lr))
                 for lr, d, div, _ in a.curve()}
        lines.append(f"| {a.label} | " + " | ".join(cells.get(lr, "-") for lr in grid) + " |")
    lines += ["", "| arm | seeds | LR sensitivity (mean ± 95%) | best lr | best loss | edge lr within "
              f"{EDGE_NATS} nats (95%) | diverged / unigram runs | largest logit (max over runs) |",
              "|---|---|---|---|---|---|---|---|"]
    for a in arms:
        logits = [p.logit_max for p in a.points if p.logit_max is not None]
        tail = (f"{sum(p.diverged for p in a.points)} / {sum(p.outcome == 'unigram' for p in a.points)} of "
                f"{len(a.points)} | {fmt(max(logits) if logits else None, '.4g')} |")
        why = a.unknowable()
        if why:
            lines.append(f"| {a.label} | {len(a.seeds())} | {why} | - | - | - | " + tail)
            continue
        sens = describe(list(a.per_seed_sensitivity().values()))
        lr_best, best = a.best()
        lines.append(f"| {a.label} | {sens['n']} | {interval(sens)} | {fmt(lr_best, 'g')} | {fmt(best)} | "
                     f"{edge_cell(a.edge())} | " + tail)
    if len(arms) > 1:
        lines += ["", "| arm | minus arm | LR sensitivity difference | 95% interval | test | note |",
                  "|---|---|---|---|---|---|"]
        for b in arms[1:]:
            c = compare_sensitivity(arms[0], b)
            ci = f"{c['diff'] - c['half']:+.3f} to {c['diff'] + c['half']:+.3f}" if c["half"] is not None else "-"
            lines.append(f"| {b.label} | {arms[0].label} | {fmt(c['diff'], '+.3f')} | {ci} | {c['test'] or '-'} | "
                         f"{c['note'] or ''} |")
    lines += ["", "LR sensitivity (Wortsman et al. 2023): per seed, the mean over the lr grid of min(L(lr), L0) − L*, "
              "L0 the step-0 val loss, L* the seed's best over the grid; 95% t-intervals over seeds; differences "
              "paired by seed where both arms ran the same seeds, else Welch's."]
    return "\n".join(lines)


def edge_cell(e: dict) -> str:
    """The edge lr in a table cell: the whole grid, or the lr with its interval over seeds."""
    if e["n"] and e["whole"] == e["n"]:
        return "the whole grid"
    if e["lr"] is None:
        return "-"
    within = f" ({e['lo']:.2g} to {e['hi']:.2g})" if e["lo"] is not None else " (one seed)"
    return f"{e['lr']:.2g}{within}" + (f"; whole grid in {e['whole']} of {e['n']} seeds" if e["whole"] else "")


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
