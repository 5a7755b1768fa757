"""Generation speed, side by side in one process: with and without the KV cache, eager and
compiled, batch 1 and batch 8, against the memory-bandwidth bound of a decode step.

    python bench_sample.py                                   # baby preset (6 x 6 x 384, block 256), 1000 tokens, CPU
    python bench_sample.py model=cpu_small tokens=500 device=cuda batch_sizes=[1,8] compile=[false,true]

Random weights (speed does not depend on what the model learned), greedy decoding. The bound:
a cached decode step must read every weight once and the cached keys and values, so
tokens/s <= batch x bandwidth / (weight bytes + KV bytes per step), with the bandwidth measured
here by copying a large tensor.
"""
import os
from dataclasses import dataclass, field
from typing import List, Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from common import Timer, UserError, cli, pick_device, run_app
from config import model_config
from model import GPT, GPTConfig
from sample import generate


@dataclass
class BenchSampleConfig:
    model: GPTConfig = MISSING
    tokens: int = 1000  # new tokens per timed generation
    device: str = "cpu"
    vocab_size: int = 65  # tiny shakespeare's characters, when model.vocab_size is unset
    batch_sizes: List[int] = field(default_factory=lambda: [1, 8])  # samples decoded together
    compile: List[bool] = field(default_factory=lambda: [False, True])  # cached decode step eager / compiled
    recompute: bool = True  # also time the no-cache path (batch 1, eager)
    threads: Optional[int] = None  # intra-op CPU threads for the timed runs; unset: torch's default
    seed: int = 0


ConfigStore.instance().store(name="base_bench_sample", node=BenchSampleConfig)


def memory_bandwidth(device, mib: int = 256, repeats: int = 5) -> float:
    """Bytes/s of a large copy (read + write) with every core, the best of a few: about what a
    decode step, which streams every weight once, could read at."""
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        with Timer(device) as t:
            dst.copy_(src)
        best = min(best, t.seconds)
    torch.set_num_threads(threads)
    return 2 * src.numel() * 4 / best


def decode_bytes(model: GPT, batch: int, context: int) -> int:
    """Bytes a cached decode step reads: every weight once (the tied embedding as the head) and
    the K and V of `context` cached positions."""
    c = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = 2 * c.n_layer * batch * c.n_kv_head * context * c.head_dim * model.wte.weight.element_size()
    return weights + kv


def bench_sample(cfg) -> dict:
    if cfg.tokens <= 0 or not cfg.batch_sizes or min(cfg.batch_sizes) <= 0 or (cfg.threads or 1) <= 0:
        raise UserError(f"tokens={cfg.tokens}, batch_sizes={list(cfg.batch_sizes)} and threads={cfg.threads} "
                        "must be positive")
    device = pick_device(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    mcfg = model_config({**OmegaConf.to_container(cfg.model, resolve=True), "dropout": 0.0}, cfg.vocab_size)
    model = GPT(mcfg).to(device).eval()
    bandwidth = memory_bandwidth(device)
    print(f"{model.num_params() / 1e6:.1f}M params, block {mcfg.block_size}, {cfg.tokens} new tokens, "
          f"device {device}, {torch.get_num_threads()} threads, memory bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows = {}

    def run(name, batch, **kw):
        prompt = torch.zeros(batch, 1, dtype=torch.long, device=device)
        generate(model, prompt, min(cfg.tokens, 20), temperature=0, **kw)  # warm-up (and compile)
        with Timer(device) as t:
            out = generate(model, prompt, cfg.tokens, temperature=0, **kw)
        assert out.shape == (batch, cfg.tokens + 1)
        rows[name] = {"batch": batch, "tokens_per_sec": batch * cfg.tokens / t.seconds, **kw}
        if kw.get("kv_cache", True):  # mean bytes per step over the run: the cache fills up to a block
            context = min(mcfg.block_size, (cfg.tokens + 1) // 2)
            bound = batch * bandwidth / decode_bytes(model, batch, context)
            rows[name]["fraction_of_bound"] = rows[name]["tokens_per_sec"] / bound
        r = rows[name]
        bound_note = f"  {100 * r['fraction_of_bound']:5.1f}% of the bandwidth bound" if "fraction_of_bound" in r else ""
        print(f"{name:28s} {r['tokens_per_sec']:9.1f} tokens/s{bound_note}", flush=True)

    if cfg.recompute:
        run("recompute, batch 1", 1, kv_cache=False)
    for compiled in cfg.compile:
        for batch in cfg.batch_sizes:
            run(f"cache{', compiled' if compiled else ''}, batch {batch}", batch, kv_cache=True, compile=compiled)
    eager1 = rows.get("cache, batch 1")
    if eager1 and "recompute, batch 1" in rows:
        print(f"cache vs recompute (batch 1, eager): {eager1['tokens_per_sec'] / rows['recompute, batch 1']['tokens_per_sec']:.1f}x")
    if "cache, compiled, batch 1" in rows and "recompute, batch 1" in rows:
        print(f"cache vs recompute (batch 1, compiled): "
              f"{rows['cache, compiled, batch 1']['tokens_per_sec'] / rows['recompute, batch 1']['tokens_per_sec']:.1f}x")
    for compiled in cfg.compile:
        tag = ", compiled" if compiled else ""
        for batch in cfg.batch_sizes:
            if batch != 1 and f"cache{tag}, batch 1" in rows:
                ratio = rows[f"cache{tag}, batch {batch}"]["tokens_per_sec"] / rows[f"cache{tag}, batch 1"]["tokens_per_sec"]
                print(f"batch {batch} vs batch 1{tag}: {ratio:.1f}x tokens/s")
    return {"bandwidth": bandwidth, "rows": rows}


@hydra.main(version_base="1.3", config_path="configs", config_name="bench_sample")
@cli
def main(cfg):
    bench_sample(cfg)


if __name__ == "__main__":
    run_app(main)
