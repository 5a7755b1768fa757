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

