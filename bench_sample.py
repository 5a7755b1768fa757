"""Generation speed with and without the KV cache, side by side in one process.

    python bench_sample.py                       # baby preset (6 x 6 x 384, block 256), 1000 tokens, CPU
    python bench_sample.py model=cpu_small tokens=500 device=cuda

Random weights: speed does not depend on what the model learned. Greedy decoding, batch 1.
"""
from dataclasses import dataclass

import hydra
import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from common import Timer, UserError, cli, pick_device
from config import model_config
from model import GPT, GPTConfig
from sample import generate


@dataclass
class BenchSampleConfig:
    model: GPTConfig = MISSING
    tokens: int = 1000  # new tokens per timed generation
    device: str = "cpu"
    vocab_size: int = 65  # tiny shakespeare's characters, when model.vocab_size is unset
    seed: int = 0


ConfigStore.instance().store(name="base_bench_sample", node=BenchSampleConfig)


def bench_sample(cfg) -> dict:
    if cfg.tokens <= 0:
        raise UserError(f"tokens={cfg.tokens} must be a positive integer")
    device = pick_device(cfg.device)
    torch.manual_seed(cfg.seed)
    mcfg = model_config({**cfg.model, "dropout": 0.0}, cfg.vocab_size)
    model = GPT(mcfg).to(device).eval()
    prompt = torch.zeros(1, 1, dtype=torch.long, device=device)
    print(f"{model.num_params() / 1e6:.1f}M params, block {mcfg.block_size}, {cfg.tokens} new tokens, "
          f"device {device}, {torch.get_num_threads()} threads")
    generate(model, prompt, 20, temperature=0, kv_cache=True)  # warm-up
    speed = {}
    for kv_cache in (True, False):
        with Timer(device) as t:
            generate(model, prompt, cfg.tokens, temperature=0, kv_cache=kv_cache)
        speed[kv_cache] = cfg.tokens / t.seconds
        print(f"kv_cache={str(kv_cache).lower():5s}: {t.seconds:7.2f} s  {speed[kv_cache]:8.1f} tokens/s")
    print(f"speed-up with the cache: {speed[True] / speed[False]:.1f}x")
    return {"cached": speed[True], "recompute": speed[False]}


@hydra.main(version_base="1.3", config_path="configs", config_name="bench_sample")
@cli
def main(cfg):
    bench_sample(cfg)


if __name__ == "__main__":
    main()
