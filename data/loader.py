"""Training-time access to a prepared dataset: memmapped token files and random windows of them."""
import json
import math
from pathlib import Path

import numpy as np
import torch

from files import file_digest
from rules import UserError
from data.tokenizer import WithBos, tokenizer_from_dict

SPLITS = ("train", "val")


def token_files_damage(directory: Path, meta: dict, checksums: bool = True):
    """What is wrong with a prepared dataset's token files against its meta.json, or None: a file
    missing, or holding another number of tokens than meta.json records, or (checksums) other bytes
    than its sha256 says."""
    if "sha256" not in meta:
        return "meta.json holds no checksums (an older version prepared it)"
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in SPLITS:
        path, want = Path(directory) / f"{split}.bin", meta["tokens"][split]
        if not path.is_file():
            return f"{path.name} is missing"
        if path.stat().st_size != want * itemsize:
            return f"{path.name} holds {path.stat().st_size / itemsize:,.0f} tokens, meta.json says {want:,}"
        if checksums and file_digest(path) != meta["sha256"][split]:
            return f"{path.name} does not match its checksum in meta.json"
    return None


class TokenData:
    """A prepared dataset (see data/prepare.py) opened read-only: memmapped splits plus its tokenizer.
    data/prepare.py has checked every byte against its checksum; the lengths are checked again here.
    With bos, every window starts with the tokenizer's extra id `bos` (data.bos)."""

    # what a refusal to resume on other data names: the data, and the settings that change its tokens
    what_differs = "another text, or other data.split_seed / val_fraction / val_split / max_tokens"

    def __init__(self, directory: Path, bos: bool = False):
        self.dir = Path(directory)
        self.label = f"the prepared data ({self.dir.name})"
        self.bos = None
        try:
            self.meta = json.loads((self.dir / "meta.json").read_text())
            damage = token_files_damage(self.dir, self.meta, checksums=False)
            if damage is None:
                self.tokenizer = tokenizer_from_dict(self.meta["tokenizer"])
                if bos:
                    self.tokenizer = WithBos(self.tokenizer)
                    self.bos = self.tokenizer.bos
                self.vocab_size = self.meta["vocab_size"] + (1 if bos else 0)
                self.splits = {s: np.memmap(self.dir / f"{s}.bin", dtype=self.meta["dtype"], mode="r") for s in SPLITS}
        except (OSError, ValueError, KeyError, TypeError) as e:  # edited, truncated or half-deleted by hand
            damage = f"{type(e).__name__}: {str(e)[:100]}"
        if damage:
            raise UserError(f"the prepared data in {self.dir} is damaged ({damage}): delete that directory and it is "
                            "prepared again")

    def unigram_loss(self, most: int = 1 << 24) -> float:
        """The val split's cross-entropy (nats per token) under the train split's token frequencies (each
        count plus one, so no token is impossible): what a model that learned only how often each token
        comes scores. A split longer than `most` tokens is read at an even stride."""
        def counted(split):
            ids = self.splits[split]
            return np.asarray(ids[::max(1, len(ids) // most)], dtype=np.int64)
        counts = np.bincount(counted("train"), minlength=self.vocab_size).astype(np.float64) + 1.0
        logp = np.log(counts / counts.sum())
        return float(-logp[counted("val")].mean())

    def bits_per_char_factor(self):
        """nats/token -> bits/character (what compares runs with different tokenizers), or None."""
        chars = self.meta.get("val_characters")
        return len(self.splits["val"]) / chars / math.log(2) if chars else None

    def check_block_size(self, block_size: int):
        for split, arr in self.splits.items():
            if len(arr) <= block_size + 1:
                raise UserError(f"model.block_size={block_size} is too large for the {split} split "
                                f"({len(arr)} tokens): lower model.block_size or give more data")

    def sample_starts(self, split: str, shape, block_size: int, generator: torch.Generator):
        """Random window starts of the given shape, e.g. (grad_accum, batch_size). Every DDP rank
        draws the same starts from the same generator and reads only its own share, so the
        global batch does not depend on the number of processes."""
        return torch.randint(len(self.splits[split]) - block_size - 1, shape, generator=generator)

    def batch(self, split: str, starts, block_size: int):
        """Windows at `starts` (B,): x = tokens[i : i+T], y = tokens[i+1 : i+T+1], each (B, T) int64.
        With bos: x = [bos, tokens[i : i+T-1]], y = tokens[i : i+T] (the first token is predicted from bos)."""
        data = self.splits[split]
        window = np.stack([data[i:i + block_size + 1] for i in starts.tolist()]).astype(np.int64)  # (B, T+1)
        window = torch.from_numpy(window)
        if self.bos is not None:
            return torch.cat([torch.full_like(window[:, :1], self.bos), window[:, :-2]], 1), window[:, :-1]
        return window[:, :-1], window[:, 1:]

    def get_batch(self, split: str, batch_size: int, block_size: int, generator: torch.Generator):
        return self.batch(split, self.sample_starts(split, (batch_size,), block_size, generator), block_size)

    def metrics(self, model, autocast) -> dict:
        """What an evaluation logs besides the losses: nothing for text (data/mqar.py: recall accuracy)."""
        return {}
