"""The directory a training run writes (hydra.run.dir, or out_dir), as one object: checked before any
work, chosen (this command's, or the run's own when resuming), locked while the run lasts, cleaned of
what killed writes left, and removed again when the run is refused and this command made it; then the
record of what the run is (train.log, config.yaml, run_info.json, Hydra's overrides), and at its end
its results and figures, or, when it runs out of memory, the one line that names its last good
checkpoint (out_of_memory). Only rank 0 writes here. The checkpoints in it are lab/checkpoint.py's."""
import fcntl
import json
import logging
import logging.handlers
import math
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from data.loader import TokenData
from lab.attnstats import AttentionProbe, induction_line
from lab.cli import in_sweep, new_run_dir, remove_new_run_dir
from lab.checkpoint import TrainState, last_good_checkpoint, latest_checkpoint, prune_checkpoints, save_checkpoint
from lab.device import Runtime, is_oom
from lab.stability import Watch, diverged_line, suspects
from lab.tracking import Tracker, log_metrics
from files import check_output_dir, dir_mode, remove_stale_temps
from model import GPT
from rules import UserError, first_line

log = logging.getLogger("attnlab")


class RunDir:
    """A training run's directory. `given` is the one this command was told (None: unset); `path` the
    run's, once open() has chosen it."""

    def __init__(self, given):
        self.given = Path(given) if given else None
        self.made = self.given is not None and new_run_dir(self.given)  # by this command (or Hydra for it)
        self.path = self.given
        self.lock = None  # held by rank 0 from open() until the run is closed
        self.log_file = None  # train.log's handler (rank 0), from open_log() until the run is closed
        self.file_mode = None  # permission bits of its checkpoints (those of the data's source files; restrict())
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
            where = "hydra.sweep.dir (a sweep's job dirs are its dir's)" if in_sweep() else "hydra.run.dir"
            raise UserError(f"{self.path} already holds a run: continue it with resume=true, or give a new "
                            f"{where} (nothing was overwritten)")
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
        """No more readable than the data the run learns from (`file_mode`: its source files' bits), the
        dir and the checkpoints save() writes in it."""
        self.file_mode = file_mode
        if self.master and file_mode is not None:
            os.chmod(self.path, self.path.stat().st_mode & dir_mode(file_mode))

    def save(self, contents: dict, name: str, keep: Optional[int] = None):
        """Write a checkpoint's `contents` as `name` (rank 0 alone); with `keep`, then delete all but the
        newest `keep` periodic checkpoints."""
        if self.master:
            save_checkpoint(self.path / name, contents, self.file_mode)
            if keep is not None:
                prune_checkpoints(self.path, keep)

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
        self.log_file = handler
        return handler

    def close(self):
        """Let go of train.log and the lock."""
        if self.log_file is not None:
            logging.getLogger().removeHandler(self.log_file)
            self.log_file.close()
        if self.lock is not None:
            self.lock.close()


@contextmanager
def held_log():
    """Every log line while inside, held (up to 10^4) for train.log, which opens only once the run is
    accepted (RunDir.open_log): yields the list of them."""
    held = logging.handlers.MemoryHandler(10**4, flushLevel=logging.CRITICAL + 1)
    logging.getLogger().addHandler(held)
    try:
        yield held.buffer
    finally:
        logging.getLogger().removeHandler(held)


@contextmanager
def out_of_memory(tcfg, block_size: int, out_dir: Optional[Path] = None):
    """A training that runs out of memory inside, as one line that says what to lower (`tcfg`: its train
    config) and, once the run has its dir (`out_dir`), the last good checkpoint there."""
    try:
        yield
    except RuntimeError as e:
        if not is_oom(e):
            raise
        saved = f"; last good checkpoint: {last_good_checkpoint(out_dir) or 'none'}" if out_dir else ""
        raise UserError(f"out of memory ({first_line(e, 120)}) at train.batch_size={tcfg.batch_size} x "
                        f"train.grad_accum={tcfg.grad_accum or 1} micro-batches x model.block_size={block_size}: "
                        "lower train.batch_size (raising train.grad_accum keeps the tokens per step), "
                        f"model.block_size or the model size{saved}") from None


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


# ----------------------------------------------------------------------------- the run's results and figures

UNIGRAM_MARGIN = 0.05  # nats either side of the unigram loss: a run that ended there learned token frequencies only


def outcome(results: dict, final: Optional[float], unigram: Optional[float], stopped: Optional[str], step: int) -> dict:
    """The one outcome of a run: diverged (stability.Watch), stopped (a signal), unigram (its last val loss
    within UNIGRAM_MARGIN of the val split's unigram cross-entropy) or finished; why, and at which step."""
    if results["diverged"]:
        return {"outcome": "diverged", "outcome_why": results.get("diverged_reason") or "diverged",
                "outcome_step": results.get("diverged_step", step)}
    if stopped:
        return {"outcome": "stopped", "outcome_why": f"stopped by {stopped}", "outcome_step": step}
    if unigram is not None and final is not None and abs(final - unigram) <= UNIGRAM_MARGIN:
        return {"outcome": "unigram", "outcome_step": step,
                "outcome_why": f"val loss {final:.3f} within {UNIGRAM_MARGIN} nats of the val split's unigram loss "
                               f"{unigram:.3f}: it learned how often each token comes, and little else"}
    return {"outcome": "finished", "outcome_why": None, "outcome_step": step}


def record_results(watch: Watch, state: TrainState, tracker: Tracker, out_dir: Path, master: bool, tcfg,
                   unigram: Optional[float] = None, stopped: Optional[str] = None) -> dict:
    """The run's results (its stability figures beside its losses, its outcome, the val split's unigram
    loss) in results.json, the W&B summary and, when it diverged, one metrics line that says where."""
    results = watch.results()
    final = state.evals.get("val_full") or state.evals.get("val")
    results.update(unigram_loss=unigram, **outcome(results, final, unigram, stopped, state.step))
    if results["diverged"]:
        good = last_good_checkpoint(out_dir, state.step) if master else None
        results["last_good_checkpoint"] = str(good) if good else None
        results["lr"], results["suspects"] = tcfg.lr, suspects(tcfg)  # what the divergence line tells to lower
        log_metrics(tracker, watch, state.step, {"diverged": 1, "diverged_step": results["diverged_step"],
                                                 **({"last_finite_loss": results["diverged_last_finite_loss"]}
                                                    if results["diverged_last_finite_loss"] is not None else {})})
    tracker.summarize({"val_loss": state.evals.get("val"), "val_loss_full": state.evals.get("val_full"),
                       "best_val_loss": state.best_val if math.isfinite(state.best_val) else None,
                       "steps": state.step, **results})
    return results


def already_finished(state: TrainState, run_dir: RunDir, watch: Watch, compiled: bool) -> dict:
    """A run resumed at its train.max_iters: say so and change nothing (its record, metrics, plots and
    W&B run stay as they are); what train() returns for it."""
    val = state.evals["val"]
    log.warning("nothing to do: the run in %s is already at step %d = train.max_iters (val loss %s, best %.4f); "
                "pass train.max_iters > %d to train on", run_dir.path, state.step,
                "unknown" if val is None else f"{val:.4f}", state.best_val, state.step)
    return {**summary(state, run_dir, compiled, [], {}), **watch.results()}


def summary(state: TrainState, run_dir: RunDir, compiled: bool, attn: list, metrics: dict, tokens_per_sec=None,
            stopped=None, wall_s=0.0, train_s=0.0, probe_s=0.0) -> dict:
    """What train() returns: losses, steps, throughput, paths (`attn`: the probes' statistics by step,
    `metrics`: the data's own at the latest evaluation)."""
    evals = state.evals
    return {"out_dir": str(run_dir.path), "steps": state.step, "best_val_loss": state.best_val,
            "train_loss": evals.get("train"), "val_loss": evals.get("val"),
            "val_loss_full": evals.get("val_full"), "tokens_per_sec": tokens_per_sec, "stopped": stopped,
            "compiled": compiled, "ckpt": str(run_dir.latest_checkpoint()), "wall_s": wall_s,
            "train_s": train_s, "probe_s": probe_s, "attn": attn, **metrics}


def log_end(result: dict, updated: bool, master: bool = True):
    """The last line of a run's log (`result`: what train() returns): where it diverged (appended to its
    train.log alone: the console gets that line once, from stability.report_divergence), or its val loss
    and the attention probes' share of the training time (`updated`: it took an optimizer step), after a
    warning where it ended at the unigram loss (from rank 0 alone: the other ranks log warnings too) and a line on
    the in-context gain where the probe measured it."""
    if result["diverged"]:
        train_log = Path(result["out_dir"]) / "train.log"
        if train_log.is_file():  # rank 0's
            with open(train_log, "a") as f:
                f.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}][{log.name}][WARNING] - {diverged_line(result)}; "
                        f"run dir {result['out_dir']}\n")
        return
    if master and result.get("outcome") == "unigram":  # trained, but only to the loss of knowing token frequencies
        log.warning("ended at the unigram loss: %s", result["outcome_why"])
    if induction := induction_line(result["attn"]):  # when an induction head formed (every probe measures it)
        log.info(induction)
    probe_s, train_s = result["probe_s"], result["train_s"]
    share = f" ({100 * probe_s / train_s:.2f}% of training time)" if train_s > 0 and updated else ""
    log.info("done: val loss %.4f (best %.4f) after %d steps; run dir %s; attention probes took %.2f s%s",
             result["val_loss"] or math.nan, result["best_val_loss"], result["steps"], result["out_dir"], probe_s,
             share)


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
