"""Training stability as results: the mitigations against their formulas (z-loss, attention soft-cap,
lr-independent weight decay, the lr floor as a fraction), divergence and collapse detection (the watch,
a real run, a two-job sweep), the sweep around its jobs, and the LR-sensitivity arithmetic of the
report on made-up run dirs."""
import json
import math
import statistics

import pytest
import torch
import torch.nn.functional as F
import yaml

from lab.device import setup_runtime
from helpers import REPO, SHAKESPEARE, TINY, compose_cfg, requires_shared
from lab.attnstats import logit_bound
from model import GPT, GPTConfig
from lab.optim import build_optimizer, lr_at, set_lr
from rules import UserError
from lab.stability import Watch, spike_score, z_loss_term
from lab.config import short_name
from train import train_step

CPU32 = setup_runtime("cpu", "float32")


def tiny(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{"vocab_size": 23, "block_size": 12, "n_layer": 2, "n_head": 2, "n_embd": 16, **kw}))


# ----------------------------------------------------------------------------- the mitigations, each against its formula

def test_z_loss_adds_the_mean_squared_log_partition_to_the_gradient_and_reports_log_z():
    """train.z_loss = c: the step descends CE + c * mean((log sum_v exp logit_v)^2) (PaLM), the loss it
    reports stays the CE, and log Z is the mean over positions; targets -1 are left out of both."""
    c = 0.5  # large, so the term shows in every gradient
    x = torch.randint(23, (3, 12), generator=torch.Generator().manual_seed(1))
    y = torch.roll(x, -1, 1)
    y[0, :4] = -1
    a, b = tiny(), tiny()
    extra = {}
    opt = torch.optim.SGD(a.parameters(), lr=0.0)  # lr 0: the step leaves the gradients to read
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    opt.zero_grad = lambda set_to_none=True: None  # keep the gradients after the step
    loss, _, _ = train_step(a, opt, [(x, y)], 1, 0.0, CPU32, scaler, z_loss=c, extra=extra)
    logits = b(x)
    lse = torch.logsumexp(logits.double(), dim=-1)[y != -1]  # written out, in float64
    ce = F.cross_entropy(logits.view(-1, 23), y.view(-1), ignore_index=-1)
    (ce + c * (lse ** 2).mean()).backward()
    assert loss.item() == pytest.approx(ce.item(), rel=1e-6)
    assert extra["log_z"].item() == pytest.approx(lse.mean().item(), rel=1e-5)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), n
    z_sq, z = z_loss_term(logits, y)
    assert z_sq.item() == pytest.approx((lse ** 2).mean().item(), rel=1e-5) and z.item() == pytest.approx(lse.mean().item(), rel=1e-5)


def test_per_block_gradient_norms_are_the_norms_of_each_blocks_gradients_before_clipping():
    """train.log_layer_grads: train_step(layers=blocks) reports ||grad|| of each block's parameters, taken
    before clipping (grad_clip 1e-3 here, far below them), against the norms computed from the gradients."""
    x = torch.randint(23, (2, 12), generator=torch.Generator().manual_seed(2))
    a = tiny()
    extra = {}
    opt = torch.optim.SGD(a.parameters(), lr=0.0)
    opt.zero_grad = lambda set_to_none=True: None  # keep the (clipped) gradients after the step
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    b = tiny()
    _, loss = b(x, torch.roll(x, -1, 1))
    loss.backward()
    train_step(a, opt, [(x, torch.roll(x, -1, 1))], 1, 1e-3, CPU32, scaler, extra=extra, layers=a.blocks)
    for i, block in enumerate(b.blocks):
        by_hand = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in block.parameters()))
        assert extra[f"grad_norm/L{i}"].item() == pytest.approx(by_hand, rel=1e-5)
        assert by_hand > 1e-2  # so the clip to 1e-3 would have shown


@pytest.mark.parametrize("impl", ["sdpa", "reference"])
def test_softcap_is_c_tanh_of_the_scaled_scores_before_the_mask(impl):
    """model.attn.softcap=c: the layer's output is softmax(c*tanh(q.k*scale/c) + M) v written out (Gemma 2),
    whatever model.attn.impl (the capped layer attends by the written-out path); what the probe reads
    (CausalSelfAttention.scores) is those capped scores, all below c; and the logit bound says c."""
    c = 2.0
    model = tiny(attn={"softcap": c, "impl": impl, "scale": "none"})  # scale 1: raw logits well above c
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.c_attn.weight.mul_(30)  # logits well beyond c
    x = torch.randn(2, 12, 16)
    q, k, v = attn.qkv(x, model.rope_at(0, 12))
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    s = q.double() @ k.double().transpose(-2, -1) * attn.scale
    assert s.abs().max() > 2 * c  # the cap has something to do
    capped = c * torch.tanh(s / c)
    i = torch.arange(12)
    want = torch.softmax(capped.masked_fill(i[None, :] > i[:, None], float("-inf")), -1) @ v.double()
    with torch.no_grad():
        got = attn(x, rope=model.rope_at(0, 12))
        want_out = attn.c_proj(want.float().transpose(1, 2).reshape(2, 12, 16))
        assert torch.allclose(got, want_out, atol=1e-5)
        scores, _ = attn.scores(q.transpose(1, 2), k.transpose(1, 2))
    seen = scores[torch.isfinite(scores)]
    assert seen.abs().max() <= c and torch.allclose(scores.double(), capped.masked_fill(
        i[None, :] > i[:, None], float("-inf")), atol=1e-5)
    assert logit_bound(attn) == c
    plain = tiny(attn={"impl": impl, "scale": "none"}).blocks[0].attn  # the cap is the only change
    assert plain.softcap is None and logit_bound(plain) is None


def test_softcap_with_qk_norm_bounds_by_the_smaller_and_is_refused_where_scores_are_never_written():
    m = tiny(attn={"softcap": 3.0, "qk_norm": True})
    assert logit_bound(m.blocks[0].attn) == pytest.approx(min(3.0, math.sqrt(8)))  # sqrt(d_k) = sqrt(8)
    with pytest.raises(UserError, match="softcap"):
        tiny(attn={"softcap": 3.0, "impl": "tiled"})
    lines = GPTConfig(vocab_size=23, n_head=2, n_embd=16, attn={"softcap": 3.0, "kind": "gdn"}).ignored
    assert any("softcap" in line for line in lines)  # no softmax, no logits to cap: said, not silently dropped


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_independent_weight_decay_shrinks_by_the_schedule_times_wd_whatever_the_peak_lr(optimizer):
    """train.weight_decay_mode=independent (Wortsman et al.): with zero gradients (Adam's update is then 0)
    a decayed weight becomes w * (1 - lr_t / lr * wd), for any peak lr; coupled: w * (1 - lr_t * wd)."""
    for mode, lr in [("independent", 1e-3), ("independent", 0.3), ("coupled", 0.3)]:
        t = compose_cfg("config", [f"train.optimizer={optimizer}", f"train.lr={lr}", "train.weight_decay=0.2",
                                   f"train.weight_decay_mode={mode}", "train.warmup_iters=10"]).train
        model = tiny()
        before = model.wte.weight.detach().clone()
        opt = build_optimizer(model, t, torch.device("cpu"))
        lr_t = lr_at(3, t)  # in the warmup: lr_t / lr = 4/11
        set_lr(opt, lr_t)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        factor = 1 - (lr_t / lr if mode == "independent" else lr_t) * 0.2
        assert torch.allclose(model.wte.weight, before * factor, rtol=1e-6), (mode, lr)


def test_min_lr_ratio_floors_every_lr_at_the_same_fraction_and_one_floor_must_be_set(train_cfg):
    from lab.config import check_train_config
    for lr in (1e-3, 1e-1):
        t = train_cfg(f"train.lr={lr}", "train.min_lr=null", "train.min_lr_ratio=0.1", "train.warmup_iters=0").train
        assert lr_at(t.max_iters, t) == pytest.approx(0.1 * lr)
        assert lr_at(t.max_iters // 2, t) == pytest.approx(0.1 * lr + 0.5 * 0.9 * lr)  # cos(pi/2) = 0
    with pytest.raises(UserError, match="exactly one floor"):
        check_train_config(train_cfg("train.min_lr_ratio=0.1"))  # min_lr's default too: both set
    with pytest.raises(UserError, match="exactly one floor"):
        check_train_config(train_cfg("train.min_lr=null"))
    # the lr * wd rule is the coupled mode's; independent has its own, wd < 1
    check_train_config(train_cfg("train.lr=5", "train.weight_decay=0.5", "train.weight_decay_mode=independent"))
    with pytest.raises(UserError, match="weight_decay_mode=independent"):
        check_train_config(train_cfg("train.lr=5", "train.weight_decay=0.5"))
    with pytest.raises(UserError, match="weight_decay=1.5"):
        check_train_config(train_cfg("train.weight_decay=1.5", "train.weight_decay_mode=independent"))


# ----------------------------------------------------------------------------- the watch

def probe_line(entropies, logits):
    return {**{f"attn_entropy/L{l}": e for l, e in enumerate(entropies)},
            **{f"attn_logit_max/L{l}": v for l, v in enumerate(logits)}}


def test_watch_diverges_after_three_evals_at_or_above_step_zero_and_after_too_many_nonfinite_steps(caplog):
    w = Watch()
    for step, val in [(0, 4.0), (50, 3.0), (100, 4.0), (150, 4.5), (200, 3.9), (250, 4.0), (300, 4.0)]:
        w.see(step, {"val/loss": val})
        assert w.stop is None, step  # a run that recovers between high evals is not diverged
    w.step(310, 2.5, 1.0)
    w.see(350, {"val/loss": float("nan")})  # NaN counts as at or above
    assert w.stop == {"step": 350, "reason": w.stop["reason"], "last_finite_loss": 2.5}
    assert "3 evaluations in a row" in w.stop["reason"]
    r = w.results()
    assert r["diverged"] and r["diverged_step"] == 350 and r["val_loss_step0"] == 4.0
    w2 = Watch()
    w2.step(0, 3.0, 1.0)
    w2.step(1, float("nan"), float("nan"))
    w2.nonfinite(2, float("nan"), 0)
    assert w2.results()["diverged_step"] == 2 and w2.results()["diverged_last_finite_loss"] == 3.0


def test_watch_warns_each_collapsed_layer_once_and_keeps_the_runs_extremes(caplog):
    w = Watch(collapse_entropy=0.1)
    with caplog.at_level("WARNING", logger="attnlab"):
        w.see(0, probe_line([2.0, 2.1], [3.0, 4.0]))
        w.see(50, probe_line([0.05, 1.5], [900.0, 20.0]))
        w.see(100, probe_line([0.01, 0.08], [5000.0, 300.0]))
        w.see(150, probe_line([0.5, 0.02], [40.0, 30.0]))
    warned = [r.getMessage() for r in caplog.records if "collapsed" in r.getMessage()]
    assert len(warned) == 2 and "layer L0" in warned[0] and "step 50" in warned[0] and "qk_norm" in warned[0]
    assert "layer L1" in warned[1] and "step 100" in warned[1]
    r = w.results()
    assert r["collapsed_layers"] == ["L0", "L1"] and r["collapse"]["L0"]["logit_max"] == 900.0
    assert r["attn_logit_max_run"] == 5000.0 and r["attn_entropy_min_run"] == 0.01  # not the last probe's
    off = Watch(collapse_entropy=0.0)
    off.see(0, probe_line([0.0], [1e4]))
    assert off.results()["collapsed_layers"] == []


def test_spike_score_is_the_share_of_values_beyond_k_sigma_of_the_window_before():
    rng = torch.Generator().manual_seed(0)
    values = (2.0 + 0.01 * torch.randn(400, generator=rng)).tolist()
    values[250] = 3.0
    values[300] = float("nan")  # left out
    brute, judged = 0, 0
    finite = [v for v in values if math.isfinite(v)]
    for i in range(20, len(finite)):
        before = finite[i - 20:i]
        judged += 1
        brute += finite[i] > statistics.fmean(before) + 7 * statistics.pstdev(before)
    assert spike_score(values, window=20, sigma=7) == pytest.approx(brute / judged) and brute == 1
    assert spike_score(values[:20], window=20) is None


def test_a_diverging_run_stops_early_records_it_and_a_lone_run_raises_one_line(train_cfg, tmp_path):
    """lr 5 without clipping (the recipe): the val loss stays above its step-0 value; the run stops at
    the third such eval, records where in results.json and metrics.jsonl, and train() returns it."""
    from train import train
    cfg = train_cfg("train.lr=5", "train.grad_clip=0", "train.warmup_iters=0", "train.max_iters=60",
                    "train.eval_interval=5", "train.log_interval=5", "model.n_embd=64", "model.n_head=2")
    result = train(cfg)
    assert result["diverged"] and result["steps"] < 60 and result["diverged_step"] == result["steps"]
    saved = json.loads((tmp_path / "run" / "results.json").read_text())
    assert saved["diverged"] and saved["diverged_step"] == result["steps"] and saved["val_loss_step0"] > 0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["diverged"] == 1 and lines[-1]["step"] == result["steps"]
    evals = [m["val/loss"] for m in lines if "val/loss" in m]
    assert all(v >= evals[0] for v in evals[-3:])  # the rule, read back from the metrics


@pytest.mark.slow
@requires_shared(SHAKESPEARE)
def test_collapse_warning_fires_at_lr_3e_2_without_qk_norm_and_not_at_1e_3(cli, tmp_path):
    """The issue's runs: 4 x 4 x 128, block 64, batch 16, warmup 30 on tiny shakespeare (here 60
    steps, the probe reads it at step 50): at lr 3e-2 without QK-Norm the probe's entropy collapses and the run
    says so; at 1e-3 not."""
    common = ["experiment=lr_sensitivity_cpu", f"data.path={SHAKESPEARE}", "device=cpu", "compile=false",
              "logger.wandb.mode=disabled", "train.max_iters=60", f"data.cache_dir={tmp_path / 'cache'}"]
    out = {}
    for lr in ("3e-2", "1e-3"):
        r = cli("train.py", *common, f"train.lr={lr}", f"hydra.run.dir={tmp_path / lr}", timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        out[lr] = (r.stderr, json.loads((tmp_path / lr / "results.json").read_text()))
    assert "collapsed" in out["3e-2"][0] and out["3e-2"][1]["collapsed_layers"]
    assert out["3e-2"][1]["attn_logit_max_run"] > 100
    assert "collapsed" not in out["1e-3"][0] and not out["1e-3"][1]["collapsed_layers"]


@pytest.mark.slow
def test_a_sweep_with_a_diverging_job_completes_and_counts_it(cli, tmp_path):
    r = cli("train.py", "-m", *TINY, "compile=false", "train.max_iters=60", "train.eval_interval=5",
            "train.grad_clip=0", "train.warmup_iters=0", "model.n_embd=64", "model.n_head=2", "train.lr=1e-3,5",
            f"hydra.sweep.dir={tmp_path / 'sweep'}", f"data.cache_dir={tmp_path / 'cache'}", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # the healthy job's 60 steps learn little more than token frequencies: finished, or at the unigram loss
    assert r.stderr.strip().splitlines()[-1].startswith(("sweep done: 2 jobs: 1 finished, 1 diverged, 0 failed",
                                                         "sweep done: 2 jobs: 0 finished, 1 diverged, 0 failed, 1 at"))
    results = sorted((tmp_path / "sweep").glob("*/results.json"))
    assert [json.loads(p.read_text())["diverged"] for p in results] == [False, True]
    assert r.stderr.count("diverged at step") == 1  # its line once on the console ...
    assert "diverged at step" in (results[1].parent / "train.log").read_text()  # ... and in its train.log
    outcome = json.loads(results[1].read_text())
    assert outcome["outcome"] == "diverged" and outcome["outcome_step"] == outcome["diverged_step"]
    assert "diverged" in outcome["outcome_why"] or outcome["outcome_why"] == outcome["diverged_reason"]


def test_the_sweep_callback_keeps_a_lone_runs_failure_and_counts_a_sweep_jobs():
    """Hydra calls on_job_end for a lone run too: its failure must stay a failure (exit 1 from
    `python train.py`, and from every process of torchrun); only a sweep's job is counted and passed."""
    from hydra.core.utils import JobReturn, JobStatus
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from lab.sweep import SweepReport

    for mode, kept in ((RunMode.RUN, JobStatus.FAILED), (RunMode.MULTIRUN, JobStatus.COMPLETED)):
        job = JobReturn(overrides=["train.lr=5"], status=JobStatus.FAILED, _return_value=RuntimeError("boom"),
                        hydra_cfg=OmegaConf.create({"hydra": {"mode": mode, "job": {"num": 3}}}))
        report = SweepReport()
        report.on_job_end(None, job)
        assert job.status == kept
        assert report.failed == ([] if mode == RunMode.RUN else [("job 3 (train.lr=5)", "boom")])


@pytest.mark.slow
def test_a_sweep_refuses_a_bad_arm_before_any_job_and_goes_past_a_failing_one(cli, tmp_path):
    r = cli("train.py", "-m", *TINY, "compile=false", "train.lr=1e-3,3", "train.weight_decay=0.5",
            f"hydra.sweep.dir={tmp_path / 'sweep'}", f"data.cache_dir={tmp_path / 'cache'}", timeout=300)
    assert r.returncode == 1 and "job 1" in r.stderr and "no job was started" in r.stderr
    assert not list((tmp_path / "sweep").glob("*/metrics.jsonl"))
    r = cli("train.py", "-m", *TINY, "train.lr=1e-3,1e-3", f"hydra.sweep.dir={tmp_path / 'twice'}", timeout=300)
    assert r.returncode == 1 and "the same job twice (train.lr=0.001 listed more than once)" in r.stderr and not (tmp_path / "twice").exists()
    # a job that fails once running (its data file is missing; the check needs no file) does not end the sweep
    r = cli("train.py", "-m", *TINY, "compile=false", "data=text", f"data.path={tmp_path / 'absent.txt'},"
            f"{tmp_path / 'absent2.txt'}", f"hydra.sweep.dir={tmp_path / 'sweep2'}",
            f"data.cache_dir={tmp_path / 'cache'}", timeout=300)
    assert r.returncode == 1, r.stderr[-2000:]
    assert r.stderr.count("error: ") >= 2  # both jobs ran and failed, each with its line
    assert "sweep done: 2 jobs: 0 finished, 0 diverged, 2 failed" in r.stderr


@pytest.mark.slow
def test_a_sweep_through_the_submitit_launcher_runs_its_jobs(cli, tmp_path):
    """The cluster route: Hydra's submitit launcher pickles the task as its SLURM mode does (its local mode
    runs each job in a process of its own); two jobs finish and the sweep's last line counts them."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")  # requirements-eval.txt installs it
    r = cli("train.py", "-m", "hydra/launcher=submitit_local", *TINY, "compile=false", "seed=1,2",
            f"hydra.sweep.dir={tmp_path / 'sweep'}", f"data.cache_dir={tmp_path / 'cache'}", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = sorted(p.parent for p in (tmp_path / "sweep").glob("*/results.json"))
    assert len(runs) == 2 and all(json.loads((p / "results.json").read_text())["steps"] == 20 for p in runs)
    assert "sweep done: 2 jobs: 2 finished, 0 diverged, 0 failed" in r.stderr


def test_a_sweep_that_would_run_the_same_job_twice_is_found_before_any_job():
    from omegaconf import OmegaConf

    from lab.sweep import repeated_jobs

    def config(task, params=None):
        return OmegaConf.create({"hydra": {"sweeper": {"params": params}, "overrides": {"task": task}}})
    assert repeated_jobs(config(["train.lr=1e-3,0.001", "seed=1,2"])) == ["train.lr=0.001"]  # one value twice
    assert repeated_jobs(config(["train.lr=1e-3,3e-3", "seed=1,2"])) == []
    assert repeated_jobs(config(["seed=1"], {"train.lr": "1e-3,1e-3"})) == ["train.lr=0.001"]  # an experiment's grid


def test_job_directory_names_stay_short_and_apart(monkeypatch):
    long_a = ",".join(f"model.attn.option_{i}=value_{i}" for i in range(40))
    long_b = long_a.replace("value_39", "value_x")
    assert short_name("train.lr=0.1") == "train.lr=0.1"
    a, b = short_name(long_a), short_name(long_b)
    assert len(a.encode()) <= 200 and len(b.encode()) <= 200 and a != b and a.startswith("model.attn.option_0=")
    monkeypatch.setattr("sys.argv", ["train.py", "-m", "model.attn.option_39=value_39,value_x"])
    assert short_name(long_a).startswith("model.attn.option_39=value_39,")  # the swept key first: it tells jobs apart
    subdir = yaml.safe_load((REPO / "configs" / "config.yaml").read_text())["hydra"]["sweep"]["subdir"]
    assert "${short:${hydra.job.override_dirname}}" in subdir  # what Hydra names each job's dir by
    from omegaconf import OmegaConf
    assert OmegaConf.create({"d": long_a, "s": "${short:${d}}"}).s == short_name(long_a)  # the resolver is registered


# ----------------------------------------------------------------------------- the report's LR view

def make_run(root, name, lr, qk, seed, loss, loss0=4.0, diverged=False, logit=10.0):
    d = root / name
    d.mkdir(parents=True)
    cfg = {"seed": seed, "train": {"lr": lr, "data_seed": None}, "model": {"attn": {"qk_norm": qk}}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = [{"step": 0, "val/loss": loss0}, {"step": 0, "attn_entropy/L0": 2.0, "attn_logit_max/L0": 1.0},
             {"step": 100, "attn_entropy/L0": 0.5, "attn_logit_max/L0": logit}]
    if not diverged:
        lines.append({"step": 100, "val/loss": loss, "val/loss_full": loss})
    else:
        lines += [{"step": 60, "val/loss": loss}, {"step": 60, "diverged": 1, "diverged_step": 60}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (d / "results.json").write_text(json.dumps({"diverged": diverged, "val_loss_step0": loss0,
                                                "attn_logit_max_run": logit}))


def test_lr_view_computes_wortsman_sensitivity_per_seed_with_diverged_runs_at_the_step0_loss(tmp_path):
    from tools.report import report
    lrs = [1e-3, 1e-2, 1e-1]
    # arm A (no QK-Norm): seed 1 diverges at 0.1, seed 2 is bad there; arm B (QK-Norm) is flat
    losses = {(False, 1): [2.2, 2.0, 9.0], (False, 2): [2.3, 2.1, 3.0], (True, 1): [2.1, 2.0, 2.05],
              (True, 2): [2.1, 2.05, 2.1]}
    for (qk, seed), row in losses.items():
        for lr, loss in zip(lrs, row):
            make_run(tmp_path, f"{qk}-{seed}-{lr}", lr, qk, seed, loss, diverged=(not qk and seed == 1 and lr == 0.1),
                     logit=1e4 if not qk and lr == 0.1 else 5.0)
    result = report([str(tmp_path)], out=str(tmp_path / "out"))
    arms = {a.label: a for a in result["lr_arms"]}
    a, b = arms["model.attn.qk_norm=False"], arms["model.attn.qk_norm=True"]
    # by hand: seed 1 of A counts 0.1 at L0 = 4.0: mean(2.2, 2.0, 4.0) - 2.0
    want_a = {1: statistics.fmean([2.2, 2.0, 4.0]) - 2.0, 2: statistics.fmean([2.3, 2.1, 3.0]) - 2.1}
    want_b = {1: statistics.fmean([2.1, 2.0, 2.05]) - 2.0, 2: statistics.fmean([2.1, 2.05, 2.1]) - 2.05}
    assert {k[0]: v for k, v in a.per_seed_sensitivity().items()} == pytest.approx(want_a)
    assert {k[0]: v for k, v in b.per_seed_sensitivity().items()} == pytest.approx(want_b)
    lr_best, best = b.best()
    assert lr_best == 1e-2 and best == pytest.approx(2.025)
    assert b.edge()["whole"] == 2  # every lr within 0.1 nats of each seed's best
    # A, seed 1: best 2.0 at 1e-2, 4.0 (diverged, counted at L0) at 1e-1: best + 0.1 crossed at
    # log10 lr = -2 + (2.1 - 2.0) / (4.0 - 2.0); seed 2: best 2.1 at 1e-2, 3.0 at 1e-1: -2 + 0.1 / 0.9
    logs = [-2 + 0.1 / 2.0, -2 + 0.1 / 0.9]
    e = a.edge()
    assert e["lr"] == pytest.approx(10 ** statistics.fmean(logs)) and e["whole"] == 0 and e["n"] == 2
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Learning-rate sweep" in md and "1 / 0 of 6" in md and "paired t" in md
    d = [want_b[s] - want_a[s] for s in (1, 2)]
    assert f"{statistics.fmean(d):+.3f}" in md
    assert (tmp_path / "out" / "loss_vs_lr.png").stat().st_size > 0
    assert (tmp_path / "out" / "logit_entropy_steps.png").stat().st_size > 0


def test_a_report_of_runs_with_one_lr_has_no_lr_view(tmp_path):
    from tools.report import report
    for seed in (1, 2):
        make_run(tmp_path, f"r{seed}", 1e-3, False, seed, 2.0 + seed / 10)
    result = report([str(tmp_path)], out=str(tmp_path / "out"))
    assert result["lr_arms"] is None and "Learning-rate sweep" not in result["table"]


def lr_sweep(root, rows: dict, diverged=(), min_lr_ratio=None):
    """Runs {(qk, seed): {lr: loss}} of an lr sweep (diverged: the (qk, seed, lr) that diverged)."""
    for (qk, seed), curve in rows.items():
        for lr, loss in curve.items():
            make_run(root, f"{qk}-{seed}-{lr}", lr, qk, seed, loss, diverged=(qk, seed, lr) in diverged)
            if min_lr_ratio is not None:
                cfg = yaml.safe_load((root / f"{qk}-{seed}-{lr}" / "config.yaml").read_text())
                cfg["train"]["min_lr"] = lr * min_lr_ratio
                (root / f"{qk}-{seed}-{lr}" / "config.yaml").write_text(yaml.safe_dump(cfg))


def test_an_arm_where_every_run_diverged_has_no_sensitivity_and_says_so(tmp_path):
    from tools.report import report
    rows = {(False, s): {1e-2: 9.0, 1e-1: 9.0} for s in (1, 2)} | {(True, s): {1e-2: 2.0, 1e-1: 2.2} for s in (1, 2)}
    lr_sweep(tmp_path, rows, diverged={(False, s, lr) for s in (1, 2) for lr in (1e-2, 1e-1)})
    result = report([str(tmp_path)], out=str(tmp_path / "out"))
    dead = next(a for a in result["lr_arms"] if "False" in a.label)
    assert dead.per_seed_sensitivity() == {} and dead.best() == (None, None)
    md = result["table"]
    assert "no lr trains here (every run diverged or ended at the unigram loss)" in md and "0.000 ± 0.000" not in md
    assert "no sensitivity in model.attn.qk_norm=False" in md  # no difference printed against it


def test_an_arm_with_one_lr_has_no_sensitivity_and_no_difference_is_printed(tmp_path):
    from tools.report import report
    rows = {(False, s): {1e-2: 2.0 + s / 100} for s in (1, 2)} | \
        {(True, s): {1e-3: 2.3, 1e-2: 2.0 + s / 50} for s in (1, 2)}
    lr_sweep(tmp_path, rows)
    result = report([str(tmp_path)], out=str(tmp_path / "out"))
    one = next(a for a in result["lr_arms"] if "False" in a.label)
    assert one.per_seed_sensitivity() == {} and one.unknowable().startswith("one lr (0.01)")
    assert "1 lr in common: no comparison" in result["table"]


def test_arms_over_different_grids_are_compared_on_their_common_lrs_and_it_is_said(tmp_path):
    from lab.lr_view import compare_sensitivity
    from tools.report import report
    a = {1e-3: 2.2, 1e-2: 2.0, 1e-1: 3.0}
    b = {1e-3: 2.1, 1e-2: 2.0, 1e-1: 2.05, 3e-1: 2.5}
    lr_sweep(tmp_path, {(False, 1): a, (False, 2): {k: v + 0.05 for k, v in a.items()},
                        (True, 1): b, (True, 2): {k: v + 0.02 for k, v in b.items()}})
    result = report([str(tmp_path)], out=str(tmp_path / "out"))
    x, y = sorted(result["lr_arms"], key=lambda arm: arm.label)
    c = compare_sensitivity(x, y)
    common = [1e-3, 1e-2, 1e-1]  # 3e-1 left out: by hand, each seed's sensitivity over these three
    want = [statistics.fmean([b[lr] + d for lr in common]) - min(b[lr] + d for lr in common)
            - (statistics.fmean([a[lr] + e for lr in common]) - min(a[lr] + e for lr in common))
            for d, e in ((0, 0), (0.02, 0.05))]
    assert c["diff"] == pytest.approx(statistics.fmean(want))
    assert c["note"] == "on the common lrs only: 0.001, 0.01, 0.1" and c["note"] in result["table"]


def test_a_per_run_floor_of_lr_over_ten_keeps_the_runs_in_one_arm(tmp_path):
    from tools.report import report
    lr_sweep(tmp_path, {(False, s): {1e-3: 2.2, 1e-2: 2.0 + s / 100} for s in (1, 2)}, min_lr_ratio=0.1)
    result = report([str(tmp_path)], out=str(tmp_path / "out"))
    assert len(result["lr_arms"]) == 1 and len(result["lr_arms"][0].points) == 4


def test_an_lr_sweep_compares_arms_at_equal_lr_never_across_lrs(tmp_path):
    from tools.report import report
    rows = {(qk, s): {1e-3: 2.2 + qk / 10, 1e-2: 2.0 + s / 100} for qk in (False, True) for s in (1, 2)}
    lr_sweep(tmp_path, rows)
    result = report([str(tmp_path)], out=str(tmp_path / "out"))
    lr_of = {a.label: a.runs[0].config["train.lr"] for a in result["arms"]}
    assert result["comparisons"] and all(lr_of[c["a"]] == lr_of[c["b"]] for c in result["comparisons"])
    assert len(result["comparisons"]) == 2  # qk_norm=True against False, at 1e-3 and at 1e-2



# ----------------------------------------------------------------------------- a run's one outcome

@pytest.mark.slow
def test_a_run_that_learns_only_token_frequencies_ends_as_unigram(train_cfg, tmp_path, caplog):
    """Text of independent characters (a skewed five-letter alphabet) has nothing to learn but how often each
    comes: the run ends within the margin of the val split's unigram loss, which results.json records as
    recomputed here from the prepared token files (counts + 1, in float64), and its outcome and log say so."""
    import random
    from collections import Counter

    import numpy as np

    from train import train
    rng = random.Random(0)
    (tmp_path / "iid.txt").write_text("".join(rng.choices("abcde", weights=[50, 20, 15, 10, 5], k=30000)))
    with caplog.at_level("INFO", logger="attnlab"):
        train(train_cfg("data=text", f"data.path={tmp_path / 'iid.txt'}", "train.max_iters=60", "train.lr=1e-2",
                        "train.warmup_iters=5", "train.eval_interval=30"))
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    prepared = next((tmp_path / "cache").rglob("meta.json")).parent
    meta = json.loads((prepared / "meta.json").read_text())
    train_ids, val_ids = (np.fromfile(prepared / f"{s}.bin", dtype=meta["dtype"]).tolist() for s in ("train", "val"))
    counts, total = Counter(train_ids), len(train_ids) + meta["vocab_size"]
    want = -sum(math.log((counts[t] + 1) / total) for t in val_ids) / len(val_ids)
    assert res["unigram_loss"] == pytest.approx(want, rel=1e-9)
    assert res["outcome"] == "unigram" and res["outcome_step"] == 60 and "unigram loss" in res["outcome_why"]
    said = [r for r in caplog.records if r.levelname == "WARNING" and "ended at the unigram loss" in r.getMessage()]
    assert len(said) == 1 and f"unigram loss {want:.3f}" in said[0].getMessage()


def test_the_sweep_counts_each_outcome_and_names_the_unigram_runs(capsys):
    from lab.sweep import SweepReport
    report = SweepReport()
    for name, result in [("job 0", {"outcome": "finished"}), ("job 1", {"outcome": "unigram"}),
                         ("job 2", {"diverged": True}), ("job 3", {})]:  # older runs: no outcome recorded
        report.count(name, result)

    class Config:
        class hydra:
            class sweep:
                dir = "."
    report.on_multirun_end(Config)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("sweep done: 4 jobs: 2 finished, 1 diverged, 0 failed, 1 at the unigram loss")
    assert "at the unigram loss (learned token frequencies only): job 1" in line


def test_the_lr_table_and_the_report_mark_unigram_and_stopped_runs(tmp_path):
    from tools.report import report
    lr_sweep(tmp_path, {(False, s): {1e-3: 2.2, 1e-2: 3.34} for s in (1, 2)})
    for s in (1, 2):  # both runs at 1e-2 ended at the unigram loss; one at 1e-3 was stopped at step 80
        res = tmp_path / f"False-{s}-0.01" / "results.json"
        res.write_text(json.dumps({**json.loads(res.read_text()), "outcome": "unigram", "outcome_step": 100}))
    res = tmp_path / "False-2-0.001" / "results.json"
    res.write_text(json.dumps({**json.loads(res.read_text()), "outcome": "stopped", "outcome_step": 80}))
    md = report([str(tmp_path)], out=str(tmp_path / "out"))["table"]
    assert "| 3.340 ± 0.000 ‡ ‡ |" in md and "0 / 2 of 4" in md
    assert "1 finished; seed 2 stopped at step 80" in md  # the arm table's outcomes column


def test_a_blow_up_is_blamed_on_the_setting_that_caused_it_naming_the_users_key(train_cfg):
    """train.z_loss=1e30 overflows at step 0: the line names train.z_loss, not model.* or the data; a
    divergence under a weight decay that halves the weights every step names that key, not the lr."""
    from omegaconf import OmegaConf

    from lab.stability import diverged_line, suspects
    from train import train
    with pytest.raises(UserError) as e:
        train(train_cfg("train.z_loss=1e30"))
    line = str(e.value)
    assert "\n" not in line and "train.z_loss=1e+30" in line and "model." not in line
    assert "last good checkpoint: none: nothing was trained yet" in line
    tcfg = OmegaConf.create({"lr": 1e-3, "optimizer": "muon", "muon_lr": 0.02, "weight_decay": 0.1,
                             "muon_weight_decay": 30.0, "weight_decay_mode": "coupled", "z_loss": 0.0})
    assert suspects(tcfg) == ["train.muon_weight_decay=30.0 (shrinks every matrix by 60% per step at the peak)"]
    line = diverged_line({"diverged_step": 9, "diverged_reason": "the loss was not finite", "lr": 1e-3,
                          "suspects": suspects(tcfg)})
    assert line.endswith("lower train.muon_weight_decay=30.0 (shrinks every matrix by 60% per step at the peak)")
    assert "train.lr" not in line
    assert suspects(OmegaConf.create({**tcfg, "muon_weight_decay": 0.1})) == []  # 0.2% a step: nothing to blame


def test_a_second_sweep_into_the_same_dir_keeps_the_first_ones_record(tmp_path, capsys):
    from lab.sweep import keep_earlier_record
    (tmp_path / "multirun.yaml").write_text("first: sweep\n")
    keep_earlier_record(tmp_path)
    kept = list(tmp_path.glob("multirun.*.yaml"))
    assert len(kept) == 1 and kept[0].read_text() == "first: sweep\n" and not (tmp_path / "multirun.yaml").exists()
    assert f"kept as {kept[0].name}" in capsys.readouterr().err
    keep_earlier_record(tmp_path / "absent")  # a new sweep dir: nothing to keep, nothing said
    assert capsys.readouterr().err == ""
