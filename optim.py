"""The optimizer step and the learning-rate schedule, shared by train.py and bench.py.

`train.optimizer` picks the optimizer (build_optimizer):
- adamw: AdamW with weight decay on matrices only (GPT.configure_optimizer).
- muon: torch.optim.Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) on the 2-D
  weights of every nn.Linear inside the blocks (attention and MLP matrices), AdamW on everything else
  (token embedding, an untied head, position table, norms, QK gains, biases), as Muon's authors
  prescribe. Its default `adjust_lr_fn="match_rms_adamw"` (Liu et al. 2025, arXiv 2502.16982) scales
  each matrix's orthogonalised update to AdamW's RMS, so Muon's lr sits near AdamW's. The two are one
  object, MuonAdamW, so the loop, GradScaler and checkpoints treat them as one optimizer.
The lr schedule (lr_at) gives train.lr's curve; every group follows it as a multiple of its own base lr
(its `lr_scale`: muon_lr / lr for Muon's group, 1 for AdamW's).
"""
import math
from contextlib import nullcontext

import torch
import torch.nn as nn

from common import UserError, all_ranks_agree

OPTIMIZERS = ("adamw", "muon")
MUON_ADJUST_LR = ("match_rms_adamw", "original")


def build_optimizer(model, tcfg, device):
    """The optimizer train.py steps, as `train.optimizer` names it, with fused AdamW kernels: one
    kernel per tensor instead of ~10 foreach ops over all of them (on 2 CPU cores at nanoGPT's CPU
    config an AdamW step takes 0.55 ms fused against 1.8 ms, ~3% of a training step)."""
    fused = device.type in ("cuda", "cpu")
    if tcfg.optimizer not in OPTIMIZERS:
        raise UserError(f"train.optimizer={tcfg.optimizer!r} is unknown: use one of {', '.join(OPTIMIZERS)}")
    if tcfg.optimizer == "adamw":
        return model.configure_optimizer(tcfg.lr, tcfg.weight_decay, (tcfg.beta1, tcfg.beta2), fused=fused)
    check_muon_config(tcfg)
    muon_params, decay, no_decay = split_params(model)
    muon_lr = tcfg.lr if tcfg.muon_lr is None else tcfg.muon_lr
    wd = tcfg.weight_decay if tcfg.muon_weight_decay is None else tcfg.muon_weight_decay
    muon = torch.optim.Muon([{"params": muon_params, "lr_scale": muon_lr / tcfg.lr}], lr=muon_lr, weight_decay=wd,
                            momentum=tcfg.muon_momentum, nesterov=True, ns_steps=tcfg.muon_ns_steps,
                            adjust_lr_fn=tcfg.muon_adjust_lr)
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": tcfg.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}],
                              lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), fused=fused)
    return MuonAdamW(muon, adamw, tcfg.muon_momentum_start, tcfg.muon_momentum_warmup)


def check_muon_config(tcfg):
    if tcfg.muon_lr is not None and not tcfg.muon_lr > 0:
        raise UserError(f"train.muon_lr={tcfg.muon_lr} must be > 0 (or unset: train.lr)")
    if tcfg.muon_weight_decay is not None and tcfg.muon_weight_decay < 0:
        raise UserError(f"train.muon_weight_decay={tcfg.muon_weight_decay} must be >= 0 (or unset)")
    for key in ("muon_momentum", "muon_momentum_start"):
        if not 0 <= getattr(tcfg, key) < 1:
            raise UserError(f"train.{key}={getattr(tcfg, key)} must be in [0, 1)")
    if tcfg.muon_momentum_warmup < 0 or tcfg.muon_ns_steps < 1:
        raise UserError("train.muon_momentum_warmup must be >= 0 and train.muon_ns_steps >= 1")
    if tcfg.muon_adjust_lr not in MUON_ADJUST_LR:
        raise UserError(f"train.muon_adjust_lr={tcfg.muon_adjust_lr!r} is unknown: use one of "
                        f"{', '.join(MUON_ADJUST_LR)}")


def split_params(model):
    """(muon, adamw_decay, adamw_no_decay) parameter lists, every parameter in exactly one: Muon gets
    the weight of each nn.Linear inside model.blocks (matrices that map hidden features to hidden
    features); AdamW the other 2-D weights (embedding, untied head, position table) with weight decay,
    and norms, QK gains and biases without. QK gains can be 2-D (one per head and channel) yet are
    gains, not maps: chosen by module, not by shape, they stay with AdamW."""
    in_blocks = {id(m.weight) for m in model.blocks.modules() if isinstance(m, nn.Linear)}
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():  # a tied weight is listed once
        if id(p) in in_blocks:
            muon.append(p)
        elif p.dim() == 2 and name.endswith("weight"):
            decay.append(p)
        else:
            no_decay.append(p)
    return muon, decay, no_decay


class MuonAdamW:
    """torch.optim.Muon and torch.optim.AdamW stepped as one optimizer.

    `param_groups` lists Muon's groups then AdamW's (the optimizers' own dicts, so setting a group's lr
    reaches the optimizer that owns it; GradScaler unscales every gradient through them); `step`,
    `zero_grad`, `state_dict` and `load_state_dict` cover both. With momentum warmup, Muon's momentum
    rises linearly from `momentum_start` to its group's target over `momentum_warmup` steps
    (modded-nanogpt's 0.85 -> 0.95); the step count is part of the state, so a resume continues it."""

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW, momentum_start=0.85, momentum_warmup=0):
        self.muon, self.adamw = muon, adamw
        self.momentum_start, self.momentum_warmup = momentum_start, momentum_warmup
        self.momentum_target = [g["momentum"] for g in muon.param_groups]
        self.steps = 0  # steps taken (a step skipped for non-finite gradients is not one)

    @property
    def param_groups(self):
        return self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self):
        return {**self.muon.state, **self.adamw.state}

    def momentum_at(self, step: int, target: float) -> float:
        if step >= self.momentum_warmup:
            return target
        return self.momentum_start + (target - self.momentum_start) * step / self.momentum_warmup

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, target in zip(self.muon.param_groups, self.momentum_target):
            group["momentum"] = self.momentum_at(self.steps, target)
        self.muon.step()
        self.adamw.step()
        self.steps += 1
        return loss

    def zero_grad(self, set_to_none: bool = True):
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict(), "steps": self.steps,
                "momentum_target": list(self.momentum_target)}

    def load_state_dict(self, state: dict):
        if "muon" not in state:
            raise UserError("cannot resume: the checkpoint's optimizer state is AdamW's (train.optimizer=adamw); "
                            "resume with the run's own train.optimizer")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
        self.steps, self.momentum_target = state["steps"], list(state["momentum_target"])

    def __repr__(self):
        return f"MuonAdamW(\n{self.muon!r},\n{self.adamw!r})"


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
    """Set every group's lr for this step: `lr` (train.lr's schedule) times the group's lr_scale."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)


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
