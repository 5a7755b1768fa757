"""Throughput and MFU as logged by a training run."""
import pytest

from lab.checkpoint import load_checkpoint, step_name
from lab.tracking import read_metrics
from train import train


def test_mfu_is_logged_against_the_given_peak(train_cfg, tmp_path):
    train(train_cfg("train.peak_flops=1e12", "train.max_iters=10"))
    lines = [m for m in read_metrics(tmp_path / "run") if "mfu" in m]
    assert lines
    c = load_checkpoint(tmp_path / "run" / step_name(10))["model_config"]
    assert (c["mlp"], c["norm"], c["bias"], c["tie_embeddings"], c["pos"]) == ("gelu", "layernorm", False, True, "rope")
    L, d, T, V = c["n_layer"], c["n_embd"], c["block_size"], c["vocab_size"]
    # PaLM's 6N + 12 L T d, written out: per block 12 d² of matrices and two norms' d weights, ln_f, the tied head
    n_flops = 6 * (L * (12 * d * d + 2 * d) + d + V * d) + 12 * L * T * d
    for m in lines:
        assert m["mfu"] == pytest.approx(n_flops * m["tokens_per_sec"] / 1e12, rel=1e-9)
