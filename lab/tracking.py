"""Where metrics go: `metrics.jsonl` in the run dir (always) and Weights & Biases (offline by default),
and what a training run logs there besides its evaluations: each logged step's line (log_progress).

W&B never prompts and never needs the network unless the user asks: the mode is the user's
choice (`logger.wandb.mode` or WANDB_MODE), else offline. Its files go inside the run dir.
"""
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from lab.device import Throughput
from lab.stability import Watch
from rules import UserError

log = logging.getLogger("attnlab")

WANDB_MODES = ("offline", "online", "disabled")
WANDB_HOST = "https://api.wandb.ai"


def check_wandb_mode(wcfg):
    """The W&B mode is known and, for online, a key is there: a one-line error before any file is
    written, not wandb's UsageError traceback after the run dir was set up. Reads the key's usual
    places (WANDB_API_KEY, the netrc file `wandb login` writes) without the network."""
    mode = wcfg.mode
    if mode is not None and mode not in WANDB_MODES:
        raise UserError(f"logger.wandb.mode={mode!r} is unknown: use offline, online or disabled")
    if (mode or os.environ.get("WANDB_MODE")) == "online" and not wandb_key_present():
        raise UserError("logger.wandb.mode=online but no W&B API key is set: run `wandb login` (or set "
                        "WANDB_API_KEY), or leave the mode unset: offline is the default (`wandb sync` uploads later)")


def wandb_key_present() -> bool:
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    import netrc
    from urllib.parse import urlsplit
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    host = urlsplit(os.environ.get("WANDB_BASE_URL") or WANDB_HOST).netloc
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class Tracker:
    def __init__(self, out_dir, cfg, name=None, group=None, enabled=True, run_id=None):
        self.enabled = enabled  # False on DDP ranks > 0: nothing is written there
        self.path = Path(out_dir) / "metrics.jsonl"
        self.run = None
        if not enabled:
            return
        wcfg = cfg.logger.wandb
        mode = wcfg.mode
        check_wandb_mode(wcfg)  # before anything is written
        self.file = open(self.path, "a")
        if mode is None and not os.environ.get("WANDB_MODE"):
            mode = "offline"  # never reach for the network or a key unless asked to
        if mode == "disabled" or (mode is None and os.environ.get("WANDB_MODE") == "disabled"):
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.run = wandb.init(
            project=wcfg.project, entity=wcfg.entity, group=wcfg.group or group,
            name=wcfg.name or name, tags=list(wcfg.tags) or None, mode=mode,  # None: WANDB_MODE decides
            dir=str(out_dir), config=OmegaConf.to_container(cfg, resolve=True),
            reinit="finish_previous", id=run_id, resume="allow" if run_id else None)  # a resumed run keeps its W&B run
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")  # every key plots against the training step

    def log(self, metrics: dict, step: int):
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()
        if self.run is not None:
            self.run.log({"step": step, **metrics}, step=step)

    def log_image(self, key: str, path, step: int):
        if self.run is not None:
            import wandb
            self.run.log({key: wandb.Image(str(path))}, step=step)

    def summarize(self, results: dict):
        """The run's results: results.json in the run dir (written whole, then renamed into place) and
        the W&B run's summary."""
        if not self.enabled:
            return
        path = self.path.with_name("results.json")
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(results, indent=1, default=str) + "\n")
        os.replace(tmp, path)
        if self.run is not None:
            self.run.summary.update({k: v for k, v in results.items() if v is not None})

    def close(self):
        if not self.enabled:
            return
        self.file.close()
        if self.run is not None:
            self.run.finish()
            self.run = None


def read_metrics(path) -> list:
    """All lines of a metrics.jsonl (a run dir or the file itself). A torn last line, what a kill or
    a full disk mid-write leaves, is dropped with a warning; a bad line elsewhere is an error."""
    p = Path(path)
    p = p / "metrics.jsonl" if p.is_dir() else p
    try:
        lines = [line for line in p.read_text(errors="replace").splitlines() if line.strip()]
    except OSError as e:
        raise UserError(f"cannot read {p}: {e.strerror or e}") from None
    out = []
    for i, line in enumerate(lines):
        try:
            m = json.loads(line)
            if not isinstance(m, dict) or not isinstance(m.get("step"), int):
                raise ValueError("not a metrics line")
            out.append(m)
        except ValueError:  # JSONDecodeError is one
            if i == len(lines) - 1:
                log.warning("%s: dropping its torn last line (the run was killed mid-write)", p)
                break
            raise UserError(f"{p} line {i + 1} is not a metrics line (JSON with a step): the file was edited or "
                            "damaged; remove that line") from None
    return out


def truncate_metrics(path: Path, step: int):
    """Keep only the metric lines logged at or before `step` (a resumed run logs the rest again).
    Written to a temporary file and renamed, so a kill mid-way loses nothing."""
    if not path.is_file():
        return
    keep = [m for m in read_metrics(path) if m["step"] <= step]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(m) + "\n" for m in keep))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- a training run's lines

def log_metrics(tracker: Tracker, watch: Watch, step: int, line: dict):
    """One metrics line of a run's `step`: to metrics.jsonl and W&B, and to the run's stability watch."""
    tracker.log(line, step)
    watch.see(step, line)


@dataclass
class StepStats:
    """What one optimizer step reports (train.optimizer_step), for log_progress."""
    loss: torch.Tensor  # the mean loss of the step's global batch
    grad_norm: torch.Tensor
    lr: float
    aux: dict = field(default_factory=dict)  # this process's auxiliary losses (mixer.aux_metrics: an indexer's KL)
    log_z: Optional[torch.Tensor] = None  # train.z_loss > 0: the mean log Z of the output softmax
    update_norm: Optional[float] = None  # ||theta_after - theta_before||, on the steps that are logged


def log_progress(tracker: Tracker, watch: Watch, meter: Throughput, step: int, max_iters: int, stats: StepStats, *,
                 world: int, flops: Optional[float] = None, peak: Optional[float] = None):
    """The metrics line and the log line of training step `step` (of `max_iters`): loss, lr, norms,
    throughput, MFU (`flops` per token against a GPU's `peak`) and the auxiliary losses, each the mean
    over the `world` processes (every process calls it)."""
    loss = stats.loss.item()  # waits for the device, so the time read next covers its work
    tok_s, ms = meter.read()
    line = {"train/loss": loss, "lr": stats.lr, "grad_norm": stats.grad_norm.item(), "tokens_per_sec": tok_s,
            "ms_per_iter": ms, **({"update_norm": stats.update_norm} if stats.update_norm is not None else {}),
            **({"train/log_z": stats.log_z.item()} if stats.log_z is not None else {})}
    if peak:  # tokens_per_sec counts every process's tokens; MFU is per GPU
        line["mfu"] = flops * tok_s / (peak * world)
    for name, value in stats.aux.items():  # the mean over processes too, as the loss is
        value = value.clone()
        if world > 1:
            dist.all_reduce(value)
        line[f"aux/{name}"] = value.item() / world
    log_metrics(tracker, watch, step, line)
    eta = (max_iters - step) * ms / 1000
    log.info("step %d/%d | loss %.4f%s | lr %.2e | %.0f tok/s | %.1f ms/iter%s | ETA %s", step, max_iters, loss,
             "".join(f" | {name} {line[f'aux/{name}']:.4f}" for name in stats.aux), stats.lr, tok_s, ms,
             f" | MFU {100 * line['mfu']:.1f}%" if peak else "", time.strftime("%H:%M:%S", time.gmtime(eta)))
