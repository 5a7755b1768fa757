"""The recall experiment's table and plot: each arm's final exact-match recall (`val/recall_acc`, data=mqar)
at each number of key-value pairs, the mean ± sd over its seeds with a 95% interval of the mean
(Student t), and recall against pairs, one line per arm with its interval as error bars.

    python train.py -m experiment=recall_cpu
    python tools/recall.py outputs/multirun/2026-12-03_09-00-00            # recall.md, recall.png in its recall/<time>/
    python tools/recall.py RUN_DIR ... --out outputs/recall/mine

An arm is what tools/report.py calls one (runs whose configs differ only in their seeds) with
data.pairs left out: its runs at every number of pairs form one line. A run trained on a mix
(data.pairs=[4,8,16]) gives a value for each of them (val/recall_acc/pairs4, ...).
"""
import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

from lab.cli import cli  # noqa: E402
from files import check_output_dir  # noqa: E402
from lab.plots import plt, save_figure  # noqa: E402
from rules import UserError  # noqa: E402
from lab.intervals import describe  # noqa: E402
from lab.arms import RunSummary, default_out, find_runs, group_arms, summarize  # noqa: E402

PAIRS = "data.pairs"


def final_recall(run: RunSummary) -> dict:
    """{pairs: the last evaluation's recall} of a run: each number of pairs it trained on."""
    last = [m for m in run.metrics if "val/recall_acc" in m][-1]
    mixed = {int(k.rsplit("pairs", 1)[1]): v for k, v in last.items() if k.startswith("val/recall_acc/pairs")}
    pairs = run.config[PAIRS]
    return mixed or {(pairs[0] if isinstance(pairs, list) else pairs): last["val/recall_acc"]}


def recall_runs(paths) -> list:
    """The runs under `paths`, each with its final recall per number of pairs; one line if one is not
    an mqar run."""
    runs = [summarize(r) for r in find_runs(paths)]
    for r in runs:
        if r.config.get("data.name") != "mqar" or r.final["recall_acc"] is None:
            raise UserError(f"{r.dir} logged no val/recall_acc: tools/recall.py reads runs of data=mqar "
                            "(python train.py -m experiment=recall_cpu)")
        r.final["recall"] = final_recall(r)
    return runs


def arm_label(arm) -> str:
    """The arm's differing settings, short: its layers' kinds first (layer_kinds, else kind), then what
    else differs and is set (an unset value or `none` says nothing of the arm)."""
    config = arm.runs[0].config
    kinds = config.get("model.attn.layer_kinds") or config.get("model.attn.kind") or "softmax"
    kinds = "[" + ",".join(kinds) + "]" if isinstance(kinds, (list, tuple)) else str(kinds)
    rest = [part.replace("model.attn.", "") for part in arm.label.split(", ") if "=" in part
            and not part.startswith(("model.attn.layer_kinds=", "model.attn.kind="))
            and part.split("=", 1)[1] not in ("None", "none", "(unset)")]
    return ", ".join([kinds, *rest])


def recall_table(runs) -> tuple:
    """(pairs, rows): the pair counts in order, and per arm (label, {pairs: describe(recall values)})."""
    without = [replace(r, config={k: v for k, v in r.config.items() if k != PAIRS}) for r in runs]
    pairs = sorted({p for r in runs for p in r.final["recall"]})
    rows = []
    for arm in group_arms(without):
        label = arm_label(arm) + ("" if arm.outcomes() == "all finished" else f" ({arm.outcomes()})")  # a stopped run
        values = {p: [r.final["recall"][p] for r in arm.runs if p in r.final["recall"]] for p in pairs}
        cells = {p: {**describe(v), "values": v} for p, v in values.items()}
        rows.append((label, cells))
    return pairs, rows


def cell(d: dict) -> str:
    if d["n"] == 0:
        return "-"
    if d["half"] is None:
        return f"{d['mean']:.3f} (one run)"
    return f"{d['mean']:.3f} ± {d['sd']:.3f} [{d['mean'] - d['half']:.3f}, {d['mean'] + d['half']:.3f}]"


def markdown(pairs, rows) -> str:
    n = sorted({d["n"] for _, cells in rows for d in cells.values() if d["n"]})
    lines = ["| arm | " + " | ".join(f"{p} pairs" for p in pairs) + " |", "|---|" + "---|" * len(pairs)]
    lines += [f"| {label} | " + " | ".join(cell(cells[p]) for p in pairs) + " |" for label, cells in rows]
    lines.append(f"\nFinal val/recall_acc (share of the answers the argmax gets right): mean ± sd over "
                 f"{'/'.join(map(str, n))} seeds, [95% interval of the mean, Student t]. Each seed:\n")
    lines += ["| arm | " + " | ".join(f"{p} pairs" for p in pairs) + " |", "|---|" + "---|" * len(pairs)]
    lines += [f"| {label} | " + " | ".join(", ".join(f"{v:.3f}" for v in cells[p]["values"]) or "-" for p in pairs)
              + " |" for label, cells in rows]
    return "\n".join(lines)


def plot(pairs, rows, path):
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, cells in rows:
        xs = [p for p in pairs if cells[p]["n"]]
        ys = [cells[p]["mean"] for p in xs]
        err = [cells[p]["half"] or 0.0 for p in xs]
        line = ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
        seeds = [(p, v) for p in xs for v in cells[p]["values"]]  # each seed, so a split between seeds shows
        ax.scatter([p for p, _ in seeds], [v for _, v in seeds], s=12, alpha=0.5, color=line[0].get_color())
    ax.set_xscale("log", base=2)
    ax.set_xticks(pairs, [str(p) for p in pairs])
    ax.set_xlabel("key-value pairs per window")
    ax.set_ylabel("recall accuracy (val)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("associative recall: mean over seeds, 95% interval; dots: each seed")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def recall(dirs, out=None):
    """Read the runs under `dirs`, write recall.md and recall.png to `out` and print the table."""
    out = check_output_dir(out or default_out(dirs, "recall"), "--out")
    pairs, rows = recall_table(recall_runs(dirs))
    table = markdown(pairs, rows)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recall.md").write_text(table + "\n")
    png = plot(pairs, rows, out / "recall.png")
    print(table)
    print(f"wrote {out / 'recall.md'}, {png}", file=sys.stderr)


@cli
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", help="run dirs or sweep (multirun) dirs of data=mqar runs")
    parser.add_argument("--out", default=None, help="where to write recall.md and recall.png (default: a new "
                        "dir per call, SWEEP/recall/<time> when given one sweep dir, else outputs/recall/<time>)")
    args = parser.parse_args(argv)
    recall(args.dirs, args.out)


if __name__ == "__main__":
    main()
