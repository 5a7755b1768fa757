"""Generation speed, side by side in one process: with and without the KV cache, eager and
compiled, batch 1 and batch 8, against the memory-bandwidth bound of a decode step.

    python tools/bench_sample.py                                   # baby preset (6 x 6 x 384, block 256), 1000 tokens, CPU
    python tools/bench_sample.py model=cpu_small tokens=500 device=cuda batch_sizes=[1,8] compile=[false,true]

Random weights (speed does not depend on what the model learned), greedy decoding. The bound:
a cached decode step must read every weight once and the cached keys and values, so
tokens/s <= batch x bandwidth / (weight bytes + KV bytes per step), with the bandwidth measured
here by copying a large tensor. Each case is timed `repeats` times in interleaved rounds (this
machine class is noisy) and the median printed with the range; a compiled case is warmed up at
the timed length, so no compilation is timed. `layouts=[row,column]` also times the weights as
training leaves them (row-major) against the layout sample.py uses on CPU; `kv_dtypes` (default
both) times an fp32 and a bf16 KV cache side by side (sample.py's kv_dtype). A model whose every layer
keeps a constant-size recurrent state has no KV cache: kv_dtypes set is a warning line (the state stays
at least fp32, whatever is asked).
"""
import sys
from pathlib import Path

import hydra

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

import copy
import itertools
import os
import statistics
from dataclasses import dataclass, field
from typing import ClassVar, List, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from lab.config import model_config  # noqa: E402
from lab.counting import decode_bytes  # noqa: E402
from lab.device import DTYPES, Timer, setup_runtime  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from rules import POSITIVE, SEED, Needs, OneOf, Range, UserError, check_values  # noqa: E402
from lab.sampling import (NO_CACHE, all_recurrent, cpu_cores, decode_layout, decode_threads, kv_cache_dtype,  # noqa: E402
                          warn_no_effect)
from sample import generate  # noqa: E402
from lab.cli import cli, run_app  # noqa: E402



@dataclass
class BenchSampleConfig:
    model: GPTConfig = MISSING
    tokens: int = 1000  # new tokens per timed generation
    device: str = "cpu"
    vocab_size: int = 65  # tiny shakespeare's characters, when model.vocab_size is unset
    batch_sizes: List[int] = field(default_factory=lambda: [1, 8])  # samples decoded together
    compile: List[bool] = field(default_factory=lambda: [False, True])  # cached decode step eager / compiled
    recompute: bool = True  # also time the no-cache path (batch 1, eager)
    threads: Optional[int] = None  # intra-op CPU threads for the timed runs; unset: sample.py's choice per case
    dtype: str = "auto"  # autocast dtype, as sample.py: auto = bfloat16 on capable GPUs, else float32
    layouts: List[str] = field(default_factory=lambda: ["auto"])  # Linear weights: auto (what sample.py does: column-major on CPU) | row | column
    kv_dtypes: List[str] = field(default_factory=lambda: ["float32", "bfloat16"])  # KV cache dtypes (sample.kv_dtype; auto = sample.py's choice)
    repeats: int = 3  # timed runs per case, interleaved; the median is reported
    seed: int = 0

    RULES: ClassVar[dict] = {
        "tokens": POSITIVE, "vocab_size": POSITIVE, "batch_sizes": POSITIVE, "threads": Range(1, 4096),
        "layouts": OneOf(("auto", "row", "column")), "kv_dtypes": OneOf(("auto", *DTYPES)), "repeats": POSITIVE,
        "seed": SEED, "dtype": OneOf(("auto", *DTYPES)),
    }
    NEEDS: ClassVar[dict] = {"vocab_size": Needs(lambda c: c.model.vocab_size is None, "model.vocab_size is unset")}


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


def bench_sample(cfg) -> dict:
    """Time each case; torch's thread count is left as found (each case may set its own)."""
    threads = torch.get_num_threads()
    try:
        return timed_cases(cfg)
    finally:
        torch.set_num_threads(threads)


def timed_cases(cfg) -> dict:
    check_values(cfg)
    for key in ("batch_sizes", "layouts", "kv_dtypes"):  # each a list of cases to time
        if not cfg[key] or len(set(cfg[key])) < len(cfg[key]):
            raise UserError(f"{key}={list(cfg[key])}: list at least one value, each once")
    if len(set(cfg.compile)) < len(cfg.compile):
        raise UserError(f"compile={list(cfg.compile)}: list each value once")
    if not cfg.compile and not cfg.recompute:  # before anything is built or printed
        raise UserError("nothing to time: compile=[] leaves no cached case and recompute=false no recomputing one; "
                        "give compile=[false] (or [false,true]), or recompute=true")
    rt = setup_runtime(cfg.device, cfg.dtype)  # the device and autocast sample.py would use
    device = rt.device
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    mcfg = model_config({**OmegaConf.to_container(cfg.model, resolve=True), "dropout": 0.0}, cfg.vocab_size)
    model = GPT(mcfg).to(device).eval()
    if all_recurrent(model) and list(cfg.kv_dtypes) != BenchSampleConfig().kv_dtypes:  # the layers keep no KV cache
        warn_no_effect([("kv_dtypes", list(cfg.kv_dtypes))], model, NO_CACHE, what="this model")
    column = {"row": False, "column": True, "auto": device.type == "cpu"}  # auto: as sample.py lays weights out
    models = {layout: decode_layout(copy.deepcopy(model)) if column[layout] else model for layout in cfg.layouts}
    bandwidth = memory_bandwidth(device)
    print(f"{model.num_params() / 1e6:.1f}M params, block {mcfg.block_size}, {cfg.tokens} new tokens, "
          f"device {device}, {cfg.threads or 'per case as sample.py chooses:'} threads, memory bandwidth {bandwidth / 1e9:.1f} GB/s, "
          f"median of {cfg.repeats} interleaved runs")

    def suffix(layout, kv):  # the layout and cache dtype, where the command compares more than one
        return (f", {layout}-major" if len(cfg.layouts) > 1 else "") + (f", kv {kv}" if len(cfg.kv_dtypes) > 1 else "")

    def name(compiled, batch, layout, kv):
        return f"cache{', compiled' if compiled else ''}, batch {batch}" + suffix(layout, kv)

    cases = {}  # name -> (model, batch, generate's keywords)
    if cfg.recompute:
        cases["recompute, batch 1"] = (models[cfg.layouts[0]], 1, {"kv_cache": False})
    for layout, kv, compiled, batch in itertools.product(cfg.layouts, cfg.kv_dtypes, cfg.compile, cfg.batch_sizes):
        cases[name(compiled, batch, layout, kv)] = (models[layout], batch,
                                                    {"kv_cache": True, "compile": compiled, "kv_dtype": kv})

    def timed(case, tokens):
        m, batch, kw = case
        if not cfg.threads and device.type == "cpu":  # sample.py's choice for this much work
            torch.set_num_threads(decode_threads(batch, kw["kv_cache"], cpu_cores()))
        if "kv_dtype" in kw:
            kw = {**kw, "kv_dtype": kv_cache_dtype(kw["kv_dtype"], rt, batch)}  # sample.py's rule for auto
        prompt = torch.zeros(batch, 1, dtype=torch.long, device=device)
        with Timer(device) as t, rt.autocast():
            out = generate(m, prompt, tokens, temperature=0, **kw)
        assert out.shape == (batch, tokens + 1)
        return batch * tokens / t.seconds

    for case in cases.values():  # warm-up; a compiled step at the timed length (its cache shape), else short
        timed(case, cfg.tokens if case[2].get("compile") else min(cfg.tokens, 20))
    speeds = {n: [] for n in cases}
    for r in range(cfg.repeats):  # rounds alternate the order, so no case always runs first on a noisy machine
        for n in (list(cases) if r % 2 == 0 else reversed(list(cases))):
            speeds[n].append(timed(cases[n], cfg.tokens))
    rows = {}
    for n, (m, batch, kw) in cases.items():
        rows[n] = {"batch": batch, "tokens_per_sec": statistics.median(speeds[n]), **kw}
        note = ""
        if kw["kv_cache"]:  # mean bytes per step over the run: the cache fills up to a block
            context = min(mcfg.block_size, (cfg.tokens + 1) // 2)
            kv_bytes = kv_cache_dtype(kw["kv_dtype"], rt, batch).itemsize
            bound = batch * bandwidth / decode_bytes(m.config, batch, context, kv_bytes=kv_bytes)
            rows[n]["fraction_of_bound"] = rows[n]["tokens_per_sec"] / bound
            note = f"  {100 * rows[n]['fraction_of_bound']:5.1f}% of the bandwidth bound"
        spread = f"({min(speeds[n]):.0f}-{max(speeds[n]):.0f})" if cfg.repeats > 1 else ""
        print(f"{n:34s} {rows[n]['tokens_per_sec']:9.1f} tokens/s {spread:>12s}{note}")

    recompute = rows.get("recompute, batch 1")
    for layout, kv, compiled in itertools.product(cfg.layouts, cfg.kv_dtypes, cfg.compile):
        tag = (", compiled" if compiled else "") + suffix(layout, kv)
        one = rows.get(name(compiled, 1, layout, kv))
        if one and recompute:
            print(f"cache vs recompute (batch 1{tag}): {one['tokens_per_sec'] / recompute['tokens_per_sec']:.1f}x")
        for batch in cfg.batch_sizes:
            if batch != 1 and one:
                ratio = rows[name(compiled, batch, layout, kv)]["tokens_per_sec"] / one["tokens_per_sec"]
                print(f"batch {batch} vs batch 1{tag}: {ratio:.1f}x tokens/s")
    return {"bandwidth": bandwidth, "rows": rows}


@hydra.main(version_base="1.3", config_path="../configs", config_name="bench_sample")
@cli
def main(cfg):
    bench_sample(cfg)


if __name__ == "__main__":
    run_app(main)
