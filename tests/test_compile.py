"""torch.compile on CPU: the same training, traced by dynamo."""
import pytest

from train import train


@pytest.mark.slow
def test_compile_on_cpu_matches_eager(train_cfg, tmp_path):
    from torch._dynamo.utils import counters
    graphs = counters["stats"]["unique_graphs"]
    eager = train(train_cfg("train.max_iters=10", f"out_dir={tmp_path / 'eager'}"))
    assert counters["stats"]["unique_graphs"] == graphs and not eager["compiled"]
    compiled = train(train_cfg("train.max_iters=10", "compile=true", f"out_dir={tmp_path / 'compiled'}"))
    assert counters["stats"]["unique_graphs"] > graphs and compiled["compiled"]  # dynamo really traced the model
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], abs=1e-4)  # fused kernels reorder float sums
