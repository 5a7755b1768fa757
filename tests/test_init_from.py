"""init_from=RUN: a new run that starts from another run's weights (step 0, a fresh optimizer), built
with settings that hold no weights changed (a window, a selection) or with weights added (an indexer,
fresh from the seed); the run it starts from is left byte for byte."""
import pytest
import torch

from lab.checkpoint import BEST_NAME, load_checkpoint, save_checkpoint
from helpers import TINY, compose_cfg
from model import GPT
from rules import UserError
from train import setup, train


def cfg(tmp_path, first, *overrides):
    """The debug model's config writing to tmp_path/run, with the first run's prepared data."""
    return compose_cfg("config", TINY + [f"out_dir={tmp_path / 'run'}", f"data.cache_dir={first[0].parent / 'cache'}",
                                         *overrides])


def close(run):
    run.tracker.close()
    run.lock.close()


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """A finished 4-step run of the debug model (one for the module); its dir and its files' bytes."""
    d = tmp_path_factory.mktemp("init") / "first"
    train(compose_cfg("config", TINY + ["train.max_iters=4", "train.eval_interval=2", f"out_dir={d}",
                                        f"data.cache_dir={d.parent / 'cache'}"]))
    return d, {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()}


def test_a_windowed_run_starts_from_every_weight_of_a_full_one_at_step_0(tmp_path, first):
    d, before = first
    best = load_checkpoint(d / BEST_NAME)["model"]
    run = setup(cfg(tmp_path, first, f"init_from={d}", "model.attn.window=8", "train.max_iters=3"))
    try:
        own = run.model.state_dict()
        assert own.keys() == best.keys() and all(torch.equal(own[k], best[k]) for k in own)
        assert run.step == 0 and not run.optimizer.state  # no step taken, no moments carried over
        assert run.model.config.attn.window == 8
    finally:
        close(run)
    result = train(cfg(tmp_path, first, f"init_from={d}", "model.attn.window=8", "train.max_iters=3",
                       "train.eval_interval=3"))
    assert result["steps"] == 3
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.is_file()} == before  # the first run as it was


def test_weights_the_checkpoint_lacks_are_the_seeds_fresh_ones(tmp_path, first):
    d, _ = first
    best = load_checkpoint(d / BEST_NAME)["model"]
    over = ["model.attn.select=indexer", "model.attn.select_topk=8", "seed=7"]
    run = setup(cfg(tmp_path, first, f"init_from={d}", *over))
    try:
        torch.manual_seed(7)
        fresh = GPT(run.model.config).state_dict()  # what the seed alone gives (build seeds the same way)
        own = run.model.state_dict()
        added = sorted(set(own) - set(best))
        assert added and all(".attn.select.w" in k for k in added)  # the indexer's projections
        for k in own:
            assert torch.equal(own[k], best[k] if k in best else fresh[k]), k
    finally:
        close(run)


def test_a_checkpoint_that_does_not_fit_is_one_line_and_makes_no_run(tmp_path, first):
    d, _ = first
    with pytest.raises(UserError, match=r"init_from=.*: its wte.weight is \(\d+, 32\) but \(\d+, 48\) here"):
        train(cfg(tmp_path, first, f"init_from={d}", "model.n_embd=48"))
    assert not (tmp_path / "run").exists()  # the refused run's dir is gone again
    with pytest.raises(UserError, match=r"init_from=.*nowhere: no checkpoint there"):
        train(cfg(tmp_path, first, f"init_from={tmp_path / 'nowhere'}"))
    train(cfg(tmp_path / "idx", first, "train.max_iters=2", "train.eval_interval=2", "model.attn.select=indexer",
                    "model.attn.select_topk=8"))
    with pytest.raises(UserError, match=r"its blocks.0.attn.select.w\S* has no place in this model"):
        train(cfg(tmp_path, first, f"init_from={tmp_path / 'idx' / 'run'}"))
    state = load_checkpoint(d / BEST_NAME)
    state["tokenizer"] = {"kind": "mqar", "vocab_size": 64}
    save_checkpoint(tmp_path / "other.pt", state)
    with pytest.raises(UserError, match="its tokenizer differs from this run's data"):
        train(cfg(tmp_path, first, f"init_from={tmp_path / 'other.pt'}"))
