"""A training run's evaluation: the loss on a fixed set of batches (the same tokens at every evaluation
and in every run with the same data seed, so curves and runs compare), and at its end the loss over
the whole val split. Both take the parts of a run they read (its model, data, config, runtime and
processes); train.evaluate logs them. The attention probe reads a fixed val batch too (probe_batch)."""
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig

from data.loader import TokenData
from lab.attnstats import AttentionProbe
from lab.config import data_seed
from lab.device import Runtime
from lab.parallel import Dist
from model import GPT


@torch.no_grad()
def estimate_loss(model: nn.Module, data: TokenData, cfg: DictConfig, block_size: int, rt: Runtime) -> dict:
    """Mean loss of `model` (what training steps run through: wrapped or compiled alike) over a fixed
    set of train.eval_iters batches per split: the same tokens at every evaluation and in every run
    with the same data seed (of the run config `cfg`), so curves and runs compare."""
    tcfg = cfg.train
    model.eval()
    out = {}
    for i, split in enumerate(("train", "val")):
        gen = torch.Generator().manual_seed(data_seed(cfg) + 1000 + i)
        losses = []
        for _ in range(tcfg.eval_iters):
            x, y = data.get_batch(split, tcfg.batch_size, block_size, gen)
            with rt.autocast():
                _, loss = model(x.to(rt.device), y.to(rt.device))
            losses.append(loss.item())
        out[split] = sum(losses) / len(losses)
    model.train()
    return out


@torch.no_grad()
def full_val_loss(model: GPT, data: TokenData, tcfg: DictConfig, rt: Runtime, dist_: Dist) -> tuple:
    """Mean loss over the whole val split (up to train.final_eval_tokens tokens), in consecutive
    windows of the model's block_size: the run's final figure, free of the sampling noise of eval_iters
    random windows (what runs of an ablation are compared by). Shared across ranks; returns (loss, tokens).
    Every rank runs the same number of forwards (FSDP's all-gathers need them all): one with fewer
    windows ends with a spare forward that counts nothing."""
    T, B = model.config.block_size, tcfg.batch_size
    n = min(len(data.splits["val"]) - 1, tcfg.final_eval_tokens) // T
    starts = torch.arange(n) * T
    total = torch.zeros(2, dtype=torch.float64, device=rt.device)  # summed loss, tokens
    mine = starts[dist_.rank::dist_.world].split(B)
    rounds = math.ceil(math.ceil(n / dist_.world) / B)  # rank 0's, the most
    model.eval()
    for i in range(rounds):
        spare = i >= len(mine)
        x, y = data.batch("val", starts[:1] if spare else mine[i], T)
        with rt.autocast():
            _, loss = model(x.to(rt.device), y.to(rt.device))
        if not spare:
            total[0] += loss.double() * y.numel()
            total[1] += y.numel()
    model.train()
    if dist_.world > 1:
        dist.all_reduce(total)
    return (total[0] / total[1]).item(), int(total[1].item())


def probe_every(tcfg: DictConfig) -> int:
    """Steps between attention probes: train.log_attn_interval, else train.eval_interval (0: never)."""
    return tcfg.eval_interval if tcfg.log_attn_interval is None else tcfg.log_attn_interval


def probe_batch(data: TokenData, batch_size: int, block_size: int, seed: int, device: torch.device) -> AttentionProbe:
    """The attention probe on a fixed val batch, drawn once from the data seed (`seed`): its statistics
    compare across evaluations and runs, as the losses do."""
    x, _ = data.get_batch("val", batch_size, block_size, torch.Generator().manual_seed(seed + 7))
    return AttentionProbe(x.to(device), bos=data.bos is not None)
