"""Nothing lost, nothing silently wrong: one test per hostile case found by using every command as a
new user would, each saying what must hold and what goes wrong otherwise; one test that walks every
numeric config key through its bad values (0, negative, huge, nan, inf, wrong type), and one that sets
every key where it has no effect. Output paths are tests/test_output_paths.py's, exports' overwrite
tests/tools/test_export.py's."""
import copy
import dataclasses
import json
import logging
import math
import os
import re
import shutil
import signal
import stat
import time
import typing
import zipfile
from pathlib import Path

import pytest
import torch
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from lab import checkpoint as ck
import model as model_module
import train as train_module
from lab.cli import hydra_error_line
from rules import OneOf, UserError, check_values, schema_nodes
from helpers import REPO, TINY, assert_one_line_error, compose_cfg, corpus_text, interruptible, one_line
from data.loader import TokenData
from data.prepare import cache_key, prepare
from tools.report import report
from sample import sample
from lab.tracking import check_wandb_mode, read_metrics, truncate_metrics
from lab.stability import diverged_line
from train import train


# ----------------------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A small corpus and one data cache for the whole module (preparing is the slow part)."""
    root = tmp_path_factory.mktemp("shared")
    corpus = root / "corpus.txt"
    corpus.write_text(corpus_text())
    return {"corpus": corpus, "cache": root / "cache", "root": root}


def make_cfg(tmp_path, shared, *overrides):
    """A tiny CPU training config on the shared corpus and cache, writing to tmp_path/run; later
    overrides of the same key win."""
    base = TINY + [f"out_dir={tmp_path / 'run'}", f"data.cache_dir={shared['cache']}", f"data.path={shared['corpus']}"]
    return compose_cfg("config", base + list(overrides))


@pytest.fixture(scope="module")
def tiny_run(shared):
    """A trained tiny char model's run dir (10 steps), for the sampling cases."""
    run = shared["root"] / "tiny"
    train(make_cfg(shared["root"] / "unused", shared, f"out_dir={run}", "train.max_iters=10", "train.eval_interval=5"))
    return run


def snapshot(run: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(run.iterdir()) if p.is_file() and p.name != ".lock"}


# ----------------------------------------------------------------------------- data loss

@pytest.mark.slow
def test_resume_with_max_iters_below_the_checkpoint_step_is_refused_and_changes_nothing(tmp_path, shared):
    """Resuming past train.max_iters is refused and leaves the run as it was: the loop stops on `>=`, never
    runs on (`step 8700/100` under an `==` test) and never prunes the finished run's checkpoints."""
    train(make_cfg(tmp_path, shared, "train.max_iters=20"))
    run = tmp_path / "run"
    before = snapshot(run)
    with pytest.raises(UserError, match=r"at step 20, past train.max_iters=10: pass train.max_iters > 20") as e:
        train(make_cfg(tmp_path, shared, "train.max_iters=10", "resume=true"))
    one_line(e)
    assert snapshot(run) == before
    # resuming a finished run with its own max_iters stops at once (the stop test is >=) and changes nothing
    assert train(make_cfg(tmp_path, shared, "train.max_iters=20", "resume=true"))["steps"] == 20
    after = snapshot(run)
    assert [n for n in after if n.startswith("ckpt_")] == [ck.step_name(10), ck.step_name(20)]
    assert read_metrics(run) == read_metrics_bytes(before["metrics.jsonl"])


def read_metrics_bytes(data: bytes) -> list:
    return [json.loads(line) for line in data.decode().splitlines()]


def test_second_training_in_a_run_dir_is_refused_while_the_first_holds_it(tmp_path, shared, cli):
    """A second training in a held run dir is one line and writes nothing, so two runs never both exit 0
    with interleaved metrics.jsonl lines. The lock is an flock held by the first."""
    run = tmp_path / "run"
    holder = cli.popen("-c", "import sys, time; sys.path.insert(0, sys.argv[1]); "
                       "from lab.rundir import lock_run_dir; from pathlib import Path; "
                       "held = lock_run_dir(Path(sys.argv[2])); print('locked', flush=True); time.sleep(60)",
                       str(REPO), str(run), stderr=None)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=r"is in use by a running training \(pid \d+") as e:
            train(make_cfg(tmp_path, shared))
        one_line(e)
        assert sorted(p.name for p in run.iterdir()) == [".lock"]  # nothing of ours was written
    finally:
        holder.kill()
        holder.wait()
    assert train(make_cfg(tmp_path, shared, "train.max_iters=2"))["steps"] == 2  # the lock died with its holder


def test_default_run_dirs_of_runs_started_in_the_same_second_differ():
    """The default run dir's name carries microseconds (`%f`): with `%Y-%m-%d_%H-%M-%S` alone, two
    `python train.py` started together would share one dir."""
    import yaml
    from hydra.core.utils import setup_globals
    from omegaconf import OmegaConf
    setup_globals()  # registers Hydra's `now` resolver
    pattern = yaml.safe_load((REPO / "configs" / "config.yaml").read_text())["hydra"]["run"]["dir"]
    assert "%f" in pattern
    resolved = {OmegaConf.create({"d": pattern}).d for _ in range(3)}
    assert len(resolved) == 3


def test_checkpoints_past_step_9999999_sort_by_number(tmp_path):
    """Checkpoints sort by step number, not as text: with names padded to 7 digits sorted as text the
    newest (step 10,000,000) would be pruned."""
    state = {"model": {}, "model_config": {}, "tokenizer": {"kind": "char", "chars": "ab"}}
    for step in (10, 9_999_999, 10_000_000):
        ck.save_checkpoint(tmp_path / ck.step_name(step), {**state, "step": step})
    assert ck.latest_checkpoint(tmp_path).name == "ckpt_10000000.pt"
    ck.prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in ck.step_checkpoints(tmp_path)] == ["ckpt_9999999.pt", "ckpt_10000000.pt"]


@pytest.mark.slow  # trains 10 steps, then resumes to 20
def test_torn_last_metrics_line_is_dropped_so_resume_and_report_work(tmp_path, shared, caplog):
    """A torn last line of metrics.jsonl (a kill mid-write) is dropped with a warning: report.py and a
    resume read the file without a JSONDecodeError."""
    train(make_cfg(tmp_path, shared, "train.max_iters=10"))
    run = tmp_path / "run"
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 10, "train/lo')  # what a kill mid-write leaves
    rows = report([str(run)], tmp_path / "report")["rows"]
    assert rows[0]["steps"] == 10 and "torn last line" in caplog.text
    assert train(make_cfg(tmp_path, shared, "train.max_iters=20", "resume=true"))["steps"] == 20
    steps = [m["step"] for m in read_metrics(run)]  # every line parses again
    assert steps == sorted(steps) and steps[-1] == 20


def test_truncating_metrics_is_atomic(tmp_path, monkeypatch):
    """truncate_metrics replaces the file atomically: a kill mid-rewrite leaves the whole history (a
    rewrite in place would lose it)."""
    from lab import tracking
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(10)))
    before = path.read_bytes()

    def killed(*a):
        raise KeyboardInterrupt
    monkeypatch.setattr(tracking.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        truncate_metrics(path, 4)
    assert path.read_bytes() == before
    monkeypatch.undo()
    truncate_metrics(path, 4)
    assert [m["step"] for m in read_metrics(path)] == [0, 1, 2, 3, 4]


def test_resume_with_another_corpus_of_the_same_vocabulary_size_is_refused(tmp_path, shared):
    """Resuming on a corpus of other characters but the same vocabulary size is refused: every id would
    silently mean another character."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("abcd abcd dcba\n" * 300)
    b.write_text("wxyz wxyz zyxw\n" * 300)  # five characters each: same vocab size, other mapping
    train(make_cfg(tmp_path, shared, f"data.path={a}", "train.max_iters=10"))
    before = snapshot(tmp_path / "run")
    with pytest.raises(UserError, match="the data's tokenizer differs from the checkpoint's") as e:
        train(make_cfg(tmp_path, shared, f"data.path={b}", "train.max_iters=20", "resume=true"))
    one_line(e)
    assert snapshot(tmp_path / "run") == before


def test_refused_command_keeps_the_runs_hydra_record(tmp_path, shared, cli):
    """A refused command leaves the run's .hydra/ record as it was (Hydra writes it before our checks),
    so report.py labels the run by the overrides it ran with."""
    run = tmp_path / "run"
    args = ["model=debug", "train.max_iters=2", "train.eval_interval=1", "train.eval_iters=1", "train.batch_size=2",
            "device=cpu", "logger.wandb.mode=disabled", f"data.path={shared['corpus']}",
            f"data.cache_dir={shared['cache']}", f"hydra.run.dir={run}"]
    assert cli("train.py", *args).returncode == 0
    record = {p.name: p.read_bytes() for p in (run / ".hydra").iterdir()}
    assert b"train.max_iters=2" in record["overrides.yaml"]
    r = cli("train.py", *args, "train.lr=0.5")  # no resume=true: refused
    assert_one_line_error(r, "already holds a run")
    assert {p.name: p.read_bytes() for p in (run / ".hydra").iterdir()} == record


def test_run_that_died_before_its_first_checkpoint_is_taken_by_a_rerun(tmp_path, shared):
    """A run dir whose run died before its first checkpoint is taken by a rerun (its lines and config
    replaced); resume=true says it starts again without resume=true."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "val/loss": 9.9}) + "\n")
    (run / "config.yaml").write_text("old: config\n")
    with pytest.raises(UserError, match="starts again without resume=true") as e:
        train(make_cfg(tmp_path, shared, "resume=true"))
    one_line(e)
    assert train(make_cfg(tmp_path, shared, "train.max_iters=10"))["steps"] == 10
    assert 9.9 not in [m.get("val/loss") for m in read_metrics(run)]  # the dead run's lines are gone
    assert "old: config" not in (run / "config.yaml").read_text()


def test_resume_from_best_pt_is_one_line(tmp_path, shared):
    train(make_cfg(tmp_path, shared, "train.max_iters=10"))
    with pytest.raises(UserError, match="best.pt holds weights only") as e:
        train(make_cfg(tmp_path, shared, f"resume={tmp_path / 'run' / 'best.pt'}", "train.max_iters=20"))
    one_line(e)


def test_temp_files_of_killed_writes_are_removed_at_the_next_start(tmp_path, shared, dead_pid):
    """The next start removes the `.ckpt_*.tmp-PID` files and half-prepared cache dirs that killed
    processes left, and keeps those of a preparation still running."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    pid = dead_pid
    run.mkdir()
    stale_run = [run / f".ckpt_0000010.pt.tmp-{pid}", run / f".metrics.jsonl.tmp-{pid}"]
    for p in stale_run:
        p.write_bytes(b"half written")
    cache.mkdir()
    stale_cache = cache / f".text-char-0123.tmp-{pid}"
    (stale_cache / "x").mkdir(parents=True)
    live_cache = cache / f".text-char-4567.tmp-{os.getpid()}"  # a preparation still running: kept
    live_cache.mkdir()
    train(make_cfg(tmp_path, shared, f"data.cache_dir={cache}", "train.max_iters=2"))
    assert not any(p.exists() for p in stale_run) and not stale_cache.exists() and live_cache.exists()
    assert not list(run.glob(".*.tmp-*"))


# ----------------------------------------------------------------------------- silent wrong results

def test_cache_key_tells_apart_corpora_with_the_same_concatenated_bytes(tmp_path):
    """The cache key tells apart file sets whose bytes run together are the same (or renamed files): a
    hash of the joined bytes would give them one cache and one split."""
    texts = {"one": {"a.txt": "first document\nand its end\n", "b.txt": "second document\n"},
             "two": {"a.txt": "first document\n", "b.txt": "and its end\nsecond document\n"},  # same bytes joined
             "renamed": {"a.txt": "first document\nand its end\n", "c.txt": "second document\n"}}
    dirs = {}
    for name, files in texts.items():
        for fname, text in files.items():
            (tmp_path / name / fname).parent.mkdir(exist_ok=True)
            (tmp_path / name / fname).write_text(text)
        dirs[name] = compose_cfg("config", ["data=text", f"data.path={tmp_path / name}/*.txt",
                                            f"data.cache_dir={tmp_path / 'cache'}", "data.val_fraction=0.5"]).data
    keys = {name: cache_key(d, "file", d.path, sorted(map(str, (tmp_path / name).glob("*.txt"))))
            for name, d in dirs.items()}
    assert len(set(keys.values())) == 3
    one, two = TokenData(prepare(dirs["one"])), TokenData(prepare(dirs["two"]))
    assert one.dir != two.dir and one.meta["tokens"] != two.meta["tokens"]


def nan_checkpoint(tiny_run, tmp_path) -> Path:
    state = ck.load_checkpoint(tiny_run / "best.pt")
    next(t for t in state["model"].values() if t.is_floating_point()).view(-1)[0] = math.nan
    path = tmp_path / "nan.pt"
    torch.save(state, path)  # what an older version or a crafted file holds: train.py never writes one
    return path


def test_nan_weight_checkpoint_is_refused_for_sampling(tmp_path, tiny_run, sample_cfg):
    """A checkpoint with a NaN weight is refused in one line; loaded, greedy sampling would print blank
    lines with exit 0."""
    path = nan_checkpoint(tiny_run, tmp_path)
    with pytest.raises(UserError, match="holds non-finite weights") as e:
        sample(sample_cfg(f"ckpt={path}", "temperature=0", "max_new_tokens=5"))
    one_line(e)


def bpe_run(tmp_path, shared, path, name):
    out = tmp_path / name
    train(make_cfg(tmp_path, shared, f"data.path={path}", "data.tokenizer=bpe", "data.vocab_size=300",
                   f"out_dir={out}", "train.max_iters=2", "train.eval_interval=1", "train.eval_iters=1"))
    return out


@pytest.mark.slow  # trains two BPE models (a BPE tokenizer each)
def test_bpe_model_of_a_single_document_asks_for_a_prompt(tmp_path, shared, sample_cfg, caplog):
    """An empty prompt is refused for a BPE model of a single document: <|endoftext|> is a token a
    single-file corpus never has in its train split (appended once, at its end, in val), and starting
    from it gives byte noise. A model that saw it samples from it."""
    single = bpe_run(tmp_path, shared, shared["corpus"], "single")
    assert ck.load_checkpoint(single / "best.pt")["eot_in_train"] is False
    with pytest.raises(UserError, match="trained on a single document.*pass prompt=TEXT") as e:
        sample(sample_cfg(f"ckpt={single}", "prompt=''", "max_new_tokens=5"))
    one_line(e)
    assert sample(sample_cfg(f"ckpt={single}", "prompt=line", "max_new_tokens=5"))[0].startswith("line")
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"{i:02d}.txt").write_text(corpus_text(20 + i))
    several = bpe_run(tmp_path, shared, f"{docs}/*.txt", "several")
    assert ck.load_checkpoint(several / "best.pt")["eot_in_train"] is True
    assert len(sample(sample_cfg(f"ckpt={several}", "prompt=''", "max_new_tokens=5"))) == 1
    # a checkpoint from before this was recorded still samples, with a warning instead of silence
    old = ck.load_checkpoint(several / "best.pt")
    del old["eot_in_train"]
    torch.save(old, tmp_path / "old.pt")
    sample(sample_cfg(f"ckpt={tmp_path / 'old.pt'}", "prompt=''", "max_new_tokens=5"))
    assert "cannot tell its model ever saw" in caplog.text


def test_values_that_only_fail_together_are_refused(tmp_path, shared):
    """Values that only fail together are refused before anything is written: min_lr > lr (the "decay"
    would raise the lr), and weight_decay x lr >= 1."""
    with pytest.raises(UserError, match=r"train.min_lr=0.01 is above train.lr=0.001") as e:
        train(make_cfg(tmp_path, shared, "train.lr=1e-3", "train.min_lr=1e-2"))
    one_line(e)
    with pytest.raises(UserError, match=r"train.weight_decay=2000.0 times train.lr=0.001 is >= 1") as e:
        train(make_cfg(tmp_path, shared, "train.lr=1e-3", "train.weight_decay=2000"))
    one_line(e)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_glob_of_few_files_warns_with_the_actual_val_share(tmp_path, caplog):
    """A glob of few files warns with the val split's real share of the tokens (2 files at
    val_fraction=0.1 put 54 % of them in val), and the reused cache says it again."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text(corpus_text(120))
    (tmp_path / "d" / "b.txt").write_text(corpus_text(100))
    cfg = compose_cfg("config", ["data=text", f"data.path={tmp_path / 'd'}/*.txt",
                                 f"data.cache_dir={tmp_path / 'cache'}"]).data
    d = TokenData(prepare(cfg))
    share = d.meta["tokens"]["val"] / (d.meta["tokens"]["val"] + d.meta["tokens"]["train"])
    assert share > 0.3 and f"the val split holds {share:.1%} of the tokens, not data.val_fraction=0.1" in caplog.text
    caplog.clear()
    prepare(cfg)  # the reused cache says it again
    assert f"holds {share:.1%}" in caplog.text


@pytest.fixture
def umask():
    """umask(mask) sets the process umask for this test; the original comes back after it."""
    original = os.umask(0o022)
    os.umask(original)
    yield os.umask
    os.umask(original)


def other_bits(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode) & 0o007


def test_caches_and_checkpoints_are_no_more_readable_than_a_0640_source(tmp_path, shared, umask, monkeypatch):
    """Token files, checkpoints and their dirs are no more readable than the source: a file only its
    owner's group can read is never copied into world-readable token files, ~/.cache/huggingface Arrow
    files or checkpoints; and the umask is respected."""
    import datasets
    hf_default = tmp_path / "hf-default"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf_default)
    umask(0o022)
    secret = tmp_path / "private" / "diary.txt"
    secret.parent.mkdir()
    secret.write_text("the secret word is marmalade.\n" * 300)
    secret.chmod(0o640)
    cache = tmp_path / "cache"
    train(make_cfg(tmp_path, shared, f"data.path={secret}", f"data.cache_dir={cache}", "train.max_iters=10"))
    [prepared] = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert other_bits(prepared) == 0 and stat.S_IMODE(prepared.stat().st_mode) & 0o050 == 0o050
    for f in prepared.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o640, f
    run = tmp_path / "run"
    assert other_bits(run) == 0
    for f in list(run.glob("*.pt")):
        assert stat.S_IMODE(f.stat().st_mode) == 0o640, f
    leaked = [p for p in tmp_path.rglob("*.arrow")] + [p for p in cache.iterdir() if p.name.startswith(".")]
    assert not leaked and not hf_default.exists()  # datasets' copy lived in a private temp dir, now gone
    # the umask is respected too: 077 keeps a world-readable source's tokens to the owner
    umask(0o077)
    public = tmp_path / "public.txt"
    public.write_text(corpus_text())
    public.chmod(0o644)
    out = prepare(compose_cfg("config", ["data=text", f"data.path={public}", f"data.cache_dir={cache}"]).data)
    assert {stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == {0o600}
    assert stat.S_IMODE(out.stat().st_mode) == 0o700


# ----------------------------------------------------------------------------- hangs and lost output

def wait_for(predicate, proc, timeout=120):
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline
        time.sleep(0.02)


def test_ctrl_c_while_sampling_prints_what_was_generated(tiny_run, cli):
    """Ctrl-C during a long generation (max_new_tokens=<huge>) prints the text generated so far and one
    line, never a traceback, and exits 130."""
    proc = cli.popen("sample.py", f"ckpt={tiny_run}", "prompt=line", "max_new_tokens=3000000", "device=cpu",
                     preexec_fn=interruptible)
    first = proc.stderr.readline()  # the log line just before generation starts
    assert "sampling from" in first, first + proc.communicate()[1][-3000:]
    time.sleep(3)  # generating; nothing is printed yet
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "interrupted (Ctrl-C): the text above is what was generated until then"
    assert out.startswith("line") and out.endswith("---------------\n") and len(out) > 100, out[:200]


def test_wandb_online_without_a_key_is_one_line_before_anything_is_written(tmp_path, shared, monkeypatch):
    """W&B online without an API key is one line before the run dir exists (not W&B's 8-frame
    UsageError traceback after it); a key in the netrc file is found."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_IDENTITY_TOKEN_FILE", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    with pytest.raises(UserError, match=r"no W&B API key.*`wandb login`.*offline is the default") as e:
        train(make_cfg(tmp_path, shared, "logger.wandb.mode=online"))
    one_line(e)
    assert not (tmp_path / "run").exists()
    monkeypatch.setenv("WANDB_MODE", "online")  # the environment asking for it is caught the same way
    with pytest.raises(UserError, match="no W&B API key"):
        train(make_cfg(tmp_path, shared, "logger.wandb.mode=null"))
    # a key in the netrc file `wandb login` writes is found without the network (never going online here)
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    check_wandb_mode(compose_cfg("config", ["logger.wandb.mode=online"]).logger.wandb)


# ----------------------------------------------------------------------------- tracebacks and misleading messages

def broken_checkpoints(tiny_run, tmp_path):
    good = (tiny_run / "best.pt").read_bytes()
    state = ck.load_checkpoint(tiny_run / "best.pt")
    cases = {"empty": b"", "text": b"hello, I am a text file\n" * 20, "random": os.urandom(4096),
             "truncated": good[: len(good) // 2], "zip of junk": b"PK\x03\x04" + os.urandom(500)}
    files = {}
    import zipfile

    def with_pickle(payload: bytes) -> bytes:  # a real checkpoint archive, its pickle replaced (CRCs made anew)
        with zipfile.ZipFile(tiny_run / "best.pt") as src, zipfile.ZipFile(tmp_path / "bad_pickle.pt", "w") as dst:
            for item in src.infolist():
                dst.writestr(item, payload(len(src.read(item))) if item.filename.endswith("data.pkl") else src.read(item))
        return (tmp_path / "bad_pickle.pt").read_bytes()
    cases["damaged pickle"] = with_pickle(os.urandom)
    cases["pickle that pops an empty stack"] = with_pickle(lambda n: b"\x80\x02)\x85R.")  # IndexError in torch.load
    for name, data in cases.items():
        files[name] = tmp_path / f"{name.replace(' ', '_')}.pt"
        files[name].write_bytes(data)
    layouts = {"a list": [1, 2, 3], "no tokenizer": {k: v for k, v in state.items() if k != "tokenizer"},
               "weights not tensors": {**state, "model": {"wte.weight": [1.0, 2.0]}},
               "unknown model key": {**state, "model_config": {**state["model_config"], "n_wings": 2}},
               "damaged tokenizer": {**state, "tokenizer": {"kind": "bpe", "ranks": ["%%%"], "pattern": "x"}}}
    for name, obj in layouts.items():
        files[name] = tmp_path / f"{name.replace(' ', '_')}.pt"
        torch.save(obj, files[name])
    return files


def test_broken_checkpoints_are_one_line_and_never_called_untrusted(tmp_path, tiny_run, sample_cfg):
    """Every broken checkpoint is one line, and a corrupt (not pickled) file is never reported as an
    untrusted pickle; a text file, an unknown model key or a damaged tokenizer included."""
    for name, path in broken_checkpoints(tiny_run, tmp_path).items():
        with pytest.raises(UserError) as e:
            sample(sample_cfg(f"ckpt={path}", "max_new_tokens=3"))
        msg = one_line(e)
        assert "refusing" not in msg and "objects other than tensors" not in msg, (name, msg)


def test_resume_from_a_checkpoint_of_another_layout_is_one_line(tmp_path, shared):
    train(make_cfg(tmp_path, shared, "train.max_iters=10"))
    path = tmp_path / "run" / ck.step_name(10)
    state = ck.load_checkpoint(path)
    del state["rng"]
    torch.save(state, path)
    with pytest.raises(UserError, match="it has no rng") as e:
        train(make_cfg(tmp_path, shared, "train.max_iters=20", "resume=true"))
    one_line(e)
    state = ck.load_checkpoint(tmp_path / "run" / "best.pt")
    torch.save({**state, "optimizer": {"state": {}, "param_groups": []}, "sampler": state["model"]["wte.weight"]
                if "wte.weight" in state["model"] else torch.zeros(3), "rng": {}, "best_val_loss": 1.0}, path)
    with pytest.raises(UserError, match="its optimizer or random state does not fit this run") as e:
        train(make_cfg(tmp_path, shared, "train.max_iters=20", "resume=true"))
    one_line(e)


def cut_short(path: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 4])


def change_a_byte(path: Path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


DAMAGE = {  # what a kill, a full disk or a hand can leave of a prepared dataset
    "train.bin cut short": lambda d: cut_short(d / "train.bin"),
    "a byte of val.bin changed": lambda d: change_a_byte(d / "val.bin"),
    "train.bin deleted": lambda d: (d / "train.bin").unlink(),
    "meta.json cut short": lambda d: (d / "meta.json").write_text('{"tokenizer": {"kind": "char", "ch'),
    "meta.json deleted": lambda d: (d / "meta.json").unlink(),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_prepared_data_is_found_and_prepared_again(tmp_path, damage, caplog):
    """Damaged prepared data is found and prepared again, in one log line: a train.bin cut short
    (meta.json: 180,000 tokens, 50,000 left) or with changed bytes is never used as it is, and a cache
    dir without its meta.json is no OSError traceback."""
    (tmp_path / "c.txt").write_text(corpus_text())
    cfg = compose_cfg("config", ["data=text", f"data.path={tmp_path / 'c.txt'}", f"data.cache_dir={tmp_path}/cache"])
    out = prepare(cfg.data)
    whole = {f: (out / f).read_bytes() for f in ("train.bin", "val.bin")}
    DAMAGE[damage](out)
    assert prepare(cfg.data) == out
    [line] = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert "\n" not in line and line.endswith("preparing it again") and str(out) in line, line
    assert {f: (out / f).read_bytes() for f in whole} == whole
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [out.name]  # the damaged copy is gone


def test_a_token_file_cut_short_is_one_line_when_opened(tmp_path):
    """TokenData checks the lengths too (what data/prepare.py checked can be cut afterwards)."""
    (tmp_path / "c.txt").write_text(corpus_text())
    out = prepare(compose_cfg("config", ["data=text", f"data.path={tmp_path / 'c.txt'}",
                                         f"data.cache_dir={tmp_path}/cache"]).data)
    cut_short(out / "train.bin")
    with pytest.raises(UserError, match=r"is damaged \(train.bin holds [\d,]+ tokens, meta.json says [\d,]+\)") as e:
        TokenData(out)
    one_line(e)


def test_last_good_checkpoint_names_a_good_one(tmp_path, shared, monkeypatch):
    """A diverged run names the last checkpoint whose val loss is finite, not the newest on disk."""
    real_estimate, calls = train_module.estimate_loss, []

    def estimate(*args):  # evaluations at steps 0, 10, 20, ...: the third is step 20's
        calls.append(1)
        return {"train": math.nan, "val": math.nan} if len(calls) == 3 else real_estimate(*args)
    monkeypatch.setattr(train_module, "estimate_loss", estimate)
    poison_training_forward(monkeypatch, from_call=24)  # step 23: the run diverges (lab/stability.py)
    result = train(make_cfg(tmp_path, shared, "train.max_iters=40", "train.keep_ckpts=5"))
    assert result["diverged"] and result["diverged_step"] == 24
    assert re.search(r"at step 24: the loss or gradients were not finite .*last good checkpoint: \S*ckpt_0000010.pt;",
                     diverged_line(result)) and "\n" not in diverged_line(result)
    assert (tmp_path / "run" / ck.step_name(20)).exists()  # the newer one exists, but its val loss is NaN


def poison_training_forward(monkeypatch, from_call: int):
    """Training forward passes from the n-th on return a NaN loss (what a bad model value gives)."""
    real_forward, calls = model_module.GPT.forward, {"n": 0}

    def poisoned(self, idx, targets=None, **kw):
        out = real_forward(self, idx, targets, **kw)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] >= from_call:
                return out[0], out[1] * math.nan
        return out
    monkeypatch.setattr(model_module.GPT, "forward", poisoned)


def test_nan_from_a_bad_model_value_is_not_blamed_on_the_learning_rate(tmp_path, shared, monkeypatch):
    """A NaN the freshly initialised model gives (e.g. model.rope_base=0: 1/0**x makes the rotary angles
    infinite) points at the model.* values, not `lower train.lr`: the learning rate has not acted yet.
    After some updates a NaN is a divergence that names the lr."""
    poison_training_forward(monkeypatch, from_call=1)
    with pytest.raises(UserError, match=r"freshly initialised model already gives it, so the learning rate is "
                                        r"not the cause: check the model.\* values") as e:
        train(make_cfg(tmp_path, shared, "train.skip_nonfinite=2"))
    assert "lower train.lr" not in one_line(e)
    monkeypatch.undo()
    poison_training_forward(monkeypatch, from_call=6)  # after 5 updates the step size is the suspect: a divergence
    result = train(make_cfg(tmp_path / "b", shared))
    assert result["diverged_step"] == 6 and re.search(r"at step 6: .*lower train.lr \(now 0.002\)", diverged_line(result))


@pytest.mark.parametrize("sig,status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_a_library_turned_into_an_error_is_still_the_signal(sig, status, capsys):
    """A signal landing inside a library that catches everything and raises its own error (datasets:
    "An error occurred while generating the dataset"), which our code then words as a UserError: the
    command ends as interrupted, 143 or 130, not as `error: could not load`."""
    from lab.cli import cli

    @cli
    def command():
        try:
            os.kill(os.getpid(), getattr(signal, sig))
            time.sleep(5)
        except BaseException as e:  # the library's blanket handler
            raise UserError("could not load big.txt split 'train': An error occurred while generating") from e

    with pytest.raises(SystemExit) as e:
        command()
    assert e.value.code == status
    assert capsys.readouterr().err.strip() == f"interrupted ({'Ctrl-C' if sig == 'SIGINT' else 'SIGTERM'})"


@pytest.mark.parametrize("script,sig", [("tools/prepare.py", "SIGINT"), ("train.py", "SIGINT"), ("tools/prepare.py", "SIGTERM")])
def test_ctrl_c_during_data_preparation_is_one_line_and_leaves_nothing(tmp_path, script, sig, cli):
    """Ctrl-C, and SIGTERM likewise, during data preparation is one line and leaves no temporary dir in
    the cache."""
    # one tokenizing process: with data.num_proc > 1 a Ctrl-C can leave datasets' worker pool
    # waiting for killed workers (README, Reliability: not guaranteed)
    big = tmp_path / "big.txt"
    big.write_text(corpus_text(1000) * 300)  # ~18 MB: seconds of tokenizing
    cache = tmp_path / "cache"
    proc = cli.popen(script, "data=text", f"data.path={big}", f"data.cache_dir={cache}", "data.num_proc=1",
                     "model=debug", "device=cpu", "logger.wandb.mode=disabled", f"hydra.run.dir={tmp_path / 'run'}",
                     start_new_session=True, preexec_fn=interruptible)
    wait_for(lambda: cache.is_dir() and any(cache.iterdir()), proc)
    time.sleep(1.5)
    os.killpg(proc.pid, getattr(signal, sig))  # SIGINT: what Ctrl-C in a terminal does, to the whole process group
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == {"SIGINT": 130, "SIGTERM": 143}[sig] and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == f"interrupted ({'Ctrl-C' if sig == 'SIGINT' else 'SIGTERM'})"
    assert list(cache.iterdir()) == []  # no half-written dataset, no temporary dir


def test_out_of_memory_batch_is_one_line(tmp_path, shared, monkeypatch):
    """A batch too large for memory is one line, from the estimate and from the allocator's own failure
    (never a RuntimeError traceback)."""
    with pytest.raises(UserError, match=r"need at least .* GiB .*train.batch_size=1000000000000") as e:
        train(make_cfg(tmp_path, shared, "train.batch_size=1000000000000"))
    one_line(e)
    assert "the tokenizer's" in str(e.value) and "model.vocab_size" not in str(e.value)  # not a key the user set
    with pytest.raises(UserError, match=r"need at least .* GiB .*data.vocab_size=300") as e:  # the key they did set
        train(make_cfg(tmp_path, shared, "data.tokenizer=bpe", "data.vocab_size=300", "train.batch_size=1000000000000"))
    assert "model.vocab_size" not in str(e.value)
    # past the estimate, the allocator's own failure (a real one: 8 TB of batch indices) is one line too
    monkeypatch.setattr(train_module, "check_memory", lambda *a, **k: None)
    with pytest.raises(UserError, match=r"out of memory \(.*can't allocate memory.*batch_size=1000000000000") as e:
        train(make_cfg(tmp_path, shared, "train.batch_size=1000000000000"))
    one_line(e)


def without_root_powers():
    """A prefix that runs a command without the capabilities that let root read any file."""
    if os.geteuid() != 0:
        return ()
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: a 000 file is readable")
    return ("setpriv", "--inh-caps=-all", "--bounding-set=-all")


def test_unreadable_files_are_one_line_errors(tmp_path, tiny_run, shared, cli):
    prefix = without_root_powers()
    locked = {}
    for name, src in (("corpus.txt", shared["corpus"]), ("best.pt", tiny_run / "best.pt"),
                      ("prompt.txt", None), ("run/metrics.jsonl", tiny_run / "metrics.jsonl")):
        dest = tmp_path / "locked" / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(src.read_bytes() if src else b"hello")
        dest.chmod(0)
        locked[name] = dest
    r = cli("train.py", f"data.path={locked['corpus.txt']}", f"data.cache_dir={tmp_path / 'cache'}",
                f"hydra.run.dir={tmp_path / 'run'}", "logger.wandb.mode=disabled", prefix=prefix)
    assert_one_line_error(r, "Permission denied")
    r = cli("sample.py", f"ckpt={locked['best.pt']}", "device=cpu", prefix=prefix)
    assert_one_line_error(r, "Permission denied")
    r = cli("sample.py", f"ckpt={tiny_run}", f"prompt_file={locked['prompt.txt']}", "device=cpu", prefix=prefix)
    assert_one_line_error(r, "Permission denied")
    r = cli("tools/report.py", str(tmp_path / "locked" / "run"), "--out", str(tmp_path / "out"), prefix=prefix)
    assert_one_line_error(r, "Permission denied")


# ----------------------------------------------------------------------------- every key of every schema

HUGE = {int: 10**12, float: 1e30}
# in range, yet too big for any machine: refused by the memory estimate or the allocator, in one line
HUGE_MUST_FAIL = {"train.batch_size", "train.probe_batch_size", "train.grad_accum", "model.vocab_size",
                  "model.block_size", "model.n_layer", "model.n_embd", "model.n_head", "model.n_kv_head",
                  "model.d_ff", "num_samples", "bench.vocab_size"}
# every command's config (configs/NAME.yaml) and the function its entry point calls first
ENTRY_POINTS = {"config": "train:train", "sample": "sample:sample", "bench": "tools.bench:bench",
                "cost": "tools.cost:cost", "bench_sample": "tools.bench_sample:bench_sample",
                "visualize": "tools.visualize:visualize", "export": "tools.export:export",
                "bench_attention": "tools.bench_attention:bench_attention", "eval_stream": "tools.eval_stream:eval_stream",
                "eval_lengths": "tools.eval_lengths:eval_lengths", "ablate": "tools.ablate:ablate",
                "lens": "tools.lens:lens",
                "patch": "tools.patch:patch", "needle": "tools.needle:needle"}


def entry(name):
    module, fn = ENTRY_POINTS[name].split(":")
    return getattr(__import__(module, fromlist=[fn]), fn)


def schema_keys():
    """(command, dotted key, field type, rule) of every field of every command's schema, nested
    schemas included, read from the dataclasses: a key added anywhere is enumerated without touching
    this test. A command's keys that another command already covers (bench's model, data, train) are
    listed once."""
    from omegaconf import OmegaConf

    seen = set()
    for name in ENTRY_POINTS:
        entry(name)  # importing the command registers its schema
    for name in ENTRY_POINTS:
        schema = OmegaConf.get_type(compose_cfg(name, ["model=debug"] if name in ("bench", "cost", "bench_sample") else []))

        def walk(dc, prefix):
            hints = typing.get_type_hints(dc)
            for f in dataclasses.fields(dc):
                t = hints[f.name]
                if typing.get_origin(t) is typing.Union:
                    t = next(a for a in typing.get_args(t) if a is not type(None))
                if typing.get_origin(t) in (list, typing.List):
                    t = typing.get_args(t)[0]
                if dataclasses.is_dataclass(t):
                    yield from walk(t, f"{prefix}{f.name}.")
                elif (t, f"{prefix}{f.name}") not in seen:
                    seen.add((t, f"{prefix}{f.name}"))
                    yield name, f"{prefix}{f.name}", t, getattr(dc, "RULES", {}).get(f.name)
        yield from walk(schema, "")


def test_every_command_is_enumerated():
    """A new command's schema must be added to ENTRY_POINTS (its bad values are then checked)."""
    from hydra.core.config_store import ConfigStore

    import tools  # noqa: F401
    for module in REPO.joinpath("tools").glob("*.py"):  # every command there registers its schema on import
        __import__(f"tools.{module.stem}")
    stored = {k.removesuffix(".yaml") for k in ConfigStore.instance().repo if k.startswith("base_")}
    assert stored == {"base_" + n for n in ENTRY_POINTS}, stored


def bad_cases():
    cases = []
    for name, key, typ, rule in schema_keys():
        if typ not in (int, float) and not isinstance(rule, OneOf):
            continue  # free text (paths, names) and flags
        if rule is None:  # a numeric key without a declared rule fails here, by name
            cases.append(pytest.param(name, key, typ, "undeclared", None, id=f"{name}:{key}=undeclared"))
            continue
        values = ("bogus",) if isinstance(rule, OneOf) else \
            (0, -1, HUGE[typ], math.nan, math.inf, "abc") + ((1.5,) if typ is int else ())
        for value in values:
            if typ in (int, float) and (value == "abc" or (typ is int and not isinstance(value, int))):
                kind = "schema"  # Hydra's schema refuses it at composition
            elif not rule.contains(value):
                kind = "rule"
            elif value == HUGE.get(typ) and key in HUGE_MUST_FAIL:
                kind = "resource"
            else:
                continue  # legal (a huge max_iters is a long run, not an error)
            cases.append(pytest.param(name, key, typ, kind, value, id=f"{name}:{key}={value}"))
    return cases


def override(key, value, listed=False):
    text = {math.nan: "nan", math.inf: "inf"}.get(value, str(value)) if not isinstance(value, str) else value
    return f"{key}=[{text}]" if listed else f"{key}={text}"


@pytest.fixture(scope="module")
def enum_dirs(tmp_path_factory, shared, tiny_run):
    return {"tmp": tmp_path_factory.mktemp("enum"), "ckpt": tiny_run, "composed": {}}


@pytest.mark.parametrize("name,key,typ,kind,value", bad_cases())
def test_every_config_key_refuses_its_bad_values_in_one_line(name, key, typ, kind, value, shared, enum_dirs):
    """Every command's every numeric key (0, negative, huge, nan, inf, wrong type) and every named
    choice (an unknown name): one line naming the key, before any work. A value of the wrong type goes
    through Hydra's composition (its schema refuses it); the others are set on a copy of the command's
    composed config (composing costs ~0.1 s a case; Hydra's parsing of nan, inf and 1e+30 on the
    command line is checked through the real CLI below)."""
    assert kind != "undeclared", f"{key} ({name}) has no rule: add it to its schema's RULES table"
    tmp = enum_dirs["tmp"] / name  # every case is refused before anything is written there
    short = ["train.max_iters=1", "train.eval_interval=1", "train.eval_iters=1"]
    base = {"config": TINY + short + [f"out_dir={tmp / 'run'}", f"data.cache_dir={shared['cache']}",
                                       f"data.path={shared['corpus']}"],
            "sample": ["device=cpu", f"ckpt={enum_dirs['ckpt']}", "max_new_tokens=2"],
            "bench": ["model=debug", "device=cpu", "bench.iters=1", "bench.warmup=0"],
            "cost": ["model=debug", "plot=null", "format=json"],
            "bench_sample": ["model=debug", "tokens=2", "repeats=1", "batch_sizes=[1]", "compile=[false]",
                             "recompute=false"],
            "visualize": [f"ckpt={enum_dirs['ckpt']}", "prompt=line", f"out={tmp / 'maps'}"],
            "export": [f"ckpt={enum_dirs['ckpt']}", f"out={tmp / 'hf'}"],
            "bench_attention": ["lengths=[8]", "paths=[sdpa]", "repeats=1", "out=null"],
            "eval_stream": [f"ckpt={enum_dirs['ckpt']}", "out=null"],
            "eval_lengths": [f"ckpt={enum_dirs['ckpt']}", "out=null"],
            "ablate": [f"ckpt={enum_dirs['ckpt']}", "out=null", "batches=1", "batch_size=1"],
            "lens": [f"ckpt={enum_dirs['ckpt']}", "out=null", "batches=1", "batch_size=1"],
            "patch": [f"ckpt={enum_dirs['ckpt']}", "out=null", "n=1", "span=4"],
            "needle": [f"ckpt={enum_dirs['ckpt']}", "out=null"]}[name]
    listed = key.rsplit(".", 1)[-1] in ("batch_sizes", "layouts", "kv_dtypes", "transformers", "ratio_tokens", "lengths", "paths", "policies", "layer_kinds", "pairs", "distances")  # a list: one bad element
    if kind == "schema":
        with pytest.raises((HydraException, OmegaConfBaseException)) as e:
            compose_cfg(name, base + [override(key, value, listed)])
        line = hydra_error_line(e.value)  # what run_app prints after `error: `
        assert "\n" not in line and key in line, line
        return
    composed = enum_dirs["composed"]
    if name not in composed:
        composed[name] = compose_cfg(name, base)
    cfg = copy.deepcopy(composed[name])
    OmegaConf.update(cfg, key, [value] if listed else value, merge=False)
    with pytest.raises(UserError) as e:
        entry(name)(cfg)
    assert key in one_line(e)


TRAINING = ["device=cpu", "logger.wandb.mode=disabled"]


@pytest.mark.parametrize("script,args,needle", [
    ("train.py", ["train.lr=nan", *TRAINING], "error: train.lr=nan must be a finite number"),
    ("train.py", ["train.batch_size=abc", *TRAINING], "error: Error merging override train.batch_size=abc"),
    ("train.py", ["train.min_lr=1", *TRAINING], "error: train.min_lr=1.0 is above train.lr"),
    ("sample.py", ["temperature=inf", "device=cpu"], "error: temperature=inf must be"),
    ("tools/bench.py", ["train.batch_size=0", "model=debug", *TRAINING], "error: train.batch_size=0 must be an integer >= 1"),
    ("tools/prepare.py", ["data.max_tokens=-5"], "error: data.max_tokens=-5.0 must be"),
])
def test_bad_values_through_the_real_cli_are_one_line(tmp_path, script, args, needle, cli):
    """A few of the cases above end to end: `error: ...` as the one last line, status 1, no traceback,
    and nothing written: no run dir (train.py removes the run dir Hydra made, with its train.log)."""
    r = cli(script, *args, f"hydra.run.dir={tmp_path / 'run'}")
    assert_one_line_error(r, needle)
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- interruptions, changed data, values at their limits

def test_sigterm_while_sampling_prints_what_was_generated(tiny_run, tmp_path, cli):
    """SIGTERM during sampling (`timeout 6 python sample.py max_new_tokens=3000000 > out.txt`) leaves the
    text generated so far in the file and one line on stderr, exit 143."""
    with open(tmp_path / "out.txt", "w") as out:
        proc = cli.popen("sample.py", f"ckpt={tiny_run}", "prompt=line", "max_new_tokens=3000000", "device=cpu",
                         stdout=out)
        first = proc.stderr.readline()  # the log line just before generation starts
        assert "sampling from" in first, first + proc.communicate()[1][-3000:]
        time.sleep(3)
        proc.send_signal(signal.SIGTERM)  # what `timeout`, `kill` and job schedulers send
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == "interrupted (SIGTERM): the text above is what was generated until then"
    text = (tmp_path / "out.txt").read_text()
    assert text.startswith("line") and text.endswith("---------------\n") and len(text) > 100, text[:200]


def test_resume_with_another_text_of_the_same_characters_is_refused(tmp_path, shared):
    """Resuming on another text of the same characters is refused (the tokens are compared, not the
    tokenizer alone); the same text at another path is the same data."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(corpus_text())
    b.write_text("".join(reversed(corpus_text().splitlines(keepends=True))))  # the same characters
    train(make_cfg(tmp_path, shared, f"data.path={a}", "train.max_iters=10"))
    before = snapshot(tmp_path / "run")
    with pytest.raises(UserError, match="holds other tokens than the checkpoint was trained on") as e:
        train(make_cfg(tmp_path, shared, f"data.path={b}", "train.max_iters=20", "resume=true"))
    one_line(e)
    assert snapshot(tmp_path / "run") == before
    moved = tmp_path / "moved" / "a.txt"  # the same text elsewhere is the same data
    moved.parent.mkdir()
    shutil.copy(a, moved)
    assert train(make_cfg(tmp_path, shared, f"data.path={moved}", "train.max_iters=20", "resume=true"))["steps"] == 20


def test_resume_with_another_split_seed_or_data_seed_is_refused(tmp_path, shared):
    """A multi-file run resumed with another data.split_seed (documents moved between train and val)
    or another train.data_seed (other evaluation windows) is refused in one line."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        (docs / f"{i:02d}.txt").write_text(corpus_text(20 + i))
    data = [f"data.path={docs}/*.txt", "data.val_fraction=0.25"]
    train(make_cfg(tmp_path, shared, *data, "train.max_iters=10"))
    before = snapshot(tmp_path / "run")
    with pytest.raises(UserError, match=r"holds other tokens .*data.split_seed") as e:
        train(make_cfg(tmp_path, shared, *data, "data.split_seed=7", "train.max_iters=20", "resume=true"))
    one_line(e)
    with pytest.raises(UserError, match=r"the data seed \(train.data_seed, else seed\) is 5 here but 1337") as e:
        train(make_cfg(tmp_path, shared, *data, "train.data_seed=5", "train.max_iters=20", "resume=true"))
    one_line(e)
    assert snapshot(tmp_path / "run") == before


def record_bytes(path: Path, name_end: str) -> tuple:
    """(offset, length) of the stored bytes of a zip record whose name ends with name_end."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(name_end))
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def test_a_checkpoint_with_changed_bytes_is_refused(tmp_path, tiny_run, sample_cfg):
    """64 changed bytes inside a weight fail the record's checksum: the checkpoint is refused in one line,
    never sampled from."""
    good = tiny_run / "best.pt"
    with zipfile.ZipFile(good) as z:  # the largest tensor record
        largest = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size).filename
    start, size = record_bytes(good, largest)
    data = bytearray(good.read_bytes())
    data[start + size // 2:start + size // 2 + 64] = bytes(b ^ 0x5A for b in data[start + size // 2:start + size // 2 + 64])
    bad = tmp_path / "best.pt"
    bad.write_bytes(bytes(data))
    with pytest.raises(UserError, match=rf"checkpoint {bad} is damaged: its record \S+ does not match its checksum") as e:
        sample(sample_cfg(f"ckpt={bad}", "max_new_tokens=3"))
    one_line(e)
    assert ck.load_checkpoint(good)["step"] == 10  # the untouched one loads


def test_lr_decay_that_ends_before_the_warmup_is_refused(tmp_path, shared):
    """An lr decay that ends before the warmup is refused (the lr would jump from its peak to min_lr when
    the warmup ends)."""
    with pytest.raises(UserError, match=r"train.lr_decay_iters=50 is not past train.warmup_iters=100") as e:
        train(make_cfg(tmp_path, shared, "train.warmup_iters=100", "train.lr_decay_iters=50"))
    one_line(e)
    assert not (tmp_path / "run").exists()


def test_sampling_at_extreme_temperatures_and_top_p(tiny_run, sample_cfg):
    """temperature=1e-40 and top_p=1e-300 (0 in float32) sample as greedy decoding, with no `probability
    tensor contains inf/nan` or `invalid multinomial distribution` error; temperature=1e300 still gives
    text."""
    base = [f"ckpt={tiny_run}", "prompt=line", "max_new_tokens=20"]
    greedy = sample(sample_cfg(*base, "temperature=0"))
    assert sample(sample_cfg(*base, "temperature=1e-40")) == greedy
    assert sample(sample_cfg(*base, "top_p=1e-300")) == greedy
    assert len(sample(sample_cfg(*base, "temperature=1e300"))[0]) > len("line")  # uniform, still text


def test_bench_without_warm_up_times_its_steps():
    """bench.warmup=0 times its steps (no ZeroDivisionError)."""
    from tools.bench import bench
    r = bench(compose_cfg("bench", ["model=debug", "device=cpu", "bench.warmup=0", "bench.iters=1",
                                    "train.batch_size=2"]))
    assert r["attnlab"]["ms_per_iter"] > 0


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path, shared, caplog):
    """Resuming a finished run says there is nothing to do, returns its val loss (not `done: val loss
    nan`) and leaves its record and plots as they were."""
    first = train(make_cfg(tmp_path, shared, "train.max_iters=10"))
    before = snapshot(tmp_path / "run")
    again = train(make_cfg(tmp_path, shared, "train.max_iters=10", "resume=true"))
    assert again["steps"] == 10 and again["val_loss"] == first["val_loss"] is not None
    assert "nothing to do: the run in" in caplog.text and "pass train.max_iters > 10 to train on" in caplog.text
    assert snapshot(tmp_path / "run") == before


def test_muon_settings_under_adamw_are_warned_recorded_and_the_run_goes_on(tmp_path, shared, caplog):
    """train.muon_* under train.optimizer=adamw is neither silently ignored nor refused (a refusal would
    kill a sweep's AdamW arm): one warning line at the start, the run's record lists it, and the run
    trains as AdamW alone, the same as without the setting."""
    with caplog.at_level(logging.WARNING, logger="attnlab"):
        with_lr = train(make_cfg(tmp_path, shared, "train.muon_lr=0.01", "train.max_iters=4"))
    line = "train.muon_lr=0.01 has no effect unless train.optimizer=muon: ignored (its default is None)"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING].count(line) == 1
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    assert info["ignored_settings"] == [line]
    assert line in (tmp_path / "run" / "train.log").read_text()
    without = train(make_cfg(tmp_path, shared, "train.max_iters=4", f"out_dir={tmp_path / 'plain'}"))
    assert with_lr["val_loss"] == without["val_loss"]
    assert json.loads((tmp_path / "plain" / "run_info.json").read_text())["ignored_settings"] == []


NO_EFFECT = [  # (command, overrides that idle the key, the key set anyway): one for each NEEDS entry
    *[("config", [], f"train.{k}") for k in ("muon_lr=0.01", "muon_weight_decay=0", "muon_momentum=0.9",
                                              "muon_momentum_warmup=10", "muon_adjust_lr=original", "muon_ns_steps=3",
                                              "muon_split_qkv=true", "muon_ns_dtype=float32")],
    ("config", ["train.optimizer=muon"], "train.muon_momentum_start=0.5"),
    ("config", [], "train.cooldown_frac=0.2"),
    ("config", ["train.log_attn_interval=0"], "train.probe_batch_size=8"),
    ("config", ["train.log_attn_interval=0"], "train.collapse_entropy=0.2"),
    ("config", ["model.attn.kind=gdn"], "model.attn.softcap=30"),
    ("config", ["model.pos=learned"], "model.rope_base=500"),
    ("config", [], "model.attn.qk_norm_type=l2"),
    ("config", [], "model.attn.qk_norm_gain=head"),
    ("config", [], "model.attn.block=64"),
    ("config", [], "model.attn.window_pattern=LG"),
    ("config", ["model.attn.kind=linear"], "model.attn.impl=reference"),
    ("config", ["model.attn.kind=linear"], "model.attn.scale=none"),
    ("config", ["model.attn.kind=linear"], "model.attn.window=8"),
    ("config", ["model.attn.kind=linear"], "model.attn.sink=learned"),
    ("config", [], "model.attn.kv_lora_rank=16"),
    ("config", ["model.attn.kind=mla"], "model.attn.qk_norm=true"),
    ("config", ["model.attn.kind=gdn"], "model.attn.gate=head"),
    ("config", [], "model.attn.state_dim=16"),
    ("config", ["model.attn.layer_kinds=[gdn,softmax]"], "model.attn.kind=linear"),
    ("config", [], "model.attn.q_lora_rank=16"),
    ("config", ["model.attn.kind=gdn"], "model.attn.select=moba"),
    ("config", [], "model.attn.select_block=32"),
    ("config", [], "model.attn.select_topk=2"),
    *[("config", ["model.attn.select=oracle"], f"model.attn.{k}") for k in ("indexer_heads=2", "indexer_dim=8",
                                                                          "indexer_kl=0.5")],
    ("config", [], "model.attn.rope_head_dim=8"),
    ("config", ["model.pos=alibi"], "model.rope_scaling=yarn"),
    ("config", [], "model.rope_scaling_factor=4"),
    ("config", ["model.mlp=none"], "model.d_ff=128"),
    ("config", [], "data.vocab_size=512"),
    ("config", [], "data.pairs=[16]"),
    ("config", [], "data.examples=1000"),
    ("config", ["data=mqar"], "data.bos=true"),
    ("config", [], "data.hub_config=sample-10BT"),
    ("config", ["data.max_tokens=1000"], "data.streaming=true"),
    *[("config", ["data=mqar"], k) for k in ("data.path=t.txt", "data.url=https://example.com/t.txt", "data.hub=a/b",
                                             "data.text_column=body", "data.val_split=validation",
                                             "data.max_tokens=1000", "data.num_proc=2", "data.cache_dir=/tmp/c",
                                             "data.val_fraction=0.2", "data.tokenizer=bpe")],
    ("sample", ["temperature=0"], "top_k=5"),
    ("sample", ["temperature=0"], "top_p=0.5"),
    ("sample", ["temperature=0"], "seed=7"),
    ("sample", ["kv_cache=false"], "kv_dtype=bfloat16"),
    ("sample", ["kv_cache=false"], "compile=true"),
    ("sample", ["kv_cache=false"], "kv_sinks=4"),
    ("sample", ["prompt_file=p.txt"], "prompt=hi"),
    ("visualize", ["prompt_file=p.txt"], "prompt=hi"),
    *[("patch", ["clean=ab", "corrupted=ba"], k) for k in ("text=t.txt", "n=4", "span=8", "seed=3")],
    ("cost", ["model=debug", "model.vocab_size=100"], "vocab_size=50"),
    ("bench_sample", ["model=debug", "model.vocab_size=100"], "vocab_size=50"),
    ("bench", ["model=debug"], "bench.rounds=3"),
    ("bench_attention", ["paths=[sdpa]"], "window=64"),
    ("bench_attention", ["paths=[sdpa]"], "block=64"),
    ("bench_attention", ["paths=[sdpa]"], "select_block=32"),
    ("bench_attention", ["paths=[sdpa]"], "select_topk=2"),
]


@pytest.mark.parametrize("name,idle,setting", NO_EFFECT, ids=[f"{n}:{s}" for n, _, s in NO_EFFECT])
def test_a_setting_without_effect_is_warned_in_one_line_and_returned(name, idle, setting, caplog):
    """Every option is used or said to be ignored: set where it cannot act (muon_* under AdamW, top_k
    when greedy, a prompt beside prompt_file, ...), it is one warning line naming it and what would
    make it act, and check_values returns that line (train.py records it in run_info.json); the
    command goes on, since in a sweep another arm may use it."""
    entry(name)  # registers the command's schema
    key = setting.split("=")[0]
    assert check_values(compose_cfg(name, idle)) == []  # idle alone says nothing
    with caplog.at_level(logging.WARNING, logger="attnlab"):
        ignored = check_values(compose_cfg(name, [*idle, setting]))
    assert len(ignored) == 1 and re.match(rf"^{key}=\S+ has no effect unless .*: ignored \(its default is ", ignored[0])
    assert [r.getMessage() for r in caplog.records] == ignored


def test_every_key_that_can_be_idle_has_a_case():
    """A key added to any schema's NEEDS table must get a row in NO_EFFECT."""
    declared = set()
    for name in ENTRY_POINTS:
        entry(name)
        cfg = compose_cfg(name, ["model=debug"] if name in ("bench", "cost", "bench_sample") else [])
        for _, schema, prefix in schema_nodes(cfg):
            declared |= {f"{prefix}.{k}" if prefix else k for k in getattr(schema, "NEEDS", {})}
    assert declared == {setting.split("=")[0] for _, _, setting in NO_EFFECT}


@pytest.mark.parametrize("args", [["train.lr=nan"], ["data.path=no-such-file.txt"], ["model.block_size=100000"]],
                         ids=["bad value", "missing data", "refused after the data"])
def test_a_refused_training_writes_nothing(tmp_path, shared, args, cli):
    """A refused train.py leaves nothing in its working directory: no outputs/runs/<time>/train.log
    (Hydra makes the dir and opens the log before any check)."""
    r = cli("train.py", "model=debug", "device=cpu", "logger.wandb.mode=disabled", "data=text",
            f"data.path={shared['corpus']}", f"data.cache_dir={shared['cache']}", *args, cwd=tmp_path)
    assert_one_line_error(r, args[0].split("=")[0])
    assert list(tmp_path.iterdir()) == []  # no outputs/, no run dir, no train.log


def test_cost_at_extreme_lengths_gives_a_result_and_a_plot(tmp_path):
    """cost.py gives the exact result and draws its plot at any length, 10^12 tokens and batch 10^6
    included (values past int64): a float N meeting a Fraction, or int64 overflow in matplotlib, would
    fail the plot."""
    from tools.cost import cost
    r = cost(compose_cfg("cost", ["model=debug", "seq_len=1000000000000", "batch_size=1000000", "format=json",
                                  f"plot={tmp_path / 'cost.png'}"]))
    assert r["memory_bytes"]["attn_weights_per_layer"] == 10**6 * 2 * 10**24 * 2  # B * heads * N^2 * 2 bytes
    assert (tmp_path / "cost.png").stat().st_size > 10_000


def test_an_interrupt_lost_in_a_clean_up_callback_is_raised_again(monkeypatch):
    """A Ctrl-C or SIGTERM that lands while Python runs a weakref's callback (often, while `datasets`
    tokenizes) is raised again, not printed as "Exception ignored" with the command going on to the end."""
    import sys
    import weakref
    from lab.cli import redeliver_lost_interrupt
    monkeypatch.setattr(sys, "unraisablehook", redeliver_lost_interrupt)
    previous = signal.getsignal(signal.SIGALRM)

    def interrupted_callback(ref):
        raise KeyboardInterrupt  # what a signal handler raises when it runs inside the callback

    class Thing:
        pass
    thing = Thing()
    ref = weakref.ref(thing, interrupted_callback)  # noqa: F841 (the callback needs the ref alive)
    try:
        with pytest.raises(KeyboardInterrupt):
            del thing  # the callback's exception is dropped by Python, then raised again
            time.sleep(5)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
