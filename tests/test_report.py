"""A real sweep through the CLI, then report.py over its runs."""
import struct

import pytest

from common import UserError
from helpers import wandb_run_record
from tools.report import report


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def test_two_run_sweep_then_report(tmp_path, cli):
    sweep = tmp_path / "sweep"
    r = cli("train.py", "-m", "model=debug", "train.max_iters=20", "train.eval_interval=10",
                "train.eval_iters=2", "train.batch_size=4", "device=cpu", f"data.cache_dir={tmp_path / 'cache'}",
                "model.attn.scale=sqrt_dk,none", f"hydra.sweep.dir={sweep}", "logger.wandb.mode=offline",
                env={"WANDB_DIR": str(tmp_path / "wandb_env")})
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(p for p in sweep.iterdir() if (p / "metrics.jsonl").is_file())
    assert len(runs) == 2 and runs[0] != runs[1]
    assert "scale=none" in runs[1].name  # named by their overrides
    identities = []
    for run in runs:  # one W&B run per job, grouped by the sweep, named by its overrides
        offline = list((run / "wandb").glob("offline-run-*"))
        assert len(offline) == 1 and (run / "best.pt").is_file()
        identities.append(wandb_run_record(offline[0]))
    assert identities[0]["group"] == identities[1]["group"] == "sweep"
    assert identities[0]["id"] != identities[1]["id"]
    assert "model.attn.scale=none" in identities[1]["name"]
    cfgs = [(run / "config.yaml").read_text() for run in runs]
    assert "scale: sqrt_dk" in cfgs[0] and "scale: none" in cfgs[1]

    result = report([str(sweep)])
    table_rows = [l for l in result["table"].splitlines() if l.startswith("| model.attn.scale=")]
    assert len(table_rows) == 2
    for name in ("val_loss.png", "attn_stats.png", "report.md"):
        assert (sweep / name).is_file()
    w, h = png_size(sweep / "val_loss.png")
    assert w >= 600 and h >= 400
    png_size(sweep / "attn_stats.png")
    # the table's val loss is the last eval line of each run
    import json
    last = [json.loads(l) for l in (runs[1] / "metrics.jsonl").read_text().splitlines() if "val/loss" in l][-1]
    assert f"{last['val/loss']:.4f}" in table_rows[1]


def test_report_cli_on_missing_dir_is_one_line_error(tmp_path, cli):
    r = cli("tools/report.py", str(tmp_path / "nope"))
    assert r.returncode != 0 and "error:" in r.stderr and "Traceback" not in r.stderr


def test_report_on_missing_or_empty_dirs_is_one_line_error(tmp_path):
    """The test above in-process (so this module has a fast test): a missing dir, and a dir without runs."""
    with pytest.raises(UserError, match="is not a run dir or a sweep dir") as e:
        report([str(tmp_path / "nope")])
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="no metrics.jsonl under"):
        report([str(tmp_path)])
