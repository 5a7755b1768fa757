"""Generation speed with and without the KV cache, side by side in one process.

    python bench_sample.py                       # baby preset (6 x 6 x 384, block 256), 1000 tokens, CPU
    python bench_sample.py model=cpu_small tokens=500 device=cuda

Random weights: speed does not depend on what the model learned. Greedy decoding, batch 1.
"""
import sys
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import config  # noqa: F401  (registers the config schema)
from model import GPT, GPTConfig
from sample import generate
from train import pick_device


def main(argv):
    opts = dict(a.split("=", 1) for a in argv if not a.startswith(("model", "+")) and "=" in a)
    overrides = [a for a in argv if a.startswith("model")] or ["model=baby"]
    tokens, device = int(opts.get("tokens", 1000)), pick_device(opts.get("device", "cpu"))
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parent / "configs"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    mcfg = OmegaConf.to_container(cfg.model, resolve=True)
    mcfg.update(vocab_size=int(opts.get("vocab_size", 65)), dropout=0.0)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**mcfg)).to(device).eval()
    prompt = torch.zeros(1, 1, dtype=torch.long, device=device)
    print(f"{overrides[0]}: {model.num_params() / 1e6:.1f}M params, block {model.config.block_size}, "
          f"{tokens} new tokens, device {device}, {torch.get_num_threads()} threads")
    generate(model, prompt, 20, temperature=0, kv_cache=True)  # warm-up
    speed = {}
    for kv_cache in (True, False):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = generate(model, prompt, tokens, temperature=0, kv_cache=kv_cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        speed[kv_cache] = tokens / seconds
        print(f"kv_cache={str(kv_cache).lower():5s}: {seconds:7.2f} s  {speed[kv_cache]:8.1f} tokens/s")
        assert out.shape[1] == tokens + 1
    print(f"speed-up with the cache: {speed[True] / speed[False]:.1f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
