"""Text -> token ids on disk, once (data/loader.py then reads random windows of them).

    python tools/prepare.py data=shakespeare_char data.path=input.txt   # ahead of training
    python tools/prepare.py data=tinystories data.num_proc=8            # a Hub dataset (needs the network)

Every source goes through `datasets.load_dataset`: local files and globs and URLs with the
`text` loader, Hub datasets by name (optionally streamed, with a token budget). Documents are
tokenized with `Dataset.map(batched=True, num_proc=...)` and written to the token files shard
by shard.

A prepared dataset is a directory of `train.bin` and `val.bin` (flat token ids, uint16 when the
vocabulary fits, else uint32) and `meta.json` (the tokenizer, dtype, counts, each file's sha256;
written last). Its name holds a hash of everything that decides its content, so a second run with
the same settings reuses it; it is written under a temporary name and renamed into place, so an
interrupted preparation never leaves a directory that looks complete. Before it is reused, every
token file is checked against its length and checksum: one cut short, edited or missing (or a
meta.json missing or unreadable) is reported in one line and prepared again.
"""
import glob
import gzip
import hashlib
import json
import logging
import os
import shutil
import sys
import time
import zlib
from pathlib import Path

import numpy as np

from files import check_output_dir, dir_mode, file_digest, private_mode, remove_stale_temps, temp_suffix
from rules import UserError, check_values
from data.loader import SPLITS, token_files_damage
from data.tokenizer import cached_tokenizer, train_tokenizer

log = logging.getLogger(__name__)
REPO = Path(__file__).resolve().parents[1]
FORMAT_VERSION = 3  # bump when the on-disk layout or tokenization changes
CHUNK_CHARS = 1 << 16  # a long document is tokenized in pieces of about this size, in parallel
SHARDS = 64  # a tokenized split is written in this many pieces (memory: one piece at a time)
MIN_SPLIT_TOKENS = 2  # each split needs at least one (input, target) pair
STREAMED_VAL_SHARE = 100  # a streamed source's own val split is read up to budget / this
LEARNED_TOKENIZERS = ("char", "bpe")  # fitted on the corpus; any other name is a tiktoken encoding
PYTHON_DOCS = REPO / "data" / "python_docs.txt.gz"  # the default corpus (data=python_docs), gzip
PYTHON_DOCS_SHA256 = "2a95af4ac93f5b719944030ce3769070ddf827d847cba42192afa8da989e5dc4"  # of its text


# ----------------------------------------------------------------------------- sources

def python_docs_text() -> str:
    """The embedded corpus: the prose of Python's own documentation, shipped in the repo as
    data/python_docs.txt.gz (CPython 3.11.7's pydoc_data.topics, joined in key order; licence beside
    it), so the default run needs no download and trains on the same text under any Python
    (pydoc_data itself differs between versions: 3.11.2 has 466,097 characters, 3.11.7 465,048).
    Checked against PYTHON_DOCS_SHA256: a damaged or edited file is a one-line UserError."""
    restore = "restore it with `git checkout data/python_docs.txt.gz`"
    try:
        with gzip.open(PYTHON_DOCS, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise UserError(f"{PYTHON_DOCS} is missing (the default corpus, data=python_docs): {restore}") from None
    except (OSError, EOFError, zlib.error) as e:  # not gzip, or cut short
        raise UserError(f"{PYTHON_DOCS} is damaged ({type(e).__name__}): {restore}") from None
    if hashlib.sha256(raw).hexdigest() != PYTHON_DOCS_SHA256:
        raise UserError(f"{PYTHON_DOCS} is not the shipped corpus (its text's sha256 is not "
                        f"{PYTHON_DOCS_SHA256[:12]}...): {restore}")
    return raw.decode("utf-8")


def repeated_spans_text(n_lines: int = 40000, seed: int = 0) -> str:
    """A corpus where copying pays: each line is a span of 10 to 30 characters, a space,
    and the same span again; half the spans are random letters (a-z, A-Z), half are cut from the
    embedded docs prose (whitespace collapsed). Copying the second copy is what an induction head
    does (Olsson et al. 2022, arXiv 2209.11895), and it builds on a previous-token head: the prose
    teaches that one early (spelling needs the last few characters), the random letters make copying
    worth ln 52 = 3.95 nats a character. (Random letters alone give a previous-token head nothing to
    do until an induction head uses it, prose alone makes copying worth less: with either, a 2-layer
    model was still on its plateau after 2000 steps.) The last tenth of the lines, which prepare()
    holds out as val, cuts its prose from the last tenth of the docs."""
    rng = np.random.default_rng(seed)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", dtype=np.uint8)
    prose = " ".join(python_docs_text().split())
    cut, n_train = int(len(prose) * 0.9), int(n_lines * 0.9)
    lines = []
    for i, n in enumerate(rng.integers(10, 31, size=n_lines).tolist()):
        if rng.random() < 0.5:
            span = letters[rng.integers(0, len(letters), size=n)].tobytes().decode("ascii")
        else:
            lo, hi = (0, cut) if i < n_train else (cut, len(prose))
            start = int(rng.integers(lo, hi - n))
            span = prose[start:start + n]
        lines.append(f"{span} {span}\n")
    return "".join(lines)


EMBEDDED = {"python_docs": python_docs_text, "repeated_spans": repeated_spans_text}  # kind -> its text


def source_of(data_cfg):
    """(kind, location) of the corpus: local file(s), a URL, a Hub dataset or the embedded docs."""
    if data_cfg.path:
        return "file", str(Path(data_cfg.path).expanduser())
    if data_cfg.url:
        return "url", data_cfg.url
    if data_cfg.hub:
        return "hub", data_cfg.hub
    if data_cfg.name == "python_docs":  # shipped in the repo
        return "python_docs", PYTHON_DOCS.name
    if data_cfg.name == "repeated_spans":  # synthetic, generated here
        return "repeated_spans", "generated"
    raise UserError(f"data={data_cfg.name!r} has no source: set data.path=FILE, data.url=URL or data.hub=NAME")


def local_files(pattern: str) -> list:
    """The regular files data.path names (a file or a glob); one line naming what it is when it is none."""
    files = sorted(p for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
    if not files:
        p = Path(pattern).expanduser()
        what = ("a directory: name the text file(s) in it, e.g. data.path='DIR/*.txt'" if p.is_dir() else
                "not a regular file (a device or a pipe): name a UTF-8 text file" if p.exists() else
                "no such file (give a UTF-8 text file or a glob)")
        raise UserError(f"data.path={pattern!r}: {what}")
    return files


def _load(data_cfg, kind, location, split, files=None, cache_dir=None):
    """One split of the source through datasets.load_dataset, errors as one line. `cache_dir`:
    where datasets keeps its Arrow copy of the text (a local file's goes to a private temporary
    dir, never to the shared, world-readable ~/.cache/huggingface)."""
    import datasets
    from datasets import load_dataset

    datasets.disable_progress_bars()
    try:
        if kind in ("file", "url"):
            return load_dataset("text", data_files=files if kind == "file" else location, sample_by="document",
                                split=split, cache_dir=cache_dir)
        return load_dataset(location, data_cfg.hub_config, split=split, streaming=data_cfg.streaming)
    except UserError:
        raise
    except Exception as e:
        chain, cause = [], e
        while cause is not None:
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        if any(isinstance(c, UnicodeDecodeError) for c in chain):
            raise UserError(f"data.path={location!r} is not UTF-8 text: convert it (e.g. iconv -t UTF-8) "
                            "or pick another file") from None
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        if kind == "file" or (isinstance(e, ValueError) and "split" in str(e).lower()):
            raise UserError(f"could not load {location} split {split!r}: {first}") from None
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") in ("1", "true") else ""
        raise UserError(f"could not load {location} split {split!r}{offline}: {type(e).__name__}; data={data_cfg.name} "
                        "needs the network: download it where you have one, or pass data.path=FILE") from None


def load_texts(data_cfg, kind, location, files=None, cache_dir=None):
    """(train, val) datasets with a `text` column; val is None when it is to be carved from train."""
    if kind in EMBEDDED:
        from datasets import Dataset
        return Dataset.from_dict({"text": [EMBEDDED[kind]()]}), None
    train = _load(data_cfg, kind, location, "train", files, cache_dir)
    val = _load(data_cfg, kind, location, data_cfg.val_split, files, cache_dir) if data_cfg.val_split else None
    if data_cfg.text_column not in (train.column_names or [data_cfg.text_column]):
        raise UserError(f"data.text_column={data_cfg.text_column!r} is not a column of {location}: "
                        f"it has {', '.join(train.column_names)}")
    if data_cfg.text_column != "text":
        train = train.rename_column(data_cfg.text_column, "text")
        val = val.rename_column(data_cfg.text_column, "text") if val is not None else None
    return train, val


def cache_key(data_cfg, kind: str, location: str, files=()) -> str:
    """A hash of everything that decides the prepared tokens: settings, and for local files each
    file's name (relative to their common folder) and content hash, so an edited file, a renamed
    one or the same bytes cut into other files (other documents) is prepared again; for the
    embedded corpus its text."""
    if kind == "file":
        root = os.path.commonpath([os.path.dirname(os.path.abspath(f)) for f in files])
        identity = [[os.path.relpath(os.path.abspath(f), root), file_digest(f)] for f in files]
    elif kind in EMBEDDED:
        identity = hashlib.sha256(EMBEDDED[kind]().encode()).hexdigest()
    else:
        identity = location
    settings = {k: v for k, v in dict(data_cfg).items() if k not in ("cache_dir", "num_proc", "path", "name", "bos")}
    settings.update(v=FORMAT_VERSION, source=identity)
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- tokenize and write

def workers(data_cfg) -> int:
    """Tokenizing processes: data.num_proc, at most one per CPU (more only thrash)."""
    return min(data_cfg.num_proc, os.cpu_count() or 1)


def token_dtype(vocab_size: int):
    return np.uint16 if vocab_size <= 2**16 else np.uint32


def split_points(text: str, size: int) -> list:
    """Cut points in a long text, about `size` apart, where tokenizing the pieces separately gives
    the same tokens as the whole: before a newline that has a non-space on either side (all
    tokenizers here end a token there, tested). Returns [0, ..., len(text)]."""
    points, start = [0], 0
    while start + size < len(text):
        i = start + size
        while i < len(text) - 1 and not (text[i] == "\n" and not text[i - 1].isspace() and not text[i + 1].isspace()):
            i += 1
        if i >= len(text) - 1:
            break
        points.append(i)
        start = i
    return points + [len(text)]


def to_chunks(batch):
    """Rows of documents -> rows of pieces; the last piece of each document has `end` True."""
    out = {"text": [], "end": []}
    for text in batch["text"]:
        cuts = split_points(text, CHUNK_CHARS)
        for a, b in zip(cuts[:-1], cuts[1:]):
            out["text"].append(text[a:b])
            out["end"].append(b == len(text))
    return out


def encode_rows(batch, spec_key):
    """datasets.map function: token ids of each piece, <|endoftext|> after each document's last."""
    tok = cached_tokenizer(spec_key)
    ids = tok.encode_batch(batch["text"]) if hasattr(tok, "encode_batch") else [tok.encode(t).tolist() for t in batch["text"]]
    if tok.eot is not None:
        ids = [list(x) + [tok.eot] if end else x for x, end in zip(ids, batch["end"])]
    return {"ids": ids, "len": [len(x) for x in ids]}


def tokenize(ds, tok, num_proc, desc):
    """A dataset of `text` rows -> one of `ids` rows (documents split into pieces for parallelism)."""
    import datasets
    if sys.stderr.isatty():
        datasets.enable_progress_bars()
    ds = ds.map(to_chunks, batched=True, batch_size=16, remove_columns=ds.column_names)
    spec_key = json.dumps(tok.to_dict(), sort_keys=True)
    ds = ds.map(encode_rows, batched=True, num_proc=num_proc if num_proc > 1 else None,
                fn_kwargs={"spec_key": spec_key}, remove_columns=["text", "end"], desc=desc)
    datasets.disable_progress_bars()
    return ds


class TokenWriter:
    """Appends token arrays to a .bin file in the chosen dtype, stopping at a budget; notes whether
    <|endoftext|> (`eot`) was among them."""

    def __init__(self, path: Path, dtype, budget=None, eot=None):
        self.f, self.dtype, self.budget, self.n = open(path, "wb"), dtype, budget, 0
        self.eot, self.saw_eot = eot, False

    def full(self):
        return self.budget is not None and self.n >= self.budget

    def write(self, ids):
        if self.budget is not None:
            ids = ids[: max(0, self.budget - self.n)]
        ids = np.asarray(ids, dtype=self.dtype)
        if self.eot is not None and not self.saw_eot:
            self.saw_eot = bool((ids == self.eot).any())
        self.f.write(ids.tobytes())
        self.n += len(ids)

    def close(self):
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def write_ranges(ds, routes, shards=SHARDS):
    """Stream a tokenized dataset's `ids` shard by shard (bounded memory), sending the tokens at
    global positions [start, end) to each (writer, start, end) route; end None = to the last."""
    shards = max(1, min(shards, len(ds)))
    done = 0
    for i in range(shards):
        shard = ds.shard(shards, i, contiguous=True).with_format("numpy")
        arr = np.concatenate(list(shard["ids"])) if len(shard) else np.zeros(0, np.int64)
        for writer, start, end in routes:
            lo, hi = max(start, done), len(arr) + done if end is None else min(end, done + len(arr))
            if hi > lo:
                writer.write(arr[lo - done:hi - done])
        done += len(arr)
        if all(end is not None and done >= end for _, _, end in routes):
            break


def write_streamed(train_iter, tok, writers, val_fraction, seed, max_tokens):
    """A streamed source: documents go to val with probability val_fraction (seeded), until the
    train budget is reached."""
    from tqdm import tqdm
    rng = np.random.default_rng(seed)
    bar = tqdm(total=max_tokens, unit="tok", desc="tokenizing (streamed)", disable=not sys.stderr.isatty())
    for row in train_iter:
        ids = list(tok.encode(row["text"])) + ([tok.eot] if tok.eot is not None else [])
        if len(writers) > 1 and rng.random() < val_fraction:
            writers[1].write(ids)
        else:
            before = writers[0].n
            writers[0].write(ids)
            bar.update(writers[0].n - before)
        if writers[0].full():
            break
    bar.close()


def pick_tokenizer(data_cfg, train, val, tail_split: bool, streamed: bool):
    """The tokenizer `data.tokenizer` names, fitted where it learns from data: char on every
    character of the corpus (so val has no unknown ones), bpe on the training text only."""
    name = data_cfg.tokenizer
    if name not in LEARNED_TOKENIZERS:
        return train_tokenizer(name, [])
    if streamed:
        raise UserError(f"data.tokenizer={name} learns from the whole training split, which a streamed "
                        "source does not have: use a tiktoken encoding (r50k_base)")
    texts = list(train["text"])
    if name == "char":
        return train_tokenizer(name, texts + (list(val["text"]) if val is not None else []))
    if tail_split:  # not the validation tail
        texts = [texts[0][: int(len(texts[0]) * (1 - data_cfg.val_fraction))]]
    return train_tokenizer(name, texts, data_cfg.vocab_size)


def write_tail_split(train, tok, tmp: Path, dtype, data_cfg, budget):
    """One document: the last val_fraction of its tokens is val (as nanoGPT does); train is the
    head, cut to the budget if one is set."""
    ids = tokenize(train, tok, workers(data_cfg), "tokenizing train")
    total = int(sum(ids["len"]))
    n_val = int(total * data_cfg.val_fraction)
    if n_val < MIN_SPLIT_TOKENS or total - n_val < MIN_SPLIT_TOKENS:
        raise UserError(f"the corpus has only {total} tokens: too few to split with "
                        f"data.val_fraction={data_cfg.val_fraction}")
    n_train = total - n_val if budget is None else min(budget, total - n_val)
    writers = [TokenWriter(tmp / "train.bin", dtype, eot=tok.eot), TokenWriter(tmp / "val.bin", dtype)]
    write_ranges(ids, [(writers[0], 0, n_train), (writers[1], total - n_val, total)])
    return writers


def write_document_splits(train, val, tok, tmp: Path, dtype, data_cfg, budget):
    """Whole documents: the source's own val split, or a seeded draw of val_fraction of them."""
    if val is None:
        parts = train.train_test_split(test_size=data_cfg.val_fraction, seed=data_cfg.split_seed)
        train, val = parts["train"], parts["test"]
    writers = [TokenWriter(tmp / "train.bin", dtype, eot=tok.eot), TokenWriter(tmp / "val.bin", dtype)]
    write_ranges(tokenize(train, tok, workers(data_cfg), "tokenizing train"), [(writers[0], 0, budget)])
    write_ranges(tokenize(val, tok, workers(data_cfg), "tokenizing val"), [(writers[1], 0, None)])
    return writers


def write_streamed_splits(train, val, tok, tmp: Path, dtype, data_cfg, budget):
    """A streamed Hub source, read until the train budget is reached: val is the source's own
    split (a small share of the budget), else documents drawn into val with probability val_fraction."""
    writers = [TokenWriter(tmp / "train.bin", dtype, budget, tok.eot), TokenWriter(tmp / "val.bin", dtype)]
    if val is None:
        write_streamed(train, tok, writers, data_cfg.val_fraction, data_cfg.split_seed, budget)
    else:
        write_streamed(train, tok, writers[:1], 0.0, data_cfg.split_seed, budget)
        writers[1].budget = max(1, budget // STREAMED_VAL_SHARE)
        write_streamed(val, tok, writers[1:], 0.0, data_cfg.split_seed, writers[1].budget)
    return writers


def split_warning(counts: dict, data_cfg, documents: int):
    """Whole documents drawn into val cannot hit val_fraction when there are few of them (2 files
    at 0.1: one file, half the tokens, goes to val). A message when the share is off by 2x, else None."""
    share = counts["val"] / (counts["train"] + counts["val"])
    if data_cfg.val_fraction / 2 <= share <= 2 * data_cfg.val_fraction:
        return None
    return (f"the val split holds {share:.1%} of the tokens, not data.val_fraction={data_cfg.val_fraction}: whole "
            f"documents are drawn into it and there are only {documents}; join the files into one (split by its "
            "tail) or add documents")


def prepared_damage(directory: Path):
    """What makes a prepared dataset unusable, in words, or None if it is whole: meta.json (written
    last) missing or unreadable, a token file missing, of another length or content than it records."""
    try:
        meta = json.loads((directory / "meta.json").read_text())
        return token_files_damage(directory, meta)
    except FileNotFoundError:
        return "no meta.json: its preparation never finished"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # edited or cut short by hand
        return f"meta.json is unreadable ({type(e).__name__})"


def discard(directory: Path):
    """Delete a damaged prepared dataset: renamed to a temporary name first, so a kill half-way leaves
    what the next start removes, never a directory that looks prepared."""
    aside = directory.with_name(f".{directory.name}.damaged{temp_suffix()}")
    try:
        if directory.is_dir() and not directory.is_symlink():
            os.rename(directory, aside)
            shutil.rmtree(aside)
        else:
            directory.unlink()
    except OSError as e:
        raise UserError(f"cannot remove the damaged prepared data {directory} ({e.strerror}): delete it yourself, "
                        "then run again") from None


def prepare(data_cfg) -> Path:
    """Tokenize the configured corpus into a cached directory (reused when it exists); return it.

    The result is no more readable than the source files (and the umask): the token files and
    meta.json take the source's permission bits, the directory the matching ones."""
    check_values(data_cfg, "data", warn=False)  # train.py and the prepare command warned already
    if data_cfg.streaming and not data_cfg.max_tokens:
        raise UserError("data.streaming=true needs a token budget: set data.max_tokens (e.g. 1e9)")
    kind, location = source_of(data_cfg)
    files = local_files(location) if kind == "file" else []
    cache_root = Path(data_cfg.cache_dir or REPO / "data" / "cache").expanduser()
    final = cache_root / f"{data_cfg.name}-{data_cfg.tokenizer}-{cache_key(data_cfg, kind, location, files)}"
    if cache_root.is_dir():
        remove_stale_temps(cache_root)  # what killed preparations left (not those still running)
    damage = prepared_damage(final) if final.is_dir() else None
    if final.is_dir() and damage is None:
        log.info("using prepared data %s", final)
        warning = json.loads((final / "meta.json").read_text()).get("warning")
        if warning:
            log.warning(warning)
        return final
    check_output_dir(cache_root, "data.cache_dir")  # about to write there: one line now, not after tokenizing
    if final.exists():
        log.warning("the prepared data in %s is damaged (%s): preparing it again", final, damage or "not a directory")
        discard(final)

    t0 = time.perf_counter()
    mode = private_mode(files)
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = cache_root / f".{final.name}{temp_suffix()}"
    hf_cache = cache_root / f".{final.name}-hf{temp_suffix()}"  # datasets' own copy of a local text, deleted
    for d in (tmp, hf_cache):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        os.chmod(d, dir_mode(mode))
    try:
        train, val = load_texts(data_cfg, kind, location, files, hf_cache if kind == "file" else None)
        streamed = data_cfg.streaming and kind == "hub"
        if not streamed and len(train) == 1 and not train[0]["text"].strip():
            raise UserError(f"data.path={location!r} holds no text: give a non-empty UTF-8 file")
        # a single document is split by tokens at its tail; several documents by a seeded draw
        tail_split = val is None and not streamed and len(train) == 1
        tok = pick_tokenizer(data_cfg, train, val, tail_split, streamed)
        dtype = token_dtype(tok.vocab_size)
        budget = int(data_cfg.max_tokens) if data_cfg.max_tokens else None
        if workers(data_cfg) < data_cfg.num_proc:
            log.info("data.num_proc=%d but this machine has %d CPUs: using %d", data_cfg.num_proc,
                     os.cpu_count(), workers(data_cfg))
        if streamed:
            writers = write_streamed_splits(train, val, tok, tmp, dtype, data_cfg, budget)
        elif tail_split:
            writers = write_tail_split(train, tok, tmp, dtype, data_cfg, budget)
        else:
            writers = write_document_splits(train, val, tok, tmp, dtype, data_cfg, budget)
        for w in writers:
            w.close()
        counts = {"train": writers[0].n, "val": writers[1].n}
        if min(counts.values()) < MIN_SPLIT_TOKENS:
            raise UserError(f"the corpus gave too few tokens to train on: {counts}")
        warning = None
        if val is None and not streamed and not tail_split and budget is None:
            warning = split_warning(counts, data_cfg, len(train))
        val_ids = np.fromfile(tmp / "val.bin", dtype=dtype)
        if tok.eot is not None:
            val_ids = val_ids[val_ids != tok.eot]
        val_chars = len(tok.decode(val_ids))  # for bits per character, comparable across tokenizers
        meta = {"sha256": {s: file_digest(tmp / f"{s}.bin") for s in SPLITS},  # checked before every reuse
                "format_version": FORMAT_VERSION, "source": {"kind": kind, "location": location},
                "val_characters": val_chars,
                "tokenizer": tok.to_dict(), "vocab_size": tok.vocab_size, "dtype": np.dtype(dtype).name,
                "tokens": counts, "seconds": round(time.perf_counter() - t0, 2),
                # a single document's train split never holds <|endoftext|> (appended once, at its very end)
                "eot_in_train": writers[0].saw_eot if tok.eot is not None else None,
                "file_mode": mode if files else None, "warning": warning}
        (tmp / "meta.json").write_text(json.dumps(meta))  # written last: the "complete" mark
        for f in tmp.iterdir():
            os.chmod(f, mode)
        if warning:
            log.warning(warning)
        try:
            os.rename(tmp, final)  # atomic: readers see all of it or none of it
        except OSError:  # another process finished the same preparation first
            if not (final / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(hf_cache, ignore_errors=True)
    log.info("prepared %s: %s tokens (vocab %d) in %.1f s", final, meta["tokens"], tok.vocab_size, meta["seconds"])
    return final
