"""What every entry point shares: the one error type and how it ends a command, the device,
dtype and autocast, distributed setup, peak FLOP/s for MFU, the compile rule, and a timer that
waits for the GPU. Entry points import this, never each other (nanochat keeps the same
nanochat/common.py)."""
import functools
import os
import platform
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist


class UserError(Exception):
    """Bad input (config value, data file, checkpoint, prompt); the message says how to fix it."""


def cli(main):
    """Wrap an entry point: a UserError ends it with one line `error: ...` and exit status 1,
    running out of memory likewise, Ctrl-C with one line and status 130, never a traceback."""
    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(1)
        except KeyboardInterrupt:
            print("interrupted (Ctrl-C)", file=sys.stderr)
            sys.exit(130)
        except BrokenPipeError:  # `... | head`: the reader left; what it wanted was printed
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(0)
        except RuntimeError as e:
            if not is_oom(e):
                raise
            print(f"error: out of memory ({first_line(e)}): lower the batch size, sequence length or model "
                  "size", file=sys.stderr)
            sys.exit(1)
    return wrapper


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
    finally:
        del os.environ["HYDRA_FULL_ERROR"]


# ----------------------------------------------------------------------------- files

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
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return Runtime(device, dtype)


def memory_bytes(device: torch.device):
    """Memory a run on `device` can use at most: the GPU's, else the machine's RAM (None: unknown)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(mcfg, batch_size: int, device, batch_name="train.batch_size", vocab_name="model.vocab_size"):
    """Refuse, before allocating anything, a model or batch that cannot fit the device: a huge
    model.n_layer would otherwise build layers until the machine runs out of memory (a hang, then
    the OOM killer), not fail. A lower bound: fp32 weights, gradients and AdamW's two moments, and
    per token and layer a few n_embd-wide activations plus the logits."""
    available = memory_bytes(device)
    if available is None:
        return
    d, L, V, T = mcfg.n_embd, mcfg.n_layer, mcfg.vocab_size, mcfg.block_size
    d_ff = getattr(mcfg, "d_ff", None) or 4 * d
    params = V * d + L * (4 * d * d + 2 * d * d_ff)
    need = 16 * params + 4 * batch_size * T * ((6 * d + d_ff) * L + 2 * V)
    if need > available:
        raise UserError(f"the model and batch need at least {need / 2**30:.3g} GiB but {device} has "
                        f"{available / 2**30:.3g} GiB (model.n_layer={L}, model.n_embd={d}, model.d_ff={d_ff}, "
                        f"{vocab_name}={V}, model.block_size={T}, {batch_name}={batch_size}): make them smaller")


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
