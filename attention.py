"""Causal self-attention, the default path, read top-down: the scale, the mask, the attention
function (a fast path and a plain-math reference path), RoPE, QK-Norm, the KV cache, hook points,
and the module that puts them together.

    softmax(q·kᵀ·scale + M) · v

- scale: `model.attn.scale`, passed explicitly to the kernel: 1/√d_k by default (Vaswani et al.
  2017), `none` (1.0) or `dk` (1/d_k, muP), or any positive number, to ablate it.
- M: 0 where a key is visible, -inf elsewhere: causal (a query sees itself and earlier keys), and
  optionally within a window of the latest W keys (Longformer, Mistral; `model.attn.window`).
- Two paths, one signature: `sdpa` (F.scaled_dot_product_attention: flash or memory-efficient
  kernels on a GPU) and `reference` (explicit scores, mask, softmax, weights @ V). Tests hold them
  equal; the attention probe and the viewer use the reference weights (CausalSelfAttention.scores).
- RoPE (Su et al. 2021, arXiv 2104.09864) rotates q and k, never v: q·k then depends only on the
  offset between two positions, which is also what lets a KV cache slide past block_size.
- QK-Norm (Henry et al. 2020, arXiv 2010.04245; Dehghani et al. 2023, arXiv 2302.05442): q and k
  are normalised per head *before* RoPE, so the norm (and its optional gain) sees the raw projection
  and RoPE, a rotation, keeps the norm: |logit| <= scale · |q̂| · |k̂|.
- Soft-capping (Gemma 2, arXiv 2408.00118; `model.attn.softcap`): c·tanh(s/c) on the scaled scores
  before the mask bounds every logit by c; no fused kernel takes it, so such a layer attends by the
  reference path.
- Grouped-query / multi-query attention (`n_kv_head`, Ainslie et al. 2023, arXiv 2305.13245; Shazeer
  2019, arXiv 1911.02150): consecutive query heads share one key/value head.

Everything else is a small file in variants/ (its __init__ holds the table that picks them): other
kinds subclass CausalSelfAttention and override named methods; other paths, a logit bias (ALiBi), a
sink logit and an output gate fill the module's slots, once, at construction.
"""
import math
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


def resolve_scale(scale, head_dim: int) -> float:
    """The attention logit multiplier named by `model.attn.scale` (a legal value, see AttnConfig)."""
    named = {"sqrt_dk": 1.0 / math.sqrt(head_dim), "none": 1.0, "dk": 1.0 / head_dim}
    return named[str(scale)] if str(scale) in named else float(scale)


# ----------------------------------------------------------------------------- the mask

@dataclass
class Mask:
    """Which keys each query may see. The Tq queries are the last Tq of the Tk key positions (training
    and a prefill: Tq = Tk; a decode step: one query after every cached key), so query i sees key j
    when j <= i + Tk - Tq, and with a window W when also j > i + Tk - Tq - W. `written` (Tk,) bool:
    the slots a fixed-shape cache has filled (StaticKVCache)."""
    Tq: int
    Tk: int
    window: Optional[int] = None
    written: Optional[torch.Tensor] = None

    @property
    def causal(self) -> bool:
        """The plain causal table: what SDPA's is_causal computes without a mask tensor."""
        return self.Tq == self.Tk and self.written is None and (self.window is None or self.window >= self.Tk)

    @property
    def sees_all(self) -> bool:
        """One query that sees every key: a decode step over a cache that holds just what it may see."""
        return self.Tq == 1 and self.written is None and (self.window is None or self.window >= self.Tk)

    def __call__(self, device=None, q0: int = 0, q1=None, k0: int = 0, k1=None):
        """(q1 - q0, k1 - k0) bool: which of the keys k0..k1-1 the queries q0..q1-1 see."""
        q1, k1 = self.Tq if q1 is None else q1, self.Tk if k1 is None else k1
        if self.Tq == 1 and self.window is None and self.written is not None:  # a compiled decode step
            return self.written[None, k0:k1]
        i = torch.arange(q0, q1, device=device)[:, None] + (self.Tk - self.Tq)
        j = torch.arange(k0, k1, device=device)[None, :]
        visible = j <= i
        if self.window is not None:
            visible &= j > i - self.window
        if self.written is not None:
            visible &= self.written[None, k0:k1]
        return visible


# ----------------------------------------------------------------------------- the attention function

def repeat_kv(x, n_head: int):
    """K or V of n_kv heads (B, n_kv, T, hs) -> (B, n_head, T, hs): query head h reads kv head
    h // (n_head / n_kv), i.e. consecutive query heads share one kv head."""
    return x if x.size(1) == n_head else x.repeat_interleave(n_head // x.size(1), dim=1)


def attention_scores(q, k, *, scale: float, mask: Optional[Mask] = None, bias=None, softcap=None):
    """The logits softmax takes, q·kᵀ·scale (soft-capped) (+ bias), -inf where the mask hides a key:
    (B, nh, Tq, hs) and (B, nh, Tk, hs) -> (B, nh, Tq, Tk). softcap c: c·tanh(s/c) on the scaled scores,
    so |logit| < c whatever q and k (Gemma 2, arXiv 2408.00118; `model.attn.softcap`). bias: a logit
    bias (variants/alibi.py), bias(rows, cols) -> (nh, Tq, Tk)."""
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, nh, Tq, Tk)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias(slice(None), slice(None)).to(scores.dtype)
    if mask is not None:
        scores = scores.masked_fill(~mask(q.device), float("-inf"))
    return scores


def softmax_with_sink(scores, sink=None):
    """softmax over the last dim (in at least fp32); with a sink (nh,), one more logit per head whose
    share goes to nothing (Xiao et al. 2023; Miller 2023's "off by one"; gpt-oss): returns the keys'
    weights (rows then sum to 1 minus the sink's share)."""
    if sink is not None:
        scores = torch.cat([sink.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1), scores], dim=-1)
    weights = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    return weights if sink is None else weights[..., 1:]


def attention_weights(q, k, *, scale: float, mask=None, bias=None, sink=None, softcap=None):
    """softmax(q·kᵀ·scale + bias + M) with K expanded to one head per query head and the sink's logit
    as one more choice: (B, nh, Tq, Tk) in q's dtype."""
    k = repeat_kv(k, q.size(1))
    return softmax_with_sink(attention_scores(q, k, scale=scale, mask=mask, bias=bias, softcap=softcap),
                             sink).type_as(q)


def reference_attention(q, k, v, *, scale: float, mask=None, bias=None, sink=None, dropout_p: float = 0.0,
                        softcap=None):
    """The attention function written out: explicit weights (attention_weights), weights @ V; the one
    path that takes a soft-cap (the fused kernels have no place for it)."""
    weights = attention_weights(q, k, scale=scale, mask=mask, bias=bias, sink=sink, softcap=softcap)
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ repeat_kv(v, q.size(1))


def with_sink(q, k, v, sink, scale: float, mask):
    """q, k, v and an additive mask extended by a sink for a fused kernel: one more key, first, that
    every query sees, with value zero and logit `sink` (one per query head, whatever the query). The
    logit rides on one more channel: q gets sink/scale, the sink key 1, every other key 0."""
    B, nh, Tq, hs = q.shape
    n_kv, Tk = k.size(1), k.size(2)
    q = torch.cat([q, (sink / scale).to(q.dtype).view(1, nh, 1, 1).expand(B, nh, Tq, 1)], dim=-1)
    k = torch.cat([k.new_zeros(B, n_kv, 1, hs + 1), torch.cat([k, k.new_zeros(B, n_kv, Tk, 1)], dim=-1)], dim=2)
    k[:, :, 0, -1] = 1.0
    v = torch.cat([v.new_zeros(B, n_kv, 1, v.size(-1)), v], dim=2)
    return q, k, v, torch.cat([mask.new_zeros(*mask.shape[:-1], 1), mask], dim=-1)


def sdpa_attention(q, k, v, *, scale: float, mask=None, bias=None, sink=None, dropout_p: float = 0.0):
    """The fast path: PyTorch's fused kernel (flash or memory-efficient on a GPU), K/V shared by
    query groups without a copy (enable_gqa). A bias or a sink goes in as an additive float mask."""
    kw = dict(scale=scale, dropout_p=dropout_p, enable_gqa=k.size(1) != q.size(1))
    if bias is None and sink is None:  # the kernels' own masks
        if mask is None or mask.sees_all:
            return F.scaled_dot_product_attention(q, k, v, **kw)
        if mask.causal:  # aligned top-left: only for Tq == Tk
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask(q.device), **kw)
    Tq, Tk = q.size(-2), k.size(-2)
    logits = bias(slice(None), slice(None)).to(q.dtype) if bias is not None else q.new_zeros(1, Tq, Tk)
    if mask is not None:
        logits = logits.masked_fill(~mask(q.device), float("-inf"))
    if sink is not None:
        q, k, v, logits = with_sink(q, k, v, sink, scale, logits)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=logits, **kw)


# ----------------------------------------------------------------------------- RoPE and QK-Norm

def rope_theta(head_dim: int, base: float, device=None):
    """RoPE's angular frequencies theta_j = base^(-2j/d), j = 0..d/2-1 (variants/rope_scaling.py
    stretches them for contexts longer than trained)."""
    return 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


def rope_freqs(head_dim: int, length: int, base: float, device=None, theta=None, mscale: float = 1.0):
    """cos and sin of position * theta_j for positions 0..length-1: (length, head_dim // 2, 2), both
    times mscale (a scaling's attention temperature; 1 unscaled)."""
    theta = rope_theta(head_dim, base, device) if theta is None else theta
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), theta)  # (L, hs/2)
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


def qk_normalize(x, kind: str, eps: float = 1e-6):
    """Parameter-free per-head norm of x (..., hs). rms and layer give |x| = sqrt(hs); l2 gives 1."""
    if kind == "l2":
        return F.normalize(x, dim=-1, eps=eps)
    if kind == "layer":
        x = x - x.mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- the KV cache

class KVCache:
    """Per-layer K and V (after RoPE) for generation, preallocated as a ring buffer: with RoPE a
    cached key keeps its absolute position forever, and attention only sees offsets, so once
    `length` tokens are cached the oldest slot is overwritten and the context slides. Its dtype may
    be narrower than the model's: a bf16 cache halves what a decode step reads. v_dim: the values'
    width when it differs from the keys' (MLA caches its RoPE key as k and its latent as v)."""

    def __init__(self, batch_size, n_kv_head, length, head_dim, device=None, dtype=torch.float32, v_dim=None):
        self.k = torch.zeros(batch_size, n_kv_head, length, head_dim, device=device, dtype=dtype)
        self.v = torch.zeros(batch_size, n_kv_head, length, head_dim if v_dim is None else v_dim, device=device,
                             dtype=dtype)
        self.length = length

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def update(self, pos: int, k, v):
        """Store k, v (B, n_kv, T, hs) for positions pos..pos+T-1; return all cached (B, n_kv, n, hs)
        and which slots hold a key (None: all returned). A prefill longer than the cache (a windowed
        layer's holds one window) keeps its latest `length` positions and returns all T for its own,
        windowed, attention."""
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

    def positions(self, q_pos, n: int):
        """(query positions, positions of the n keys update returned), for a position-dependent bias
        (ALiBi): slot s of the ring holds the latest position p <= the newest with p = s mod length."""
        newest = q_pos[-1]
        if n > self.length:  # a prefill longer than the cache attends to all of its own tokens
            return q_pos, torch.arange(n, device=q_pos.device) + newest - n + 1
        return q_pos, newest - (newest - torch.arange(n, device=q_pos.device)) % self.length


class StaticKVCache(KVCache):
    """The same ring buffer with fixed shapes, for a compiled decode step (as gpt-fast does): the
    position is a tensor, each step attends over every slot and a mask hides those not written yet,
    so one graph serves every step and nothing waits for the host. The storage is padded to a
    multiple of ALIGN slots (masked, never written: GPU kernels want aligned key lengths) and marked
    as static addresses, so a CUDA graph can capture the step (torch.compile skips CUDA graphs for
    inputs mutated in place that are not static)."""
    ALIGN = 64

    def __init__(self, batch_size, n_kv_head, length, head_dim, device=None, dtype=torch.float32, v_dim=None):
        padded = -(-length // self.ALIGN) * self.ALIGN
        super().__init__(batch_size, n_kv_head, padded, head_dim, device, dtype, v_dim)
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
        return self.k, self.v, (self.slots <= pos) & (self.slots < self.length)  # 0..pos, all once full; no pad

    def positions(self, q_pos, n: int):
        if n != self.slots.numel():  # the eager prefill
            return super().positions(q_pos, n)
        return q_pos, q_pos[-1] - (q_pos[-1] - self.slots) % self.length  # unwritten and pad: masked anyway


# ----------------------------------------------------------------------------- the attention module

class HookPoint(nn.Module):
    """An identity a forward hook reads a tensor at (TransformerLens' HookPoint and its names): the
    attention probe, the maps and the tools attach here, so no forward carries them."""

    def forward(self, x):
        return x


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused q|k|v projection, QK-Norm and RoPE on q and k, the
    attention path, the output projection. Hook points (TransformerLens' names and layouts): hook_q
    (B, T, nh, hs), hook_k and hook_v (B, T, n_kv, hs), what enters attention (normed, rotated),
    hook_pattern (B, nh, T, T), the softmax's weights, and hook_z (B, T, nh, hs), each head's output
    before the projection. The weights exist only when a hook is on hook_pattern: the layer then
    attends by the written-out path, so the hook can read or replace them (patching).

    Slots, filled once at construction by variants/__init__.py (None: the plain path): `path`, the
    function that attends; `bias`, a logit bias (ALiBi); `sink`, a logit per head for a key of value
    zero; `gate`, an output gate; `select`, a choice of keys by content that narrows the mask (MoBA);
    `softcap`, c·tanh(s/c) on its scaled scores (model.attn.softcap: the layer then attends by the
    written-out path, and the probe reads the capped scores)."""
    softmax = True  # its weights are a softmax of logits: the attention probe reads them
    rotates_heads = True  # with model.pos=rope, RoPE rotates its whole q and k heads (pairs of channels)

    def __init__(self, config, layer: int, *, path=sdpa_attention, bias=None, sink=None, gate=None, select=None):
        super().__init__()
        self.layer = layer  # this block's index, for the attention probe
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.scale = config.attn_scale
        self.dropout = config.dropout
        self.make_projections(config)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.softcap = config.attn.softcap or None
        self.attend = partial(reference_attention, softcap=self.softcap) if self.softcap else path
        pattern = config.attn.window_pattern
        local = config.attn.window is not None and pattern[layer % len(pattern)] == "L"
        self.window = config.attn.window if local else None  # this layer's own window (None: global)
        self.gate = gate(config) if gate else None  # sigmoid(x W_g) on each head's output (variants/gates.py)
        sink = sink(config) if sink else None  # a logit per head: learned (a Parameter) or fixed (variants/sinks.py)
        self.register_parameter("sink_logit", sink) if isinstance(sink, nn.Parameter) else \
            self.register_buffer("sink_logit", sink, persistent=False)
        self.bias = bias(config) if bias else None  # bias(q_pos, k_pos) -> bias(rows, cols) (variants/alibi.py)
        self.select = select(config) if select else None  # (q, k, mask, q_pos, k_pos) -> a narrower mask (variants/moba.py)
        self.hook_q, self.hook_k, self.hook_v, self.hook_z = HookPoint(), HookPoint(), HookPoint(), HookPoint()
        self.hook_pattern = HookPoint()

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
        """q (B, T, nh, hs) and k, v (B, T, n_kv, hs) of x (B, T, C); q and k normed (if enabled), then
        rotated (rope: (T, hs/2, 2), None for the other position schemes); ve (B, T, n_kv hs), the
        token's value embedding, is added to v."""
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
        return q, k, (v if ve is None else v + ve).view(B, T, self.n_kv_head, hs)

    def forward(self, x, *, rope=None, kv_cache=None, pos=0, window=None, ve=None):
        """x (B, T, C) at positions pos..pos+T-1 -> (B, T, C). kv_cache: this layer's cache (k, v are
        added to it and attention reads all it holds); window: each query sees only the latest
        `window` keys (with the layer's own window, the narrower); ve: the value embedding added to v."""
        B, T, C = x.shape
        window = self.window if window is None else min(window, self.window or window)
        q, k, v = self.qkv(x, rope, ve)
        q, k, v = (h(t).transpose(1, 2) for h, t in ((self.hook_q, q), (self.hook_k, k), (self.hook_v, v)))
        mask = Mask(T, T, window)  # (B, heads, T, hs) above: the layout attention takes
        if kv_cache is not None:  # a decode step sees all a cache holds: one window at most
            k, v, written = kv_cache.update(pos, k, v)  # (B, n_kv, n_cached, hs)
            mask = Mask(T, k.size(2), window if T > 1 else None, written)
        bias = None if self.bias is None else self.bias(*self.positions(pos, T, kv_cache, k.size(2)))
        if self.select is not None:  # each query reads only the keys it chooses
            mask = self.select(q, k, mask, *self.positions(pos, T, kv_cache, k.size(2)))
        # a cache may hold another dtype (sample.kv_dtype): q joins it, the output returns to q's
        y = self.path()(q.to(k.dtype), k, v, scale=self.scale, mask=mask, bias=bias, sink=self.sink_logit,
                        dropout_p=self.dropout if self.training else 0.0)
        return self.project(x, y.to(q.dtype).transpose(1, 2))

    def path(self):
        """The function that attends: the layer's own, or the written-out one while a hook is on hook_pattern."""
        return self.through_pattern if self.hook_pattern._forward_hooks else self.attend

    def through_pattern(self, q, k, v, *, scale, mask, bias, sink, dropout_p):
        """The written-out path with its weights (B, nh, Tq, Tk) passed through hook_pattern."""
        weights = self.hook_pattern(attention_weights(q, k, scale=scale, mask=mask, bias=bias, sink=sink,
                                                      softcap=self.softcap))
        return F.dropout(weights, p=dropout_p) @ repeat_kv(v, q.size(1))

    def positions(self, pos, T: int, kv_cache=None, n_keys: Optional[int] = None):
        """(query positions (T,), key positions (n_keys,)) for a position-dependent bias; pos may be a
        tensor (a compiled decode step)."""
        q_pos = pos + torch.arange(T, device=self.c_proj.weight.device)
        return kv_cache.positions(q_pos, n_keys) if kv_cache is not None else (q_pos, q_pos)

    def project(self, x, y):
        """Each head's output y (B, T, nh, hs), through hook_z and the gate if the layer has one, side by
        side, projected."""
        y = self.hook_z(y)
        if self.gate is not None:
            y = self.gate.transform(x, y)
        return self.resid_dropout(self.c_proj(y.reshape(*y.shape[:2], -1)))

    def scores(self, q, k, q0: int = 0, q1: Optional[int] = None):
        """What this layer's softmax takes in a forward without a cache, for the queries q0..q1-1 of q
        (B, T, nh, hs) against the keys k (B, T, n_kv, hs) read at its hook points: (logits (B, nh,
        q1 - q0, q1), -inf for keys it does not see: its scale, mask and bias; its sink's logit per head
        or None). The attention probe and the viewer ask this, so their weights are the layer's own."""
        q1 = q.size(1) if q1 is None else q1
        q, k = q[:, q0:q1].transpose(1, 2), repeat_kv(k[:, :q1].transpose(1, 2), self.n_head)
        at = lambda a, b: torch.arange(a, b, device=q.device)  # noqa: E731
        bias = None if self.bias is None else self.bias(at(q0, q1), at(0, q1))
        mask = Mask(q1 - q0, q1, self.window)  # the queries are the last q1 - q0 of the q1 positions
        if self.select is not None:
            mask = self.select(q, k, mask, at(q0, q1), at(0, q1))
        return attention_scores(q, k, scale=self.scale, mask=mask, bias=bias, softcap=self.softcap), self.sink_logit

    def logit_bound(self):
        """With QK-Norm, the largest |logit| any input can give: scale * |q_hat| * |k_hat|, where
        |x_hat| = sqrt(hs) after rms or layer norm and 1 after l2, times the largest |gain| of q and
        of k; with a soft-cap c (model.attn.softcap), c at most. None with neither (then logits grow with
        the inputs)."""
        if self.norm_kind is None:
            return self.softcap
        norm_sq = 1.0 if self.norm_kind == "l2" else float(self.head_dim)
        gains = 1.0 if self.q_gain is None else self.q_gain.abs().max().item() * self.k_gain.abs().max().item()
        return min(self.scale * norm_sq * gains, self.softcap or math.inf)

    def new_cache(self, batch_size: int, length: int, *, device=None, dtype=torch.float32, make=KVCache, **_):
        """This layer's KV cache for generation: `length` positions, or its window's if shorter, kept
        as `make` keeps them (KVCache; StaticKVCache for a compiled decode step; variants/ has more)."""
        length = length if self.window is None else min(length, self.window)
        return make(batch_size, self.n_kv_head, length, self.head_dim, device=device, dtype=dtype)
