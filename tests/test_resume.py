"""Never lose a run: exact resume after SIGKILL, SIGTERM checkpoints, the NaN guard, and a resume that
lengthens the context (and nothing else)."""
import json
import re
import signal
import time

import pytest
import torch

from lab.checkpoint import BEST_NAME, load_checkpoint, save_checkpoint, step_name
from rules import UserError
from helpers import cli_args, metrics_without_timing, poison_training_loss, wandb_run_record
from lab.stability import diverged_line
from train import train


def test_sigkill_then_resume_is_bitwise_identical(tmp_path, cli):
    cache = tmp_path / "cache"
    a, b = tmp_path / "a", tmp_path / "b"
    r = cli("train.py", *cli_args(a, cache))
    assert r.returncode == 0, r.stderr[-2000:]

    proc = cli.popen("train.py", *cli_args(b, cache))
    deadline = time.time() + 120
    while not (b / step_name(30)).exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)  # no clean-up of any kind
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "run B finished before it could be killed"
    assert not (b / step_name(60)).exists()
    resumed_from = max(int(p.stem.split("_")[1]) for p in b.glob("ckpt_*.pt"))
    assert 30 <= resumed_from < 60

    r = cli("train.py", *cli_args(b, cache), "resume=true")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resuming from {b / step_name(resumed_from)} at step {resumed_from}" in r.stderr
    # every metric line, before and after the resume point, equals the uninterrupted run's
    assert metrics_without_timing(b) == metrics_without_timing(a)
    wa, wb = load_checkpoint(a / step_name(60)), load_checkpoint(b / step_name(60))
    for name, tensor in wa["model"].items():
        assert torch.equal(tensor, wb["model"][name]), name
    assert wa["optimizer"]["state"][0]["exp_avg"].equal(wb["optimizer"]["state"][0]["exp_avg"])


def test_sigterm_checkpoints_the_current_step_and_exits_zero(tmp_path, cli):
    run = tmp_path / "run"
    args = cli_args(run, tmp_path / "cache")
    args[args.index("train.max_iters=60")] = "train.max_iters=100000"
    args[args.index("train.ckpt_interval=10")] = "train.ckpt_interval=100000"
    proc = cli.popen("train.py", *args)
    deadline = time.time() + 120
    while not (run / "metrics.jsonl").exists() or (run / "metrics.jsonl").read_text().count('"lr"') < 15:
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    ckpts = list(run.glob("ckpt_*.pt"))
    assert len(ckpts) == 1  # the only checkpoint is the one SIGTERM asked for
    step = load_checkpoint(ckpts[0])["step"]
    assert step >= 15 and f"stopped by SIGTERM at step {step}" in err and "resume=true" in err
    last_logged = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    assert last_logged == step


@pytest.mark.slow  # trains 20 steps, then resumes to 30
def test_resume_continues_in_process_and_keeps_the_wandb_run(train_cfg, tmp_path):
    first = train(train_cfg("train.max_iters=20", "logger.wandb.mode=offline"))
    assert first["steps"] == 20
    # W&B names an offline run's folder by the second it started and the run id: a resume within
    # the same second would write into the first run's folder (wandb's layout, not ours)
    time.sleep(1.0 - time.time() % 1.0 + 0.05)
    again = train(train_cfg("train.max_iters=30", "logger.wandb.mode=offline", "resume=true"))
    assert again["steps"] == 30
    steps = [json.loads(l)["step"] for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 30
    ids = {wandb_run_record(d)["id"] for d in (tmp_path / "run" / "wandb").glob("offline-run-*")}
    assert len(ids) == 1  # one W&B run, resumed


def test_resume_errors_are_one_line(train_cfg, tmp_path):
    with pytest.raises(UserError, match="resume=true but .* has no checkpoint"):
        train(train_cfg("resume=true"))
    with pytest.raises(UserError, match="no checkpoint there"):
        train(train_cfg(f"resume={tmp_path / 'nowhere'}"))
    train(train_cfg("train.max_iters=10"))
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(UserError, match="already holds a run: continue it with resume=true"):
        train(train_cfg("train.max_iters=10"))  # a fresh run never overwrites an old one
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before
    with pytest.raises(UserError, match=r"cannot resume: model.n_embd is 64 here but 32 in the checkpoint"):
        train(train_cfg("resume=true", "model.n_embd=64"))


def test_nan_loss_stops_naming_the_step_and_keeps_finite_checkpoints(train_cfg, tmp_path, monkeypatch):
    poison_training_loss(monkeypatch, {14: float("nan")})  # the 14th training step: step 13 -> 14
    result = train(train_cfg("train.max_iters=40"))  # a divergence (lab/stability.py): recorded, the run ends there
    assert result["diverged"] and result["steps"] == 14 and result["diverged_last_finite_loss"] is not None
    assert re.search(r"diverged at step 14: the loss or gradients were not finite .*last good checkpoint: "
                     r".*ckpt_0000010.pt", diverged_line(result))
    run = tmp_path / "run"
    assert sorted(p.name for p in run.glob("*.pt")) == [BEST_NAME, step_name(10)]
    for t in load_checkpoint(run / step_name(10))["model"].values():
        assert torch.isfinite(t).all()


@pytest.mark.slow  # trains 20 steps
def test_skip_nonfinite_skips_bad_steps_and_goes_on(train_cfg, tmp_path, monkeypatch):
    poison_training_loss(monkeypatch, {5: float("inf"), 9: float("inf")})
    result = train(train_cfg("train.max_iters=20", "train.skip_nonfinite=2"))
    assert result["steps"] == 20
    for t in load_checkpoint(tmp_path / "run" / step_name(20))["model"].values():
        assert torch.isfinite(t).all()


def test_sigterm_stops_a_whole_sweep_not_only_its_current_run(tmp_path, cli):
    """SIGTERM stops the whole sweep: the signalled run checkpoints and returns, and Hydra starts no next
    point; the one command its stop line prints finishes it (the stopped job resumes, the other starts)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(300)))
    sweep = tmp_path / "sweep"
    proc = cli.popen("train.py", "-m", "model=debug", "model.n_embd=32,64", "train.max_iters=600",
                     "train.ckpt_interval=100000", "train.eval_interval=1000", "train.eval_iters=1", "device=cpu",
                     "logger.wandb.mode=disabled", "logger.plots=false", f"data.path={corpus}", f"data.cache_dir={tmp_path / 'cache'}",
                     f"hydra.sweep.dir={sweep}")
    deadline = time.time() + 120
    while not list(sweep.glob("0_*/metrics.jsonl")) or '"lr"' not in next(sweep.glob("0_*/metrics.jsonl")).read_text():
        assert proc.poll() is None and time.time() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "sweep stopped" in err, err[-2000:]
    assert [p.name[:2] for p in sweep.iterdir() if p.is_dir()] == ["0_"]  # the second point never started
    assert len(list(sweep.glob("0_*/ckpt_*.pt"))) == 1
    import shlex
    stop_line = next(line for line in err.splitlines() if line.startswith("sweep stopped"))
    command = shlex.split(stop_line.split("with: ", 1)[1])
    assert command[:3] == ["python", "train.py", "-m"] and command[-1] == "resume=true"
    r = cli(*command[1:], timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "sweep done: 2 jobs: 2 finished, 0 diverged, 0 failed" in r.stderr
    done = sorted(sweep.glob("*/results.json"))
    assert len(done) == 2 and all(json.loads(p.read_text())["steps"] == 600 for p in done)


def test_a_checkpoint_from_before_an_option_existed_resumes_as_that_options_default(train_cfg, tmp_path):
    """A checkpoint without model.attn.kind, window, gate, ... (written before they existed) resumes with
    each at its default, not refused with "model.attn is {...} here but {...} in the checkpoint"; it
    may lengthen its context with RoPE scaling; such an option set to other than its default is another
    model, refused."""
    train(train_cfg("train.max_iters=10"))
    path = tmp_path / "run" / step_name(10)
    state = load_checkpoint(path)
    added_later = ("block", "window", "window_pattern", "kind", "gate", "sink", "kv_lora_rank", "q_lora_rank",
                   "rope_head_dim")
    for key in added_later:
        state["config"]["model"]["attn"].pop(key)
    for key in ("rope_scaling", "rope_scaling_factor", "rope_original_length"):
        state["config"]["model"].pop(key)
    state["config"]["data"].pop("bos")
    save_checkpoint(path, state)
    # it may lengthen its context with RoPE scaling, options it did not know (a new run: a fine-tune)
    longer = ["model.block_size=64", "model.rope_scaling=ntk", "model.rope_scaling_factor=2"]
    train(train_cfg("train.max_iters=12", f"resume={path}", f"out_dir={tmp_path / 'longer'}", *longer))
    assert load_checkpoint(tmp_path / "longer" / step_name(12))["context_extensions"][0]["rope_scaling"] == ["none", "ntk"]
    assert train(train_cfg("train.max_iters=12", "resume=true"))["steps"] == 12
    # an option the old checkpoint lacks, set to other than its default, is still a different model
    with pytest.raises(UserError, match=r"cannot resume: model.attn.gate is .head. here but .none. in the checkpoint"):
        train(train_cfg("train.max_iters=14", "resume=true", "model.attn.gate=head"))


# ----------------------------------------------------------------------------- lengthening the context

def test_a_resume_may_lengthen_the_context_keeping_every_weight_and_nothing_else(train_cfg, tmp_path):
    from lab import checkpoint as ck
    import train as train_module
    train_module.train(train_cfg("train.max_iters=4", "train.eval_interval=2"))
    before = ck.load_checkpoint(tmp_path / "run" / "ckpt_0000004.pt")
    longer = ["model.block_size=64", "model.rope_scaling=yarn", "model.rope_scaling_factor=2", "resume=true"]
    with pytest.raises(UserError, match="model.n_head is 4 here but 2"):
        train_module.train(train_cfg("train.max_iters=6", *longer, "model.n_head=4"))  # any other change is refused
    run = train_module.setup(train_cfg("train.max_iters=6", *longer))
    try:  # the resumed model: every weight as saved, the longer block with YaRN from the trained 32
        assert all(torch.equal(before["model"][k], v) for k, v in run.model.state_dict().items())
        c = run.model.config
        assert (c.block_size, c.rope_scaling, c.rope_scaling_factor, c.rope_original_length) == (64, "yarn", 2.0, 32)
    finally:
        run.tracker.close()
        run.lock.close()
    train_module.train(train_cfg("train.max_iters=6", *longer))
    after = ck.load_checkpoint(tmp_path / "run" / "ckpt_0000006.pt")  # stated in the checkpoint
    ext = after["context_extensions"]
    assert len(ext) == 1 and ext[0]["step"] == 4 and ext[0]["block_size"] == [32, 64]
    assert ext[0]["rope_scaling"] == ["none", "yarn"] and after["model_config"]["rope_original_length"] == 32


def test_lengthening_another_runs_context_is_a_new_run_that_leaves_the_first_as_it_was(train_cfg, tmp_path):
    """resume=OTHER_RUN/ckpt with a longer block and hydra.run.dir=NEW is a fine-tune: it runs in the dir
    it is given, from the other run's weights, and leaves the other run byte for byte (its config,
    metrics, best.pt and checkpoints)."""
    from train import train
    train(train_cfg("train.max_iters=4", "train.eval_interval=2"))
    first = tmp_path / "run"
    before = {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()}
    new = tmp_path / "finetune"
    longer = ["model.block_size=64", "model.rope_scaling=ntk", "model.rope_scaling_factor=2"]
    result = train(train_cfg("train.max_iters=6", *longer, f"resume={first / 'ckpt_0000004.pt'}", f"out_dir={new}"))
    assert result["out_dir"] == str(new) and result["steps"] == 6
    assert {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()} == before
    from lab import checkpoint as ck
    state = ck.load_checkpoint(new / "ckpt_0000006.pt")
    assert state["model_config"]["block_size"] == 64 and state["context_extensions"][0]["block_size"] == [32, 64]
    assert [json.loads(line)["step"] for line in (new / "metrics.jsonl").read_text().splitlines()][0] >= 4
    with pytest.raises(UserError, match="already holds a run"):  # and never into a dir that holds another run
        train(train_cfg("train.max_iters=6", *longer, f"resume={first / 'ckpt_0000004.pt'}", f"out_dir={new}"))


def test_a_position_table_cannot_be_lengthened(train_cfg):
    from train import train
    train(train_cfg("train.max_iters=2", "train.eval_interval=2", "model.pos=learned"))
    with pytest.raises(UserError, match="model.pos=learned has a table of 32 positions"):
        train(train_cfg("train.max_iters=4", "model.pos=learned", "model.block_size=64", "resume=true"))


def test_a_resume_from_an_older_checkpoint_or_with_another_lr_never_rewrites_the_run(train_cfg, tmp_path):
    """resume=RUN/ckpt_older (what the divergence line invites) and a resume at another lr branch into the
    command's own dir, which records where it came from; the run itself stays byte for byte (its later
    checkpoints, best.pt, metrics and config.yaml). resume=true with another lr is refused in one line that
    gives the branching command."""
    from train import train
    train(train_cfg("train.max_iters=6", "train.eval_interval=2", "train.keep_ckpts=5"))
    first = tmp_path / "run"
    before = {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()}
    older = first / "ckpt_0000002.pt"
    for i, extra in enumerate([[], ["train.lr=3e-4"]]):  # an older checkpoint; the newest at another lr
        source = older if not extra else first / "ckpt_0000006.pt"
        new = tmp_path / f"branch{i}"
        result = train(train_cfg("train.max_iters=8", "train.eval_interval=2", "train.keep_ckpts=5", *extra,
                                 f"resume={source}", f"out_dir={new}"))
        assert result["out_dir"] == str(new) and result["steps"] == 8
        info = json.loads((new / "run_info.json").read_text())["branched_from"]
        assert info["checkpoint"] == str(source) and ("older" in info["why"] if not extra else "train.lr=0.0003" in info["why"])
        assert {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()} == before
    with pytest.raises(UserError, match=r"train.lr=0.0003 \(was 0.002\) would rewrite that run: branch into a new "
                                        r"run dir instead, python train.py resume=\S+ckpt_0000006.pt") as e:
        train(train_cfg("train.max_iters=8", "train.eval_interval=2", "train.keep_ckpts=5", "train.lr=3e-4", "resume=true"))
    assert "\n" not in str(e.value)
    assert {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()} == before
