"""Parameters, FLOPs and bytes of a model, counted from its config alone (no model built): the one
home of every count attnlab prints or checks against. flops_per_token (MFU), the memory checks
before training and sampling, tools/cost.py, tools/bench.py and tools/bench_sample.py all call these;
tests hold them equal to a built model (parameters, FLOPs, KV-cache tensors) for every variant.

The convention is the texts' and PaLM's (Chowdhery et al. 2022, arXiv 2204.02311, appendix B;
Kaplan et al. 2020, arXiv 2001.08361): per token and layer, a matrix of m x n weights costs m*n
multiply-accumulates (MACs, 1 MAC = 2 FLOPs) forward, and attention costs 2*N*d MACs (q.k for N
keys, then weights.V) over the full N x N table, although a causal kernel computes only the visible
half. Backward costs twice the forward, so training is 3 x forward = 6 FLOPs per weight per token
plus 12*n_layer*N*d.
"""
import math
from fractions import Fraction

import torch

from attention import CausalSelfAttention
from kv_cache import KVCache
from variants.int8_cache import Int8KVCache
from variants import CACHE_LAYOUTS, GATES, KINDS, SELECTS, SINKS, layer_kind

ADAMW_BYTES_PER_PARAM = 8  # exp_avg + exp_avg_sq, fp32: train.py keeps fp32 weights and autocasts
TRAIN_BYTES_PER_PARAM = 16  # fp32 weight, gradient and AdamW's two moments


def mlp_matrices(c) -> int:
    """Weight matrices of one MLP, in units of n_embd x d_ff: gate, up and down for SwiGLU; none
    without an MLP."""
    return {"swiglu": 3, "none": 0}.get(c.mlp, 2)


def layer_types(c) -> list:
    """[(layer, how many layers are like it)]: the layers of one period of the model's repeating
    patterns (model.attn.layer_kinds and window_pattern), each standing for every layer that has its
    kind and window, so that a count over n_layer layers costs one period (n_layer may be huge)."""
    a = c.attn
    period = math.lcm(len(a.layer_kinds) if a.layer_kinds else 1, len(a.window_pattern) if a.window else 1)
    return [(i, c.n_layer // period + (i < c.n_layer % period)) for i in range(min(period, c.n_layer))]


def mixer(c, layer=None):
    """Layer `layer`'s mixer class, which answers for its own counts (mixer.Mixer); None: model.attn.kind's."""
    return KINDS[c.attn.kind if layer is None else layer_kind(c.attn, layer)]


def local(c, layer: int) -> bool:
    """Does layer `layer` attend within model.attn.window (a softmax kind marked L in window_pattern)?"""
    a = c.attn
    return a.window is not None and a.window_pattern[layer % len(a.window_pattern)] == "L" and not mixer(c, layer).recurrent


def layer_params(c, layer=None) -> dict:
    """One block's parameters (layer `layer`'s mixer; None: model.attn.kind's), matrices apart from the
    rest (biases, norm weights, QK-Norm gains, sink logits, a recurrent layer's convolution and decay
    rates), in the layout GPT builds: the mixer's (its params), a key selection's (its params), the MLP's."""
    kind, k, d, b = mixer(c, layer), mlp_matrices(c), c.n_embd, int(c.bias)
    p, select = kind.params(c), SELECTS[c.attn.select] if kind.selects else None
    gate, sink = GATES[c.attn.gate] if kind.takes_gate else None, SINKS[c.attn.sink] if kind.softmax else None
    return {  # the kind's own, then its slots' (each piece counts itself)
        "attn_matrices": p["matrices"] + (select.params(c) if select else 0) + (gate.params(c) if gate else 0),
        "attn_other": p["other"] + (sink.params(c) if sink else 0),
        "mlp_matrices": k * d * c.d_ff,  # c_fc (gate|up fused for swiglu), c_proj
        "mlp_other": b * ((k - 1) * c.d_ff + d) if k else 0,  # their biases
        "norm": d * (2 if c.norm == "layernorm" and c.bias else 1),  # one norm: weight (+ LayerNorm bias)
    }


def count_params(c) -> dict:
    """Parameters by kind; `non_embedding` is what 6N counts: every weight a token's forward
    multiplies by (the tied wte is the LM head), not the lookup tables."""
    d, L = c.n_embd, c.n_layer
    layers = [(layer_params(c, i), n) for i, n in layer_types(c)]
    norms_per_block = 1 if c.mlp == "none" else 2  # ln_1 (and ln_2 before the MLP)
    p = {
        # wte (+ wpe) (+ a value-embedding table per layer)
        "embedding": c.vocab_size * d + (c.block_size * d if c.pos == "learned" else 0)
        + (L * c.vocab_size * c.n_kv_head * c.head_dim if c.value_embed else 0),
        "lm_head": 0 if c.tie_embeddings else c.vocab_size * d,
        "attention": sum(n * (lp["attn_matrices"] + lp["attn_other"]) for lp, n in layers),
        "mlp": sum(n * (lp["mlp_matrices"] + lp["mlp_other"]) for lp, n in layers),
        "norms": sum(n * norms_per_block * lp["norm"] for lp, n in layers)
        + (layers[0][0]["norm"] if c.norm_position == "pre" else 0),
    }
    p["total"] = sum(p.values())
    p["non_embedding"] = p["total"] - p["embedding"] + (c.vocab_size * d if c.tie_embeddings else 0)
    return p


def attention_macs(c, seq_len, layer: int) -> tuple:
    """(scores, weighted_sum) MACs per token of one layer's mixing at length seq_len, as its kind counts
    them (mixing_macs): softmax attention N * d each for q.k with the N keys and the weighted sum of their
    values, over the full N x N table (the texts' and PaLM's convention; a causal kernel computes about
    half) and over the latest W keys in a layer with a window of W; the recurrent kinds in their chunked
    training form, independent of N beyond one chunk (variants/linear.py, gdn.py, mamba2.py)."""
    keys = min(seq_len, c.attn.window) if local(c, layer) else seq_len
    return mixer(c, layer).mixing_macs(c, seq_len, keys)


def selected_keys(c, seq_len: int) -> Fraction:
    """The keys a query reads with model.attn.select, the mean over the seq_len causal queries (the
    full causal table: (N + 1) / 2). oracle and indexer: min(k, i + 1) for query i; moba: its own block's keys up
    to itself and min(K, b) earlier blocks of B for a query in block b (variants/moba.py). What is read,
    not computed: the masked paths still score every key."""
    a, N, select = c.attn, seq_len, SELECTS[c.attn.select]
    return Fraction(sum(select.reads(a, i) if select else i + 1 for i in range(N)), N)


def selected_macs(c, seq_len: int) -> dict:
    """Forward MACs per token of one model.attn.select=moba layer that computes only the blocks it
    chose (model.attn.impl=gathered, variants/selected.py), the mean over the seq_len causal queries,
    with n = ceil(N/B) blocks of B keys and a query in block b:
    - choose: q against every block's mean key, n_head * hs * n (variants/moba.py scores them all);
    - scores: q.k with every key of its own block and of its min(K, b) chosen earlier blocks, whole
      blocks (its own block's later keys and a short last block's padding are computed, then hidden):
      n_head * hs * (min(K, b) + 1) * B, that is (K·B + B) keys once b >= K;
    - weighted_sum: as many for weights.V.
    The full table's convention (attention_macs) is N * n_head * hs for each of the last two."""
    a, N, width = c.attn, seq_len, c.n_head * c.head_dim
    B, K = a.select_block, a.select_topk
    keys = Fraction(sum((min(K, i // B) + 1) * B for i in range(N)), N)
    return {"choose": width * -(-N // B), "scores": width * keys, "weighted_sum": width * keys}


def mean_over_layers(values, counts):
    """The mean over the layers of per-layer counts (one value for each of layer_types' layers, which
    stands for `counts` layers each), exact for ints and Fractions (a float N stays a float)."""
    total, n = sum(v * k for v, k in zip(values, counts)), sum(counts)
    return total / n if isinstance(total, float) else Fraction(total, n)


def macs_per_token(c, seq_len) -> dict:
    """Forward MACs per token at length seq_len: per layer (q, k, v, o, scores, weighted_sum, mlp,
    other; sums proj, attn, layer; each the mean over the layers, which differ with a local/global
    window pattern or a hybrid's kinds) and for the model (lm_head, other_final, forward). `other` is
    one MAC per parameter outside a matrix (norm weights, biases, QK-Norm gains, a recurrent layer's
    convolution and decay rates), the gates' matrices too, the 6N convention. seq_len may be a
    Fraction (the crossovers are checked exactly)."""
    d, types = c.n_embd, layer_types(c)
    counts = [n for _, n in types]
    lps = [layer_params(c, i) for i, _ in types]
    projs = [mixer(c, i).projections(c) for i, _ in types]
    attn = [attention_macs(c, seq_len, i) for i, _ in types]
    norms = 1 if c.mlp == "none" else 2

    def mean(values):
        return mean_over_layers(values, counts)
    m = {
        **{key: mean([p[key] for p in projs]) for key in ("q", "k", "v", "o")},  # one MAC per weight
        "scores": mean([s for s, _ in attn]),  # q.k with each key a query sees (attention_macs)
        "weighted_sum": mean([w for _, w in attn]),  # the weighted sum of their values
        "mlp": mean([lp["mlp_matrices"] for lp in lps]),
        # the gates' MACs (the attention matrices beyond q, k, v, o) with the rest
        "other": mean([lp["attn_other"] + lp["mlp_other"] + norms * lp["norm"] + lp["attn_matrices"]
                       - sum(p[key] for key in ("q", "k", "v", "o")) for lp, p in zip(lps, projs)]),
        "lm_head": d * c.vocab_size,
        "other_final": lps[0]["norm"] if c.norm_position == "pre" else 0,  # ln_f
    }
    for key in ("q", "k", "v", "o", "scores", "weighted_sum", "mlp", "other"):  # whole numbers stay ints (N may
        if isinstance(m[key], Fraction) and m[key].denominator == 1:  # be a Fraction: keep it exact; a float N stays)
            m[key] = int(m[key])
    m["proj"] = m["q"] + m["k"] + m["v"] + m["o"]
    m["attn"] = m["scores"] + m["weighted_sum"]
    m["layer"] = m["proj"] + m["attn"] + m["mlp"] + m["other"]
    m["forward"] = c.n_layer * m["layer"] + m["lm_head"] + m["other_final"]
    return m


def flops_per_token(c, seq_len=None) -> int:
    """Training FLOPs per token at seq_len (default block_size), for MFU: forward 2 FLOPs per MAC,
    backward twice the forward, so 6 x the forward MACs = 6 x non-embedding params + 12 * n_layer * N * d
    (full softmax attention; PaLM, arXiv 2204.02311)."""
    return round(6 * macs_per_token(c, c.block_size if seq_len is None else seq_len)["forward"])


def all_attention(c):
    """The same stack with softmax attention in every layer (what a hybrid's recurrent layers save)."""
    from dataclasses import replace
    return replace(c, attn=replace(c.attn, kind="softmax", layer_kinds=None, state_dim=None))


def crossovers(c) -> dict:
    """Exact lengths N where attention's 2*N*d MACs per token equal (a) the projections
    2*d*(d + d_kv), (b) the MLP k*d*d_ff (k = 2, or 3 for SwiGLU), (c) both: divide by 2*d."""
    kv = c.n_kv_head * c.head_dim
    proj = Fraction(c.n_embd + kv)
    mlp = Fraction(mlp_matrices(c) * c.d_ff, 2)
    return {"attn_vs_proj": proj, "attn_vs_mlp": mlp, "attn_vs_proj_mlp": proj + mlp}


# ----------------------------------------------------------------------------- bytes

def layer_cache_bytes(c, layer: int, tokens: int = 1, batch: int = 1, dtype_bytes: int = 4, n_kv_head=None,
                      int8: bool = False) -> int:
    """What layer `layer` caches for `tokens` positions of `batch` sequences (kv_cache_bytes says how)."""
    kind = mixer(c, layer) if n_kv_head is None else CausalSelfAttention  # another head count: plain K and V
    held = min(tokens, c.attn.window) if local(c, layer) else tokens
    cache = Int8KVCache if int8 else KVCache  # each cache says what a token's rows cost it
    return cache.token_bytes(kind.cache_rows(c, n_kv_head), dtype_bytes) * held * batch


def kv_cache_bytes(c, tokens: int = 1, batch: int = 1, dtype_bytes: int = 4, n_kv_head=None, int8: bool = False) -> int:
    """What generation caches for `tokens` positions of `batch` sequences in every layer: K and V,
    2 * n_kv_head * head_dim numbers per token (n_kv_head: another head count for the same shape, e.g.
    MHA's); int8 stores each head's k and v as head_dim bytes plus one fp32 scale; MLA caches its
    latent and RoPE key, d_c + d_r numbers per token shared by every head (int8: d_c + d_r bytes and
    a scale for each); a layer with a window holds at most its window; linear, gdn and mamba2 layers
    cache nothing per token (their state's size, state_bytes, does not grow)."""
    return sum(n * layer_cache_bytes(c, layer, tokens, batch, dtype_bytes, n_kv_head, int8)
               for layer, n in layer_types(c))


RECURRENT = tuple(name for name, kind in KINDS.items() if kind.recurrent)  # a constant-size state, no KV cache


def layer_state_bytes(c, layer: int, batch: int = 1) -> int:
    """Layer `layer`'s recurrent state, fp32, whatever the context (its kind's state_numbers: linear
    attention's S and z per kv head; gdn's S per head and its convolution's last inputs of q, k and v;
    mamba2's h per head and the last inputs of x, B and C); 0 for the others."""
    return mixer(c, layer).state_numbers(c) * 4 * batch


def state_bytes(c, batch: int = 1) -> int:
    """The recurrent layers' states (layer_state_bytes), all layers: the same at any context length."""
    return sum(n * layer_state_bytes(c, layer, batch) for layer, n in layer_types(c))


def layer_table(c, seq_len, batch: int = 1, dtype_bytes: int = 2) -> list:
    """One row per kind of layer the model has (layer_types: kind and window): how many layers, and per
    layer its parameters, forward MACs per token at seq_len (projections, attention or mixing, the
    gates and the rest; the MLP apart), what its cache holds at seq_len and its state's bytes; layers
    alike in all of these are one row."""
    rows = {}
    for layer, n in layer_types(c):
        lp = layer_params(c, layer)
        scores, weighted = attention_macs(c, seq_len, layer)
        row = {"kind": layer_kind(c.attn, layer) + (f" (window {c.attn.window})" if local(c, layer) else ""),
               "params": lp["attn_matrices"] + lp["attn_other"],
               "mixer_macs": lp["attn_matrices"] + lp["attn_other"] + scores + weighted,  # a MAC per weight
               "mlp_params": lp["mlp_matrices"] + lp["mlp_other"],
               "cache_bytes": layer_cache_bytes(c, layer, seq_len, batch, dtype_bytes),
               "state_bytes": layer_state_bytes(c, layer, batch)}
        key = tuple(row.values())
        rows[key] = {**row, "layers": rows[key]["layers"] + n if key in rows else n}
    return list(rows.values())


def memory_breakdown(c, seq_len: int, batch: int, dtype_bytes: int) -> dict:
    """What tools/cost.py prints: weights and AdamW state, a naive N x N attention table, the KV cache."""
    total = count_params(c)["total"]
    table = batch * c.n_head * seq_len * seq_len * dtype_bytes  # one (B, H, N, N) softmax output
    return {
        "weights": total * dtype_bytes,
        "adamw_state": total * ADAMW_BYTES_PER_PARAM,
        "attn_weights_per_layer": table,
        "attn_weights_all_layers": c.n_layer * table,
        "kv_cache_per_token": kv_cache_bytes(c, 1, 1, dtype_bytes),
        "kv_cache": kv_cache_bytes(c, seq_len, batch, dtype_bytes),
        "kv_cache_mha": kv_cache_bytes(c, seq_len, batch, dtype_bytes, c.n_head),
    }


def training_bytes(c, batch: int, shards: int = 1) -> int:
    """A lower bound on a training step's memory: fp32 weights, gradients and AdamW's two moments
    (each process's 1/shards of them under FSDP), and per token and layer the main fp32 activations a
    backward pass keeps (the residual stream and norms, q, k, v, the attention output, the MLP's
    hidden width), plus the logits."""
    d, L, T = c.n_embd, c.n_layer, c.block_size
    hidden = max(mlp_matrices(c) - 1, 0) * c.d_ff  # the MLP's activations: d_ff wide (two for SwiGLU's gate, up)
    per_token = (4 * d + 2 * c.n_kv_head * c.head_dim + hidden) * L + 2 * c.vocab_size
    return TRAIN_BYTES_PER_PARAM * math.ceil(count_params(c)["total"] / shards) + 4 * batch * T * per_token


def generation_bytes(c, batch: int, length: int, kv_bytes: int = 4, int8: bool = False) -> int:
    """What generation allocates per call beyond the weights: the int64 token buffer and a KV cache of
    up to one block per layer (or a recurrent layer's state), for every sample."""
    return batch * 8 * length + kv_cache_bytes(c, min(length, c.block_size), batch, kv_bytes, int8=int8) + \
        state_bytes(c, batch)


def decode_bytes(c, batch: int, context: int, weight_bytes: int = 4, kv_bytes: int = 4) -> int:
    """What one decode step must read: every weight once, and the K and V of `context` cached
    positions for each of `batch` samples (the memory-bandwidth bound of tools/bench_sample.py)."""
    return count_params(c)["total"] * weight_bytes + kv_cache_bytes(c, context, batch, kv_bytes)


def attention_variants(c, seq_len: int, batch: int = 1, dtype_bytes: int = 4) -> list:
    """Softmax attention's ways of paying for the N x N table, against full attention at length N,
    per layer for the config's shape: forward MACs per token (scores + weighted sum) and the
    attention memory a training step keeps for its backward (per layer, `batch` sequences), with
    the length from which each costs less than the reference path. Rows:
    - reference: the table of weights, B*h*N*N numbers, saved for the backward;
    - tiled (FlashAttention): the same MACs (every dot product is still computed; the causal half is
      skipped by whole blocks, as by the reference convention's "about half"), but only the output
      and one log-sum-exp per query row, B*h*N*(hs + 1): O(N) memory, less than the table for N > hs + 1;
    - window W: W keys per query, B*h*N*W weights with a banded kernel: O(N*W), less for N > W;
    - linear, chunked into L = min(N, LINEAR_CHUNK) positions: (h + h_kv)*hs*(hs + 1) MACs per token
      for the states plus 2*d*L inside its chunk (attention_macs), whatever N beyond one chunk; it
      keeps each chunk's L x L table of φ(q)·φ(k) and the state each chunk starts from,
      B*(h*N*L + h_kv*ceil(N/L)*hs*hs): O(N), less compute than full attention for
      N > L + (h + h_kv)*hs*(hs + 1)/(2*d)."""
    from variants.linear import LINEAR_CHUNK, LinearAttention

    d, h, hkv, hs, N, B = c.n_embd, c.n_head, c.n_kv_head, c.head_dim, seq_len, batch
    W = c.attn.window or max(1, N // 8)
    L = min(N, LINEAR_CHUNK)
    linear_macs = sum(LinearAttention.mixing_macs(c, N, N))  # (h + h_kv)*hs*(hs + 1) + 2*d*L
    full = {"macs": 2 * N * d, "memory": B * h * N * N * dtype_bytes}
    rows = [
        {"name": "reference (full table)", **full, "beats_full_from": None, "memory_order": "N^2"},
        {"name": "tiled (FlashAttention)", "macs": 2 * N * d, "memory": B * h * N * (hs + 1) * dtype_bytes,
         "beats_full_from": hs + 2, "memory_order": "N"},
        {"name": f"window W={W}", "macs": 2 * min(N, W) * d, "memory": B * h * N * min(N, W) * dtype_bytes,
         "beats_full_from": W + 1, "memory_order": "N*W"},
        {"name": "linear (elu + 1)", "macs": linear_macs,
         "memory": B * (h * N * L + hkv * -(-N // L) * hs * hs) * dtype_bytes,
         "beats_full_from": LINEAR_CHUNK + math.floor(Fraction((h + hkv) * hs * (hs + 1), 2 * d)) + 1,
         "memory_order": "N"},
    ]
    return rows


def cache_table(c, lengths=(8192, 131072), batch: int = 1) -> list:
    """The KV cache of the config's shape stored every way attnlab can: multi-head (n_head K/V heads),
    grouped-query (the config's n_kv_head, or n_head/4 or n_head/2 if above 1), multi-query (1), MLA (latent d_c = 4·hs and a
    RoPE key of hs/2, DeepSeek-V2's proportions, or the config's own), each in fp32, bf16 and int8
    where it exists: bytes per token (all layers) and at each length."""
    gqa = c.n_kv_head if c.n_kv_head not in (c.n_head, 1) else \
        next((g for g in (c.n_head // 4, c.n_head // 2) if g > 1 and c.n_head % g == 0), None)  # none: no GQA row
    kinds = [(f"MHA ({c.n_head} K/V heads)", c, c.n_head), *([(f"GQA ({gqa} K/V heads)", c, gqa)] if gqa else []),
             ("MQA (1 K/V head)", c, 1),
             *((name, layout(c), None) for name, layout in CACHE_LAYOUTS.items())]  # e.g. MLA's latent (variants/)
    rows = []
    for name, cfg, heads in kinds:
        for dtype, nbytes, int8 in (("float32", 4, False), ("bfloat16", 2, False), ("int8", 1, True)):
            if heads is None and int8:
                continue  # attnlab's int8 cache quantises per head; the latent cache has none
            per_token = kv_cache_bytes(cfg, 1, 1, nbytes, heads, int8=int8)
            rows.append({"kind": name, "dtype": dtype, "per_token": per_token,
                         **{str(n): per_token * n * batch for n in lengths}})
    return rows


# ----------------------------------------------------------------------------- training memory per GPU

def activation_numbers(c) -> dict:
    """Numbers per token that autograd keeps for the backward, as torch 2.13 saves them for softmax
    attention through the fused kernel (SDPA) with dropout 0: `layer` per block, `outside` for the
    rest (the final norm and the head's input; the fp32 log-softmax and the int64 ids are apart, in
    activation_bytes). Per block:
    - each of the two norms, its input (d) and statistics (LayerNorm: mean and 1/std; RMSNorm: 1/rms
      and the normalised input its weight multiplies, d + 1); Post-LN normalises the sums, as many;
    - the input of the q|k|v projection and of the MLP (d each: the norms' outputs);
    - RoPE: q and k before the rotation (d + d_kv); none with other positions;
    - attention: q, k, v (d + 2*d_kv), its output (d: also the output projection's input) and one
      log-sum-exp per head and token;
    - the MLP: GELU and ReLU² their input and output (2*d_ff); SwiGLU gate|up (2*d_ff), silu(gate) and
      the product (d_ff each).
    QK-Norm, value embeddings, a logit soft-cap, dropout, windows, linear attention and the reference
    path keep more (tests hold the count equal to what autograd saves for the variants above)."""
    d, kv, f = c.n_embd, c.n_kv_head * c.head_dim, c.d_ff
    norm = d + (2 if c.norm == "layernorm" else d + 1)
    rope = d + kv if c.pos == "rope" else 0
    mlp = {"gelu": 2 * f, "relu2": 2 * f, "swiglu": 4 * f, "none": -norm - d}[c.mlp]  # none: no ln_2, no MLP input
    layer = 2 * norm + 2 * d + rope + (d + 2 * kv) + d + c.n_head + mlp
    outside = (norm if c.norm_position == "pre" else 0) + d  # ln_f; the head's input
    return {"layer": layer, "outside": outside}


def activation_bytes(c, batch: int, seq_len: int, dtype_bytes: int = 4, checkpointing: bool = False) -> dict:
    """Activation memory of one micro-batch of `batch` sequences of seq_len tokens: `kept`, what the
    forward leaves for the backward (activation_numbers x dtype_bytes, the fp32 log-softmax of the
    logits, the int64 token ids and targets), and `peak`, the most held during the backward. With
    checkpointing each block keeps only its input (d numbers per token) and its other activations
    come back, one block at a time, when the backward recomputes it: peak = kept + one block's.
    Under bf16 autocast the activations are mostly 16-bit (norms keep fp32): dtype_bytes=2 estimates."""
    n, tokens = activation_numbers(c), batch * seq_len
    outside = tokens * (n["outside"] * dtype_bytes + 4 * c.vocab_size + 2 * 8)
    outside += 4 + (8 * seq_len if c.pos == "learned" else 0)  # the loss's fp32 total weight; the table's indices
    layer = tokens * n["layer"] * dtype_bytes
    if not checkpointing:
        kept = c.n_layer * layer + outside
        return {"kept": kept, "peak": kept}
    kept = c.n_layer * tokens * c.n_embd * dtype_bytes + outside
    return {"kept": kept, "peak": kept + layer}


def per_gpu_bytes(c, batch: int, seq_len: int, world: int = 1, parallel: str = "ddp", dtype_bytes: int = 2,
                  checkpointing: bool = False) -> dict:
    """Training memory on each of `world` GPUs (lab/parallel.py says what each way holds), `batch`
    sequences of seq_len tokens per GPU, fp32 weights, gradients and AdamW moments with activations
    in dtype_bytes:
    - weights, gradients, adamw_state: the whole under DDP; under FSDP each GPU's 1/world of them
      (rounded up: FSDP pads each tensor's rows to a multiple of world);
    - buffers: DDP's all-reduce buckets, a flat fp32 copy of the gradients (torch's default,
      gradient_as_bucket_view=False); FSDP's working set, an estimate from its schedule: the root
      group (embeddings, final norm, head) stays gathered from its forward to the end of the backward
      and two blocks are gathered at a time (the one computing, the next prefetched), their
      parameters and their gradients before the reduce-scatter, in the compute dtype (bf16 through the
      mixed-precision policy when dtype_bytes is 2, else fp32);
    - activations: activation_bytes' peak, with or without activation checkpointing.
    Left out: the CUDA context and kernels' workspaces (~0.5-1 GiB), the allocator's fragmentation,
    and the gradients of the activations during the backward."""
    P = count_params(c)["total"]
    sharded = parallel == "fsdp" and world > 1
    local = math.ceil(P / world) if sharded else P
    out = {"weights": 4 * local, "gradients": 4 * local, "adamw_state": ADAMW_BYTES_PER_PARAM * local}
    if sharded:
        lp = layer_params(c)
        block = lp["attn_matrices"] + lp["attn_other"] + lp["mlp_matrices"] + lp["mlp_other"] + 2 * lp["norm"]
        root = P - c.n_layer * block
        param_bytes = dtype_bytes if dtype_bytes == 2 else 4
        out["buffers"] = (root + 2 * block) * param_bytes + (root + block) * param_bytes
    else:
        out["buffers"] = 4 * P if world > 1 else 0
    out["activations"] = activation_bytes(c, batch, seq_len, dtype_bytes, checkpointing)["peak"]
    out["total"] = sum(out.values())
    return out


# ----------------------------------------------------------------------------- measured: what autograd saves

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
