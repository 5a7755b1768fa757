"""Checkpoint I/O: safe loading, clear errors, atomic writes."""
import pytest
import torch

from lab import checkpoint as ck
from rules import UserError
from model import GPT, GPTConfig


def small_state(n_embd=16):
    import dataclasses
    model = GPT(GPTConfig(vocab_size=20, block_size=8, n_layer=1, n_head=2, n_embd=n_embd))
    return model, {"model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
                   "tokenizer": {"kind": "char", "chars": "abcdefghijklmnopqrst"}, "step": 3}


class Payload:
    """Unpickling this calls open(marker, 'w'): code that runs on load."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pickle_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    _, state = small_state()
    state["extra"] = Payload(marker)
    torch.save(state, path)
    with pytest.raises(UserError, match="refusing to load") as e:
        ck.load_checkpoint(path)
    assert "\n" not in str(e.value)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the payload is live: an unsafe load would have run it
    assert marker.exists()


def test_round_trip_rebuilds_the_same_model(tmp_path):
    model, state = small_state()
    ck.save_checkpoint(tmp_path / "ckpt.pt", state)
    loaded = ck.model_from_checkpoint(ck.load_checkpoint(tmp_path / "ckpt.pt"))
    idx = torch.randint(20, (2, 8))
    assert torch.equal(model.eval()(idx), loaded.eval()(idx))


def test_truncated_checkpoint_is_one_line_error(tmp_path):
    _, state = small_state()
    path = ck.save_checkpoint(tmp_path / "ckpt.pt", state)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="cannot read checkpoint") as e:
        ck.load_checkpoint(path)
    assert "\n" not in str(e.value)


def test_incompatible_checkpoint_names_the_mismatch(tmp_path):
    _, state = small_state(n_embd=32)
    other, _ = small_state(n_embd=16)
    with pytest.raises(UserError, match=r"wte.weight is \(20, 32\) in the checkpoint but \(20, 16\)"):
        ck.load_weights(other, state["model"])


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, state = small_state()
    path = ck.save_checkpoint(tmp_path / "ckpt.pt", state)
    before = path.read_bytes()

    def crash_mid_write(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt
    monkeypatch.setattr(ck.torch, "save", crash_mid_write)
    with pytest.raises(KeyboardInterrupt):
        ck.save_checkpoint(path, {**state, "step": 4})
    monkeypatch.undo()
    assert path.read_bytes() == before and ck.load_checkpoint(path)["step"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left


def test_find_checkpoint_prefers_best_then_newest(tmp_path):
    with pytest.raises(UserError, match="no checkpoint found"):
        ck.find_checkpoint(None, root=tmp_path)
    with pytest.raises(UserError, match="no checkpoint at"):
        ck.find_checkpoint(tmp_path / "nope")
    _, state = small_state()
    old = ck.save_checkpoint(tmp_path / "a" / ck.step_name(10), state)
    new = ck.save_checkpoint(tmp_path / "b" / ck.step_name(10), state)
    newer = ck.save_checkpoint(tmp_path / "b" / ck.step_name(20), state)
    import os
    os.utime(old, (1, 1))
    assert ck.find_checkpoint(None, root=tmp_path) == newer  # newest run, its newest checkpoint
    assert ck.find_checkpoint(tmp_path / "a") == old
    best = ck.save_checkpoint(tmp_path / "b" / ck.BEST_NAME, state)
    assert ck.find_checkpoint(tmp_path / "b") == best and ck.find_checkpoint(new) == new
    ck.prune_checkpoints(tmp_path / "b", keep=1)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [ck.BEST_NAME, ck.step_name(20)]


def test_resuming_a_checkpoint_without_its_run_config_is_one_line_naming_init_from():
    """A checkpoint saved by hand (weights and model_config, no run config) has nothing to hold the run
    against: one line, not a comparison with the schema's defaults that names a key the checkpoint never had."""
    from lab.checkpoint import check_resumable
    with pytest.raises(UserError, match="holds no run config .* init_from=CKPT") as e:
        check_resumable({"model_config": {"block_size": 32}, "model": {}}, cfg=None, data=None)
    assert "\n" not in str(e.value)
