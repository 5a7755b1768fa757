"""variants/selected.py, the gathered path (model.attn.impl=gathered with select=moba): outputs and
gradients against the masked path and against softmax over the chosen keys written out (float64, GQA,
a sink, lengths no multiple of the block); a choice of every block against full causal attention; a
model on it against the masked model and cached generation against recomputation; the keys it reads and
the MACs it does against lab/counting.py; the memory it keeps; what it refuses."""
from fractions import Fraction

import pytest
import torch

from attention import Mask, reference_attention
from variants.sinks import sdpa_with_sink
from helpers import grads, plain_attention, saved_bytes
from helpers import variant_model as make
from model import GPTConfig
from rules import UserError
from variants.moba import MoBA
from variants.selected import gathered_attention, pairs


def config(T, block, topk, n_kv=4, **attn):
    return GPTConfig(vocab_size=40, block_size=T, n_layer=1, n_head=4, n_embd=32, n_kv_head=n_kv,
                     attn={"select": "moba", "select_block": block, "select_topk": topk, "impl": "gathered", **attn})


def choice(q, k, block, topk):
    """MoBA's choice over q (B, nh, T, hs) and k (B, n_kv, T, hs) in training (no cache)."""
    T = q.size(2)
    return MoBA(config(T, block, topk))(q, k, Mask(T, T), torch.arange(T), torch.arange(T))


def inputs(B, nh, n_kv, T, hs=8, seed=0, sink=False):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(B, nh, T, hs, generator=g, dtype=torch.float64),
          torch.randn(B, n_kv, T, hs, generator=g, dtype=torch.float64),
          torch.randn(B, n_kv, T, hs, generator=g, dtype=torch.float64)]
    return xs + ([torch.randn(nh, generator=g, dtype=torch.float64)] if sink else [])


def assert_close(got, want, names, tol=1e-10):
    for name, a, b in zip(names, got, want):
        d = (a - b).abs()
        assert d.max() < tol, f"{name}: max {d.max():.2e}, mean {d.mean():.2e}"


CASES = [(2, 4, 4, 37, 5, 2, False), (2, 4, 2, 37, 8, 1, False), (1, 4, 1, 30, 7, 3, True),
         (2, 4, 2, 64, 8, 2, True), (1, 4, 4, 9, 4, 1, False)]


@pytest.mark.parametrize("B,nh,n_kv,T,block,topk,sink", CASES,
                         ids=["mha-ragged", "gqa-ragged", "mqa-sink", "gqa-whole-blocks-sink", "short"])
def test_the_gathered_path_equals_the_masked_path_and_the_chosen_keys_written_out(B, nh, n_kv, T, block, topk, sink):
    """Outputs and gradients (q, k, v, the sink) equal the masked paths' (reference, sdpa) in float64, and
    the output equals softmax over the chosen keys written out (helpers.plain_attention, keep=the choice)."""
    xs = inputs(B, nh, n_kv, T, seed=T + block, sink=sink)
    mask = choice(xs[0], xs[1], block, topk)
    assert mask().sum(-1).lt(torch.arange(1, T + 1)).any() or T <= block  # some query leaves keys out

    def path(fn):
        return lambda q, k, v, *s: fn(q, k, v, scale=0.3, mask=mask, sink=s[0] if s else None)
    got = grads(path(gathered_attention), *xs)
    names = ("out", "dq", "dk", "dv", "dsink")
    assert_close(got, grads(path(reference_attention), *xs), names)
    assert_close(got, grads(path(sdpa_with_sink), *xs), names)  # the fused path (with a sink, its key)
    want = plain_attention(*xs[:3], 0.3, causal=False, keep=mask(), sink=xs[3] if sink else None)
    assert_close(got[:1], [want], names)


@pytest.mark.parametrize("n_kv", [4, 2])
def test_a_choice_of_every_block_is_full_causal_attention(n_kv):
    """K at least the number of blocks: outputs and gradients of the plain causal formula (float64)."""
    xs = inputs(2, 4, n_kv, 29, seed=n_kv)
    mask = choice(xs[0], xs[1], 4, 8)
    got = grads(lambda q, k, v: gathered_attention(q, k, v, scale=0.4, mask=mask), *xs)
    assert_close(got, grads(lambda q, k, v: plain_attention(q, k, v, 0.4), *xs), ("out", "dq", "dk", "dv"))


@pytest.mark.parametrize("attn", [{"select_topk": 2}, {"select_topk": 1, "qk_norm": True, "sink": "learned"}],
                         ids=["moba", "qk-norm-sink"])
def test_a_model_on_the_gathered_path_equals_the_masked_model(attn):
    """The same weights on impl=gathered and impl=sdpa (the mask): logits and every parameter's gradient."""
    idx = torch.randint(40, (2, 30), generator=torch.Generator().manual_seed(4))
    a = {"select": "moba", "select_block": 4, **attn}
    models = [make(block_size=30, n_kv_head=2, impl=impl, attn=a).train() for impl in ("gathered", "sdpa")]
    outs = []
    for m in models:
        logits = m(idx)
        logits.logsumexp(-1).mean().backward()
        outs.append(logits)
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    for (name, p), (_, r) in zip(*(m.named_parameters() for m in models)):
        assert torch.allclose(p.grad, r.grad, atol=1e-5), name


def test_cached_generation_on_the_gathered_path_equals_recomputation():
    """The prefill reads its blocks by gathering, each decode step by the mask over the cache."""
    from sample import generate
    model = make(block_size=48, n_kv_head=2, impl="gathered", attn={"select": "moba", "select_block": 4,
                                                                   "select_topk": 1})
    prompt = torch.randint(40, (2, 13), generator=torch.Generator().manual_seed(3))
    assert torch.equal(generate(model, prompt, 30, temperature=0, kv_cache=True),
                       generate(model, prompt, 30, temperature=0, kv_cache=False))


@pytest.mark.parametrize("T,block,topk,n_kv", [(45, 8, 2, 2), (30, 7, 1, 4), (64, 16, 3, 1)])
def test_the_keys_read_and_the_macs_done_are_what_counting_says(T, block, topk, n_kv):
    """counting.selected_keys = the keys the choice lets through (its mask's True entries) = the keys the
    gathered path leaves visible in the blocks it reads; counting.selected_macs = the matrix products
    torch's FlopCounterMode measures in the choice and the path (2 FLOPs per MAC)."""
    from torch.utils.flop_counter import FlopCounterMode

    from lab.counting import selected_keys, selected_macs
    c = config(T, block, topk, n_kv)
    xs = [x.float().requires_grad_() for x in inputs(2, 4, n_kv, T, seed=T)]
    with FlopCounterMode(display=False) as counter:
        mask = MoBA(c)(xs[0], xs[1], Mask(T, T), torch.arange(T), torch.arange(T))
        gathered_attention(*xs, scale=0.3, mask=mask)
    macs = selected_macs(c, T)
    assert counter.get_total_flops() == 2 * 2 * T * sum(macs.values())  # 2 sequences of T tokens
    rows, offset, _ = pairs(mask, n_kv)
    read_by_path = int((offset + 1).clamp(max=block).sum())  # in each block it reads, the keys up to its query
    assert read_by_path == int(mask().sum()) == 2 * 4 * T * selected_keys(c, T)
    computed = Fraction(len(rows) * block, 2 * 4 * T)  # keys per query and head: whole blocks
    assert computed * 4 * 8 == macs["scores"] == macs["weighted_sum"]


def test_bench_attention_times_moba_gathered_beside_its_mask():
    """tools/bench_attention.py paths=[sdpa,moba,moba_masked]: from N = 256 to 1024 what moba keeps for its
    backward grows ~4x (no table), moba_masked's ~16x (its mask's table over sdpa); moba's predicted MACs
    are counting.selected_macs' for the benchmark's B and K."""
    from lab.counting import selected_macs
    from helpers import compose_cfg
    from tools.bench_attention import bench_attention
    cfg = compose_cfg("bench_attention", ["lengths=[256,1024]", "paths=[sdpa,moba,moba_masked]", "repeats=1",
                                          "select_block=16", "select_topk=2", "out=null"])
    rows = {(r["path"], r["N"]): r for r in bench_attention(cfg)["rows"]}
    grow = {p: rows[(p, 1024)]["saved_bytes"] / rows[(p, 256)]["saved_bytes"] for p in ("moba", "moba_masked")}
    assert grow["moba"] < 4.5 and grow["moba_masked"] > 8, grow
    c = GPTConfig(vocab_size=2, block_size=1024, n_layer=1, n_head=4, n_embd=128,
                  attn={"select": "moba", "select_block": 16, "select_topk": 2})
    assert rows[("moba", 1024)]["predicted_macs_per_token"] == float(sum(selected_macs(c, 1024).values()))
    assert all(r["ms"] > 0 for r in rows.values())


def test_the_gathered_path_keeps_memory_that_grows_as_n_not_n_squared():
    """What one call keeps for its backward at N and 4N (blocks of 32, K = 2): ~4x on the gathered path
    (q, k, v, the output, one log-sum-exp and the pairs per query), ~16x for the masked path's table."""
    def kept(impl, N):
        q, k, v = (torch.randn(1, 4, N, 16, requires_grad=True) for _ in range(3))
        mask = choice(q.detach(), k.detach(), 32, 2)
        return saved_bytes(lambda: impl(q, k, v, scale=0.25, mask=mask)) - 3 * q.numel() * 4
    ratio = {f.__name__: kept(f, 1024) / kept(f, 256) for f in (gathered_attention, reference_attention)}
    assert ratio["gathered_attention"] < 5 and ratio["reference_attention"] > 12, ratio
    assert kept(reference_attention, 1024) > 10 * kept(gathered_attention, 1024)


@pytest.mark.parametrize("select", ["none", "oracle"])
def test_the_gathered_path_without_moba_is_ignored_and_said(select):
    """Without MoBA's blocks the path is sdpa's with the mask: the setting is said to have no effect."""
    attn = {"impl": "gathered", "select": select} if select == "none" else \
        {"impl": "gathered", "select": select, "select_topk": 3}
    c = GPTConfig(vocab_size=40, n_layer=1, n_head=4, n_embd=32, attn=attn)
    assert any(line.startswith("model.attn.impl='gathered' has no effect unless model.attn.select=moba")
               for line in c.ignored), c.ignored


def test_cost_prints_the_macs_of_a_layer_that_computes_only_its_blocks(capsys):
    """tools/cost.py with select=moba: per token and layer, q against each of the ceil(N/B) block means,
    then q.k and weights.V over whole blocks, its own and min(K, b) earlier ones, written out here."""
    import json

    from helpers import compose_cfg
    from tools.cost import cost
    N, B, K = 300, 32, 3
    cost(compose_cfg("cost", ["model=debug", f"seq_len={N}", "model.attn.select=moba", f"model.attn.select_block={B}",
                              f"model.attn.select_topk={K}", "model.attn.impl=gathered", "format=json", "plot=null"]))
    got = json.loads(capsys.readouterr().out)["selected_macs_per_token"]
    width = compose_cfg("cost", ["model=debug"]).model.n_embd  # n_head * head_dim
    keys = sum(B * (1 + min(K, i // B)) for i in range(N)) / N
    assert got["choose"] == width * 10  # ceil(300 / 32) blocks
    assert got["scores"] == got["weighted_sum"] == pytest.approx(width * keys, rel=1e-12)
    assert got["total"] == pytest.approx(width * (10 + 2 * keys), rel=1e-12)
    assert got["full_table"] == 2 * N * width


def test_the_gathered_path_refuses_dropout_in_one_line():
    with pytest.raises(UserError, match="model.attn.impl=gathered does not drop attention weights") as e:
        GPTConfig(vocab_size=40, n_layer=1, n_head=4, n_embd=32, dropout=0.1,
                  attn={"impl": "gathered", "select": "moba"})
    assert "\n" not in str(e.value)
