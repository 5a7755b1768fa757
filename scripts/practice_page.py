"""docs/practice.md's measurements, written from the run dirs: the questions a practitioner asks before turning
QK-Norm on, each answered below the page's marker line.

    python scripts/practice_page.py RUNS [RUNS ...] [--bench FILE ...] [--page docs/practice.md]

Each RUNS dir holds one sweep dir per experiment, made by the commands the page prints (this page's, and
docs/stability.md's for the 400-step cells and width 128):
  l_noqkn, l_qkn, l_qkln    (1) 2000 steps at lr 3e-3/1e-2/3e-2: no QK-Norm, gainless QK-Norm, qk-layernorm
  w64, w256 (and e1_noqkn, e1_qkn as width 128)   (2) the width axis at lr 1e-3/1e-2/3e-2/1e-1
  w_dk64, w_dk128, w_dk256   (2) scale=dk at each width, one seed
  x_postln, x_preln         (3) 8 layers, lr 3e-3, warmup 0/30/100 (Post-LN) and 0/100 (Pre-LN), grads from step 1
  c_zloss, c_zloss_best, c_softcap, c_softcap_best, c_clip   (4) the mitigations where they can act
  d_decay                   (4) independent decay 1e-3 over 2000 steps, lr 1e-2/3e-2
  m_opt_none, m_opt_qkn, m_opt_clip   (5) AdamW and Muon, each without a control, with QK-Norm, with QK-Clip
  v_e1check                 one docs/stability.md run repeated at this page's commit (its loss must be the same)
--bench takes the output of scripts/bench_controls.py (each file one run) for the decision table's step time.
A sweep that is missing leaves its section out with one line that says so. The figures are named as on
docs/stability.md: a loss is the final val loss over the whole val split, "± h" the 95% t-half-interval of
the mean over seeds (with 2 seeds, t = 12.7: wide), a difference is paired by seed with its 95% interval.
"""
import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import stability_page as sp  # noqa: E402  (the runs' reader and the figures' helpers)
from stability_page import (Runs, at, best, best_per_seed, cost_line, diff, diff_dicts, g, interval,  # noqa: E402
                            largest_logit, lowest_entropy, lr_head, lr_name, mean, mean_cell, says, sensitivity,
                            sens_diff, signed)
from rules import UserError  # noqa: E402

MARKER = "<!-- Everything below is written by scripts/practice_page.py from the run dirs; edit the script, not the page. -->"
SWEEP = sp.SWEEP
BASE = "model.attn.qk_norm=false model.attn.scale=sqrt_dk"
LONG_LRS = [3e-3, 1e-2, 3e-2]
WIDTH_LRS = [1e-3, 1e-2, 3e-2, 1e-1]
CONTROL_LRS = [3e-3, 3e-2, 1e-1]
OPT_LRS = [3e-3, 1e-2]
FIGURES = {}  # what other pages quote (docs/practice.json: tools/claims.py's A5 and C7 read it)


def seeds(points, keep) -> list:
    return [p for p in points if p.replicate and p.replicate[0] in keep]


def missing(runs: Runs, title: str, *exps) -> list:
    lacking = [e for e in exps if not runs.have(e)]
    return [title, "", "Not on this page: RUNS has no " + ", ".join(lacking) + ".", ""] if lacking else []


def fit_slope(xs, ys) -> dict:
    """Least squares y = a + b·x (scipy's linregress): {"slope", "half" (95% t, n - 2 df), "n"}; half None
    under 3 points."""
    fit = stats.linregress(xs, ys)
    n = len(xs)
    return {"slope": fit.slope, "half": stats.t.ppf(0.975, n - 2) * fit.stderr if n > 2 else None, "n": n}


def slope_text(f: dict) -> str:
    if f["half"] is None:
        return f"{signed(f['slope'])} (no interval)"
    lo, hi = f["slope"] - f["half"], f["slope"] + f["half"]
    return f"{signed(f['slope'])} (95%: {signed(lo)} to {signed(hi)}{', within noise' if lo <= 0 <= hi else ''})"


def params(width: int, layers: int = 4) -> int:
    """Parameters of the lab's model at this width, d_k 32 (tiny shakespeare's 65 tokens, tied embeddings)."""
    from model import GPT, GPTConfig
    return GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=layers, n_head=width // 32, n_embd=width)).num_params()


def at_step(p, step, prefix):
    """The largest value of the metrics named prefix* logged at `step` in a run, or None."""
    vals = [v for m in p.metrics if m.get("step") == step for k, v in m.items() if k.startswith(prefix)]
    return max(vals) if vals else None


def span(vals, spec=".2f") -> str:
    vals = [v for v in vals if v is not None]
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return format(lo, spec) if format(lo, spec) == format(hi, spec) else f"{lo:{spec}}-{hi:{spec}}"


# ----------------------------------------------------------------------------- the sections

PAGE_EXPS = ("l_", "w64", "w256", "w_dk", "x_", "c_", "d_", "m_opt_", "v_")  # this page's sweeps (name prefixes)
COMPARED = ("e1_noqkn", "e1_qkn", "qk_layernorm")  # docs/stability.md's sweeps this page compares with


def header(runs: Runs) -> list:
    used = [r for r in runs.rows if r["exp"].startswith(PAGE_EXPS) or r["exp"] in COMPARED]
    infos = [r["info"] for r in used]
    commits = sorted({i["git_commit"][:10] for i in infos if i.get("git_commit")})
    unrecorded = sum(not i.get("git_commit") for i in infos)
    threads = sorted({i.get("cpu_threads") for i in infos if i.get("cpu_threads") is not None})
    torch_v = sorted({i.get("torch") for i in infos if i.get("torch")})
    py = sorted({i.get("python") for i in infos if i.get("python")})
    mine = [r for r in used if r["exp"].startswith(PAGE_EXPS)]
    still = f" {len(runs.unfinished)} more have no results.json yet and are left out." if runs.unfinished else ""
    check = ""
    if runs.have("v_e1check", "e1_noqkn"):
        again = runs.points("v_e1check")[0]
        old = [p for p in runs.points("e1_noqkn", model__attn__scale="sqrt_dk")
               if p.replicate == again.replicate and math.isclose(p.lr, again.lr)]
        if old:
            same = old[0].loss == again.loss
            check = (f" One of docs/stability.md's runs (seed 1, lr {lr_name(again.lr)}) repeated at this page's commit "
                     f"ends at {again.loss:.6f} against {old[0].loss:.6f}: "
                     + ("the same to the last digit, so its runs pair with these by seed." if same else
                        "not the same, so pairings across the two pages are only approximate."))
    return [
        "## Measured so far", "",
        f"Written by `python scripts/practice_page.py RUNS` from {len(used)} run dirs ({len(mine)} this page's, the "
        f"rest docs/stability.md's 400-step runs it compares with). Commits {', '.join(commits) or '-'}"
        f"{f' ({unrecorded} runs recorded none: docs/stability.md says which)' if unrecorded else ''}; "
        f"{sp.cpu_name()}; {'/'.join(map(str, threads)) or '-'} CPU thread per run, two runs at a time on 2 cores; "
        f"torch {', '.join(torch_v)}, Python {', '.join(py)}; {runs.cost([r['exp'] for r in mine])[1]:.0f} minutes "
        "of one core for this page's runs. Every run is `experiment=lr_sensitivity_cpu` (4 × 4 × 128, d_k 32, tiny "
        "shakespeare, block 64, batch 16, 400 steps, warmup 30, cosine to lr/10, AdamW, clip 1.0) unless its "
        "command says otherwise. A loss is the final val loss over the whole val split; \"± h\" the 95% "
        "t-half-interval of the mean over the seeds (with 2 seeds t = 12.7, so these intervals are wide); a "
        "difference is paired by seed, with its 95% interval; † a diverged run, ‡ a run that ended at the unigram "
        "loss." + check + still, ""]


def section_long(runs: Runs) -> list:
    title = "### (1) Does QK-Norm reach a lower loss with longer training? 2000 steps"
    if gone := missing(runs, title, "l_noqkn", "l_qkn", "e1_noqkn", "e1_qkn"):
        return gone
    keep = {1, 2}
    arms = [("1/√d_k, no QK-Norm", runs.points("l_noqkn"),
             seeds(runs.points("e1_noqkn", model__attn__scale="sqrt_dk"), keep)),
            ("QK-Norm (RMS, no gain)", runs.points("l_qkn"),
             seeds(runs.points("e1_qkn", model__attn__scale="sqrt_dk"), keep))]
    if runs.have("l_qkln", "qk_layernorm"):
        arms.append(("qk-layernorm with gain", runs.points("l_qkln"), seeds(runs.points("qk_layernorm"), keep)))
    lrs = LONG_LRS
    long_cost = cost_line(runs, ["l_noqkn", "l_qkn", "l_qkln"])
    lines = [title + " (seeds 1, 2)", "",
             f"`{SWEEP} {BASE} train.max_iters=2000 train.eval_interval=100 train.lr=3e-3,1e-2,3e-2 seed=1,2`, the "
             "same with `model.attn.qk_norm=true`, and with `model.attn.qk_norm=true model.attn.qk_norm_type=layer "
             f"model.attn.qk_norm_gain=channel` ({long_cost}). The 400-step column of each lr is docs/stability.md "
             "(1)'s runs of the same seeds.", "",
             "| arm | " + " | ".join(f"lr {lr_name(lr)}: 400 → 2000 steps" for lr in lrs) + " | best lr at 2000 |",
             "|---|" + "---|" * (len(lrs) + 1)]
    for label, long, short in arms:
        cells = [f"{mean_cell(at(short, lr))} → {mean_cell(at(long, lr))}" for lr in lrs]
        lr_best, _ = best(long, lrs)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {lr_name(lr_best)} |")
    base_long, base_short = arms[0][1], arms[0][2]
    figs = {"steps": 2000, "lrs": lrs, "seeds": 2}
    lines.append("")
    for label, long, short in arms[1:]:
        best_d = diff_dicts(best_per_seed(base_long), best_per_seed(long))
        best_400 = diff_dicts(best_per_seed(at_lrs(base_short, lrs)), best_per_seed(at_lrs(short, lrs)))
        per_lr = {lr: (diff(at(base_short, lr), at(short, lr)), diff(at(base_long, lr), at(long, lr))) for lr in lrs}
        kept = [lr for lr, (a, b) in per_lr.items() if a["diff"] is not None and b["diff"] is not None
                and (a["diff"] > 0) == (b["diff"] > 0)]
        lines.append(f"- {label} minus no QK-Norm, each seed's best loss over the three lrs: at 2000 steps "
                     f"{says(best_d)}; at 400 steps {says(best_400)}. At each lr, 400 → 2000 steps: "
                     + "; ".join(f"{lr_name(lr)} {signed(a['diff']) if a['diff'] is not None else '-'} → {says(b)}"
                                 for lr, (a, b) in per_lr.items())
                     + f". The sign of the difference is kept at {len(kept)} of {len(lrs)} lrs.")
        figs[label] = {"best_minus_none": [best_d["diff"], best_d["lo"], best_d["hi"]],
                       "best_lr": best(long, lrs)[0], "best_minus_none_400": best_400["diff"]}
    figs["best_lr_none"] = best(base_long, lrs)[0]
    lines.append(f"- The best lr of the seed means: no QK-Norm {lr_name(best(base_short, lrs)[0])} at 400 steps and "
                 f"{lr_name(best(base_long, lrs)[0])} at 2000; "
                 + "; ".join(f"{label} {lr_name(best(short, lrs)[0])} and {lr_name(best(long, lrs)[0])}"
                             for label, long, short in arms[1:]) + ".")
    FIGURES["long"] = figs
    return lines + [""]


def at_lrs(points, lrs) -> list:
    return [p for p in points if any(math.isclose(p.lr, lr, rel_tol=1e-9) for lr in lrs)]


def section_width(runs: Runs) -> list:
    title = "### (2) Does the effect grow with size? Width 64 / 128 / 256 at d_k 32"
    if gone := missing(runs, title, "w64", "w256", "e1_noqkn", "e1_qkn"):
        return gone
    keep, lrs = {1, 2}, WIDTH_LRS
    arms = {False: {64: runs.points("w64", model__attn__qk_norm=False),
                    128: seeds(at_lrs(runs.points("e1_noqkn", model__attn__scale="sqrt_dk"), lrs), keep),
                    256: runs.points("w256", model__attn__qk_norm=False)},
            True: {64: runs.points("w64", model__attn__qk_norm=True),
                   128: seeds(at_lrs(runs.points("e1_qkn", model__attn__scale="sqrt_dk"), lrs), keep),
                   256: runs.points("w256", model__attn__qk_norm=True)}}
    n = {w: params(w) for w in (64, 128, 256)}
    lines = [title + " (seeds 1, 2)", "",
             f"`{SWEEP} model.n_embd=64 model.n_head=2 model.attn.qk_norm=false,true model.attn.scale=sqrt_dk "
             "train.lr=1e-3,1e-2,3e-2,1e-1 seed=1,2` and the same at `model.n_embd=256 model.n_head=8` "
             f"({cost_line(runs, ['w64', 'w256'])}); width 128 is docs/stability.md (1)'s runs of these seeds and lrs. "
             "Depth 4, heads grow with the width so d_k stays 32. LR sensitivity (Wortsman et al.'s, over these 4 "
             "lrs):", "",
             "| width | parameters | " + lr_head(lrs) + " | LR sensitivity | largest logit at 1e-1 |",
             "|---|---|" + "---|" * (len(lrs) + 2)]
    for qk in (False, True):
        for w, pts in arms[qk].items():
            lines.append(f"| {w}, {'QK-Norm' if qk else 'no QK-Norm'} | {n[w] / 1e6:.2f}M | "
                         + " | ".join(mean_cell(at(pts, lr)) for lr in lrs)
                         + f" | {interval(sensitivity(pts, lrs))} | {g(largest_logit(at(pts, 1e-1)))} |")
    fits, figs = {}, {"widths": list(n), "params": list(n.values()), "lrs": lrs}
    for qk in (False, True):
        xs, ys = [], []
        for w, pts in arms[qk].items():
            for s in sensitivity(pts, lrs)["seeds"].values():
                xs.append(math.log10(n[w]))
                ys.append(s)
        fits[qk] = fit_slope(xs, ys)
        figs["qk_norm" if qk else "no_qk_norm"] = {
            "sensitivity": {w: sensitivity(pts, lrs)["mean"] for w, pts in arms[qk].items()},
            "slope_per_decade": [fits[qk]["slope"], fits[qk]["half"]]}
    edge = [f"width {w} {'with' if qk else 'without'} QK-Norm" for qk in (False, True) for w, pts in arms[qk].items()
            if pts and best(pts, lrs)[0] in (lrs[0], lrs[-1])]
    seven = sensitivity(runs.points("e1_noqkn", model__attn__scale="sqrt_dk"))
    seven_q = sensitivity(runs.points("e1_qkn", model__attn__scale="sqrt_dk"))
    gaps = {w: sens_diff(arms[False][w], arms[True][w], lrs) for w in n}
    lines += ["",
              f"- LR sensitivity against log10(parameters), a least-squares line through every seed's value "
              f"({fits[False]['n']} points, 95% t with {fits[False]['n'] - 2} df): without QK-Norm {slope_text(fits[False])} nats per decade of parameters; with "
              f"QK-Norm {slope_text(fits[True])}. QK-Norm minus none at each width: "
              + "; ".join(f"{w} {says(d)}" for w, d in gaps.items()) + ".",
              f"- The reduced grid: at width 128 the sensitivity over these 4 lrs is "
              f"{interval(sensitivity(arms[False][128], lrs))} without QK-Norm and "
              f"{interval(sensitivity(arms[True][128], lrs))} with it, against {interval(seven)} and {interval(seven_q)} "
              "over docs/stability.md's 7 lrs and 3 seeds: a sensitivity is a mean over its grid, so only figures over "
              "one grid compare."]
    if edge:
        lines.append(f"- The best lr is at the grid's edge for {', '.join(edge)}: the best loss there may lie past the "
                     "grid, so its sensitivity is a lower bound. The best lr of the seed means by width: "
                     + "; ".join(f"{'QK-Norm' if qk else 'no QK-Norm'} "
                                 + ", ".join(f"{w} {lr_name(best(pts, lrs)[0])}" for w, pts in arms[qk].items())
                                 for qk in (False, True))
                     + ". A best lr that falls with the width is the usual pattern when one lr serves every matrix "
                     "(μP's correction); over a fixed grid, part of a trend is where the grid sits.")
    FIGURES["width"] = figs
    dk = {w: runs.points(f"w_dk{w}") for w in n if runs.have(f"w_dk{w}")}
    if dk:
        lines += [f"- `model.attn.scale=dk` (1/d_k instead of 1/√d_k), one seed, no QK-Norm, the same 4 lrs "
                  f"({cost_line(runs, [f'w_dk{w}' for w in dk])}): LR sensitivity "
                  + "; ".join(f"width {w} {interval(sensitivity(pts, lrs))}" for w, pts in dk.items())
                  + "; losses " + "; ".join(f"width {w}: " + " / ".join(mean_cell(at(pts, lr)).split(' ')[0] for lr in lrs)
                                            for w, pts in dk.items())
                  + f" (lr {' / '.join(lr_name(lr) for lr in lrs)}). On this axis d_k stays 32, so 1/d_k is 1/√d_k "
                  "times a constant 1/√32 ≈ 0.18 at every width: a colder softmax, not a rule that changes with size. "
                  "μP's 1/d_k matters where d_k grows with the width, and μP also scales the hidden matrices' Adam lr "
                  "by 1/width, their init, and the output logits by 1/width; none of that is run here."]
    return lines + [""]


def section_warmup(runs: Runs, docs: Path = None) -> list:
    title = "### (3) When does Post-LN need warmup? 8 layers, lr 3e-3"
    if gone := missing(runs, title, "x_postln", "x_preln"):
        return gone
    cells = {("post", w): runs.points("x_postln", train__warmup_iters=w) for w in (0, 30, 100)}
    cells.update({("pre", w): runs.points("x_preln", train__warmup_iters=w) for w in (0, 100)})
    name = {k: f"{'Pre' if k[0] == 'pre' else 'Post'}-LN, warmup {k[1]}" for k in cells}
    lines = [title + " (3 seeds)", "",
             f"`{SWEEP} {BASE} model.n_layer=8 model.norm_position=post train.warmup_iters=0,30,100 train.lr=3e-3 "
             "seed=1,2,3 train.log_layer_grads=true train.log_interval=1`, and Pre-LN with warmup 0 and 100 "
             f"({cost_line(runs, ['x_postln', 'x_preln'])}): docs/stability.md (5)'s cell with one more warmup length, "
             "each block's gradient norm logged from the first step. Xiong et al. (2020) show that at "
             "initialisation Post-LN's gradients are largest near the output, so the full lr at once breaks it, "
             "while Pre-LN's are even across layers.", "",
             "| | final loss | ended at the unigram loss | train loss at step 1 / 5 / 20 / 50 (range over seeds) |",
             "|---|---|---|---|"]
    for k, pts in cells.items():
        early = " / ".join(span([at_step(p, s, "train/loss") for p in pts]) for s in (1, 5, 20, 50))
        lines.append(f"| {name[k]} | {mean_cell(pts)} | {sum(p.outcome == 'unigram' for p in pts)} of {len(pts)} | "
                     f"{early} |")
    lines += ["", "- Warmup against none: " + "; ".join(
        f"{name[(pos, w)]} minus warmup 0: {says(diff(cells[pos, 0], cells[pos, w]))}"
        for pos, w in (("post", 30), ("post", 100), ("pre", 100))) + "."]
    first = {}
    for k in (("pre", 0), ("post", 0)):
        per = {}
        for p in cells[k]:
            for m in p.metrics:
                if m.get("step") == 1:
                    for key, v in m.items():
                        if key.startswith("aux/grad_norm/L"):
                            per.setdefault(int(key.rsplit("L", 1)[1]), []).append(v)
        first[k] = [statistics.fmean(per[l]) for l in sorted(per)]
    if all(first.values()):
        n = len(first["pre", 0])
        lines += ["", "Each block's gradient norm at the first step (the gradient of the initial weights, the same with "
                  "any warmup; mean over the 3 seeds), first block to last:", "",
                  "| | " + " | ".join(f"L{l}" for l in range(n)) + " | last / first |", "|---|" + "---|" * (n + 1)]
        for k, vals in first.items():
            lines.append(f"| {'Pre' if k[0] == 'pre' else 'Post'}-LN | " + " | ".join(f"{v:.3g}" for v in vals)
                         + f" | {vals[-1] / vals[0]:.2g} |")
        FIGURES["grad_at_init"] = {"pre_ln": first["pre", 0], "post_ln": first["post", 0]}
        post, pre = first["post", 0][-1] / first["post", 0][0], first["pre", 0][-1] / first["pre", 0][0]
        way = lambda r: "grows" if r > 1 else "shrinks"  # noqa: E731
        lines += ["", f"- At initialisation the gradient {way(post)} toward the output in Post-LN (last block "
                  f"{post:.2g}× the first's) and {way(pre)} in Pre-LN ({pre:.2g}×)"
                  + (", the direction of Xiong et al.'s analysis, though at 8 layers Post-LN's last block is only "
                     f"{post:.2g}× its first." if post > 1 > pre else ".")
                  + " AdamW divides each gradient by its running size, so what warmup changes here is the size of the "
                  "first updates, and the loss shows their effect: at step 5 Post-LN's training loss is "
                  f"{span([at_step(p, 5, 'train/loss') for p in cells['post', 0]])} without warmup (the unigram loss "
                  f"is ≈ 3.34) and {span([at_step(p, 5, 'train/loss') for p in cells['post', 100]])} with 100 "
                  "warmup steps (the step-0 loss is ≈ 4.2)."]
    if docs is not None and all(first.values()):
        plot_grads(cells, name, docs / "practice_grad_norms.png")
        lines += ["", "![each block's gradient norm over the first 50 steps](practice_grad_norms.png)"]
    unigram = {f"{k[0]}_warmup{k[1]}": sum(p.outcome == "unigram" for p in pts) for k, pts in cells.items()}
    FIGURES["warmup_trend"] = {"layers": 8, "lr": 3e-3, "seeds": 3, "unigram": unigram,
                               "loss": {f"{k[0]}_warmup{k[1]}": mean(pts) for k, pts in cells.items()}}
    return lines + [""]


def section_controls(runs: Runs) -> list:
    title = "### (4) The mitigations where they can act"
    if gone := missing(runs, title, "e1_noqkn", "e1_qkn", "c_zloss", "c_softcap", "c_clip"):
        return gone
    lrs = CONTROL_LRS
    base = runs.points("e1_noqkn", model__attn__scale="sqrt_dk")
    qkn = runs.points("e1_qkn", model__attn__scale="sqrt_dk")
    wd0 = runs.points(["c_zloss", "c_zloss_best"], train__z_loss=0.0)
    zl = runs.points(["c_zloss", "c_zloss_best"], train__z_loss=1e-4)
    caps = {c: runs.points(["c_softcap", "c_softcap_best"], model__attn__softcap=float(c)) for c in (5, 10, 20)}
    clip = runs.points("c_clip") + [p for p in runs.points("m_opt_clip", train__optimizer="adamw")
                                    if math.isclose(p.lr, 3e-3)]
    rows = [("none (docs/stability.md (1))", base, None),
            ("`model.attn.qk_norm=true` (docs/stability.md (1))", qkn, base),
            ("`train.weight_decay=0`", wd0, base),
            ("`train.weight_decay=0 train.z_loss=1e-4` (PaLM)", zl, wd0)]
    rows += [(f"`model.attn.softcap={c}` (Gemma 2's form)", pts, base) for c, pts in caps.items()]
    rows.append(("`train.qk_clip=30` (Kimi K2's QK-Clip)", clip, base))
    hi = lrs[-1]
    lines = [title + " (3 seeds; QK-Clip at 3e-3 2 seeds)", "",
             f"1/√d_k, no QK-Norm; each arm one command, e.g. `{SWEEP} {BASE} model.attn.softcap=5,10,20 "
             "train.lr=3e-2,1e-1 seed=1,2,3`, `... train.weight_decay=0 train.z_loss=0,1e-4 ...`, `... "
             f"train.qk_clip=30 ...` ({cost_line(runs, ['c_zloss', 'c_zloss_best', 'c_softcap', 'c_softcap_best', 'c_clip'])}). "
             "Each cell: the loss, then the arm minus the row it is compared with (the baseline; for z-loss the "
             "baseline without weight decay), paired by seed. The largest logit is the attention probe's (before any "
             "soft-cap); the largest activation is the largest |value| a block writes to the residual stream at the "
             f"last probe (`act_max/L*`), the max over layers and seeds.", "",
             f"| arm | {lr_head(lrs)} | largest logit at {lr_name(hi)} | lowest entropy at {lr_name(hi)} | "
             f"largest activation at {lr_name(hi)} |", "|---|" + "---|" * (len(lrs) + 3)]
    figs = {}
    for label, pts, ref in rows:
        cells = []
        for lr in lrs:
            c = mean_cell(at(pts, lr))
            if ref is not None and at(pts, lr):
                d = diff(at(ref, lr), at(pts, lr))
                c += f"<br>{signed(d['diff'])} ({signed(d['lo'])} to {signed(d['hi'])})" if d["diff"] is not None else ""
            cells.append(c)
        acts = [last_value(p, "act_max/max") for p in at(pts, hi)]
        acts = [a for a in acts if a is not None]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {g(largest_logit(at(pts, hi)))} | "
                     f"{g(lowest_entropy(at(pts, hi)))} | {g(max(acts)) if acts else '-'} |")
        figs[label] = {lr_name(lr): mean(at(pts, lr)) for lr in lrs}
    z_at = {lr: diff(at(wd0, lr), at(zl, lr)) for lr in lrs if at(zl, lr)}
    log_z = [last_value(p, "train/log_z") for p in at(zl, hi)]
    lines += ["",
              "- z-loss where it can act: without weight decay the output logits are free to grow, and the z-loss "
              "(1e-4 · (log Z)²) pulls log Z of the output softmax toward 0. Against the same runs without it: "
              + "; ".join(f"{lr_name(lr)} {says(d)}" for lr, d in z_at.items())
              + (f"; its log Z at the end of the lr {lr_name(hi)} runs is {span(log_z)}." if any(log_z) else ".")
              + " Weight decay 0 itself against the default 0.1: "
              + "; ".join(f"{lr_name(lr)} {says(diff(at(base, lr), at(wd0, lr)))}" for lr in lrs if at(wd0, lr)) + ".",
              "- Soft-caps against the baseline at 1e-1: "
              + "; ".join(f"cap {c} {says(diff(at(base, hi), at(pts, hi)))}" for c, pts in caps.items())
              + "; against QK-Norm at 1e-1: "
              + "; ".join(f"cap {c} {says(diff(at(qkn, hi), at(pts, hi)))}" for c, pts in caps.items())
              + ". At 3e-3, the baseline's best lr: "
              + "; ".join(f"cap {c} {says(diff(at(base, 3e-3), at(pts, 3e-3)))}" for c, pts in caps.items()) + ".",
              f"- QK-Clip at τ = 30: {'; '.join(f'{lr_name(lr)} {says(diff(at(base, lr), at(clip, lr)))}' for lr in lrs)}. "
              "It bounds the logits of each step's training batch; the probe reads a held-out batch after the step, "
              f"so a probed logit can pass τ: largest {g(largest_logit(clip))}."]
    acts = {label: {l: max((v for p in at(pts, hi) for v in [last_value(p, f"act_max/L{l}")] if v is not None),
                           default=None) for l in range(4)} for label, pts in (("none", base), ("QK-Norm", qkn))}
    if all(v is not None for a in acts.values() for v in a.values()):
        lines.append("- Rybakov et al. (2024): QK-Norm bounds the logits but not what the layers write. The largest "
                     f"activation per block at lr {lr_name(hi)}, max over seeds, L0 to L3: "
                     + "; ".join(f"{label} {' / '.join(g(v) for v in a.values())}" for label, a in acts.items())
                     + "; at lr 1e-3 the max over blocks is "
                     + "; ".join(f"{label} {g(max(v for p in at(pts, 1e-3) for v in [last_value(p, 'act_max/max')] if v is not None))}"
                                 for label, pts in (("none", base), ("QK-Norm", qkn)) if at(pts, 1e-3)) + ".")
        figs["act_max_1e-1"] = acts
    if runs.have("d_decay", "l_noqkn"):
        decayed, coupled = runs.points("d_decay"), runs.points("l_noqkn")
        wd = runs_value(runs, "d_decay", "train.weight_decay")
        kept = shrink(wd, 2000)
        d_at = {lr: diff(at(coupled, lr), at(decayed, lr)) for lr in (1e-2, 3e-2) if at(decayed, lr)}
        lines.append(f"- Independent decay where it can act: `{SWEEP} {BASE} train.max_iters=2000 train.eval_interval=100 "
                     f"train.weight_decay_mode=independent train.weight_decay={wd:g} train.lr=1e-2,3e-2 seed=1,2` "
                     f"({cost_line(runs, ['d_decay'])}): over 2000 steps of this schedule it leaves a weight that no "
                     f"gradient moves at {kept:.2f} of its size (Wortsman et al.'s 1e-4 over 1e5 steps leaves e^-10 "
                     "before their schedule). Minus (1)'s 2000-step baseline (coupled decay 0.1, a shrink of 0.1 × lr a "
                     "step): " + "; ".join(f"{lr_name(lr)} {says(d)}" for lr, d in d_at.items()) + ". "
                     + " ".join(f"At {lr_name(lr)} coupled decay shrinks by {0.1 * lr:g} a step, "
                                + ("the same as the independent arm, so the two are one run twice (a check: they match)."
                                   if math.isclose(0.1 * lr, wd) else f"{0.1 * lr / wd:.3g}× the independent arm's.")
                                for lr in d_at)
                     + (" Where they differ, decoupling the decay from the lr is within noise here." if all(
                         d["lo"] is not None and d["lo"] <= 0 <= d["hi"] for d in d_at.values()) else ""))
        figs["independent_decay_2000"] = {"weight_decay": wd, "kept": kept,
                                          **{lr_name(lr): d["diff"] for lr, d in d_at.items()}}
    FIGURES["controls"] = figs
    return lines + [""]


def runs_value(runs: Runs, exp: str, key: str):
    return next(r["config"].get(key) for r in runs.rows if r["exp"] == exp)


def shrink(wd: float, steps: int) -> float:
    """What independent decay leaves of a weight no gradient moves after `steps` of lr_sensitivity_cpu's
    schedule: the product of (1 - s_t · wd), s_t = lr_t / lr (lab/optim.py's decay_factor and lr_at)."""
    from claims.common import compose
    from lab.optim import lr_at
    t = compose(["experiment=lr_sensitivity_cpu", f"train.max_iters={steps}"]).train
    return math.prod(1 - lr_at(step, t) / t.lr * wd for step in range(steps))


def last_value(p, key):
    vals = [m[key] for m in p.metrics if key in m]
    return vals[-1] if vals else None


def section_muon(runs: Runs, docs: Path = None) -> list:
    title = "### (5) Muon and the logits; QK-Clip as the control where QK-Norm cannot go"
    if gone := missing(runs, title, "m_opt_none", "m_opt_qkn", "m_opt_clip"):
        return gone
    lrs = OPT_LRS
    arms = {(opt, ctl): runs.points(exp, train__optimizer=opt)
            for opt in ("adamw", "muon") for ctl, exp in (("none", "m_opt_none"), ("QK-Norm", "m_opt_qkn"),
                                                          ("QK-Clip 30", "m_opt_clip"))}
    probes = (50, 100, 200, 400)
    lines = [title + " (seeds 1, 2)", "",
             f"`{SWEEP} {BASE} train.optimizer=adamw,muon train.lr=3e-3,1e-2 seed=1,2`, the same with "
             "`model.attn.qk_norm=true` and with `train.qk_clip=30` "
             f"({cost_line(runs, ['m_opt_none', 'm_opt_qkn', 'm_opt_clip'])}). Muon's lr is `train.lr` "
             "(`train.muon_adjust_lr=match_rms_adamw` makes its update's size AdamW's); it steps the blocks' "
             "matrices, AdamW the rest. The largest probed logit at steps " + " / ".join(map(str, probes))
             + " (max over the seeds), and the final loss:", "",
             "| optimizer, control | " + " | ".join(f"lr {lr_name(lr)}: logits; loss" for lr in lrs) + " |",
             "|---|" + "---|" * len(lrs)]
    for (opt, ctl), pts in arms.items():
        cells = []
        for lr in lrs:
            curve = [max((v for p in at(pts, lr) for v in [at_step(p, s, "attn_logit_max/L")] if v is not None),
                         default=None) for s in probes]
            cells.append(" / ".join(g(v) for v in curve) + f"; {mean_cell(at(pts, lr))}")
        lines.append(f"| {'Muon' if opt == 'muon' else 'AdamW'}, {ctl} | " + " | ".join(cells) + " |")
    if docs is not None:
        plot_logits(arms, lrs, docs / "practice_muon_logits.png")
        lines += ["", "![the largest attention logit over training, AdamW against Muon](practice_muon_logits.png)", "",
                  "Solid: seed 1, dashed: seed 2. Where QK-Clip never clips, its runs are the runs without it, and "
                  "the orange curves cover the red ones."]
    ratio = {lr: [m / a for m, a in [(at_step(pm, 400, "attn_logit_max/L"), at_step(pa, 400, "attn_logit_max/L"))
                                     for pa in at(arms["adamw", "none"], lr) for pm in at(arms["muon", "none"], lr)
                                     if pa.replicate == pm.replicate] if m and a] for lr in lrs}
    lines += ["",
              "- Muon's largest logit over AdamW's at step 400, no control, per seed: "
              + "; ".join(f"lr {lr_name(lr)} {', '.join(f'{r:.2g}×' for r in rs) or '-'}" for lr, rs in ratio.items())
              + (". Here Muon grows the attention logits more slowly than AdamW at every lr and seed, the opposite of "
                 "what Kimi Team (2025) report from training at scale (one size, 400 steps, 2 seeds here)"
                 if all(r < 1 for rs in ratio.values() for r in rs) and any(ratio.values()) else "")
              + ". Muon minus AdamW in loss: "
              + "; ".join(f"{ctl} at {lr_name(lr)} {says(diff(at(arms['adamw', ctl], lr), at(arms['muon', ctl], lr)))}"
                          for ctl in ("none", "QK-Norm", "QK-Clip 30") for lr in lrs) + ".",
              "- QK-Clip minus no control: "
              + "; ".join(f"{'Muon' if opt == 'muon' else 'AdamW'} at {lr_name(lr)} "
                          f"{says(diff(at(arms[opt, 'none'], lr), at(arms[opt, 'QK-Clip 30'], lr)))}"
                          for opt in ("adamw", "muon") for lr in lrs) + "."]
    FIGURES["muon"] = {"logit_ratio_step400": {lr_name(lr): rs for lr, rs in ratio.items()},
                       "loss": {f"{opt}_{ctl}": {lr_name(lr): mean(at(pts, lr)) for lr in lrs}
                                for (opt, ctl), pts in arms.items()}}
    return lines + [""]


def plot_grads(cells, name, out):
    """Each block's gradient norm (before clipping) over steps 1-50, one panel per arm, seed 1."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lab.plots import save_figure
    keys = [k for k in (("post", 0), ("post", 100), ("pre", 0)) if cells.get(k)]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), sharey=True)
    for ax, k in zip(axes, keys):
        p = min(cells[k], key=lambda p: p.replicate)
        rows = [m for m in p.metrics if 0 < m.get("step", 0) <= 50 and "aux/grad_norm/L0" in m]
        n = sum(key.startswith("aux/grad_norm/L") for key in rows[0])
        for l in range(n):
            ax.plot([m["step"] for m in rows], [m[f"aux/grad_norm/L{l}"] for m in rows],
                    color=plt.cm.viridis(l / max(n - 1, 1)), label=f"block {l}")
        ax.set(yscale="log", xlabel="step", title=f"{name[k]} (seed {p.replicate[0]})")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("gradient norm of the block (before clipping)")
    axes[-1].legend(fontsize=7)
    save_figure(fig, out)


def plot_logits(arms, lrs, out):
    """The largest probed attention logit over training, AdamW and Muon without a control, each seed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lab.plots import save_figure
    fig, axes = plt.subplots(1, len(lrs), figsize=(6 * len(lrs), 4))
    for ax, lr in zip(axes, lrs):
        for (opt, ctl), color in ((("adamw", "none"), "tab:blue"), (("muon", "none"), "tab:red"),
                                  (("muon", "QK-Clip 30"), "tab:orange")):
            for i, p in enumerate(sorted(at(arms[opt, ctl], lr), key=lambda p: p.replicate)):
                steps = sorted({m["step"] for m in p.metrics if "attn_logit_max/L0" in m})
                ax.plot(steps, [at_step(p, s, "attn_logit_max/L") for s in steps], color=color,
                        ls="-" if i == 0 else "--",
                        label=f"{'Muon' if opt == 'muon' else 'AdamW'}, {ctl}" if i == 0 else None)
        ax.set(yscale="log", xlabel="step", ylabel="largest attention logit (probe)", title=f"lr {lr_name(lr)}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, out)


BOUNDS = {  # what each control bounds, in words (the decision table's second column)
    "1/√d_k": "the logits' spread at initialisation (≈ 1 for random q, k); nothing once ‖q‖, ‖k‖ grow",
    "QK-Norm (RMS, no gain)": "every attention logit ≤ scale·d_k = √d_k (5.66 here), by construction",
    "qk-layernorm with gain": "the logits up to the learned gains' product: a bound that can grow",
    "soft-cap 20": "every attention logit inside ±20 (tanh), but not q, k or the weights",
    "z-loss 1e-4": "log Z of the output softmax (a penalty, not a bound); nothing in attention",
    "QK-Clip 30": "each head's logits on each training batch ≤ 30 after the step; not another batch's",
    "Muon": "nothing: an optimizer (its logits in (5))",
}


def read_bench(files) -> dict:
    """{control: [median ratio of each bench_controls.py output]} of the files given."""
    found = {}
    row = re.compile(r"^(.+?)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)-([\d.]+)$")
    for f in files:
        for line in Path(f).read_text().splitlines():
            if m := row.match(line.strip()):
                found.setdefault(m.group(1).strip(), []).append(float(m.group(3)))
    return found


def section_decision(runs: Runs, bench: dict) -> list:
    title = "### Which control to turn on"
    if gone := missing(runs, title, "e1_noqkn", "e1_qkn", "c_softcap", "c_zloss", "c_clip"):
        return gone
    base = runs.points("e1_noqkn", model__attn__scale="sqrt_dk")
    wd0 = runs.points(["c_zloss", "c_zloss_best"], train__z_loss=0.0)
    arms = {"QK-Norm (RMS, no gain)": (runs.points("e1_qkn", model__attn__scale="sqrt_dk"), base),
            "qk-layernorm with gain": (runs.points("qk_layernorm"), base),
            "soft-cap 20": (runs.points(["c_softcap", "c_softcap_best"], model__attn__softcap=20.0), base),
            "z-loss 1e-4": (runs.points(["c_zloss", "c_zloss_best"], train__z_loss=1e-4), wd0),
            "QK-Clip 30": (runs.points("c_clip") + runs.points("m_opt_clip", train__optimizer="adamw"), base),
            "Muon": (runs.points("m_opt_none", train__optimizer="muon"), base)}
    time_of = {"QK-Norm (RMS, no gain)": "QK-Norm (RMS, no gain)", "qk-layernorm with gain": "qk-layernorm with gain",
               "soft-cap 20": "soft-cap 20", "z-loss 1e-4": "z-loss 1e-4", "QK-Clip 30": "QK-Clip, every head clipped",
               "Muon": "Muon"}
    runs_of_bench = max((len(v) for v in bench.values()), default=0)
    lines = [title, "",
             "Each control against the baseline (z-loss against the baseline without weight decay, as in (4)), paired by "
             "seed: at lr 3e-3, the baseline's best lr at 400 steps (what the control costs where nothing is "
             "unstable), and at lr 1e-1 (what it saves where the baseline breaks). Step time: one training step "
             "over the baseline's, from `python scripts/bench_controls.py` (side by side in one process, 7 "
             f"rounds; {runs_of_bench} runs: the range of their medians). QK-Clip's time is with every head clipped "
             "(its most). Helped: the lrs of this page's 400-step runs where its difference's interval is below 0. "
             "The sections below hold every figure.", "",
             "| control | what it bounds | at lr 3e-3 | at lr 1e-1 | helped at | step time |",
             "|---|---|---|---|---|---|",
             f"| 1/√d_k alone (the baseline) | {BOUNDS['1/√d_k']} | - | - | - | 1.00× |"]
    figs = {}
    for name, (pts, ref) in arms.items():
        helped = [lr_name(lr) for lr in sorted({p.lr for p in pts}) if (d := diff(at(ref, lr), at(pts, lr)))["hi"] is not None
                  and d["hi"] < 0]
        d_lo, d_hi = diff(at(ref, 3e-3), at(pts, 3e-3)), diff(at(ref, 1e-1), at(pts, 1e-1))
        t = bench.get(time_of[name], [])
        tt = (f"{min(t):.2f}×" if len(t) == 1 or min(t) == max(t) else f"{min(t):.2f}-{max(t):.2f}×") if t else "not measured"
        cell = lambda d, p: (says(d) if d["diff"] is not None else "not run") if p else "not run"  # noqa: E731
        lines.append(f"| {name} | {BOUNDS[name]} | {cell(d_lo, at(pts, 3e-3))} | {cell(d_hi, at(pts, 1e-1))} | "
                     f"{', '.join(helped) or 'nowhere'} | {tt} |")
        figs[name] = {"at_3e-3": d_lo["diff"], "at_1e-1": d_hi["diff"], "step_time": t, "helped": helped}
    FIGURES["decision"] = figs
    return lines + [""]


def section_brief() -> list:
    """The answers in one line each, from the figures the sections below computed (FIGURES)."""
    out = ["### The answers in brief", ""]
    if (f := FIGURES.get("long")) and (q := f.get("QK-Norm (RMS, no gain)")):
        d = q["best_minus_none"]
        out.append(f"- Longer runs (2000 steps): each seed's best loss with QK-Norm minus without, {signed(d[0])} nats "
                   f"(95%: {signed(d[1])} to {signed(d[2])}); the best lr is {lr_name(q['best_lr'])} with QK-Norm and "
                   f"{lr_name(f['best_lr_none'])} without: "
                   + ("QK-Norm reaches a lower best loss (1)." if d[2] is not None and d[2] < 0 else
                      "no lower best loss with QK-Norm; what it buys is the range of lrs that train (1)."))
    if f := FIGURES.get("width"):
        (a, ha), (b, hb) = f["no_qk_norm"]["slope_per_decade"], f["qk_norm"]["slope_per_decade"]
        out.append(f"- Size: LR sensitivity changes by {signed(a)} ± {ha:.3f} nats per decade of parameters without "
                   f"QK-Norm and {signed(b)} ± {hb:.3f} with it, over widths {'/'.join(map(str, f['widths']))} "
                   "(2 seeds, 4 lrs; (2)).")
    if f := FIGURES.get("warmup_trend"):
        u = f["unigram"]
        out.append(f"- Post-LN at 8 layers, lr 3e-3: runs that ended at the unigram loss with warmup 0 / 30 / 100: "
                   f"{u.get('post_warmup0')} / {u.get('post_warmup30')} / {u.get('post_warmup100')} of {f['seeds']} (3).")
    if f := FIGURES.get("muon"):
        r = [x for v in f["logit_ratio_step400"].values() for x in v]
        if r:
            out.append(f"- Muon's largest attention logit at step 400 is {min(r):.2g}-{max(r):.2g}× AdamW's at the same "
                       "lr and seed, without a control (5).")
    out.append("- Which control to turn on: the table below.")
    return out + [""]


GPU = """### On a GPU (not run yet)

The same questions at one GPU's size, not run yet; each line is the full grid of one question:

- Longer runs: `python train.py -m experiment=lr_long data.path=tinyshakespeare.txt` (the baby GPT, 6 × 6 × 384, 10000
  steps, lr 3e-3/1e-2/3e-2, no QK-Norm and QK-Norm, 3 seeds), then the same with
  `model.attn.qk_norm=true model.attn.qk_norm_type=layer model.attn.qk_norm_gain=channel`.
- The width axis: `python train.py -m experiment=lr_size_axis data.path=tinyshakespeare.txt model.n_embd=256
  model.n_head=4`, and again at `model.n_embd=512 model.n_head=8` and `model.n_embd=1024 model.n_head=16` (d_k 64,
  Wortsman et al.'s 7 lrs, QK-Norm off and on, 3 seeds; each width one command, as the heads must follow it).
- Post-LN and warmup, the mitigations and Muon: the CPU commands above with `experiment=lr_sensitivity` (the baby GPT).
"""


def write(page: Path, runs: Runs, bench: dict):
    head = sp.page_head(page, MARKER)
    docs = page.parent
    sections = (section_long(runs) + section_width(runs) + section_warmup(runs, docs) + section_controls(runs)
                + section_muon(runs, docs))
    body = header(runs) + section_brief() + section_decision(runs, bench) + sections + [GPU]
    page.write_text(head + MARKER + "\n\n" + "\n".join(body).rstrip() + "\n")
    (page.parent / "practice.json").write_text(json.dumps(FIGURES, indent=1) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path, nargs="+", help="dirs holding one sweep dir per experiment")
    ap.add_argument("--bench", type=Path, nargs="*", default=[], help="outputs of scripts/bench_controls.py")
    ap.add_argument("--page", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "practice.md")
    args = ap.parse_args(argv)
    for d in args.runs:
        if not d.is_dir():
            raise SystemExit(f"{d} is not a directory: pass the dirs holding the experiments' sweep dirs")
    for f in args.bench:
        if not f.is_file():
            raise SystemExit(f"--bench {f}: no such file (save `python scripts/bench_controls.py` output there)")
    try:
        runs = Runs(args.runs)
    except UserError as e:  # no run dirs under a RUNS
        raise SystemExit(f"practice_page.py: {e}") from None
    write(args.page, runs, read_bench(args.bench))
    print(f"wrote {args.page} from {len(runs.rows)} runs")


if __name__ == "__main__":
    main()
