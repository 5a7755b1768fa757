"""Tokenizers: text <-> token ids. Each one round-trips through a plain dict (`to_dict`) of
strings and numbers, stored beside the prepared data and inside every checkpoint, so sampling
needs nothing else (and checkpoints still load with weights_only=True).

- `char`: one token per distinct character of the corpus.
- a tiktoken encoding by name (`r50k_base` is the GPT-2 BPE, `cl100k_base`, ...).
- `bpe`: a byte-level BPE trained on the training split with rustbpe, then run through
  `tiktoken.Encoding` for fast encoding and decoding (the nanochat pattern).
BPE tokenizers end every document with `<|endoftext|>`.
"""
import base64
import codecs
import logging
import re
import sys
from contextlib import contextmanager
from functools import lru_cache

import numpy as np

from rules import UserError

EOT = "<|endoftext|>"


class CharTokenizer:
    """One token per distinct character of the training corpus, ids in code-point order."""

    kind = "char"
    eot = None  # char-level corpora are one stream of text

    def __init__(self, chars: str):
        self.chars = chars
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.vocab_size = len(chars)
        self._codepoints = np.array([ord(c) for c in chars], dtype=np.uint32)  # sorted

    @classmethod
    def train(cls, texts) -> "CharTokenizer":
        return cls("".join(sorted(set().union(*map(set, texts)))))

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


class TiktokenTokenizer:
    """A tiktoken.Encoding: a named one, or one built from trained ranks (kind `bpe`)."""

    def __init__(self, encoding, spec: dict):
        self.enc = encoding
        self.spec = spec
        self.kind = spec["kind"]
        self.eot = encoding.eot_token
        self.vocab_size = encoding.n_vocab

    @classmethod
    def named(cls, name: str) -> "TiktokenTokenizer":
        import tiktoken
        try:
            enc = tiktoken.get_encoding(name)
        except ValueError:
            raise UserError(f"data.tokenizer={name!r} is unknown: use char, bpe or a tiktoken encoding "
                            f"({', '.join(tiktoken.list_encoding_names())})") from None
        except Exception as e:  # no network and no cached file
            raise UserError(f"cannot load the tiktoken encoding {name!r} ({type(e).__name__}): offline? point "
                            "TIKTOKEN_CACHE_DIR at a directory that holds its file (one run with the network "
                            "fills tiktoken's own cache), or use data.tokenizer=char or bpe") from None
        return cls(enc, {"kind": "tiktoken", "name": name})

    @classmethod
    def from_ranks(cls, ranks: list, pattern: str) -> "TiktokenTokenizer":
        """ranks: token byte strings in rank order (the 256 single bytes first, then merges)."""
        import tiktoken
        enc = tiktoken.Encoding(f"attnlab-bpe-{len(ranks)}", pat_str=pattern,
                                mergeable_ranks={tok: i for i, tok in enumerate(ranks)},
                                special_tokens={EOT: len(ranks)})
        spec = {"kind": "bpe", "pattern": pattern, "ranks": [base64.b64encode(t).decode() for t in ranks]}
        return cls(enc, spec)

    @classmethod
    def train(cls, texts, vocab_size: int) -> "TiktokenTokenizer":
        """Byte-level BPE with vocab_size tokens in all: 256 bytes, merges, and <|endoftext|>."""
        import rustbpe
        if vocab_size < 257:
            raise UserError(f"data.vocab_size={vocab_size} is too small for a byte-level BPE: use >= 257")
        trainer = rustbpe.Tokenizer()
        with merge_progress_bar():
            trainer.train_from_iterator(iter(texts), vocab_size - 1)
        ranks = [bytes(tok) for tok, _ in sorted(trainer.get_mergeable_ranks(), key=lambda kv: kv[1])]
        return cls.from_ranks(ranks, trainer.get_pattern())

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.enc.encode_ordinary(text), dtype=np.int64)

    def encode_batch(self, texts) -> list:
        return self.enc.encode_ordinary_batch(list(texts))

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids])

    def to_dict(self) -> dict:
        return dict(self.spec)


class WithBos:
    """A tokenizer plus one id past its vocabulary, `bos`, that starts every training window
    (data.bos=true): a fixed first token, as models trained on documents see. Text never encodes
    to it; decoding drops it."""

    def __init__(self, tok):
        self.tok = tok
        self.bos = tok.vocab_size
        self.vocab_size = tok.vocab_size + 1

    def __getattr__(self, name):  # kind, eot, enc, encode, ...: the wrapped tokenizer's
        return getattr(self.tok, name)

    def decode(self, ids) -> str:
        return self.tok.decode([i for i in ids if int(i) != self.bos])

    def to_dict(self) -> dict:
        return {**self.tok.to_dict(), "bos": True}


@contextmanager
def merge_progress_bar():
    """rustbpe logs each percent of its merge loop as an INFO line (about 100 of them): show one
    progress bar instead (on a terminal), and keep its lines out of the run's log."""
    from tqdm import tqdm

    class ToBar(logging.Handler):
        def emit(self, record):
            m = re.search(r"\((\d+)/(\d+) merges\)", record.getMessage())
            if m:
                bar.total = int(m.group(2))
                bar.update(int(m.group(1)) - bar.n)

    logger = logging.getLogger("rustbpe")
    handler, propagate, level = ToBar(), logger.propagate, logger.level
    bar = tqdm(desc="training BPE", unit="merge", disable=not sys.stderr.isatty())
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate, logger.level = propagate, level
        bar.close()


def tokenizer_from_dict(d: dict):
    kind = d.get("kind") if isinstance(d, dict) else None
    if kind and d.get("bos"):
        return WithBos(tokenizer_from_dict({k: v for k, v in d.items() if k != "bos"}))
    try:
        if kind == "char":
            return CharTokenizer(d["chars"])
        if kind == "tiktoken":
            return TiktokenTokenizer.named(d["name"])
        if kind == "bpe":
            return TiktokenTokenizer.from_ranks([base64.b64decode(t, validate=True) for t in d["ranks"]], d["pattern"])
        if kind == "mqar":
            from data.mqar import MQARTokenizer
            return MQARTokenizer(int(d["vocab_size"]))
    except (KeyError, TypeError, ValueError) as e:  # binascii.Error is a ValueError
        raise UserError(f"the {kind} tokenizer stored in the checkpoint or data cache is damaged "
                        f"({type(e).__name__}: {str(e)[:100]}): use another checkpoint, or delete the cache "
                        "entry") from None
    raise UserError(f"unknown tokenizer kind {kind!r} in checkpoint or data cache")


class StreamDecoder:
    """Token ids -> text, a few at a time: a BPE token can end inside a UTF-8 character, whose
    bytes then wait for the next token. The pieces (and flush()) join to what decode() gives for
    all the ids at once, at a cost per token that does not grow with the text (decoding the whole
    continuation after every token is quadratic)."""

    def __init__(self, tok):
        self.tok = tok
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if hasattr(tok, "enc") else None

    def feed(self, ids) -> str:
        if self.utf8 is None:
            return self.tok.decode(ids)
        bos = getattr(self.tok, "bos", None)
        return self.utf8.decode(self.tok.enc.decode_bytes([int(i) for i in ids if int(i) != bos]))

    def flush(self) -> str:
        """The bytes still held (an unfinished character, shown as U+FFFD as decode() does)."""
        return self.utf8.decode(b"", final=True) if self.utf8 is not None else ""


@lru_cache(maxsize=4)
def cached_tokenizer(spec_key: str):
    """A tokenizer rebuilt from its dict's JSON, once per process (for datasets' worker processes)."""
    import json
    return tokenizer_from_dict(json.loads(spec_key))


def train_tokenizer(name: str, texts, vocab_size=None):
    """The tokenizer `data.tokenizer=name`, fitted on the training texts where it learns from data."""
    if name == "char":
        return CharTokenizer.train(texts)
    if name == "bpe":
        if not vocab_size:
            raise UserError("data.tokenizer=bpe needs data.vocab_size=N (e.g. 1024)")
        if vocab_size < 257:
            raise UserError(f"data.vocab_size={vocab_size} must be >= 257 with data.tokenizer=bpe: a byte-level BPE "
                            "holds the 256 bytes and <|endoftext|>")
        return TiktokenTokenizer.train(texts, vocab_size)
    return TiktokenTokenizer.named(name)
