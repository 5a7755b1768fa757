"""tools/eval_lengths.py, a checkpoint's loss at lengths past its training length: at block_size it is
train.py's own whole-val-split loss, a sweep's runs are grouped into arms with intervals, and absolute
position tables are not extrapolated."""
import math

import pytest

from helpers import save_tiny_checkpoint
from rules import UserError


def test_loss_at_block_size_is_train_pys_whole_val_split_loss(train_cfg, tmp_path):
    from helpers import compose_cfg
    from tools.eval_lengths import eval_lengths
    from train import train
    result = train(train_cfg("train.max_iters=6", "train.eval_interval=3"))
    r = eval_lengths(compose_cfg("eval_lengths", [f"ckpt={tmp_path / 'run' / 'ckpt_0000006.pt'}", "lengths=[32,64]",
                                                  "tokens=1000000", "out=null"]))
    assert r["rows"][0]["loss"] == pytest.approx(result["val_loss_full"], abs=1e-5)
    assert sum(r["rows"][0]["per_position"]) / 32 == pytest.approx(r["rows"][0]["loss"], rel=1e-6)
    assert len(r["rows"][1]["per_position"]) == 64 and math.isfinite(r["rows"][1]["copy_loss"])


def test_runs_of_a_sweep_are_evaluated_and_grouped_into_arms(train_cfg, tmp_path):
    """runs=: every run's checkpoint evaluated, runs differing only in their seed one arm: its mean, sd
    and 95% interval at each length are those of the per-checkpoint losses (t(0.975, 1) = 12.706)."""
    from helpers import compose_cfg
    from tools.eval_lengths import eval_lengths
    from train import train
    for seed in (1, 2):
        train(train_cfg("train.max_iters=4", "train.eval_interval=4", f"seed={seed}",
                        f"out_dir={tmp_path / 'sweep' / f'seed{seed}'}"))
    args = ["lengths=[32,64]", "tokens=2000", "out=null"]
    one = [eval_lengths(compose_cfg("eval_lengths", [f"ckpt={tmp_path / 'sweep' / f'seed{s}'}", *args]))
           for s in (1, 2)]
    r = eval_lengths(compose_cfg("eval_lengths", [f"runs=[{tmp_path / 'sweep'}]", *args,
                                                  f"out={tmp_path / 'arms.png'}"]))
    assert len(r["arms"]) == 1 and len(r["arms"][0]["runs"]) == 2
    for i, L in enumerate((32, 64)):
        a, b = (o["rows"][i]["loss"] for o in one)
        d = r["arms"][0]["loss"][L]
        assert a != b and d["n"] == 2 and d["mean"] == pytest.approx((a + b) / 2, abs=1e-9)
        assert d["sd"] == pytest.approx(abs(a - b) / math.sqrt(2), rel=1e-9)
        assert d["half"] == pytest.approx(12.706 * d["sd"] / math.sqrt(2), rel=1e-3)
    assert (tmp_path / "arms.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(UserError, match="ckpt= and runs= both given"):
        eval_lengths(compose_cfg("eval_lengths", [f"runs=[{tmp_path / 'sweep'}]", "ckpt=x.pt", *args]))


def test_absolute_tables_are_not_extrapolated(tmp_path, capsys):
    from helpers import compose_cfg
    from tools.eval_lengths import eval_lengths
    ckpt = save_tiny_checkpoint(tmp_path, pos="learned", block_size=16)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    r = eval_lengths(compose_cfg("eval_lengths", [f"ckpt={ckpt}", f"text={text}", "lengths=[16,32]", "out=null"]))
    assert "loss" in r["rows"][0] and r["rows"][1] == {"length": 32, "skipped": True}
    assert "L=32: skipped: model.pos=learned has a table of 16 positions" in capsys.readouterr().out


def test_any_checkpoint_is_read_through_a_choice_of_keys(tmp_path, capsys):
    """select= at evaluation, no training: an oracle that keeps every key is the checkpoint itself; one
    that keeps fewer changes the loss; the per-position losses equal the model built with that choice."""
    import torch
    from lab.checkpoint import load_checkpoint, model_from_checkpoint, with_selection
    from data.tokenizer import tokenizer_from_dict
    from helpers import compose_cfg
    from lab.heldout import window_losses
    from tools.eval_lengths import eval_lengths
    ckpt = save_tiny_checkpoint(tmp_path, block_size=32)
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    base = [f"ckpt={ckpt}", f"text={text}", "lengths=[32]", "out=null"]
    plain = eval_lengths(compose_cfg("eval_lengths", base))["rows"][0]["loss"]
    every = eval_lengths(compose_cfg("eval_lengths", [*base, "select=oracle", "select_topk=32"]))["rows"][0]["loss"]
    few = eval_lengths(compose_cfg("eval_lengths", [*base, "select=moba", "select_block=4", "select_topk=1"]))
    assert every == pytest.approx(plain, abs=1e-6) and abs(few["rows"][0]["loss"] - plain) > 1e-3
    assert "select=moba top 1" in capsys.readouterr().out
    model = model_from_checkpoint(with_selection(load_checkpoint(ckpt), "moba", 1, 4)).eval()
    ids = torch.as_tensor(tokenizer_from_dict(load_checkpoint(ckpt)["tokenizer"]).encode(text.read_text())).long()
    with torch.no_grad():
        want = window_losses(model, ids, 32)
    assert few["rows"][0]["per_position"] == pytest.approx(want.mean(0).tolist(), abs=1e-5)


def test_a_choice_the_checkpoint_cannot_take_is_one_line(tmp_path):
    from helpers import compose_cfg
    from tools.eval_lengths import eval_lengths
    ckpt = save_tiny_checkpoint(tmp_path, block_size=32, attn={"window": 8})
    with pytest.raises(UserError, match="model.attn.select=oracle chooses keys by content; with a window"):
        eval_lengths(compose_cfg("eval_lengths", [f"ckpt={ckpt}", "select=oracle", "out=null"]))
