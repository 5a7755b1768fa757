"""Multi-head latent attention, `model.attn.kind=mla` (kv_lora_rank, q_lora_rank, rope_head_dim):
keys and values are up-projected from one small latent per token, and only the latent (with a small
RoPE key) is cached.

A kind: LatentAttention subclasses attention.CausalSelfAttention and overrides make_projections,
forward and new_cache (its path, logit bias, sink and gate are the core's slots). DeepSeek-V2, arXiv
2405.04434. Its cache is any of the KV caches (plain, static, int8, sink-keeping) with one "head":
the RoPE key as k and the latent as v. Tests: tests/variants/test_mla.py (the layer against its
up-projections written out, naive and absorbed decoding against the whole sequence, the cache's
bytes, int8 and sink caches), tests/test_variants.py (through every path and a short training run).
"""
from dataclasses import replace

import torch
import torch.nn as nn

from attention import CausalSelfAttention, Mask, apply_rope, resolve_scale
from kv_cache import KVCache
from rules import UserError


class LatentAttention(CausalSelfAttention):
    """Keys and values from one small latent per token, c = norm(x W_dkv) (d_c = kv_lora_rank), and
    only c is cached: k_h = W_uk,h c, v_h = W_uv,h c. RoPE cannot pass through W_uk (the rotation
    depends on the position, the product would not), so position rides on a decoupled part: a small
    RoPE key shared by every head, k_R = rope(x W_kr) (d_r = rope_head_dim), and a RoPE part of each
    query, q_R,h. A head's logit is scale · (q_C,h·k_C,h + q_R,h·k_R), scale = 1/√(hs + d_r) by
    default. Queries come from x, or from their own latent (q_lora_rank) as in DeepSeek-V2.

    Decoding has two forms that compute the same thing: naive (up-project every cached latent into
    keys and values, then attend) and absorbed (fold W_uk into the query, q̃_h = W_uk,hᵀ q_C,h, and
    attend over the latents themselves, all heads sharing them like one key/value head; then W_uv,h
    turns each head's weighted latent into its output): the cache is read, never expanded."""
    rotates_heads = False  # RoPE rotates its own decoupled part (model.attn.rope_head_dim), not the heads
    selects = False  # a key selection over latents is not implemented
    takes_qk_norm = groups_kv = False  # its keys come from the latent, which every head reads
    ungrouped = "every head reads the one shared latent"  # why model.n_kv_head does nothing here
    options = ("kv_lora_rank", "q_lora_rank", "rope_head_dim")

    @staticmethod
    def dims(c) -> tuple:
        """(d_c, d_r, the query latent's width or 0): d_r is 0 without RoPE."""
        a = c.attn
        return a.kv_lora_rank or 4 * c.head_dim, LatentAttention.rope_width(c) if c.pos == "rope" else 0, a.q_lora_rank or 0

    @staticmethod
    def layout(c):
        """c's shape with this latent cache in every layer (c's own ranks, if it set them; else d_c = 4·hs and
        a RoPE key of hs/2, DeepSeek-V2's proportions): counting.cache_table's latent row."""
        return replace(c, n_kv_head=None, value_embed=False,
                       attn=type(c.attn)(kind="mla", kv_lora_rank=c.attn.kv_lora_rank, rope_head_dim=c.attn.rope_head_dim))

    @classmethod
    def rope_width(cls, c):
        return c.attn.rope_head_dim or c.head_dim // 2

    @classmethod
    def kv_heads(cls, c) -> int:
        return c.n_head  # every head reads the one shared latent

    @classmethod
    def projections(cls, c) -> dict:
        """k and v include the down-projection to the latent (and its RoPE key) and the up-projections
        from it, as training computes them for every token."""
        d, nh, hs = c.n_embd, c.n_head, c.head_dim
        d_c, d_r, rq = cls.dims(c)
        q = (d * rq + rq * nh * (hs + d_r)) if rq else d * nh * (hs + d_r)
        return {"q": q, "k": d * (d_c + d_r) + d_c * nh * hs, "v": d_c * nh * hs, "o": nh * hs * d}

    @classmethod
    def params(cls, c) -> dict:
        """Its projections; q_down, q_up, kv_down and c_proj's biases, the latent's norm (and the query
        latent's). The slots count their own (lab/counting.py)."""
        nh, hs, d = c.n_head, c.head_dim, c.n_embd
        d_c, d_r, rq = cls.dims(c)
        return {"matrices": sum(cls.projections(c).values()),
                "other": int(c.bias) * ((rq + nh * (hs + d_r)) + (d_c + d_r) + d) + d_c + rq}

    @classmethod
    def mixing_macs(cls, c, seq_len, keys) -> tuple:
        return keys * c.n_head * (c.head_dim + cls.dims(c)[1]), keys * c.n_head * c.head_dim  # keys carry k_R too

    @classmethod
    def cache_rows(cls, c, n_kv_head=None) -> list:
        """The latent and the RoPE key, shared by every head (an int8 cache scales each: two rows)."""
        d_c, d_r, _ = cls.dims(c)
        return [d_c, d_r]

    @staticmethod
    def check(config) -> list:
        """The options that do not fit a latent, refused in one line; returns those it ignores."""
        if config.value_embed:
            raise UserError("model.value_embed=true with model.attn.kind=mla is not implemented: MLA's values are "
                            "up-projected from the latent")
        if config.attn.qk_norm:
            raise UserError("model.attn.qk_norm=true with model.attn.kind=mla is not implemented: its keys are "
                            "up-projected from the latent; use kind=softmax for QK-Norm")
        if config.pos == "rope" and config.rope_dim % 2:
            raise UserError(f"MLA's RoPE part (model.attn.rope_head_dim, else head_dim/2) is {config.rope_dim}, odd, "
                            "but RoPE rotates pairs of channels: set model.attn.rope_head_dim to an even number")
        return []

    def make_projections(self, config):
        a, d, nh, hs = config.attn, config.n_embd, config.n_head, config.head_dim
        self.d_c, self.d_r, _ = self.dims(config)  # no RoPE: no decoupled part
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
        self.scale = resolve_scale(a.scale, hs + self.d_r)  # the logit's dot product is hs + d_r long

    def queries(self, x, rope):
        """(q_C (B, T, nh, hs), q_R (B, T, nh, d_r), rotated) of x (B, T, C)."""
        B, T, _ = x.shape
        h = self.q_norm(self.q_down(x)) if hasattr(self, "q_down") else x
        q = self.q_up(h).view(B, T, self.n_head, self.head_dim + self.d_r)
        qc, qr = q.split((self.head_dim, self.d_r), dim=-1)
        return qc, (apply_rope(qr, rope, dim=1) if rope is not None and self.d_r else qr)

    def latents(self, x, rope):
        """What the cache holds for x (B, T, C): the RoPE key rope(k_R) (B, 1, T, d_r) and the latent
        norm(c) (B, 1, T, d_c)."""
        c, kr = self.kv_down(x).split((self.d_c, self.d_r), dim=-1)
        if rope is not None and self.d_r:
            kr = apply_rope(kr, rope, dim=1)
        return kr.unsqueeze(1), self.kv_norm(c).unsqueeze(1)

    def expand(self, kr, c):
        """Keys (B, n, nh, hs + d_r) and values (B, n, nh, hs) up-projected from the cached kr, c."""
        B, _, n, _ = c.shape
        k = self.k_up(c[:, 0]).view(B, n, self.n_head, self.head_dim)
        k = torch.cat([k, kr[:, 0].unsqueeze(2).expand(B, n, self.n_head, self.d_r)], dim=-1)
        return k, self.v_up(c[:, 0]).view(B, n, self.n_head, self.head_dim)

    def new_cache(self, batch_size: int, length: int, *, device=None, dtype=torch.float32, make=KVCache,
                  absorbed: bool = True, **_):
        """The layer's latent cache: per token the RoPE key (as k) and the latent (as v), `length`
        positions (or its window's), kept as `make` keeps them; absorbed: decode without expanding."""
        length = length if self.window is None else min(length, self.window)
        cache = make(batch_size, 1, length, self.d_r, device=device, dtype=dtype, v_dim=self.d_c)
        cache.absorbed = absorbed
        return cache

    def forward(self, x, *, rope=None, cache=None, pos=0, window=None, ve=None):
        B, T, C = x.shape
        window = self.window if window is None else min(window, self.window or window)
        qc, qr = self.queries(x, rope)
        kr, c = self.latents(x, rope)
        mask = Mask(T, T, window)
        if cache is not None:  # a decode step sees all the cache holds: one window at most
            kr, c, written = cache.update(pos, kr, c)  # (B, 1, n, d_r), (B, 1, n, d_c)
            mask = Mask(T, c.size(2), window if T > 1 else None, written)
        kr, c = kr.to(qc.dtype), c.to(qc.dtype)
        kw = dict(scale=self.scale, mask=mask, **self.sink_key(), dropout_p=self.dropout if self.training else 0.0,
                  bias=None if self.bias is None else self.bias(*self.positions(pos, T, cache, c.size(2))))
        if cache is not None and cache.absorbed:
            # absorbed: q̃_h = W_uk,hᵀ q_C,h against the latents, shared by every head (one kv head)
            w_uk = self.k_up.weight.view(self.n_head, self.head_dim, self.d_c)  # k_C,h = W_uk,h c
            q = self.hook_q(torch.cat([torch.einsum("bthd,hdc->bthc", qc, w_uk), qr], dim=-1))  # (B, T, nh, d_c + d_r)
            k = self.hook_k(torch.cat([c, kr], dim=-1).transpose(1, 2))  # (B, n, 1, d_c + d_r)
            lat = self.path()(q.transpose(1, 2), k.transpose(1, 2), self.hook_v(c.transpose(1, 2)).transpose(1, 2),
                              **kw)  # (B, nh, T, d_c): each head's weighted latent
            w_uv = self.v_up.weight.view(self.n_head, self.head_dim, self.d_c)
            y = torch.einsum("bhtc,hdc->bthd", lat, w_uv)  # v_h = W_uv,h c, applied after the weights
        else:  # naive: keys and values up-projected from the latents, then ordinary attention
            k, v = self.expand(kr, c)
            q, k, v = self.hook_q(torch.cat([qc, qr], dim=-1)), self.hook_k(k), self.hook_v(v)
            y = self.path()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw).transpose(1, 2)
        return self.project(x, y.to(x.dtype))
