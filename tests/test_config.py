"""lab/config.py's check of a training config: a bad value of a key is one line naming the key and what it
must be. (Every key of every schema against its rules table, and the settings that have no effect, are
tested in test_reliability.py.)"""
import pytest

from lab.config import check_train_config
from helpers import compose_cfg
from rules import UserError


@pytest.mark.parametrize("override, message", [
    ("train.optimizer=sgd", "train.optimizer='sgd' is unknown: use one of adamw, muon"),
    ("train.muon_lr=0", "train.muon_lr=0.0 must be a finite number > 0 and <= 10"),
    ("train.muon_momentum=1.0", r"train.muon_momentum=1.0 must be a finite number >= 0 and < 1"),
    ("train.muon_adjust_lr=spectral", "train.muon_adjust_lr='spectral' is unknown"),
    ("train.muon_ns_dtype=float16", "train.muon_ns_dtype='float16' is unknown"),
    ("train.lr_schedule=linear", "train.lr_schedule='linear' is unknown: use one of cosine, wsd"),
])
def test_bad_optimizer_settings_are_one_line_errors(override, message):
    with pytest.raises(UserError, match=message):
        check_train_config(compose_cfg("config", ["train.optimizer=muon", override]))


def test_bad_stability_settings_are_one_line_errors(train_cfg):
    for bad, needle in [("train.z_loss=-1", "train.z_loss"), ("train.min_lr_ratio=2", "train.min_lr_ratio"),
                        ("train.weight_decay_mode=sometimes", "train.weight_decay_mode"),
                        ("train.collapse_entropy=-0.1", "train.collapse_entropy"),
                        ("model.attn.softcap=-3", "model.attn.softcap")]:
        with pytest.raises(UserError, match=needle.replace(".", r"\.")) as e:
            overrides = [bad, "train.min_lr=null"] if "min_lr_ratio" in bad else [bad]
            check_train_config(train_cfg(*overrides))
        assert "\n" not in str(e.value)



# ----------------------------------------------------------------------------- schedule and decay traps, warned

def schedule_warnings(caplog, *overrides):
    import logging

    from lab.config import check_train_config
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="attnlab"):
        check_train_config(compose_cfg(overrides=["model=debug", *overrides]))
    return [r.getMessage() for r in caplog.records if r.name == "attnlab"]


def test_independent_decay_that_shrinks_weights_faster_than_they_learn_warns_naming_its_key(caplog):
    lines = schedule_warnings(caplog, "train.weight_decay_mode=independent")  # weight_decay 0.1, the default
    assert len(lines) == 1 and lines[0].startswith("train.weight_decay=0.1 with train.weight_decay_mode=independent "
                                                   "shrinks every matrix by 10.0% per step")
    assert "\n" not in lines[0]
    assert schedule_warnings(caplog, "train.weight_decay_mode=independent", "train.weight_decay=1e-4") == []
    assert schedule_warnings(caplog, "train.weight_decay=0.1") == []  # coupled: times the lr, 1e-4 a step at 1e-3


def test_muon_weight_decay_of_one_with_independent_decay_is_refused_as_weight_decay_is():
    from lab.config import check_train_config
    with pytest.raises(UserError, match=r"^train.muon_weight_decay=1.0 with train.weight_decay_mode=independent is >= 1"):
        check_train_config(compose_cfg(overrides=["model=debug", "train.optimizer=muon", "train.weight_decay=1e-4",
                                                  "train.weight_decay_mode=independent", "train.muon_weight_decay=1.0"]))


def test_a_run_shorter_than_its_warmup_warns_and_the_decay_refusal_points_to_a_setting_that_works(caplog):
    from lab.config import check_train_config
    from lab.optim import lr_at
    lines = schedule_warnings(caplog, "train.max_iters=50")  # warmup 100, the default
    assert len(lines) == 1 and "never reaches train.lr" in lines[0] and "train.warmup_iters=5" in lines[0]
    cfg = compose_cfg(overrides=["model=debug", "train.max_iters=50"])
    assert lr_at(49, cfg.train) < cfg.train.lr * 0.51  # what the warning says: half the lr at the end, never decaying
    with pytest.raises(UserError, match=r"lr_decay_iters > warmup_iters, or a shorter warmup \(e.g. train.warmup_iters=5\)"):
        check_train_config(compose_cfg(overrides=["model=debug", "train.lr_decay_iters=50"]))
    assert schedule_warnings(caplog, "train.lr_decay_iters=50", "train.warmup_iters=5") == []  # the hint works
