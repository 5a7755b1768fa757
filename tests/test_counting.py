"""lab/counting.py: counts derived by hand for two small configs, the same counts from real models
(num_params, torch's FlopCounterMode, a real KV cache, the built recurrent states), every model preset,
and the crossovers plugged back in."""
from fractions import Fraction

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lab.config import model_config
from lab.counting import (activation_bytes, all_attention, attention_variants, count_params, crossovers, flops_per_token,
                      macs_per_token, memory_breakdown, per_gpu_bytes)
from helpers import GQA_SWIGLU, MHA_GELU, REPO, compose_cfg
from model import GPT, GPTConfig


def model_cfg(preset):
    """The model group of a preset (configs/model/PRESET.yaml), as every command composes it."""
    return compose_cfg("config", [f"model={preset}"]).model


# ----------------------------------------------------------------------------- by hand

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
    """The model's own parameters grouped by name, as counting.count_params groups them."""
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
    m = model_cfg(preset)
    c = model_config(m, None if m.vocab_size else 96)
    with torch.device("meta"):
        model = GPT(c)
    assert count_params(c)["total"] == model.num_params()
    for key, n in crossovers(c).items():  # and the crossovers hold for every preset (a hybrid's: its
        assert_crossover(all_attention(c), key, n)  # softmax layers', which have the N^2 part)


def test_llama3_8b_shape_is_llama_3_8b():
    c = model_config(model_cfg("llama3_8b_shape"))
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
            model(torch.randint(0, c.vocab_size, (B, N)), cache=caches, pos=0)  # prefill of N tokens
        assert all(cache.k[:, :, N - 1].abs().sum() > 0 for cache in caches)  # filled to the last slot
        cached = sum(t.numel() * t.element_size() for cache in caches for t in (cache.k, cache.v))
        assert cached == memory_breakdown(c, N, B, dtype.itemsize)[key]
    per_token = memory_breakdown(c, N, B, dtype.itemsize)["kv_cache_per_token"]
    assert per_token * N * B == memory_breakdown(c, N, B, dtype.itemsize)["kv_cache"]


def test_cache_table_gqa_row_is_between_mha_and_mqa():
    """The GQA row of an MHA config groups its heads (n_head/4, else n_head/2), never one K/V head
    (that is the MQA row); with 2 heads there is no grouping in between, so no GQA row."""
    from lab.counting import cache_table
    for n_head, want in ((16, "GQA (4 K/V heads)"), (4, "GQA (2 K/V heads)"), (6, "GQA (3 K/V heads)"), (2, None)):
        kinds = {r["kind"] for r in cache_table(GPTConfig(vocab_size=10, n_head=n_head, n_embd=8 * n_head))}
        gqa = [k for k in kinds if k.startswith("GQA")]
        assert gqa == ([want] if want else []), (n_head, kinds)


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
    from lab.counting import kv_cache_bytes, state_bytes
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



@pytest.mark.parametrize("attn", [{"kind": "linear"}, {"kind": "mla"}, {"layer_kinds": ["linear", "softmax"]},
                                  {"layer_kinds": ["gdn", "softmax"]}, {"layer_kinds": ["mamba2", "mla"], "pos": "none"}],
                         ids=["linear", "mla", "linear+softmax", "gdn+softmax", "mamba2+mla"])
def test_a_learned_sink_is_built_and_counted_only_in_softmax_layers(attn):
    """A sink is a key of the softmax: a layer without one (linear, gdn, mamba2) holds no sink logit, and the
    count (nh logits per softmax layer) equals the built model's parameters."""
    attn = dict(attn)
    pos = attn.pop("pos", "rope")
    c = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64, pos=pos, attn={**attn, "sink": "learned"})
    model = GPT(c)
    softmax_layers = [i for i, b in enumerate(model.blocks) if type(b.attn).__name__ in ("CausalSelfAttention", "LatentAttention")]
    assert sorted(n for n, _ in model.named_parameters() if "sink" in n) == \
        [f"blocks.{i}.attn.sink_logit" for i in softmax_layers]
    assert count_params(c)["total"] == model.num_params()
    without = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64, pos=pos, attn=attn)
    assert count_params(c)["total"] - count_params(without)["total"] == 4 * len(softmax_layers)
