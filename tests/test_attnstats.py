"""Attention statistics against direct computations, and their logging to files and W&B."""
import json
import math

import pytest
import torch

import model as model_module
from attnstats import AttentionProbe, attention_stats
from model import GPT, GPTConfig, attention
import wandb_log
from tracking import read_metrics
from train import train


def full_matrix_stats(q, k, scale):
    """Entropy, normalised entropy and peak per head from the reference path's whole attention
    matrix in float64 (weights = attention(q, k, I))."""
    q, k = q.double(), k.double()
    B, nh, T, _ = q.shape
    eye = torch.eye(T, dtype=torch.float64).expand(B, nh, T, T)
    p = attention(q, k, eye, scale, impl="reference")  # (B, nh, T, T): row i = weights of query i
    ent = torch.zeros(B, nh, T, dtype=torch.float64)
    for i in range(T):
        row = p[..., i, : i + 1]
        ent[..., i] = -(row * row.log()).nan_to_num(0.0).sum(-1)
    lnk = torch.log(torch.arange(1, T + 1, dtype=torch.float64))
    norm = (ent[..., 1:] / lnk[1:]).mean(dim=(0, 2))
    return ent.mean(dim=(0, 2)), norm, p.amax(-1).mean(dim=(0, 2))


def test_uniform_rows_have_entropy_ln_keys_and_one_hot_rows_zero():
    T, hs = 12, 16
    zeros = torch.zeros(1, 1, T, hs)  # all scores 0: each row uniform over its i+1 keys
    s = attention_stats(zeros, torch.randn(1, 1, T, hs), 1.0, dtype=torch.float64)
    want = sum(math.log(i + 1) for i in range(T)) / T
    assert s["entropy"].item() == pytest.approx(want, abs=1e-9)
    assert s["entropy_norm"].item() == pytest.approx(1.0, abs=1e-9)
    assert s["peak"].item() == pytest.approx(sum(1 / (i + 1) for i in range(T)) / T, abs=1e-9)
    e = torch.eye(T, hs).view(1, 1, T, hs) * 100  # q_i . k_j = 1e4 * [i == j]: one-hot on the diagonal
    s = attention_stats(e, e, 1.0, dtype=torch.float64)
    assert s["entropy"].item() == pytest.approx(0.0, abs=1e-9)
    assert s["peak"].item() == pytest.approx(1.0, abs=1e-9)
    assert s["logit_max"].item() == pytest.approx(1e4)


def capture_qk(model, idx):
    seen = {}
    model(idx, probe=lambda layer, q, k, scale: seen.setdefault(layer, (q, k, scale)))
    return seen


@pytest.mark.parametrize("T,block", [(23, 5), (23, 23), (16, 256)])
def test_blockwise_stats_equal_full_matrix_in_float64(T, block):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=30, block_size=32, n_layer=2, n_head=3, n_embd=48)).eval()
    with torch.no_grad():
        model.blocks[1].attn.c_attn.weight.mul_(8)  # a sharper layer too
    for layer, (q, k, scale) in capture_qk(model, torch.randint(30, (2, T))).items():
        got = attention_stats(q, k, scale, block=block, dtype=torch.float64)
        ent, norm, peak = full_matrix_stats(q, k, scale)
        for name, a, b in [("entropy", got["entropy"], ent), ("norm", got["entropy_norm"], norm), ("peak", got["peak"], peak)]:
            assert torch.allclose(a, b, atol=1e-5), f"layer {layer} {name}: max diff {(a - b).abs().max():.2e}"


def test_probe_float32_matches_float64_reference():
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=30, block_size=32, n_layer=2, n_head=2, n_embd=32)).eval()
    idx = torch.randint(30, (3, 32))
    stats = AttentionProbe(idx, block=7).run(model)
    for layer, (q, k, scale) in capture_qk(model, idx).items():
        ent, _, _ = full_matrix_stats(q, k, scale)
        for h in range(2):
            assert stats[f"attn_entropy/L{layer}/H{h}"] == pytest.approx(ent[h].item(), abs=1e-5)
        assert stats[f"attn_entropy/L{layer}"] == pytest.approx(ent.mean().item(), abs=1e-5)


def test_removing_sqrt_dk_saturates_attention_of_large_qk():
    results = {}
    for scale in ("sqrt_dk", "none"):
        torch.manual_seed(2)
        model = GPT(GPTConfig(vocab_size=30, block_size=64, n_layer=2, n_head=1, n_embd=128,
                              attn={"scale": scale})).eval()
        with torch.no_grad():
            for block in model.blocks:
                block.attn.c_attn.weight.mul_(5)  # q, k entries of order 1
        results[scale] = AttentionProbe(torch.randint(30, (4, 64))).run(model)
    assert results["none"]["attn_entropy_norm/mean"] < 0.5 * results["sqrt_dk"]["attn_entropy_norm/mean"]
    assert results["none"]["attn_peak/mean"] > results["sqrt_dk"]["attn_peak/mean"] + 0.2


def test_probe_works_at_block_size_2048_on_cpu():
    torch.manual_seed(3)
    model = GPT(GPTConfig(vocab_size=30, block_size=2048, n_layer=2, n_head=2, n_embd=32)).eval()
    stats = AttentionProbe(torch.randint(30, (1, 2048)), block=256).run(model)
    assert 0 < stats["attn_entropy/mean"] < math.log(2048)


def test_training_steps_never_build_the_attention_matrix(train_cfg, tmp_path, monkeypatch):
    calls = []
    real = model_module.attention_scores
    monkeypatch.setattr(model_module, "attention_scores", lambda *a, **k: calls.append(1) or real(*a, **k))
    train(train_cfg("train.max_iters=20", "train.log_attn_interval=10"))
    assert calls == []  # the reference path never ran; the probe has its own import
    train(train_cfg("train.max_iters=2", "model.attn.impl=reference", f"out_dir={tmp_path / 'reference'}"))
    assert calls  # and the counter does see the reference path when it is used


def test_entropy_logged_every_interval_to_metrics(train_cfg, tmp_path):
    train(train_cfg("train.max_iters=20", "train.log_attn_interval=5"))
    probes = [m for m in read_metrics(tmp_path / "run") if "attn_entropy/mean" in m]
    assert [m["step"] for m in probes] == [0, 5, 10, 15, 20]
    keys = probes[0].keys()
    for l in range(2):
        assert {f"attn_entropy/L{l}/H0", f"attn_entropy/L{l}/H1", f"attn_entropy/L{l}", f"attn_entropy_norm/L{l}",
                f"attn_peak/L{l}", f"attn_logit_max/L{l}"} <= keys
    assert (tmp_path / "run" / "attn_entropy.png").stat().st_size > 1000
    # same probe tokens every time: an untrained model's step-0 entropies are reproducible
    train(train_cfg("train.max_iters=0", "train.log_attn_interval=5", f"out_dir={tmp_path / 'again'}"))
    again = [m for m in read_metrics(tmp_path / "again") if "attn_entropy/mean" in m]
    assert again[0] == probes[0]


def test_wandb_offline_run_holds_entropy_and_loss_keys(train_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_env"))
    train(train_cfg("logger.wandb.mode=offline", "train.max_iters=10", "train.eval_interval=5"))
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    summary = wandb_log.summary(runs[0])  # read back from the run's own transaction log
    for l in range(2):
        for h in range(2):
            assert f"attn_entropy/L{l}/H{h}" in summary
        assert f"attn_entropy/L{l}" in summary and f"attn_peak/L{l}" in summary
    assert {"train/loss", "val/loss", "lr", "tokens_per_sec", "attn_entropy/mean"} <= summary.keys()
    last_eval = [m for m in read_metrics(tmp_path / "run") if "val/loss" in m][-1]
    assert summary["val/loss"] == pytest.approx(last_eval["val/loss"]) and summary["step"] == 10


def test_unknown_wandb_mode_fails_before_writing_metrics(train_cfg, tmp_path):
    from common import UserError
    with pytest.raises(UserError, match="logger.wandb.mode='banana'"):
        train(train_cfg("logger.wandb.mode=banana"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    train(train_cfg("train.max_iters=2"))  # so the run dir is still free for a real run


def test_wandb_disabled_writes_nothing(train_cfg, tmp_path):
    train(train_cfg("logger.wandb.mode=disabled", "train.max_iters=5"))
    assert not (tmp_path / "run" / "wandb").exists()
