"""What each layer already predicts, and who wrote the final logit: the logit lens and direct logit
attribution.

    python tools/lens.py ckpt=outputs/runs/X                              # a line of the run's val text
    python tools/lens.py ckpt=outputs/runs/X prompt="ROMEO: But soft" token=e position=-1 out=null

The logit lens (nostalgebraist 2020, "interpreting GPT: the logit lens"; TransformerLens'
accumulated_resid): the residual stream before the first block (the embeddings) and after every
block goes through the model's own ending, the final norm ln_f and the unembedding lm_head (and the
logit soft-cap, if the model has one), as if the later layers were not there. Printed: the top
tokens of every layer at one position of the prompt, and the val loss of every layer's prediction
on the run's val windows (the last layer's is the model's loss). The lens reads every layer with the
last layer's unembedding, so early layers look worse than what they know (Belrose et al. 2023, arXiv
2303.08112, fit a probe per layer instead).

Direct logit attribution (Elhage et al. 2021, "A Mathematical Framework for Transformer Circuits";
TransformerLens' stack_head_results and logit_attrs): the final residual at the position is a sum,
the embedding (and the absolute positions, if any), each head's output through its columns of the
attention's output projection (read at c_proj's input, so a gate counts; every kind: softmax, GQA,
MLA, linear, gdn, mamba2), the projection's bias and each MLP's output. ln_f is linear once its scale
is frozen at the value the full residual gives: each part is centred (LayerNorm), divided by that
scale and multiplied by the norm's weight; the norm's bias is one more part. Dotted with the token's
unembedding row, the parts sum to the token's logit (before a soft-cap): printed sorted by size, with
the check. A Post-LN model normalises inside every block, so its logit is no such sum: refused.
lens.json and lens.png (loss per layer; the largest parts) go to `out`.
"""
import json
import math
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
from lab.interventions import POST_LN, attribute, layer_names, lens_losses, logit_lens  # noqa: E402
from rules import POSITIVE, Range, UserError, check_values  # noqa: E402
from lab.heldout import stream_tokens, windows  # noqa: E402

SUM_TOLERANCE = 1e-4  # |sum of the parts - the logit| the check accepts (float32 model, float64 sum)
BARS = 16  # parts drawn in lens.png


@dataclass
class LensConfig:
    ckpt: Optional[str] = None  # checkpoint file or run dir; default: the newest run under outputs/
    prompt: Optional[str] = None  # the text looked at; unset: a line of the val text (trailing spaces: prompt="'def '")
    text: Optional[str] = None  # a UTF-8 file for the val windows and the default prompt; unset: the run's val split
    token: Optional[str] = None  # the token whose logit is attributed (one token; \n: a newline); unset: the top prediction
    position: Optional[int] = None  # the prompt position looked at; default the last; <0 counts from the end
    top: int = 5  # tokens shown per layer
    batches: int = 1  # forward passes of batch_size val windows for the loss per layer
    batch_size: int = 8  # windows of block_size tokens per pass
    device: str = "cpu"
    out: Optional[str] = default_output("lens")  # a dir for lens.json and lens.png (a new one per call); null: print only

    RULES: ClassVar[dict] = {"position": Range(-2**31, 2**31), "top": POSITIVE, "batches": POSITIVE,
                             "batch_size": POSITIVE}


ConfigStore.instance().store(name="base_lens", node=LensConfig)


# ----------------------------------------------------------------------------- the command

def default_prompt(tok, ids, room: int) -> list:
    """A line of the val text ids as token ids: the first whole line (after the first line break) of
    at most `room` tokens, else the first whole line cut to `room`, else the text's first tokens."""
    lines = [tok.encode(line).tolist() for line in tok.decode(ids[:4096].tolist()).split("\n")[1:-1] if line.strip()]
    fits = [line for line in lines if len(line) <= room]
    return fits[0] if fits else lines[0][:room] if lines else ids[:room].tolist()


def prompt_ids(tok, prompt: Optional[str], val, block: int) -> list:
    """The prompt's token ids (bos first for a model trained with data.bos=true); unset: a line of val."""
    bos = getattr(tok, "bos", None)
    ids = tok.encode(prompt).tolist() if prompt is not None else default_prompt(tok, val, block - (bos is not None))
    if not ids:
        raise UserError('the prompt encodes to no tokens: pass prompt="some text"')
    if bos is not None:  # every training window began with it
        ids = [bos, *ids]
    if len(ids) > block:
        raise UserError(f"the prompt is {len(ids)} tokens but the model's block_size is {block}: shorten it")
    return ids


def token_id(tok, text: str) -> int:
    """The id of the one token `text` encodes to; \\n and \\t typed on a command line are a newline and a tab."""
    ids = tok.encode(text).tolist()
    if len(ids) != 1 and "\\" in text:
        ids = tok.encode(text.replace("\\n", "\n").replace("\\t", "\t")).tolist()
    if len(ids) != 1:
        raise UserError(f"token={text!r} is {len(ids)} tokens for this model's tokenizer: give the text of one token "
                        "(quote a leading space: token=\"' the'\")")
    return ids[0]


def lens(cfg) -> dict:
    check_values(cfg)
    out = check_output_dir(cfg.out, "out") if cfg.out else None
    from lab.plots import label, token_pieces
    device = pick_device(cfg.device)
    path = find_checkpoint(cfg.ckpt)
    state = load_checkpoint(path)
    model = model_from_checkpoint(state, device).eval()
    c = model.config
    if c.norm_position == "post":
        raise UserError(POST_LN)
    tok = tokenizer_from_dict(state["tokenizer"])
    val = stream_tokens(state, cfg, None)
    ids = prompt_ids(tok, cfg.prompt, val, c.block_size)
    T = len(ids)
    if cfg.position is not None and not -T <= cfg.position < T:
        raise UserError(f"position={cfg.position} is out of range: the prompt has {T} tokens, so use 0..{T - 1} "
                        f"(or -1..-{T} from the end)")
    p = T - 1 if cfg.position is None else cfg.position % T
    idx = torch.tensor([ids], device=device)
    lens_logits = logit_lens(model, idx)[:, 0]  # (n_layer + 1, T, vocab)
    token = lens_logits[-1, p].argmax().item() if cfg.token is None else token_id(tok, cfg.token)
    show = lambda i: label(token_pieces(tok, [i])[0])  # noqa: E731
    names = layer_names(model)
    probs = lens_logits.float().softmax(-1)
    top = probs.topk(min(cfg.top, c.vocab_size), dim=-1)  # (n_layer + 1, T, top)
    rank = (probs > probs[:, :, token:token + 1]).sum(-1)  # (n_layer + 1, T): 0 = the top token
    x, y = (t.to(device) for t in windows(val, c.block_size, cfg.batches * cfg.batch_size))
    losses = lens_losses(model, x, y, cfg.batch_size)
    dla = attribute(model, idx, p, token)
    ok = abs(dla["sum"] - dla["logit"]) <= SUM_TOLERANCE * max(1.0, abs(dla["logit"]))

    pieces = [label(s) for s in token_pieces(tok, ids)]
    capped = f" (soft-capped to {c.logit_softcap * math.tanh(dla['logit'] / c.logit_softcap):.4f})" \
        if c.logit_softcap else ""
    print(f"{path}: a prompt of {T} tokens, {''.join(pieces)!r}; position {p} ({pieces[p]!r}); token {show(token)!r}"
          + (" (the model's top prediction)" if cfg.token is None else ""))
    print(f"logit lens at position {p}: each layer's top {top.indices.size(-1)} tokens (probability); after |, the "
          f"rank and probability of {show(token)!r}")
    for l, name in enumerate(names):
        row = "  ".join(f"{show(i)!r} {q:.3f}" for i, q in zip(top.indices[l, p].tolist(), top.values[l, p].tolist()))
        print(f"  {name:<6} {row}   | {show(token)!r} #{rank[l, p].item() + 1} {probs[l, p, token].item():.3f}")
    print(f"val loss per layer on {x.size(0)} windows of {c.block_size} tokens: "
          + ", ".join(f"{n} {v:.4f}" for n, v in zip(names, losses["losses"]))
          + f" (the model's own: {losses['model_loss']:.4f})")
    print(f"direct logit attribution of {show(token)!r} at position {p} (ln_f's scale frozen at {dla['scale']:.4f}):")
    for name, v in dla["parts"]:
        print(f"  {name:<14}{v:>+10.4f}")
    print(f"  {'sum':<14}{dla['sum']:>+10.4f}")
    print(f"the parts sum to {dla['sum']:.6f}, the {'pre-soft-cap ' if c.logit_softcap else ''}logit is "
          f"{dla['logit']:.6f}{capped}: " + ("they agree" if ok else "they DIFFER")
          + f" (difference {abs(dla['sum'] - dla['logit']):.2e})")
    result = {"ckpt": str(path), "prompt": tok.decode(ids), "tokens": pieces, "position": p, "token": token,
              "token_text": show(token), "layers": names, "val_windows": x.size(0), **losses,
              "top": {name: [[[show(i), q] for i, q in zip(top.indices[l, t].tolist(), top.values[l, t].tolist())]
                             for t in range(T)] for l, name in enumerate(names)},
              "token_rank": {name: (rank[l] + 1).tolist() for l, name in enumerate(names)},
              "dla": {**dla, "parts_sum_to_logit": ok, "softcap": c.logit_softcap}}
    if out is not None:
        write(result, out)
    return result


def write(result, out: Path):
    """lens.json and lens.png: the val loss per layer, and the largest parts of the attribution."""
    from lab.plots import plt, save_figure
    out.mkdir(parents=True, exist_ok=True)
    (out / "lens.json").write_text(json.dumps(result, indent=1))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = result["layers"]
    a.plot(range(len(names)), result["losses"], "o-")
    a.axhline(result["model_loss"], color="grey", ls=":", label="the model's loss")
    a.set(xticks=range(len(names)), xticklabels=names, xlabel="residual stream after", ylabel="val loss (nats)",
          title=f"logit lens: val loss per layer ({result['val_windows']} windows)")
    a.legend()
    a.grid(alpha=0.3)
    parts = result["dla"]["parts"][:BARS][::-1]
    b.barh([n for n, _ in parts], [v for _, v in parts], color=["tab:blue" if v >= 0 else "tab:red" for _, v in parts])
    b.axvline(0, color="black", lw=0.5)
    b.set(xlabel=f"share of the {'pre-soft-cap ' if result['dla']['softcap'] else ''}logit",
          title=f"direct logit attribution: {result['token_text']!r} at position {result['position']} "
          f"(sum {result['dla']['sum']:.2f})")
    save_figure(fig, out / "lens.png")
    print(f"wrote {out / 'lens.json'}, {out / 'lens.png'}", file=sys.stderr)


@hydra.main(version_base="1.3", config_path="../configs", config_name="lens")
@cli
def main(cfg):
    lens(cfg)


if __name__ == "__main__":
    run_app(main)
