"""The teaching texts' claims as checks (tools/claims.py is the command; its docstring says what a row
shows): running them (run_claims), their tables (text, markdown) and figures. The registry and what the
checks share are in common.py; the checks themselves in a.py, b.py and c.py, one file per text,
imported here in order so that CLAIMS lists them A1-A11, B1-B4, C1-C12."""
import textwrap
import time
from pathlib import Path

import torch

import claims.a  # noqa: F401  (each registers its checks in CLAIMS, text by text)
import claims.b  # noqa: F401
import claims.c  # noqa: F401
from claims.common import CLAIMS, STATUSES, TRAINING_RUNS, Context, layer_max, probes  # noqa: F401
from lab.attnstats import logit_bound
from rules import UserError


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
    from lab.plots import plt, save_figure
    written = []
    if "scaled" in runs and "unscaled" in runs:
        fig, (ex, px) = plt.subplots(1, 2, figsize=(11, 4))
        for name, label, color in (("scaled", "scale 1/√d_k", "C0"), ("unscaled", "no scale", "C3")):
            ex.plot(*probes(runs[name], "attn_entropy/mean"), "o-", color=color, label=label, ms=3)
            px.plot(*probes(runs[name], "attn_peak/mean"), "o-", color=color, label=label, ms=3)
        ex.set(xlabel="step", ylabel="mean attention entropy (nats)", title="entropy falls further without 1/√d_k")
        px.set(xlabel="step", ylabel="mean peak weight", title="the largest weight (1 would be one-hot)")
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
