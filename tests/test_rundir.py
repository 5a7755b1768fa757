"""rundir.RunDir: a training run's dir is chosen, locked and cleaned, and a refused run leaves nothing
behind (train.setup uses it; tests/test_reliability.py checks the same through whole runs)."""
import pytest

from lab.checkpoint import step_name
from rules import UserError
from lab.rundir import RunDir


def test_a_refused_run_removes_the_dir_it_made_and_lets_the_lock_go(tmp_path):
    run_dir = RunDir(tmp_path / "new")
    with pytest.raises(UserError), run_dir.removed_if_refused():
        run_dir.check()
        run_dir.open()
        assert (tmp_path / "new" / ".lock").exists()
        raise UserError("refused")
    assert not (tmp_path / "new").exists() and run_dir.lock.closed


def test_a_dir_that_holds_a_run_is_refused_and_left_as_it_was(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    (old / step_name(10)).write_bytes(b"")
    (old / f".{step_name(20)}.tmp-123").write_bytes(b"")  # a killed write's: only a run that holds the lock cleans it
    run_dir = RunDir(old)
    assert not run_dir.made
    with pytest.raises(UserError, match="already holds a run: continue it with resume=true"):
        with run_dir.removed_if_refused():
            run_dir.open()
    assert sorted(p.name for p in old.iterdir()) == sorted([".lock", step_name(10), f".{step_name(20)}.tmp-123"])


def test_a_second_training_in_a_locked_dir_is_refused_in_one_line(tmp_path):
    first = RunDir(tmp_path / "run")
    first.open()
    try:
        with pytest.raises(UserError, match="is in use by a running training"):
            RunDir(tmp_path / "run").open()
    finally:
        first.lock.close()


def test_an_unset_dir_is_refused_before_anything_is_made(tmp_path):
    with pytest.raises(UserError, match="out_dir is unset"):
        RunDir(None).check()


def test_a_record_that_cannot_be_written_is_one_line_and_the_refused_run_leaves_nothing(tmp_path):
    """A file where the run's .hydra directory goes (or a directory named config.yaml) is refused in one line
    naming the dir, not an OSError traceback; the refused run wrote nothing and let its lock go, and only what
    was in the way is left (a dir is removed only when empty: nothing of the user's is deleted)."""
    from omegaconf import OmegaConf
    for blocker in (".hydra", "config.yaml"):
        made = tmp_path / blocker.strip(".")
        run_dir = RunDir(made)
        with pytest.raises(UserError, match="cannot write the run's record in") as e, run_dir.removed_if_refused():
            run_dir.check()
            run_dir.open()
            (made / blocker).mkdir() if blocker == "config.yaml" else (made / blocker).write_text("")
            run_dir.write_record(OmegaConf.create({"a": 1}), {}, overrides=["a=1"])
        assert "\n" not in str(e.value) and [p.name for p in made.iterdir()] == [blocker] and run_dir.lock.closed
