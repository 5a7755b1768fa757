"""The tools researchers point at an export read it (requirements-eval.txt): lm-evaluation-harness
runs its rolling log-likelihood on a stock and on a custom-code export with no extra flags and gets
attnlab's own bits per character; TransformerLens' bridge loads the default (GPT-NeoX) export and
the other stock ones, with tools/visualize.py's attention maps. The references are attnlab's own
figures (train.py's val/bpc_full, visualize.py's maps, model.py's log-probabilities), never the
export's. Marked slow: the two packages take ~15 s to import."""
import json
import re

import numpy as np
import pytest
import torch

from helpers import REPO, client, compose_cfg, export_chars, export_model, run_export, write_checkpoint
from data.tokenizer import tokenizer_from_dict
from lab.tracking import read_metrics
from train import train

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# ----------------------------------------------------------------------------- lm-evaluation-harness

LINE = 48  # characters per line of the corpus, its leading newline included
LINES = 300  # a multiple of 10: the val split (the last 10%) then starts with a line's newline


def write_corpus(path):
    """Lines "\\n" + 47 characters, varied enough to learn something in a few steps."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "cat", "sat", "mat"]
    lines = []
    for i in range(LINES):
        text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12))
        lines.append(("\n" + f"{i % 97:02d} {text}")[:LINE].ljust(LINE, "."))
    path.write_text("".join(lines), encoding="utf-8")
    return path


def local_task(task_dir, text: str):
    """docs/export.md's local task (its yaml block, data path made absolute) over one JSON-lines
    document holding `text`: what the page tells users to run is what this runs."""
    task_dir.mkdir()
    (task_dir / "text.jsonl").write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
    page = (REPO / "docs" / "export.md").read_text(encoding="utf-8")
    yaml = re.search(r"```yaml\n# local_text.yaml\n(.*?)```", page, re.S).group(1)
    assert "test: text.jsonl" in yaml
    (task_dir / "local_text.yaml").write_text(yaml.replace("test: text.jsonl", f"test: {task_dir / 'text.jsonl'}"),
                                              encoding="utf-8")
    return task_dir


def harness_bits_per_byte(export_dir, task_dir, code: bool) -> float:
    """`lm_eval --model hf --model_args pretrained=DIR[,trust_remote_code=True]` through its Python
    API: nothing else passed (no prefix_token_id, no max_length)."""
    lm_eval = client("lm_eval")
    from lm_eval.tasks import TaskManager

    args = f"pretrained={export_dir}" + (",trust_remote_code=True" if code else "")
    out = lm_eval.simple_evaluate(model="hf", model_args=args, tasks=["local_text"], device="cpu", batch_size=1,
                                  task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                                  bootstrap_iters=0, log_samples=False)
    return out["results"]["local_text"]["bits_per_byte,none"]


@pytest.mark.parametrize("name,overrides", [
    ("default", []),  # GPT-NeoX (stock)
    ("post_norm", ["model.norm_position=post", "model.attn.qk_norm=true", "model.attn.qk_norm_gain=channel"]),  # code
])
def test_lm_eval_bits_per_byte_equals_attnlab_val_bpc(name, overrides, train_cfg, tmp_path):
    """A model trained for a few steps; lm-eval's bits_per_byte of its val split's text equals the
    run's own val/bpc_full. The windows are the same tokens on both sides: attnlab's whole-val loss
    reads windows val[kT : kT+T] and predicts val[kT+1 : kT+T+1]; the harness predicts a text's
    first token after the BOS (a newline for a char vocabulary), then windows of T with one token
    of context before. With val[0] a newline and the text val[1 : nT+1], both predict the same
    tokens from the same contexts."""
    cfg = train_cfg("data=text", f"data.path={write_corpus(tmp_path / 'corpus.txt')}", "train.max_iters=30",
                    "train.eval_interval=30", "train.warmup_iters=0", *overrides)
    result = train(cfg)
    bpc = next(m["val/bpc_full"] for m in read_metrics(result["out_dir"]) if "val/bpc_full" in m)
    out = run_export(result["ckpt"], tmp_path / "hf")  # the final weights, which val/bpc_full measured
    code = "auto_map" in json.loads((out / "config.json").read_text())
    assert code == (name == "post_norm")

    data = next((tmp_path / "cache").glob("*/meta.json")).parent
    meta = json.loads((data / "meta.json").read_text())
    val = np.fromfile(data / "val.bin", dtype=meta["dtype"]).astype(np.int64)
    tok = tokenizer_from_dict(meta["tokenizer"])
    T = cfg.model.block_size
    n = (len(val) - 1) // T
    assert tok.decode(val[:1]) == "\n", "the val split should start with a newline"
    text = tok.decode(val[1:n * T + 1])
    bpb = harness_bits_per_byte(out, local_task(tmp_path / "task", text), code)
    print(f"{name}: lm-eval bits_per_byte {bpb:.6f}, attnlab val/bpc_full {bpc:.6f}, relative difference "
          f"{abs(bpb - bpc) / bpc:.1e} ({n * T} characters)")
    assert bpb == pytest.approx(bpc, rel=1e-4), f"lm-eval {bpb:.5f} vs attnlab {bpc:.5f}"  # within 1%


# ----------------------------------------------------------------------------- TransformerLens

PROMPT = "the cat sat on the mat. the cat"
STOCK = {
    "default": {},  # GPT-NeoX: no biases in attnlab, zeros written for TransformerLens' adapter
    "llama_gqa": dict(norm="rmsnorm", mlp="swiglu", n_kv_head=2, tie_embeddings=False),
    "qwen3_qk_norm": dict(norm="rmsnorm", mlp="swiglu", n_kv_head=2, attn={"qk_norm": True, "scale": "0.5"}),
    "gpt2_learned": dict(pos="learned"),
}


def boot(export_dir, **kw):
    bridge_module = client("transformer_lens.model_bridge")
    bridge = bridge_module.TransformerBridge.boot_transformers(str(export_dir), device="cpu", **kw)
    bridge.enable_compatibility_mode()
    return bridge


@pytest.mark.parametrize("name", list(STOCK))
def test_transformer_lens_patterns_equal_visualize_maps(name, tmp_path):
    """TransformerLens' hook_pattern of every layer and head equals tools/visualize.py's map for
    the same prompt; its log-probabilities equal attnlab's (compatibility mode centres the
    unembedding, so raw logits differ by a constant per position)."""
    from tools.visualize import visualize

    model = export_model(**STOCK[name])
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", model)
    out = run_export(ckpt, tmp_path / "hf", "format=stock")
    views = visualize(compose_cfg("visualize", [f"ckpt={ckpt}", f"prompt='{PROMPT}'", f"out={tmp_path / 'maps'}"]),
                      out=open(tmp_path / "top_keys.txt", "w"))
    ids = torch.tensor([export_chars().encode(PROMPT).tolist()])
    logits, cache = boot(out).run_with_cache(ids)
    patterns = torch.stack([cache[f"blocks.{layer}.attn.hook_pattern"][0] for layer in range(model.config.n_layer)])
    maps = views["maps"]  # (L, nh, T, T)
    assert patterns.shape == maps.shape
    d = (patterns - maps).abs()
    print(f"{name}: TransformerLens patterns vs visualize.py maps: max {d.max():.1e}, mean {d.mean():.1e}")
    assert d.max() < 1e-5, f"{name}: patterns differ by up to {d.max():.2e} (mean {d.mean():.2e})"
    with torch.no_grad():
        want = model(ids).log_softmax(-1)
    assert (logits.log_softmax(-1) - want).abs().max() < 1e-4


def test_a_head_ablated_through_transformer_lens_hooks_costs_what_ablate_py_measures(tmp_path):
    """The same hook names mean the same tensors: TransformerLens' blocks.{l}.attn.hook_z on the
    export equals attnlab's at that name, and zeroing one head there changes the loss by what
    tools/ablate.py's Ablation measures on attnlab's model (every head of a 2-layer model)."""
    import torch.nn.functional as F

    from lab.interventions import Ablation

    model = export_model()  # 2 layers of 4 heads
    out = run_export(write_checkpoint(tmp_path / "ckpt.pt", model), tmp_path / "hf", "format=stock")
    bridge = boot(out)
    ids = torch.tensor([export_chars().encode(PROMPT * 2).tolist()])
    x, y = ids[:, :-1], ids[:, 1:]
    loss = lambda logits: F.cross_entropy(logits[0].float(), y[0]).item()  # noqa: E731
    zs, modules = {}, dict(model.named_modules())
    handles = [modules[f"blocks.{l}.attn.hook_z"].register_forward_hook(lambda m, a, z, l=l: zs.__setitem__(l, z))
               for l in range(2)]
    with torch.no_grad():
        base = loss(model(x))
    for h in handles:
        h.remove()
    _, cache = bridge.run_with_cache(x)
    for l in range(2):
        assert (cache[f"blocks.{l}.attn.hook_z"] - zs[l]).abs().max() < 1e-5
    tl_base = loss(bridge(x))
    assert tl_base == pytest.approx(base, abs=1e-5)
    for l in range(2):
        for h in range(model.config.n_head):
            def zero(z, hook, h=h):
                z[:, :, h] = 0.0
                return z
            tl = loss(bridge.run_with_hooks(x, fwd_hooks=[(f"blocks.{l}.attn.hook_z", zero)])) - tl_base
            with Ablation(model, [(l, h)]), torch.no_grad():
                ours = loss(model(x)) - base
            assert tl == pytest.approx(ours, abs=2e-5), f"L{l}H{h}: TransformerLens {tl:+.6f}, attnlab {ours:+.6f}"


def test_transformer_lens_reads_a_bos_model_from_its_own_tokens(tmp_path):
    """data.bos=true: TransformerLens' to_tokens(prepend_bos=True) puts the bos token first, once (its
    default for this architecture is without), and its patterns over those tokens equal
    tools/visualize.py's maps (which start at bos too)."""
    from data.tokenizer import WithBos
    from tools.visualize import visualize

    tok = WithBos(export_chars())
    model = export_model(bos=True)
    ckpt = write_checkpoint(tmp_path / "ckpt.pt", model, tokenizer=tok)
    out = run_export(ckpt, tmp_path / "hf", "format=stock")
    views = visualize(compose_cfg("visualize", [f"ckpt={ckpt}", f"prompt='{PROMPT}'", f"out={tmp_path / 'maps'}"]),
                      out=open(tmp_path / "top_keys.txt", "w"))
    bridge = boot(out)
    ids = bridge.to_tokens(PROMPT, prepend_bos=True)
    assert ids[0].tolist() == [tok.bos, *export_chars().encode(PROMPT).tolist()]
    _, cache = bridge.run_with_cache(ids)
    patterns = torch.stack([cache[f"blocks.{layer}.attn.hook_pattern"][0] for layer in range(model.config.n_layer)])
    assert (patterns - views["maps"]).abs().max() < 1e-5


def test_transformer_lens_cannot_load_custom_code(tmp_path):
    """TransformerLens' bridge maps each architecture it supports (config.json's architectures)
    through an adapter of its own, and has none for attnlab's custom code: docs/export.md says so.
    If a release adds a way, this fails and the docs change."""
    out = run_export(write_checkpoint(tmp_path / "ckpt.pt", export_model(norm_position="post")), tmp_path / "hf")
    with pytest.raises(ValueError, match="Could not determine supported architecture"):
        boot(out, trust_remote_code=True)

