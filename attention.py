"""Causal self-attention, read top-down: the scale, the mask, one attention function (a fast path,
a plain-math reference path and FlashAttention's tiled algorithm), positions (RoPE and its scalings,
ALiBi), QK-Norm, KV caches (full, static, int8, with sink tokens), and the attention kinds that put
them together: softmax attention, linear attention and multi-head latent attention.

    softmax(q·kᵀ·scale + M) · v

- scale: `model.attn.scale`, passed explicitly to the kernel: 1/√d_k by default (Vaswani et al.
  2017), `none` (1.0) or `dk` (1/d_k, muP), or any positive number, to ablate it.
- M: 0 where a key is visible, -inf elsewhere: causal (a query sees itself and earlier keys), and
  optionally within a window of the latest keys.
- Three paths, one function: `sdpa` (F.scaled_dot_product_attention: flash / memory-efficient
  kernels on a GPU), `reference` (explicit scores, mask, softmax, weights @ V) and `tiled`
  (FlashAttention's algorithm in plain PyTorch: blocks of keys and an online softmax, so the N x N
  table is never built, forward or backward). Tests hold them equal, and the attention statistics
  are computed from the reference scores.
- Sliding windows (`model.attn.window`, Longformer, Mistral, Gemma 2): a query sees only the latest
  W keys, in every layer or in the local layers of a local/global pattern; a local layer's KV cache
  holds W positions.
- Linear attention (`model.attn.kind=linear`, Katharopoulos et al. 2020, arXiv 2006.16236): the
  kernel φ(q)·φ(k) instead of softmax, so the product re-associates and a constant-size state
  replaces the KV cache.
- RoPE (Su et al. 2021, arXiv 2104.09864) rotates q and k, never v: q·k then depends only on the
  offset between two positions, which is also what lets a KV cache slide past block_size.
- QK-Norm (Henry et al. 2020, arXiv 2010.04245; Dehghani et al. 2023, arXiv 2302.05442): q and k
  are normalised per head *before* RoPE, so the norm (and its optional gain) sees the raw projection
  and RoPE, a rotation, keeps the norm. logit = scale · <rope(norm(q)), rope(norm(k))>, so
  |logit| <= scale · |q̂| · |k̂|.
- Grouped-query / multi-query attention (`n_kv_head`, Ainslie et al. 2023, arXiv 2305.13245; Shazeer
  2019, arXiv 1911.02150): consecutive query heads share one key/value head.
- Multi-head latent attention (`model.attn.kind=mla`, DeepSeek-V2, arXiv 2405.04434): keys and values
  are up-projected from one small latent per token, and only the latent (with a small RoPE key) is
  cached.
- RoPE scaling (`model.rope_scaling`: position interpolation, NTK-aware, YaRN) stretches the rotation
  to contexts longer than trained; ALiBi (`model.pos=alibi`, Press et al. 2021, arXiv 2108.12409)
  adds a linear bias per head to the logits instead of rotating.
- Gates and sinks: `model.attn.gate` multiplies each head's output by a sigmoid of the layer input
  (Qiu et al. 2025, arXiv 2505.06708); `model.attn.sink` lets softmax put weight on nothing (an extra
  zero logit, or a learned one per head). KV caches can keep the first tokens as sinks while they
  slide (StreamingLLM, Xiao et al. 2023, arXiv 2309.17453) or hold int8 numbers.

Every option is chosen once, at construction (which class is the layer's attention, which function
normalises, which path attends, which window the layer has); what forward still branches on is the
call itself: a cache, a window, grouped heads.
"""
import math
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import Needs, OneOf, Range, Rule, UserError

QK_NORM_TYPES = ("rms", "layer", "l2")
QK_NORM_GAINS = ("none", "head", "channel")
IMPLS = ("sdpa", "reference", "tiled")
KINDS = ("softmax", "linear", "mla")
GATES = ("none", "head", "channel")
SINKS = ("none", "zero", "learned")
NAMED_SCALES = ("sqrt_dk", "none", "dk")


def positive_number(v) -> bool:
    try:
        return math.isfinite(float(v)) and float(v) > 0
    except (TypeError, ValueError):
        return False


@dataclass
class AttnConfig:
    scale: str = "sqrt_dk"  # sqrt_dk (1/sqrt(d_k)) | none (1.0) | dk (1/d_k) | a positive number
    qk_norm: bool = False  # normalise q and k per head before RoPE
    qk_norm_type: str = "rms"  # rms | layer | l2 (all parameter-free unless qk_norm_gain is set)
    qk_norm_gain: str = "none"  # none | head (one scalar per head) | channel (one per head dim)
    impl: str = "sdpa"  # sdpa (fast path) | reference (plain math, for checking and statistics) | tiled (FlashAttention's algorithm)
    block: int = 128  # impl=tiled: queries and keys per tile
    window: Optional[int] = None  # each query sees only the latest `window` keys (itself included); unset: all
    window_pattern: str = "L"  # with a window: L (local) or G (global) per layer, repeated over the layers (LG: alternating)
    kind: str = "softmax"  # softmax | linear (phi(q).phi(k) with phi = elu + 1: linear in N, an RNN's state when decoding) | mla (latent KV)
    gate: str = "none"  # none | head | channel: sigmoid gate from the layer input on each head's output (gated attention)
    sink: str = "none"  # none | zero (softmax with an extra zero logit, "off by one") | learned (a logit per head)
    kv_lora_rank: Optional[int] = None  # kind=mla: the latent's width d_c; unset: 4 * head_dim
    q_lora_rank: Optional[int] = None  # kind=mla: a query latent's width too; unset: queries straight from x
    rope_head_dim: Optional[int] = None  # kind=mla: the decoupled RoPE key/query width; unset: head_dim / 2

    RULES: ClassVar[dict] = {
        "scale": Rule(lambda v: str(v) in NAMED_SCALES or positive_number(v), "sqrt_dk, none, dk or a positive number"),
        "qk_norm_type": OneOf(QK_NORM_TYPES),
        "qk_norm_gain": OneOf(QK_NORM_GAINS),
        "impl": OneOf(IMPLS),
        "block": Range(1, 65536),
        "window": Range(1, why="keys a query sees, itself included"),
        "window_pattern": Rule(lambda v: bool(v) and set(str(v)) <= {"L", "G"}, "a string of L (local) and G (global)"),
        "kind": OneOf(KINDS),
        "gate": OneOf(GATES),
        "sink": OneOf(SINKS),
        "kv_lora_rank": Range(1),
        "q_lora_rank": Range(1),
        "rope_head_dim": Range(2, why="RoPE rotates pairs of channels"),
    }
    # each option must change what the model computes
    SOFTMAX: ClassVar[Needs] = Needs(lambda a: a.kind != "linear", "{p}kind is softmax or mla (linear attention "
                                     "has no softmax, no logits, no N x N table)")
    QK_NORM: ClassVar[Needs] = Needs(lambda a: a.qk_norm, "{p}qk_norm=true")
    MLA: ClassVar[Needs] = Needs(lambda a: a.kind == "mla", "{p}kind=mla")
    NEEDS: ClassVar[dict] = {
        "impl": SOFTMAX, "scale": SOFTMAX, "window": SOFTMAX, "sink": SOFTMAX,
        "qk_norm_type": QK_NORM, "qk_norm_gain": QK_NORM,
        "kv_lora_rank": MLA, "q_lora_rank": MLA, "rope_head_dim": MLA,
        "block": Needs(lambda a: a.impl == "tiled", "{p}impl=tiled"),
        "window_pattern": Needs(lambda a: a.window is not None, "{p}window=W"),
    }


def check_attention_options(config):
    """The attention options (of a GPTConfig) that only fail with a model option, in one line."""
    attn, dropout = config.attn, config.dropout
    if attn.kind == "mla":
        if config.n_kv_head != config.n_head:
            raise UserError(f"model.n_kv_head={config.n_kv_head} has no effect with model.attn.kind=mla (every head "
                            "reads the one shared latent): leave it unset")
        if config.value_embed:
            raise UserError("model.value_embed=true with model.attn.kind=mla is not implemented: MLA's values are "
                            "up-projected from the latent")
        if attn.qk_norm:
            raise UserError("model.attn.qk_norm=true with model.attn.kind=mla is not implemented: its keys are "
                            "up-projected from the latent; use kind=softmax for QK-Norm")
    if attn.rope_head_dim is not None and attn.rope_head_dim % 2:
        raise UserError(f"model.attn.rope_head_dim={attn.rope_head_dim} is odd, but RoPE rotates pairs of channels")
    if attn.impl == "tiled" and dropout > 0:
        raise UserError(f"model.attn.impl=tiled does not drop attention weights: set model.dropout=0 (now {dropout}) "
                        "or use impl=sdpa")


def resolve_scale(scale, head_dim: int) -> float:
    """The attention logit multiplier named by `model.attn.scale` (a legal value, see AttnConfig)."""
    named = {"sqrt_dk": 1.0 / math.sqrt(head_dim), "none": 1.0, "dk": 1.0 / head_dim}
    return named[str(scale)] if str(scale) in named else float(scale)


# ----------------------------------------------------------------------------- the mask

def visible(Tq: int, Tk: int, window=None, device=None):
    """Which keys each query may see, (Tq, Tk) bool. The Tq queries are the last Tq of the Tk
    positions (a decode step, Tq=1, sees every key; a block of probed queries sees its past).
    With a window, a query also sees only the latest `window` keys (itself included)."""
    offset = Tk - Tq  # absolute position of query 0 among the keys
    i = torch.arange(Tq, device=device).unsqueeze(1) + offset
    j = torch.arange(Tk, device=device).unsqueeze(0)
    mask = j <= i
    if window is not None:
        mask &= j > i - window
    return mask


def alibi_slopes(n_head: int) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al. 2021, arXiv 2108.12409): for n heads, n a power of two, the
    geometric sequence m_h = 2^(-8h/n), h = 1..n; otherwise those of the largest power of two p < n,
    then every other slope of the sequence for 2p, until there are n."""
    def geometric(n):
        return [2 ** (-8 * h / n) for h in range(1, n + 1)]
    p = 2 ** int(math.floor(math.log2(n_head)))
    slopes = geometric(p) if p == n_head else geometric(p) + geometric(2 * p)[0::2][:n_head - p]
    return torch.tensor(slopes, dtype=torch.float32)


def alibi_bias(alibi, rows=slice(None), cols=slice(None)):
    """ALiBi's additive bias -m_h * (i - j) for the queries and keys at positions alibi = (slopes (nh,),
    q_pos (Tq,), k_pos (Tk,)), or the rows/cols slices of it: (nh, tq, tk), in fp32."""
    slopes, q_pos, k_pos = alibi
    distance = (q_pos[rows, None] - k_pos[None, cols]).to(torch.float32)  # i - j
    return -slopes.view(-1, 1, 1).to(torch.float32) * distance


# ----------------------------------------------------------------------------- the attention function

def attention_scores(q, k, scale: float, causal: bool = True, window=None):
    """Scaled logits q·kᵀ·scale, keys a query may not see at -inf: (B, nh, Tq, hs), (B, nh, Tk, hs) -> (B, nh, Tq, Tk)."""
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, nh, Tq, Tk)
    if causal:
        scores = scores.masked_fill(~visible(q.size(-2), k.size(-2), window, q.device), float("-inf"))
    return scores


def repeat_kv(x, n_head: int):
    """K or V of n_kv heads (B, n_kv, T, hs) -> (B, n_head, T, hs): query head h reads kv head
    h // (n_head / n_kv), i.e. consecutive query heads share one kv head."""
    return x if x.size(1) == n_head else x.repeat_interleave(n_head // x.size(1), dim=1)


def with_sink(q, k, v, sink, scale, mask):
    """q, k, v and mask extended by a sink (Xiao et al. 2023; Miller 2023's "off by one"; gpt-oss):
    one extra key every query sees, whose logit is `sink` (one per query head, whatever the query) and
    whose value is zero, so the softmax may put weight on nothing. Its logit comes from one extra
    channel: q gets sink/scale, the sink key 1 and every other key 0, so q·k_sink·scale = sink."""
    B, nh, Tq, hs = q.shape
    n_kv, Tk = k.size(1), k.size(2)
    q = torch.cat([q, (sink / scale).to(q.dtype).view(1, nh, 1, 1).expand(B, nh, Tq, 1)], dim=-1)
    k = torch.cat([k.new_zeros(B, n_kv, 1, hs + 1), torch.cat([k, k.new_zeros(B, n_kv, Tk, 1)], dim=-1)], dim=2)
    k[:, :, 0, -1] = 1.0  # the sink key: position 0 of the keys
    v = torch.cat([v.new_zeros(B, n_kv, 1, v.size(-1)), v], dim=2)
    if mask is not None and mask.is_floating_point():  # an additive mask (ALiBi): the sink adds nothing
        return q, k, v, torch.cat([mask.new_zeros(*mask.shape[:-1], 1), mask], dim=-1)
    sees = torch.ones(*(mask.shape[:-1] if mask is not None else (Tq,)), 1, dtype=torch.bool, device=q.device)
    mask = sees if mask is None else torch.cat([sees, mask], dim=-1)
    return q, k, v, mask


def key_visibility(Tq: int, Tk: int, causal: bool, window, key_mask, device):
    """The keys each query may see, broadcastable to (B, nh, Tq, Tk) bool, or None for all."""
    mask = visible(Tq, Tk, window, device) if causal and (Tq > 1 or (window is not None and window < Tk)) else None
    if key_mask is not None:
        mask = key_mask if mask is None else mask & key_mask
    return mask


def sdpa_attention(q, k, v, scale, causal=True, dropout_p=0.0, window=None, key_mask=None, sink=None, alibi=None):
    """The fast path: PyTorch's fused kernel (flash or memory-efficient on a GPU), K/V shared by
    query groups without a copy (enable_gqa). ALiBi's bias goes in as an additive float mask."""
    Tq, Tk = q.size(-2), k.size(-2)
    kw = dict(dropout_p=dropout_p, scale=scale, enable_gqa=k.size(1) != q.size(1))
    mask = key_visibility(Tq, Tk, causal, window, key_mask, q.device) if sink is not None or alibi is not None else None
    if alibi is not None:  # (nh, Tq, Tk): the bias where a key is visible, -inf where not
        bias = alibi_bias(alibi).to(q.dtype)
        mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
    if sink is not None:
        q, k, v, mask = with_sink(q, k, v, sink, scale, mask)
    if mask is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
    if causal and Tq == Tk and (window is None or window >= Tk) and key_mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)  # aligned top-left: only for Tq == Tk
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_visibility(Tq, Tk, causal, window, key_mask,
                                                                             q.device), **kw)


def reference_attention(q, k, v, scale, causal=True, dropout_p=0.0, window=None, key_mask=None, sink=None, alibi=None):
    """The same function written out: K/V expanded to one head per query head, explicit scores,
    -inf mask, the sink's logit as one more column (its weight multiplies no value), softmax (in at
    least fp32), weights @ V."""
    k, v = repeat_kv(k, q.size(1)), repeat_kv(v, q.size(1))
    scores = attention_scores(q, k, scale, causal, window)  # (B, nh, Tq, Tk)
    if alibi is not None:
        scores = scores + alibi_bias(alibi).to(scores.dtype)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, float("-inf"))
    if sink is not None:
        column = sink.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([column, scores], dim=-1)
    weights = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).type_as(q)
    if sink is not None:
        weights = weights[..., 1:]  # the sink's share goes nowhere
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v


def key_blocks(q0: int, q1: int, Tk: int, offset: int, block: int, causal: bool, window):
    """The key blocks [k0, k1) the queries q0..q1-1 (positions offset + q) can see any key of: a
    causal query sees no later key, a windowed one none older than its window. Blocks past that are
    never computed (FlashAttention skips them too: the causal half of the table costs nothing)."""
    lo = 0 if not causal or window is None else max(0, offset + q0 - window + 1) // block * block
    hi = Tk if not causal else min(Tk, offset + q1)
    return [(k0, min(k0 + block, hi)) for k0 in range(lo, hi, block)]


def tile_mask(q0, q1, k0, k1, offset, causal, window, key_mask, device):
    """Which keys k0..k1-1 the queries q0..q1-1 see: (q1 - q0, k1 - k0) bool, or None if all."""
    mask = None
    if causal:
        i = torch.arange(q0, q1, device=device)[:, None] + offset
        j = torch.arange(k0, k1, device=device)[None, :]
        mask = j <= i
        if window is not None:
            mask &= j > i - window
    if key_mask is not None:
        slots = key_mask.reshape(-1)[k0:k1]
        mask = slots.expand(q1 - q0, -1) if mask is None else mask & slots
    return mask


class TiledAttention(torch.autograd.Function):
    """FlashAttention's algorithm (Dao et al. 2022, arXiv 2205.14135), written for reading: queries
    and keys in blocks, an online softmax (Milakov & Gimelshein 2018, arXiv 1805.02867) and a
    backward pass that recomputes each block's scores. All N² dot products are still computed (less
    the blocks a causal mask hides); the N x N table never exists: a training step keeps only q, k, v,
    the output and one log-sum-exp per query row, O(N) memory.

    Forward, per block of queries: a running maximum m, a running sum l of exp(s - m) and a running
    output o. For each block of keys, s = q·kᵀ·scale; m' = max(m, max_j s); the old l and o are
    rescaled by exp(m - m'), then l += Σ_j exp(s - m'), o += exp(s - m')·v. At the end o / l is the
    softmax-weighted sum, and m + ln l (the log-sum-exp) is all the backward needs to rebuild the
    weights p = exp(s - lse) of any block. Backward, with D_i = Σ_d dO_id O_id:
    dV += pᵀ dO, dP = dO Vᵀ, dS = p ∘ (dP - D), dQ += dS K · scale, dK += dSᵀ Q · scale.
    Grouped-query heads read their shared k, v without copying them (the g query heads of a kv head
    are one batch dimension); everything accumulates in at least fp32."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, window, key_mask, block, sink, alibi):
        B, nh, Tq, hs = q.shape
        n_kv, Tk = k.size(1), k.size(2)
        acc = torch.promote_types(q.dtype, torch.float32)
        qg = q.view(B, n_kv, nh // n_kv, Tq, hs).to(acc)  # (B, n_kv, g, Tq, hs): query heads by kv head
        kg, vg = k.unsqueeze(2).to(acc), v.unsqueeze(2).to(acc)  # (B, n_kv, 1, Tk, hs)
        out = torch.zeros(*qg.shape[:-1], v.size(-1), dtype=acc, device=q.device)  # (B, n_kv, g, Tq, hs_v)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)  # (B, n_kv, g, Tq)
        offset = Tk - Tq  # the queries are the last Tq positions
        for q0 in range(0, Tq, block):
            q1 = min(q0 + block, Tq)
            m = torch.full((*qg.shape[:3], q1 - q0), float("-inf"), dtype=acc, device=q.device)
            l, o = torch.zeros_like(m), torch.zeros_like(out[..., q0:q1, :])
            if sink is not None:  # a sink is where every row starts: its logit, weight exp(0) = 1, value 0
                m = sink.to(acc).view(1, n_kv, nh // n_kv, 1).expand_as(m).clone()
                l = torch.ones_like(m)
            for k0, k1 in key_blocks(q0, q1, Tk, offset, block, causal, window):
                s = qg[..., q0:q1, :] @ kg[..., k0:k1, :].transpose(-2, -1) * scale  # (B, n_kv, g, bq, bk)
                if alibi is not None:  # this tile's part of ALiBi's bias: never the whole table
                    s = s + alibi_bias(alibi, slice(q0, q1), slice(k0, k1)).view(1, n_kv, nh // n_kv, q1 - q0, -1)
                mask = tile_mask(q0, q1, k0, k1, offset, causal, window, key_mask, q.device)
                if mask is not None:
                    s = s.masked_fill(~mask, float("-inf"))
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row that sees no key yet
                p = torch.exp(s - m_safe.unsqueeze(-1))
                rescale = torch.exp(m - m_safe)  # the earlier blocks' partial sums, moved to the new max
                l = l * rescale + p.sum(-1)
                o = o * rescale.unsqueeze(-1) + p @ vg[..., k0:k1, :]
                m = m_new
            out[..., q0:q1, :] = o / l.unsqueeze(-1)
            lse[..., q0:q1] = m + torch.log(l)
        ctx.save_for_backward(q, k, v, out, lse, key_mask, sink)
        ctx.args = (scale, causal, window, block, alibi)
        return out.view(B, nh, Tq, -1).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, key_mask, sink = ctx.saved_tensors
        scale, causal, window, block, alibi = ctx.args
        B, nh, Tq, hs = q.shape
        n_kv, Tk = k.size(1), k.size(2)
        acc = out.dtype
        qg, kg, vg = q.view(B, n_kv, nh // n_kv, Tq, hs).to(acc), k.unsqueeze(2).to(acc), v.unsqueeze(2).to(acc)
        do = dout.reshape(out.shape).to(acc)
        D = (do * out).sum(-1)  # (B, n_kv, g, Tq)
        dq, dk, dv = torch.zeros_like(qg), torch.zeros_like(kg), torch.zeros_like(vg)
        offset = Tk - Tq
        for q0 in range(0, Tq, block):
            q1 = min(q0 + block, Tq)
            for k0, k1 in key_blocks(q0, q1, Tk, offset, block, causal, window):
                s = qg[..., q0:q1, :] @ kg[..., k0:k1, :].transpose(-2, -1) * scale
                if alibi is not None:
                    s = s + alibi_bias(alibi, slice(q0, q1), slice(k0, k1)).view(1, n_kv, nh // n_kv, q1 - q0, -1)
                mask = tile_mask(q0, q1, k0, k1, offset, causal, window, key_mask, q.device)
                if mask is not None:
                    s = s.masked_fill(~mask, float("-inf"))
                p = torch.exp(s - lse[..., q0:q1].unsqueeze(-1))  # this block's softmax weights, rebuilt
                dv[..., k0:k1, :] += (p.transpose(-2, -1) @ do[..., q0:q1, :]).sum(2, keepdim=True)
                dp = do[..., q0:q1, :] @ vg[..., k0:k1, :].transpose(-2, -1)
                ds = p * (dp - D[..., q0:q1].unsqueeze(-1))
                dq[..., q0:q1, :] += ds @ kg[..., k0:k1, :] * scale
                dk[..., k0:k1, :] += (ds.transpose(-2, -1) @ qg[..., q0:q1, :]).sum(2, keepdim=True) * scale
        dsink = None
        if sink is not None:  # the sink's weight p = exp(sink - lse) times (dP = 0 for its zero value) - D
            p_sink = torch.exp(sink.to(acc).view(1, n_kv, nh // n_kv, 1) - lse)
            dsink = -(p_sink * D).sum(dim=(0, 3)).reshape(nh).to(sink.dtype)
        return (dq.view(q.shape).to(q.dtype), dk.squeeze(2).to(k.dtype), dv.squeeze(2).to(v.dtype),
                None, None, None, None, None, dsink, None)


def tiled_attention(q, k, v, scale, causal=True, dropout_p=0.0, window=None, key_mask=None, sink=None, alibi=None,
                    block=128):
    """FlashAttention's algorithm in plain PyTorch (TiledAttention); no attention dropout."""
    if dropout_p > 0:
        raise ValueError("the tiled path does not drop attention weights")
    return TiledAttention.apply(q, k, v, scale, causal, window, key_mask, block, sink, alibi)


ATTENTION_PATHS = {"sdpa": sdpa_attention, "reference": reference_attention, "tiled": tiled_attention}


def attention(q, k, v, scale: float, *, causal: bool = True, impl: str = "sdpa", dropout_p: float = 0.0,
              window=None, key_mask=None, sink=None, alibi=None, block: int = 128):
    """softmax(q·kᵀ·scale + M)·v for q (B, nh, Tq, hs) and k, v (B, n_kv, Tk, hs) -> (B, nh, Tq, hs).

    M is 0 where a key is visible (causal, and within `window` if given), -inf elsewhere. With
    n_kv < nh (grouped-query attention) each kv head serves nh / n_kv consecutive query heads.
    key_mask (1, 1, 1, Tk) bool, for a single query: which cache slots hold a key (a static cache).
    sink (nh,): the logit of a key every query sees and whose value is zero (with_sink).
    alibi (slopes (nh,), q positions (Tq,), k positions (Tk,)): ALiBi's bias -m_h (i - j) on the logits."""
    kw = {"block": block} if impl == "tiled" else {}
    return ATTENTION_PATHS[impl](q, k, v, scale, causal, dropout_p, window, key_mask, sink, alibi, **kw)


# ----------------------------------------------------------------------------- RoPE and QK-Norm

ROPE_SCALINGS = ("none", "linear", "ntk", "yarn")
YARN_ALPHA, YARN_BETA = 1.0, 32.0  # YaRN's ramp: dims with fewer turns than alpha interpolate, more than beta don't


def rope_theta(head_dim: int, base: float, scaling: str = "none", factor: float = 1.0, original: int = 0, device=None):
    """RoPE's angular frequencies theta_j = base^(-2j/d), j = 0..d/2-1, for positions `factor` times
    longer than the `original` length trained on (factor 1: unchanged, whatever the scaling):
    - linear, position interpolation (Chen et al. 2023, arXiv 2306.15595): theta_j / factor;
    - ntk, "NTK-aware" (bloc97, 2023): the base raised to base * factor^(d / (d - 2)), so the lowest
      frequency is interpolated and the highest kept;
    - yarn (Peng et al. 2023, arXiv 2309.00071): per dimension by its number of turns within the
      original length, r_j = original * theta_j / 2π: interpolated where r_j < alpha, kept where
      r_j > beta, a linear ramp between."""
    j = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
    if factor == 1:
        scaling = "none"
    if scaling == "ntk":
        base = base * factor ** (head_dim / (head_dim - 2))
    theta = 1.0 / base ** (j / head_dim)
    if scaling == "linear":
        theta = theta / factor
    elif scaling == "yarn":
        turns = original * theta / (2 * math.pi)
        keep = ((turns - YARN_ALPHA) / (YARN_BETA - YARN_ALPHA)).clamp(0, 1)  # 1: keep, 0: interpolate
        theta = keep * theta + (1 - keep) * theta / factor
    return theta


def rope_freqs(head_dim: int, length: int, base: float, device=None, scaling: str = "none", factor: float = 1.0,
               original: int = 0):
    """cos and sin of position * theta_j for positions 0..length-1: (length, head_dim // 2, 2).
    YaRN also scales both by its attention temperature 0.1 ln(factor) + 1, so every q·k logit is
    multiplied by its square (Peng et al. 2023, "length scaling")."""
    theta = rope_theta(head_dim, base, scaling, factor, original, device)
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), theta)  # (L, hs/2)
    mscale = 0.1 * math.log(factor) + 1 if scaling == "yarn" and factor > 1 else 1.0
    return torch.stack((angles.cos(), angles.sin()), dim=-1) * mscale


def apply_rope(x, freqs, real=None):
    """Rotate each channel pair (2j, 2j+1) of x (..., hs) by its position's angle; freqs
    (..., hs/2, 2) holds that angle's cos and sin and must broadcast against x's leading dims.

    Eagerly this is one complex multiply (fewest kernels); under torch.compile (real=True) the
    same rotation is written in real arithmetic, which inductor fuses (it has no complex dtype)."""
    real = torch.compiler.is_compiling() if real is None else real
    pairs = x.to(torch.promote_types(x.dtype, torch.float32)).unflatten(-1, (-1, 2))  # (..., hs/2, 2), >= fp32
    if real:
        x0, x1 = pairs.unbind(-1)
        cos, sin = freqs.unbind(-1)
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    else:
        out = torch.view_as_real(torch.view_as_complex(pairs) * torch.view_as_complex(freqs))
    return out.flatten(-2).type_as(x)


def rotate(x, freqs):
    """RoPE on x (B, T, ..., hs) at the positions of freqs (T, hs/2, 2)."""
    return apply_rope(x, freqs.view(freqs.size(0), *([1] * (x.dim() - 3)), -1, 2))


def rotate_heads(x, freqs):
    """RoPE on x (B, heads, T, hs) at the positions of freqs (T, hs/2, 2) (None: as is)."""
    return x if freqs is None else rotate(x.transpose(1, 2), freqs).transpose(1, 2)


def qk_normalize(x, kind: str, eps: float = 1e-6):
    """Parameter-free per-head norm of x (..., hs). rms and layer give |x| = sqrt(hs); l2 gives 1."""
    if kind == "l2":
        return F.normalize(x, dim=-1, eps=eps)
    if kind == "layer":
        x = x - x.mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- KV caches

class KVCache:
    """Per-layer K and V (after RoPE) for generation, preallocated as a ring buffer.

    With RoPE a cached key keeps its absolute position forever, and attention only sees offsets,
    so once `length` tokens are cached the oldest slot is overwritten and the context slides.
    Its dtype may be narrower than the model's: a bf16 cache halves what a decode step reads.
    """

    rotates = False  # keys are cached rotated (SinkKVCache stores them before RoPE and rotates them itself)

    def __init__(self, batch_size, n_kv_head, length, head_dim, device=None, dtype=torch.float32):
        self.k = torch.zeros(batch_size, n_kv_head, length, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = length

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def positions(self, q_pos, n: int):
        """(query positions, positions of the n keys update returned) for a position-dependent bias
        (ALiBi): slot s of the ring holds the latest position p <= the newest with p = s mod length."""
        newest = q_pos[-1]
        if n > self.length:  # a prefill longer than the cache attends to all of its own tokens
            return q_pos, torch.arange(n, device=q_pos.device) + newest - n + 1
        slots = torch.arange(n, device=q_pos.device)
        return q_pos, newest - (newest - slots) % self.length

    def update(self, pos: int, k, v):
        """Store k, v (B, n_kv, T, hs) for positions pos..pos+T-1; return all cached (B, n_kv, n, hs)
        and a key mask (None: every returned slot holds a key). A prefill longer than the cache (a
        windowed layer's cache holds one window) keeps its latest `length` positions and returns all
        T for its own, windowed, attention."""
        T = k.size(2)
        if T > 1 and pos != 0:
            raise ValueError("a KV cache takes a multi-token chunk only as the first (prefill) step")
        if T > self.length:  # ring slot of position p is p % length, as for every later step
            keep = torch.arange(T - self.length, T, device=k.device)
            self.k.index_copy_(2, keep % self.length, k[:, :, keep].to(self.k.dtype))
            self.v.index_copy_(2, keep % self.length, v[:, :, keep].to(self.v.dtype))
            return k, v, None
        slot = pos % self.length  # a prefill starts at 0 and fits, a decode step writes one slot: no wrap
        self.k[:, :, slot:slot + T] = k  # cast to the cache's dtype on the way in
        self.v[:, :, slot:slot + T] = v
        n = min(pos + T, self.length)  # slots in use; order is irrelevant once no mask is needed
        return self.k[:, :, :n], self.v[:, :, :n], None


class StaticKVCache(KVCache):
    """The same ring buffer with fixed shapes, for a compiled decode step (as gpt-fast does): the
    position is a tensor, each step attends over every slot and a mask hides those not written yet,
    so one graph serves every step and nothing waits for the host.

    The storage is padded to a multiple of ALIGN slots (masked, never written: GPU attention kernels
    want aligned key lengths) and its tensors are marked as static addresses, so a CUDA graph can
    capture the step: inputs mutated in place that are not static make torch.compile skip CUDA graphs."""
    ALIGN = 64

    def __init__(self, batch_size, n_kv_head, length, head_dim, device=None, dtype=torch.float32):
        padded = -(-length // self.ALIGN) * self.ALIGN
        super().__init__(batch_size, n_kv_head, padded, head_dim, device, dtype)
        self.length = length  # the ring's size: position p lives in slot p % length
        self.slots = torch.arange(padded, device=device)
        for t in (self.k, self.v, self.slots):
            torch._dynamo.mark_static_address(t)

    def update(self, pos, k, v):
        if not torch.is_tensor(pos):  # the prefill runs eagerly, as for KVCache
            return super().update(pos, k, v)
        slot = pos % self.length  # (1,)
        self.k.index_copy_(2, slot, k.to(self.k.dtype))
        self.v.index_copy_(2, slot, v.to(self.v.dtype))
        written = (self.slots <= pos) & (self.slots < self.length)  # positions 0..pos, all once full; never the pad
        return self.k, self.v, written.view(1, 1, 1, -1)

    def positions(self, q_pos, n: int):
        """A decode step returns every slot (the unwritten and the pad are masked, whatever position they
        get); the eager prefill, what KVCache returns."""
        if n != self.slots.numel():
            return super().positions(q_pos, n)
        return q_pos, q_pos[-1] - (q_pos[-1] - self.slots) % self.length


class Int8KVCache(KVCache):
    """The KV ring buffer quantised to int8: each token's key (and value) in each head is stored as
    round(x / s) with its own scale s = max|x| / 127 (per token and head, fp32), and read back as the
    int8 values times s. Per token and head it holds hs + 4 bytes for each of k and v against 2·hs
    in bf16; the rounding error of every element is at most s / 2."""

    def __init__(self, batch_size, n_kv_head, length, head_dim, device=None, dtype=torch.float32):
        self.k = torch.zeros(batch_size, n_kv_head, length, head_dim, device=device, dtype=torch.int8)
        self.v = torch.zeros_like(self.k)
        self.k_scale = torch.zeros(batch_size, n_kv_head, length, 1, device=device, dtype=torch.float32)
        self.v_scale = torch.zeros_like(self.k_scale)
        self.length, self.out_dtype = length, dtype

    @staticmethod
    def quantize(x):
        """(int8 values, fp32 scales) of x (..., hs): x ≈ values * scales, per row."""
        scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
        return (x.float() / scale).round().clamp(-127, 127).to(torch.int8), scale

    def update(self, pos: int, k, v):
        T = k.size(2)
        if T > 1 and pos != 0:
            raise ValueError("a KV cache takes a multi-token chunk only as the first (prefill) step")
        keep = torch.arange(max(0, T - self.length), T, device=k.device)  # a longer prefill keeps its latest
        slots = (pos + keep) % self.length
        for store, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            values, scale = self.quantize(x[:, :, keep])
            store.index_copy_(2, slots, values)
            scales.index_copy_(2, slots, scale)
        if T > self.length:
            return k, v, None
        n = min(pos + T, self.length)
        deq = lambda s, sc: (s[:, :, :n].float() * sc[:, :, :n]).to(self.out_dtype)  # noqa: E731
        return deq(self.k, self.k_scale), deq(self.v, self.v_scale), None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.k_scale, self.v_scale))


class SinkKVCache(KVCache):
    """Eviction that keeps attention sinks (StreamingLLM, Xiao et al. 2023, arXiv 2309.17453): once
    the cache is full, the first `sinks` tokens stay for good and the rest of it is a ring of the most
    recent tokens. Keys are stored before RoPE and rotated to their place in the cache at every step
    (sinks at 0..s-1, then the recent window in order, the query last), as the paper does, so no offset
    ever exceeds the cache's length: evicted tokens leave no gap in the positions."""
    rotates = True

    def __init__(self, batch_size, n_kv_head, length, head_dim, device=None, dtype=torch.float32, sinks=4,
                 rope_table=None):
        if not 0 < sinks < length:
            raise ValueError(f"{sinks} sink tokens need a cache longer than that (it holds {length})")
        super().__init__(batch_size, n_kv_head, length, head_dim, device, dtype)
        self.sinks, self.rope_table, self.n = sinks, rope_table, 0

    def update(self, pos: int, k, v):
        T = k.size(2)
        if T > 1 and pos != 0:
            raise ValueError("a KV cache takes a multi-token chunk only as the first (prefill) step")
        window = self.length - self.sinks
        for t in range(max(0, T - window), T) if T > self.length else range(T):  # a long prefill: its latest
            p = pos + t
            slot = p if p < self.length else self.sinks + (p - self.sinks) % window
            self.k[:, :, slot] = k[:, :, t]
            self.v[:, :, slot] = v[:, :, t]
        if T > self.length:  # the first sinks were written by the loop only if T <= window: write them too
            self.k[:, :, :self.sinks], self.v[:, :, :self.sinks] = k[:, :, :self.sinks], v[:, :, :self.sinks]
        self.n = max(self.n, pos + T)
        if T > 1:  # a prefill attends to its own tokens, at their own positions
            self.order = None
            return k, v, None
        # cache order: the sinks, then the recent window oldest first (the ring's next slot is its oldest)
        if self.n <= self.length:
            order = torch.arange(self.n, device=k.device)
        else:
            oldest = self.sinks + (self.n - self.sinks) % window
            ring = torch.arange(window, device=k.device)
            order = torch.cat([torch.arange(self.sinks, device=k.device), self.sinks + (oldest - self.sinks + ring) % window])
        self.order = order
        return self.k[:, :, order], self.v[:, :, order], None

    def positions(self, q_pos, n: int):
        """Positions within the cache: the keys 0..n-1 in cache order, the query the newest (decoding)."""
        if q_pos.numel() > 1:  # a prefill, at its own positions
            return q_pos, q_pos
        return torch.arange(n - 1, n, device=q_pos.device), torch.arange(n, device=q_pos.device)

    def rotate(self, q, k):
        """q (B, nh, T, hs) and cached keys (B, n_kv, n, hs) rotated to their positions in the cache."""
        if self.rope_table is None:
            return q, k
        n, T = k.size(2), q.size(2)
        rq = self.rope_table[n - T:n]
        rk = self.rope_table[:n]
        return rotate(q.transpose(1, 2), rq).transpose(1, 2), rotate(k.transpose(1, 2), rk).transpose(1, 2)


# ----------------------------------------------------------------------------- the attention module

class HookPoint(nn.Module):
    """An identity a tensor passes through so that a forward hook can read it (TransformerLens'
    HookPoint): the attention probe and the maps attach here, so no forward carries a probe."""

    def forward(self, x):
        return x


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused q|k|v projection, QK-Norm and RoPE on q and k,
    the attention function, the output projection. Hook points: hook_q (B, nh, T, hs) and hook_k
    (B, n_kv, T, hs), the q and k that enter attention (normed, rotated)."""
    softmax = True  # its weights are a softmax of logits: the attention probe reads them

    def __init__(self, config, layer: int):
        super().__init__()
        self.layer = layer  # this block's index, for the attention probe
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.scale = config.attn_scale
        self.attn_cfg = config.attn
        self.dropout = config.dropout
        self.make_projections(config)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.attend = ATTENTION_PATHS[config.attn.impl]
        if config.attn.impl == "tiled":
            self.attend = partial(tiled_attention, block=config.attn.block)
        pattern = config.attn.window_pattern
        local = config.attn.window is not None and pattern[layer % len(pattern)] == "L"
        self.window = config.attn.window if local else None  # this layer's own window (None: global)
        # gated attention (Qiu et al. 2025, arXiv 2505.06708): sigmoid(x W_g) scales each head's output,
        # one gate per head or per channel, computed from the layer's input
        outputs = {"none": 0, "head": config.n_head, "channel": config.n_head * config.head_dim}[config.attn.gate]
        self.gate = nn.Linear(config.n_embd, outputs, bias=False) if outputs else None
        # an attention sink: a logit per head that the softmax may spend weight on instead of any key
        if config.attn.sink == "learned":  # gpt-oss: learned, one per head
            self.sink_logit = nn.Parameter(torch.zeros(config.n_head))
        else:  # zero: softmax with an extra zero logit ("off by one", Miller 2023); none: no sink
            self.register_buffer("sink_logit", torch.zeros(config.n_head) if config.attn.sink == "zero" else None,
                                 persistent=False)
        # ALiBi (Press et al. 2021): no positions in q or k; a per-head linear bias on the logits
        self.register_buffer("alibi_slopes", alibi_slopes(config.n_head) if config.pos == "alibi" else None,
                             persistent=False)
        self.hook_q, self.hook_k = HookPoint(), HookPoint()

    def make_projections(self, config):
        """q (n_head heads), k and v (n_kv_head heads each) in one matmul laid out [Q | K | V], the
        output projection, and QK-Norm's optional gains."""
        self.c_attn = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_kv_head) * config.head_dim,
                                bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # QK-Norm gains broadcast over (B, T, 2 (q|k), nh, hs): a scalar or a vector per head
        gain = config.attn.qk_norm_gain if config.attn.qk_norm else "none"
        per = {"none": None, "head": 1, "channel": config.head_dim}[gain]  # one gain per head, or per channel
        self.q_gain = nn.Parameter(torch.ones(config.n_head, per)) if per else None
        self.k_gain = nn.Parameter(torch.ones(config.n_kv_head, per)) if per else None
        self.norm_kind = config.attn.qk_norm_type if config.attn.qk_norm else None

    def normalize(self, x, gain):
        """QK-Norm of x (..., heads, hs) before RoPE, so the gain multiplies un-rotated channels."""
        if self.norm_kind is None:
            return x
        x = qk_normalize(x, self.norm_kind)
        return x if gain is None else x * gain

    def qkv(self, x, rope=None, ve=None):
        """q (B, nh, T, hs) and k, v (B, n_kv, T, hs) of x (B, T, C); q and k normed (if enabled),
        then rotated (rope: (T, hs/2, 2), None for the other position schemes); ve (B, T, n_kv hs),
        the token's value embedding, is added to v."""
        B, T, C = x.shape
        nq, hs = self.n_head * self.head_dim, self.head_dim
        qkv = self.c_attn(x)  # (B, T, (nh + 2 n_kv) hs)
        nkv = self.n_kv_head * hs
        # split, not qkv[..., a:b]: each slice's backward zero-fills a gradient the size of qkv
        if self.n_kv_head == self.n_head:  # q and k side by side: one norm and one rotation for both
            qk, v = qkv.split((2 * nq, nkv), dim=-1)
            gains = None if self.q_gain is None else torch.stack((self.q_gain, self.k_gain))  # (2, nh, 1 or hs)
            qk = self.normalize(qk.view(B, T, 2, self.n_head, hs), gains)
            q, k = (qk if rope is None else rotate(qk, rope)).unbind(2)  # (B, T, nh, hs) each
        else:  # grouped-query: fewer k heads than q heads
            q, k, v = qkv.split((nq, nkv, nkv), dim=-1)
            q = self.normalize(q.view(B, T, self.n_head, hs), self.q_gain)
            k = self.normalize(k.view(B, T, self.n_kv_head, hs), self.k_gain)
            if rope is not None:
                q, k = rotate(q, rope), rotate(k, rope)
        v = (v if ve is None else v + ve).view(B, T, self.n_kv_head, hs)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hs)

    def logit_bound(self):
        """With QK-Norm, the largest |logit| any input can give: scale * |q_hat| * |k_hat|, where
        |x_hat| = sqrt(hs) after rms or layer norm and 1 after l2, times the largest |gain| of q and
        of k. None without QK-Norm (then logits grow with the inputs)."""
        if self.norm_kind is None:
            return None
        norm_sq = 1.0 if self.norm_kind == "l2" else float(self.head_dim)
        gains = 1.0 if self.q_gain is None else self.q_gain.abs().max().item() * self.k_gain.abs().max().item()
        return self.scale * norm_sq * gains

    def new_cache(self, batch_size: int, length: int, device, dtype, static: bool = False, sinks: int = 0,
                  rope_table=None, absorbed: bool = True):
        """This layer's KV cache for generation: `length` positions, or its window's if shorter; int8
        (dtype=torch.int8: Int8KVCache), keeping `sinks` first tokens when it slides (SinkKVCache), or
        with fixed shapes for a compiled decode step (StaticKVCache)."""
        length = length if self.window is None else min(length, self.window)
        shape = (batch_size, self.n_kv_head, length, self.head_dim, device)
        if static and (sinks or dtype == torch.int8):
            raise UserError("a compiled decode step supports neither an int8 cache nor sink tokens: use compile=false")
        if dtype == torch.int8:
            if sinks:
                raise UserError("an int8 cache does not keep sink tokens yet: use kv_dtype=auto with kv_sinks, or no sinks")
            return Int8KVCache(*shape)
        if sinks:
            return SinkKVCache(*shape, dtype, sinks=sinks, rope_table=rope_table)
        return (StaticKVCache if static else KVCache)(*shape, dtype)

    def forward(self, x, *, rope=None, kv_cache=None, pos=0, window=None, ve=None):
        """x (B, T, C) at positions pos..pos+T-1 -> (B, T, C). kv_cache: this layer's cache (k, v
        are added to it and attention reads all it holds); window: each query sees only the latest
        `window` keys (with the layer's own window, the narrower); ve: the value embedding added to v."""
        B, T, C = x.shape
        if self.window is not None:
            window = self.window if window is None else min(window, self.window)
        in_cache = kv_cache is not None and kv_cache.rotates  # positions are the cache's to give (SinkKVCache)
        q, k, v = self.qkv(x, None if in_cache else rope, ve)
        q, k = self.hook_q(q), self.hook_k(k)  # what the attention probe reads
        key_mask = None
        if kv_cache is not None:
            k, v, key_mask = kv_cache.update(pos, k, v)  # (B, n_kv, n_cached, hs)
            if in_cache:
                q, k = kv_cache.rotate(q, k) if T == 1 else (rotate_heads(q, rope), rotate_heads(k, rope))
            if T == 1:  # a decode step: the cache (one window long) holds just the keys it may see, in slot order
                window = None
        # a cache may hold another dtype (sample.kv_dtype): q joins it, the output returns to q's
        y = self.attend(q.to(k.dtype), k, v, self.scale, True, self.dropout if self.training else 0.0, window,
                        key_mask, self.sink_logit, self.alibi(pos, T, kv_cache, k.size(2))).to(q.dtype)  # (B, nh, T, hs)
        return self.project(x, y)

    def alibi(self, pos, T: int, kv_cache, n_keys: int):
        """(slopes, query positions, key positions) for ALiBi's bias, or None without ALiBi."""
        if self.alibi_slopes is None:
            return None
        q_pos = pos + torch.arange(T, device=self.alibi_slopes.device)  # pos may be a tensor (compiled decoding)
        return (self.alibi_slopes, *(kv_cache.positions(q_pos, n_keys) if kv_cache is not None else (q_pos, q_pos)))

    def project(self, x, y):
        """The heads' outputs y (B, nh, T, hs), gated if the layer has a gate, side by side, projected."""
        B, nh, T, hs = y.shape
        if self.gate is not None:  # (B, T, nh or nh*hs) -> (B, nh, T, 1 or hs)
            y = y * torch.sigmoid(self.gate(x)).view(B, T, nh, -1).transpose(1, 2)
        y = y.transpose(1, 2).contiguous().view(B, T, nh * hs)  # re-assemble heads side by side
        return self.resid_dropout(self.c_proj(y))


# ----------------------------------------------------------------------------- linear attention

LINEAR_CHUNK = 64  # positions per chunk of linear attention's training form (counting.py counts with it)


def elu_feature(x):
    """φ(x) = elu(x) + 1 > 0: the feature map of Katharopoulos et al. (2020), whose inner products
    φ(q)·φ(k) stand in for exp(q·k) (positive, so each row is still a weighted mean of values)."""
    return F.elu(x) + 1


class LinearState:
    """A linear-attention layer's whole context, in constant size whatever its length: S = Σ_j
    rope(φ(k_j)) v_jᵀ (B, n_kv, hs, hs) and z = Σ_j φ(k_j) (B, n_kv, hs). What a KV cache is to
    softmax attention, this is to linear attention: an RNN's hidden state ("Transformers are RNNs")."""

    def __init__(self, batch_size, n_kv_head, head_dim, device=None, dtype=torch.float32):
        self.S = torch.zeros(batch_size, n_kv_head, head_dim, head_dim, device=device, dtype=dtype)
        self.z = torch.zeros(batch_size, n_kv_head, head_dim, device=device, dtype=dtype)
        for t in (self.S, self.z):  # updated in place by a compiled decode step
            torch._dynamo.mark_static_address(t)

    def nbytes(self) -> int:
        return self.S.numel() * self.S.element_size() + self.z.numel() * self.z.element_size()


class LinearAttention(CausalSelfAttention):
    """Causal linear attention (Katharopoulos et al. 2020, arXiv 2006.16236): the weights of query i
    on key j are φ(q_i)·φ(k_j) / Σ_{j'≤i} φ(q_i)·φ(k_j'), φ(x) = elu(x) + 1, so

        y_i = φ(q_i)ᵀ S_i / φ(q_i)ᵀ z_i,   S_i = Σ_{j≤i} φ(k_j) v_jᵀ,   z_i = Σ_{j≤i} φ(k_j)

    and the N x N product re-associates. Training uses the chunked form (Hua et al. 2022, arXiv
    2202.10447; Yang et al. 2023, arXiv 2312.06635): within a chunk of `chunk` positions the masked
    quadratic form (φ(q)·φ(k) table, lower triangle, times v), and across chunks one state S per
    chunk boundary, so the work is O(N·(chunk + hs)·hs) and it keeps N/chunk states instead of N (the
    plain prefix sums of S_i keep an hs x hs matrix per position, and at nanoGPT's CPU size took
    several times as long). z_i is a prefix sum (hs numbers per position). Generation carries S and
    z as a constant-size state (the recurrent form). With RoPE, φ(q) and φ(k) are rotated in the
    numerator only, as the RoPE paper does for linear attention (Su et al. 2021, §3.4.4): the
    denominator keeps every weight's sum.
    QK-Norm applies before φ. No softmax: no scale, no logits, no windows, no N x N table."""

    softmax = False  # the attention probe reads softmax attention only
    chunk = LINEAR_CHUNK  # positions per chunk in the chunked (training) form

    def features(self, x, rope, ve):
        """q, k, v as linear attention uses them: (φ rotated, φ) for q and k, v as is."""
        q, k, v = self.qkv(x, None, ve)  # normed (QK-Norm), not rotated: φ comes first
        fq, fk = elu_feature(q), elu_feature(k)  # (B, heads, T, hs)
        if rope is None:
            return (fq, fq), (fk, fk), v
        return (rotate_heads(fq, rope), fq), (rotate_heads(fk, rope), fk), v

    def new_cache(self, batch_size: int, length: int, device, dtype, static: bool = False, sinks: int = 0, **_):
        """The layer's recurrent state: its size does not depend on `length` (nothing to evict)."""
        if sinks or dtype == torch.int8:
            raise UserError("linear attention keeps a constant-size state: kv_sinks and kv_dtype=int8 do not apply")
        return LinearState(batch_size, self.n_kv_head, self.head_dim, device, torch.promote_types(dtype, torch.float32))

    def forward(self, x, *, rope=None, kv_cache=None, pos=0, window=None, ve=None):
        """x (B, T, C) -> (B, T, C); kv_cache: this layer's LinearState (prefill or one decode step)."""
        B, T, C = x.shape
        (qn, qd), (kn, kd), v = self.features(x, rope, ve)  # numerator (rotated) and denominator features
        g = self.n_head // self.n_kv_head
        acc = torch.promote_types(x.dtype, torch.float32)
        qn, qd = (t.view(B, self.n_kv_head, g, T, -1).to(acc) for t in (qn, qd))  # query heads by kv head
        kn, kd, v = kn.to(acc), kd.to(acc), v.to(acc)
        z = torch.cumsum(kd, dim=2)  # (B, n_kv, T, hs): z_i, a prefix sum
        S0 = None
        if kv_cache is not None:  # start from the state before this input (prefill or decode)
            S0, z = kv_cache.S, z + kv_cache.z.unsqueeze(2)
        num, S = self.chunked_numerator(qn, kn, v, S0)  # φ(q_i)ᵀ S_i (B, n_kv, g, T, hs) and S_T
        den = torch.einsum("bkgtd,bktd->bkgt", qd, z)  # φ(q_i)ᵀ z_i > 0
        if kv_cache is not None:  # the recurrent form's state, for the next step
            kv_cache.S.copy_(S)
            kv_cache.z.copy_(z[:, :, -1])
        y = (num / den.unsqueeze(-1)).to(x.dtype).reshape(B, self.n_head, T, -1)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))

    def chunked_numerator(self, q, k, v, S0=None):
        """φ(q_i)ᵀ S_i for every i, S_i = S0 + Σ_{j≤i} φ(k_j) v_jᵀ, chunk by chunk: q (B, n_kv, g, T, hs),
        k and v (B, n_kv, T, hs). Returns it (B, n_kv, g, T, hs) and S_T (B, n_kv, hs, hs)."""
        B, K, g, T, hs = q.shape
        L = min(T, self.chunk)
        n = -(-T // L)  # chunks; the last is padded with zero keys and values, which add nothing
        pad = n * L - T
        if pad:
            q, k, v = F.pad(q, (0, 0, 0, pad)), F.pad(k, (0, 0, 0, pad)), F.pad(v, (0, 0, 0, pad))
        q, k, v = q.view(B, K, g, n, L, hs), k.view(B, K, n, L, hs), v.view(B, K, n, L, -1)
        S_chunk = k.transpose(-1, -2) @ v  # (B, K, n, hs, hs): each chunk's Σ φ(k_j) v_jᵀ
        S_end = torch.cumsum(S_chunk, dim=2)  # the state after each chunk
        if S0 is not None:
            S_end = S_end + S0.unsqueeze(2)
        first = S0.unsqueeze(2) if S0 is not None else torch.zeros_like(S_chunk[:, :, :1])
        S_before = torch.cat([first, S_end[:, :, :-1]], dim=2)  # the state each chunk starts from
        scores = (q @ k.unsqueeze(2).transpose(-1, -2)).tril()  # (B, K, g, n, L, L): φ(q_i)·φ(k_j), j ≤ i
        num = q @ S_before.unsqueeze(2) + scores @ v.unsqueeze(2)
        return num.view(B, K, g, n * L, -1)[:, :, :, :T], S_end[:, :, -1]


# ----------------------------------------------------------------------------- multi-head latent attention

class LatentCache(KVCache):
    """What an MLA layer caches per token: its latent c (d_c) and its decoupled RoPE key (d_r), side by
    side in one ring buffer (B, 1, length, d_c + d_r): no per-head keys or values at all."""

    def __init__(self, batch_size, width, length, device=None, dtype=torch.float32, absorbed=True):
        self.k = torch.zeros(batch_size, 1, length, width, device=device, dtype=dtype)
        self.v = self.k[..., :0]  # nothing else is kept: update returns the latents twice, as k and v
        self.length = length
        self.absorbed = absorbed  # decode by folding the up-projections into q and the output

    def update(self, pos, ckr, _unused=None):
        return super().update(pos, ckr, ckr[..., :0])[0]

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size()


class LatentAttention(CausalSelfAttention):
    """Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434): keys and values are up-projected
    from one small latent per token, c = norm(x W_dkv) (d_c = kv_lora_rank), and only c is cached:
    k_h = W_uk,h c, v_h = W_uv,h c. RoPE cannot pass through W_uk (the rotation depends on the position,
    the product would not), so position rides on a decoupled part: a small RoPE key shared by every
    head, k_R = rope(x W_kr) (d_r = rope_head_dim), and a RoPE part of each query, q_R,h. A head's
    logit is scale · (q_C,h·k_C,h + q_R,h·k_R), scale = 1/√(hs + d_r) by default. Queries come from x,
    or from their own latent (q_lora_rank) as in DeepSeek-V2.

    Decoding has two forms that compute the same thing: naive (up-project every cached latent into
    keys and values, then attend) and absorbed (fold W_uk into the query, q̃_h = W_uk,hᵀ q_C,h, and
    attend over the latents themselves, all heads sharing them like one key/value head; then W_uv,h
    turns each head's weighted latent into its output): the cache is read, never expanded."""

    def make_projections(self, config):
        a, d, nh, hs = config.attn, config.n_embd, config.n_head, config.head_dim
        self.d_c = a.kv_lora_rank or 4 * hs
        self.d_r = (a.rope_head_dim or hs // 2) if config.pos == "rope" else 0  # no RoPE: no decoupled part
        if a.q_lora_rank:  # queries from their own latent (DeepSeek-V2 does this to save activation memory)
            self.q_down = nn.Linear(d, a.q_lora_rank, bias=config.bias)
            self.q_norm = nn.RMSNorm(a.q_lora_rank, eps=1e-6)
            self.q_up = nn.Linear(a.q_lora_rank, nh * (hs + self.d_r), bias=config.bias)
        else:
            self.q_up = nn.Linear(d, nh * (hs + self.d_r), bias=config.bias)  # [q_C | q_R] per head
        self.kv_down = nn.Linear(d, self.d_c + self.d_r, bias=config.bias)  # [c | k_R]: all that is cached
        self.kv_norm = nn.RMSNorm(self.d_c, eps=1e-6)
        self.k_up = nn.Linear(self.d_c, nh * hs, bias=False)
        self.v_up = nn.Linear(self.d_c, nh * hs, bias=False)
        self.c_proj = nn.Linear(nh * hs, d, bias=config.bias)
        self.q_gain = self.k_gain = None
        self.norm_kind = None
        self.scale = resolve_scale(a.scale, hs + self.d_r)

    def queries(self, x, rope):
        """(q_C (B, nh, T, hs), q_R (B, nh, T, d_r), rotated) of x (B, T, C)."""
        B, T, _ = x.shape
        h = self.q_norm(self.q_down(x)) if hasattr(self, "q_down") else x
        q = self.q_up(h).view(B, T, self.n_head, self.head_dim + self.d_r)
        qc, qr = q.split((self.head_dim, self.d_r), dim=-1)
        if rope is not None and self.d_r:
            qr = rotate(qr, rope)
        return qc.transpose(1, 2), qr.transpose(1, 2)

    def latents(self, x, rope):
        """What the cache holds for x (B, T, C): [norm(c) | rope(k_R)] (B, 1, T, d_c + d_r)."""
        c, kr = self.kv_down(x).split((self.d_c, self.d_r), dim=-1)
        if rope is not None and self.d_r:
            kr = rotate(kr.unsqueeze(2), rope).squeeze(2)
        return torch.cat([self.kv_norm(c), kr], dim=-1).unsqueeze(1)

    def expand(self, ckr):
        """Keys (B, nh, n, hs + d_r) and values (B, nh, n, hs) up-projected from latents (B, 1, n, d_c + d_r)."""
        B, _, n, _ = ckr.shape
        c, kr = ckr[:, 0].split((self.d_c, self.d_r), dim=-1)
        k = self.k_up(c).view(B, n, self.n_head, self.head_dim)
        k = torch.cat([k, kr.unsqueeze(2).expand(B, n, self.n_head, self.d_r)], dim=-1)
        v = self.v_up(c).view(B, n, self.n_head, self.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)

    def new_cache(self, batch_size: int, length: int, device, dtype, static: bool = False, sinks: int = 0,
                  absorbed: bool = True, **_):
        """The layer's latent cache: latent + RoPE key per token, `length` positions (or its window's)."""
        if static or sinks or dtype == torch.int8:
            raise UserError("MLA's latent cache supports neither a compiled decode step, sink tokens nor int8: "
                            "use compile=false, no kv_sinks and kv_dtype=auto")
        length = length if self.window is None else min(length, self.window)
        return LatentCache(batch_size, self.d_c + self.d_r, length, device, dtype, absorbed)

    def forward(self, x, *, rope=None, kv_cache=None, pos=0, window=None, ve=None):
        B, T, C = x.shape
        if self.window is not None:
            window = self.window if window is None else min(window, self.window)
        qc, qr = self.queries(x, rope)
        ckr = self.latents(x, rope)
        if kv_cache is not None:
            ckr = kv_cache.update(pos, ckr)  # (B, 1, n, d_c + d_r)
            if T == 1:  # a decode step: the cache holds just the keys its window allows
                window = None
        drop = self.dropout if self.training else 0.0
        if kv_cache is not None and kv_cache.absorbed:
            # absorbed: q̃_h = W_uk,hᵀ q_C,h against the latents, shared by every head (one kv head)
            w_uk = self.k_up.weight.view(self.n_head, self.head_dim, self.d_c)  # k_C,h = W_uk,h c
            q = torch.cat([torch.einsum("bhtd,hdc->bhtc", qc, w_uk), qr], dim=-1)  # (B, nh, T, d_c + d_r)
            q, k = self.hook_q(q), self.hook_k(ckr.to(q.dtype))
            lat = self.attend(q, k, ckr[..., :self.d_c].to(q.dtype), self.scale, True, drop, window, None,
                              self.sink_logit, self.alibi(pos, T, kv_cache, ckr.size(2)))  # (B, nh, T, d_c): each head's weighted latent
            w_uv = self.v_up.weight.view(self.n_head, self.head_dim, self.d_c)
            y = torch.einsum("bhtc,hdc->bhtd", lat, w_uv)  # v_h = W_uv,h c, summed after the weights
        else:  # naive: keys and values up-projected from the latents, then ordinary attention
            k, v = self.expand(ckr.to(qc.dtype))
            q, k = self.hook_q(torch.cat([qc, qr], dim=-1)), self.hook_k(k)
            y = self.attend(q, k, v, self.scale, True, drop, window, None, self.sink_logit,
                            self.alibi(pos, T, kv_cache, k.size(2)))
        return self.project(x, y.to(x.dtype))


ATTENTION_KINDS = {"softmax": CausalSelfAttention, "linear": LinearAttention, "mla": LatentAttention}
