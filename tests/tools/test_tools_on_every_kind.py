"""Every looking-inside tool on a checkpoint of every kind (softmax, hybrid, recurrent, sparse, mqar):
a result, or one line that names the tool's own keys (never the training run's data.* keys, which a
tool does not take). Short real training runs; each tool called as its command calls it."""
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
