"""data=mqar: Zoology's multi-query associative recall, generated here. The layout against the task's
definition checked example by example, the loss taken on the answers only, val/recall_acc against a
recomputation and an oracle, a mix of pair counts, bad settings, and a short run read by
tools/report.py and tools/recall.py."""
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from data.mqar import FILLER, MQARData, MQARTokenizer, generate
from helpers import compose_cfg
from rules import UserError


def data_cfg(pairs=(4,), vocab=40, examples=300, seed=5):
    return SimpleNamespace(pairs=list(pairs), vocab_size=vocab, examples=examples, split_seed=seed)


@pytest.mark.parametrize("length,pairs", [(32, 8), (33, 4), (64, 1), (16, 4)])
def test_every_example_is_pairs_then_each_key_asked_once_with_its_value(length, pairs):
    tok = MQARTokenizer(40)
    x, y = generate(50, length, pairs, 40, seed=3)
    assert x.shape == y.shape == (50, length)
    for xe, ye in zip(x.tolist(), y.tolist()):
        keys, values = xe[0:2 * pairs:2], xe[1:2 * pairs:2]
        assert len(set(keys)) == pairs and all(1 <= k <= tok.keys for k in keys)
        assert all(tok.keys < v < 40 for v in values)
        value_of = dict(zip(keys, values))
        asked = [t for t in range(2 * pairs, length) if ye[t] >= 0]
        assert sorted(xe[t] for t in asked) == sorted(keys)  # each key asked once, after the context
        for t in asked:
            assert ye[t] == value_of[xe[t]]  # the answer: the value the key was paired with
            assert t + 1 >= length or xe[t + 1] == ye[t]  # and it follows the key in the text
        answered = set(asked) | {t + 1 for t in asked}
        assert all(xe[t] == 0 for t in range(2 * pairs, length) if t not in answered)  # filler elsewhere
        assert all(ye[t] == -1 for t in range(length) if t not in asked)


def test_the_same_seed_gives_the_same_examples_and_another_seed_others():
    a, b, c = generate(20, 32, 4, 40, 1), generate(20, 32, 4, 40, 1), generate(20, 32, 4, 40, 2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and not torch.equal(a[0], c[0])


def test_the_loss_is_taken_on_the_answers_only():
    """GPT's loss with the mqar targets = cross-entropy over the answer positions, written out."""
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=32, n_layer=1, n_head=2, n_embd=16))
    x, y = generate(6, 32, 4, 40, seed=0)
    logits, loss = model(x, y)
    asked = y >= 0
    by_hand = -F.log_softmax(logits[asked], -1).gather(1, y[asked][:, None]).mean()
    assert asked.sum() == 6 * 4 and torch.allclose(loss, by_hand)


class Oracle(torch.nn.Module):
    """Reads the answer off the val examples it is given, wrong on every `wrong`-th (by its index)."""

    def __init__(self, data, wrong=0):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.answers = {tuple(xe.tolist()): (i, ye) for i, (xe, ye) in enumerate(zip(*data.examples["val"]))}
        self.wrong = wrong

    def forward(self, x):
        found = [self.answers[tuple(xe.tolist())] for xe in x]
        y = torch.stack([ye if not (self.wrong and i % self.wrong == 0) else torch.zeros_like(ye)  # the filler:
                         for i, ye in found]).clamp(min=0)  # never an answer
        return F.one_hot(y, 40).float()


def test_recall_acc_is_the_share_of_answers_right_for_each_mix():
    data = MQARData(data_cfg(pairs=(2, 4, 8)), block_size=32)
    x, y = data.examples["val"]
    assert len(x) == 3 * 256 and [(y[s] >= 0).sum(1).unique().tolist() for s in data.groups["val"].values()] == \
        [[2], [4], [8]]  # at least 256 per number of pairs, in equal shares
    assert len(data.examples["train"][0]) == 300
    no_autocast = torch.autocast("cpu", enabled=False)
    assert data.metrics(Oracle(data), lambda: no_autocast) == {
        "val/recall_acc": 1.0, "val/recall_acc/pairs2": 1.0, "val/recall_acc/pairs4": 1.0, "val/recall_acc/pairs8": 1.0}
    got = data.metrics(Oracle(data, wrong=3), lambda: no_autocast)
    by_hand = {}  # every third example answered with the filler: recomputed per group
    for p, part in data.groups["val"].items():
        n = part.stop - part.start
        wrong = sum(1 for i in range(part.start, part.stop) if i % 3 == 0)
        by_hand[f"val/recall_acc/pairs{p}"] = (n - wrong) / n
    assert all(got[k] == pytest.approx(v) for k, v in by_hand.items())
    assert got["val/recall_acc"] == pytest.approx((2 * 256 - sum(1 for i in range(0, 256) if i % 3 == 0) * 2 +
                                                   4 * 256 - sum(1 for i in range(256, 512) if i % 3 == 0) * 4 +
                                                   8 * 256 - sum(1 for i in range(512, 768) if i % 3 == 0) * 8)
                                                  / (14 * 256))


def test_one_number_of_pairs_logs_one_recall():
    data = MQARData(data_cfg(pairs=(4,)), block_size=32)
    no_autocast = torch.autocast("cpu", enabled=False)
    assert data.metrics(Oracle(data), lambda: no_autocast) == {"val/recall_acc": 1.0}


@pytest.mark.parametrize("pairs,block,vocab,needle", [
    ((9,), 32, 40, "data.pairs=9 needs windows of at least 35 tokens"),
    ((4, 20), 128, 40, "data.pairs=20 needs as many distinct keys, but data.vocab_size=40 has 19"),
    ((4, 4), 32, 40, "names a number twice"),
])
def test_bad_settings_are_one_line_errors(pairs, block, vocab, needle):
    with pytest.raises(UserError, match=needle) as e:
        MQARData(data_cfg(pairs=pairs, vocab=vocab), block_size=block)
    assert "\n" not in str(e.value)


def test_the_tokenizer_names_keys_and_values_and_refuses_others():
    tok = MQARTokenizer(9)  # the filler, k1..k4, v1..v4
    ids = tok.encode(f"k1 v4 {FILLER} k4")
    assert ids.tolist() == [1, 8, 0, 4] and tok.decode(ids) == f" k1 v4 {FILLER} k4"
    with pytest.raises(UserError, match="'v5' is not an mqar token"):
        tok.encode("k1 v5")


def test_a_short_run_logs_recall_and_the_tools_read_it(train_cfg, tmp_path, capsys):
    """train.py data=mqar logs val/recall_acc for each number of pairs; report.py shows the recall
    column and tools/recall.py the table per number of pairs."""
    from tools import recall
    from tools.report import report
    from train import train
    result = train(train_cfg("data=mqar", "data.pairs=[2,4]", "data.vocab_size=40", "data.examples=200",
                             "model.block_size=32", "train.max_iters=4", "train.eval_interval=2"))
    assert 0 <= result["val/recall_acc"] <= 1 and {"val/recall_acc/pairs2", "val/recall_acc/pairs4"} <= result.keys()
    run = tmp_path / "run"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines if "val/recall_acc/pairs4" in m] == [0, 2, 4]
    table = report([run], out=tmp_path / "report")["table"]
    assert "recall acc" in table and f"{result['val/recall_acc']:.3f}" in table
    recall.main([str(run), "--out", str(tmp_path / "recall")])
    out = capsys.readouterr().out
    assert "| 2 pairs | 4 pairs |" in out and f"{result['val/recall_acc/pairs4']:.3f} (one run)" in out
    assert (tmp_path / "recall" / "recall.png").read_bytes()[:4] == b"\x89PNG"


def test_recall_labels_name_each_arms_kinds_and_drop_unset_settings():
    """An arm of softmax layers is "softmax", a hybrid its kinds; unset or `none` settings say nothing."""
    from types import SimpleNamespace as NS

    from tools.recall import arm_label
    softmax = NS(label="model.attn.layer_kinds=None, model.attn.select=none, model.n_layer=2",
                 runs=[NS(config={"model.attn.kind": "softmax", "model.attn.layer_kinds": None})])
    hybrid = NS(label="model.attn.layer_kinds=[gdn, softmax], model.attn.select=moba, model.n_layer=2",
                runs=[NS(config={"model.attn.kind": "softmax", "model.attn.layer_kinds": ["gdn", "softmax"]})])
    assert arm_label(softmax) == "softmax, model.n_layer=2"
    assert arm_label(hybrid) == "[gdn,softmax], select=moba, model.n_layer=2"


# every data key, by what data=mqar does with it: a new key must be classified here
MQAR_USES = {"name", "vocab_size", "pairs", "examples", "split_seed", "tokenizer"}
TEXT_ONLY = {"path": "x.txt", "url": "https://example.com/x.txt", "hub": "a/b", "hub_config": "c", "text_column": "body",
             "val_split": "validation", "val_fraction": 0.2, "max_tokens": 1000, "num_proc": 2, "cache_dir": "/tmp/c",
             "bos": True, "streaming": True}


def test_every_data_key_is_used_by_mqar_or_warned_as_ignored(caplog):
    """data=mqar generates its examples: each text source key set with it is one warning naming the key
    (nothing refused: a sweep's arm may set what another arm's data uses); and the other way round, the
    mqar keys with text data."""
    import dataclasses

    from lab.config import DataConfig, check_train_config
    assert {f.name for f in dataclasses.fields(DataConfig)} == MQAR_USES | TEXT_ONLY.keys()
    for key, value in TEXT_ONLY.items():
        cfg = compose_cfg("config", ["data=mqar", "model=debug", f"data.{key}={value}"])
        assert any(line.startswith(f"data.{key}=") for line in check_train_config(cfg)), key
    cfg = compose_cfg("config", ["model=debug", "data.tokenizer=mqar"])
    assert any(line.startswith("data.tokenizer=") for line in check_train_config(cfg))
    for key, value in (("pairs", "[4]"), ("examples", 100), ("vocab_size", 300)):
        cfg = compose_cfg("config", ["model=debug", f"data.{key}={value}"])
        assert any(line.startswith(f"data.{key}=") for line in check_train_config(cfg)), key
    for key in MQAR_USES - {"name", "tokenizer"}:  # what mqar uses is not warned
        cfg = compose_cfg("config", ["data=mqar", "model=debug", f"data.{key}=" + {"pairs": "[4]"}.get(key, "300")])
        assert not any(line.startswith(f"data.{key}=") for line in check_train_config(cfg)), key


def test_mqar_sizes_that_cannot_fit_are_refused_before_anything_is_drawn(monkeypatch):
    """No pairs, and examples x window past half the available memory, are one line from the config
    check (before a sweep's first job); a huge vocabulary draws its keys without a vocab-sized matrix."""
    import data.mqar as mqar
    from lab.config import check_train_config
    with pytest.raises(UserError, match=r"data.pairs=\[\] names no number"):
        check_train_config(compose_cfg("config", ["data=mqar", "model=debug", "data.pairs=[]"]))
    monkeypatch.setattr(mqar, "available_memory", lambda: 2**30)  # a machine with 1 GiB free
    with pytest.raises(UserError, match="data.examples=1000000 windows .* need about .* GiB") as e:
        check_train_config(compose_cfg("config", ["data=mqar", "model=debug", "data.examples=1000000"]))
    assert "\n" not in str(e.value)
    x, y = mqar.generate(64, 32, 4, 10**7, seed=1)  # 5M keys: drawn with replacement, rows with repeats redrawn
    keys = x[:, 0:8:2]
    assert all(len(set(row.tolist())) == 4 for row in keys) and int(keys.max()) <= (10**7 - 1) // 2
    answered = y >= 0
    assert answered.sum(1).eq(4).all()
