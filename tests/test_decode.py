"""Fast decoding: the compiled static-cache decode step, chunked host checks, streaming, batching."""
import io

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
        model(idx[:, :5], kv_cache=cache, pos=0)
    for pos in range(5, 40):
        a = model(idx[:, pos:pos + 1], kv_cache=caches[0], pos=pos)
        b = model(idx[:, pos:pos + 1], kv_cache=caches[1], pos=torch.tensor([pos]))
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
    from conftest import compose_cfg
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
    from conftest import compose_cfg
    from bench_sample import bench_sample, decode_bytes
    cfg = compose_cfg("bench_sample", ["model=debug", "tokens=40", "batch_sizes=[1,2]", "compile=[false]",
                                       "layouts=[row,column]", "repeats=2"])
    result = bench_sample(cfg)
    text = capsys.readouterr().out
    assert "cache vs recompute" in text and "batch 2 vs batch 1" in text and "% of the bandwidth bound" in text
    rows = result["rows"]
    assert set(rows) == {"recompute, batch 1", "cache, batch 1, row-major", "cache, batch 2, row-major",
                         "cache, batch 1, column-major", "cache, batch 2, column-major"}
    assert all(r["tokens_per_sec"] > 0 for r in rows.values()) and result["bandwidth"] > 1e8
    model = tiny()  # weights: params x 4 bytes; KV: 2 (k, v) x layers x batch x kv heads x context x head dim x 4
    assert decode_bytes(model, 3, 10) == model.num_params() * 4 + 2 * 2 * 3 * 4 * 10 * 8 * 4


def test_column_major_weights_decode_the_same_tokens():
    """sample.py's CPU layout changes only where the Linear weights' bytes sit, not what they hold."""
    from sample import decode_layout
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
