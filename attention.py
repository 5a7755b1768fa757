"""Causal self-attention, the default path, bottom-up: the parts first (the mask, the attention function
with its fast SDPA path and plain-math reference path, held equal by tests, then RoPE and QK-Norm), the
module that uses them last: softmax(q·kᵀ·scale + M)·v, scale passed explicitly (`model.attn.scale`;
1/√d_k, Vaswani et al. 2017).
RoPE (Su et al. 2021) rotates q and k, never v: a logit depends on their content and offset, not on
absolute positions. QK-Norm (Henry et al. 2020; Dehghani et al. 2023) normalises q and k per head
before RoPE: |logit| <= scale·|q̂|·|k̂|. Caches: kv_cache.py; the base every mixer shares: mixer.py;
every other piece is a file of variants/, whose table fills this module's slots once, at construction.
"""
import math
from dataclasses import dataclass
from functools import partial
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from kv_cache import KVCache
from mixer import Mixer


def resolve_scale(scale, head_dim: int) -> float:  # the logit multiplier `model.attn.scale` names
    named = {"sqrt_dk": 1.0 / math.sqrt(head_dim), "none": 1.0, "dk": 1.0 / head_dim}
    return named[str(scale)] if str(scale) in named else float(scale)


# ----------------------------------------------------------------------------- the mask

@dataclass
class Mask:
    """Which keys each query sees: the Tq queries are the last of Tk positions, so query i sees key j when
    j <= i + Tk - Tq (and j > i + Tk - Tq - W in a window W); `written` (Tk,): a fixed-shape cache's slots."""
    Tq: int
    Tk: int
    window: Optional[int] = None
    written: Optional[torch.Tensor] = None

    @property
    def causal(self) -> bool:  # the plain causal table: what SDPA's is_causal computes without a mask tensor
        return self.Tq == self.Tk and self.written is None and (self.window is None or self.window >= self.Tk)

    @property
    def sees_all(self) -> bool:  # one query that sees every key: a decode step over a cache of just those
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
    """K or V (B, n_kv, T, hs) -> (B, n_head, T, hs): consecutive query heads share one kv head (GQA)."""
    return x if x.size(1) == n_head else x.repeat_interleave(n_head // x.size(1), dim=1)


def attention_scores(q, k, *, scale: float, mask: Optional[Mask] = None, bias=None, softcap=None):
    """The logits softmax takes, (B, nh, Tq, hs) and (B, nh, Tk, hs) -> (B, nh, Tq, Tk): q·kᵀ·scale,
    soft-capped (|logit| < c), + bias(rows, cols) (variants/alibi.py), -inf where the mask hides a key."""
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, nh, Tq, Tk)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if bias is not None:
        scores = scores + bias(slice(None), slice(None)).to(scores.dtype)
    if mask is not None:
        scores = scores.masked_fill(~mask(q.device), float("-inf"))
    return scores


def softmax_with_sink(scores, sink=None):
    """softmax over the last dim (in at least fp32); with a sink (nh,), one more logit per head whose share
    goes to nothing (variants/sinks.py): the keys' weights then sum to 1 minus the sink's share."""
    if sink is not None:
        scores = torch.cat([sink.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1), scores], dim=-1)
    weights = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    return weights if sink is None else weights[..., 1:]


def attention_weights(q, k, *, scale: float, mask=None, bias=None, sink=None, softcap=None):
    """softmax(q·kᵀ·scale + bias + M), the sink one more choice: (B, nh, Tq, Tk) in q's dtype."""
    k = repeat_kv(k, q.size(1))
    return softmax_with_sink(attention_scores(q, k, scale=scale, mask=mask, bias=bias, softcap=softcap),
                             sink).type_as(q)


def reference_attention(q, k, v, *, scale: float, mask=None, bias=None, sink=None, dropout_p: float = 0.0,
                        softcap=None):
    """The attention function written out: weights @ V; the one path that takes a soft-cap."""
    weights = attention_weights(q, k, scale=scale, mask=mask, bias=bias, sink=sink, softcap=softcap)
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ repeat_kv(v, q.size(1))


def float_mask(q, k, mask=None, bias=None):
    """bias + M as one additive float mask (1 or B, nh, Tq, Tk) for the fused kernel."""
    logits = bias(slice(None), slice(None)).to(q.dtype) if bias is not None else q.new_zeros(1, q.size(-2), k.size(-2))
    return logits if mask is None else logits.masked_fill(~mask(q.device), float("-inf"))


def sdpa_attention(q, k, v, *, scale: float, mask=None, bias=None, dropout_p: float = 0.0):
    """The fast path: PyTorch's fused kernel (flash or memory-efficient on a GPU), K/V shared by query
    groups without a copy (enable_gqa), a bias as an additive float mask. A sink: variants/sinks.py."""
    kw = dict(scale=scale, dropout_p=dropout_p, enable_gqa=k.size(1) != q.size(1))
    if bias is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=float_mask(q, k, mask, bias), **kw)
    if mask is None or mask.sees_all:  # the kernels' own masks
        return F.scaled_dot_product_attention(q, k, v, **kw)
    if mask.causal:  # aligned top-left: only for Tq == Tk
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask(q.device), **kw)


# ----------------------------------------------------------------------------- RoPE and QK-Norm

def rope_theta(head_dim: int, base: float, device=None):
    """RoPE's frequencies theta_j = base^(-2j/d), j < d/2 (variants/rope_scaling.py stretches them)."""
    return 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


def rope_table(head_dim: int, length: int, base: float, device=None, theta=None, mscale: float = 1.0):
    """The precompute: cos and sin of position·theta_j, (length, head_dim // 2, 2), times mscale (a scaling's)."""
    theta = rope_theta(head_dim, base, device) if theta is None else theta
    angles = torch.outer(torch.arange(length, device=device, dtype=torch.float32), theta)  # (L, hs/2)
    return torch.stack((angles.cos(), angles.sin()), dim=-1) * mscale


def apply_rope(x, freqs, dim=None, real=None):
    """The apply: rotate each channel pair (2j, 2j+1) of x (..., hs) by the angle whose cos and sin freqs
    holds: (T, hs/2, 2) for the T positions along x's dimension `dim`, or (None) already broadcastable
    (one position: a decode step). One complex multiply eagerly, each pair read in place as the complex
    number x_2j + i·x_2j+1 (views: at fp32 nothing is cast or copied but the product); real arithmetic
    under torch.compile (real=True): inductor fuses it. Below fp32, x is rotated in fp32."""
    if dim is not None:
        freqs = freqs.view(*[freqs.size(0) if i == dim % x.dim() else 1 for i in range(x.dim() - 1)], -1, 2)
    real = torch.compiler.is_compiling() if real is None else real
    wide = x if x.dtype in (torch.float32, torch.float64) else x.float()  # complex numbers are >= fp32
    pairs = wide.unflatten(-1, (-1, 2))  # (..., hs/2, 2)
    if real:
        x0, x1 = pairs.unbind(-1)
        cos, sin = freqs.unbind(-1)
        out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    else:
        out = torch.view_as_real(torch.view_as_complex(pairs) * torch.view_as_complex(freqs))
    out = out.flatten(-2)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def qk_normalize(x, kind: str, eps: float = 1e-6):
    """Parameter-free per-head norm of x (..., hs). rms and layer give |x| = sqrt(hs); l2 gives 1."""
    if kind == "l2":
        return F.normalize(x, dim=-1, eps=eps)
    if kind == "layer":
        x = x - x.mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- the attention module

class CausalSelfAttention(Mixer):
    """Multi-head causal self-attention: one fused q|k|v projection, QK-Norm and RoPE on q and k, the
    attention path, the output projection. Hook points (mixer.py): hook_q (B, T, nh, hs), hook_k and
    hook_v (B, T, n_kv, hs) as they enter attention, hook_pattern (B, nh, T, T), the weights (they exist
    only while a hook is on it: the layer then attends by the written-out path), hook_z (B, T, nh, hs).
    Slots, filled once by variants/__init__.py (None: the plain path): `path`, the function that
    attends; `bias`, a logit bias (ALiBi); `sink`, a logit per head for a key of value zero; `gate`, an
    output gate; `select`, a choice of keys by content (MoBA). A soft-cap (`model.attn.softcap`,
    c·tanh(s/c) on the scaled scores) takes the written-out path; the probe reads the capped scores."""
    softmax = True  # its weights are a softmax of logits: the attention probe reads them
    rotates_heads = True  # with model.pos=rope, RoPE rotates its whole q and k heads (pairs of channels)
    selects = True  # model.attn.select may choose its keys by content
    takes_qk_norm = takes_gate = groups_kv = True  # model.attn.qk_norm, model.attn.gate, model.n_kv_head act on it

    def __init__(self, config, layer: int, *, path=sdpa_attention, bias=None, sink=None, gate=None, select=None):
        super().__init__(config, layer, gate=gate)  # the projections, hooks, the gate slot (mixer.py)
        self.softcap = config.attn.softcap or None
        self.attend = partial(reference_attention, softcap=self.softcap) if self.softcap else path
        pattern = config.attn.window_pattern
        local = config.attn.window is not None and pattern[layer % len(pattern)] == "L"
        self.window = config.attn.window if local else None  # this layer's own window (None: global)
        sink = sink.make(config) if sink else None  # a logit per head: learned (a Parameter) or fixed (variants/sinks.py)
        self.register_parameter("sink_logit", sink) if isinstance(sink, nn.Parameter) else \
            self.register_buffer("sink_logit", sink, persistent=False)
        self.bias = bias(config) if bias else None  # bias(q_pos, k_pos) -> bias(rows, cols) (variants/alibi.py)
        self.select = select(config) if select else None  # (q, k, mask, q_pos, k_pos) -> a narrower mask (variants/moba.py)

    def make_projections(self, config):
        """q (n_head heads), k and v (n_kv_head heads each) in one matmul laid out [Q | K | V], the
        output projection, QK-Norm's optional gains, and the logit scale."""
        self.scale = config.attn_scale
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
            q, k = (qk if rope is None else apply_rope(qk, rope, dim=1)).unbind(2)  # (B, T, nh, hs) each
        else:  # grouped-query: fewer k heads than q heads
            q, k, v = qkv.split((nq, nkv, nkv), dim=-1)
            q = self.normalize(q.view(B, T, self.n_head, hs), self.q_gain)
            k = self.normalize(k.view(B, T, self.n_kv_head, hs), self.k_gain)
            if rope is not None:
                q, k = apply_rope(q, rope, dim=1), apply_rope(k, rope, dim=1)
        return q, k, (v if ve is None else v + ve).view(B, T, self.n_kv_head, hs)

    def token_qkv(self, x, rope=None, ve=None):
        """qkv for one token x (B, 1, C), laid out as attention takes it: q (B, nh, 1, hs), k and v (B, n_kv,
        1, hs). With T = 1, (B, 1, heads, hs) and (B, heads, 1, hs) are the same memory, so views replace
        forward's transposes, and q and k are normed and rotated together (rope (1, hs/2, 2) broadcasts over
        the heads): a decode step's time is mostly its dispatches (tests/test_decode_ops.py counts them)."""
        B, nq, nkv, hs = x.size(0), self.n_head, self.n_kv_head, self.head_dim
        qk, v = self.c_attn(x).view(B, nq + 2 * nkv, 1, hs).split((nq + nkv, nkv), dim=1)  # [Q | K], V heads
        if self.norm_kind is not None:
            gains = None if self.q_gain is None else torch.cat((self.q_gain, self.k_gain))[:, None]  # (heads, 1, ·)
            qk = self.normalize(qk, gains)
        q, k = (qk if rope is None else apply_rope(qk, rope)).split((nq, nkv), dim=1)
        return q, k, (v if ve is None else v + ve.view(B, nkv, 1, hs))

    def forward(self, x, *, rope=None, cache=None, pos=0, window=None, ve=None):
        """x (B, T, C) at positions pos..pos+T-1 -> (B, T, C). cache: this layer's cache (k, v are
        added to it and attention reads all it holds); window: each query sees only the latest
        `window` keys (with the layer's own window, the narrower); ve: the value embedding added to v."""
        B, T, C = x.shape
        window = self.window if window is None else min(window, self.window or window)
        if T == 1 and cache is not None and not self.reads_qkv():  # a decode step: the same q, k, v by views
            q, k, v = self.token_qkv(x, rope, ve)
        else:
            q, k, v = self.qkv(x, rope, ve)
            q, k, v = (h(t).transpose(1, 2) for h, t in ((self.hook_q, q), (self.hook_k, k), (self.hook_v, v)))
        mask = Mask(T, T, window)  # (B, heads, T, hs) above: the layout attention takes
        if cache is not None:  # a decode step sees all a cache holds: one window at most
            k, v, written = cache.update(pos, k, v)  # (B, n_kv, n_cached, hs)
            mask = Mask(T, k.size(2), window if T > 1 else None, written)
        bias = None if self.bias is None else self.bias(*self.positions(pos, T, cache, k.size(2)))
        if self.select is not None:  # each query reads only the keys it chooses
            mask = self.select(q, k, mask, *self.positions(pos, T, cache, k.size(2)))
        # a cache may hold another dtype (sample.kv_dtype): q joins it, the output returns to q's
        y = self.path()(q if q.dtype == k.dtype else q.to(k.dtype), k, v, scale=self.scale, mask=mask, bias=bias,
                        dropout_p=self.dropout if self.training else 0.0, **self.sink_key())
        return self.project(x, (y if y.dtype == q.dtype else y.to(q.dtype)).transpose(1, 2))  # (B, T, nh, hs)

    def reads_qkv(self) -> bool:
        """Is a hook on hook_q, hook_k or hook_v? They read (B, T, heads, hs): forward's general layout."""
        return any(h._forward_hooks or h._forward_pre_hooks for h in (self.hook_q, self.hook_k, self.hook_v))

    def sink_key(self) -> dict:
        """The path's `sink` argument, only on a layer with a sink (whose path takes one: variants/sinks.py)."""
        return {} if self.sink_logit is None else {"sink": self.sink_logit}

    def path(self):
        """The function that attends: the layer's own, or the written-out one while a hook is on hook_pattern."""
        return self.through_pattern if self.hook_pattern._forward_hooks else self.attend

    def through_pattern(self, q, k, v, *, scale, mask, bias, dropout_p, sink=None):
        """The written-out path with its weights (B, nh, Tq, Tk) passed through hook_pattern."""
        weights = self.hook_pattern(attention_weights(q, k, scale=scale, mask=mask, bias=bias, sink=sink,
                                                      softcap=self.softcap))
        return (F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights) @ repeat_kv(v, q.size(1))

    def positions(self, pos, T: int, cache=None, n_keys: Optional[int] = None):
        """(query positions (T,), key positions (n_keys,)) for a position-dependent bias; pos may be a
        tensor (a compiled decode step)."""
        q_pos = pos + torch.arange(T, device=self.c_proj.weight.device)
        return cache.positions(q_pos, n_keys) if cache is not None else (q_pos, q_pos)

    def scores(self, q, k, q0: int = 0, q1: Optional[int] = None):
        """What this layer's softmax takes without a cache, for the queries q0..q1-1 of q (B, T, nh, hs)
        against k (B, T, n_kv, hs) read at its hooks: (logits (B, nh, q1 - q0, q1) with its scale, mask
        and bias, its sink's logits or None). The probe and the viewer ask this: the layer's own weights."""
        q1 = q.size(1) if q1 is None else q1
        q, k = q[:, q0:q1].transpose(1, 2), repeat_kv(k[:, :q1].transpose(1, 2), self.n_head)
        at = lambda a, b: torch.arange(a, b, device=q.device)  # noqa: E731
        bias = None if self.bias is None else self.bias(at(q0, q1), at(0, q1))
        mask = Mask(q1 - q0, q1, self.window)  # the queries are the last q1 - q0 of the q1 positions
        if self.select is not None:
            mask = self.select(q, k, mask, at(q0, q1), at(0, q1))
        return attention_scores(q, k, scale=self.scale, mask=mask, bias=bias, softcap=self.softcap), self.sink_logit

    def new_cache(self, batch_size: int, length: int, *, device=None, dtype=torch.float32, make=KVCache, **_):
        """This layer's KV cache for generation: `length` positions, or its window's if shorter, kept
        as `make` keeps them (KVCache; StaticKVCache for a compiled decode step; variants/ has more)."""
        length = length if self.window is None else min(length, self.window)
        return make(batch_size, self.n_kv_head, length, self.head_dim, device=device, dtype=dtype)

    def aux_loss(self):  # a learned selection's (variants/indexer.py)
        return None if self.select is None else self.select.aux_loss()

    def aux_metrics(self) -> dict:
        return {} if self.select is None else self.select.aux_metrics()

    # --------------------------------------------------------------- its counts (mixer.py; lab/counting.py totals them)

    @classmethod
    def rope_width(cls, c):
        return c.head_dim

    @classmethod
    def projections(cls, c) -> dict:
        d, kv = c.n_embd, c.n_kv_head * c.head_dim
        return {"q": d * d, "k": d * kv, "v": d * kv, "o": d * d}

    @classmethod
    def params(cls, c) -> dict:
        """c_attn and c_proj; the biases and QK-Norm's gains (the slots count their own: lab/counting.py)."""
        nh, hs, kv, a = c.n_head, c.head_dim, c.n_kv_head * c.head_dim, c.attn
        gain = {"none": 0, "head": 1, "channel": hs}[a.qk_norm_gain] if a.qk_norm else 0
        return {"matrices": sum(cls.projections(c).values()),
                "other": int(c.bias) * (2 * c.n_embd + 2 * kv) + gain * (nh + c.n_kv_head)}

    @classmethod
    def mixing_macs(cls, c, seq_len, keys) -> tuple:  # q·k with each key a query sees, weights·V
        return keys * c.n_head * c.head_dim, keys * c.n_head * c.head_dim

    @classmethod
    def cache_rows(cls, c, n_kv_head=None) -> list:
        """K and V of each kv head."""
        return [c.head_dim] * 2 * (n_kv_head or c.n_kv_head)
