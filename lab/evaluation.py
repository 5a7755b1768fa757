"""A training run's evaluation: the loss on a fixed set of batches (the same tokens at every evaluation
and in every run with the same data seed, so curves and runs compare), and at its end the loss over
the whole val split. Both read what a run holds (train.Run: its config, data, model, runtime and
processes); train.evaluate logs them."""
import math

import torch
import torch.distributed as dist

from lab.config import data_seed


@torch.no_grad()
def estimate_loss(run) -> dict:
    """Mean loss over a fixed set of eval_iters batches per split: the same tokens at every
    evaluation and in every run with the same data seed, so curves and runs compare."""
    tcfg = run.cfg.train
    run.fwd_model.eval()
    out = {}
    for i, split in enumerate(("train", "val")):
        gen = torch.Generator().manual_seed(data_seed(run.cfg) + 1000 + i)
        losses = []
        for _ in range(tcfg.eval_iters):
            x, y = run.data.get_batch(split, tcfg.batch_size, run.mcfg.block_size, gen)
            with run.rt.autocast():
                _, loss = run.fwd_model(x.to(run.rt.device), y.to(run.rt.device))
            losses.append(loss.item())
        out[split] = sum(losses) / len(losses)
    run.fwd_model.train()
    return out


@torch.no_grad()
def full_val_loss(run):
    """Mean loss over the whole val split (up to train.final_eval_tokens tokens), in consecutive
    windows of block_size: the run's final figure, free of the sampling noise of eval_iters random
    windows (what runs of an ablation are compared by). Shared across ranks; returns (loss, tokens).
    Every rank runs the same number of forwards (FSDP's all-gathers need them all): one with fewer
    windows ends with a spare forward that counts nothing."""
    T, B = run.mcfg.block_size, run.cfg.train.batch_size
    n = min(len(run.data.splits["val"]) - 1, run.cfg.train.final_eval_tokens) // T
    starts = torch.arange(n) * T
    total = torch.zeros(2, dtype=torch.float64, device=run.rt.device)  # summed loss, tokens
    mine = starts[run.dist.rank::run.dist.world].split(B)
    rounds = math.ceil(math.ceil(n / run.dist.world) / B)  # rank 0's, the most
    run.model.eval()
    for i in range(rounds):
        spare = i >= len(mine)
        x, y = run.data.batch("val", starts[:1] if spare else mine[i], T)
        with run.rt.autocast():
            _, loss = run.model(x.to(run.rt.device), y.to(run.rt.device))
        if not spare:
            total[0] += loss.double() * y.numel()
            total[1] += y.numel()
    run.model.train()
    if run.dist.world > 1:
        dist.all_reduce(total)
    return (total[0] / total[1]).item(), int(total[1].item())
