"""The directory a training run writes (hydra.run.dir, or out_dir), as one object: checked before any
work, chosen (this command's, or the run's own when resuming), locked while the run lasts, cleaned of
what killed writes left, and removed again when the run is refused and this command made it; then the
record of what the run is (train.log, config.yaml, run_info.json, Hydra's overrides), and at its end
its figures. Only rank 0 writes here. The checkpoints in it are lab/checkpoint.py's."""
import fcntl
import json
import logging
import os
import platform
import subprocess
import sys
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from data.loader import TokenData
from lab.attnstats import AttentionProbe
from lab.checkpoint import latest_checkpoint
from lab.device import Runtime
from lab.tracking import Tracker
from files import check_output_dir, dir_mode, new_run_dir, remove_new_run_dir, remove_stale_temps
from model import GPT
from rules import UserError

log = logging.getLogger("attnlab")


class RunDir:
    """A training run's directory. `given` is the one this command was told (None: unset); `path` the
    run's, once open() has chosen it."""

    def __init__(self, given):
        self.given = Path(given) if given else None
        self.made = self.given is not None and new_run_dir(self.given)  # by this command (or Hydra for it)
        self.path = self.given
        self.lock = None  # held by rank 0 from open() until the run is closed
        self.master = True  # rank 0, the one process that writes here (set once the processes are known)

    def check(self, cache_dir=None):
        """Before anything is written: a dir is given, and it (and data.cache_dir) can be written."""
        if self.given is None:
            raise UserError("out_dir is unset: pass out_dir=DIR (train.py sets it to Hydra's run dir)")
        check_output_dir(self.given, "hydra.run.dir")
        if cache_dir:
            check_output_dir(cache_dir, "data.cache_dir")

    def open(self, source=None, branch=False):
        """Choose the run's dir, lock it and clean it. A resumed run continues in its own dir (that of
        `source`, its checkpoint); a new run, or one that branches off another run's checkpoint
        (`branch`: a longer context), is this command's, and must not hold a run already."""
        self.path = self.given if source is None or branch else source.parent
        if self.path != self.given and self.made and self.master:
            remove_new_run_dir(self.given)  # resume=RUN_DIR: the dir made for this command is not used
        if not self.master:
            return
        self.lock = lock_run_dir(self.path)
        if (source is None or branch) and self.latest_checkpoint() is not None:
            raise UserError(f"{self.path} already holds a run: continue it with resume=true, or give a new "
                            "hydra.run.dir (nothing was overwritten)")
        remove_stale_temps(self.path, alive_only=False)  # we hold the lock: a temp file here is a killed write's

    @contextmanager
    def removed_if_refused(self):
        """A refused run leaves nothing behind: a dir this command (or Hydra for it) made is removed
        again, an existing one is left as it was, and the lock is let go at once (not when the
        traceback is freed), so the next command gets in."""
        try:
            yield self
        except BaseException:
            if self.made and self.master:
                remove_new_run_dir(self.given, locked=self.lock is not None and self.path == self.given)
            if self.lock is not None:
                self.lock.close()
            raise

    def latest_checkpoint(self):
        return latest_checkpoint(self.path)

    def restrict(self, file_mode):
        """No more readable than the data the run learns from (`file_mode`: its source files' bits)."""
        if self.master and file_mode is not None:
            os.chmod(self.path, self.path.stat().st_mode & dir_mode(file_mode))

    def write_record(self, cfg, info: dict, overrides=None):
        """What this run is, before it starts: the resolved config, code version and hardware (`info`),
        and for a new run Hydra's overrides and config."""
        try:
            if overrides is not None:
                (self.path / ".hydra").mkdir(exist_ok=True)  # first: a file in its way fails before anything is written
            (self.path / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
            (self.path / "run_info.json").write_text(json.dumps(info, indent=1))
            if overrides is not None:
                (self.path / ".hydra" / "overrides.yaml").write_text(OmegaConf.to_yaml(list(overrides)))
                (self.path / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        except OSError as e:  # e.g. a file where the run's .hydra directory goes, a directory named config.yaml
            with suppress(OSError):
                (self.path / ".hydra").rmdir()  # if this made it, empty
            raise UserError(f"cannot write the run's record in {self.path}: {e.strerror or e} ({e.filename}); "
                            "move that away or choose another run dir") from None

    def open_log(self, earlier) -> logging.Handler:
        """train.log: every log line of the run, those logged before it was accepted (`earlier`) first.
        Opened only now, so a refused command leaves no log file behind (Hydra's own would be opened
        before any check: configs/config.yaml logs to stderr alone)."""
        handler = logging.FileHandler(self.path / "train.log")
        handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
        for line in earlier:
            handler.handle(line)
        logging.getLogger().addHandler(handler)
        return handler


def lock_run_dir(out_dir: Path):
    """An exclusive lock on the run dir, held until the process ends: a second training pointed at
    the same dir stops with one line instead of interleaving its files with ours."""
    out_dir.mkdir(parents=True, exist_ok=True)
    f = open(out_dir / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        owner = f.read().strip() or "another process"
        f.close()
        raise UserError(f"{out_dir} is in use by a running training ({owner}): wait for it, or give "
                        "another hydra.run.dir") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on {platform.node()}\n")
    f.flush()
    return f


def run_info(device, world: int) -> dict:
    """Code version and hardware, recorded at the start of every run."""
    repo = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                timeout=5).stdout.strip() or None
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                                    capture_output=True, text=True, timeout=5).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = None, None
    return {"git_commit": commit, "git_dirty": dirty, "python": platform.python_version(),
            "torch": torch.__version__, "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "cpu_threads": torch.get_num_threads(), "hostname": platform.node(), "argv": sys.argv,
            "world_size": world}


# ----------------------------------------------------------------------------- the run's figures

def write_plots(out_dir: Path, step: int, model: GPT, probe: Optional[AttentionProbe], data: TokenData,
                tracker: Tracker, rt: Runtime, master: bool):
    """The figures of the run in `out_dir` at `step` and the attention maps of the probe text (decoded
    by the data's tokenizer), written by rank 0 (`master`) and sent to the run's tracker. Every rank
    calls it: under FSDP the maps' forward needs every rank (its all-gathers), so the others run it too."""
    if master:
        try:
            from lab.plots import plot_run
            for png in plot_run(out_dir):
                tracker.log_image(f"plots/{png.stem}", png, step)
        except Exception as e:  # a plot must never cost the run
            log.warning("plots skipped: %s", e)
    if probe is None:  # the attention probe is off (train.log_attn_interval=0), or a DDP rank > 0
        return
    try:  # the maps of the probe text (its first row, at most 256 tokens: the HTML stays a few MB)
        from lab.attnstats import attention_maps
        from lab.plots import write_views
        m = model.config
        with rt.autocast():  # as the probe: the flash kernel has no fp32
            if not master:  # FSDP: this rank's part of rank 0's forward
                attention_maps(model, probe.idx[:1, :256])
                return
            views = write_views(model, probe.idx[:1, :256], data.tokenizer, out_dir,
                                title=f"attention on the probe text at step {step}",
                                meta=f"{out_dir.name} · {m.n_layer} layers × {m.n_head} heads · block {m.block_size}")
        tracker.log_image("attention/maps", views["png"], step)
        if tracker.run is not None:
            import wandb
            tracker.run.log({"attention/viewer": wandb.Html(views["html"], inject=False)},  # as is: no CDN
                            step=step)
    except Exception as e:
        log.warning("attention maps skipped: %s", e)
