"""The teaching texts' claims as checks (tools/claims.py is the command; its docstring says what a row
shows): the registry (@claim, CLAIMS, Result), what checks share (measuring FLOPs and tensors, small
models, the training runs the trained checks use, trained on first use), running them (run_claims) and
their tables (text, markdown) and figures. The checks themselves are in a.py, b.py and c.py, one file per
text, imported at the end so that CLAIMS lists them in order: A1-A11, B1-B4, C1-C12."""
import math
import sys
import textwrap
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
from attnstats import attention_stats, layer_scores, logit_bound, reading_qk
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
    import config  # noqa: F401  (registers the schema)

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


def preset(name: str) -> GPTConfig:
    """The GPTConfig of a model preset (configs/model/NAME.yaml)."""
    from config import model_config
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
        from checkpoint import load_checkpoint, model_from_checkpoint
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


def skipped(what: str) -> Result:
    return Result("skipped", f"needs {what}: run without --quick")


# ----------------------------------------------------------------------------- running and reporting

def run_claims(quick: bool = False, seed: int = 0, out=None, only=None, log=None) -> list:
    """Run the checks (those in `only`, else all) and return one dict per claim, in CLAIMS order."""
    wanted = [c for c in CLAIMS if only is None or c.id in only]
    unknown = set(only or ()) - {c.id for c in CLAIMS}
    if unknown:
        raise UserError(f"--only {','.join(sorted(unknown))}: no such claim (ids: {', '.join(c.id for c in CLAIMS)})")
    ctx = Context(seed, quick, Path(out) if out else None, log)
    rows = []
    with torch.random.fork_rng():
        for c in wanted:
            ctx.claim_id = c.id
            t0 = time.perf_counter()
            r = c.check(ctx)
            rows.append({"id": c.id, "says": c.says, "zh": c.zh, "status": r.status, "verdict": STATUSES[r.status],
                         "measured": r.measured, "tolerance": r.tolerance, "note": r.note, "figures": r.figures,
                         "rounded": r.rounded, "trains": c.trains, "seconds": time.perf_counter() - t0,
                         "command": f"python tools/claims.py --only {c.id}", "tests": list(c.tests)})
    if not quick and out is not None and {"scaled", "unscaled", "qk_norm"} & ctx.runs.keys():
        for path in write_figures(ctx.runs, Path(out)):
            ctx.log(f"wrote {path}")
    return rows


def write_figures(runs: dict, out: Path) -> list:
    """The trained checks' figures: attention entropy with and without 1/√d_k (A4), and the largest
    logit with and without QK-Norm against QK-Norm's bound (A5)."""
    from plots import plt, save_figure
    written = []
    if "scaled" in runs and "unscaled" in runs:
        fig, (ex, px) = plt.subplots(1, 2, figsize=(11, 4))
        for name, label, color in (("scaled", "scale 1/√d_k", "C0"), ("unscaled", "no scale", "C3")):
            ex.plot(*probes(runs[name], "attn_entropy/mean"), "o-", color=color, label=label, ms=3)
            px.plot(*probes(runs[name], "attn_peak/mean"), "o-", color=color, label=label, ms=3)
        ex.set(xlabel="step", ylabel="mean attention entropy (nats)", title="entropy collapses without 1/√d_k")
        px.set(xlabel="step", ylabel="mean peak weight", title="the largest weight → 1 (saturation)")
        for ax in (ex, px):
            ax.grid(alpha=0.3)
            ax.legend()
        m = runs["scaled"].cfg.model
        fig.suptitle(f"{m.n_layer} layers of {m.n_head} head(s), d_k = {m.n_embd // m.n_head}, "
                     f"{runs['scaled'].cfg.data.name} (tools/claims.py, A4)", fontsize=9)
        written.append(save_figure(fig, out / "claims_entropy.png"))
    if "scaled" in runs and "qk_norm" in runs:
        fig, ax = plt.subplots(figsize=(7, 4))
        bound = logit_bound(runs["qk_norm"].model().blocks[0].attn)
        for name, label, color in (("scaled", "1/√d_k only", "C0"), ("qk_norm", "1/√d_k + QK-Norm (rms)", "C2")):
            ax.plot(*layer_max(runs[name]), "o-", color=color, label=label, ms=3)
        ax.axhline(bound, color="C2", ls="--", lw=1, label=f"QK-Norm's bound √d_k = {bound:.2f}")
        ax.set(xlabel="step", ylabel="largest logit q·k·scale (any layer)",
               title="QK-Norm holds the logits under its bound (tools/claims.py, A5)")
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(save_figure(fig, out / "claims_qk_norm.png"))
    return written


COLUMNS = (("claim", 5), ("verdict", 13), ("the text says", 44), ("attnlab measured (holds if ...)", 62))


def text_table(rows) -> str:
    """The table as the command prints it: one row per claim, its cells wrapped in fixed columns."""
    def line(cells):
        return "  ".join(c.ljust(w) for c, (_, w) in zip(cells, COLUMNS)).rstrip()
    out = [line([name for name, _ in COLUMNS]), line(["-" * w for _, w in COLUMNS])]
    for r in rows:
        measured = r["measured"] + (f" (holds if {r['tolerance']})" if r["tolerance"] else "") \
            + (f". Note: {r['note']}" if r["note"] else "")
        cells = [textwrap.wrap(text, w) or [""] for text, (_, w) in
                 zip((r["id"], r["verdict"], r["says"], measured), COLUMNS)]
        for i in range(max(map(len, cells))):
            out.append(line([c[i] if i < len(c) else "" for c in cells]))
        out.append("")
    return "\n".join(out) + summary(rows)


PLURAL = {"holds": "hold", "fails": "FAIL", "partial": "hold in part"}  # "23 claims: 21 hold, ..."


def summary(rows) -> str:
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    parts = [f"{n} {(PLURAL.get(s) if n > 1 else None) or STATUSES[s]}" for s, n in counts.items() if n]
    return f"{len(rows)} claims: " + ", ".join(parts) + f"; {sum(r['seconds'] for r in rows):.1f} s"


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown_table(rows) -> str:
    """The table of docs/claims.md: each claim in English and in Chinese, what attnlab measured, the
    verdict, and the command and tests that check it."""
    out = ["| id | the claim (English) | 论断（中文） | attnlab measured | verdict | checked by |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        measured = r["measured"] + (f" *(holds if {r['tolerance']})*" if r["tolerance"] else "") \
            + (f" **Note:** {r['note']}" if r["note"] else "")
        checked = f"`{r['command']}`" + "".join(f"<br>`{t}`" for t in r["tests"])
        out.append(f"| {r['id']} | {cell(r['says'])} | {cell(r['zh'])} | {cell(measured)} | "
                   f"**{r['verdict']}** | {checked} |")
    return "\n".join(out)


import claims.a  # noqa: E402,F401  (each registers its checks in CLAIMS, text by text)
import claims.b  # noqa: E402,F401
import claims.c  # noqa: E402,F401
