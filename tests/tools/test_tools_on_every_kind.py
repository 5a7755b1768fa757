"""Every looking-inside tool on a checkpoint of every kind (softmax, hybrid, recurrent, sparse, mqar):
a result, or one line that names the tool's own keys (never the training run's data.* keys, which a
tool does not take). Short real training runs; each tool called as its command calls it. Then each tool's
options that a kind cannot act on (no softmax weights, no KV cache, no RoPE): one warning line per key on
that kind, none where the option acts (tiny untrained checkpoints)."""
import pytest

from helpers import compose_cfg
from rules import UserError

KINDS = {"softmax": [], "hybrid": ["model.attn.layer_kinds=[gdn,softmax]"],
         "recurrent": ["model.attn.layer_kinds=[mamba2,linear]"],
         "sparse": ["model.attn.select=moba", "model.attn.select_block=8", "model.attn.select_topk=1"],
         "mqar": ["data=mqar", "data.examples=256", "data.pairs=[4]", "data.vocab_size=40"]}
TOOLS = {  # tool: (module, function, overrides that keep it short)
    "ablate": ("tools.ablate", "ablate", ["batches=1", "batch_size=2"]),
    "lens": ("tools.lens", "lens", []),
    "patch": ("tools.patch", "patch", []),
    "eval_lengths": ("tools.eval_lengths", "eval_lengths", ["lengths=[32,64]"]),
    "eval_stream": ("tools.eval_stream", "eval_stream", ["tokens=80"]),
    "export": ("tools.export", "export", []),
    "needle": ("tools.needle", "needle", []),
    "visualize": ("tools.visualize", "visualize", []),
    "sample": ("sample", "sample", ["max_new_tokens=4"]),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from train import train
    root = tmp_path_factory.mktemp("kinds")
    out = {}
    for kind, over in KINDS.items():
        train(compose_cfg("config", ["model=debug", "device=cpu", "compile=false", "train.max_iters=2",
                                     "train.eval_interval=2", "train.eval_iters=1", "logger.wandb.mode=disabled",
                                     "logger.plots=false", f"out_dir={root / kind}", f"data.cache_dir={root / 'cache'}",
                                     *over]))
        out[kind] = root / kind
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tool", list(TOOLS))
def test_each_tool_gives_a_result_or_one_line_of_its_own_keys_on_every_kind(tool, checkpoints, tmp_path):
    import importlib
    module, function, over = TOOLS[tool]
    run = getattr(importlib.import_module(module), function)
    outcomes = {}
    for kind, ckpt in checkpoints.items():
        prompt = "'k1 v9 k2 v17 k1'" if kind == "mqar" else "'the cat'"
        extra = [f"prompt={prompt}"] if tool == "visualize" or (tool == "sample" and kind == "mqar") else []
        out = [f"out={tmp_path / kind}"] if tool not in ("sample",) else []
        try:
            run(compose_cfg(tool, [f"ckpt={ckpt}", *([] if tool == "export" else ["device=cpu"]), *out, *over, *extra]))
            outcomes[kind] = "result"
        except UserError as e:
            line = str(e)
            assert "\n" not in line, (kind, line)
            assert not any(f"data.{k}" in line for k in ("path", "url", "hub")), (kind, line)
            outcomes[kind] = line
    # a tool refuses a kind only for a reason of that kind (needle: mqar checkpoints only)
    expected_results = {"mqar"} if tool == "needle" else set(KINDS)
    assert {k for k, v in outcomes.items() if v == "result"} == expected_results, outcomes


@pytest.mark.slow
def test_sample_options_without_effect_on_a_checkpoint_are_each_one_warning(checkpoints, caplog):
    """Options sample.py takes that cannot act on this checkpoint: warned by name, the samples still made."""
    from sample import sample
    cases = [("recurrent", "kv_dtype=int8"), ("recurrent", "kv_sinks=2"), ("recurrent", "select=moba"),
             ("softmax", "select_topk=3"), ("softmax", "select=oracle select_topk=1000")]
    for kind, options in cases:
        caplog.clear()
        texts = sample(compose_cfg("sample", [f"ckpt={checkpoints[kind]}", "device=cpu", "max_new_tokens=3",
                                              *options.split()]))
        assert len(texts) == 1
        key = options.split()[-1].split("=")[0]
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert any(w.startswith(f"{key}=") or f"select={options.split()[0].split('=')[1]}" in w for w in warned), \
            (options, warned)


# ----------------------------------------------------------------------------- options a kind cannot take, warned
# Tiny untrained checkpoints (no training run), so these are quick: a softmax model, a hybrid (a gdn layer beside a
# softmax one: some layer has softmax weights, a KV cache and RoPE) and a model of gdn and mamba2 layers only (no
# softmax weights, every layer a constant-size recurrent state, RoPE rotating nothing).

SMALL_KINDS = {"softmax": [], "hybrid": ["gdn", "softmax"], "recurrent": ["gdn", "mamba2"]}
IGNORED_ON = {"recurrent"}  # the kind none of the options below can act on; on the others each acts
OPTION_CASES = {  # case: (tool, the option's overrides, the keys each warned once, overrides that keep it short)
    "needle window": ("needle", ["window=4"], ["window"], ["needles=4", "distances=[4]", "out=null"]),
    "eval_stream sinks": ("eval_stream", ["sinks=2"], ["sinks"], ["tokens=40", "out=null"]),
    "eval_stream kv_dtypes": ("eval_stream", ["kv_dtypes=[float32,int8]"], ["kv_dtypes"],
                              ["tokens=40", "greedy=4", "out=null"]),
    "eval_stream policies": ("eval_stream", ["policies=[ring,sinks]"], ["policies"], ["tokens=40", "out=null"]),
    "eval_lengths rope_scaling": ("eval_lengths", ["rope_scaling=linear", "rope_scaling_factor=2"],
                                  ["rope_scaling", "rope_scaling_factor"], ["lengths=[16]", "tokens=64", "out=null"]),
    "sample rope_scaling": ("sample", ["rope_scaling=yarn", "rope_scaling_factor=2"],
                            ["rope_scaling", "rope_scaling_factor"], ["prompt=abc", "max_new_tokens=3"]),
    "bench_sample kv_dtypes": ("bench_sample", ["kv_dtypes=[float32]"], ["kv_dtypes"],
                               ["tokens=4", "batch_sizes=[1]", "compile=[false]", "recompute=false", "repeats=1"]),
}
RUNS = {"needle": ("tools.needle", "needle"), "eval_stream": ("tools.eval_stream", "eval_stream"),
        "eval_lengths": ("tools.eval_lengths", "eval_lengths"), "sample": ("sample", "sample"),
        "bench_sample": ("tools.bench_sample", "bench_sample")}


@pytest.fixture(scope="module")
def small_checkpoints(tmp_path_factory):
    """{kind: (a char checkpoint, an mqar checkpoint)} of each SMALL_KINDS model, and a text to stream."""
    from data.mqar import MQARTokenizer
    from helpers import save_tiny_checkpoint, variant_model, write_checkpoint
    root = tmp_path_factory.mktemp("small_kinds")
    out = {}
    for kind, layers in SMALL_KINDS.items():
        attn = {"layer_kinds": layers} if layers else {}
        mqar = write_checkpoint(root / f"mqar-{kind}" / "best.pt", variant_model(vocab=40, attn=attn),
                                tokenizer=MQARTokenizer(40), config={"data": {"name": "mqar", "pairs": [2]}})
        out[kind] = (save_tiny_checkpoint(root / kind, attn=attn), mqar)
    text = root / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)  # the tiny checkpoints' characters only
    return out, text


@pytest.mark.parametrize("kind", list(SMALL_KINDS))
@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_an_option_a_kind_cannot_take_is_one_warning_naming_its_key_and_none_where_it_acts(case, kind,
                                                                                           small_checkpoints, caplog):
    """Each tool's option on a kind it cannot act on (decided by the layers' flags and RoPE, not their names):
    the tool still gives its result, and logs exactly one line per key given, `key=value ... has no effect`;
    on a kind where the option acts, no such line."""
    import importlib
    import logging

    import torch
    tool, options, keys, short = OPTION_CASES[case]
    (char_ckpt, mqar_ckpt), text = small_checkpoints[0][kind], small_checkpoints[1]
    layers = SMALL_KINDS[kind]
    where = {"needle": [f"ckpt={mqar_ckpt}", "device=cpu"],
             "bench_sample": ["model=debug", "device=cpu"] + ([f"model.attn.layer_kinds=[{','.join(layers)}]"]
                                                              if layers else []),
             "sample": [f"ckpt={char_ckpt}", "device=cpu"]}.get(tool, [f"ckpt={char_ckpt}", "device=cpu",
                                                                      f"text={text}"])
    module, function = RUNS[tool]
    run = getattr(importlib.import_module(module), function)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="attnlab"), torch.random.fork_rng():
        result = run(compose_cfg(tool, [*where, *short, *options]))
    assert result is not None
    warned = [r.getMessage() for r in caplog.records if r.name == "attnlab" and r.levelname == "WARNING"]
    for key in keys:
        lines = [w for w in warned if w.startswith(f"{key}=")]
        if kind in IGNORED_ON:
            assert len(lines) == 1 and "has no effect on this" in lines[0] and "\n" not in lines[0], (key, warned)
        else:
            assert lines == [], (key, warned)


def test_what_an_ignored_option_would_have_changed_is_left_as_it_was(small_checkpoints, caplog):
    """Ignored means not applied: eval_lengths on the recurrent model reports no RoPE scaling, eval_stream
    compares no cache dtypes, and sample.py's text with rope_scaling is the text without it."""
    from sample import sample
    from tools.eval_lengths import eval_lengths
    from tools.eval_stream import eval_stream
    (ckpt, _), text = small_checkpoints[0]["recurrent"], small_checkpoints[1]
    r = eval_lengths(compose_cfg("eval_lengths", [f"ckpt={ckpt}", f"text={text}", "device=cpu", "lengths=[16]",
                                                  "tokens=64", "out=null", "rope_scaling=linear",
                                                  "rope_scaling_factor=2"]))
    assert r["rope_scaling"] == "none" and r["rope_scaling_factor"] == 1 and r["block_size"] == 16
    r = eval_stream(compose_cfg("eval_stream", [f"ckpt={ckpt}", f"text={text}", "device=cpu", "tokens=40", "out=null",
                                                "kv_dtypes=[float32,int8]", "sinks=40"]))  # past the cache: not refused
    assert "kv_dtypes" not in r and r["policies"]["sinks"]["losses"] == r["policies"]["ring"]["losses"]
    plain = sample(compose_cfg("sample", [f"ckpt={ckpt}", "device=cpu", "prompt=abc", "max_new_tokens=8"]))
    scaled = sample(compose_cfg("sample", [f"ckpt={ckpt}", "device=cpu", "prompt=abc", "max_new_tokens=8",
                                           "rope_scaling=yarn", "rope_scaling_factor=2"]))
    assert scaled == plain


@pytest.mark.parametrize("tool", ["sample", "eval_lengths"])
def test_rope_scaling_on_a_model_without_rope_is_refused_in_one_line(tool, tmp_path, small_checkpoints):
    """model.pos other than rope: there is no RoPE to stretch (lab/checkpoint.with_rope_scaling's refusal)."""
    from helpers import one_line, save_tiny_checkpoint
    module, function = RUNS[tool]
    import importlib
    run = getattr(importlib.import_module(module), function)
    ckpt = save_tiny_checkpoint(tmp_path, pos="learned")
    extra = ["prompt=abc"] if tool == "sample" else [f"text={small_checkpoints[1]}", "out=null", "lengths=[16]"]
    with pytest.raises(UserError, match="rope_scaling applies to RoPE models; this one has model.pos=learned") as e:
        run(compose_cfg(tool, [f"ckpt={ckpt}", "device=cpu", "rope_scaling=ntk", "rope_scaling_factor=2", *extra]))
    one_line(e)
