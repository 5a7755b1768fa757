"""The optimizers and the learning-rate schedule, shared by train.py and tools/bench.py (the training
step itself, which steps them, is train.train_step).

`train.optimizer` picks the optimizer (build_optimizer):
- adamw: AdamW with weight decay on matrices only (adamw).
- muon: torch.optim.Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) on the 2-D
  weights of every nn.Linear inside the blocks (attention and MLP matrices), AdamW on everything else
  (token embedding, an untied head, position table, norms, QK gains, biases), as Muon's authors
  prescribe. Its default `adjust_lr_fn="match_rms_adamw"` (Liu et al. 2025, arXiv 2502.16982) scales
  each matrix's orthogonalised update to AdamW's RMS, so Muon's lr sits near AdamW's. The two are one
  object, MuonAdamW, so the loop, GradScaler and checkpoints treat them as one optimizer.
Muon's Newton-Schulz iteration runs in `train.muon_ns_dtype` (optim.Muon): torch.optim.Muon always
casts to bf16, right on GPUs with bf16 matrix units, but on a CPU without them (no AMX) a bf16 matmul
is slower than an fp32 one, so `auto` picks fp32 there.
The lr schedule (lr_at) gives train.lr's curve; every group follows it as a multiple of its own base lr
(its `lr_scale`: muon_lr / lr for Muon's group, 1 for AdamW's). A step's micro-batches (micro_batches) and
the norm of what it changed (params_now, update_norm) are here too.
"""
import math

import torch
import torch.nn as nn

from lab.device import has_native_bf16
from rules import UserError

OPTIMIZERS = ("adamw", "muon")
MUON_ADJUST_LR = ("match_rms_adamw", "original")
MUON_NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build_optimizer(model, tcfg, device):
    """The optimizer train.py steps, as `train.optimizer` names it, with fused AdamW kernels: one
    kernel per tensor instead of ~10 foreach ops over all of them (on 2 CPU cores at nanoGPT's CPU
    config an AdamW step takes 0.55 ms fused against 1.8 ms, ~3% of a training step)."""
    fused = device.type in ("cuda", "cpu")
    if tcfg.optimizer == "adamw":
        return adamw(model, tcfg.lr, decay_factor(tcfg.weight_decay, tcfg.lr, tcfg), (tcfg.beta1, tcfg.beta2),
                     fused=fused)
    muon_params, decay, no_decay = split_params(model)
    muon_lr = tcfg.lr if tcfg.muon_lr is None else tcfg.muon_lr
    wd = decay_factor(tcfg.weight_decay if tcfg.muon_weight_decay is None else tcfg.muon_weight_decay, muon_lr, tcfg)
    ns_dtype = tcfg.muon_ns_dtype
    if ns_dtype == "auto":  # bf16 where matmuls run natively in it (torch's choice), else fp32
        ns_dtype = "bfloat16" if has_native_bf16(device) else "float32"
    groups = [{"params": muon_params, "lr_scale": muon_lr / tcfg.lr}]
    if tcfg.muon_split_qkv:  # q, k and v orthogonalised apart, as if three matrices (modded-nanogpt does)
        qkv = {id(m.c_attn.weight) for m in model.blocks.modules() if hasattr(m, "c_attn")}
        c = model.config
        groups = [{"params": [p for p in muon_params if id(p) not in qkv], "lr_scale": muon_lr / tcfg.lr},
                  {"params": [p for p in muon_params if id(p) in qkv], "lr_scale": muon_lr / tcfg.lr,
                   "split": [c.n_head * c.head_dim, c.n_kv_head * c.head_dim, c.n_kv_head * c.head_dim]}]
    muon = Muon(groups, lr=muon_lr, weight_decay=wd,
                momentum=tcfg.muon_momentum, nesterov=True, ns_steps=tcfg.muon_ns_steps,
                adjust_lr_fn=tcfg.muon_adjust_lr, ns_dtype=MUON_NS_DTYPES[ns_dtype])
    rest = torch.optim.AdamW([{"params": decay, "weight_decay": decay_factor(tcfg.weight_decay, tcfg.lr, tcfg)},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2), fused=fused)
    return MuonAdamW(muon, rest, tcfg.muon_momentum_start, tcfg.muon_momentum_warmup)


def micro_batches(tcfg, world: int) -> int:
    """Micro-batches per step over all `world` processes: train.grad_accum, an equal share for each."""
    grad_accum = tcfg.grad_accum or world  # unset: one micro-batch per process
    if grad_accum % world:
        raise UserError(f"train.grad_accum={grad_accum} must be a multiple of the {world} processes: "
                        "each process takes an equal share of the micro-batches (or leave it unset)")
    return grad_accum


def params_now(model: nn.Module) -> list:
    """A copy of the parameters as the optimizer sees them. Under FSDP an eval's forward (no backward)
    leaves the root's parameters gathered; resharding first makes every copy a shard like the params."""
    if hasattr(model, "reshard"):
        model.reshard()
    return [p.detach().clone() for p in model.parameters()]


def update_norm(before: list, model: nn.Module) -> float:
    """The global L2 norm of what the optimizer step changed, ||theta_after - theta_before|| (under
    FSDP each process holds a shard: the squares are summed over processes)."""
    total = 0.0
    for old, p in zip(before, model.parameters()):
        sq = (p.detach() - old).float().pow(2).sum()
        total = total + (sq.full_tensor() if hasattr(sq, "full_tensor") else sq)
    return math.sqrt(float(total))


WEIGHT_DECAY_MODES = ("coupled", "independent")


def decay_factor(weight_decay: float, peak_lr: float, tcfg) -> float:
    """The weight_decay torch's AdamW (and Muon) take, whose step shrinks a weight by lr_t * weight_decay.
    train.weight_decay_mode=coupled (the default, AdamW as Loshchilov & Hutter wrote it): that product,
    so the decay grows with the peak lr. independent (Wortsman et al. 2023, arXiv 2309.14322): the shrink
    per step is s_t * weight_decay, s_t = lr_t / peak lr the schedule's factor, whatever the peak lr, so
    an lr sweep changes the step size alone; torch's factor is then weight_decay / peak lr."""
    independent = getattr(tcfg, "weight_decay_mode", "coupled") == "independent"
    return weight_decay / peak_lr if independent else weight_decay


def min_lr(tcfg) -> float:
    """The schedule's floor: train.min_lr_ratio times the peak lr when set (an lr sweep then decays
    every lr to the same fraction), else train.min_lr."""
    ratio = getattr(tcfg, "min_lr_ratio", None)
    return tcfg.lr * ratio if ratio is not None else tcfg.min_lr


def adamw(model, lr, weight_decay, betas=(0.9, 0.95), fused=False):
    """AdamW with weight decay on matrices (Linear weights, embedding) only, not on biases, norm
    weights or QK gains (Loshchilov & Hutter 2019)."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if n.endswith("weight") and p.dim() == 2]
    no_decay = [p for n, p in named if not (n.endswith("weight") and p.dim() == 2)]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)


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


def newton_schulz(G, steps: int, coefficients=(3.4445, -4.775, 2.0315), eps: float = 1e-7, dtype=torch.bfloat16):
    """G (m, n) -> about U S' V^T where G = U S V^T and S' ~ [0.5, 1.5]: Muon's "orthogonalised" update,
    by torch.optim.Muon's quintic iteration (Jordan et al. 2024), run in `dtype`. With bf16 the result
    is torch's, bit for bit (tested); fp32 is what this iteration computes without bf16 rounding."""
    a, b, c = coefficients
    X = G.to(dtype)
    tall = X.size(0) > X.size(1)
    if tall:  # iterate on the wide side: X Xᵀ is then the smaller Gram matrix
        X = X.T
    X = X / X.norm().clamp(min=eps)  # Frobenius norm 1, so every singular value <= 1
    for _ in range(steps):
        A = X @ X.T
        X = torch.addmm(X, torch.addmm(A, A, A, beta=b, alpha=c), X, beta=a)  # (a + b A + c A²) X
    return X.T if tall else X


class Muon(torch.optim.Muon):
    """torch.optim.Muon with its Newton-Schulz iteration in `ns_dtype`: the same state, hyperparameters
    and update, step for step, and with ns_dtype=bf16 the same bits (tested). torch's always runs it in
    bf16; on these CPUs (no AMX) that is the slow choice: the 16 matrices of nanoGPT's CPU config took
    55.7 ms per step in bf16 and 25.7 ms in fp32 (one thread).
    A group with "split": [rows, ...] orthogonalises those blocks of rows of each matrix apart, each with
    its own lr factor (train.muon_split_qkv: the fused q|k|v projection as three matrices)."""

    def __init__(self, params, ns_dtype=torch.bfloat16, **kw):
        super().__init__(params, **kw)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        if self.ns_dtype == torch.bfloat16 and not any("split" in g for g in self.param_groups):
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            self._init_group(group, params, grads, bufs)  # torch's: momentum buffers created as it does
            lr, mu = group["lr"], group["momentum"]
            for p, g, buf in zip(params, grads, bufs):
                buf.lerp_(g, 1 - mu)  # momentum: an EMA of gradients
                update = g.lerp(buf, mu) if group["nesterov"] else buf
                p.mul_(1 - lr * group["weight_decay"])  # decoupled weight decay
                rows = group.get("split", [p.size(0)])
                for block, u in zip(p.split(rows), update.split(rows)):  # views: p is updated in place
                    u = newton_schulz(u, group["ns_steps"], group["ns_coefficients"], group["eps"], self.ns_dtype)
                    block.add_(u, alpha=-lr * muon_lr_ratio(group["adjust_lr_fn"], block.shape))
        return loss


def muon_lr_ratio(adjust_lr_fn, shape) -> float:
    """torch.optim.Muon's per-matrix lr factor for a (A, B) weight: match_rms_adamw gives the update
    AdamW's typical RMS (0.2 sqrt(max(A, B))); original (Keller Jordan's) sqrt(max(1, A / B))."""
    A, B = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, A / B))
    return 0.2 * math.sqrt(max(A, B)) if adjust_lr_fn == "match_rms_adamw" else 1.0


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


def cosine(progress: float, cooldown_frac: float) -> float:
    """Half a cosine from 1 down to 0 over the whole decay (Loshchilov & Hutter 2017)."""
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def wsd(progress: float, cooldown_frac: float) -> float:
    """Warmup-stable-decay (trapezoidal): 1 until the last cooldown_frac of the decay, then a
    straight line to 0 (Hägele et al. 2024, arXiv 2405.18392; modded-nanogpt's schedule)."""
    return min(1.0, (1.0 - progress) / cooldown_frac)


LR_SCHEDULES = {"cosine": cosine, "wsd": wsd}


def lr_at(step: int, tcfg) -> float:
    """Linear warmup to lr, then `train.lr_schedule`'s decay to min_lr at lr_decay_iters, then min_lr."""
    decay_iters = tcfg.lr_decay_iters or tcfg.max_iters
    floor = min_lr(tcfg)
    if step < tcfg.warmup_iters:
        return tcfg.lr * (step + 1) / (tcfg.warmup_iters + 1)
    if step >= decay_iters:
        return floor
    progress = (step - tcfg.warmup_iters) / max(1, decay_iters - tcfg.warmup_iters)
    return floor + LR_SCHEDULES[tcfg.lr_schedule](progress, tcfg.cooldown_frac) * (tcfg.lr - floor)


def set_lr(optimizer, lr: float):
    """Set every group's lr for this step: `lr` (train.lr's schedule) times the group's lr_scale."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
