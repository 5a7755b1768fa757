"""The teaching texts' claims, checked on this machine through attnlab's own code.

    python tools/claims.py --quick                 # every claim in seconds; the trained checks skipped
    python tools/claims.py                         # and the trained checks at CPU size: a few minutes
    python tools/claims.py --only A2,A3 --seed 1   # some claims; another seed, other digits, same rounded figures
    python tools/claims.py --format json --json claims.json   # JSON on stdout and in a file
    python tools/claims.py --format markdown       # the table of docs/claims.md

attnlab is built from three teaching texts on attention (A, B, C; docs/claims.md lists, in our words,
what they claim that a program can check). Each claim here is one small function that
measures its figure at run time, through the code the texts describe in attnlab: the attention
function (its sdpa, reference and tiled paths), the model, counting.py's counts, the KV caches, linear
attention, and small models trained by train.train on the embedded corpus. A row prints what the text
says with its figure, what attnlab measured, what "holds" requires (the tolerance), and the verdict:
holds, FAILS, holds in part (the rest not in attnlab yet), not shown at this size (a trained check
whose effect the small model does not show), not checkable yet, or skipped (--quick: it needs training).
Nothing is a stored number: a change that breaks a claim fails its row, and the exit status is 1.

Random measurements take --seed; each claim draws from its own generator (seed and claim id), so
--only gives the same figures as the whole run. The training runs use train.py's own seed (1337):
their figures are the same on every run of the same code on the same kind of machine. --out DIR
receives the training runs, the figures (claims_entropy.png, claims_qk_norm.png), claims.json and
claims.md. Adding a claim is one function under @claim; tests/test_claims.py holds every id of
CLAIMS.md to exactly one row.
"""
import argparse
import dataclasses
import json
import math
import sys
import textwrap
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as tools/X.py: the repo's modules

import attention as attn_lib  # noqa: E402  (called through the modules: a test may break one of their functions)
import variants  # noqa: E402
from attnstats import attention_maps, attention_stats, layer_scores, reading_qk  # noqa: E402
from cli import cli  # noqa: E402
from rules import UserError  # noqa: E402
from counting import (attention_variants, count_params, crossovers, kv_cache_bytes, macs_per_token,  # noqa: E402
                      memory_breakdown, selected_keys)
from model import GPT, GPTConfig  # noqa: E402
from benchmarks import saved_bytes  # noqa: E402

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
    overrides: list
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
            run = Trained(name, overrides, train(cfg), cfg=cfg)
        except UserError as e:  # a run that diverges (non-finite loss) is a result, not a crash
            run = Trained(name, overrides, None, error=str(e), cfg=cfg)
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


# ----------------------------------------------------------------------------- text A: Q/K/V, √d_k, the N² accounts

@claim("A1", "Attention is five steps: scores QKᵀ, scale by 1/√d_k, add the mask M, softmax, weighted sum of V.",
       "注意力分五步：QKᵀ 打分，乘以 1/√d_k 缩放，加上掩码 M，做 softmax，再对 V 加权求和。",
       tests=("tests/test_model.py::test_reference_path_equals_hand_written_softmax",
              "tests/test_model.py::test_fast_path_equals_reference"))
def check_a1(ctx):
    gen, d, T = ctx.gen(), 16, 9
    q, k, v = (rand(gen, 2, 3, T, d) for _ in range(3))
    scores = q @ k.transpose(-2, -1)  # 1. scores
    scaled = scores / math.sqrt(d)  # 2. scale
    mask = torch.full((T, T), -math.inf, dtype=scores.dtype).triu(1)  # 3. M: 0 on and below the diagonal
    weights = torch.softmax(scaled + mask, dim=-1)  # 4. softmax
    five = weights @ v  # 5. weighted sum of V
    scale = attn_lib.resolve_scale("sqrt_dk", d)
    diffs = {impl: max_diff(variants.attention(q, k, v, scale, impl=impl), five) for impl in IMPLS}
    return Result(verdict(max(diffs.values()) <= 1e-10),
                  "the five steps written out in float64 vs attention(): max |diff| "
                  + ", ".join(f"{impl} {d_:.0e}" for impl, d_ in diffs.items()),
                  "every path within 1e-10 of the five steps", figures={"max_diff": diffs})


@claim("A2", "Var(q·k) = d_k for q, k with independent mean-0 variance-1 components: over 8192 random pairs "
             "std ≈ 2.8 / 11.3 / 32.4 at d_k = 8 / 128 / 1024.",
       "q、k 各分量独立、均值 0、方差 1 时 Var(q·k) = d_k：8192 对随机向量下，d_k = 8 / 128 / 1024 的标准差约为 "
       "2.8 / 11.3 / 32.4。",
       tests=("tests/test_attention_options.py::test_raw_score_variance_is_dk_and_sqrt_dk_scaling_makes_it_one",))
def check_a2(ctx):
    gen, n = ctx.gen(), 8192
    stds, ratios, scaled = [], [], []
    for d in (8, 128, 1024):
        q, k = rand(gen, n, 1, 1, d), rand(gen, n, 1, 1, d)  # 8192 pairs, one score each
        raw = attn_lib.attention_scores(q, k, scale=attn_lib.resolve_scale("none", d)).flatten()
        stds.append(raw.std().item())
        ratios.append(raw.var().item() / d)
        scaled.append(attn_lib.attention_scores(q, k, scale=attn_lib.resolve_scale("sqrt_dk", d)).var().item())
    roots = [math.sqrt(d) for d in (8, 128, 1024)]
    ok = all(abs(s / r - 1) <= 0.05 for s, r in zip(stds, roots)) and all(abs(v - 1) <= 0.1 for v in scaled)
    spread = math.sqrt((2 + 6 / 1024) / (4 * n))  # relative sd of a sample std of q·k (kurtosis 3 + 6/d_k)
    return Result(verdict(ok),
                  f"std {slash(stds)} (√d_k = {slash(roots)}); Var/d_k {slash(ratios)}; "
                  f"after ×1/√d_k Var {slash(scaled)}",
                  "std within 5% of √d_k at each d_k; Var within 10% of 1 after the scale",
                  note=f"the text's 32.4 is {100 * (32.4 / 32 - 1):.1f}% above √1024 = 32: one draw of {n} pairs "
                       f"varies by ±{100 * spread:.1f}% (1 sd), so it is such a draw",
                  figures={"std": stds, "var_over_dk": ratios, "scaled_var": scaled},
                  rounded={"var_over_dk": [round(r, 1) for r in ratios], "scaled_var": [round(v, 1) for v in scaled]})


def six_score_rows(gen, n=8192, d=128):
    """q (n, 1, 1, d) and k (n, 1, 6, d) of random unit-variance vectors: n rows of 6 scores whose
    spread is that of d_k = d (std √d)."""
    return rand(gen, n, 1, 1, d), rand(gen, n, 1, 6, d)


@claim("A3", "Rows of 6 scores with the spread of d_k = 128 (std 11.3): the largest softmax weight averages ≈ 0.92 "
             "over 8192 rows; divided by √128 first, ≈ 0.42.",
       "6 个分数一行、离散度如 d_k = 128（标准差 11.3）：8192 行上最大 softmax 权重平均约 0.92；"
       "先除以 √128 则约 0.42。",
       tests=("tests/test_attention_options.py::test_softmax_peak_of_six_scores_unscaled_vs_scaled",))
def check_a3(ctx):
    q, k = six_score_rows(ctx.gen())
    eye = torch.eye(6, dtype=q.dtype).expand(q.size(0), 1, 6, 6)  # weights @ I: the weights themselves
    peaks = {s: variants.attention(q, k, eye, attn_lib.resolve_scale(s, 128), causal=False,
                                   impl="reference").amax(-1).mean().item() for s in ("none", "sqrt_dk")}
    ok = abs(peaks["none"] - 0.92) <= 0.02 and abs(peaks["sqrt_dk"] - 0.42) <= 0.02
    return Result(verdict(ok), f"mean peak weight {fmt(peaks['none'], 3)} unscaled, {fmt(peaks['sqrt_dk'], 3)} "
                               "with the scale (attention(), reference path, 8192 rows)",
                  "each within 0.02 of the text's figure", figures={"peak": peaks},
                  rounded={"peak": {s: round(p, 2) for s, p in peaks.items()}})


def softmax_jacobian_norms(scores):
    """‖∂softmax(s)/∂s‖_F of each row of scores (n, m), through attention(): with q = s, keys and
    values the identity, the output is the row's softmax weights."""
    n, m = scores.shape
    s = scores.reshape(n, 1, 1, m).clone().requires_grad_()
    eye = torch.eye(m, dtype=s.dtype).expand(n, 1, m, m)
    w = variants.attention(s, eye, eye, 1.0, causal=False, impl="reference")  # (n, 1, 1, m)
    jac = torch.stack([torch.autograd.grad(w[..., j].sum(), s, retain_graph=True)[0] for j in range(m)], -2)
    return jac.reshape(n, m * m).norm(dim=1)


def qkv_grads(q, k, scale, gen):
    """Median per-row gradient norms of q, k and v for a random linear function of attention's output."""
    q, k = q.clone().requires_grad_(), k.clone().requires_grad_()
    v = rand(gen, *k.shape).requires_grad_()
    out = variants.attention(q, k, v, scale, causal=False, impl="reference")
    (out * rand(gen, *out.shape)).sum().backward()
    return {name: t.grad.flatten(1).norm(dim=1).median().item() for name, t in (("q", q), ("k", k), ("v", v))}


@claim("A4", "A saturated softmax has Jacobian A_i(δ_ij − A_j) → 0: the gradients that would move q and k vanish "
             "(V still learns). Trained without 1/√d_k, attention saturates.",
       "softmax 饱和时雅可比 A_i(δ_ij − A_j) → 0：推动 q、k 的梯度消失（V 仍在学习）；不用 1/√d_k 训练，注意力会饱和。",
       trains=True,
       tests=("tests/test_attnstats.py::test_removing_sqrt_dk_saturates_attention_of_large_qk",))
def check_a4(ctx):
    gen = ctx.gen()
    q, k = six_score_rows(gen)
    s = (q @ k.transpose(-2, -1)).reshape(-1, 6)  # the raw scores, std ≈ 11.3
    scale = attn_lib.resolve_scale("sqrt_dk", 128)
    jac = {"scaled": softmax_jacobian_norms(s * scale).median().item(),
           "unscaled": softmax_jacobian_norms(s).median().item()}
    grads = {"scaled": qkv_grads(q, k, scale, gen), "unscaled": qkv_grads(q, k, 1.0, gen)}
    quick_ok = (jac["unscaled"] <= 0.1 * jac["scaled"] and grads["unscaled"]["q"] < grads["scaled"]["q"]
                and grads["unscaled"]["v"] >= 0.5 * grads["scaled"]["v"])
    measured = (f"median ‖Jacobian‖ {fmt(jac['scaled'], 3)} with the scale, {fmt(jac['unscaled'], 4)} without "
                f"({jac['scaled'] / jac['unscaled']:.0f}x smaller); median ‖∂/∂q‖ {fmt(grads['scaled']['q'])} → "
                f"{fmt(grads['unscaled']['q'])} although the logits are 11.3x larger; "
                f"‖∂/∂v‖ {fmt(grads['scaled']['v'])} "
                f"→ {fmt(grads['unscaled']['v'])}")
    tolerance = ("unscaled Jacobian ≤ 0.1x scaled, ∂/∂q smaller, ∂/∂v at least half"
                 + ("" if ctx.quick else "; trained: entropy without the scale ≤ 0.6x with it"))
    figures = {"jacobian_median": jac, "grad_median": grads}
    if ctx.quick:
        return Result(verdict(quick_ok), measured + " (the trained part: full run)", tolerance, figures=figures)
    runs = {name: ctx.trained(name) for name in ("scaled", "unscaled")}
    end = {name: run.result["attn"][-1] for name, run in runs.items()}
    ent = {name: a["attn_entropy/mean"] for name, a in end.items()}
    peak = {name: a["attn_peak/mean"] for name, a in end.items()}
    ok = quick_ok and ent["unscaled"] <= 0.6 * ent["scaled"]
    figures.update(trained_entropy=ent, trained_peak=peak)
    m = runs["scaled"].cfg.model
    return Result(verdict(ok), measured + f"; trained ({m.n_layer} layers of {m.n_head} head, d_k = "
                  f"{m.n_embd // m.n_head}, {runs['scaled'].result['steps']} steps): entropy "
                  f"{fmt(ent['scaled'])} → {fmt(ent['unscaled'])} nats, peak {fmt(peak['scaled'])} → "
                  f"{fmt(peak['unscaled'])} without the scale (claims_entropy.png)", tolerance, figures=figures)


@claim("A5", "1/√d_k is a fixed per-dimension correction and cannot stop ‖q‖, ‖k‖ from growing in training; "
             "QK-Norm holds the logits' scale.",
       "1/√d_k 是固定的逐维校正，挡不住训练中 ‖q‖、‖k‖ 变大；QK-Norm 才能把 logit 的尺度稳住。",
       trains=True,
       tests=("tests/test_attention_options.py::test_qk_norm_bounds_logits_for_any_input_magnitude",
              "tests/test_attention_options.py::test_without_qk_norm_logits_grow_with_the_input"))
def check_a5(ctx):
    torch.manual_seed(ctx.seed)
    idx = torch.randint(40, (2, 32), generator=ctx.gen())
    grown = {}
    for qk_norm in (False, True):
        model = small_model(n_layer=2, n_head=1, n_embd=128, attn={"qk_norm": qk_norm})
        logits = []
        for grow in range(3):  # projections x1, x10, x100: q and k grow, the fixed scale does not follow
            with torch.no_grad():
                for block in model.blocks:
                    block.attn.c_attn.weight.mul_(10 if grow else 1)
            logits.append(max_logit(model, idx))
        grown[qk_norm] = logits
    bound = model.blocks[0].attn.logit_bound()
    quick_ok = grown[False][-1] >= 1000 * grown[False][0] and max(grown[True]) <= bound * (1 + 1e-5)
    measured = (f"projections x1 / x10 / x100: max logit {slash(grown[False], 1)} without QK-Norm, "
                f"{slash(grown[True], 2)} with it (bound √d_k = {fmt(bound)})")
    tolerance = ("without QK-Norm the max logit grows ≥ 1000x for 100x larger projections; with it ≤ the bound"
                 + ("" if ctx.quick else "; trained: max logit ≥ 10x its step-0 value, QK-Norm ≤ bound at every probe; "
                    "at lr 3e-2 without QK-Norm the run's max logit ≥ 10x lr 1e-3's and its entropy collapses "
                    "(< 0.1 nats), with QK-Norm ≤ the bound"))
    figures = {"max_logit_vs_projection_scale": {"no_qk_norm": grown[False], "qk_norm": grown[True]}, "bound": bound}
    if ctx.quick:
        return Result(verdict(quick_ok), measured + " (the trained part: full run)", tolerance, figures=figures)
    plain, normed = ctx.trained("scaled"), ctx.trained("qk_norm")
    steps, plain_max = layer_max(plain)
    half = len(steps) // 2
    _, normed_max = layer_max(normed)
    bound_trained = normed.model().blocks[0].attn.logit_bound()
    hot, hot_normed = ctx.trained("scaled_lr3e-2"), ctx.trained("qk_norm_lr3e-2")
    run_max = {name: run.result["attn_logit_max_run"] for name, run in
               (("lr1e-3", plain), ("lr3e-2", hot), ("lr3e-2_qk_norm", hot_normed))}
    hot_entropy = hot.result["attn_entropy_min_run"]
    ok = (quick_ok and plain_max[-1] >= 10 * plain_max[0] and max(normed_max) <= bound_trained * (1 + 1e-5)
          and run_max["lr3e-2"] >= 10 * run_max["lr1e-3"] and hot_entropy < 0.1
          and run_max["lr3e-2_qk_norm"] <= bound_trained * (1 + 1e-5))
    figures.update(trained_max_logit={"scaled": plain_max, "qk_norm": normed_max}, trained_bound=bound_trained,
                   run_max_logit=run_max, lr3e_2_min_entropy=hot_entropy)
    return Result(verdict(ok), measured + f"; trained {plain.result['steps']} steps: max logit {fmt(plain_max[0])} → "
                  f"{fmt(plain_max[half])} (step {steps[half]}) → {fmt(plain_max[-1])} with 1/√d_k alone, ≤ "
                  f"{fmt(max(normed_max))} with QK-Norm (bound {fmt(bound_trained)}; claims_qk_norm.png); at lr 3e-2 "
                  f"the run's max logit {fmt(run_max['lr3e-2'])} (lr 1e-3: {fmt(run_max['lr1e-3'])}), lowest entropy "
                  f"{fmt(hot_entropy)} nats, with QK-Norm ≤ {fmt(run_max['lr3e-2_qk_norm'])}", tolerance,
                  note="at lr 1e-3 most of the rise from step 0 is the small initialisation coming into use; the "
                       "runaway growth shows at higher lr (docs/stability.md: an lr sweep with 3 seeds)",
                  figures=figures)


TEXT_SHAPE = dict(vocab_size=128256, block_size=8192, n_layer=32, n_head=32, n_embd=4096, mlp="swiglu", d_ff=14336)


@claim("A6", "Per layer: N² terms 2N²d, projections 4Nd², SwiGLU FFN 3Nd·d_ff. At d = 4096, H = 32, d_ff = 14336 "
             "the N² terms equal the projections at N = 8192, the FFN at 21504, both at ≈ 29700; at 2k they are "
             "≈ 7% of the layer.",
       "每层：N² 项 2N²d，投影 4Nd²，SwiGLU 前馈 3Nd·d_ff。d = 4096、32 头、d_ff = 14336 时，"
       "N² 项在 N = 8192 追上投影，"
       "21504 追上前馈，约 29700 追上两者之和；2k 上下文时约占该层 7%。",
       tests=("tests/test_cost.py::test_crossovers_make_the_two_terms_equal",))
def check_a6(ctx):
    mha, gqa = GPTConfig(**TEXT_SHAPE), preset("llama3_8b_shape")
    x_mha, x_gqa = ({k: float(v) for k, v in crossovers(c).items()} for c in (mha, gqa))
    m = macs_per_token(mha, 2048)
    share, ratio = float(m["attn"] / m["layer"]), float(m["attn"] / (m["proj"] + m["mlp"]))
    m_gqa = macs_per_token(gqa, 2048)
    ratio_gqa = float(m_gqa["attn"] / (m_gqa["proj"] + m_gqa["mlp"]))
    ok = (x_mha["attn_vs_proj"] == 8192 and x_mha["attn_vs_mlp"] == 21504
          and abs(x_mha["attn_vs_proj_mlp"] / 29700 - 1) <= 0.005 and round(100 * ratio) == 7)
    return Result(verdict(ok),
                  "counting.crossovers, the text's shape (MHA): "
                  f"{x_mha['attn_vs_proj']:,.0f} / {x_mha['attn_vs_mlp']:,.0f}"
                  f" / {x_mha['attn_vs_proj_mlp']:,.0f}; at N = 2048 attention is {100 * ratio:.1f}% of projections + "
                  f"FFN ({100 * share:.1f}% of the whole layer). Llama-3-8B's GQA shape (8 KV heads): "
                  f"{x_gqa['attn_vs_proj']:,.0f} / {x_gqa['attn_vs_mlp']:,.0f} / {x_gqa['attn_vs_proj_mlp']:,.0f}, "
                  f"{100 * ratio_gqa:.1f}% at 2k",
                  "8192 and 21504 exactly, 29700 within 0.5%, the 2k figure rounding to 7%",
                  note="the text's projections 4Nd² assume multi-head K and V (MHA); attnlab counts d·(d + d_kv) per "
                       "token, so a GQA model's crossovers come earlier. The text's ≈ 7% is attention over the rest "
                       f"of the layer (N / {x_mha['attn_vs_proj_mlp']:,.0f}); as a share of the whole layer it is "
                       f"{100 * share:.1f}%",
                  figures={"crossovers_mha": x_mha, "crossovers_llama3_8b_gqa": x_gqa, "share_2k": share,
                           "ratio_2k": ratio, "ratio_2k_gqa": ratio_gqa})


@claim("A7", "A naive implementation stores the attention weights: N = 8192, H = 32, bf16, batch 1 → 4 GiB per "
             "layer, 128 GiB for 32 layers, while the model's bf16 weights are ≈ 16 GB.",
       "朴素实现会存下注意力权重：N = 8192、32 头、bf16、批大小 1 时每层 4 GiB，32 层共 128 GiB，"
       "而 bf16 权重约 16 GB。",
       tests=("tests/test_cost.py::test_mha_gelu_by_hand",))
def check_a7(ctx):
    c = preset("llama3_8b_shape")
    mem = memory_breakdown(c, 8192, 1, 2)
    per_layer, all_layers, weights = mem["attn_weights_per_layer"], mem["attn_weights_all_layers"], mem["weights"]
    B, H, N, hs = 1, 4, 256, 16  # the reference path at a small size: what it keeps for backward
    q, k, v = (torch.randn(B, H, N, hs, requires_grad=True) for _ in range(3))
    kept = saved_bytes(lambda: variants.attention(q, k, v, 0.25, impl="reference"))
    table = B * H * N * N * 4
    ok = per_layer == 4 * 2**30 and all_layers == 128 * 2**30 and abs(weights / 16e9 - 1) <= 0.05 and kept >= table
    return Result(verdict(ok),
                  f"counting.memory_breakdown (llama3_8b_shape, N = 8192, bf16): {per_layer / 2**30:g} GiB per layer, "
                  f"{all_layers / 2**30:g} GiB for {c.n_layer}; weights {weights / 1e9:.2f} GB; the reference path "
                  "keeps "
                  f"{kept / 2**20:.2f} MiB for backward at N = {N}, H = {H}, of which the B·H·N² table is "
                  f"{table / 2**20:.2f} MiB",
                  "4 GiB and 128 GiB exactly, weights within 5% of 16 GB, the reference path keeping the table",
                  figures={"attn_table_per_layer": per_layer, "attn_table_all_layers": all_layers,
                           "weights_bytes": weights, "reference_saved_bytes": kept, "table_bytes": table})


@claim("A8", "FlashAttention tiles Q, K, V with an online softmax and recomputes in the backward pass: the N×N table "
             "is never stored, memory falls from O(N²) to O(N), and all N² dot products are still computed.",
       "FlashAttention 对 Q、K、V 分块、用在线 softmax、反向时重算：不存 N×N 表，显存从 O(N²) 降到 O(N)，"
       "但 N² 个点积仍全部计算，复杂度不降。")
def check_a8(ctx):
    gen = ctx.gen()
    q, k, v = (rand(gen, 1, 2, 192, 16).requires_grad_() for _ in range(3))
    outs, grads = {}, {}
    for impl in ("reference", "tiled"):
        outs[impl] = variants.attention(q, k, v, 0.25, impl=impl, block=64)
        grads[impl] = torch.autograd.grad(outs[impl].sum(), (q, k, v))
    diff = max([max_diff(outs["reference"], outs["tiled"])]
               + [max_diff(a, b) for a, b in zip(grads["reference"], grads["tiled"])])
    fl, mem = {}, {}
    for N in (256, 512):
        x = [torch.randn(1, 2, N, 16, requires_grad=True) for _ in range(3)]
        for impl in ("reference", "tiled"):
            for causal in (False, True):
                fl[(impl, causal, N)] = flops(lambda: variants.attention(*x, 0.25, causal=causal, impl=impl, block=64))
            mem[(impl, N)] = saved_bytes(lambda: variants.attention(*x, 0.25, impl=impl, block=64))
    same = all(fl[("tiled", False, N)] == fl[("reference", False, N)] for N in (256, 512))
    growth = {impl: fl[(impl, True, 512)] / fl[(impl, True, 256)] for impl in ("reference", "tiled")}
    mem_growth = {impl: mem[(impl, 512)] / mem[(impl, 256)] for impl in ("reference", "tiled")}
    ok = diff <= 1e-10 and same and growth["tiled"] >= 3.5 and abs(mem_growth["tiled"] - 2) <= 0.05 \
        and mem_growth["reference"] >= 3.5
    return Result(verdict(ok),
                  f"tiled (impl=tiled) = reference to {diff:.0e} in output and gradients (float64); FLOPs without a "
                  f"mask equal ({fl[('tiled', False, 512)] / 1e6:.1f} M at N = 512); causal: tiled skips the masked "
                  f"blocks ({fl[('tiled', True, 512)] / fl[('reference', True, 512)]:.2f}x the table's) and still "
                  "grows "
                  f"{growth['tiled']:.2f}x for 2x N; saved for backward: tiled {mem_growth['tiled']:.2f}x for 2x N, "
                  f"reference {mem_growth['reference']:.2f}x",
                  "equal within 1e-10; same FLOPs without a mask; causal FLOPs ≥ 3.5x per doubling; tiled memory "
                  "2x (± 0.05) per doubling, reference ≥ 3.5x",
                  figures={"max_diff": diff,
                           "flops": {f"{i}_{'causal' if c else 'full'}_{n}": f for (i, c, n), f in fl.items()},
                           "saved_bytes": {f"{i}_{n}": b for (i, n), b in mem.items()}})


@claim("A9", "Activation recomputation is a different remedy: it does not by itself keep an N×N table from existing "
             "inside the attention kernel.",
       "激活重计算是另一种手段：它本身并不能阻止注意力内部出现 N×N 的表。")
def check_a9(ctx):
    B, H, N, hs = 1, 2, 256, 16
    table = B * H * N * N
    fns = {"checkpointed reference": lambda q, k, v: checkpoint(
               lambda a, b, c: variants.attention(a, b, c, 0.25, impl="reference"), q, k, v, use_reentrant=False),
           "tiled": lambda q, k, v: variants.attention(q, k, v, 0.25, impl="tiled", block=64)}
    kept, largest = {}, {}
    for name, fn in fns.items():
        x = [torch.randn(B, H, N, hs, requires_grad=True) for _ in range(3)]
        kept[name] = saved_bytes(lambda: fn(*x))
        out = fn(*x)
        with LargestTensor() as seen:  # the backward pass alone
            out.sum().backward()
        largest[name] = seen.numel
    inputs = 3 * B * H * N * hs * 4
    ok = (kept["checkpointed reference"] <= inputs and largest["checkpointed reference"] >= table
          and largest["tiled"] < table)
    return Result(verdict(ok),
                  "torch.utils.checkpoint around the reference path keeps only q, k, v "
                  f"({kept['checkpointed reference']:,} B)"
                  f", yet its backward rebuilds a tensor of {largest['checkpointed reference']:,} numbers (the B·H·N² "
                  f"table, N = {N}); the tiled path's backward never exceeds {largest['tiled']:,}",
                  "checkpointed: nothing but the inputs kept, a table-sized tensor in the backward; tiled: none",
                  figures={"saved_bytes": kept, "largest_backward_tensor": largest, "table_numel": table})


@claim("A10", "What lowers the complexity: sparse attention (each position sees only some) and linear attention "
              "(a kernel in place of softmax, so the product re-associates): toward N log N or N.",
       "真正降低复杂度的是稀疏注意力（每个位置只看一部分位置）和线性注意力（用核函数代替 softmax，乘法可重新结合）："
       "趋向 N log N 或 N。")
def check_a10(ctx):
    W, hs, H = 64, 16, 2
    growth = {}
    for name in ("full", "window", "linear"):
        counts = []
        for N in (256, 512):
            if name == "linear":
                c = GPTConfig(vocab_size=2, block_size=N, n_layer=1, n_head=H, n_embd=H * hs, attn={"kind": "linear"})
                layer, x = variants.make_attention(c, 0), torch.randn(1, N, H * hs)
                counts.append(flops(lambda: layer(x)))  # the whole layer: projections and the prefix sums' products
            else:
                x = [torch.randn(1, H, N, hs) for _ in range(3)]
                window = W if name == "window" else None
                counts.append(flops(lambda: variants.attention(*x, 0.25, impl="tiled", block=64, window=window)))
        growth[name] = counts[1] / counts[0]
    # a choice by content (MoBA: each query reads its own block and the K best earlier ones), on the path that
    # computes only the chosen blocks: the whole layer, choice included, and the keys each query reads
    moba = {"select": "moba", "select_block": 64, "select_topk": 2, "impl": "gathered"}
    counts, keys = [], {}
    for N in (512, 1024):
        c = GPTConfig(vocab_size=2, block_size=N, n_layer=1, n_head=H, n_embd=H * hs, attn=moba)
        layer, x = variants.make_attention(c, 0), torch.randn(1, N, H * hs)
        counts.append(flops(lambda: layer(x)))
        keys[N] = float(selected_keys(c, N))
    growth["moba"] = counts[1] / counts[0]
    c = GPTConfig(vocab_size=2, block_size=4096, n_layer=1, n_head=4, n_embd=128, attn={"window": W})
    per_token = {N: {r["name"].split()[0]: r["macs"] for r in attention_variants(c, N)} for N in (1024, 4096)}
    ok = (growth["full"] >= 3.5 and growth["window"] <= 2.2 and abs(growth["linear"] - 2) <= 0.05
          and growth["moba"] <= 2.4)
    return Result(verdict(ok),
                  f"FLOPs for 2x N (256 → 512): full attention {growth['full']:.2f}x, window W = {W} (tiled path) "
                  f"{growth['window']:.2f}x, a linear-attention layer {growth['linear']:.2f}x; counted MACs per token "
                  f"(counting.attention_variants, N = 1024 → 4096): full {per_token[1024]['reference']:,} → "
                  f"{per_token[4096]['reference']:,}, window {per_token[1024]['window']:,} → "
                  f"{per_token[4096]['window']:,}, "
                  f"linear {per_token[1024]['linear']:,} → {per_token[4096]['linear']:,}; chosen by content "
                  f"(select=moba, blocks of 64, the 2 best earlier ones, impl=gathered; N = 512 → 1024): the layer's "
                  f"FLOPs {growth['moba']:.2f}x, keys a query reads {keys[512]:.1f} → {keys[1024]:.1f} "
                  f"(causal full: {(512 + 1) / 2:.1f} → {(1024 + 1) / 2:.1f})",
                  "full ≥ 3.5x per doubling; window ≤ 2.2x; linear 2x (± 0.05); moba ≤ 2.4x",
                  note="N log N methods (e.g. Reformer's hashing) are not in attnlab; the linear layer's prefix sums "
                       "are additions, which the FLOP counter leaves out (they grow as N too); MoBA's choice scores "
                       "every block mean (N²/B), which keeps its growth above 2x; the loss at these sparsities is "
                       "measured in docs/attention_kinds.md",
                  figures={"flops_growth_per_doubling": growth, "macs_per_token": per_token,
                           "moba_keys_per_query": keys})


@claim("A11", "Generation has two phases: prefill (the whole prompt at once) and decode (one new query against "
              "cached keys and values).",
       "生成分两个阶段：预填充（整段提示一次处理）和解码（每步一个新查询，对照缓存的键和值）。",
       tests=("tests/test_sample.py::test_greedy_cached_and_uncached_generate_the_same_tokens",))
def check_a11(ctx):
    from sample import generate
    torch.manual_seed(ctx.seed)
    model = small_model(n_layer=2, vocab=40)
    prompt = torch.randint(40, (1, 12), generator=ctx.gen())
    rows = []
    hook = model.blocks[0].attn.hook_q.register_forward_hook(lambda m, a, q: rows.append(q.size(1)))  # (B, T, nh, hs)
    cached = generate(model, prompt, 8, temperature=0, kv_cache=True)
    hook.remove()
    recomputed = generate(model, prompt, 8, temperature=0, kv_cache=False)
    ok = rows[0] == 12 and rows[1:] == [1] * 7 and torch.equal(cached, recomputed)
    return Result(verdict(ok),
                  f"sample.generate with a KV cache: queries per forward {rows} (a 12-token prefill, then one per "
                  f"step); the same {cached.size(1) - 12} greedy tokens as recomputing the context",
                  "one prefill of the whole prompt, then exactly one query per step, tokens equal",
                  figures={"query_rows_per_forward": rows})


# ----------------------------------------------------------------------------- text B: softmax, N², the KV cache

@claim("B1", "Raw scores 0.5, 0.2, 2.5, 3.0 → softmax ≈ 0.05, 0.03, 0.35, 0.57: the two strong ones take ≈ 92%.",
       "原始分数 0.5、0.2、2.5、3.0 经 softmax 约为 0.05、0.03、0.35、0.57：两个高分合占约 92%。")
def check_b1(ctx):
    scores = torch.tensor([[[[0.5, 0.2, 2.5, 3.0]]]], dtype=torch.float64)  # one query whose q·k_j are the scores
    eye = torch.eye(4, dtype=torch.float64).view(1, 1, 4, 4)
    w = variants.attention(scores, eye, eye, 1.0, causal=False).flatten().tolist()
    text = [0.05, 0.03, 0.35, 0.57]
    ok = all(abs(a - b) <= 0.005 for a, b in zip(w, text)) and abs(w[2] + w[3] - 0.92) <= 0.005
    return Result(verdict(ok), f"attention() weights {slash(w, 4)}; the two strong ones {100 * (w[2] + w[3]):.1f}%",
                  "each rounds to the text's two decimals (± 0.005), the pair to 92%", figures={"weights": w})


@claim("B2", "N tokens compared pairwise is N² (100 → 10⁴; 10⁴ → 10⁸; 10⁶ → 10¹²): 10× the length, 100× the work.",
       "N 个词两两比较是 N² 次（100 → 10⁴，10⁴ → 10⁸，10⁶ → 10¹²）：长度 10 倍，计算 100 倍。")
def check_b2(ctx):
    c = GPTConfig(vocab_size=2, block_size=16, n_layer=1, n_head=1, n_embd=8)
    pairs = {N: macs_per_token(c, N)["scores"] * N // c.n_embd for N in (100, 10**4, 10**6)}  # q·k per sequence
    x = {N: [torch.randn(1, 1, N, 8) for _ in range(3)] for N in (100, 1000)}
    fl = {N: flops(lambda: variants.attention(*x[N], 1.0, causal=False, impl="reference")) for N in x}
    ok = all(p == N * N for N, p in pairs.items()) and fl[1000] == 100 * fl[100]
    return Result(verdict(ok), "counted q·k pairs (counting.macs_per_token) "
                  + ", ".join(f"{power10(N)} → {power10(p)}" for N, p in pairs.items())
                  + f"; measured reference-path FLOPs at N = 1000 over N = 100: {fl[1000] / fl[100]:g}x",
                  "N² exactly; 100x exactly", figures={"pairs": pairs, "flops_ratio_10x": fl[1000] / fl[100]})


@claim("B3", "Multi-head attention runs several such weightings side by side in smaller subspaces.",
       "多头注意力在更小的子空间里并排做多组这样的加权。",
       tests=("tests/test_variants.py::test_gqa_equals_mha_with_kv_weights_repeated_per_group",))
def check_b3(ctx):
    gen, H, T, hs = ctx.gen(), 4, 10, 8
    q, k, v = (rand(gen, 1, H, T, hs) for _ in range(3))
    together = variants.attention(q, k, v, hs ** -0.5, impl="reference")
    apart = torch.cat([variants.attention(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], hs ** -0.5, impl="reference")
                       for h in range(H)], dim=1)
    torch.manual_seed(ctx.seed)
    model = small_model(n_layer=1, n_head=4, n_embd=32)
    maps, _ = attention_maps(model, torch.randint(40, (1, 16), generator=gen))
    heads = maps[0]  # (nh, T, T)
    apart_maps = min((heads[a] - heads[b]).abs().mean().item() for a in range(4) for b in range(a + 1, 4))
    diff = max_diff(together, apart)
    ok = diff <= 1e-12 and apart_maps > 1e-3
    return Result(verdict(ok),
                  f"{H} heads at once = each head alone on its {hs}-wide slice to {diff:.0e}; in a 32-wide model "
                  f"the 4 heads (8 wide each) weight the keys differently (mean |Δ| ≥ {apart_maps:.3f} between "
                  "any two maps)",
                  "equal within 1e-12; every two heads' maps differ by more than 1e-3",
                  figures={"max_diff": diff, "min_map_difference": apart_maps})


@claim("B4", "The KV cache keeps past keys and values so decoding does not recompute them.",
       "KV 缓存保存过去的键和值，解码时不必重新计算。",
       tests=("tests/test_sample.py::test_cached_logits_equal_recomputed_ones",))
def check_b4(ctx):
    torch.manual_seed(ctx.seed)
    model = small_model(n_layer=2, attn={"impl": "reference"})
    T = 48
    idx = torch.randint(40, (1, T + 1), generator=ctx.gen())
    with torch.no_grad():
        cache = model.new_kv_cache(1, 64)
        model(idx[:, :T], kv_cache=cache, pos=0)  # prefill
        before = [(c.k[:, :, :T].clone(), c.v[:, :, :T].clone()) for c in cache]
        step = {}
        cached = flops(lambda: step.setdefault("logits", model(idx[:, T:], kv_cache=cache, pos=T)))
        full = flops(lambda: step.setdefault("full", model(idx)))
    kept = all(torch.equal(b[0], c.k[:, :, :T]) and torch.equal(b[1], c.v[:, :, :T]) for b, c in zip(before, cache))
    diff = max_diff(step["logits"][0, -1], step["full"][0, -1])
    ok = kept and diff <= 1e-4 and cached <= 2 / T * full
    return Result(verdict(ok),
                  f"a cached decode step at context {T} costs {100 * cached / full:.1f}% of recomputing it "
                  f"({cached / 1e6:.2f} vs {full / 1e6:.1f} MFLOPs); the cached K, V are left as they were; logits "
                  f"equal to {diff:.0e}",
                  f"cache untouched, logits within 1e-4, step ≤ 2/T = {100 * 2 / T:.1f}% of recomputing",
                  figures={"cached_step_flops": cached, "recompute_flops": full, "max_diff": diff})


# ----------------------------------------------------------------------------- text C: RNNs to the Transformer

@claim("C1", "An RNN's error signal decays like γᵏ: with γ = 0.9, after 50 steps ≈ 0.5% is left; its steps cannot run "
             "in parallel over the sequence.",
       "RNN 的误差信号按 γᵏ 衰减：γ = 0.9 时 50 步后只剩约 0.5%；各步无法沿序列并行。")
def check_c1(ctx):
    x = torch.zeros(51, dtype=torch.float64, requires_grad=True)
    h = torch.zeros((), dtype=torch.float64)
    for t in range(51):  # h_t = γ h_{t-1} + x_t: each step waits for the one before
        h = 0.9 * h + x[t]
    (rnn,) = torch.autograd.grad(h, x)
    v = torch.zeros(1, 1, 51, 4, dtype=torch.float64, requires_grad=True)
    q = torch.zeros(1, 1, 51, 4, dtype=torch.float64)  # equal scores: uniform causal weights
    y = variants.attention(q, q, v, 0.5, impl="reference")
    (attn,) = torch.autograd.grad(y[0, 0, 50, 0], v)
    ok = abs(rnn[0].item() - 0.005) < 0.0005
    return Result(verdict(ok),
                  f"∂h_50/∂x_0 through a linear RNN (γ = 0.9, autograd): {rnn[0].item():.5f} = "
                  f"{100 * rnn[0].item():.2f}% after 50 sequential steps; through causal attention the same distance "
                  f"is one step: ∂y_50/∂v_0 = the weight {attn[0, 0, 0, 0].item():.4f} (1/51), however far",
                  "rounds to 0.5% (± 0.05 points)",
                  note="attnlab has no RNN: the recurrence is written out in the check",
                  figures={"rnn_gradient": rnn[0].item(), "attention_gradient": attn[0, 0, 0, 0].item()})


@claim("C2", "Worked example: q = (1,0,1); k = (1,0,1), (0,1,0), (1,0,0); v = 10, 0, 2. Raw scores 2, 0, 1; scaled "
             "(d_k = 3) ≈ 1.15, 0, 0.58; weights ≈ 0.53, 0.17, 0.30; output ≈ 5.9. No weight is exactly 0.",
       "算例：q = (1,0,1)，k 为 (1,0,1)、(0,1,0)、(1,0,0)，v = 10、0、2。原始分数 2、0、1；缩放后约 1.15、0、0.58；"
       "权重约 0.53、0.17、0.30；输出约 5.9；没有权重恰为 0。")
def check_c2(ctx):
    q = torch.tensor([[[[1.0, 0, 1]]]], dtype=torch.float64)
    k = torch.tensor([[[[1.0, 0, 1], [0, 1, 0], [1, 0, 0]]]], dtype=torch.float64)
    v = torch.tensor([[[[10.0], [0], [2]]]], dtype=torch.float64)
    raw = attn_lib.attention_scores(q, k, scale=attn_lib.resolve_scale("none", 3)).flatten().tolist()
    scale = attn_lib.resolve_scale("sqrt_dk", 3)
    scaled = attn_lib.attention_scores(q, k, scale=scale).flatten().tolist()
    eye = torch.eye(3, dtype=q.dtype).view(1, 1, 3, 3)  # weights @ I: the weights themselves
    weights = variants.attention(q, k, eye, scale, causal=False).flatten().tolist()
    out = variants.attention(q, k, v, scale, causal=False).item()
    near = lambda xs, ys: all(abs(a - b) <= 0.005 for a, b in zip(xs, ys))  # noqa: E731  the text's two decimals
    ok = (raw == [2, 0, 1] and near(scaled, [1.15, 0, 0.58]) and near(weights, [0.53, 0.17, 0.30])
          and abs(out - 5.9) <= 0.05 and min(weights) > 0)
    return Result(verdict(ok), f"raw {slash(raw, 0)}; scaled {slash(scaled, 3)}; weights {slash(weights, 3)}; "
                  f"output {out:.3f}; smallest weight {min(weights):.3f} > 0",
                  "each figure rounds to the text's (± 0.005; output ± 0.05); every weight > 0",
                  figures={"raw": raw, "scaled": scaled, "weights": weights, "output": out})


@claim("C3", "Multi-head at the base size: 8 heads of 64 in 512 cost about as much as one 512-wide head.",
       "基础规模下：512 维里 8 个 64 维的头，开销与一个 512 维的头差不多。")
def check_c3(ctx):
    N, x = 64, torch.randn(1, 64, 512)
    counted, measured = {}, {}
    for heads in (8, 1):
        c = GPTConfig(vocab_size=2, block_size=N, n_layer=1, n_head=heads, n_embd=512, attn={"impl": "reference"})
        counted[heads] = macs_per_token(c, N)["layer"]
        layer = variants.make_attention(c, 0)
        measured[heads] = flops(lambda: layer(x))
    ok = counted[8] == counted[1] and abs(measured[8] / measured[1] - 1) <= 0.01
    return Result(verdict(ok), f"one attention layer at N = {N}: {measured[8] / 1e6:.1f} MFLOPs with 8 heads of 64, "
                  f"{measured[1] / 1e6:.1f} with 1 head of 512 (FLOP counter); counted MACs per token equal "
                  f"({counted[8]:,})", "counted equal, measured within 1%",
                  figures={"flops": measured, "macs_per_token": counted})


@claim("C4", "The FFN (d_ff = 4·d_model = 2048 at base) holds most parameters.",
       "前馈层（基础规模 d_ff = 4·d_model = 2048）占了大部分参数。")
def check_c4(ctx):
    c = GPTConfig(vocab_size=37000, block_size=512, n_layer=6, n_head=8, n_embd=512, d_ff=2048)
    p = count_params(c)
    blocks = p["attention"] + p["mlp"] + p["norms"]
    share = p["mlp"] / blocks
    return Result(verdict(share > 0.5),
                  f"counting.count_params at d = 512, d_ff = 2048, 6 layers: FFN {p['mlp']:,} of the blocks' "
                  f"{blocks:,} ({100 * share:.1f}%), attention {p['attention']:,}; the 37k-token embedding "
                  f"{p['embedding']:,}", "the FFN more than half of the blocks' parameters",
                  note="the blocks' parameters; with the original 37k-token vocabulary the embedding table alone "
                       "is larger than the 6 FFNs of this decoder-only stack",
                  figures={"params": p, "ffn_share_of_blocks": share})


def shuffled_last_logits(model, idx, gen):
    """(max |Δ| of the last position's logits when the earlier tokens are shuffled, the permutation)."""
    T = idx.size(1)
    perm = torch.cat([torch.randperm(T - 1, generator=gen), torch.tensor([T - 1])])
    with torch.no_grad():
        return max_diff(model(idx)[:, -1], model(idx[:, perm])[:, -1])


@claim("C5", "Without position information attention cannot tell \"dog bites man\" from \"man bites dog\": it is "
             "permutation-equivariant; positions (e.g. RoPE) break that.",
       "没有位置信息，注意力分不清“狗咬人”和“人咬狗”：它对排列等变；位置编码（如 RoPE）打破了这一点。",
       trains=True, tests=("tests/variants/test_positions.py::test_nope_one_layer_ignores_the_order_of_earlier_tokens",))
def check_c5(ctx):
    gen, T = ctx.gen(), 48
    q, k, v = (rand(gen, 1, 2, 12, 8) for _ in range(3))
    perm = torch.randperm(12, generator=gen)
    out = variants.attention(q, k, v, 8 ** -0.5, causal=False)
    equivariant = max_diff(out[:, :, perm], variants.attention(q[:, :, perm], k[:, :, perm], v[:, :, perm],
                                                               8 ** -0.5, causal=False))
    torch.manual_seed(ctx.seed)
    deep = shuffled_last_logits(small_model(n_layer=2, pos="none"), torch.randint(40, (4, T), generator=gen), gen)
    if ctx.quick:
        torch.manual_seed(ctx.seed)
        models = {"nope": small_model(n_layer=1, pos="none"), "rope": small_model(n_layer=1)}
        idx, which = torch.randint(40, (4, T), generator=gen), "random 1-layer models"
    else:
        models = {name: ctx.trained(name).model() for name in ("nope", "rope")}
        val = ctx.trained("nope").val_tokens()
        idx, which = val[: 4 * T].view(4, T), f"trained 1-layer models ({ctx.trained('nope').result['steps']} steps)"
    moved = {name: shuffled_last_logits(m, idx, gen) for name, m in models.items()}
    ok = equivariant <= 1e-12 and moved["nope"] <= 1e-4 and moved["rope"] >= 0.05
    return Result(verdict(ok),
                  f"attention() without mask or positions: permuting the tokens permutes the outputs (to "
                  f"{equivariant:.0e}); {which}, earlier tokens shuffled: the last logits move {moved['nope']:.0e} "
                  f"without positions, {moved['rope']:.2f} with RoPE",
                  "equivariant within 1e-12; NoPE's last logits within 1e-4, RoPE's moved ≥ 0.05",
                  note=f"from two causal layers on, NoPE sees order too (a random 2-layer NoPE model's last logits "
                       f"moved {deep:.2f}): the causal mask is itself a position signal",
                  figures={"equivariance_diff": equivariant, "last_logits_moved": moved, "two_layer_nope_moved": deep})


@claim("C6", "The causal mask: each position sees itself and earlier ones only; later tokens never change earlier "
             "outputs.",
       "因果掩码：每个位置只看到自己和之前的位置；后面的词永远不会改变前面的输出。",
       tests=("tests/test_model.py::test_causality_future_tokens_never_change_earlier_logits",))
def check_c6(ctx):
    gen, T, t = ctx.gen(), 24, 13
    idx = torch.randint(40, (2, T), generator=gen)
    changed = idx.clone()
    changed[:, t:] = torch.randint(40, (2, T - t), generator=gen)
    earlier, later = {}, {}
    for impl in IMPLS:
        torch.manual_seed(ctx.seed)
        model = small_model(n_layer=2, attn={"impl": impl})
        with torch.no_grad():
            a, b = model(idx), model(changed)
        earlier[impl], later[impl] = max_diff(a[:, :t], b[:, :t]), max_diff(a[:, t:], b[:, t:])
    ok = max(earlier.values()) <= 1e-5 and min(later.values()) >= 0.01
    return Result(verdict(ok),
                  f"tokens {t}..{T - 1} replaced: logits at 0..{t - 1} move "
                  + ", ".join(f"{i} {d:.0e}" for i, d in earlier.items())
                  + f"; later ones move ≥ {min(later.values()):.2f}",
                  "earlier logits within 1e-5 on every path; later ones moved",
                  figures={"earlier": earlier, "later": later})


@claim("C7", "Post-LN (the original placement) vs Pre-LN (later found to train deep stacks more stably).",
       "Post-LN（原始的放法）与 Pre-LN（后来发现训练深层网络更稳定）。", trains=True)
def check_c7(ctx):
    if ctx.quick:
        return skipped("two 12-layer models trained without warmup")
    runs = {name: ctx.trained(name) for name in ("pre_ln", "post_ln")}
    loss = {name: (run.result["val_loss_full"] if run.result else math.inf) for name, run in runs.items()}
    m, t = runs["pre_ln"].cfg.model, runs["pre_ln"].cfg.train
    tolerance = "Pre-LN's whole-val loss ≥ 0.05 nats below Post-LN's, or Post-LN diverging"
    said = (f"{m.n_layer} layers x {m.n_embd} wide, warmup {t.warmup_iters}, lr {t.lr:g}, {t.max_iters} steps: "
            "val loss (whole split) Pre-LN "
            + ("diverged" if not runs["pre_ln"].result else f"{loss['pre_ln']:.3f}") + ", Post-LN "
            + ("diverged" if not runs["post_ln"].result else f"{loss['post_ln']:.3f}"))
    if loss["pre_ln"] <= loss["post_ln"] - 0.05:
        return Result("holds", said, tolerance, figures={"val_loss_full": loss})
    gap = loss["pre_ln"] - loss["post_ln"]
    here = f"here Post-LN ended {gap:.2f} nats ahead; " if gap >= 0.05 else ""
    return Result("not_shown", said, tolerance,
                  note=here + "one seed at CPU size; Xiong et al. (2020, arXiv 2002.04745) saw Post-LN need warmup in "
                       "larger models trained longer. Under an lr sweep (docs/stability.md, 4 layers, 3 seeds) "
                       "Pre-LN trains at lr 1e-2 (2.07) where Post-LN stalls at 3.34 with or without warmup: the "
                       "higher lr holds, the need for warmup is not shown",
                  figures={"val_loss_full": loss})


@claim("C8", "2K → 32K tokens (16×) multiplies the attention scores' compute by 256.",
       "上下文从 2K 到 32K（16 倍），注意力打分的计算量变为 256 倍。")
def check_c8(ctx):
    c = GPTConfig(vocab_size=2, block_size=16, n_layer=1, n_head=1, n_embd=8)
    counted = (macs_per_token(c, 32768)["scores"] * 32768) / (macs_per_token(c, 2048)["scores"] * 2048)
    x = {N: [torch.randn(1, 1, N, 8) for _ in range(3)] for N in (64, 1024)}
    fl = {N: flops(lambda: variants.attention(*x[N], 1.0, causal=False, impl="reference")) for N in x}
    ok = counted == 256 and fl[1024] == 256 * fl[64]
    return Result(verdict(ok), f"counted (counting.macs_per_token) 2048 → 32768: {float(counted):g}x; measured "
                  f"reference-path FLOPs 64 → 1024 tokens (16x): {fl[1024] / fl[64]:g}x", "256 exactly, both",
                  figures={"counted": float(counted), "measured": fl[1024] / fl[64]})


@claim("C9", "KV-cache bytes ≈ layers × KV heads × tokens × head dim × 2 × bytes × batch; at long contexts and many "
             "requests it exceeds the weights; GQA cuts it about linearly in the number of KV heads.",
       "KV 缓存字节数 ≈ 层数 × KV 头数 × token 数 × 头维度 × 2 × 每数字节数 × 批大小；长上下文、多请求时超过权重；"
       "GQA 让它随 KV 头数近似线性减小。",
       tests=("tests/test_cost.py::test_kv_bytes_equal_a_real_cache_after_prefill",
              "tests/test_variants.py::test_kv_cache_is_n_head_over_n_kv_head_times_smaller"))
def check_c9(ctx):
    small = GPTConfig(vocab_size=40, block_size=64, n_layer=3, n_head=4, n_kv_head=2, n_embd=32)
    cache = GPT(small).new_kv_cache(3, 50, dtype=torch.bfloat16)
    real = sum(c.k.nbytes + c.v.nbytes for c in cache)
    formula = small.n_layer * small.n_kv_head * 50 * small.head_dim * 2 * 2 * 3
    c = preset("llama3_8b_shape")
    weights = count_params(c)["total"] * 2
    per_seq = kv_cache_bytes(c, 8192, 1, 2)
    sequences = math.ceil(weights / per_seq)
    by_heads = {h: kv_cache_bytes(c, 8192, 1, 2, n_kv_head=h) for h in (32, 8, 1)}
    ok = (real == formula == kv_cache_bytes(small, 50, 3, 2) and by_heads[32] == 4 * by_heads[8] == 32 * by_heads[1]
          and kv_cache_bytes(c, 8192, sequences, 2) > weights)
    return Result(verdict(ok),
                  f"a real cache (3 layers, 2 KV heads, 50 tokens, batch 3, bf16) holds {real:,} B = the formula; "
                  f"llama3_8b_shape in bf16: {per_seq / 2**30:g} GiB per 8k sequence, so {sequences} sequences of 8k "
                  f"outweigh the {weights / 1e9:.1f} GB of weights; 32 / 8 / 1 KV heads: "
                  + " / ".join(f"{b / 2**30:g}" for b in by_heads.values()) + " GiB",
                  "the real cache equals the formula to the byte; 4x and 32x exactly for 8 and 1 KV heads",
                  figures={"real_bytes": real, "formula_bytes": formula, "bytes_per_8k_sequence": per_seq,
                           "sequences_to_exceed_weights": sequences, "by_kv_heads": by_heads})


@claim("C10", "The KV cache is fought on several fronts: GQA/MQA/MLA compression, quantisation, eviction.",
       "KV 缓存有多条战线：GQA/MQA/MLA 压缩、量化、淘汰。",
       tests=("tests/test_decode.py::test_bf16_kv_cache_follows_the_reference_to_bf16_rounding",
              "tests/variants/test_mla.py::test_mla_cache_holds_only_the_latent_and_the_rope_key",
              "tests/variants/test_int8_cache.py::test_int8_cache_dequantises_within_half_a_scale_and_weighs_what_cost_py_says",
              "tests/variants/test_sink_cache.py::test_sink_eviction_equals_attention_over_exactly_the_kept_positions"))
def check_c10(ctx):
    base = dict(vocab_size=40, block_size=64, n_layer=2, n_head=8, n_embd=64)
    size = {h: sum(c.nbytes() for c in GPT(GPTConfig(**base, n_kv_head=h)).new_kv_cache(1, 64)) for h in (8, 2, 1)}
    mla = GPT(GPTConfig(**base, attn={"kind": "mla", "kv_lora_rank": 16, "rope_head_dim": 4}))
    size["mla"] = sum(c.nbytes() for c in mla.new_kv_cache(1, 64))  # latent 16 + RoPE key 4 per token and layer
    model = GPT(GPTConfig(**base))
    by_dtype = {str(dt).split(".")[1]: sum(c.nbytes() for c in model.new_kv_cache(1, 64, dtype=dt))
                for dt in (torch.float32, torch.bfloat16, torch.int8)}
    evicting = model.new_kv_cache(1, 16, sinks=4)  # StreamingLLM: 4 sinks + the latest 12 of any length
    windowed = GPT(GPTConfig(**base, attn={"window": 16})).new_kv_cache(1, 64)
    ok = size[8] == 4 * size[2] == 8 * size[1] and size[8] == size["mla"] * 2 * 8 * 8 // 20 \
        and by_dtype["float32"] == 2 * by_dtype["bfloat16"] and by_dtype["int8"] < by_dtype["bfloat16"] \
        and evicting[0].length == 16 and evicting[0].sinks == 4 and windowed[0].length == 16
    return Result(verdict(ok),
                  f"compression: 8 → 2 → 1 KV heads make the cache {size[8] // size[2]}x / {size[8] // size[1]}x "
                  f"smaller, MLA (a latent of 16 and a RoPE key of 4 per token) {size[8] / size['mla']:.1f}x; "
                  f"quantisation: int8 with a scale per token and head {by_dtype['float32'] / by_dtype['int8']:.2f}x "
                  f"below fp32 (bf16 2x); eviction: a cache of 16 that keeps 4 sink tokens and the latest 12 "
                  f"(sample.kv_sinks), a windowed layer's of 16",
                  "each front's bytes as counted: 4x, 8x, 2·8·8/(16+4) for MLA, 2x bf16, < bf16 for int8, fixed sizes",
                  note="evicting by importance (e.g. H2O) and int4 are not in attnlab; docs/kv_cache.md measures what "
                       "eviction does to the loss",
                  figures={"bytes_by_kv_heads": size, "bytes_by_dtype": by_dtype})


@claim("C11", "RoPE has limits when extrapolating past the trained length.",
       "RoPE 外推到超过训练长度时能力有限。", trains=True,
       tests=("tests/variants/test_rope_scaling.py::test_each_rope_scaling_is_its_formula_and_factor_one_is_none",
              "tests/variants/test_alibi.py::test_alibi_attention_is_the_biased_softmax_written_out"))
def check_c11(ctx):
    if ctx.quick:
        return skipped("a trained model")
    from streams import window_losses

    def late_loss(model, L):  # the mean loss of positions 4x..8x the trained length, every window of L
        n = window_losses(model, val, L)
        return n[:, L // 2:].mean().item()

    run = ctx.trained("scaled")
    trained = run.model()
    alibi = ctx.trained("alibi").model()  # trained like "scaled", ALiBi in place of RoPE
    T = trained.config.block_size
    L = 8 * T
    val = run.val_tokens()
    with torch.no_grad():
        windowed = F.cross_entropy(trained(val[: ((len(val) - 1) // L) * L].view(-1, L), window=T)[:, L // 2:]
                                   .reshape(-1, trained.config.vocab_size),
                                   val[1: ((len(val) - 1) // L) * L + 1].view(-1, L)[:, L // 2:].reshape(-1)).item()
        loss = {"rope": late_loss(trained, L), f"rope, window {T}": windowed}
        fields = dataclasses.asdict(trained.config)  # the fields, not what __post_init__ derives
        for scaling in ("linear", "ntk", "yarn"):  # the same weights, RoPE scaled 8x at evaluation
            scaled = GPT(GPTConfig(**{**fields, "rope_scaling": scaling, "rope_scaling_factor": 8.0})).eval()
            scaled.load_state_dict(trained.state_dict())
            loss[f"rope + {scaling} x8"] = late_loss(scaled, L)
        loss["alibi"] = late_loss(alibi, L)
        loss["alibi, at the trained length"] = window_losses(alibi, val, T).mean().item()
    rise = loss["rope"] - loss[f"rope, window {T}"]
    best = min(("rope + linear x8", "rope + ntk x8", "rope + yarn x8"), key=loss.get)
    status = "holds" if rise >= 0.05 else "not_shown"
    return Result(status,
                  f"models trained at {T} tokens, on the val split in windows of {L}, positions {L // 2}-{L - 1}: RoPE "
                  f"{loss['rope']:.3f} nats vs {loss[f'rope, window {T}']:.3f} seeing only the latest {T} "
                  f"(+{rise:.3f}); scaled at evaluation: {best} {loss[best]:.3f}; ALiBi {loss['alibi']:.3f} "
                  f"({loss['alibi, at the trained length']:.3f} at its trained length)",
                  "the same tokens cost ≥ 0.05 nats more with context past the trained length",
                  note="the rise mixes unseen rotation offsets with attention spread over more keys; docs/positions.md "
                       "has every scheme and scaling with seeds (tools/eval_lengths.py)",
                  figures={"loss": loss, "rise": rise})


@claim("C12", "Sub-quadratic alternatives: state-space models (Mamba), linear attention, and hybrids of both with "
              "standard attention.",
       "次二次的替代方案：状态空间模型（Mamba）、线性注意力，以及二者与标准注意力的混合。", trains=True,
       tests=("tests/variants/test_gdn.py::test_chunked_form_equals_the_formula_written_out",
              "tests/variants/test_mamba2.py::test_ssd_is_its_materialised_matrix_and_the_recurrence",
              "tests/test_variants.py::test_cached_generation_equals_recomputation"))
def check_c12(ctx):
    torch.manual_seed(ctx.seed)
    kinds = {"linear": ["linear"], "Mamba-2 (SSD)": ["mamba2"], "Gated DeltaNet": ["gdn"],
             "hybrid gdn + softmax": ["gdn", "softmax"]}
    idx = torch.randint(40, (1, 40), generator=ctx.gen())
    diffs, states, kv = {}, {}, {}
    for name, pattern in kinds.items():
        model = small_model(n_layer=2, attn={"layer_kinds": pattern})
        recurrent = [not b.attn.softmax for b in model.blocks]
        held = {n: [x.nbytes() for x in model.new_kv_cache(1, n)] for n in (256, 4096)}  # the built caches, fp32
        states[name] = {n: sum(b for b, r in zip(held[n], recurrent) if r) for n in held}
        kv[name] = {n: sum(b for b, r in zip(held[n], recurrent) if not r) for n in held}
        model = model.double()  # the two forms compared in float64: their own gap, not rounding
        with torch.no_grad():
            parallel = model(idx)
            cache = model.new_kv_cache(1, 40)
            steps = [model(idx[:, t:t + 1], kv_cache=cache, pos=t) for t in range(40)]  # one token at a time
        diffs[name] = max_diff(torch.cat(steps, 1), parallel)
    constant = all(s[256] == s[4096] > 0 for s in states.values())
    hybrid = kv["hybrid gdn + softmax"]
    quick_ok = max(diffs.values()) <= 1e-9 and constant and hybrid[4096] == 16 * hybrid[256] > 0
    measured = ("recurrent = parallel (one token at a time with the state vs the whole sequence, float64) to "
                + ", ".join(f"{n} {d:.0e}" for n, d in diffs.items())
                + "; the recurrent layers' state in bytes at N = 256 and 4096 (built caches): "
                + ", ".join(f"{n} {s[256]:,} / {s[4096]:,}" for n, s in states.items() if n in kinds)
                + f"; the hybrid's softmax layer's KV cache {hybrid[256]:,} / {hybrid[4096]:,}")
    tolerance = "recurrent = parallel within 1e-9; the state the same size at every N" + \
        ("" if ctx.quick else "; trained: the hybrid [linear, softmax] recalls ≥ 0.9 and ≥ pure linear + 0.2")
    figures = {"max_diff": diffs, "state_bytes": states, "kv_cache_bytes": kv}
    if ctx.quick:
        return Result(verdict(quick_ok), measured + " (the recall part: full run)", tolerance, figures=figures)
    runs = {name: ctx.trained(name) for name in ("recall_linear", "recall_hybrid")}
    recall = {name: run.result["val/recall_acc"] for name, run in runs.items()}
    ok = quick_ok and recall["recall_hybrid"] >= 0.9 and recall["recall_hybrid"] >= recall["recall_linear"] + 0.2
    figures["recall"] = recall
    cfg = runs["recall_linear"].cfg
    return Result(verdict(ok), measured + f"; trained on multi-query associative recall ({', '.join(map(str, cfg.data.pairs))} pairs in "
                  f"{cfg.model.block_size} tokens, {cfg.model.n_layer} layers of one {cfg.model.n_embd}-wide head, "
                  f"{cfg.train.max_iters} steps): pure linear recalls {recall['recall_linear']:.3f}, the hybrid "
                  f"[linear, softmax] {recall['recall_hybrid']:.3f}", tolerance,
                  note="one seed here; docs/hybrids.md has the recall experiment with 3 seeds and intervals",
                  figures=figures)


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
            (log or (lambda m: print(m, file=sys.stderr)))(f"wrote {path}")
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
        bound = runs["qk_norm"].model().blocks[0].attn.logit_bound()
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


@cli
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="skip the training runs (seconds instead of minutes)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random measurements (A2, A3, ...)")
    parser.add_argument("--only", default=None, help="comma-separated claim ids, e.g. A2,C5")
    parser.add_argument("--format", choices=("text", "json", "markdown"), default="text", help="what stdout shows")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON to FILE")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="training runs, figures, claims.json and claims.md (default: outputs/claims/<time>; "
                             "--quick writes there only when given)")
    args = parser.parse_args(argv)
    if args.seed < 0:
        raise UserError(f"--seed {args.seed}: a seed is a non-negative integer")
    out = Path(args.out) if args.out else None
    if out is None and not args.quick:
        out = REPO / "outputs" / "claims" / time.strftime("%Y-%m-%d_%H-%M-%S")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    only = None if args.only is None else [s.strip().upper() for s in args.only.split(",") if s.strip()]
    t0 = time.perf_counter()
    rows = run_claims(args.quick, args.seed, out, only)
    report = {"quick": args.quick, "seed": args.seed, "torch": torch.__version__, "seconds": time.perf_counter() - t0,
              "claims": rows}
    text = {"text": text_table(rows), "json": json.dumps(report, indent=1, ensure_ascii=False),
            "markdown": markdown_table(rows)}[args.format]
    print(text)
    for path, content in ((args.json, report), (out and out / "claims.json", report)):
        if path:
            Path(path).write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    if out is not None:
        (out / "claims.md").write_text(markdown_table(rows) + "\n", encoding="utf-8")
        print(f"wrote {out / 'claims.json'}, {out / 'claims.md'}", file=sys.stderr)
    return 1 if any(r["status"] == "fails" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
