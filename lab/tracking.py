"""Where metrics go: `metrics.jsonl` in the run dir (always) and Weights & Biases (offline by default).

W&B never prompts and never needs the network unless the user asks: the mode is the user's
choice (`logger.wandb.mode` or WANDB_MODE), else offline. Its files go inside the run dir.
"""
import json
import logging
import os
from pathlib import Path

from omegaconf import OmegaConf

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
