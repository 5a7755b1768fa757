"""Time training steps of the configured model on random tokens (no data preparation).

    python tools/bench.py model=cpu_small train.batch_size=12            # ms/iter, tokens/s, MFU, memory
    python tools/bench.py model=cpu_small train.batch_size=12 bench.compare=/path/to/nanoGPT
    python tools/bench.py model=cpu_small train.batch_size=12 bench.kinds=[gdn,mamba2,gdn+softmax]

With bench.compare pointing at a karpathy/nanoGPT checkout, its GPT is timed at the same shapes
(learned positions instead of RoPE, otherwise the same block), interleaved round by round with
ours in one process, and the ratio printed: these machines are too noisy for anything else.
bench.kinds times the same model with other layer kinds the same way (each entry a layer_kinds
pattern, its layers joined by +): the step time of each as a ratio to the configured model's.
"""
import sys
from pathlib import Path

import hydra

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

import importlib.util
import resource
import statistics
from dataclasses import dataclass, field, replace
from typing import ClassVar, List, Optional

import torch
from hydra.core.config_store import ConfigStore

from lab.config import Config, check_train_config, model_config  # noqa: E402
from lab.counting import flops_per_token as count_flops, training_bytes  # noqa: E402
from lab.device import Timer, check_memory, compile_wanted, peak_flops, setup_runtime  # noqa: E402
from lab.optim import build_optimizer  # noqa: E402
from model import GPT  # noqa: E402
from rules import NON_NEGATIVE, POSITIVE, Needs, Range  # noqa: E402
from lab.cli import cli, run_app  # noqa: E402
from lab.device import is_oom  # noqa: E402
from rules import UserError  # noqa: E402
from train import train_step  # noqa: E402  (the training step timed is train.py's own)



@dataclass
class BenchSettings:
    iters: int = 30  # timed steps per round
    warmup: int = 5  # untimed steps first (allocator, compile, caches)
    rounds: int = 6  # interleaved rounds when comparing (order alternating); the median is reported
    vocab_size: int = 65  # used when model.vocab_size is unset (tiny shakespeare's characters)
    compare: Optional[str] = None  # a karpathy/nanoGPT checkout to time side by side
    kinds: List[str] = field(default_factory=list)  # layer-kind patterns to time side by side: [gdn,gdn+softmax]
    cpu_peak_flops: float = 180e9  # CPU peak for MFU (fp32 matmul ceiling of 2 cores here); GPUs: train.peak_flops or the table

    RULES: ClassVar[dict] = {"iters": POSITIVE, "warmup": NON_NEGATIVE, "rounds": POSITIVE, "vocab_size": POSITIVE,
                             "cpu_peak_flops": Range(0, lo_open=True)}
    NEEDS: ClassVar[dict] = {"rounds": Needs(lambda b: b.compare is not None or b.kinds, "{p}compare=NANOGPT_CHECKOUT "
                                             "or {p}kinds is set (rounds interleave several models)")}


@dataclass
class BenchConfig(Config):
    bench: BenchSettings = field(default_factory=BenchSettings)


ConfigStore.instance().store(name="base_bench", node=BenchConfig)


def rss_mb() -> float:
    """Resident memory of this process now, in MiB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def load_nanogpt(path):
    """GPT and GPTConfig from a nanoGPT checkout's model.py, imported under another name."""
    file = Path(path) / "model.py" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise UserError(f"bench.compare={path!r}: no model.py there (give a karpathy/nanoGPT checkout)")
    spec = importlib.util.spec_from_file_location("nanogpt_model", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GPT, module.GPTConfig


def time_steps(model, optimizer, cfg, rt, n, batch):
    """Seconds per training step, mean of n steps (GPU work included); None for no steps (no warm-up)."""
    scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.dtype == torch.float16)
    accum = cfg.train.grad_accum or 1
    with Timer(rt.device) as t:
        for _ in range(n):
            train_step(model, optimizer, [batch] * accum, accum, cfg.train.grad_clip, rt, scaler)
    return t.seconds / n if n else None


def bench(cfg) -> dict:
    check_train_config(cfg)  # train.batch_size=0 would time nothing and print "0 tokens/s"
    torch.manual_seed(cfg.seed)
    rt = setup_runtime(cfg.device, cfg.dtype)
    device = rt.device
    mcfg = model_config(cfg.model, cfg.bench.vocab_size)
    B, T = cfg.train.batch_size, mcfg.block_size
    vocab = "model.vocab_size" if cfg.model.vocab_size else "bench.vocab_size"
    check_memory(training_bytes(mcfg, B), device, "the model and batch", f"model.n_layer={mcfg.n_layer}, "
                 f"model.n_embd={mcfg.n_embd}, {vocab}={mcfg.vocab_size}, model.block_size={T}, train.batch_size={B}")
    x = torch.randint(mcfg.vocab_size, (B, T), device=device)
    batch = (x, torch.roll(x, -1, dims=1))

    models = {"attnlab": GPT(mcfg).to(device)}
    for pattern in cfg.bench.kinds:  # the same model, another kind in each layer (checked as model.attn.layer_kinds)
        layer_kinds = pattern.split("+")
        try:
            models[pattern] = GPT(replace(mcfg, attn=replace(mcfg.attn, kind="softmax", layer_kinds=layer_kinds))).to(device)
        except UserError as e:
            raise UserError(f"bench.kinds entry {pattern!r}: {e}") from None
    if cfg.bench.compare:
        NanoGPT, NanoConfig = load_nanogpt(cfg.bench.compare)
        models["nanoGPT"] = NanoGPT(NanoConfig(block_size=T, vocab_size=mcfg.vocab_size, n_layer=mcfg.n_layer,
                                               n_head=mcfg.n_head, n_embd=mcfg.n_embd, dropout=mcfg.dropout,
                                               bias=mcfg.bias)).to(device)
    rss_before = rss_mb()  # CPU memory is measured from here: the steps' activations and optimizer state
    runners = {}
    for name, m in models.items():
        # ours steps with what train.py would build (AdamW or Muon + AdamW); nanoGPT's with AdamW
        opt = build_optimizer(m, cfg.train, device) if name == "attnlab" else torch.optim.AdamW(
            m.parameters(), lr=1e-4, betas=(cfg.train.beta1, cfg.train.beta2),
            weight_decay=cfg.train.weight_decay, fused=device.type == "cuda")
        runners[name] = (torch.compile(m) if compile_wanted(cfg.compile, device) else m, opt)
        time_steps(*runners[name], cfg, rt, cfg.bench.warmup, batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = {name: [] for name in runners}
    for r in range(cfg.bench.rounds if len(runners) > 1 else 1):
        order = list(runners) if r % 2 == 0 else list(reversed(runners))  # no model always goes first
        for name in order:
            times[name].append(time_steps(*runners[name], cfg, rt, cfg.bench.iters, batch))

    peak = peak_flops(rt, cfg.train.peak_flops or (cfg.bench.cpu_peak_flops if device.type == "cpu" else None))
    tokens = B * T * (cfg.train.grad_accum or 1)
    flops_per_token = count_flops(models["attnlab"].config, T)
    result = {"device": str(device), "dtype": str(rt.dtype).replace("torch.", ""), "batch_size": B,
              "block_size": T, "params": models["attnlab"].num_params(), "flops_per_token": flops_per_token}
    for name, ts in times.items():
        s = statistics.median(ts)
        result[name] = {"ms_per_iter": 1000 * s, "tokens_per_sec": tokens / s}
    ours = result["attnlab"]
    ours["mfu"] = flops_per_token * ours["tokens_per_sec"] / peak if peak else None
    if device.type == "cuda":
        result["peak_mem_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    else:  # growth of the process's peak resident set over what it held before the timed steps
        result["peak_mem_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss_before
    if "nanoGPT" in result:
        result["speed_ratio"] = result["nanoGPT"]["ms_per_iter"] / ours["ms_per_iter"]
    for pattern in cfg.bench.kinds:  # > 1: the pattern's step takes longer than the configured model's
        result[pattern]["params"] = models[pattern].num_params()
        result[pattern]["time_ratio"] = result[pattern]["ms_per_iter"] / ours["ms_per_iter"]
        result[pattern]["round_ratios"] = [a / b for a, b in zip(times[pattern], times["attnlab"])]
    return result


def print_result(r):
    print(f"device {r['device']} ({r['dtype']}), batch {r['batch_size']} x block {r['block_size']}, "
          f"{r['params'] / 1e6:.2f}M params, {r['flops_per_token'] / 1e6:.2f} MFLOP/token")
    for name in ("attnlab", "nanoGPT"):
        if name in r:
            print(f"{name:8s}: {r[name]['ms_per_iter']:7.2f} ms/iter  {r[name]['tokens_per_sec']:10.0f} tokens/s")
    for name, k in r.items():
        if isinstance(k, dict) and "time_ratio" in k:  # bench.kinds: each round's ratio too, for its spread
            spread = ", ".join(f"{x:.2f}" for x in k["round_ratios"])
            print(f"{name}: {k['ms_per_iter']:7.2f} ms/iter  {k['tokens_per_sec']:10.0f} tokens/s  "
                  f"{k['params'] / 1e6:.2f}M params  {k['time_ratio']:.2f}x the step time (rounds: {spread})")
    if r["attnlab"]["mfu"] is not None:
        print(f"MFU (attnlab): {100 * r['attnlab']['mfu']:.2f}%")
    print(f"peak memory of the timed steps: {r['peak_mem_mb']:.0f} MiB")
    if "speed_ratio" in r:
        print(f"speed ratio attnlab/nanoGPT (>1 = attnlab faster): {r['speed_ratio']:.3f}")


@hydra.main(version_base="1.3", config_path="../configs", config_name="bench")
@cli
def main(cfg):
    try:
        result = bench(cfg)
    except RuntimeError as e:
        if is_oom(e):
            raise UserError(f"out of memory at train.batch_size={cfg.train.batch_size}: lower it, "
                            "model.block_size or the model size") from None
        raise
    print_result(result)


if __name__ == "__main__":
    run_app(main)
