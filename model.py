"""A decoder-only Transformer (GPT) written to be read, trained and taken apart.

Architecture choices, and why:
- Pre-LN blocks, x + attn(ln(x)) then x + mlp(ln(x)), with a final norm before the LM head:
  the residual stream stays an identity path, so training is stable without warmup tricks
  (Xiong et al. 2020, arXiv 2002.04745).
- Rotary position embeddings (RoPE, Su et al. 2021, arXiv 2104.09864) rotate q and k, never v,
  and there is no learned position table: q·k then depends only on the offset between two
  positions, which is also what lets the KV cache slide past block_size.
- The attention logit scale is a config value (`attn.scale`), passed explicitly to the kernel:
  1/sqrt(d_k) by default (Vaswani et al. 2017), `none` (1.0) or `dk` (1/d_k, muP) to ablate it.
- Optional QK-Norm (Henry et al. 2020, arXiv 2010.04245; Dehghani et al. 2023, arXiv
  2302.05442): q and k are normalised per head *before* RoPE, so the norm (and its gain) sees
  the raw projection and RoPE, a rotation, then keeps the norm. The scale applies after both:
  logit = scale * <rope(norm(q)), rope(norm(k))>, so |logit| <= scale * |q_hat| * |k_hat|.
- One attention function with two paths: the fast one (F.scaled_dot_product_attention, flash
  on GPU) and a plain-math reference (explicit scores, -inf mask, softmax, weights @ V). Tests
  hold them equal; attention statistics are computed from the reference scores.
- The LM head is tied to the token embedding (Press & Wolf 2017, arXiv 1608.05859).

The variants the texts discuss are one override each, every one a small piece chosen once at
construction (no branches in forward): grouped-query / multi-query attention (`n_kv_head`,
Ainslie et al. 2023, arXiv 2305.13245; Shazeer 2019, arXiv 1911.02150), Post-LN blocks (the
original Transformer, Vaswani et al. 2017), RMSNorm (Zhang & Sennrich 2019, arXiv 1910.07467),
SwiGLU (Shazeer 2020, arXiv 2002.05202) and ReLU² MLPs (So et al. 2021, arXiv 2109.08668),
learned, sinusoidal or no positions (NoPE, Kazemnejad et al. 2023, arXiv 2305.19466), an untied
head, a tanh logit soft-cap (Gemma 2) and zero-initialised output projections (modded-nanogpt).
"""
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import UserError

QK_NORM_TYPES = ("rms", "layer", "l2")
QK_NORM_GAINS = ("none", "head", "channel")
NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post")
MLPS = ("gelu", "swiglu", "relu2")
POSITIONS = ("rope", "learned", "sinusoidal", "none")
NORM_EPS = 1e-5  # LayerNorm's and RMSNorm's epsilon (PyTorch's LayerNorm default)


class ConfigError(UserError):
    """A bad config value; the message is one line that says how to fix it."""


# ----------------------------------------------------------------------------- config

@dataclass
class AttnConfig:
    scale: str = "sqrt_dk"  # sqrt_dk (1/sqrt(d_k)) | none (1.0) | dk (1/d_k) | a positive number
    qk_norm: bool = False  # normalise q and k per head before RoPE
    qk_norm_type: str = "rms"  # rms | layer | l2 (all parameter-free unless qk_norm_gain is set)
    qk_norm_gain: str = "none"  # none | head (one scalar per head) | channel (one per head dim)
    impl: str = "sdpa"  # sdpa (fast path) | reference (plain math, for checking and statistics)


@dataclass
class GPTConfig:
    vocab_size: Optional[int] = None  # set from the tokenizer by the data pipeline
    block_size: int = 256  # longest context the model is trained on
    n_layer: int = 4  # number of transformer blocks
    n_head: int = 4  # attention heads per block
    n_embd: int = 128  # residual stream width; head_dim = n_embd // n_head
    n_kv_head: Optional[int] = None  # key/value heads, shared by groups of query heads; unset: n_head (MHA), 1: MQA
    dropout: float = 0.0  # on attention weights, residual branches and embeddings
    bias: bool = False  # biases in Linear and LayerNorm (GPT-2 had them; they do not help)
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_position: str = "pre"  # pre: x + f(norm(x)) | post: norm(x + f(x)), the original Transformer
    mlp: str = "gelu"  # gelu (GPT-2) | swiglu (Llama) | relu2 (ReLU squared)
    d_ff: Optional[int] = None  # MLP hidden width; unset: 4*n_embd, or for swiglu ~8/3*n_embd rounded up to 64
    pos: str = "rope"  # rope | learned (a table added to the embeddings) | sinusoidal (added) | none (NoPE)
    rope_base: float = 10000.0  # RoPE frequency base theta
    tie_embeddings: bool = True  # the LM head shares the token embedding's weights
    logit_softcap: float = 0.0  # > 0: output logits = c * tanh(logits / c); 0 = off
    zero_init_proj: bool = False  # residual output projections (attn and MLP c_proj) start at zero
    value_embed: bool = False  # each layer adds a learned embedding of the token to its values (modded-nanogpt)
    attn: AttnConfig = field(default_factory=AttnConfig)

    def __post_init__(self):
        if isinstance(self.attn, dict):
            self.attn = AttnConfig(**self.attn)
        if self.vocab_size is None:
            raise ConfigError("model.vocab_size is unset: it comes from the data's tokenizer")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be a positive integer")
        if self.n_embd % self.n_head:
            raise ConfigError(f"model.n_embd={self.n_embd} is not divisible by model.n_head="
                              f"{self.n_head}: pick n_embd as a multiple of n_head")
        self.head_dim = self.n_embd // self.n_head
        if self.head_dim % 2:
            raise ConfigError(f"head size n_embd/n_head={self.head_dim} is odd, but RoPE rotates "
                              "pairs of channels: make n_embd/n_head even")
        self.n_kv_head = self.n_head if self.n_kv_head is None else self.n_kv_head
        if self.n_kv_head <= 0 or self.n_head % self.n_kv_head:
            raise ConfigError(f"model.n_kv_head={self.n_kv_head} must divide model.n_head={self.n_head} "
                              "(n_head for multi-head, 1 for multi-query attention)")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        for name, allowed in (("norm", NORMS), ("norm_position", NORM_POSITIONS), ("mlp", MLPS), ("pos", POSITIONS)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"model.{name}={getattr(self, name)!r} is unknown: use one of {', '.join(allowed)}")
        if self.d_ff is None:
            self.d_ff = 64 * math.ceil(8 * self.n_embd / 3 / 64) if self.mlp == "swiglu" else 4 * self.n_embd
        if self.d_ff <= 0:
            raise ConfigError(f"model.d_ff={self.d_ff} must be a positive integer (or unset)")
        if not (math.isfinite(self.rope_base) and self.rope_base > 1):
            raise ConfigError(f"model.rope_base={self.rope_base} must be a finite number > 1")
        if not (math.isfinite(self.logit_softcap) and self.logit_softcap >= 0):
            raise ConfigError(f"model.logit_softcap={self.logit_softcap} must be >= 0 (0 = off)")
        self.attn_scale = resolve_scale(self.attn.scale, self.head_dim)
        if self.attn.qk_norm_type not in QK_NORM_TYPES:
            raise ConfigError(f"model.attn.qk_norm_type={self.attn.qk_norm_type!r} is unknown: "
                              f"use one of {', '.join(QK_NORM_TYPES)}")
        if self.attn.qk_norm_gain not in QK_NORM_GAINS:
            raise ConfigError(f"model.attn.qk_norm_gain={self.attn.qk_norm_gain!r} is unknown: "
                              f"use one of {', '.join(QK_NORM_GAINS)}")
        if self.attn.impl not in ("sdpa", "reference"):
            raise ConfigError(f"model.attn.impl={self.attn.impl!r} is unknown: use sdpa or reference")


def resolve_scale(scale, head_dim: int) -> float:
    """The attention logit multiplier named by `model.attn.scale`."""
    named = {"sqrt_dk": 1.0 / math.sqrt(head_dim), "none": 1.0, "dk": 1.0 / head_dim}
    if str(scale) in named:
        return named[str(scale)]
    try:
        value = float(scale)
    except (TypeError, ValueError):
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"model.attn.scale={scale} is invalid: use sqrt_dk, none, dk or a "
                          "positive number")
    return value


# ----------------------------------------------------------------------------- helpers

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


def qk_normalize(x, kind: str, eps: float = 1e-6):
    """Parameter-free per-head norm of x (..., hs). rms and layer give |x| = sqrt(hs); l2 gives 1."""
    if kind == "l2":
        return F.normalize(x, dim=-1, eps=eps)
    if kind == "layer":
        x = x - x.mean(dim=-1, keepdim=True)
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- attention

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


def attention(q, k, v, scale: float, causal: bool = True, impl: str = "sdpa", dropout_p: float = 0.0, window=None,
              key_mask=None):
    """softmax(q·kᵀ·scale + M)·v for q (B, nh, Tq, hs) and k, v (B, n_kv, Tk, hs) -> (B, nh, Tq, hs).

    M is 0 where a key is visible (causal, and within `window` if given), -inf elsewhere. With
    n_kv < nh (grouped-query attention) each kv head serves nh / n_kv consecutive query heads.
    key_mask (1, 1, 1, Tk) bool, for a single query: which cache slots hold a key (a static cache)."""
    if impl == "sdpa":
        Tq, Tk = q.size(-2), k.size(-2)
        kw = dict(dropout_p=dropout_p, scale=scale, enable_gqa=k.size(1) != q.size(1))  # GQA without copying K/V
        if causal and Tq == Tk and (window is None or window >= Tk):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
        if causal and (Tq > 1 or (window is not None and window < Tk)):  # SDPA's is_causal aligns top-left
            return F.scaled_dot_product_attention(q, k, v, attn_mask=visible(Tq, Tk, window, q.device), **kw)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, **kw)
    # reference path: the same function written out, K/V expanded to one head per query head
    k, v = repeat_kv(k, q.size(1)), repeat_kv(v, q.size(1))
    scores = attention_scores(q, k, scale, causal, window)  # (B, nh, Tq, Tk)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, float("-inf"))
    weights = F.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).type_as(q)
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v


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
    position is a tensor, each step attends over all `length` slots and a mask hides those not
    written yet, so one graph serves every step and nothing waits for the host."""

    def update(self, pos, k, v):
        if not torch.is_tensor(pos):  # the prefill runs eagerly, as for KVCache
            return super().update(pos, k, v)
        slot = pos % self.length  # (1,)
        self.k.index_copy_(2, slot, k.to(self.k.dtype))
        self.v.index_copy_(2, slot, v.to(self.v.dtype))
        written = torch.arange(self.length, device=pos.device) <= pos  # positions 0..pos, all once full
        return self.k, self.v, written.view(1, 1, 1, -1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
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

    def qkv(self, x, freqs, ve=None):
        """q (B, nh, T, hs) and k, v (B, n_kv, T, hs) of x (B, T, C); q and k normed (if enabled),
        then rotated (with RoPE: freqs is None for the other position schemes); ve (B, T, n_kv hs),
        the token's value embedding, is added to v."""
        B, T, C = x.shape
        nq, hs = self.n_head * self.head_dim, self.head_dim
        qkv = self.c_attn(x)  # (B, T, (nh + 2 n_kv) hs)
        nkv = self.n_kv_head * hs
        # split, not qkv[..., a:b]: each slice's backward zero-fills a gradient the size of qkv
        if self.n_kv_head == self.n_head:  # q and k side by side: one norm and one rotation for both
            qk, v = qkv.split((2 * nq, nkv), dim=-1)
            gains = None if self.q_gain is None else torch.stack((self.q_gain, self.k_gain))  # (2, nh, 1 or hs)
            qk = self.rotate(self.normalize(qk.view(B, T, 2, self.n_head, hs), gains), freqs)
            q, k = qk.unbind(2)  # (B, T, nh, hs) each
        else:  # grouped-query: fewer k heads than q heads
            q, k, v = qkv.split((nq, nkv, nkv), dim=-1)
            q = self.rotate(self.normalize(q.view(B, T, self.n_head, hs), self.q_gain), freqs)
            k = self.rotate(self.normalize(k.view(B, T, self.n_kv_head, hs), self.k_gain), freqs)
        v = (v if ve is None else v + ve).view(B, T, self.n_kv_head, hs)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, hs)

    def normalize(self, x, gain):
        """QK-Norm of x (..., heads, hs) before RoPE, so the gain multiplies un-rotated channels."""
        if not self.attn_cfg.qk_norm:
            return x
        x = qk_normalize(x, self.attn_cfg.qk_norm_type)
        return x if gain is None else x * gain

    @staticmethod
    def rotate(x, freqs):
        """RoPE on x (B, T, ..., hs) when the model uses it (freqs (T, hs/2, 2)), else x as is."""
        if freqs is None:
            return x
        return apply_rope(x, freqs.view(freqs.size(0), *([1] * (x.dim() - 3)), -1, 2))

    def logit_bound(self):
        """With QK-Norm, the largest |logit| any input can give: scale * |q_hat| * |k_hat|, where
        |x_hat| = sqrt(hs) after rms or layer norm and 1 after l2, times the largest |gain| of q and
        of k. None without QK-Norm (then logits grow with the inputs)."""
        if not self.attn_cfg.qk_norm:
            return None
        norm_sq = 1.0 if self.attn_cfg.qk_norm_type == "l2" else float(self.head_dim)
        gains = 1.0 if self.q_gain is None else self.q_gain.abs().max().item() * self.k_gain.abs().max().item()
        return self.scale * norm_sq * gains

    def forward(self, x, freqs, kv_cache=None, pos=0, probe=None, window=None, ve=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x, freqs, ve)
        if probe is not None:  # attention statistics read q, k here (one k per query head); None on training steps
            probe(self.layer, q, repeat_kv(k, self.n_head), self.scale)
        key_mask = None
        if kv_cache is not None:
            k, v, key_mask = kv_cache.update(pos, k, v)  # (B, n_kv, n_cached, hs)
        # a cache may hold another dtype (sample.kv_dtype): q joins it, the output returns to q's
        y = attention(q.to(k.dtype), k, v, self.scale, causal=True, impl=self.attn_cfg.impl,
                      dropout_p=self.dropout if self.training else 0.0, window=window,
                      key_mask=key_mask).to(q.dtype)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble heads side by side
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """GPT-2's MLP: c_proj(gelu(c_fc(x))), hidden width d_ff (4 * n_embd by default)."""

    def __init__(self, config: GPTConfig, fc_out=None):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, fc_out or config.d_ff, bias=config.bias)
        self.c_proj = nn.Linear(config.d_ff, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))

    @staticmethod
    def act(h):
        return F.gelu(h)


class ReLU2MLP(MLP):
    """relu(h)², the Primer activation (So et al. 2021), as modded-nanogpt uses it."""

    @staticmethod
    def act(h):
        return F.relu(h).square()


class SwiGLUMLP(MLP):
    """c_proj(silu(gate(x)) * up(x)), the Llama MLP; gate and up are one matmul, laid out [gate | up]."""

    def __init__(self, config: GPTConfig):
        super().__init__(config, fc_out=2 * config.d_ff)

    @staticmethod
    def act(h):
        gate, up = h.chunk(2, dim=-1)  # (B, T, d_ff) each
        return F.silu(gate) * up


MLP_CLASSES = {"gelu": MLP, "relu2": ReLU2MLP, "swiglu": SwiGLUMLP}


def make_norm(config: GPTConfig) -> nn.Module:
    """LayerNorm (mean and variance, GPT-2) or RMSNorm (root mean square only, Llama)."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=NORM_EPS)
    return nn.LayerNorm(config.n_embd, eps=NORM_EPS, bias=config.bias)


class Block(nn.Module):
    """Pre-LN: x + attn(ln_1(x)), then x + mlp(ln_2(x)); the residual stream is never normalised."""

    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = make_norm(config)
        self.mlp = MLP_CLASSES[config.mlp](config)

    def forward(self, x, freqs, kv_cache=None, pos=0, probe=None, window=None, ve=None):
        x = x + self.attn(self.ln_1(x), freqs, kv_cache, pos, probe, window, ve)
        return x + self.mlp(self.ln_2(x))


class PostNormBlock(Block):
    """Post-LN, the original Transformer's order: ln_1(x + attn(x)), then ln_2(x + mlp(x)). Every
    residual sum is normalised, so gradients to early layers shrink with depth: it needs warmup
    (Xiong et al. 2020, arXiv 2002.04745)."""

    def forward(self, x, freqs, kv_cache=None, pos=0, probe=None, window=None, ve=None):
        x = self.ln_1(x + self.attn(x, freqs, kv_cache, pos, probe, window, ve))
        return self.ln_2(x + self.mlp(x))


def sinusoidal_table(length: int, dim: int):
    """Vaswani et al.'s fixed positions: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(same)."""
    angles = torch.outer(torch.arange(length, dtype=torch.float32),
                         1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # (L, d/2)
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(1)  # (L, d): sin, cos interleaved


class LearnedPositions(nn.Module):
    """A trained table of block_size position vectors added to the token embeddings (GPT-2)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.wpe = nn.Embedding(config.block_size, config.n_embd)

    def forward(self, start, T: int):
        return self.wpe.weight.index_select(0, torch.arange(T, device=self.wpe.weight.device) + start)  # (T, C)


class SinusoidalPositions(nn.Module):
    """The fixed sinusoidal table added to the token embeddings (Vaswani et al. 2017)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.register_buffer("table", sinusoidal_table(config.block_size, config.n_embd), persistent=False)

    def forward(self, start, T: int):
        return self.table.index_select(0, torch.arange(T, device=self.table.device) + start)  # (T, C)


ABSOLUTE_POSITIONS = {"learned": LearnedPositions, "sinusoidal": SinusoidalPositions}


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        # absolute positions are added to the embeddings; RoPE acts inside attention; NoPE has none
        self.positions = ABSOLUTE_POSITIONS[config.pos](config) if config.pos in ABSOLUTE_POSITIONS else None
        self.drop = nn.Dropout(config.dropout)
        block = PostNormBlock if config.norm_position == "post" else Block
        self.blocks = nn.ModuleList(block(config, i) for i in range(config.n_layer))
        # value embeddings: per layer a second token table, added to the values (not the residual stream)
        self.value_embeds = nn.ModuleList(nn.Embedding(config.vocab_size, config.n_kv_head * config.head_dim)
                                          for _ in range(config.n_layer)) if config.value_embed else None
        # Pre-LN needs a final norm (the stream is never normalised); Post-LN's last block ends with one
        self.ln_f = make_norm(config) if config.norm_position == "pre" else nn.Identity()
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.rotary = config.pos == "rope"
        freqs = rope_freqs(config.head_dim, config.block_size, config.rope_base)
        self.register_buffer("rope", freqs, persistent=False)  # (block_size, hs/2, 2): cos, sin
        self.init_weights()

    def init_weights(self):
        """GPT-2 init: every Linear and embedding (positions included) ~ N(0, 0.02); the two
        projections that write into the residual stream (attn.c_proj, mlp.c_proj) ~ N(0,
        0.02/sqrt(2*n_layer)), so the stream's variance does not grow with depth, or exactly 0 with
        zero_init_proj (each block then starts as the identity); biases 0; norm weights and QK gains 1."""
        std_resid = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.zeros_(p) if self.config.zero_init_proj else nn.init.normal_(p, mean=0.0, std=std_resid)
            elif p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)

    def _apply(self, fn, recurse=True):
        """After .to()/.half()/.bfloat16(): the RoPE table stays float32 (cos and sin of large
        angles in bf16 would be wrong, and complex bf16 does not exist)."""
        super()._apply(fn, recurse)
        if self.rope.dtype != torch.float32:
            self.rope = rope_freqs(self.config.head_dim, self.rope.size(0), self.config.rope_base, self.rope.device)
        return self

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # a tied embedding counts once

    def flops_per_token(self, seq_len=None) -> int:
        """Training FLOPs per token: 6N for the weights used in matmuls (forward 2N, backward 4N;
        a lookup table, i.e. an untied input embedding or learned positions, does no matmul), plus
        attention's q·k and weights·v, 2·2·T·d per layer forward, x3 for backward (PaLM, arXiv 2204.02311)."""
        T = seq_len or self.config.block_size
        lookup = (0 if self.config.tie_embeddings else self.wte.weight.numel()) + \
            (self.positions.wpe.weight.numel() if isinstance(self.positions, LearnedPositions) else 0) + \
            (0 if self.value_embeds is None else sum(e.weight.numel() for e in self.value_embeds))
        return 6 * (self.num_params() - lookup) + 12 * self.config.n_layer * T * self.config.n_embd

    def rope_at(self, start: int, T: int):
        """RoPE factors for positions start..start+T-1 (None without RoPE), grown on demand
        (generation past block_size)."""
        if not self.rotary:
            return None
        if torch.is_tensor(start):  # a compiled decode step: the position is data (T = 1)
            return self.rope.index_select(0, start)
        if start + T > self.rope.size(0):  # a normal tensor even when grown under inference_mode (sampling),
            with torch.inference_mode(False):  # so a later forward with autograd can still use it
                self.rope = rope_freqs(self.config.head_dim, 2 * (start + T), self.config.rope_base, self.rope.device)
        return self.rope[start:start + T]

    @property
    def slides(self) -> bool:
        """Can a KV cache slide past block_size? Yes with relative (RoPE) or no positions; an
        absolute position table ends at block_size, so generation there must re-prefill."""
        return self.positions is None

    def forward(self, idx, targets=None, kv_cache=None, pos: int = 0, probe=None, window=None):
        """idx (B, T) token ids -> logits (B, T, vocab), plus the mean next-token loss if targets.

        kv_cache: a list of KVCache (one per layer); idx then holds positions pos..pos+T-1.
        probe: optional callable(layer, q, k, scale), used only for attention statistics.
        window: each query sees only the latest `window` positions, in every layer; this is what a
        sliding KV cache computes past block_size, so a longer idx is allowed with it.
        """
        B, T = idx.shape
        if kv_cache is None and window is None and T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={self.config.block_size}")
        if self.positions is not None and not torch.is_tensor(pos) and pos + T > self.config.block_size:
            raise ValueError(f"positions up to {pos + T} but model.pos={self.config.pos} has a table of "
                             f"{self.config.block_size}")
        freqs = self.rope_at(pos, T)
        x = self.wte(idx)  # (B, T, C)
        if self.positions is not None:
            x = x + self.positions(pos, T)
        x = self.drop(x)
        ves = [None] * len(self.blocks) if self.value_embeds is None else [e(idx) for e in self.value_embeds]
        for i, block in enumerate(self.blocks):
            x = block(x, freqs, None if kv_cache is None else kv_cache[i], pos, probe, window, ves[i])
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        if self.config.logit_softcap:  # smoothly bounded logits: |logit| < c (Gemma 2)
            logits = self.config.logit_softcap * torch.tanh(logits / self.config.logit_softcap)
        if targets is None:
            return logits
        # teacher forcing: every position predicts its successor in one pass
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def new_kv_cache(self, batch_size: int, length: int, device=None, dtype=None, static=False):
        """One preallocated KVCache per layer holding up to `length` positions (StaticKVCache,
        fixed shapes, for a compiled decode step)."""
        p = self.wte.weight
        return [(StaticKVCache if static else KVCache)(batch_size, self.config.n_kv_head, length, self.config.head_dim,
                        device or p.device, dtype or p.dtype) for _ in range(self.config.n_layer)]

    def configure_optimizer(self, lr, weight_decay, betas=(0.9, 0.95), fused=False):
        """AdamW with weight decay on matrices (Linear weights, embedding) only, not on biases,
        norm weights or QK gains (Loshchilov & Hutter 2019)."""
        named = list(self.named_parameters())
        decay = [p for n, p in named if n.endswith("weight") and p.dim() == 2]
        no_decay = [p for n, p in named if not (n.endswith("weight") and p.dim() == 2)]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=betas, fused=fused)
