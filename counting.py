"""Parameters, FLOPs and bytes of a model, counted from its config alone (no model built): the one
home of every count attnlab prints or checks against. GPT.flops_per_token (MFU), the memory checks
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

ADAMW_BYTES_PER_PARAM = 8  # exp_avg + exp_avg_sq, fp32: train.py keeps fp32 weights and autocasts
TRAIN_BYTES_PER_PARAM = 16  # fp32 weight, gradient and AdamW's two moments


def mlp_matrices(c) -> int:
    """Weight matrices of one MLP, in units of n_embd x d_ff: gate, up and down for SwiGLU."""
    return 3 if c.mlp == "swiglu" else 2


def layer_params(c) -> dict:
    """One block's parameters, matrices apart from the rest (biases, norm weights, QK-Norm gains),
    in the layout GPT builds."""
    d, kv, b = c.n_embd, c.n_kv_head * c.head_dim, int(c.bias)
    gain = {"none": 0, "head": 1, "channel": c.head_dim}[c.attn.qk_norm_gain] if c.attn.qk_norm else 0
    k = mlp_matrices(c)
    return {
        "attn_matrices": d * (d + 2 * kv) + d * d,  # c_attn (q, k, v fused), c_proj
        "attn_other": b * (d + 2 * kv + d) + gain * (c.n_head + c.n_kv_head),  # biases; q_gain, k_gain per head
        "mlp_matrices": k * d * c.d_ff,  # c_fc (gate|up fused for swiglu), c_proj
        "mlp_other": b * ((k - 1) * c.d_ff + d),  # their biases
        "norm": d * (2 if c.norm == "layernorm" and c.bias else 1),  # one norm: weight (+ LayerNorm bias)
    }


def count_params(c) -> dict:
    """Parameters by kind; `non_embedding` is what 6N counts: every weight a token's forward
    multiplies by (the tied wte is the LM head), not the lookup tables."""
    d, L, lp = c.n_embd, c.n_layer, layer_params(c)
    p = {
        # wte (+ wpe) (+ a value-embedding table per layer)
        "embedding": c.vocab_size * d + (c.block_size * d if c.pos == "learned" else 0)
        + (L * c.vocab_size * c.n_kv_head * c.head_dim if c.value_embed else 0),
        "lm_head": 0 if c.tie_embeddings else c.vocab_size * d,
        "attention": L * (lp["attn_matrices"] + lp["attn_other"]),
        "mlp": L * (lp["mlp_matrices"] + lp["mlp_other"]),
        "norms": L * 2 * lp["norm"] + (lp["norm"] if c.norm_position == "pre" else 0),  # ln_1, ln_2 (+ ln_f)
    }
    p["total"] = sum(p.values())
    p["non_embedding"] = p["total"] - p["embedding"] + (c.vocab_size * d if c.tie_embeddings else 0)
    return p


def attention_macs(c, seq_len, layer: int) -> tuple:
    """(scores, weighted_sum) MACs per token of one layer's attention at length seq_len. Softmax
    attention: N * d each for q.k with N keys and the weighted sum of N values, over the full N x N
    table (the texts' and PaLM's convention; a causal kernel computes about half) and over the
    latest W keys in a layer with a window of W. Linear attention: each token adds φ(k)vᵀ and φ(k)
    to its kv head's state (n_kv * hs * (hs + 1)) and each query head reads it (n_head * hs * (hs + 1)):
    independent of N."""
    a, hs = c.attn, c.head_dim
    if a.kind == "linear":
        return c.n_kv_head * hs * (hs + 1), c.n_head * hs * (hs + 1)
    pattern = a.window_pattern
    keys = seq_len if a.window is None or pattern[layer % len(pattern)] == "G" else min(seq_len, a.window)
    return keys * c.n_embd, keys * c.n_embd


def macs_per_token(c, seq_len) -> dict:
    """Forward MACs per token at length seq_len: per layer (q, k, v, o, scores, weighted_sum, mlp,
    other; sums proj, attn, layer; attention averaged over the layers, which differ only with a
    local/global window pattern) and for the model (lm_head, other_final, forward). `other` is
    one MAC per parameter outside a matrix (norm weights, biases, QK-Norm gains), the 6N
    convention. seq_len may be a Fraction (the crossovers are checked exactly)."""
    d, kv, lp = c.n_embd, c.n_kv_head * c.head_dim, layer_params(c)
    attn = [attention_macs(c, seq_len, layer) for layer in range(c.n_layer)]
    m = {
        "q": d * d, "k": d * kv, "v": d * kv, "o": d * d,  # projections: one MAC per weight
        "scores": sum(s for s, _ in attn) / Fraction(c.n_layer),  # q.k with each key a query sees (attention_macs)
        "weighted_sum": sum(w for _, w in attn) / Fraction(c.n_layer),  # the weighted sum of their values
        "mlp": lp["mlp_matrices"],
        "other": lp["attn_other"] + lp["mlp_other"] + 2 * lp["norm"],
        "lm_head": d * c.vocab_size,
        "other_final": lp["norm"] if c.norm_position == "pre" else 0,  # ln_f
    }
    for key in ("scores", "weighted_sum"):  # whole numbers stay ints (N may be a Fraction: keep it exact)
        if isinstance(m[key], Fraction) and m[key].denominator == 1:  # a float N (the plot's) stays a float
            m[key] = int(m[key])
    m["proj"] = m["q"] + m["k"] + m["v"] + m["o"]
    m["attn"] = m["scores"] + m["weighted_sum"]
    m["layer"] = m["proj"] + m["attn"] + m["mlp"] + m["other"]
    m["forward"] = c.n_layer * m["layer"] + m["lm_head"] + m["other_final"]
    return m


def flops_per_token(c, seq_len) -> int:
    """Training FLOPs per token: forward 2 FLOPs per MAC, backward twice the forward, so 6 x the
    forward MACs = 6 x non-embedding params + 12 * n_layer * N * d (full softmax attention)."""
    return round(6 * macs_per_token(c, seq_len)["forward"])


def crossovers(c) -> dict:
    """Exact lengths N where attention's 2*N*d MACs per token equal (a) the projections
    2*d*(d + d_kv), (b) the MLP k*d*d_ff (k = 2, or 3 for SwiGLU), (c) both: divide by 2*d."""
    kv = c.n_kv_head * c.head_dim
    proj = Fraction(c.n_embd + kv)
    mlp = Fraction(mlp_matrices(c) * c.d_ff, 2)
    return {"attn_vs_proj": proj, "attn_vs_mlp": mlp, "attn_vs_proj_mlp": proj + mlp}


# ----------------------------------------------------------------------------- bytes

def kv_cache_bytes(c, tokens: int = 1, batch: int = 1, dtype_bytes: int = 4, n_kv_head=None) -> int:
    """K and V of `tokens` positions of `batch` sequences in every layer: 2 * n_layer * n_kv_head *
    head_dim numbers per token (n_kv_head: another head count for the same shape, e.g. MHA's)."""
    return 2 * c.n_layer * (n_kv_head or c.n_kv_head) * c.head_dim * dtype_bytes * tokens * batch


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


def training_bytes(c, batch: int) -> int:
    """A lower bound on a training step's memory: fp32 weights, gradients and AdamW's two moments,
    and per token and layer the main fp32 activations a backward pass keeps (the residual stream
    and norms, q, k, v, the attention output, the MLP's hidden width), plus the logits."""
    d, L, T = c.n_embd, c.n_layer, c.block_size
    hidden = (mlp_matrices(c) - 1) * c.d_ff  # the MLP's activations: d_ff wide (two for SwiGLU's gate, up)
    per_token = (4 * d + 2 * c.n_kv_head * c.head_dim + hidden) * L + 2 * c.vocab_size
    return TRAIN_BYTES_PER_PARAM * count_params(c)["total"] + 4 * batch * T * per_token


def generation_bytes(c, batch: int, length: int, kv_bytes: int = 4) -> int:
    """What generation allocates per call beyond the weights: the int64 token buffer and a KV cache of
    up to one block per layer, for every sample."""
    return batch * 8 * length + kv_cache_bytes(c, min(length, c.block_size), batch, kv_bytes)


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
    - linear: (h + h_kv)*hs*(hs + 1) MACs per token whatever N, and the prefix sums of φ(k)vᵀ this
      implementation keeps, B*h_kv*N*hs*hs: O(N*hs²), less compute than full attention for
      N > (h + h_kv)*hs*(hs + 1)/(2*d), about hs."""
    d, h, hkv, hs, N, B = c.n_embd, c.n_head, c.n_kv_head, c.head_dim, seq_len, batch
    W = c.attn.window or max(1, N // 8)
    linear_macs = (h + hkv) * hs * (hs + 1)
    full = {"macs": 2 * N * d, "memory": B * h * N * N * dtype_bytes}
    rows = [
        {"name": "reference (full table)", **full, "beats_full_from": None, "memory_order": "N^2"},
        {"name": "tiled (FlashAttention)", "macs": 2 * N * d, "memory": B * h * N * (hs + 1) * dtype_bytes,
         "beats_full_from": hs + 2, "memory_order": "N"},
        {"name": f"window W={W}", "macs": 2 * min(N, W) * d, "memory": B * h * N * min(N, W) * dtype_bytes,
         "beats_full_from": W + 1, "memory_order": "N*W"},
        {"name": "linear (elu + 1)", "macs": linear_macs, "memory": B * hkv * N * hs * hs * dtype_bytes,
         "beats_full_from": math.floor(Fraction(linear_macs, 2 * d)) + 1, "memory_order": "N*hs^2"},
    ]
    return rows
