"""Causal self-attention, read top-down: the scale, the mask, one attention function (a fast path
and a plain-math reference path), RoPE, QK-Norm, KV caches, and the attention module that puts them
together.

    softmax(q·kᵀ·scale + M) · v

- scale: `model.attn.scale`, passed explicitly to the kernel: 1/√d_k by default (Vaswani et al.
  2017), `none` (1.0) or `dk` (1/d_k, muP), or any positive number, to ablate it.
- M: 0 where a key is visible, -inf elsewhere: causal (a query sees itself and earlier keys), and
  optionally within a window of the latest keys.
- Two paths, one function: `sdpa` (F.scaled_dot_product_attention: flash / memory-efficient kernels
  on a GPU) and `reference` (explicit scores, mask, softmax, weights @ V). Tests hold them equal, and
  the attention statistics are computed from the reference scores.
- RoPE (Su et al. 2021, arXiv 2104.09864) rotates q and k, never v: q·k then depends only on the
  offset between two positions, which is also what lets a KV cache slide past block_size.
- QK-Norm (Henry et al. 2020, arXiv 2010.04245; Dehghani et al. 2023, arXiv 2302.05442): q and k
  are normalised per head *before* RoPE, so the norm (and its optional gain) sees the raw projection
  and RoPE, a rotation, keeps the norm. logit = scale · <rope(norm(q)), rope(norm(k))>, so
  |logit| <= scale · |q̂| · |k̂|.
- Grouped-query / multi-query attention (`n_kv_head`, Ainslie et al. 2023, arXiv 2305.13245; Shazeer
  2019, arXiv 1911.02150): consecutive query heads share one key/value head.

Every option is chosen once, in CausalSelfAttention.__init__ (which function normalises, which path
attends); what forward still branches on is the call itself: a cache, a window, grouped heads.
"""
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import OneOf, Rule

QK_NORM_TYPES = ("rms", "layer", "l2")
QK_NORM_GAINS = ("none", "head", "channel")
IMPLS = ("sdpa", "reference")
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
    impl: str = "sdpa"  # sdpa (fast path) | reference (plain math, for checking and statistics)

    RULES: ClassVar[dict] = {
        "scale": Rule(lambda v: str(v) in NAMED_SCALES or positive_number(v), "sqrt_dk, none, dk or a positive number"),
        "qk_norm_type": OneOf(QK_NORM_TYPES),
        "qk_norm_gain": OneOf(QK_NORM_GAINS),
        "impl": OneOf(IMPLS),
    }


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


ATTENTION_PATHS = {"sdpa": sdpa_attention, "reference": reference_attention}


def attention(q, k, v, scale: float, *, causal: bool = True, impl: str = "sdpa", dropout_p: float = 0.0,
              window=None, key_mask=None):
    """softmax(q·kᵀ·scale + M)·v for q (B, nh, Tq, hs) and k, v (B, n_kv, Tk, hs) -> (B, nh, Tq, hs).

    M is 0 where a key is visible (causal, and within `window` if given), -inf elsewhere. With
    n_kv < nh (grouped-query attention) each kv head serves nh / n_kv consecutive query heads.
    key_mask (1, 1, 1, Tk) bool, for a single query: which cache slots hold a key (a static cache)."""
    return ATTENTION_PATHS[impl](q, k, v, scale, causal, dropout_p, window, key_mask)


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
        and a key mask (None: every returned slot holds a key)."""
        T = k.size(2)
        if T > 1 and pos != 0:
            raise ValueError("a KV cache takes a multi-token chunk only as the first (prefill) step")
        if T > self.length:
            raise ValueError(f"prefill of {T} tokens does not fit a cache of {self.length}")
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

    def forward(self, x, *, rope=None, kv_cache=None, pos=0, window=None, ve=None):
        """x (B, T, C) at positions pos..pos+T-1 -> (B, T, C). kv_cache: this layer's cache (k, v
        are added to it and attention reads all it holds); window: each query sees only the latest
        `window` keys; ve: the value embedding added to v."""
        B, T, C = x.shape
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
