"""Generation past the cache: what each way of evicting the KV cache does to the next-token loss on
a long held-out text (many times block_size), token by token, as a model streams it.

    python tools/eval_stream.py ckpt=outputs/runs/X                        # the run's own val text
    python tools/eval_stream.py ckpt=outputs/runs/X text=book.txt tokens=4096 sinks=4 out=outputs/eval_stream/book.png

Policies (`policies=`), each with a cache of block_size positions:
- recompute: every token is predicted from the latest block_size tokens run afresh at positions
  0..block_size-1 (what sample.py kv_cache=false does);
- ring: the KV ring buffer sample.py uses (window only): the oldest key is overwritten, keys keep
  their RoPE positions;
- sinks: the first `sinks` tokens stay, the rest is a ring of the latest (StreamingLLM, Xiao et al.
  2023, arXiv 2309.17453; variants/sink_cache.py, positions given within the cache).
A model whose every layer keeps a constant-size recurrent state (linear, gdn, mamba2) has no KV cache:
ring and sinks stream that state alike, and sinks= and kv_dtypes= set are each a warning line, ignored.
A model trained with data.bos=true streams from its bos token, which ring and recompute drop once
the stream passes block_size and sinks keeps. StreamingLLM's claim: dropping the first tokens breaks
a model that parks attention on them (a "sink"), and keeping ~4 restores it. Prints the mean loss
before and past the cache length per policy, the model's measured sink mass (the attn_first of its
last probe, if logged), and plots the loss against the position.

With kv_dtypes=[float32,bfloat16,int8] the ring cache (sample.py's) also runs with each cache dtype
(int8: per-token, per-head scales): the cache's bytes, the largest and mean |logit - fp32 logit| over
the stream, the next-token loss, how often the most likely next token is the fp32 cache's (argmax
agreement), and greedy generation: `greedy` tokens at temperature 0 from the text's first
block_size/2 tokens with each cache, and the step at which it first differs from the fp32 cache's
(after that the two texts go their own ways, so only the first difference means anything).
"""
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, List, Optional

import hydra
import torch
import torch.nn.functional as F
from hydra.core.config_store import ConfigStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

from lab.checkpoint import find_checkpoint, load_checkpoint, model_from_checkpoint  # noqa: E402
from lab.cli import cli, run_app  # noqa: E402
from lab.device import pick_device  # noqa: E402
from files import check_output_file, default_output  # noqa: E402
from rules import POSITIVE, OneOf, Range, UserError, check_values, warn_ignored  # noqa: E402
from lab.heldout import stream_tokens  # noqa: E402
from lab.tracking import read_metrics  # noqa: E402
from data.tokenizer import tokenizer_from_dict  # noqa: E402
from lab.sampling import NO_CACHE, all_recurrent, layer_names, warn_no_effect  # noqa: E402

POLICIES = ("recompute", "ring", "sinks")
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}


@dataclass
class EvalStreamConfig:
    ckpt: Optional[str] = None  # checkpoint file or run dir; default: the newest run under outputs/
    text: Optional[str] = None  # a UTF-8 text file to stream; unset: the run's own val split
    tokens: int = 2048  # tokens streamed (at least a few block_sizes)
    policies: List[str] = field(default_factory=lambda: list(POLICIES))
    sinks: int = 4  # tokens the sinks policy keeps
    kv_dtypes: List[str] = field(default_factory=lambda: ["float32"])  # cache dtypes compared (float32 | bfloat16 | int8)
    greedy: int = 512  # tokens generated greedily with each cache dtype (with kv_dtypes beyond float32)
    device: str = "cpu"
    out: Optional[str] = default_output("eval_stream", "stream.png")  # the plot (a new dir per call); null: none

    RULES: ClassVar[dict] = {"tokens": Range(2), "policies": OneOf(POLICIES), "sinks": POSITIVE,
                             "kv_dtypes": OneOf(KV_DTYPES), "greedy": POSITIVE}


ConfigStore.instance().store(name="base_eval_stream", node=EvalStreamConfig)


@torch.no_grad()
def stream_logits(model, ids, policy: str, sinks: int = 4, dtype=None) -> torch.Tensor:
    """The logits predicting every position 1..n-1 of ids (n,) as the policy predicts them: (n - 1, V)."""
    L, n = model.config.block_size, ids.numel()
    if policy == "recompute":  # each position from the latest L tokens at positions 0..L-1
        logits = [model(ids[None, :t])[0, -1] for t in range(1, min(L, n))]  # the first block: growing contexts
        windows = ids.unfold(0, L, 1)[:max(0, n - L)]  # (n - L, L): the L tokens before each position t >= L
        for chunk in windows.split(256):
            logits.extend(model(chunk)[:, -1])
        return torch.stack(logits).float()
    cache = model.new_kv_cache(1, L, dtype=dtype, sinks=sinks if policy == "sinks" else 0)
    logits = [model(ids[None, :1], cache=cache, pos=0)[0, -1]]
    for t in range(1, n - 1):
        logits.append(model(ids[None, t:t + 1], cache=cache, pos=t)[0, -1])
    return torch.stack(logits).float()


def stream_losses(model, ids, policy: str, sinks: int = 4, dtype=None) -> torch.Tensor:
    """The next-token loss at every position 1..n-1 of ids (n,) as the policy predicts it: (n - 1,)."""
    return F.cross_entropy(stream_logits(model, ids, policy, sinks, dtype), ids[1:], reduction="none")


def compare_dtypes(model, ids, cfg, policy: str = "ring") -> dict:
    """Each cache dtype against the fp32 cache (the ring cache): bytes, logit error, loss, argmax
    agreement, and the first difference of cfg.greedy greedily generated tokens."""
    from sample import generate

    L = model.config.block_size
    sinks = 0
    ref = stream_logits(model, ids, policy, cfg.sinks, torch.float32)
    prompt = ids[None, :L // 2]
    ref_tokens = generate(model, prompt, cfg.greedy, temperature=0, kv_dtype=torch.float32, kv_sinks=sinks)[0, L // 2:]
    rows = {}
    for name in cfg.kv_dtypes:
        dtype = KV_DTYPES[name]
        logits = ref if dtype == torch.float32 else stream_logits(model, ids, policy, cfg.sinks, dtype)
        tokens = generate(model, prompt, cfg.greedy, temperature=0, kv_dtype=dtype, kv_sinks=sinks)[0, L // 2:]
        same = tokens == ref_tokens
        err = (logits - ref).abs()
        rows[name] = {"bytes": sum(c.nbytes() for c in model.new_kv_cache(1, L, dtype=dtype, sinks=sinks)),
                      "max_logit_error": err.max().item(), "mean_logit_error": err.mean().item(),
                      "loss": F.cross_entropy(logits, ids[1:]).item(),
                      "argmax_agreement": (logits.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                      "first_difference": None if same.all() else int((~same).nonzero()[0, 0])}
    return rows


def sink_mass(run_dir: Path):
    """The mean weight heads put on the first token at the run's last probe (attn_first), or None."""
    if not (run_dir / "metrics.jsonl").is_file():
        return None
    try:
        lines = read_metrics(run_dir)
    except UserError:  # a damaged log: the figure is an extra, the evaluation goes on
        return None
    probes = [m for m in lines if any(k.startswith("attn_first/L") for k in m)]
    if not probes:
        return None
    values = [v for k, v in probes[-1].items() if k.startswith("attn_first/L") and k.count("/") == 1]
    return sum(values) / len(values)


def warn_cache_settings(model, cfg):
    """The cache's settings, each set away from its default, warned in one line on a model whose every layer
    keeps a constant-size recurrent state (no KV cache): sinks and kv_dtypes are ignored, and the sinks
    policy streams the state as ring does."""
    defaults = EvalStreamConfig()
    warn_no_effect([(key, value) for key, value in (("sinks", cfg.sinks), ("kv_dtypes", list(cfg.kv_dtypes)))
                    if value != getattr(defaults, key)], model, NO_CACHE)
    if "sinks" in cfg.policies and list(cfg.policies) != defaults.policies:  # asked for by name
        warn_ignored([f"policies={list(cfg.policies)!r}: sinks has no effect on this checkpoint: its layers "
                      f"({layer_names(model)}) {NO_CACHE}, so sinks keeps nothing apart and streams as ring does"])


def eval_stream(cfg) -> dict:
    check_values(cfg)
    if cfg.out:
        check_output_file(cfg.out, "out")  # before any work
    path = find_checkpoint(cfg.ckpt)
    state = load_checkpoint(path)
    model = model_from_checkpoint(state, pick_device(cfg.device)).eval()
    L = model.config.block_size
    if not model.slides:
        raise UserError(f"model.pos={model.config.pos} has a position table of {L}: its cache cannot slide past it "
                        "(generation re-runs the last block), so there is nothing to evict")
    recurrent = all_recurrent(model)  # no KV cache: the cache's settings cannot act (ring and sinks stream alike)
    if recurrent:
        warn_cache_settings(model, cfg)
    elif cfg.sinks >= L:
        raise UserError(f"sinks={cfg.sinks} must be below the cache's length, block_size={L}")
    ids = stream_tokens(state, cfg, cfg.tokens).to(model.wte.weight.device)
    bos = getattr(tokenizer_from_dict(state["tokenizer"]), "bos", None)
    if bos is not None:  # trained with data.bos=true: the stream starts at bos, as every training window did
        ids = torch.cat([ids.new_tensor([bos]), ids[:-1]])
    result = {"ckpt": str(path), "block_size": L, "tokens": cfg.tokens, "sink_mass": sink_mass(path.parent),
              "policies": {}}
    mass = "-" if result["sink_mass"] is None else f"{result['sink_mass']:.3f}"
    print(f"{path}: block_size {L}, streaming {cfg.tokens} tokens; sink mass (attn_first at the last probe): {mass}")
    for policy in cfg.policies:
        losses = stream_losses(model, ids, policy, cfg.sinks).cpu()
        within, past = losses[:L - 1].mean().item(), losses[L - 1:].mean().item()
        result["policies"][policy] = {"within": within, "past": past, "losses": losses.tolist()}
        print(f"{policy:10s} mean loss within the cache {within:.4f}, past it {past:.4f} nats/token")
    if list(cfg.kv_dtypes) != ["float32"] and not recurrent:
        rows = result["kv_dtypes"] = compare_dtypes(model, ids, cfg)
        print(f"\nring cache by dtype, against fp32 ({cfg.tokens - 1} predictions; greedy: {cfg.greedy} tokens from "
              f"the first {L // 2})")
        for name, r in rows.items():
            first = "never" if r["first_difference"] is None else f"at token {r['first_difference']}"
            print(f"{name:9s} {r['bytes']:>10,d} B  |logit error| max {r['max_logit_error']:.4f} mean "
                  f"{r['mean_logit_error']:.5f}  loss {r['loss']:.4f}  argmax agreement {r['argmax_agreement']:.4f}  "
                  f"greedy text differs {first}")
    if cfg.out:
        plot(result, cfg.out)
        print(f"wrote {cfg.out}")
    return result


def plot(result, path):
    from lab.plots import plt, save_figure

    fig, ax = plt.subplots(figsize=(9, 5))
    for policy, r in result["policies"].items():
        losses = torch.tensor(r["losses"])
        w = 32  # a running mean over 32 positions
        smooth = losses.unfold(0, w, 1).mean(-1) if losses.numel() > w else losses
        ax.plot(range(w, w + smooth.numel()), smooth.tolist(), lw=1.2, label=f"{policy} (past the cache: {r['past']:.3f})")
    ax.axvline(result["block_size"], color="grey", ls=":", label="the cache is full (block_size)")
    ax.set(xlabel="position in the stream", ylabel="next-token loss (nats, running mean of 32)",
           title=f"streaming past the cache: {Path(result['ckpt']).parent.name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


@hydra.main(version_base="1.3", config_path="../configs", config_name="eval_stream")
@cli
def main(cfg):
    eval_stream(cfg)


if __name__ == "__main__":
    run_app(main)
