"""Generation: the KV-cache path is the same function as full recomputation, also past block_size."""
import io

import pytest
import torch

from rules import UserError
from model import GPT, GPTConfig
from sample import generate, next_tokens

ATTN_OPTIONS = [
    {},
    {"scale": "none"},
    {"scale": "dk"},
    {"scale": "0.3"},
    {"qk_norm": True},
    {"qk_norm": True, "qk_norm_type": "layer", "qk_norm_gain": "channel"},
    {"qk_norm": True, "qk_norm_type": "l2", "qk_norm_gain": "head", "scale": "4.0"},
]


def make_model(seed=0, block_size=16, n_layer=2, impl="sdpa", **attn):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=40, block_size=block_size, n_layer=n_layer, n_head=2, n_embd=32,
                          attn=dict(impl=impl, **attn)))
    with torch.no_grad():  # trained-looking weights: gains away from 1, bigger projections
        for name, p in model.named_parameters():
            if "gain" in name:
                p.uniform_(0.5, 2.0)
            elif p.dim() == 2:
                p.mul_(5)
    return model.eval()


def assert_close(a, b, what):
    d = (a - b).abs()
    assert d.max() < 1e-4, f"{what}: max diff {d.max():.2e}, mean {d.mean():.2e}"


def cached_logits(model, seq, prompt):
    """Logits for positions prompt-1 .. len-1: prefill seq[:prompt], then one token at a time."""
    cache = model.new_kv_cache(seq.size(0), model.config.block_size)
    with torch.no_grad():
        out = [model(seq[:, :prompt], cache=cache, pos=0)[:, -1]]
        for t in range(prompt, seq.size(1)):
            out.append(model(seq[:, t:t + 1], cache=cache, pos=t)[:, -1])
    return out


@pytest.mark.parametrize("attn", ATTN_OPTIONS, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default")
def test_cached_logits_equal_the_sliding_window_reference_at_every_step(attn):
    """Past block_size the cache slides: every layer attends to the latest block_size positions.
    The independent reference is the plain-math path over the whole sequence with that band mask."""
    model = make_model(**attn)
    reference = make_model(impl="reference", **attn)
    reference.load_state_dict(model.state_dict())
    bs = model.config.block_size
    seq = torch.randint(40, (2, 2 * bs + 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = [reference(seq[:, :t + 1], window=bs)[:, -1] for t in range(4, seq.size(1))]
    for step, (a, b) in enumerate(zip(cached_logits(model, seq, 5), want)):
        assert_close(a, b, f"step {step}")


@pytest.mark.parametrize("attn", ATTN_OPTIONS, ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default")
def test_cached_logits_equal_recomputed_ones(attn):
    """The recomputing path (kv_cache=false) re-encodes the last block_size tokens each step. It is
    the same function as the cache while the text fits one block (any depth), and past block_size
    for one layer, where RoPE makes scores depend on offsets only."""
    bs = 16
    for n_layer, length in [(3, bs), (1, 3 * bs)]:
        model = make_model(n_layer=n_layer, **attn)
        seq = torch.randint(40, (2, length), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            want = [model(seq[:, max(0, t + 1 - bs):t + 1])[:, -1] for t in range(2, length)]
        for step, (a, b) in enumerate(zip(cached_logits(model, seq, 3), want)):
            assert_close(a, b, f"{n_layer} layers, step {step}")


def test_deeper_models_past_block_size_see_further_than_the_recomputing_path():
    """Why the two paths part past block_size from 2 layers on: a cached layer-2 key was computed
    when its position still saw older tokens, which the recomputing path has cropped away. So the
    cache's receptive field is n_layer * (block_size - 1) + 1 tokens, as in sliding-window attention."""
    model = make_model(n_layer=2)
    bs = 16
    seq = torch.randint(40, (1, 2 * bs), generator=torch.Generator().manual_seed(3))
    cached = cached_logits(model, seq, 1)[-1]
    with torch.no_grad():
        cropped = model(seq[:, -bs:])[:, -1]
        changed = seq.clone()
        changed[:, 1] = (changed[:, 1] + 1) % 40  # 2*bs-2 positions back: outside one block, inside 2
        assert not torch.allclose(cached, cropped, atol=1e-3)
        assert not torch.allclose(cached, cached_logits(model, changed, 1)[-1], atol=1e-4)
        assert torch.allclose(cropped, model(changed[:, -bs:])[:, -1])


def greedy_reference(model, idx, n, window):
    """Greedy decoding by full recomputation of the sliding-window function, one token per step."""
    for _ in range(n):
        with torch.no_grad():
            logits = model(idx, window=window)[:, -1]
        idx = torch.cat((idx, logits.argmax(-1, keepdim=True)), dim=1)
    return idx


@pytest.mark.parametrize("prompt_len,new,n_layer", [(1, 15, 2), (15, 1, 2), (14, 2, 3), (3, 40, 1)])
def test_greedy_cached_and_uncached_generate_the_same_tokens(prompt_len, new, n_layer):
    model = make_model(seed=2, n_layer=n_layer)  # within one block at any depth; 2.7x past it with 1 layer
    idx = torch.randint(40, (1, prompt_len), generator=torch.Generator().manual_seed(3))
    a = generate(model, idx, new, temperature=0, kv_cache=True)
    b = generate(model, idx, new, temperature=0, kv_cache=False)
    assert a.shape == (1, prompt_len + new)
    assert torch.equal(a, b)


def test_greedy_cached_generation_2x_past_block_size_equals_sliding_window_reference():
    model = make_model(seed=4, n_layer=3)
    idx = torch.randint(40, (1, 3), generator=torch.Generator().manual_seed(5))
    assert torch.equal(generate(model, idx, 40, temperature=0, kv_cache=True), greedy_reference(model, idx, 40, 16))


def test_prompt_longer_than_block_size_is_cropped_the_same_way():
    model = make_model(seed=4)
    idx = torch.randint(40, (1, 30), generator=torch.Generator().manual_seed(5))
    assert torch.equal(generate(model, idx, 1, temperature=0, kv_cache=True),
                       generate(model, idx, 1, temperature=0, kv_cache=False))


def test_cache_is_preallocated_not_concatenated():
    model = make_model()
    cache = model.new_kv_cache(1, 16)
    storage = cache[0].k.data_ptr()
    generate(model, torch.zeros(1, 1, dtype=torch.long), 40, temperature=0)
    with torch.no_grad():
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache, pos=0)
        for t in range(3, 40):
            model(torch.zeros(1, 1, dtype=torch.long), cache=cache, pos=t)
    assert cache[0].k.data_ptr() == storage and cache[0].k.shape[2] == 16


def test_batched_samples_equal_single_samples_with_the_same_seeds():
    model = make_model(seed=6)
    prompt = torch.randint(40, (1, 4), generator=torch.Generator().manual_seed(7))
    gens = lambda seeds: [torch.Generator().manual_seed(s) for s in seeds]  # noqa: E731
    batched = generate(model, prompt.repeat(3, 1), 25, temperature=1.0, top_k=10, generators=gens([11, 12, 13]))
    for row, seed in enumerate([11, 12, 13]):
        single = generate(model, prompt, 25, temperature=1.0, top_k=10, generators=gens([seed]))
        assert torch.equal(batched[row], single[0])
    assert not torch.equal(batched[0], batched[1])


def test_top_k_and_top_p_keep_only_the_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1]]))
    draws = lambda **kw: {next_tokens(logits, 1.0, generators=[g], **kw).item()  # noqa: E731
                          for g in [torch.Generator().manual_seed(s) for s in range(300)]}
    assert draws(top_k=2, top_p=1.0) == {0, 1}
    assert draws(top_k=None, top_p=0.7) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.25 >= 0.7
    assert draws(top_k=None, top_p=0.5) == {0}
    assert draws(top_k=None, top_p=1.0) == {0, 1, 2, 3}
    assert next_tokens(logits, 0.0, None, 1.0, []).item() == 0  # greedy


@pytest.mark.parametrize("kw,needle", [
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.5), "temperature"),
])
def test_bad_sampling_arguments_are_one_line_errors(kw, needle):
    model = make_model()
    args = {"max_new_tokens": 5, "temperature": 1.0, "top_p": 1.0, **kw}
    with pytest.raises(UserError, match=needle):
        generate(model, torch.zeros(1, 1, dtype=torch.long), **args)


def test_sample_stop_string_and_stream(train_cfg, sample_cfg, tmp_path):
    from sample import sample
    from train import train
    train(train_cfg("train.max_iters=10"))
    run = tmp_path / "run"
    out = io.StringIO()
    texts = sample(sample_cfg(f"ckpt={run}", "prompt=a", "max_new_tokens=60", "stream=true", "temperature=0"), out=out)
    assert out.getvalue() == texts[0] and len(texts[0]) == 61
    generated = texts[0][1:]
    cfg = sample_cfg(f"ckpt={run}", "prompt=a", "max_new_tokens=60", "temperature=0")
    cfg.stop = generated[4:6]  # a string the greedy sample is known to contain
    assert sample(cfg)[0] == "a" + generated[:generated.index(cfg.stop)]
    with pytest.raises(UserError, match="num_samples"):
        sample(sample_cfg(f"ckpt={run}", "stream=true", "num_samples=2"))
    # a prompt file keeps its whitespace exactly (Hydra would strip a trailing space on the command line)
    (tmp_path / "prompt.txt").write_text("line 1: \n ")
    text = sample(sample_cfg(f"ckpt={run}", f"prompt_file={tmp_path / 'prompt.txt'}", "max_new_tokens=5",
                             "temperature=0"))[0]
    assert text.startswith("line 1: \n ") and len(text) == len("line 1: \n ") + 5
    with pytest.raises(UserError, match="prompt_file=.*cannot be read"):
        sample(sample_cfg(f"ckpt={run}", f"prompt_file={tmp_path / 'missing.txt'}"))


@pytest.mark.parametrize("num_samples, kv_cache, cores, want", [(1, True, 2, 1), (1, True, 16, 1), (2, True, 2, 1),
                                                                  (4, True, 2, 2), (8, True, 16, 16), (1, False, 2, 2),
                                                                  (8, False, 4, 4)])
def test_decode_threads_are_one_for_a_cached_sequence_and_every_core_for_a_batch_or_a_recompute(
        num_samples, kv_cache, cores, want):
    from lab.sampling import decode_threads
    assert decode_threads(num_samples, kv_cache, cores) == want


def test_sample_sets_the_chosen_threads_and_an_explicit_value_wins(tmp_path, monkeypatch):
    """sample() on a CPU runs with decode_threads' choice (or threads=N) and leaves torch's count as found."""
    import lab.sampling
    import sample as sample_module
    from helpers import compose_cfg, save_tiny_checkpoint
    ckpt = save_tiny_checkpoint(tmp_path)
    seen = []
    real = sample_module.generate
    monkeypatch.setattr(sample_module, "generate", lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k))
    monkeypatch.setattr(lab.sampling, "cpu_cores", lambda: 2)  # this machine's count may be anything
    before = torch.get_num_threads()
    for over, want in ((["num_samples=1"], 1), (["num_samples=8"], 2), (["num_samples=1", "threads=2"], 2)):
        sample_module.sample(compose_cfg("sample", [f"ckpt={ckpt}", "device=cpu", "max_new_tokens=3", "prompt=ab", *over]))
        assert seen[-1] == want, over
        assert torch.get_num_threads() == before
