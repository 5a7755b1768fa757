"""A decoder-only Transformer (GPT) written to be read, trained and taken apart: its config (one
table of every knob), the MLP and norm, the Pre-LN block and the GPT that stacks them. Attention is
attention.py; every other kind, path, position scheme and add-on is a small file in variants/.

Architecture choices, and why:
- Pre-LN blocks, x + attn(ln(x)) then x + mlp(ln(x)), with a final norm before the LM head:
  the residual stream stays an identity path, so training is stable without warmup tricks
  (Xiong et al. 2020, arXiv 2002.04745). Post-LN, the original Transformer's order, is one class
  below, for comparing the two.
- RoPE (Su et al. 2021) rotates q and k, never v; no learned position table. The attention logit
  scale and QK-Norm are config values (`model.attn.*`, attention.py).
- The LM head is tied to the token embedding (Press & Wolf 2017, arXiv 1608.05859).
- Teacher forcing: forward(idx, targets) predicts every position's successor in one pass.

Every option is a small piece chosen once at construction: RMSNorm (Zhang & Sennrich 2019), SwiGLU
(Shazeer 2020) and ReLU² MLPs (So et al. 2021), an untied head, a logit soft-cap (Gemma 2), zero-init
output projections and value embeddings (modded-nanogpt) here; the rest through variants/' table.
"""
import math
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from attention import resolve_scale, rope_table
from mixer import Dropout, HookPoint, with_aux_losses
from rules import FRACTION, POSITIVE, Needs, OneOf, Range, UserError, check_values
from variants import ACTIVATIONS, KINDS, POSITIONS, ROPE_SCALINGS, AttnConfig, cache_maker, check, kinds, make_attention

NORMS, NORM_POSITIONS = ("layernorm", "rmsnorm"), ("pre", "post")
NORM_EPS = 1e-5  # LayerNorm's and RMSNorm's epsilon (PyTorch's LayerNorm default)


class ConfigError(UserError):
    """A bad config value; the message is one line that says how to fix it."""


# ----------------------------------------------------------------------------- config

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
    mlp: str = "gelu"  # gelu (GPT-2) | swiglu (Llama) | relu2 (ReLU squared) | none (no MLP: attention alone)
    d_ff: Optional[int] = None  # MLP hidden width; unset: 4*n_embd, or for swiglu ~8/3*n_embd rounded up to 64
    pos: str = "rope"  # rope | learned (a table added to the embeddings) | sinusoidal (added) | none (NoPE) | alibi (a bias per head on the logits)
    rope_base: float = 10000.0  # RoPE frequency base theta
    rope_scaling: str = "none"  # none | linear (position interpolation) | ntk | yarn: RoPE for contexts longer than trained
    rope_scaling_factor: float = 1.0  # how many times longer than rope_original_length (1: no scaling)
    rope_original_length: Optional[int] = None  # the length RoPE was trained at; unset: block_size
    tie_embeddings: bool = True  # the LM head shares the token embedding's weights
    logit_softcap: float = 0.0  # > 0: output logits = c * tanh(logits / c); 0 = off
    zero_init_proj: bool = False  # residual output projections (attn and MLP c_proj) start at zero
    value_embed: bool = False  # each layer adds a learned embedding of the token to its values (modded-nanogpt)
    attn: AttnConfig = field(default_factory=AttnConfig)  # model.attn.*: variants/__init__.py, with the pieces they pick

    RULES: ClassVar[dict] = {
        "vocab_size": POSITIVE, "block_size": POSITIVE, "n_layer": POSITIVE, "n_head": POSITIVE,
        "n_embd": POSITIVE, "n_kv_head": POSITIVE, "d_ff": POSITIVE, "dropout": FRACTION,
        "norm": OneOf(NORMS), "norm_position": OneOf(NORM_POSITIONS), "mlp": OneOf(tuple(ACTIVATIONS)), "pos": OneOf(tuple(POSITIONS)),
        "rope_base": Range(1, lo_open=True, why="the RoPE frequency base"), "rope_scaling": OneOf(tuple(ROPE_SCALINGS)),
        "rope_scaling_factor": Range(1, why="1 is no scaling"), "rope_original_length": POSITIVE,
        "logit_softcap": Range(0, why="0 turns the soft-cap off"),
    }
    ROPE: ClassVar[Needs] = Needs(lambda c: c.pos == "rope", "{p}pos=rope")
    NEEDS: ClassVar[dict] = {"rope_base": ROPE, "rope_scaling": ROPE, "d_ff": Needs(lambda c: c.mlp != "none", "{p}mlp is not none"),
                             "rope_scaling_factor": Needs(lambda c: c.rope_scaling != "none", "{p}rope_scaling is set")}

    def __post_init__(self):
        if isinstance(self.attn, dict):
            self.attn = AttnConfig(**self.attn)
        if self.vocab_size is None:
            raise ConfigError("model.vocab_size is unset: it comes from the data's tokenizer")
        self.ignored = check_values(self, "model", warn=False)  # set but without effect here: ignored
        # what only holds between keys
        if self.n_embd % self.n_head:
            raise ConfigError(f"model.n_embd={self.n_embd} is not divisible by model.n_head="
                              f"{self.n_head}: pick n_embd as a multiple of n_head")
        self.head_dim = self.n_embd // self.n_head
        rotated = [k for k in sorted(kinds(self.attn)) if KINDS[k].rotates_heads]
        if self.head_dim % 2 and self.pos == "rope" and rotated:
            raise ConfigError(f"head size n_embd/n_head={self.head_dim} is odd, but RoPE rotates pairs of channels of "
                              f"each {'/'.join(rotated)} head: make n_embd/n_head even (or model.pos=none)")
        if self.n_head % (self.n_kv_head or self.n_head):
            raise ConfigError(f"model.n_kv_head={self.n_kv_head} must divide model.n_head={self.n_head} "
                              "(n_head for multi-head, 1 for multi-query attention)")
        if self.d_ff is None:
            self.d_ff = 64 * math.ceil(8 * self.n_embd / 3 / 64) if self.mlp == "swiglu" else 4 * self.n_embd
        self.attn_scale = resolve_scale(self.attn.scale, self.head_dim)
        # the channels RoPE rotates, as the kinds answer: a head's, or MLA's decoupled part (variants/mla.py)
        self.rope_dim = min(filter(None, (KINDS[k].rope_width(self) for k in kinds(self.attn))), default=self.head_dim)
        if self.rope_original_length is None:
            self.rope_original_length = self.block_size
        self.ignored += check(self)  # what each chosen piece refuses, or ignores (n_kv_head as given: None, n_head)
        self.n_kv_head = max(KINDS[k].kv_heads(self) for k in kinds(self.attn))  # set once: what the kinds make of it


# ----------------------------------------------------------------------------- MLP, norm, blocks

class MLP(nn.Module):
    """GPT-2's MLP, c_proj(act(c_fc(x))), hidden width d_ff (4 * n_embd by default): act is gelu, or
    ReLU² or SwiGLU (variants/mlps.py; SwiGLU's c_fc makes its gate and up side by side)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.act, parts = ACTIVATIONS[config.mlp]
        self.c_fc = nn.Linear(config.n_embd, parts * config.d_ff, bias=config.bias)
        self.c_proj = nn.Linear(config.d_ff, config.n_embd, bias=config.bias)
        self.dropout = Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


def make_norm(config: GPTConfig) -> nn.Module:
    """LayerNorm (mean and variance, GPT-2) or RMSNorm (root mean square only, Llama)."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=NORM_EPS)
    return nn.LayerNorm(config.n_embd, eps=NORM_EPS, bias=config.bias)


class Block(nn.Module):
    """Pre-LN: x + attn(ln_1(x)), then x + mlp(ln_2(x)); the residual stream is never normalised.
    Hook points with TransformerLens' names (blocks.{l}.hook_*): the stream before the block
    (hook_resid_pre), after attention (hook_resid_mid) and after it (hook_resid_post), and what
    attention and the MLP add to it (hook_attn_out, hook_mlp_out)."""

    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = make_attention(config, layer)  # the layer's kind, its slots filled (variants/)
        if ACTIVATIONS[config.mlp]:  # model.mlp=none: attention alone (the synthetic-recall models)
            self.ln_2 = make_norm(config)
            self.mlp = MLP(config)
        self.hook_resid_pre, self.hook_resid_mid, self.hook_resid_post = HookPoint(), HookPoint(), HookPoint()
        self.hook_attn_out, self.hook_mlp_out = HookPoint(), HookPoint()

    def forward(self, x, **kw):
        """kw: what the attention needs (rope, cache, pos, window, ve; CausalSelfAttention.forward)."""
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(x + self.hook_attn_out(self.attn(self.ln_1(x), **kw)))
        if hasattr(self, "mlp"):
            x = x + self.hook_mlp_out(self.mlp(self.ln_2(x)))
        return self.hook_resid_post(x)


class PostNormBlock(Block):
    """Post-LN, the original Transformer's order: ln_1(x + attn(x)), then ln_2(x + mlp(x)). Every
    residual sum is normalised, so gradients to early layers shrink with depth: it needs warmup
    (Xiong et al. 2020, arXiv 2002.04745)."""

    def forward(self, x, **kw):
        x = self.hook_resid_pre(x)
        x = self.hook_resid_mid(self.ln_1(x + self.hook_attn_out(self.attn(x, **kw))))
        if hasattr(self, "mlp"):
            x = self.ln_2(x + self.hook_mlp_out(self.mlp(x)))
        return self.hook_resid_post(x)


# ----------------------------------------------------------------------------- the model

class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        # absolute positions are added to the embeddings (variants/positions.py); RoPE acts inside attention
        self.positions = POSITIONS[config.pos](config) if POSITIONS[config.pos] else None
        self.drop = Dropout(config.dropout)
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
        self.register_buffer("rope", self.rope_table(config.block_size), persistent=False)  # (block_size, hs/2, 2): cos, sin
        self.init_weights()

    def init_weights(self):
        """GPT-2 init: every Linear and embedding ~ N(0, 0.02); the projections into the residual stream
        (c_proj) ~ N(0, 0.02/sqrt(2*n_layer)), so its variance does not grow with depth, or 0 with
        zero_init_proj (each block starts as the identity); biases and learned sink logits 0 (softmax's
        "off by one"); norm weights and QK gains 1; gates are Linear weights (sigmoid starts near 0.5).
        Then a kind's own init_weights (a recurrent layer's decay rates and convolution, variants/)."""
        std_resid = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.zeros_(p) if self.config.zero_init_proj else nn.init.normal_(p, mean=0.0, std=std_resid)
            elif name.endswith(("bias", "sink_logit")):
                nn.init.zeros_(p)
            elif p.dim() < 2 or name.endswith("_gain"):  # QK-Norm's gains are (heads, 1 or hs): 1, not N(0, 0.02)
                nn.init.ones_(p)
            else:
                nn.init.normal_(p, mean=0.0, std=0.02)
        for m in self.modules():  # a kind's own parameters (a recurrent layer's decay, its convolution)
            if m is not self and hasattr(m, "init_weights"):
                m.init_weights()

    def _apply(self, fn, recurse=True):
        """After .to()/.half()/.bfloat16(): the RoPE table stays float32 (cos and sin of large
        angles in bf16 would be wrong, and complex bf16 does not exist)."""
        super()._apply(fn, recurse)
        if self.rope.dtype != torch.float32:
            self.rope = self.rope_table(self.rope.size(0), self.rope.device)
        return self

    def rope_theta(self, device=None):
        """RoPE's frequencies and temperature, scaled as model.rope_scaling says (variants/rope_scaling.py)."""
        c = self.config
        scaling = ROPE_SCALINGS[c.rope_scaling if c.rope_scaling_factor != 1 else "none"]
        return scaling(c.rope_dim, c.rope_base, c.rope_scaling_factor, c.rope_original_length, device)

    def rope_table(self, length: int, device=None):
        """cos and sin of RoPE's angles for positions 0..length-1."""
        return rope_table(self.config.rope_dim, length, self.config.rope_base, device, *self.rope_theta(device))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())  # a tied embedding counts once

    def rope_at(self, start: int, T: int):
        """RoPE factors for positions start..start+T-1 (None without RoPE), grown on demand."""
        if not self.rotary:
            return None
        if torch.is_tensor(start):  # a compiled decode step: the position is data (T = 1)
            return self.rope.index_select(0, start)
        if start + T > self.rope.size(0):  # a normal tensor even when grown under inference_mode (sampling),
            with torch.inference_mode(False):  # so a later forward with autograd can still use it
                self.rope = self.rope_table(2 * (start + T), self.rope.device)
        return self.rope[start:start + T]

    @property
    def slides(self) -> bool:
        """Can a KV cache slide past block_size? Not with an absolute position table (re-prefill then)."""
        return self.positions is None

    def forward(self, idx, targets=None, *, cache=None, pos: int = 0, window=None):
        """idx (B, T) token ids -> logits (B, T, vocab), plus the mean next-token loss if targets. cache:
        one cache per layer, idx at positions pos..pos+T-1; window: each query sees the latest `window`
        positions in every layer (what a sliding cache computes past block_size: idx may be longer)."""
        B, T = idx.shape
        if cache is None and window is None and T > self.config.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={self.config.block_size}")
        if self.positions is not None and not torch.is_tensor(pos) and pos + T > self.config.block_size:
            raise ValueError(f"positions up to {pos + T} but model.pos={self.config.pos} has a table of "
                             f"{self.config.block_size}")
        rope = self.rope_at(pos, T)
        x = self.wte(idx)  # (B, T, C)
        if self.positions is not None:
            x = x + self.positions(pos, T)
        x = self.drop(x)
        ves = [None] * len(self.blocks) if self.value_embeds is None else [e(idx) for e in self.value_embeds]
        for i, block in enumerate(self.blocks):
            x = block(x, rope=rope, cache=None if cache is None else cache[i], pos=pos, window=window,
                      ve=ves[i])
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab)
        if self.config.logit_softcap:  # smoothly bounded logits: |logit| < c (Gemma 2)
            logits = self.config.logit_softcap * torch.tanh(logits / self.config.logit_softcap)
        if targets is None:
            return logits
        # teacher forcing: every position predicts its successor in one pass
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1), ignore_index=-1)
        return logits, with_aux_losses(loss, [block.attn for block in self.blocks])  # e.g. an indexer's KL

    def new_kv_cache(self, batch_size: int, length: int, device=None, dtype=None, static=False, sinks: int = 0,
                     **options):
        """One cache per layer for generation, as its mixer keeps one (new_cache: K and V of up to `length`
        positions, MLA's latents, a recurrent state), kept as the settings ask (variants.cache_maker)."""
        p = self.wte.weight
        device = device or p.device
        make = cache_maker(dtype, static, sinks, self.rope_theta(device)[0] if self.rotary and sinks else None)
        dtype = p.dtype if dtype in (None, torch.int8) else dtype  # an int8 cache returns the model's dtype
        return [block.attn.new_cache(batch_size, length, device=device, dtype=dtype, make=make, **options)
                for block in self.blocks]
