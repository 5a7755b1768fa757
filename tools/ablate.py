"""Which heads matter: remove one head's output and measure what the model loses. Maps show where a head
looks; ablation shows whether the loss needs it.

    python tools/ablate.py ckpt=outputs/runs/X                         # every head, zero and mean ablation
    python tools/ablate.py ckpt=outputs/runs/X heads=[L1H3,L0H1]       # those heads together
    python tools/ablate.py ckpt=outputs/runs/X batches=16 out=outputs/ablate/16  # more val windows; where the files go

For every layer and head, its output before the output projection (hook_z, every kind of layer: a
linear, gdn or mamba2 layer's heads too) is replaced by zero (zero ablation) or by its mean over the
same val windows (mean ablation, which keeps what the head always adds and removes what depends on the
text), and two numbers are measured against the intact model: the val loss on `batches` x `batch_size`
windows of block_size tokens (the run's own val split, or text=), and the in-context gain on spans of
that text repeated ([r, r]: the loss on the first copy minus on the second, what seeing the span once
saves; an induction head's work). Printed sorted by the zero ablation's loss change; ablate.json,
ablate.csv and ablate.png (layer x head heatmaps) go to `out`.
"""
import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, List, Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

from lab.checkpoint import find_checkpoint, load_checkpoint, model_from_checkpoint  # noqa: E402
from lab.cli import cli, run_app  # noqa: E402
from lab.device import pick_device  # noqa: E402
from files import check_output_dir, default_output  # noqa: E402
from lab.interventions import Ablation, head_means, measure  # noqa: E402
from rules import POSITIVE, Rule, UserError, check_values  # noqa: E402
from lab.heldout import stream_tokens, windows  # noqa: E402


def parse_head(name: str) -> tuple:
    """'L1H3' -> (1, 3)."""
    layer, _, head = str(name).upper().removeprefix("L").partition("H")
    return int(layer), int(head)


HEAD = Rule(lambda v: str(v).upper().startswith("L") and "H" in str(v).upper()
            and all(p.isdigit() for p in str(v).upper()[1:].split("H", 1)), "a head named L<layer>H<head>, e.g. L1H3")


@dataclass
class AblateConfig:
    ckpt: Optional[str] = None  # checkpoint file or run dir; default: the newest run under outputs/
    text: Optional[str] = None  # a UTF-8 text file; unset: the run's own val split
    heads: Optional[List[str]] = None  # ablate these heads together (L1H3 = layer 1, head 3); unset: each head alone
    batches: int = 4  # forward passes of batch_size windows each, the same windows for every ablation
    batch_size: int = 8  # windows of block_size tokens per pass
    device: str = "cpu"
    out: Optional[str] = default_output("ablate")  # a dir for ablate.json, .csv, .png (a new one per call); null: print only

    RULES: ClassVar[dict] = {"heads": HEAD, "batches": POSITIVE, "batch_size": POSITIVE}


ConfigStore.instance().store(name="base_ablate", node=AblateConfig)


def ablate(cfg) -> dict:
    check_values(cfg)
    out = check_output_dir(cfg.out, "out") if cfg.out else None
    device = pick_device(cfg.device)
    path = find_checkpoint(cfg.ckpt)
    state = load_checkpoint(path)
    model = model_from_checkpoint(state, device).eval()
    c = model.config
    heads = [parse_head(h) for h in cfg.heads] if cfg.heads else None
    for layer, head in heads or []:
        if layer >= c.n_layer or head >= c.n_head:
            raise UserError(f"heads: L{layer}H{head} is not in this model ({c.n_layer} layers of {c.n_head} heads): "
                            f"layers 0..{c.n_layer - 1}, heads 0..{c.n_head - 1}")
    x, y = (t.to(device) for t in windows(stream_tokens(state, cfg, None), c.block_size, cfg.batches * cfg.batch_size))
    base = measure(model, x, y, cfg.batch_size)
    means = head_means(model, x, cfg.batch_size)
    sets = [heads] if heads else [[(l, h)] for l in range(c.n_layer) for h in range(c.n_head)]
    rows = []
    for chosen in sets:
        row = {"heads": ",".join(f"L{l}H{h}" for l, h in chosen)}
        for how, m in (("zero", None), ("mean", means)):
            with Ablation(model, chosen, m):
                r = measure(model, x, y, cfg.batch_size)
            row[f"{how}_dloss"], row[f"{how}_dgain"] = r["loss"] - base["loss"], r["gain"] - base["gain"]
        rows.append(row)
    rows.sort(key=lambda r: -r["zero_dloss"])
    result = {"ckpt": str(path), "windows": x.size(0), "block_size": c.block_size, "base": base, "rows": rows}
    print(f"{path}: {x.size(0)} windows of {c.block_size} tokens; intact: val loss {base['loss']:.4f}, in-context gain "
          f"{base['gain']:.4f}")
    print(f"{'heads':<16}{'zero: Δloss':>13}{'Δgain':>10}{'mean: Δloss':>14}{'Δgain':>10}")
    for r in rows:
        print(f"{r['heads']:<16}{r['zero_dloss']:>+13.4f}{r['zero_dgain']:>+10.4f}{r['mean_dloss']:>+14.4f}"
              f"{r['mean_dgain']:>+10.4f}")
    if out is not None:
        write(result, c, out, single=heads is None)
    return result


def write(result, c, out: Path, single: bool):
    """ablate.json, ablate.csv and, for one head at a time, ablate.png: Δloss per layer and head."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "ablate.json").write_text(json.dumps(result, indent=1))
    with open(out / "ablate.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(result["rows"][0]))
        w.writeheader()
        w.writerows(result["rows"])
    names = ["ablate.json", "ablate.csv"]
    if single:
        from lab.plots import plt, save_figure
        fig, axes = plt.subplots(1, 2, figsize=(4 + 1.2 * c.n_head, 1.5 + 0.6 * c.n_layer), squeeze=False)
        for ax, how in zip(axes[0], ("zero", "mean")):
            grid = torch.zeros(c.n_layer, c.n_head)
            for r in result["rows"]:
                l, h = parse_head(r["heads"])
                grid[l, h] = r[f"{how}_dloss"]
            im = ax.imshow(grid, cmap="Reds", aspect="auto")
            ax.set(title=f"{how} ablation: Δ val loss", xlabel="head", ylabel="layer", xticks=range(c.n_head),
                   yticks=range(c.n_layer))
            fig.colorbar(im, ax=ax)
        save_figure(fig, out / "ablate.png")
        names.append("ablate.png")
    print(f"wrote {', '.join(str(out / n) for n in names)}", file=sys.stderr)


@hydra.main(version_base="1.3", config_path="../configs", config_name="ablate")
@cli
def main(cfg):
    ablate(cfg)


if __name__ == "__main__":
    run_app(main)
