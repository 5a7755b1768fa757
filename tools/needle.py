"""A window or a choice: can a query still find a key-value pair d positions back? A sliding window
decides by position which keys a query sees, a selection (MoBA, the oracle, a learned indexer) by content;
this probe asks a data=mqar checkpoint for one pair at a set distance and counts how often it answers.

    python tools/needle.py ckpt=outputs/runs/X                                  # distances over the context
    python tools/needle.py ckpt=outputs/runs/X distances=[16,64,128,240] needles=1000
    python tools/needle.py ckpt=outputs/runs/X window=64                        # the same weights through a window
    python tools/needle.py ckpt=outputs/runs/X select=moba select_block=32 select_topk=1
    python tools/needle.py runs=[outputs/multirun/T]                            # every run of a sweep, by arm
    python tools/needle.py runs=[outputs/multirun/T] last=true                  # each run's last weights, not best.pt

The sequences are the task's own layout (data/mqar.py): `kv_pairs` key-value pairs first, then each key
asked once at an even position with its value after it, fillers elsewhere. One key, the needle, is
asked at exactly `d` positions after its pair's key: it appears nowhere else before its query, so
the model can answer only by reaching back d positions (the value it needs sits d - 1 back). Only the
needle's answer is scored: the argmax of the logits at the query against the pair's value. For each
distance, `needles` sequences drawn from `seed` (the same for every checkpoint, so arms compare on the
same needles): the accuracy, n and its 95% Wilson score interval (Wilson 1927).

A stack of n layers that each see their latest W keys cannot carry anything farther than n(W - 1)
positions: each layer moves information at most W - 1 back (its reach). The probe prints it and marks
the distances beyond it, where a window model's answer cannot depend on the needle at all.

window=W reads a checkpoint through a window in every layer (no training; with no softmax layer
nothing is windowed: a warning line); select= through a choice of keys, as tools/eval_lengths.py does.
With runs=, every run's checkpoint is probed and the runs are grouped into arms as tools/report.py
groups them: per arm and distance the mean accuracy over its runs with a 95% t-interval (one run: the
Wilson interval), then each run's. needle.json, needle.md and needle.png (accuracy against distance) go
to `out`.
"""
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, List, Optional

import hydra
from hydra.core.config_store import ConfigStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

from lab.checkpoint import (find_checkpoint, latest_checkpoint, load_checkpoint, model_from_checkpoint,  # noqa: E402
                        with_selection)
from lab.cli import cli, run_app  # noqa: E402
from lab.device import pick_device  # noqa: E402
from files import check_output_dir, default_output  # noqa: E402
from data.mqar import MQARTokenizer  # noqa: E402
from lab.needle_probe import probe, reach, with_window  # noqa: E402
from lab.sampling import NO_SOFTMAX, no_softmax, warn_no_effect  # noqa: E402
from rules import POSITIVE, SEED, OneOf, Range, UserError, check_values  # noqa: E402
from variants import SELECTS  # noqa: E402


@dataclass
class NeedleConfig:
    ckpt: Optional[str] = None  # a data=mqar checkpoint file or run dir; default: the newest run under outputs/
    runs: Optional[List[str]] = None  # run or sweep dirs instead of ckpt: every run, grouped into arms by config
    last: bool = False  # a run's newest ckpt_*.pt (the weights it ended with), not its best.pt (lowest val loss)
    distances: Optional[List[int]] = None  # positions from the needle's key to its query (even); unset: 1/16..15/16 of block_size
    needles: int = 500  # sequences per distance, one needle scored in each
    kv_pairs: Optional[int] = None  # key-value pairs per sequence, the needle one of them; unset: the most the run trained on
    seed: int = 0  # the draw of the sequences (each distance its own), the same for every checkpoint
    window: Optional[int] = None  # read through a sliding window of W keys in every layer; unset: the checkpoint's own
    select: Optional[str] = None  # moba | oracle | indexer | none: each query reads only the keys it chooses; unset: the checkpoint's own
    select_topk: Optional[int] = None  # with select: blocks (moba) or keys (oracle) each query reads; unset: its own
    select_block: Optional[int] = None  # with select=moba: keys per block; unset: its own
    batch_size: int = 64  # sequences per forward pass
    device: str = "cpu"
    out: Optional[str] = default_output("needle")  # a dir for needle.json, .md, .png (a new one per call); null: print only

    RULES: ClassVar[dict] = {"distances": Range(2, 2**20, why="the needle's key is at least one pair before its "
                                                "query"), "needles": POSITIVE, "kv_pairs": POSITIVE, "seed": SEED,
                             "window": Range(1, why="keys a query sees, itself included"), "select": OneOf(tuple(SELECTS)),
                             "select_topk": POSITIVE, "select_block": POSITIVE, "batch_size": POSITIVE}


ConfigStore.instance().store(name="base_needle", node=NeedleConfig)


# ----------------------------------------------------------------------------- the distances

def check_distances(distances, length: int, pairs: int):
    """One line for a distance the layout cannot hold: odd (keys sit at even positions), or too far
    (the query must fall inside the `length` tokens)."""
    if 4 * pairs > length + 1:
        raise UserError(f"kv_pairs={pairs} needs sequences of at least {4 * pairs - 1} tokens (each pair once as "
                        f"context and once asked), but the model's block_size is {length}: lower kv_pairs")
    for d in distances:
        if d % 2:
            raise UserError(f"distances: {d} is odd, but mqar puts every key at an even position, so a key is "
                            "asked an even number of positions after its pair: use even distances")
        if d > length - 1:
            raise UserError(f"distances: {d} does not fit in the model's block_size of {length} (a query at most "
                            f"{length - 1 - (length - 1) % 2} positions after its pair): use smaller distances")


def default_distances(length: int) -> list:
    """1/16, 1/8, 1/4, 1/2, 3/4 and 15/16 of the context, each rounded down to an even number."""
    return sorted({max(2, length * a // b // 2 * 2) for a, b in ((1, 16), (1, 8), (1, 4), (1, 2), (3, 4), (15, 16))})


# ----------------------------------------------------------------------------- checkpoints and arms


def attention_label(model) -> str:
    """What each query reads, in a few words: full attention, a window, a selection, other kinds."""
    a = model.config.attn
    kinds = a.layer_kinds or [a.kind]
    if kinds != ["softmax"]:
        return f"layers {kinds}"
    if a.window is not None:
        return f"window {a.window}" + (f" ({a.window_pattern})" if a.window_pattern != "L" else "")
    if a.select == "moba":
        return f"moba B={a.select_block} K={a.select_topk}"
    if a.select in ("oracle", "indexer"):
        return f"{a.select} top {a.select_topk}"
    return "full attention"


def trained_pairs(state) -> Optional[int]:
    """The most key-value pairs the run trained on (data.pairs), or None if the checkpoint does not say."""
    pairs = ((state.get("config") or {}).get("data") or {}).get("pairs")
    return max(pairs) if isinstance(pairs, (list, tuple)) and pairs else pairs


def probe_checkpoint(cfg, path) -> dict:
    """One checkpoint's accuracy at each distance, printed as a table."""
    state = load_checkpoint(path)
    if state["tokenizer"].get("kind") != "mqar":
        raise UserError(f"{path} was trained on {state['tokenizer'].get('kind')} tokens, not data=mqar: the needle "
                        "probe asks mqar keys (train one: python train.py data=mqar)")
    state = with_window(with_selection(state, cfg.select, cfg.select_topk, cfg.select_block), cfg.window)
    model = model_from_checkpoint(state, pick_device(cfg.device)).eval()
    if cfg.window is not None and no_softmax(model):  # gdn, mamba2, linear: nothing for a window to narrow
        warn_no_effect([("window", cfg.window)], model, NO_SOFTMAX)
    c = model.config
    pairs = cfg.kv_pairs or trained_pairs(state)
    if pairs is None:
        raise UserError(f"{path} does not record the pairs it trained on: give kv_pairs=")
    if pairs > MQARTokenizer(c.vocab_size).keys:
        raise UserError(f"kv_pairs={pairs} needs as many distinct keys, but this model's vocabulary has "
                        f"{MQARTokenizer(c.vocab_size).keys}: lower pairs")
    distances = list(cfg.distances) if cfg.distances else default_distances(c.block_size)
    check_distances(distances, c.block_size, pairs)
    far = reach(model)
    rows = probe(model, distances, length=c.block_size, vocab_size=c.vocab_size, needles=cfg.needles, pairs=pairs,
                 seed=cfg.seed, batch_size=cfg.batch_size, far=far)
    values = c.vocab_size - 1 - MQARTokenizer(c.vocab_size).keys
    result = {"ckpt": str(path), "attention": attention_label(model), "n_layer": c.n_layer, "reach": far,
              "block_size": c.block_size, "pairs": pairs, "seed": cfg.seed, "chance": 1 / values, "rows": rows}
    print(f"{path}: {result['attention']}, {c.n_layer} layers; " + (
        f"nothing more than {far} positions back reaches a query ({c.n_layer} x {far // c.n_layer})" if far is not None
        else "any position may reach a query") + f"; {c.block_size} tokens, {pairs} pairs, {cfg.needles} needles "
          f"per distance (seed {cfg.seed}); chance {1 / values:.3f}")
    print(f"{'distance':>9}{'accuracy':>10}   {'95% interval (Wilson)':<24}{'n':>6}")
    for r in rows:
        print(f"{r['distance']:>9}{r['accuracy']:>10.3f}   [{r['low']:.3f}, {r['high']:.3f}]{'':<8}{r['n']:>6}"
              + ("   beyond the reach" if r["beyond"] else ""))
    return result


def checkpoint_of(cfg, where):
    """The checkpoint to probe: a file as given; in a run dir its best.pt, or with last=true its newest
    ckpt_*.pt (a fine-tune that only lost val loss keeps its starting weights as best.pt)."""
    if cfg.last and where and Path(where).is_dir():
        found = latest_checkpoint(Path(where))
        if found is None:
            raise UserError(f"last=true: {where} holds no ckpt_*.pt (a run dir train.py wrote)")
        return found
    return find_checkpoint(str(where) if where else where)


def probe_arms(cfg) -> dict:
    """Every run under cfg.runs probed, grouped into arms (lab/arms.py's grouping, as tools/report.py's): per arm and
    distance the mean accuracy over its runs, sd and 95% t-interval."""
    from lab.intervals import describe
    from lab.arms import find_runs, group_arms, summarize

    table = []
    for arm in group_arms([summarize(r) for r in find_runs(cfg.runs)]):
        per_run = [probe_checkpoint(cfg, checkpoint_of(cfg, r.dir)) for r in arm.runs]
        stats = {}
        for i, row in enumerate(per_run[0]["rows"]):
            stats[row["distance"]] = describe([run["rows"][i]["accuracy"] for run in per_run])
        table.append({"arm": arm.label, "runs": per_run, "accuracy": stats})
    short = [arm["runs"][0]["attention"] for arm in table]  # "window 32": the arms' own words, when they tell them apart
    if len(set(short)) == len(short):
        for arm, name in zip(table, short):
            arm["arm"] = name
    return {"arms": table}


def cell(d: dict, one_run: dict) -> str:
    """mean ± sd [95% t-interval] over runs; one run: its accuracy [Wilson interval]."""
    if d["half"] is None:
        return f"{one_run['accuracy']:.3f} [{one_run['low']:.3f}, {one_run['high']:.3f}]"
    return f"{d['mean']:.3f} ± {d['sd']:.3f} [{d['mean'] - d['half']:.3f}, {d['mean'] + d['half']:.3f}]"


def markdown(result) -> str:
    """The table: a row per arm (or the one checkpoint), a column per distance; then each run's."""
    arms = result.get("arms") or [{"arm": result["attention"], "runs": [result], "accuracy": {
        r["distance"]: {"n": 1, "mean": r["accuracy"], "sd": None, "half": None} for r in result["rows"]}}]
    distances = [r["distance"] for r in arms[0]["runs"][0]["rows"]]
    head = ["| arm | " + " | ".join(f"d={d}" for d in distances) + " |", "|---|" + "---|" * len(distances)]
    lines = list(head)
    for arm in arms:
        first = arm["runs"][0]["rows"]
        lines.append(f"| {arm['arm']} | " + " | ".join(cell(arm["accuracy"][d], r) + (" †" if r["beyond"] else "")
                                                       for d, r in zip(distances, first)) + " |")
    runs = sorted({len(a["runs"]) for a in arms})
    needles = arms[0]["runs"][0]["rows"][0]["n"]
    lines.append(f"\nAccuracy of the needle's answer (argmax) at each distance d, {needles} needles per distance and "
                 f"run: " + ("accuracy [95% Wilson interval]" if runs == [1] else
                             f"mean ± sd over {'/'.join(map(str, runs))} runs [95% interval of the mean, Student t]; "
                             "an arm of one run: accuracy [95% Wilson interval]")
                 + ". †: beyond the window's reach (n layers x (W - 1)). Each run:\n")
    lines += head
    for arm in arms:
        for run in arm["runs"]:
            lines.append(f"| {arm['arm']} | " + " | ".join(f"{r['accuracy']:.3f} ({r['right']}/{r['n']})"
                                                           for r in run["rows"]) + " |")
    return "\n".join(lines)


def plot(result, path):
    """Accuracy against distance, one line per arm with its interval, each window's reach dotted."""
    from lab.plots import plt, save_figure

    arms = result.get("arms") or [{"arm": result["attention"], "runs": [result], "accuracy": None}]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for arm in arms:
        rows, stats = arm["runs"][0]["rows"], arm["accuracy"]
        xs = [r["distance"] for r in rows]
        if stats is None or stats[xs[0]]["half"] is None:  # one run: its Wilson interval
            ys = [r["accuracy"] for r in rows]
            err = [[y - r["low"] for y, r in zip(ys, rows)], [r["high"] - y for y, r in zip(ys, rows)]]
        else:
            ys = [stats[d]["mean"] for d in xs]
            err = [stats[d]["half"] for d in xs]
        line = ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=arm["arm"])
        far = arm["runs"][0]["reach"]
        if far is not None:
            ax.axvline(far + 1, color=line[0].get_color(), ls=":", lw=1)
    ax.axhline(arms[0]["runs"][0]["chance"], color="grey", lw=0.8, label="chance")
    ax.set(xlabel="distance from the needle's key to its query (positions)", ylabel="needle accuracy",
           ylim=(-0.02, 1.02), title="needle recall by distance (dotted: a window's reach)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def needle(cfg) -> dict:
    check_values(cfg)
    out = check_output_dir(cfg.out, "out") if cfg.out else None  # before any work
    if cfg.runs and cfg.ckpt:
        raise UserError("ckpt= and runs= both given: probe one checkpoint (ckpt=) or every run of some dirs (runs=)")
    result = probe_arms(cfg) if cfg.runs else probe_checkpoint(cfg, checkpoint_of(cfg, cfg.ckpt))
    table = markdown(result)
    if cfg.runs:
        print("\n" + table)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "needle.json").write_text(json.dumps(result, indent=1))
        (out / "needle.md").write_text(table + "\n")
        plot(result, out / "needle.png")
        print(f"wrote {out / 'needle.json'}, {out / 'needle.md'}, {out / 'needle.png'}", file=sys.stderr)
    return result


@hydra.main(version_base="1.3", config_path="../configs", config_name="needle")
@cli
def main(cfg):
    needle(cfg)


if __name__ == "__main__":
    run_app(main)
