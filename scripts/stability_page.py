"""docs/stability.md's measurements, written from the run dirs: every table, figure and comparison below
the page's marker line, and its two plots.

    python scripts/stability_page.py RUNS [--page docs/stability.md]

RUNS holds one sweep dir per experiment, made by the commands the page prints (each a
`python train.py -m experiment=lr_sensitivity_cpu ... hydra.sweep.dir=RUNS/<name>`):
  e1_noqkn, e1_qkn   (1) the 7-lr grid, scale sqrt_dk/none, without and with QK-Norm
  qk_layernorm       (1) Wortsman et al.'s qk-layernorm arm (LayerNorm of q and k with a per-channel gain)
  gain_head          (2) QK-Norm with a learned per-head gain, lr 3e-3/3e-2/3e-1
  e2_zloss, e2_indep, e2_softcap, e2_qkn_softcap   (2) one mitigation each at the same lrs
  e3_postln, e3_preln_nowarm   (3) Post-LN with warmup 0 and 30, Pre-LN without warmup, lr 1e-3/1e-2/1e-1
  e4_depth           (4) 2 and 8 layers, lr 1e-3/1e-2/1e-1
A sweep that is missing leaves its section out with one line that says so. Every figure is named: a loss
is the final val loss over the whole val split (results.json val_loss_full), "± h" the 95% t-half-interval
of the mean over seeds, a difference is paired by seed (the same seed draws the same batches), the
largest logit is the max over the runs of each run's largest probed logit (attn_logit_max_run), the lowest
entropy the min over runs of each run's lowest probed layer-mean entropy.
"""
import argparse
import json
import math
import platform
import re
import shutil
import statistics
import sys
import tempfile
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lab.arms import find_runs, summarize  # noqa: E402
from lab.intervals import describe, replicate_interval  # noqa: E402
from rules import UserError  # noqa: E402
from lab.lr_view import EDGE_NATS, LrArm, plot, point  # noqa: E402

MARKER = "<!-- Everything below is written by scripts/stability_page.py from the run dirs; edit the script, not the page. -->"
DATA = "data.path=tinyshakespeare.txt"
SWEEP = f"python train.py -m experiment=lr_sensitivity_cpu {DATA}"
GRID7 = [3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]
MITIGATION_LRS = [3e-3, 3e-2, 3e-1]
NORM_LRS = [1e-3, 1e-2, 1e-1]
# The previous version of this page: the same command and seeds on another 2-core machine (6-lr grid),
# the seed means it printed, kept to show how far a run moves between machines.
PREVIOUS_MACHINE = {
    ("sqrt_dk", False): {1e-3: 2.070, 3e-3: 1.992, 1e-2: 2.067, 3e-2: 2.549, 1e-1: 2.915, 3e-1: 3.118},
    ("none", False): {1e-3: 2.020, 3e-3: 2.048, 1e-2: 2.358, 3e-2: 2.762, 1e-1: 3.020, 3e-1: 3.108},
    ("sqrt_dk", True): {1e-3: 2.027, 3e-3: 1.991, 1e-2: 2.012, 3e-2: 2.099, 1e-1: 2.113, 3e-1: 2.147},
    ("none", True): {1e-3: 2.059, 3e-3: 2.019, 1e-2: 2.038, 3e-2: 2.082, 1e-1: 2.124, 3e-1: 2.164},
}


FIGURES = {}  # what other pages quote (docs/stability.json: tools/claims.py's A5 and C7 read it)


# ----------------------------------------------------------------------------- reading the runs

class Runs:
    """Every run under RUNS, each a lab/lr_view Point with its experiment (its sweep dir's name) and config."""

    def __init__(self, roots):
        self.rows, self.unfinished = [], []
        for root in [roots] if isinstance(roots, Path) else roots:
            for run in find_runs([root]):
                s = summarize(run)
                if s.config.get("train.lr") is None:
                    continue
                if not (run / "results.json").is_file():  # still running, or killed before its end: not a figure yet
                    self.unfinished.append(run)
                    continue
                self.rows.append({"exp": run.relative_to(root).parts[0], "config": s.config, "point": point(s),
                                  "info": read_json(run / "run_info.json"), "seconds": wall_seconds(run)})

    def have(self, *exps) -> bool:
        return all(any(r["exp"] == e for r in self.rows) for e in exps)

    def points(self, exps, **where) -> list:
        """Points of the runs in the experiments `exps` whose config has every key=value of `where`
        (keys with __ for dots: model__attn__qk_norm=True)."""
        exps = [exps] if isinstance(exps, str) else exps
        want = {k.replace("__", "."): v for k, v in where.items()}
        return [r["point"] for r in self.rows if r["exp"] in exps
                and all(r["config"].get(k) == v for k, v in want.items())]

    def cost(self, exps) -> tuple:
        """(runs, minutes of one core summed over them) of the experiments."""
        rows = [r for r in self.rows if r["exp"] in exps]
        return len(rows), sum(r["seconds"] or 0 for r in rows) / 60


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+\]")


def wall_seconds(run: Path):
    """A run's wall time: its train.log's first to last timestamp (None without one)."""
    try:
        stamps = [m.group(1) for line in (run / "train.log").read_text().splitlines() for m in [STAMP.match(line)] if m]
    except OSError:
        return None
    if len(stamps) < 2:
        return None
    t = [datetime.strptime(s, "%Y-%m-%d %H:%M:%S") for s in (stamps[0], stamps[-1])]
    return (t[1] - t[0]).total_seconds()


# ----------------------------------------------------------------------------- figures

def at(points, lr) -> list:
    return [p for p in points if math.isclose(p.lr, lr, rel_tol=1e-9)]


def by_seed(points) -> dict:
    return {p.replicate: p.counted for p in points if p.counted is not None}


def mean_cell(points) -> str:
    """'mean ± h' of the counted losses, † per diverged run, ‡ per run at the unigram loss."""
    d = describe([p.counted for p in points if p.counted is not None])
    if d["mean"] is None:
        return "-"
    s = f"{d['mean']:.3f}" + (f" ± {d['half']:.3f}" if d["half"] is not None else " (one run)")
    return s + " †" * sum(p.diverged for p in points) + " ‡" * sum(p.outcome == "unigram" for p in points)


def mean(points):
    return describe([p.counted for p in points if p.counted is not None])["mean"]


def diff(a_points, b_points) -> dict:
    """b minus a, paired by seed: {"diff", "half", "lo", "hi"} (Nones where it cannot be given)."""
    a, b = by_seed(a_points), by_seed(b_points)
    c = replicate_interval(a, b)
    if not c:
        return {"diff": None, "half": None, "lo": None, "hi": None}
    return {"diff": c["diff"], "half": c["half"], "lo": c["diff"] - c["half"], "hi": c["diff"] + c["half"]}


def signed(x: float) -> str:
    """+0.123 / -0.123, and 0.000 for what rounds to zero (no '-0.000')."""
    return "0.000" if abs(x) < 5e-4 else f"{x:+.3f}"


def says(d: dict, unit: str = " nats") -> str:
    """A difference in words: '+0.123 nats (95%: +0.1 to +0.15)' and 'within noise' when 0 is inside."""
    if d["diff"] is None:
        return "no interval (fewer than two seeds)"
    noise = ", within noise" if d["lo"] <= 0 <= d["hi"] else ""
    return f"{signed(d['diff'])}{unit} (95%: {signed(d['lo'])} to {signed(d['hi'])}{noise})"


def sensitivity(points, lrs=None) -> dict:
    """Wortsman et al.'s LR sensitivity per seed over `lrs` (all the arm's lrs if None): describe() of it,
    and the per-seed values under "seeds"."""
    arm = LrArm("", points)
    per = arm.per_seed_sensitivity(lrs)
    return {**describe(list(per.values())), "seeds": per}


def sens_diff(a_points, b_points, lrs) -> dict:
    a, b = sensitivity(a_points, lrs)["seeds"], sensitivity(b_points, lrs)["seeds"]
    c = replicate_interval(a, b)
    return {"diff": c["diff"], "half": c["half"], "lo": c["diff"] - c["half"], "hi": c["diff"] + c["half"]} \
        if c else {"diff": None, "half": None, "lo": None, "hi": None}


def interval(d: dict, spec=".3f") -> str:
    if d["mean"] is None:
        return "-"
    return format(d["mean"], spec) + (f" ± {d['half']:{spec}}" if d["half"] is not None else " (one seed)")


def largest_logit(points):
    v = [p.logit_max for p in points if p.logit_max is not None]
    return max(v) if v else None


def lowest_entropy(points):
    v = [p.entropy_min for p in points if p.entropy_min is not None]
    return min(v) if v else None


def g(v, spec=".3g") -> str:
    """A figure in a sentence: 6.6e4, 4,490, 31.7, 0.0304, 2.0e-7."""
    if v is None:
        return "-"
    if v >= 1e4:
        return f"{v:.2g}".replace("e+0", "e").replace("e+", "e")
    if v >= 1e3:
        return f"{v:,.0f}"
    if 0 < v < 1e-3:
        return f"{v:.1e}".replace("e-0", "e-")
    return format(v, spec)


def edge_text(points) -> str:
    e = LrArm("", points).edge()
    if e["n"] and e["whole"] == e["n"]:
        return "the whole grid"
    if e["lr"] is None:
        return "-"
    return f"{e['lr']:.2g}" + (f" ({e['lo']:.2g} to {e['hi']:.2g})" if e["lo"] is not None else " (one seed)")


def best(points, lrs):
    """(lr, mean) of the lowest seed-mean loss over lrs."""
    return min(((lr, mean(at(points, lr))) for lr in lrs if at(points, lr)), key=lambda x: x[1])


def best_per_seed(points) -> dict:
    """{seed: its lowest loss over the grid}: the best loss each seed reached, wherever its best lr was."""
    out = {}
    for p in points:
        if p.counted is not None:
            out[p.replicate] = min(out.get(p.replicate, math.inf), p.counted)
    return out


def outcome_counts(points) -> str:
    kinds = {}
    for p in points:
        kinds[p.outcome] = kinds.get(p.outcome, 0) + 1
    return ", ".join(f"{n} {k}" for k, n in sorted(kinds.items(), key=lambda x: -x[1]))


def lr_name(lr) -> str:
    return f"{lr:.0e}".replace("e-0", "e-")


def lr_head(lrs) -> str:
    return " | ".join(f"lr {lr_name(lr)}" for lr in lrs)


# ----------------------------------------------------------------------------- the sections

def header(runs: Runs) -> list:
    infos = [r["info"] for r in runs.rows]
    commits = sorted({i["git_commit"][:10] for i in infos if i.get("git_commit")})
    unrecorded = sum(not i.get("git_commit") for i in infos)
    dirty = sum(bool(i.get("git_dirty")) for i in infos)
    threads = sorted({i.get("cpu_threads") for i in infos if i.get("cpu_threads") is not None})
    hosts = sorted({i.get("hostname") for i in infos if i.get("hostname")})
    torch_v = sorted({i.get("torch") for i in infos if i.get("torch")})
    py = sorted({i.get("python") for i in infos if i.get("python")})
    cpu = cpu_name() if hosts == [platform.node()] else "not recorded"
    n, minutes = runs.cost([r["exp"] for r in runs.rows])
    still = f" {len(runs.unfinished)} more have no results.json yet and are left out." if runs.unfinished else ""
    return [
        "## Measured so far",
        "",
        f"Written by `python scripts/stability_page.py RUNS` from {n} run dirs. Runs: commit "
        f"{', '.join(commits)}{f' ({unrecorded} runs recorded none)' if unrecorded else ''}"
        f"{f' ({dirty} from a tree with changes)' if dirty else ''}; machine {', '.join(hosts) or '-'} "
        f"({cpu}); {'/'.join(map(str, threads)) or '-'} CPU thread per run, two runs at a time on 2 cores; torch "
        f"{', '.join(torch_v)}, Python {', '.join(py)}; {minutes:.0f} minutes of one core in all. Every run: 4 × 4 × 128 "
        "(d_k 32), tiny shakespeare, block 64, batch 16, 400 steps, warmup 30, cosine to lr/10, AdamW, clip 1.0, "
        "seeds 1, 2, 3, unless a row says otherwise. A loss is the final val loss over the whole val split; "
        "\"± h\" the 95% t-half-interval of the mean over the 3 seeds; a difference is paired by seed, with its "
        "95% interval; a run that diverged counts at its step-0 loss (†), ‡ marks a run that ended at the val "
        "split's unigram loss (it learned token frequencies only); the largest logit is the max over the runs of "
        "each run's largest probed attention logit, the lowest entropy the min over runs of each run's lowest "
        "probed layer-mean entropy." + still,
        "",
    ]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU not known"


def cost_line(runs: Runs, exps) -> str:
    n, minutes = runs.cost(exps)
    return f"{n} runs, {minutes:.0f} minutes of one core ({minutes / 2:.0f} of wall time on 2 cores, two runs at a time)"


def section_lr(runs: Runs, docs: Path) -> list:
    if not runs.have("e1_noqkn", "e1_qkn"):
        return ["### (1) Scale × QK-Norm over the learning rate", "", "Not on this page: RUNS has no e1_noqkn and e1_qkn.", ""]
    arms = [("1/√d_k, no QK-Norm", runs.points("e1_noqkn", model__attn__scale="sqrt_dk")),
            ("no scale, no QK-Norm", runs.points("e1_noqkn", model__attn__scale="none")),
            ("1/√d_k, QK-Norm (RMS, no gain)", runs.points("e1_qkn", model__attn__scale="sqrt_dk")),
            ("no scale, QK-Norm (RMS, no gain)", runs.points("e1_qkn", model__attn__scale="none"))]
    if runs.have("qk_layernorm"):
        arms.append(("1/√d_k, qk-layernorm with gain (Wortsman et al.)", runs.points("qk_layernorm")))
    base, qkn = arms[0][1], arms[2][1]
    grid = GRID7
    lines = ["### (1) Scale × QK-Norm over the learning rate (3 seeds, Wortsman et al.'s 7 lrs)", "",
             f"`{SWEEP}` (the four arms: {cost_line(runs, ['e1_noqkn', 'e1_qkn'])}); the qk-layernorm arm is "
             f"`{SWEEP} model.attn.qk_norm=true model.attn.qk_norm_type=layer model.attn.qk_norm_gain=channel "
             f"model.attn.scale=sqrt_dk seed=1,2,3` ({cost_line(runs, ['qk_layernorm'])}; its gains start at 1). Then "
             "`python tools/report.py` on a sweep prints the same table and plots.", "",
             f"| arm | {lr_head(grid)} | LR sensitivity | edge lr (95%) | largest logit |",
             "|---|" + "---|" * (len(grid) + 3)]
    for label, pts in arms:
        cells = [mean_cell(at(pts, lr)) for lr in grid]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {interval(sensitivity(pts))} | {edge_text(pts)} | "
                     f"{g(largest_logit(pts))} |")
    lines += ["", f"LR sensitivity (Wortsman et al. 2023): per seed, the mean over the grid of min(L(lr), L0) − L*, L0 "
              "the step-0 val loss, L* the seed's best; edge lr: per seed the largest lr within "
              f"{EDGE_NATS} nats of that seed's best (fixed before the runs), interpolated in log-lr, then the "
              "geometric mean over seeds with its 95% interval. Outcomes: "
              + "; ".join(f"{label}: {outcome_counts(pts)}" for label, pts in arms) + ".", ""]
    with tempfile.TemporaryDirectory() as tmp:  # lab/lr_view.plot names its files for a report dir
        plot([LrArm(label, pts) for label, pts in arms], Path(tmp))
        for name in ("loss_vs_lr", "logit_entropy_steps"):
            shutil.copyfile(Path(tmp) / f"{name}.png", docs / f"stability_{name}.png")
    lines += ["![loss and largest logit against lr](stability_loss_vs_lr.png)", ""]

    missing = incomplete(arms, grid)
    if missing:
        return lines + [f"The comparisons are left out until every arm has 3 seeds at every lr; missing: {missing}.", ""]
    six = grid[1:]
    s_base, s_qkn = sensitivity(base), sensitivity(qkn)
    d_qkn = sens_diff(base, qkn, grid)
    d_none_qkn = sens_diff(base, arms[3][1], grid)
    d_none = sens_diff(base, arms[1][1], grid)
    FIGURES["lr_sensitivity"] = {"grid": grid, "seeds": s_base["n"], "no_qk_norm": [s_base["mean"], s_base["half"]],
                                 "qk_norm": [s_qkn["mean"], s_qkn["half"]],
                                 "qk_norm_minus_none": [d_qkn["diff"], d_qkn["lo"], d_qkn["hi"]],
                                 "largest_logit": {"no_qk_norm": largest_logit(base), "qk_norm": largest_logit(qkn)}}
    ratio7 = s_base["mean"] / s_qkn["mean"]
    ratio6 = sensitivity(base, six)["mean"] / sensitivity(qkn, six)["mean"]
    b_best, q_best = best(base, grid), best(qkn, grid)
    best_diff = diff_dicts(best_per_seed(base), best_per_seed(qkn))
    hi = grid[-1]
    lines += [
        f"- **QK-Norm lowers the LR sensitivity**: {interval(s_qkn)} against {interval(s_base)} without it, "
        f"difference {says(d_qkn)}; without the scale, {says(d_none_qkn)} against the same baseline. The ratio "
        f"of the means ({ratio7:.1f}× over the 7 lrs, {ratio6:.1f}× over the 6 from 1e-3) is a property of the grid: "
        "a sensitivity is a mean over the lrs swept. At lr "
        f"{lr_name(hi)} QK-Norm's seed-mean loss is {mean(at(qkn, hi)) - q_best[1]:.2f} nats above its best seed-mean, "
        f"the unnormed arm's {mean(at(base, hi)) - b_best[1]:.2f} above its own.",
        f"- **Its best loss, at this length**: with 1/√d_k the best seed-mean is {b_best[1]:.3f} at lr {lr_name(b_best[0])} "
        f"without QK-Norm and {q_best[1]:.3f} at {lr_name(q_best[0])} with it; each seed's best over the grid, QK-Norm "
        f"minus none: {says(best_diff)}.",
        "- **√d_k without QK-Norm**: dropping the scale changes the sensitivity by "
        f"{says(d_none)}; paired at equal lr, no scale minus 1/√d_k: "
        + "; ".join(f"{lr_name(lr)}: {says(diff(at(base, lr), at(arms[1][1], lr)))}" for lr in grid) + ". "
        + sides(base, arms[1][1], grid, "no scale"),
        "- **√d_k with QK-Norm**: no scale minus 1/√d_k at equal lr: "
        + "; ".join(f"{lr_name(lr)}: {says(diff(at(qkn, lr), at(arms[3][1], lr)))}" for lr in grid)
        + ". The gainless norm caps each logit at scale·hs, "
        f"{1 / math.sqrt(32) * 32:.2f} with 1/√d_k and 32 without; the largest logits reached "
        f"{g(largest_logit(qkn))} and {g(largest_logit(arms[3][1]))}, so part of the flat curve is that cap by "
        "construction.",
        "- **What goes wrong without QK-Norm is collapse**: the largest attention logit (max over runs) per lr "
        + ", ".join(f"{g(largest_logit(at(base, lr)))} ({lr_name(lr)})" for lr in grid)
        + "; the lowest layer entropy (min over runs) "
        + ", ".join(f"{g(lowest_entropy(at(base, lr)))}" for lr in grid)
        + " nats. With QK-Norm: largest logit ≤ " + g(largest_logit(qkn)) + ", lowest entropy ≥ "
        + g(lowest_entropy(qkn)) + " nats at every lr. Outcomes as listed under the table.",
    ]
    if runs.have("qk_layernorm"):
        ln = arms[4][1]
        lines += [
            f"- **qk-layernorm with its gain** (Wortsman et al.'s arm): sensitivity {interval(sensitivity(ln))}; "
            f"against gainless QK-Norm {says(sens_diff(qkn, ln, grid))}; against no QK-Norm "
            f"{says(sens_diff(base, ln, grid))}. The gain takes back part of the bound: largest logit per lr "
            + ", ".join(f"{g(largest_logit(at(ln, lr)))} ({lr_name(lr)})" for lr in grid[-3:])
            + f", lowest entropy {g(lowest_entropy(at(ln, hi)))} nats at {lr_name(hi)}; its loss at {lr_name(hi)} minus gainless "
            f"QK-Norm's: {says(diff(at(qkn, hi), at(ln, hi)))}."]
    lines += ["", "![largest logit and entropy over the steps at one lr](stability_logit_entropy_steps.png)", ""]
    lines += previous_machine(arms[:4])
    return lines


def sides(a_points, b_points, lrs, name: str) -> str:
    """Where b is ahead of a and where behind (the intervals that exclude 0), in words."""
    ahead = [lr_name(lr) for lr in lrs if (d := diff(at(a_points, lr), at(b_points, lr)))["hi"] is not None and d["hi"] < 0]
    behind = [lr_name(lr) for lr in lrs if (d := diff(at(a_points, lr), at(b_points, lr)))["lo"] is not None and d["lo"] > 0]
    return (f"So {name} is ahead at lr {', '.join(ahead) or 'none'} and behind at {', '.join(behind) or 'none'} "
            "(intervals that exclude 0); elsewhere within noise.")


def incomplete(arms, lrs, seeds=3) -> str:
    """'' when every arm has `seeds` runs at each lr, else which (arm, lr) cells are short."""
    short = [f"{label} at {lr_name(lr)} ({len(at(pts, lr))} runs)" for label, pts in arms for lr in lrs
             if len(at(pts, lr)) < seeds]
    return "; ".join(short)


def diff_dicts(a: dict, b: dict) -> dict:
    c = replicate_interval(a, b)
    return {"diff": c["diff"], "half": c["half"], "lo": c["diff"] - c["half"], "hi": c["diff"] + c["half"]} \
        if c else {"diff": None, "half": None, "lo": None, "hi": None}


def previous_machine(arms) -> list:
    """How far the seed means moved from the previous page's (another machine, same command and seeds)."""
    keys = [("sqrt_dk", False), ("none", False), ("sqrt_dk", True), ("none", True)]
    moved = {}
    for (label, pts), key in zip(arms, keys):
        for lr, old in PREVIOUS_MACHINE[key].items():
            m = mean(at(pts, lr))
            if m is not None:
                moved.setdefault(lr, []).append(abs(m - old))
    if not moved:
        return []
    low = [v for lr, vs in moved.items() if lr <= 3e-3 for v in vs]
    high = [v for lr, vs in moved.items() if lr >= 3e-2 for v in vs]
    return ["**Across machines.** The previous version of this page ran the same command and seeds on another "
            "2-core machine (6 lrs). Its seed means and these differ by at most "
            f"{max(low):.3f} nats at lr ≤ 3e-3 (the 8 cells there) and by up to {max(high):.3f} at lr ≥ 3e-2 "
            f"(median {statistics.median(high):.3f}, 16 cells): at high lr a run amplifies the last bits of "
            "floating point, so the same seed need not reproduce on another CPU; compare arms run on one machine, "
            "paired by seed.", ""]


def section_mitigations(runs: Runs) -> list:
    exps = ["e2_zloss", "e2_indep", "e2_softcap", "e2_qkn_softcap"]
    if not runs.have("e1_noqkn", "e1_qkn", *exps):
        return ["### (2) The mitigations side by side", "", "Not on this page: RUNS lacks one of " + ", ".join(exps) + ".", ""]
    base = runs.points("e1_noqkn", model__attn__scale="sqrt_dk")
    rows = [("none (baseline; (1)'s runs)", base),
            ("`train.z_loss=1e-4` (PaLM)", runs.points("e2_zloss")),
            ("`train.weight_decay_mode=independent train.weight_decay=1e-4`", runs.points("e2_indep")),
            ("`model.attn.softcap=50` (Gemma 2)", runs.points("e2_softcap"))]
    if runs.have("gain_head"):
        rows.append(("`model.attn.qk_norm=true model.attn.qk_norm_gain=head`", runs.points("gain_head")))
    qkn = runs.points("e1_qkn", model__attn__scale="sqrt_dk")
    rows += [("`model.attn.qk_norm=true` ((1)'s runs)", qkn),
             ("`model.attn.qk_norm=true model.attn.softcap=50`", runs.points("e2_qkn_softcap"))]
    lrs, hi = MITIGATION_LRS, MITIGATION_LRS[-1]
    lines = ["### (2) The mitigations side by side (3 seeds)", "",
             f"1/√d_k, lr {' / '.join(f'{lr_name(lr)}' for lr in lrs)}, one override per arm, e.g. `{SWEEP} "
             "model.attn.qk_norm=false model.attn.scale=sqrt_dk train.lr=3e-3,3e-2,3e-1 train.z_loss=1e-4` "
             f"({cost_line(runs, exps + (['gain_head'] if runs.have('gain_head') else []))}). Each cell: the loss, "
             "then the arm minus the baseline at that lr (paired by seed, 95% interval).", "",
             f"| arm | {lr_head(lrs)} | largest logit at {lr_name(hi)} | lowest entropy at {lr_name(hi)} |", "|---|---|---|---|---|---|"]
    for label, pts in rows:
        cells = []
        for lr in lrs:
            c = mean_cell(at(pts, lr))
            if pts is not base:
                d = diff(at(base, lr), at(pts, lr))
                c += f"<br>{signed(d['diff'])} ({signed(d['lo'])} to {signed(d['hi'])})" if d["diff"] is not None else ""
            cells.append(c)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {g(largest_logit(at(pts, hi)))} | "
                     f"{g(lowest_entropy(at(pts, hi)))} |")
    z, dec, cap = rows[1][1], rows[2][1], rows[3][1]
    qcap = rows[-1][1]
    lines += ["",
              "- z-loss and lr-independent decay against the baseline: "
              + "; ".join(f"{name} at {lr_name(lr)} {says(diff(at(base, lr), at(pts, lr)))}"
                          for name, pts in (("z-loss", z), ("decay", dec)) for lr in lrs)
              + ". Neither acts on attention's logits: the z-loss on the output softmax's (here beside coupled decay "
              "0.1), independent decay of 1e-4 shrinks weights by at most 4% over 400 steps. The z-loss where it "
              "can act, without coupled decay, is in [practice.md](practice.md) (4); decay over longer runs is not run "
              "yet.",
              f"- The soft-cap of 50 against the baseline: {'; '.join(f'{lr_name(lr)} {says(diff(at(base, lr), at(cap, lr)))}' for lr in lrs)}; "
              f"against QK-Norm: {'; '.join(f'{lr_name(lr)} {says(diff(at(qkn, lr), at(cap, lr)))}' for lr in lrs)}. It holds "
              f"every logit at 50 (largest {g(largest_logit(cap))}), and a cap of 50 at d_k 32 still lets a head be nearly "
              f"one-hot: the lowest layer entropy over its runs is {g(lowest_entropy(cap))} nats.",
              f"- QK-Norm with the soft-cap minus QK-Norm: {'; '.join(f'{lr_name(lr)} {says(diff(at(qkn, lr), at(qcap, lr)))}' for lr in lrs)}. "
              f"With gainless QK-Norm no logit passes √d_k = 5.66, far under the cap."]
    if runs.have("gain_head"):
        gain = rows[4][1]
        lines += [f"- A learned per-head gain minus gainless QK-Norm: "
                  f"{'; '.join(f'{lr_name(lr)} {says(diff(at(qkn, lr), at(gain, lr)))}' for lr in lrs)}. It gives part of the "
                  f"bound back: largest logit {g(largest_logit(at(gain, hi)))} at {lr_name(hi)}, lowest entropy "
                  f"{g(lowest_entropy(at(gain, hi)))} nats. (Its runs: `{SWEEP} model.attn.qk_norm=true "
                  "model.attn.qk_norm_gain=head model.attn.scale=sqrt_dk train.lr=3e-3,3e-2,3e-1 seed=1,2,3`, made "
                  "after the gains' init was fixed.)"]
    return lines + [""]


def section_norm(runs: Runs) -> list:
    if not runs.have("e1_noqkn", "e3_postln", "e3_preln_nowarm"):
        return ["### (3) Pre-LN and Post-LN, with and without warmup", "", "Not on this page: RUNS lacks e3_postln or e3_preln_nowarm.", ""]
    pre30 = runs.points("e1_noqkn", model__attn__scale="sqrt_dk")
    pre0 = runs.points("e3_preln_nowarm")
    post30 = runs.points("e3_postln", train__warmup_iters=30)
    post0 = runs.points("e3_postln", train__warmup_iters=0)
    lrs = NORM_LRS
    lines = ["### (3) Pre-LN and Post-LN, with and without warmup (3 seeds)", "",
             f"4 layers, 1/√d_k, no QK-Norm: `{SWEEP} model.attn.qk_norm=false model.attn.scale=sqrt_dk "
             "model.norm_position=post train.warmup_iters=0,30 train.lr=1e-3,1e-2,1e-1` and the same with "
             f"`model.norm_position=pre train.warmup_iters=0` ({cost_line(runs, ['e3_postln', 'e3_preln_nowarm'])}); "
             "Pre-LN with warmup 30 is (1)'s baseline.", "",
             f"| arm | {lr_head(lrs)} |", "|---|---|---|---|"]
    for label, pts in (("Pre-LN, warmup 30", pre30), ("Pre-LN, no warmup", pre0), ("Post-LN, warmup 30", post30),
                       ("Post-LN, no warmup", post0)):
        lines.append(f"| {label} | " + " | ".join(mean_cell(at(pts, lr)) for lr in lrs) + " |")
    uni = [p.outcome == "unigram" for p in post30 + post0]
    FIGURES["norm_position"] = {
        "layers": 4, "seeds": 3, "lrs": lrs, "unigram_runs": sum(uni), "post_ln_runs": len(uni),
        "loss": {name: {lr_name(lr): mean(at(pts, lr)) for lr in lrs}
                 for name, pts in (("pre_ln_warmup30", pre30), ("pre_ln_no_warmup", pre0),
                                   ("post_ln_warmup30", post30), ("post_ln_no_warmup", post0))},
        "unigram": {name: {lr_name(lr): sum(p.outcome == "unigram" for p in at(pts, lr)) for lr in lrs}
                    for name, pts in (("post_ln_warmup30", post30), ("post_ln_no_warmup", post0))}}
    lines += ["",
              "- Post-LN minus Pre-LN (warmup 30): " + "; ".join(f"{lr_name(lr)} {says(diff(at(pre30, lr), at(post30, lr)))}" for lr in lrs)
              + f". {sum(uni)} of the {len(uni)} Post-LN runs ended at the unigram loss (‡): they learned token "
              "frequencies and nothing else, a plateau under the step-0 loss that the divergence rule does not call "
              "diverged.",
              "- Warmup 30 minus none: Pre-LN " + "; ".join(f"{lr_name(lr)} {says(diff(at(pre0, lr), at(pre30, lr)))}" for lr in lrs)
              + "; Post-LN " + "; ".join(f"{lr_name(lr)} {says(diff(at(post0, lr), at(post30, lr)))}" for lr in lrs) + ".",
              early_line(pre0, pre30, 1e-2),
              "- Text C's C7 (Pre-LN trains deep stacks more stably) holds here in the form \"Pre-LN takes the higher "
              "lr\"; Xiong et al.'s \"Post-LN needs warmup\" is not shown at 4 layers, where a 30-step warmup does not "
              "rescue Post-LN at 1e-2 and it is not needed at 1e-3.", ""]
    return lines


def first_probe(p, step=50):
    """(largest logit, lowest layer-mean entropy) at the probe of `step` of a run's metrics, or None."""
    for m in p.metrics:
        if m.get("step") == step and any(k.startswith("attn_logit_max/L") for k in m):
            return (max(v for k, v in m.items() if k.startswith("attn_logit_max/L")),
                    min(v for k, v in m.items() if k.startswith("attn_entropy/L") and k.count("/") == 1))
    return None


def early_line(cold, warm, lr) -> str:
    """Pre-LN's warmup at lr, read at the first probe after the start: how fast the logits grew."""
    a = [x for p in at(cold, lr) for x in [first_probe(p)] if x]
    b = [x for p in at(warm, lr) for x in [first_probe(p)] if x]
    if not a or not b:
        return "- (no probe at step 50 in these runs)"
    span = lambda xs, i, f: f"{f(min(x[i] for x in xs))}-{f(max(x[i] for x in xs))}"  # noqa: E731
    return (f"- Why Pre-LN wants warmup at {lr_name(lr)}: at the first probe (step 50) the largest attention logit is "
            f"{span(a, 0, g)} without warmup against {span(b, 0, g)} with it, and the lowest layer entropy "
            f"{span(a, 1, g)} nats against {span(b, 1, g)} (ranges over the 3 seeds): without warmup the first steps "
            "take the full lr, the logits grow faster and a layer's attention collapses sooner, the same growth (1) "
            "shows over the lr; with warmup it comes too, later.")


def section_depth(runs: Runs) -> list:
    if not runs.have("e1_noqkn", "e4_depth"):
        return ["### (4) Depth", "", "Not on this page: RUNS has no e4_depth.", ""]
    lrs = NORM_LRS
    depth = {2: runs.points("e4_depth", model__n_layer=2),
             4: [p for p in runs.points("e1_noqkn", model__attn__scale="sqrt_dk") if p.lr in lrs],
             8: runs.points("e4_depth", model__n_layer=8)}
    lines = ["### (4) Depth (3 seeds)", "",
             f"1/√d_k, no QK-Norm, `{SWEEP} model.attn.qk_norm=false model.attn.scale=sqrt_dk model.n_layer=2,8 "
             f"train.lr=1e-3,1e-2,1e-1` beside (1)'s 4 layers ({cost_line(runs, ['e4_depth'])}):", "",
             f"| layers | {lr_head(lrs)} | LR sensitivity over these 3 lrs | largest logit at 1e-1 |", "|---|---|---|---|---|---|"]
    for n, pts in depth.items():
        lines.append(f"| {n} | " + " | ".join(mean_cell(at(pts, lr)) for lr in lrs)
                     + f" | {interval(sensitivity(pts, lrs))} | {g(largest_logit(at(pts, 1e-1)))} |")
    lines += ["",
              f"- 8 layers minus 2, LR sensitivity over the three lrs: {says(sens_diff(depth[2], depth[8], lrs))}; the "
              "loss at each lr: " + "; ".join(f"{lr_name(lr)} {says(diff(at(depth[2], lr), at(depth[8], lr)))}" for lr in lrs)
              + ". Wortsman et al.'s trend, sensitivity growing with model size, comes from a range of sizes; "
              "between 2 and 8 layers at this width it is within noise here. The width axis is in "
              "[practice.md](practice.md) (2).", ""]
    return lines


def section_warmup(runs: Runs) -> list:
    """The cell where Post-LN needs warmup (8 layers, lr 3e-3), with each block's gradient norm early on."""
    if not runs.have("p3_postln8"):
        return []
    cells = {(pos, w): runs.points("p3_postln8", model__norm_position=pos, train__warmup_iters=w)
             for pos in ("pre", "post") for w in (0, 100)}
    lines = ["### (5) Post-LN needs warmup: 8 layers, lr 3e-3 (3 seeds)", "",
             f"`{SWEEP} model.attn.qk_norm=false model.attn.scale=sqrt_dk model.n_layer=8 "
             "model.norm_position=pre,post train.warmup_iters=0,100 train.lr=3e-3 seed=1,2,3 train.log_layer_grads=true "
             f"train.log_interval=5` ({cost_line(runs, ['p3_postln8'])}): the cell a one-seed pilot found, where 4 "
             "layers had trained either way. Xiong et al. (2020) find that Post-LN's gradients near the output are "
             "large at initialisation, so a large lr without warmup breaks it, while Pre-LN's are even across "
             "layers. Final loss:", "",
             "| | warmup 0 | warmup 100 | warmup 100 minus 0 |", "|---|---|---|---|"]
    for pos, name in (("pre", "Pre-LN"), ("post", "Post-LN")):
        lines.append(f"| {name} | {mean_cell(cells[pos, 0])} | {mean_cell(cells[pos, 100])} | "
                     f"{says(diff(cells[pos, 0], cells[pos, 100]))} |")
    early = {}
    for key, pts in cells.items():
        per_layer = {}
        for p in pts:
            for m in p.metrics:
                if 0 < m.get("step", 0) <= 50:
                    for k, v in m.items():
                        if k.startswith("aux/grad_norm/L"):
                            per_layer.setdefault(int(k.rsplit("L", 1)[1]), []).append(v)
        early[key] = {l: statistics.fmean(v) for l, v in sorted(per_layer.items())}
    if all(early.values()):
        n = len(early["pre", 0])
        lines += ["", "Each block's gradient norm (before clipping) over steps 5-50, the mean over the logged steps and "
                  "the 3 seeds, first block to last:", "",
                  "| | " + " | ".join(f"L{l}" for l in range(n)) + " | last / first |", "|---|" + "---|" * (n + 1)]
        for (pos, w), norms in early.items():
            vals = [norms[l] for l in range(n)]
            lines.append(f"| {'Pre' if pos == 'pre' else 'Post'}-LN, warmup {w} | " + " | ".join(f"{v:.3g}" for v in vals)
                         + f" | {vals[-1] / vals[0]:.2g} |")
    at5 = {key: [m for p in pts for m in p.metrics if m.get("step") == 5 and "aux/grad_norm/L0" in m]
           for key, pts in cells.items()}
    if all(at5.values()):
        loss5 = {k: (min(m["train/loss"] for m in v), max(m["train/loss"] for m in v)) for k, v in at5.items()}
        grad5 = {k: statistics.fmean(x for m in v for name, x in m.items() if name.startswith("aux/grad_norm/L"))
                 for k, v in at5.items()}
        lines += ["", "- What the first steps do: at step 5 (the first logged, after five updates) the training loss "
                  "is " + "; ".join(f"{'Pre' if pos == 'pre' else 'Post'}-LN warmup {w}: {a:.2f}-{b:.2f}"
                                     for (pos, w), (a, b) in loss5.items())
                  + " (the unigram loss is ≈ 3.34), and a block's gradient norm averages "
                  + "; ".join(f"{'Pre' if pos == 'pre' else 'Post'}-LN warmup {w}: {x:.3g}" for (pos, w), x in grad5.items())
                  + ". Without warmup the first updates at the full lr take both placements to predicting character "
                  "frequencies within five steps, where the gradients are small; Post-LN stays there in most seeds, "
                  "Pre-LN leaves it later and ends behind its warmed-up runs. The blocks' norms are logged from step 5, "
                  "after the damage: Xiong et al.'s argument is about the gradients at initialisation, which "
                  "[practice.md](practice.md) (3) logs from the first step."]
    post_uni = sum(p.outcome == "unigram" for p in cells["post", 0])
    lines += [f"- Post-LN without warmup ended at the unigram loss in {post_uni} of {len(cells['post', 0])} seeds; "
              f"with 100 warmup steps in {sum(p.outcome == 'unigram' for p in cells['post', 100])} of "
              f"{len(cells['post', 100])}.", ""]
    FIGURES["warmup_8_layers"] = {"lr": 3e-3, "loss": {f"{pos}_warmup{w}": mean(pts) for (pos, w), pts in cells.items()},
                                  "post_no_warmup_unigram": post_uni, "seeds": len(cells["post", 0])}
    return lines


DEPARTURES = """### Where this lab departs from Wortsman et al. 2023

Their defaults as their section 2 states them, against this page's runs:

| | Wortsman et al. | here | what it changes |
|---|---|---|---|
| size | a range of sizes (their result is a trend with size) | 0.8M parameters (4 × 4 × 128); depth 2/8 in (4), widths 64-256 in [practice.md](practice.md) (2) | one size shows the shape of their result, not its trend |
| steps | 1e5, warmup 5e3, cosine to 1e-5 | 400, warmup 30, cosine to lr/10 | losses far from converged (the 2000-step CPU preset reaches 1.57) |
| AdamW | β2 0.95, ε 1e-8, clip 1 | β2 0.99, ε 1e-8, clip 1 | the second moment tracks more slowly at high lr |
| weight decay | independent of the lr, 1e-4 | coupled (lr × 0.1), the lab's default; (2) has one independent arm | decay grows with the lr swept |
| z-loss | 1e-4 in every run | off; (2) has one arm | the output-logit divergence it prevents is not separated here |
| qk-layernorm | in every run: LayerNorm of q and k | the presets' QK-Norm is gainless RMS (its logits ≤ scale·hs); Wortsman's arm is (1)'s last row | part of the presets' flat curve is that cap |
| embeddings | - | tied (input and output share one matrix) | |
| precision | - | fp32 on a CPU | no low-precision overflow: collapse shows without NaN |
| grid | 3e-4 … 3e-1 at half decades | the same 7 lrs in (1); (2)-(4) keep 3 lrs each | a sensitivity over 3 lrs is not comparable with one over 7 |
| data | - | tiny shakespeare, characters | a 65-token vocabulary; the unigram loss is ≈ 3.34 nats |
"""


def page_head(page: Path, marker: str) -> str:
    """The hand-written part of `page`, above `marker` (everything below it is the script's); one line if not there."""
    if not page.is_file():
        raise SystemExit(f"--page {page}: no such file (give the page whose hand-written head ends with the marker)")
    text = page.read_text()
    if marker not in text:
        raise SystemExit(f"{page} has no marker line: add `{marker}` where the measurements start")
    return text.split(marker)[0]


def write(page: Path, runs: Runs):
    head = page_head(page, MARKER)
    body = header(runs) + section_lr(runs, page.parent) + section_mitigations(runs) \
        + section_norm(runs) + section_depth(runs) + section_warmup(runs) + [DEPARTURES]
    page.write_text(head + MARKER + "\n\n" + "\n".join(body).rstrip() + "\n")
    (page.parent / "stability.json").write_text(json.dumps(FIGURES, indent=1) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, help="the dir holding one sweep dir per experiment")
    ap.add_argument("--page", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "stability.md")
    args = ap.parse_args(argv)
    if not args.runs.is_dir():
        raise SystemExit(f"{args.runs} is not a directory: pass the dir holding the experiments' sweep dirs")
    try:
        runs = Runs(args.runs)
    except UserError as e:  # no run dirs under RUNS
        raise SystemExit(f"stability_page.py: {e}") from None
    write(args.page, runs)
    print(f"wrote {args.page} from {len(runs.rows)} runs")


if __name__ == "__main__":
    main()
