"""What a sweep (`python train.py -m ...`) does around its jobs: a Hydra callback (configs/config.yaml,
hydra.callbacks.sweep) and the short name of each job's directory.

- Before the first job starts, every job's config is composed and checked (config.check_train_config):
  an arm that would be refused (say one lr times weight_decay >= 1) fails the sweep in seconds, with one
  line per refused job, instead of after the jobs before it trained for hours.
- A job that diverges (lab/stability.py) is a result: it records it and the sweep goes on. A job that fails
  (one line `error: ...`) is reported and the sweep goes on too.
- The sweep's last line counts its jobs: how many finished, diverged and failed. It exits 1 if any
  failed, 0 otherwise (divergence is an outcome of the experiment, not a fault of the command).
- A job's directory is named by its number and its overrides, shortened with a hash of them when long
  (a sweep with many overrides otherwise fails with "File name too long").
- A job's W&B name and group: its overrides, and the sweep dir and arm (hydra_run_info).
"""
import json
import logging
import os
import sys
import time
from pathlib import Path

from hydra.experimental.callback import Callback

from lab.cli import JobFailed
from lab.config import check_train_config, override_key
from rules import UserError

def hydra_run_info():
    """(name, group, overrides) for W&B and the run dir, from Hydra: the job's overrides; in a
    multirun, the group is the sweep dir and the arm (the overrides minus the seeds), so the seeds of
    one arm are the runs of one W&B group."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    name = hc.job.override_dirname or None
    overrides = list(hc.overrides.task)
    group = None
    if hc.mode == RunMode.MULTIRUN:
        skip = {*hc.job.config.override_dirname.exclude_keys, "seed", "train.data_seed"}
        arm = ",".join(sorted(o for o in overrides if override_key(o) not in skip))
        group = f"{Path(hc.sweep.dir).name}/{arm or 'base'}"[:128]  # W&B's limit on a group name
    return name, group, overrides


def sweep_jobs(config) -> list:
    """Every job's overrides, as Hydra's basic sweeper will run them: hydra.sweeper.params (an
    experiment's grid) then the command line's overrides, crossed."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    parsed = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def refused_jobs(config) -> list:
    """[(job number, its overrides, the one line that refuses it)] for every job whose config
    check_train_config refuses; the settings a job ignores are not warned here (each job warns them)."""
    from hydra import compose

    refused = []
    quiet = logging.getLogger("attnlab")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        for i, job in enumerate(sweep_jobs(config)):
            try:
                check_train_config(compose(config_name=config.hydra.job.config_name, overrides=list(job)))
            except UserError as e:
                refused.append((i, job, str(e)))
    finally:
        quiet.level = level
    return refused


def repeated_jobs(config) -> list:
    """The values a sweep lists more than once for a key (`train.lr=0.001` of train.lr=1e-3,0.001), each
    as key=value: the jobs they make would run twice."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    repeated = []
    for o in OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task]):
        if o.is_sweep_override():
            values = list(o.sweep_string_iterator())
            repeated += [f"{o.get_key_element()}={v}" for v in dict.fromkeys(values) if values.count(v) > 1]
    return repeated


def keep_earlier_record(sweep_dir: Path):
    """A second sweep into the same dir (the finishing command of a stopped one, say): Hydra rewrites its
    multirun.yaml, so the earlier one is kept beside it under the time it was last written, and said."""
    record = sweep_dir / "multirun.yaml"
    if record.is_file():
        kept = record.with_name(f"multirun.{time.strftime('%Y-%m-%d_%H-%M-%S', time.localtime(record.stat().st_mtime))}.yaml")
        os.replace(record, kept)
        print(f"{sweep_dir} held an earlier sweep's multirun.yaml: kept as {kept.name}", file=sys.stderr)


def outcome(job_return) -> dict:
    """A finished job's outcome, from its results.json: {"diverged": bool, ...}, or {} without one."""
    out_dir = job_return.cfg.get("out_dir") or job_return.hydra_cfg.hydra.runtime.output_dir
    try:
        return json.loads((Path(out_dir) / "results.json").read_text())
    except (OSError, ValueError):
        return {}


class SweepReport(Callback):
    """hydra.callbacks.sweep: checks every job first, keeps the sweep going past a failed or diverged
    job, and ends with one line that counts them."""

    def __init__(self):
        self.finished, self.diverged, self.failed, self.unigram, self.stopped = [], [], [], [], []

    def on_multirun_start(self, config, **kwargs):
        twice = repeated_jobs(config)
        if twice:
            print(f"error: the sweep would run the same job twice ({', '.join(twice)} listed more than once): a repeated value (say "
                  "train.lr=1e-3,1e-3) counts one run as two seeds' worth; list each value once. No job was started",
                  file=sys.stderr)
            sys.exit(1)
        refused = refused_jobs(config)
        if not refused:
            keep_earlier_record(Path(config.hydra.sweep.dir))
        if refused:
            for i, job, line in refused:
                print(f"error: job {i} ({' '.join(job)}): {line}", file=sys.stderr)
            print(f"error: {len(refused)} of the sweep's jobs would be refused (above); no job was started",
                  file=sys.stderr)
            sys.exit(1)

    def on_job_end(self, config, job_return, **kwargs):
        from hydra.core.utils import JobStatus
        from hydra.types import RunMode

        if job_return.hydra_cfg is None or job_return.hydra_cfg.hydra.mode != RunMode.MULTIRUN:
            return  # a lone run (callbacks see those too): its failure stays a failure
        num = job_return.hydra_cfg.hydra.job.get("num") if job_return.hydra_cfg is not None else None
        name = f"job {num} ({' '.join(job_return.overrides or [])})"
        if job_return.status == JobStatus.FAILED:
            error = job_return._return_value
            self.failed.append((name, str(error).splitlines()[0] if str(error) else type(error).__name__))
            if not isinstance(error, JobFailed):  # its line is printed already; anything else is not
                print(f"error: {name} failed: {type(error).__name__}: {error}", file=sys.stderr)
            job_return.status, job_return.return_value = JobStatus.COMPLETED, None  # the next jobs run
        else:
            self.count(name, outcome(job_return))

    def count(self, name: str, result: dict):
        """A job that ran, by its recorded outcome (lab/rundir.outcome; older runs: the diverged flag)."""
        kind = result.get("outcome") or ("diverged" if result.get("diverged") else "finished")
        {"diverged": self.diverged, "unigram": self.unigram, "stopped": self.stopped}.get(kind, self.finished).append(name)

    def on_multirun_end(self, config, **kwargs):
        if not (self.finished or self.diverged or self.failed or self.unigram or self.stopped):  # jobs run in processes of
            self.count_from_disk(Path(config.hydra.sweep.dir))  # their own (submitit): their callbacks ran there
        n = sum(map(len, (self.finished, self.diverged, self.failed, self.unigram, self.stopped)))
        parts = [f"{len(self.finished)} finished", f"{len(self.diverged)} diverged", f"{len(self.failed)} failed"]
        parts += [f"{len(self.unigram)} at the unigram loss"] * bool(self.unigram)
        parts += [f"{len(self.stopped)} stopped"] * bool(self.stopped)
        print(f"sweep done: {n} jobs: {', '.join(parts)}"
              + (f"; diverged: {'; '.join(self.diverged)}" if self.diverged else "")
              + (f"; at the unigram loss (learned token frequencies only): {'; '.join(self.unigram)}"
                 if self.unigram else "")
              + (f"; failed: {'; '.join(f'{j} ({e})' for j, e in self.failed)}" if self.failed else ""),
              file=sys.stderr)
        if self.failed:
            sys.exit(1)

    def count_from_disk(self, sweep_dir: Path):
        """The outcomes of a sweep's jobs read from their dirs (results.json; a job dir without one failed)."""
        for job in sorted(p for p in sweep_dir.iterdir() if p.is_dir() and (p / ".hydra").is_dir()):
            try:
                result = json.loads((job / "results.json").read_text())
            except (OSError, ValueError):
                self.failed.append((f"job {job.name}", "no results.json"))
                continue
            self.count(f"job {job.name}", result)
