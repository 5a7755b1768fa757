"""A real sweep through the CLI, then report.py over its runs."""
import json
import math
import struct
from pathlib import Path

import pytest
import torch

from rules import UserError
from helpers import wandb_run_record
from tools.report import report


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def test_two_run_sweep_then_report(tmp_path, cli):
    sweep = tmp_path / "sweep"
    """`python train.py -m ... seed=1,2` then the report: two arms of two seeds, W&B runs grouped by arm,
    the arms' means, their paired difference and the band plots."""
    r = cli("train.py", "-m", "model=debug", "train.max_iters=20", "train.eval_interval=10",
            "train.eval_iters=2", "train.batch_size=4", "device=cpu", f"data.cache_dir={tmp_path / 'cache'}",
            "model.attn.scale=sqrt_dk,none", "seed=1,2", f"hydra.sweep.dir={sweep}", "logger.wandb.mode=offline",
            env={"WANDB_DIR": str(tmp_path / "wandb_env")})
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(p for p in sweep.iterdir() if (p / "metrics.jsonl").is_file())
    assert len(runs) == 4 and len(set(runs)) == 4
    assert "scale=none" in runs[2].name and "seed=2" in runs[3].name  # named by their overrides
    identities = []
    for run in runs:  # one W&B run per job; the seeds of an arm are one group
        offline = list((run / "wandb").glob("offline-run-*"))
        assert len(offline) == 1 and (run / "best.pt").is_file()
        identities.append(wandb_run_record(offline[0]))
    groups = [i["group"] for i in identities]
    assert groups[0] == groups[1] != groups[2] == groups[3] and groups[0].startswith("sweep/")
    assert "seed" not in groups[0] and "model.attn.scale=none" in groups[2]
    assert len({i["id"] for i in identities}) == 4 and "seed=2" in identities[3]["name"]

    result = report([str(sweep)])
    arms_table = result["table"].split("\n\n")[0]  # the first table: one row per arm (then the comparisons)
    table_rows = [l for l in arms_table.splitlines() if l.startswith("| model.attn.scale=")]
    assert len(table_rows) == 2 and all(row.split("|")[2].strip() == "2" for row in table_rows)  # n = 2 seeds each
    import json
    finals = [[json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if "val/loss_full" in l][-1]
              ["val/loss_full"] for run in runs]
    assert f"{(finals[2] + finals[3]) / 2:.4f}" in table_rows[1]  # the arm's mean of its seeds' final loss
    (c,) = result["comparisons"]
    assert c["test"] == "paired t" and c["diff"] == pytest.approx((finals[2] - finals[0] + finals[3] - finals[1]) / 2)
    out = result["files"][-1].parent  # the default: a new SWEEP/report/<time>/ per call
    assert out.parent == sweep / "report"
    for name in ("val_loss.png", "attn_stats.png", "val_loss_diff.png", "report.md"):
        assert (out / name).is_file()
    w, h = png_size(out / "val_loss.png")
    assert w >= 600 and h >= 400


def test_a_sweep_runs_every_arm_when_one_arm_ignores_a_setting(tmp_path, cli):
    """`python train.py -m train.optimizer=adamw,muon train.muon_lr=0.01`: the Muon lr does nothing in the
    AdamW arm. Both arms run (a refusal there would stop the sweep at its first job); the AdamW run
    warns once at its start and lists the setting in its run_info.json, the Muon run lists nothing,
    and the report names it under the AdamW arm."""
    sweep = tmp_path / "sweep"
    r = cli("train.py", "-m", "model=debug", "train.max_iters=4", "train.eval_interval=4", "train.eval_iters=1",
            "train.batch_size=4", "device=cpu", f"data.cache_dir={tmp_path / 'cache'}", "logger.wandb.mode=disabled",
            "logger.plots=false",
            "train.optimizer=adamw,muon", "train.muon_lr=0.01", f"hydra.sweep.dir={sweep}")
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(p for p in sweep.iterdir() if (p / "metrics.jsonl").is_file())
    assert len(runs) == 2 and "optimizer=adamw" in runs[0].name and "optimizer=muon" in runs[1].name
    line = "train.muon_lr=0.01 has no effect unless train.optimizer=muon: ignored (its default is None)"
    assert [json.loads((run / "run_info.json").read_text())["ignored_settings"] for run in runs] == [[line], []]
    assert r.stderr.count(line) == 1
    result = report([str(sweep)])
    listed = [l for l in result["table"].splitlines() if l.startswith("- ")]
    assert listed == [f"- train.optimizer=adamw: {line}"]


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


# ----------------------------------------------------------------------------- arms, intervals, tests, verdicts

T975 = {2: 4.302652729749464, 4: 2.7764451051977934}  # Student t's 0.975 quantiles (printed tables)


def fake_run(root, name, config, final, curve=(2.5, 2.0)):
    """A run dir as train.py leaves it, with a given resolved config and final whole-val-split loss."""
    import yaml
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    lines = [{"step": 0, "val/loss": curve[0]}, {"step": 10, "val/loss": curve[1]},
             {"step": 20, "val/loss": final + 0.01, "val/loss_full": final}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    return run


def cfg(qk_norm, seed, data_seed=None, lr=1e-3):
    return {"seed": seed, "out_dir": f"/tmp/{seed}", "model": {"n_layer": 2, "attn": {"qk_norm": qk_norm}},
            "train": {"lr": lr, "data_seed": data_seed}, "logger": {"wandb": {"mode": "disabled"}}}


def test_arms_means_intervals_and_the_paired_test_by_hand(tmp_path):
    sweep = tmp_path / "sweep"
    a, b = [1.80, 1.78, 1.79], [1.76, 1.75, 1.78]
    for i, seed in enumerate((1, 2, 3)):
        fake_run(sweep, f"{i}_a", cfg(False, seed), a[i])
        fake_run(sweep, f"{3 + i}_b", cfg(True, seed), b[i])
    r = report([str(sweep)])
    arm_a, arm_b = r["arms"]
    assert (arm_a.label, arm_b.label) == ("model.attn.qk_norm=False", "model.attn.qk_norm=True")
    half = T975[2] * 0.01 / math.sqrt(3)  # sd of a: 0.01
    assert f"1.7900 ± 0.0100 | {1.79 - half:.4f} to {1.79 + half:.4f}" in r["table"]
    (c,) = r["comparisons"]
    d = [y - x for x, y in zip(a, b)]
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    t = mean / (sd / math.sqrt(3))
    assert c["test"] == "paired t" and c["diff"] == pytest.approx(mean) and c["half"] == pytest.approx(T975[2] * sd / math.sqrt(3))
    # p of |t| = 3.024 with 2 degrees of freedom: 2 (1 - F(t)), F of Student's t with 2 dof in closed form
    assert c["p"] == pytest.approx(1 - abs(t) / math.sqrt(2 + t * t), rel=1e-9)
    assert "within noise (-0.0267 ± 0.0379)" in r["table"] and "paired t, n=3" in r["table"]
    assert "Student t" in r["table"] and "Welch" in r["table"]  # the footnote names the tests
    out = r["files"][-1].parent  # the default: a new SWEEP/report/<time>/
    assert out.parent == sweep / "report" and (out / "val_loss_diff.png").is_file() and (out / "val_loss.png").is_file()


def test_arms_with_other_seeds_are_compared_by_welch_and_lone_runs_get_no_interval(tmp_path):
    a, c = [1.80, 1.78, 1.79], [1.70, 1.72, 1.71]
    for i in range(3):
        fake_run(tmp_path / "s1", f"a{i}", cfg(False, i + 1), a[i])
        fake_run(tmp_path / "s2", f"c{i}", cfg(True, i + 4), c[i])  # other seeds: nothing to pair
    lone_cfg = cfg(False, 1)
    lone_cfg["model"]["n_layer"] = 3
    fake_run(tmp_path, "lone", lone_cfg, 1.5)  # another config (at the same lr: an lr sweep compares at equal lr), one run
    r = report([str(tmp_path / "s1"), str(tmp_path / "s2"), str(tmp_path / "lone")], out=tmp_path / "out")
    labels = [arm.label for arm in r["arms"]]
    assert len(labels) == 3 and sum(len(arm.runs) for arm in r["arms"]) == 7
    welch = next(x for x in r["comparisons"] if x["test"] == "Welch t")
    # equal variances 1e-4 and n = 3 each: Welch's degrees of freedom are exactly 2 (n - 1) = 4
    assert welch["df"] == pytest.approx(4) and welch["diff"] == pytest.approx(-0.08)
    assert welch["half"] == pytest.approx(T975[4] * math.sqrt(2e-4 / 3))
    assert f"lower by 0.0800 ± {T975[4] * math.sqrt(2e-4 / 3):.4f}" in r["table"]
    lone = [x for x in r["comparisons"] if "n_layer=3" in x["a"] + x["b"]]
    assert lone and all(x["half"] is None for x in lone) and "no interval can be given" in r["table"]
    assert "one run: none" in r["table"]


def test_the_data_seed_shares_batches_across_arms_and_changes_them_across_seeds(train_cfg, tmp_path):
    import train as train_module

    def first_batches(*overrides, name):
        run = train_module.setup(train_cfg("train.max_iters=2", f"out_dir={tmp_path / name}", *overrides))
        try:
            starts = run.data.sample_starts("train", (3, 4), run.mcfg.block_size, run.sampler)
            probe = run.probe.idx.clone()
        finally:
            run.tracker.close()
            run.lock.close()
        return starts, probe, run.model.wte.weight.detach().clone()
    a = first_batches("seed=1", "train.data_seed=7", name="a")
    b = first_batches("seed=2", "train.data_seed=7", "model.attn.qk_norm=true", name="b")  # another arm
    c = first_batches("seed=1", "train.data_seed=8", name="c")  # another data seed
    d = first_batches("seed=5", name="d")  # unset: the data follows the seed
    e = first_batches("seed=5", "train.data_seed=5", name="e")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # same batches and probe text
    assert not torch.equal(a[2], b[2])  # other weights
    assert not torch.equal(a[0], c[0]) and torch.equal(a[2], c[2])  # other batches, same weights
    assert torch.equal(d[0], e[0]) and torch.equal(d[1], e[1])


def test_runs_of_an_older_version_join_the_arm_of_their_settings(tmp_path):
    """Runs made before an option existed lack its key; newer runs with the same settings carry it at its
    default. They are one arm, labelled by what really differs (not as many arms as versions, with
    labels full of `(unset)`); a key that newer runs set to different values still tells arms apart."""
    for s in (1, 2):
        fake_run(tmp_path, f"old{s}", cfg(False, s), 1.80 + s / 100)
    new_cfg = lambda qk, s, gate: {**cfg(qk, s), "model": {"n_layer": 2, "attn": {"qk_norm": qk, "gate": gate}}}
    fake_run(tmp_path, "new3", new_cfg(False, 3, "none"), 1.83)
    for s in (1, 2, 3):
        fake_run(tmp_path, f"qk{s}", new_cfg(True, s, "none"), 1.75)
    r = report([str(tmp_path)], out=tmp_path / "out")
    assert sorted((a.label, len(a.runs)) for a in r["arms"]) == [("model.attn.qk_norm=False", 3),
                                                                  ("model.attn.qk_norm=True", 3)]
    fake_run(tmp_path, "gated", new_cfg(True, 1, "head"), 1.70)  # now the key tells arms apart: the old runs,
    labels = sorted(a.label for a in report([str(tmp_path)], out=tmp_path / "out2")["arms"])  # without it, apart too
    assert labels == ["model.attn.gate=(unset), model.attn.qk_norm=False", "model.attn.gate=head, model.attn.qk_norm=True",
                      "model.attn.gate=none, model.attn.qk_norm=False", "model.attn.gate=none, model.attn.qk_norm=True"]


def test_the_report_gives_each_arms_first_token_mass_and_largest_activation(tmp_path):
    """The sink columns: the last probe's weight on the first token, mean over heads and the top
    head's, and its largest activation, each as mean ± sd over the arm's seeds (computed here by hand)."""
    sweep = tmp_path / "sweep"
    heads = {1: [0.10, 0.30, 0.02, 0.06], 2: [0.12, 0.26, 0.04, 0.02]}  # L0/H0, L0/H1, L1/H0, L1/H1
    acts = {1: 120.0, 2: 80.0}
    for seed in (1, 2):
        run = fake_run(sweep, f"{seed}", cfg(False, seed), 1.8)
        probe = {"step": 20, "attn_entropy/mean": 2.0, "act_max/max": acts[seed], "attn_first/L0": 0.2,
                 **{f"attn_first/L{i // 2}/H{i % 2}": v for i, v in enumerate(heads[seed])}}
        with open(run / "metrics.jsonl", "a") as f:
            f.write(json.dumps(probe) + "\n")
    result = report([str(sweep)])
    row = result["table"].splitlines()[2]  # the one arm's row
    means = [sum(h) / 4 for h in heads.values()]
    tops = [max(h) for h in heads.values()]
    sd = lambda v: abs(v[0] - v[1]) / math.sqrt(2)  # noqa: E731 (the sd of two values)
    assert (f"| {sum(means) / 2:.3f} ± {sd(means):.3f} / {sum(tops) / 2:.3f} ± {sd(tops):.3f} | "
            f"100.0 ± {sd(list(acts.values())):.1f} |") in row
    sinks = result["files"][-1].parent / "sinks.png"  # in the default SWEEP/report/<time>/
    assert sinks in result["files"] and png_size(sinks)[0] >= 600


def test_runs_started_from_each_seeds_own_parent_are_one_arm_apart_from_scratch_runs():
    """init_from differs with the seed (each seed's fine-tune starts from that seed's full run): the
    arm groups them by whether they started from weights, not by whose."""
    from lab.arms import RunSummary, group_arms

    def run(seed, **config):
        return RunSummary(Path(f"/r/{len(config)}/{seed}"), {"seed": seed, "model.attn.window": None,
                                                             "init_from": None, **config}, [], {}, (seed, seed))
    runs = [run(s) for s in (1, 2, 3)] + \
        [run(s, **{"init_from": f"/r/full/s{s}", "model.attn.window": 32}) for s in (1, 2, 3)] + \
        [run(1, **{"model.attn.window": 32})]
    arms = group_arms(runs)
    assert [len(a.runs) for a in arms] == [3, 3, 1]
    assert [sorted(r.seed for r in a.runs) for a in arms] == [[1, 2, 3], [1, 2, 3], [1]]
    assert "init_from=another run" in arms[1].label and "init_from=None" in arms[2].label


def test_an_arms_label_leaves_out_keys_that_could_not_act_in_it():
    """Two sweeps reported together: select_block and select_topk differ between their arms, but in an arm
    without selection they do nothing, so its label must not read like a selecting arm (it did: recall.py
    labelled a softmax arm `select_block=64, select_topk=4`)."""
    from lab.arms import RunSummary, group_arms

    def run(seed, **changed):
        config = {"seed": seed, "model.attn.kind": "softmax", "model.attn.layer_kinds": None,
                  "model.attn.select": "none", "model.attn.select_block": 64, "model.attn.select_topk": 4,
                  "model.pos": "rope", "model.rope_base": 10000.0, **changed}
        return RunSummary(Path(f"/r/{sorted(changed.items())}/{seed}"), config, [], {}, (seed, seed))
    moba = {"model.attn.select": "moba", "model.attn.select_block": 8, "model.attn.select_topk": 1}
    hybrid = {"model.attn.layer_kinds": ["gdn", "softmax"], "model.attn.select_block": 8, "model.attn.select_topk": 1}
    nope = {"model.pos": "none", "model.rope_base": 500.0}
    inert = {"model.attn.select_block": 32}  # set, but without selection it does nothing: the same arm
    arms = group_arms([run(1), run(2), run(1, **moba), run(1, **hybrid), run(1, **nope), run(3, **inert)])
    labels = [a.label for a in arms]
    assert [len(a.runs) for a in arms] == [3, 1, 1, 1]
    assert "select_block" not in labels[0] and "select_topk" not in labels[0] and "rope_base" in labels[0]
    assert "model.attn.select_block=8" in labels[1] and "model.attn.select_topk=1" in labels[1]
    assert "select_block" not in labels[2] and "model.attn.kind" not in labels[2]  # layer_kinds names the kinds
    assert "rope_base" not in labels[3] and "model.pos=none" in labels[3]  # no RoPE: its base does nothing


def test_a_run_given_twice_or_within_its_sweep_dir_is_counted_once(tmp_path):
    for i, loss in enumerate((1.80, 1.78)):
        fake_run(tmp_path / "sweep", f"a{i}", cfg(False, i + 1), loss)
    one = tmp_path / "sweep" / "a0"
    r = report([str(tmp_path / "sweep"), str(one), str(one) + "/"], out=tmp_path / "out")
    assert [len(arm.runs) for arm in r["arms"]] == [2]  # not 4: n = 2, the interval over two seeds
    from lab.arms import find_runs
    assert find_runs([str(one), str(tmp_path / "sweep" / ".." / "sweep" / "a0")]) == [one]
