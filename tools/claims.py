"""The teaching texts' claims, checked on this machine through attnlab's own code.

    python tools/claims.py --quick                 # every claim in seconds; the trained checks skipped
    python tools/claims.py                         # and the trained checks at CPU size: a few minutes
    python tools/claims.py --only A2,A3 --seed 1   # some claims; another seed, other digits, same rounded figures
    python tools/claims.py --format json --json claims.json   # JSON on stdout and in a file
    python tools/claims.py --format markdown       # the table of docs/claims.md

attnlab is built from three teaching texts on attention (A, B, C; docs/claims.md lists, in our words,
what they claim that a program can check). Each claim is one small function in claims/ (a.py, b.py,
c.py: one file per text) that measures its figure at run time, through the code the texts describe in
attnlab: the attention function (its sdpa, reference and tiled paths), the model, lab/counting.py's counts,
the KV caches, linear attention, and small models trained by train.train on the embedded corpus. A row
prints what the text says with its figure, what attnlab measured, what "holds" requires (the tolerance),
and the verdict: holds, FAILS, holds in part (the rest not in attnlab yet), not shown at this size (a
trained check whose effect the small model does not show), not checkable yet, or skipped (--quick: it
needs training).
Nothing is a stored number: a change that breaks a claim fails its row, and the exit status is 1.

Random measurements take --seed; each claim draws from its own generator (seed and claim id), so --only
gives the same figures as the whole run. The training runs use train.py's own seed (1337): their figures
are the same on every run of the same code on the same kind of machine. --out DIR receives the training
runs, the figures (claims_entropy.png, claims_qk_norm.png), claims.json and claims.md. Adding a claim is
one function under @claim in its text's file; tests/tools/test_claims.py holds every id of CLAIMS.md to
exactly one row.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as tools/X.py: the repo's modules

from claims import markdown_table, run_claims, text_table  # noqa: E402
from files import check_output_dir, check_output_file  # noqa: E402
from lab.cli import cli  # noqa: E402
from rules import UserError  # noqa: E402


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
    out = check_output_dir(args.out, "--out") if args.out else None  # before minutes of checks
    if args.json:
        check_output_file(args.json, "--json")
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
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(content, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    if out is not None:
        (out / "claims.md").write_text(markdown_table(rows) + "\n", encoding="utf-8")
        print(f"wrote {out / 'claims.json'}, {out / 'claims.md'}", file=sys.stderr)
    return 1 if any(r["status"] == "fails" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
