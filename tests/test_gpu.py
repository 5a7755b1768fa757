"""The GPU checks (tools/gpu_check.sh runs `pytest -m gpu`), each with a CPU twin that runs the same
code path on the CPU in every test run: a GPU test that only ever ran on a GPU would first meet its
own bugs there. Parameter `device`: cpu always, cuda where a GPU is (marked `gpu`)."""
import pytest
import torch
import torch.nn.functional as F

from lab.checkpoint import load_checkpoint, step_name
from lab.device import has_native_bf16, pick_dtype
from lab.tracking import read_metrics
from train import train

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def run_dtype(device) -> str:
    """bf16 where the run would use it: auto on a capable GPU, asked for on the CPU twin."""
    return "auto" if device == "cuda" else "bfloat16"


@pytest.fixture
def sdpa_calls(monkeypatch):
    """Every call of F.scaled_dot_product_attention: (q dtype, autocast on?). CUDA's flash kernel has
    no fp32, so on a GPU restricted to it every call must come in a 16-bit dtype."""
    calls, real = [], F.scaled_dot_product_attention

    def spy(q, *args, **kwargs):
        calls.append((q.dtype, torch.is_autocast_enabled(q.device.type)))
        return real(q, *args, **kwargs)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


def test_every_attention_call_of_a_bf16_run_is_in_bf16(train_cfg, sdpa_calls):
    """Training steps, evaluations, the whole-val-split loss, the attention probe and the end-of-run
    maps of a bf16 run all reach SDPA in bf16 (they run under the run's autocast): a flash-only GPU run
    would otherwise stop with "No available kernel" at the first probe."""
    train(train_cfg("dtype=bfloat16", "compile=false", "train.max_iters=4", "train.eval_interval=2",
                    "train.log_attn_interval=2"))
    assert sdpa_calls and {dtype for dtype, _ in sdpa_calls} == {torch.bfloat16}, sorted(set(sdpa_calls))


@pytest.mark.slow  # compiles twice (the run and its resume)
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_compiled_training_on_the_flash_kernel_then_resume(device, train_cfg, tmp_path):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if device == "cuda" and has_native_bf16(torch.device("cuda")):
        assert pick_dtype("auto", torch.device("cuda")) == torch.bfloat16
    # SDPA restricted to flash attention: a call it cannot serve raises instead of silently
    # taking the math or memory-efficient kernel (on the CPU the flash kernel takes fp32 too)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        run = train(train_cfg(f"device={device}", f"dtype={run_dtype(device)}", "compile=true", "train.max_iters=30"))
    assert run["compiled"]
    metrics = read_metrics(tmp_path / "run")
    val = [m["val/loss"] for m in metrics if "val/loss" in m]
    assert val[-1] < val[0] - 0.2, val  # relative to step 0: absolute figures depend on the corpus
    fp32 = train(train_cfg("device=cpu", "dtype=float32", "compile=false", "train.max_iters=30",
                           f"out_dir={tmp_path / 'fp32'}"))
    # same init and batches (both drawn on the CPU), no dropout: only bf16 and kernels differ
    assert run["val_loss"] == pytest.approx(fp32["val_loss"], abs=0.1)
    if device == "cuda":
        mfu = [m["mfu"] for m in metrics if "mfu" in m]
        assert mfu and all(0 < x < 1 for x in mfu), mfu  # the GPU is in the peak-FLOPs table
    state = load_checkpoint(tmp_path / "run" / step_name(30))
    assert all(t.dtype == torch.float32 for t in state["model"].values())  # autocast keeps fp32 master weights
    assert len(state["rng"]["cuda"]) == (device == "cuda") and all(t.device.type == "cpu" for t in state["rng"]["cuda"])
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # the RNG byte tensors are restored from the CPU
        resumed = train(train_cfg(f"device={device}", f"dtype={run_dtype(device)}", "compile=true",
                                  "train.max_iters=40", "resume=true"))
    assert resumed["steps"] == 40


@pytest.mark.parametrize("device", DEVICES)
def test_flash_attention_matches_the_reference_in_bf16(device):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from variants import attention
    q, k, v = (torch.randn(2, 4, 512, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        fast = attention(q, k, v, 0.125, impl="sdpa").float()
    ref = attention(q.float(), k.float(), v.float(), 0.125, impl="reference")
    diff = (fast - ref).abs()
    assert diff.max().item() < 2e-2, f"max {diff.max().item():.3e}, mean {diff.mean().item():.3e}"


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_cast_model_runs_forward(device):
    """A model cast to bf16 for inference (RoPE's table stays fp32) runs forward; without targets
    GPT.forward returns the logits alone."""
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)).to(device).to(torch.bfloat16)
    logits = model(torch.randint(64, (2, 16), device=device))
    assert logits.shape == (2, 16, 64) and logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()
    assert model.rope.dtype == torch.float32
