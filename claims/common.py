"""What the claims' checks share: the registry (@claim, CLAIMS, Result), measuring FLOPs and tensors,
small models, and the training runs the trained checks use (trained on first use). The checks are in
a.py, b.py and c.py, one file per text; claims/__init__.py runs them and writes their tables."""
import math
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

import variants
from lab.attnstats import attention_stats, layer_scores, reading_qk
from model import GPT, GPTConfig
from rules import UserError

REPO = Path(__file__).resolve().parents[1]
STATUSES = {  # status -> how a row shows it
    "holds": "holds", "fails": "FAILS", "partial": "holds in part", "not_shown": "not shown at this size",
    "not_yet": "not checkable yet", "skipped": "skipped (--quick)"}
IMPLS = tuple(variants.PATHS)  # sdpa, reference, tiled


@dataclass
class Result:
    status: str  # a key of STATUSES
    measured: str  # what attnlab measured, in words with its figures
    tolerance: str = ""  # what "holds" requires
    note: str = ""  # where attnlab's figure differs from the text's, and why; what is missing
    figures: dict = field(default_factory=dict)  # the numbers, for JSON
    rounded: dict = field(default_factory=dict)  # of a random check: what another seed must reproduce


@dataclass
class Claim:
    id: str
    says: str  # what the text says, with its figures (our words), one line
    zh: str  # the same in Chinese (the texts' language; our own wording)
    check: Callable  # check(ctx) -> Result
    trains: bool  # needs trained models for (part of) its verdict
    tests: tuple  # tests that check the same thing, "file::name"


CLAIMS: list = []


def claim(id: str, says: str, zh: str, trains: bool = False, tests: tuple = ()):
    """Register a check: a function of the Context that returns a Result."""
    def register(fn):
        CLAIMS.append(Claim(id, says, zh, fn, trains, tests))
        return fn
    return register


def verdict(ok: bool) -> str:
    return "holds" if ok else "fails"


# ----------------------------------------------------------------------------- measuring

def flops(fn) -> int:
    """FLOPs of the matrix products fn() runs (torch's FlopCounterMode; elementwise ops not counted)."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


class LargestTensor(TorchDispatchMode):
    """The most elements any op's output had while the block ran (forward and backward ops alike)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def rand(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=dtype)


def small_model(n_layer=2, n_head=4, n_embd=32, vocab=40, block_size=64, **kw) -> GPT:
    """A small GPT (GPTConfig fields as keywords) with trained-looking weights: matrices ~ N(0, 0.3),
    norm weights and gains in [0.5, 1.5], in eval mode. Seeded by the caller (torch.manual_seed)."""
    model = GPT(GPTConfig(vocab_size=vocab, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                          **kw))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() >= 2 else p.uniform_(0.5, 1.5)
    return model.eval()


def max_logit(model, idx) -> float:
    """The largest scaled logit q·k·scale any query gives a visible key, over every layer and head."""
    found = []

    def read(layer, attn, q, k):
        found.append(attention_stats(layer_scores(attn, q, k), q.size(1))["logit_max"].max().item())
    with torch.no_grad(), reading_qk(model, read):
        model(idx)
    return max(found)


def compose(overrides) -> object:
    """train.py's config with overrides, composed by Hydra as train.py composes it."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from lab import config  # noqa: F401  (registers the schema)

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def preset(name: str) -> GPTConfig:
    """The GPTConfig of a model preset (configs/model/NAME.yaml)."""
    from lab.config import model_config
    return model_config(compose([f"model={name}"]).model)


def power10(n: int) -> str:
    """10**k as the texts write it (10⁴); other numbers as they are."""
    k = round(math.log10(n))
    return f"10{str(k).translate(str.maketrans('0123456789', '⁰¹²³⁴⁵⁶⁷⁸⁹'))}" if 10 ** k == n and k > 2 else f"{n:,}"


def fmt(x, digits=2) -> str:
    return f"{x:.{digits}f}"


def slash(xs, digits=2) -> str:
    return " / ".join(fmt(x, digits) for x in xs)


# ----------------------------------------------------------------------------- trained models

# The training runs the trained checks share, as train.py overrides on the embedded corpus (python_docs):
# at CPU size, a few hundred steps each. Every run is train.train with a composed config.
COMMON = ["device=cpu", "logger.wandb.mode=disabled", "model.block_size=64", "train.eval_iters=5",
          "train.log_interval=50", "train.final_eval_tokens=0"]
ONE_WIDE_HEAD = ["model.n_layer=2", "model.n_head=1", "model.n_embd=128", "train.batch_size=12",  # d_k = 128
                 "train.max_iters=300", "train.lr=1e-3", "train.min_lr=1e-4", "train.warmup_iters=30",
                 "train.eval_interval=300", "train.log_attn_interval=25"]
DEEP = ["model.n_layer=12", "model.n_head=2", "model.n_embd=64", "train.batch_size=8", "train.max_iters=200",
        "train.lr=2e-3", "train.min_lr=2e-4", "train.warmup_iters=0", "train.eval_interval=200",
        "train.log_attn_interval=0", "train.final_eval_tokens=100000"]  # the whole val split at the end
ONE_LAYER = ["model.n_layer=1", "model.n_head=2", "model.n_embd=64", "train.batch_size=12", "train.max_iters=150",
             "train.warmup_iters=20", "train.eval_interval=150", "train.log_attn_interval=0"]
RECALL = ["experiment=recall_cpu", "data.pairs=[8]", "train.max_iters=1000", "train.eval_interval=500"]  # docs/hybrids.md, one arm each
TRAINING_RUNS = {
    "scaled": ONE_WIDE_HEAD,  # 1/sqrt(d_k), no QK-Norm: attnlab's default attention
    "unscaled": ONE_WIDE_HEAD + ["model.attn.scale=none"],
    "qk_norm": ONE_WIDE_HEAD + ["model.attn.qk_norm=true"],
    "scaled_lr3e-2": ONE_WIDE_HEAD + ["train.lr=3e-2", "train.min_lr=3e-3"],  # where the logits run away (A5)
    "qk_norm_lr3e-2": ONE_WIDE_HEAD + ["train.lr=3e-2", "train.min_lr=3e-3", "model.attn.qk_norm=true"],
    "pre_ln": DEEP,
    "post_ln": DEEP + ["model.norm_position=post"],
    "nope": ONE_LAYER + ["model.pos=none"],
    "rope": ONE_LAYER,
    "alibi": ONE_WIDE_HEAD + ["model.pos=alibi"],
    "recall_linear": RECALL + ["model.attn.layer_kinds=[linear]"],
    "recall_hybrid": RECALL + ["model.attn.layer_kinds=[linear,softmax]"],
}


@dataclass
class Trained:
    name: str
    result: Optional[dict]  # train.train's summary (attn: the probes), None if it stopped with an error
    error: Optional[str] = None
    cfg: object = None

    def model(self) -> GPT:
        from lab.checkpoint import load_checkpoint, model_from_checkpoint
        return model_from_checkpoint(load_checkpoint(self.result["ckpt"])).eval()

    def val_tokens(self):
        """The run's val split as one int64 tensor."""
        from data.loader import TokenData
        from data.prepare import prepare
        data = TokenData(prepare(self.cfg.data))
        return torch.from_numpy(data.splits["val"][:].astype("int64"))


class Context:
    """What a check may use: its seeded generator, whether training is allowed, the trained runs."""

    def __init__(self, seed: int = 0, quick: bool = False, out: Optional[Path] = None, log=None):
        self.seed, self.quick, self.out = seed, quick, out
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.runs: dict = {}
        self.claim_id = ""

    def gen(self) -> torch.Generator:
        """This claim's own random stream: the same figures whatever else runs."""
        return torch.Generator().manual_seed(self.seed * 100003 + zlib.crc32(self.claim_id.encode()))

    def trained(self, name: str) -> Trained:
        """The training run `name` of TRAINING_RUNS, trained on first use (train.train) and kept."""
        if name in self.runs:
            return self.runs[name]
        import logging
        from train import train
        if self.out is None:
            raise UserError("the trained checks write runs: pass --out DIR")
        run_dir = self.out / "runs" / name
        if run_dir.exists():
            raise UserError(f"{run_dir} exists: give another --out (the runs are not reused)")
        overrides = COMMON + TRAINING_RUNS[name] + [f"out_dir={run_dir}"]
        cfg = compose(overrides)
        self.log(f"  training '{name}' ({cfg.model.n_layer} layers x {cfg.model.n_embd} wide, "
                 f"{cfg.train.max_iters} steps) into {run_dir} ...")
        t0 = time.perf_counter()
        logging.getLogger("attnlab").setLevel(logging.WARNING)
        try:
            run = Trained(name, train(cfg), cfg=cfg)
        except UserError as e:  # a run that diverges (non-finite loss) is a result, not a crash
            run = Trained(name, None, error=str(e), cfg=cfg)
        self.log(f"  ... '{name}' done in {time.perf_counter() - t0:.0f} s")
        self.runs[name] = run
        return run


def probes(run: Trained, key: str) -> tuple:
    """(steps, values) of a probed statistic over a trained run (`key` as in metrics.jsonl)."""
    rows = [a for a in run.result["attn"] if key in a]
    return [a["step"] for a in rows], [a[key] for a in rows]


def layer_max(run: Trained, stat: str = "logit_max") -> tuple:
    """(steps, the largest value over the layers) of a per-layer statistic."""
    rows = run.result["attn"]
    layers = sorted({k for a in rows for k in a if k.startswith(f"attn_{stat}/L")})
    return [a["step"] for a in rows], [max(a[k] for k in layers) for a in rows]


def stability_figures() -> dict:
    """The lr sweeps' figures docs/stability.md and docs/practice.md quote (docs/stability.json and
    docs/practice.json, written with the pages by scripts/stability_page.py and scripts/practice_page.py from
    their run dirs); a file missing or unreadable adds nothing."""
    import json
    found = {}
    for name in ("stability.json", "practice.json"):
        try:
            found.update(json.loads((REPO / "docs" / name).read_text()))
        except (OSError, ValueError):
            pass
    return found


def skipped(what: str) -> Result:
    return Result("skipped", f"needs {what}: run without --quick")
