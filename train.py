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
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
from omegaconf import OmegaConf

import config  # noqa: F401  (registers the config schema with Hydra)
from attnstats import AttentionProbe
from checkpoint import CKPT_NAME, save_checkpoint
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
    for key in ("batch_size", "grad_accum", "eval_iters", "log_interval", "eval_interval", "probe_batch_size"):
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
    """One optimizer step over `grad_accum` micro-batches (x, y); returns the last micro-batch's
    loss as a tensor (reading it is a host sync, so the caller does that only when logging)."""
    for x, y in batches:
        with autocast:
            _, loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        scaler.scale(loss / grad_accum).backward()  # mean over micro-batches = one big batch
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


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


# ----------------------------------------------------------------------------- training

def train(cfg, run_name=None, run_group=None) -> dict:
    """Train the model `cfg` describes; write config, metrics, plots and checkpoint to cfg.out_dir."""
    if not cfg.out_dir:
        raise UserError("out_dir is unset: pass out_dir=DIR (train.py sets it to Hydra's run dir)")
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tcfg = cfg.train
    check_train_config(tcfg)
    torch.manual_seed(cfg.seed)
    device, ptdtype, autocast = setup_device(cfg.device, cfg.dtype)

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
    log.info("model: %.2fM parameters, %d layers x %d heads x %d head dim, block %d, vocab %d, scale %s%s",
             model.num_params() / 1e6, mcfg.n_layer, mcfg.n_head, mcfg.head_dim, mcfg.block_size,
             mcfg.vocab_size, mcfg.attn.scale, f", qk_norm={mcfg.attn.qk_norm_type}" if mcfg.attn.qk_norm else "")
    optimizer = model.configure_optimizer(tcfg.lr, tcfg.weight_decay, (tcfg.beta1, tcfg.beta2),
                                          fused=device.type == "cuda")
    scaler = torch.amp.GradScaler(device.type, enabled=ptdtype == torch.float16)
    fwd_model = torch.compile(model) if cfg.compile else model

    # what this run is, recorded before it starts
    resolved = OmegaConf.to_container(cfg, resolve=True)
    (out_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    (out_dir / "run_info.json").write_text(json.dumps(run_info(device), indent=1))
    tracker = Tracker(out_dir, cfg, name=run_name or out_dir.name, group=run_group)
    probe_every = tcfg.eval_interval if tcfg.log_attn_interval is None else tcfg.log_attn_interval
    probe = None
    if probe_every > 0:  # a fixed batch from the val split, drawn once: curves compare across steps and runs
        px, _ = data.get_batch("val", tcfg.probe_batch_size, mcfg.block_size, torch.Generator().manual_seed(cfg.seed + 7))
        probe = AttentionProbe(px.to(device))

    tokens_per_step = tcfg.batch_size * tcfg.grad_accum * mcfg.block_size
    gen = torch.Generator().manual_seed(cfg.seed)  # the training sampler's own stream
    result = {"out_dir": str(out_dir), "best_val_loss": float("inf"), "tokens_per_sec": None}
    attn_history = []
    step, t_window, steps_window, t_start = 0, time.perf_counter(), 0, time.perf_counter()
    train_time = 0.0
    try:
        while True:
            last = step == tcfg.max_iters
            t_eval = time.perf_counter()
            if step % tcfg.eval_interval == 0 or last:
                losses = estimate_loss(fwd_model, data, tcfg, mcfg.block_size, device, cfg.seed, autocast)
                tracker.log({"train/loss": losses["train"], "val/loss": losses["val"]}, step)
                result.update({"train_loss": losses["train"], "val_loss": losses["val"]})
                result["best_val_loss"] = min(result["best_val_loss"], losses["val"])
                log.info("eval step %d: train loss %.4f, val loss %.4f", step, losses["train"], losses["val"])
            if probe is not None and (step % probe_every == 0 or last):
                stats = probe.run(model)
                tracker.log(stats, step)
                attn_history.append({"step": step, **stats})
            if (step % tcfg.eval_interval == 0 and step > 0) or last:
                save_checkpoint(out_dir / CKPT_NAME, {
                    "model": model.state_dict(), "model_config": dataclasses.asdict(mcfg),
                    "tokenizer": data.tokenizer.to_dict(), "step": step, "val_loss": result.get("val_loss"),
                    "optimizer": optimizer.state_dict(), "config": resolved})
            if last:
                break
            t_window += time.perf_counter() - t_eval  # evaluation time is not training time

            lr = lr_at(step, tcfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            batches = (data.get_batch("train", tcfg.batch_size, mcfg.block_size, gen) for _ in range(tcfg.grad_accum))
            loss = train_step(fwd_model, optimizer, batches, tcfg.grad_accum, tcfg.grad_clip, device, autocast, scaler)
            step += 1
            steps_window += 1

            if step % tcfg.log_interval == 0 or step == tcfg.max_iters:
                loss_value = loss.item()  # the only host sync of a training step
                elapsed = time.perf_counter() - t_window
                train_time += elapsed
                tok_s = steps_window * tokens_per_step / elapsed
                result["tokens_per_sec"] = tok_s
                tracker.log({"train/loss": loss_value, "lr": lr, "tokens_per_sec": tok_s,
                             "ms_per_iter": 1000 * elapsed / steps_window}, step)
                eta = (tcfg.max_iters - step) * elapsed / steps_window
                log.info("step %d/%d | loss %.4f | lr %.2e | %.0f tok/s | %.1f ms/iter | ETA %s", step,
                         tcfg.max_iters, loss_value, lr, tok_s, 1000 * elapsed / steps_window,
                         time.strftime("%H:%M:%S", time.gmtime(eta)))
                if not math.isfinite(loss_value):
                    raise UserError(f"loss is {loss_value} at step {step}: lower train.lr or check the data")
                steps_window, t_window = 0, time.perf_counter()
        try:
            from plots import plot_run
            for png in plot_run(out_dir):
                tracker.log_image(f"plots/{png.stem}", png, step)
        except Exception as e:  # a plot must never cost the run
            log.warning("plots skipped: %s", e)
    finally:
        tracker.close()
    result.update({"steps": step, "ckpt": str(out_dir / CKPT_NAME), "wall_s": time.perf_counter() - t_start,
                   "train_s": train_time, "attn": attn_history})
    log.info("done: val loss %.4f (best %.4f) after %d steps; run dir %s", result.get("val_loss", float("nan")),
             result["best_val_loss"], step, out_dir)
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
        return train(cfg, run_name=name, run_group=group)["best_val_loss"]
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
