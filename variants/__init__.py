"""Every piece beyond the default path, one small file each, and the one table that picks them.

attention.py and model.py hold the default path (softmax attention on SDPA, RoPE, QK-Norm, a KV
cache, Pre-LN blocks). Each file here adds one piece and opens by naming the core method or slot it
fills, its paper and its test file:

    file             chosen by                             fills
    tiled.py         model.attn.impl=tiled                 the attention module's path slot
    selected.py      model.attn.impl=gathered              the path slot: only the blocks select=moba chose
    alibi.py         model.pos=alibi                       its logit-bias slot
    sinks.py         model.attn.sink=zero|learned          its sink slot (and the fused path's sink key)
    gates.py         model.attn.gate=head|channel          its output-gate slot
    moba.py          model.attn.select=moba                its key-selection slot (blocks chosen by content)
    oracle.py        model.attn.select=oracle              its key-selection slot (the exact top-k keys)
    indexer.py       model.attn.select=indexer             its key-selection slot (a learned scorer's top-k keys)
    linear.py        model.attn.kind=linear                a kind: forward, new_cache, its counts
    mla.py           model.attn.kind=mla                   a kind: make_projections, forward, new_cache, its counts
    gdn.py           model.attn.kind=gdn                   a kind: Gated DeltaNet (a recurrent state)
    mamba2.py        model.attn.kind=mamba2                a kind: Mamba-2's SSD mixer (a recurrent state)
                     model.attn.layer_kinds=[gdn,softmax]  a kind per layer, repeated (hybrid stacks)
    rope_scaling.py  model.rope_scaling=linear|ntk|yarn    RoPE's frequencies (GPT.rope_table)
    positions.py     model.pos=learned|sinusoidal          the model's position table (GPT.positions)
    mlps.py          model.mlp=relu2|swiglu                the MLP's activation (model.MLP.act)
    int8_cache.py    sample.py kv_dtype=int8               a KV cache (new_cache's make)
    sink_cache.py    sample.py kv_sinks=S                  a KV cache (new_cache's make)

The tables below map each config value to its piece. model.py reads them once, at construction
(make_attention, GPT.__init__, GPT.rope_table, GPT.new_kv_cache), and a key's legal values are its
table's keys. A new kind is one file and one row of KINDS, nothing else: a subclass of
mixer.Mixer (or of attention.CausalSelfAttention, for a softmax kind that overrides named methods)
with its make_projections, forward, new_cache and its counts (params, projections, mixing_macs,
cache_rows or state_numbers; rope_width; kv_heads) and its flags (softmax, recurrent, selects,
takes_qk_norm, takes_gate, groups_kv, options: what the config checks ask, so a key the kind takes is
never reported as ignored), which lab/counting.py, the probe and generation ask; a static
`check(config)` that refuses, in one line, the options it cannot take and returns those it ignores;
`effective_attention` if the maps should draw it. tests/test_mixer.py registers such a kind from a
test file. An add-on fills a slot instead: a row in PATHS, BIASES, SINKS, GATES or SELECTS; the
pieces count their own parameters and bytes (a gate's params, a sink's, an int8 cache's token_bytes).
"""
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, List, Optional

import torch
import torch.nn.functional as F

from attention import CausalSelfAttention, Mask, reference_attention, sdpa_attention
from kv_cache import KVCache, StaticKVCache
from rules import Needs, OneOf, Range, Rule, UserError, positive_number
from variants.alibi import ALiBi
from variants.gates import ChannelGate, HeadGate
from variants.indexer import Indexer
from variants.int8_cache import Int8KVCache
from variants.gdn import GatedDeltaNet
from variants.linear import LinearAttention
from variants.mamba2 import Mamba2
from variants.mlps import relu2, swiglu
from variants.mla import LatentAttention
from variants.moba import MoBA
from variants.oracle import Oracle
from variants.positions import LearnedPositions, SinusoidalPositions
from variants.rope_scaling import ROPE_SCALINGS  # noqa: F401  (model.rope_scaling: none, linear, ntk, yarn)
from variants.sink_cache import SinkKVCache
from variants.sinks import LearnedSink, ZeroSink
from variants.selected import gathered_attention
from variants.tiled import tiled_attention

# ----------------------------------------------------------------------------- the table

KINDS = {"softmax": CausalSelfAttention, "linear": LinearAttention, "mla": LatentAttention,  # model.attn.kind,
         "gdn": GatedDeltaNet, "mamba2": Mamba2}  # or each layer's: model.attn.layer_kinds
PATHS = {  # model.attn.impl: the path, given the tile size (model.attn.block)
    "sdpa": lambda block: sdpa_attention,  # a layer with a sink: the sink's wrap (variants/sinks.py)
    "reference": lambda block: reference_attention,
    "tiled": lambda block: partial(tiled_attention, block=block),
    "gathered": lambda block: gathered_attention,  # with select=moba: only the chosen blocks (variants/selected.py)
}
SINKS = {"none": None, "zero": ZeroSink, "learned": LearnedSink}  # model.attn.sink
GATES = {"none": None, "head": HeadGate, "channel": ChannelGate}  # model.attn.gate
SELECTS = {"none": None, "moba": MoBA, "oracle": Oracle, "indexer": Indexer}  # model.attn.select
POSITIONS = {"rope": None, "none": None, "alibi": None,  # model.pos: a table added to the embeddings,
             "learned": LearnedPositions, "sinusoidal": SinusoidalPositions}
BIASES = {"alibi": ALiBi}  # model.pos: or a bias on the logits
CACHE_LAYOUTS = {"MLA (latent + RoPE key)": LatentAttention.layout}  # counting.cache_table: other caches of a shape
ACTIVATIONS = {"gelu": (F.gelu, 1), "relu2": (relu2, 1), "swiglu": (swiglu, 2),  # model.mlp: (act, c_fc's parts)
               "none": None}  # no MLP: a block is its attention alone


@dataclass
class AttnConfig:
    """The attention's options, `model.attn.*` (GPTConfig.attn): each picks a piece of the tables
    above, or shapes the default path (the scale, QK-Norm and windows: attention.py)."""
    scale: str = "sqrt_dk"  # sqrt_dk (1/sqrt(d_k)) | none (1.0) | dk (1/d_k) | a positive number
    qk_norm: bool = False  # normalise q and k per head before RoPE
    qk_norm_type: str = "rms"  # rms | layer | l2 (all parameter-free unless qk_norm_gain is set)
    qk_norm_gain: str = "none"  # none | head (one scalar per head) | channel (one per head dim)
    impl: str = "sdpa"  # sdpa (fast) | reference (plain math) | tiled (FlashAttention's algorithm, variants/tiled.py) | gathered (select=moba's blocks only)
    block: int = 128  # impl=tiled: queries and keys per tile
    window: Optional[int] = None  # each query sees only the latest `window` keys (itself included); unset: all
    window_pattern: str = "L"  # with a window: L (local) or G (global) per layer, repeated over the layers (LG: alternating)
    kind: str = "softmax"  # softmax | linear (phi(q).phi(k)) | mla (latent KV) | gdn (Gated DeltaNet) | mamba2 (SSD)
    layer_kinds: Optional[List[str]] = None  # a kind per layer, repeated over the layers (a hybrid: [gdn,gdn,gdn,softmax])
    gate: str = "none"  # none | head | channel: sigmoid gate from the layer input on each head's output
    sink: str = "none"  # none | zero (softmax with an extra zero logit, "off by one") | learned (a logit per head)
    kv_lora_rank: Optional[int] = None  # kind=mla: the latent's width d_c; unset: 4 * head_dim
    q_lora_rank: Optional[int] = None  # kind=mla: a query latent's width too; unset: queries straight from x
    rope_head_dim: Optional[int] = None  # kind=mla: the decoupled RoPE key/query width; unset: head_dim / 2
    state_dim: Optional[int] = None  # kind=mamba2: the state's width per head (B and C); unset: head_dim
    select: str = "none"  # none | moba (blocks chosen by q.mean(K)) | oracle (the top keys by weight) | indexer (a learned scorer's): softmax layers
    select_block: int = 64  # select=moba: keys per block
    select_topk: int = 4  # select=moba: earlier blocks each query reads (besides its own); oracle, indexer: keys
    indexer_heads: int = 4  # select=indexer: the indexer's heads H
    indexer_dim: int = 16  # select=indexer: the width d of each indexer head and of its one key head
    indexer_kl: float = 1.0  # select=indexer: the weight of its KL loss (0: it does not learn; variants/indexer.py)
    softcap: float = 0.0  # > 0: attention logits c*tanh(s/c) (Gemma 2: 50); the layer takes the reference path; 0 = off

    RULES: ClassVar[dict] = {
        "scale": Rule(lambda v: str(v) in ("sqrt_dk", "none", "dk") or positive_number(v),
                      "sqrt_dk, none, dk or a positive number"),
        "qk_norm_type": OneOf(("rms", "layer", "l2")), "qk_norm_gain": OneOf(("none", "head", "channel")), "impl": OneOf(tuple(PATHS)),
        "block": Range(1, 65536), "window": Range(1, why="keys a query sees, itself included"),
        "window_pattern": Rule(lambda v: bool(v) and set(str(v)) <= {"L", "G"}, "a string of L (local) and G (global)"),
        "kind": OneOf(KINDS), "layer_kinds": OneOf(KINDS), "gate": OneOf(tuple(GATES)),  # KINDS itself: a row added later is legal
        "sink": OneOf(tuple(SINKS)), "kv_lora_rank": Range(1), "q_lora_rank": Range(1),
        "rope_head_dim": Range(2, why="RoPE rotates pairs of channels"), "state_dim": Range(1),
        "select": OneOf(tuple(SELECTS)), "select_block": Range(1), "select_topk": Range(1),
        "indexer_heads": Range(1), "indexer_kl": Range(0, why="0 leaves the indexer untrained"),
        "softcap": Range(0, why="0 turns the soft-cap off"),
        "indexer_dim": Rule(lambda v: Range(2).contains(v) and v % 2 == 0, "an even integer >= 2 (RoPE rotates pairs)"),
    }
    # each option must change what the model computes: set where no layer uses it, it is ignored and said
    SOFTMAX: ClassVar[Needs] = Needs(lambda a: softmax_kinds(a), "a layer is softmax or mla ({p}kind "
                                     "or {p}layer_kinds: the others have no softmax, no logits, no N x N table)")
    QK_NORM: ClassVar[Needs] = Needs(lambda a: a.qk_norm, "{p}qk_norm=true")
    NEEDS: ClassVar[dict] = {
        "impl": SOFTMAX, "scale": SOFTMAX, "window": SOFTMAX, "sink": SOFTMAX, "softcap": SOFTMAX, "qk_norm_type": QK_NORM,
        "qk_norm_gain": QK_NORM,
        "qk_norm": Needs(lambda a: taking(a, "takes_qk_norm"), "a layer's kind takes it ({p}kind or {p}layer_kinds: "
                         + ", ".join(k for k in KINDS if KINDS[k].takes_qk_norm) + "; MLA's keys come from its latent, "
                         "gdn normalises q and k itself)"),
        "gate": Needs(lambda a: taking(a, "takes_gate"), "a layer's kind takes it ({p}kind or {p}layer_kinds: "
                      + ", ".join(k for k in KINDS if KINDS[k].takes_gate) + "; gdn and mamba2 gate their output themselves)"),
        **{key: Needs(lambda a, key=key: [k for k in kinds(a) if key in KINDS[k].options],
                      "a layer is " + " or ".join(k for k in KINDS if key in KINDS[k].options) + " ({p}kind or {p}layer_kinds)")
           for key in sorted({o for kind in KINDS.values() for o in kind.options})},  # a kind's own options
        "kind": Needs(lambda a: not a.layer_kinds, "{p}layer_kinds is unset (it names every layer's kind)"),
        "block": Needs(lambda a: a.impl == "tiled", "{p}impl=tiled"),
        "window_pattern": Needs(lambda a: a.window is not None, "{p}window=W"),
        "select": Needs(lambda a: selecting_kinds(a), "a layer is softmax ({p}kind or {p}layer_kinds)"),
        "select_block": Needs(lambda a: a.select == "moba", "{p}select=moba"),
        "select_topk": Needs(lambda a: a.select != "none", "{p}select=moba, oracle or indexer"),
        **dict.fromkeys(("indexer_heads", "indexer_dim", "indexer_kl"), Needs(lambda a: a.select == "indexer",
                                                                            "{p}select=indexer")),
    }


def taking(a, flag: str) -> set:
    """The kinds the layers have whose class sets `flag` (takes_qk_norm, takes_gate, groups_kv, ...)."""
    return {k for k in kinds(a) if getattr(KINDS[k], flag)}


def kinds(a) -> set:
    """The attention kinds the layers have: model.attn.layer_kinds' or model.attn.kind."""
    return set(a.layer_kinds) if a.layer_kinds else {a.kind}


def softmax_kinds(a) -> set:
    """The kinds the layers have whose weights are a softmax of logits (an N x N table: windows, sinks, soft-caps)."""
    return {k for k in kinds(a) if KINDS[k].softmax}


def selecting_kinds(a) -> set:
    """The kinds the layers have that take a choice of keys by content (model.attn.select)."""
    return {k for k in kinds(a) if KINDS[k].selects}


def layer_kind(a, layer: int) -> str:
    """Layer `layer`'s kind: its entry of layer_kinds (repeated over the layers), else model.attn.kind."""
    return a.layer_kinds[layer % len(a.layer_kinds)] if a.layer_kinds else a.kind


def make_attention(config, layer: int):
    """Layer `layer`'s mixer: its kind, with its slots filled from the table."""
    a, kind = config.attn, KINDS[layer_kind(config.attn, layer)]
    sink = SINKS[a.sink] if kind.softmax else None
    path = PATHS[a.impl](a.block)
    return kind(config, layer, path=sink.wrap(path) if sink else path, bias=BIASES.get(config.pos), sink=sink,
                gate=GATES[a.gate] if kind.takes_gate else None, select=SELECTS[a.select] if kind.selects else None)


def check(config) -> list:
    """What the chosen pieces cannot take, refused in one line before anything is built; returns the
    settings they ignore (a line each, as rules.check_values gives them)."""
    used = kinds(config.attn)
    if config.attn.impl in ("tiled", "gathered") and config.dropout > 0:
        raise UserError(f"model.attn.impl={config.attn.impl} does not drop attention weights: set model.dropout=0 "
                        f"(now {config.dropout}) or use impl=sdpa")
    rotating = {k: KINDS[k].rotates_heads for k in used if KINDS[k].rope_width(config) is not None}
    if config.pos == "rope" and len(set(rotating.values())) > 1:  # RoPE of a whole head beside a part of one
        whole, part = (sorted(k for k, v in rotating.items() if v == w) for w in (True, False))
        raise UserError(f"model.attn.layer_kinds={list(config.attn.layer_kinds)} mixes {' and '.join(part)} with "
                        f"{' and '.join(whole)} layers, whose RoPE rotates a whole head while {part[0]}'s rotates its "
                        f"own small part: not implemented; mix {part[0]} with kinds without RoPE, or use model.pos=none")
    if config.attn.select != "none" and selecting_kinds(config.attn):
        taken = {"a window": config.attn.window is not None, "ALiBi": config.pos == "alibi",
                 "the tiled path": config.attn.impl == "tiled"}
        clash = [name for name, on in taken.items() if on]
        if clash:
            raise UserError(f"model.attn.select={config.attn.select} chooses keys by content; with {clash[0]} it is "
                            "not implemented: use one or the other")
    if config.attn.softcap and config.attn.impl in ("tiled", "gathered") and softmax_kinds(config.attn):
        raise UserError(f"model.attn.softcap={config.attn.softcap} caps scores that model.attn.impl={config.attn.impl} "
                        "never writes out: use impl=sdpa or reference (a capped layer attends by the reference path)")
    a, n_layer = config.attn, config.n_layer
    if a.layer_kinds is not None and len(a.layer_kinds) > n_layer:  # kinds past the last layer would never be built
        raise UserError(f"model.attn.layer_kinds={list(a.layer_kinds)} names {len(a.layer_kinds)} layers but "
                        f"model.n_layer={n_layer}: the last {len(a.layer_kinds) - n_layer} would never be used; give "
                        f"at most {n_layer} (a shorter list repeats over the layers)")
    ignored = []
    windowed = softmax_kinds(a)  # the kinds with an N x N table to window (linear, gdn, mamba2: none)
    if a.window is not None and used & windowed and not any(layer_kind(a, i) in windowed and a.window_pattern[i % len(a.window_pattern)]
                                        == "L" and a.window < config.block_size for i in range(n_layer)):
        ignored.append(f"model.attn.window={a.window} with window_pattern={a.window_pattern!r} windows no layer here "
                       f"(a window acts on softmax or mla layers marked L, and only below model.block_size="
                       f"{config.block_size}): ignored")
    if a.select != "none" and selecting_kinds(a):
        why = SELECTS[a.select].reads_everything(a, config.block_size)
        if why:
            ignored.append(f"model.attn.select={a.select} selects nothing away at model.block_size={config.block_size}: "
                           f"{why} (the model computes dense attention)")
    if config.attn.impl == "gathered" and config.attn.select != "moba" and selecting_kinds(config.attn):  # sdpa's mask then
        ignored.append(f"model.attn.impl='gathered' has no effect unless model.attn.select=moba (the blocks it reads; "
                       f"now {config.attn.select!r}): ignored (its default is 'sdpa')")
    if config.n_kv_head not in (None, config.n_head) and not taking(a, "groups_kv"):
        first = layer_kind(a, 0)
        ignored.append(f"model.n_kv_head={config.n_kv_head} has no effect on a {first} layer "
                       f"({KINDS[first].ungrouped}): ignored")
    for name in sorted(used):
        ignored += getattr(KINDS[name], "check", lambda c: [])(config)
    return list(dict.fromkeys(ignored))


def cache_maker(dtype=None, static: bool = False, sinks: int = 0, theta=None):
    """The KV cache sample.py's settings ask for, as a maker for new_cache: StaticKVCache for a
    compiled decode step, Int8KVCache for dtype=torch.int8, SinkKVCache keeping `sinks` first tokens
    (theta: RoPE's frequencies, to move its keys), else KVCache."""
    if static and (sinks or dtype == torch.int8):
        raise UserError("a compiled decode step supports neither an int8 cache nor sink tokens: use compile=false")
    if dtype == torch.int8 and sinks:
        raise UserError("an int8 cache does not keep sink tokens: use kv_dtype=auto with kv_sinks, or no kv_sinks")
    if sinks:
        return partial(SinkKVCache, sinks=sinks, theta=theta)
    return StaticKVCache if static else Int8KVCache if dtype == torch.int8 else KVCache


def attention(q, k, v, scale: float, *, impl: str = "sdpa", block: int = 128, causal: bool = True, window=None,
              **keys):
    """Any path by name, as tests and tools compare them: softmax(q·kᵀ·scale + M)·v for q (B, nh, Tq,
    hs) and k, v (B, n_kv, Tk, hs), M causal (the queries the last Tq positions; within `window` if
    given) or nothing (causal=False); keys: what else every path takes (bias, sink, dropout_p)."""
    mask = Mask(q.size(-2), k.size(-2), window) if causal else None
    path = PATHS[impl](block)
    if keys.get("sink") is not None:
        path = ZeroSink.wrap(path)
    elif "sink" in keys:
        del keys["sink"]  # no sink: the paths' own signature
    return path(q, k, v, scale=scale, mask=mask, **keys)
