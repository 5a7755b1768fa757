"""What does attention cost? Parameters, compute and memory of a model config at a sequence length.

    python tools/cost.py model=llama3_8b_shape seq_len=8192              # a Llama-3-8B-like shape at 8k
    python tools/cost.py model=gpt2_124m model.vocab_size=50304 seq_len=1024 batch_size=8 dtype=float32
    python tools/cost.py model=default model.n_kv_head=1 seq_len=4096 format=json
    python tools/cost.py model=gpt2_124m model.vocab_size=50304 batch_size=8 world_size=8   # DDP or FSDP?

Everything is counted from the config by lab/counting.py (its docstring gives the convention); no
model is built, so any shape runs on a laptop.
"""
import json
import math
import sys
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import ClassVar, Optional

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

from lab.cli import cli, run_app  # noqa: E402
from lab.device import DTYPES  # noqa: E402
from files import check_output_file, default_output  # noqa: E402
from rules import POSITIVE, Needs, OneOf, Range, check_values  # noqa: E402
from lab.counting import (ADAMW_BYTES_PER_PARAM, RECURRENT, all_attention, attention_variants, cache_table, count_params, crossovers,
                      kv_cache_bytes, layer_table, macs_per_token, memory_breakdown, mlp_matrices, per_gpu_bytes,
                      selected_keys, selected_macs, state_bytes)
from lab.config import model_config
from model import GPTConfig


@dataclass
class CostConfig:
    model: GPTConfig = MISSING
    seq_len: Optional[int] = None  # N, tokens per sequence; unset: model.block_size
    batch_size: int = 1  # B, sequences (for the attention table, the KV cache and a step's FLOPs)
    dtype: str = "bfloat16"  # bytes per weight, activation and cached K/V: bfloat16 | float16 | float32
    vocab_size: int = 50304  # used when model.vocab_size is unset: GPT-2's BPE padded to a multiple of 64
    format: str = "text"  # text | json (one JSON object on stdout)
    plot: Optional[str] = default_output("cost", "cost.png")  # the figure (a new dir per call); null: none
    train_tokens: Optional[float] = None  # tokens one training run sees (steps x batch x block): its FLOPs and time
    peak_flops: float = 989e12  # the GPU's peak FLOP/s for that estimate (H100 SXM, bf16 dense)
    mfu: float = 0.2  # the fraction of peak a run reaches (small models reach less than large ones)
    world_size: int = 8  # GPUs training together: the per-GPU memory of DDP and FSDP across them (batch_size per GPU)

    RULES: ClassVar[dict] = {"seq_len": POSITIVE, "batch_size": POSITIVE, "vocab_size": POSITIVE,
                             "dtype": OneOf(tuple(DTYPES)), "format": OneOf(("text", "json")),
                             "train_tokens": Range(1), "peak_flops": Range(0, lo_open=True),
                             "mfu": Range(0, 1, lo_open=True),
                             "world_size": Range(1, 1_000_000, why="GPUs training together")}
    NEEDS: ClassVar[dict] = {"vocab_size": Needs(lambda c: c.model.vocab_size is None, "model.vocab_size is unset")}


ConfigStore.instance().store(name="base_cost", node=CostConfig)


def round_half_up(x: Fraction) -> int:
    return math.floor(x + Fraction(1, 2))


# ----------------------------------------------------------------------------- the report

def cost(cfg) -> dict:
    """The JSON object of `format=json` (integers: counts, MACs, bytes); prints it, or the text
    report, and writes the plot."""
    check_values(cfg)
    if cfg.plot:
        check_output_file(cfg.plot, "plot")
    fallback = cfg.model.vocab_size is None  # no data is loaded: any vocabulary may be asked about
    c = model_config(cfg.model, cfg.vocab_size if fallback else None)
    N = c.block_size if cfg.seq_len is None else cfg.seq_len
    nbytes = DTYPES[cfg.dtype].itemsize
    p, m, x = count_params(c), macs_per_token(c, N), crossovers(c)
    mem = memory_breakdown(c, N, cfg.batch_size, nbytes)
    result = {
        "params": p["total"],
        "macs_per_token": {k: m[k] for k in ("proj", "attn", "mlp", "lm_head")},
        "crossover": {k: round_half_up(v) for k, v in x.items()},
        "memory_bytes": mem,
        "attention_variants": attention_variants(c, N, cfg.batch_size, nbytes),
        "kv_cache_table": cache_table(c, (8192, 131072), cfg.batch_size),
        "memory_per_gpu": memory_per_gpu(c, N, cfg.batch_size, nbytes, cfg.world_size),
        "layers": layer_table(c, N, cfg.batch_size, nbytes),
    }
    if any(r["kind"] in RECURRENT for r in result["layers"]):  # against the same stack with attention everywhere
        result["all_attention"] = {name: stack(x, N, cfg.batch_size, nbytes) for name, x in
                                   (("this", c), ("all_attention", all_attention(c)))}
    if c.attn.select != "none":  # keys chosen by content: what a query reads, against the causal table's
        result["selected_keys_per_query"] = {"selected": float(selected_keys(c, N)),
                                             "causal": float(selected_keys(replace(c, attn=replace(c.attn, select="none")), N))}
    if c.attn.select == "moba":  # what a layer computing only the chosen blocks does (model.attn.impl=gathered)
        sm = selected_macs(c, N)
        result["selected_macs_per_token"] = {**{k: float(v) for k, v in sm.items()}, "total": float(sum(sm.values())),
                                             "full_table": 2 * N * c.n_head * c.head_dim}
    if cfg.train_tokens:  # a training run's FLOPs, and its time at the stated peak and MFU
        flops = 6 * m["forward"] * cfg.train_tokens
        result["training_run"] = {"tokens": cfg.train_tokens, "flops": flops,
                                  "seconds": flops / (cfg.peak_flops * cfg.mfu)}
    if cfg.format == "json":
        print(json.dumps(result))
    else:
        if fallback:
            print(f"(model.vocab_size unset: vocab_size={cfg.vocab_size} assumed; set model.vocab_size=V)")
        print(report(c, N, cfg.batch_size, cfg.dtype, p, m, x, mem))
        print(variants_report(result["attention_variants"], c, N, cfg.batch_size, cfg.dtype))
        print(cache_report(result["kv_cache_table"], cfg.batch_size))
        print(per_gpu_report(result["memory_per_gpu"], N, cfg.batch_size, cfg.dtype, cfg.world_size))
        print(layers_report(result, c, N, cfg.batch_size, cfg.dtype))
        if "selected_keys_per_query" in result:
            r = result["selected_keys_per_query"]
            print(f"\nmodel.attn.select={c.attn.select}: a query reads {r['selected']:,.1f} keys on average at N={N:,} "
                  f"(the causal table: {r['causal']:,.1f}); the masked paths still compute every score "
                  "(counting.selected_keys)")
        if "selected_macs_per_token" in result:
            print(selected_report(result["selected_macs_per_token"], c, N))
        if cfg.train_tokens:
            r = result["training_run"]
            print(f"\na training run of {short(r['tokens'])} tokens at N={N:,}: {r['flops']:.3g} FLOPs (6 x forward "
                  f"MACs per token x tokens); at {cfg.mfu:.0%} of {short(cfg.peak_flops)} FLOP/s, "
                  f"{r['seconds'] / 60:.1f} minutes of compute (evaluations, compilation and start-up come on top)")
    if cfg.plot:
        plot_cost(c, N, cfg.batch_size, cfg.dtype, x, mem, cfg.plot)
        print(f"wrote {cfg.plot}: per-layer MACs against N with the crossovers, memory at N={N:,}",
              file=sys.stdout if cfg.format == "text" else sys.stderr)  # stdout stays one JSON object
    return result


def short(n) -> str:
    """A count in words: 8.03 billion, 33.6 million."""
    for scale, word in ((1e12, "trillion"), (1e9, "billion"), (1e6, "million"), (1e3, "thousand")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {word}"
    return f"{n:g}"


def size(nbytes) -> str:
    """Bytes in binary units (KiB = 2^10 B, MiB = 2^20 B, GiB = 2^30 B, TiB = 2^40 B)."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:{'.2f' if nbytes < 1e6 * scale else '.3g'}} {unit}"  # 1e+30 TiB, not 31 digits
    return f"{nbytes} B"


def heads_word(n: int) -> str:
    return f"{n} K/V head" + ("" if n == 1 else "s")


def describe(c: GPTConfig) -> str:
    heads = (f"{c.n_head} heads of {c.head_dim}" if c.n_kv_head == c.n_head else
             f"{c.n_head} query heads of {c.head_dim} sharing {heads_word(c.n_kv_head)} "
             f"({'MQA' if c.n_kv_head == 1 else 'GQA'})")
    return (f"{c.n_layer} layers x {c.n_embd} wide, {heads}, {c.mlp} MLP d_ff={c.d_ff}, vocab "
            f"{c.vocab_size}, {c.norm} ({c.norm_position}), positions {c.pos}, "
            f"{'tied' if c.tie_embeddings else 'untied'} LM head, block {c.block_size}")


def report(c, N, B, dtype, p, m, x, mem) -> str:
    d, L = c.n_embd, c.n_layer
    nbytes = DTYPES[dtype].itemsize
    k = mlp_matrices(c)
    out = [f"cost of {describe(c)}",
           f"at N={N:,} tokens per sequence, batch B={B}, {dtype} ({nbytes} bytes per number); "
           "counted from the config, no model built"
           + (f"; N > block_size={c.block_size}: the cost the model would have at N" if N > c.block_size else ""),
           "", "parameters (count)"]
    rows = [("embedding (wte" + (" + wpe)" if c.pos == "learned" else ")"), p["embedding"]),
            ("LM head" + (" (tied to wte: 0 extra)" if c.tie_embeddings else " (untied)"), p["lm_head"]),
            (f"attention ({L} layers: Q,K,V,O" + (", QK-Norm gains)" if c.attn.qk_norm and
                                                  c.attn.qk_norm_gain != "none" else ")"), p["attention"]),
            (f"MLP ({L} layers, {c.mlp})", p["mlp"]), ("norms", p["norms"])]
    for name, n in rows:
        out.append(f"  {name:<46}{n:>17,}  {100 * n / p['total']:5.1f}%")
    out.append(f"  {'total':<46}{p['total']:>17,}  ({short(p['total'])})")

    mlp_formula = {2: "2*d*d_ff", 3: "3*d*d_ff"}[k]
    out += ["", f"forward cost per token at N={N:,}, in MACs (multiply-accumulates; 1 MAC = 2 FLOPs), "
                "attention over the full N x N table",
            f"  per layer (d={d}, d_kv=n_kv_head*head_dim={c.n_kv_head * c.head_dim}, d_ff={c.d_ff})"]
    lines = [("Q projection", "d*d", m["q"]), ("K projection", "d*d_kv", m["k"]),
             ("V projection", "d*d_kv", m["v"]), ("O projection", "d*d", m["o"]),
             ("attention scores q.k^T", "N*d", m["scores"]), ("attention weights.V", "N*d", m["weighted_sum"]),
             (f"MLP ({c.mlp})", mlp_formula, m["mlp"]),
             ("norms, biases, gains", "1 per param", m["other"]), ("layer total", "", m["layer"])]
    for name, formula, n in lines:
        out.append(f"    {name:<24}{formula:<14}{n:>17,} MACs")
    out.append(f"  {'LM head':<26}{'d*vocab':<14}{m['lm_head']:>17,} MACs")
    if m["other_final"]:
        out.append(f"  {'final norm':<26}{'1 per param':<14}{m['other_final']:>17,} MACs")
    fwd = m["forward"]
    train = 6 * fwd
    out += [f"  forward, {L} layers + head: {fwd:,} MACs = {2 * fwd:,} FLOPs per token ({short(2 * fwd)} FLOPs)",
            f"  training (backward = 2 x forward): {train:,} FLOPs per token ({short(train)} FLOPs)",
            f"    = counting.flops_per_token({N}) = 6 x {p['non_embedding']:,} params + 12*n_layer*N*d (6N counts every",
            "    parameter but the lookup tables: an untied wte, learned positions)",
            f"    per step of B*N = {B * N:,} tokens: {short(train * B * N)} FLOPs",
            f"  attention's N^2 part (scores + weights.V) is {100 * L * m['attn'] / fwd:.1f}% of the forward "
            "at this N;",
            "  a causal kernel (SDPA is_causal, FlashAttention) skips the masked keys, about half of that",
            "  part: a query sees (N+1)/2 keys on average"]

    mlp_x = "d_ff" if k == 2 else "3*d_ff/2"
    cross = [("(a) the projections", "2*d*(d+d_kv)", "d + d_kv", x["attn_vs_proj"]),
             ("(b) the MLP", mlp_formula, mlp_x, x["attn_vs_mlp"]),
             ("(c) projections + MLP", "", f"d + d_kv + {mlp_x}", x["attn_vs_proj_mlp"])]
    out += ["", "crossovers: the N at which attention's N^2 part, 2*N*d MACs per token and layer, equals"
            + (" (in a softmax layer: the recurrent ones have no N^2 part)" if c.attn.layer_kinds else "")]
    for name, formula, closed, n in cross:
        out.append(f"  {name:<22}{formula:<14}N = {closed:<22}= {fmt_len(n):>9} tokens")
    out.append(f"  at N={N:,} attention is {float(N / x['attn_vs_proj_mlp']):.2f}x projections + MLP "
               "(the ratio grows linearly with N)")

    items = [("weights", f"{p['total']:,} params x {nbytes} B", mem["weights"]),
             ("AdamW state", f"exp_avg + exp_avg_sq in fp32, {ADAMW_BYTES_PER_PARAM} B/param", mem["adamw_state"]),
             ("naive attention weights, one layer", f"B*n_head*N*N x {nbytes} B", mem["attn_weights_per_layer"]),
             (f"naive attention weights, {L} layers", "kept for backward", mem["attn_weights_all_layers"]),
             ("KV cache per token (one sequence)", f"2*n_layer*n_kv_head*head_dim x {nbytes} B",
              mem["kv_cache_per_token"]),
             (f"KV cache at N, batch {B}", f"x N x B, {heads_word(c.n_kv_head)}", mem["kv_cache"]),
             (f"KV cache with MHA ({c.n_head} K/V heads)", "same config, n_kv_head=n_head", mem["kv_cache_mha"])]
    out += ["", f"memory at N={N:,}, batch {B}, {dtype}, in bytes (KiB, MiB, GiB = 2^10, 2^20, 2^30 bytes)"]
    for name, how, n in items:
        out.append(f"  {name:<38}{how:<42}{size(n):>11}  ({n:,} B)")
    if c.n_kv_head != c.n_head:
        out.append(f"  {'MQA' if c.n_kv_head == 1 else 'GQA'}: {heads_word(c.n_kv_head)} instead of {c.n_head} "
                   f"make the cache {c.n_head // c.n_kv_head}x smaller, saving "
                   f"{size(mem['kv_cache_mha'] - mem['kv_cache'])} at N={N:,}, batch {B}")
    out.append("  a fused kernel (FlashAttention) never materialises the N x N table: O(N) memory, not O(N^2)")
    return "\n".join(out)


def cache_report(rows, B) -> str:
    """counting.cache_table: the KV cache of this shape stored every way, per token and at 8k / 128k."""
    out = ["", f"the KV cache of this shape, stored each way (all layers, batch {B}; counting.cache_table)",
           f"  {'kind':<28}{'dtype':<10}{'per token':>12}{'at 8k tokens':>14}{'at 128k tokens':>16}"]
    for r in rows:
        out.append(f"  {r['kind']:<28}{r['dtype']:<10}{size(r['per_token']):>12}{size(r['8192']):>14}"
                   f"{size(r['131072']):>16}")
    out.append("  int8: one byte per number plus an fp32 scale per token and head; MLA: one latent (and RoPE key) "
               "per token for all heads")
    return "\n".join(out)


def variants_report(rows, c, N, B, dtype) -> str:
    """The table of counting.attention_variants: what each way of computing attention costs at N."""
    out = ["", f"attention's N x N table, paid for four ways (one layer, N={N:,}, batch {B}, {dtype}; "
               "counting.attention_variants says what each counts)",
           f"  {'path or kind':<26}{'MACs per token':>16}{'training memory':>18}{'  grows as':<12}{'costs less than the reference from N =':>40}"]
    for r in rows:
        beats = "-" if r["beats_full_from"] is None else f"{r['beats_full_from']:,} (memory" + \
            (" and compute)" if r["macs"] < 2 * N * c.n_embd or r["name"].startswith("linear") else ")")
        out.append(f"  {r['name']:<26}{r['macs']:>16,}{size(r['memory']):>18}  {r['memory_order']:<10}{beats:>40}")
    out.append("  tiled computes every dot product the reference does (FlashAttention lowers memory, not FLOPs);"
               " a window and linear attention change what is computed")
    return "\n".join(out)


def selected_report(r, c, N) -> str:
    """counting.selected_macs: one MoBA layer's attention MACs when only the chosen blocks are computed."""
    B, K = c.attn.select_block, c.attn.select_topk
    out = [f"MoBA on the gathered path (model.attn.impl=gathered): forward MACs per token and layer at N={N:,}, "
           f"n = ceil(N/B) = {-(-N // B):,} blocks of B={B}, K={K} (counting.selected_macs)",
           f"  {'choose the blocks (q.mean(K_block))':<40}{'n_head*hs*n':<28}{r['choose']:>16,.0f}",
           f"  {'attention scores q.k^T':<40}{'n_head*hs*(min(K,b)+1)*B':<28}{r['scores']:>16,.1f}",
           f"  {'attention weights.V':<40}{'the same':<28}{r['weighted_sum']:>16,.1f}",
           f"  {'total':<40}{'':<28}{r['total']:>16,.1f}  ({r['total'] / r['full_table']:.3f} x the full "
           f"table's 2*N*d = {r['full_table']:,})",
           f"  a query in block b reads its own block and min(K, b) earlier ones, whole: (K+1)*B = {(K + 1) * B} keys "
           "once b >= K, whatever N"]
    return "\n".join(out)


def stack(c, N, B, nbytes) -> dict:
    """A model's parameters, forward MACs per token at N, and what generation holds at N tokens: the
    KV cache and the recurrent layers' states."""
    kv, states = kv_cache_bytes(c, N, B, nbytes), state_bytes(c, B)
    return {"params": count_params(c)["total"], "macs_per_token": macs_per_token(c, N)["forward"],
            "kv_cache_bytes": kv, "state_bytes": states, "generation_bytes": kv + states}


def layers_report(result, c, N, B, dtype) -> str:
    """counting.layer_table, and for a model with recurrent layers the same stack all attention."""
    rows = result["layers"]
    pattern = f"model.attn.layer_kinds={list(c.attn.layer_kinds)} repeated" if c.attn.layer_kinds else \
        f"every layer {c.attn.kind}"
    out = ["", f"the layers ({pattern}; per layer, the MLP apart; N={N:,}, batch {B}, {dtype} cache, fp32 states)",
           f"  {'kind':<22}{'layers':>7}{'params':>14}{'MACs per token':>16}{'cache at N':>14}{'state':>12}"]
    for r in rows:
        out.append(f"  {r['kind']:<22}{r['layers']:>7}{r['params']:>14,}{r['mixer_macs']:>16,}"
                   f"{size(r['cache_bytes']):>14}{size(r['state_bytes']):>12}")
    out.append("  a recurrent layer (linear, gdn, mamba2) keeps a state of fixed size, the same at any N; its MACs per "
               "token stop growing past one chunk")
    if "all_attention" in result:
        this, full = result["all_attention"]["this"], result["all_attention"]["all_attention"]
        out += ["", f"this stack against the same stack with softmax attention in every layer, at N={N:,}",
                f"  {'':<28}{'this stack':>16}{'all attention':>16}{'ratio':>9}"]
        for key, name, show in (("params", "parameters", "{:,}".format), ("macs_per_token", "forward MACs per token",
                                                                           "{:,}".format),
                                ("kv_cache_bytes", "KV cache", size), ("state_bytes", "recurrent states", size),
                                ("generation_bytes", "cache + states", size)):
            ratio = f"{this[key] / full[key]:.3f}" if full[key] else "-"
            out.append(f"  {name:<28}{show(this[key]):>16}{show(full[key]):>16}{ratio:>9}")
    return "\n".join(out)


def memory_per_gpu(c, N, B, nbytes, world) -> dict:
    """counting.per_gpu_bytes for one GPU, and DDP and FSDP over `world` GPUs, with and without
    activation checkpointing: {"one_gpu" | "ddp" | "fsdp": {"plain" | "checkpointed": bytes by part}}."""
    arms = {"one_gpu": (1, "ddp"), "ddp": (world, "ddp"), "fsdp": (world, "fsdp")}
    return {name: {arm: per_gpu_bytes(c, B, N, w, par, nbytes, checkpointing=arm == "checkpointed")
                   for arm in ("plain", "checkpointed")} for name, (w, par) in arms.items()}


def per_gpu_report(mem, N, B, dtype, world) -> str:
    """The table of memory_per_gpu: which parallelism a model needs."""
    heads = ["1 GPU", f"DDP x {world}", f"FSDP x {world}"]
    out = ["", f"training memory per GPU: batch {B} x N={N:,} tokens per GPU, fp32 weights, gradients and AdamW "
               f"moments, {dtype} activations (counting.per_gpu_bytes)",
           f"  {'':<44}" + "".join(f"{h:>14}" for h in heads)]
    rows = [("weights (fp32)", "plain", "weights"), ("gradients (fp32)", "plain", "gradients"),
            (f"AdamW state ({ADAMW_BYTES_PER_PARAM} B/param)", "plain", "adamw_state"),
            ("DDP buckets / FSDP gathered groups", "plain", "buffers"),
            ("activations", "plain", "activations"), ("total", "plain", "total"),
            ("activations, checkpointed (recomputed)", "checkpointed", "activations"),
            ("total with activation checkpointing", "checkpointed", "total")]
    for label, arm, key in rows:
        out.append(f"  {label:<44}" + "".join(f"{size(mem[name][arm][key]):>14}" for name in mem))
    out.append("  DDP keeps everything on every GPU (its buckets add a copy of the gradients); FSDP splits weights,")
    out.append(f"  gradients and AdamW state {world} ways and gathers a few groups at a time. Not counted: the CUDA")
    out.append("  context and workspaces (~0.5-1 GiB), fragmentation. Commands: docs/gpu.md")
    return "\n".join(out)


def fmt_len(n: Fraction) -> str:
    return f"{int(n):,}" if n.denominator == 1 else f"{float(n):,.1f}"


# ----------------------------------------------------------------------------- the plot

def plot_cost(c, N, B, dtype, x, mem, path):
    """Left: per-layer forward MACs for one sequence of n tokens against n (log-log), the
    projections and MLP linear in n, attention quadratic, crossovers marked. Right: memory at N."""
    from lab.plots import save_figure  # selects the Agg backend (files only) before pyplot is imported
    import matplotlib.pyplot as plt

    top = 2 ** math.ceil(math.log2(4 * max(N, float(x["attn_vs_proj_mlp"]))))
    ns = [2 ** (i / 8) for i in range(4 * 8, 8 * int(math.log2(top)) + 1)]
    per_seq = lambda n: {key: n * v for key, v in macs_per_token(c, n).items()}  # noqa: E731
    curves = [("projections Q,K,V,O", "proj", "C0"), (f"MLP ({c.mlp})", "mlp", "C1"),
              ("attention q.k^T + weights.V", "attn", "C3")]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1.2, 1]})
    for label, key, color in curves:
        ax.plot(ns, [per_seq(n)[key] for n in ns], color=color, label=label)
    ax.plot(ns, [per_seq(n)["proj"] + per_seq(n)["mlp"] for n in ns], "k--", lw=1, label="projections + MLP")
    names = {"attn_vs_proj": "= projections", "attn_vs_mlp": "= MLP", "attn_vs_proj_mlp": "= proj. + MLP"}
    for key, label in names.items():  # (c) is the largest: its label right of its line, the others left
        n = float(x[key])
        ax.plot([n], [n * float(macs_per_token(c, x[key])["attn"])], "o", color="C3")
        ax.axvline(n, color="C3", lw=0.6, alpha=0.5)
        right = key == "attn_vs_proj_mlp"
        ax.text(n, 0.02, f" attention {label} at N={fmt_len(x[key])} ", transform=ax.get_xaxis_transform(),
                rotation=90, fontsize=8, va="bottom", ha="left" if right else "right", color="C3")
    ax.axvline(N, color="gray", ls=":", label=f"N={N:,}")
    ax.set(xscale="log", yscale="log", xlabel="sequence length N (tokens)",
           ylabel="forward MACs per layer per sequence (1 MAC = 2 FLOPs)",
           title="per-layer cost: attention's N^2 against the N terms (full N x N)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left")
    bars = [("weights", mem["weights"]), ("AdamW state (fp32)", mem["adamw_state"]),
            ("attn table, 1 layer", mem["attn_weights_per_layer"]),
            (f"attn table, {c.n_layer} layers", mem["attn_weights_all_layers"]),
            (f"KV cache ({heads_word(c.n_kv_head)})", mem["kv_cache"]),
            (f"KV cache, MHA ({c.n_head})", mem["kv_cache_mha"])]
    labels, values = zip(*bars)
    bx.barh(range(len(bars)), [float(v) for v in values], color=["C0", "C0", "C3", "C3", "C2", "C7"])  # past int64 too
    for i, v in enumerate(values):
        bx.text(float(v), i, f" {size(v)}", va="center", fontsize=8)
    bx.set_yticks(range(len(bars)), labels)
    bx.invert_yaxis()
    bx.set(xscale="log", xlabel="bytes (log)", title=f"memory at N={N:,}, batch {B}, {dtype}")
    bx.set_xlim(right=float(max(values)) * 8)  # room for the labels
    return save_figure(fig, path)


@hydra.main(version_base="1.3", config_path="../configs", config_name="cost")
@cli
def main(cfg):
    cost(cfg)


if __name__ == "__main__":
    run_app(main)
