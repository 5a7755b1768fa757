"""cost.py: counts derived by hand for two small configs, the same counts from real
models (num_params, flops_per_token, torch's FlopCounterMode, a real KV cache), the crossovers
plugged back in, and one-line errors."""
import dataclasses
import json
import math
from fractions import Fraction

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rules import UserError
from config import model_config
from counting import (activation_bytes, attention_variants, count_params, crossovers, flops_per_token,
                      macs_per_token, memory_breakdown, per_gpu_bytes)
from tools.cost import all_attention, cost, round_half_up
from helpers import REPO, compose_cfg
from model import GPT, GPTConfig

# MHA + GELU, everything else the defaults (LayerNorm without bias, Pre-LN, RoPE, tied head):
# d=64, 4 heads of 16, d_kv = 4*16 = 64, d_ff = 4*64 = 256, vocab 100, 2 layers.
MHA_GELU = dict(vocab_size=100, block_size=32, n_layer=2, n_head=4, n_embd=64)
# GQA + SwiGLU with RMSNorm and an untied head: d=80, 4 query heads of 20 sharing 2 K/V heads,
# d_kv = 2*20 = 40, d_ff = 64*ceil(8*80/3/64) = 64*ceil(3.33) = 256, vocab 100, 2 layers.
GQA_SWIGLU = dict(vocab_size=100, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=80, mlp="swiglu",
                  norm="rmsnorm", tie_embeddings=False)


def test_mha_gelu_by_hand():
    c = GPTConfig(**MHA_GELU)
    # parameters
    #   wte 100*64 = 6,400 (tied: it is the LM head too, counted once)
    #   per layer: c_attn 64*(64+2*64) = 12,288 + c_proj 64*64 = 4,096 -> attention 16,384
    #              c_fc 64*256 = 16,384 + c_proj 256*64 = 16,384      -> MLP 32,768
    #              ln_1, ln_2: 64 weights each (no bias)              -> norms 128
    #   2 layers: attention 32,768, MLP 65,536, norms 256; ln_f 64 -> norms 320
    #   total 6,400 + 32,768 + 65,536 + 320 = 105,024
    assert count_params(c) == {"embedding": 6400, "lm_head": 0, "attention": 32768, "mlp": 65536, "norms": 320,
                               "total": 105024, "non_embedding": 105024}
    # MACs per token and layer at N=32: Q, K, V, O 64*64 = 4,096 each -> 16,384 = 4*d^2 (MHA);
    # scores N*d = 32*64 = 2,048, weights.V 2,048 -> 4,096; MLP 2*64*256 = 32,768; norms 128.
    # Layer 16,384 + 4,096 + 32,768 + 128 = 53,376; LM head 64*100 = 6,400; ln_f 64.
    # Forward 2*53,376 + 6,400 + 64 = 113,216 MACs; training 6*113,216 = 679,296 FLOPs
    # = PaLM's 6*105,024 + 12*2*32*64 = 630,144 + 49,152.
    m = macs_per_token(c, 32)
    assert (m["q"], m["k"], m["v"], m["o"], m["proj"]) == (4096, 4096, 4096, 4096, 16384)
    assert (m["scores"], m["weighted_sum"], m["attn"], m["mlp"], m["other"]) == (2048, 2048, 4096, 32768, 128)
    assert (m["layer"], m["lm_head"], m["other_final"], m["forward"]) == (53376, 6400, 64, 113216)
    assert flops_per_token(c, 32) == 679296 == 6 * 105024 + 12 * 2 * 32 * 64
    # crossovers: 2*N*d = 2*d*(d+d_kv) -> N = 64+64 = 128; 2*N*d = 2*d*d_ff -> N = d_ff = 256; both: 384
    assert crossovers(c) == {"attn_vs_proj": 128, "attn_vs_mlp": 256, "attn_vs_proj_mlp": 384}
    # memory at N=32, batch 2, float32 (4 B): weights 105,024*4 = 420,096; AdamW 105,024*8 = 840,192;
    # one layer's N x N table 2*4*32*32*4 = 32,768, two layers 65,536; KV per token
    # 2 (K, V) * 2 layers * 4 heads * 16 * 4 B = 1,024; at N, batch 2: 1,024*32*2 = 65,536 (MHA: the same)
    assert memory_breakdown(c, 32, 2, 4) == {
        "weights": 420096, "adamw_state": 840192, "attn_weights_per_layer": 32768,
        "attn_weights_all_layers": 65536, "kv_cache_per_token": 1024, "kv_cache": 65536, "kv_cache_mha": 65536}


def test_gqa_swiglu_by_hand():
    c = GPTConfig(**GQA_SWIGLU)
    assert c.d_ff == 256  # the default SwiGLU width, rounded up to a multiple of 64
    # parameters
    #   wte 100*80 = 8,000; untied LM head 80*100 = 8,000
    #   per layer: c_attn 80*(80+2*40) = 12,800 + c_proj 80*80 = 6,400      -> attention 19,200
    #              c_fc (gate|up) 80*2*256 = 40,960 + c_proj 256*80 = 20,480 -> MLP 61,440
    #              ln_1, ln_2: RMSNorm weights 80 each                      -> norms 160
    #   2 layers: attention 38,400, MLP 122,880, norms 320; ln_f 80 -> norms 400
    #   total 8,000 + 8,000 + 38,400 + 122,880 + 400 = 177,680; non-embedding (no wte) 169,680
    assert count_params(c) == {"embedding": 8000, "lm_head": 8000, "attention": 38400, "mlp": 122880,
                               "norms": 400, "total": 177680, "non_embedding": 169680}
    # MACs per token and layer at N=32: Q 80*80 = 6,400, K 80*40 = 3,200, V 3,200, O 6,400 -> 19,200
    # (MHA would be 4*80^2 = 25,600); scores 32*80 = 2,560, weights.V 2,560 -> 5,120 (GQA shares K/V
    # heads, every query head still scores every key); MLP 3*80*256 = 61,440; norms 160.
    # Layer 19,200 + 5,120 + 61,440 + 160 = 85,920; LM head 8,000; ln_f 80.
    # Forward 2*85,920 + 8,000 + 80 = 179,920 MACs; training 6*179,920 = 1,079,520 FLOPs
    # = 6*169,680 + 12*2*32*80 = 1,018,080 + 61,440.
    m = macs_per_token(c, 32)
    assert (m["q"], m["k"], m["v"], m["o"], m["proj"]) == (6400, 3200, 3200, 6400, 19200)
    assert (m["scores"], m["weighted_sum"], m["attn"], m["mlp"], m["other"]) == (2560, 2560, 5120, 61440, 160)
    assert (m["layer"], m["lm_head"], m["other_final"], m["forward"]) == (85920, 8000, 80, 179920)
    assert flops_per_token(c, 32) == 1079520 == 6 * 169680 + 12 * 2 * 32 * 80
    # crossovers: N = d + d_kv = 80 + 40 = 120; 2*N*d = 3*d*d_ff -> N = 3*256/2 = 384; both: 504
    assert crossovers(c) == {"attn_vs_proj": 120, "attn_vs_mlp": 384, "attn_vs_proj_mlp": 504}
    # memory at N=32, batch 2, bfloat16 (2 B): weights 177,680*2 = 355,360; AdamW 177,680*8 = 1,421,440;
    # table 2*4*32*32*2 = 16,384, two layers 32,768; KV per token 2*2 layers*2 K/V heads*20*2 B = 320,
    # at N, batch 2: 320*64 = 20,480; with 4 K/V heads (MHA) twice that, 40,960
    assert memory_breakdown(c, 32, 2, 2) == {
        "weights": 355360, "adamw_state": 1421440, "attn_weights_per_layer": 16384,
        "attn_weights_all_layers": 32768, "kv_cache_per_token": 320, "kv_cache": 20480, "kv_cache_mha": 40960}


def test_memory_per_gpu_by_hand():
    """MHA_GELU (105,024 parameters, test_mha_gelu_by_hand) at N=32, batch 2 per GPU, float32."""
    c = GPTConfig(**MHA_GELU)
    # activations, numbers per token (d=64, d_kv=64, 4 heads, d_ff=256), per layer:
    #   ln_1 and ln_2: input 64 + mean and 1/std 2 = 66 each           132
    #   inputs of q|k|v and of the MLP (the norms' outputs): 64 each     128
    #   RoPE: q and k before the rotation, 64 + 64                       128
    #   attention: q, k, v 64 + 64 + 64, output 64, a log-sum-exp per head 4  260
    #   MLP (GELU): its input and output, 256 each                       512 -> 1,160
    # outside: ln_f 66 + the head's input 64 = 130 numbers, then the fp32 log-softmax (100 x 4 B) and the
    # int64 ids and targets (16 B): 130*4 + 400 + 16 = 936 B per token, and the loss's 4 B total weight
    tokens = 2 * 32
    layer, outside = tokens * 1160 * 4, tokens * 936 + 4  # 296,960 and 59,908
    assert activation_bytes(c, 2, 32, 4) == {"kept": 2 * layer + outside, "peak": 653828}
    # checkpointed: each block keeps its input (64 numbers per token), and one block's activations come
    # back in the backward: kept 2*64*64*4 + 59,908 = 92,676, peak 92,676 + 296,960 = 389,636
    assert activation_bytes(c, 2, 32, 4, checkpointing=True) == {"kept": 92676, "peak": 389636}
    # one GPU: fp32 weights and gradients 105,024*4 = 420,096 each, AdamW 105,024*8 = 840,192
    one = per_gpu_bytes(c, 2, 32, 1, "ddp", 4)
    assert one == {"weights": 420096, "gradients": 420096, "adamw_state": 840192, "buffers": 0,
                   "activations": 653828, "total": 2334212}
    # DDP over 2: the same, and its buckets, a flat copy of the gradients, 420,096
    assert per_gpu_bytes(c, 2, 32, 2, "ddp", 4) == {**one, "buffers": 420096, "total": 2334212 + 420096}
    # FSDP over 2: half of each, 52,512 parameters a GPU; gathered: the root (wte 6,400 + ln_f 64) and
    # two blocks of 16,384 + 32,768 + 2*64 = 49,280 (here the whole model), and the gradients of the root
    # and one block, in fp32: (6,464 + 98,560)*4 + (6,464 + 49,280)*4 = 420,096 + 222,976 = 643,072
    fsdp = per_gpu_bytes(c, 2, 32, 2, "fsdp", 4, checkpointing=True)
    assert fsdp == {"weights": 210048, "gradients": 210048, "adamw_state": 420096, "buffers": 643072,
                    "activations": 389636, "total": 210048 * 2 + 420096 + 643072 + 389636}
    # in bf16 (2 B) the gathered groups halve; FSDP over 3 rounds each GPU's share up: 35,008 parameters
    assert per_gpu_bytes(c, 2, 32, 2, "fsdp", 2)["buffers"] == 643072 // 2
    assert per_gpu_bytes(c, 2, 32, 3, "fsdp", 4)["weights"] == 35008 * 4


def cost_cfg(*overrides, tmp_path=None):
    plot = f"plot={tmp_path / 'cost.png'}" if tmp_path else "plot=null"
    return compose_cfg("cost", [plot, *overrides])


def model_overrides(fields):
    return [f"model.{k}={v}" for k, v in fields.items()]


def test_json_output_has_the_issue_keys_and_the_hand_numbers(capsys, tmp_path):
    cfg = cost_cfg("model=debug", *model_overrides(GQA_SWIGLU), "seq_len=32", "batch_size=2", "dtype=bfloat16",
                   "format=json", tmp_path=tmp_path)
    result = cost(cfg)
    printed = json.loads(capsys.readouterr().out)  # one JSON object, nothing else on stdout
    assert printed == result
    variants = attention_variants(GPTConfig(**GQA_SWIGLU), 32, 2, 2)
    assert result.pop("attention_variants") == json.loads(json.dumps(variants))
    table = {(r["kind"].split()[0], r["dtype"]): r for r in result.pop("kv_cache_table")}
    # GQA_SWIGLU: 2 layers, 4 heads of 20, 2 K/V heads: per token 2 (k, v) x 2 layers x heads x 20 numbers
    assert table[("MHA", "bfloat16")]["per_token"] == 2 * 2 * 4 * 20 * 2
    assert table[("GQA", "float32")]["per_token"] == 2 * 2 * 2 * 20 * 4
    assert table[("MQA", "int8")]["per_token"] == 2 * 2 * 1 * (20 + 4)  # a byte a number, an fp32 scale per head
    assert table[("MLA", "bfloat16")]["per_token"] == 2 * (4 * 20 + 20 // 2) * 2  # latent 4 hs + RoPE key hs/2
    assert table[("GQA", "bfloat16")]["131072"] == 131072 * 2 * 2 * 2 * 20 * 2 * 2  # x tokens x batch 2
    # per layer: q, o 80 x 80 and k, v 80 x 40 weights; q.k and the weighted sum 2 x 32 keys x 80; the
    # cache 2 (k, v) x 2 K/V heads x 20 numbers x 2 bytes for 32 tokens of 2 sequences
    assert result.pop("layers") == [{"kind": "softmax", "params": 19200, "mixer_macs": 19200 + 2 * 32 * 80,
                                     "mlp_params": 61440, "cache_bytes": 2 * 2 * 20 * 2 * 32 * 2, "state_bytes": 0,
                                     "layers": 2}]
    per_gpu = result.pop("memory_per_gpu")  # counting.per_gpu_bytes, checked by hand below
    assert list(per_gpu) == ["one_gpu", "ddp", "fsdp"] and list(per_gpu["ddp"]) == ["plain", "checkpointed"]
    assert per_gpu["fsdp"]["plain"] == per_gpu_bytes(GPTConfig(**GQA_SWIGLU), 2, 32, 8, "fsdp", 2)
    assert result == {
        "params": 177680,
        "macs_per_token": {"proj": 19200, "attn": 5120, "mlp": 61440, "lm_head": 8000},
        "crossover": {"attn_vs_proj": 120, "attn_vs_mlp": 384, "attn_vs_proj_mlp": 504},
        "memory_bytes": {"weights": 355360, "adamw_state": 1421440, "attn_weights_per_layer": 16384,
                         "attn_weights_all_layers": 32768, "kv_cache_per_token": 320, "kv_cache": 20480,
                         "kv_cache_mha": 40960}}
    assert (tmp_path / "cost.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_text_report_names_units_and_conventions(capsys):
    cost(cost_cfg("model=debug", *model_overrides(MHA_GELU), "seq_len=32", "dtype=float32"))
    out = capsys.readouterr().out
    for phrase in ("1 MAC = 2 FLOPs", "113,216 MACs = 226,432 FLOPs per token", "679,296 FLOPs per token",
                   "counting.flops_per_token(32)", "full N x N table", "about half", "N = d + d_kv", "128 tokens",
                   "256 tokens", "384 tokens", "float32 (4 bytes per number)", "(420,096 B)", "105,024",
                   "KV cache with MHA", "training memory per GPU", "DDP x 8", "FSDP x 8",
                   "total with activation checkpointing"):
        assert phrase in out, phrase
    assert "GQA:" not in out  # MHA: no saving to report


# ----------------------------------------------------------------------------- against real models

VARIANTS = [  # each a small change from MHA_GELU (every option that changes a parameter count)
    {}, {"bias": True}, {"n_kv_head": 2}, {"n_kv_head": 1, "bias": True}, {"mlp": "swiglu"}, {"mlp": "relu2"},
    {"mlp": "swiglu", "d_ff": 100, "bias": True}, {"d_ff": 96}, {"norm": "rmsnorm", "bias": True},
    {"norm_position": "post"}, {"norm_position": "post", "bias": True}, {"pos": "learned"},
    {"pos": "sinusoidal"}, {"pos": "none"}, {"tie_embeddings": False}, {"tie_embeddings": False, "pos": "learned"},
    {"attn": {"qk_norm": True}}, {"attn": {"qk_norm": True, "qk_norm_gain": "head"}, "n_kv_head": 2},
    {"attn": {"qk_norm": True, "qk_norm_gain": "channel"}, "n_kv_head": 1, "bias": True},
    GQA_SWIGLU, {"value_embed": True}, {"value_embed": True, "n_kv_head": 2},
]


def by_kind(model) -> dict:
    """The model's own parameters grouped by name, as cost.count_params groups them."""
    kinds = dict.fromkeys(("embedding", "lm_head", "attention", "mlp", "norms"), 0)
    for name, p in model.named_parameters():  # a tied lm_head.weight is wte.weight, listed once
        kind = ("embedding" if name.startswith(("wte.", "positions.", "value_embeds.")) else "lm_head" if name.startswith("lm_head.")
                else "attention" if ".attn." in name else "mlp" if ".mlp." in name else "norms")
        assert kind != "norms" or "ln_" in name, name
        kinds[kind] += p.numel()
    return kinds


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={v[k]}" for k in v) or "base")
def test_counts_equal_a_real_model(variant):
    """Parameters by kind equal the built model's; the forward's matmul FLOPs, as torch's FlopCounterMode measures them on the reference attention path
    (explicit q·kᵀ and weights·V over the full table), equal 2 x the MACs counted here, per module."""
    fields = {**MHA_GELU, **variant, "attn": {**variant.get("attn", {}), "impl": "reference"}}
    c = GPTConfig(**fields)
    torch.manual_seed(0)
    model = GPT(c).eval()
    p = count_params(c)
    assert p["total"] == model.num_params()
    assert {k: p[k] for k in by_kind(model)} == by_kind(model)
    B, N = 2, c.block_size
    with FlopCounterMode(display=False) as counter:  # with grad: its module tracker trips on no_grad views
        model(torch.randint(0, c.vocab_size, (B, N)))
    flops = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    m = macs_per_token(c, N)
    assert flops["GPT.blocks.0.attn"] == 2 * B * N * (m["proj"] + m["attn"])
    assert flops["GPT.blocks.0.mlp"] == 2 * B * N * m["mlp"]
    assert flops["GPT.lm_head"] == 2 * B * N * m["lm_head"]
    # everything else (norms, biases, gains) does no matmul: the 6N convention counts 1 MAC each
    assert flops["Global"] == 2 * B * N * (m["forward"] - c.n_layer * m["other"] - m["other_final"])


MODEL_PRESETS = sorted(p.stem for p in (REPO / "configs" / "model").glob("*.yaml"))


@pytest.mark.parametrize("preset", MODEL_PRESETS)
def test_every_model_preset_counts_like_its_model(preset):
    """Built on the meta device (shapes, no memory: llama3_8b_shape has 8B parameters); presets
    without a vocabulary get a small one."""
    cfg = cost_cfg(f"model={preset}")
    c = model_config(cfg.model, None if cfg.model.vocab_size else 96)
    with torch.device("meta"):
        model = GPT(c)
    assert count_params(c)["total"] == model.num_params()
    for key, n in crossovers(c).items():  # and the crossovers hold for every preset (a hybrid's: its
        assert_crossover(all_attention(c), key, n)  # softmax layers', which have the N^2 part)


def test_llama3_8b_shape_is_llama_3_8b():
    c = model_config(cost_cfg("model=llama3_8b_shape").model)
    assert count_params(c)["total"] == 8_030_261_248  # Meta's published count for Llama 3 8B
    assert (c.n_layer, c.n_embd, c.n_head, c.n_kv_head, c.head_dim, c.d_ff, c.vocab_size) == \
        (32, 4096, 32, 8, 128, 14336, 128256)
    # per token and layer: 4096 + 1024 = 5120 (projections), 3*14336/2 = 21504 (MLP)
    assert crossovers(c) == {"attn_vs_proj": 5120, "attn_vs_mlp": 21504, "attn_vs_proj_mlp": 26624}
    # KV per token: 2 * 32 layers * 8 heads * 128 * 2 B = 128 KiB; MHA 4x that
    mem = memory_breakdown(c, 8192, 1, 2)
    assert mem["kv_cache_per_token"] == 2**17 and mem["kv_cache"] == 2**30 and mem["kv_cache_mha"] == 2**32


@pytest.mark.parametrize("fields", [MHA_GELU, GQA_SWIGLU, {**GQA_SWIGLU, "n_kv_head": 1}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_equal_a_real_cache_after_prefill(fields, dtype):
    c = GPTConfig(**fields)
    B, N = 3, 20
    for n_kv_head, key in ((c.n_kv_head, "kv_cache"), (c.n_head, "kv_cache_mha")):
        model = GPT(GPTConfig(**{**fields, "n_kv_head": n_kv_head})).to(dtype).eval()
        caches = model.new_kv_cache(B, N)  # in the model's dtype
        assert caches[0].k.dtype == dtype
        with torch.no_grad():
            model(torch.randint(0, c.vocab_size, (B, N)), kv_cache=caches, pos=0)  # prefill of N tokens
        assert all(cache.k[:, :, N - 1].abs().sum() > 0 for cache in caches)  # filled to the last slot
        cached = sum(t.numel() * t.element_size() for cache in caches for t in (cache.k, cache.v))
        assert cached == memory_breakdown(c, N, B, dtype.itemsize)[key]
    per_token = memory_breakdown(c, N, B, dtype.itemsize)["kv_cache_per_token"]
    assert per_token * N * B == memory_breakdown(c, N, B, dtype.itemsize)["kv_cache"]


# ----------------------------------------------------------------------------- crossovers

def assert_crossover(c, key, n):
    """Plugged back in at the exact length, attention's MACs equal the other side's."""
    m = macs_per_token(c, n)
    other = {"attn_vs_proj": m["proj"], "attn_vs_mlp": m["mlp"], "attn_vs_proj_mlp": m["proj"] + m["mlp"]}[key]
    assert m["attn"] == other, (key, n, m["attn"], other)
    # and the sides differ on either side of it: below, attention is cheaper; above, dearer
    below, above = macs_per_token(c, n - 1), macs_per_token(c, n + 1)
    assert below["attn"] < other < above["attn"]


@pytest.mark.parametrize("fields", [MHA_GELU, GQA_SWIGLU, {**GQA_SWIGLU, "d_ff": 101}, {**MHA_GELU, "n_kv_head": 1},
                                    {**MHA_GELU, "mlp": "relu2", "d_ff": 50}])
def test_crossovers_make_the_two_terms_equal(fields):
    c = GPTConfig(**fields)
    for key, n in crossovers(c).items():
        assert_crossover(c, key, n)
        assert isinstance(n, Fraction)


def test_crossovers_round_to_the_nearest_integer(capsys):
    # SwiGLU with d_ff=101: 3*101/2 = 151.5 (exact), reported as 152; + d + d_kv = 80 + 40 -> 271.5 -> 272
    c = GPTConfig(**{**GQA_SWIGLU, "d_ff": 101})
    assert crossovers(c)["attn_vs_mlp"] == Fraction(303, 2)
    assert round_half_up(Fraction(303, 2)) == 152 and round_half_up(Fraction(7, 3)) == 2
    result = cost(cost_cfg("model=debug", *model_overrides(GQA_SWIGLU), "model.d_ff=101", "format=json"))
    assert result["crossover"] == {"attn_vs_proj": 120, "attn_vs_mlp": 152, "attn_vs_proj_mlp": 272}


# ----------------------------------------------------------------------------- errors

@pytest.mark.parametrize("override, message", [
    ("seq_len=0", "seq_len=0 must be an integer >= 1"),
    ("seq_len=-8", "seq_len=-8 must be an integer >= 1"),
    ("batch_size=0", "batch_size=0 must be an integer >= 1"),
    ("dtype=fp8", "dtype='fp8' is unknown"),
    ("format=yaml", "format='yaml' is unknown"),
    ("world_size=0", "world_size=0 must be"),
    ("model.n_kv_head=3", "model.n_kv_head=3 must divide model.n_head=2"),
    ("model.n_embd=33", "model.n_embd=33 is not divisible"),
])
def test_bad_values_are_user_errors(override, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cost(cost_cfg("model=debug", override))


def test_cli_prints_one_line_errors(tmp_path, cli):
    r = cli("tools/cost.py", "model=debug", "model.n_kv_head=3", cwd=tmp_path)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("error: model.n_kv_head=3 must divide model.n_head=2") and r.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []  # refused before the plot


def test_cli_llama3_8b_json(tmp_path, cli):
    """The README's command, in JSON, through the real CLI; the figure lands in the working directory."""
    r = cli("tools/cost.py", "model=llama3_8b_shape", "seq_len=8192", "format=json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["params"] == 8_030_261_248
    assert out["macs_per_token"] == {"proj": 41_943_040, "attn": 67_108_864, "mlp": 176_160_768,
                                     "lm_head": 525_336_576}
    assert out["memory_bytes"]["attn_weights_per_layer"] == 32 * 8192**2 * 2  # 4 GiB for one layer
    assert (tmp_path / "cost.png").is_file()


def test_cache_table_gqa_row_is_between_mha_and_mqa():
    """The GQA row of an MHA config groups its heads (n_head/4, else n_head/2), never one K/V head
    (that is the MQA row); with 2 heads there is no grouping in between, so no GQA row."""
    from counting import cache_table
    for n_head, want in ((16, "GQA (4 K/V heads)"), (4, "GQA (2 K/V heads)"), (6, "GQA (3 K/V heads)"), (2, None)):
        kinds = {r["kind"] for r in cache_table(GPTConfig(vocab_size=10, n_head=n_head, n_embd=8 * n_head))}
        gqa = [k for k in kinds if k.startswith("GQA")]
        assert gqa == ([want] if want else []), (n_head, kinds)


# ----------------------------------------------------------------------------- the N² wall: each attention kind's counts

def test_counts_of_each_kind_against_the_formulas_by_hand():
    """4 heads of 32 in 128, 2 kv heads, N = 1024: the texts' accounting per layer and token."""
    c = GPTConfig(vocab_size=64, block_size=1024, n_layer=2, n_head=4, n_kv_head=2, n_embd=128)
    rows = {r["name"].split()[0]: r for r in attention_variants(c, 1024, batch=2, dtype_bytes=2)}
    assert rows["reference"]["macs"] == rows["tiled"]["macs"] == 2 * 1024 * 128  # same dot products
    assert rows["reference"]["memory"] == 2 * 4 * 1024 * 1024 * 2
    assert rows["tiled"]["memory"] == 2 * 4 * 1024 * 33 * 2  # output + log-sum-exp per row: O(N)
    assert rows["window"]["macs"] == 2 * 128 * 128  # W = N/8 when the config sets none
    # linear, chunks of 64: the states' (4 + 2) heads x 32 x 33, plus q.k and the weighted sum with 64 keys
    assert rows["linear"]["macs"] == (4 + 2) * 32 * 33 + 2 * 64 * 128 and rows["linear"]["beats_full_from"] == 89
    assert rows["linear"]["memory"] == 2 * (4 * 1024 * 64 + 2 * 16 * 32 * 32) * 2  # chunk tables + 16 states
    window = GPTConfig(vocab_size=64, block_size=1024, n_layer=2, n_head=4, n_embd=128,
                       attn={"window": 100, "window_pattern": "LG"})
    full = GPTConfig(vocab_size=64, block_size=1024, n_layer=2, n_head=4, n_embd=128)
    m, f = macs_per_token(window, 1024), macs_per_token(full, 1024)
    assert f["attn"] == 2 * 1024 * 128 and m["attn"] == (2 * 100 * 128 + 2 * 1024 * 128) // 2  # local + global: the mean
    assert flops_per_token(full, 1024) - flops_per_token(window, 1024) == 6 * 2 * (1024 - 100) * 128 // 2 * 2
    lin = GPTConfig(vocab_size=64, block_size=1024, n_layer=2, n_head=4, n_embd=128, attn={"kind": "linear"})
    assert macs_per_token(lin, 1024)["attn"] == macs_per_token(lin, 64)["attn"] == 2 * 4 * 32 * 33 + 2 * 64 * 128
    assert macs_per_token(lin, 16)["attn"] == 2 * 4 * 32 * 33 + 2 * 16 * 128  # one chunk of 16 positions


def test_flops_per_token_of_a_windowed_model_count_its_real_parameters():
    """6 x (the real model's matmul weights) + the attention term with each layer's own keys."""
    c = GPTConfig(vocab_size=64, block_size=256, n_layer=3, n_head=4, n_embd=64,
                  attn={"window": 16, "window_pattern": "LLG"})
    model = GPT(c)
    keys = [16, 16, 256]
    assert flops_per_token(c) == 6 * model.num_params() + sum(12 * k * 64 for k in keys)


def test_cost_prints_the_four_ways(tmp_path, capsys):
    from helpers import compose_cfg
    from tools.cost import cost
    out = cost(compose_cfg("cost", ["model=cpu_small", "seq_len=4096", "plot=null"]))
    text = capsys.readouterr().out
    for name in ("reference (full table)", "tiled (FlashAttention)", "window W=512", "linear (elu + 1)"):
        assert name in text
    assert [r["name"] for r in out["attention_variants"]][1] == "tiled (FlashAttention)"
    assert math.isclose(out["attention_variants"][0]["memory"] / out["attention_variants"][1]["memory"], 4096 / 33,
                        rel_tol=1e-9)


def test_bench_attention_measures_each_path_against_its_own_prediction(tmp_path):
    """tools/bench_attention.py at two lengths: what the reference keeps for its backward grows ~4x when N
    doubles (the table), the tiled paths' ~2x (no table); each row's predicted MACs are counting's for
    that path's own config (the window path's W, not a default), and the plot is written."""
    from helpers import compose_cfg
    from tools.bench_attention import bench_attention
    cfg = compose_cfg("bench_attention", ["lengths=[512,1024]", "repeats=1", "window=32", "block=64",
                                          f"out={tmp_path / 'n2.png'}"])
    rows = {(r["path"], r["N"]): r for r in bench_attention(cfg)["rows"]}
    assert {p for p, _ in rows} == {"sdpa", "reference", "tiled", "window", "tiled_window", "linear"}
    grow = {p: rows[(p, 1024)]["saved_bytes"] / rows[(p, 512)]["saved_bytes"] for p, _ in rows}
    assert 3.0 < grow["reference"] < 4.2, grow  # the table, plus the O(N) projections it also keeps
    assert grow["tiled"] < 2.3 and grow["tiled_window"] < 2.3, grow
    d = cfg.n_embd
    assert rows[("window", 1024)]["predicted_macs_per_token"] == 2 * 32 * d
    assert rows[("tiled_window", 1024)]["predicted_macs_per_token"] == 2 * 32 * d
    assert rows[("tiled", 1024)]["predicted_macs_per_token"] == rows[("reference", 1024)]["predicted_macs_per_token"] \
        == 2 * 1024 * d
    assert all(r["ms"] > 0 for r in rows.values())
    assert (tmp_path / "n2.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_attention_decodes_each_recurrent_path_from_a_state_that_does_not_grow():
    """decode=true: sdpa's cache holds N + 1 keys and values (the context and the new token), gdn's and
    mamba2's state the same bytes at every N; each ratio is the median of the rounds' ratios to sdpa
    timed beside it, and the crossover is the first N from which the path stays below sdpa."""
    import statistics
    from helpers import compose_cfg
    from tools.bench_attention import bench_attention
    d = 64
    result = bench_attention(compose_cfg("bench_attention", ["lengths=[32,64]", "paths=[sdpa,gdn,mamba2]", "decode=true",
                                                            f"n_embd={d}", "n_head=2", "repeats=2", "out=null"]))
    rows = {(r["path"], r["N"]): r for r in result["rows"]}
    for N in (32, 64):
        assert rows[("sdpa", N)]["cache_bytes"] == 2 * (N + 1) * d * 4
        for path in ("gdn", "mamba2"):
            row, base = rows[(path, N)], rows[("sdpa", N)]
            assert row["vs_sdpa"] == statistics.median(a / b for a, b in zip(row["seconds"], base["seconds"]))
            assert row["decode_vs_sdpa"] == statistics.median(
                a / b for a, b in zip(row["decode_seconds"], base["decode_seconds"]))
            assert row["decode_ms"] > 0
    for path in ("gdn", "mamba2"):
        assert rows[(path, 32)]["cache_bytes"] == rows[(path, 64)]["cache_bytes"] > 0
        below = [rows[(path, N)]["vs_sdpa"] < 1 for N in (32, 64)]
        assert result["crossover"][path] == (32 if all(below) else 64 if below[1] else None)


def test_bench_attention_decode_needs_sdpa_to_compare_with():
    from helpers import compose_cfg
    from tools.bench_attention import bench_attention
    with pytest.raises(UserError, match="sdpa"):
        bench_attention(compose_cfg("bench_attention", ["lengths=[32]", "paths=[gdn]", "decode=true", "out=null"]))


def test_bench_times_other_layer_kinds_of_the_same_model_side_by_side(capsys):
    """bench.kinds: each pattern is the configured model with those layer kinds (its parameters are that
    model's), timed in the same rounds; its ratio is its median step time over the configured one's."""
    from helpers import compose_cfg
    from benchmarks import bench, print_result
    cfg = compose_cfg("bench", ["model=debug", "device=cpu", "bench.iters=1", "bench.warmup=0", "bench.rounds=2",
                                "bench.kinds=[gdn,mamba2+softmax]", "train.batch_size=2"])
    r = bench(cfg)
    for pattern, kinds in (("gdn", ["gdn"]), ("mamba2+softmax", ["mamba2", "softmax"])):
        c = model_config(cfg.model, cfg.bench.vocab_size)
        built = GPT(GPTConfig(**{**dataclasses.asdict(c), "attn": {**dataclasses.asdict(c.attn), "layer_kinds": kinds}}))
        assert r[pattern]["params"] == built.num_params() != r["params"]
        assert r[pattern]["time_ratio"] == r[pattern]["ms_per_iter"] / r["attnlab"]["ms_per_iter"]
        assert len(r[pattern]["round_ratios"]) == 2
    print_result(r)
    assert "mamba2+softmax:" in capsys.readouterr().out


# ----------------------------------------------------------------------------- recurrent kinds and hybrid stacks

@pytest.mark.parametrize("attn,bias", [({"kind": "gdn"}, False), ({"kind": "gdn"}, True),
                                       ({"kind": "mamba2"}, False), ({"kind": "mamba2", "state_dim": 32}, True)],
                         ids=["gdn", "gdn-bias", "mamba2", "mamba2-ds32-bias"])
def test_recurrent_layers_count_like_the_built_layer(attn, bias):
    """Parameters equal the built model's; the layer's matmul and convolution FLOPs, as FlopCounterMode
    measures them over two chunks, equal 2 x its counted MACs (projections, the chunked form's
    products, the gate's projection, one MAC per convolution weight); per token they do not grow with N
    past one chunk."""
    c = GPTConfig(vocab_size=64, block_size=128, n_layer=1, n_head=4, n_embd=128, bias=bias, attn=attn)
    model = GPT(c)
    assert count_params(c)["total"] == model.num_params()
    assert {k: count_params(c)[k] for k in by_kind(model)} == by_kind(model)
    B, N = 2, 128
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 64, (B, N)))
    measured = sum(counter.get_flop_counts()["GPT.blocks.0.attn"].values())
    m = macs_per_token(c, N)
    ds = attn.get("state_dim", 32)
    conv = 4 * (3 * 128 if attn["kind"] == "gdn" else 128 + 2 * ds)  # a depthwise kernel of 4 per channel
    gate = 128 * 128  # the output gate's projection, counted with `other`
    assert measured == 2 * B * N * (m["proj"] + m["attn"] + gate + conv)
    assert macs_per_token(c, 64)["attn"] == macs_per_token(c, 4096)["attn"] == macs_per_token(c, 2**18)["attn"]


HYBRIDS = [{"layer_kinds": ["gdn", "gdn", "softmax"]}, {"layer_kinds": ["mamba2", "linear", "softmax"]},
           {"layer_kinds": ["gdn", "softmax"], "window": 6, "window_pattern": "LLG"},
           {"layer_kinds": ["mla", "gdn"]}, {"kind": "mamba2", "state_dim": 16}]


@pytest.mark.parametrize("attn", HYBRIDS, ids=["gdn3-softmax", "mamba2-linear-softmax", "window-hybrid",
                                               "mla-gdn", "mamba2-ds16"])
def test_hybrid_stacks_count_like_the_built_model_and_their_caches(attn):
    """Every layer counted as its own kind: parameters equal the built model's; the
    KV-cache bytes and the recurrent layers' state bytes equal what the built caches hold, at lengths
    below and above the window and the block."""
    from counting import kv_cache_bytes, state_bytes
    c = GPTConfig(vocab_size=50, block_size=32, n_layer=5, n_head=4, n_embd=32, attn=attn)
    model = GPT(c)
    assert count_params(c)["total"] == model.num_params()
    assert {k: count_params(c)[k] for k in by_kind(model)} == by_kind(model)
    recurrent = ("LinearState", "RecurrentState")
    for length in (3, 6, 32):
        caches = model.new_kv_cache(2, length)
        kv = sum(x.nbytes() for x in caches if type(x).__name__ not in recurrent)
        states = sum(x.nbytes() for x in caches if type(x).__name__ in recurrent)
        assert (kv, states) == (kv_cache_bytes(c, length, 2), state_bytes(c, 2)), length


def test_a_qwen3_next_like_stack_at_262144_tokens_against_all_attention(capsys):
    """model=qwen3_next_shape (48 layers, 3 gdn : 1 attention) at 256K tokens: the KV cache and the
    states cost.py reports, written out from the shape, against the same stack all attention, and the
    layer table's counts equal the built layers' (one of each kind, at the same width)."""
    out = cost(compose_cfg("cost", ["model=qwen3_next_shape", "seq_len=262144", "plot=null"]))
    N, hs = 262144, 2048 // 16
    this, full = out["all_attention"]["this"], out["all_attention"]["all_attention"]
    assert full["kv_cache_bytes"] == 48 * 2 * 2 * hs * 2 * N and this["kv_cache_bytes"] == 12 * 2 * 2 * hs * 2 * N
    assert this["state_bytes"] == 36 * (16 * hs * hs + 3 * 2048 * 3) * 4 and full["state_bytes"] == 0
    assert [(r["kind"], r["layers"]) for r in out["layers"]] == [("gdn", 36), ("softmax", 12)]
    assert "cache + states" in capsys.readouterr().out
    c = model_config(compose_cfg("cost", ["model=qwen3_next_shape"]).model)
    small = GPT(dataclasses.replace(c, n_layer=2, vocab_size=8, block_size=8,
                                    attn=dataclasses.replace(c.attn, layer_kinds=["gdn", "softmax"])))
    assert [r["params"] for r in out["layers"]] == \
        [sum(p.numel() for p in b.attn.parameters()) for b in small.blocks]


def test_cost_says_what_a_selecting_query_reads(capsys):
    """model.attn.select: the mean keys a query reads at N, as counting.selected_keys gives them for the
    config and for its causal table ((N + 1) / 2)."""
    from counting import selected_keys
    cfg = compose_cfg("cost", ["model=debug", "model.vocab_size=50", "seq_len=256", "format=json", "plot=null",
                               "model.attn.select=moba", "model.attn.select_block=16", "model.attn.select_topk=3"])
    cost(cfg)
    out = json.loads(capsys.readouterr().out)["selected_keys_per_query"]
    c = model_config(cfg.model, 50)
    assert out == {"selected": float(selected_keys(c, 256)), "causal": 257 / 2}
    assert out["selected"] == (sum(i % 16 + 1 + min(3, i // 16) * 16 for i in range(256))) / 256
