"""The N² wall taken apart: FlashAttention's tiled algorithm, sliding windows and linear attention,
each against its formula written out (float64 where the formula is the reference), and the memory
and counts the texts claim for them."""
import math

import pytest
import torch
import torch.nn.functional as F

from attention import LinearState, attention, rope_freqs, rotate
from common import UserError
from counting import attention_variants, flops_per_token, macs_per_token
from helpers import variant_model as make
from model import GPT, GPTConfig


def plain_attention(q, k, v, scale, causal=True, window=None):
    """softmax(q·kᵀ·scale + M)·v written out in float64, K/V repeated per query-head group; queries are
    the last Tq of the Tk positions; M hides later keys and, with a window, keys W or more back."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    Tq, Tk = q.size(2), k.size(2)
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        i = torch.arange(Tq)[:, None] + (Tk - Tq)
        j = torch.arange(Tk)[None, :]
        band = (j <= i) & ((j > i - window) if window is not None else True)
        s = s.masked_fill(~band, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def grads(fn, *xs):
    xs = [x.detach().requires_grad_(True) for x in xs]
    out = fn(*xs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(out.dtype)
    return (out, *torch.autograd.grad((out * g).sum(), xs))


# ----------------------------------------------------------------------------- tiled (FlashAttention)

@pytest.mark.parametrize("B,nh,nkv,Tq,Tk,block,causal,window", [
    (2, 4, 4, 37, 37, 8, True, None),   # MHA, a length no multiple of the block
    (2, 4, 2, 37, 37, 16, True, None),  # GQA
    (1, 4, 1, 29, 29, 7, False, None),  # MQA, no mask
    (2, 2, 2, 5, 41, 8, True, None),    # queries after a cached prefix (Tq < Tk)
    (2, 4, 2, 45, 45, 8, True, 10),     # a window
], ids=["mha", "gqa", "mqa-full", "suffix", "window"])
def test_tiled_forward_and_gradients_equal_the_plain_formula(B, nh, nkv, Tq, Tk, block, causal, window):
    torch.manual_seed(0)
    q, k, v = torch.randn(B, nh, Tq, 16), torch.randn(B, nkv, Tk, 16), torch.randn(B, nkv, Tk, 16)
    tiled = grads(lambda q, k, v: attention(q, k, v, 0.3, causal=causal, impl="tiled", window=window, block=block),
                  q, k, v)
    plain = grads(lambda q, k, v: plain_attention(q, k, v, 0.3, causal, window), q.double(), k.double(), v.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), tiled, plain):
        d = (a.double() - b).abs()
        assert d.max() < 1e-5, f"{name}: max {d.max():.2e}, mean {d.mean():.2e}"


def test_tiled_model_equals_the_reference_model_in_loss_and_every_gradient():
    idx = torch.randint(40, (2, 16))
    models = [make(attn={"impl": "tiled", "block": 5}), make(attn={"impl": "reference"})]
    losses, grads_ = [], []
    for m in models:
        m.train()
        _, loss = m(idx, idx)
        loss.backward()
        losses.append(loss.item())
        grads_.append({n: p.grad for n, p in m.named_parameters()})
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)
    for name in grads_[1]:
        assert torch.allclose(grads_[0][name], grads_[1][name], atol=1e-5), name


def saved_bytes(fn):
    """Bytes of the tensors autograd keeps for the backward pass while fn() runs, each storage once."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_tiled_memory_grows_linearly_and_the_reference_quadratically():
    """The texts' claim (FlashAttention: O(N) memory, the same N² dot products): what one attention
    call keeps for its backward, at N and 4N. 4x the length costs ~4x (tiled) against ~16x (the
    reference's N x N weights); generous bounds."""
    def kept(impl, N):
        q, k, v = (torch.randn(1, 4, N, 32, requires_grad=True) for _ in range(3))
        return saved_bytes(lambda: attention(q, k, v, 0.2, impl=impl, block=64)) - 3 * q.numel() * 4
    ratio = {impl: kept(impl, 1024) / kept(impl, 256) for impl in ("tiled", "reference")}
    assert ratio["tiled"] < 6 and ratio["reference"] > 12, ratio
    assert kept("reference", 1024) > 20 * kept("tiled", 1024)


# ----------------------------------------------------------------------------- windows

@pytest.mark.parametrize("impl", ["sdpa", "reference", "tiled"])
def test_window_masks_equal_an_explicit_band(impl):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 33, 8), torch.randn(2, 2, 33, 8), torch.randn(2, 2, 33, 8)
    got = attention(q, k, v, 0.5, impl=impl, window=7, block=8)
    assert torch.allclose(got.double(), plain_attention(q, k, v, 0.5, True, 7), atol=1e-5)


def test_a_local_global_pattern_windows_only_the_local_layers():
    model = make(n_layer=4, attn={"window": 3, "window_pattern": "LLG"})
    assert [b.attn.window for b in model.blocks] == [3, 3, None, 3]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_windowed_cache_holds_the_window_and_equals_recomputation(static):
    """A local layer's cache holds W positions; decoding step by step past W (and past a prompt longer
    than W) gives the logits of the whole sequence run at once with the same windows."""
    model = make(n_layer=3, block_size=64, attn={"window": 6, "window_pattern": "LG"})
    idx = torch.randint(40, (2, 30))
    with torch.no_grad():
        full = model(idx)
        cache = model.new_kv_cache(2, 64, static=static)
        assert [c.length for c in cache] == [6, 64, 6]
        steps = [model(idx[:, :9], kv_cache=cache, pos=0)]  # a prefill longer than the window
        for t in range(9, 30):
            pos = torch.tensor([t]) if static else t
            steps.append(model(idx[:, t:t + 1], kv_cache=cache, pos=pos))
    assert torch.allclose(torch.cat(steps, 1), full, atol=1e-5)


# ----------------------------------------------------------------------------- linear attention

def phi(x):
    return F.elu(x) + 1


def linear_formula(q, k, v, rope=None):
    """y_i = Σ_{j≤i} φ(q_i)ᵀφ(k_j) v_j / Σ_{j≤i} φ(q_i)ᵀφ(k_j) in float64, one row at a time, K/V repeated
    per query-head group; with rope (T, hs/2, 2), the numerator's φ(q_i), φ(k_j) are rotated to their
    positions (RoFormer's linear attention), the denominator's are not."""
    q, k, v = phi(q.double()), phi(k.double()), v.double()
    g = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    rq, rk = q, k
    if rope is not None:
        rq = rotate(q.transpose(1, 2), rope.double()).transpose(1, 2)
        rk = rotate(k.transpose(1, 2), rope.double()).transpose(1, 2)
    out = torch.zeros_like(q[..., :v.size(-1)])
    for i in range(q.size(2)):
        num = (rq[:, :, i:i + 1] * rk[:, :, :i + 1]).sum(-1)  # (B, h, i+1)
        den = (q[:, :, i:i + 1] * k[:, :, :i + 1]).sum(-1).sum(-1, keepdim=True)
        out[:, :, i] = (num.unsqueeze(-1) * v[:, :, :i + 1]).sum(2) / den
    return out


@pytest.mark.parametrize("chunk", [64, 5, 1], ids=["one-chunk", "ragged-chunks", "chunks-of-1"])
@pytest.mark.parametrize("pos,n_kv", [("none", 4), ("rope", 4), ("rope", 2)], ids=["nope", "rope", "rope-gqa"])
def test_linear_attention_parallel_and_recurrent_forms_equal_the_causal_formula(pos, n_kv, chunk):
    """The parallel (chunked) form of a whole sequence, with one chunk, chunks that do not divide the
    length and chunks of one position, and the recurrent form fed one token at a time (a prefill,
    then steps on the state) all equal the formula written out."""
    model = make(pos=pos, n_kv_head=n_kv, attn={"kind": "linear"})
    attn = model.blocks[0].attn
    attn.chunk = chunk
    x = torch.randn(2, 12, 32)
    rope = rope_freqs(8, 12, 10000.0) if pos == "rope" else None
    with torch.no_grad():
        q, k, v = attn.qkv(x, None)  # unrotated: φ comes first
        want = linear_formula(q, k, v, rope)  # (B, h, T, hs), before the output projection
        B, T, C = x.shape
        project = lambda y: attn.c_proj(y.transpose(1, 2).reshape(B, -1, C).float())  # noqa: E731
        parallel = attn(x, rope=rope)
        state = attn.new_cache(2, 12, x.device, x.dtype)
        steps = [attn(x[:, :4], rope=None if rope is None else rope[:4], kv_cache=state, pos=0)]
        for t in range(4, 12):
            steps.append(attn(x[:, t:t + 1], rope=None if rope is None else rope[t:t + 1], kv_cache=state, pos=t))
    assert torch.allclose(parallel, project(want), atol=1e-5)
    assert torch.allclose(torch.cat(steps, 1), project(want), atol=1e-5)


@pytest.mark.parametrize("chunk", [64, 5])
def test_linear_attention_gradients_equal_the_causal_formulas(chunk):
    """Training's gradients: the chunked form's gradients for the input and every weight of the layer
    equal those of the formula written out (float64, RoPE, GQA, a ragged last chunk)."""
    model = make(pos="rope", n_kv_head=2, attn={"kind": "linear"}).double()
    attn = model.blocks[0].attn
    attn.chunk = chunk
    x = torch.randn(2, 12, 32, dtype=torch.float64, requires_grad=True)
    rope = rope_freqs(8, 12, 10000.0).double()
    w = torch.randn(2, 12, 32, dtype=torch.float64)
    grads = []
    for formula in (False, True):
        if formula:
            q, k, v = attn.qkv(x, None)
            y = attn.c_proj(linear_formula(q, k, v, rope).transpose(1, 2).reshape(2, 12, 32))
        else:
            y = attn(x, rope=rope)
        params = [x, *attn.parameters()]
        grads.append(torch.autograd.grad((y * w).sum(), params))
    for mine, want in zip(*grads):
        assert torch.allclose(mine, want, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("n_kv", [4, 2])
def test_linear_attention_matmuls_are_what_counting_says(n_kv):
    """torch's FlopCounterMode on a linear-attention layer (2 chunks of 64, GQA or not) measures 2 x
    the MACs counted for it, less the additions counting also counts as MACs (z += φ(k): n_kv x hs
    per token, no matmul)."""
    from torch.utils.flop_counter import FlopCounterMode
    c = GPTConfig(vocab_size=64, block_size=128, n_layer=1, n_head=4, n_kv_head=n_kv, n_embd=128,
                  attn={"kind": "linear"})
    model, (B, N) = GPT(c), (2, 128)
    with FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 64, (B, N)))
    measured = sum(counter.get_flop_counts()["GPT.blocks.0.attn"].values())
    m = macs_per_token(c, N)
    assert measured == 2 * B * N * (m["proj"] + m["attn"] - n_kv * 32)


def test_linear_state_does_not_grow_with_the_tokens_generated():
    from sample import generate
    model = make(attn={"kind": "linear"})
    sizes = []
    for n in (10, 100):
        caches = []
        real = model.new_kv_cache
        model.new_kv_cache = lambda *a, **k: caches.append(real(*a, **k)) or caches[-1]
        generate(model, torch.zeros(1, 1, dtype=torch.long), n, temperature=0)
        model.new_kv_cache = real
        assert all(isinstance(c, LinearState) for c in caches[0])
        sizes.append(sum(c.nbytes() for c in caches[0]))
    assert sizes[0] == sizes[1] == 2 * 4 * (8 * 8 + 8) * 4  # layers x kv heads x (hs² + hs) fp32


def test_linear_attention_gives_the_probe_no_softmax_weights_and_says_so():
    from attnstats import AttentionProbe, attention_maps
    model = make(attn={"kind": "linear"})
    stats = AttentionProbe(torch.randint(40, (2, 16))).run(model)
    assert not any(k.startswith("attn_") for k in stats) and "incontext/gain" in stats
    with pytest.raises(ValueError, match="no layer of this model has softmax attention"):
        attention_maps(model, torch.randint(40, (1, 8)))


@pytest.mark.parametrize("attn,dropout,needle", [
    ({"kind": "linear", "impl": "tiled"}, 0.0, "model.attn.impl='tiled' has no effect unless model.attn.kind is softmax or mla"),
    ({"kind": "linear", "scale": "none"}, 0.0, "model.attn.scale='none' has no effect unless"),
    ({"kind": "linear", "window": 4}, 0.0, "model.attn.window=4 has no effect unless"),
    ({"impl": "tiled"}, 0.1, "model.attn.impl=tiled does not drop attention weights"),
    ({"window_pattern": "LG"}, 0.0, "model.attn.window_pattern='LG' has no effect unless model.attn.window=W"),
    ({"window_pattern": "LX", "window": 4}, 0.0, "model.attn.window_pattern=LX is invalid"),
    ({"kind": "rnn"}, 0.0, "model.attn.kind='rnn' is unknown"),
])
def test_options_that_would_not_do_what_was_asked_are_refused_in_one_line(attn, dropout, needle):
    with pytest.raises(UserError, match=needle) as e:
        GPTConfig(vocab_size=40, n_layer=2, n_head=4, n_embd=32, dropout=dropout, attn=attn)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- counts

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
    assert model.flops_per_token() == 6 * model.num_params() + sum(12 * k * 64 for k in keys)


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
