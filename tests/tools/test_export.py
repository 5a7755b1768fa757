"""export.py: a checkpoint as a transformers model directory with the same logits, the same greedy
continuations and the same tokenization. CPU, offline, fp32, eager attention. The
reference is always attnlab itself (model.py's forward, sample.generate, tokenizer.py), never the
export's own code."""
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from lab import export_hf
from tools import export  # the command; registers its config schema
from lab.checkpoint import model_from_checkpoint
from rules import UserError
from helpers import (SHAKESPEARE, TIKTOKEN_CACHE, compose_cfg, corpus_text, export_chars, export_model, load_export,
                     requires_shared, run_export, write_checkpoint)
from data.prepare import prepare
from attention import apply_rope, rope_table
from model import GPT, GPTConfig
from sample import generate
from data.tokenizer import EOT, tokenizer_from_dict
from train import train

CHARS = export_chars()
BLOCK = 64  # a 5-token prompt and 50 new tokens fit: both sides then see the same context
LLAMA = dict(norm="rmsnorm", mlp="swiglu")

# the three stock families, then variants of each (bias, GQA/MQA, relu2, tied or not, scales)
MAIN = {
    "default": ({}, "GPTNeoXForCausalLM"),
    "llama_gqa": (dict(norm="rmsnorm", mlp="swiglu", n_kv_head=2, tie_embeddings=False), "LlamaForCausalLM"),
    "qk_norm": (dict(norm="rmsnorm", mlp="swiglu", n_kv_head=2, attn={"qk_norm": True}), "Qwen3ForCausalLM"),
}
VARIANTS = {
    **MAIN,
    "default_bias_gqa_relu2_scale": (dict(bias=True, n_kv_head=2, mlp="relu2", attn={"scale": "0.3"}),
                                     "GPTNeoXForCausalLM"),
    "default_untied_scale_none": (dict(tie_embeddings=False, rope_base=500.0, attn={"scale": "none"}),
                                  "GPTNeoXForCausalLM"),
    "llama_mqa_bias_tied_scale_dk": (dict(norm="rmsnorm", mlp="swiglu", n_kv_head=1, bias=True, d_ff=40,
                                          attn={"scale": "dk"}), "LlamaForCausalLM"),
    "qk_norm_mha_untied_scale": (dict(norm="rmsnorm", mlp="swiglu", tie_embeddings=False,
                                      attn={"qk_norm": True, "scale": "2.5"}), "Qwen3ForCausalLM"),
    "gpt2_learned": (dict(pos="learned"), "GPT2LMHeadModel"),
    "gpt2_sinusoidal_gqa_bias_relu2": (dict(pos="sinusoidal", n_kv_head=2, bias=True, mlp="relu2",
                                            attn={"scale": "0.3"}), "GPT2LMHeadModel"),
    "gpt2_nope_untied_scale_dk": (dict(pos="none", tie_embeddings=False, attn={"scale": "dk"}), "GPT2LMHeadModel"),
    # q and k so small that the norms' eps (1e-6 in attnlab, 1e-5 in Qwen3) decides the result
    "qk_norm_tiny_qk": (dict(norm="rmsnorm", mlp="swiglu", n_kv_head=2, attn={"qk_norm": True}, tiny_qk=True),
                        "Qwen3ForCausalLM"),
}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Exports must load from their directory alone: any Hub request fails at once."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def assert_close(got, want, what, tol=1e-4):
    d = (got - want).abs()
    assert d.max() < tol, f"{what}: max diff {d.max():.2e}, mean {d.mean():.2e}"


def check_logits(model: GPT, hf, what):
    """Random token batches at full block_size: every position, every vocabulary entry."""
    c = model.config
    idx = torch.randint(c.vocab_size, (3, c.block_size), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_close(hf(idx).logits, model(idx), what)


def check_greedy(model: GPT, hf, prompt, what):
    """transformers' greedy generate == attnlab's sample.generate at temperature 0, 50 tokens."""
    want = generate(model, prompt, 50, temperature=0)
    hf.generation_config.eos_token_id = None  # never stop early: compare all 50 tokens
    with torch.no_grad():
        got = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=50, do_sample=False,
                          top_k=None, temperature=None)
    assert got.tolist() == want.tolist(), f"{what}: greedy continuations differ"


# ----------------------------------------------------------------------------- the mapping


@pytest.mark.parametrize("name", list(VARIANTS))
def test_random_weights_give_equal_logits(name, tmp_path):
    kw, cls = VARIANTS[name]
    model = export_model(**kw)
    out = run_export(write_checkpoint(tmp_path / "ckpt.pt", model), tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == [cls]
    check_logits(model, load_export(out), name)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_generation_equals_sample_py(name, tmp_path):
    kw, _ = VARIANTS[name]
    model = export_model(seed=3, **kw)
    out = run_export(write_checkpoint(tmp_path / "ckpt.pt", model), tmp_path / "hf")
    prompt = torch.tensor([CHARS.encode("the c").tolist()])
    check_greedy(model, load_export(out), prompt, name)


TRAINED = {
    "default": [],
    "llama_gqa": ["model.norm=rmsnorm", "model.mlp=swiglu", "model.n_head=4", "model.n_kv_head=2",
                  "model.tie_embeddings=false"],
    "qk_norm": ["model.norm=rmsnorm", "model.mlp=swiglu", "model.n_head=4", "model.n_kv_head=2",
                "model.attn.qk_norm=true", "model.attn.scale=0.5"],
    # no stock class: format=auto writes custom code
    "post_norm_layer_qk_norm": ["model.norm_position=post", "model.attn.qk_norm=true",
                                "model.attn.qk_norm_type=layer", "model.attn.qk_norm_gain=head"],
}


@pytest.mark.parametrize("name", list(TRAINED))
def test_trained_model_exports_exactly(name, train_cfg, text_file, tmp_path):
    """A few real training steps (AdamW moves every weight, norms and biases included), exported
    from the run dir as a user would; then logits, greedy text and the model card."""
    cfg = train_cfg("data=text", f"data.path={text_file}", f"model.block_size={BLOCK}", "train.max_iters=10",
                    "train.eval_interval=5", "train.warmup_iters=0", *TRAINED[name])
    result = train(cfg)
    out = run_export(result["out_dir"], tmp_path / "hf")
    state = torch.load(Path(result["ckpt"]).parent / "best.pt", weights_only=True)
    model = model_from_checkpoint(state).eval()
    hf = load_export(out)
    check_logits(model, hf, name)
    tok = tokenizer_from_dict(state["tokenizer"])
    check_greedy(model, hf, torch.tensor([tok.encode("line 1").tolist()]), name)
    stock = not name.startswith("post_norm")
    cls = export_hf.TARGET_CLASSES[export_hf.pick_target(model.config)] if stock else "AttnlabForCausalLM"
    assert json.loads((out / "config.json").read_text())["architectures"] == [cls]
    card = (out / "README.md").read_text()
    assert "| training data | text (tokenizer: char" in card
    assert f"| steps | {state['step']} |" in card and f"| val loss | {state['val_loss']:.4f} |" in card


def test_rope_permutation_turns_pairs_into_halves():
    """The rotation alone: attnlab's interleaved-pair RoPE followed by the export's row permutation
    equals transformers' rotate-half RoPE of the permuted vector (same angles, same direction) at
    every position; q.k, a sum over channels, then does not change."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hs, T, base = 16, 40, 500.0
    x = torch.randn(T, hs)  # one head's q at positions 0..T-1
    halves = lambda t: export_hf.rope_halves(t.T, 1, hs).T  # noqa: E731  the export's permutation, (T, hs)
    ours = apply_rope(x, rope_table(hs, T, base))  # (T, hs)
    config = transformers.LlamaConfig(hidden_size=hs, num_attention_heads=1, head_dim=hs,
                                      rope_parameters={"rope_type": "default", "rope_theta": base})
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(T).unsqueeze(0))  # (1, T, hs)
    theirs, _ = apply_rotary_pos_emb(halves(x)[None, None], halves(x)[None, None], cos, sin)
    assert_close(theirs[0, 0], halves(ours), "RoPE")
    assert halves(x)[:, :4].tolist() == x[:, [0, 2, 4, 6]].tolist()  # pairs (2j, 2j+1) -> (j, j + hs/2)


# ----------------------------------------------------------------------------- custom code (format=code)

# Every option attnlab has, each value at least once (test_code_variants_cover_every_option keeps it so):
# the custom-code route is attnlab's own model files, so each must export exactly by construction.
CODE_VARIANTS = {
    "default": {},
    "post_norm_rmsnorm_gelu": dict(norm_position="post", norm="rmsnorm"),
    "layernorm_swiglu_gqa_bias_softcap_dropout": dict(mlp="swiglu", n_kv_head=2, bias=True, logit_softcap=5.0,
                                                      dropout=0.1),
    "learned_value_embed_untied_relu2_dff": dict(pos="learned", value_embed=True, tie_embeddings=False, mlp="relu2",
                                                 d_ff=48),
    "sinusoidal_mqa_qk_layer_head_gain": dict(pos="sinusoidal", n_kv_head=1,
                                              attn={"qk_norm": True, "qk_norm_type": "layer", "qk_norm_gain": "head"}),
    "nope_qk_l2_channel_gain_scale": dict(pos="none", attn={"qk_norm": True, "qk_norm_type": "l2",
                                                            "qk_norm_gain": "channel", "scale": "4.0"}),
    "qk_rms_reference_zero_init_rope_base_yarn": dict(rope_base=500.0, zero_init_proj=True, rope_scaling="yarn",
                                                      rope_scaling_factor=2.0, rope_original_length=8,
                                                      attn={"qk_norm": True, "impl": "reference", "scale": "dk",
                                                            "softcap": 3.0}),
    "tiled_window_local_global_ntk": dict(rope_scaling="ntk", rope_scaling_factor=4.0,
                                          attn={"impl": "tiled", "block": 16, "window": 8, "window_pattern": "LG"}),
    "rmsnorm_swiglu_window_scale_none_pi": dict(norm="rmsnorm", mlp="swiglu", rope_scaling="linear",
                                                rope_scaling_factor=2.0, attn={"window": 12, "scale": "none"}),
    "linear_attention_gqa": dict(n_kv_head=2, attn={"kind": "linear"}),
    "mla_query_latent_head_gate_learned_sink": dict(attn={"kind": "mla", "q_lora_rank": 16, "kv_lora_rank": 12,
                                                          "rope_head_dim": 4, "gate": "head", "sink": "learned"}),
    "alibi_channel_gate_zero_sink": dict(pos="alibi", attn={"gate": "channel", "sink": "zero"}),
    "gdn_no_mlp": dict(mlp="none", attn={"kind": "gdn"}),
    "mamba2_state_dim": dict(attn={"kind": "mamba2", "state_dim": 8}),
    "hybrid_gdn_softmax": dict(attn={"layer_kinds": ["gdn", "softmax"]}),
    "hybrid_mla_mamba2": dict(attn={"layer_kinds": ["mla", "mamba2"]}),
    "hybrid_linear_gdn": dict(n_kv_head=2, attn={"layer_kinds": ["linear", "gdn"]}),
    "moba_gqa": dict(n_kv_head=2, attn={"select": "moba", "select_block": 8, "select_topk": 2}),
    "moba_gathered": dict(attn={"select": "moba", "select_block": 8, "select_topk": 1, "impl": "gathered"}),
    "oracle_hybrid": dict(attn={"layer_kinds": ["softmax", "gdn"], "select": "oracle", "select_topk": 5}),
    "indexer_gqa": dict(n_kv_head=2, attn={"select": "indexer", "select_topk": 5, "indexer_heads": 2, "indexer_dim": 8,
                                            "indexer_kl": 0.5}),
}
SIZES = {"vocab_size", "block_size", "n_layer", "n_head", "n_embd"}  # shapes every variant sets


def test_code_variants_cover_every_option():
    """A new model option (a GPTConfig or AttnConfig field) fails here, by name, until a custom-code
    variant sets it (every value of a choice): then test_code_export_equals_attnlab covers it."""
    from rules import OneOf
    from variants import AttnConfig

    seen = [export_hf.flat_fields(GPTConfig(vocab_size=CHARS.vocab_size, block_size=BLOCK, n_layer=2, n_head=4, n_embd=32,
                                         **kw)) for kw in CODE_VARIANTS.values()]
    base = export_hf.flat_fields(GPTConfig(vocab_size=CHARS.vocab_size, n_head=4, n_embd=32))
    rules = {**GPTConfig.RULES, **{f"attn.{k}": rule for k, rule in AttnConfig.RULES.items()}}
    missing = []
    for key, default in base.items():
        values = {v for cfg in seen for v in (cfg[key] if isinstance(cfg[key], list) else [cfg[key]])}
        if isinstance(rules.get(key), OneOf):
            missing += [f"{key}={v}" for v in rules[key].choices if v not in values]
        elif key not in SIZES and values == {default}:
            missing.append(key)
    assert not missing, f"no CODE_VARIANTS entry sets {', '.join(missing)}: add one"


@pytest.mark.parametrize("name", list(CODE_VARIANTS))
def test_code_export_equals_attnlab(name, tmp_path):
    """format=code: transformers' AutoModelForCausalLM (trust_remote_code) gives attnlab's logits
    at full block_size and sample.py's greedy text (50 tokens), for every option."""
    model = export_model(seed=3, **CODE_VARIANTS[name])
    out = run_export(write_checkpoint(tmp_path / "ckpt.pt", model), tmp_path / "hf", "format=code")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["AttnlabForCausalLM"] and config["auto_map"] == export_hf.CODE_CLASSES
    hf = load_export(out)
    check_logits(model, hf, name)
    check_greedy(model, hf, torch.tensor([CHARS.encode("the c").tolist()]), name)


def test_code_export_loads_in_bfloat16(tmp_path):
    """from_pretrained(dtype=bfloat16) gives attnlab's model after .to(bfloat16): the tables GPT
    computes when built (not saved) follow its own rules, RoPE's in float32, a position table in
    the model's dtype."""
    model = export_model(**CODE_VARIANTS["sinusoidal_mqa_qk_layer_head_gain"])
    out = run_export(write_checkpoint(tmp_path / "ckpt.pt", model), tmp_path / "hf")
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.bfloat16).eval()
    idx = torch.randint(CHARS.vocab_size, (2, BLOCK), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(hf(idx).logits, model.to(torch.bfloat16)(idx))


@pytest.mark.parametrize("kw,chosen,why", [
    ({}, "GPTNeoXForCausalLM", "a stock class that computes this model exactly"),
    (dict(norm_position="post"), "AttnlabForCausalLM", "since model.norm_position=post has no exact counterpart"),
    (dict(attn={"window": 8}), "AttnlabForCausalLM", "since model.attn.window=8 has no exact counterpart"),
], ids=["stock", "post_norm", "window"])
def test_auto_says_which_route_and_why_in_one_line(kw, chosen, why, tmp_path, caplog):
    caplog.set_level("INFO", logger="attnlab")
    out = run_export(write_checkpoint(tmp_path / "ckpt.pt", export_model(**kw)), tmp_path / "hf")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("format=auto")]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith(f"format=auto: {chosen}") and why in lines[0], lines[0]
    assert json.loads((out / "config.json").read_text())["architectures"] == [chosen]


def test_code_export_loads_alone(tmp_path, cli):
    """A custom-code export loads from its directory alone: a fresh process elsewhere, attnlab not on
    sys.path, omegaconf and hydra unimportable, offline; logits and greedy text as attnlab's."""
    model = export_model(**CODE_VARIANTS["post_norm_rmsnorm_gelu"])
    out = run_export(write_checkpoint(tmp_path / "ckpt.pt", model), tmp_path / "hf")
    idx = torch.randint(CHARS.vocab_size, (2, BLOCK), generator=torch.Generator().manual_seed(2))
    torch.save(idx, tmp_path / "idx.pt")
    code = f"""
import sys
sys.modules["omegaconf"] = sys.modules["hydra"] = None  # attnlab's commands need them, its model must not
import torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
assert not {{"model", "attention", "common", "counting"}} & set(sys.modules), "attnlab's own modules were imported"
with torch.no_grad():
    logits = m(torch.load({str(tmp_path / 'idx.pt')!r})).logits
    text = m.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=20, do_sample=False, top_k=None, temperature=None)
torch.save((logits, text), {str(tmp_path / 'got.pt')!r})
"""
    away = tmp_path / "elsewhere"
    away.mkdir()
    cli("-c", code, cwd=away, env={"HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}, check=True)
    logits, text = torch.load(tmp_path / "got.pt")
    with torch.no_grad():
        assert_close(logits, model(idx), "fresh process")
    assert text.tolist() == generate(model, torch.tensor([[5, 6, 7]]), 20, temperature=0).tolist()


# ----------------------------------------------------------------------------- tokenizers


def export_tokenizer(tok, tmp_path) -> Path:
    """A tiny random model over `tok`'s vocabulary, exported; the directory's tokenizer is what
    AutoTokenizer loads."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=16, n_layer=1, n_head=2, n_embd=16))
    return run_export(write_checkpoint(tmp_path / "tok.pt", model, tok), tmp_path / "tok_hf")


def check_val_split(data_dir: Path, tmp_path):
    """The whole val split: transformers' encoding of its text (documents joined by <|endoftext|>
    where the vocabulary has it) equals attnlab's, and decoding gives the text back."""
    meta = json.loads((data_dir / "meta.json").read_text())
    tok = tokenizer_from_dict(meta["tokenizer"])
    val = np.fromfile(data_dir / "val.bin", dtype=meta["dtype"]).astype(np.int64)
    fast = AutoTokenizer.from_pretrained(export_tokenizer(tok, tmp_path))
    pieces = [(val, False)]  # (ids of a document, followed by <|endoftext|>)
    if tok.eot is not None:
        cuts = np.flatnonzero(val == tok.eot).tolist()
        pieces = [(val[a:b], b < len(val)) for a, b in zip([0, *(i + 1 for i in cuts)], [*cuts, len(val)])]
        pieces = [(ids, eot) for ids, eot in pieces if len(ids) or eot]  # no empty piece after the last EOT
        assert len(cuts) > 1 or tok.kind == "tiktoken", "a multi-document val split should hold <|endoftext|>"
    docs = [(tok.decode(ids), eot) for ids, eot in pieces]
    text = "".join(doc + EOT * eot for doc, eot in docs)
    want = [i for doc, eot in docs for i in [*tok.encode(doc).tolist(), *[tok.eot] * eot]]
    got = fast(text)["input_ids"]
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert got == want, f"{tok.kind}: encodings differ from token {first} of {len(want)}"
    assert fast.decode(got) == text
    assert fast.decode(val.tolist()) == tok.decode(val)  # the stored ids too (a tail split may start mid-word)
    if tok.eot is not None:
        assert fast.eos_token == EOT and fast.eos_token_id == tok.eot
    return len(want)


def test_char_export_names_a_newline_its_bos(tmp_path):
    """A char vocabulary has no special token; the export names a newline its BOS, so that
    lm-evaluation-harness has a prefix token (and TransformerLens' prepend_bos a BOS). Encoding is
    unchanged, and decoding keeps the newline unless special tokens are skipped."""
    out = run_export(write_checkpoint(tmp_path / "ckpt.pt", export_model()), tmp_path / "hf")
    fast = AutoTokenizer.from_pretrained(out)
    text = "ab\ncd\n"
    assert fast.bos_token == "\n" and fast.bos_token_id == CHARS.encode("\n")[0] and fast.eos_token is None
    assert fast(text)["input_ids"] == CHARS.encode(text).tolist() and fast.decode(fast(text)["input_ids"]) == text
    assert fast.decode(fast(text)["input_ids"], skip_special_tokens=True) == "abcd"  # what the docs warn of
    assert json.loads((out / "generation_config.json").read_text())["bos_token_id"] == fast.bos_token_id


def test_a_bos_model_exports_with_its_bos_token_before_every_text(tmp_path):
    """data.bos=true: the export's tokenizer has the token (its id one past the characters), puts it
    before every text as training did, drops it when skipping special tokens; the exported model
    continues [bos, prompt] greedily as sample.py does."""
    from data.tokenizer import WithBos
    tok = WithBos(CHARS)
    model = export_model(seed=3, bos=True)
    out = run_export(write_checkpoint(tmp_path / "ckpt.pt", model, tokenizer=tok), tmp_path / "hf")
    fast = AutoTokenizer.from_pretrained(out)
    text = "ab\ncd\n"
    ids = fast(text)["input_ids"]
    assert ids == [tok.bos, *CHARS.encode(text).tolist()] and fast.bos_token_id == tok.bos == CHARS.vocab_size
    assert fast.decode(ids, skip_special_tokens=True) == text
    assert json.loads((out / "generation_config.json").read_text())["bos_token_id"] == tok.bos
    assert "data.bos=true" in (out / "README.md").read_text()
    check_greedy(model, load_export(out), torch.tensor([fast("the c")["input_ids"]]), "bos")


def test_a_bos_bpe_tokenizer_exports_with_its_bos_token():
    from data.tokenizer import TiktokenTokenizer, WithBos
    tok = WithBos(TiktokenTokenizer.train([corpus_text(40)], 300))
    tok, fast = export_hf.hf_tokenizer(tok.to_dict(), 64)
    export_hf.check_tokenizer(tok, fast)  # raises if the ids differ
    text = "the quick brown fox" + EOT
    assert fast(text)["input_ids"] == [tok.bos, *tok.encode("the quick brown fox").tolist(), tok.eot]
    assert fast.bos_token_id == tok.bos == 300 and fast.eos_token_id == tok.eot


def prepared(train_cfg, *overrides):
    return prepare(train_cfg(*overrides).data)


def test_char_tokenizer_matches_on_val_split(train_cfg, text_file, tmp_path):
    assert check_val_split(prepared(train_cfg, "data=text", f"data.path={text_file}"), tmp_path) > 100


def test_bpe_tokenizer_matches_on_val_split(train_cfg, tmp_path):
    """Our trained BPE (rustbpe ranks and its GPT-4-style pattern) on several documents, so val
    holds <|endoftext|> between them; the text mixes scripts, digits, contractions and odd spaces."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(12):
        lines = [f"Doc {i}: It's {i * 1234} o'clock; we'll see. Ünïcödé café, 日本語 {i}, emoji 😀{'!' * i}",
                 "\tindented\r\n  two  spaces\u00a0nbsp\u2003em\u3000ideographic",
                 "def f(x):\n    return x ** 2  # comment\n\n\n"] * (3 + i)
        (docs / f"{i:02d}.txt").write_text("\n".join(lines), encoding="utf-8")
    data = prepared(train_cfg, "data=text", f"data.path={docs}/*.txt", "data.tokenizer=bpe", "data.vocab_size=300",
                    "data.val_fraction=0.3")
    assert check_val_split(data, tmp_path) > 100


@requires_shared(TIKTOKEN_CACHE)
def test_r50k_tokenizer_matches_on_val_split(train_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_CACHE))
    data = prepared(train_cfg, "data=shakespeare", f"data.path={SHAKESPEARE}")
    assert check_val_split(data, tmp_path) > 10_000


@requires_shared(SHAKESPEARE)
def test_char_tokenizer_matches_on_shakespeare_val_split(train_cfg, tmp_path):
    assert check_val_split(prepared(train_cfg, "data=shakespeare_char", f"data.path={SHAKESPEARE}"), tmp_path) > 10_000


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("kw,option", [
    (dict(pos="learned", norm="rmsnorm", mlp="swiglu"), "model.norm=rmsnorm with model.pos=learned"),
    (dict(pos="sinusoidal", attn={"qk_norm": True}), "model.attn.qk_norm=true with model.pos=sinusoidal"),
    (dict(pos="none", mlp="swiglu"), "model.mlp=swiglu with model.pos=none"),
    (dict(norm_position="post"), "model.norm_position=post"),
    (dict(logit_softcap=30.0), "model.logit_softcap=30.0"),
    (dict(value_embed=True), "model.value_embed=true"),
    (dict(LLAMA, attn={"qk_norm": True, "qk_norm_type": "layer"}), "model.attn.qk_norm_type=layer"),
    (dict(LLAMA, attn={"qk_norm": True, "qk_norm_type": "l2"}), "model.attn.qk_norm_type=l2"),
    (dict(LLAMA, attn={"qk_norm": True, "qk_norm_gain": "channel"}), "model.attn.qk_norm_gain=channel"),
    (dict(LLAMA, attn={"qk_norm": True, "qk_norm_gain": "head"}), "model.attn.qk_norm_gain=head"),
    (dict(attn={"qk_norm": True}), "model.attn.qk_norm=true with model.norm=layernorm"),
    (dict(mlp="swiglu"), "model.mlp=swiglu with model.norm=layernorm"),
    (dict(norm="rmsnorm"), "model.mlp=gelu with model.norm=rmsnorm"),
    (dict(LLAMA, bias=True, attn={"qk_norm": True}), "model.bias=true with model.attn.qk_norm"),
    (dict(norm="rmsnorm", mlp="relu2"), "model.mlp=relu2 with model.norm=rmsnorm"),
    (dict(attn={"window": 8}), "model.attn.window=8"),
    (dict(attn={"kind": "linear"}), "model.attn.kind=linear"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_option_without_counterpart_is_a_one_line_error(kw, option, tmp_path):
    """format=stock refuses what no stock class computes (format=auto writes custom code instead)."""
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", export_model(**kw))
    with pytest.raises(UserError) as e:
        run_export(ckpt, tmp_path / "hf", "format=stock")
    assert option in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "hf").exists()


def test_cli_refuses_with_one_line(tmp_path, cli):
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", export_model(norm_position="post"))
    r = cli("tools/export.py", f"ckpt={ckpt}", f"out={tmp_path / 'hf'}", "format=stock", env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("error: model.norm_position=post has no exact counterpart")


def test_non_finite_checkpoint_is_refused(tmp_path):
    model = export_model()
    with torch.no_grad():
        model.blocks[1].mlp.c_fc.weight[3, 4] = float("nan")
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", model)
    with pytest.raises(UserError, match="non-finite"):
        run_export(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_out_dir_is_never_clobbered_and_keeps_the_checkpoint_private(tmp_path):
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", export_model())
    precious = tmp_path / "mine"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    for overrides, needle in (([], "not empty"), (["overwrite=true"], "holds notes.txt, which no export wrote")):
        with pytest.raises(UserError, match=needle):
            run_export(ckpt, precious, *overrides)
    assert (precious / "notes.txt").read_text() == "keep me"
    with pytest.raises(UserError, match="out=DIR is required"):
        export.export(compose_cfg("export", [f"ckpt={ckpt}"]))
    out = run_export(ckpt, tmp_path / "hf")
    ckpt.chmod(0o600)  # a private checkpoint gives a private export (as checkpoints follow their data)
    run_export(ckpt, out, "overwrite=true")  # an earlier export may be replaced
    assert {p.stat().st_mode & 0o777 for p in out.iterdir()} == {0o600} and out.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "attnlab_export.json", "config.json",
                                                     "generation_config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary dir left


def tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_overwrite_replaces_only_an_export_of_ours_and_never_the_directory_you_are_in(tmp_path, monkeypatch):
    """overwrite=true replaces only a directory holding an export's files and nothing else: never a
    project that merely holds a config.json (and its sources), never an export with a file added, and
    never the directory you are in (`cd EXPORT && export.py out=. overwrite=true`), which it would empty
    and then fail to write."""
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", export_model())
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "config.json").write_text('{"name": "my project"}')
    (project / "src" / "main.py").write_text("print('hello')\n")
    before = tree(project)
    with pytest.raises(UserError, match=r"holds config.json, src, which no export wrote") as e:
        run_export(ckpt, project, "overwrite=true")
    assert "\n" not in str(e.value) and tree(project) == before

    out = run_export(ckpt, tmp_path / "hf")
    exported = tree(out)
    (out / "notes.txt").write_text("mine")  # something added to an export: not only ours
    with pytest.raises(UserError, match="holds notes.txt, which no export wrote"):
        run_export(ckpt, out, "overwrite=true")
    assert tree(out) == {**exported, "notes.txt": b"mine"}
    (out / "notes.txt").unlink()

    monkeypatch.chdir(out)  # standing in the export
    for here in (".", str(out), str(tmp_path)):
        with pytest.raises(UserError, match="is the directory you are in, or holds it"):
            run_export(ckpt, here, "overwrite=true")
    assert tree(out) == exported
    monkeypatch.chdir(tmp_path)

    (tmp_path / "link").symlink_to(out)
    with pytest.raises(UserError, match="is a symbolic link"):
        run_export(ckpt, tmp_path / "link", "overwrite=true")
    run_export(ckpt, out, "overwrite=true")  # our own export, nothing added: replaced
    assert tree(out).keys() == exported.keys()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary or old dir left


def test_ctrl_c_while_swapping_an_export_in_keeps_the_old_one(tmp_path, monkeypatch):
    """The new export is written beside the old one and swapped in by two renames (old aside, new in):
    Ctrl-C between them puts the old one back."""
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", export_model())
    out = run_export(ckpt, tmp_path / "hf")
    exported = tree(out)
    real_rename, swaps = os.rename, []

    def ctrl_c_on_the_second_swap(a, b):
        if Path(b).parent == tmp_path:  # the swap's renames (transformers' own ones are inside the new dir)
            swaps.append(Path(b).name)
            if len(swaps) == 2:
                raise KeyboardInterrupt
        real_rename(a, b)
    monkeypatch.setattr(os, "rename", ctrl_c_on_the_second_swap)
    with pytest.raises(KeyboardInterrupt):
        run_export(ckpt, out, "overwrite=true")
    monkeypatch.undo()
    assert swaps[0].startswith(".hf.old") and swaps[1] == "hf"
    assert tree(out) == exported and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_the_tokenizer_check_of_a_vocabulary_longer_than_the_block_prints_no_warning(capsys):
    """The export checks its tokenizer on the whole character vocabulary, longer than model_max_length (the
    block) on purpose: transformers' "sequence length is longer than the specified maximum" is not printed."""
    import logging

    from data.tokenizer import CharTokenizer
    from lab.export_hf import check_tokenizer, hf_tokenizer
    chars = "".join(chr(c) for c in range(32, 127))  # 95 characters against a block of 16
    tok, fast = hf_tokenizer(CharTokenizer(chars).to_dict(), block_size=16)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        check_tokenizer(tok, fast)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    shown = capsys.readouterr()
    assert not [r for r in records if "longer than the specified maximum" in r.getMessage()]
    assert "longer than the specified maximum" not in shown.out + shown.err
    assert fast(chars)["input_ids"] == list(range(len(chars)))  # the check passed: the same ids
