"""The claims of text C (from RNNs to the Transformer: the worked example, heads, the FFN, positions,
the causal mask, Post-LN and Pre-LN, long contexts, the KV cache's fronts, RoPE's limits, sub-quadratic
alternatives), C1-C12: one check per claim, registered with @claim in the order of docs/claims.md.
claims/__init__.py holds the registry and what checks share."""
import dataclasses
import math

import torch
import torch.nn.functional as F

import attention as attn_lib
import variants
from lab.counting import count_params, kv_cache_bytes, macs_per_token
from model import GPT, GPTConfig
from claims.common import (IMPLS, Result, claim, flops, max_diff, preset, rand, skipped, slash, small_model,
                           stability_figures, verdict)


@claim("C1", "An RNN's error signal decays like γᵏ: with γ = 0.9, after 50 steps ≈ 0.5% is left; its steps cannot run "
             "in parallel over the sequence.",
       "RNN 的误差信号按 γᵏ 衰减：γ = 0.9 时 50 步后只剩约 0.5%；各步无法沿序列并行。")
def check_c1(ctx):
    x = torch.zeros(51, dtype=torch.float64, requires_grad=True)
    h = torch.zeros((), dtype=torch.float64)
    for t in range(51):  # h_t = γ h_{t-1} + x_t: each step waits for the one before
        h = 0.9 * h + x[t]
    (rnn,) = torch.autograd.grad(h, x)
    v = torch.zeros(1, 1, 51, 4, dtype=torch.float64, requires_grad=True)
    q = torch.zeros(1, 1, 51, 4, dtype=torch.float64)  # equal scores: uniform causal weights
    y = variants.attention(q, q, v, 0.5, impl="reference")
    (attn,) = torch.autograd.grad(y[0, 0, 50, 0], v)
    ok = abs(rnn[0].item() - 0.005) < 0.0005
    return Result(verdict(ok),
                  f"∂h_50/∂x_0 through a linear RNN (γ = 0.9, autograd): {rnn[0].item():.5f} = "
                  f"{100 * rnn[0].item():.2f}% after 50 sequential steps; through causal attention the same distance "
                  f"is one step: ∂y_50/∂v_0 = the weight {attn[0, 0, 0, 0].item():.4f} (1/51), however far",
                  "rounds to 0.5% (± 0.05 points)",
                  note="attnlab has no RNN: the recurrence is written out in the check",
                  figures={"rnn_gradient": rnn[0].item(), "attention_gradient": attn[0, 0, 0, 0].item()})


@claim("C2", "Worked example: q = (1,0,1); k = (1,0,1), (0,1,0), (1,0,0); v = 10, 0, 2. Raw scores 2, 0, 1; scaled "
             "(d_k = 3) ≈ 1.15, 0, 0.58; weights ≈ 0.53, 0.17, 0.30; output ≈ 5.9. No weight is exactly 0.",
       "算例：q = (1,0,1)，k 为 (1,0,1)、(0,1,0)、(1,0,0)，v = 10、0、2。原始分数 2、0、1；缩放后约 1.15、0、0.58；"
       "权重约 0.53、0.17、0.30；输出约 5.9；没有权重恰为 0。")
def check_c2(ctx):
    q = torch.tensor([[[[1.0, 0, 1]]]], dtype=torch.float64)
    k = torch.tensor([[[[1.0, 0, 1], [0, 1, 0], [1, 0, 0]]]], dtype=torch.float64)
    v = torch.tensor([[[[10.0], [0], [2]]]], dtype=torch.float64)
    raw = attn_lib.attention_scores(q, k, scale=attn_lib.resolve_scale("none", 3)).flatten().tolist()
    scale = attn_lib.resolve_scale("sqrt_dk", 3)
    scaled = attn_lib.attention_scores(q, k, scale=scale).flatten().tolist()
    eye = torch.eye(3, dtype=q.dtype).view(1, 1, 3, 3)  # weights @ I: the weights themselves
    weights = variants.attention(q, k, eye, scale, causal=False).flatten().tolist()
    out = variants.attention(q, k, v, scale, causal=False).item()
    near = lambda xs, ys: all(abs(a - b) <= 0.005 for a, b in zip(xs, ys))  # noqa: E731  the text's two decimals
    ok = (raw == [2, 0, 1] and near(scaled, [1.15, 0, 0.58]) and near(weights, [0.53, 0.17, 0.30])
          and abs(out - 5.9) <= 0.05 and min(weights) > 0)
    return Result(verdict(ok), f"raw {slash(raw, 0)}; scaled {slash(scaled, 3)}; weights {slash(weights, 3)}; "
                  f"output {out:.3f}; smallest weight {min(weights):.3f} > 0",
                  "each figure rounds to the text's (± 0.005; output ± 0.05); every weight > 0",
                  figures={"raw": raw, "scaled": scaled, "weights": weights, "output": out})


@claim("C3", "Multi-head at the base size: 8 heads of 64 in 512 cost about as much as one 512-wide head.",
       "基础规模下：512 维里 8 个 64 维的头，开销与一个 512 维的头差不多。")
def check_c3(ctx):
    N, x = 64, torch.randn(1, 64, 512)
    counted, measured = {}, {}
    for heads in (8, 1):
        c = GPTConfig(vocab_size=2, block_size=N, n_layer=1, n_head=heads, n_embd=512, attn={"impl": "reference"})
        counted[heads] = macs_per_token(c, N)["layer"]
        layer = variants.make_attention(c, 0)
        measured[heads] = flops(lambda: layer(x))
    ok = counted[8] == counted[1] and abs(measured[8] / measured[1] - 1) <= 0.01
    return Result(verdict(ok), f"one attention layer at N = {N}: {measured[8] / 1e6:.1f} MFLOPs with 8 heads of 64, "
                  f"{measured[1] / 1e6:.1f} with 1 head of 512 (FLOP counter); counted MACs per token equal "
                  f"({counted[8]:,})", "counted equal, measured within 1%",
                  figures={"flops": measured, "macs_per_token": counted})


@claim("C4", "The FFN (d_ff = 4·d_model = 2048 at base) holds most parameters.",
       "前馈层（基础规模 d_ff = 4·d_model = 2048）占了大部分参数。")
def check_c4(ctx):
    c = GPTConfig(vocab_size=37000, block_size=512, n_layer=6, n_head=8, n_embd=512, d_ff=2048)
    p = count_params(c)
    blocks = p["attention"] + p["mlp"] + p["norms"]
    share = p["mlp"] / blocks
    return Result(verdict(share > 0.5),
                  f"counting.count_params at d = 512, d_ff = 2048, 6 layers: FFN {p['mlp']:,} of the blocks' "
                  f"{blocks:,} ({100 * share:.1f}%), attention {p['attention']:,}; the 37k-token embedding "
                  f"{p['embedding']:,}", "the FFN more than half of the blocks' parameters",
                  note="the blocks' parameters; with the original 37k-token vocabulary the embedding table alone "
                       "is larger than the 6 FFNs of this decoder-only stack",
                  figures={"params": p, "ffn_share_of_blocks": share})


def shuffled_last_logits(model, idx, gen):
    """(max |Δ| of the last position's logits when the earlier tokens are shuffled, the permutation)."""
    T = idx.size(1)
    perm = torch.cat([torch.randperm(T - 1, generator=gen), torch.tensor([T - 1])])
    with torch.no_grad():
        return max_diff(model(idx)[:, -1], model(idx[:, perm])[:, -1])


@claim("C5", "Without position information attention cannot tell \"dog bites man\" from \"man bites dog\": it is "
             "permutation-equivariant; positions (e.g. RoPE) break that.",
       "没有位置信息，注意力分不清“狗咬人”和“人咬狗”：它对排列等变；位置编码（如 RoPE）打破了这一点。",
       trains=True, tests=("tests/variants/test_positions.py::test_nope_one_layer_ignores_the_order_of_earlier_tokens",))
def check_c5(ctx):
    gen, T = ctx.gen(), 48
    q, k, v = (rand(gen, 1, 2, 12, 8) for _ in range(3))
    perm = torch.randperm(12, generator=gen)
    out = variants.attention(q, k, v, 8 ** -0.5, causal=False)
    equivariant = max_diff(out[:, :, perm], variants.attention(q[:, :, perm], k[:, :, perm], v[:, :, perm],
                                                               8 ** -0.5, causal=False))
    torch.manual_seed(ctx.seed)
    deep = shuffled_last_logits(small_model(n_layer=2, pos="none"), torch.randint(40, (4, T), generator=gen), gen)
    if ctx.quick:
        torch.manual_seed(ctx.seed)
        models = {"nope": small_model(n_layer=1, pos="none"), "rope": small_model(n_layer=1)}
        idx, which = torch.randint(40, (4, T), generator=gen), "random 1-layer models"
    else:
        models = {name: ctx.trained(name).model() for name in ("nope", "rope")}
        val = ctx.trained("nope").val_tokens()
        idx, which = val[: 4 * T].view(4, T), f"trained 1-layer models ({ctx.trained('nope').result['steps']} steps)"
    moved = {name: shuffled_last_logits(m, idx, gen) for name, m in models.items()}
    ok = equivariant <= 1e-12 and moved["nope"] <= 1e-4 and moved["rope"] >= 0.05
    return Result(verdict(ok),
                  f"attention() without mask or positions: permuting the tokens permutes the outputs (to "
                  f"{equivariant:.0e}); {which}, earlier tokens shuffled: the last logits move {moved['nope']:.0e} "
                  f"without positions, {moved['rope']:.2f} with RoPE",
                  "equivariant within 1e-12; NoPE's last logits within 1e-4, RoPE's moved ≥ 0.05",
                  note=f"from two causal layers on, NoPE sees order too (a random 2-layer NoPE model's last logits "
                       f"moved {deep:.2f}): the causal mask is itself a position signal",
                  figures={"equivariance_diff": equivariant, "last_logits_moved": moved, "two_layer_nope_moved": deep})


@claim("C6", "The causal mask: each position sees itself and earlier ones only; later tokens never change earlier "
             "outputs.",
       "因果掩码：每个位置只看到自己和之前的位置；后面的词永远不会改变前面的输出。",
       tests=("tests/test_model.py::test_causality_future_tokens_never_change_earlier_logits",))
def check_c6(ctx):
    gen, T, t = ctx.gen(), 24, 13
    idx = torch.randint(40, (2, T), generator=gen)
    changed = idx.clone()
    changed[:, t:] = torch.randint(40, (2, T - t), generator=gen)
    earlier, later = {}, {}
    for impl in IMPLS:
        torch.manual_seed(ctx.seed)
        model = small_model(n_layer=2, attn={"impl": impl})
        with torch.no_grad():
            a, b = model(idx), model(changed)
        earlier[impl], later[impl] = max_diff(a[:, :t], b[:, :t]), max_diff(a[:, t:], b[:, t:])
    ok = max(earlier.values()) <= 1e-5 and min(later.values()) >= 0.01
    return Result(verdict(ok),
                  f"tokens {t}..{T - 1} replaced: logits at 0..{t - 1} move "
                  + ", ".join(f"{i} {d:.0e}" for i, d in earlier.items())
                  + f"; later ones move ≥ {min(later.values()):.2f}",
                  "earlier logits within 1e-5 on every path; later ones moved",
                  figures={"earlier": earlier, "later": later})


@claim("C7", "Post-LN (the original placement) vs Pre-LN (later found to train deep stacks more stably).",
       "Post-LN（原始的放法）与 Pre-LN（后来发现训练深层网络更稳定）。", trains=True)
def check_c7(ctx):
    if ctx.quick:
        return skipped("two 12-layer models trained without warmup")
    runs = {name: ctx.trained(name) for name in ("pre_ln", "post_ln")}
    loss = {name: (run.result["val_loss_full"] if run.result else math.inf) for name, run in runs.items()}
    m, t = runs["pre_ln"].cfg.model, runs["pre_ln"].cfg.train
    tolerance = "Pre-LN's whole-val loss ≥ 0.05 nats below Post-LN's, or Post-LN diverging"
    said = (f"{m.n_layer} layers x {m.n_embd} wide, warmup {t.warmup_iters}, lr {t.lr:g}, {t.max_iters} steps: "
            "val loss (whole split) Pre-LN "
            + (f"stopped ({runs['pre_ln'].error})" if not runs["pre_ln"].result else f"{loss['pre_ln']:.3f}")
            + ", Post-LN "
            + (f"stopped ({runs['post_ln'].error})" if not runs["post_ln"].result else f"{loss['post_ln']:.3f}"))
    if loss["pre_ln"] <= loss["post_ln"] - 0.05:
        return Result("holds", said, tolerance, figures={"val_loss_full": loss})
    gap = loss["pre_ln"] - loss["post_ln"]
    here = f"here Post-LN ended {gap:.2f} nats ahead; " if gap >= 0.05 else ""
    return Result("not_shown", said, tolerance,
                  note=here + "one seed at CPU size; Xiong et al. (2020, arXiv 2002.04745) saw Post-LN need warmup in "
                       "larger models trained longer" + norm_sweep_note(),
                  figures={"val_loss_full": loss})


def norm_sweep_note() -> str:
    """docs/stability.md's Pre-LN/Post-LN sweep in one clause (its figures from docs/stability.json)."""
    f = stability_figures().get("norm_position")
    if not f:
        return ""
    pre, post, post0 = (f["loss"][k]["1e-2"] for k in ("pre_ln_warmup30", "post_ln_warmup30", "post_ln_no_warmup"))
    return (f". Under an lr sweep (docs/stability.md (3), {f['layers']} layers, {f['seeds']} seeds) Pre-LN trains at lr "
            f"1e-2 ({pre:.2f}) where Post-LN ends at {post:.2f} with a 30-step warmup and {post0:.2f} without; "
            f"{f['unigram_runs']} of its {f['post_ln_runs']} runs ended at the unigram loss (token frequencies only): "
            "the higher lr holds" + warmup_note())


def warmup_note() -> str:
    """docs/stability.md's 8-layer warmup cell in one clause, or that the need for warmup is not shown."""
    w = stability_figures().get("warmup_8_layers")
    if not w:
        return "; the need for warmup is not shown at this depth"
    loss = w["loss"]
    return (f"; at 8 layers and lr {w['lr']:g} ({w['seeds']} seeds) Post-LN ends at {loss['post_warmup0']:.2f} without "
            f"warmup ({w['post_no_warmup_unigram']} of {w['seeds']} at the unigram loss) and {loss['post_warmup100']:.2f} "
            f"with 100 warmup steps, Pre-LN at {loss['pre_warmup0']:.2f} and {loss['pre_warmup100']:.2f}" + trend_note())


def trend_note() -> str:
    """docs/practice.md's warmup lengths and gradients at initialisation in one clause."""
    f = stability_figures()
    t, init = f.get("warmup_trend"), f.get("grad_at_init")
    if not t:
        return ""
    u = t["unigram"]
    out = (f"; with warmup 0 / 30 / 100 (docs/practice.md (3), {t['seeds']} seeds) {u['post_warmup0']} / "
           f"{u['post_warmup30']} / {u['post_warmup100']} Post-LN runs ended at the unigram loss")
    if init:
        out += (f"; at initialisation the last block's gradient norm is {init['post_ln'][-1] / init['post_ln'][0]:.2g}× the "
                f"first's in Post-LN, {init['pre_ln'][-1] / init['pre_ln'][0]:.2g}× in Pre-LN")
    return out


@claim("C8", "2K → 32K tokens (16×) multiplies the attention scores' compute by 256.",
       "上下文从 2K 到 32K（16 倍），注意力打分的计算量变为 256 倍。")
def check_c8(ctx):
    c = GPTConfig(vocab_size=2, block_size=16, n_layer=1, n_head=1, n_embd=8)
    counted = (macs_per_token(c, 32768)["scores"] * 32768) / (macs_per_token(c, 2048)["scores"] * 2048)
    x = {N: [torch.randn(1, 1, N, 8) for _ in range(3)] for N in (64, 1024)}
    fl = {N: flops(lambda: variants.attention(*x[N], 1.0, causal=False, impl="reference")) for N in x}
    ok = counted == 256 and fl[1024] == 256 * fl[64]
    return Result(verdict(ok), f"counted (counting.macs_per_token) 2048 → 32768: {float(counted):g}x; measured "
                  f"reference-path FLOPs 64 → 1024 tokens (16x): {fl[1024] / fl[64]:g}x", "256 exactly, both",
                  figures={"counted": float(counted), "measured": fl[1024] / fl[64]})


@claim("C9", "KV-cache bytes ≈ layers × KV heads × tokens × head dim × 2 × bytes × batch; at long contexts and many "
             "requests it exceeds the weights; GQA cuts it about linearly in the number of KV heads.",
       "KV 缓存字节数 ≈ 层数 × KV 头数 × token 数 × 头维度 × 2 × 每数字节数 × 批大小；长上下文、多请求时超过权重；"
       "GQA 让它随 KV 头数近似线性减小。",
       tests=("tests/test_counting.py::test_kv_bytes_equal_a_real_cache_after_prefill",
              "tests/test_variants.py::test_kv_cache_is_n_head_over_n_kv_head_times_smaller"))
def check_c9(ctx):
    small = GPTConfig(vocab_size=40, block_size=64, n_layer=3, n_head=4, n_kv_head=2, n_embd=32)
    cache = GPT(small).new_kv_cache(3, 50, dtype=torch.bfloat16)
    real = sum(c.k.nbytes + c.v.nbytes for c in cache)
    formula = small.n_layer * small.n_kv_head * 50 * small.head_dim * 2 * 2 * 3
    c = preset("llama3_8b_shape")
    weights = count_params(c)["total"] * 2
    per_seq = kv_cache_bytes(c, 8192, 1, 2)
    sequences = math.ceil(weights / per_seq)
    by_heads = {h: kv_cache_bytes(c, 8192, 1, 2, n_kv_head=h) for h in (32, 8, 1)}
    ok = (real == formula == kv_cache_bytes(small, 50, 3, 2) and by_heads[32] == 4 * by_heads[8] == 32 * by_heads[1]
          and kv_cache_bytes(c, 8192, sequences, 2) > weights)
    return Result(verdict(ok),
                  f"a real cache (3 layers, 2 KV heads, 50 tokens, batch 3, bf16) holds {real:,} B = the formula; "
                  f"llama3_8b_shape in bf16: {per_seq / 2**30:g} GiB per 8k sequence, so {sequences} sequences of 8k "
                  f"outweigh the {weights / 1e9:.1f} GB of weights; 32 / 8 / 1 KV heads: "
                  + " / ".join(f"{b / 2**30:g}" for b in by_heads.values()) + " GiB",
                  "the real cache equals the formula to the byte; 4x and 32x exactly for 8 and 1 KV heads",
                  figures={"real_bytes": real, "formula_bytes": formula, "bytes_per_8k_sequence": per_seq,
                           "sequences_to_exceed_weights": sequences, "by_kv_heads": by_heads})


@claim("C10", "The KV cache is fought on several fronts: GQA/MQA/MLA compression, quantisation, eviction.",
       "KV 缓存有多条战线：GQA/MQA/MLA 压缩、量化、淘汰。",
       tests=("tests/test_decode.py::test_bf16_kv_cache_follows_the_reference_to_bf16_rounding",
              "tests/variants/test_mla.py::test_mla_cache_holds_only_the_latent_and_the_rope_key",
              "tests/variants/test_int8_cache.py::test_int8_cache_dequantises_within_half_a_scale_and_weighs_what_cost_py_says",
              "tests/variants/test_sink_cache.py::test_sink_eviction_equals_attention_over_exactly_the_kept_positions"))
def check_c10(ctx):
    base = dict(vocab_size=40, block_size=64, n_layer=2, n_head=8, n_embd=64)
    size = {h: sum(c.nbytes() for c in GPT(GPTConfig(**base, n_kv_head=h)).new_kv_cache(1, 64)) for h in (8, 2, 1)}
    mla = GPT(GPTConfig(**base, attn={"kind": "mla", "kv_lora_rank": 16, "rope_head_dim": 4}))
    size["mla"] = sum(c.nbytes() for c in mla.new_kv_cache(1, 64))  # latent 16 + RoPE key 4 per token and layer
    model = GPT(GPTConfig(**base))
    by_dtype = {str(dt).split(".")[1]: sum(c.nbytes() for c in model.new_kv_cache(1, 64, dtype=dt))
                for dt in (torch.float32, torch.bfloat16, torch.int8)}
    evicting = model.new_kv_cache(1, 16, sinks=4)  # StreamingLLM: 4 sinks + the latest 12 of any length
    windowed = GPT(GPTConfig(**base, attn={"window": 16})).new_kv_cache(1, 64)
    ok = size[8] == 4 * size[2] == 8 * size[1] and size[8] == size["mla"] * 2 * 8 * 8 // 20 \
        and by_dtype["float32"] == 2 * by_dtype["bfloat16"] and by_dtype["int8"] < by_dtype["bfloat16"] \
        and evicting[0].length == 16 and evicting[0].sinks == 4 and windowed[0].length == 16
    return Result(verdict(ok),
                  f"compression: 8 → 2 → 1 KV heads make the cache {size[8] // size[2]}x / {size[8] // size[1]}x "
                  f"smaller, MLA (a latent of 16 and a RoPE key of 4 per token) {size[8] / size['mla']:.1f}x; "
                  f"quantisation: int8 with a scale per token and head {by_dtype['float32'] / by_dtype['int8']:.2f}x "
                  f"below fp32 (bf16 2x); eviction: a cache of 16 that keeps 4 sink tokens and the latest 12 "
                  f"(sample.kv_sinks), a windowed layer's of 16",
                  "each front's bytes as counted: 4x, 8x, 2·8·8/(16+4) for MLA, 2x bf16, < bf16 for int8, fixed sizes",
                  note="evicting by importance (e.g. H2O) and int4 are not in attnlab; docs/kv_cache.md measures what "
                       "eviction does to the loss",
                  figures={"bytes_by_kv_heads": size, "bytes_by_dtype": by_dtype})


@claim("C11", "RoPE has limits when extrapolating past the trained length.",
       "RoPE 外推到超过训练长度时能力有限。", trains=True,
       tests=("tests/variants/test_rope_scaling.py::test_each_rope_scaling_is_its_formula_and_factor_one_is_none",
              "tests/variants/test_alibi.py::test_alibi_attention_is_the_biased_softmax_written_out"))
def check_c11(ctx):
    if ctx.quick:
        return skipped("a trained model")
    from lab.heldout import window_losses

    def late_loss(model, L):  # the mean loss of positions 4x..8x the trained length, every window of L
        n = window_losses(model, val, L)
        return n[:, L // 2:].mean().item()

    run = ctx.trained("scaled")
    trained = run.model()
    alibi = ctx.trained("alibi").model()  # trained like "scaled", ALiBi in place of RoPE
    T = trained.config.block_size
    L = 8 * T
    val = run.val_tokens()
    with torch.no_grad():
        windowed = F.cross_entropy(trained(val[: ((len(val) - 1) // L) * L].view(-1, L), window=T)[:, L // 2:]
                                   .reshape(-1, trained.config.vocab_size),
                                   val[1: ((len(val) - 1) // L) * L + 1].view(-1, L)[:, L // 2:].reshape(-1)).item()
        loss = {"rope": late_loss(trained, L), f"rope, window {T}": windowed}
        fields = dataclasses.asdict(trained.config)  # the fields, not what __post_init__ derives
        for scaling in ("linear", "ntk", "yarn"):  # the same weights, RoPE scaled 8x at evaluation
            scaled = GPT(GPTConfig(**{**fields, "rope_scaling": scaling, "rope_scaling_factor": 8.0})).eval()
            scaled.load_state_dict(trained.state_dict())
            loss[f"rope + {scaling} x8"] = late_loss(scaled, L)
        loss["alibi"] = late_loss(alibi, L)
        loss["alibi, at the trained length"] = window_losses(alibi, val, T).mean().item()
    rise = loss["rope"] - loss[f"rope, window {T}"]
    best = min(("rope + linear x8", "rope + ntk x8", "rope + yarn x8"), key=loss.get)
    status = "holds" if rise >= 0.05 else "not_shown"
    return Result(status,
                  f"models trained at {T} tokens, on the val split in windows of {L}, positions {L // 2}-{L - 1}: RoPE "
                  f"{loss['rope']:.3f} nats vs {loss[f'rope, window {T}']:.3f} seeing only the latest {T} "
                  f"(+{rise:.3f}); scaled at evaluation: {best} {loss[best]:.3f}; ALiBi {loss['alibi']:.3f} "
                  f"({loss['alibi, at the trained length']:.3f} at its trained length)",
                  "the same tokens cost ≥ 0.05 nats more with context past the trained length",
                  note="the rise mixes unseen rotation offsets with attention spread over more keys; docs/positions.md "
                       "has every scheme and scaling with seeds (tools/eval_lengths.py)",
                  figures={"loss": loss, "rise": rise})


@claim("C12", "Sub-quadratic alternatives: state-space models (Mamba), linear attention, and hybrids of both with "
              "standard attention.",
       "次二次的替代方案：状态空间模型（Mamba）、线性注意力，以及二者与标准注意力的混合。", trains=True,
       tests=("tests/variants/test_gdn.py::test_chunked_form_equals_the_formula_written_out",
              "tests/variants/test_mamba2.py::test_ssd_is_its_materialised_matrix_and_the_recurrence",
              "tests/test_variants.py::test_cached_generation_equals_recomputation"))
def check_c12(ctx):
    torch.manual_seed(ctx.seed)
    kinds = {"linear": ["linear"], "Mamba-2 (SSD)": ["mamba2"], "Gated DeltaNet": ["gdn"],
             "hybrid gdn + softmax": ["gdn", "softmax"]}
    idx = torch.randint(40, (1, 40), generator=ctx.gen())
    diffs, states, kv = {}, {}, {}
    for name, pattern in kinds.items():
        model = small_model(n_layer=2, attn={"layer_kinds": pattern})
        recurrent = [not b.attn.softmax for b in model.blocks]
        held = {n: [x.nbytes() for x in model.new_kv_cache(1, n)] for n in (256, 4096)}  # the built caches, fp32
        states[name] = {n: sum(b for b, r in zip(held[n], recurrent) if r) for n in held}
        kv[name] = {n: sum(b for b, r in zip(held[n], recurrent) if not r) for n in held}
        model = model.double()  # the two forms compared in float64: their own gap, not rounding
        with torch.no_grad():
            parallel = model(idx)
            cache = model.new_kv_cache(1, 40)
            steps = [model(idx[:, t:t + 1], cache=cache, pos=t) for t in range(40)]  # one token at a time
        diffs[name] = max_diff(torch.cat(steps, 1), parallel)
    constant = all(s[256] == s[4096] > 0 for s in states.values())
    hybrid = kv["hybrid gdn + softmax"]
    quick_ok = max(diffs.values()) <= 1e-9 and constant and hybrid[4096] == 16 * hybrid[256] > 0
    measured = ("recurrent = parallel (one token at a time with the state vs the whole sequence, float64) to "
                + ", ".join(f"{n} {d:.0e}" for n, d in diffs.items())
                + "; the recurrent layers' state in bytes at N = 256 and 4096 (built caches): "
                + ", ".join(f"{n} {s[256]:,} / {s[4096]:,}" for n, s in states.items() if n in kinds)
                + f"; the hybrid's softmax layer's KV cache {hybrid[256]:,} / {hybrid[4096]:,}")
    tolerance = "recurrent = parallel within 1e-9; the state the same size at every N" + \
        ("" if ctx.quick else "; trained: the hybrid [linear, softmax] recalls ≥ 0.9 and ≥ pure linear + 0.2")
    figures = {"max_diff": diffs, "state_bytes": states, "kv_cache_bytes": kv}
    if ctx.quick:
        return Result(verdict(quick_ok), measured + " (the recall part: full run)", tolerance, figures=figures)
    runs = {name: ctx.trained(name) for name in ("recall_linear", "recall_hybrid")}
    recall = {name: run.result["val/recall_acc"] for name, run in runs.items()}
    ok = quick_ok and recall["recall_hybrid"] >= 0.9 and recall["recall_hybrid"] >= recall["recall_linear"] + 0.2
    figures["recall"] = recall
    cfg = runs["recall_linear"].cfg
    return Result(verdict(ok), measured + f"; trained on multi-query associative recall ({', '.join(map(str, cfg.data.pairs))} pairs in "
                  f"{cfg.model.block_size} tokens, {cfg.model.n_layer} layers of one {cfg.model.n_embd}-wide head, "
                  f"{cfg.train.max_iters} steps): pure linear recalls {recall['recall_linear']:.3f}, the hybrid "
                  f"[linear, softmax] {recall['recall_hybrid']:.3f}", tolerance,
                  note="one seed here; in docs/hybrids.md (3 seeds, 2,000 steps) [linear, softmax] learned the lookup in 1 of 3 "
                       "seeds and [gdn, softmax] in all 3",
                  figures=figures)
