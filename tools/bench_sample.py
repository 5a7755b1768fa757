"""Generation speed, side by side in one process: with and without the KV cache, eager and compiled,
batch 1 and batch 8, against the memory-bandwidth bound of a decode step and against transformers'
own generate on the same weights.

    python tools/bench_sample.py                                   # baby preset (6 x 6 x 384, block 256), 1000 tokens, CPU
    python tools/bench_sample.py model=cpu_small tokens=500 device=cuda batch_sizes=[1,8] compile=[false,true]
    python tools/bench_sample.py transformers=[] ratio_tokens=[]   # attnlab alone, at `tokens` only

Random weights (speed does not depend on what the model learned), greedy decoding. The bound:
a cached decode step must read every weight once and the cached keys and values, so
tokens/s <= batch x bandwidth / (weight bytes + KV bytes per step), with the bandwidth measured
here by copying a large tensor on as many CPU threads as the step itself runs on (one thread streams
less than every core: a cached batch 1 runs on one, lab/sampling.decode_threads). Each case is timed
`repeats` times in interleaved rounds (this machine class is noisy) and the median printed with the
range; a compiled case is warmed up at the timed length, so no compilation is timed.
`layouts=[row,column]` also times the weights as training leaves them (row-major) against the layout
sample.py uses on CPU; `kv_dtypes` (default both) times an fp32 and a bf16 KV cache side by side
(sample.py's kv_dtype). A model whose every layer keeps a constant-size recurrent state has no KV
cache: kv_dtypes set is a warning line (the state stays at least fp32, whatever is asked).
`ratio_tokens` (default 64, 256, 1024) times cache against recomputation at those lengths too (batch 1,
eager): the curve of how the cache's lead grows with the context a recomputed step re-reads.
`transformers` (default dynamic and static) adds rows for transformers' generate on the same weights,
exported in-process to the stock class that computes the model (lab/export_hf.py; row-major, as a user
loads them), greedy, at the same threads: with its dynamic cache, and with cache_implementation="static",
eagerly and, where compile includes true, compiled by generate's own compile_config (a dynamic cache
changes shape every step: it is not compiled). Their greedy tokens must equal attnlab's within
block_size (past it attnlab's cache slides and transformers' grows): a line says so where they do not.
The last lines compare attnlab's cached batch 1 (the first layout and kv dtype listed) with the faster
transformers row, eager and compiled. `profile=true` then shows where a cached batch-1 eager step's time
goes (torch.profiler's self time per op, grouped: matmuls, attention, norms, activations, cache writes, and
the rest), beside the weights' one-row products timed alone and the bandwidth bound (profile_step).
"""
import sys
from pathlib import Path

import hydra

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

import contextlib
import copy
import itertools
import statistics
from dataclasses import dataclass, field, replace
from typing import Callable, ClassVar, List, Optional

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
from sample import CachedDecoder, generate  # noqa: E402
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
    transformers: List[str] = field(default_factory=lambda: ["dynamic", "static"])  # transformers' generate with these caches, same weights; [] for none
    ratio_tokens: List[int] = field(default_factory=lambda: [64, 256, 1024])  # with recompute: new tokens at which cache vs recompute is also timed (batch 1, eager)
    repeats: int = 3  # timed runs per case, interleaved; the median is reported
    profile: bool = False  # after the rows: where a cached batch-1 eager step's time goes (profile_step)
    seed: int = 0

    RULES: ClassVar[dict] = {
        "tokens": POSITIVE, "vocab_size": POSITIVE, "batch_sizes": POSITIVE, "threads": Range(1, 4096),
        "layouts": OneOf(("auto", "row", "column")), "kv_dtypes": OneOf(("auto", *DTYPES)), "repeats": POSITIVE,
        "seed": SEED, "dtype": OneOf(("auto", *DTYPES)), "transformers": OneOf(("dynamic", "static")),
        "ratio_tokens": POSITIVE,
    }
    NEEDS: ClassVar[dict] = {"vocab_size": Needs(lambda c: c.model.vocab_size is None, "model.vocab_size is unset")}


ConfigStore.instance().store(name="base_bench_sample", node=BenchSampleConfig)


@dataclass
class Case:
    """One timed row: `run(prompt (batch, 1), n)` generates n tokens greedily and returns (batch, 1 + n)."""
    batch: int
    run: Callable
    threads: Optional[int]  # the CPU threads it runs on (None: as found)
    row: dict  # what the row records besides its speed (generate's keywords, or transformers' cache)
    kv_bytes: Optional[int] = None  # bytes per cached K or V number: a cached case, with a bandwidth bound
    tokens: Optional[int] = None  # new tokens per run (None: cfg.tokens)


def memory_bandwidth(device, threads: Optional[int] = None, mib: int = 256, repeats: int = 5,
                     read_only: bool = False) -> float:
    """Bytes/s of a large copy (read + write) on `threads` CPU threads (None: as set), the best of a few:
    about what a decode step, which streams every weight once, could read at on as many threads.
    read_only: of a sum instead, which only reads (what a one-row product does to its weight)."""
    before = torch.get_num_threads()
    if device.type == "cpu" and threads:
        torch.set_num_threads(threads)
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src) if not read_only else None
    best = float("inf")
    for _ in range(repeats):
        with Timer(device) as t:
            src.sum() if read_only else dst.copy_(src)
        best = min(best, t.seconds)
    torch.set_num_threads(before)
    return (1 if read_only else 2) * src.numel() * 4 / best


def transformers_name(cache: str, compiled: bool, batch: int) -> str:
    return f"transformers, {cache} cache{', compiled' if compiled else ''}, batch {batch}"


def transformers_model(model, mcfg, device, tokens: int, dtype=torch.float32):
    """(transformers' model of the same weights, a note for the header), or (None, why not) where no stock
    class computes the model or its positions end before the run does."""
    import transformers
    from lab.export_hf import NoCounterpart, hf_model, pick_target

    try:
        target = pick_target(mcfg)
    except NoCounterpart as e:
        return None, f"; no transformers rows: {e}"
    if target == "gpt2" and tokens + 1 > mcfg.block_size:
        return None, f"; no transformers rows: GPT-2's position table ends at block_size={mcfg.block_size}"
    hf = hf_model(mcfg, model, target, None, None).to(device, dtype)  # as a user loads it: in the run's dtype
    return hf, f"; transformers {transformers.__version__} {type(hf).__name__} ({hf.config._attn_implementation})"


def transformers_runner(hf, cache: str, compiled: bool, device):
    """transformers' greedy generate with its `cache` (dynamic | static), compiled by its own compile_config
    (CUDA graphs on CUDA, as attnlab's compiled step) or with its automatic compile turned off."""
    from transformers import CompileConfig

    kw = dict(do_sample=False, top_k=None, top_p=None, temperature=None)  # no eos: every run makes all n tokens
    if cache == "static":
        kw["cache_implementation"] = "static"
        if compiled:
            kw["compile_config"] = CompileConfig(mode="reduce-overhead" if device.type == "cuda" else None)
            kw["compile_config"]._compile_all_devices = True  # generate compiles only on GPUs unless told
        else:
            kw["disable_compile"] = True

    def run(prompt, n):  # its weights already in the autocast dtype (transformers_model): no autocast around it
        with torch.autocast(device.type, enabled=False):
            return hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, **kw)
    return run


PROFILE_PARTS = {  # profile_step's rows: a row sums the self time of every op whose name holds one of its strings
    "Linear matmuls (addmm, mm, linear, matmul)": ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul"),
    "attention (scaled_dot_product_attention, its kernels)": ("attention", "softmax"),
    "norms (layer_norm, rms_norm)": ("layer_norm", "rms_norm"),
    "activations (gelu, silu, relu...)": ("gelu", "silu", "relu", "sigmoid", "tanh"),
    "cache writes (copy_)": ("aten::copy_",),
}
EVERYTHING_ELSE = "everything else (views, slices, adds, Python between ops)"


def product_weights(model) -> list:
    """The weights a decode step multiplies its one row by: every Linear of the blocks, and the LM head."""
    return [m.weight for m in [*model.blocks.modules(), model.lm_head] if isinstance(m, torch.nn.Linear)]


def one_row_products(model, device, repeats: int = 7, loops: int = 10) -> float:
    """Seconds for a decode step's weight products alone: one row times every Linear weight of the blocks and
    the LM head (x (1, in) @ W.T, no bias), back to back in a tight loop, the best of `repeats`."""
    weights = product_weights(model)
    rows = [torch.randn(1, w.size(1), device=device) for w in weights]  # (1, in)
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            with Timer(device) as t:
                for _ in range(loops):
                    for x, w in zip(rows, weights):
                        x @ w.t()  # (1, out)
            best = min(best, t.seconds / loops)
    return best


def profile_step(model, mcfg, rt, threads: int, bandwidth: float, context: int, steps: int = 20,
                 warm: int = 5) -> dict:
    """Where a cached decode step's time goes: batch 1, eager, fp32 KV cache, the model as laid out, on
    `threads`. After a prefill and `warm` steps, `steps` steps run under torch.profiler; each op's self time
    goes to its PROFILE_PARTS row, per step, and the step's wall time without the profiler (the best of 5 runs
    of the same steps) less all of theirs is everything else (views, small ops, Python): the profiler's own
    cost between ops stays out of the table, its header shows how much. Then the references: the one-row
    products alone and the bandwidth bound (weights + KV bytes / bandwidth). Prints the table; returns its ms
    per step."""
    from torch.profiler import ProfilerActivity, profile

    device = rt.device
    if device.type == "cpu":
        torch.set_num_threads(threads)
    steps = max(1, min(steps, mcfg.block_size - warm - 1))  # the cache never full: every step a decode step
    start = max(1, min(context, mcfg.block_size - steps) - warm - steps // 2)  # steps centred on the rows' context
    out = torch.zeros(1, start + warm + steps, dtype=torch.long, device=device)  # token 0 throughout

    def per_step(around=contextlib.nullcontext()):  # seconds per step of the `steps` run inside `around`
        with torch.inference_mode(), rt.autocast():
            decoder = CachedDecoder(model, out[:, :start], warm + steps, kv_dtype=torch.float32)
            for n in range(start + 1, start + warm + 1):
                decoder.next_logits(out, n)
            with around, Timer(device) as t:
                for n in range(start + warm + 1, out.size(1) + 1):
                    decoder.next_logits(out, n)
        return t.seconds / steps

    step_ms = 1e3 * min(per_step() for _ in range(5))  # the step as the timed rows run it
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else []))
    profiled_ms = 1e3 * per_step(prof)
    parts = dict.fromkeys(PROFILE_PARTS, 0.0)
    for op in prof.key_averages():
        part = next((p for p, names in PROFILE_PARTS.items() if any(s in op.key for s in names)), None)
        if part:
            parts[part] += op.self_cpu_time_total / 1e3 / steps  # us over all steps -> ms per step
    parts[EVERYTHING_ELSE] = step_ms - sum(parts.values())
    context = start + warm + (steps + 1) // 2  # the profiled steps' mean context
    layout = "column" if model.lm_head.weight.t().is_contiguous() else "row"
    print(f"where a cached decode step's time goes (batch 1, eager, {threads} thread{'s' * (threads > 1)}, kv float32, "
          f"{layout}-major, context {context}, {steps} steps): {step_ms:.3f} ms per step ({profiled_ms:.3f} profiled)"
          + ("; CPU self time, the GPU runs behind" if device.type == "cuda" else ""))
    for part, ms in parts.items():
        print(f"  {part:58s} {ms:7.3f} ms {100 * ms / step_ms:5.1f}%")
    with rt.autocast():
        products = 1e3 * one_row_products(model, device)
    bound = 1e3 * decode_bytes(mcfg, 1, context) / bandwidth
    products_gbs = sum(w.numel() * w.element_size() for w in product_weights(model)) / products / 1e6  # bytes/ms
    reads = memory_bandwidth(device, threads, read_only=True)
    print(f"the one-row products alone (every block Linear and the LM head, best of 7): {products:.3f} ms per step, "
          f"{100 * products / step_ms:.0f}% of the eager step; they read their weights at "
          f"{products_gbs:.1f} GB/s, where a sum reads at {reads / 1e9:.1f}")
    print(f"the bandwidth bound (weights + KV at context {context}, {bandwidth / 1e9:.1f} GB/s): "
          f"{bound:.3f} ms per step")
    return {"step_ms": step_ms, "profiled_ms": profiled_ms, "parts": parts, "products_ms": products, "bound_ms": bound,
            "products_gbs": products_gbs, "read_gbs": reads / 1e9}


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
    for key in ("compile", "transformers", "ratio_tokens"):  # may be empty
        if len(set(cfg[key])) < len(cfg[key]):
            raise UserError(f"{key}={list(cfg[key])}: list each value once")
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

    def threads(batch, kv_cache):  # sample.py's choice for this much work (None: leave torch's as set)
        return None if cfg.threads or device.type != "cpu" else decode_threads(batch, kv_cache, cpu_cores())

    def suffix(layout, kv):  # the layout and cache dtype, where the command compares more than one
        return (f", {layout}-major" if len(cfg.layouts) > 1 else "") + (f", kv {kv}" if len(cfg.kv_dtypes) > 1 else "")

    def name(compiled, batch, layout, kv):
        return f"cache{', compiled' if compiled else ''}, batch {batch}" + suffix(layout, kv)

    def ours(m, batch, **kw):
        if "kv_dtype" in kw:  # sample.py's rule for auto
            kw = {**kw, "kv_dtype": kv_cache_dtype(kw["kv_dtype"], rt, batch)}
        return lambda prompt, n: generate(m, prompt, n, temperature=0, **kw)

    cases = {}  # name -> Case
    if cfg.recompute:
        cases["recompute, batch 1"] = Case(1, ours(models[cfg.layouts[0]], 1, kv_cache=False), threads(1, False),
                                           {"kv_cache": False})
    for layout, kv, compiled, batch in itertools.product(cfg.layouts, cfg.kv_dtypes, cfg.compile, cfg.batch_sizes):
        kw = {"kv_cache": True, "compile": compiled, "kv_dtype": kv}
        cases[name(compiled, batch, layout, kv)] = Case(batch, ours(models[layout], batch, **kw), threads(batch, True),
                                                        kw, kv_cache_dtype(kv, rt, batch).itemsize)
    first = (cfg.layouts[0], cfg.kv_dtypes[0])  # the attnlab rows transformers' are held to: eager where timed
    reference = {batch: name(False not in cfg.compile, batch, *first) for batch in cfg.batch_sizes}
    hf_note = ""
    if cfg.transformers and cfg.compile:
        hf, hf_note = transformers_model(model, mcfg, device, cfg.tokens, rt.dtype)
        for cache, compiled, batch in itertools.product(cfg.transformers, cfg.compile, cfg.batch_sizes):
            if hf is None or (compiled and cache != "static"):  # a dynamic cache is not compiled
                continue
            cases[transformers_name(cache, compiled, batch)] = Case(
                batch, transformers_runner(hf, cache, compiled, device), threads(batch, True),
                {"transformers": cache, "compile": compiled}, kv_cache_dtype("auto", rt, batch).itemsize)
    curve = {}  # new tokens -> the names of its (cache, recompute) cases, batch 1, eager
    for n in cfg.ratio_tokens if cfg.recompute else ():
        curve[n] = (f"cache, batch 1, {n} new tokens", f"recompute, batch 1, {n} new tokens")
        cases[curve[n][0]] = Case(1, ours(models[first[0]], 1, kv_cache=True, kv_dtype=first[1]), threads(1, True), {},
                                  tokens=n)
        cases[curve[n][1]] = replace(cases["recompute, batch 1"], tokens=n)

    bandwidth = {t: memory_bandwidth(device, t) for t in sorted({c.threads or torch.get_num_threads()
                                                                  for c in cases.values() if c.kv_bytes})}
    print(f"{model.num_params() / 1e6:.1f}M params, block {mcfg.block_size}, {cfg.tokens} new tokens, "
          f"device {device}, {cfg.threads or 'per case as sample.py chooses:'} threads, memory bandwidth "
          + ", ".join(f"{b / 1e9:.1f} GB/s on {t} thread{'s' * (t > 1)}" for t, b in bandwidth.items())
          + f", median of {cfg.repeats} interleaved runs{hf_note}")

    outputs = {}  # name -> the tokens of its latest timed run

    def timed(n, tokens):
        case = cases[n]
        if case.threads:
            torch.set_num_threads(case.threads)
        prompt = torch.zeros(case.batch, 1, dtype=torch.long, device=device)
        with Timer(device) as t, rt.autocast():
            out = case.run(prompt, tokens)
        assert out.shape == (case.batch, tokens + 1), (n, out.shape)
        outputs[n] = out
        return case.batch * tokens / t.seconds

    for n, case in cases.items():  # warm-up; a compiled step at the timed length (its cache shape), else short
        if case.tokens is None:
            timed(n, cfg.tokens if case.row.get("compile") else min(cfg.tokens, 20))
    speeds = {n: [] for n in cases}
    for r in range(cfg.repeats):  # rounds alternate the order, so no case always runs first on a noisy machine
        for n in (list(cases) if r % 2 == 0 else reversed(list(cases))):
            speeds[n].append(timed(n, cases[n].tokens or cfg.tokens))
    rows = {}
    for n, case in cases.items():
        if case.tokens is not None:  # the curve's: printed below as ratios
            continue
        rows[n] = {"batch": case.batch, "tokens_per_sec": statistics.median(speeds[n]), **case.row}
        note = ""
        if case.kv_bytes:  # mean bytes per step over the run: the cache fills up to a block
            context = min(mcfg.block_size, (cfg.tokens + 1) // 2)
            bw = bandwidth[case.threads or torch.get_num_threads()]
            bound = case.batch * bw / decode_bytes(mcfg, case.batch, context, kv_bytes=case.kv_bytes)
            rows[n]["fraction_of_bound"] = rows[n]["tokens_per_sec"] / bound
            note = f"  {100 * rows[n]['fraction_of_bound']:5.1f}% of the bandwidth bound"
        spread = f"({min(speeds[n]):.0f}-{max(speeds[n]):.0f})" if cfg.repeats > 1 else ""
        print(f"{n:46s} {rows[n]['tokens_per_sec']:9.1f} tokens/s {spread:>12s}{note}")

    for n, row in rows.items():  # transformers' greedy tokens against attnlab's, within block_size
        want = outputs.get(reference.get(row["batch"]))
        if "transformers" in row and want is not None:
            got, block = outputs[n][:, :mcfg.block_size], want[:, :mcfg.block_size]
            row["same_tokens"] = torch.equal(got, block)
            if not row["same_tokens"]:
                at = (got != block).any(0).nonzero()[0].item()
                print(f"TOKENS DIFFER: {n} generates other greedy tokens than attnlab ({reference[row['batch']]}), "
                      f"from position {at} of {block.size(1)} (within block_size)")

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
    ratios = {n: statistics.median(speeds[c]) / statistics.median(speeds[r]) for n, (c, r) in curve.items()}
    if ratios:
        print("cache vs recompute (batch 1) by new tokens: " + ", ".join(f"{n}: {x:.1f}x" for n, x in ratios.items()))
    for compiled, label in ((False, "eager"), (True, "compiled")):
        ours_row = rows.get(name(compiled, 1, *first))
        theirs = {c: rows[transformers_name(c, compiled, 1)] for c in cfg.transformers
                  if transformers_name(c, compiled, 1) in rows}
        if ours_row and theirs:
            best = max(r["tokens_per_sec"] for r in theirs.values())
            which = f"faster of {', '.join(theirs)}" if len(theirs) > 1 else next(iter(theirs))
            print(f"attnlab {label} / transformers {label} ({which}): "
                  f"{ours_row['tokens_per_sec'] / best:.2f}x")
    result = {"bandwidth": bandwidth, "rows": rows, "cache_vs_recompute": ratios}
    if cfg.profile:  # sample.py's layout and threads for a cached batch 1
        one = threads(1, True) or torch.get_num_threads()
        laid_out = models.get("auto") or (decode_layout(copy.deepcopy(model)) if column["auto"] else model)
        result["profile"] = profile_step(laid_out, mcfg, rt, one, bandwidth.get(one) or memory_bandwidth(device, one),
                                         min(mcfg.block_size, (cfg.tokens + 1) // 2))
    return result


@hydra.main(version_base="1.3", config_path="../configs", config_name="bench_sample")
@cli
def main(cfg):
    bench_sample(cfg)


if __name__ == "__main__":
    run_app(main)
