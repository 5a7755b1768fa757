"""Same seed, same run: a tiny training run's metrics equal a reference file recorded before the
structure change (every key but the timing ones), so refactors cannot silently
change what training computes.

The reference was made with the code before that change by
    python tests/test_same_seed_same_run.py tests/data/reference_metrics.jsonl
(another CPU may round differently, hence the 1e-5 relative tolerance)."""
import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REFERENCE = HERE / "data" / "reference_metrics.jsonl"
TIMING_KEYS = {"tokens_per_sec", "ms_per_iter", "mfu"}
OVERRIDES = ["model=debug", "model.n_layer=2", "model.n_head=2", "model.n_embd=32", "model.block_size=32",
             "device=cpu", "logger.wandb.mode=disabled", "train.max_iters=40", "train.eval_interval=10",
             "train.eval_iters=2", "train.log_interval=5", "train.batch_size=4", "train.grad_accum=2",
             "train.warmup_iters=5", "seed=7"]


def corpus(path: Path) -> Path:
    """A deterministic corpus: varied lines, a few thousand characters."""
    lines = [f"{i:03d} the quick brown fox {'jumps' if i % 3 else 'leaps'} over {i * 7 % 13} lazy dogs;"
             for i in range(300)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def run_metrics(tmp: Path) -> list:
    from helpers import compose_cfg
    from lab.tracking import read_metrics
    from train import train

    data = corpus(tmp / "corpus.txt")
    cfg = compose_cfg("config", OVERRIDES + [f"data.path={data}", f"out_dir={tmp / 'run'}",
                                             f"data.cache_dir={tmp / 'cache'}"])
    train(cfg)
    return [{k: v for k, v in m.items() if k not in TIMING_KEYS} for m in read_metrics(tmp / "run")]


def test_metrics_equal_the_reference_run(tmp_path):
    reference = [json.loads(line) for line in REFERENCE.read_text().splitlines()]
    got = run_metrics(tmp_path)
    assert [m["step"] for m in got] == [m["step"] for m in reference]
    for a, b in zip(got, reference):
        # metrics added later may add keys; every recorded key must still be there, with its value
        assert b.keys() <= a.keys(), f"step {a['step']}: keys missing: {sorted(b.keys() - a.keys())}"
        for key in b:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), f"step {a['step']} {key}: {a[key]} vs {b[key]}"


if __name__ == "__main__":  # write the reference file
    import tempfile

    sys.path[:0] = [str(HERE), str(HERE.parent)]
    with tempfile.TemporaryDirectory() as tmp:
        lines = run_metrics(Path(tmp))
    Path(sys.argv[1]).write_text("".join(json.dumps(m) + "\n" for m in lines))
    print(f"wrote {len(lines)} lines to {sys.argv[1]}")
