"""How far does a model's position scheme reach? Its loss on held-out text at several context lengths,
at and beyond the block_size it was trained at, and the loss at each position within the context.

    python tools/eval_lengths.py ckpt=outputs/runs/X                         # 1/2/4/8 x block_size
    python tools/eval_lengths.py ckpt=outputs/runs/X lengths=[64,256,512] rope_scaling=yarn rope_scaling_factor=8
    python tools/eval_lengths.py ckpt=outputs/runs/X text=book.txt out=outputs/eval_lengths/book.png
    python tools/eval_lengths.py runs=[outputs/multirun/T] lengths=[64,128,256,512]  # every run of a sweep, by arm

For each length L the first `tokens` tokens of the text (the run's own val split unless text= is
given) are cut into consecutive windows of L tokens, each run as its own sequence at positions
0..L-1: the mean loss (nats per token, and bits per character for a char-level model), and the loss
at each position averaged over the windows (does it keep falling with more context, or rise past the
trained length?). At L = block_size, with `tokens` at least the split's length, this is train.py's
whole-val-split loss (val/loss_full). A retrieval column: the loss on the second copy of a span
repeated once (the first L/2 tokens of each window, twice), which is low only if the model can
look back L/2 tokens and copy. RoPE scaling (position interpolation, NTK, YaRN) applies to a trained
checkpoint as it is, without training: rope_scaling= and rope_scaling_factor= (refused without RoPE; on
layers that RoPE does not rotate, gdn and mamba2, a warning line each, ignored). A model with a learned
or sinusoidal position table has no position past its block_size: those lengths are skipped with a
line saying so, never extrapolated.

With runs= (run or sweep dirs, as tools/report.py takes them) every run's checkpoint is evaluated
and the runs are grouped into arms as report.py groups them (their configs minus the seeds): a table
of each arm's mean loss at each length with its 95% interval over seeds, and a plot of loss against
length with a band per arm.
"""
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, List, Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

from variants import ROPE_SCALINGS, SELECTS  # noqa: E402
from lab.attnstats import copy_losses  # noqa: E402
from lab.checkpoint import find_checkpoint, load_checkpoint, model_from_checkpoint, with_selection  # noqa: E402
from lab.sampling import with_rope_scaling_if_it_acts  # noqa: E402
from lab.cli import cli, run_app  # noqa: E402
from lab.device import pick_device  # noqa: E402
from files import check_output_file, default_output  # noqa: E402
from rules import POSITIVE, OneOf, Range, UserError, check_values  # noqa: E402
from data.tokenizer import tokenizer_from_dict  # noqa: E402
from lab.heldout import stream_tokens, window_losses  # noqa: E402


@dataclass
class EvalLengthsConfig:
    ckpt: Optional[str] = None  # checkpoint file or run dir; default: the newest run under outputs/
    runs: Optional[List[str]] = None  # run or sweep dirs instead of ckpt: every run, grouped into arms by config
    text: Optional[str] = None  # a UTF-8 text file; unset: the run's own val split
    lengths: Optional[List[int]] = None  # context lengths L; unset: 1, 2, 4 and 8 times block_size
    tokens: int = 65536  # tokens evaluated at each length (consecutive windows of L)
    rope_scaling: Optional[str] = None  # none | linear | ntk | yarn; unset: the checkpoint's own
    rope_scaling_factor: Optional[float] = None  # unset: the checkpoint's own
    select: Optional[str] = None  # moba | oracle | indexer (a checkpoint trained with one) | none: each query reads only the keys it chooses; unset: the checkpoint's own
    select_topk: Optional[int] = None  # with select: blocks (moba) or keys (oracle) each query reads; unset: its own
    select_block: Optional[int] = None  # with select=moba: keys per block; unset: its own
    batch_size: int = 8  # windows per forward pass
    device: str = "cpu"
    out: Optional[str] = default_output("eval_lengths", "lengths.png")  # the plot (a new dir per call); null: none

    RULES: ClassVar[dict] = {"lengths": Range(2, 2**20), "tokens": Range(2), "rope_scaling": OneOf(tuple(ROPE_SCALINGS)),
                             "rope_scaling_factor": Range(1, why="1 is no scaling"), "batch_size": POSITIVE,
                             "select": OneOf(tuple(SELECTS)), "select_topk": POSITIVE, "select_block": POSITIVE}


ConfigStore.instance().store(name="base_eval_lengths", node=EvalLengthsConfig)


def copy_distance(L: int, bos=None) -> int:
    """The span length r of copy_loss's [r, r] in a window of L: L/2, or (L-1)/2 after a bos token."""
    return L // 2 if bos is None else (L - 1) // 2


@torch.no_grad()
def copy_loss(model, ids, L: int, batch_size: int = 8, bos=None) -> float:
    """Mean loss on the second copy of [r, r], r the first L/2 tokens of each window of L (a retrieval
    probe at distance L/2: what seeing the span once saves). With bos: [bos, r, r], r of (L-1)/2."""
    n, half = min((ids.numel() - 1) // L, 64), copy_distance(L, bos)
    rows = ids[:n * L].view(n, L)[:, :half]
    total = 0.0
    for rb in rows.split(batch_size):
        seq = torch.cat([rb, rb], dim=1)
        if bos is None:
            logits = model(seq, window=L)
        else:  # the logits after bos, over [r, r]
            logits = model(torch.cat([torch.full_like(rb[:, :1], bos), seq], dim=1), window=L)[:, 1:]
        total += copy_losses(logits, seq, half)[1] * rb.size(0)
    return total / n


def eval_lengths(cfg) -> dict:
    check_values(cfg)
    if cfg.out:
        check_output_file(cfg.out, "out")  # before any work
    if cfg.runs:
        if cfg.ckpt:
            raise UserError("ckpt= and runs= both given: evaluate one checkpoint (ckpt=) or every run of some dirs "
                            "(runs=)")
        return eval_arms(cfg)
    return eval_checkpoint(cfg, find_checkpoint(cfg.ckpt), cfg.out)


def eval_checkpoint(cfg, path, out) -> dict:
    """The table (and plot) of one checkpoint."""
    state = load_checkpoint(path)
    state = with_selection(with_rope_scaling_if_it_acts(state, cfg.rope_scaling, cfg.rope_scaling_factor),
                           cfg.select, cfg.select_topk, cfg.select_block)
    model = model_from_checkpoint(state, pick_device(cfg.device)).eval()
    c = model.config
    lengths = list(cfg.lengths) if cfg.lengths else [c.block_size * k for k in (1, 2, 4, 8)]
    bos = getattr(tokenizer_from_dict(state["tokenizer"]), "bos", None)  # data.bos=true: every window starts at it
    ids = stream_tokens(state, cfg, None).to(model.wte.weight.device)
    chars_per_token = state["tokenizer"].get("kind") == "char"
    scaling = f", rope_scaling={c.rope_scaling} x{c.rope_scaling_factor:g}" if c.rope_scaling != "none" else ""
    scaling += f", select={c.attn.select} top {c.attn.select_topk}" if c.attn.select != "none" else ""
    print(f"{path}: model.pos={c.pos}, block_size {c.block_size}{scaling}; {ids.numel()} tokens of text")
    rows = []
    for L in lengths:
        if model.positions is not None and L > c.block_size:
            print(f"L={L}: skipped: model.pos={c.pos} has a table of {c.block_size} positions (nothing to extrapolate)")
            rows.append({"length": L, "skipped": True})
            continue
        losses = window_losses(model, ids[:cfg.tokens + 1], L, cfg.batch_size, bos)
        row = {"length": L, "loss": losses.mean().item(), "windows": losses.size(0),
               "per_position": losses.mean(0).tolist(), "copy_loss": copy_loss(model, ids, L, cfg.batch_size, bos)}
        if chars_per_token:
            row["bpc"] = row["loss"] / math.log(2)
        rows.append(row)
        print(f"L={L:6d} ({L / c.block_size:4.1f} x block): loss {row['loss']:.4f}"
              + (f", {row['bpc']:.3f} bits/char" if "bpc" in row else "")
              + f", last quarter of positions {sum(row['per_position'][-L // 4:]) / (L // 4):.4f}"
              + f", copy loss at distance {copy_distance(L, bos)}: {row['copy_loss']:.4f} ({row['windows']} windows)")
    result = {"ckpt": str(path), "block_size": c.block_size, "pos": c.pos, "rope_scaling": c.rope_scaling,
              "rope_scaling_factor": c.rope_scaling_factor, "rows": rows}
    if out and any("loss" in r for r in rows):
        plot(result, out)
        print(f"wrote {out}")
    return result


def eval_arms(cfg) -> dict:
    """Every run under cfg.runs evaluated, grouped into arms (lab/arms.py's grouping, as tools/report.py's): per arm and
    length the mean loss, its sd and 95% interval over the arm's runs; a plot with a band per arm."""
    from lab.intervals import describe
    from lab.arms import find_runs, group_arms, summarize

    arms = group_arms([summarize(r) for r in find_runs(cfg.runs)])
    table = []
    for arm in arms:
        per_run = [eval_checkpoint(cfg, find_checkpoint(str(r.dir)), None) for r in arm.runs]
        lengths = [row["length"] for row in per_run[0]["rows"]]
        stats = {}
        for i, L in enumerate(lengths):
            losses = [run["rows"][i]["loss"] for run in per_run if "loss" in run["rows"][i]]
            stats[L] = describe(losses) if losses else None
        table.append({"arm": arm.label, "runs": [str(r.dir) for r in arm.runs], "loss": stats})
    lengths = sorted({L for row in table for L in row["loss"]})
    print("\nmean loss (nats per token) at each length, ± half the 95% interval over an arm's runs (n runs)")
    print(f"{'arm':40s}" + "".join(f"{'L=' + str(L):>22s}" for L in lengths))
    for row in table:
        cells = []
        for L in lengths:
            d = row["loss"].get(L)
            cells.append("skipped" if d is None else f"{d['mean']:.4f}" + (f" ± {d['half']:.4f}" if d["half"] else "")
                         + f" ({d['n']})")
        print(f"{row['arm'][:40]:40s}" + "".join(f"{c:>22s}" for c in cells))
    result = {"arms": table}
    if cfg.out:
        plot_arms(table, cfg.out)
        print(f"wrote {cfg.out}")
    return result


def plot_arms(table, path):
    """Mean loss against context length per arm, with its 95% band over seeds."""
    from lab.plots import plot_bands

    lines = []
    for row in table:
        pts = [(L, d) for L, d in sorted(row["loss"].items()) if d is not None]
        lo = [d["mean"] - d["half"] for _, d in pts] if all(d["half"] for _, d in pts) else None
        hi = [d["mean"] + d["half"] for _, d in pts] if lo is not None else None
        lines.append((row["arm"], 0, [L for L, _ in pts], [d["mean"] for _, d in pts], lo, hi))
    return plot_bands(lines, path, [("loss at each context length (mean over seeds, 95% band)",
                                     "next-token loss (nats)")], xlabel="context length L", xscale="log")


def plot(result, path):
    """The loss at each position of the context, one line per length, the trained length marked."""
    from lab.plots import plt, save_figure

    fig, ax = plt.subplots(figsize=(9, 5))
    for r in result["rows"]:
        if "per_position" in r:
            per = torch.tensor(r["per_position"])
            w = max(1, r["length"] // 64)  # smoothed over length/64 positions
            smooth = per.unfold(0, w, w).mean(-1) if w > 1 else per
            ax.plot((torch.arange(smooth.numel()) * w + w / 2).tolist(), smooth.tolist(), lw=1.2,
                    label=f"L={r['length']} (mean {r['loss']:.3f})")
    ax.axvline(result["block_size"], color="grey", ls=":", label="trained length (block_size)")
    scaling = f", {result['rope_scaling']} x{result['rope_scaling_factor']:g}" if result["rope_scaling"] != "none" else ""
    ax.set(xscale="log", xlabel="position in the context", ylabel="next-token loss (nats)",
           title=f"loss by position: pos={result['pos']}{scaling}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


@hydra.main(version_base="1.3", config_path="../configs", config_name="eval_lengths")
@cli
def main(cfg):
    eval_lengths(cfg)


if __name__ == "__main__":
    run_app(main)
