"""Watching a training run for instability: divergence, attention collapse and loss spikes, as results.

A learning-rate sweep that crosses the unstable edge must survive it and say what happened there, so
none of these ends a run with an error:

- Divergence: the loss went non-finite more often than train.skip_nonfinite allows, or three
  evaluations in a row gave a val loss at or above the step-0 one (the run learned nothing, or
  unlearned it). The run stops early and records `diverged` (the step, why, the last finite loss)
  in results.json, metrics.jsonl and the W&B summary; a lone run then exits non-zero with one line,
  a sweep goes on with its next job (report_divergence; lab/sweep.py counts them).
- Attention collapse (Zhai et al. 2023, arXiv 2303.06296): a layer's mean attention entropy on the
  probe batch falls below train.collapse_entropy nats (default 0.1: about one key per query).
  Warned once per layer with the step and what usually prevents it; recorded, not an error. Without
  QK-Norm at a high lr the logits grow into the thousands (text A's A5; Dehghani et al. 2023; Wortsman
  et al. 2023, arXiv 2309.14322) and every head goes one-hot.
- Loss spikes: OLMo 2's spike score (OLMo et al. 2024, arXiv 2501.00656), the share of steps whose
  value is more than SPIKE_SIGMA standard deviations above the mean of the SPIKE_WINDOW steps before
  it, for the training loss and the gradient norm, beside the largest gradient and update norms
  (in large runs the update norm's spikes come before the loss's).

The loop hands every metrics line it logs to Watch.see (evaluations, probes, norms) and each step's
loss and gradient norm to Watch.step, and ends when Watch.stop is set. A non-finite loss the freshly
initialised model already gives is no divergence but an error (nonfinite_error): its config is at fault.
One remedy lives here too: PaLM's z-loss (z_loss_term, train.z_loss), which keeps the output softmax's
normaliser from drifting.
"""
import logging
import math
import sys
from collections import deque
from pathlib import Path
from typing import Optional

from rules import UserError

log = logging.getLogger("attnlab")

DIVERGED_EVALS = 3  # evaluations in a row at or above the step-0 val loss
SPIKE_WINDOW, SPIKE_SIGMA = 100, 7.0  # OLMo 2 uses 1000 steps; our runs are a few hundred to a few thousand
COLLAPSE_HINT = ("QK-Norm (model.attn.qk_norm=true), a lower train.lr, a longer train.warmup_iters or an "
                 "attention soft-cap (model.attn.softcap) usually prevent it")


def z_loss_term(logits, targets) -> tuple:
    """PaLM's auxiliary z-loss (Chowdhery et al. 2022, arXiv 2204.02311): the mean over predicted
    positions of (log Z)^2, Z = sum_v exp(logit_v), which pulls the softmax's normaliser toward 1 (log Z
    toward 0) without changing which token wins. Returns ((log Z)^2, log Z), both means over positions
    whose target is not -1."""
    log_z = logits.float().logsumexp(dim=-1)
    keep = (targets != -1).float()
    n = keep.sum().clamp(min=1)
    return (log_z.square() * keep).sum() / n, (log_z.detach() * keep).sum() / n


def spike_score(values, window: int = SPIKE_WINDOW, sigma: float = SPIKE_SIGMA) -> Optional[float]:
    """The share of values more than `sigma` standard deviations (population sd) above the mean of the
    `window` values before each, over the values that have a full window; None when none has. Non-finite
    values are left out. Rolling sums: one pass."""
    values = [float(v) for v in values if math.isfinite(v)]
    if len(values) <= window:
        return None
    s = sum(values[:window])
    s2 = sum(v * v for v in values[:window])
    spikes = 0
    for i in range(window, len(values)):
        mean = s / window
        sd = math.sqrt(max(s2 / window - mean * mean, 0.0))
        spikes += values[i] > mean + sigma * sd
        s += values[i] - values[i - window]
        s2 += values[i] * values[i] - values[i - window] ** 2
    return spikes / (len(values) - window)


class Watch:
    """What one run's metrics say about its stability. `see(step, line)` takes every metrics line
    the run logs; `stop` is the divergence that ends the run (None while it trains on); `results()`
    the figures for results.json. Its state rides in every checkpoint (state_dict), so a resumed
    run keeps its step-0 loss, its warnings and its extremes."""

    def __init__(self, collapse_entropy: float = 0.1):
        self.collapse_entropy = collapse_entropy  # 0: not watched
        self.val0: Optional[float] = None  # the step-0 val loss
        self.high_evals = 0  # evaluations in a row at or above val0
        self.last_finite_loss: Optional[float] = None
        self.stop: Optional[dict] = None  # {"step", "reason", "last_finite_loss"} once diverged
        self.collapsed: dict = {}  # layer -> {"step", "entropy", "logit_max"} when first seen collapsed
        self.logit_max: Optional[float] = None  # the largest attention logit any probe saw
        self.entropy_min: Optional[float] = None  # the lowest layer-mean entropy any probe saw
        self.losses, self.grad_norms = deque(maxlen=100_000), deque(maxlen=100_000)
        self.grad_norm_max: Optional[float] = None
        self.update_norm_max: Optional[float] = None

    # -------------------------------------------------------------- what the run logs

    def see(self, step: int, line: dict):
        """Read one metrics line: a step's loss and norms, an evaluation, or a probe."""
        if "update_norm" in line:
            self.update_norm_max = max_of(self.update_norm_max, line["update_norm"])
        if "val/loss" in line:
            self.evaluation(step, line["val/loss"])
        entropies = {key.split("/")[1]: v for key, v in line.items()
                     if key.startswith("attn_entropy/L") and key.count("/") == 1}
        if entropies:
            self.probe(step, line, entropies)

    def step(self, step: int, loss: float, grad_norm: Optional[float]):
        """Every training step's loss and gradient norm (floats: the step has synchronised already)."""
        if math.isfinite(loss):
            self.last_finite_loss = loss
            self.losses.append(loss)
        if grad_norm is not None and math.isfinite(grad_norm):
            self.grad_norms.append(grad_norm)
            self.grad_norm_max = max_of(self.grad_norm_max, grad_norm)

    def nonfinite(self, step: int, loss: float, allowed: int):
        """The step's loss or gradients were not finite more than `allowed` times: diverged."""
        self.diverge(step, f"the loss or gradients were not finite ({loss}) more than train.skip_nonfinite="
                           f"{allowed} times")

    def evaluation(self, step: int, val: float):
        if step == 0 or self.val0 is None:
            self.val0 = val if step == 0 else self.val0
            return
        self.high_evals = self.high_evals + 1 if not val < self.val0 else 0  # NaN counts as high
        if self.high_evals >= DIVERGED_EVALS:
            self.diverge(step, f"val loss {val:.4f} at or above its step-0 value {self.val0:.4f} in "
                               f"{DIVERGED_EVALS} evaluations in a row")

    def probe(self, step: int, line: dict, entropies: dict):
        logits = [v for key, v in line.items() if key.startswith("attn_logit_max/L") and math.isfinite(v)]
        if logits:
            self.logit_max = max_of(self.logit_max, max(logits))
        finite = [v for v in entropies.values() if math.isfinite(v)]
        if finite:
            self.entropy_min = min(finite) if self.entropy_min is None else min(self.entropy_min, min(finite))
        for layer, entropy in sorted(entropies.items()):
            if not (self.collapse_entropy and entropy < self.collapse_entropy) or layer in self.collapsed:
                continue
            top = line.get(f"attn_logit_max/{layer}")
            self.collapsed[layer] = {"step": step, "entropy": entropy, "logit_max": top}
            log.warning("step %d: attention in layer %s collapsed: mean entropy %.3f nats < train.collapse_entropy="
                        "%g (about one key per query)%s; %s", step, layer, entropy, self.collapse_entropy,
                        "" if top is None else f", largest logit {top:.4g}", COLLAPSE_HINT)

    def diverge(self, step: int, reason: str):
        if self.stop is None:
            self.stop = {"step": step, "reason": reason, "last_finite_loss": self.last_finite_loss}

    # -------------------------------------------------------------- what the run records

    def results(self) -> dict:
        """The run's stability figures, for results.json and the W&B summary."""
        return {"diverged": self.stop is not None,
                **({f"diverged_{k}": v for k, v in self.stop.items()} if self.stop else {}),
                "collapsed_layers": sorted(self.collapsed), "collapse": self.collapsed,
                "attn_logit_max_run": self.logit_max, "attn_entropy_min_run": self.entropy_min,
                "loss_spike_score": spike_score(self.losses), "grad_norm_spike_score": spike_score(self.grad_norms),
                "grad_norm_max": self.grad_norm_max, "update_norm_max": self.update_norm_max,
                "val_loss_step0": self.val0}

    def state_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, deque) else v) for k, v in vars(self).items()}

    def load_state_dict(self, state: dict):
        for k, v in state.items():
            if hasattr(self, k):
                setattr(self, k, deque(v, maxlen=100_000) if isinstance(getattr(self, k), deque) else v)


def max_of(a, b):
    return b if a is None else max(a, b)


def suspects(tcfg) -> list:
    """Training settings far outside their sensible range that make a loss blow up whatever the lr: a
    z-loss weight (PaLM: 1e-4) whose c·(log Z)² overflows, a weight decay that shrinks weights by half
    or more per step. The lines name the user's own keys."""
    found = []
    if getattr(tcfg, "z_loss", 0) and tcfg.z_loss > 1e-2:
        found.append(f"train.z_loss={tcfg.z_loss} (PaLM uses 1e-4; its c·(log Z)² term overflows)")
    independent = getattr(tcfg, "weight_decay_mode", "coupled") == "independent"
    for key, lr in (("weight_decay", tcfg.lr), ("muon_weight_decay", getattr(tcfg, "muon_lr", None) or tcfg.lr)):
        wd = getattr(tcfg, key, None)
        if key == "muon_weight_decay" and (getattr(tcfg, "optimizer", "adamw") != "muon" or wd is None):
            continue
        shrink = wd if independent else wd * lr
        if wd and shrink >= 0.5:
            found.append(f"train.{key}={wd} (shrinks every matrix by {shrink:.0%} per step at the peak)")
    return found


def diverged_line(results: dict) -> str:
    """One line that says a run diverged, where, and what it last had; what to change: the settings
    suspects() named, else the lr."""
    last = results.get("diverged_last_finite_loss")
    fix = (f"lower {' and '.join(results['suspects'])}" if results.get("suspects") else
           f"lower train.lr (now {results.get('lr')}), raise train.warmup_iters, or turn on model.attn.qk_norm")
    return (f"diverged at step {results['diverged_step']}: {results['diverged_reason']}; last finite training loss "
            f"{'none' if last is None else f'{last:.4f}'}; last good checkpoint: "
            f"{results.get('last_good_checkpoint') or 'none'}; {fix}")


def nonfinite_error(step: int, loss: float, good: Optional[Path], fresh: bool, lr: float, tcfg=None) -> UserError:
    """Name the likely cause of a non-finite loss at `step` (`good`: the last good checkpoint, or None):
    a training setting suspects() names (`tcfg`: the train config); else, before any update (`fresh`)
    the learning rate has not acted yet, so the model config (or the data) is at fault; after updates, a
    step size (`lr`) too large for the model."""
    where = f"non-finite loss or gradients at step {step} (loss {loss}); last good checkpoint: " + \
        f"{good or ('none: nothing was trained yet' if fresh else 'none yet')}"
    named = suspects(tcfg) if tcfg is not None else []
    if named:
        return UserError(f"{where}; the likely cause: {'; '.join(named)}: lower it")
    if fresh:
        return UserError(f"{where}; the freshly initialised model already gives it, so the learning rate is not "
                         "the cause: check the model.* values (one out of its sensible range?) and the data")
    return UserError(f"{where}; the usual cause is a step too large for this model: lower train.lr (now {lr}) "
                     "or raise train.warmup_iters, or set train.skip_nonfinite=K to skip such steps")


def report_divergence(result: dict, sweep: bool):
    """A diverged run (`result`: what train() returns) is a result: a job of a `sweep` says so on stderr
    and the sweep goes on with its next job; a lone run ends with the one-line error."""
    if result["diverged"]:
        line = f"{diverged_line(result)}; run dir {result['out_dir']}"
        if not sweep:
            raise UserError(line)
        print(line, file=sys.stderr)
