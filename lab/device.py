"""The device a command runs on and what it can do: the device and autocast dtype (`Runtime`), the
memory check before allocating, whether running out of memory is what failed, the compile rule, peak
FLOP/s for MFU, a timer that waits for the GPU and a training run's throughput."""
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from rules import UserError

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
    fail. `need` is a lower bound from lab/counting.py; `keys` names the values to lower."""
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


def is_oom(e: BaseException) -> bool:
    """True for a failed allocation: CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and ("can't allocate memory" in str(e) or "out of memory" in str(e).lower()))


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


class Throughput:
    """Tokens/s and ms per step between two log lines, evaluation and probe time left out."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step, self.steps, self.train_s = tokens_per_step, 0, 0.0
        self.t0 = time.perf_counter()
        self.tokens_per_sec = None  # the latest reading

    @contextmanager
    def paused(self):
        t = time.perf_counter()
        yield
        self.t0 += time.perf_counter() - t

    def read(self):
        """(tokens/s, ms/step) since the last read; call after the device has finished the steps."""
        elapsed = time.perf_counter() - self.t0
        self.train_s += elapsed
        self.tokens_per_sec = self.steps * self.tokens_per_step / elapsed
        ms = 1000 * elapsed / self.steps
        self.steps, self.t0 = 0, time.perf_counter()
        return self.tokens_per_sec, ms
