"""Every path a command writes to, given a place it cannot write: one line naming the key, before any
work, and nothing changed there. The table below is every command that writes files (sample.py,
bench.py and bench_sample.py print only) times every kind of bad place: an existing file, a symbolic
link to nothing (or, for a file, a link to another file: writing would change that file), /proc, and
through the real CLI a read-only directory and a run dir Hydra cannot make."""
import importlib
import json
import os
from pathlib import Path

import pytest

from rules import UserError
from helpers import TINY, assert_one_line_error, compose_cfg, one_line


def run_train(tmp, key, path):
    from train import train
    base = TINY + [f"out_dir={tmp / 'run'}", f"data.cache_dir={tmp / 'cache'}"]
    train(compose_cfg("config", base + [f"{'out_dir' if key == 'hydra.run.dir' else key}={path}"]))


def run_prepare(tmp, key, path):
    from data.prepare import prepare
    prepare(compose_cfg("config", [f"data.cache_dir={path}"]).data)


def run_tool(config, module, function, base=()):
    def run(tmp, key, path):
        fn = getattr(__import__(module, fromlist=[function]), function)
        fn(compose_cfg(config, [*base, f"{key}={path}"]))
    return run


def run_report(tmp, key, path):
    from tools.report import report
    report([str(tmp / "no-such-run")], str(path))


def run_recall(tmp, key, path):
    from tools.recall import recall
    recall([str(tmp / "no-such-run")], str(path))


def run_gpu_figures(tmp, key, path):
    from tools.gpu_figures import gpu_figures
    gpu_figures("cpu", str(path))


# (command, key, what it writes there: dir or file, how to run it with `key` at a path)
WRITERS = [
    ("train.py", "hydra.run.dir", "dir", run_train),
    ("train.py", "data.cache_dir", "dir", run_train),
    ("tools/prepare.py", "data.cache_dir", "dir", run_prepare),
    ("tools/export.py", "out", "dir", run_tool("export", "tools.export", "export", ["ckpt=no-such.pt"])),
    ("tools/visualize.py", "out", "dir", run_tool("visualize", "tools.visualize", "visualize",
                                                  ["ckpt=no-such.pt", "prompt=hi"])),
    ("tools/report.py", "--out", "dir", run_report),
    ("tools/recall.py", "--out", "dir", run_recall),
    ("tools/cost.py", "plot", "file", run_tool("cost", "tools.cost", "cost", ["model=debug", "format=json"])),
    ("tools/bench_attention.py", "out", "file", run_tool("bench_attention", "tools.bench_attention",
                                                         "bench_attention", ["lengths=[8]", "repeats=1"])),
    ("tools/eval_stream.py", "out", "file", run_tool("eval_stream", "tools.eval_stream", "eval_stream",
                                                     ["ckpt=no-such.pt"])),
    ("tools/eval_lengths.py", "out", "file", run_tool("eval_lengths", "tools.eval_lengths", "eval_lengths",
                                                      ["ckpt=no-such.pt"])),
    ("tools/ablate.py", "out", "dir", run_tool("ablate", "tools.ablate", "ablate", ["ckpt=no-such.pt"])),
    ("tools/lens.py", "out", "dir", run_tool("lens", "tools.lens", "lens", ["ckpt=no-such.pt"])),
    ("tools/needle.py", "out", "dir", run_tool("needle", "tools.needle", "needle", ["ckpt=no-such.pt"])),
    ("tools/patch.py", "out", "dir", run_tool("patch", "tools.patch", "patch", ["ckpt=no-such.pt"])),
    ("tools/gpu_figures.py", "--out", "file", run_gpu_figures),
]


def bad_place(tmp: Path, kind: str, writes: str) -> Path:
    """A place of the given kind in tmp (what was there before is checked to be unchanged after)."""
    (tmp / "a_file").write_text("keep me\n")
    if kind == "existing file":
        return tmp / "a_file" if writes == "dir" else tmp / "a_dir_not_a_file"
    if kind == "symbolic link":
        link = tmp / "link"
        link.symlink_to(tmp / "nowhere" if writes == "dir" else tmp / "a_file")
        return link
    if kind == "inside a file":
        return tmp / "a_file" / "sub"
    return Path("/proc/attnlab-output")  # /proc: nothing can be made there, even by root


@pytest.mark.parametrize("kind", ["existing file", "symbolic link", "inside a file", "/proc"])
@pytest.mark.parametrize("command,key,writes,run", WRITERS, ids=[f"{w[0]}:{w[1]}" for w in WRITERS])
def test_every_output_path_refuses_a_bad_place_in_one_line(command, key, writes, run, kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a command's defaults (outputs/, report/) land here if anything is written
    if kind == "existing file" and writes == "file":
        (tmp_path / "a_dir_not_a_file").mkdir()  # a file's place taken by a directory
    path = bad_place(tmp_path, kind, writes)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    with pytest.raises(UserError) as e:
        run(tmp_path, key, path)
    msg = one_line(e)
    assert msg.startswith(f"{key}=") and str(path) in msg, msg
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before  # nothing written
    assert (tmp_path / "a_file").read_text() == "keep me\n"


def without_root_powers():
    """A prefix that runs a command without the capabilities that let root write anywhere."""
    if os.geteuid() != 0:
        return ()
    import shutil
    if not shutil.which("setpriv"):
        pytest.skip("running as root without setpriv: a read-only directory is writable")
    return ("setpriv", "--inh-caps=-all", "--bounding-set=-all")


def test_read_only_places_are_one_line_through_the_cli(tmp_path, cli):
    """Each command, its output in a directory it may not write: one line naming the key, status 1."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    where = locked / "out"
    train = ["model=debug", "device=cpu", "logger.wandb.mode=disabled"]
    cases = [("train.py", [*train, f"hydra.run.dir={where}"], "hydra.run.dir"),
             ("train.py", [*train, f"data.cache_dir={where}", f"hydra.run.dir={tmp_path / 'run'}"], "data.cache_dir"),
             ("tools/prepare.py", [f"data.cache_dir={where}"], "data.cache_dir"),
             ("tools/export.py", ["ckpt=no-such.pt", f"out={where}"], "out="),
             ("tools/visualize.py", ["ckpt=no-such.pt", "prompt=hi", f"out={where}"], "out="),
             ("tools/report.py", [str(tmp_path), "--out", str(where)], "--out="),
             ("tools/cost.py", ["model=debug", f"plot={where}.png"], "plot="),
             ("tools/bench_attention.py", ["lengths=[8]", f"out={where}.png"], "out=")]
    try:
        for script, args, needle in cases:
            r = cli(script, *args, prefix=without_root_powers(), cwd=tmp_path)
            assert_one_line_error(r, needle)
            assert list(locked.iterdir()) == [], script
        assert not (tmp_path / "run").exists()  # the refused training left no run dir either
    finally:
        locked.chmod(0o755)


@pytest.mark.parametrize("script,place", [("train.py", "a_file"), ("train.py", "a_file/sub"),
                                          ("train.py", "/proc/attnlab-run"), ("sample.py", "a_file")])
def test_a_run_dir_hydra_cannot_make_is_one_line(tmp_path, script, place, cli):
    """A run dir Hydra cannot make is one line, not Hydra's FileExistsError traceback (it makes the run dir
    before the command runs), and the file in its way is kept."""
    (tmp_path / "a_file").write_text("keep me\n")
    r = cli(script, f"hydra.run.dir={place}", "device=cpu", cwd=tmp_path)
    assert_one_line_error(r, f"cannot make the run dir {place}")
    assert (tmp_path / "a_file").read_text() == "keep me\n"


# ----------------------------------------------------------------------------- where a command writes by default

# (command, the key of its output path): each writes under outputs/<command>/ unless told otherwise, so the
# README's commands leave `git status` clean (outputs/ is in .gitignore)
DEFAULT_OUTPUTS = [("ablate", "out"), ("lens", "out"), ("needle", "out"), ("patch", "out"), ("visualize", "out"),
                   ("cost", "plot"), ("bench_attention", "out"), ("eval_lengths", "out"), ("eval_stream", "out")]


@pytest.mark.parametrize("command,key", DEFAULT_OUTPUTS, ids=[c for c, _ in DEFAULT_OUTPUTS])
def test_every_command_writes_under_outputs_by_default(command, key):
    importlib.import_module(f"tools.{command}")  # registers the command's schema
    default = compose_cfg(command, ["model=debug"] if command == "cost" else [])[key]
    assert Path(default).parts[:2] == ("outputs", command), default


def a_run(root: Path, name: str, config: dict, metrics: dict) -> str:
    """A run dir with a resolved config and one line of metrics."""
    import yaml

    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 10, **metrics}) + "\n")
    return str(run)


def test_report_and_recall_write_under_outputs_by_default(tmp_path, monkeypatch):
    """Given run dirs (not one sweep dir, where they write beside the runs), report.py and recall.py write
    into outputs/report/ and outputs/recall/ of the working directory."""
    from tools.recall import recall
    from tools.report import report

    runs = [a_run(tmp_path / "runs", f"s{seed}", {"seed": seed, "data": {"name": "mqar", "pairs": 4}},
                  {"val/loss": 2.0 + seed / 10, "val/recall_acc": 0.5}) for seed in (1, 2)]
    monkeypatch.chdir(tmp_path)
    report(runs)
    recall(runs)
    assert (tmp_path / "outputs" / "report" / "report.md").is_file()
    assert (tmp_path / "outputs" / "recall" / "recall.md").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs", "runs"]
