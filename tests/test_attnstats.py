"""Attention statistics against direct computations, and their logging to files and W&B."""
import math

import pytest
import torch

import attention as attention_module
from attention import repeat_kv
from lab.attnstats import (AttentionProbe, attention_stats, causal_scores, copy_losses, induction_line, reading_qk,
                           repeated_batch, role_rows)
from helpers import compose_cfg, wandb_summary
from model import GPT, GPTConfig
from tools.report import report
from lab.tracking import read_metrics
from train import train
from variants import attention


def full_matrix_stats(q, k, scale):
    """Entropy, normalised entropy and peak per head from the reference path's whole attention
    matrix in float64 (weights = attention(q, k, I))."""
    q, k = q.double(), k.double()
    B, nh, T, _ = q.shape
    eye = torch.eye(T, dtype=torch.float64).expand(B, nh, T, T)
    p = attention(q, k, eye, scale, impl="reference")  # (B, nh, T, T): row i = weights of query i
    ent = torch.zeros(B, nh, T, dtype=torch.float64)
    for i in range(T):
        row = p[..., i, : i + 1]
        ent[..., i] = -(row * row.log()).nan_to_num(0.0).sum(-1)
    lnk = torch.log(torch.arange(1, T + 1, dtype=torch.float64))
    norm = (ent[..., 1:] / lnk[1:]).mean(dim=(0, 2))
    return ent.mean(dim=(0, 2)), norm, p.amax(-1).mean(dim=(0, 2))


def plain_stats(q, k, scale, dtype=torch.float32, **kw):
    """attention_stats of plain causal softmax(q·kᵀ·scale) for q, k (B, nh, T, hs), in dtype."""
    return attention_stats(causal_scores(q.to(dtype), k.to(dtype), scale), q.size(2), **kw)


def test_uniform_rows_have_entropy_ln_keys_and_one_hot_rows_zero():
    T, hs = 12, 16
    zeros = torch.zeros(1, 1, T, hs)  # all scores 0: each row uniform over its i+1 keys
    s = plain_stats(zeros, torch.randn(1, 1, T, hs), 1.0, dtype=torch.float64)
    want = sum(math.log(i + 1) for i in range(T)) / T
    assert s["entropy"].item() == pytest.approx(want, abs=1e-9)
    assert s["entropy_norm"].item() == pytest.approx(1.0, abs=1e-9)
    assert s["peak"].item() == pytest.approx(sum(1 / (i + 1) for i in range(T)) / T, abs=1e-9)
    e = torch.eye(T, hs).view(1, 1, T, hs) * 100  # q_i . k_j = 1e4 * [i == j]: one-hot on the diagonal
    s = plain_stats(e, e, 1.0, dtype=torch.float64)
    assert s["entropy"].item() == pytest.approx(0.0, abs=1e-9)
    assert s["peak"].item() == pytest.approx(1.0, abs=1e-9)
    assert s["logit_max"].item() == pytest.approx(1e4)


def capture_qk(model, idx):
    """{layer: (q, k, scale)} each softmax layer computed for idx, as (B, nh, T, hs), k repeated to one
    per query head."""
    seen = {}

    def read(layer, attn, q, k):
        seen.setdefault(layer, (q.transpose(1, 2), repeat_kv(k.transpose(1, 2), attn.n_head), attn.scale))
    with reading_qk(model, read):
        model(idx)
    return seen


@pytest.mark.parametrize("T,block", [(23, 5), (23, 23), (16, 256)])
def test_blockwise_stats_equal_full_matrix_in_float64(T, block):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=30, block_size=32, n_layer=2, n_head=3, n_embd=48)).eval()
    with torch.no_grad():
        model.blocks[1].attn.c_attn.weight.mul_(8)  # a sharper layer too
    for layer, (q, k, scale) in capture_qk(model, torch.randint(30, (2, T))).items():
        got = plain_stats(q, k, scale, block=block, dtype=torch.float64)
        ent, norm, peak = full_matrix_stats(q, k, scale)
        for name, a, b in [("entropy", got["entropy"], ent), ("norm", got["entropy_norm"], norm), ("peak", got["peak"], peak)]:
            assert torch.allclose(a, b, atol=1e-5), f"layer {layer} {name}: max diff {(a - b).abs().max():.2e}"


def test_probe_float32_matches_float64_reference():
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=30, block_size=32, n_layer=2, n_head=2, n_embd=32)).eval()
    idx = torch.randint(30, (3, 32))
    stats = AttentionProbe(idx, block=7).run(model)
    for layer, (q, k, scale) in capture_qk(model, idx).items():
        ent, _, _ = full_matrix_stats(q, k, scale)
        for h in range(2):
            assert stats[f"attn_entropy/L{layer}/H{h}"] == pytest.approx(ent[h].item(), abs=1e-5)
        assert stats[f"attn_entropy/L{layer}"] == pytest.approx(ent.mean().item(), abs=1e-5)


def test_removing_sqrt_dk_saturates_attention_of_large_qk():
    results = {}
    for scale in ("sqrt_dk", "none"):
        torch.manual_seed(2)
        model = GPT(GPTConfig(vocab_size=30, block_size=64, n_layer=2, n_head=1, n_embd=128,
                              attn={"scale": scale})).eval()
        with torch.no_grad():
            for block in model.blocks:
                block.attn.c_attn.weight.mul_(5)  # q, k entries of order 1
        results[scale] = AttentionProbe(torch.randint(30, (4, 64))).run(model)
    assert results["none"]["attn_entropy_norm/mean"] < 0.5 * results["sqrt_dk"]["attn_entropy_norm/mean"]
    assert results["none"]["attn_peak/mean"] > results["sqrt_dk"]["attn_peak/mean"] + 0.2


def test_probe_works_at_block_size_2048_on_cpu():
    torch.manual_seed(3)
    model = GPT(GPTConfig(vocab_size=30, block_size=2048, n_layer=2, n_head=2, n_embd=32)).eval()
    stats = AttentionProbe(torch.randint(30, (1, 2048)), block=256).run(model)
    assert 0 < stats["attn_entropy/mean"] < math.log(2048)


@pytest.mark.slow  # trains 20 steps, then 2
def test_training_steps_never_build_the_attention_matrix(train_cfg, tmp_path, monkeypatch):
    calls = []
    real = attention_module.attention_scores
    monkeypatch.setattr(attention_module, "attention_scores", lambda *a, **k: calls.append(1) or real(*a, **k))
    train(train_cfg("train.max_iters=20", "train.log_attn_interval=0"))  # the probe (which does) off
    assert calls == []  # training steps and evaluations never built the table
    train(train_cfg("train.max_iters=2", "model.attn.impl=reference", "train.log_attn_interval=0",
                    f"out_dir={tmp_path / 'reference'}"))
    assert calls  # and the counter does see the reference path when it is used


@pytest.mark.slow  # trains 20 steps, then a second run
def test_entropy_logged_every_interval_to_metrics(train_cfg, tmp_path):
    train(train_cfg("logger.plots=true", "train.max_iters=20", "train.log_attn_interval=5"))
    probes = [m for m in read_metrics(tmp_path / "run") if "attn_entropy/mean" in m]
    assert [m["step"] for m in probes] == [0, 5, 10, 15, 20]
    keys = probes[0].keys()
    for l in range(2):
        assert {f"attn_entropy/L{l}/H0", f"attn_entropy/L{l}/H1", f"attn_entropy/L{l}", f"attn_entropy_norm/L{l}",
                f"attn_peak/L{l}", f"attn_logit_max/L{l}"} <= keys
    assert (tmp_path / "run" / "attn_entropy.png").stat().st_size > 1000
    # same probe tokens every time: an untrained model's step-0 entropies are reproducible
    train(train_cfg("train.max_iters=0", "train.log_attn_interval=5", f"out_dir={tmp_path / 'again'}"))
    again = [m for m in read_metrics(tmp_path / "again") if "attn_entropy/mean" in m]
    assert again[0] == probes[0]


# ----------------------------------------------------------------------------- what each head does

def one_hot_head(targets, T, c=40.0):
    """q, k (1, 1, T, hs) whose attention is (almost) one-hot: query i looks at key targets[i]
    (k_j = c e_j, q_i = c e_targets[i]; scores c² = 1600 there, 0 elsewhere)."""
    k = torch.eye(T, dtype=torch.float64)[None, None] * c
    q = torch.stack([k[0, 0, t] for t in targets])[None, None]
    return q, k


def test_previous_token_head_has_prev_one_and_distance_one():
    T = 12
    q, k = one_hot_head([0] + list(range(T - 1)), T)
    s = plain_stats(q, k, 1.0, block=5, dtype=torch.float64)
    assert s["prev"].item() == pytest.approx(1.0, abs=1e-9)
    assert s["dist"].item() == pytest.approx(1.0, abs=1e-9)
    assert s["self"].item() == pytest.approx(0.0, abs=1e-9)
    assert s["first"].item() == pytest.approx(1 / (T - 1), abs=1e-9)  # only row 1's previous token is token 0


def test_sink_and_self_heads():
    T = 10
    s = plain_stats(*one_hot_head([0] * T, T), 1.0, block=3, dtype=torch.float64)
    assert s["first"].item() == pytest.approx(1.0, abs=1e-9)
    assert s["dist"].item() == pytest.approx(sum(range(1, T)) / (T - 1), abs=1e-9)  # row i looks i back
    s = plain_stats(*one_hot_head(list(range(T)), T), 1.0, block=3, dtype=torch.float64)
    assert s["self"].item() == pytest.approx(1.0, abs=1e-9) and s["dist"].item() == pytest.approx(0.0, abs=1e-9)


def test_uniform_head_looks_i_over_2_back_in_every_row():
    T = 9
    p = torch.tril(torch.ones(T, T, dtype=torch.float64))
    p = (p / p.sum(-1, keepdim=True))[None, None]  # row i: 1/(i+1) on keys 0..i
    for start in (0, 4):  # a block of rows start.. of a longer sequence, as attention_stats passes them
        rows = role_rows(p[..., start:, :], start)
        i = torch.arange(start, T, dtype=torch.float64)
        assert torch.allclose(rows["dist"][0, 0], i / 2)
        assert torch.allclose(rows["self"][0, 0], 1 / (i + 1)) and torch.allclose(rows["first"][0, 0], 1 / (i + 1))
        assert torch.allclose(rows["prev"][0, 0], torch.where(i > 0, 1 / (i + 1), 0.0))
    s = plain_stats(torch.zeros(1, 1, T, 4), torch.randn(1, 1, T, 4), 1.0, block=4, dtype=torch.float64)
    assert s["dist"].item() == pytest.approx(sum(i / 2 for i in range(1, T)) / (T - 1), abs=1e-9)


def copying_head(x, vocab, c=40.0):
    """A hand-built induction head for tokens x (T,): key j carries the token before it (what a
    previous-token head writes), the query its own token; so query t looks right after the
    earlier occurrences of x_t. One-hot token vectors, scores c² where they match."""
    E = torch.eye(vocab, dtype=torch.float64) * c
    k = torch.cat([torch.zeros(1, vocab, dtype=torch.float64), E[x[:-1]]])  # key 0 has no token before it
    return E[x][None, None], k[None, None]


@pytest.mark.parametrize("block", [4, 256])
def test_copying_head_on_a_repeated_sequence_has_induction_score_one(block):
    n, vocab = 10, 16
    r = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))[:n]
    x = torch.cat([r, r])
    s = plain_stats(*copying_head(x, vocab), 1.0, block=block, dtype=torch.float64, period=n)
    assert s["induction"].item() == pytest.approx(1.0, abs=1e-9)
    # a previous-token head on the same sequence copies nothing
    s = plain_stats(*one_hot_head([0] + list(range(2 * n - 1)), 2 * n), 1.0, block=block, period=n)
    assert s["induction"].item() == pytest.approx(0.0, abs=1e-6)


def full_matrix_roles(q, k, scale, period, offset=0):
    """prev, first, self, dist and induction per head, row by row from the whole float64 matrix
    (induction: [r, r] of period `period` after `offset` tokens)."""
    q, k = q.double(), k.double()
    B, nh, T, _ = q.shape
    p = attention(q, k, torch.eye(T, dtype=torch.float64).expand(B, nh, T, T), scale, impl="reference")
    rows = range(1, T)
    out = {"prev": sum(p[..., i, i - 1] for i in rows), "first": sum(p[..., i, 0] for i in rows),
           "self": sum(p[..., i, i] for i in rows),
           "dist": sum((p[..., i, : i + 1] * torch.arange(i, -1, -1, dtype=torch.float64)).sum(-1) for i in rows)}
    out = {name: v.mean(0) / (T - 1) for name, v in out.items()}
    out["induction"] = sum(p[..., t, t - period + 1] for t in range(offset + period, T)).mean(0) / (T - offset - period)
    return out


@pytest.mark.parametrize("block", [5, 256])
def test_blockwise_roles_equal_full_matrix_in_float64(block):
    torch.manual_seed(4)
    model = GPT(GPTConfig(vocab_size=30, block_size=32, n_layer=2, n_head=3, n_embd=48)).eval()
    with torch.no_grad():
        model.blocks[1].attn.c_attn.weight.mul_(8)
    r = torch.randint(30, (2, 11))
    for offset in (0, 1):  # 1: a bos token before the repeated span (data.bos=true)
        x = torch.cat([torch.zeros(2, offset, dtype=torch.long), r, r], 1)
        for layer, (q, k, scale) in capture_qk(model, x).items():
            got = plain_stats(q, k, scale, block=block, dtype=torch.float64, period=11, offset=offset)
            for name, want in full_matrix_roles(q, k, scale, 11, offset).items():
                d = (got[name] - want).abs()
                assert d.max() < 1e-6, f"offset {offset} layer {layer} {name}: max diff {d.max():.2e}"


def test_repeated_batch_is_the_first_half_of_each_probe_row_twice():
    idx = torch.randint(50, (3, 41), generator=torch.Generator().manual_seed(5))
    x = repeated_batch(idx)
    assert x.shape == (3, 40) and torch.equal(x[:, :20], idx[:, :20]) and torch.equal(x[:, 20:], idx[:, :20])


def test_copy_losses_are_the_cross_entropy_of_each_copy():
    torch.manual_seed(6)
    n, V = 7, 11
    x = torch.randint(V, (2, 2 * n))
    logits = torch.randn(2, 2 * n, V)
    first, second = copy_losses(logits, x, n)
    ce = torch.nn.functional.cross_entropy
    assert first == pytest.approx(ce(logits[:, : n - 1].reshape(-1, V), x[:, 1:n].reshape(-1)).item(), rel=1e-6)
    assert second == pytest.approx(ce(logits[:, n:-1].reshape(-1, V), x[:, n + 1:].reshape(-1)).item(), rel=1e-6)


def test_probe_logs_roles_induction_and_gain_per_head_and_layer():
    torch.manual_seed(7)
    model = GPT(GPTConfig(vocab_size=30, block_size=32, n_layer=2, n_head=2, n_embd=32)).eval()
    idx = torch.randint(30, (3, 32))
    state = torch.get_rng_state()
    probe = AttentionProbe(idx, block=7)
    stats = probe.run(model)
    assert torch.equal(torch.get_rng_state(), state)  # the probe draws from no global stream
    for name in ("prev", "first", "self", "dist", "induction"):
        for l in range(2):
            heads = [stats[f"attn_{name}/L{l}/H{h}"] for h in range(2)]
            assert stats[f"attn_{name}/L{l}"] == pytest.approx(sum(heads) / 2)
    assert stats["attn_induction/max"] == max(v for k, v in stats.items() if k.startswith("attn_induction/L") and k.count("/") == 2)
    assert stats["incontext/gain"] == pytest.approx(stats["incontext/loss_first"] - stats["incontext/loss_second"])
    # the same numbers from the full matrices of the repeated batch
    x, n = probe.repeated, probe.repeated.size(1) // 2
    for layer, (q, k, scale) in capture_qk(model, x).items():
        want = full_matrix_roles(q, k, scale, n)["induction"]
        for h in range(2):
            assert stats[f"attn_induction/L{layer}/H{h}"] == pytest.approx(want[h].item(), abs=1e-5)
    with torch.no_grad():
        assert stats["incontext/loss_first"] == pytest.approx(copy_losses(model(x), x, n)[0])


def test_a_bos_probe_repeats_the_span_after_bos():
    """data.bos=true: the probe's repeated batch is [bos, r, r]; its induction scores and copy losses
    are those of the full matrices and the logits after bos."""
    torch.manual_seed(7)
    model = GPT(GPTConfig(vocab_size=30, block_size=32, n_layer=2, n_head=2, n_embd=32)).eval()
    idx = torch.cat([torch.full((3, 1), 29), torch.randint(29, (3, 31))], 1)  # id 29 plays bos
    probe = AttentionProbe(idx, block=7, bos=True)
    stats = probe.run(model)
    x, n = probe.repeated, 15
    assert torch.equal(x, torch.cat([idx[:, :1], idx[:, 1:16], idx[:, 1:16]], 1))
    for layer, (q, k, scale) in capture_qk(model, x).items():
        want = full_matrix_roles(q, k, scale, n, offset=1)["induction"]
        for h in range(2):
            assert stats[f"attn_induction/L{layer}/H{h}"] == pytest.approx(want[h].item(), abs=1e-5)
    with torch.no_grad():
        first, second = copy_losses(model(x)[:, 1:], x[:, 1:], n)
    assert stats["incontext/loss_first"] == pytest.approx(first)
    assert stats["incontext/loss_second"] == pytest.approx(second)


def test_training_logs_head_roles_and_writes_maps_and_figure(train_cfg, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_env"))
    with caplog.at_level("INFO", logger="attnlab"):
        train(train_cfg("logger.plots=true", "train.max_iters=10", "train.log_attn_interval=5",
                        "logger.wandb.mode=offline"))
    run = tmp_path / "run"
    probes = [m for m in read_metrics(run) if "attn_entropy/mean" in m]
    assert [m["step"] for m in probes] == [0, 5, 10]
    # the end of the log says when the gain rose most, from the metrics file's gains
    g = [m["incontext/gain"] for m in probes]
    rise = max(range(2), key=lambda i: g[i + 1] - g[i])
    said = (f"in-context gain on the probe batch {g[2]:.3f} at step 10 ({g[0]:.3f} at step 0); its largest rise, "
            f"{g[rise]:.3f} to {g[rise + 1]:.3f}, between steps {5 * rise} and {5 * rise + 5}; top induction scores ")
    assert any(r.getMessage().startswith(said) for r in caplog.records), [r.getMessage() for r in caplog.records]
    for m in probes:
        for l in range(2):
            for name in ("prev", "first", "self", "dist", "induction"):
                assert f"attn_{name}/L{l}/H0" in m and f"attn_{name}/L{l}" in m
        assert {"incontext/gain", "incontext/loss_first", "incontext/loss_second", "attn_induction/max"} <= m.keys()
    for name in ("attn_heads.png", "attention.png", "attention.html"):
        assert (run / name).stat().st_size > 1000, name
    # the end-of-run maps are in the W&B run too, as an image and as the HTML viewer
    offline = next((run / "wandb").glob("offline-run-*"))
    summary = wandb_summary(offline)  # waits for wandb-core to finish writing the run's log
    assert summary["attention/maps._type"] == "image-file" and summary["attention/viewer._type"] == "html-file"
    assert "attn_induction/L1/H1" in summary and "incontext/gain" in summary
    assert (tmp_path / "report" / "attn_heads.png") in report([str(run)], tmp_path / "report")["files"]


def test_the_induction_line_names_the_largest_rise_and_the_two_strongest_heads():
    def line(step, gain, scores):
        return {"step": step, "incontext/gain": gain,
                **{f"attn_induction/L{l}/H{h}": v for (l, h), v in scores.items()}, "attn_induction/L1": 0.9}

    scores = {(0, 0): 0.01, (0, 1): 0.02, (1, 0): 0.38, (1, 1): 0.05, (1, 2): 0.44}
    history = [line(0, 0.0, scores), line(50, -0.1, scores), line(100, 0.9, scores), line(150, 1.3, scores)]
    assert induction_line(history) == ("in-context gain on the probe batch 1.300 at step 150 (0.000 at step 0); "
                                       "its largest rise, -0.100 to 0.900, between steps 50 and 100; "
                                       "top induction scores L1H2 0.440, L1H0 0.380")
    one = "in-context gain on the probe batch 0.250 at step 0 (0.250 at step 0)"
    assert induction_line([line(0, 0.25, {})]) == one
    assert induction_line([line(0, -0.0004, {})]).endswith(" 0.000 at step 0 (0.000 at step 0)")  # no -0.000
    assert induction_line([{"step": 0, "attn_entropy/mean": 1.0}]) is None  # no gain measured: no line


def test_repeated_spans_source_is_lines_of_a_span_twice():
    from data.prepare import python_docs_text, repeated_spans_text, source_of
    cfg = compose_cfg("config", ["experiment=induction_cpu"])
    assert source_of(cfg.data) == ("repeated_spans", "generated") and cfg.model.n_layer == 2
    text = repeated_spans_text(n_lines=400)
    assert text == repeated_spans_text(n_lines=400)  # the same corpus every time (it is cached by content)
    prose = " ".join(python_docs_text().split())
    lines = text.splitlines()
    assert len(lines) == 400
    kinds = []
    for line in lines:
        n = (len(line) - 1) // 2
        span = line[:n]
        assert 10 <= n <= 30 and span == line[n + 1:] and line[n] == " "
        kinds.append("prose" if span in prose else "letters")
        assert kinds[-1] == "prose" or span.isalpha()
    assert 150 < kinds.count("letters") < 250  # half and half
    val_prose = [l[:(len(l) - 1) // 2] for l, k in zip(lines[360:], kinds[360:]) if k == "prose"]
    assert val_prose and all(s in prose[int(len(prose) * 0.9) - 30:] for s in val_prose)  # val: the prose's tail
