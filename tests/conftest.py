"""Shared fixtures: configs composed through Hydra's compose API, forced to CPU, tiny sizes and
tmp_path, with W&B disabled unless a test turns it on."""
import os
from pathlib import Path

# OpenMP threads that spin while they wait make every op take a scheduler time slice once more
# processes than cores compute (a test's subprocess next to the test itself, or a shared
# machine): ~10x slower tests. Passive waiting costs little when the cores are free. Set before
# torch loads OpenMP; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"
TIKTOKEN_CACHE = SHARED_DATA / "tiktoken"

os.environ.setdefault("WANDB_SILENT", "true")
os.environ.pop("WANDB_MODE", None)  # tests choose the mode explicitly
torch.set_num_threads(min(2, torch.get_num_threads()))


def compose_cfg(config_name="config", overrides=()):
    import config  # noqa: F401  (registers the schema)

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


TINY = ["model=debug", "device=cpu", "logger.wandb.mode=disabled", "train.max_iters=20",
        "train.eval_interval=10", "train.eval_iters=2", "train.log_interval=5", "train.batch_size=4"]


@pytest.fixture
def train_cfg(tmp_path):
    """train_cfg(*overrides): a tiny CPU training config writing under tmp_path."""
    def make(*overrides):
        base = TINY + [f"out_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
        return compose_cfg("config", base + list(overrides))
    return make


@pytest.fixture
def sample_cfg():
    def make(*overrides):
        return compose_cfg("sample", ["device=cpu", *overrides])
    return make


@pytest.fixture
def text_file(tmp_path):
    """A small UTF-8 corpus file (a few thousand characters of varied text)."""
    lines = [f"line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}." for i in range(200)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def requires_shared(path):
    return pytest.mark.skipif(not Path(path).exists(), reason=f"{path} absent (a fresh clone has no ../shared)")
