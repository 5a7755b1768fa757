"""How a command ends and stops (nanochat keeps the same in nanochat/common.py): `run_app` and `cli`
wrap every entry point so that the one error type (rules.UserError), Hydra's own errors and running
out of memory end in one line `error: ...` and exit status 1, Ctrl-C or SIGTERM in one line and 130 or
143, never a traceback, and a refused command leaves no run dir it made behind (new_run_dir,
remove_new_run_dir); `StopRequest` lets a training finish its step and checkpoint first (and a sweep
end there: end_sweep_on_signal)."""
import functools
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from lab.device import is_oom
from lab.parallel import all_ranks_agree
from rules import UserError, first_line

log = logging.getLogger("attnlab")

STARTED = time.time()  # this process's start, as near as an import gets: what it created is newer


class JobFailed(Exception):
    """A sweep job's refusal (a UserError's line, already printed): a failed job, not the sweep's end."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a scheduler stopping a job), raised where Ctrl-C raises
    KeyboardInterrupt: a command stops the same way, keeping what it made so far."""


received = []  # the signals this process was stopped by, in order (a library may turn one into another error)


def raise_terminated(signum, frame):
    received.append("SIGTERM")
    raise Terminated()


def raise_interrupt(signum, frame):
    received.append("Ctrl-C")
    raise KeyboardInterrupt()


def redeliver_lost_interrupt(unraisable):
    """sys.unraisablehook: Python prints and drops an exception raised while it runs a clean-up
    callback (a weakref's, an import lock's), so a Ctrl-C or SIGTERM that lands there would be lost
    (seen while `datasets` tokenizes). Raise it again 50 ms later, from wherever the command is then."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        return sys.__unraisablehook__(unraisable)
    lost = unraisable.exc_value

    def again(signum, frame):
        raise lost
    signal.signal(signal.SIGALRM, again)
    signal.setitimer(signal.ITIMER_REAL, 0.05)


def interruption(e: KeyboardInterrupt):
    """(what stopped a command, its exit status): Ctrl-C 130, SIGTERM 143 (128 + the signal)."""
    return ("SIGTERM", 143) if isinstance(e, Terminated) else ("Ctrl-C", 130)


def interrupted(name: str):
    """End a command stopped by Ctrl-C or SIGTERM (`name`): one line, status 130 or 143."""
    forget_hydra_run_dir()
    print(f"interrupted ({name})", file=sys.stderr)
    sys.exit(143 if name == "SIGTERM" else 130)


entered = False  # set once Hydra has handed a command its config: errors before that are Hydra's


def cli(main):
    """Wrap an entry point: a UserError ends it with one line `error: ...` and exit status 1,
    running out of memory likewise, Ctrl-C or SIGTERM with one line and status 130 or 143, never a
    traceback."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        global entered
        entered = True
        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread:  # restored on the way out: a caller in Python (a test, a notebook) keeps its own
            previous = (signal.signal(signal.SIGTERM, raise_terminated), sys.unraisablehook,
                        signal.signal(signal.SIGINT, raise_interrupt))
            sys.unraisablehook = redeliver_lost_interrupt
        received.clear()
        try:
            return main(*args, **kwargs)
        except UserError as e:
            if received:  # a library turned the signal into an error we then worded (datasets: "An error
                interrupted(received[-1])  # occurred while generating the dataset"): still the signal
            forget_hydra_run_dir()
            print(f"error: {e}", file=sys.stderr)
            if in_sweep():  # one job of a sweep failed: the sweep records it and goes on (lab/sweep.py)
                raise JobFailed(str(e)) from None
            sys.exit(1)
        except KeyboardInterrupt as e:
            interrupted(interruption(e)[0])
        except BrokenPipeError:  # `... | head`: the reader left; what it wanted was printed
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        except RuntimeError as e:
            if not is_oom(e):
                raise
            print(f"error: out of memory ({first_line(e)}): lower the batch size, sequence length or model "
                  "size", file=sys.stderr)
            if in_sweep():
                raise JobFailed(f"out of memory ({first_line(e)})") from None
            sys.exit(1)
        except Exception:
            if not received:
                raise
            # the signal landed inside a library that cleaned up and raised something else instead
            # (datasets' Arrow writer: "I/O operation on closed file"): still an interruption
            interrupted(received[-1])
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, previous[0])
                signal.signal(signal.SIGINT, previous[2])
                sys.unraisablehook = previous[1]
    return wrapper


def end_sweep_on_signal(stopped, sweep: bool):
    """A signal (`stopped`: its name, or None) stops a whole `sweep`, not only this run: exit 0 once the
    run has saved its checkpoint, the jobs after it not started."""
    if stopped and sweep:
        print(f"sweep stopped: the runs after this one were not started; finish it (the stopped job resumes, the "
              f"others start) with: {finishing_command()}", file=sys.stderr)
        sys.exit(0)


def finishing_command() -> str:
    """The one command that finishes a stopped sweep: the sweep's own overrides (its multirun.yaml, as
    Hydra wrote it at the sweep's start), its dir, resume=true."""
    import shlex

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf
    sweep_dir = HydraConfig.get().sweep.dir
    try:
        task = list(OmegaConf.load(Path(sweep_dir) / "multirun.yaml").hydra.overrides.task)
    except (OSError, ValueError, AttributeError):  # no record: the job's own overrides are the best guess
        task = list(HydraConfig.get().overrides.task)
    keep = [a for a in task if not a.startswith(("resume=", "hydra.sweep.dir="))]
    return shlex.join(["python", "train.py", "-m", *keep, f"hydra.sweep.dir={sweep_dir}", "resume=true"])


def in_sweep() -> bool:
    """Is this a job of a Hydra multirun (`-m`)?"""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def hydra_error_line(e: BaseException) -> str:
    """Hydra's composition errors (unknown key, wrong type, bad override syntax) are several lines
    (the message, then full_key/object_type lines); the part a user needs, as one line."""
    parts = [str(e)] + ([str(e.__cause__)] if e.__cause__ is not None else [])
    keep = []
    for part in parts:
        for line in map(str.strip, part.splitlines()):
            if line.startswith("Config search path:"):  # Hydra's internals from here on
                break
            # "To append ... use +key=value": a structured config refuses new keys, so that advice fails too
            if line and not line.startswith(("full_key:", "object_type=", "reference_type=", "provider=",
                                             "To append to your config")):
                keep.append(line)
    return " ".join(dict.fromkeys(keep))  # the cause often repeats the message


def run_app(app):
    """Run a @hydra.main entry point so that Hydra's own errors, raised before our code runs (a
    misspelt key, a value of the wrong type), also end in one line `error: ...` and status 1.
    HYDRA_FULL_ERROR=1 set by the user keeps Hydra's full report."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        return app()
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra then raises instead of printing a multi-line report
    try:
        return app()
    except (HydraException, OmegaConfBaseException) as e:
        print(f"error: {hydra_error_line(e)} (--help lists every key and its type)", file=sys.stderr)
        sys.exit(1)
    except OSError as e:
        if entered:  # the command's own: not Hydra's
            raise
        # before the command runs Hydra creates its run dir (and nothing else here): a file, a link to
        # nothing, a read-only place or /proc there fails in its mkdir
        print(f"error: cannot make the run dir {e.filename}: {e.strerror} (hydra.run.dir, or hydra.sweep.dir "
              "with -m, must be a directory you can write)", file=sys.stderr)
        sys.exit(1)
    finally:
        del os.environ["HYDRA_FULL_ERROR"]


def forget_hydra_run_dir():
    """A refused or interrupted command leaves no empty run dir behind: Hydra made it (hydra.run.dir)
    before the command ran."""
    from hydra.core.hydra_config import HydraConfig

    if HydraConfig.initialized():
        out_dir = Path(HydraConfig.get().runtime.output_dir)
        if new_run_dir(out_dir):
            remove_new_run_dir(out_dir)


def new_run_dir(out_dir: Path) -> bool:
    """True if the run dir is absent, or empty and made since this process started (Hydra makes a
    command's run dir before the command runs): a refused run may then remove it again."""
    try:
        return not any(out_dir.iterdir()) and out_dir.stat().st_mtime >= STARTED
    except FileNotFoundError:
        return True
    except OSError:
        return False


def remove_new_run_dir(out_dir: Path, locked: bool = False):
    """Undo a refused run's new dir: its lock file if this process holds the lock (`locked`; another
    process's lock stays, and so then does the dir), the dir, then each parent below the working
    directory that is left empty (Hydra's outputs/runs/ of a first run). Never the working directory
    or one above it."""
    run_dir, here = out_dir.resolve(), Path.cwd().resolve()
    if run_dir == here or run_dir in here.parents:
        return
    if locked:
        (out_dir / ".lock").unlink(missing_ok=True)
    for d in [run_dir] + [p for p in run_dir.parents if here in p.parents]:
        try:
            d.rmdir()  # only ever an empty one
        except OSError:
            break


class StopRequest:
    """SIGTERM or SIGINT: finish the current step, checkpoint, exit 0. A second SIGINT exits now. As a
    context manager, the previous handlers are restored on the way out."""

    def __init__(self):
        self.signal = None
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self.handle)

    def handle(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:
            os._exit(130)
        self.signal = signal.Signals(signum).name
        log.warning("%s received: finishing this step, then saving a checkpoint (Ctrl-C again to quit now)", self.signal)

    def agree(self, device, world: int):
        """Under DDP every rank must stop at the same step: all stop if any was signalled."""
        if all_ranks_agree(self.signal is not None, device, world) and self.signal is None:
            self.signal = "SIGTERM"

    def tell(self, step: int, checkpoint: Path, run_dir: Path):
        """Where a stopped training stands and how to resume it, on stderr."""
        print(f"stopped by {self.signal} at step {step}; checkpoint {checkpoint}\nresume with: "
              f"python train.py hydra.run.dir={run_dir} resume=true (and the same overrides)", file=sys.stderr)

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()
