"""Checks that need a CUDA GPU (skipped without one; tools/gpu_check.sh runs them). What can be
reproduced on CPU is in test_gpu_path.py."""
import pytest
import torch

from checkpoint import load_checkpoint, step_name
from common import has_native_bf16, pick_dtype
from tracking import read_metrics
from train import train

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_compiled_training_on_the_flash_kernel_then_resume(train_cfg, tmp_path):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    cuda = torch.device("cuda")
    if has_native_bf16(cuda):
        assert pick_dtype("auto", cuda) == torch.bfloat16
    # SDPA restricted to flash attention: a call it cannot serve raises instead of silently
    # taking the math or memory-efficient kernel
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        gpu = train(train_cfg("device=cuda", "train.max_iters=30"))
    assert gpu["compiled"]  # dtype auto (bf16 here), compile on by default on CUDA
    metrics = read_metrics(tmp_path / "run")
    val = [m["val/loss"] for m in metrics if "val/loss" in m]
    # relative to step 0: absolute thresholds depend on the corpus (the same config gives 4.21 on CPU)
    assert val[-1] < val[0] - 0.2, val
    cpu = train(train_cfg("device=cpu", "train.max_iters=30", f"out_dir={tmp_path / 'cpu'}"))
    # same init and batches (both drawn on the CPU), no dropout: only bf16 and kernels differ
    assert gpu["val_loss"] == pytest.approx(cpu["val_loss"], abs=0.1)
    mfu = [m["mfu"] for m in metrics if "mfu" in m]
    assert mfu and all(0 < x < 1 for x in mfu), mfu  # the GPU is in the peak-FLOPs table

    state = load_checkpoint(tmp_path / "run" / step_name(30))
    assert all(t.dtype == torch.float32 for t in state["model"].values())  # autocast keeps fp32 master weights
    assert len(state["rng"]["cuda"]) == 1 and state["rng"]["cuda"][0].device.type == "cpu"
    # resume on CUDA (bug 1: the RNG byte tensors must be restored from the CPU)
    resumed = train(train_cfg("device=cuda", "train.max_iters=40", "resume=true"))
    assert resumed["steps"] == 40


@pytest.mark.gpu
@needs_cuda
def test_flash_attention_matches_the_reference_in_bf16():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attention import attention
    q, k, v = (torch.randn(2, 4, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        fast = attention(q, k, v, 0.125, impl="sdpa").float()
    ref = attention(q.float(), k.float(), v.float(), 0.125, impl="reference")
    diff = (fast - ref).abs()
    assert diff.max().item() < 2e-2, f"max {diff.max().item():.3e}, mean {diff.mean().item():.3e}"


@pytest.mark.gpu
@needs_cuda
def test_bf16_cast_model_generates_on_gpu():
    """A model cast to bf16 for inference (bug 9: RoPE stays fp32) runs forward on the GPU."""
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)).cuda().to(torch.bfloat16)
    logits, _ = model(torch.randint(64, (2, 16), device="cuda"))
    assert logits.shape == (2, 16, 64) and torch.isfinite(logits.float()).all()
