"""Data parallelism through the real torchrun (gloo on CPU)."""
import json

import pytest

from helpers import assert_same_training
from lab.tracking import read_metrics
from train import train

COMMON = ["model=debug", "model.dropout=0.0", "train.max_iters=10", "train.eval_interval=5", "train.eval_iters=2",
          "train.log_interval=1", "train.batch_size=4", "train.grad_accum=2", "device=cpu",
          "logger.wandb.mode=disabled", "logger.plots=false"]


def test_torchrun_two_processes_equal_one_process_with_the_same_global_batch(tmp_path, cli):
    cache = tmp_path / "cache"
    single, multi = tmp_path / "single", tmp_path / "multi"
    env = {"OMP_NUM_THREADS": "1"}
    r = cli("train.py", *COMMON, f"data.cache_dir={cache}", f"hydra.run.dir={single}", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    # no grad_accum given: one micro-batch per process, the same global batch as the single run's 2
    multi_args = [a for a in COMMON if not a.startswith("train.grad_accum")]
    r = cli("train.py", *multi_args, f"data.cache_dir={cache}", f"hydra.run.dir={multi}", env=env, torchrun=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((multi / "run_info.json").read_text())["world_size"] == 2

    # each rank took one of the two micro-batches; gradients averaged = the single run's mean, and the
    # train loss logged at every step is the mean over both micro-batches in both runs
    # (tolerance 1e-5: all-reduce sums in another order)
    assert_same_training(single, multi, step=10, tol=1e-5)
    # rank 0 alone wrote: one run dir, one metrics file, one set of checkpoints
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "multi", "single"]
    assert len(read_metrics(multi)) == len(read_metrics(single))
    assert sorted(p.name for p in multi.glob("*.pt")) == sorted(p.name for p in single.glob("*.pt"))


def test_grad_accum_must_split_evenly_across_processes(train_cfg, monkeypatch):
    from rules import UserError
    import train as train_module
    from lab.parallel import Dist
    monkeypatch.setattr(train_module, "init_distributed", lambda device: Dist(0, 2, None))
    with pytest.raises(UserError, match="grad_accum=3 must be a multiple of the 2 processes"):
        train(train_cfg("train.grad_accum=3"))
