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

# (command, the key of its output path, the file it names or None for a directory): each writes under
# outputs/<command>/ unless told otherwise, so the README's commands leave `git status` clean (outputs/ is in
# .gitignore), and into a new directory per call, outputs/<command>/<time>/, so that no call replaces an
# earlier call's files (`tools/ablate.py ckpt=A; tools/ablate.py ckpt=B` keeps A's)
DEFAULT_OUTPUTS = [("ablate", "out", None), ("lens", "out", None), ("needle", "out", None), ("patch", "out", None),
                   ("visualize", "out", None), ("cost", "plot", "cost.png"),
                   ("bench_attention", "out", "attention_n2.png"), ("eval_lengths", "out", "lengths.png"),
                   ("eval_stream", "out", "stream.png")]


@pytest.mark.parametrize("command,key,file", DEFAULT_OUTPUTS, ids=[c for c, _, _ in DEFAULT_OUTPUTS])
def test_every_command_writes_into_a_new_dir_under_outputs_by_default(command, key, file):
    """Two compositions of a command's config (two calls) give two directories under outputs/<command>/,
    each named by its time to the microsecond; within one call every read of the key gives the same path."""
    import time
    from datetime import datetime
    from files import OUTPUT_TIME

    importlib.import_module(f"tools.{command}")  # registers the command's schema
    first, second = (compose_cfg(command, ["model=debug"] if command == "cost" else []) for _ in range(2))
    paths = []
    for cfg in (first, second):
        path = Path(cfg[key])
        time.sleep(0.001)
        assert cfg[key] == str(path) and "$" not in str(path), path  # resolved, once per composed config
        d = path.parent if file else path
        assert d.parent == Path("outputs", command) and (file is None or path.name == file), path
        datetime.strptime(d.name, OUTPUT_TIME)  # a time, as configs/config.yaml's run dirs
        paths.append(d)
    assert paths[0] != paths[1] and sorted(paths) == paths  # the newest (`ls | tail -1`) is the latest call's


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
    into a new outputs/report/<time>/ and outputs/recall/<time>/ of the working directory."""
    from tools.recall import recall
    from tools.report import report

    runs = [a_run(tmp_path / "runs", f"s{seed}", {"seed": seed, "data": {"name": "mqar", "pairs": 4}},
                  {"val/loss": 2.0 + seed / 10, "val/recall_acc": 0.5}) for seed in (1, 2)]
    monkeypatch.chdir(tmp_path)
    report(runs)
    recall(runs)
    assert len(list((tmp_path / "outputs" / "report").glob("*/report.md"))) == 1
    assert len(list((tmp_path / "outputs" / "recall").glob("*/recall.md"))) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs", "runs"]


def test_a_second_report_of_a_sweep_keeps_the_first(tmp_path, monkeypatch, capsys):
    """report.py and recall.py on one sweep dir, twice, with no --out: each call writes a new
    SWEEP/report/<time>/ (SWEEP/recall/<time>/), names it on stderr, and the first call's files are kept;
    the runs found in the sweep are the same the second time (the reports hold no metrics.jsonl)."""
    from tools.recall import recall
    from tools.report import report

    sweep = tmp_path / "sweep"
    for seed in (1, 2):
        a_run(sweep, f"s{seed}", {"seed": seed, "data": {"name": "mqar", "pairs": 4}},
              {"val/loss": 2.0 + seed / 10, "val/recall_acc": 0.5})
    monkeypatch.chdir(tmp_path)
    first = report([str(sweep)])
    md = first["files"][-1]
    assert md.name == "report.md" and md.parent.parent == sweep / "report"
    written = {f: f.stat().st_mtime_ns for f in first["files"]}
    second = report([str(sweep)])
    assert second["files"][-1].parent != md.parent and second["table"] == first["table"]
    assert sorted(p.parent.name for p in (sweep / "report").glob("*/report.md")) == \
        [md.parent.name, second["files"][-1].parent.name]
    assert {f: f.stat().st_mtime_ns for f in first["files"]} == written  # the first call's files, untouched
    recall([str(sweep)])
    recall([str(sweep)])
    made = sorted((sweep / "recall").glob("*/recall.md"))
    assert len(made) == 2 and f"wrote {made[0]}" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep"]  # nothing under outputs/