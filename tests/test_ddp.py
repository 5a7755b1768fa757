"""Data parallelism through the real torchrun (gloo on CPU), compile, MFU, and GPU-only checks."""
import json
import os
import subprocess
import sys

import pytest
import torch

from checkpoint import load_checkpoint, step_name
from conftest import REPO
from tracking import read_metrics
from train import train

COMMON = ["model=debug", "model.dropout=0.0", "train.max_iters=10", "train.eval_interval=5", "train.eval_iters=2",
          "train.log_interval=5", "train.batch_size=4", "train.grad_accum=2", "device=cpu",
          "logger.wandb.mode=disabled"]


@pytest.mark.slow
def test_torchrun_two_processes_equal_one_process_with_the_same_global_batch(tmp_path):
    cache = tmp_path / "cache"
    single, multi = tmp_path / "single", tmp_path / "multi"
    env = {**os.environ, "WANDB_SILENT": "true", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(REPO / "train.py"), *COMMON, f"data.cache_dir={cache}",
                        f"hydra.run.dir={single}"], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(REPO / "train.py"), *COMMON, f"data.cache_dir={cache}", f"hydra.run.dir={multi}"],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((multi / "run_info.json").read_text())["world_size"] == 2

    # each rank took one of the two micro-batches; gradients averaged = the single run's mean
    a, b = load_checkpoint(single / step_name(10)), load_checkpoint(multi / step_name(10))
    for name, t in a["model"].items():
        d = (t - b["model"][name]).abs().max().item()
        assert d < 1e-5, f"{name}: max diff {d:.2e} (tolerance 1e-5: all-reduce sums in another order)"
    la = [m["val/loss"] for m in read_metrics(single) if "val/loss" in m]
    lb = [m["val/loss"] for m in read_metrics(multi) if "val/loss" in m]
    assert la == pytest.approx(lb, abs=1e-5)
    # rank 0 alone wrote: one run dir, one metrics file, one set of checkpoints
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "multi", "single"]
    assert len(read_metrics(multi)) == len(read_metrics(single))
    assert sorted(p.name for p in multi.glob("*.pt")) == sorted(p.name for p in single.glob("*.pt"))


def test_grad_accum_must_split_evenly_across_processes(train_cfg, monkeypatch):
    from errors import UserError
    import train as train_module
    monkeypatch.setattr(train_module, "init_distributed", lambda device: (0, 2, None))
    with pytest.raises(UserError, match="grad_accum=1 must be a multiple of the 2 processes"):
        train(train_cfg("train.grad_accum=1"))


def test_mfu_is_logged_against_the_given_peak(train_cfg, tmp_path):
    from model import GPT, GPTConfig
    train(train_cfg("train.peak_flops=1e12", "train.max_iters=10"))
    lines = [m for m in read_metrics(tmp_path / "run") if "mfu" in m]
    assert lines
    n_flops = GPT(GPTConfig(**load_checkpoint(tmp_path / "run" / step_name(10))["model_config"])).flops_per_token()
    for m in lines:
        assert m["mfu"] == pytest.approx(n_flops * m["tokens_per_sec"] / 1e12, rel=1e-9)


@pytest.mark.slow
def test_compile_on_cpu_matches_eager(train_cfg, tmp_path):
    from torch._dynamo.utils import counters
    graphs = counters["stats"]["unique_graphs"]
    eager = train(train_cfg("train.max_iters=10", f"out_dir={tmp_path / 'eager'}"))
    assert counters["stats"]["unique_graphs"] == graphs and not eager["compiled"]
    compiled = train(train_cfg("train.max_iters=10", "compile=true", f"out_dir={tmp_path / 'compiled'}"))
    assert counters["stats"]["unique_graphs"] > graphs and compiled["compiled"]  # dynamo really traced the model
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], abs=1e-4)  # fused kernels reorder float sums


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_training_and_flash_path(train_cfg, tmp_path):
    result = train(train_cfg("device=cuda", "train.max_iters=30"))
    assert result["val_loss"] < 4.0
    state = load_checkpoint(tmp_path / "run" / step_name(30))
    assert all(t.dtype == torch.float32 for t in state["model"].values())  # autocast keeps fp32 master weights
    from model import attention
    q, k, v = (torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fast = attention(q, k, v, 0.125, impl="sdpa").float()
    ref = attention(q.float(), k.float(), v.float(), 0.125, impl="reference")
    assert (fast - ref).abs().max().item() < 2e-2
