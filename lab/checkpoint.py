"""The one place checkpoints are written, found and read, and what resuming from one needs: the
checkpoint to resume from (resume_point), whether it fits this run, and every random stream's state;
for a training run, what its checkpoints hold (checkpoint_contents: the weights, the optimizer's and
the other objects' states, and its TrainState, how far it has come) and how it continues from one
(restore).

A checkpoint is a dict of tensors and plain values (weights, model config, tokenizer, step,
optimizer state, the run's resolved config), so it loads with `torch.load(weights_only=True)`:
a file carrying a pickled object that would run code is refused, never executed; every record is
checked against its checksum first (check_archive), so a damaged file never loads. It is written
to a temporary file, fsynced and renamed over the old one, so a crash at any moment leaves the
previous checkpoint intact.
"""
import dataclasses
import logging
import math
import os
import pickle
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from rules import UserError, first_line, warn_ignored
from lab.cli import in_sweep
from lab.config import DataConfig, data_seed
from model import GPT, GPTConfig
from data.loader import TokenData
from lab.parallel import Dist, FullyShard, Replicated, load_weights
from lab.stability import Watch
from lab.tracking import read_metrics

log = logging.getLogger("attnlab")

BEST_NAME = "best.pt"  # lowest val loss so far; what sample.py loads from a run dir


def step_name(step: int) -> str:
    return f"ckpt_{step:07d}.pt"


def step_checkpoints(run_dir) -> list:
    """The run's periodic checkpoints, oldest first (by step number: past 7 digits text order is wrong)."""
    found = [p for p in Path(run_dir).glob("ckpt_[0-9]*.pt") if p.stem[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.stem[5:]))


def latest_checkpoint(run_dir):
    found = step_checkpoints(run_dir)
    return found[-1] if found else None


def prune_checkpoints(run_dir, keep: int):
    """Delete all but the newest `keep` periodic checkpoints (best.pt is separate)."""
    for old in step_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        old.unlink()


def save_checkpoint(path, state: dict, mode=None) -> Path:
    """Atomically write `state` (tensors and plain Python values only) to `path`, with permission
    bits `mode` if given (a checkpoint is no more readable than the data it learned from)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # removed at the next start if we are killed
    try:
        with open(tmp, "wb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


def find_checkpoint(where=None, root="outputs") -> Path:
    """A checkpoint file: `where` itself, or in a run dir its best.pt (else its newest
    checkpoint); with no `where`, that of the most recently written run under `root`."""
    if where:
        p = Path(where).expanduser()
        if p.is_dir():
            p = p / BEST_NAME if (p / BEST_NAME).is_file() else latest_checkpoint(p)
        if p is None or not p.is_file():
            raise UserError(f"no checkpoint at {where!r}: pass ckpt=RUN_DIR or ckpt=FILE of a trained run")
        return p
    found = sorted(Path(root).rglob("*.pt"), key=lambda q: q.stat().st_mtime)
    found = [q for q in found if q.name == BEST_NAME or q.name.startswith("ckpt_")]
    if not found:
        raise UserError(f"no checkpoint found under {root}/: train first (python train.py) or pass ckpt=PATH")
    return find_checkpoint(found[-1].parent)


def initial_weights(model, where, tokenizer) -> list:
    """init_from=: load another run's weights into this fresh model (a fine-tune: the caller starts at
    step 0 with a fresh optimizer). The model may be built otherwise than the checkpoint's wherever no
    weight differs: a window, a selection, QK-Norm's scale rule. Weights this model has and the
    checkpoint lacks (a new indexer's) keep their fresh initialisation; returns their names. One line
    for a checkpoint whose tokenizer or weights do not fit."""
    try:
        path = find_checkpoint(where)
    except UserError:
        raise UserError(f"init_from={where}: no checkpoint there (give a run dir or a .pt file train.py "
                        "wrote)") from None
    state = load_checkpoint(path)
    if state.get("tokenizer") != tokenizer.to_dict():
        raise UserError(f"init_from={where}: its tokenizer differs from this run's data (the same ids would mean "
                        "other tokens); train on the data it was trained on")
    own, weights = model.state_dict(), state["model"]
    for name, tensor in weights.items():
        if name not in own:
            raise UserError(f"init_from={where}: its {name} has no place in this model; build the model it was "
                            "trained as (change only settings that add or keep weights)")
        if own[name].shape != tensor.shape:
            raise UserError(f"init_from={where}: its {name} is {tuple(tensor.shape)} but {tuple(own[name].shape)} "
                            "here; build the model it was trained as (n_embd, n_head, vocab, ...)")
    model.load_state_dict({**own, **weights})
    return [name for name in own if name not in weights]


ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since 1.6: a zip archive
LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19."  # the older format: a pickled magic number first


def load_checkpoint(path, map_location="cpu") -> dict:
    """Read a checkpoint without unpickling arbitrary objects; errors are one line. Refuses what
    is not a PyTorch file, a file whose pickle names code (never run), a dict of another layout, and
    weights that are not finite (a diverged run's: sampling them prints blanks, resuming trains on NaN)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(len(LEGACY_MAGIC))
    except OSError as e:
        raise UserError(f"cannot read checkpoint {path}: {e.strerror or first_line(e)}") from None
    if not (head.startswith(ZIP_MAGIC) or head == LEGACY_MAGIC):
        what = "it is empty" if not head else "its first bytes are not those of a file torch.save writes"
        raise UserError(f"{path} is not a checkpoint ({what}): pass a ckpt_*.pt or best.pt file that train.py wrote")
    if head.startswith(ZIP_MAGIC):
        check_archive(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "global" not in str(e).lower():  # a damaged pickle, not one that asks for code
            raise UserError(f"cannot read checkpoint {path}: its data is damaged (truncated or corrupt); "
                            "use another checkpoint of the run") from None
        unsafe = [line.strip() for line in str(e).splitlines() if "global" in line.lower()]
        raise UserError(f"refusing to load {path}: it holds objects other than tensors and plain "
                        f"values ({(unsafe or [first_line(e)])[0][:200]}); only load checkpoints you trust, and never "
                        "with weights_only=False") from None
    except (RuntimeError, EOFError, OSError, KeyError, ValueError) as e:
        raise UserError(f"cannot read checkpoint {path}: {first_line(e)} (truncated or not a checkpoint?)") from None
    except Exception as e:  # a damaged pickle can fail the unpickler any way (IndexError, TypeError, ...)
        raise UserError(f"cannot read checkpoint {path}: its data is damaged ({type(e).__name__}: {first_line(e, 80)}); "
                        "use another checkpoint of the run") from None
    check_layout(state, path)
    bad = [name for name, t in state["model"].items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise UserError(f"{path} holds non-finite weights ({bad[0]} has NaN/Inf): it was saved from a diverged "
                        "run; use an earlier checkpoint of it")
    return state


def check_archive(path: Path):
    """Every record of a checkpoint (weights, optimizer state, the pickle) against the CRC-32 that
    torch.save's zip format keeps for it in the archive's directory, written last: torch.load reads
    the bytes unchecked, so flipped or lost ones would load as other weights. Costs ~0.8 s per GB on
    2 CPU cores, a third of what torch.load then takes (a 1.8 GB checkpoint of GPT-2 small with AdamW
    state: 1.3-1.5 s against 4-5.5 s)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as e:
        raise UserError(f"cannot read checkpoint {path}: its data is damaged or cut short ({first_line(e, 120)}); "
                        "use another checkpoint of the run") from None
    if bad is not None:
        raise UserError(f"checkpoint {path} is damaged: its record {bad} does not match its checksum (changed "
                        "bytes); use another checkpoint of the run")


def check_layout(state, path):
    """The parts every reader needs: weights (a dict of tensors), the model config and the tokenizer."""
    if not isinstance(state, dict) or "model" not in state or "model_config" not in state:
        raise UserError(f"{path} is not an attnlab checkpoint (no model weights or model config)")
    weights, mcfg, tok = state["model"], state["model_config"], state.get("tokenizer")
    if not isinstance(weights, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in weights.items()):
        raise UserError(f"{path} is not an attnlab checkpoint: its `model` entry is not a dict of named tensors")
    if not isinstance(mcfg, dict) or not isinstance(tok, dict) or "kind" not in tok:
        raise UserError(f"{path} is not an attnlab checkpoint: its model config or tokenizer entry is missing "
                        "or of another layout")


def step0_loss(run_dir) -> float:
    """The run's step-0 val loss from its metrics (what a model that learned nothing scores); inf unknown."""
    if not (Path(run_dir) / "metrics.jsonl").is_file():
        return math.inf
    try:
        lines = read_metrics(run_dir)
    except UserError:  # a damaged metrics file: no bound to hold checkpoints to
        return math.inf
    return next((float(m["val/loss"]) for m in lines if m.get("step") == 0 and "val/loss" in m), math.inf)


def last_good_checkpoint(run_dir, before_step=None):
    """The newest periodic checkpoint that loads, holds finite weights and whose val loss was below the
    run's step-0 val loss (a checkpoint of a run that learned nothing, or unlearned it, is no place to
    resume from), else best.pt if it is; only those at or before `before_step` (a resumed run's later
    ones belong to the abandoned timeline). None if there is none."""
    below = step0_loss(run_dir)
    best = Path(run_dir) / BEST_NAME
    for p in [*reversed(step_checkpoints(run_dir)), *([best] if best.is_file() else [])]:
        if before_step is not None and p != best and int(p.stem[5:]) > before_step:
            continue
        try:
            val = load_checkpoint(p).get("val_loss")
        except UserError:
            continue
        if val is None and math.isinf(below) or val is not None and math.isfinite(val) and val < below:
            return p
    return None


def model_from_checkpoint(state: dict, device="cpu") -> GPT:
    """Rebuild the model a checkpoint was saved from and load its weights."""
    try:
        config = GPTConfig(**state["model_config"])
    except TypeError as e:  # a key this code does not know: another version's checkpoint
        raise UserError(f"the checkpoint's model config does not fit this code ({first_line(e)}): it was written by "
                        "another version of attnlab") from None
    model = GPT(config)
    load_weights(model, state["model"])
    return model.to(device)


def with_selection(state: dict, select=None, topk=None, block=None) -> dict:
    """The checkpoint read through a choice of keys at evaluation or generation time, no training:
    model.attn.select (moba | oracle | indexer | none; None: the checkpoint's own) with its select_topk and
    select_block (None: the checkpoint's own). What the model cannot take is refused when it is built.
    An indexer learns in training: select=indexer needs a checkpoint trained with one; another choice
    on such a checkpoint leaves its indexer's weights out."""
    given = {"select": select, "select_topk": topk, "select_block": block}
    if all(v is None for v in given.values()):
        return state
    mc = dict(state["model_config"])
    own = (mc.get("attn") or {}).get("select", "none")
    if select == "indexer" and own != "indexer":
        raise UserError(f"select=indexer needs a checkpoint trained with model.attn.select=indexer (this one has "
                        f"{own}): its indexer learns in training; read this one through select=oracle or moba")
    mc["attn"] = {**(mc.get("attn") or {}), **{k: v for k, v in given.items() if v is not None}}
    try:  # what the choice cannot do in this model (no softmax layer, no selection, a selection of everything)
        own_lines = set(GPTConfig(**state["model_config"]).ignored)
        warn_ignored([line.replace("model.attn.", "") for line in GPTConfig(**mc).ignored if line not in own_lines])
    except TypeError:
        pass  # another version's config: model_from_checkpoint says so in one line
    weights = state["model"] if select in (None, own) else \
        {k: v for k, v in state["model"].items() if ".attn.select." not in k}  # an indexer's, now unused
    return {**state, "model_config": mc, "model": weights}


def with_rope_scaling(state: dict, scaling=None, factor=None, longer: bool = False) -> dict:
    """The checkpoint with its RoPE stretched at evaluation or generation time, no training: scaling
    (linear | ntk | yarn; None: the checkpoint's own) by factor (None: the checkpoint's own). With
    `longer`, block_size becomes factor times the trained length (generation then holds that many
    tokens before its cache slides). One line for a model without RoPE."""
    if scaling is None and factor is None:
        return state
    mc = dict(state["model_config"])
    if mc.get("pos", "rope") != "rope":
        raise UserError(f"rope_scaling applies to RoPE models; this one has model.pos={mc.get('pos')}")
    if scaling not in (None, "none") and factor is None and mc.get("rope_scaling_factor", 1.0) == 1:
        raise UserError(f"rope_scaling={scaling} does nothing without rope_scaling_factor: give how many times "
                        "longer than the trained length (e.g. rope_scaling_factor=4)")
    original = mc.get("rope_original_length") or mc["block_size"]
    mc.update(rope_scaling=scaling or mc.get("rope_scaling", "none"),
              rope_scaling_factor=factor or mc.get("rope_scaling_factor", 1.0), rope_original_length=original)
    if longer:
        mc["block_size"] = max(mc["block_size"], int(original * mc["rope_scaling_factor"]))
    return {**state, "model_config": mc}


# ----------------------------------------------------------------------------- resuming

def rng_state(device=torch.device("cpu"), world: int = 1) -> dict:
    """Every random stream a training step may touch, as tensors and plain values. The CPU streams
    are alike on every rank; each rank's GPU has its own (seeded seed + rank), so "cuda" lists every
    rank's, index = rank: under DDP every rank must call this (an all-gather)."""
    np_state = np.random.get_state()
    cuda = []
    if device.type == "cuda":
        cuda = [torch.cuda.get_rng_state(device)]
        if world > 1:
            cuda = [None] * world
            dist.all_gather_object(cuda, torch.cuda.get_rng_state(device))
    return {"python": random.getstate(), "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()),
                                                   *np_state[2:]],
            "torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict, device=torch.device("cpu"), rank: int = 0):
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and rank < len(state["cuda"]):  # a rank new since the save keeps its fresh seed
        torch.cuda.set_rng_state(state["cuda"][rank], device)


def resume_source(resume, out_dir: Path):
    """The checkpoint to resume from: `resume=true` means this run dir's newest one; any other
    value is a run dir or checkpoint file. None when not resuming."""
    if resume is None or str(resume).lower() in ("false", "none", "null", ""):
        return None
    if str(resume).lower() == "true":
        found = latest_checkpoint(out_dir)
        if found is None and in_sweep() and not (Path(out_dir) / "metrics.jsonl").is_file():
            log.warning("resume=true: job dir %s holds no run (a job the stopped sweep never started): starting it",
                        out_dir)
            return None
        if found is None:
            raise UserError(f"resume=true but {out_dir} has no checkpoint: a run stopped before its first one "
                            "starts again without resume=true (same hydra.run.dir); another run's dir is "
                            "resume=RUN_DIR")
        return found
    p = Path(resume).expanduser()
    found = latest_checkpoint(p) if p.is_dir() else (p if p.is_file() else None)
    if found is None:
        raise UserError(f"resume={resume}: no checkpoint there (give a run dir or a ckpt_*.pt file)")
    if found.name == BEST_NAME:
        raise UserError(f"resume={resume}: best.pt holds weights only, no optimizer or data position; "
                        "resume from the run dir (or a ckpt_*.pt file)")
    return found


@dataclass
class ResumePoint:
    """Where a training run starts: a fresh model (no source), or the checkpoint `source`, read as
    `state`, with the context extension it asks for (context_extension)."""
    source: Optional[Path] = None
    state: Optional[dict] = None
    extension: dict = field(default_factory=dict)
    # a new run from another run's checkpoint, leaving that run as it was: one that lengthens its context,
    # resumes from an older checkpoint than its newest, or changes how it trains (why: `branch_why`)
    branch: bool = False
    branch_why: Optional[str] = None


# what a resume may change and still be the same run: how long it goes on and how often it reports
SAME_RUN_KEYS = ("max_iters", "eval_interval", "eval_iters", "log_interval", "ckpt_interval", "keep_ckpts",
                 "log_attn_interval", "final_eval_tokens", "probe_interval")


def changed_training(state: dict, cfg) -> list:
    """The train.* keys whose value differs from the checkpoint's run (those of SAME_RUN_KEYS apart, and
    train.data_seed: another data seed is other data, which check_same_data refuses)."""
    saved = (state.get("config") or {}).get("train") or {}
    now = OmegaConf.to_container(cfg.train, resolve=True)
    return [f"train.{k}={now[k]} (was {saved[k]})" for k in sorted(set(saved) & set(now))
            if k not in (*SAME_RUN_KEYS, "data_seed") and saved[k] != now[k]]


def resume_point(cfg, run_dir: Path) -> ResumePoint:
    """What `resume` asks this run (told `run_dir`) to start from. A resumed run continues in its own
    dir from its newest checkpoint with the settings it trained with; anything else never rewrites that
    run: a longer context, an older checkpoint or changed train.* settings is a new run in `run_dir` that
    records where it came from, and, asked of the run's own dir (resume=true), is refused with the
    command that branches."""
    source = resume_source(cfg.resume, run_dir)
    if source is None:
        return ResumePoint()
    state = load_checkpoint(source)  # to CPU: RNG states must stay there
    extension = context_extension(state, cfg)  # a longer block: known before the model is built
    if "block_size" in extension:  # a longer context: recorded in the run's checkpoints, wherever it continues
        why = "a longer context" if source.parent != run_dir else None
    else:
        why = (f"{source.name} is older than the run's newest checkpoint ({latest_checkpoint(source.parent).name})"
               if source != latest_checkpoint(source.parent) else ", ".join(changed_training(state, cfg)) or None)
        if why and source.parent == run_dir:  # resume=true here would write over the run it resumes
            raise UserError(f"resume from {source} with {why} would rewrite that run: branch into a new run dir "
                            f"instead, python train.py resume={source} (and your overrides); nothing was changed")
    return ResumePoint(source, state, extension, branch=why is not None, branch_why=why)


CONTEXT_KEYS = ("block_size", "rope_scaling", "rope_scaling_factor", "rope_original_length")


def context_extension(state: dict, cfg):
    """A resume may lengthen the context and nothing else of the model: model.block_size above the
    checkpoint's, with RoPE scaling (or ALiBi, NoPE: nothing to scale) changed to reach it. Returns
    what changed ({key: [checkpoint's, now]}; empty if nothing), after setting an unset
    model.rope_original_length to the length RoPE was trained at. One line if the positions cannot
    stretch (a learned or sinusoidal table) or the block would shrink."""
    saved = (state.get("config") or {}).get("model")
    if saved is None:
        return {}
    saved = with_defaults(saved, OmegaConf.to_container(OmegaConf.structured(GPTConfig)))  # keys added since: defaults
    now = cfg.model
    changed = {k: [saved.get(k), now[k]] for k in CONTEXT_KEYS if saved.get(k) != now[k]}
    if "block_size" not in changed or changed["block_size"][0] is None:
        return {k: v for k, v in changed.items() if k != "rope_original_length"}
    old, new = changed["block_size"]
    if new < old:
        raise UserError(f"cannot resume: model.block_size={new} is below the checkpoint's {old}; a resume may only "
                        "lengthen the context")
    if now.pos in ("learned", "sinusoidal"):
        raise UserError(f"cannot resume with model.block_size={new}: model.pos={now.pos} has a table of {old} "
                        "positions; only rope (with model.rope_scaling), alibi and none can lengthen the context")
    if now.rope_original_length is None:  # RoPE was trained at the checkpoint's length (or its own original)
        now.rope_original_length = saved.get("rope_original_length") or old
        changed["rope_original_length"] = [saved.get("rope_original_length"), now.rope_original_length]
    return changed


def with_defaults(saved: dict, defaults: dict) -> dict:
    """`saved` with every key it lacks (at any depth) taken from `defaults`."""
    full = dict(saved)
    for key, value in defaults.items():
        if key not in full:
            full[key] = value
        elif isinstance(value, dict) and isinstance(full[key], dict):
            full[key] = with_defaults(full[key], value)
    return full


def check_resumable(state: dict, cfg, data, extension=()):
    """A checkpoint resumes only into the same model (the context extension's keys apart), tokenizer,
    data and data seed (`data`: the prepared TokenData); name the first difference."""
    saved = state.get("config")
    if not saved:  # nothing to hold this run against: comparing with the schema's defaults would name a wrong key
        raise UserError("cannot resume: the checkpoint holds no run config (not written by train.py?); start a new "
                        "run from its weights with init_from=CKPT")
    now = OmegaConf.to_container(cfg, resolve=True)
    for group, keys in (("model", None), ("data", ("name", "tokenizer", "val_fraction", "bos"))):
        a, b = saved.get(group, {}), now.get(group, {})
        if group in ("model", "data"):  # an option added since the checkpoint was written: it had the default
            schema = GPTConfig if group == "model" else DataConfig
            a = with_defaults(a, OmegaConf.to_container(OmegaConf.structured(schema)))
        for key in keys or sorted(set(a) | set(b)):
            if group == "model" and key in extension:
                continue
            if key != "vocab_size" and a.get(key) != b.get(key):
                name, x, y = f"{group}.{key}", a.get(key), b.get(key)
                while isinstance(x, dict) and isinstance(y, dict):  # name the innermost key: model.attn.gate
                    sub = next(k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k))
                    name, x, y = f"{name}.{sub}", x.get(sub), y.get(sub)
                raise UserError(f"cannot resume: {name} is {y!r} here but {x!r} in the checkpoint; resume with the "
                                "run's own config")
    if state.get("tokenizer") != data.tokenizer.to_dict():  # same size is not enough: ids must mean the same text
        raise UserError("cannot resume: the data's tokenizer differs from the checkpoint's (another corpus "
                        "or vocabulary); resume with the run's own data")
    check_same_data(state, cfg, data)


def check_same_data(state: dict, cfg, data):
    """The same tokens in each split (the token files' checksums: another text with the same
    characters, or documents moved between train and val by data.split_seed, data.val_fraction,
    data.val_split or data.max_tokens, all differ there), and the same data seed (it decides the
    evaluation windows, so the val curve would jump). Checkpoints from before data checksums were
    recorded are compared by their config alone."""
    if state.get("data_sha256") not in (None, data.meta.get("sha256")):
        raise UserError(f"cannot resume: {data.label} holds other tokens than the checkpoint was trained on "
                        f"({data.what_differs}); resume with the run's own data settings")
    saved = state.get("config") or {}
    if "train" in saved and "seed" in saved and data_seed(saved) != data_seed(cfg):
        raise UserError(f"cannot resume: the data seed (train.data_seed, else seed) is {data_seed(cfg)} here but "
                        f"{data_seed(saved)} in the checkpoint: it decides the evaluation windows; resume with the "
                        "run's own seeds")


# ----------------------------------------------------------------------------- a training run's checkpoints

@dataclass
class TrainState:
    """How far a training run has come: what its checkpoints hold about it beside the weights and the
    states of the optimizer, grad scaler, batch sampler, stability watch and RNGs, each under the key
    named in its comment. train.Run holds one; checkpoint_contents writes it, restore reads it back."""
    step: int = 0  # "step": optimizer steps taken, skipped ones included
    best_val: float = math.inf  # "best_val_loss": the lowest val loss of an evaluation so far
    evals: dict = field(default_factory=dict)  # "val_loss" (its "val"): the latest {"train": loss, "val": loss}
    extensions: list = field(default_factory=list)  # "context_extensions": step, block_size and RoPE changes
    wandb_id: Optional[str] = None  # "wandb_id": the W&B run a resume continues, then the run's tracker's own


def checkpoint_contents(model: GPT, parallel: Replicated | FullyShard, state: TrainState, *, data: TokenData,
                        config: dict, out_dir: Path, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                        sampler: torch.Generator, watch: Watch, dist_: Dist, device: torch.device,
                        full: bool = True) -> dict:
    """A checkpoint of a training run: weights, model config, tokenizer, its `state` and resolved `config`;
    with `full`, also what an exact resume needs (optimizer, scaler, sampler, watch and RNG states, W&B run
    id). Every rank calls it (under FSDP the full state is gathered from all of them, to rank 0 alone)."""
    contents = {"model": parallel.model_state(model), "model_config": dataclasses.asdict(model.config),
                "tokenizer": data.tokenizer.to_dict(), "step": state.step, "val_loss": state.evals.get("val"),
                "best_val_loss": state.best_val, "config": config,
                # whether a sample may start from <|endoftext|>: only if the model saw documents begin after one
                "eot_in_train": data.meta.get("eot_in_train"),
                "context_extensions": state.extensions,
                "data_sha256": data.meta.get("sha256")}  # what resuming must find again (check_resumable)
    if full:
        contents.update(optimizer=parallel.optimizer_state(model, optimizer), scaler=scaler.state_dict(),
                        sampler=sampler.get_state(), rng=rng_state(device, dist_.world), wandb_id=state.wandb_id,
                        watch=watch.state_dict())
    bad = [n for n, t in contents["model"].items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:  # never write a checkpoint that holds NaN/Inf
        raise UserError(f"weights are not finite at step {state.step} ({bad[0]}): not saving; "
                        f"last good checkpoint: {last_good_checkpoint(out_dir, state.step) or 'none'}")
    return contents


def restore(point: ResumePoint, *, cfg: DictConfig, data: TokenData, model: GPT, parallel: Replicated | FullyShard,
            optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, sampler: torch.Generator, watch: Watch,
            dist_: Dist, device: torch.device) -> TrainState:
    """Continue a training run from the checkpoint `point`: load its weights, optimizer, grad scaler,
    batch sampler, stability watch and every RNG into these, and return its TrainState; with a context
    extension (a longer block, RoPE scaled to it), recorded in the run's checkpoints. A branch is a new
    run started from it (a fine-tune in another dir), with a W&B run of its own. The reverse of
    checkpoint_contents."""
    state, source, extension = point.state, point.source, point.extension
    missing = [k for k in ("step", "optimizer", "sampler", "rng", "best_val_loss") if k not in state]
    if missing:
        raise UserError(f"cannot resume from {source}: it has no {', '.join(missing)} (weights only?); resume "
                        "from a ckpt_*.pt file train.py wrote, or start a new run")
    check_resumable(state, cfg, data, extension)
    if state["step"] > cfg.train.max_iters:
        raise UserError(f"the checkpoint is at step {state['step']}, past train.max_iters={cfg.train.max_iters}: "
                        f"pass train.max_iters > {state['step']} to train on (nothing was changed)")
    parallel.load_model(model, state["model"])
    try:
        parallel.load_optimizer(model, optimizer, state["optimizer"])
        if scaler.is_enabled() and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        sampler.set_state(state["sampler"])
        set_rng_state(state["rng"], device, dist_.rank)
    except (KeyError, ValueError, TypeError, RuntimeError, IndexError) as e:
        raise UserError(f"cannot resume from {source}: its optimizer or random state does not fit this run "
                        f"({type(e).__name__}: {first_line(e, 120)}); resume with the run's own config") from None
    watch.load_state_dict(state.get("watch") or {})  # older checkpoints: watched from here on
    progress = TrainState(step=state["step"], best_val=state["best_val_loss"], evals={"val": state.get("val_loss")},
                          extensions=list(state.get("context_extensions") or []),
                          wandb_id=state.get("wandb_id") if not point.branch else None)
    if extension and "block_size" in extension:
        progress.extensions.append({"step": progress.step, **extension})
        log.info("extending the context at step %d: %s", progress.step,
                 ", ".join(f"model.{k} {a} -> {b}" for k, (a, b) in extension.items()))
    log.info("resuming from %s at step %d", source, progress.step)
    return progress
