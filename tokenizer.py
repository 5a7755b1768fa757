"""Tokenizers: text <-> token ids. Each one round-trips through a plain dict (`to_dict`), which
is stored beside the prepared data and inside every checkpoint, so sampling needs nothing else."""
import numpy as np

from errors import UserError


class CharTokenizer:
    """One token per distinct character of the training corpus, ids in code-point order."""

    kind = "char"

    def __init__(self, chars: str):
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.vocab_size = len(chars)
        self._codepoints = np.array([ord(c) for c in chars], dtype=np.uint32)  # sorted

    @classmethod
    def train(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    def encode(self, text: str) -> np.ndarray:
        unknown = sorted(set(text) - self.stoi.keys())
        if unknown:
            raise UserError(f"text has characters outside the vocabulary: {''.join(unknown)!r} "
                            "(a char-level model only knows the characters of its training corpus)")
        # vectorised lookup: code points -> rank in the sorted vocabulary
        codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        return np.searchsorted(self._codepoints, codepoints).astype(np.int64)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}


def tokenizer_from_dict(d: dict):
    if d.get("kind") == "char":
        return CharTokenizer(d["chars"])
    raise UserError(f"unknown tokenizer kind {d.get('kind')!r} in checkpoint or data cache")


def train_tokenizer(name: str, text: str):
    """The tokenizer `data.tokenizer=name`, fitted on `text` where it learns from data."""
    if name == "char":
        return CharTokenizer.train(text)
    raise UserError(f"data.tokenizer={name!r} is unknown: use char")
