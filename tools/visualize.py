"""Look inside: the attention weights of every layer and head for a prompt you type.

    python tools/visualize.py prompt="ROMEO: But soft"                      # newest checkpoint under outputs/
    python tools/visualize.py ckpt=outputs/runs/X prompt_file=p.txt out=outputs/visualize/maps query=5 top_k=3

Runs the prompt once through the model; its probe hook hands over each layer's q and k, and each
layer says what its softmax takes of them (its scale, mask and window, logit bias and sink:
attnstats.layer_maps), so every model option is covered with no second copy of the model. A layer
without softmax (linear attention, Gated DeltaNet, Mamba-2) writes out its effective attention
instead: the matrix A with each head's output = A @ v (its effective_attention, variants/), signed
for Gated DeltaNet and Mamba-2, drawn in a diverging colour map; its entropy is given only where
A's rows are distributions (linear attention without RoPE), else n/a with the reason. Every layer is
labelled with its kind (softmax, with its window or key selection; mla; linear, gdn, mamba2), so a
hybrid stack shows all its layers. Writes `out`/attention.png (a layer x head grid of heatmaps) and
`out`/attention.html (one self-contained file: opens from disk, no network), and prints the top-k keys
(largest |weight|) of the last query (or `query=INDEX`) for every head on stdout.
"""
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

from lab.plots import format_top_keys, write_views
from lab.checkpoint import find_checkpoint, load_checkpoint, model_from_checkpoint
from lab.cli import cli, run_app  # noqa: E402
from lab.device import pick_device  # noqa: E402
from files import check_output_dir, default_output  # noqa: E402
from lab.sampling import read_prompt  # noqa: E402
from rules import POSITIVE, Needs, Range, UserError, check_values  # noqa: E402
from data.tokenizer import tokenizer_from_dict

log = logging.getLogger("attnlab")


@dataclass
class VisualizeConfig:
    ckpt: Optional[str] = None  # checkpoint file or run dir; default: newest under outputs/
    prompt: Optional[str] = None  # the text to look at (quote trailing spaces for Hydra: prompt="'def '")
    prompt_file: Optional[str] = None  # read the prompt from this file instead (whitespace kept as is)
    query: Optional[int] = None  # the query token whose top keys are printed and shown first; default the last; <0 counts from the end
    top_k: int = 5  # keys printed per head
    out: str = default_output("visualize")  # directory for attention.png and attention.html (a new one per call)
    device: str = "cpu"  # one forward pass of at most block_size tokens: the CPU takes seconds

    RULES: ClassVar[dict] = {"top_k": POSITIVE, "query": Range(-2**31, 2**31)}
    NEEDS: ClassVar[dict] = {"prompt": Needs(lambda c: c.prompt_file is None,
                                             "prompt_file is unset (the file's text is the prompt)")}


ConfigStore.instance().store(name="base_visualize", node=VisualizeConfig)


def prompt_of(cfg) -> str:
    """The prompt to map (lab.sampling.read_prompt); an empty one is an error here."""
    prompt = read_prompt(cfg)
    if not prompt:
        raise UserError('no prompt: pass prompt="some text" or prompt_file=FILE')
    return prompt


def query_index(query, n_tokens: int) -> int:
    if query is None:
        return n_tokens - 1
    if not -n_tokens <= query < n_tokens:
        raise UserError(f"query={query} is out of range: the prompt has {n_tokens} tokens, so use 0..{n_tokens - 1} "
                        f"(or -1..-{n_tokens} from the end)")
    return query % n_tokens


def visualize(cfg, out=None) -> dict:
    """Maps of cfg.prompt for the checkpoint cfg.ckpt, written to cfg.out; returns write_views'
    dict plus the query and the seconds the maps took (forward pass, PNG and HTML)."""
    check_values(cfg)
    check_output_dir(cfg.out, "out")
    prompt = prompt_of(cfg)
    device = pick_device(cfg.device)
    path = find_checkpoint(cfg.ckpt)
    log.info("attention maps from %s", path)
    state = load_checkpoint(path)
    model = model_from_checkpoint(state, device)
    tok = tokenizer_from_dict(state["tokenizer"])
    ids = tok.encode(prompt)
    block = model.config.block_size
    if len(ids) == 0:
        raise UserError("the prompt encodes to no tokens: give some text")
    if getattr(tok, "bos", None) is not None:  # trained with data.bos=true: every window began with it
        ids = [tok.bos, *ids.tolist()]
    if len(ids) > block:
        raise UserError(f"the prompt is {len(ids)} tokens but the model's block_size is {block}: shorten it "
                        f"(the model never saw a longer context)")
    query = query_index(cfg.query, len(ids))
    c = model.config
    meta = (f"{path} (step {state.get('step', '?')}) · {c.n_layer} layers × {c.n_head} heads"
            f"{f' ({c.n_kv_head} kv heads)' if c.n_kv_head != c.n_head else ''} · block {block}"
            f" · scale {c.attn.scale}{' · QK-Norm ' + c.attn.qk_norm_type if c.attn.qk_norm else ''}")
    t0 = time.perf_counter()
    views = write_views(model, torch.as_tensor(ids, dtype=torch.long, device=device)[None], tok, cfg.out,
                        title=f"attention: {len(ids)} tokens", meta=meta, query=query)
    views.update(query=query, seconds=time.perf_counter() - t0)
    print(format_top_keys(views["maps"], views["labels"], query, cfg.top_k, views["kinds"],
                          views["effective"]), file=out or sys.stdout)
    log.info("wrote %s and %s (%.1f MB) in %.2f s", views["png"], views["html"],
             views["html"].stat().st_size / 1e6, views["seconds"])
    return views


@hydra.main(version_base="1.3", config_path="../configs", config_name="visualize")
@cli
def main(cfg):
    visualize(cfg)


if __name__ == "__main__":
    run_app(main)
