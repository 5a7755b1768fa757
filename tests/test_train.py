"""Training end to end through Hydra's compose API and the real CLI, in tmp_path."""
import json
import math

import pytest
import torch

from lab.checkpoint import load_checkpoint, model_from_checkpoint
from rules import UserError
from helpers import REPO, compose_cfg
from sample import sample
from lab.tracking import read_metrics
from lab.optim import lr_at
from train import train


@pytest.mark.slow  # trains 40 steps
def test_train_then_sample_end_to_end(train_cfg, sample_cfg, tmp_path):
    cfg = train_cfg("train.max_iters=40", "logger.plots=true")
    result = train(cfg)
    run = tmp_path / "run"
    # the run dir holds config, code/hardware info, metrics and the checkpoint
    for name in ("config.yaml", "run_info.json", "metrics.jsonl", "ckpt_0000040.pt", "ckpt_0000030.pt", "best.pt",
                 "loss.png"):
        assert (run / name).is_file(), name
    info = json.loads((run / "run_info.json").read_text())
    assert info["torch"] == torch.__version__ and info["device"] == "cpu"

    metrics = read_metrics(run)
    assert all("step" in m for m in metrics)
    train_lines = [m for m in metrics if "lr" in m]
    eval_lines = [m for m in metrics if "val/loss" in m]
    assert [m["step"] for m in train_lines] == list(range(5, 41, 5))
    assert all({"train/loss", "lr", "tokens_per_sec"} <= m.keys() for m in train_lines)
    assert [m["step"] for m in eval_lines] == [0, 10, 20, 30, 40]
    assert all({"train/loss", "val/loss"} <= m.keys() for m in eval_lines)
    assert eval_lines[-1]["val/loss"] < eval_lines[0]["val/loss"]  # it learned something
    assert result["val_loss"] == eval_lines[-1]["val/loss"]

    # the checkpoint is self-contained: weights, model config, tokenizer
    assert not (run / "ckpt_0000020.pt").exists()  # keep_ckpts=2
    state = load_checkpoint(run / "ckpt_0000040.pt")
    assert state["step"] == 40 and state["tokenizer"]["kind"] == "char"
    model = model_from_checkpoint(state)
    assert model.config.n_layer == 2

    texts = sample(sample_cfg(f"ckpt={run}", "prompt=The", "max_new_tokens=25", "num_samples=2"))
    assert len(texts) == 2 and all(t.startswith("The") and len(t) == 28 for t in texts)


def test_eval_loss_recomputes_from_checkpoint(train_cfg, tmp_path):
    """The logged val loss equals a recomputation on the same fixed batches from the saved weights."""
    from data.loader import TokenData
    from data.prepare import prepare
    cfg = train_cfg("train.max_iters=10")
    result = train(cfg)
    model = model_from_checkpoint(load_checkpoint(tmp_path / "run" / "ckpt_0000010.pt")).eval()
    data = TokenData(prepare(cfg.data))
    gen = torch.Generator().manual_seed(cfg.seed + 1000 + 1)  # the val split's fixed stream
    losses = []
    with torch.no_grad():
        for _ in range(cfg.train.eval_iters):
            x, y = data.get_batch("val", cfg.train.batch_size, cfg.model.block_size, gen)
            logits = model(x)
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).item())
    assert result["val_loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert not list((tmp_path / "run").glob("*.png")) and cfg.logger.plots is False  # logger.plots=false: no figures


def test_gradient_accumulation_equals_bigger_batch(train_cfg, tmp_path):
    """grad_accum=4 with batch b takes the same step as grad_accum=1 with batch 4b when fed the
    same tokens (clipping included), and reports the same loss: the whole batch's mean, the loss
    of the model before the step on all 8 rows (not the last micro-batch's)."""
    from lab.device import Runtime
    from model import GPT, GPTConfig
    from train import train_step
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=30, block_size=8, n_layer=1, n_head=2, n_embd=16)
    a, b = GPT(cfg), GPT(cfg)
    b.load_state_dict(a.state_dict())
    x, y = torch.randint(30, (8, 8)), torch.randint(30, (8, 8))
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    # SGD: the update is the gradient itself, so a wrong 1/grad_accum weighting would show (Adam's
    # first step, g/|g|, would hide it)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.5), torch.optim.SGD(b.parameters(), lr=0.5)
    rt = Runtime(torch.device("cpu"), torch.float32)
    with torch.no_grad():
        before = a(x, y)[1].item()  # the whole batch's mean loss, computed apart
    loss_a, norm_a, _ = train_step(a, opt_a, [(x, y)], 1, 0.0, rt, scaler)
    loss_b, norm_b, _ = train_step(b, opt_b, [(x[i:i + 2], y[i:i + 2]) for i in range(0, 8, 2)], 4, 0.0, rt, scaler)
    assert norm_a.item() == pytest.approx(norm_b.item(), rel=1e-5) and norm_a.item() > 0.1
    assert loss_a.item() == pytest.approx(before, rel=1e-6) and loss_b.item() == pytest.approx(before, rel=1e-6)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=1e-6), n


def test_lr_schedule_warmup_cosine_floor(train_cfg):
    t = train_cfg("train.lr=1e-3", "train.min_lr=1e-4", "train.warmup_iters=10", "train.lr_decay_iters=110").train
    assert lr_at(0, t) == pytest.approx(1e-3 / 11)
    assert lr_at(9, t) == pytest.approx(1e-3 * 10 / 11)
    assert lr_at(10, t) == pytest.approx(1e-3)
    assert lr_at(60, t) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))  # half way: cos(pi/2) = 0
    assert lr_at(110, t) == pytest.approx(1e-4) and lr_at(500, t) == pytest.approx(1e-4)


def test_lr_schedule_wsd_holds_then_decays_linearly(train_cfg):
    """train.lr_schedule=wsd: the same warmup, lr held until the last cooldown_frac of the 100 steps after
    it (step 70 with 0.3), then a straight line to min_lr at lr_decay_iters."""
    t = train_cfg("train.lr=1e-3", "train.min_lr=1e-4", "train.warmup_iters=10", "train.lr_decay_iters=110",
                  "train.lr_schedule=wsd", "train.cooldown_frac=0.3").train
    assert lr_at(9, t) == pytest.approx(1e-3 * 10 / 11)
    assert [lr_at(s, t) for s in (10, 40, 80)] == pytest.approx([1e-3] * 3)
    assert lr_at(95, t) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))  # half way through the cooldown
    assert lr_at(101, t) == pytest.approx(1e-4 + 0.3 * (1e-3 - 1e-4))
    assert lr_at(110, t) == pytest.approx(1e-4) and lr_at(500, t) == pytest.approx(1e-4)


@pytest.mark.parametrize("override,needle", [
    ("data.path=/nonexistent/corpus.txt", "no such file"),
    ("model.n_embd=33", "not divisible by model.n_head"),
    ("model.n_embd=6", "odd"),  # 2 heads of 3
    ("model.block_size=1000000", "too large for the train split"),
    ("train.lr=-1", "train.lr"),
    ("train.batch_size=0", "train.batch_size"),
    ("model.attn.scale=-1", "model.attn.scale"),
    ("device=cuda:7" if not torch.cuda.is_available() else "device=banana", "device"),
])
def test_bad_input_is_one_line_error_and_writes_no_checkpoint(train_cfg, tmp_path, override, needle):
    with pytest.raises(UserError, match=needle) as e:
        train(train_cfg(override))
    assert "\n" not in str(e.value)
    assert not list((tmp_path / "run").glob("*.pt"))


def test_data_errors_one_line(train_cfg, tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 cr\xe8me ".encode("latin-1") * 100)
    with pytest.raises(UserError, match="not UTF-8"):
        train(train_cfg(f"data.path={bad}"))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(UserError, match="no text"):
        train(train_cfg(f"data.path={empty}"))
    assert not list((tmp_path / "cache").glob("*/meta.json"))  # no prepared dataset was left behind


def test_cli_bad_input_prints_one_line_and_exits_nonzero(tmp_path, cli):
    r = cli("train.py", "model=debug", "model.n_embd=33", f"hydra.run.dir={tmp_path / 'r'}",
                "logger.wandb.mode=disabled")
    assert r.returncode != 0
    assert "error: model.n_embd=33 is not divisible" in r.stderr
    assert "Traceback" not in r.stderr
    r = cli("train.py", "model.n_layers=3", f"hydra.run.dir={tmp_path / 'r'}")  # unknown key
    assert r.returncode != 0 and "n_layers" in r.stderr
    r = cli("train.py", "model.n_layer=three", f"hydra.run.dir={tmp_path / 'r'}")  # wrong type
    assert r.returncode != 0 and "n_layer" in r.stderr


def test_cfg_job_composes(cli):
    r = cli("train.py", "--cfg", "job")
    assert r.returncode == 0, r.stderr
    for key in ("n_layer:", "scale: sqrt_dk", "qk_norm: false", "grad_accum:", "lr_decay_iters:", "mode:"):
        assert key in r.stdout


def test_cli_train_and_sample_pipe(tmp_path, cli):
    """The README's two commands, through the real CLI: samples on stdout, logs on stderr."""
    run = tmp_path / "run"
    r = cli("train.py", "model=debug", "train.max_iters=20", "train.eval_interval=10", "train.eval_iters=2",
                "train.batch_size=4", f"hydra.run.dir={run}", f"data.cache_dir={tmp_path / 'cache'}",
                "logger.wandb.mode=disabled")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == ""  # logs go to stderr
    assert (run / ".hydra" / "config.yaml").is_file() and (run / "best.pt").is_file()
    r = cli("sample.py", f"ckpt={run}", "prompt=def", "max_new_tokens=20", "device=cpu", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("def") and r.stdout.count("\n") >= 2
    assert "sampling from" in r.stderr and "sampling from" not in r.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "run"]  # sample.py wrote nothing


def test_default_run_config_fits_the_budget():
    """The default `python train.py` must stay a few-minute CPU job: a fixed token budget."""
    cfg = compose_cfg("config")
    tokens = cfg.train.max_iters * cfg.train.batch_size * cfg.model.block_size * (cfg.train.grad_accum or 1)
    assert tokens <= 3.2e6 and cfg.data.name == "python_docs" and cfg.device == "auto"
    assert math.isclose(cfg.train.lr, 2e-3)


SHRINK = {"recall_cpu": ["data.pairs=[2,4]", "data.examples=200"],  # 16 tokens hold at most 4 pairs
          "needle_cpu": ["data.pairs=[4]", "data.examples=200"]}


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (REPO / "configs" / "experiment").glob("*.yaml")))
def test_every_experiment_preset_composes_and_runs(experiment, train_cfg, text_file):
    """A smoke run of each preset, shrunk: its own settings apply, the overrides shrink it."""
    cfg = train_cfg(f"experiment={experiment}", f"data.path={text_file}", "model.n_layer=1", "model.n_embd=32",
                    "model.n_head=2", "model.block_size=16", "train.batch_size=2", "train.max_iters=2",
                    "train.eval_interval=1", "train.eval_iters=1", "model.dropout=0.0",
                    *SHRINK.get(experiment, []))
    assert cfg.data.path == str(text_file)  # the overrides reach the preset
    result = train(cfg)
    assert result["steps"] == 2 and math.isfinite(result["val_loss"])


def test_help_describes_the_app_and_lists_only_real_choices(cli):
    r = cli("train.py", "--help")
    assert r.returncode == 0, r.stderr
    assert "train a decoder-only Transformer" in r.stdout and "python train.py -m" in r.stdout
    groups = r.stdout.split("== Config groups (group=option) ==")[1].split("==")[0]
    assert "model: baby, cpu_small, debug, default, gpt2_124m" in groups
    assert "schema" not in groups and "base_" not in groups


def test_unknown_key_is_rejected_by_every_hydra_entry_point(tmp_path, cli):
    for script in ("train.py", "sample.py", "tools/bench.py", "tools/bench_sample.py", "tools/prepare.py"):
        r = cli(script, "modle=baby", cwd=tmp_path)
        assert r.returncode != 0 and "modle" in r.stderr, script
