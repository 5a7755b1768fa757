"""Which heads cause it: activation patching. Run a clean prompt and a corrupted one, then copy one piece
of the clean run into the corrupted run and measure how much of the clean behaviour comes back.
Ablation (tools/ablate.py) asks what a head is needed for; patching asks which heads carry the
difference between two prompts.

    python tools/patch.py ckpt=outputs/runs/X                                   # [r, r] spans of val text
    python tools/patch.py ckpt=outputs/runs/X clean="abc abc" corrupted="xyz abc"
    python tools/patch.py ckpt=outputs/runs/X metric=logit_diff n=16 span=24 out=outputs/patch/logit_diff

By default the clean prompts are n spans r of the run's val text (or text=), `span` tokens each, repeated
twice, [r, r]; the corrupted prompts are [o, r], o other text of the same length, so the second copy can
no longer be predicted by copying. The metric m is the loss on the clean prompt's second half (its second
copy; the prediction of the copy's first token is left out, as attnstats.copy_losses does), or with
metric=logit_diff the logit of the clean next token minus that of the corrupted one at the last position
(the default prompts then drop their last token, whose text is the clean answer; the corrupted answer is
the corrupted run's top token other than it). Causal tracing (Meng et al. 2022, arXiv 2202.05262), the IOI
circuit (Wang et al. 2022, arXiv 2211.00593) and Zhang & Nanda 2023 (arXiv 2309.16042, on metrics and
corruptions) patch the same way. Each component is reported as its normalised recovery

    (m_patched - m_corrupted) / (m_clean - m_corrupted):   0 no effect, 1 the clean behaviour restored,

its m averaged over the n prompts first. The components, each patched alone into the corrupted run:
- every head's output before the output projection (attn.hook_z[:, :, h], all positions; every kind of
  layer has one; with an output gate it is the gate's input): a layer x head map;
- the residual stream at one position (blocks.l.hook_resid_pre[:, p]; row n_layer: after the last layer,
  blocks.{n_layer-1}.hook_resid_post): a layer x position map;
- every head's attention weights (attn.hook_pattern[:, h], softmax layers; a layer whose weights do not
  pass hook_pattern, such as a recurrent gdn or mamba2 layer, is left blank and named): a layer x head map.
Printed sorted, best first; patch.json and patch.png (the three maps) go to `out`.
"""
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

from lab.checkpoint import find_checkpoint, load_checkpoint, model_from_checkpoint  # noqa: E402
from lab.cli import cli, run_app  # noqa: E402
from lab.device import pick_device  # noqa: E402
from files import check_output_dir, default_output  # noqa: E402
from data.tokenizer import tokenizer_from_dict  # noqa: E402
from lab.interventions import Prompts, drawn_prompts, patch_all  # noqa: E402
from rules import POSITIVE, SEED, Needs, OneOf, Range, UserError, check_values  # noqa: E402
from lab.heldout import stream_tokens  # noqa: E402

METRICS = ("loss", "logit_diff")
DRAWN = Needs(lambda c: c.clean is None and c.corrupted is None,
              "clean and corrupted are unset (the prompts are then drawn from the text)")


@dataclass
class PatchConfig:
    ckpt: Optional[str] = None  # checkpoint file or run dir; default: the newest run under outputs/
    clean: Optional[str] = None  # the clean prompt; unset: n spans of text repeated, [r, r]
    corrupted: Optional[str] = None  # the corrupted prompt, as many tokens as clean; unset: [o, r], o other text
    text: Optional[str] = None  # a UTF-8 text file the spans come from; unset: the run's own val split
    n: int = 8  # prompts drawn from the text, patched together and averaged
    span: int = 16  # tokens of each copy of a drawn prompt
    seed: int = 0  # where the drawn spans start
    metric: str = "loss"  # loss (the clean prompt's second half) | logit_diff (clean minus corrupted next token)
    top: int = 8  # rows printed per kind of component
    device: str = "cpu"
    out: Optional[str] = default_output("patch")  # a dir for patch.json and patch.png (a new one per call); null: print only

    RULES: ClassVar[dict] = {"n": POSITIVE, "span": Range(2, why="a copy needs a token after its first to score"),
                             "seed": SEED, "metric": OneOf(METRICS), "top": POSITIVE}
    NEEDS: ClassVar[dict] = {"text": DRAWN, "n": DRAWN, "span": DRAWN, "seed": DRAWN}


ConfigStore.instance().store(name="base_patch", node=PatchConfig)


# ----------------------------------------------------------------------------- the prompts

def encoded(tok, text: str, key: str, bos) -> list:
    ids = [int(i) for i in tok.encode(text)]
    if not ids:
        raise UserError(f"{key}= encodes to no tokens: give some text")
    return ([bos] if bos is not None else []) + ids


def typed_prompts(tok, cfg, block: int) -> Prompts:
    """clean= and corrupted= as one prompt each, of equal token length."""
    if cfg.clean is None or cfg.corrupted is None:
        given, missing = ("clean", "corrupted") if cfg.corrupted is None else ("corrupted", "clean")
        raise UserError(f"{given}= is set but {missing}= is not: give both prompts, or neither for drawn [r, r] spans")
    bos = getattr(tok, "bos", None)
    clean, corrupted = encoded(tok, cfg.clean, "clean", bos), encoded(tok, cfg.corrupted, "corrupted", bos)
    if len(clean) != len(corrupted):
        raise UserError(f"clean= is {len(clean)} tokens and corrupted= is {len(corrupted)}: patching copies each "
                        "position into the same position, so give prompts of equal token length")
    if len(clean) > block:
        raise UserError(f"the prompts are {len(clean)} tokens but the model's block_size is {block}: shorten them")
    if clean == corrupted:
        raise UserError("clean= and corrupted= are the same tokens: there is nothing to patch; change what matters")
    offset = int(bos is not None)
    if cfg.metric == "loss" and len(clean) - offset < 3:
        raise UserError(f"clean= is {len(clean) - offset} tokens: metric=loss scores its second half, which needs 3 "
                        "tokens or more (or use metric=logit_diff, the next token)")
    return Prompts(torch.tensor([clean]), torch.tensor([corrupted]), cfg.metric, offset + (len(clean) - offset) // 2)


# ----------------------------------------------------------------------------- the command

def patch(cfg) -> dict:
    check_values(cfg)
    out = check_output_dir(cfg.out, "out") if cfg.out else None
    device = pick_device(cfg.device)
    path = find_checkpoint(cfg.ckpt)
    state = load_checkpoint(path)
    model = model_from_checkpoint(state, device).eval()
    tok = tokenizer_from_dict(state["tokenizer"])
    block = model.config.block_size
    if cfg.clean is None and cfg.corrupted is None:
        p = drawn_prompts(stream_tokens(state, cfg, None), cfg, block, getattr(tok, "bos", None))
    else:
        p = typed_prompts(tok, cfg, block)
    p.clean, p.corrupted = p.clean.to(device), p.corrupted.to(device)
    p.answer = None if p.answer is None else p.answer.to(device)
    result = patch_all(model, p)
    result.update(ckpt=str(path), seed=cfg.seed if p.copy is not None else None,
                  example={"clean": tok.decode(p.clean[0].tolist()), "corrupted": tok.decode(p.corrupted[0].tolist())})
    print_result(result, cfg.top, tok)
    if out is not None:
        write(result, model.config, out)
    return result


def print_result(result: dict, top: int, tok):
    what = {"loss": "the loss on the clean prompt's second half",
            "logit_diff": "logit of the clean next token minus the corrupted one, last position"}[result["metric"]]
    drawn = f", seed {result['seed']}" if result["seed"] is not None else ""
    print(f"{result['ckpt']}: {result['prompts']} prompt pair(s) of {result['tokens']} tokens{drawn}; metric: {what}")
    print(f"  e.g. clean {result['example']['clean']!r}\n       corrupted {result['example']['corrupted']!r}")
    if result["answers"] is not None and result["prompts"] == 1:
        clean, corrupted = (tok.decode([a]) for a in result["answers"][0])
        print(f"  answers: clean {clean!r}, corrupted {corrupted!r}")
    print(f"clean {result['clean']:.4f}, corrupted {result['corrupted']:.4f}; recovery = (patched - corrupted) / "
          "(clean - corrupted): 0 no effect, 1 clean restored")
    n_layer = len(result["grids"]["head"])
    titles = {"head": "head outputs (hook_z, every position)", "pattern": "attention weights (hook_pattern)",
              "resid": f"residual stream at one position (hook_resid_pre; L{n_layer}: after the last layer)"}
    for kind, title in titles.items():
        rows = [r for r in result["rows"] if r["kind"] == kind][:top]
        if rows:
            print(f"{title:<64}{'recovery':>10}{result['metric']:>12}")
            for r in rows:
                print(f"  {r['component']:<62}{r['recovery']:>+10.4f}{r['metric']:>12.4f}")
    if result["no_pattern"]:
        named = ", ".join(f"L{l} ({kind})" for l, kind in result["no_pattern"])
        print(f"{named}: no softmax weights through hook_pattern, no pattern to patch")


def write(result: dict, c, out: Path):
    """patch.json and patch.png: the recovery per layer and head (outputs and weights) and per layer and
    position (the residual stream), blank where a layer has no weights to patch."""
    from lab.plots import plt
    out.mkdir(parents=True, exist_ok=True)
    (out / "patch.json").write_text(json.dumps(result, indent=1))
    grids = {k: torch.tensor([[float("nan") if v is None else v for v in row] for row in g])
             for k, g in result["grids"].items()}
    limit = max(1.0, max(float(g.nan_to_num(0).abs().max()) for g in grids.values()))
    T = result["tokens"]
    head_width = 1.2 + 0.45 * c.n_head  # inches
    fig, axes = plt.subplots(1, 3, figsize=(2 * head_width + 0.22 * T + 3, 1.8 + 0.5 * (c.n_layer + 1)),
                             gridspec_kw={"width_ratios": [head_width, 0.22 * T + 0.8, head_width], "wspace": 0.45})
    cmap = plt.get_cmap("RdBu_r").with_extremes(bad="0.85")  # blank: a layer without weights to patch
    blank = dict(result["no_pattern"])
    titles = ("head outputs (hook_z)", "residual stream (hook_resid_pre)", "attention weights (hook_pattern)")
    for ax, kind, title in zip(axes, ("head", "resid", "pattern"), titles):
        im = ax.imshow(grids[kind], cmap=cmap, vmin=-limit, vmax=limit, aspect="auto")
        rows = c.n_layer + (kind == "resid")
        ylabels = [f"L{l}" + (f" ({blank[l]})" if kind == "pattern" and l in blank else "") for l in range(c.n_layer)]
        ax.set(title=title, yticks=range(rows),
               yticklabels=ylabels + ([f"L{c.n_layer} (out)"] if kind == "resid" else []))
        if kind != "resid" and c.n_layer * c.n_head <= 64:  # small maps: the numbers too
            for (l, h), v in zip(torch.cartesian_prod(torch.arange(c.n_layer), torch.arange(c.n_head)).tolist(),
                                 grids[kind].flatten().tolist()):
                if v == v:  # not blank
                    ax.text(h, l, f"{v:.2f}", ha="center", va="center", fontsize=7)
        if kind == "resid":
            ax.set(xlabel="position")
            if result["copy"] is not None:  # where the second copy starts
                ax.axvline(result["copy"] - 0.5, color="k", lw=0.8, ls="--")
        else:
            ax.set(xlabel="head", xticks=range(c.n_head))
    fig.colorbar(im, ax=list(axes), shrink=0.8, label="recovery")
    seed = f", seed {result['seed']}" if result["seed"] is not None else ""
    fig.suptitle(f"activation patching: {result['metric']}, {result['prompts']} prompt pair(s){seed}; "
                 f"clean {result['clean']:.3f}, corrupted {result['corrupted']:.3f}", fontsize=9, y=1.03)
    fig.savefig(out / "patch.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {out / 'patch.json'}, {out / 'patch.png'}", file=sys.stderr)


@hydra.main(version_base="1.3", config_path="../configs", config_name="patch")
@cli
def main(cfg):
    patch(cfg)


if __name__ == "__main__":
    run_app(main)
