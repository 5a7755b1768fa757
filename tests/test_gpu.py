"""Checks that need a CUDA GPU (skipped without one; scripts/gpu_check.sh runs them)."""
import pytest
import torch

from checkpoint import load_checkpoint, step_name
from train import train


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
