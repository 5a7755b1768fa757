"""Conversion of an attnlab model to Hugging Face transformers, exactly: which stock architecture
computes it (or attnlab's own files as custom code), its config, its weights moved and permuted, the
tokenizer, the model card, and a reload that compares logits. tools/export.py is the command (the
routes and how each weight moves are in its docstring, and in docs/export.md); it writes the directory."""
import ast
import dataclasses
import inspect
import json
import math
import re
import shutil
import textwrap
from pathlib import Path

import torch

from attention import qk_normalize
from data.tokenizer import EOT, tokenizer_from_dict
from model import GPT, NORM_EPS, GPTConfig
from rules import UserError

BOS = "<|bos|>"  # the exported name of data.bos's token
QK_NORM_EPS = inspect.signature(qk_normalize).parameters["eps"].default  # attnlab's per-head norm eps
LOGIT_TOL = 1e-4  # |exported - attnlab| logits allowed, times max(1, |logit|) for large models


class NoCounterpart(UserError):
    """An attnlab option that no stock transformers architecture computes."""

    def __init__(self, option: str, why: str):
        self.option, self.why = option, why
        super().__init__(f"{option} has no exact counterpart in transformers ({why}): cannot export this model "
                         "as a stock class (format=code exports it as custom code)")


def no_counterpart(option: str, why: str):
    raise NoCounterpart(option, why)


# ----------------------------------------------------------------------------- which architecture

# The model options the stock mappings below read. Any other option (one added after these
# mappings were written, too) set away from its default has no stock mapping: format=auto then
# writes custom code, which computes every option by construction.
STOCK_OPTIONS = {"vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head", "dropout", "bias", "norm",
                 "norm_position", "mlp", "d_ff", "pos", "rope_base", "tie_embeddings", "logit_softcap",
                 "zero_init_proj", "value_embed", "attn.scale", "attn.qk_norm", "attn.qk_norm_type",
                 "attn.qk_norm_gain", "attn.impl", "attn.block", "rope_original_length"}
UNMAPPED_WHY = {"attn.window": "the mapped classes attend to every earlier token",
                "rope_scaling": "the stock mappings here carry RoPE unscaled",
                "rope_scaling_factor": "the stock mappings here carry RoPE unscaled",
                "attn.gate": "the mapped classes do not gate attention",
                "attn.sink": "the mapped classes' softmax has no sink",
                "attn.window_pattern": "the mapped classes attend to every earlier token",
                "attn.kind": "the mapped classes' attention is a softmax of q.k",
                "attn.softcap": "the mapped classes do not cap attention logits"}


def pick_target(c: GPTConfig) -> str:
    """gpt2, gpt_neox, llama or qwen3: the stock architecture that computes the model `c` describes."""
    ours, base = flat_fields(c), flat_fields(GPTConfig(vocab_size=c.vocab_size))
    for key, value in ours.items():
        if key not in STOCK_OPTIONS and value != base[key]:
            no_counterpart(f"model.{key}={value}", UNMAPPED_WHY.get(key, "no stock mapping here computes it"))
    if c.norm_position != "pre":
        no_counterpart(f"model.norm_position={c.norm_position}", "GPT-2, GPT-NeoX, Llama and Qwen3 are Pre-LN")
    if c.logit_softcap:
        no_counterpart(f"model.logit_softcap={c.logit_softcap}", "GPT-2, GPT-NeoX, Llama and Qwen3 do not cap logits")
    if c.value_embed:
        no_counterpart("model.value_embed=true", "GPT-2, GPT-NeoX, Llama and Qwen3 have no value embeddings")
    if c.pos == "alibi":
        no_counterpart("model.pos=alibi", "the stock mappings here have no ALiBi bias")
    if c.pos != "rope":  # a table added to the embeddings: GPT-2's wpe holds any (zeros for none)
        if c.attn.qk_norm:
            no_counterpart(f"model.attn.qk_norm=true with model.pos={c.pos}",
                           "GPT-2, the absolute-position architecture, has no QK-Norm")
        if c.norm != "layernorm":
            no_counterpart(f"model.norm={c.norm} with model.pos={c.pos}",
                           "GPT-2, the absolute-position architecture, normalises with LayerNorm")
        if c.mlp == "swiglu":
            no_counterpart(f"model.mlp=swiglu with model.pos={c.pos}", "GPT-2's MLP is not gated")
        return "gpt2"
    if c.attn.qk_norm:
        if c.attn.qk_norm_type != "rms":
            no_counterpart(f"model.attn.qk_norm_type={c.attn.qk_norm_type}",
                           "Qwen3, the per-head QK-Norm architecture, normalises q and k with RMSNorm")
        if c.attn.qk_norm_gain != "none":
            no_counterpart(f"model.attn.qk_norm_gain={c.attn.qk_norm_gain}",
                           "Qwen3's q_norm/k_norm hold one gain vector shared by all heads, attnlab one per head")
        if (c.norm, c.mlp) != ("rmsnorm", "swiglu"):
            no_counterpart(f"model.attn.qk_norm=true with model.norm={c.norm} model.mlp={c.mlp}",
                           "Qwen3, the per-head QK-Norm architecture, has RMSNorm blocks and a SwiGLU MLP")
        if c.bias:
            no_counterpart("model.bias=true with model.attn.qk_norm=true", "Qwen3's MLP has no biases")
        return "qwen3"
    if c.norm == "layernorm":
        if c.mlp == "swiglu":
            no_counterpart("model.mlp=swiglu with model.norm=layernorm",
                           "GPT-NeoX's MLP is not gated and Llama normalises with RMSNorm")
        return "gpt_neox"
    if c.mlp != "swiglu":
        no_counterpart(f"model.mlp={c.mlp} with model.norm=rmsnorm",
                       "Llama's MLP is SwiGLU and GPT-NeoX normalises with LayerNorm")
    return "llama"


TARGET_CLASSES = {"gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM", "llama": "LlamaForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "code": "AttnlabForCausalLM (custom code, trust_remote_code=True)"}


def choose_format(fmt: str, c: GPTConfig):
    """(target, why): the stock architecture that computes the model exactly, or "code" (attnlab's
    own model files as custom code), and why, for the one line export prints."""
    if fmt == "code":
        return "code", "as asked (format=code)"
    try:
        target = pick_target(c)
    except NoCounterpart as e:
        if fmt == "stock":
            raise
        return "code", f"since {e.option} has no exact counterpart in transformers ({e.why})"
    return target, "a stock class that computes this model exactly (no custom code)"


def hf_config(c: GPTConfig, target: str, bos, eos):
    """The transformers config of the model `c` describes."""
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig, Qwen3Config

    if target == "gpt2":
        return GPT2Config(vocab_size=c.vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer,
                          n_head=c.n_head, n_inner=c.d_ff, activation_function=c.mlp, resid_pdrop=c.dropout,
                          embd_pdrop=c.dropout, attn_pdrop=c.dropout, layer_norm_epsilon=NORM_EPS,
                          tie_word_embeddings=c.tie_embeddings, bos_token_id=bos, eos_token_id=eos,
                          pad_token_id=None, dtype="float32")

    common = dict(vocab_size=c.vocab_size, hidden_size=c.n_embd, num_hidden_layers=c.n_layer,
                  num_attention_heads=c.n_head, intermediate_size=c.d_ff, max_position_embeddings=c.block_size,
                  tie_word_embeddings=c.tie_embeddings, attention_dropout=c.dropout, bos_token_id=bos,
                  eos_token_id=eos, pad_token_id=None, attention_bias=c.bias, dtype="float32",
                  rope_parameters={"rope_type": "default", "rope_theta": c.rope_base})
    if target == "gpt_neox":
        common["rope_parameters"]["partial_rotary_factor"] = 1.0  # its default rotates only a quarter
        common["attention_bias"] = True  # zeros without model.bias: TransformerLens' NeoX adapter needs them
        return GPTNeoXConfig(**common, hidden_act=c.mlp, layer_norm_eps=NORM_EPS, hidden_dropout=c.dropout,
                             use_parallel_residual=False)  # its default adds attn and MLP of one input
    gqa = dict(num_key_value_heads=c.n_kv_head, head_dim=c.head_dim, hidden_act="silu", rms_norm_eps=NORM_EPS)
    if target == "llama":
        return LlamaConfig(**common, **gqa, mlp_bias=c.bias)
    return Qwen3Config(**common, **gqa, use_sliding_window=False)


# ----------------------------------------------------------------------------- weights

def rope_halves(rows, heads: int, hs: int):
    """q or k rows (heads*hs, ...) reordered per head from interleaved pairs (2j, 2j+1) to halves
    (j, j + hs/2): new channel j is old 2j, new j + hs/2 is old 2j+1."""
    perm = torch.cat((torch.arange(0, hs, 2), torch.arange(1, hs, 2)))
    return rows.unflatten(0, (heads, hs))[:, perm].flatten(0, 1)  # (heads, hs, ...) -> (heads*hs, ...)


def qkv_parts(sd: dict, prefix: str, c: GPTConfig, kind: str):
    """c_attn's q, k, v `kind` (weight or bias) of one block in transformers' order: q and k rows
    in halves order (with RoPE) and scaled (see module docstring), v as is. None without biases."""
    t = sd.get(f"{prefix}.attn.c_attn.{kind}")
    if t is None:
        return None
    hs = c.head_dim
    q, k, v = t.split([c.n_head * hs, c.n_kv_head * hs, c.n_kv_head * hs])  # [Q | K | V]
    if c.pos == "rope":
        q, k = rope_halves(q, c.n_head, hs), rope_halves(k, c.n_kv_head, hs)
    if c.attn.qk_norm:  # pre-scale so Qwen3's eps (the block norms') acts as attnlab's QK eps
        q_mult = k_mult = math.sqrt(NORM_EPS / QK_NORM_EPS)
    else:  # attention logits * scale = (q * scale * sqrt(hs)) . k / sqrt(hs)
        q_mult, k_mult = c.attn_scale * math.sqrt(hs), 1.0
    return q * q_mult, k * k_mult, v


def mha_parts(sd: dict, prefix: str, c: GPTConfig, kind: str):
    """qkv_parts with K and V heads repeated for each query head of their group (GQA -> MHA, the
    same function), each as (n_head, hs, ...)."""
    parts = qkv_parts(sd, prefix, c, kind)
    if parts is None:
        return None
    group = c.n_head // c.n_kv_head
    q, k, v = (t.unflatten(0, (-1, c.head_dim)) for t in parts)  # (heads, hs, ...)
    return q, k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)


def gpt2_weights(sd: dict, model: GPT) -> dict:
    """GPT-2's names and layout: Conv1D weights are (in, out), transposed from Linear's; c_attn is
    [Q | K | V] like ours; the position table is the learned one, the sinusoidal one or zeros (NoPE)."""
    c = model.config
    zeros = torch.zeros(c.n_embd)
    table = sd.get("positions.wpe.weight")
    if table is None:
        table = model.positions.table.float().cpu() if c.pos == "sinusoidal" else torch.zeros(c.block_size, c.n_embd)
    w = {"transformer.wte.weight": sd["wte.weight"], "transformer.wpe.weight": table,
         "lm_head.weight": sd["lm_head.weight"], "transformer.ln_f.weight": sd["ln_f.weight"],
         "transformer.ln_f.bias": sd.get("ln_f.bias", zeros)}
    for i in range(c.n_layer):
        p, h = f"blocks.{i}", f"transformer.h.{i}"
        for ln in ("ln_1", "ln_2"):
            w[f"{h}.{ln}.weight"], w[f"{h}.{ln}.bias"] = sd[f"{p}.{ln}.weight"], sd.get(f"{p}.{ln}.bias", zeros)
        for kind in ("weight", "bias"):
            parts = mha_parts(sd, p, c, kind)
            fused = torch.zeros(3 * c.n_embd) if parts is None else torch.cat([t.flatten(0, 1) for t in parts])
            w[f"{h}.attn.c_attn.{kind}"] = fused.t()  # weight (C, 3C) from (3C, C); bias (3C,) as is
        for name, width in (("attn.c_proj", c.n_embd), ("mlp.c_fc", c.d_ff), ("mlp.c_proj", c.n_embd)):
            w[f"{h}.{name}.weight"] = sd[f"{p}.{name}.weight"].t()
            w[f"{h}.{name}.bias"] = sd.get(f"{p}.{name}.bias", torch.zeros(width))
    return w


def neox_weights(sd: dict, c: GPTConfig) -> dict:
    """GPT-NeoX's names and layout: LayerNorm and MLP biases always exist (zeros where we have none)."""
    zeros = torch.zeros(c.n_embd)
    w = {"gpt_neox.embed_in.weight": sd["wte.weight"], "lm_head.weight": sd["lm_head.weight"],
         "gpt_neox.final_layer_norm.weight": sd["ln_f.weight"],
         "gpt_neox.final_layer_norm.bias": sd.get("ln_f.bias", zeros)}
    for i in range(c.n_layer):
        p, h = f"blocks.{i}", f"gpt_neox.layers.{i}"
        for ours, theirs in (("ln_1", "input_layernorm"), ("ln_2", "post_attention_layernorm")):
            w[f"{h}.{theirs}.weight"] = sd[f"{p}.{ours}.weight"]
            w[f"{h}.{theirs}.bias"] = sd.get(f"{p}.{ours}.bias", zeros)
        for kind in ("weight", "bias"):
            parts = mha_parts(sd, p, c, kind)
            fused = torch.zeros(3 * c.n_embd) if parts is None else torch.stack(parts, dim=1).flatten(0, 2)
            w[f"{h}.attention.query_key_value.{kind}"] = fused  # per head [q|k|v]
            w[f"{h}.attention.dense.{kind}"] = sd.get(f"{p}.attn.c_proj.{kind}", zeros)
        w[f"{h}.mlp.dense_h_to_4h.weight"] = sd[f"{p}.mlp.c_fc.weight"]
        w[f"{h}.mlp.dense_h_to_4h.bias"] = sd.get(f"{p}.mlp.c_fc.bias", torch.zeros(c.d_ff))
        w[f"{h}.mlp.dense_4h_to_h.weight"] = sd[f"{p}.mlp.c_proj.weight"]
        w[f"{h}.mlp.dense_4h_to_h.bias"] = sd.get(f"{p}.mlp.c_proj.bias", zeros)
    return w


def llama_weights(sd: dict, c: GPTConfig, qwen3: bool) -> dict:
    """Llama's (and Qwen3's, which adds q_norm and k_norm) parameter names and layout."""
    w = {"model.embed_tokens.weight": sd["wte.weight"], "model.norm.weight": sd["ln_f.weight"],
         "lm_head.weight": sd["lm_head.weight"]}
    for i in range(c.n_layer):
        p, h = f"blocks.{i}", f"model.layers.{i}"
        w[f"{h}.input_layernorm.weight"] = sd[f"{p}.ln_1.weight"]
        w[f"{h}.post_attention_layernorm.weight"] = sd[f"{p}.ln_2.weight"]
        for kind in ("weight", "bias"):
            parts = qkv_parts(sd, p, c, kind)
            if parts is None:
                continue
            for name, t in zip(("q_proj", "k_proj", "v_proj"), parts):
                w[f"{h}.self_attn.{name}.{kind}"] = t
            w[f"{h}.self_attn.o_proj.{kind}"] = sd[f"{p}.attn.c_proj.{kind}"]
            gate, up = sd[f"{p}.mlp.c_fc.{kind}"].chunk(2)  # [gate | up]
            w[f"{h}.mlp.gate_proj.{kind}"], w[f"{h}.mlp.up_proj.{kind}"] = gate, up
            w[f"{h}.mlp.down_proj.{kind}"] = sd[f"{p}.mlp.c_proj.{kind}"]
        if qwen3:  # parameter-free per-head RMS norm; the attention scale rides on q's gain
            w[f"{h}.self_attn.q_norm.weight"] = torch.full((c.head_dim,), c.attn_scale * math.sqrt(c.head_dim))
            w[f"{h}.self_attn.k_norm.weight"] = torch.ones(c.head_dim)
    return w


def hf_weights(model: GPT, target: str) -> dict:
    """attnlab's weights under the target's names and layout, in float32."""
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    if target == "gpt2":
        w = gpt2_weights(sd, model)
    elif target == "gpt_neox":
        w = neox_weights(sd, model.config)
    else:
        w = llama_weights(sd, model.config, qwen3=target == "qwen3")
    bad = [k for k, t in w.items() if not torch.isfinite(t).all()]
    if bad:
        raise UserError(f"the exported weight {bad[0]} is not finite: refusing to write it")
    return {k: t.contiguous().clone() for k, t in w.items()}


def hf_model(c: GPTConfig, model: GPT, target: str, bos, eos):
    """The transformers model, its weights loaded by name (strict: a missing or extra name fails)."""
    from transformers import AutoModelForCausalLM

    config = hf_config(c, target, bos, eos)
    out = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.load_state_dict(hf_weights(model, target), strict=True)
    if c.tie_embeddings:
        out.tie_weights()
    return out.eval()


# ----------------------------------------------------------------------------- custom code

REPO = Path(__file__).resolve().parents[1]
WRAPPER = REPO / "tools" / "export_code"  # configuration_attnlab.py, modeling_attnlab.py
CODE_CLASSES = {"AutoConfig": "configuration_attnlab.AttnlabConfig",
                "AutoModelForCausalLM": "modeling_attnlab.AttnlabForCausalLM"}


def module_file(module: str):
    """The repo file of an attnlab module (`variants` is its package's __init__.py), or None."""
    path = REPO / Path(*module.split("."))
    return next((f for f in (path.with_suffix(".py"), path / "__init__.py") if f.is_file()), None)


def flat_name(module: str) -> str:
    """The module's name in the export's one directory: transformers' loader follows relative
    imports within one directory only, so a package's files lie flat (variants.tiled: variants_tiled)."""
    return module.replace(".", "_")


def repo_imports(source: str, module: str) -> set:
    """The attnlab modules `source` (module `module`) imports, at any depth (a function's own import
    too). Only `from X import ...` is rewritten on export: `import X` of an attnlab module is refused."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(module_file(a.name) for a in node.names):
            raise UserError(f"{module}'s file imports an attnlab module with `import X`: the custom-code export "
                            "rewrites `from X import ...` only; please report this")
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and module_file(node.module):
            found.add(node.module)
    return found


def code_modules() -> dict:
    """{file name: source} of attnlab's model as importable files of one directory: model.py and,
    transitively, every attnlab module it imports (attention.py, mixer.py, rules.py, variants/, ...),
    each copied whole, its imports of the others made relative (`from .attention import ...`), which
    is how transformers' remote-code loader finds and copies them."""
    sources, todo = {}, ["model"]
    while todo:
        module = todo.pop()
        if module not in sources:
            sources[module] = module_file(module).read_text(encoding="utf-8")
            todo += sorted(repo_imports(sources[module], module))
    out = {}
    for module, text in sources.items():
        for dep in sorted(sources, key=len, reverse=True):  # `from variants.tiled import` before `from variants import`
            text = re.sub(rf"^(\s*from\s+){re.escape(dep)}(\s+import\b)", rf"\1.{flat_name(dep)}\2", text, flags=re.M)
        head = f"# attnlab's {module_file(module).relative_to(REPO)}, copied by tools/export.py (format=code); imports made relative\n"
        out[f"{flat_name(module)}.py"] = head + text
    return out


def code_model(c: GPTConfig, model: GPT, bos, eos, tmp: Path):
    """attnlab's model wrapped as custom code: the model files and the wrapper written to `tmp`,
    loaded from there as transformers will load them, attnlab's weights under `model.`."""
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    for name, text in code_modules().items():
        (tmp / name).write_text(text, encoding="utf-8")
    for f in sorted(WRAPPER.glob("*.py")):
        shutil.copyfile(f, tmp / f.name)
    config_cls = get_class_from_dynamic_module(CODE_CLASSES["AutoConfig"], str(tmp))
    model_cls = get_class_from_dynamic_module(CODE_CLASSES["AutoModelForCausalLM"], str(tmp))
    config = config_cls(attnlab=dataclasses.asdict(c), bos_token_id=bos, eos_token_id=eos, pad_token_id=None,
                        dtype="float32", auto_map=dict(CODE_CLASSES), architectures=[model_cls.__name__])
    out = model_cls(config)
    out.model.load_state_dict({k: v.detach().float().cpu() for k, v in model.state_dict().items()}, strict=True)
    return out.eval()


# ----------------------------------------------------------------------------- tokenizer

def byte_symbols() -> dict:
    """GPT-2's bytes-to-unicode table: byte-level BPE vocabularies spell each byte as one printable
    character (the printable ASCII/Latin-1 bytes as themselves, the rest shifted past 255)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(shifted)}}


def bpe_tokenizer(ranks: dict, pattern: str, specials: dict):
    """A `tokenizers` byte-level BPE that encodes as tiktoken does with these ranks: tiktoken
    splits text with `pattern`, then in each piece repeatedly merges the adjacent pair whose
    concatenation has the lowest rank. So every (a, b) with a + b in the vocabulary is a merge,
    ordered by the rank of a + b, and a piece that is itself a token is taken whole
    (ignore_merges), as tiktoken does."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    sym = byte_symbols()
    spell = lambda b: "".join(sym[x] for x in b)  # noqa: E731
    merges = []
    for token, rank in ranks.items():
        splits = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(rank, spell(a), spell(b)) for a, b in sorted(splits, key=lambda s: (ranks[s[0]], ranks[s[1]]))]
    merges.sort(key=lambda m: m[0])  # stable: a token's splits keep their order
    vocab = {spell(t): r for t, r in ranks.items()} | dict(specials)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, a, b in merges], ignore_merges=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tk


def char_tokenizer(chars: str):
    """One token per character, ids in attnlab's order: a BPE with no merges over the whole text
    (no pre-tokenizer), decoded by joining the characters (Fuse)."""
    from tokenizers import Tokenizer, decoders, models

    tk = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(chars)}, merges=[]))
    tk.decoder = decoders.Fuse()
    return tk


def mqar_tokenizer(tok):
    """data=mqar's tokens: whole words (the filler, k1.., v1..) split on whitespace, one id each in
    attnlab's order; decoded joined by spaces."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tk = Tokenizer(models.WordLevel(vocab={tok.name(i): i for i in range(tok.vocab_size)}, unk_token=None))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with a space
    return tk


def char_bos(chars: str) -> str:
    """The character a char vocabulary names its BOS: a newline (where a text, or a paragraph,
    starts), else its first character. Tools need one: lm-evaluation-harness predicts a text's first
    token after a BOS (or EOS) token, and TransformerLens' to_tokens(prepend_bos=True) adds the BOS.
    Adding a new token instead would add a logit no attnlab model has. transformers then counts
    the character as special: decode with skip_special_tokens=False (the pipeline's default is True)
    to keep it in the text."""
    return "\n" if "\n" in chars else chars[0]


def add_bos(tk, bos: int):
    """The bos token of a model trained with data.bos=true: an added special token with its id (one
    past the vocabulary), put before every encoded text as every training window began with it."""
    from tokenizers import AddedToken, processors

    tk.add_special_tokens([AddedToken(BOS, special=True, normalized=False)])
    if tk.token_to_id(BOS) != bos:
        raise UserError(f"the exported tokenizer gives {BOS} the id {tk.token_to_id(BOS)}, the model {bos}: not "
                        "writing it; please report this")
    tk.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                      special_tokens=[(BOS, bos)])


def hf_tokenizer(tok_dict: dict, block_size: int):
    """attnlab's tokenizer as a transformers fast tokenizer (PreTrainedTokenizerFast)."""
    from transformers import PreTrainedTokenizerFast

    tok = tokenizer_from_dict(tok_dict)
    if tok.kind == "char":  # no special token: one of its characters is named BOS (char_bos)
        tk, special = char_tokenizer(tok.chars), {"bos_token": char_bos(tok.chars)}
    elif tok.kind == "mqar":
        tk, special = mqar_tokenizer(tok), {}
    else:  # a named tiktoken encoding or our trained BPE: both are tiktoken Encodings, whose ranks,
        enc = tok.enc  # pattern and special tokens tiktoken keeps in attributes without a public getter
        tk = bpe_tokenizer(enc._mergeable_ranks, enc._pat_str, enc._special_tokens)
        special = {"bos_token": EOT, "eos_token": EOT} if EOT in enc._special_tokens else {}
    if getattr(tok, "bos", None) is not None:  # data.bos=true: a token of its own, before every text as in training
        add_bos(tk, tok.bos)
        special["bos_token"] = BOS
    fast = PreTrainedTokenizerFast(tokenizer_object=tk, model_max_length=block_size,
                                   clean_up_tokenization_spaces=False, **special)
    return tok, fast


def check_tokenizer(tok, fast):
    """The same ids for a text using the whole vocabulary (char) or a mixed sample with
    <|endoftext|> (BPE), after the bos token where the model has one: a cheap guard; tests compare
    whole val splits."""
    if tok.kind == "char":
        text, want = tok.chars, list(range(len(tok.chars)))
    elif tok.kind == "mqar":
        want = list(range(min(tok.vocab_size, 4096)))
        text = " ".join(tok.name(i) for i in want)
    else:
        docs = ["Hello, world! It's 2024:\n\tcafé, naïve, 日本語, emoji 😀 and    spaces.",
                "def f(x):\n    return x**2\n"]
        want = [i for d in docs for i in [*tok.encode(d).tolist(), tok.eot]]
        text = EOT.join(docs) + EOT
    if getattr(tok, "bos", None) is not None:
        want = [tok.bos, *want]
    got = fast(text, verbose=False)["input_ids"]  # longer than model_max_length on purpose: no warning
    if got != want:
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        raise UserError(f"the exported tokenizer encodes differently from attnlab's (first at token {first}): "
                        "not writing it; please report this")


# ----------------------------------------------------------------------------- the model card and the files' portability

def update_json(path: Path, **entries):
    conf = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps({**conf, **entries}, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def make_portable(out: Path, c: GPTConfig, target: str):
    """Also loadable by transformers 4.x: it reads RoPE settings from rope_theta (and GPT-NeoX's
    from rotary_pct, default 0.25, and rotary_emb_base), not from 5.x's rope_parameters, and knows
    the fast tokenizer as PreTrainedTokenizerFast (5.x: TokenizersBackend, an alias of it)."""
    if target not in ("gpt2", "code"):
        legacy = {"rotary_pct": 1.0, "rotary_emb_base": c.rope_base} if target == "gpt_neox" else {}
        update_json(out / "config.json", rope_theta=c.rope_base, **legacy)
    update_json(out / "tokenizer_config.json", tokenizer_class="PreTrainedTokenizerFast")


def flat_fields(c: GPTConfig) -> dict:
    fields = dataclasses.asdict(c)
    attn = fields.pop("attn")
    return {**fields, **{f"attn.{k}": v for k, v in attn.items()}}


def model_card(state: dict, model: GPT, target_cls: str, ckpt: Path, tok, code: bool) -> str:
    c, run = model.config, state.get("config") or {}
    data = run.get("data") or {}
    val = state.get("val_loss")
    ours, base = (flat_fields(x) for x in (c, GPTConfig(vocab_size=c.vocab_size)))
    changed = ", ".join(f"{k}={v}" for k, v in ours.items() if v != base[k] and k != "attn.impl") or "the defaults"
    positions = f"RoPE (base {c.rope_base:g})" if c.pos == "rope" else f"{c.pos} positions (in wpe)"
    tokenizer = tok.spec["name"] if tok.kind == "tiktoken" else tok.kind
    rows = [("architecture", f"`{target_cls}`: {c.n_layer} layers, {c.n_head} heads ({c.n_kv_head} key/value), "
                             f"width {c.n_embd}, {c.mlp} MLP of {c.d_ff}, {c.norm}, {positions}, "
                             f"context {c.block_size}"),
            ("attnlab model", changed),
            ("parameters", f"{model.num_params():,}"),
            ("training data", f"{data.get('name', 'unknown')} (tokenizer: {tokenizer}, vocabulary {tok.vocab_size})"),
            ("steps", str(state.get("step", "unknown"))),
            ("val loss", f"{val:.4f}" if isinstance(val, (int, float)) else "unknown")]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    if code:
        how = ("as custom code: this directory holds attnlab's own model files (model.py, attention.py, variants/ "
               "and what they import) and a transformers wrapper (modeling_attnlab.py), so load it with "
               "`trust_remote_code=True`;")
        past = (f"this wrapper recomputes the context each step, its last {c.block_size} tokens once longer "
                "(sample.py with kv_cache=false)")
    else:
        how, past = "to a stock transformers architecture:", "transformers attends to the whole context"
    intro = (f"A GPT trained with attnlab (checkpoint `{ckpt.name}`) and exported by its `export.py` {how} its "
             f"logits equal attnlab's (fp32) within the trained context of {c.block_size} tokens.")
    outro = ("Generation defaults (generation_config.json) are attnlab's sampler's: temperature 0.8, top-k 200. "
             f"The model was trained on {c.block_size}-token contexts: past that, attnlab's sampler slides a "
             f"{c.block_size}-token window while {past}, so the two agree on prompt plus continuation up to "
             f"{c.block_size} tokens.")
    bos = getattr(tok, "bos", None) is not None
    if bos:
        outro += (f"\n\nEvery training window began with a token of its own (attnlab's data.bos=true), {BOS} here: "
                  "the tokenizer puts it before every text, and decoding with skip_special_tokens=True drops it.")
    elif tok.kind == "char":
        outro += ("\n\nA character vocabulary has no special token, so the tokenizer names a newline (or its first "
                  "character) its BOS: the token lm-evaluation-harness puts before a text (and TransformerLens' "
                  "prepend_bos adds). transformers then drops that character when decoding with skip_special_tokens=True "
                  "(the pipeline's default), hence skip_special_tokens=False above.")
    fill = lambda text: "\n\n".join(textwrap.fill(p, 100) for p in text.split("\n\n"))  # noqa: E731
    remote = ", trust_remote_code=True" if code else ""
    keep_bos = ", skip_special_tokens=False" if tok.kind == "char" and not bos else ""
    prompt = {"char": "ROMEO:", "mqar": "k1 v9 k2 v17 k1"}.get(tok.kind, "Once upon a time")
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [attnlab]
---
# {ckpt.parent.name}

{fill(intro)}

| | |
| --- | --- |
{table}

```python
from transformers import pipeline
generate = pipeline("text-generation", model="PATH/TO/THIS/DIR"{remote})
print(generate("{prompt}", max_new_tokens=100{keep_bos})[0]["generated_text"])
```

{fill(outro)}
"""


# ----------------------------------------------------------------------------- the reload that checks it

@torch.no_grad()
def verify(model: GPT, path: Path, code: bool = False) -> float:
    """Reload the export from disk (fp32, eager attention or its custom code) and compare its logits
    with attnlab's on random tokens at full block_size; refuse it if they differ. Returns the largest
    difference."""
    from transformers import AutoModelForCausalLM

    how = {"trust_remote_code": True} if code else {"attn_implementation": "eager"}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **how).eval()
    idx = torch.randint(model.config.vocab_size, (2, model.config.block_size),
                        generator=torch.Generator().manual_seed(0))
    want, got = model(idx), hf(idx).logits
    diff = (want - got).abs().max().item()
    if not diff <= LOGIT_TOL * max(1.0, want.abs().max().item()):
        raise UserError(f"the exported model's logits differ from attnlab's by up to {diff:.2e}: not writing it; "
                        "please report this")
    return diff
