"""lab/config.py's check of a training config: a bad value of a key is one line naming the key and what it
must be. (Every key of every schema against its rules table, and the settings that have no effect, are
tested in test_reliability.py.)"""
import math

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


# ----------------------------------------------------------------------------- train.collapse_entropy against the model

def test_collapse_entropy_set_on_a_model_without_softmax_weights_warns_once_naming_its_key(caplog):
    """The probe reads no attention entropy where no layer has softmax weights (gdn, mamba2, linear): a
    threshold set there is one line, ignored; left at its default, or where a softmax layer is, none."""
    recurrent = "model.attn.layer_kinds=[gdn,mamba2]"
    lines = schedule_warnings(caplog, recurrent, "train.collapse_entropy=0.3")
    assert lines == ["train.collapse_entropy=0.3 has no effect: no layer has softmax weights (model.attn: gdn, "
                     "mamba2), so the probe reads no attention entropy: ignored"]
    assert schedule_warnings(caplog, recurrent) == []  # its default: the user set nothing
    assert schedule_warnings(caplog, "model.attn.layer_kinds=[gdn,softmax]", "train.collapse_entropy=0.3") == []
    # the probe off as well: the one line check_values gives, not a second
    lines = schedule_warnings(caplog, recurrent, "train.collapse_entropy=0.3", "train.log_attn_interval=0")
    assert len(lines) == 1 and lines[0].startswith("train.collapse_entropy=0.3 has no effect unless the attention probe")
    ignored = check_train_config(compose_cfg(overrides=["model=debug", recurrent, "train.collapse_entropy=0.3"]))
    assert any(line.startswith("train.collapse_entropy=0.3 has no effect") for line in ignored)  # recorded with the run


@pytest.mark.parametrize("value", [repr(math.log(32)), "5"])  # exactly ln 32, and above it
def test_collapse_entropy_at_or_above_ln_block_size_is_refused_naming_a_value_that_works(value, caplog):
    """ln(block_size) is the entropy of weights uniform over every key, the most a query's can have: a
    threshold there calls every layer collapsed at step 0. The debug model's block_size is 32: ln 32 = 3.466."""
    with pytest.raises(UserError, match=r"^train\.collapse_entropy=.* is at or above ln\(model\.block_size=32\) = "
                                        r"3\.466 nats.*use e\.g\. train\.collapse_entropy=0\.1$") as e:
        check_train_config(compose_cfg(overrides=["model=debug", f"train.collapse_entropy={value}"]))
    assert "\n" not in str(e.value)
    below = f"train.collapse_entropy={math.log(32) - 0.01}"
    assert schedule_warnings(caplog, below) == []  # below ln(block_size): taken
    with pytest.raises(UserError, match=r"ln\(model\.block_size=16\) = 2\.773"):  # the bound is the model's own
        check_train_config(compose_cfg(overrides=["model=debug", below, "model.block_size=16"]))
    assert schedule_warnings(caplog, "train.collapse_entropy=0.1", "model.block_size=16") == []  # the hint works
    # where it cannot act it is not judged: no softmax layer, or the probe off
    assert len(schedule_warnings(caplog, "model.attn.layer_kinds=[gdn,mamba2]", f"train.collapse_entropy={value}")) == 1
    assert len(schedule_warnings(caplog, "train.log_attn_interval=0", f"train.collapse_entropy={value}")) == 1
