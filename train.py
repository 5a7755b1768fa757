"""Train a GPT from scratch.

    python train.py                                   # embedded corpus, CPU or GPU, a few minutes
    python train.py model=cpu_small data=shakespeare_char data.path=input.txt
    python train.py -m model.attn.scale=sqrt_dk,none  # a sweep: one run (and W&B run) per value

A run is setup -> loop -> finish. setup() checks the whole config first, then builds what the run
needs top-down: the data, the model, the optimizer, the restored state when resuming, and the record
of what this run is. The loop, in train(), evaluates, probes the attention, checkpoints and takes
optimizer steps; the step itself (forward and loss over the micro-batches, backward with gradient
accumulation, clipping, the non-finite check, the optimizer's step) is train_step, here. What a
checkpoint of the run holds (its TrainState beside the weights and the optimizer) and how a run
resumes from one are lab/checkpoint.py; the run dir (chosen, locked, cleaned, removed when refused,
and the run's record of code and hardware) is rundir.RunDir; signals and the error exit are
lab/cli.py. `train(cfg)` returns its results, so tests call it with a composed config; `main` is the
thin Hydra entry point.
"""
import logging
import logging.handlers
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import hydra
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from lab.attnstats import AttentionProbe, without_softmax
from lab.checkpoint import (BEST_NAME, TrainState, checkpoint_contents, initial_weights, last_good_checkpoint,
                            prune_checkpoints, restore, resume_point, save_checkpoint, step_name)
from lab.cli import StopRequest, cli, forget_hydra_run_dir, run_app
from lab.device import Runtime, Throughput, check_memory, compile_wanted, is_oom, peak_flops, setup_runtime
from rules import UserError, first_line
from lab.rundir import RunDir, run_info, write_plots
from lab.stability import Watch, diverged_line
from lab.config import check_train_config, data_seed, model_config
from lab.counting import flops_per_token, training_bytes
from data.loader import TokenData
from data.mqar import MQARData
from data.prepare import prepare
from lab.evaluation import estimate_loss, full_val_loss
from model import GPT, GPTConfig
from lab.optim import build_optimizer, lr_at, set_lr
from lab.parallel import Dist, all_ranks_agree, checkpoint_blocks, init_distributed, parallelism
from lab.sweep import hydra_run_info
from lab.tracking import Tracker, truncate_metrics
from mixer import aux_metrics

log = logging.getLogger("attnlab")


@dataclass
class Run:
    """What a training run needs, built once by setup(); the loop reads and advances it."""
    cfg: object
    run_dir: RunDir  # where it writes: chosen, locked (rank 0) and cleaned by setup()
    dist: Dist
    rt: Runtime
    data: TokenData
    mcfg: GPTConfig
    model: GPT  # the model itself (sharded in place under FSDP); its state is read and written through `parallel`
    fwd_model: torch.nn.Module  # what steps run through: the model, wrapped in DDP and/or compiled
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: torch.Generator  # the training batches' own random stream, the same on every rank
    grad_accum: int  # micro-batches per step over all processes
    compiled: bool
    file_mode: Optional[int] = None  # permission bits of checkpoints (from the data's source files)
    resuming: bool = False
    resolved: dict = field(default_factory=dict)  # the resolved config, stored in every checkpoint
    tracker: Optional[Tracker] = None
    probe: Optional[AttentionProbe] = None
    state: TrainState = field(default_factory=TrainState)  # how far it has come (step, best val loss...): checkpointed
    skipped: int = 0  # non-finite steps skipped so far
    saved_at: Optional[int] = None  # step of the newest periodic checkpoint written by this process
    metrics: dict = field(default_factory=dict)  # the data's own at the latest evaluation (data=mqar: val/recall_acc)
    attn_history: list = field(default_factory=list)
    updates: int = 0  # optimizer steps taken by this process (skipped ones not counted)
    aux: dict = field(default_factory=dict)  # the latest step's auxiliary losses (mixer.aux_metrics: an indexer's KL)
    log_z: Optional[torch.Tensor] = None  # train.z_loss > 0: the latest step's mean log Z of the output softmax
    update_norm: Optional[float] = None  # the latest logged step's ||theta_after - theta_before||
    parallel: object = None  # parallel.Replicated (one process, DDP) or FullyShard (FSDP), chosen once in build()
    log_file: Optional[logging.Handler] = None  # train.log in the run dir (rank 0), from record() on
    ignored: list = field(default_factory=list)  # settings without effect in this config (warned, in run_info.json)
    watch: Watch = field(default_factory=Watch)  # divergence, attention collapse, spikes (lab/stability.py)

    @property
    def out_dir(self) -> Path:
        return self.run_dir.path

    @property
    def lock(self):
        """The run dir's lock (rank 0; None elsewhere)."""
        return self.run_dir.lock

    @property
    def step(self) -> int:
        """The step the run is at: its state's (set by the step and by a resume only)."""
        return self.state.step

    @property
    def finished(self) -> bool:
        """Resumed at train.max_iters: there is nothing left to do."""
        return self.resuming and self.step >= self.cfg.train.max_iters


# ----------------------------------------------------------------------------- the run

def train(cfg, run_name=None, run_group=None, overrides=None) -> dict:
    """Train the model `cfg` describes; write config, metrics, plots and checkpoints to cfg.out_dir.

    Under torchrun, each process trains on its share of every global batch and rank 0 alone
    writes. Returns a summary dict (losses, steps, throughput, paths)."""
    early = logging.handlers.MemoryHandler(10**4, flushLevel=logging.CRITICAL + 1)  # setup's lines, for train.log
    logging.getLogger().addHandler(early)
    try:
        run = setup(cfg, run_name, run_group, overrides, early.buffer)
    except RuntimeError as e:  # e.g. the model does not fit the GPU
        if is_oom(e):
            raise oom_error(e, cfg) from None
        raise
    finally:
        logging.getLogger().removeHandler(early)
    if run.finished:
        return already_finished(run)
    tcfg = cfg.train
    meter = Throughput(tcfg.batch_size * run.grad_accum * run.mcfg.block_size)
    peak = peak_flops(run.rt, tcfg.peak_flops)
    ckpt_every, start_step, probe_s, t_start = tcfg.ckpt_interval or tcfg.eval_interval, run.step, 0.0, time.perf_counter()
    stop = StopRequest()
    try:
        while True:
            last = run.step >= tcfg.max_iters
            with meter.paused():
                if not (run.resuming and run.step == start_step):  # done before that checkpoint was written
                    if due(run.step, tcfg.eval_interval, last):
                        evaluate(run, last)
                    if run.probe is not None and due(run.step, probe_every(tcfg), last):
                        probe_s += probe_attention(run)
                    if run.step > 0 and due(run.step, ckpt_every, last) and not diverged(run):
                        save(run)  # on every rank: see save()
                if not last:
                    stop.agree(run.rt.device, run.dist.world)
            if last or stop.signal or diverged(run):
                break
            loss, grad_norm, lr = optimizer_step(run)
            meter.steps += 1
            if run.step % tcfg.log_interval == 0 or run.step == tcfg.max_iters or run.watch.stop:
                log_progress(run, meter, loss, grad_norm, lr, peak)
            if diverged(run):  # a result, not an error: recorded, and the run ends here
                break
        results = finish(run, stop.signal)
    except RuntimeError as e:
        if is_oom(e):
            raise oom_error(e, run) from None
        raise
    finally:
        stop.restore()
        close(run)
    result = {**summary(run, meter.tokens_per_sec, stop.signal, time.perf_counter() - t_start, meter.train_s, probe_s),
              **results}
    if result["diverged"]:
        log.warning("%s; run dir %s", diverged_line(result), run.out_dir)
    else:
        share = f" ({100 * probe_s / meter.train_s:.2f}% of training time)" if meter.train_s > 0 and run.updates else ""
        log.info("done: val loss %.4f (best %.4f) after %d steps; run dir %s; attention probes took %.2f s%s",
                 result["val_loss"] or math.nan, run.state.best_val, run.step, run.out_dir, probe_s, share)
    return result


def finish(run: Run, signal: Optional[str]) -> dict:
    """The end of the loop: when stopped by `signal`, a checkpoint of this step and how to resume from
    it; the run's figures (unless logger.plots=false: a few seconds of matplotlib, the metrics hold
    every figure's data); its results (record_results)."""
    if signal and run.saved_at != run.step:
        save(run)  # on every rank: see save()
    if signal and run.dist.master:
        path = run.out_dir / step_name(run.step)
        print(f"stopped by {signal} at step {run.step}; checkpoint {path}\nresume with: "
              f"python train.py hydra.run.dir={run.out_dir} resume=true (and the same overrides)", file=sys.stderr)
    if run.cfg.logger.plots:  # on every rank: see write_plots
        write_plots(run.out_dir, run.step, run.model, run.probe, run.data, run.tracker, run.rt, run.dist.master)
    return record_results(run)


def diverged(run: Run) -> bool:
    """Has the run diverged (stability.Watch)? Every rank takes rank 0's decision: one stops, all stop."""
    return all_ranks_agree(run.watch.stop is not None, run.rt.device, run.dist.world)


def record_results(run: Run) -> dict:
    """The run's results (its stability figures beside its losses) in results.json, the W&B summary
    and, when it diverged, one metrics line that says where."""
    results = run.watch.results()
    if results["diverged"]:
        good = last_good_checkpoint(run.out_dir, run.step) if run.dist.master else None
        results["last_good_checkpoint"] = str(good) if good else None
        results["lr"] = run.cfg.train.lr
        log_metrics(run, {"diverged": 1, "diverged_step": results["diverged_step"],
                          **({"last_finite_loss": results["diverged_last_finite_loss"]}
                             if results["diverged_last_finite_loss"] is not None else {})})
    state = run.state
    run.tracker.summarize({"val_loss": state.evals.get("val"), "val_loss_full": state.evals.get("val_full"),
                           "best_val_loss": state.best_val if math.isfinite(state.best_val) else None,
                           "steps": run.step, **results})
    return results


def summary(run: Run, tokens_per_sec=None, stopped=None, wall_s=0.0, train_s=0.0, probe_s=0.0) -> dict:
    """What train() returns: losses, steps, throughput, paths."""
    evals = run.state.evals
    return {"out_dir": str(run.out_dir), "steps": run.step, "best_val_loss": run.state.best_val,
            "train_loss": evals.get("train"), "val_loss": evals.get("val"),
            "val_loss_full": evals.get("val_full"), "tokens_per_sec": tokens_per_sec, "stopped": stopped,
            "compiled": run.compiled, "ckpt": str(run.run_dir.latest_checkpoint()), "wall_s": wall_s,
            "train_s": train_s, "probe_s": probe_s, "attn": run.attn_history, **run.metrics}


def already_finished(run: Run) -> dict:
    """A run resumed at its train.max_iters: say so and change nothing (its record, metrics, plots
    and W&B run stay as they are)."""
    val = run.state.evals["val"]
    log.warning("nothing to do: the run in %s is already at step %d = train.max_iters (val loss %s, best %.4f); "
                "pass train.max_iters > %d to train on", run.out_dir, run.step,
                "unknown" if val is None else f"{val:.4f}", run.state.best_val, run.step)
    close(run)
    return {**summary(run), **run.watch.results()}


def close(run: Run):
    """Release what the run holds: W&B and metrics, train.log, the run-dir lock, the process group."""
    if run.tracker is not None:
        run.tracker.close()
    if run.log_file is not None:
        logging.getLogger().removeHandler(run.log_file)
        run.log_file.close()
    if run.lock is not None:
        run.lock.close()
    if run.dist.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- setup: check, build, restore, record

def setup(cfg, run_name=None, run_group=None, overrides=None, early_log=()) -> Run:
    """Check everything that needs no file, lock the run dir, then build the run top-down. A refused
    run leaves nothing behind (RunDir.removed_if_refused)."""
    run_dir = RunDir(cfg.out_dir)
    with run_dir.removed_if_refused():
        ignored = check_train_config(cfg)  # before anything is written; settings without effect: warned
        run_dir.check(cfg.data.cache_dir)
        dist_ = init_distributed(cfg.device)
        run_dir.master = dist_.master
        if not dist_.master:
            logging.getLogger().setLevel(logging.WARNING)
        grad_accum = micro_batches(cfg.train, dist_)
        point = resume_point(cfg, run_dir.given)
        run_dir.open(point.source, point.branch)
        run = build(cfg, run_dir, dist_, grad_accum, init_from=cfg.init_from if point.source is None else None)
        run.ignored = ignored
        if point.state is not None:
            run.state = restore(point, cfg=cfg, data=run.data, model=run.model, parallel=run.parallel,
                                optimizer=run.optimizer, scaler=run.scaler, sampler=run.sampler, watch=run.watch,
                                dist_=run.dist, device=run.rt.device)
            run.resuming, run.saved_at = True, run.step  # the checkpoint it resumes from counts as saved
        if not run.finished:
            record(run, run_name, run_group, overrides, early_log)
        return run


def micro_batches(tcfg, dist_: Dist) -> int:
    """Micro-batches per step over all processes: train.grad_accum, an equal share for each process."""
    grad_accum = tcfg.grad_accum or dist_.world  # unset: one micro-batch per process
    if grad_accum % dist_.world:
        raise UserError(f"train.grad_accum={grad_accum} must be a multiple of the {dist_.world} processes: "
                        "each process takes an equal share of the micro-batches (or leave it unset)")
    return grad_accum


def build(cfg, run_dir: RunDir, dist_, grad_accum, init_from=None) -> Run:
    """The data, the model and the optimizer of a fresh run (seeded; its weights from `init_from`'s
    checkpoint where it has them), and what steps run through."""
    tcfg = cfg.train
    torch.manual_seed(cfg.seed)  # the same weights and batch draws on every rank
    torch.cuda.manual_seed(cfg.seed + dist_.rank)  # this rank's GPU (the current device): its own dropout masks
    rt = setup_runtime(dist_.device_name or cfg.device, cfg.dtype)

    data = MQARData(cfg.data, cfg.model.block_size) if cfg.data.name == "mqar" else \
        TokenData(prepare(cfg.data), bos=cfg.data.bos)
    mcfg = model_config(cfg.model, data.vocab_size)
    data.check_block_size(mcfg.block_size)
    file_mode = data.meta.get("file_mode")  # set for local files: run dir and checkpoints no more readable
    run_dir.restrict(file_mode)
    batch, key = max((tcfg.batch_size, "train.batch_size"), (tcfg.probe_batch_size, "train.probe_batch_size"))
    par = parallelism(tcfg, dist_, rt)
    check_memory(training_bytes(mcfg, batch, par.shards), rt.device, "the model and batch",
                 f"model.n_layer={mcfg.n_layer}, model.n_embd={mcfg.n_embd}, model.d_ff={mcfg.d_ff}, "
                 f"model.vocab_size={mcfg.vocab_size}, model.block_size={mcfg.block_size}, {key}={batch}")
    model = GPT(mcfg).to(rt.device)
    if init_from:
        fresh = initial_weights(model, init_from, data.tokenizer)
        log.info("weights from %s%s", init_from, f" (fresh: {', '.join(fresh)})" if fresh else "")
    log.info("model: %.2fM parameters, %d layers x %d heads x %d head dim, block %d, vocab %d, scale %s%s",
             model.num_params() / 1e6, mcfg.n_layer, mcfg.n_head, mcfg.head_dim, mcfg.block_size,
             mcfg.vocab_size, mcfg.attn.scale, f", qk_norm={mcfg.attn.qk_norm_type}" if mcfg.attn.qk_norm else "")
    if tcfg.activation_checkpointing:
        checkpoint_blocks(model)
    fwd_model = par.wrap(model)  # DDP or FSDP first, then compile: the compiled graph overlaps their communication
    optimizer = build_optimizer(model, tcfg, rt.device)  # after wrapping: FSDP replaced the parameters by shards
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    compiled = compile_wanted(cfg.compile, rt.device)
    if compiled:
        torch._dynamo.reset()  # a fresh compile per run: a sweep never hits the recompile limit
        fwd_model = torch.compile(fwd_model)
    return Run(cfg, run_dir, dist_, rt, data, mcfg, model, fwd_model, optimizer, scaler,
               sampler=torch.Generator().manual_seed(data_seed(cfg)), grad_accum=grad_accum, compiled=compiled,
               file_mode=file_mode, parallel=par, watch=Watch(tcfg.collapse_entropy))


def record(run: Run, run_name=None, run_group=None, overrides=None, early_log=()):
    """What this run is, written before it starts (rank 0): train.log (with the lines `early_log`
    holds, logged while the run was set up), the resolved config, code version and hardware, the
    Hydra overrides; then the metrics file, W&B and the attention probe's fixed batch."""
    cfg, out_dir = run.cfg, run.out_dir
    run.resolved = OmegaConf.to_container(cfg, resolve=True)
    if run.dist.master:
        run.log_file = run.run_dir.open_log(early_log)
        run.run_dir.write_record(cfg, {**run_info(run.rt.device, run.dist.world), "ignored_settings": run.ignored},
                                 None if run.resuming else overrides)
        truncate_metrics(out_dir / "metrics.jsonl", run.step if run.resuming else -1)
    run.tracker = Tracker(out_dir, cfg, name=run_name or out_dir.name, group=run_group, enabled=run.dist.master,
                          run_id=run.state.wandb_id)
    run.state.wandb_id = run.tracker.run.id if run.tracker.run is not None else None  # what checkpoints record
    # a fixed val batch, drawn once: curves compare across runs. Rank 0 logs it; under FSDP every rank runs
    # its forward (each block's all-gather needs them all)
    if (run.dist.master or run.parallel.collective_forward) and probe_every(cfg.train) > 0:
        px, _ = run.data.get_batch("val", cfg.train.probe_batch_size, run.mcfg.block_size,
                                   torch.Generator().manual_seed(data_seed(cfg) + 7))
        run.probe = AttentionProbe(px.to(run.rt.device), bos=run.data.bos is not None)
        if without_softmax(run.model):
            log.info("attention probe: %s", without_softmax(run.model))


# ----------------------------------------------------------------------------- what the loop calls

def probe_every(tcfg) -> int:
    return tcfg.eval_interval if tcfg.log_attn_interval is None else tcfg.log_attn_interval


def save(run: Run) -> Path:
    """A periodic checkpoint of this step; older ones beyond train.keep_ckpts are deleted. Every
    rank calls it (each adds its own CUDA RNG state); rank 0 alone writes."""
    contents, path = checkpoint(run), run.out_dir / step_name(run.step)
    if run.dist.master:
        path = save_checkpoint(path, contents, run.file_mode)
        prune_checkpoints(run.out_dir, run.cfg.train.keep_ckpts)
    run.saved_at = run.step
    return path


def checkpoint(run: Run, full: bool = True) -> dict:
    """This run's checkpoint (checkpoint_contents: with `full`, all an exact resume needs; else weights,
    config and state). Every rank calls it: see save()."""
    return checkpoint_contents(run.model, run.parallel, run.state, data=run.data, config=run.resolved,
                               out_dir=run.out_dir, optimizer=run.optimizer, scaler=run.scaler, sampler=run.sampler,
                               watch=run.watch, dist_=run.dist, device=run.rt.device, full=full)


def evaluate(run: Run, last: bool = False):
    """Log train and val loss on the fixed batches, and at the last step the whole val split's
    loss (val/loss_full); keep best.pt at the lowest val loss."""
    evals = run.state.evals = estimate_loss(run.fwd_model, run.data, run.cfg, run.mcfg.block_size, run.rt)
    bpc = run.data.bits_per_char_factor()
    run.metrics = run.data.metrics(run.model, run.rt.autocast)  # the data's own (data=mqar: val/recall_acc)
    line = {"train/loss": evals["train"], "val/loss": evals["val"],
            **({"val/bpc": evals["val"] * bpc} if bpc else {}), **run.metrics}
    if last and run.cfg.train.final_eval_tokens and run.step > 0:
        full, tokens = full_val_loss(run.model, run.data, run.cfg.train, run.rt, run.dist)
        evals["val_full"] = full
        line.update({"val/loss_full": full, "val/tokens_full": tokens, **({"val/bpc_full": full * bpc} if bpc else {})})
        log.info("step %d: val loss %.4f over the whole val split (%d tokens)", run.step, full, tokens)
    log_metrics(run, line)
    log.info("eval step %d: train loss %.4f, val loss %.4f%s", run.step, evals["train"], evals["val"],
             "".join(f", {k} {v:.4f}" for k, v in run.metrics.items()))
    # every rank takes the same decision: under FSDP the weights are gathered from all of them
    if all_ranks_agree(evals["val"] < run.state.best_val, run.rt.device, run.dist.world):
        run.state.best_val = evals["val"]
        contents = checkpoint(run, full=False)
        if run.dist.master:
            save_checkpoint(run.out_dir / BEST_NAME, contents, run.file_mode)


def probe_attention(run: Run) -> float:
    """Attention statistics of the fixed probe batch, logged; returns the seconds it took. The probe's
    forward runs under the run's autocast, as training does: on a GPU in bf16, q, k and v then reach
    the flash kernel in a dtype it has (it has no fp32); the statistics are computed in fp32."""
    t0 = time.perf_counter()
    with run.rt.autocast():
        stats = run.probe.run(run.model)
    log_metrics(run, stats)
    run.attn_history.append({"step": run.step, **stats})
    return time.perf_counter() - t0


def log_metrics(run: Run, line: dict):
    """One metrics line of this step: to metrics.jsonl and W&B, and to the run's stability watch."""
    run.tracker.log(line, run.step)
    run.watch.see(run.step, line)


def optimizer_step(run: Run):
    """One training step on this process's share of a freshly drawn global batch. A step whose loss
    or gradients are not finite is skipped; more of them than train.skip_nonfinite allows is a
    divergence (lab/stability.py), unless the fresh model already gives one (then its config is at fault)."""
    tcfg, T = run.cfg.train, run.mcfg.block_size
    lr = lr_at(run.step, tcfg)
    set_lr(run.optimizer, lr)
    starts = run.data.sample_starts("train", (run.grad_accum, tcfg.batch_size), T, run.sampler)
    local = run.grad_accum // run.dist.world
    batches = (run.data.batch("train", s, T) for s in starts[run.dist.rank * local:(run.dist.rank + 1) * local])
    logged = (run.step + 1) % tcfg.log_interval == 0 or run.step + 1 == tcfg.max_iters
    before = params_now(run.model) if logged else None  # for the update's norm
    extra = {}
    loss, grad_norm, finite = train_step(run.fwd_model, run.optimizer, batches, local, tcfg.grad_clip, run.rt,
                                         run.scaler, run.dist.world, z_loss=tcfg.z_loss, extra=extra)
    run.aux = aux_metrics(block.attn for block in run.model.blocks)  # {} without auxiliary losses
    run.log_z = extra.get("log_z")
    run.update_norm = update_norm(before, run.model) if logged and finite else None
    run.watch.step(run.step, loss.item(), grad_norm.item())  # floats: train_step has synchronised already
    if not finite:
        run.skipped += 1
        log.warning("step %d: loss %s / grad norm %s not finite, step skipped (%d of %d allowed)",
                    run.step, loss.item(), grad_norm.item(), run.skipped, tcfg.skip_nonfinite)
        if run.skipped > tcfg.skip_nonfinite:
            if run.updates == 0 and not run.resuming:
                raise nonfinite_error(run, loss.item())
            run.watch.nonfinite(run.step + 1, loss.item(), tcfg.skip_nonfinite)
    else:
        run.updates += 1
    run.state.step += 1
    return loss, grad_norm, lr


def z_loss_term(logits, targets):
    """PaLM's auxiliary z-loss (Chowdhery et al. 2022, arXiv 2204.02311): the mean over predicted
    positions of (log Z)^2, Z = sum_v exp(logit_v), which pulls the softmax's normaliser toward 1 (log Z
    toward 0) without changing which token wins. Returns ((log Z)^2, log Z), both means over positions
    whose target is not -1."""
    log_z = logits.float().logsumexp(dim=-1)
    keep = (targets != -1).float()
    n = keep.sum().clamp(min=1)
    return (log_z.square() * keep).sum() / n, (log_z.detach() * keep).sum() / n


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches, grad_accum: int, grad_clip: float,
               runtime: Runtime, scaler: torch.amp.GradScaler, world: int = 1, z_loss: float = 0.0,
               extra: Optional[dict] = None) -> tuple:
    """One optimizer step: forward, loss and backward over this process's micro-batches (x, y), then
    clip, the non-finite check and the optimizer's step. Each micro-batch is weighted 1/grad_accum so
    the step sees their mean (DDP, or FSDP's reduce-scatter, then averages over processes; FSDP
    reduces every micro-batch, DDP the last). grad_accum: this process's share of them. Returns
    (the mean loss of the step's whole global batch, every micro-batch of every process: the same
    figure whatever the number of processes; global grad norm; finite): a step whose loss or
    gradients are not finite on any rank is skipped on every rank, the weights untouched.
    z_loss > 0: the objective adds z_loss * (log Z)^2 (z_loss_term); the loss returned stays the
    cross-entropy, and `extra` (a dict) receives this process's mean log Z as "log_z"."""
    batches = list(batches)
    device = runtime.device
    total = torch.zeros((), device=device)
    log_z = torch.zeros((), device=device)
    for i, (x, y) in enumerate(batches):  # forward, loss, backward: gradients accumulate over the micro-batches
        # under DDP, gradients are all-reduced once, on the last micro-batch
        sync = i == len(batches) - 1 or not hasattr(model, "no_sync")
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with (nullcontext() if sync else model.no_sync()), runtime.autocast():
            logits, loss = model(x, y)
            objective = loss
            if z_loss:
                z_sq, z = z_loss_term(logits, y)
                objective = loss + z_loss * z_sq
                log_z += z
        scaler.scale(objective / grad_accum).backward()
        total += loss.detach().float()
    if z_loss and extra is not None:
        extra["log_z"] = log_z / len(batches)
    scaler.unscale_(optimizer)  # clip the true gradients, not fp16's scaled ones
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor, the norm over every rank's shards, replicated
        grad_norm = grad_norm.full_tensor()
    # fp16's GradScaler skips steps with inf gradients by design (and lowers its scale); only the loss counts there
    finite = torch.isfinite(total) & (torch.isfinite(grad_norm) | torch.tensor(scaler.is_enabled(), device=device))
    # one reduction and one host sync per step: the global batch's mean loss and whether any rank saw a
    # non-finite one (never step on, or save, NaN weights: every rank takes the same decision)
    step = torch.stack([total / (grad_accum * world), (~finite).float()])
    if world > 1:
        dist.all_reduce(step)
    loss, finite = step[0], step[1].item() == 0
    if finite:
        scaler.step(optimizer)
    scaler.update()  # also after a skipped step: unscale_ above must be paired with an update
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm.detach(), finite


def params_now(model) -> list:
    """A copy of the parameters as the optimizer sees them. Under FSDP an eval's forward (no backward)
    leaves the root's parameters gathered; resharding first makes every copy a shard like the params."""
    if hasattr(model, "reshard"):
        model.reshard()
    return [p.detach().clone() for p in model.parameters()]


def update_norm(before: list, model) -> float:
    """The global L2 norm of what the optimizer step changed, ||theta_after - theta_before|| (under
    FSDP each process holds a shard: the squares are summed over processes)."""
    total = 0.0
    for old, p in zip(before, model.parameters()):
        sq = (p.detach() - old).float().pow(2).sum()
        total = total + (sq.full_tensor() if hasattr(sq, "full_tensor") else sq)
    return math.sqrt(float(total))


def nonfinite_error(run: Run, loss: float) -> UserError:
    """Name the likely cause: before any update the learning rate has not acted yet, so the model
    config (or the data) is at fault; after updates, a step size too large for the model."""
    good = last_good_checkpoint(run.out_dir, run.step) if run.dist.master else None
    where = f"non-finite loss or gradients at step {run.step} (loss {loss}); last good checkpoint: {good or 'none yet'}"
    if run.updates == 0 and not run.resuming:
        return UserError(f"{where}; the freshly initialised model already gives it, so the learning rate is not "
                         "the cause: check the model.* values (one out of its sensible range?) and the data")
    return UserError(f"{where}; the usual cause is a step too large for this model: lower train.lr "
                     f"(now {run.cfg.train.lr}) "
                     "or raise train.warmup_iters, or set train.skip_nonfinite=K to skip such steps")


def log_progress(run: Run, meter: Throughput, loss, grad_norm, lr, peak):
    loss_value = loss.item()  # waits for the device, so the time read next covers its work
    tok_s, ms = meter.read()
    line = {"train/loss": loss_value, "lr": lr, "grad_norm": grad_norm.item(), "tokens_per_sec": tok_s,
            "ms_per_iter": ms, **({"update_norm": run.update_norm} if run.update_norm is not None else {}),
            **({"train/log_z": run.log_z.item()} if run.log_z is not None else {})}
    if peak:  # tokens_per_sec counts every process's tokens; MFU is per GPU
        line["mfu"] = flops_per_token(run.model.config) * tok_s / (peak * run.dist.world)
    for name, value in run.aux.items():  # the mean over processes too, as the loss is
        value = value.clone()
        if run.dist.world > 1:
            dist.all_reduce(value)
        line[f"aux/{name}"] = value.item() / run.dist.world
    log_metrics(run, line)
    eta = (run.cfg.train.max_iters - run.step) * ms / 1000
    log.info("step %d/%d | loss %.4f%s | lr %.2e | %.0f tok/s | %.1f ms/iter%s | ETA %s", run.step,
             run.cfg.train.max_iters, loss_value, "".join(f" | {name} {line[f'aux/{name}']:.4f}" for name in run.aux),
             lr, tok_s, ms,
             f" | MFU {100 * line['mfu']:.1f}%" if peak else "", time.strftime("%H:%M:%S", time.gmtime(eta)))


def due(step: int, every: int, last: bool) -> bool:
    return last or (every > 0 and step % every == 0)


# ----------------------------------------------------------------------------- finish and entry point

def oom_error(e: BaseException, run_or_cfg) -> UserError:
    """An out-of-memory failure as one line that says what to lower and what is saved."""
    cfg = getattr(run_or_cfg, "cfg", run_or_cfg)
    out_dir = getattr(run_or_cfg, "out_dir", None)
    saved = f"; last good checkpoint: {last_good_checkpoint(out_dir) or 'none'}" if out_dir else ""
    t = cfg.train
    return UserError(f"out of memory ({first_line(e, 120)}) at train.batch_size={t.batch_size} x "
                     f"train.grad_accum={t.grad_accum or 1} micro-batches x model.block_size={cfg.model.block_size}: "
                     "lower train.batch_size (raising train.grad_accum keeps the tokens per step), "
                     f"model.block_size or the model size{saved}")


@hydra.main(version_base="1.3", config_path="configs", config_name="config")
@cli
def main(cfg):
    from hydra.core.hydra_config import HydraConfig

    if cfg.out_dir:  # out_dir wins: the dir Hydra made for this command is not used
        forget_hydra_run_dir()
    else:
        cfg.out_dir = HydraConfig.get().runtime.output_dir
    name, group, overrides = hydra_run_info()
    result = train(cfg, run_name=name, run_group=group, overrides=overrides)
    if result["diverged"]:  # a result: a sweep goes on with its next job (lab/sweep.py counts them)
        if group is None:
            raise UserError(f"{diverged_line(result)}; run dir {result['out_dir']}")
        print(f"{diverged_line(result)}; run dir {result['out_dir']}", file=sys.stderr)
    if result["stopped"] and group is not None:  # a signal stops the whole sweep, not only this run
        print("sweep stopped: the runs after this one were not started", file=sys.stderr)
        sys.exit(0)
    return result["best_val_loss"]  # also when stopped


if __name__ == "__main__":
    run_app(main)
