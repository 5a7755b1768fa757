"""Compare runs without W&B: arms with seeds, intervals and verdicts, curves with bands, and plots.

    python tools/report.py outputs/multirun/2026-11-29_12-00-00           # every run of a sweep
    python tools/report.py outputs/runs/A outputs/runs/B --out outputs/report/AB  # any run dirs
    python tools/report.py SWEEP --baseline "model.attn.qk_norm=false"      # compare each arm with one

Runs whose resolved configs differ only in their seeds (`seed`, `train.data_seed`) are one arm:
`python train.py -m experiment=attn_scale_ablation_cpu seed=1,2,3` gives four arms of three runs.
For each arm: n, the mean ± sd over its runs and a 95% interval of the mean (Student t) of the final
val loss (the whole val split's, `val/loss_full`, where the run logged it), bits per character,
attention entropy, peak weight and largest logit. For each pair of arms: the difference of the
means with its 95% interval, a paired t-test when both arms ran the same seeds (else Welch's), and
a verdict in words. One run per arm gives no interval, and the report says so.

Runs that vary train.lr get the learning-rate view besides (lab/lr_view.py): an arm is then every setting
but the seeds and the lr; loss against lr, the LR sensitivity with its interval, the best lr and the
edge lr, diverged runs counted at their step-0 loss; loss_vs_lr.png and logit_entropy_steps.png. Its
arms in the tables above are then compared at equal lr only, never across lrs.

Writes into --out (default: a new directory per call, SWEEP/report/<time>/ when given one sweep dir, else
outputs/report/<time>/; the newest is the latest call's): report.md, val_loss.png
and attn_stats.png (mean per arm with a band over seeds), sinks.png (the top head's weight on the
first token and the largest activation over training), val_loss_diff.png (each arm minus the
baseline over training, with its interval) and attn_heads.png (when the runs were probed for head
roles), and prints the tables.
"""
import argparse
import itertools
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

from lab.cli import cli  # noqa: E402
from files import check_output_dir  # noqa: E402
from rules import UserError  # noqa: E402
from lab.plots import plot_bands, plot_head_roles_compare, series  # noqa: E402
from lab.intervals import describe, paired_interval, replicate_interval, welch_interval  # noqa: E402
from lab.lr_view import lr_free, lr_view  # noqa: E402
from lab.arms import Arm, arm_key, default_out, find_runs, group_arms, newer_keys, summarize  # noqa: E402

METRICS = [  # (name, column title, format)
    ("val_loss", "val loss", ".4f"), ("val_bpc", "val bits/char", ".4f"), ("attn_entropy", "attn entropy (nats)", ".3f"),
    ("attn_peak", "attn peak", ".3f"), ("attn_logit_max", "max logit", ".2f"),
    ("attn_first", "first-token mass (mean / top head)", ".3f"), ("act_max", "largest activation", ".1f"),
    ("recall_acc", "recall acc", ".3f")]


# ----------------------------------------------------------------------------- statistics

def compare(a: Arm, b: Arm, name: str = "val_loss") -> dict:
    """b minus a for metric `name`: the difference of the means with its 95% interval and p-value.
    Paired when both arms ran the same replicates (seed and data seed), else Welch's t-test; with one
    run in either arm, no interval."""
    ra = {r.replicate: r.final[name] for r in a.runs if r.final[name] is not None}
    rb = {r.replicate: r.final[name] for r in b.runs if r.final[name] is not None}
    out = {"a": a.label, "b": b.label, "metric": name, "n_a": len(ra), "n_b": len(rb),
           "diff": statistics.fmean(rb.values()) - statistics.fmean(ra.values()) if ra and rb else None,
           "half": None, "p": None, "test": None,
           "note": "; ".join(f"{arm.label}: {arm.outcomes()}" for arm in (a, b) if arm.outcomes() != "all finished")}
    if out["diff"] is not None:
        out.update(replicate_interval(ra, rb))
    return out


def curve_band(curves: list):
    """(steps, mean, lo, hi) of several runs' curves [(steps, values)] over the steps they all
    share; lo/hi the 95% t-interval of the mean at each step (None for one run)."""
    steps = sorted(set.intersection(*[set(s) for s, _ in curves]))
    rows = [[dict(zip(*c))[t] for c in curves] for t in steps]
    d = [describe(r) for r in rows]
    mean = [x["mean"] for x in d]
    if len(curves) < 2:
        return steps, mean, None, None
    return steps, mean, [x["mean"] - x["half"] for x in d], [x["mean"] + x["half"] for x in d]


def difference_curve(base: Arm, arm: Arm, key: str = "val/loss"):
    """(steps, mean, lo, hi, paired) of arm minus base for a metric over training: the 95% interval
    of the paired differences where both arms ran the same seeds, else Welch's."""
    ref = {r.replicate: dict(zip(*series(r.metrics, key))) for r in base.runs}
    own = {r.replicate: dict(zip(*series(r.metrics, key))) for r in arm.runs}
    keys = sorted(own, key=str)
    paired = set(own) == set(ref) and len(own) >= 2
    steps = sorted(set.intersection(*[set(c) for c in [*ref.values(), *own.values()]]))
    mean, lo, hi = [], [], []
    for t in steps:
        if paired:
            c = paired_interval([ref[k][t] for k in keys], [own[k][t] for k in keys])
        elif len(ref) >= 2 and len(own) >= 2:
            c = welch_interval([v[t] for v in ref.values()], [v[t] for v in own.values()])
        else:
            c = {"diff": statistics.fmean(v[t] for v in own.values()) - statistics.fmean(v[t] for v in ref.values()),
                 "half": None}
        mean.append(c["diff"])
        lo.append(None if c["half"] is None else c["diff"] - c["half"])
        hi.append(None if c["half"] is None else c["diff"] + c["half"])
    return steps, mean, (None if None in lo else lo), (None if None in hi else hi), paired


def verdict(c: dict, what: str = "") -> str:
    """A comparison in words: 'lower by 0.031 ± 0.012', 'within noise (+0.004 ± 0.015)', or why no
    interval can be given."""
    if c["diff"] is None:
        return "not measured in both arms"
    if c["half"] is None or not math.isfinite(c["half"]):
        return (f"{c['diff']:+.4f}, one run in an arm: no interval can be given (run more seeds: "
                "seed=1,2,3)")
    if c["half"] == 0 and c["diff"] == 0:
        return "identical in every run"
    if abs(c["diff"]) > c["half"]:
        return f"{'lower' if c['diff'] < 0 else 'higher'} by {abs(c['diff']):.4f} ± {c['half']:.4f}"
    return f"within noise ({c['diff']:+.4f} ± {c['half']:.4f})"


# ----------------------------------------------------------------------------- tables

def fmt(v, spec=".4f"):
    return "-" if v is None else format(v, spec)


def arm_table(arms: list) -> str:
    head = "| arm | n | outcomes | " + " | ".join(f"{title} (mean ± sd)" for _, title, _ in METRICS[:1]) + \
        " | 95% interval | " + " | ".join(title for _, title, _ in METRICS[1:]) + " |"
    lines = [head, "|" + "---|" * (5 + len(METRICS) - 1)]
    for arm in arms:
        d = describe(arm.values("val_loss"))
        loss = fmt(d["mean"]) + (f" ± {d['sd']:.4f}" if d["sd"] is not None else "") + \
            (" §" if any(not r.final["full_val"] for r in arm.runs) else "")  # a run's last evaluation, not the split
        ci = f"{d['mean'] - d['half']:.4f} to {d['mean'] + d['half']:.4f}" if d["half"] is not None else \
            ("one run: none" if d["n"] == 1 else "-")
        rest = []
        for name, _, spec in METRICS[1:]:
            values = arm.values(name)
            parts = zip(*values) if values and isinstance(values[0], tuple) else [values]  # (mean, top head)
            rest.append(" / ".join(fmt(e["mean"], spec) + (f" ± {e['sd']:{spec}}" if e["sd"] is not None else "")
                                   for e in map(describe, parts)))
        lines.append(f"| {arm.label} | {d['n']} | {arm.outcomes()} | {loss} | {ci} | " + " | ".join(rest) + " |")
    return "\n".join(lines)


def pairs_table(comparisons: list) -> str:
    lines = ["| arm | minus arm | val loss difference | 95% interval | test | p | verdict | runs not finished |",
             "|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        ci = f"{c['diff'] - c['half']:+.4f} to {c['diff'] + c['half']:+.4f}" if c["half"] is not None else "-"
        test = f"{c['test']}, n={c.get('n', min(c['n_a'], c['n_b']))}" if c["test"] else "-"
        lines.append(f"| {c['b']} | {c['a']} | {fmt(c['diff'], '+.4f')} | {ci} | {test} | {fmt(c['p'], '.3f')} | "
                     f"{verdict(c)} | {c.get('note') or ''} |")
    return "\n".join(lines)


def ignored_lines(arms: list) -> str:
    """Each arm's settings without effect (warned at its start, in its runs' run_info.json): an arm of
    a sweep may set what only another arm uses, and is then the arm without it."""
    lines = [f"- {a.label}: " + "; ".join(a.ignored) for a in arms if a.ignored]
    return ("Settings an arm ignored (no effect in its config):\n" + "\n".join(lines)) if lines else ""


def footnote(arms: list) -> str:
    runs = [r for a in arms for r in a.runs]
    last = sum(not r.final["full_val"] for r in runs)
    return ("Val loss: " + ("over the whole val split at the last step (val/loss_full)" if not last else
                            "the last evaluation's (eval_iters random windows; no whole-split loss logged) for every run"
                            if last == len(runs) else
                            f"over the whole val split at the last step (val/loss_full), except {last} of {len(runs)} runs "
                            "with no whole-split loss (a stopped or diverged run, or one from before it was logged): "
                            "their last evaluation's (eval_iters random windows), arms holding them marked §")
            + ". Mean ± sd over an arm's runs (sd with n − 1); 95% interval of the mean = mean ± t(0.975, n − 1)·sd/√n "
            "(Student t). Differences: a paired t-test on the per-seed differences where both arms ran the same "
            "seeds (seed and train.data_seed), else Welch's t-test; 95% intervals of the difference; no correction "
            "for the number of pairs compared. An arm of one run gives no interval.")


# ----------------------------------------------------------------------------- the report

def plot_arm_bands(arms: list, path, keys: list):
    """Each arm's mean over its runs against the step with its 95% band, one panel per metric key."""
    lines = []
    for i, (key, label) in enumerate(keys):
        for a in arms:
            curves = [c for c in (series(r.metrics, key) for r in a.runs) if c[0]]
            if curves:
                lines.append((f"{a.label} (n={len(curves)})", i, *curve_band(curves)))
    return plot_bands(lines, path, [(f"{label}: mean over seeds, 95% band", label) for _, label in keys])


def report(paths, out=None, baseline=None) -> dict:
    out = check_output_dir(out or default_out(paths, "report"), "--out")
    runs = [summarize(r) for r in find_runs(paths)]
    arms = group_arms(runs)
    if baseline is not None and baseline not in [a.label for a in arms]:
        raise UserError(f"--baseline {baseline!r} is not an arm; the arms are: " + "; ".join(a.label for a in arms))
    base = next((a for a in arms if a.label == baseline), arms[0])
    lr_sweep = len({repr(r.config.get("train.lr")) for r in runs}) > 1
    if lr_sweep:  # arms are compared at equal lr, each with the baseline's setting at that lr; never across lrs
        setting = lambda a: arm_key(lr_free(a.runs[0].config), a.runs[0].dir, newer_keys([r.config for r in runs]))  # noqa: E731
        lr_of = lambda a: repr(a.runs[0].config.get("train.lr"))  # noqa: E731
        pairs = [(b, a) for b in arms if setting(b) == setting(base) for a in arms
                 if a is not b and lr_of(a) == lr_of(b)]
    else:
        pairs = [(base, a) for a in arms if a is not base] if baseline or len(arms) > 5 else \
            list(itertools.combinations(arms, 2))
    comparisons = [compare(a, b) for a, b in pairs]
    out.mkdir(parents=True, exist_ok=True)
    files = [plot_arm_bands(arms, out / "val_loss.png", [("val/loss", "val loss (nats/token)")])]
    if any(a.values("attn_entropy") for a in arms):
        files.append(plot_arm_bands(arms, out / "attn_stats.png", [
            ("attn_entropy/mean", "attention entropy (nats)"), ("attn_entropy_norm/mean", "entropy / ln(keys)"),
            ("attn_peak/mean", "peak attention weight")]))
    if any(a.values("attn_first") for a in arms):  # where a sink forms, and the activation beside it
        files.append(plot_arm_bands(arms, out / "sinks.png", [
            ("attn_first/top", "top head's weight on the first token"), ("act_max/max", "largest activation")]))
    if any(a.values("recall_acc") for a in arms):  # data=mqar
        files.append(plot_arm_bands(arms, out / "recall.png", [("val/recall_acc", "recall accuracy (val)")]))
    if len(arms) > 1 and not lr_sweep:  # an lr sweep's differences are its pairs at equal lr (the table)
        lines = [(f"{a.label}{' (paired by seed)' if paired else ''}", 0, *curve)
                 for a in arms if a is not base for *curve, paired in [difference_curve(base, a)]]
        files.append(plot_bands(lines, out / "val_loss_diff.png",
                                [(f"val loss minus {base.label}'s, 95% band", "difference (nats/token)")], reference=0))
    if any("incontext/gain" in m for r in runs for m in r.metrics):  # head roles and induction
        rows = [{"run": f"{a.label} [{r.seed}]" if len(a.runs) > 1 else a.label, "metrics": r.metrics}
                for a in arms for r in a.runs]
        files.append(plot_head_roles_compare(rows, out / "attn_heads.png"))
    lr = None
    if lr_sweep:  # its own view (lab/lr_view.py)
        newer = newer_keys([r.config for r in runs])
        lr = lr_view(runs, lambda r: arm_key(lr_free(r.config), r.dir, newer), out)
        files += lr["files"]
    same_lr = "Arms of an lr sweep are compared at equal lr only (the LR view below compares whole curves)."
    md = "\n\n".join(p for p in [arm_table(arms), pairs_table(comparisons) if comparisons else "",
                                  same_lr if lr_sweep else "",
                                  "## Learning-rate sweep\n\n" + lr["table"] if lr else "", ignored_lines(arms),
                                  footnote(arms)] if p)
    (out / "report.md").write_text(md + "\n")
    files.append(out / "report.md")
    rows = [{"run": a.label, "dir": str(r.dir), "seed": r.seed, **r.final, "metrics": r.metrics}
            for a in arms for r in a.runs]
    return {"table": md, "arms": arms, "comparisons": comparisons, "rows": rows, "files": files,
            "lr_arms": lr["arms"] if lr else None}


@cli
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", help="run dirs or sweep (multirun) dirs")
    parser.add_argument("--out", default=None, help="where to write the PNGs and report.md (default: a new dir per "
                        "call, SWEEP/report/<time> when given one sweep dir, else outputs/report/<time>)")
    parser.add_argument("--baseline", default=None, help="compare every arm with this one (its label as printed)")
    args = parser.parse_args(argv)
    result = report(args.dirs, args.out, args.baseline)
    print(result["table"])
    print("wrote " + ", ".join(map(str, result["files"])), file=sys.stderr)


if __name__ == "__main__":
    main()
