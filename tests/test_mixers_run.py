"""Gated DeltaNet, Mamba-2 and a hybrid stack as a user runs them: a run resumed from its middle
checkpoint is the uninterrupted run bit for bit (the states are rebuilt per window, nothing of them
is saved), and FSDP over two torchrun processes trains what one process trains."""
import shutil

import pytest
import torch

from lab.checkpoint import load_checkpoint, step_name
from helpers import assert_same_training, compose_cfg, metrics_without_timing
from train import train

pytestmark = pytest.mark.slow

MIXERS = {"gdn": ["model.attn.kind=gdn"], "mamba2": ["model.attn.kind=mamba2"],
          "gdn_softmax": ["model.attn.layer_kinds=[gdn,softmax]"]}


@pytest.mark.parametrize("name", list(MIXERS))
def test_a_mixer_run_resumed_from_its_middle_is_the_uninterrupted_run(name, train_cfg, tmp_path):
    # dropout on: the resumed run must also restore the generator that draws its masks
    steps = ["train.max_iters=8", "train.ckpt_interval=4", "train.keep_ckpts=10", "train.eval_interval=4",
             "train.log_interval=1", "model.dropout=0.1", *MIXERS[name]]
    whole = train(train_cfg(*steps))
    a, b = tmp_path / "run", tmp_path / "resumed"
    shutil.copytree(a, b)
    (b / step_name(8)).unlink()  # as if killed after step 4's checkpoint
    again = train(train_cfg(*steps, f"out_dir={b}", "resume=true"))
    assert whole["steps"] == again["steps"] == 8
    assert metrics_without_timing(b) == metrics_without_timing(a)
    wa, wb = load_checkpoint(a / step_name(8)), load_checkpoint(b / step_name(8))
    for key, tensor in wa["model"].items():
        assert torch.equal(tensor, wb["model"][key]), key
    for i, s in wa["optimizer"]["state"].items():
        assert all(torch.equal(t, wb["optimizer"]["state"][i][k]) for k, t in s.items() if torch.is_tensor(t)), i


def test_fsdp_trains_a_stack_of_every_recurrent_mixer_as_one_process_does(tmp_path, cli):
    """[gdn, mamba2, linear, softmax], 2 processes x 2 micro-batches against one process x 4:
    weights, val losses and every logged train loss within 1e-5."""
    common = ["model=debug", "model.n_layer=4", "model.attn.layer_kinds=[gdn,mamba2,linear,softmax]",
              "model.dropout=0.0", "train.max_iters=10", "train.eval_interval=5", "train.eval_iters=2",
              "train.log_interval=1", "train.batch_size=4", "train.grad_accum=4", "train.ckpt_interval=10",
              "train.final_eval_tokens=1056", "device=cpu", "logger.wandb.mode=disabled", "logger.plots=false",
              f"data.cache_dir={tmp_path / 'cache'}"]
    single, fsdp = tmp_path / "single", tmp_path / "fsdp"
    train(compose_cfg("config", [*common, f"out_dir={single}"]))
    cli("train.py", *common, "train.parallel=fsdp", f"hydra.run.dir={fsdp}", env={"OMP_NUM_THREADS": "1"},
        check=True, torchrun=2)
    assert_same_training(single, fsdp, step=10, tol=1e-5)
