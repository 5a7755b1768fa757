"""Train a GPT from scratch.

    python train.py                                   # embedded corpus, CPU or GPU, a few minutes
    python train.py model=cpu_small data=shakespeare_char data.path=input.txt
    python train.py -m model.attn.scale=sqrt_dk,none  # a sweep: one run (and W&B run) per value

A run, train(), is setup -> loop -> finish. setup() checks the config, then builds the data, the model,
the optimizer, the restored state when resuming, and the record of the run. loop() evaluates, probes
the attention, checkpoints and steps; the step itself is train_step. Checkpoints and resuming
are lab/checkpoint.py; the run dir, its record and results lab/rundir.py; metrics lab/tracking.py;
signals and the error exit lab/cli.py. train(cfg) returns its results, so tests call it directly.
"""
import logging
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
                            restore, resume_point, step_name)
from lab.cli import StopRequest, cli, end_sweep_on_signal, forget_hydra_run_dir, run_app
from lab.device import Runtime, Throughput, check_memory, compile_wanted, peak_flops, setup_runtime
from lab.rundir import (RunDir, already_finished, held_log, log_end, out_of_memory, record_results, run_info,
                        summary, write_plots)
from lab.stability import Watch, nonfinite_error, report_divergence, z_loss_term
from lab.config import check_train_config, data_seed, model_config
from lab.counting import flops_per_token, training_bytes
from data.loader import TokenData
from data.mqar import MQARData
from data.prepare import prepare
from lab.evaluation import estimate_loss, full_val_loss, probe_batch, probe_every
from model import GPT, GPTConfig
from lab.qk_clip import clip_ as qk_clip_
from lab.optim import build_optimizer, lr_at, micro_batches, params_now, set_lr, update_norm
from lab.parallel import Dist, FullyShard, Replicated, all_ranks_agree, checkpoint_blocks, init_distributed, parallelism
from lab.sweep import hydra_run_info
from lab.tracking import StepStats, Tracker, log_metrics, log_progress, truncate_metrics
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
    parallel: Replicated | FullyShard  # one process or DDP, or FSDP: chosen once in build()
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: torch.Generator  # the training batches' own random stream, the same on every rank
    grad_accum: int  # micro-batches per step over all processes
    compiled: bool
    watch: Watch  # divergence, attention collapse, spikes (lab/stability.py)
    resuming: bool = False
    resolved: dict = field(default_factory=dict)  # the resolved config, stored in every checkpoint
    tracker: Optional[Tracker] = None
    probe: Optional[AttentionProbe] = None
    state: TrainState = field(default_factory=TrainState)  # how far it has come (step, best val loss...): checkpointed
    skipped: int = 0  # non-finite steps skipped so far
    updates: int = 0  # optimizer steps taken by this process (skipped ones not counted)
    saved_at: Optional[int] = None  # step of the newest periodic checkpoint written by this process
    metrics: dict = field(default_factory=dict)  # the data's own at the latest evaluation (data=mqar: val/recall_acc)
    attn_history: list = field(default_factory=list)
    out_dir = property(lambda self: self.run_dir.path)
    lock = property(lambda self: self.run_dir.lock)  # the run dir's lock (rank 0; None elsewhere)
    step = property(lambda self: self.state.step)  # the step the run is at (set by steps and a resume only)
    finished = property(lambda self: self.resuming and self.step >= self.cfg.train.max_iters)  # nothing left to do


def train(cfg, run_name=None, run_group=None, overrides=None) -> dict:
    """Train the model `cfg` describes; write config, metrics, plots and checkpoints to cfg.out_dir.
    Under torchrun each process trains on its share of every global batch; rank 0 alone writes.
    Returns a summary dict (losses, steps, throughput, paths)."""
    with held_log() as early, out_of_memory(cfg.train, cfg.model.block_size):  # early: setup's lines, for train.log
        run = setup(cfg, run_name, run_group, overrides, early)
    if run.finished:  # resumed at train.max_iters: said, and nothing changed
        result = already_finished(run.state, run.run_dir, run.watch, run.compiled)
        close(run)
        return result
    meter, t_start = Throughput(cfg.train.batch_size * run.grad_accum * run.mcfg.block_size), time.perf_counter()
    try:
        with StopRequest() as stop, out_of_memory(cfg.train, cfg.model.block_size, run.out_dir):
            probe_s = loop(run, meter, stop)
            results = finish(run, stop)
    finally:
        close(run)
    result = {**summary(run.state, run.run_dir, run.compiled, run.attn_history, run.metrics, meter.tokens_per_sec,
                        stop.signal, time.perf_counter() - t_start, meter.train_s, probe_s), **results}
    log_end(result, updated=run.updates > 0, master=run.dist.master)  # where it diverged, or its val loss
    return result


def loop(run: Run, meter: Throughput, stop: StopRequest) -> float:
    """Evaluate, probe the attention, checkpoint and step until train.max_iters, a signal (`stop`) or a
    divergence; returns the seconds the attention probes took."""
    tcfg = run.cfg.train
    peak = peak_flops(run.rt, tcfg.peak_flops)
    ckpt_every, start_step, probe_s = tcfg.ckpt_interval or tcfg.eval_interval, run.step, 0.0
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
            return probe_s
        stats = optimizer_step(run)
        meter.steps += 1
        if run.step % tcfg.log_interval == 0 or run.step == tcfg.max_iters or run.watch.stop:
            log_progress(run.tracker, run.watch, meter, run.step, tcfg.max_iters, stats, world=run.dist.world,
                         flops=flops_per_token(run.model.config) if peak else None, peak=peak)
        if diverged(run):  # a result, not an error: recorded, and the run ends here
            return probe_s


def finish(run: Run, stop: StopRequest) -> dict:
    """When stopped by a signal, a checkpoint of this step and how to resume from it; the run's figures
    (unless logger.plots=false: the metrics hold their data) and its results (rundir.record_results)."""
    if stop.signal and run.saved_at != run.step:
        save(run)  # on every rank: see save()
    if stop.signal and run.dist.master:
        stop.tell(run.step, run.out_dir / step_name(run.step), run.out_dir)
    if run.cfg.logger.plots:  # on every rank: see write_plots
        write_plots(run.out_dir, run.step, run.model, run.probe, run.data, run.tracker, run.rt, run.dist.master)
    unigram = run.data.unigram_loss() if hasattr(run.data, "unigram_loss") else None  # generated data has none
    return record_results(run.watch, run.state, run.tracker, run.out_dir, run.dist.master, run.cfg.train,
                          unigram, stop.signal)


def diverged(run: Run) -> bool:
    """Has the run diverged (stability.Watch)? Every rank takes rank 0's decision: one stops, all stop."""
    return all_ranks_agree(run.watch.stop is not None, run.rt.device, run.dist.world)


def close(run: Run):
    """Release what the run holds: W&B and metrics, train.log and the run-dir lock, the process group."""
    if run.tracker is not None:
        run.tracker.close()
    run.run_dir.close()
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
        grad_accum = micro_batches(cfg.train, dist_.world)
        point = resume_point(cfg, run_dir.given)
        run_dir.open(point.source, point.branch)
        run = build(cfg, run_dir, dist_, grad_accum, init_from=cfg.init_from if point.source is None else None)
        if point.state is not None:
            run.state = restore(point, cfg=cfg, data=run.data, model=run.model, parallel=run.parallel,
                                optimizer=run.optimizer, scaler=run.scaler, sampler=run.sampler, watch=run.watch,
                                dist_=run.dist, device=run.rt.device)
            run.resuming, run.saved_at = True, run.step  # the checkpoint it resumes from counts as saved
        if not run.finished:
            origin = {"checkpoint": str(point.source), "why": point.branch_why} if point.branch else None
            record(run, ignored, run_name, run_group, overrides, early_log, origin)
        return run


def build(cfg, run_dir: RunDir, dist_: Dist, grad_accum: int, init_from=None) -> Run:
    """The data, the model and the optimizer of a fresh run (seeded; its weights from `init_from`'s
    checkpoint where it has them), and what steps run through."""
    tcfg = cfg.train
    torch.manual_seed(cfg.seed)  # the same weights and batch draws on every rank
    torch.cuda.manual_seed(cfg.seed + dist_.rank)  # this rank's GPU (the current device): its own dropout masks
    rt = setup_runtime(dist_.device_name or cfg.device, cfg.dtype)
    data = MQARData(cfg.data, cfg.model.block_size) if cfg.data.name == "mqar" else \
        TokenData(prepare(cfg.data), bos=cfg.data.bos)
    mcfg = model_config(cfg.model, data.vocab_size)
    sampler = torch.Generator().manual_seed(data_seed(cfg))  # the training batches' own random stream
    data.check_block_size(mcfg.block_size)
    run_dir.restrict(data.meta.get("file_mode"))  # set for local files: run dir and checkpoints no more readable
    batch, key = max((tcfg.batch_size, "train.batch_size"), (tcfg.probe_batch_size, "train.probe_batch_size"))
    par = parallelism(tcfg, dist_, rt)
    vocab = (f"model.vocab_size={mcfg.vocab_size}" if cfg.model.vocab_size is not None else  # the key the user set
             f"data.vocab_size={cfg.data.vocab_size}" if cfg.data.get("vocab_size") is not None else
             f"the tokenizer's {mcfg.vocab_size} tokens")
    check_memory(training_bytes(mcfg, batch, par.shards), rt.device, "the model and batch",
                 f"model.n_layer={mcfg.n_layer}, model.n_embd={mcfg.n_embd}, model.d_ff={mcfg.d_ff}, "
                 f"{vocab}, model.block_size={mcfg.block_size}, {key}={batch}")
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
    return Run(cfg, run_dir, dist_, rt, data, mcfg, model, fwd_model, par, optimizer, scaler, sampler,
               grad_accum=grad_accum, compiled=compiled, watch=Watch(tcfg.collapse_entropy))


def record(run: Run, ignored: list, run_name=None, run_group=None, overrides=None, early_log=(), origin=None):
    """What this run is, written before it starts (rank 0): train.log (setup's lines, `early_log`, first),
    config, code version, hardware, settings without effect (`ignored`), Hydra's overrides; then the
    metrics file, W&B and the attention probe's fixed batch."""
    cfg, out_dir = run.cfg, run.out_dir
    run.resolved = OmegaConf.to_container(cfg, resolve=True)
    if run.dist.master:
        run.run_dir.open_log(early_log)
        info = {**run_info(run.rt.device, run.dist.world), "ignored_settings": ignored,
                **({"branched_from": origin} if origin else {})}  # a new run from another run's checkpoint
        run.run_dir.write_record(cfg, info, None if run.resuming and not origin else overrides)
        truncate_metrics(out_dir / "metrics.jsonl", run.step if run.resuming else -1)
    run.tracker = Tracker(out_dir, cfg, name=run_name or out_dir.name, group=run_group, enabled=run.dist.master,
                          run_id=run.state.wandb_id)
    run.state.wandb_id = run.tracker.run.id if run.tracker.run is not None else None  # what checkpoints record
    # rank 0 logs the probe's statistics; under FSDP every rank runs its forward (each block's all-gather)
    if (run.dist.master or run.parallel.collective_forward) and probe_every(cfg.train) > 0:
        run.probe = probe_batch(run.data, cfg.train.probe_batch_size, run.mcfg.block_size, data_seed(cfg),
                                run.rt.device)
        if without_softmax(run.model):
            log.info("attention probe: %s", without_softmax(run.model))


# ----------------------------------------------------------------------------- what the loop calls

def due(step: int, every: int, last: bool) -> bool:
    return last or (every > 0 and step % every == 0)


def save(run: Run):
    """A periodic checkpoint of this step; older ones beyond train.keep_ckpts are deleted. Every
    rank calls it (each adds its own CUDA RNG state); rank 0 alone writes."""
    run.run_dir.save(checkpoint(run), step_name(run.step), keep=run.cfg.train.keep_ckpts)
    run.saved_at = run.step


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
    log_metrics(run.tracker, run.watch, run.step, line)
    log.info("eval step %d: train loss %.4f, val loss %.4f%s", run.step, evals["train"], evals["val"],
             "".join(f", {k} {v:.4f}" for k, v in run.metrics.items()))
    # every rank takes the same decision: under FSDP the weights are gathered from all of them
    if all_ranks_agree(evals["val"] < run.state.best_val, run.rt.device, run.dist.world):
        run.state.best_val = evals["val"]
        run.run_dir.save(checkpoint(run, full=False), BEST_NAME)


def probe_attention(run: Run) -> float:
    """Attention statistics of the fixed probe batch, logged; returns the seconds it took. Under the run's
    autocast, as training: the flash kernel has no fp32 (the statistics are computed in fp32)."""
    t0 = time.perf_counter()
    with run.rt.autocast():
        stats = run.probe.run(run.model)
    log_metrics(run.tracker, run.watch, run.step, stats)
    run.attn_history.append({"step": run.step, **stats})
    return time.perf_counter() - t0


def optimizer_step(run: Run) -> StepStats:
    """One training step on this process's share of a freshly drawn global batch. A step whose loss
    or gradients are not finite is skipped; more of them than train.skip_nonfinite allows is a
    divergence (lab/stability.py), unless the fresh model already gives one (then its config is at fault)."""
    tcfg, T = run.cfg.train, run.mcfg.block_size
    lr = lr_at(run.step, tcfg)
    set_lr(run.optimizer, lr)
    starts = run.data.sample_starts("train", (run.grad_accum, tcfg.batch_size), T, run.sampler)
    local = run.grad_accum // run.dist.world
    batches = [run.data.batch("train", s, T) for s in starts[run.dist.rank * local:(run.dist.rank + 1) * local]]
    logged = (run.step + 1) % tcfg.log_interval == 0 or run.step + 1 == tcfg.max_iters
    before = params_now(run.model) if logged else None  # for the update's norm
    extra = {}
    loss, grad_norm, finite = train_step(run.fwd_model, run.optimizer, batches, local, tcfg.grad_clip, run.rt,
                                         run.scaler, run.dist.world, z_loss=tcfg.z_loss, extra=extra,
                                         layers=run.model.blocks if logged and tcfg.log_layer_grads else None)
    aux = aux_metrics(block.attn for block in run.model.blocks)  # {}: none
    aux.update({k: v for k, v in extra.items() if k.startswith("grad_norm/L")})
    if tcfg.qk_clip is not None and finite:  # rescale the heads whose logits on this batch passed tau (lab/qk_clip.py)
        aux.update(qk_clip_(run.model, [x.to(run.rt.device) for x, _ in batches], tcfg.qk_clip))
    stats = StepStats(loss, grad_norm, lr, aux=aux,
                      log_z=extra.get("log_z"),
                      update_norm=update_norm(before, run.model) if logged and finite else None)
    run.watch.step(run.step, loss.item(), grad_norm.item())  # floats: train_step has synchronised already
    if not finite:
        run.skipped += 1
        log.warning("step %d: loss %s / grad norm %s not finite, step skipped (%d of %d allowed)",
                    run.step, loss.item(), grad_norm.item(), run.skipped, tcfg.skip_nonfinite)
        if run.skipped > tcfg.skip_nonfinite:
            if run.updates == 0 and not run.resuming:  # the fresh model gives it: an error, not a divergence
                good = last_good_checkpoint(run.out_dir, run.step) if run.dist.master else None
                raise nonfinite_error(run.step, loss.item(), good, fresh=True, lr=tcfg.lr, tcfg=tcfg)
            run.watch.nonfinite(run.step + 1, loss.item(), tcfg.skip_nonfinite)
    else:
        run.updates += 1
    run.state.step += 1
    return stats


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches, grad_accum: int, grad_clip: float,
               runtime: Runtime, scaler: torch.amp.GradScaler, world: int = 1, z_loss: float = 0.0,
               extra: Optional[dict] = None, layers=None) -> tuple:
    """One optimizer step: forward, loss and backward over this process's micro-batches (x, y; `grad_accum`
    of them), each weighted 1/grad_accum so the step sees their mean (DDP or FSDP then average over
    processes); then clip, the non-finite check and the optimizer's step. Returns (the mean loss of the
    whole global batch, the same whatever the number of processes; global grad norm; finite): a step not
    finite on any rank is skipped on every rank. z_loss > 0: the objective adds z_loss * (log Z)^2
    (z_loss_term); the loss returned stays the cross-entropy; `extra` receives the mean log Z ("log_z"), and
    with `layers` (the model's blocks) each block's gradient norm before clipping ("grad_norm/L{i}")."""
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
    if layers is not None and extra is not None:  # where the gradient goes, block by block (Xiong et al. 2020)
        extra.update({f"grad_norm/L{i}": torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(p.grad) for p in block.parameters() if p.grad is not None]))
            for i, block in enumerate(layers)})
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


@hydra.main(version_base="1.3", config_path=str(Path(__file__).resolve().parent / "configs"), config_name="config")
@cli
def main(cfg):
    from hydra.core.hydra_config import HydraConfig

    if cfg.out_dir:  # out_dir wins: the dir Hydra made for this command is not used
        forget_hydra_run_dir()
    else:
        cfg.out_dir = HydraConfig.get().runtime.output_dir
    name, group, overrides = hydra_run_info()
    result = train(cfg, run_name=name, run_group=group, overrides=overrides)
    report_divergence(result, sweep=group is not None)  # a result: a lone run exits 1, a sweep goes on
    end_sweep_on_signal(result["stopped"], sweep=group is not None)  # a signal stops the whole sweep
    return result["best_val_loss"]  # also when stopped


if __name__ == "__main__":  # the task by its importable name: a launcher that pickles it (submitit) needs one
    from train import main as task
    run_app(task)
