"""variants/sink_cache.py, eviction that keeps attention sinks (sample.py kv_sinks=S, StreamingLLM):
each decode step against the model run on exactly the tokens kept, with RoPE and with ALiBi, and
tools/eval_stream.py, which compares the eviction policies on a text."""
import math

import pytest
import torch

from helpers import variant_model as make
from variants.sink_cache import SinkKVCache


@pytest.mark.parametrize("variant", [{"pos": "rope"}, {"pos": "alibi"}, {"pos": "none"}, {"attn": {"kind": "mla"}}],
                         ids=["rope", "alibi", "nope", "mla"])
def test_sink_eviction_equals_attention_over_exactly_the_kept_positions(variant):
    """One layer, decoding far past the cache: each step's logits equal the model run on just the kept
    tokens (the first 4, then the latest) at positions 0..n-1, which is what attending to them with
    in-cache positions means (RoPE: each kept key turned to its place, MLA's RoPE key too; ALiBi: its
    distance there)."""
    model = make(n_layer=1, block_size=12, **variant)
    ids = torch.randint(40, (1, 50))
    cache = model.new_kv_cache(1, 12, sinks=4)
    assert all(isinstance(c, SinkKVCache) for c in cache)
    with torch.no_grad():
        model(ids[:, :3], cache=cache, pos=0)
        for t in range(3, 50):
            got = model(ids[:, t:t + 1], cache=cache, pos=t)[0, -1]
            kept = list(range(t + 1)) if t < 12 else [0, 1, 2, 3] + list(range(t - 7, t + 1))
            want = model(ids[:, kept])[0, -1]
            assert torch.allclose(got, want, atol=1e-5), t


def test_eval_stream_reports_every_policy(tmp_path):
    """tools/eval_stream.py on a checkpoint and a text: every policy's loss within and past the cache,
    equal within it (nothing is evicted yet)."""
    from helpers import compose_cfg, save_tiny_checkpoint
    from tools.eval_stream import eval_stream
    ckpt = save_tiny_checkpoint(tmp_path, block_size=16)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 10)
    r = eval_stream(compose_cfg("eval_stream", [f"ckpt={ckpt}", f"text={text}", "tokens=80", "out=null"]))
    within = [p["within"] for p in r["policies"].values()]
    assert set(r["policies"]) == {"recompute", "ring", "sinks"} and max(within) - min(within) < 1e-4
    assert all(len(p["losses"]) == 79 and math.isfinite(p["past"]) for p in r["policies"].values())


def test_eval_stream_compares_cache_dtypes_against_a_recomputation(tmp_path):
    """kv_dtypes=: each dtype's bytes are cost.py's, its logit error and argmax agreement are those of
    decoding the text step by step through that cache (recomputed here), and the greedy texts first
    differ where sample.generate's do."""
    from lab.checkpoint import load_checkpoint, model_from_checkpoint
    from lab.counting import kv_cache_bytes
    from helpers import compose_cfg, save_tiny_checkpoint
    from sample import generate
    from lab.heldout import stream_tokens
    from tools.eval_stream import eval_stream
    ckpt = save_tiny_checkpoint(tmp_path, block_size=16)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 10)
    cfg = compose_cfg("eval_stream", [f"ckpt={ckpt}", f"text={text}", "tokens=60", "policies=[ring]", "greedy=40",
                                      "kv_dtypes=[float32,bfloat16,int8]", "out=null"])
    rows = eval_stream(cfg)["kv_dtypes"]
    state = load_checkpoint(ckpt)
    model = model_from_checkpoint(state).eval()
    ids = stream_tokens(state, cfg, 60)
    logits = {}
    with torch.no_grad():
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("int8", torch.int8)):
            cache = model.new_kv_cache(1, 16, dtype=dtype)
            logits[name] = torch.stack([model(ids[None, t:t + 1], cache=cache, pos=t)[0, -1] for t in range(59)])
            assert rows[name]["bytes"] == kv_cache_bytes(model.config, 16, 1, dtype.itemsize if name != "int8" else 1,
                                                         int8=name == "int8")
    greedy = {n: generate(model, ids[None, :8], 40, temperature=0, kv_dtype=d)[0, 8:]
              for n, d in (("float32", torch.float32), ("int8", torch.int8))}
    for name in ("bfloat16", "int8"):
        err = (logits[name].float() - logits["float32"]).abs()
        assert rows[name]["max_logit_error"] == pytest.approx(err.max().item(), abs=1e-6) and err.max() > 0
        agree = (logits[name].argmax(-1) == logits["float32"].argmax(-1)).float().mean().item()
        assert rows[name]["argmax_agreement"] == pytest.approx(agree)
    assert rows["float32"]["max_logit_error"] == 0 and rows["float32"]["first_difference"] is None
    differ = (greedy["int8"] != greedy["float32"]).nonzero()
    assert rows["int8"]["first_difference"] == (None if differ.numel() == 0 else int(differ[0, 0]))


def test_caches_a_compiled_step_or_an_int8_cache_cannot_hold_are_refused_in_one_line():
    from rules import UserError
    from sample import generate
    model = make()
    for kw, needle in (({"kv_dtype": torch.int8, "compile": True}, "compiled decode step"),
                       ({"kv_sinks": 2, "compile": True}, "compiled decode step"),
                       ({"kv_sinks": 2, "kv_dtype": torch.int8}, "an int8 cache does not keep sink tokens")):
        with pytest.raises(UserError, match=needle) as e:
            generate(model, torch.zeros(1, 1, dtype=torch.long), 20, temperature=0, **kw)
        assert "\n" not in str(e.value)
