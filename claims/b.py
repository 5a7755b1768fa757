"""The claims of text B (softmax, N² pairs, multi-head attention, the KV cache), B1-B4: one check per
claim, registered with @claim in the order of docs/claims.md. claims/__init__.py holds the registry and
what checks share."""
import torch

import variants
from lab.attnstats import attention_maps
from lab.counting import macs_per_token
from model import GPTConfig
from claims.common import Result, claim, flops, max_diff, power10, rand, slash, small_model, verdict


@claim("B1", "Raw scores 0.5, 0.2, 2.5, 3.0 → softmax ≈ 0.05, 0.03, 0.35, 0.57: the two strong ones take ≈ 92%.",
       "原始分数 0.5、0.2、2.5、3.0 经 softmax 约为 0.05、0.03、0.35、0.57：两个高分合占约 92%。")
def check_b1(ctx):
    scores = torch.tensor([[[[0.5, 0.2, 2.5, 3.0]]]], dtype=torch.float64)  # one query whose q·k_j are the scores
    eye = torch.eye(4, dtype=torch.float64).view(1, 1, 4, 4)
    w = variants.attention(scores, eye, eye, 1.0, causal=False).flatten().tolist()
    text = [0.05, 0.03, 0.35, 0.57]
    ok = all(abs(a - b) <= 0.005 for a, b in zip(w, text)) and abs(w[2] + w[3] - 0.92) <= 0.005
    return Result(verdict(ok), f"attention() weights {slash(w, 4)}; the two strong ones {100 * (w[2] + w[3]):.1f}%",
                  "each rounds to the text's two decimals (± 0.005), the pair to 92%", figures={"weights": w})


@claim("B2", "N tokens compared pairwise is N² (100 → 10⁴; 10⁴ → 10⁸; 10⁶ → 10¹²): 10× the length, 100× the work.",
       "N 个词两两比较是 N² 次（100 → 10⁴，10⁴ → 10⁸，10⁶ → 10¹²）：长度 10 倍，计算 100 倍。")
def check_b2(ctx):
    c = GPTConfig(vocab_size=2, block_size=16, n_layer=1, n_head=1, n_embd=8)
    pairs = {N: macs_per_token(c, N)["scores"] * N // c.n_embd for N in (100, 10**4, 10**6)}  # q·k per sequence
    x = {N: [torch.randn(1, 1, N, 8) for _ in range(3)] for N in (100, 1000)}
    fl = {N: flops(lambda: variants.attention(*x[N], 1.0, causal=False, impl="reference")) for N in x}
    ok = all(p == N * N for N, p in pairs.items()) and fl[1000] == 100 * fl[100]
    return Result(verdict(ok), "counted q·k pairs (counting.macs_per_token) "
                  + ", ".join(f"{power10(N)} → {power10(p)}" for N, p in pairs.items())
                  + f"; measured reference-path FLOPs at N = 1000 over N = 100: {fl[1000] / fl[100]:g}x",
                  "N² exactly; 100x exactly", figures={"pairs": pairs, "flops_ratio_10x": fl[1000] / fl[100]})


@claim("B3", "Multi-head attention runs several such weightings side by side in smaller subspaces.",
       "多头注意力在更小的子空间里并排做多组这样的加权。",
       tests=("tests/test_variants.py::test_gqa_equals_mha_with_kv_weights_repeated_per_group",))
def check_b3(ctx):
    gen, H, T, hs = ctx.gen(), 4, 10, 8
    q, k, v = (rand(gen, 1, H, T, hs) for _ in range(3))
    together = variants.attention(q, k, v, hs ** -0.5, impl="reference")
    apart = torch.cat([variants.attention(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], hs ** -0.5, impl="reference")
                       for h in range(H)], dim=1)
    torch.manual_seed(ctx.seed)
    model = small_model(n_layer=1, n_head=4, n_embd=32)
    maps, _ = attention_maps(model, torch.randint(40, (1, 16), generator=gen))
    heads = maps[0]  # (nh, T, T)
    apart_maps = min((heads[a] - heads[b]).abs().mean().item() for a in range(4) for b in range(a + 1, 4))
    diff = max_diff(together, apart)
    ok = diff <= 1e-12 and apart_maps > 1e-3
    return Result(verdict(ok),
                  f"{H} heads at once = each head alone on its {hs}-wide slice to {diff:.0e}; in a 32-wide model "
                  f"the 4 heads (8 wide each) weight the keys differently (mean |Δ| ≥ {apart_maps:.3f} between "
                  "any two maps)",
                  "equal within 1e-12; every two heads' maps differ by more than 1e-3",
                  figures={"max_diff": diff, "min_map_difference": apart_maps})


@claim("B4", "The KV cache keeps past keys and values so decoding does not recompute them.",
       "KV 缓存保存过去的键和值，解码时不必重新计算。",
       tests=("tests/test_sample.py::test_cached_logits_equal_recomputed_ones",))
def check_b4(ctx):
    torch.manual_seed(ctx.seed)
    model = small_model(n_layer=2, attn={"impl": "reference"})
    T = 48
    idx = torch.randint(40, (1, T + 1), generator=ctx.gen())
    with torch.no_grad():
        cache = model.new_kv_cache(1, 64)
        model(idx[:, :T], cache=cache, pos=0)  # prefill
        before = [(c.k[:, :, :T].clone(), c.v[:, :, :T].clone()) for c in cache]
        step = {}
        cached = flops(lambda: step.setdefault("logits", model(idx[:, T:], cache=cache, pos=T)))
        full = flops(lambda: step.setdefault("full", model(idx)))
    kept = all(torch.equal(b[0], c.k[:, :, :T]) and torch.equal(b[1], c.v[:, :, :T]) for b, c in zip(before, cache))
    diff = max_diff(step["logits"][0, -1], step["full"][0, -1])
    ok = kept and diff <= 1e-4 and cached <= 2 / T * full
    return Result(verdict(ok),
                  f"a cached decode step at context {T} costs {100 * cached / full:.1f}% of recomputing it "
                  f"({cached / 1e6:.2f} vs {full / 1e6:.1f} MFLOPs); the cached K, V are left as they were; logits "
                  f"equal to {diff:.0e}",
                  f"cache untouched, logits within 1e-4, step ≤ 2/T = {100 * 2 / T:.1f}% of recomputing",
                  figures={"cached_step_flops": cached, "recompute_flops": full, "max_diff": diff})
