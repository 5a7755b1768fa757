"""What every entry point shares: the one error type and how it ends a command, the device,
dtype and autocast, distributed setup, peak FLOP/s for MFU, the compile rule, and a timer that
waits for the GPU. Entry points import this, never each other (nanochat keeps the same
nanochat/common.py)."""
import functools
import os
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
    Ctrl-C with one line and status 130, never a traceback."""
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
    return wrapper


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


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype. auto: bf16 on GPUs with native bf16, fp16 (with a grad scaler) on
    older GPUs, float32 (no autocast) on CPU and MPS."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if has_native_bf16(device) else torch.float16
    if name not in DTYPES:
        raise UserError(f"dtype={name!r} is unknown: use auto, float32, bfloat16 or float16")
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


def compile_wanted(flag, device) -> bool:
    """`compile`: true/false as given; unset means on for CUDA (it pays), off elsewhere."""
    return flag if flag is not None else device.type == "cuda"


# Peak dense tensor FLOP/s by exact GPU model (vendor datasheets, without sparsity), per dtype
# family: 16-bit (bf16/fp16) and fp32 (TF32 tensor cores where the GPU has them). Names are
# matched as whole words in order, most specific first, so "H100 PCIe" is not an SXM part and
# "L40" is not an "L4".
PEAK_FLOPS = [  # (words in torch.cuda.get_device_name, 16-bit peak, fp32/TF32 peak)
    (("H200", "NVL"), 835e12, 418e12), (("H200",), 989e12, 495e12),
    (("H100", "PCIe"), 756e12, 378e12), (("H100", "NVL"), 835e12, 418e12), (("H100",), 989e12, 495e12),
    (("H800", "PCIe"), 756e12, 378e12), (("H800",), 989e12, 495e12),
    (("A100",), 312e12, 156e12), (("A800",), 312e12, 156e12),
    (("L40S",), 362e12, 183e12), (("L40",), 181e12, 90.5e12), (("L4",), 121e12, 60e12),
    (("A10",), 125e12, 62.5e12), (("4090",), 165e12, 82.6e12), (("3090",), 71e12, 35.6e12),
    (("V100",), 125e12, 15.7e12),  # V100: fp16 tensor cores; no bf16, no TF32
    (("T4",), 65e12, 8.1e12),
]


def peak_flops_for(name: str, dtype: torch.dtype):
    """The table entry for a GPU name and compute dtype, or None."""
    words = set(name.replace("-", " ").split())
    for keys, half, single in PEAK_FLOPS:
        if all(k in words for k in keys):
            return half if dtype in (torch.bfloat16, torch.float16) else single
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
