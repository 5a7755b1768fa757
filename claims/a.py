"""The claims of text A (Q/K/V, the 1/√d_k scale, the N² accounts: FLOPs, memory, FlashAttention,
recomputation, sparse and linear attention, prefill and decode), A1-A11: one check per claim, registered
with @claim in the order of docs/claims.md. claims/__init__.py holds the registry and what checks share."""
import math

import torch
from torch.utils.checkpoint import checkpoint

import attention as attn_lib
import variants
from lab.attnstats import logit_bound
from lab.counting import saved_bytes
from lab.counting import attention_variants, crossovers, macs_per_token, memory_breakdown, selected_keys
from model import GPTConfig
from claims.common import (IMPLS, LargestTensor, Result, claim, flops, fmt, layer_max, max_diff, max_logit, preset, rand,
                    slash, small_model, stability_figures, verdict)


@claim("A1", "Attention is five steps: scores QKᵀ, scale by 1/√d_k, add the mask M, softmax, weighted sum of V.",
       "注意力分五步：QKᵀ 打分，乘以 1/√d_k 缩放，加上掩码 M，做 softmax，再对 V 加权求和。",
       tests=("tests/test_attention.py::test_reference_path_equals_hand_written_softmax",
              "tests/test_attention.py::test_fast_path_equals_reference"))
def check_a1(ctx):
    gen, d, T = ctx.gen(), 16, 9
    q, k, v = (rand(gen, 2, 3, T, d) for _ in range(3))
    scores = q @ k.transpose(-2, -1)  # 1. scores
    scaled = scores / math.sqrt(d)  # 2. scale
    mask = torch.full((T, T), -math.inf, dtype=scores.dtype).triu(1)  # 3. M: 0 on and below the diagonal
    weights = torch.softmax(scaled + mask, dim=-1)  # 4. softmax
    five = weights @ v  # 5. weighted sum of V
    scale = attn_lib.resolve_scale("sqrt_dk", d)
    diffs = {impl: max_diff(variants.attention(q, k, v, scale, impl=impl), five) for impl in IMPLS}
    return Result(verdict(max(diffs.values()) <= 1e-10),
                  "the five steps written out in float64 vs attention(): max |diff| "
                  + ", ".join(f"{impl} {d_:.0e}" for impl, d_ in diffs.items()),
                  "every path within 1e-10 of the five steps", figures={"max_diff": diffs})


@claim("A2", "Var(q·k) = d_k for q, k with independent mean-0 variance-1 components: over 8192 random pairs "
             "std ≈ 2.8 / 11.3 / 32.4 at d_k = 8 / 128 / 1024.",
       "q、k 各分量独立、均值 0、方差 1 时 Var(q·k) = d_k：8192 对随机向量下，d_k = 8 / 128 / 1024 的标准差约为 "
       "2.8 / 11.3 / 32.4。",
       tests=("tests/test_attention.py::test_raw_score_variance_is_dk_and_sqrt_dk_scaling_makes_it_one",))
def check_a2(ctx):
    gen, n = ctx.gen(), 8192
    stds, ratios, scaled = [], [], []
    for d in (8, 128, 1024):
        q, k = rand(gen, n, 1, 1, d), rand(gen, n, 1, 1, d)  # 8192 pairs, one score each
        raw = attn_lib.attention_scores(q, k, scale=attn_lib.resolve_scale("none", d)).flatten()
        stds.append(raw.std().item())
        ratios.append(raw.var().item() / d)
        scaled.append(attn_lib.attention_scores(q, k, scale=attn_lib.resolve_scale("sqrt_dk", d)).var().item())
    roots = [math.sqrt(d) for d in (8, 128, 1024)]
    ok = all(abs(s / r - 1) <= 0.05 for s, r in zip(stds, roots)) and all(abs(v - 1) <= 0.1 for v in scaled)
    spread = math.sqrt((2 + 6 / 1024) / (4 * n))  # relative sd of a sample std of q·k (kurtosis 3 + 6/d_k)
    return Result(verdict(ok),
                  f"std {slash(stds)} (√d_k = {slash(roots)}); Var/d_k {slash(ratios)}; "
                  f"after ×1/√d_k Var {slash(scaled)}",
                  "std within 5% of √d_k at each d_k; Var within 10% of 1 after the scale",
                  note=f"the text's 32.4 is {100 * (32.4 / 32 - 1):.1f}% above √1024 = 32: one draw of {n} pairs "
                       f"varies by ±{100 * spread:.1f}% (1 sd), so it is such a draw",
                  figures={"std": stds, "var_over_dk": ratios, "scaled_var": scaled},
                  rounded={"var_over_dk": [round(r, 1) for r in ratios], "scaled_var": [round(v, 1) for v in scaled]})


def six_score_rows(gen, n=8192, d=128):
    """q (n, 1, 1, d) and k (n, 1, 6, d) of random unit-variance vectors: n rows of 6 scores whose
    spread is that of d_k = d (std √d)."""
    return rand(gen, n, 1, 1, d), rand(gen, n, 1, 6, d)


@claim("A3", "Rows of 6 scores with the spread of d_k = 128 (std 11.3): the largest softmax weight averages ≈ 0.92 "
             "over 8192 rows; divided by √128 first, ≈ 0.42.",
       "6 个分数一行、离散度如 d_k = 128（标准差 11.3）：8192 行上最大 softmax 权重平均约 0.92；"
       "先除以 √128 则约 0.42。",
       tests=("tests/test_attention.py::test_softmax_peak_of_six_scores_unscaled_vs_scaled",))
def check_a3(ctx):
    q, k = six_score_rows(ctx.gen())
    eye = torch.eye(6, dtype=q.dtype).expand(q.size(0), 1, 6, 6)  # weights @ I: the weights themselves
    peaks = {s: variants.attention(q, k, eye, attn_lib.resolve_scale(s, 128), causal=False,
                                   impl="reference").amax(-1).mean().item() for s in ("none", "sqrt_dk")}
    ok = abs(peaks["none"] - 0.92) <= 0.02 and abs(peaks["sqrt_dk"] - 0.42) <= 0.02
    return Result(verdict(ok), f"mean peak weight {fmt(peaks['none'], 3)} unscaled, {fmt(peaks['sqrt_dk'], 3)} "
                               "with the scale (attention(), reference path, 8192 rows)",
                  "each within 0.02 of the text's figure", figures={"peak": peaks},
                  rounded={"peak": {s: round(p, 2) for s, p in peaks.items()}})


def softmax_jacobian_norms(scores):
    """‖∂softmax(s)/∂s‖_F of each row of scores (n, m), through attention(): with q = s, keys and
    values the identity, the output is the row's softmax weights."""
    n, m = scores.shape
    s = scores.reshape(n, 1, 1, m).clone().requires_grad_()
    eye = torch.eye(m, dtype=s.dtype).expand(n, 1, m, m)
    w = variants.attention(s, eye, eye, 1.0, causal=False, impl="reference")  # (n, 1, 1, m)
    jac = torch.stack([torch.autograd.grad(w[..., j].sum(), s, retain_graph=True)[0] for j in range(m)], -2)
    return jac.reshape(n, m * m).norm(dim=1)


def qkv_grads(q, k, scale, gen):
    """Median per-row gradient norms of q, k and v for a random linear function of attention's output."""
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    v = rand(gen, *k.shape).requires_grad_()
    out = variants.attention(q, k, v, scale, causal=False, impl="reference")
    (out * rand(gen, *out.shape)).sum().backward()
    return {name: t.grad.flatten(1).norm(dim=1).median().item() for name, t in (("q", q), ("k", k), ("v", v))}


@claim("A4", "A saturated softmax has Jacobian A_i(δ_ij − A_j) → 0: the gradients that would move q and k vanish "
             "(V still learns). Trained without 1/√d_k, attention saturates.",
       "softmax 饱和时雅可比 A_i(δ_ij − A_j) → 0：推动 q、k 的梯度消失（V 仍在学习）；不用 1/√d_k 训练，注意力会饱和。",
       trains=True,
       tests=("tests/test_attnstats.py::test_removing_sqrt_dk_saturates_attention_of_large_qk",))
def check_a4(ctx):
    gen = ctx.gen()
    q, k = six_score_rows(gen)
    s = (q @ k.transpose(-2, -1)).reshape(-1, 6)  # the raw scores, std ≈ 11.3
    scale = attn_lib.resolve_scale("sqrt_dk", 128)
    jac = {"scaled": softmax_jacobian_norms(s * scale).median().item(),
           "unscaled": softmax_jacobian_norms(s).median().item()}
    grads = {"scaled": qkv_grads(q, k, scale, gen), "unscaled": qkv_grads(q, k, 1.0, gen)}
    quick_ok = (jac["unscaled"] <= 0.1 * jac["scaled"] and grads["unscaled"]["q"] < grads["scaled"]["q"]
                and grads["unscaled"]["v"] >= 0.5 * grads["scaled"]["v"])
    measured = (f"median ‖Jacobian‖ {fmt(jac['scaled'], 3)} with the scale, {fmt(jac['unscaled'], 4)} without "
                f"({jac['scaled'] / jac['unscaled']:.0f}x smaller); median ‖∂/∂q‖ {fmt(grads['scaled']['q'])} → "
                f"{fmt(grads['unscaled']['q'])} although the logits are 11.3x larger; "
                f"‖∂/∂v‖ {fmt(grads['scaled']['v'])} "
                f"→ {fmt(grads['unscaled']['v'])}")
    tolerance = ("unscaled Jacobian ≤ 0.1x scaled, ∂/∂q smaller, ∂/∂v at least half"
                 + ("" if ctx.quick else "; trained: entropy without the scale ≤ 0.6x with it"))
    figures = {"jacobian_median": jac, "grad_median": grads}
    if ctx.quick:
        return Result(verdict(quick_ok), measured + " (the trained part: full run)", tolerance, figures=figures)
    runs = {name: ctx.trained(name) for name in ("scaled", "unscaled")}
    end = {name: run.result["attn"][-1] for name, run in runs.items()}
    ent = {name: a["attn_entropy/mean"] for name, a in end.items()}
    peak = {name: a["attn_peak/mean"] for name, a in end.items()}
    ok = quick_ok and ent["unscaled"] <= 0.6 * ent["scaled"]
    figures.update(trained_entropy=ent, trained_peak=peak)
    m = runs["scaled"].cfg.model
    return Result(verdict(ok), measured + f"; trained ({m.n_layer} layers of {m.n_head} head, d_k = "
                  f"{m.n_embd // m.n_head}, {runs['scaled'].result['steps']} steps): entropy "
                  f"{fmt(ent['scaled'])} → {fmt(ent['unscaled'])} nats, peak {fmt(peak['scaled'])} → "
                  f"{fmt(peak['unscaled'])} without the scale (claims_entropy.png)", tolerance, figures=figures)


@claim("A5", "1/√d_k is a fixed per-dimension correction and cannot stop ‖q‖, ‖k‖ from growing in training; "
             "QK-Norm holds the logits' scale.",
       "1/√d_k 是固定的逐维校正，挡不住训练中 ‖q‖、‖k‖ 变大；QK-Norm 才能把 logit 的尺度稳住。",
       trains=True,
       tests=("tests/test_attention.py::test_qk_norm_bounds_logits_for_any_input_magnitude",
              "tests/test_attention.py::test_without_qk_norm_logits_grow_with_the_input"))
def check_a5(ctx):
    torch.manual_seed(ctx.seed)
    idx = torch.randint(40, (2, 32), generator=ctx.gen())
    grown = {}
    for qk_norm in (False, True):
        model = small_model(n_layer=2, n_head=1, n_embd=128, attn={"qk_norm": qk_norm})
        logits = []
        for grow in range(3):  # projections x1, x10, x100: q and k grow, the fixed scale does not follow
            with torch.no_grad():
                for block in model.blocks:
                    block.attn.c_attn.weight.mul_(10 if grow else 1)
            logits.append(max_logit(model, idx))
        grown[qk_norm] = logits
    bound = logit_bound(model.blocks[0].attn)
    quick_ok = grown[False][-1] >= 1000 * grown[False][0] and max(grown[True]) <= bound * (1 + 1e-5)
    measured = (f"projections x1 / x10 / x100: max logit {slash(grown[False], 1)} without QK-Norm, "
                f"{slash(grown[True], 2)} with it (bound √d_k = {fmt(bound)})")
    tolerance = ("without QK-Norm the max logit grows ≥ 1000x for 100x larger projections; with it ≤ the bound"
                 + ("" if ctx.quick else "; trained: max logit ≥ 10x its step-0 value, QK-Norm ≤ bound at every probe; "
                    "at lr 3e-2 without QK-Norm the run's max logit ≥ 10x lr 1e-3's and its entropy collapses "
                    "(< 0.1 nats), with QK-Norm ≤ the bound"))
    figures = {"max_logit_vs_projection_scale": {"no_qk_norm": grown[False], "qk_norm": grown[True]}, "bound": bound}
    if ctx.quick:
        return Result(verdict(quick_ok), measured + " (the trained part: full run)", tolerance, figures=figures)
    plain, normed = ctx.trained("scaled"), ctx.trained("qk_norm")
    steps, plain_max = layer_max(plain)
    half = len(steps) // 2
    _, normed_max = layer_max(normed)
    bound_trained = logit_bound(normed.model().blocks[0].attn)
    hot, hot_normed = ctx.trained("scaled_lr3e-2"), ctx.trained("qk_norm_lr3e-2")
    stopped = [r for r in (plain, normed, hot, hot_normed) if r.result is None]
    if stopped:  # a run that went non-finite has no probes to read: say which, and why
        return Result("not_shown", measured + "; " + ", ".join(f"'{r.name}' stopped: {r.error}" for r in stopped),
                      tolerance, figures=figures)
    run_max = {name: run.result["attn_logit_max_run"] for name, run in
               (("lr1e-3", plain), ("lr3e-2", hot), ("lr3e-2_qk_norm", hot_normed))}
    hot_entropy = hot.result["attn_entropy_min_run"]
    ok = (quick_ok and plain_max[-1] >= 10 * plain_max[0] and max(normed_max) <= bound_trained * (1 + 1e-5)
          and run_max["lr3e-2"] >= 10 * run_max["lr1e-3"] and hot_entropy < 0.1
          and run_max["lr3e-2_qk_norm"] <= bound_trained * (1 + 1e-5))
    figures.update(trained_max_logit={"scaled": plain_max, "qk_norm": normed_max}, trained_bound=bound_trained,
                   run_max_logit=run_max, lr3e_2_min_entropy=hot_entropy)
    return Result(verdict(ok), measured + f"; trained {plain.result['steps']} steps: max logit {fmt(plain_max[0])} → "
                  f"{fmt(plain_max[half])} (step {steps[half]}) → {fmt(plain_max[-1])} with 1/√d_k alone, ≤ "
                  f"{fmt(max(normed_max))} with QK-Norm (bound {fmt(bound_trained)}; claims_qk_norm.png); at lr 3e-2 "
                  f"the run's max logit {fmt(run_max['lr3e-2'])} (lr 1e-3: {fmt(run_max['lr1e-3'])}), lowest entropy "
                  f"{fmt(hot_entropy)} nats, with QK-Norm ≤ {fmt(run_max['lr3e-2_qk_norm'])}", tolerance,
                  note="at lr 1e-3 most of the rise from step 0 is the small initialisation coming into use; the "
                       "runaway growth shows at higher lr" + sweep_note(), figures=figures)


def sweep_note() -> str:
    """docs/stability.md's lr sweep in one clause (its figures from docs/stability.json)."""
    f = stability_figures().get("lr_sensitivity")
    if not f:
        return " (docs/stability.md: an lr sweep with 3 seeds)"
    none, normed, diff = f["no_qk_norm"], f["qk_norm"], f["qk_norm_minus_none"]
    return (f". docs/stability.md, {len(f['grid'])} lrs from {min(f['grid']):g} to {max(f['grid']):g}, {f['seeds']} "
            f"seeds: LR sensitivity {none[0]:.3f} ± {none[1]:.3f} nats without QK-Norm, {normed[0]:.3f} ± "
            f"{normed[1]:.3f} with it (difference {diff[0]:+.3f}, 95% {diff[1]:+.3f} to {diff[2]:+.3f}); largest logit "
            f"{f['largest_logit']['no_qk_norm']:.3g} against {f['largest_logit']['qk_norm']:.3g}" + width_note())


def width_note() -> str:
    """docs/practice.md's width axis in one clause: how the LR sensitivity moves with the parameters."""
    w = stability_figures().get("width")
    if not w:
        return ""
    (a, ha), (b, hb) = w["no_qk_norm"]["slope_per_decade"], w["qk_norm"]["slope_per_decade"]
    return (f"; over widths {'/'.join(map(str, w['widths']))} (docs/practice.md (2), {len(w['lrs'])} lrs, 2 seeds) the "
            f"sensitivity changes by {a:+.3f} ± {ha:.3f} nats per decade of parameters without QK-Norm and "
            f"{b:+.3f} ± {hb:.3f} with it")


TEXT_SHAPE = dict(vocab_size=128256, block_size=8192, n_layer=32, n_head=32, n_embd=4096, mlp="swiglu", d_ff=14336)


@claim("A6", "Per layer: N² terms 2N²d, projections 4Nd², SwiGLU FFN 3Nd·d_ff. At d = 4096, H = 32, d_ff = 14336 "
             "the N² terms equal the projections at N = 8192, the FFN at 21504, both at ≈ 29700; at 2k they are "
             "≈ 7% of the layer.",
       "每层：N² 项 2N²d，投影 4Nd²，SwiGLU 前馈 3Nd·d_ff。d = 4096、32 头、d_ff = 14336 时，"
       "N² 项在 N = 8192 追上投影，"
       "21504 追上前馈，约 29700 追上两者之和；2k 上下文时约占该层 7%。",
       tests=("tests/test_counting.py::test_crossovers_make_the_two_terms_equal",))
def check_a6(ctx):
    mha, gqa = GPTConfig(**TEXT_SHAPE), preset("llama3_8b_shape")
    x_mha, x_gqa = ({k: float(v) for k, v in crossovers(c).items()} for c in (mha, gqa))
    m = macs_per_token(mha, 2048)
    share, ratio = float(m["attn"] / m["layer"]), float(m["attn"] / (m["proj"] + m["mlp"]))
    m_gqa = macs_per_token(gqa, 2048)
    ratio_gqa = float(m_gqa["attn"] / (m_gqa["proj"] + m_gqa["mlp"]))
    ok = (x_mha["attn_vs_proj"] == 8192 and x_mha["attn_vs_mlp"] == 21504
          and abs(x_mha["attn_vs_proj_mlp"] / 29700 - 1) <= 0.005 and round(100 * ratio) == 7)
    return Result(verdict(ok),
                  "counting.crossovers, the text's shape (MHA): "
                  f"{x_mha['attn_vs_proj']:,.0f} / {x_mha['attn_vs_mlp']:,.0f}"
                  f" / {x_mha['attn_vs_proj_mlp']:,.0f}; at N = 2048 attention is {100 * ratio:.1f}% of projections + "
                  f"FFN ({100 * share:.1f}% of the whole layer). Llama-3-8B's GQA shape (8 KV heads): "
                  f"{x_gqa['attn_vs_proj']:,.0f} / {x_gqa['attn_vs_mlp']:,.0f} / {x_gqa['attn_vs_proj_mlp']:,.0f}, "
                  f"{100 * ratio_gqa:.1f}% at 2k",
                  "8192 and 21504 exactly, 29700 within 0.5%, the 2k figure rounding to 7%",
                  note="the text's projections 4Nd² assume multi-head K and V (MHA); attnlab counts d·(d + d_kv) per "
                       "token, so a GQA model's crossovers come earlier. The text's ≈ 7% is attention over the rest "
                       f"of the layer (N / {x_mha['attn_vs_proj_mlp']:,.0f}); as a share of the whole layer it is "
                       f"{100 * share:.1f}%",
                  figures={"crossovers_mha": x_mha, "crossovers_llama3_8b_gqa": x_gqa, "share_2k": share,
                           "ratio_2k": ratio, "ratio_2k_gqa": ratio_gqa})


@claim("A7", "A naive implementation stores the attention weights: N = 8192, H = 32, bf16, batch 1 → 4 GiB per "
             "layer, 128 GiB for 32 layers, while the model's bf16 weights are ≈ 16 GB.",
       "朴素实现会存下注意力权重：N = 8192、32 头、bf16、批大小 1 时每层 4 GiB，32 层共 128 GiB，"
       "而 bf16 权重约 16 GB。",
       tests=("tests/test_counting.py::test_mha_gelu_by_hand",))
def check_a7(ctx):
    c = preset("llama3_8b_shape")
    mem = memory_breakdown(c, 8192, 1, 2)
    per_layer, all_layers, weights = mem["attn_weights_per_layer"], mem["attn_weights_all_layers"], mem["weights"]
    B, H, N, hs = 1, 4, 256, 16  # the reference path at a small size: what it keeps for backward
    q, k, v = (torch.randn(B, H, N, hs, requires_grad=True) for _ in range(3))
    kept = saved_bytes(lambda: variants.attention(q, k, v, 0.25, impl="reference"))
    table = B * H * N * N * 4
    ok = per_layer == 4 * 2**30 and all_layers == 128 * 2**30 and abs(weights / 16e9 - 1) <= 0.05 and kept >= table
    return Result(verdict(ok),
                  f"counting.memory_breakdown (llama3_8b_shape, N = 8192, bf16): {per_layer / 2**30:g} GiB per layer, "
                  f"{all_layers / 2**30:g} GiB for {c.n_layer}; weights {weights / 1e9:.2f} GB; the reference path "
                  "keeps "
                  f"{kept / 2**20:.2f} MiB for backward at N = {N}, H = {H}, of which the B·H·N² table is "
                  f"{table / 2**20:.2f} MiB",
                  "4 GiB and 128 GiB exactly, weights within 5% of 16 GB, the reference path keeping the table",
                  figures={"attn_table_per_layer": per_layer, "attn_table_all_layers": all_layers,
                           "weights_bytes": weights, "reference_saved_bytes": kept, "table_bytes": table})


@claim("A8", "FlashAttention tiles Q, K, V with an online softmax and recomputes in the backward pass: the N×N table "
             "is never stored, memory falls from O(N²) to O(N), and all N² dot products are still computed.",
       "FlashAttention 对 Q、K、V 分块、用在线 softmax、反向时重算：不存 N×N 表，显存从 O(N²) 降到 O(N)，"
       "但 N² 个点积仍全部计算，复杂度不降。")
def check_a8(ctx):
    gen = ctx.gen()
    q, k, v = (rand(gen, 1, 2, 192, 16).requires_grad_() for _ in range(3))
    outs, grads = {}, {}
    for impl in ("reference", "tiled"):
        outs[impl] = variants.attention(q, k, v, 0.25, impl=impl, block=64)
        grads[impl] = torch.autograd.grad(outs[impl].sum(), (q, k, v))
    diff = max([max_diff(outs["reference"], outs["tiled"])]
               + [max_diff(a, b) for a, b in zip(grads["reference"], grads["tiled"])])
    fl, mem = {}, {}
    for N in (256, 512):
        x = [torch.randn(1, 2, N, 16, requires_grad=True) for _ in range(3)]
        for impl in ("reference", "tiled"):
            for causal in (False, True):
                fl[(impl, causal, N)] = flops(lambda: variants.attention(*x, 0.25, causal=causal, impl=impl, block=64))
            mem[(impl, N)] = saved_bytes(lambda: variants.attention(*x, 0.25, impl=impl, block=64))
    same = all(fl[("tiled", False, N)] == fl[("reference", False, N)] for N in (256, 512))
    growth = {impl: fl[(impl, True, 512)] / fl[(impl, True, 256)] for impl in ("reference", "tiled")}
    mem_growth = {impl: mem[(impl, 512)] / mem[(impl, 256)] for impl in ("reference", "tiled")}
    ok = diff <= 1e-10 and same and growth["tiled"] >= 3.5 and abs(mem_growth["tiled"] - 2) <= 0.05 \
        and mem_growth["reference"] >= 3.5
    return Result(verdict(ok),
                  f"tiled (impl=tiled) = reference to {diff:.0e} in output and gradients (float64); FLOPs without a "
                  f"mask equal ({fl[('tiled', False, 512)] / 1e6:.1f} M at N = 512); causal: tiled skips the masked "
                  f"blocks ({fl[('tiled', True, 512)] / fl[('reference', True, 512)]:.2f}x the table's) and still "
                  "grows "
                  f"{growth['tiled']:.2f}x for 2x N; saved for backward: tiled {mem_growth['tiled']:.2f}x for 2x N, "
                  f"reference {mem_growth['reference']:.2f}x",
                  "equal within 1e-10; same FLOPs without a mask; causal FLOPs ≥ 3.5x per doubling; tiled memory "
                  "2x (± 0.05) per doubling, reference ≥ 3.5x",
                  figures={"max_diff": diff,
                           "flops": {f"{i}_{'causal' if c else 'full'}_{n}": f for (i, c, n), f in fl.items()},
                           "saved_bytes": {f"{i}_{n}": b for (i, n), b in mem.items()}})


@claim("A9", "Activation recomputation is a different remedy: it does not by itself keep an N×N table from existing "
             "inside the attention kernel.",
       "激活重计算是另一种手段：它本身并不能阻止注意力内部出现 N×N 的表。")
def check_a9(ctx):
    B, H, N, hs = 1, 2, 256, 16
    table = B * H * N * N
    fns = {"checkpointed reference": lambda q, k, v: checkpoint(
               lambda a, b, c: variants.attention(a, b, c, 0.25, impl="reference"), q, k, v, use_reentrant=False),
           "tiled": lambda q, k, v: variants.attention(q, k, v, 0.25, impl="tiled", block=64)}
    kept, largest = {}, {}
    for name, fn in fns.items():
        x = [torch.randn(B, H, N, hs, requires_grad=True) for _ in range(3)]
        kept[name] = saved_bytes(lambda: fn(*x))
        out = fn(*x)
        with LargestTensor() as seen:  # the backward pass alone
            out.sum().backward()
        largest[name] = seen.numel
    inputs = 3 * B * H * N * hs * 4
    ok = (kept["checkpointed reference"] <= inputs and largest["checkpointed reference"] >= table
          and largest["tiled"] < table)
    return Result(verdict(ok),
                  "torch.utils.checkpoint around the reference path keeps only q, k, v "
                  f"({kept['checkpointed reference']:,} B)"
                  f", yet its backward rebuilds a tensor of {largest['checkpointed reference']:,} numbers (the B·H·N² "
                  f"table, N = {N}); the tiled path's backward never exceeds {largest['tiled']:,}",
                  "checkpointed: nothing but the inputs kept, a table-sized tensor in the backward; tiled: none",
                  figures={"saved_bytes": kept, "largest_backward_tensor": largest, "table_numel": table})


@claim("A10", "What lowers the complexity: sparse attention (each position sees only some) and linear attention "
              "(a kernel in place of softmax, so the product re-associates): toward N log N or N.",
       "真正降低复杂度的是稀疏注意力（每个位置只看一部分位置）和线性注意力（用核函数代替 softmax，乘法可重新结合）："
       "趋向 N log N 或 N。")
def check_a10(ctx):
    W, hs, H = 64, 16, 2
    growth = {}
    for name in ("full", "window", "linear"):
        counts = []
        for N in (256, 512):
            if name == "linear":
                c = GPTConfig(vocab_size=2, block_size=N, n_layer=1, n_head=H, n_embd=H * hs, attn={"kind": "linear"})
                layer, x = variants.make_attention(c, 0), torch.randn(1, N, H * hs)
                counts.append(flops(lambda: layer(x)))  # the whole layer: projections and the prefix sums' products
            else:
                x = [torch.randn(1, H, N, hs) for _ in range(3)]
                window = W if name == "window" else None
                counts.append(flops(lambda: variants.attention(*x, 0.25, impl="tiled", block=64, window=window)))
        growth[name] = counts[1] / counts[0]
    # a choice by content (MoBA: each query reads its own block and the K best earlier ones), on the path that
    # computes only the chosen blocks: the whole layer, choice included, and the keys each query reads
    moba = {"select": "moba", "select_block": 64, "select_topk": 2, "impl": "gathered"}
    counts, keys = [], {}
    for N in (512, 1024):
        c = GPTConfig(vocab_size=2, block_size=N, n_layer=1, n_head=H, n_embd=H * hs, attn=moba)
        layer, x = variants.make_attention(c, 0), torch.randn(1, N, H * hs)
        counts.append(flops(lambda: layer(x)))
        keys[N] = float(selected_keys(c, N))
    growth["moba"] = counts[1] / counts[0]
    c = GPTConfig(vocab_size=2, block_size=4096, n_layer=1, n_head=4, n_embd=128, attn={"window": W})
    per_token = {N: {r["name"].split()[0]: r["macs"] for r in attention_variants(c, N)} for N in (1024, 4096)}
    ok = (growth["full"] >= 3.5 and growth["window"] <= 2.2 and abs(growth["linear"] - 2) <= 0.05
          and growth["moba"] <= 2.4)
    return Result(verdict(ok),
                  f"FLOPs for 2x N (256 → 512): full attention {growth['full']:.2f}x, window W = {W} (tiled path) "
                  f"{growth['window']:.2f}x, a linear-attention layer {growth['linear']:.2f}x; counted MACs per token "
                  f"(counting.attention_variants, N = 1024 → 4096): full {per_token[1024]['reference']:,} → "
                  f"{per_token[4096]['reference']:,}, window {per_token[1024]['window']:,} → "
                  f"{per_token[4096]['window']:,}, "
                  f"linear {per_token[1024]['linear']:,} → {per_token[4096]['linear']:,}; chosen by content "
                  f"(select=moba, blocks of 64, the 2 best earlier ones, impl=gathered; N = 512 → 1024): the layer's "
                  f"FLOPs {growth['moba']:.2f}x, keys a query reads {keys[512]:.1f} → {keys[1024]:.1f} "
                  f"(causal full: {(512 + 1) / 2:.1f} → {(1024 + 1) / 2:.1f})",
                  "full ≥ 3.5x per doubling; window ≤ 2.2x; linear 2x (± 0.05); moba ≤ 2.4x",
                  note="N log N methods (e.g. Reformer's hashing) are not in attnlab; the linear layer's prefix sums "
                       "are additions, which the FLOP counter leaves out (they grow as N too); MoBA's choice scores "
                       "every block mean (N²/B), which keeps its growth above 2x; the loss at these sparsities is "
                       "measured in docs/attention_kinds.md",
                  figures={"flops_growth_per_doubling": growth, "macs_per_token": per_token,
                           "moba_keys_per_query": keys})


@claim("A11", "Generation has two phases: prefill (the whole prompt at once) and decode (one new query against "
              "cached keys and values).",
       "生成分两个阶段：预填充（整段提示一次处理）和解码（每步一个新查询，对照缓存的键和值）。",
       tests=("tests/test_sample.py::test_greedy_cached_and_uncached_generate_the_same_tokens",))
def check_a11(ctx):
    from sample import generate
    torch.manual_seed(ctx.seed)
    model = small_model(n_layer=2, vocab=40)
    prompt = torch.randint(40, (1, 12), generator=ctx.gen())
    rows = []
    hook = model.blocks[0].attn.hook_q.register_forward_hook(lambda m, a, q: rows.append(q.size(1)))  # (B, T, nh, hs)
    cached = generate(model, prompt, 8, temperature=0, kv_cache=True)
    hook.remove()
    recomputed = generate(model, prompt, 8, temperature=0, kv_cache=False)
    ok = rows[0] == 12 and rows[1:] == [1] * 7 and torch.equal(cached, recomputed)
    return Result(verdict(ok),
                  f"sample.generate with a KV cache: queries per forward {rows} (a 12-token prefill, then one per "
                  f"step); the same {cached.size(1) - 12} greedy tokens as recomputing the context",
                  "one prefill of the whole prompt, then exactly one query per step, tokens equal",
                  figures={"query_rows_per_forward": rows})
