"""Data parallelism through the real torchrun (gloo on CPU)."""
import json
import os
import subprocess
import sys

import pytest

from checkpoint import load_checkpoint, step_name
from conftest import REPO
from tracking import read_metrics
from train import train

COMMON = ["model=debug", "model.dropout=0.0", "train.max_iters=10", "train.eval_interval=5", "train.eval_iters=2",
          "train.log_interval=5", "train.batch_size=4", "train.grad_accum=2", "device=cpu",
          "logger.wandb.mode=disabled"]


def assert_same_training(single, multi, step: int, tol: float):
    """The two runs' weights at `step` and their val losses agree within tol."""
    a, b = load_checkpoint(single / step_name(step)), load_checkpoint(multi / step_name(step))
    for name, t in a["model"].items():
        d = (t - b["model"][name]).abs().max().item()
        assert d < tol, f"{name}: max diff {d:.2e} (tolerance {tol:g})"
    la = [m["val/loss"] for m in read_metrics(single) if "val/loss" in m]
    lb = [m["val/loss"] for m in read_metrics(multi) if "val/loss" in m]
    assert la and la == pytest.approx(lb, abs=tol)


@pytest.mark.slow
def test_torchrun_two_processes_equal_one_process_with_the_same_global_batch(tmp_path):
    cache = tmp_path / "cache"
    single, multi = tmp_path / "single", tmp_path / "multi"
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(REPO / "train.py"), *COMMON, f"data.cache_dir={cache}",
                        f"hydra.run.dir={single}"], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    # no grad_accum given: one micro-batch per process, the same global batch as the single run's 2
    multi_args = [a for a in COMMON if not a.startswith("train.grad_accum")]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(REPO / "train.py"), *multi_args, f"data.cache_dir={cache}", f"hydra.run.dir={multi}"],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((multi / "run_info.json").read_text())["world_size"] == 2

    # each rank took one of the two micro-batches; gradients averaged = the single run's mean
    # (tolerance 1e-5: all-reduce sums in another order)
    assert_same_training(single, multi, step=10, tol=1e-5)
    # rank 0 alone wrote: one run dir, one metrics file, one set of checkpoints
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "multi", "single"]
    assert len(read_metrics(multi)) == len(read_metrics(single))
    assert sorted(p.name for p in multi.glob("*.pt")) == sorted(p.name for p in single.glob("*.pt"))


def test_grad_accum_must_split_evenly_across_processes(train_cfg, monkeypatch):
    from common import UserError
    import train as train_module
    from common import Dist
    monkeypatch.setattr(train_module, "init_distributed", lambda device: Dist(0, 2, None))
    with pytest.raises(UserError, match="grad_accum=3 must be a multiple of the 2 processes"):
        train(train_cfg("train.grad_accum=3"))
