"""The optimizer step and the learning-rate schedule, shared by train.py and bench.py."""
import math
from contextlib import nullcontext

import torch

from common import all_ranks_agree


def build_optimizer(model, tcfg, device):
    """The optimizer train.py steps: AdamW with weight decay on matrices only (see
    GPT.configure_optimizer); fused kernels on CUDA."""
    return model.configure_optimizer(tcfg.lr, tcfg.weight_decay, (tcfg.beta1, tcfg.beta2),
                                     fused=device.type == "cuda")


def lr_at(step: int, tcfg) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at lr_decay_iters, then min_lr."""
    decay_iters = tcfg.lr_decay_iters or tcfg.max_iters
    if step < tcfg.warmup_iters:
        return tcfg.lr * (step + 1) / (tcfg.warmup_iters + 1)
    if step >= decay_iters:
        return tcfg.min_lr
    progress = (step - tcfg.warmup_iters) / max(1, decay_iters - tcfg.warmup_iters)
    return tcfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (tcfg.lr - tcfg.min_lr)


def set_lr(optimizer, lr: float):
    for group in optimizer.param_groups:
        group["lr"] = lr


def train_step(model, optimizer, batches, grad_accum, grad_clip, runtime, scaler, world=1):
    """One optimizer step over this process's micro-batches (x, y), each weighted 1/grad_accum so
    the step sees their mean (DDP then averages over processes). Returns (loss of the last
    micro-batch, grad norm, finite): a step whose loss or gradients are not finite on any rank
    is skipped on every rank, the weights untouched."""
    batches = list(batches)
    device = runtime.device
    for i, (x, y) in enumerate(batches):
        # under DDP, gradients are all-reduced once, on the last micro-batch
        sync = i == len(batches) - 1 or not hasattr(model, "no_sync")
        with (nullcontext() if sync else model.no_sync()), runtime.autocast():
            _, loss = model(x.to(device, non_blocking=True), y.to(device, non_blocking=True))
        scaler.scale(loss / grad_accum).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    # fp16's GradScaler skips steps with inf gradients by design (and lowers its scale); only the loss counts there
    finite = torch.isfinite(loss) & (torch.isfinite(grad_norm) | torch.tensor(scaler.is_enabled(), device=loss.device))
    # one host sync per step: never step on (or save) NaN weights; every rank takes the same decision
    finite = not all_ranks_agree(not bool(finite.item()), device, world)
    if finite:
        scaler.step(optimizer)
    scaler.update()  # also after a skipped step: unscale_ above must be paired with an update
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm.detach(), finite
