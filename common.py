"""What the commands share (nanochat keeps the same nanochat/common.py): how the one error type
(rules.UserError) ends a command, file modes and temporary files, the device, dtype and autocast,
the memory check, peak FLOP/s for MFU, the compile rule, distributed setup, a timer that waits for
the GPU, and a training process's own helpers: its record of code and hardware, the signals that
stop it, and the lock on its run dir."""
import fcntl
import functools
import logging
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from rules import UserError

log = logging.getLogger("attnlab")
STARTED = time.time()  # this process's start, as near as an import gets: what it created is newer


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a scheduler stopping a job), raised where Ctrl-C raises
    KeyboardInterrupt: a command stops the same way, keeping what it made so far."""


def raise_terminated(signum, frame):
    raise Terminated()


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
            previous = signal.signal(signal.SIGTERM, raise_terminated), sys.unraisablehook
            sys.unraisablehook = redeliver_lost_interrupt
        try:
            return main(*args, **kwargs)
        except UserError as e:
            forget_hydra_run_dir()
            print(f"error: {e}", file=sys.stderr)
            if in_sweep():  # one job of a sweep failed: the sweep records it and goes on (sweep.py)
                from sweep import JobFailed
                raise JobFailed(str(e)) from None
            sys.exit(1)
        except KeyboardInterrupt as e:
            forget_hydra_run_dir()
            name, status = interruption(e)
            print(f"interrupted ({name})", file=sys.stderr)
            sys.exit(status)
        except BrokenPipeError:  # `... | head`: the reader left; what it wanted was printed
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        except RuntimeError as e:
            if not is_oom(e):
                raise
            print(f"error: out of memory ({first_line(e)}): lower the batch size, sequence length or model "
                  "size", file=sys.stderr)
            if in_sweep():
                from sweep import JobFailed
                raise JobFailed(f"out of memory ({first_line(e)})") from None
            sys.exit(1)
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, previous[0])
                sys.unraisablehook = previous[1]
    return wrapper


def in_sweep() -> bool:
    """Is this a job of a Hydra multirun (`-m`)?"""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def first_line(e, limit=200) -> str:
    """An exception's first line, for one-line messages."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:limit]


def is_oom(e: BaseException) -> bool:
    """True for a failed allocation: CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "out of memory" in str(e).lower()))


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


# ----------------------------------------------------------------------------- files

def check_output_dir(path, key: str) -> Path:
    """A directory a command will write into (made if absent), checked before any work: one line if
    it is a file or a link to nothing, or if nothing can be made where it is or would be (read-only,
    another user's, /proc)."""
    p = Path(path).expanduser()
    if p.is_symlink() and not p.exists():
        raise UserError(f"{key}={path} is a symbolic link to nothing: name a directory")
    if p.exists() and not p.is_dir():
        raise UserError(f"{key}={path} is a file: name a directory")
    check_can_write(p, key, path)
    return p


def check_output_file(path, key: str) -> Path:
    """A file a command will write (or replace), checked before any work: one line if it is a
    directory, a symbolic link (writing would change whatever it points to) or in a place where
    nothing can be written."""
    p = Path(path).expanduser()
    if p.is_symlink():
        raise UserError(f"{key}={path} is a symbolic link: writing it would change the file it points to; "
                        "name the file itself")
    if p.is_dir():
        raise UserError(f"{key}={path} is a directory: name a file")
    check_can_write(p.parent, key, path)
    return p


def check_can_write(p: Path, key: str, given):
    """Try it: make and remove an empty directory in `p`, or in its nearest existing ancestor. Read-only
    places, another user's directory and /proc (where os.access says yes to root) all fail here."""
    import tempfile

    place = next(a for a in (p, *p.parents) if a.exists() or a.is_symlink())
    if not place.is_dir():
        raise UserError(f"{key}={given}: {place} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".attnlab-write-test-", dir=place))
    except OSError as e:
        raise UserError(f"{key}={given}: nothing can be written in {place} ({e.strerror}): name a directory "
                        "you can write") from None


def file_digest(file) -> str:
    """sha256 of a file's bytes (hex), read in pieces; an unreadable file is one line."""
    import hashlib

    h = hashlib.sha256()
    try:
        with open(file, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        raise UserError(f"cannot read {file}: {e.strerror or e} (check its permissions)") from None
    return h.hexdigest()


def umask() -> int:
    """The process's umask, read without changing it (os.umask can only set it, and setting it
    even briefly races with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o077)  # not Linux: the strict mask for the instant it takes to read it
    os.umask(mask)
    return mask


def private_mode(sources=()) -> int:
    """Permission bits for files derived from `sources` (token files, checkpoints): no more
    readable than any source file and the umask allow; the owner keeps read and write."""
    mode = 0o666 & ~umask()
    for src in sources:
        mode &= os.stat(src).st_mode & 0o666
    return mode | 0o600


def dir_mode(file_mode: int) -> int:
    """The directory mode matching a file mode: searchable wherever readable."""
    return file_mode | ((file_mode & 0o444) >> 2) | 0o700


def remove_stale_temps(directory, alive_only=True):
    """Delete what killed writes left in `directory`: entries named `.NAME.tmp-PID` (files or
    dirs). With alive_only, entries of a process still running on this machine are kept (another
    process may be writing them); else every one goes (the caller holds the directory's lock)."""
    import shutil
    from pathlib import Path

    for p in Path(directory).glob(".*.tmp-*"):
        host, _, pid = p.name.rsplit(".tmp-", 1)[1].rpartition("-")  # .NAME.tmp-PID or .NAME.tmp-HOST-PID
        if alive_only and (host not in ("", platform.node()) or (pid.isdigit() and pid_alive(int(pid)))):
            continue  # another machine's (shared disk) or a live process's write
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def temp_suffix() -> str:
    """The tail of a temporary name in a directory other machines may share: host and pid."""
    return f".tmp-{platform.node()}-{os.getpid()}"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


# ----------------------------------------------------------------------------- device and dtype

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str) -> torch.device:
    """auto: cuda > mps > cpu. An explicit device that is not there is an error, not a fallback."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name not in ("cpu", "mps") and not str(name).startswith("cuda"):
        raise UserError(f"device={name!r} is unknown: use auto, cpu, cuda, cuda:N or mps")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise UserError(f"device={name} but no CUDA GPU is visible: use device=auto or device=cpu")
        try:
            device = torch.device(name)
        except RuntimeError:
            raise UserError(f"device={name!r} is not a device name: use cuda or cuda:N") from None
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"device={name} but only {torch.cuda.device_count()} GPU(s) are visible")
        return device
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("device=mps but MPS is not available: use device=auto or device=cpu")
    return torch.device(name)


def has_native_bf16(device: torch.device) -> bool:
    """Real bf16 tensor cores (Ampere, compute capability 8.0, and later). Older GPUs (T4, V100)
    report bf16 as supported but only emulate it, far slower than fp16."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def pick_dtype(name: str, device: torch.device, key: str = "dtype") -> torch.dtype:
    """The autocast dtype. auto: bf16 on GPUs with native bf16, fp16 (with a grad scaler) on
    older GPUs, float32 (no autocast) on CPU and MPS."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if has_native_bf16(device) else torch.float16
    if name not in DTYPES:
        raise UserError(f"{key}={name!r} is unknown: use auto, float32, bfloat16 or float16")
    return DTYPES[name]


@dataclass
class Runtime:
    device: torch.device
    dtype: torch.dtype  # autocast dtype; float32 means no autocast

    def autocast(self):
        """A fresh autocast context for one forward pass (a no-op in float32)."""
        if self.dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)


def setup_runtime(device_name: str, dtype_name: str) -> Runtime:
    """Device and autocast dtype; TF32 matmuls on CUDA (free speed, fp32 range)."""
    device = pick_device(device_name)
    dtype = pick_dtype(dtype_name, device)
    if device.type == "cuda":  # torch >= 2.9's precision API (allow_tf32 is its deprecated form)
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.fp32_precision = "tf32"
    return Runtime(device, dtype)


def device_memory_bytes(device: torch.device):
    """Memory a run on `device` can use at most: the GPU's, else the machine's RAM (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(need: int, device, what: str, keys: str):
    """Refuse, before allocating anything, what cannot fit the device: a huge model.n_layer would
    otherwise build layers until the machine runs out of memory (a hang, then the OOM killer), not
    fail. `need` is a lower bound from counting.py; `keys` names the values to lower."""
    available = device_memory_bytes(device)
    if available is not None and need > available:
        raise UserError(f"{what} need at least {need / 2**30:.3g} GiB but {device} has {available / 2**30:.3g} GiB "
                        f"({keys}): make them smaller")


def compile_wanted(flag, device) -> bool:
    """`compile`: true/false as given; unset means on for CUDA (it pays), off elsewhere."""
    return flag if flag is not None else device.type == "cuda"


# Peak dense tensor FLOP/s by exact GPU model (vendor datasheets, without sparsity), per dtype
# family: 16-bit (bf16/fp16) and fp32 (TF32 tensor cores where the GPU has them). Names are
# matched as whole words in order, most specific first, so "H100 PCIe" is not an SXM part and
# "L40" is not an "L4".
PEAK_FLOPS = [  # (words in torch.cuda.get_device_name, 16-bit peak, fp32/TF32 peak)
    (("H200", "NVL"), 835e12, 418e12), (("H200",), 989e12, 495e12), (("GH200",), 989e12, 495e12),
    (("H100", "PCIe"), 756e12, 378e12), (("H100", "NVL"), 835e12, 418e12), (("H100",), 989e12, 495e12),
    (("H800", "PCIe"), 756e12, 378e12), (("H800",), 989e12, 495e12),
    (("A100",), 312e12, 156e12), (("A800",), 312e12, 156e12),
    (("L40S",), 362e12, 183e12), (("L40",), 181e12, 90.5e12), (("L4",), 121e12, 60e12),
    (("A10",), 125e12, 62.5e12), (("4090",), 165e12, 82.6e12), (("3090",), 71e12, 35.6e12),
    (("V100",), 125e12, 15.7e12),  # V100, T4: fp16 tensor cores, no TF32, and bf16 only emulated
    (("T4",), 65e12, 8.1e12),
]
EMULATED_BF16 = ("V100", "T4")  # a bf16 run there is measured against the fp32 peak, not fp16's


def peak_flops_for(name: str, dtype: torch.dtype):
    """The table entry for a GPU name and compute dtype, or None."""
    words = set(name.replace("-", " ").split())
    for keys, half, single in PEAK_FLOPS:
        if all(k in words for k in keys):
            if dtype == torch.float16 or (dtype == torch.bfloat16 and keys[0] not in EMULATED_BF16):
                return half
            return single
    return None


def peak_flops(runtime: Runtime, override=None):
    """The FLOP/s MFU is measured against: the user's figure, else the GPU's table entry for the
    dtype the run computes in."""
    if override:
        return float(override)
    if runtime.device.type == "cuda":
        return peak_flops_for(torch.cuda.get_device_name(runtime.device), runtime.dtype)
    return None


# ----------------------------------------------------------------------------- distributed

@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device_name: str = None  # the device this rank must use, where torchrun decides it

    @property
    def master(self) -> bool:
        return self.rank == 0


def init_distributed(device_name: str) -> Dist:
    """Rank and world size from torchrun's environment, and a process group if world > 1 (NCCL
    with one GPU per process when the run is on CUDA, gloo on CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available() and (device_name == "auto" or str(device_name).startswith("cuda"))
    if use_cuda:
        torch.cuda.set_device(local_rank)  # under torchrun, cuda:N names nothing: each rank has its own GPU
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return Dist(rank, world, f"cuda:{local_rank}" if use_cuda else None)


def all_ranks_agree(flag: bool, device, world: int) -> bool:
    """True on every rank if `flag` is true on any (one all-reduce; the flag itself without DDP)."""
    if world == 1:
        return flag
    t = torch.tensor([float(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


# ----------------------------------------------------------------------------- timing

def synchronize(device):
    """Wait for queued GPU work, so a wall-clock reading covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """Wall-clock seconds of a block, GPU work included: `with Timer(device) as t: ...; t.seconds`."""

    def __init__(self, device=torch.device("cpu")):
        self.device, self.seconds = device, 0.0

    def __enter__(self):
        synchronize(self.device)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        synchronize(self.device)
        self.seconds = time.perf_counter() - self.t0


def read_prompt(cfg) -> str:
    """The prompt of sample.py / visualize.py: `prompt_file` read as is (every space and newline
    kept), else `prompt`."""
    if cfg.prompt_file is None:
        return cfg.prompt
    from pathlib import Path
    try:
        return Path(cfg.prompt_file).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"prompt_file={cfg.prompt_file!r} cannot be read as UTF-8 text: "
                        f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}") from None


# ----------------------------------------------------------------------------- a training process

def run_info(device, world: int) -> dict:
    """Code version and hardware, recorded at the start of every run."""
    repo = Path(__file__).resolve().parent
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


class StopRequest:
    """SIGTERM or SIGINT: finish the current step, checkpoint, exit 0. A second SIGINT exits now."""

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

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


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
