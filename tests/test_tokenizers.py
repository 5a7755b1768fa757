"""BPE tokenizers (tiktoken, and our own trained with rustbpe) through the whole data pipeline."""
import time

import numpy as np
import pytest
import rustbpe
import tiktoken

from helpers import SHAKESPEARE, TIKTOKEN_CACHE, compose_cfg, requires_shared
from data.loader import TokenData
from data.prepare import prepare, split_points
from rules import UserError
from data.tokenizer import EOT, TiktokenTokenizer, tokenizer_from_dict


def data_cfg(tmp_path, *overrides):
    return compose_cfg("config", [f"data.cache_dir={tmp_path / 'cache'}", *overrides]).data


def hand_made(extra_merges=()):
    """A tiny byte-level BPE: the 256 bytes, then a few merges in order."""
    ranks = [bytes([b]) for b in range(256)] + [b"th", b"he", b"the", b" the", b"in", b"ing", *extra_merges]
    return TiktokenTokenizer.from_ranks(ranks, r"""'s|'t|'re|'ve|'m|'ll|'d| ?\w+| ?\d+| ?[^\s\w\d]+|\s+(?!\S)|\s+""")


def test_hand_made_encoding_merges_by_rank():
    tok = hand_made()
    ids = tok.encode(" the thing").tolist()
    assert [tok.enc.decode_single_token_bytes(i) for i in ids] == [b" the", b" ", b"th", b"ing"]
    assert tok.eot == 262 and tok.vocab_size == 263
    again = tokenizer_from_dict(tok.to_dict())  # what data caches and checkpoints store
    assert again.encode(" the thing").tolist() == ids


def test_hand_made_encoding_through_prepare_train_and_sample(train_cfg, sample_cfg, tmp_path, text_file, monkeypatch):
    from sample import sample
    from train import train
    monkeypatch.setattr(TiktokenTokenizer, "train", classmethod(lambda cls, texts, vocab_size: hand_made()))
    overrides = ("data=text", f"data.path={text_file}", "data.tokenizer=bpe", "data.vocab_size=263")
    d = TokenData(prepare(train_cfg(*overrides).data))
    assert d.vocab_size == 263 and d.meta["tokenizer"]["kind"] == "bpe"
    ids = np.concatenate([d.splits["train"], d.splits["val"]])
    assert d.tokenizer.decode(ids) == text_file.read_text() + EOT  # one document, then <|endoftext|>
    train(train_cfg(*overrides, "train.max_iters=10"))
    monkeypatch.undo()
    texts = sample(sample_cfg(f"ckpt={tmp_path / 'run'}", "prompt=' the'", "max_new_tokens=20", "temperature=0"))
    assert texts[0].startswith(" the") and len(texts[0]) > 4


def test_bpe_trained_ranks_are_lossless_and_agree_with_rustbpe(tmp_path, text_file):
    d = TokenData(prepare(data_cfg(tmp_path, "data=text", f"data.path={text_file}", "data.tokenizer=bpe",
                                   "data.vocab_size=300")))
    tok = d.tokenizer
    assert tok.vocab_size == 300 and tok.eot == 299
    lines = text_file.read_text().splitlines(keepends=True)
    for line in lines:
        assert tok.decode(tok.encode(line)) == line
    # train rustbpe the same way: its own encoder and our tiktoken encoding give the same ids
    train_text = text_file.read_text()[: int(len(text_file.read_text()) * 0.9)]
    ref = rustbpe.Tokenizer()
    ref.train_from_iterator(iter([train_text]), 299)
    for line in lines[:50]:
        assert ref.encode(line) == tok.encode(line).tolist()
    assert (tok.encode(train_text) >= 256).mean() > 0.5  # merges were learned and used


def test_bpe_needs_a_vocab_size(tmp_path, text_file):
    with pytest.raises(UserError, match="data.vocab_size"):
        prepare(data_cfg(tmp_path, "data=text", f"data.path={text_file}", "data.tokenizer=bpe"))


def test_uint32_is_chosen_when_the_vocabulary_needs_it(tmp_path, text_file, monkeypatch):
    pairs = [bytes([a, b]) for a in range(256) for b in range(256)][:65400]
    big = TiktokenTokenizer.from_ranks([bytes([b]) for b in range(256)] + pairs, r"\S+|\s+")
    monkeypatch.setattr(TiktokenTokenizer, "train", classmethod(lambda cls, texts, vocab_size: big))
    text_file.write_text("".join(chr(c) for c in range(0x20, 0x7f)) * 20)
    d = TokenData(prepare(data_cfg(tmp_path, "data=text", f"data.path={text_file}", "data.tokenizer=bpe",
                                   "data.vocab_size=65657")))
    assert d.vocab_size == 65657 > 65536 and d.splits["train"].dtype == np.uint32
    ids = np.concatenate([d.splits["train"], d.splits["val"]])
    assert ids.max() > 65535  # ids that a uint16 file would have wrapped
    assert d.tokenizer.decode(ids) == text_file.read_text() + EOT


@requires_shared(TIKTOKEN_CACHE)
@requires_shared(SHAKESPEARE)
def test_r50k_base_round_trip_uint16_and_chunking_is_exact(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
    d = TokenData(prepare(data_cfg(tmp_path, "data=shakespeare", f"data.path={SHAKESPEARE}")))
    assert d.vocab_size == 50257 and d.splits["train"].dtype == np.uint16
    text = SHAKESPEARE.read_text()
    whole = tiktoken.get_encoding("r50k_base").encode_ordinary(text) + [50256]
    stored = np.concatenate([d.splits["train"], d.splits["val"]]).tolist()
    assert stored == whole  # pieces tokenized apart (in parallel) give exactly the whole text's tokens
    assert len(split_points(text, 1 << 16)) > 10
    assert d.tokenizer.decode(d.splits["val"]) == tiktoken.get_encoding("r50k_base").decode(whole[-len(d.splits["val"]):])


def test_chunk_boundaries_do_not_change_char_or_bpe_tokens():
    text = "".join(f"Line {i}: some words, punctuation!  and  spaces\n\n  indented {i}\nnext" for i in range(3000))
    cuts = split_points(text, 997)
    assert len(cuts) > 50
    tok = TiktokenTokenizer.train([text], 400)
    pieces = [tok.encode(text[a:b]).tolist() for a, b in zip(cuts[:-1], cuts[1:])]
    assert sum(pieces, []) == tok.encode(text).tolist()


def test_missing_tiktoken_file_offline_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty_cache"))
    t0 = time.time()
    with pytest.raises(UserError, match="TIKTOKEN_CACHE_DIR") as e:
        TiktokenTokenizer.named("cl100k_base")
    assert "\n" not in str(e.value) and time.time() - t0 < 60
    with pytest.raises(UserError, match="unknown"):
        TiktokenTokenizer.named("no_such_encoding")


def test_several_documents_split_by_a_seeded_draw(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(40):
        (folder / f"{i:02d}.txt").write_text(f"document number {i}. " * 30)
    cfg = data_cfg(tmp_path, "data=text", f"data.path={folder}/*.txt", "data.tokenizer=bpe", "data.vocab_size=280",
                   "data.val_fraction=0.1")
    d = TokenData(prepare(cfg))
    eot = d.tokenizer.eot
    assert (d.splits["train"] == eot).sum() == 36 and (d.splits["val"] == eot).sum() == 4  # whole documents
    val_text = d.tokenizer.decode(d.splits["val"])
    assert val_text.count("document number") == 4 * 30
    again = TokenData(prepare(data_cfg(tmp_path / "again", "data=text", f"data.path={folder}/*.txt",
                                       "data.tokenizer=bpe", "data.vocab_size=280", "data.val_fraction=0.1")))
    assert np.array_equal(again.splits["val"], d.splits["val"])  # the draw is seeded


def test_hub_preset_offline_fails_fast_with_one_line(tmp_path, cli):
    t0 = time.time()
    r = cli("tools/prepare.py", "data=tinystories", f"data.cache_dir={tmp_path / 'cache'}",
            f"hydra.run.dir={tmp_path / 'hydra'}",
            env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert r.returncode == 1 and time.time() - t0 < 60
    assert "data=tinystories needs the network" in r.stderr and "HF_HUB_OFFLINE is set" in r.stderr
    assert "Traceback" not in r.stderr and not list((tmp_path / "cache").glob("*/meta.json"))


def test_streamed_preset_needs_a_token_budget(tmp_path):
    with pytest.raises(UserError, match="max_tokens"):
        prepare(data_cfg(tmp_path, "data=fineweb_edu", "data.max_tokens=null"))


def test_streamed_source_stops_at_the_token_budget(tmp_path, monkeypatch):
    """data=fineweb_edu's path, fed by a local IterableDataset instead of the Hub."""
    from datasets import Dataset
    import data.prepare as dp
    docs = [f"story {i}: " + "once upon a time " * (5 + i % 7) for i in range(400)]
    monkeypatch.setattr(dp, "_load", lambda cfg, kind, location, split, *files_cache:
                        Dataset.from_dict({"text": docs}).to_iterable_dataset())
    cfg = data_cfg(tmp_path, "data=fineweb_edu", "data.tokenizer=gpt2_test", "data.max_tokens=3000", "data.val_fraction=0.1")
    monkeypatch.setattr(dp, "train_tokenizer", lambda name, texts, vocab_size=None: hand_made())
    d = TokenData(prepare(cfg))
    assert len(d.splits["train"]) == 3000  # the budget, exactly
    n_val_docs = int((d.splits["val"] == d.tokenizer.eot).sum())
    assert 3 <= n_val_docs <= 40 and d.tokenizer.decode(d.splits["val"]).startswith("story ")


def test_bpe_training_logs_no_merge_lines(caplog):
    """rustbpe's ~100 INFO lines of merge progress become one progress bar, not log lines."""
    import logging
    text = " ".join(f"word{i % 37} other{i % 11}" for i in range(3000))
    with caplog.at_level(logging.INFO):
        tok = TiktokenTokenizer.train([text], 400)
    assert tok.vocab_size > 257 and tok.decode(tok.encode(text)) == text
    assert not [r for r in caplog.records if r.name == "rustbpe"]
    assert logging.getLogger("rustbpe").propagate  # restored afterwards
