"""The one place checkpoints are written, found and read.

A checkpoint is a dict of tensors and plain values (weights, model config, tokenizer, step,
optimizer state, the run's resolved config), so it loads with `torch.load(weights_only=True)`:
a file carrying a pickled object that would run code is refused, never executed. It is written
to a temporary file, fsynced and renamed over the old one, so a crash at any moment leaves the
previous checkpoint intact.
"""
import os
import pickle
from pathlib import Path

import torch

from common import UserError
from model import GPT, GPTConfig

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


def save_checkpoint(path, state: dict) -> Path:
    """Atomically write `state` (tensors and plain Python values only) to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
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


def load_checkpoint(path, map_location="cpu") -> dict:
    """Read a checkpoint without unpickling arbitrary objects; errors are one line."""
    path = Path(path)
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"refusing to load {path}: it holds objects other than tensors and plain "
                        f"values ({first[:200]}); only load checkpoints you trust, and never with "
                        "weights_only=False") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise UserError(f"cannot read checkpoint {path}: {str(e).splitlines()[0][:200]} "
                        "(truncated or not a checkpoint?)") from None
    if not isinstance(state, dict) or "model" not in state or "model_config" not in state:
        raise UserError(f"{path} is not an attnlab checkpoint (no model weights or model config)")
    return state


def model_from_checkpoint(state: dict, device="cpu") -> GPT:
    """Rebuild the model a checkpoint was saved from and load its weights."""
    model = GPT(GPTConfig(**state["model_config"]))
    load_weights(model, state["model"])
    return model.to(device)


def load_weights(model: GPT, weights: dict):
    """load_state_dict, with shape mismatches named in one line instead of a traceback."""
    own = model.state_dict()
    for name, tensor in weights.items():
        if name in own and own[name].shape != tensor.shape:
            raise UserError(f"checkpoint does not fit this model: {name} is {tuple(tensor.shape)} in the "
                            f"checkpoint but {tuple(own[name].shape)} here (different n_embd/vocab/...)")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise UserError(f"checkpoint does not fit this model: missing {missing[:3]}, unexpected {unexpected[:3]}")
