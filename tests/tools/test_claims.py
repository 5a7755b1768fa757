"""tools/claims.py and the claims package: every claim of the texts has exactly one row, the quick checks hold, random
measurements keep their rounded figures under another seed, a broken code path fails its claim
(a check that cannot fail checks nothing), and the trained checks run end to end at a tiny size."""
import json
import re

import pytest

import attention
from helpers import REPO, requires_shared
import claims
import claims.common
from tools.claims import main

CLAIMS_MD = REPO.parent / "shared" / "CLAIMS.md"
IDS = [c.id for c in claims.CLAIMS]
HOLDING = {"holds", "partial"}  # "partial": the checkable part holds, the rest is named as missing


@pytest.fixture(scope="module")
def quick_rows():
    return {r["id"]: r for r in claims.run_claims(quick=True, seed=0)}


def test_every_claim_has_exactly_one_row_in_order(quick_rows):
    assert len(IDS) == len(set(IDS)) == len(quick_rows)
    assert IDS == [f"A{i}" for i in range(1, 12)] + [f"B{i}" for i in range(1, 5)] + [f"C{i}" for i in range(1, 13)]


@requires_shared(CLAIMS_MD)
def test_the_ids_are_those_of_claims_md():
    listed = re.findall(r"^([ABC]\d+)\. ", CLAIMS_MD.read_text(encoding="utf-8"), flags=re.M)
    assert sorted(listed) == sorted(IDS) and len(listed) == len(set(listed))


def test_quick_claims_hold_and_only_trained_ones_are_skipped(quick_rows):
    for c in claims.CLAIMS:
        r = quick_rows[c.id]
        assert r["status"] in HOLDING | {"skipped"}, f"{c.id}: {r['verdict']}: {r['measured']}"
        assert r["status"] != "skipped" or c.trains, f"{c.id} is skipped but needs no training"
        assert r["measured"] and (r["tolerance"] or r["status"] == "skipped"), c.id  # a verdict states its bar
        assert r["zh"] and r["says"]
    assert {i for i, r in quick_rows.items() if r["status"] == "skipped"} == {"C7", "C11"}


def test_partial_and_missing_parts_are_named(quick_rows):
    """A claim only partly checkable says what is missing; C10's fronts and C12's alternatives (linear,
    Mamba-2, Gated DeltaNet, hybrids) are all in attnlab."""
    assert quick_rows["C12"]["status"] == "holds" and "the recall part: full run" in quick_rows["C12"]["measured"]
    assert quick_rows["C10"]["status"] == "holds" and "not in attnlab" in quick_rows["C10"]["note"]


def test_another_seed_gives_other_digits_and_the_same_rounded_figures(quick_rows):
    other = {r["id"]: r for r in claims.run_claims(quick=True, seed=1, only=["A2", "A3"])}
    for i in ("A2", "A3"):
        assert other[i]["status"] == "holds"
        assert other[i]["rounded"] == quick_rows[i]["rounded"] and quick_rows[i]["rounded"]
        assert other[i]["figures"] != quick_rows[i]["figures"]


def test_only_gives_the_same_figures_as_the_whole_run(quick_rows):
    alone = claims.run_claims(quick=True, seed=0, only=["A3", "C5"])
    for r in alone:
        assert r["figures"] == quick_rows[r["id"]]["figures"]


def test_removing_the_scale_fails_a1_and_a3(monkeypatch):
    monkeypatch.setattr(attention, "resolve_scale", lambda scale, head_dim: 1.0)
    rows = {r["id"]: r for r in claims.run_claims(quick=True, only=["A1", "A3"])}
    assert rows["A1"]["status"] == rows["A3"]["status"] == "fails"


def test_a_leaking_mask_fails_c6(monkeypatch):
    monkeypatch.setattr(attention.Mask, "__call__", lambda self, device=None, q0=0, q1=None, k0=0, k1=None:
                        attention.torch.ones((q1 or self.Tq) - q0, (k1 or self.Tk) - k0, dtype=attention.torch.bool))
    (row,) = claims.run_claims(quick=True, only=["C6"])
    assert row["status"] == "fails" and row["figures"]["earlier"]["reference"] > 1e-5


def test_cli_json_markdown_and_exit_status(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["--quick", "--only", "b1,C2", "--format", "json", "--json", str(tmp_path / "c.json"),
                        "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [r["id"] for r in printed["claims"]] == ["B1", "C2"] and printed["quick"]
    assert json.loads((tmp_path / "c.json").read_text()) == json.loads((out / "claims.json").read_text())
    assert "| C2 |" in (out / "claims.md").read_text()
    assert main(["--quick", "--only", "C2", "--format", "markdown"]) == 0
    assert "论断" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--quick", "--only", "Z9"])
    assert "no such claim" in capsys.readouterr().err


def test_text_table_has_one_row_per_claim_and_a_summary(quick_rows):
    table = claims.text_table(list(quick_rows.values()))
    starts = [line.split()[0] for line in table.splitlines()[2:] if line[:1].strip()]
    assert starts[:-1] == IDS and starts[-1] == "27"  # "27 claims: ..."
    assert "2 skipped (--quick)" in table.splitlines()[-1]


def test_named_tests_exist():
    for c in claims.CLAIMS:
        for name in c.tests:
            path, test = name.split("::")
            assert re.search(rf"^def {test}\(", (REPO / path).read_text(), flags=re.M), name


def test_docs_show_every_claim_with_its_command():
    doc = (REPO / "docs" / "claims.md").read_text(encoding="utf-8")
    for i in IDS:
        assert re.search(rf"^\| {i} \|", doc, flags=re.M), i
        assert f"python tools/claims.py --only {i}`" in doc, i


@pytest.mark.slow
def test_trained_checks_run_end_to_end_at_a_tiny_size(tmp_path, monkeypatch):
    """The full run's code path (train.train, checkpoints, figures), a few steps per run: each trained
    check returns a verdict (not its figure: 6 steps train nothing)."""
    tiny = {name: overrides + ["train.max_iters=6", "train.eval_interval=3", "train.log_attn_interval=3",
                               "train.warmup_iters=2", "train.eval_iters=2", "model.n_layer=2", "logger.plots=false"]
            for name, overrides in claims.TRAINING_RUNS.items()}
    monkeypatch.setattr(claims.common, "TRAINING_RUNS", tiny)  # where the runs are read (claims/common.py)
    trained = [c.id for c in claims.CLAIMS if c.trains]
    rows = claims.run_claims(quick=False, out=tmp_path, only=trained, log=lambda msg: None)
    assert [r["id"] for r in rows] == trained
    assert all(r["status"] in claims.STATUSES and r["status"] != "skipped" for r in rows)
    assert (tmp_path / "claims_entropy.png").stat().st_size > 0 and (tmp_path / "claims_qk_norm.png").is_file()
    with pytest.raises(claims.UserError, match="exists"):  # runs are never overwritten
        claims.run_claims(quick=False, out=tmp_path, only=["C7"])


@pytest.mark.parametrize("flag,where", [("--out", "a_file"), ("--json", "a_dir"), ("--json", "/proc/claims.json"),
                                        ("--out", "/proc/claims")])
def test_output_paths_are_checked_before_any_claim_runs(tmp_path, capsys, monkeypatch, flag, where):
    """A bad --out or --json is one line before the checks run (they take minutes with training), and
    nothing is written; a --json into a folder not made yet is made."""
    (tmp_path / "a_file").write_text("keep me\n")
    (tmp_path / "a_dir").mkdir()
    ran = []
    monkeypatch.setattr("tools.claims.run_claims", lambda *a, **k: ran.append(1) or [])
    path = where if where.startswith("/") else str(tmp_path / where)
    with pytest.raises(SystemExit) as e:
        main(["--quick", "--only", "A2", flag, path])
    assert e.value.code == 1 and not ran
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {flag}=")
    assert (tmp_path / "a_file").read_text() == "keep me\n" and not list((tmp_path / "a_dir").iterdir())
    main(["--quick", "--only", "A2", "--json", str(tmp_path / "new" / "deeper" / "c.json")])
    assert json.loads((tmp_path / "new" / "deeper" / "c.json").read_text())["quick"] is True
