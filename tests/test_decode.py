"""Fast decoding: the compiled static-cache decode step, chunked host checks, streaming, batching."""
import io
import re

import pytest
import torch

from model import GPT, GPTConfig
from sample import generate


def tiny(**kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=4, n_embd=32, **kw)).eval()


@pytest.mark.slow
@pytest.mark.parametrize("variant", [{}, {"n_kv_head": 1, "attn": {"qk_norm": True}}, {"pos": "sinusoidal"}],
                         ids=["default", "mqa+qknorm", "sinusoidal"])
def test_compiled_decode_step_equals_eager(variant):
    """Greedy tokens with the compiled fixed-shape decode step equal the eager cached ones, past
    block_size too (the static ring buffer slides; absolute positions re-prefill eagerly)."""
    from torch._dynamo.utils import counters
    model = tiny(**variant)
    prompt = torch.randint(40, (3, 4))
    eager = generate(model, prompt, 30, temperature=0)
    graphs = counters["stats"]["unique_graphs"]
    compiled = generate(model, prompt, 30, temperature=0, compile=True)
    assert counters["stats"]["unique_graphs"] > graphs  # dynamo really traced the step
    assert torch.equal(eager, compiled)
    sampled = [generate(model, prompt, 20, temperature=1.0, top_k=10, compile=c,
                        generators=[torch.Generator().manual_seed(b) for b in range(3)]) for c in (False, True)]
    assert torch.equal(*sampled)


def test_static_cache_step_equals_dynamic_cache_step():
    """One decode step through StaticKVCache (tensor position, key mask over all slots) gives the
    logits of the dynamic cache (sliced to the slots in use), before and after the ring wraps."""
    model = tiny()
    idx = torch.randint(40, (2, 40))
    caches = model.new_kv_cache(2, 16), model.new_kv_cache(2, 16, static=True)
    for cache in caches:
        model(idx[:, :5], cache=cache, pos=0)
    for pos in range(5, 40):
        a = model(idx[:, pos:pos + 1], cache=caches[0], pos=pos)
        b = model(idx[:, pos:pos + 1], cache=caches[1], pos=torch.tensor([pos]))
        assert torch.allclose(a, b, atol=1e-5), f"pos {pos}: max diff {(a - b).abs().max():.2e}"


def test_checks_every_k_tokens_see_every_token_once():
    model = tiny()
    prompt = torch.randint(40, (2, 3))
    seen = []
    out = generate(model, prompt, 50, temperature=0, on_token=lambda t: seen.append(t.clone()), every=16)
    assert [t.size(1) for t in seen] == [16, 16, 16, 2]
    assert torch.equal(torch.cat(seen, dim=1), out[:, 3:])
    stopped = generate(model, prompt, 50, temperature=0, on_token=lambda t: True, every=16)
    assert stopped.shape == (2, 3 + 16)  # stops at the first check


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from helpers import compose_cfg
    from train import train
    tmp = tmp_path_factory.mktemp("decode")
    corpus = tmp / "corpus.txt"
    corpus.write_text("".join(f"the {w} sat on the mat, said {w}.\n" for w in ("cat", "dog", "bird") * 80))
    train(compose_cfg("config", ["model=debug", "device=cpu", "logger.wandb.mode=disabled", "train.max_iters=30",
                                 "train.eval_interval=30", "train.eval_iters=1", "train.batch_size=8",
                                 f"data.path={corpus}", f"out_dir={tmp / 'run'}", f"data.cache_dir={tmp / 'cache'}"]))
    return tmp / "run"


def test_streamed_text_equals_non_streamed_text(run_dir, sample_cfg):
    from sample import sample
    for stop in (None, "at"):
        args = [f"ckpt={run_dir}", "prompt=the", "max_new_tokens=70", "temperature=0.9", "seed=5"]
        args += [f"stop={stop}"] if stop else []
        out = io.StringIO()
        streamed = sample(sample_cfg(*args, "stream=true"), out=out)
        plain = sample(sample_cfg(*args))
        assert streamed == plain and out.getvalue() == plain[0]


def test_stop_string_stops_every_sample_of_a_batch(run_dir, sample_cfg):
    from sample import sample
    texts = sample(sample_cfg(f"ckpt={run_dir}", "prompt=the", "max_new_tokens=120", "num_samples=4",
                              "temperature=1.0", "stop=.", "seed=3"))
    full = sample(sample_cfg(f"ckpt={run_dir}", "prompt=the", "max_new_tokens=120", "num_samples=4",
                             "temperature=1.0", "seed=3"))
    for text, whole in zip(texts, full):
        assert "." not in text[3:]
        assert "." in whole[3:] and whole.startswith(text) and whole[len(text)] == "."  # cut right at the stop


def test_bench_sample_prints_ratios_and_the_bandwidth_bound(capsys):
    from helpers import compose_cfg
    from tools.bench_sample import bench_sample
    from lab.counting import decode_bytes
    cfg = compose_cfg("bench_sample", ["model=debug", "tokens=40", "batch_sizes=[1,2]", "compile=[false]",
                                       "layouts=[row,column]", "kv_dtypes=[float32]", "repeats=2", "ratio_tokens=[8,16]"])
    result = bench_sample(cfg)  # transformers=[dynamic,static] by default: its rows, eager (compile=[false])
    text = capsys.readouterr().out
    assert "cache vs recompute" in text and "batch 2 vs batch 1" in text and "% of the bandwidth bound" in text
    assert re.search(r"cache vs recompute \(batch 1\) by new tokens: 8: [\d.]+x, 16: [\d.]+x", text)
    assert re.search(r"attnlab eager / transformers eager \(faster of dynamic, static\): \d+\.\d\dx", text)
    assert "TOKENS DIFFER" not in text and "compiled / transformers" not in text
    assert "where a cached decode step's time goes" not in text and "profile" not in result  # profile=false
    rows = result["rows"]
    assert set(rows) == {"recompute, batch 1", "cache, batch 1, row-major", "cache, batch 2, row-major",
                         "cache, batch 1, column-major", "cache, batch 2, column-major",
                         *(f"transformers, {c} cache, batch {b}" for c in ("dynamic", "static") for b in (1, 2))}
    assert all(r["tokens_per_sec"] > 0 for r in rows.values())
    assert all(r["same_tokens"] and r["fraction_of_bound"] > 0 for n, r in rows.items() if n.startswith("transformers"))
    assert set(result["cache_vs_recompute"]) == {8, 16}
    # the bound's bandwidth is measured on the threads the step runs on: one for a cached batch 1 on a CPU
    assert 1 in result["bandwidth"] and all(b > 1e8 for b in result["bandwidth"].values())
    model = tiny()  # weights: params x 4 bytes; KV: 2 (k, v) x layers x batch x kv heads x context x head dim x 4
    assert decode_bytes(model.config, 3, 10) == model.num_params() * 4 + 2 * 2 * 3 * 4 * 10 * 8 * 4
    assert decode_bytes(model.config, 3, 10, kv_bytes=2) == model.num_params() * 4 + 2 * 2 * 3 * 4 * 10 * 8 * 2
    cfg = compose_cfg("bench_sample", ["model=debug", "tokens=20", "batch_sizes=[1]", "compile=[false]",
                                       "recompute=false", "repeats=1", "transformers=[]"])  # default kv_dtypes: float32 and bfloat16
    rows = bench_sample(cfg)["rows"]
    assert set(rows) == {"cache, batch 1, kv float32", "cache, batch 1, kv bfloat16"}
    assert "batch 1, kv bfloat16" in capsys.readouterr().out


def test_bench_sample_profile_splits_a_cached_step_into_parts_that_sum_to_it(capsys):
    """profile=true: after the rows, a cached batch-1 eager step (1 thread, column-major on a CPU) split into
    its parts' ms per step and share, everything else included, which sum to the step; then the one-row
    products and the bandwidth bound."""
    from helpers import compose_cfg
    from tools.bench_sample import EVERYTHING_ELSE, PROFILE_PARTS, bench_sample
    cfg = compose_cfg("bench_sample", ["model=debug", "tokens=20", "batch_sizes=[1]", "compile=[false]",
                                       "recompute=false", "kv_dtypes=[float32]", "transformers=[]", "repeats=1",
                                       "profile=true"])
    profile = bench_sample(cfg)["profile"]
    text = capsys.readouterr().out
    step = float(re.search(r"where a cached decode step's time goes \(batch 1, eager, 1 thread, kv float32, "
                           r"column-major, context \d+, 20 steps\): ([\d.]+) ms per step \([\d.]+ profiled\)", text)[1])
    rows = {n: (float(ms), float(share))
            for n, ms, share in re.findall(r"^  (.+?) +(-?[\d.]+) ms +(-?[\d.]+)%$", text, re.M)}
    assert list(rows) == [*PROFILE_PARTS, EVERYTHING_ELSE]
    assert abs(sum(ms for ms, _ in rows.values()) - step) <= 0.0005 * (len(rows) + 1)  # each printed to 0.001 ms
    assert abs(sum(share for _, share in rows.values()) - 100) <= 0.05 * len(rows)
    assert sum(profile["parts"].values()) == pytest.approx(profile["step_ms"])
    assert all(profile["parts"][part] > 0 for part in PROFILE_PARTS)  # the debug model runs every kind of op
    products = re.search(r"^the one-row products alone \(.*\): ([\d.]+) ms per step, \d+% of the eager step; they "
                         r"read their weights at ([\d.]+) GB/s, where a sum reads at ([\d.]+)$", text, re.M)
    # the rate is the Linear weights' bytes over the products' time: the debug preset's, counted here
    m = cfg.model
    d_ff = 4 * m.n_embd
    weight_bytes = 4 * (m.n_layer * (3 * m.n_embd * m.n_embd + m.n_embd * m.n_embd + 2 * m.n_embd * d_ff)
                        + cfg.vocab_size * m.n_embd)
    assert profile["products_gbs"] == pytest.approx(weight_bytes / profile["products_ms"] / 1e6)
    assert float(products[1]) == pytest.approx(profile["products_ms"], abs=0.0006)
    assert float(products[2]) == pytest.approx(profile["products_gbs"], abs=0.06)
    assert float(products[3]) == pytest.approx(profile["read_gbs"], abs=0.06) and profile["read_gbs"] > 0.1
    assert re.search(r"^the bandwidth bound \(weights \+ KV at context \d+, [\d.]+ GB/s\): [\d.]+ ms per step$",
                     text, re.M)
    assert 0 < profile["bound_ms"] < profile["products_ms"] < profile["step_ms"]


@pytest.mark.parametrize("overrides,needle", [
    (["compile=[]", "recompute=false"], "nothing to time: compile=[] leaves no cached case"),
    (["compile=[false,false]"], "compile=[False, False]: list each value once"),
    (["transformers=[static,static]"], "transformers=['static', 'static']: list each value once"),
    (["batch_sizes=[]"], "batch_sizes=[]: list at least one value"),
])
def test_bench_sample_with_nothing_to_time_says_what_to_change_before_any_work(overrides, needle, capsys):
    """With nothing to time, bench_sample is one line saying what to change, before printing anything (not
    exit 0 after only its header line)."""
    from helpers import compose_cfg
    from rules import UserError
    from tools.bench_sample import bench_sample
    with pytest.raises(UserError, match=re.escape(needle)) as e:
        bench_sample(compose_cfg("bench_sample", ["model=debug", "tokens=5", *overrides]))
    assert "\n" not in str(e.value) and capsys.readouterr().out == ""  # refused before printing anything


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_bf16_kv_cache_follows_the_reference_to_bf16_rounding(static):
    """sample.kv_dtype=bfloat16: the cache holds bf16 (half the bytes), and its logits, step by step
    past block_size, stay within bf16 rounding (2% of the largest logit) of the fp32 sliding-window
    reference, which the fp32 cache matches to 1e-4."""
    from helpers import variant_model as make
    model, bs = make(), 16
    seq = torch.randint(40, (2, 2 * bs + 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = [model(seq[:, :t + 1], window=bs)[:, -1] for t in range(4, seq.size(1))]
    top = max(w.abs().max().item() for w in want)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.02 * top)):
        cache = model.new_kv_cache(2, bs, dtype=dtype, static=static)
        slots = 64 if static else bs  # a static cache pads its storage to a multiple of 64 slots (masked)
        assert all(c.k.dtype == c.v.dtype == dtype and c.k.numel() == 2 * 4 * slots * 8 and c.length == bs
                   for c in cache)
        with torch.no_grad():
            got = [model(seq[:, :5], cache=cache, pos=0)[:, -1]]
            for t in range(5, seq.size(1)):
                got.append(model(seq[:, t:t + 1], cache=cache, pos=torch.tensor([t]) if static else t)[:, -1])
        for step, (a, b) in enumerate(zip(got, want)):
            assert a.dtype == torch.float32 and (a - b).abs().max() <= tol, f"{dtype} step {step}"


def test_kv_dtype_auto_is_the_autocast_dtype_else_fp32():
    from lab.device import Runtime
    from lab.sampling import kv_cache_dtype
    cpu, cuda, mps = torch.device("cpu"), torch.device("cuda"), torch.device("mps")
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    auto = lambda device, dtype, n=1: kv_cache_dtype("auto", Runtime(device, dtype), n)
    assert auto(cpu, f32, 8) == auto(cpu, f32, 2) == auto(cpu, f32, 1) == f32  # as measured (bench_sample.py)
    assert auto(cuda, bf16) == auto(cuda, bf16, 8) == bf16 and auto(cuda, f16) == f16
    assert auto(cuda, f32, 8) == auto(mps, f32, 8) == f32
    assert kv_cache_dtype("float32", Runtime(cpu, f32), 8) == f32 and kv_cache_dtype("float16", Runtime(cuda, bf16), 1) == f16


def test_sample_kv_dtype(run_dir, sample_cfg, monkeypatch):
    """sample.py kv_dtype=bfloat16 generates (the cache it builds is bf16); auto on a CPU builds an fp32
    cache for one sample and for three (tokens equal to kv_dtype=float32); an unknown kv_dtype is a
    one-line error."""
    from rules import UserError
    from sample import sample
    built = []  # the dtype of every cache sample.py builds (the real method runs)
    new_kv_cache = GPT.new_kv_cache
    monkeypatch.setattr(GPT, "new_kv_cache", lambda self, *a, **kw: built.append(new_kv_cache(self, *a, **kw)) or built[-1])
    dtypes = lambda: {c.k.dtype for c in built.pop()}
    args = [f"ckpt={run_dir}", "prompt=the", "max_new_tokens=40", "temperature=0"]
    texts = sample(sample_cfg(*args, "kv_dtype=bfloat16"))
    assert len(texts) == 1 and len(texts[0]) == 3 + 40 and dtypes() == {torch.bfloat16}
    auto = sample(sample_cfg(*args))
    assert dtypes() == {torch.float32} and auto == sample(sample_cfg(*args, "kv_dtype=float32"))
    hot = [*args[:3], "temperature=1.0", "num_samples=3"]
    auto = sample(sample_cfg(*hot, "kv_dtype=auto"))
    assert dtypes() == {torch.float32} and auto == sample(sample_cfg(*hot, "kv_dtype=float32"))
    with pytest.raises(UserError, match=r"^kv_dtype='int4' is unknown: use one of auto, float32, bfloat16, float16, int8$"):
        sample(sample_cfg(*args, "kv_dtype=int4"))


def test_column_major_weights_decode_the_same_tokens():
    """sample.py's CPU layout changes only where the Linear weights' bytes sit, not what they hold."""
    from lab.sampling import decode_layout
    model = tiny()
    prompt = torch.randint(model.config.vocab_size, (3, 5))
    before = generate(model, prompt, 30, temperature=0)
    logits = model(prompt)
    decode_layout(model)
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            assert m.weight.t().is_contiguous() and not m.weight.is_contiguous()  # column-major now
    assert model.lm_head.weight is model.wte.weight  # still tied
    torch.testing.assert_close(model(prompt), logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(generate(model, prompt, 30, temperature=0), before)


def test_training_forward_works_after_sampling_past_block_size():
    """Sampling past block_size grows the RoPE table under inference_mode; a later training
    forward (sampling between evals) must still be able to save it for backward."""
    model = tiny()
    prompt = torch.randint(model.config.vocab_size, (1, 4))
    generate(model, prompt, 3 * model.config.block_size, temperature=0)
    assert model.rope.size(0) > model.config.block_size  # grown by generation
    model.train()
    _, loss = model(prompt, torch.roll(prompt, -1, 1))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
