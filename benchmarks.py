"""Timing on random weights and tokens, shared by the benchmark commands: training steps of the
configured model (ms/iter, tokens/s, MFU, memory; other layer kinds or nanoGPT's GPT side by side) for
tools/bench.py, decode speed with and without the KV cache against the memory-bandwidth bound for
tools/bench_sample.py, both run in one process by tools/gpu_figures.py; and the bytes autograd saves
for the backward pass (tools/bench_attention.py, tools/claims.py). The commands' config schemas are
registered here, so every command that runs them composes the same config."""
import copy
import importlib.util
import itertools
import os
import resource
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import ClassVar, List, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from device import DTYPES, Timer, check_memory, compile_wanted, peak_flops, setup_runtime
from config import Config, check_train_config, model_config
from counting import decode_bytes, flops_per_token as count_flops, training_bytes
from model import GPT, GPTConfig
from optim import build_optimizer, train_step
from rules import NON_NEGATIVE, POSITIVE, SEED, Needs, OneOf, Range, UserError, check_values
from sample import cpu_cores, decode_layout, decode_threads, generate, kv_cache_dtype


# ----------------------------------------------------------------------------- training steps (tools/bench.py)

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


# ----------------------------------------------------------------------------- decoding (tools/bench_sample.py)

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


# ----------------------------------------------------------------------------- memory

def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves while fn() runs its forward, each storage counted once."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen[(st.device, st.data_ptr())] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())
