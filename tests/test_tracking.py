"""lab/tracking.py: what a training run logs to W&B (offline, read back from its own transaction log, against
metrics.jsonl), an unknown W&B mode refused before anything is written, and a disabled W&B writing
nothing."""
import pytest

from helpers import wandb_summary
from lab.tracking import read_metrics
from train import train


def test_wandb_offline_run_holds_entropy_and_loss_keys(train_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_env"))
    train(train_cfg("logger.wandb.mode=offline", "train.max_iters=10", "train.eval_interval=5"))
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    summary = wandb_summary(runs[0])  # read back from the run's own transaction log
    for l in range(2):
        for h in range(2):
            assert f"attn_entropy/L{l}/H{h}" in summary
        assert f"attn_entropy/L{l}" in summary and f"attn_peak/L{l}" in summary
    assert {"train/loss", "val/loss", "lr", "tokens_per_sec", "attn_entropy/mean"} <= summary.keys()
    last_eval = [m for m in read_metrics(tmp_path / "run") if "val/loss" in m][-1]
    assert summary["val/loss"] == pytest.approx(last_eval["val/loss"]) and summary["step"] == 10


def test_unknown_wandb_mode_fails_before_writing_metrics(train_cfg, tmp_path):
    from rules import UserError
    with pytest.raises(UserError, match="logger.wandb.mode='banana'"):
        train(train_cfg("logger.wandb.mode=banana"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    train(train_cfg("train.max_iters=2"))  # so the run dir is still free for a real run


def test_wandb_disabled_writes_nothing(train_cfg, tmp_path):
    train(train_cfg("logger.wandb.mode=disabled", "train.max_iters=5"))
    assert not (tmp_path / "run" / "wandb").exists()

