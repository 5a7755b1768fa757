"""The ladder's README table and plot, from the run dirs scripts/ladder.sh wrote.

    python scripts/ladder_table.py outputs/ladder [--target 1.886]

One row per ladder row (OUT/<row>/seed<N>/metrics.jsonl): val loss at steps 500/1000/2000 per seed and
their median, the first evaluated step at which val <= target (nanoGPT's final 1.886), the median
ms/iter of the logged training steps (evaluation excluded; under shared load these are noisy, so
they are figures as measured, not a side-by-side timing), and the change of val@2000 against the
row it was built on (OUT/<row>.parent), paired by seed (the same seed draws the same training and
eval batches, so a pair differs by the change, not by the batches; across seeds val@2000 moved by
~0.03 in our runs), median over the seeds both rows have: a row pays when that is below -NOISE.
Writes OUT/ladder_val.png.
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from lab.plots import save_figure  # noqa: E402
from lab.tracking import read_metrics  # noqa: E402

STEPS = (500, 1000, 2000)
NOISE = 0.02  # a paired gain smaller than this at step 2000 is not counted as paying (a judgement: two seeds, no interval)


def run_summary(run_dir: Path, target: float) -> dict:
    metrics = read_metrics(run_dir)
    val = {m["step"]: m["val/loss"] for m in metrics if "val/loss" in m}
    ms = [m["ms_per_iter"] for m in metrics if "ms_per_iter" in m]
    reached = next((s for s in sorted(val) if val[s] <= target), None)
    return {"val": val, "ms": statistics.median(ms) if ms else None, "reached": reached}


def fmt(x, spec=".3f"):
    return "–" if x is None else format(x, spec)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def last_wins(overrides: str) -> str:
    """An override line with each key once, at its last value (as Hydra applies them)."""
    keep = {}
    for item in overrides.split():
        key = item.split("=", 1)[0]
        keep.pop(key, None)
        keep[key] = item
    return " ".join(keep.values())


def read(path: Path, default=""):
    return path.read_text().strip() if path.exists() else default


def rows(out: Path, target: float):
    """[(row name, parent row, overrides line, {seed: summary})] in row order (the names sort as the ladder)."""
    found = []

    def order(p):  # 2_x < 10_y: the number before the first "_", then the rest (4 < 4a < 4b)
        number, _, rest = p.name.partition("_")
        digits = number.rstrip("abcdefghijklmnopqrstuvwxyz")
        return (int(digits) if digits.isdigit() else float("inf"), number, rest)

    for row_dir in sorted((p for p in out.iterdir() if p.is_dir()), key=order):
        seeds = {p.name.removeprefix("seed"): run_summary(p, target)
                 for p in sorted(row_dir.glob("seed*")) if (p / "metrics.jsonl").exists()}
        if seeds:
            overrides = read(out / f"{row_dir.name}.overrides", ":").split(":", 1)[1].strip()
            found.append((row_dir.name, read(out / f"{row_dir.name}.parent", "-"), overrides, seeds))
    return found


def table(found, target: float) -> str:
    lines = [f"| row | seed | val@500 | val@1000 | val@2000 | val ≤ {target} at step | ms/iter | Δ val@2000 vs parent, paired |",
             "|---|---|---|---|---|---|---|---|"]
    final = {}  # row -> {seed: val@2000}
    for name, parent, _, seeds in found:
        for seed, s in seeds.items():
            lines.append(f"| {name} | {seed} | " + " | ".join(fmt(s['val'].get(k)) for k in STEPS)
                         + f" | {fmt(s['reached'], 'd')} | {fmt(s['ms'], '.1f')} | |")
        med = [median([s["val"].get(k) for s in seeds.values()]) for k in STEPS]
        final[name] = {seed: s["val"].get(STEPS[-1]) for seed, s in seeds.items()}
        reached = median([s["reached"] for s in seeds.values()]) if all(s["reached"] for s in seeds.values()) else None
        base = final.get(parent, {})
        pairs = [v - base[seed] for seed, v in final[name].items() if v is not None and base.get(seed) is not None]
        delta, plural = median(pairs), "s" if len(pairs) > 1 else ""
        verdict = "" if delta is None else (" paid" if delta <= -NOISE else " did not pay" if delta >= 0
                                            else " within noise")
        lines.append(f"| **{name}** | median of {len(seeds)} | " + " | ".join(f"**{fmt(v)}**" for v in med)
                     + f" | {fmt(reached, '.0f')} | {fmt(median([s['ms'] for s in seeds.values()]), '.1f')}"
                     + f" | {fmt(delta, '+.3f')}{f' ({len(pairs)} seed{plural})' if pairs else ''}{verdict} |")
    return "\n".join(lines)


def plot(found, path: Path, target: float):
    import matplotlib.pyplot as plt

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.5))
    built_on = {parent for _, parent, _, _ in found}  # rows another row adds to: the ladder's path, in colour
    path_rows = [name for name, *_ in found if name in built_on]
    leaf_label = "rows nothing was built on (see the table)"
    for name, _, _, seeds in found:
        on_path = name in built_on
        for j, s in enumerate(seeds.values()):
            steps = sorted(s["val"])
            label = (name if on_path else leaf_label) if j == 0 else None
            leaf_label = leaf_label if on_path or label is None else None  # one legend entry for all leaves
            for a in (ax, zoom):
                a.plot(steps, [s["val"][k] for k in steps], "-", lw=1.6 if on_path else 0.8,
                       color=f"C{path_rows.index(name) % 10}" if on_path else "0.7", alpha=0.9,
                       label=label, zorder=3 if on_path else 2)
    for a in (ax, zoom):
        a.axhline(target, color="k", ls=":", lw=1, label=f"nanoGPT's final val {target}" if a is ax else None)
        a.set(xlabel="step", ylabel="val loss (nats/char)")
        a.grid(alpha=0.3)
    ax.set(title="ladder: val loss (each seed a line)", ylim=(1.4, 2.6))
    zoom.set(title="steps 1000-2000", xlim=(1000, 2000), ylim=(1.45, 1.85))
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the ladder's output dir (scripts/ladder.sh's second argument)")
    parser.add_argument("--target", type=float, default=1.886, help="val loss to reach (nanoGPT's final)")
    args = parser.parse_args(argv)
    found = rows(args.out, args.target)
    if not found:
        sys.exit(f"error: no ladder runs under {args.out}")
    print(table(found, args.target))
    print()
    print(f"Commands (each run also with `{read(args.out / 'common.overrides')} seed=S "
          f"hydra.run.dir={args.out}/ROW/seedS`; `bash scripts/ladder.sh` runs them all):")
    for name, _, overrides, _ in found:
        print(f"- {name}: `python train.py {last_wins(overrides)}`")
    print(f"\nplot: {plot(found, args.out / 'ladder_val.png', args.target)}")


if __name__ == "__main__":
    main()
