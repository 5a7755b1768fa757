"""Export a checkpoint to a Hugging Face transformers model directory, exactly.

    python tools/export.py ckpt=outputs/runs/X out=outputs/export/X      # a run dir (its best.pt) or a checkpoint file
    python tools/export.py ckpt=best.pt out=outputs/export/X overwrite=true
    python tools/export.py ckpt=outputs/runs/X out=outputs/export/X format=code

The directory holds config.json, model.safetensors, generation_config.json, the tokenizer
(tokenizer.json, tokenizer_config.json), a README.md model card and attnlab_export.json (the files
the export wrote: overwrite=true replaces only such a directory, and only if nothing was added to
it), and loads offline with `AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)`. Two routes (`format=auto`, the default, takes the first that
computes the model and says which in one line):

- stock (`format=stock`): a stock architecture that computes the same function, no custom code (the
  opposite of nanoGPT's from_pretrained):

    attnlab model (Pre-LN, no logit soft-cap)            transformers class
    layernorm, gelu|relu2, RoPE, MHA/GQA/MQA             GPTNeoXForCausalLM (sequential residual, rotary_pct 1)
    layernorm, gelu|relu2, learned|sinusoidal|no pos.    GPT2LMHeadModel (the table in wpe)
    rmsnorm, swiglu, RoPE, MHA/GQA/MQA                   LlamaForCausalLM
    rmsnorm, swiglu, RoPE, per-head RMS QK-Norm (no gain) Qwen3ForCausalLM
    (every row: bias or not, tied or untied head, any attn.scale, rope_base and d_ff)

- code (`format=code`): the Hub's convention for a new architecture. The directory also holds
  attnlab's own model files, whole (model.py, attention.py, rules.py, lab/counting.py and variants/, its
  files side by side; their imports made relative) and tools/export_code/'s wrapper
  (configuration_attnlab.py, modeling_attnlab.py: a PreTrainedModel + GenerationMixin around
  attnlab's GPT), registered for the Auto classes in config.json's auto_map and loaded with
  `trust_remote_code=True`. Every model option, present or future, exports exactly by construction:
  it is the same code. A model option the stock mappings do not know (STOCK_OPTIONS) is never
  mapped to a stock class.

How the weights move (all exact; the export reloads itself and compares logits before it keeps
the directory):
- RoPE: attnlab rotates interleaved channel pairs (2j, 2j+1) by p*theta_j, theta_j = base^(-2j/hs);
  these three rotate halves (j, j + hs/2) by the same angle in the same direction (x*cos + rot(x)*sin
  with rot = (-x2, x1)). So each head's q and k rows are permuted [0, 2, 4, ..., 1, 3, 5, ...]; q.k
  is a sum over channels, unchanged by permuting both (Meta's Llama conversion does the same).
- Scale: transformers divides logits by sqrt(hs); a non-default model.attn.scale is folded into
  the q rows (or, with QK-Norm, into q_norm's gain, which the norm does not undo).
- QK-Norm eps: attnlab's per-head norm adds 1e-6, Qwen3's q_norm/k_norm use rms_norm_eps (1e-5,
  the block norms'). rms(a*x) with eps E equals rms(x) with eps E/a^2, so q and k rows are scaled
  by a = sqrt(1e-5 / 1e-6) before the norm, which then computes exactly attnlab's.
- GPT-NeoX and GPT-2 have no grouped-query attention: K and V heads are repeated for each query
  head of their group (the function GQA computes). NeoX fuses query_key_value per head
  [q_h, k_h, v_h]; GPT-2's Conv1D weights are (in, out). Biases these always have (MLP, LayerNorm,
  GPT-2's attention) are written as zeros where attnlab has none (model.bias=false); so are NeoX's
  attention biases, which TransformerLens' GPT-NeoX adapter requires.
- Positions: GPT-2's wpe table holds the learned table, the sinusoidal one, or zeros (NoPE).
Options no stock class computes (Post-LN, logit soft-cap, layer/l2 QK-Norm, per-head QK gains,
SwiGLU with LayerNorm, windows, linear attention, ...) go to custom code with format=auto, and stop
format=stock with one line naming the option.
Tokenizer: a char vocabulary has no special token, so a newline is named its BOS (char_bos): what
lm-evaluation-harness predicts a text's first token after (and TransformerLens' prepend_bos adds).
Past block_size attnlab's sampler slides a block_size window; transformers attends to the whole
context, so generation agrees while prompt plus continuation fit in block_size tokens.
"""
import dataclasses
import json
import logging
import os
import shutil
import sys
from pathlib import Path
from typing import ClassVar, Optional

import hydra
from hydra.core.config_store import ConfigStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

from lab.checkpoint import find_checkpoint, load_checkpoint, model_from_checkpoint
from lab.cli import cli, run_app  # noqa: E402
from files import check_output_dir, dir_mode, private_mode, temp_suffix  # noqa: E402
from rules import OneOf, UserError, check_values  # noqa: E402
from lab.export_hf import (TARGET_CLASSES, check_tokenizer, choose_format, code_model, hf_model, hf_tokenizer,  # noqa: E402
                       make_portable, model_card, verify)

log = logging.getLogger("attnlab")
FORMATS = ("auto", "stock", "code")
MARK = "attnlab_export.json"  # written last into every export: the files it wrote, so overwrite=true knows its own


@dataclasses.dataclass
class ExportConfig:
    ckpt: Optional[str] = None  # checkpoint file or run dir; default: the newest run under outputs/
    out: Optional[str] = None  # the directory to write (required)
    overwrite: bool = False  # replace `out` if it already holds an export
    verify: bool = True  # reload the export with transformers and compare its logits with attnlab's
    format: str = "auto"  # auto (stock where one computes the model, else code) | stock | code (custom code)

    RULES: ClassVar[dict] = {"format": OneOf(FORMATS)}


ConfigStore.instance().store(name="base_export", node=ExportConfig)


# ----------------------------------------------------------------------------- writing

def check_out(out: Optional[str], overwrite: bool) -> Path:
    """The directory to export to, checked before any work. An export replaces its directory whole, so
    an existing one is replaced only if it is an export of ours with nothing added (its mark lists
    every file in it), never through a symbolic link, never the directory you are in or one above it."""
    if not out:
        raise UserError("out=DIR is required: the directory to write the transformers model to")
    path = Path(out).expanduser()
    if path.is_symlink():
        raise UserError(f"out={out} is a symbolic link: an export replaces its directory whole; name the directory "
                        "itself")
    check_output_dir(path, "out")
    here = Path.cwd().resolve()
    if path.resolve() == here or path.resolve() in here.parents:
        raise UserError(f"out={out} is the directory you are in, or holds it: an export replaces its directory "
                        "whole; name another one")
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            raise UserError(f"out={out} is not empty: pass overwrite=true to replace an earlier export, or another dir")
        foreign = not_exported(path)
        if foreign:
            raise UserError(f"out={out} holds {', '.join(foreign[:3])}{' and more' if len(foreign) > 3 else ''}, "
                            f"which no export wrote: only a directory an export marked ({MARK}) and nothing was "
                            "added to is replaced; pass another out=DIR")
    return path


def not_exported(path: Path) -> list:
    """The entries of `path` that no export wrote: all of them, unless its mark lists every one as a file."""
    try:
        listed = json.loads((path / MARK).read_text(encoding="utf-8"))["files"]
    except (OSError, ValueError, KeyError, TypeError):
        listed = []
    return sorted(p.name for p in path.iterdir()
                  if p.name != MARK and (p.name not in listed or p.is_symlink() or not p.is_file()))


def mark_export(path: Path, ckpt: Path):
    """The mark that lets a later overwrite=true recognise this directory: the files the export wrote."""
    files = sorted(p.name for p in path.iterdir())
    (path / MARK).write_text(json.dumps({"written_by": "attnlab tools/export.py", "checkpoint": str(ckpt),
                                         "files": files}, indent=1) + "\n", encoding="utf-8")


def swap_in(tmp: Path, out: Path):
    """The new export where `out` is: an old one is renamed aside first and deleted last, so at any
    moment one of them is whole on disk (put back if the swap is interrupted; after a kill -9 between
    the two renames, under the name .OUT.old.tmp-HOST-PID)."""
    old = out.parent / f".{out.name}.old{temp_suffix()}"
    if out.exists():
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        if old.exists():
            os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def export(cfg) -> Path:
    """Write the checkpoint cfg.ckpt names as a transformers model directory cfg.out; return it.
    It is written under a temporary name beside `out`, checked, then swapped in: `out` is whole or absent."""
    check_values(cfg)
    out = check_out(cfg.out, cfg.overwrite)
    ckpt = find_checkpoint(cfg.ckpt)
    state = load_checkpoint(ckpt)  # refuses non-finite weights
    model = model_from_checkpoint(state).eval()
    c = model.config
    target, why = choose_format(cfg.format, c)
    log.info("format=%s: %s, %s", cfg.format, TARGET_CLASSES[target], why)
    try:
        from transformers import GenerationConfig
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise UserError("export needs transformers: pip install -r requirements.txt") from None
    hf_logging.disable_progress_bar()  # "Loading weights" bars on every save and load
    tok, fast = hf_tokenizer(state["tokenizer"], c.block_size)
    check_tokenizer(tok, fast)
    eot = tok.eot if tok.eot is not None and tok.eot < c.vocab_size else None
    bos = fast.bos_token_id if fast.bos_token_id is not None and fast.bos_token_id < c.vocab_size else None
    gen = GenerationConfig(do_sample=True, temperature=0.8, top_k=200, bos_token_id=bos, eos_token_id=eot,
                           pad_token_id=eot)  # sample.py's defaults
    mode = private_mode([ckpt])  # an export is no more readable than the checkpoint it came from
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}{temp_suffix()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        code = target == "code"
        hf = code_model(c, model, bos, eot, tmp) if code else hf_model(c, model, target, bos, eot)
        hf.save_pretrained(tmp, safe_serialization=True)
        gen.save_pretrained(tmp)
        fast.save_pretrained(tmp)
        make_portable(tmp, c, target)
        (tmp / "README.md").write_text(model_card(state, model, type(hf).__name__, ckpt, tok, code), encoding="utf-8")
        diff = verify(model, tmp, code) if cfg.verify else None
        mark_export(tmp, ckpt)
        for f in tmp.iterdir():
            os.chmod(f, mode)
        os.chmod(tmp, dir_mode(mode))
        swap_in(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("exported %s as %s to %s%s", ckpt, type(hf).__name__, out,
             "" if diff is None else f" (logits within {diff:.1e} of attnlab's)")
    return out


@hydra.main(version_base="1.3", config_path="../configs", config_name="export")
@cli
def main(cfg):
    print(export(cfg))


if __name__ == "__main__":
    run_app(main)
