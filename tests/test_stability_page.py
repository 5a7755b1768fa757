"""scripts/stability_page.py on made-up run dirs: the page's table and the figures other pages quote
(docs/stability.json) against the LR sensitivity and the paired difference computed here by hand."""
import importlib.util
import json
import math
import statistics

import pytest
import yaml

from helpers import REPO

GRID = [3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]


def page_script():
    spec = importlib.util.spec_from_file_location("stability_page", REPO / "scripts" / "stability_page.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_run(root, exp, i, lr, qk, scale, seed, loss, loss0=4.2):
    d = root / exp / str(i)
    d.mkdir(parents=True)
    cfg = {"seed": seed, "train": {"lr": lr}, "model": {"attn": {"qk_norm": qk, "scale": scale}}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = [{"step": 0, "val/loss": loss0}, {"step": 400, "attn_entropy/L0": 1.0, "attn_logit_max/L0": 5.0},
             {"step": 400, "val/loss": loss, "val/loss_full": loss}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (d / "results.json").write_text(json.dumps({"diverged": False, "val_loss_step0": loss0, "outcome": "finished",
                                                "attn_logit_max_run": 5.0 if qk else 100.0 * lr,
                                                "attn_entropy_min_run": 1.0}))
    (d / "train.log").write_text("[2026-01-01 00:00:00,000][x] start\n[2026-01-01 00:00:40,000][x] done\n")


def test_the_page_is_written_from_the_runs_with_the_sensitivity_computed_by_hand(tmp_path):
    curve = {False: [2.3, 2.1, 2.0, 2.1, 2.5, 2.9, 3.1], True: [2.2, 2.05, 2.0, 2.01, 2.05, 2.1, 2.15]}
    shift = {1: 0.0, 2: 0.02, 3: -0.01}  # each seed a little apart, so intervals are not zero
    i = 0
    for qk in (False, True):
        for scale in ("sqrt_dk", "none"):
            for seed, dx in shift.items():
                for lr, loss in zip(GRID, curve[qk]):
                    bump = dx * (1 + GRID.index(lr) / 6) if not qk else dx  # seeds differ in shape without QK-Norm
                    make_run(tmp_path / "runs", "e1_qkn" if qk else "e1_noqkn", i, lr, qk, scale, seed, loss + bump)
                    i += 1
    docs = tmp_path / "docs"
    docs.mkdir()
    page = docs / "stability.md"
    script = page_script()
    page.write_text("# head\n\nkept as written\n\n" + script.MARKER + "\nold text\n")
    script.main([str(tmp_path / "runs"), "--page", str(page)])
    text = page.read_text()
    assert text.startswith("# head\n\nkept as written\n\n" + script.MARKER) and "old text" not in text
    assert "from 84 run dirs" in text and "56 minutes of one core" in text  # 84 runs x 40 s

    def sensitivity(qk, seed):  # Wortsman et al.'s, written out: mean of min(L, L0) - L* over the grid
        losses = [loss + (shift[seed] * (1 + k / 6) if not qk else shift[seed]) for k, loss in enumerate(curve[qk])]
        return statistics.fmean(losses) - min(losses)

    none = [sensitivity(False, s) for s in shift]
    normed = [sensitivity(True, s) for s in shift]
    figures = json.loads((docs / "stability.json").read_text())["lr_sensitivity"]
    assert figures["no_qk_norm"][0] == pytest.approx(statistics.fmean(none))
    assert figures["qk_norm"][0] == pytest.approx(statistics.fmean(normed))
    d = [b - a for a, b in zip(none, normed)]
    half = 4.302652729911275 * statistics.stdev(d) / math.sqrt(3)  # t(0.975, 2 df)
    assert figures["qk_norm_minus_none"] == pytest.approx([statistics.fmean(d), statistics.fmean(d) - half,
                                                           statistics.fmean(d) + half])
    row = next(line for line in text.splitlines() if line.startswith("| 1/√d_k, no QK-Norm |"))
    assert f"{statistics.fmean(curve[False][0] + shift[s] for s in shift):.3f}" in row.split("|")[2]
    assert "Not on this page: RUNS lacks one of e2_zloss" in text  # a missing sweep is said, not skipped silently
    assert (docs / "stability_loss_vs_lr.png").stat().st_size > 0


def test_a_runs_dir_without_runs_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as e:
        page_script().main([str(tmp_path), "--page", str(tmp_path / "page.md")])
    assert "no metrics.jsonl under" in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "page.md").exists()
