"""Compare runs without W&B: loss curves on one axis, attention statistics, and a Markdown table.

    python tools/report.py outputs/multirun/2026-11-29_12-00-00           # every run of a sweep
    python tools/report.py outputs/runs/A outputs/runs/B --out report/      # any run dirs

Writes val_loss.png, attn_stats.png and attn_heads.png (when the runs were probed) and report.md into --out
(default: the sweep dir when given one, else ./report) and prints the table.
"""
import argparse
import statistics
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

from common import UserError, cli
from plots import plot_attn_compare, plot_head_roles_compare, plot_val_loss
from tracking import read_metrics


def find_runs(paths) -> list:
    """Run dirs (those holding metrics.jsonl) among the paths and their subdirectories."""
    runs = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").is_file():
            runs.append(p)
        elif p.is_dir():
            runs.extend(sorted(q.parent for q in p.rglob("metrics.jsonl")))
        else:
            raise UserError(f"{p} is not a run dir or a sweep dir")
    if not runs:
        raise UserError(f"no metrics.jsonl under {' '.join(map(str, paths))}: pass run or sweep dirs")
    return runs


def run_overrides(run: Path) -> list:
    """The run's command-line overrides that change the model or training (not paths or logging)."""
    overrides = run / ".hydra" / "overrides.yaml"
    if not overrides.is_file():
        return []
    try:
        listed = yaml.safe_load(overrides.read_text())
    except (OSError, yaml.YAMLError) as e:  # a label is not worth failing the report for
        print(f"warning: {overrides} is unreadable ({type(e).__name__}): the run is labelled by its dir name",
              file=sys.stderr)
        return []
    if not isinstance(listed, list):
        return []
    return [o for o in map(str, listed)
            if not o.split("=")[0].lstrip("+~").startswith(("hydra.", "logger.", "data.", "device", "out_dir"))]


def run_labels(runs) -> list:
    """Each run named by the overrides that set it apart (those all runs share are dropped)."""
    overrides = [run_overrides(r) for r in runs]
    shared = set.intersection(*map(set, overrides)) if len(runs) > 1 else set()
    return [", ".join(o for o in ov if o not in shared) or run.name for run, ov in zip(runs, overrides)]


def summarize(run: Path, label: str) -> dict:
    metrics = read_metrics(run)
    evals = [m for m in metrics if "val/loss" in m]
    speeds = [m["tokens_per_sec"] for m in metrics if "tokens_per_sec" in m]
    probes = [m for m in metrics if "attn_entropy/mean" in m]
    last = evals[-1] if evals else {}
    return {"run": label, "dir": str(run), "metrics": metrics, "steps": last.get("step"),
            "train_loss": last.get("train/loss"), "val_loss": last.get("val/loss"),
            "best_val_loss": min((m["val/loss"] for m in evals), default=None),
            "val_bpc": last.get("val/bpc"),
            "tokens_per_sec": statistics.median(speeds) if speeds else None,
            "attn_entropy": probes[-1]["attn_entropy/mean"] if probes else None,
            "attn_peak": probes[-1].get("attn_peak/mean") if probes else None}


def fmt(v, spec=".4f"):
    return "-" if v is None else format(v, spec)


def table(rows) -> str:
    lines = ["| run | steps | train loss | val loss | best val loss | val bits/char | tokens/s | attn entropy (nats) | attn peak |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['run']} | {fmt(r['steps'], 'd')} | {fmt(r['train_loss'])} | {fmt(r['val_loss'])} | "
                     f"{fmt(r['best_val_loss'])} | {fmt(r['val_bpc'])} | {fmt(r['tokens_per_sec'], '.0f')} | {fmt(r['attn_entropy'], '.3f')} | "
                     f"{fmt(r['attn_peak'], '.3f')} |")
    return "\n".join(lines)


def report(paths, out=None) -> dict:
    runs = find_runs(paths)
    rows = [summarize(r, label) for r, label in zip(runs, run_labels(runs))]
    if out is None:
        out = paths[0] if len(paths) == 1 and not (Path(paths[0]) / "metrics.jsonl").is_file() else "report"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plot_val_loss(rows, out / "val_loss.png")
    files = [out / "val_loss.png"]
    if any(r["attn_entropy"] is not None for r in rows):
        plot_attn_compare(rows, out / "attn_stats.png")
        files.append(out / "attn_stats.png")
    if any("incontext/gain" in m for r in rows for m in r["metrics"]):  # head roles and induction
        plot_head_roles_compare(rows, out / "attn_heads.png")
        files.append(out / "attn_heads.png")
    md = table(rows)
    (out / "report.md").write_text(md + "\n")
    files.append(out / "report.md")
    return {"table": md, "rows": rows, "files": files}


@cli
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", help="run dirs or sweep (multirun) dirs")
    parser.add_argument("--out", default=None, help="where to write the PNGs and report.md")
    args = parser.parse_args(argv)
    result = report(args.dirs, args.out)
    print(result["table"])
    print("wrote " + ", ".join(map(str, result["files"])), file=sys.stderr)


if __name__ == "__main__":
    main()
