"""Causal self-attention, read top-down: the scale, the mask, one attention function (a fast path,
a plain-math reference path and FlashAttention's tiled algorithm), RoPE, QK-Norm, KV caches, and the
attention kinds that put them together: softmax attention, and linear attention.

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
KINDS = ("softmax", "linear")
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
    kind: str = "softmax"  # softmax | linear (phi(q).phi(k) with phi = elu + 1: linear in N, an RNN's state when decoding)

    RULES: ClassVar[dict] = {
        "scale": Rule(lambda v: str(v) in NAMED_SCALES or positive_number(v), "sqrt_dk, none, dk or a positive number"),
        "qk_norm_type": OneOf(QK_NORM_TYPES),
        "qk_norm_gain": OneOf(QK_NORM_GAINS),
        "impl": OneOf(IMPLS),
        "block": Range(1, 65536),
        "window": Range(1, why="keys a query sees, itself included"),
        "window_pattern": Rule(lambda v: bool(v) and set(str(v)) <= {"L", "G"}, "a string of L (local) and G (global)"),
        "kind": OneOf(KINDS),
    }
    # each option must change what the model computes
    SOFTMAX: ClassVar[Needs] = Needs(lambda a: a.kind == "softmax", "{p}kind=softmax (linear attention has no "
                                     "softmax, no logits, no N x N table)")
    QK_NORM: ClassVar[Needs] = Needs(lambda a: a.qk_norm, "{p}qk_norm=true")
    NEEDS: ClassVar[dict] = {
        "impl": SOFTMAX, "scale": SOFTMAX, "window": SOFTMAX, "qk_norm_type": QK_NORM, "qk_norm_gain": QK_NORM,
        "block": Needs(lambda a: a.impl == "tiled", "{p}impl=tiled"),
        "window_pattern": Needs(lambda a: a.window is not None, "{p}window=W"),
    }


def check_attention_options(attn: AttnConfig, dropout: float):
    """The attention options that only fail with a model option."""
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


def sdpa_attention(q, k, v, scale, causal=True, dropout_p=0.0, window=None, key_mask=None):
    """The fast path: PyTorch's fused kernel (flash or memory-efficient on a GPU), K/V shared by
    query groups without a copy (enable_gqa)."""
    Tq, Tk = q.size(-2), k.size(-2)
    kw = dict(dropout_p=dropout_p, scale=scale, enable_gqa=k.size(1) != q.size(1))
    if causal and Tq == Tk and (window is None or window >= Tk):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    if causal and (Tq > 1 or (window is not None and window < Tk)):  # SDPA's is_causal aligns top-left
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible(Tq, Tk, window, q.device), **kw)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, **kw)


def reference_attention(q, k, v, scale, causal=True, dropout_p=0.0, window=None, key_mask=None):
    """The same function written out: K/V expanded to one head per query head, explicit scores,
    -inf mask, softmax (in at least fp32), weights @ V."""
    k, v = repeat_kv(k, q.size(1)), repeat_kv(v, q.size(1))
    scores = attention_scores(q, k, scale, causal, window)  # (B, nh, Tq, Tk)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, float("-inf"))
    weights = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).type_as(q)
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
    def forward(ctx, q, k, v, scale, causal, window, key_mask, block):
        B, nh, Tq, hs = q.shape
        n_kv, Tk = k.size(1), k.size(2)
        acc = torch.promote_types(q.dtype, torch.float32)
        qg = q.view(B, n_kv, nh // n_kv, Tq, hs).to(acc)  # (B, n_kv, g, Tq, hs): query heads by kv head
        kg, vg = k.unsqueeze(2).to(acc), v.unsqueeze(2).to(acc)  # (B, n_kv, 1, Tk, hs)
        out = torch.zeros_like(qg)
        lse = torch.full(qg.shape[:-1], float("-inf"), dtype=acc, device=q.device)  # (B, n_kv, g, Tq)
        offset = Tk - Tq  # the queries are the last Tq positions
        for q0 in range(0, Tq, block):
            q1 = min(q0 + block, Tq)
            m = torch.full((*qg.shape[:3], q1 - q0), float("-inf"), dtype=acc, device=q.device)
            l, o = torch.zeros_like(m), torch.zeros_like(qg[..., q0:q1, :])
            for k0, k1 in key_blocks(q0, q1, Tk, offset, block, causal, window):
                s = qg[..., q0:q1, :] @ kg[..., k0:k1, :].transpose(-2, -1) * scale  # (B, n_kv, g, bq, bk)
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
        ctx.save_for_backward(q, k, v, out, lse, key_mask)
        ctx.args = (scale, causal, window, block)
        return out.view(B, nh, Tq, hs).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, key_mask = ctx.saved_tensors
        scale, causal, window, block = ctx.args
        B, nh, Tq, hs = q.shape
        n_kv, Tk = k.size(1), k.size(2)
        acc = out.dtype
        qg, kg, vg = q.view(B, n_kv, nh // n_kv, Tq, hs).to(acc), k.unsqueeze(2).to(acc), v.unsqueeze(2).to(acc)
        do = dout.reshape(qg.shape).to(acc)
        D = (do * out).sum(-1)  # (B, n_kv, g, Tq)
        dq, dk, dv = torch.zeros_like(qg), torch.zeros_like(kg), torch.zeros_like(vg)
        offset = Tk - Tq
        for q0 in range(0, Tq, block):
            q1 = min(q0 + block, Tq)
            for k0, k1 in key_blocks(q0, q1, Tk, offset, block, causal, window):
                s = qg[..., q0:q1, :] @ kg[..., k0:k1, :].transpose(-2, -1) * scale
                mask = tile_mask(q0, q1, k0, k1, offset, causal, window, key_mask, q.device)
                if mask is not None:
                    s = s.masked_fill(~mask, float("-inf"))
                p = torch.exp(s - lse[..., q0:q1].unsqueeze(-1))  # this block's softmax weights, rebuilt
                dv[..., k0:k1, :] += (p.transpose(-2, -1) @ do[..., q0:q1, :]).sum(2, keepdim=True)
                dp = do[..., q0:q1, :] @ vg[..., k0:k1, :].transpose(-2, -1)
                ds = p * (dp - D[..., q0:q1].unsqueeze(-1))
                dq[..., q0:q1, :] += ds @ kg[..., k0:k1, :] * scale
                dk[..., k0:k1, :] += (ds.transpose(-2, -1) @ qg[..., q0:q1, :]).sum(2, keepdim=True) * scale
        return (dq.view(q.shape).to(q.dtype), dk.squeeze(2).to(k.dtype), dv.squeeze(2).to(v.dtype),
                None, None, None, None, None)


def tiled_attention(q, k, v, scale, causal=True, dropout_p=0.0, window=None, key_mask=None, block=128):
    """FlashAttention's algorithm in plain PyTorch (TiledAttention); no attention dropout."""
    if dropout_p > 0:
        raise ValueError("the tiled path does not drop attention weights")
    return TiledAttention.apply(q, k, v, scale, causal, window, key_mask, block)


ATTENTION_PATHS = {"sdpa": sdpa_attention, "reference": reference_attention, "tiled": tiled_attention}


def attention(q, k, v, scale: float, *, causal: bool = True, impl: str = "sdpa", dropout_p: float = 0.0,
              window=None, key_mask=None, block: int = 128):
    """softmax(q·kᵀ·scale + M)·v for q (B, nh, Tq, hs) and k, v (B, n_kv, Tk, hs) -> (B, nh, Tq, hs).

    M is 0 where a key is visible (causal, and within `window` if given), -inf elsewhere. With
    n_kv < nh (grouped-query attention) each kv head serves nh / n_kv consecutive query heads.
    key_mask (1, 1, 1, Tk) bool, for a single query: which cache slots hold a key (a static cache)."""
    kw = {"block": block} if impl == "tiled" else {}
    return ATTENTION_PATHS[impl](q, k, v, scale, causal, dropout_p, window, key_mask, **kw)


# ----------------------------------------------------------------------------- RoPE and QK-Norm

def rope_freqs(head_dim: int, length: int, base: float, device=None):
    """cos and sin of position * theta_j for positions 0..length-1: (length, head_dim // 2, 2)."""
    theta = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), theta)  # (L, hs/2)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


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

    def __init__(self, batch_size, n_kv_head, length, head_dim, device=None, dtype=torch.float32):
        self.k = torch.zeros(batch_size, n_kv_head, length, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros_like(self.k)
        self.length = length

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
        # q (n_head heads), k and v (n_kv_head heads each) in one matmul, laid out [Q | K | V]
        self.c_attn = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_kv_head) * config.head_dim,
                                bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        # QK-Norm gains broadcast over (B, T, 2 (q|k), nh, hs): a scalar or a vector per head
        gain = config.attn.qk_norm_gain if config.attn.qk_norm else "none"
        per = {"none": None, "head": 1, "channel": config.head_dim}[gain]  # one gain per head, or per channel
        self.q_gain = nn.Parameter(torch.ones(config.n_head, per)) if per else None
        self.k_gain = nn.Parameter(torch.ones(config.n_kv_head, per)) if per else None
        self.norm_kind = config.attn.qk_norm_type if config.attn.qk_norm else None
        self.attend = ATTENTION_PATHS[config.attn.impl]
        if config.attn.impl == "tiled":
            self.attend = partial(tiled_attention, block=config.attn.block)
        pattern = config.attn.window_pattern
        local = config.attn.window is not None and pattern[layer % len(pattern)] == "L"
        self.window = config.attn.window if local else None  # this layer's own window (None: global)
        self.hook_q, self.hook_k = HookPoint(), HookPoint()

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

    def new_cache(self, batch_size: int, length: int, device, dtype, static: bool = False):
        """This layer's KV cache for generation: `length` positions, or its window's if shorter."""
        length = length if self.window is None else min(length, self.window)
        return (StaticKVCache if static else KVCache)(batch_size, self.n_kv_head, length, self.head_dim, device, dtype)

    def forward(self, x, *, rope=None, kv_cache=None, pos=0, window=None, ve=None):
        """x (B, T, C) at positions pos..pos+T-1 -> (B, T, C). kv_cache: this layer's cache (k, v
        are added to it and attention reads all it holds); window: each query sees only the latest
        `window` keys (with the layer's own window, the narrower); ve: the value embedding added to v."""
        B, T, C = x.shape
        if self.window is not None:
            window = self.window if window is None else min(window, self.window)
        q, k, v = self.qkv(x, rope, ve)
        q, k = self.hook_q(q), self.hook_k(k)  # what the attention probe reads
        key_mask = None
        if kv_cache is not None:
            k, v, key_mask = kv_cache.update(pos, k, v)  # (B, n_kv, n_cached, hs)
        # a cache may hold another dtype (sample.kv_dtype): q joins it, the output returns to q's
        y = self.attend(q.to(k.dtype), k, v, self.scale, True, self.dropout if self.training else 0.0, window,
                        key_mask).to(q.dtype)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads side by side
        return self.resid_dropout(self.c_proj(y))


# ----------------------------------------------------------------------------- linear attention

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

    and the N x N product re-associates: training computes every S_i at once as prefix sums (the
    parallel form, O(N·hs²) per head), generation carries S and z as a constant-size state (the
    recurrent form). With RoPE, φ(q) and φ(k) are rotated in the numerator only, as the RoPE paper
    does for linear attention (Su et al. 2021, §3.4.4): the denominator keeps every weight's sum.
    QK-Norm applies before φ. No softmax: no scale, no logits, no windows, no N x N table."""

    softmax = False  # the attention probe reads softmax attention only

    def features(self, x, rope, ve):
        """q, k, v as linear attention uses them: (φ rotated, φ) for q and k, v as is."""
        q, k, v = self.qkv(x, None, ve)  # normed (QK-Norm), not rotated: φ comes first
        fq, fk = elu_feature(q), elu_feature(k)  # (B, heads, T, hs)
        if rope is None:
            return (fq, fq), (fk, fk), v
        rot = lambda t: rotate(t.transpose(1, 2), rope).transpose(1, 2)  # noqa: E731  rope wants (B, T, h, hs)
        return (rot(fq), fq), (rot(fk), fk), v

    def new_cache(self, batch_size: int, length: int, device, dtype, static: bool = False):
        """The layer's recurrent state: its size does not depend on `length`."""
        return LinearState(batch_size, self.n_kv_head, self.head_dim, device, torch.promote_types(dtype, torch.float32))

    def forward(self, x, *, rope=None, kv_cache=None, pos=0, window=None, ve=None):
        """x (B, T, C) -> (B, T, C); kv_cache: this layer's LinearState (prefill or one decode step)."""
        B, T, C = x.shape
        (qn, qd), (kn, kd), v = self.features(x, rope, ve)  # numerator (rotated) and denominator features
        g = self.n_head // self.n_kv_head
        acc = torch.promote_types(x.dtype, torch.float32)
        qn, qd = (t.view(B, self.n_kv_head, g, T, -1).to(acc) for t in (qn, qd))  # query heads by kv head
        kn, kd, v = kn.to(acc), kd.to(acc), v.to(acc)
        # the parallel form: prefix sums over positions of φ(k_j) v_jᵀ and φ(k_j)
        S = torch.cumsum(kn.unsqueeze(-1) * v.unsqueeze(-2), dim=2)  # (B, n_kv, T, hs, hs)
        z = torch.cumsum(kd, dim=2)  # (B, n_kv, T, hs)
        if kv_cache is not None:  # prefill from an empty state, or one step on top of it (recurrent form)
            S, z = S + kv_cache.S.unsqueeze(2), z + kv_cache.z.unsqueeze(2)
            kv_cache.S.copy_(S[:, :, -1])
            kv_cache.z.copy_(z[:, :, -1])
        num = torch.einsum("bkgtd,bktde->bkgte", qn, S)  # φ(q_i)ᵀ S_i
        den = torch.einsum("bkgtd,bktd->bkgt", qd, z)  # φ(q_i)ᵀ z_i > 0
        y = (num / den.unsqueeze(-1)).to(x.dtype).reshape(B, self.n_head, T, -1)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


ATTENTION_KINDS = {"softmax": CausalSelfAttention, "linear": LinearAttention}
