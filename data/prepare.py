"""Text -> token ids on disk, once; then random windows of them for training.

    python data/prepare.py data=shakespeare_char data.path=input.txt   # ahead of training

A prepared dataset is a directory of `train.bin` and `val.bin` (flat token ids, uint16 when the
vocabulary fits, else uint32) and `meta.json` (the tokenizer, dtype, counts). Its name holds a
hash of everything that decides its content, so a second run with the same settings reuses it;
it is written under a temporary name and renamed into place, so an interrupted preparation never
leaves a directory that looks complete.
"""
import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

if __name__ == "__main__":  # run as a script: make the repo's modules importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from errors import UserError
from tokenizer import tokenizer_from_dict, train_tokenizer

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]
FORMAT_VERSION = 1  # bump when the on-disk layout or tokenization changes
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
PRESET_URLS = {"shakespeare_char": SHAKESPEARE_URL}


# ----------------------------------------------------------------------------- sources

def python_docs_text() -> str:
    """The embedded corpus: the prose of Python's own documentation (pydoc topics), which ships
    with CPython, so the default run needs no download. Its content follows the Python version."""
    from pydoc_data.topics import topics
    return "\n".join(topics[k] for k in sorted(topics))


def load_text_file(path_or_url: str) -> str:
    """The whole text of a local file or URL, read by `datasets`' text loader."""
    import datasets
    from datasets import load_dataset

    datasets.disable_progress_bars()
    is_url = "://" in path_or_url
    if not is_url and not Path(path_or_url).is_file():
        raise UserError(f"data.path={path_or_url!r}: no such file (give a UTF-8 text file)")
    try:
        ds = load_dataset("text", data_files=path_or_url, sample_by="document", split="train",
                          keep_in_memory=True)
    except Exception as e:
        chain, cause = [], e
        while cause is not None:
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        if any(isinstance(c, UnicodeDecodeError) for c in chain):
            raise UserError(f"data.path={path_or_url!r} is not UTF-8 text: convert it "
                            "(e.g. iconv -t UTF-8) or pick another file") from None
        if is_url:
            raise UserError(f"could not load {path_or_url} ({type(e).__name__}): offline? download "
                            "it elsewhere and pass data.path=FILE") from None
        raise
    text = "".join(ds["text"])
    if not text.strip():
        raise UserError(f"data.path={path_or_url!r} holds no text: give a non-empty UTF-8 file")
    return text


def source_of(data_cfg):
    """(kind, location) of the corpus: a local file, a URL, or the embedded Python docs."""
    if data_cfg.path:
        return "file", str(Path(data_cfg.path).expanduser())
    if data_cfg.url:
        return "url", data_cfg.url
    if data_cfg.name in PRESET_URLS:
        return "url", PRESET_URLS[data_cfg.name]
    if data_cfg.name == "python_docs":
        return "python_docs", sys.version.split()[0]
    raise UserError(f"data={data_cfg.name!r} has no source: set data.path=FILE or data.url=URL")


def cache_key(data_cfg, kind: str, location: str) -> str:
    if kind == "file":
        if not Path(location).is_file():
            raise UserError(f"data.path={location!r}: no such file (give a UTF-8 text file)")
        h = hashlib.sha256()
        with open(location, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        identity = h.hexdigest()  # the content, not the path: an edited file is re-prepared
    elif kind == "python_docs":
        identity = hashlib.sha256(python_docs_text().encode()).hexdigest()
    else:
        identity = location
    settings = {"v": FORMAT_VERSION, "source": identity, "tokenizer": data_cfg.tokenizer,
                "val_fraction": data_cfg.val_fraction}
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- prepare

def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def prepare(data_cfg) -> Path:
    """Tokenize the configured corpus into a cached directory (reused when it exists); return it."""
    if not 0.0 < data_cfg.val_fraction < 1.0:
        raise UserError(f"data.val_fraction={data_cfg.val_fraction} must be in (0, 1)")
    kind, location = source_of(data_cfg)
    cache_root = Path(data_cfg.cache_dir) if data_cfg.cache_dir else REPO / "data" / "cache"
    final = cache_root / f"{data_cfg.name}-{data_cfg.tokenizer}-{cache_key(data_cfg, kind, location)}"
    if (final / "meta.json").is_file():
        log.info("using prepared data %s", final)
        return final

    text = python_docs_text() if kind == "python_docs" else load_text_file(location)
    tok = train_tokenizer(data_cfg.tokenizer, text)
    ids = tok.encode(text)
    n_val = int(len(ids) * data_cfg.val_fraction)
    if n_val < 2 or len(ids) - n_val < 2:
        raise UserError(f"the corpus has only {len(ids)} tokens: too few to split with "
                        f"data.val_fraction={data_cfg.val_fraction}")
    dtype = token_dtype(tok.vocab_size)
    splits = {"train": ids[:-n_val], "val": ids[-n_val:]}  # val is the end of the text, as in nanoGPT

    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = cache_root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for split, arr in splits.items():
            with open(tmp / f"{split}.bin", "wb") as f:
                f.write(arr.astype(dtype).tobytes())
                f.flush()
                os.fsync(f.fileno())
        meta = {"format_version": FORMAT_VERSION, "source": {"kind": kind, "location": location},
                "tokenizer": tok.to_dict(), "vocab_size": tok.vocab_size, "dtype": np.dtype(dtype).name,
                "tokens": {k: int(len(v)) for k, v in splits.items()}, "characters": len(text)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))  # written last: the "complete" mark
        try:
            os.rename(tmp, final)  # atomic: readers see all of it or none of it
        except OSError:  # another process finished the same preparation first
            if not (final / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("prepared %s: %s tokens (vocab %d)", final, meta["tokens"], tok.vocab_size)
    return final


class TokenData:
    """A prepared dataset opened read-only: memmapped splits plus its tokenizer."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.meta = json.loads((self.dir / "meta.json").read_text())
        self.tokenizer = tokenizer_from_dict(self.meta["tokenizer"])
        self.vocab_size = self.meta["vocab_size"]
        self.splits = {s: np.memmap(self.dir / f"{s}.bin", dtype=self.meta["dtype"], mode="r")
                       for s in ("train", "val")}

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
        """Windows at `starts` (B,): x = tokens[i : i+T], y = tokens[i+1 : i+T+1], each (B, T) int64."""
        data = self.splits[split]
        window = np.stack([data[i:i + block_size + 1] for i in starts.tolist()]).astype(np.int64)  # (B, T+1)
        window = torch.from_numpy(window)
        return window[:, :-1], window[:, 1:]

    def get_batch(self, split: str, batch_size: int, block_size: int, generator: torch.Generator):
        return self.batch(split, self.sample_starts(split, (batch_size,), block_size, generator), block_size)


def main():
    import hydra

    import config  # noqa: F401  (registers the schema)

    @hydra.main(version_base="1.3", config_path=str(REPO / "configs"), config_name="config")
    def _main(cfg):
        try:
            directory = prepare(cfg.data)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)
        print(directory)

    _main()


if __name__ == "__main__":
    main()
