"""data.bos=true: every window starts with a beginning-of-sequence token of its own (one id past the
tokenizer's), the fixed first token on which attention sinks form. Checked against the token files
read directly, the model run by hand, and every command that reads such a checkpoint."""
import io

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from lab.checkpoint import find_checkpoint, load_checkpoint, model_from_checkpoint
from rules import UserError
from data.loader import TokenData
from data.prepare import prepare
from data.tokenizer import CharTokenizer, StreamDecoder, TiktokenTokenizer, WithBos, tokenizer_from_dict
from helpers import compose_cfg, corpus_text


def test_bos_windows_start_at_bos_and_predict_the_same_tokens(tmp_path, text_file):
    cfg = compose_cfg("config", ["data=text", f"data.path={text_file}", f"data.cache_dir={tmp_path}"]).data
    directory = prepare(cfg)
    cfg.bos = True
    assert prepare(cfg) == directory  # the prepared tokens do not depend on it: one cache entry
    plain, bos = TokenData(directory), TokenData(directory, bos=True)
    tokens = np.fromfile(directory / "train.bin", dtype=plain.meta["dtype"]).astype(np.int64)
    V, T = plain.meta["vocab_size"], 16
    assert (plain.vocab_size, bos.vocab_size, bos.bos, plain.bos) == (V, V + 1, V, None)
    starts = torch.tensor([0, 5, len(tokens) - T - 1])
    x, y = bos.batch("train", starts, T)
    for row, i in enumerate(starts.tolist()):
        assert x[row, 0] == V and x[row, 1:].tolist() == tokens[i:i + T - 1].tolist()
        assert y[row].tolist() == tokens[i:i + T].tolist()  # the first token is predicted from bos alone
        assert bos.tokenizer.decode(x[row]) == plain.tokenizer.decode(tokens[i:i + T - 1])
    x0, y0 = plain.batch("train", starts, T)  # without it, as before
    assert x0.tolist() == [tokens[i:i + T].tolist() for i in starts.tolist()]
    assert y0.tolist() == [tokens[i + 1:i + T + 1].tolist() for i in starts.tolist()]


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_the_bos_tokenizer_round_trips_and_decodes_without_it(kind):
    text = corpus_text(40)
    inner = CharTokenizer.train([text]) if kind == "char" else TiktokenTokenizer.train([text], 300)
    tok = tokenizer_from_dict(WithBos(inner).to_dict())  # as a checkpoint stores it
    assert isinstance(tok, WithBos) and tok.bos == inner.vocab_size and tok.vocab_size == inner.vocab_size + 1
    assert tok.to_dict() == {**inner.to_dict(), "bos": True} and tok.kind == inner.kind and tok.eot == inner.eot
    ids = inner.encode("the quick brown fox").tolist()
    assert tok.encode("the quick brown fox").tolist() == ids  # text never encodes to it
    with_bos = [tok.bos, *ids[:5], tok.bos, *ids[5:]]
    assert tok.decode(with_bos) == "the quick brown fox"
    stream = StreamDecoder(tok)
    assert "".join(stream.feed([i]) for i in with_bos) + stream.flush() == "the quick brown fox"


def test_a_bos_model_trains_probes_samples_streams_and_resumes(train_cfg, sample_cfg, tmp_path):
    from lab.sampling import start_ids
    from sample import sample
    from tools.eval_stream import eval_stream
    from train import train
    train(train_cfg("data.bos=true", "train.max_iters=10", "train.log_attn_interval=5", "logger.plots=true"))
    run = tmp_path / "run"
    state = load_checkpoint(find_checkpoint(str(run)))
    tok = tokenizer_from_dict(state["tokenizer"])
    model = model_from_checkpoint(state).eval()
    assert tok.bos == model.config.vocab_size - 1  # one embedding row more than the tokenizer's
    assert '"tokens": [{"text": "\\u003cbos>"' in (run / "attention.html").read_text()  # the probe's first token
    probes = [line for line in (run / "metrics.jsonl").read_text().splitlines() if "attn_first/L0" in line]
    assert probes  # the first-token mass is the weight on bos

    # sampling starts at bos, as every training window did: greedy equals the model run by hand
    ids = start_ids(tok, "a", state)
    assert ids == [tok.bos, *tok.encode("a").tolist()]
    want = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(8):
            want = torch.cat([want, model(want)[:, -1:].argmax(-1)], 1)
    got = sample(sample_cfg(f"ckpt={run}", "prompt=a", "max_new_tokens=8", "temperature=0"), out=io.StringIO())[0]
    new = want[0, 2:].tolist()
    assert got == "a" + tok.decode(new[:new.index(tok.bos)] if tok.bos in new else new)  # bos would end it
    assert len(sample(sample_cfg(f"ckpt={run}", "prompt=", "max_new_tokens=5"))[0]) == 5  # bos alone is a start

    # so do the attention maps of a prompt
    from tools.visualize import visualize
    views = visualize(compose_cfg("visualize", [f"ckpt={run}", "prompt=ab a", f"out={tmp_path / 'maps'}"]),
                      out=io.StringIO())
    assert views["labels"][0] == "<bos>" and views["maps"].shape[-1] == 5

    # eval_stream streams from bos: its first prediction is the model's from [bos]
    text = tmp_path / "stream.txt"
    text.write_text(corpus_text(20))
    r = eval_stream(compose_cfg("eval_stream", [f"ckpt={run}", f"text={text}", "tokens=200", "out=null"]))
    first = tok.encode(corpus_text(20))[0]
    with torch.no_grad():
        logits = model(torch.tensor([[tok.bos]]))[0, -1]
    for policy in r["policies"].values():
        assert policy["losses"][0] == pytest.approx(F.cross_entropy(logits, torch.tensor(first)).item(), abs=1e-5)

    # it resumes as itself, and not as a model without bos
    assert train(train_cfg("data.bos=true", "train.max_iters=12", "resume=true"))["steps"] == 12
    with pytest.raises(UserError, match=r"cannot resume: data.bos is False here but True in the checkpoint"):
        train(train_cfg("train.max_iters=14", "resume=true"))


def test_eval_lengths_starts_every_window_of_a_bos_model_at_bos(train_cfg, tmp_path):
    """tools/eval_lengths.py on a bos model: each window of L reads [bos, L-1 tokens] and predicts
    the L tokens, its loss equal to the model run on that window by hand; the retrieval probe reads
    [bos, r, r]."""
    from lab.attnstats import copy_losses
    from tools.eval_lengths import eval_lengths
    from train import train
    train(train_cfg("data.bos=true", "train.max_iters=2", "train.eval_interval=2"))
    run = tmp_path / "run"
    text = tmp_path / "text.txt"
    text.write_text(corpus_text(30))
    r = eval_lengths(compose_cfg("eval_lengths", [f"ckpt={run}", f"text={text}", "lengths=[16]", "tokens=64",
                                                  "out=null"]))
    state = load_checkpoint(find_checkpoint(str(run)))
    tok, model = tokenizer_from_dict(state["tokenizer"]), model_from_checkpoint(state).eval()
    ids = torch.as_tensor(tok.encode(corpus_text(30)))
    with torch.no_grad():
        want = [F.cross_entropy(model(torch.cat([torch.tensor([tok.bos]), ids[w * 16:w * 16 + 15]])[None])[0],
                                ids[w * 16:w * 16 + 16]).item() for w in range(4)]
        rows = ids[:64 * 16].view(-1, 16)[:64, :7]  # copy_loss: up to 64 windows, r of (16 - 1) // 2 = 7
        seq = torch.cat([torch.full_like(rows[:, :1], tok.bos), rows, rows], 1)
        copy = copy_losses(model(seq)[:, 1:], seq[:, 1:], 7)[1]
    (row,) = r["rows"]
    assert row["windows"] == 4 and row["loss"] == pytest.approx(sum(want) / 4, abs=1e-5)
    assert row["copy_loss"] == pytest.approx(copy, abs=1e-5)
