"""Throughput and MFU as logged by a training run."""
import pytest

from checkpoint import load_checkpoint, step_name
from tracking import read_metrics
from train import train


def test_mfu_is_logged_against_the_given_peak(train_cfg, tmp_path):
    from counting import flops_per_token
    from model import GPTConfig
    train(train_cfg("train.peak_flops=1e12", "train.max_iters=10"))
    lines = [m for m in read_metrics(tmp_path / "run") if "mfu" in m]
    assert lines
    n_flops = flops_per_token(GPTConfig(**load_checkpoint(tmp_path / "run" / step_name(10))["model_config"]))
    for m in lines:
        assert m["mfu"] == pytest.approx(n_flops * m["tokens_per_sec"] / 1e12, rel=1e-9)
