"""Train a GPT from scratch.

    python train.py                                   # embedded corpus, CPU or GPU, a few minutes
    python train.py model=cpu_small data=shakespeare_char data.path=input.txt
    python train.py -m model.attn.scale=sqrt_dk,none  # a sweep: one run (and W&B run) per value

`train(cfg)` does the work and returns its results, so tests call it with a composed config;
`main` is the thin Hydra entry point.
"""
import dataclasses
import json
import logging
import math
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import numpy as np
import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP

import config  # noqa: F401  (registers the config schema with Hydra)
from attnstats import AttentionProbe
from checkpoint import (BEST_NAME, latest_checkpoint, load_checkpoint, load_weights, prune_checkpoints,
                        save_checkpoint, step_name)
from data.prepare import TokenData, prepare
from errors import UserError
from model import GPT, GPTConfig
from tracking import Tracker

log = logging.getLogger("attnlab")


# ----------------------------------------------------------------------------- setup helpers

def pick_device(name: str) -> torch.device:
    """auto: cuda > mps > cpu. An explicit device that is not there is an error, not a fallback."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"device={name} but no CUDA GPU is visible: use device=auto or device=cpu")
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("device=mps but MPS is not available: use device=auto or device=cpu")
    if name not in ("cpu", "mps") and not name.startswith("cuda"):
        raise UserError(f"device={name!r} is unknown: use auto, cpu, cuda, cuda:N or mps")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype: bfloat16 on GPUs that have it, float32 (no autocast) elsewhere."""
    if name == "auto":
        bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
        return torch.bfloat16 if bf16 else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise UserError(f"dtype={name!r} is unknown: use auto, float32, bfloat16 or float16")
    return dtypes[name]


# peak dense bf16 FLOP/s by GPU name (vendor figures), for MFU; a CPU has no entry: train.peak_flops
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12,
              "L4": 121e12, "A10": 125e12, "4090": 165e12, "3090": 71e12, "V100": 125e12}


def peak_flops(device, override=None):
    """The FLOP/s MFU is measured against: the user's figure, else the GPU's table entry."""
    if override:
        return float(override)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return None


def compile_wanted(flag, device) -> bool:
    """`compile`: true/false as given; unset means on for CUDA (it pays), off elsewhere."""
    return flag if flag is not None else device.type == "cuda"


def setup_device(device_name: str, dtype_name: str):
    """(device, autocast dtype, autocast context); TF32 matmuls on CUDA (free speed, fp32 range)."""
    device = pick_device(device_name)
    ptdtype = pick_dtype(dtype_name, device)
    autocast = torch.autocast(device.type, dtype=ptdtype) if ptdtype != torch.float32 else nullcontext()
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return device, ptdtype, autocast


def lr_at(step: int, tcfg) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at lr_decay_iters, then min_lr."""
    decay_iters = tcfg.lr_decay_iters or tcfg.max_iters
    if step < tcfg.warmup_iters:
        return tcfg.lr * (step + 1) / (tcfg.warmup_iters + 1)
    if step >= decay_iters:
        return tcfg.min_lr
    progress = (step - tcfg.warmup_iters) / max(1, decay_iters - tcfg.warmup_iters)
    return tcfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (tcfg.lr - tcfg.min_lr)


def check_train_config(tcfg):
    for key in ("batch_size", "grad_accum", "eval_iters", "log_interval", "eval_interval", "probe_batch_size",
                "keep_ckpts"):
        if getattr(tcfg, key) <= 0:
            raise UserError(f"train.{key}={getattr(tcfg, key)} must be a positive integer")
    if tcfg.max_iters < 0:
        raise UserError(f"train.max_iters={tcfg.max_iters} must be >= 0")
    if not (tcfg.lr > 0 and tcfg.min_lr >= 0):
        raise UserError(f"train.lr={tcfg.lr} must be > 0 and train.min_lr={tcfg.min_lr} >= 0")
    if tcfg.weight_decay < 0 or tcfg.grad_clip < 0 or tcfg.warmup_iters < 0:
        raise UserError("train.weight_decay, train.grad_clip and train.warmup_iters must be >= 0")


def run_info(device) -> dict:
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
            "cpu_threads": torch.get_num_threads(), "hostname": platform.node(), "argv": sys.argv}


def train_step(model, optimizer, batches, grad_accum, grad_clip, device, autocast, scaler):
    """One optimizer step over the micro-batches (x, y) of this process, each weighted
    1/grad_accum so the step sees their mean (DDP then averages over processes). Returns (loss of the last micro-batch, grad norm,
    finite): a step whose loss or gradients are not finite is skipped, the weights untouched."""
    batches = list(batches)
    for i, (x, y) in enumerate(batches):
        # under DDP, gradients are all-reduced once, on the last micro-batch
        sync = i == len(batches) - 1 or not hasattr(model, "no_sync")
        with (nullcontext() if sync else model.no_sync()), autocast:
            _, loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        scaler.scale(loss / grad_accum).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    # fp16's GradScaler skips steps with inf gradients by design; only the loss counts there
    finite = torch.isfinite(loss) & (torch.isfinite(grad_norm) | torch.tensor(scaler.is_enabled(), device=loss.device))
    finite = bool(finite.item())  # one host sync per step: never step on (or save) NaN weights
    if finite:
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm.detach(), finite


@torch.no_grad()
def estimate_loss(model, data, tcfg, block_size, device, seed, autocast):
    """Mean loss over a fixed set of eval_iters batches per split: the same tokens at every
    evaluation and in every run with the same seed, so curves and runs compare."""
    model.eval()
    out = {}
    for i, split in enumerate(("train", "val")):
        gen = torch.Generator().manual_seed(seed + 1000 + i)
        losses = []
        for _ in range(tcfg.eval_iters):
            x, y = data.get_batch(split, tcfg.batch_size, block_size, gen)
            with autocast:
                _, loss = model(x.to(device), y.to(device))
            losses.append(loss.item())
        out[split] = sum(losses) / len(losses)
    model.train()
    return out


# ----------------------------------------------------------------------------- resume, signals, DDP

def rng_state() -> dict:
    """Every random stream a training step may touch, as tensors and plain values."""
    np_state = np.random.get_state()
    return {"python": random.getstate(), "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()),
                                                   *np_state[2:]],
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict):
    random.setstate(tuple(tuple(x) if isinstance(x, list) else x for x in state["python"]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def resume_source(resume, out_dir: Path):
    """The checkpoint to resume from: `resume=true` means this run dir's newest one; any other
    value is a run dir or checkpoint file. None when not resuming."""
    if resume is None or str(resume).lower() in ("false", "none", "null", ""):
        return None
    if str(resume).lower() == "true":
        found = latest_checkpoint(out_dir)
        if found is None:
            raise UserError(f"resume=true but {out_dir} has no checkpoint: pass the run's dir "
                            "(hydra.run.dir=RUN_DIR resume=true) or resume=RUN_DIR")
        return found
    p = Path(resume).expanduser()
    found = latest_checkpoint(p) if p.is_dir() else (p if p.is_file() else None)
    if found is None:
        raise UserError(f"resume={resume}: no checkpoint there (give a run dir or a ckpt_*.pt file)")
    return found


def check_resumable(state: dict, cfg):
    """A checkpoint resumes only into the same model and data; name the first difference."""
    saved = state.get("config") or {}
    now = OmegaConf.to_container(cfg, resolve=True)
    for group, keys in (("model", None), ("data", ("name", "tokenizer", "val_fraction"))):
        a, b = saved.get(group, {}), now.get(group, {})
        for key in keys or sorted(set(a) | set(b)):
            if key != "vocab_size" and a.get(key) != b.get(key):
                raise UserError(f"cannot resume: {group}.{key} is {b.get(key)!r} here but {a.get(key)!r} in the "
                                "checkpoint; resume with the run's own config")


def truncate_metrics(path: Path, step: int):
    """Drop metric lines logged after the checkpoint we resume from (they will be logged again)."""
    if path.is_file():
        keep = [l for l in path.read_text().splitlines() if l.strip() and json.loads(l)["step"] <= step]
        path.write_text("".join(l + "\n" for l in keep))


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

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def init_distributed(device_name: str):
    """(rank, world_size, device) from torchrun's environment; a process group if world > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, None
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available() and device_name in ("auto", "cuda")
    if use_cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return rank, world, f"cuda:{local_rank}" if use_cuda else None


# ----------------------------------------------------------------------------- training

def train(cfg, run_name=None, run_group=None) -> dict:
    """Train the model `cfg` describes; write config, metrics, plots and checkpoints to cfg.out_dir.

    Under torchrun, each process trains on its share of every global batch and rank 0 alone
    writes. Returns a summary dict (losses, steps, throughput, paths)."""
    if not cfg.out_dir:
        raise UserError("out_dir is unset: pass out_dir=DIR (train.py sets it to Hydra's run dir)")
    tcfg = cfg.train
    check_train_config(tcfg)
    rank, world, ddp_device = init_distributed(cfg.device)
    master = rank == 0
    if not master:
        logging.getLogger().setLevel(logging.WARNING)
    if tcfg.grad_accum % world:
        raise UserError(f"train.grad_accum={tcfg.grad_accum} must be a multiple of the {world} processes: "
                        "each process takes an equal share of the micro-batches")
    local_accum = tcfg.grad_accum // world
    out_dir = Path(cfg.out_dir)
    source = resume_source(cfg.resume, out_dir)
    if source is not None:
        out_dir = source.parent  # a resumed run continues in its own directory
    elif master and ((out_dir / "metrics.jsonl").exists() or latest_checkpoint(out_dir) is not None):
        raise UserError(f"{out_dir} already holds a run: continue it with resume=true, or give a new "
                        "hydra.run.dir (nothing was overwritten)")
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device, ptdtype, autocast = setup_device(ddp_device or cfg.device, cfg.dtype)

    # data, then a model sized to its vocabulary
    data = TokenData(prepare(cfg.data))
    model_dict = OmegaConf.to_container(cfg.model, resolve=True)
    model_dict["vocab_size"] = model_dict.get("vocab_size") or data.vocab_size
    if model_dict["vocab_size"] < data.vocab_size:
        raise UserError(f"model.vocab_size={model_dict['vocab_size']} is smaller than the tokenizer's "
                        f"{data.vocab_size}: leave it unset")
    mcfg = GPTConfig(**model_dict)
    data.check_block_size(mcfg.block_size)
    model = GPT(mcfg).to(device)
    optimizer = model.configure_optimizer(tcfg.lr, tcfg.weight_decay, (tcfg.beta1, tcfg.beta2),
                                          fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type, enabled=ptdtype == torch.float16)
    gen = torch.Generator().manual_seed(cfg.seed)  # the training sampler's own stream, shared by all ranks
    step, best_val, wandb_id, state = 0, float("inf"), None, None
    if source is not None:
        state = load_checkpoint(source, map_location=device)
        check_resumable(state, cfg)
        load_weights(model, state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        gen.set_state(state["sampler"])
        set_rng_state(state["rng"])
        step, best_val, wandb_id = state["step"], state["best_val_loss"], state.get("wandb_id")
        log.info("resuming from %s at step %d", source, step)
    log.info("model: %.2fM parameters, %d layers x %d heads x %d head dim, block %d, vocab %d, scale %s%s",
             model.num_params() / 1e6, mcfg.n_layer, mcfg.n_head, mcfg.head_dim, mcfg.block_size,
             mcfg.vocab_size, mcfg.attn.scale, f", qk_norm={mcfg.attn.qk_norm_type}" if mcfg.attn.qk_norm else "")
    use_compile = compile_wanted(cfg.compile, device)
    fwd_model = torch.compile(model) if use_compile else model
    if world > 1:
        fwd_model = DDP(fwd_model, device_ids=[device.index] if device.type == "cuda" else None)

    # what this run is, recorded before it starts
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if master:
        (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        (out_dir / "run_info.json").write_text(json.dumps({**run_info(device), "world_size": world}, indent=1))
        if state is not None:
            truncate_metrics(out_dir / "metrics.jsonl", step)
    tracker = Tracker(out_dir, cfg, name=run_name or out_dir.name, group=run_group, enabled=master, run_id=wandb_id)
    probe_every = tcfg.eval_interval if tcfg.log_attn_interval is None else tcfg.log_attn_interval
    probe = None
    if master and probe_every > 0:  # a fixed val batch, drawn once: curves compare across steps and runs
        px, _ = data.get_batch("val", tcfg.probe_batch_size, mcfg.block_size, torch.Generator().manual_seed(cfg.seed + 7))
        probe = AttentionProbe(px.to(device))
    ckpt_every = tcfg.ckpt_interval or tcfg.eval_interval
    # nats/token -> bits/character: what compares runs with different tokenizers
    bpc_factor = len(data.splits["val"]) / data.meta["val_characters"] / math.log(2) if data.meta.get("val_characters") else None
    peak = peak_flops(device, tcfg.peak_flops)
    flops_per_token = model.flops_per_token()

    def save(step, val_loss):
        ckpt = {"model": model.state_dict(), "model_config": dataclasses.asdict(mcfg),
                "tokenizer": data.tokenizer.to_dict(), "step": step, "val_loss": val_loss,
                "best_val_loss": best_val, "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
                "sampler": gen.get_state(), "rng": rng_state(), "config": resolved,
                "wandb_id": tracker.run.id if tracker.run is not None else None}
        bad = [n for n, t in ckpt["model"].items() if t.is_floating_point() and not torch.isfinite(t).all()]
        if bad:  # never write a checkpoint that holds NaN/Inf
            raise UserError(f"weights are not finite at step {step} ({bad[0]}): not saving; "
                            f"last good checkpoint: {latest_checkpoint(out_dir)}")
        path = save_checkpoint(out_dir / step_name(step), ckpt)
        prune_checkpoints(out_dir, tcfg.keep_ckpts)
        return path

    tokens_per_step = tcfg.batch_size * tcfg.grad_accum * mcfg.block_size
    result = {"out_dir": str(out_dir), "best_val_loss": best_val, "tokens_per_sec": None, "stopped": None,
              "compiled": use_compile}
    attn_history, skipped, probe_time = [], 0, 0.0
    start_step, saved_at = step, step if state is not None else None
    stop = StopRequest()
    t_window, steps_window, t_start, train_time = time.perf_counter(), 0, time.perf_counter(), 0.0
    try:
        while True:
            last = step == tcfg.max_iters
            t_eval = time.perf_counter()
            # the step a resumed run starts at had its evaluations before its checkpoint was written
            if not (state is not None and step == start_step):
                if step % tcfg.eval_interval == 0 or last:
                    losses = estimate_loss(fwd_model, data, tcfg, mcfg.block_size, device, cfg.seed, autocast)
                    tracker.log({"train/loss": losses["train"], "val/loss": losses["val"],
                                 **({"val/bpc": losses["val"] * bpc_factor} if bpc_factor else {})}, step)
                    result.update({"train_loss": losses["train"], "val_loss": losses["val"]})
                    log.info("eval step %d: train loss %.4f, val loss %.4f", step, losses["train"], losses["val"])
                    if losses["val"] < best_val and master:
                        best_val = losses["val"]
                        save_checkpoint(out_dir / BEST_NAME, {"model": model.state_dict(),
                                        "model_config": dataclasses.asdict(mcfg), "tokenizer": data.tokenizer.to_dict(),
                                        "step": step, "val_loss": best_val, "config": resolved})
                if probe is not None and (step % probe_every == 0 or last):
                    t_probe = time.perf_counter()
                    stats = probe.run(model)
                    probe_time += time.perf_counter() - t_probe
                    tracker.log(stats, step)
                    attn_history.append({"step": step, **stats})
                if master and ((step % ckpt_every == 0 and step > 0) or last):
                    save(step, result.get("val_loss"))
                    saved_at = step
            if world > 1 and not last:  # every rank must stop at the same step
                flag = torch.tensor([stop.signal is not None], dtype=torch.float32, device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                stop.signal = stop.signal or ("SIGTERM" if flag.item() else None)
            if last or stop.signal:
                if stop.signal and master:
                    path = save(step, result.get("val_loss")) if saved_at != step else out_dir / step_name(step)
                    print(f"stopped by {stop.signal} at step {step}; checkpoint {path}\nresume with: "
                          f"python train.py hydra.run.dir={out_dir} resume=true (and the same overrides)",
                          file=sys.stderr)
                    result["stopped"] = stop.signal
                break
            t_window += time.perf_counter() - t_eval  # evaluation time is not training time

            lr = lr_at(step, tcfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            starts = data.sample_starts("train", (tcfg.grad_accum, tcfg.batch_size), mcfg.block_size, gen)
            mine = starts[rank * local_accum:(rank + 1) * local_accum]  # this process's share
            batches = (data.batch("train", s, mcfg.block_size) for s in mine)
            # DDP averages gradients over processes, so each weights its micro-batches by 1/local_accum
            loss, grad_norm, finite = train_step(fwd_model, optimizer, batches, local_accum, tcfg.grad_clip,
                                                 device, autocast, scaler)
            if not finite:
                skipped += 1
                log.warning("step %d: loss %s / grad norm %s not finite, step skipped (%d of %d allowed)",
                            step, loss.item(), grad_norm.item(), skipped, tcfg.skip_nonfinite)
                if skipped > tcfg.skip_nonfinite:
                    raise UserError(f"non-finite loss or gradients at step {step} (loss {loss.item()}); "
                                    f"last good checkpoint: {latest_checkpoint(out_dir) or 'none yet'}; "
                                    "lower train.lr or set train.skip_nonfinite=K to skip such steps")
            step += 1
            steps_window += 1

            if step % tcfg.log_interval == 0 or step == tcfg.max_iters:
                loss_value = loss.item()
                elapsed = time.perf_counter() - t_window
                train_time += elapsed
                tok_s = steps_window * tokens_per_step / elapsed
                result["tokens_per_sec"] = tok_s
                line = {"train/loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(), "tokens_per_sec": tok_s,
                        "ms_per_iter": 1000 * elapsed / steps_window}
                if peak:
                    line["mfu"] = flops_per_token * tok_s / peak
                tracker.log(line, step)
                eta = (tcfg.max_iters - step) * elapsed / steps_window
                log.info("step %d/%d | loss %.4f | lr %.2e | %.0f tok/s | %.1f ms/iter%s | ETA %s", step,
                         tcfg.max_iters, loss_value, lr, tok_s, 1000 * elapsed / steps_window,
                         f" | MFU {100 * line['mfu']:.1f}%" if peak else "", time.strftime("%H:%M:%S", time.gmtime(eta)))
                steps_window, t_window = 0, time.perf_counter()
        if master:
            try:
                from plots import plot_run
                for png in plot_run(out_dir):
                    tracker.log_image(f"plots/{png.stem}", png, step)
            except Exception as e:  # a plot must never cost the run
                log.warning("plots skipped: %s", e)
    finally:
        stop.restore()
        tracker.close()
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    result.update({"steps": step, "ckpt": str(latest_checkpoint(out_dir)), "best_val_loss": best_val,
                   "wall_s": time.perf_counter() - t_start, "train_s": train_time, "probe_s": probe_time,
                   "attn": attn_history})
    log.info("done: val loss %.4f (best %.4f) after %d steps; run dir %s; attention probes took %.2f s "
             "(%.2f%% of training time)", result.get("val_loss", float("nan")), best_val, step, out_dir,
             probe_time, 100 * probe_time / max(train_time, 1e-9))
    return result


def hydra_run_name():
    """(name, group) for W&B from Hydra: the job's overrides, and the sweep dir in multirun."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    name = hc.job.override_dirname or None
    group = Path(hc.sweep.dir).name if hc.mode == RunMode.MULTIRUN else None
    return name, group


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
def main(cfg):
    from hydra.core.hydra_config import HydraConfig

    if not cfg.out_dir:
        cfg.out_dir = HydraConfig.get().runtime.output_dir
    try:
        name, group = hydra_run_name()
        return train(cfg, run_name=name, run_group=group)["best_val_loss"]  # also when stopped by a signal
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
