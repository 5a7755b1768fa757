"""Multi-query associative recall (`data=mqar`): Zoology's synthetic task (Arora et al. 2023, arXiv
2312.04927), generated here, nothing downloaded.

Each example is one window of model.block_size tokens: a number of key-value pairs from `data.pairs`
(a list: several make an equal mix; distinct keys, random values), then, in the rest, each of those keys asked once in a random order at a random place,
its value right after it; every other position is a filler token. The loss is taken on the answers
only (the value after a queried key, predicted at the key), and `val/recall_acc` is the share of them
the model gets exactly (argmax). A key asked must be looked up among everything seen so far: what a
fixed-size state can hold only about d_k of (the reason hybrids keep some attention layers).

Tokens: 0 the filler, then keys, then values, written `k1 k2 ... v1 v2 ...` (the `mqar` tokenizer).
"""
import hashlib
import json

import numpy as np
import torch

from rules import UserError

FILLER = "·"


class MQARTokenizer:
    """ids <-> names: 0 the filler, 1..K keys k1..kK, K+1..V-1 values v1..v(V-1-K)."""

    kind = "mqar"
    eot = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.keys = (vocab_size - 1) // 2  # names are computed, not listed: a vocabulary may be millions

    def name(self, i: int) -> str:
        return FILLER if i == 0 else f"k{i}" if i <= self.keys else f"v{i - self.keys}"

    def id(self, name: str):
        """The id of a token name, or None if it is not one."""
        if name == FILLER:
            return 0
        head, num = name[:1], name[1:]
        if head not in ("k", "v") or not num.isdigit() or num != str(int(num)) or int(num) < 1:
            return None
        i = int(num) + (self.keys if head == "v" else 0)
        return i if (i <= self.keys if head == "k" else i < self.vocab_size) else None

    def encode(self, text: str) -> np.ndarray:
        ids = [self.id(t) for t in text.split()]
        if None in ids:
            raise UserError(f"{text.split()[ids.index(None)]!r} is not an mqar token: write keys k1..k{self.keys}, "
                            f"values v1..v{self.vocab_size - 1 - self.keys} and {FILLER}, separated by spaces")
        return np.array(ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return "".join(" " + self.name(int(i)) for i in ids)  # a leading space: pieces join as the text does

    def to_dict(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size}


ROWS = 4096  # examples drawn per chunk: every random matrix is at most ROWS x max(keys, slots)


def distinct_keys(rng, n: int, pairs: int, keys: int) -> np.ndarray:
    """n rows of `pairs` distinct keys out of 1..keys. A uniform random ordering of the keys, cut to
    `pairs`: a row's sorting keys are drawn in chunks of ROWS rows, so memory stays ROWS x keys
    (the random stream is the same as one n x keys draw). With many keys (over 2^16) and few pairs, draws
    with replacement and redraws the rows that repeat a key."""
    out = np.empty((n, pairs), dtype=np.int64)
    if keys <= 2 ** 16:
        for i in range(0, n, ROWS):
            out[i:i + ROWS] = np.argsort(rng.random((min(ROWS, n - i), keys)), axis=1)[:, :pairs] + 1
        return out
    out[:] = rng.integers(1, keys + 1, (n, pairs))
    while True:
        s = np.sort(out, axis=1)
        bad = np.flatnonzero((s[:, 1:] == s[:, :-1]).any(axis=1))
        if not len(bad):
            return out
        out[bad] = rng.integers(1, keys + 1, (len(bad), pairs))


def generate(n: int, length: int, pairs: int, vocab_size: int, seed: int):
    """n examples (x, y) of `length` tokens with `pairs` pairs each: x the tokens, y the answers (-1
    where none). The random draws come in chunks of rows (see distinct_keys), so the memory beyond x
    and y stays bounded whatever the vocabulary."""
    tok = MQARTokenizer(vocab_size)
    rng = np.random.default_rng(seed)
    x = np.zeros((n, length + 1), dtype=np.int64)
    y = np.full((n, length), -1, dtype=np.int64)
    slots = (length + 1 - 2 * pairs) // 2  # (key, value) slots after the context's pairs
    keys = distinct_keys(rng, n, pairs, tok.keys)
    values = rng.integers(tok.keys + 1, vocab_size, (n, pairs))
    x[:, 0:2 * pairs:2], x[:, 1:2 * pairs:2] = keys, values
    asked = np.argsort(rng.random((n, pairs)), axis=1)  # the order the keys are asked in
    where = np.empty((n, pairs), dtype=np.int64)  # each query's key
    for i in range(0, n, ROWS):
        draw = rng.random((min(ROWS, n - i), slots))
        where[i:i + ROWS] = 2 * pairs + 2 * np.sort(np.argsort(draw, axis=1)[:, :pairs], axis=1)
    rows = np.arange(n)[:, None]
    x[rows, where], x[rows, where + 1] = keys[rows, asked], values[rows, asked]
    y[rows, where] = values[rows, asked]  # predicted at the key: the next token
    return torch.from_numpy(x[:, :length]), torch.from_numpy(y)


def examples_per_split(examples: int, pairs: list) -> dict:
    """How many examples of each number of pairs each split holds."""
    return {"train": -(-examples // len(pairs)), "val": max(256, examples // 10 // len(pairs))}


def check_examples_memory(examples: int, pairs: list, block_size: int):
    """Refuse, before anything is drawn, a set of examples larger than half the memory this machine
    has available (x and y, int64, and generation's working copy)."""
    per = examples_per_split(examples, pairs)
    need = len(pairs) * (per["train"] + per["val"]) * (2 * block_size + 1) * 8 * 2
    have = available_memory()
    if have is not None and need > have / 2:
        raise UserError(f"data.examples={examples} windows of model.block_size={block_size} need about "
                        f"{need / 2**30:.1f} GiB in memory, and this machine has {have / 2**30:.1f} GiB available: "
                        "lower data.examples (or model.block_size)")


def available_memory():
    """Bytes of memory available now (Linux's MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_config(cfg, block_size: int):
    """The data config's relations to the model's window and the machine, before anything is drawn:
    a one-line UserError for the first that fails (train.py checks this with the rest of the config)."""
    pairs, vocab = list(cfg.pairs), cfg.vocab_size or 256
    if not pairs:
        raise UserError("data.pairs=[] names no number of pairs: give at least one, e.g. data.pairs=[8] "
                        "(several make an equal mix: data.pairs=[4,8,16])")
    for p in pairs:
        if 4 * p > block_size + 1:
            raise UserError(f"data.pairs={p} needs windows of at least {4 * p - 1} tokens (each pair once "
                            f"as context and once asked), but model.block_size={block_size}: lower data.pairs or "
                            "raise model.block_size")
        if p > (vocab - 1) // 2:
            raise UserError(f"data.pairs={p} needs as many distinct keys, but data.vocab_size={vocab} has "
                            f"{(vocab - 1) // 2}: raise data.vocab_size")
    if len(set(pairs)) != len(pairs):
        raise UserError(f"data.pairs={pairs} names a number twice: give each once")
    check_examples_memory(cfg.examples, pairs, block_size)


class MQARData:
    """The data a run trains on (TokenData's interface): a fixed training set of `data.examples`
    examples and a validation set of a tenth as many (at least 256 per number of pairs), both drawn
    from `data.split_seed`. With several numbers of pairs (data.pairs=[4,8,16]) each is an equal share
    of both sets, and the recall is logged for each too (val/recall_acc/pairs8). Windows are whole
    examples: a start is an example's index times the window length."""

    what_differs = "other data.pairs / vocab_size / examples / split_seed"  # as TokenData's

    def __init__(self, cfg, block_size: int):
        check_config(cfg, block_size)  # the memory the examples take too
        self.label = f"the mqar examples (data.pairs={list(cfg.pairs)}, data.examples={cfg.examples})"
        pairs, vocab = list(cfg.pairs), cfg.vocab_size or 256
        per = examples_per_split(cfg.examples, pairs)
        self.block_size, self.bos, self.pairs = block_size, None, pairs
        self.tokenizer, self.vocab_size = MQARTokenizer(vocab), vocab
        self.examples, self.groups = {}, {}
        for i, split in enumerate(per):
            parts = [generate(per[split], block_size, p, vocab, cfg.split_seed + 2 * i + 1000 * j)
                     for j, p in enumerate(pairs)]
            self.examples[split] = tuple(torch.cat(t) for t in zip(*parts))
            self.groups[split] = {p: slice(j * per[split], (j + 1) * per[split]) for j, p in enumerate(pairs)}
        sizes = {s: len(x) for s, (x, _) in self.examples.items()}
        self.splits = {s: range(n * block_size + 1) for s, n in sizes.items()}  # what full_val_loss cuts windows of
        spec = json.dumps({"pairs": pairs, "vocab": vocab, "examples": cfg.examples, "seed": cfg.split_seed,
                           "length": block_size}, sort_keys=True)
        self.meta = {"sha256": hashlib.sha256(spec.encode()).hexdigest(), "name": "mqar"}

    def bits_per_char_factor(self):
        return None  # not text

    def check_block_size(self, block_size: int):
        if block_size != self.block_size:
            raise UserError(f"the mqar examples were made for windows of {self.block_size}, not {block_size}")

    def sample_starts(self, split: str, shape, block_size: int, generator: torch.Generator):
        return torch.randint(len(self.examples[split][0]), shape, generator=generator) * block_size

    def batch(self, split: str, starts, block_size: int):
        x, y = self.examples[split]
        return x[starts // block_size], y[starts // block_size]

    def get_batch(self, split: str, batch_size: int, block_size: int, generator: torch.Generator):
        return self.batch(split, self.sample_starts(split, (batch_size,), block_size, generator), block_size)

    @torch.no_grad()
    def metrics(self, model, autocast, batch_size: int = 64) -> dict:
        """val/recall_acc: the share of the val examples' answers the model's argmax gets right; with
        several numbers of pairs, also each one's (val/recall_acc/pairs{n})."""
        x, y = self.examples["val"]
        device = next(model.parameters()).device
        right = torch.zeros(len(x), dtype=torch.long)
        asked = (y >= 0).sum(1)
        for i in range(0, len(x), batch_size):
            xb, yb = x[i:i + batch_size].to(device), y[i:i + batch_size].to(device)
            with autocast():
                pred = model(xb).argmax(-1)
            right[i:i + batch_size] = ((pred == yb) & (yb >= 0)).sum(1).cpu()
        out = {"val/recall_acc": right.sum().item() / asked.sum().item()}
        if len(self.pairs) > 1:
            for p, part in self.groups["val"].items():
                out[f"val/recall_acc/pairs{p}"] = right[part].sum().item() / asked[part].sum().item()
        return out
