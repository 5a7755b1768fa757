"""tools/needle.py, the needle probe: each needle sits exactly d positions before its query in the
task's own layout (checked sequence by sequence), the accuracy per distance is that of a lookup written
out by hand, the Wilson interval is scipy's, a stack of windowed layers provably cannot carry a token
farther back than its reach while full attention can, and the command's table, files and arms."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from rules import UserError


@pytest.mark.parametrize("length,pairs,distance", [(64, 4, 2), (64, 4, 16), (64, 4, 62), (33, 8, 20), (256, 8, 240)])
def test_each_needle_sits_exactly_d_before_its_query_in_the_task_layout(length, pairs, distance):
    from data.mqar import MQARTokenizer
    from lab.needle_probe import needle_sequences
    tok = MQARTokenizer(40)
    x, q, answer = needle_sequences(200, length, pairs, 40, distance, seed=3)
    assert x.shape == (200, length) and q.shape == answer.shape == (200,)
    starts = set()
    for xe, qe, ae in zip(x.tolist(), q.tolist(), answer.tolist()):
        keys, values = xe[0:2 * pairs:2], xe[1:2 * pairs:2]
        assert len(set(keys)) == pairs and all(1 <= k <= tok.keys for k in keys)
        assert all(tok.keys < v < 40 for v in values)
        assert qe % 2 == 0 and 2 * pairs <= qe < length  # asked after the pairs, at a key's place
        seen = [t for t in range(qe) if xe[t] == xe[qe]]
        assert seen == [qe - distance]  # the needle's key: once before its query, exactly d back
        assert xe[qe - distance + 1] == ae == dict(zip(keys, values))[xe[qe]]  # its value: the answer
        assert qe + 1 >= length or xe[qe + 1] == ae
        starts.add(qe - distance)
        asked = [t for t in range(2 * pairs, length) if xe[t] != 0 and t % 2 == 0]
        assert sorted(xe[t] for t in asked) == sorted(keys)  # every key asked once: the needle and the others
        for t in asked:
            assert t + 1 >= length or xe[t + 1] == dict(zip(keys, values))[xe[t]]
        answered = set(asked) | {t + 1 for t in asked}
        assert all(xe[t] == 0 for t in range(2 * pairs, length) if t not in answered)  # fillers elsewhere
    assert len(starts) == len(range(max(0, 2 * pairs - distance), min(2 * pairs - 2, length - 1 - distance) + 1, 2))


def test_the_same_seed_gives_the_same_needles_and_each_distance_its_own():
    from lab.needle_probe import needle_sequences
    a, b = needle_sequences(20, 64, 4, 40, 16, 1), needle_sequences(20, 64, 4, 40, 16, 1)
    assert all(torch.equal(s, t) for s, t in zip(a, b))
    assert not torch.equal(a[0], needle_sequences(20, 64, 4, 40, 16, 2)[0])
    assert not torch.equal(a[0], needle_sequences(20, 64, 4, 40, 18, 1)[0])


class WindowedLookup(torch.nn.Module):
    """A recall written out by hand: at each position t, the latest earlier s with the same token whose
    next token is among the `window` latest positions (s + 1 >= t - window + 1) gives the answer x[s +
    1]; nothing found, the filler (never an answer). One-hot logits."""

    def __init__(self, window, vocab=40):
        super().__init__()
        self.w, self.window, self.vocab = torch.nn.Parameter(torch.zeros(1)), window, vocab

    def forward(self, x):
        out = torch.zeros_like(x)
        for back in range(self.window, 1, -1):  # s = t - back, nearest last: the latest match wins
            match = (x[:, :-back] == x[:, back:]) & (x[:, back:] != 0)  # (B, T - back): x[s] == x[t]
            out[:, back:] = torch.where(match, x[:, 1:x.size(1) - back + 1], out[:, back:])  # x[s + 1]
        return F.one_hot(out, self.vocab).float()


def test_accuracy_per_distance_is_that_of_a_lookup_written_out():
    """A lookup that reads the latest W positions answers every needle whose value is among them (d <=
    W) and none beyond; the probe's accuracy, n and Wilson interval per distance, scipy's interval."""
    from scipy.stats import binomtest

    from lab.needle_probe import probe
    W, distances = 12, [2, 4, 10, 12, 14, 30, 60]
    rows = probe(WindowedLookup(W), distances, length=64, vocab_size=40, needles=40, pairs=4, seed=0, far=W - 1)
    assert [r["distance"] for r in rows] == distances and all(r["n"] == 40 for r in rows)
    assert [r["accuracy"] for r in rows] == [1.0 if d <= W else 0.0 for d in distances]
    assert [r["beyond"] for r in rows] == [d > W for d in distances]  # the value sits d - 1 back: W - 1 the most
    for r in rows:
        ci = binomtest(r["right"], r["n"]).proportion_ci(confidence_level=0.95, method="wilson")
        assert (r["low"], r["high"]) == pytest.approx((ci.low, ci.high), abs=1e-12)


@pytest.mark.parametrize("right,n", [(0, 10), (3, 10), (10, 10), (497, 500), (1, 1)])
def test_the_wilson_interval_is_scipys(right, n):
    from scipy.stats import binomtest

    from lab.intervals import wilson
    ci = binomtest(right, n).proportion_ci(confidence_level=0.95, method="wilson")
    low, high = wilson(right, n)
    assert (low, high) == pytest.approx((ci.low, ci.high), abs=1e-12) and 0 <= low <= right / n <= high <= 1


def tiny_gpt(seed=0, **attn):
    from model import GPT, GPTConfig
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=40, block_size=64, n_layer=2, n_head=2, n_embd=16, attn=attn)).eval()


def test_a_window_cannot_carry_a_token_past_its_reach_and_full_attention_can():
    """Two layers of window W: a token n(W - 1) back still changes the logits at a query, one more
    back changes nothing, bit for bit; the needle's value beyond the reach leaves the probe's answer
    as it was. Full attention's logits change for a token and a needle anywhere before the query."""
    from lab.needle_probe import needle_sequences, reach
    W = 5
    windowed, full = tiny_gpt(window=W), tiny_gpt()
    far = reach(windowed)
    assert far == 2 * (W - 1) and reach(full) is None and reach(tiny_gpt(window=W, window_pattern="LG")) is None
    torch.manual_seed(1)
    x, t = torch.randint(1, 40, (1, 40)), 39

    def at_query(model, ids):
        with torch.no_grad():
            return model(ids)[0, t]

    def changed(model, back):
        y = x.clone()
        y[0, t - back] = x[0, t - back] % 39 + 1  # another token, never the same
        return not torch.equal(at_query(model, x), at_query(model, y))

    assert changed(windowed, far) and not changed(windowed, far + 1) and not changed(windowed, 30)
    assert changed(full, far + 1) and changed(full, 30)
    for d in (8, 10, 20, 40):  # the needle's value sits d - 1 back: within the reach (8) for d = 8 only
        x2, q, answer = needle_sequences(16, 64, 4, 40, d, seed=2)
        other = x2.clone()
        other[torch.arange(16), q - d + 1] = (answer - 20 + 1) % 20 + 20  # another value (values are 20..39)
        with torch.no_grad():
            same = [torch.equal(m(x2)[torch.arange(16), q], m(other)[torch.arange(16), q]) for m in (windowed, full)]
        assert same == [d - 1 > far, False], d


def mqar_checkpoint(directory, pairs=(2, 4), model=None, **attn):
    """A checkpoint of a tiny untrained model (or `model`) over mqar's tokens, recording the pairs it trained on."""
    import dataclasses

    from lab.checkpoint import save_checkpoint
    from data.mqar import MQARTokenizer
    model = model or tiny_gpt(**attn)
    state = {"model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
             "tokenizer": MQARTokenizer(40).to_dict(), "step": 1, "config": {"data": {"pairs": list(pairs)}}}
    directory.mkdir(parents=True, exist_ok=True)
    return save_checkpoint(directory / "best.pt", state)


def always(value, **attn):
    """A model whose argmax is `value` at every position: the final norm outputs a fixed vector (weight
    0, bias e) and value's embedding, the tied head's row, is a long e."""
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=64, n_layer=2, n_head=2, n_embd=16, bias=True, attn=attn)).eval()
    with torch.no_grad():
        e = torch.randn(16)
        model.ln_f.weight.zero_()
        model.ln_f.bias.copy_(e)
        model.wte.weight[value] = 100 * e
    return model


def test_the_command_probes_a_checkpoint_through_a_window_and_writes_its_table(tmp_path, capsys):
    """window= at evaluation: the probe's answers are the checkpoint's own argmax at each query,
    recomputed here from the logits of the same weights with that window; the reach, the files."""
    from lab.checkpoint import load_checkpoint, model_from_checkpoint
    from helpers import compose_cfg
    from lab.needle_probe import needle_sequences, with_window
    from tools.needle import needle
    ckpt = mqar_checkpoint(tmp_path)
    result = needle(compose_cfg("needle", [f"ckpt={ckpt}", "distances=[4,8,20]", "needles=30", "window=3",
                                           f"out={tmp_path / 'out'}"]))
    assert result["reach"] == 2 * (3 - 1) and result["pairs"] == 4 and result["attention"] == "window 3"
    assert [r["beyond"] for r in result["rows"]] == [False, True, True]
    model = model_from_checkpoint(with_window(load_checkpoint(ckpt), 3)).eval()
    for r in result["rows"]:
        x, q, answer = needle_sequences(30, 64, 4, 40, r["distance"], seed=0)
        with torch.no_grad():
            logits = model(x)
        picked = torch.stack([logits[i, q[i]] for i in range(30)]).argmax(-1)
        assert r["right"] == int((picked == answer).sum()) and r["accuracy"] == r["right"] / 30
    out = capsys.readouterr().out
    assert "window 3, 2 layers; nothing more than 4 positions back" in out and "beyond the reach" in out
    assert json.loads((tmp_path / "out" / "needle.json").read_text()) == result
    assert "| window 3 | " in (tmp_path / "out" / "needle.md").read_text()
    assert (tmp_path / "out" / "needle.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("over,needle_text", [
    (["distances=[5]"], "distances: 5 is odd"),
    (["distances=[64]"], "distances: 64 does not fit in the model's block_size of 64"),
    (["kv_pairs=17"], "kv_pairs=17 needs sequences of at least 67 tokens"),
    (["window=4", "select=moba"], "model.attn.select=moba chooses keys by content; with a window"),
    (["runs=[x]"], "ckpt= and runs= both given"),
])
def test_bad_settings_are_one_line(tmp_path, over, needle_text):
    from helpers import compose_cfg, one_line
    from tools.needle import needle
    ckpt = mqar_checkpoint(tmp_path)
    with pytest.raises(UserError, match=needle_text) as e:
        needle(compose_cfg("needle", [f"ckpt={ckpt}", "out=null", "needles=2", *over]))
    one_line(e)


def test_a_checkpoint_of_another_task_is_one_line(tmp_path):
    from helpers import compose_cfg, one_line, save_tiny_checkpoint
    from tools.needle import needle
    ckpt = save_tiny_checkpoint(tmp_path)
    with pytest.raises(UserError, match="not data=mqar: the needle probe asks mqar keys") as e:
        needle(compose_cfg("needle", [f"ckpt={ckpt}", "out=null"]))
    one_line(e)


def test_runs_are_grouped_into_arms_with_the_mean_and_interval_of_their_accuracies(tmp_path, capsys):
    """runs=: runs whose configs differ only in the seed form one arm, named by what it reads. Each run's
    model always answers one value, so its accuracy is the share of needles asking for that value,
    counted here; the arm's mean, sd and 95% interval are those of the counts (t(0.975, 1) = 12.706);
    an arm of one run shows its Wilson interval."""
    import yaml

    from lab.intervals import wilson
    from lab.needle_probe import needle_sequences
    from tools.needle import needle
    runs = {"full/s1": (25, 1, {}), "full/s2": (37, 2, {}), "window/s1": (22, 1, {"window": 3})}
    for name, (value, seed, attn) in runs.items():
        run = tmp_path / "sweep" / name
        mqar_checkpoint(run, pairs=[4], model=always(value, **attn))
        config = {"seed": seed, "data": {"name": "mqar", "pairs": [4]}, "model": {"attn": {"window": attn.get("window")}}}
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "val/loss": 1.0}) + "\n")
    r = needle(compose_cfg_needle([f"runs=[{tmp_path / 'sweep'}]", "distances=[4,16]", "needles=100", "out=null"]))
    full, window = r["arms"]
    differ = []
    assert (full["arm"], len(full["runs"]), window["arm"], len(window["runs"])) == ("full attention", 2, "window 3", 1)
    for d in (4, 16):
        answer = needle_sequences(100, 64, 4, 40, d, seed=0)[2]
        a, b, c = (int((answer == v).sum()) / 100 for v in (25, 37, 22))  # each run's accuracy, counted
        assert [run["rows"][[4, 16].index(d)]["accuracy"] for arm in (full, window) for run in arm["runs"]] == [a, b, c]
        differ.append(a != b)
        s = full["accuracy"][d]
        assert s["n"] == 2 and s["mean"] == pytest.approx((a + b) / 2, abs=1e-12)
        assert s["sd"] == pytest.approx(abs(a - b) / math.sqrt(2), rel=1e-9)
        assert s["half"] == pytest.approx(12.706 * s["sd"] / math.sqrt(2), rel=1e-3)
    assert any(differ)  # two runs that agree everywhere would leave the sd untested
    table = capsys.readouterr().out
    low, high = wilson(round(c * 100), 100)
    assert "| window 3 | " in table and f"{c:.3f} [{low:.3f}, {high:.3f}]" in table and "mean ± sd over 1/2 runs" in table


def compose_cfg_needle(overrides):
    from helpers import compose_cfg
    return compose_cfg("needle", overrides)


@pytest.mark.slow  # trains two runs
def test_runs_of_a_sweep_are_probed_and_grouped_into_arms(train_cfg, tmp_path, capsys):
    """runs=: runs differing only in their seed form one arm: its mean, sd and 95% interval at each
    distance are those of the runs' own accuracies (t(0.975, 1) = 12.706)."""
    from helpers import compose_cfg
    from tools.needle import needle
    from train import train
    for seed in (1, 2):
        train(train_cfg("data=mqar", "data.pairs=[4]", "data.vocab_size=40", "data.examples=100", "model.block_size=32",
                        "train.max_iters=2", "train.eval_interval=2", f"seed={seed}",
                        f"out_dir={tmp_path / 'sweep' / f'seed{seed}'}"))
    args = ["distances=[4,16]", "needles=50", "out=null"]
    one = [needle(compose_cfg("needle", [f"ckpt={tmp_path / 'sweep' / f'seed{s}'}", *args])) for s in (1, 2)]
    r = needle(compose_cfg("needle", [f"runs=[{tmp_path / 'sweep'}]", *args]))
    assert len(r["arms"]) == 1 and len(r["arms"][0]["runs"]) == 2
    for i, d in enumerate((4, 16)):
        a, b = (o["rows"][i]["accuracy"] for o in one)
        s = r["arms"][0]["accuracy"][d]
        assert s["n"] == 2 and s["mean"] == pytest.approx((a + b) / 2, abs=1e-12)
        assert s["sd"] == pytest.approx(abs(a - b) / math.sqrt(2), abs=1e-12)
        assert s["half"] == pytest.approx(12.706 * s["sd"] / math.sqrt(2), rel=1e-3, abs=1e-12)
    assert "mean ± sd over 2 runs" in capsys.readouterr().out


def test_last_probes_each_runs_newest_checkpoint_and_best_its_best_pt(train_cfg, tmp_path):
    """A run's best.pt and its newest ckpt_*.pt differ (here: best.pt made the newest holds other
    weights); last=true probes the newest, the default best.pt, each equal to ckpt= on that file."""
    from lab.checkpoint import BEST_NAME, load_checkpoint, save_checkpoint
    from helpers import compose_cfg
    from tools.needle import needle
    from train import train
    run = tmp_path / "sweep" / "seed1"
    train(train_cfg("data=mqar", "data.pairs=[4]", "data.vocab_size=40", "data.examples=100", "model.block_size=32",
                    "train.max_iters=4", "train.eval_interval=2", f"out_dir={run}"))
    state = load_checkpoint(run / BEST_NAME)
    state["model"] = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in state["model"].items()}
    save_checkpoint(run / BEST_NAME, state)  # a best.pt unlike the run's last weights
    args = ["distances=[4,16]", "needles=100", "out=null"]
    newest = sorted(run.glob("ckpt_*.pt"))[-1]
    want = {name: [r["accuracy"] for r in needle(compose_cfg("needle", [f"ckpt={path}", *args]))["rows"]]
            for name, path in (("last", newest), ("best", run / BEST_NAME))}
    assert want["last"] != want["best"]
    for name, extra in (("last", ["last=true"]), ("best", [])):
        arms = needle(compose_cfg("needle", [f"runs=[{tmp_path / 'sweep'}]", *args, *extra]))["arms"]
        assert [arms[0]["accuracy"][d]["mean"] for d in (4, 16)] == want[name], name
        assert needle(compose_cfg("needle", [f"ckpt={run}", *args, *extra]))["rows"][0]["accuracy"] == want[name][0]
