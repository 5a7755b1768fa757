"""scripts/practice_page.py on made-up run dirs (the width axis's sensitivities and fitted slope, the longer runs'
paired best-loss difference, against the formulas written out here), and scripts/bench_controls.py's output
read back by the page."""
import importlib.util
import json
import math
import statistics
import sys

import pytest
import yaml

from helpers import REPO

T1 = 12.706204736174707  # t(0.975) with 1 degree of freedom
T4 = 2.7764451051977987  # t(0.975) with 4


def script(name):
    sys.path.insert(0, str(REPO / "scripts"))
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_run(root, exp, i, lr, seed, loss, qk=False, width=128, loss0=4.2, **train):
    d = root / exp / str(i)
    d.mkdir(parents=True)
    cfg = {"seed": seed, "train": {"lr": lr, **train},
           "model": {"n_embd": width, "attn": {"qk_norm": qk, "scale": "sqrt_dk"}}}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = [{"step": 0, "val/loss": loss0}, {"step": 400, "val/loss": loss, "val/loss_full": loss}]
    (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    (d / "results.json").write_text(json.dumps({"diverged": False, "val_loss_step0": loss0, "outcome": "finished",
                                                "attn_logit_max_run": 5.0, "attn_entropy_min_run": 1.0}))
    (d / "train.log").write_text("[2026-01-01 00:00:00,000][x] start\n[2026-01-01 00:00:30,000][x] done\n")


LRS = [1e-3, 1e-2, 3e-2, 1e-1]
SEED_SHIFT = {1: 0.0, 2: 0.03}


def curve(width, qk, seed):
    """Made-up final losses over LRS: without QK-Norm the rise past the best lr grows with the width."""
    rise = 0.0 if qk else {64: 0.2, 128: 0.4, 256: 0.7}[width]
    return [2.1 + SEED_SHIFT[seed], 2.0, 2.0 + rise * (1 + SEED_SHIFT[seed]), 2.0 + 2 * rise]


def write_width_runs(root):
    i = 0
    for width, exp in ((64, "w64"), (128, None), (256, "w256")):
        for qk in (False, True):
            for seed in SEED_SHIFT:
                for lr, loss in zip(LRS, curve(width, qk, seed)):
                    name = exp or ("e1_qkn" if qk else "e1_noqkn")
                    make_run(root, name, i, lr, seed, loss, qk=qk, width=width)
                    i += 1


def test_the_width_axis_sensitivities_and_slope_match_the_formulas(tmp_path):
    write_width_runs(tmp_path / "runs")
    page = tmp_path / "practice.md"
    mod = script("practice_page")
    page.write_text("# head\n\n" + mod.MARKER + "\nold\n")
    mod.main([str(tmp_path / "runs"), "--page", str(page)])
    text = page.read_text()
    assert text.startswith("# head\n\n" + mod.MARKER) and "\nold\n" not in text
    figures = json.loads((tmp_path / "practice.json").read_text())["width"]

    def sens(width, qk, seed):  # Wortsman et al.'s, written out: mean over the grid of min(L, L0) - the best
        losses = curve(width, qk, seed)
        return statistics.fmean(losses) - min(losses)

    for qk, key in ((False, "no_qk_norm"), (True, "qk_norm")):
        for width in (64, 128, 256):
            assert figures[key]["sensitivity"][str(width)] == pytest.approx(
                statistics.fmean(sens(width, qk, s) for s in SEED_SHIFT))
    # the slope per decade of parameters, least squares written out, and its 95% t half-interval (4 df)
    xs = [math.log10(n) for n in figures["params"] for _ in SEED_SHIFT]
    ys = [sens(w, False, s) for w in (64, 128, 256) for s in SEED_SHIFT]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    se = math.sqrt(sum((y - my - b * (x - mx)) ** 2 for x, y in zip(xs, ys)) / 4 / sxx)
    assert figures["no_qk_norm"]["slope_per_decade"] == pytest.approx([b, T4 * se])
    assert figures["qk_norm"]["slope_per_decade"][0] == pytest.approx(0, abs=1e-12)  # flat curves: 0 at every width
    assert figures["params"][1] == 4 * 12 * 128 ** 2 + 65 * 128 + 9 * 128  # blocks, tied embedding, 9 norms
    assert "Not on this page: RUNS has no l_noqkn, l_qkn." in text  # a missing sweep is said


def test_the_longer_runs_compare_each_seeds_best_loss_paired(tmp_path):
    root = tmp_path / "runs"
    write_width_runs(root)  # the 400-step runs (e1_*) the longer ones are set beside
    long = {False: {1: [1.80, 1.75, 1.90], 2: [1.82, 1.74, 1.95]}, True: {1: [1.78, 1.70, 1.72], 2: [1.79, 1.73, 1.69]}}
    i = 1000
    for qk, exp in ((False, "l_noqkn"), (True, "l_qkn")):
        for seed, losses in long[qk].items():
            for lr, loss in zip([3e-3, 1e-2, 3e-2], losses):
                make_run(root, exp, i, lr, seed, loss, qk=qk, max_iters=2000)
                i += 1
    page = tmp_path / "practice.md"
    mod = script("practice_page")
    page.write_text(mod.MARKER + "\n")
    mod.main([str(root), "--page", str(page)])
    figures = json.loads((tmp_path / "practice.json").read_text())["long"]
    d = [min(long[True][s]) - min(long[False][s]) for s in (1, 2)]
    half = T1 * statistics.stdev(d) / math.sqrt(2)
    assert figures["QK-Norm (RMS, no gain)"]["best_minus_none"] == pytest.approx(
        [statistics.fmean(d), statistics.fmean(d) - half, statistics.fmean(d) + half])
    assert figures["QK-Norm (RMS, no gain)"]["best_lr"] == 3e-2 and figures["best_lr_none"] == 1e-2


def test_the_step_times_are_read_from_bench_controls_output(tmp_path, capsys):
    """A real (short) scripts/bench_controls.py run; the page reads every control's ratio back from its output."""
    bench = script("bench_controls")
    bench.main(["--rounds", "1", "--iters", "1"])
    out = capsys.readouterr().out
    (tmp_path / "bench.txt").write_text(out)
    found = script("practice_page").read_bench([tmp_path / "bench.txt"])
    assert set(found) == set(bench.CONTROLS) and found["baseline (1/√d_k)"] == [1.0]
    assert all(r[0] > 0 for r in found.values())


def test_a_missing_runs_dir_or_bench_file_is_one_line(tmp_path):
    mod = script("practice_page")
    for argv, said in (([str(tmp_path / "nope")], "is not a directory"),
                       ([str(tmp_path), "--bench", str(tmp_path / "b.txt")], "no such file")):
        with pytest.raises(SystemExit) as e:
            mod.main(argv + ["--page", str(tmp_path / "page.md")])
        assert said in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "runs").mkdir()
    make_run(tmp_path / "runs", "e1_noqkn", 0, 1e-3, 1, 2.0)
    (tmp_path / "unmarked.md").write_text("# a page without the marker\n")
    for page, said in ((tmp_path / "absent.md", "no such file"), (tmp_path / "unmarked.md", "has no marker line")):
        with pytest.raises(SystemExit) as e:
            mod.main([str(tmp_path / "runs"), "--page", str(page)])
        assert said in str(e.value) and "\n" not in str(e.value)
    assert (tmp_path / "unmarked.md").read_text() == "# a page without the marker\n"  # left as it was
    assert not (tmp_path / "practice.json").exists()
    with pytest.raises(SystemExit, match="must be at least 1"):
        script("bench_controls").main(["--threads", "0"])


def test_the_warmup_section_reads_each_blocks_gradient_at_the_first_step(tmp_path):
    """(3): the gradient norms at step 1 are averaged over seeds block by block; unigram outcomes are counted."""
    root = tmp_path / "runs"
    grads = {("post", 1): [1.0, 2.0, 8.0], ("post", 2): [1.2, 2.2, 9.0], ("pre", 1): [3.0, 2.5, 2.0],
             ("pre", 2): [3.2, 2.7, 2.1]}
    i = 0
    for pos, exp, warmups in (("post", "x_postln", (0, 30, 100)), ("pre", "x_preln", (0, 100))):
        for w in warmups:
            for seed in (1, 2):
                d = root / exp / str(i)
                d.mkdir(parents=True)
                i += 1
                cfg = {"seed": seed, "train": {"lr": 3e-3, "warmup_iters": w},
                       "model": {"norm_position": pos, "attn": {"qk_norm": False, "scale": "sqrt_dk"}}}
                (d / "config.yaml").write_text(yaml.safe_dump(cfg))
                lines = [{"step": 0, "val/loss": 4.2},
                         {"step": 1, "train/loss": 4.1, **{f"aux/grad_norm/L{l}": g for l, g in enumerate(grads[pos, seed])}},
                         {"step": 400, "val/loss": 3.34, "val/loss_full": 3.34}]
                (d / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
                unigram = pos == "post" and w == 0
                (d / "results.json").write_text(json.dumps({"diverged": False, "val_loss_step0": 4.2,
                                                            "outcome": "unigram" if unigram else "finished"}))
    page = tmp_path / "practice.md"
    mod = script("practice_page")
    page.write_text(mod.MARKER + "\n")
    mod.main([str(root), "--page", str(page)])
    figures = json.loads((tmp_path / "practice.json").read_text())
    assert figures["grad_at_init"]["post_ln"] == pytest.approx([1.1, 2.1, 8.5])
    assert figures["grad_at_init"]["pre_ln"] == pytest.approx([3.1, 2.6, 2.05])
    assert figures["warmup_trend"]["unigram"] == {"post_warmup0": 2, "post_warmup30": 0, "post_warmup100": 0,
                                                  "pre_warmup0": 0, "pre_warmup100": 0}
    assert (tmp_path / "practice_grad_norms.png").stat().st_size > 0
