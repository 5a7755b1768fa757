"""variants/indexer.py, a learned lightning indexer (model.attn.select=indexer): the index score and the
chosen keys against the formula written out (float64, loops), its RoPE handling (a shift of every
position leaves the score as it was), full attention when k covers every key (outputs and gradients),
the KL against a formula written out and where its gradient goes, the probe's weights over the chosen
keys only, the keys counted, the checkpoint read through another choice; in the slow tier a training
run whose indexer learns and a run resumed from its middle."""
import dataclasses
import math
import shutil

import pytest
import torch
import torch.nn.functional as F

from attention import Mask
from helpers import hooked_outputs, plain_attention, variant_model as make
from model import GPT, GPTConfig
from rules import UserError
from variants.indexer import Indexer

ATTN = {"select": "indexer", "select_topk": 3, "indexer_heads": 3, "indexer_dim": 4}


def config(n_kv_head=4, **attn):
    return GPTConfig(vocab_size=40, block_size=64, n_layer=1, n_head=4, n_embd=32, n_kv_head=n_kv_head,
                     attn={**ATTN, **attn})


def rotated(x, pos, d, base=10000.0):
    """x (..., T, d) with each channel pair (2j, 2j+1) turned by the angle pos_t · base^(-2j/d), float64."""
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # (d/2,)
    a = pos.double()[:, None] * theta  # (T, d/2)
    x0, x1 = x.double()[..., 0::2], x.double()[..., 1::2]
    out = torch.empty(x.shape, dtype=torch.float64)
    out[..., 0::2], out[..., 1::2] = x0 * a.cos() - x1 * a.sin(), x0 * a.sin() + x1 * a.cos()
    return out


def score_written_out(sel, q, k, q_pos, k_pos, weights=None):
    """I[b, t, s] = Σ_j w_tj ReLU(q^I_tj · k^I_s / √d), one (t, s) at a time, float64: q and k turned back
    by RoPE's angles, the projections, the indexer's own rotation. weights: (wq, ww, wk) to use (float64
    tensors that may require grad), else the module's."""
    B, nh, Tq, hs = q.shape
    H, d = sel.heads, sel.dim
    wq, ww, wk = weights or (sel.wq.weight.double(), sel.ww.weight.double(), sel.wk.weight.double())
    q, k = rotated(q, -q_pos, hs), rotated(k, -k_pos, hs)  # as before RoPE
    qi = rotated((q.transpose(1, 2).reshape(B, Tq, nh * hs) @ wq.T).view(B, Tq, H, d).transpose(1, 2), q_pos, d)
    ki = rotated(k.transpose(1, 2).reshape(B, k.size(2), -1) @ wk.T, k_pos, d)  # (B, Tk, d)
    w = q.transpose(1, 2).reshape(B, Tq, nh * hs) @ ww.T / math.sqrt(H)  # (B, Tq, H)
    rows = []
    for b in range(B):
        for t in range(Tq):
            rows.append(torch.stack([sum(w[b, t, j] * torch.relu(qi[b, j, t] @ ki[b, s] / math.sqrt(d))
                                         for j in range(H)) for s in range(k.size(2))]))
    return torch.stack(rows).view(B, Tq, k.size(2))


def chosen_written_out(score, q_pos, k_pos, topk):
    """(B, Tq, Tk) bool: the topk keys with position <= the query's, by score, a tie to the newer key."""
    out = torch.zeros(score.shape, dtype=torch.bool)
    for b in range(score.size(0)):
        for t in range(score.size(1)):
            seen = [s for s in range(score.size(2)) if k_pos[s] <= q_pos[t]]
            for s in sorted(seen, key=lambda s: (-score[b, t, s].item(), -k_pos[s].item()))[:topk]:
                out[b, t, s] = True
    return out


@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_the_chosen_keys_are_the_top_k_of_the_index_score_written_out(n_kv):
    g = torch.Generator().manual_seed(n_kv)
    sel = Indexer(config(n_kv_head=n_kv))
    q, k = torch.randn(2, 4, 20, 8, generator=g), torch.randn(2, n_kv, 20, 8, generator=g)
    pos = torch.arange(20)
    score = score_written_out(sel, q, k, pos, pos)
    assert torch.allclose(sel.score(q, k, pos, pos).double(), score, atol=1e-5)
    got = sel(q, k, Mask(20, 20), pos, pos)()  # (B, 1, Tq, Tk): one choice for every head
    assert got.shape == (2, 1, 20, 20) and torch.equal(got[:, 0], chosen_written_out(score, pos, pos, 3))


def test_a_decode_step_chooses_among_keys_held_in_any_order():
    """One query over a cache whose slots hold positions out of order (a ring that slid): the same keys,
    by position, as written out."""
    g = torch.Generator().manual_seed(5)
    sel = Indexer(config(n_kv_head=2, select_topk=4))
    q, k = torch.randn(1, 4, 1, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g)
    k_pos = torch.tensor([40, 41, 42, 43, 32, 33, 34, 35, 36, 37, 38, 39])  # slot s holds position k_pos[s]
    q_pos = torch.tensor([43])
    want = chosen_written_out(score_written_out(sel, q, k, q_pos, k_pos), q_pos, k_pos, 4)
    assert torch.equal(sel(q, k, Mask(1, 12), q_pos, k_pos)()[:, 0], want)


@pytest.mark.parametrize("scaling", [{}, {"rope_scaling": "yarn", "rope_scaling_factor": 4.0}], ids=["rope", "yarn"])
def test_the_index_score_depends_on_positions_only_through_their_offset(scaling):
    """q and k rotated as the model's layers rotate them (its own RoPE table, scaled or not) to positions
    shifted by 57, scored at those positions: the same score. The indexer undoes the layer's RoPE and
    applies its own, so a slid cache chooses as recomputation does."""
    from attention import apply_rope
    g = torch.Generator().manual_seed(2)
    c = GPTConfig(**{**dataclasses.asdict(config(n_kv_head=2)), **scaling})
    sel, table = Indexer(c), GPT(c).rope_table(80)  # (80, hs/2, 2): cos and sin the layers rotate by
    q, k = torch.randn(2, 4, 10, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g)
    pos = torch.arange(10)
    turn = lambda x, at: apply_rope(x, table[at], dim=-2)  # noqa: E731  (B, heads, T, hs)
    at = lambda shift: sel.score(turn(q, pos + shift), turn(k, pos + shift), pos + shift, pos + shift)  # noqa: E731
    a, b = at(0), at(57)
    assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert not torch.allclose(a, sel.score(q, k, pos, pos), atol=1e-3)  # the rotation does reach the score


@pytest.mark.parametrize("n_kv", [4, 1])
def test_k_covering_every_key_is_full_attention(n_kv):
    """Outputs and every gradient of the main model equal the model without selection (the same weights):
    the indexer's loss adds gradient to its own parameters only, and nothing to the loss's value."""
    idx = torch.randint(40, (2, 64), generator=torch.Generator().manual_seed(1))
    models = [make(block_size=64, n_kv_head=n_kv, attn=a).train() for a in ({**ATTN, "select_topk": 64}, {})]
    assert models[0].load_state_dict(models[1].state_dict(), strict=False).unexpected_keys == []  # the same weights
    outs = [m(idx[:, :-1], idx[:, 1:]) for m in models]
    (logits, loss), (base_logits, base_loss) = outs
    assert torch.equal(loss, F.cross_entropy(logits.reshape(-1, 40), idx[:, 1:].reshape(-1)))  # CE's value, exactly
    assert torch.allclose(logits, base_logits, atol=1e-5) and torch.allclose(loss, base_loss, atol=1e-6)
    loss.backward()
    base_loss.backward()
    base = dict(models[1].named_parameters())
    for name, p in models[0].named_parameters():
        if ".select." in name:
            assert p.grad.abs().max() > 0, name  # the indexer learns
        else:
            assert torch.allclose(p.grad, base[name].grad, atol=1e-5), name


def kl_written_out(q, k, score, scale):
    """KL(p_t || softmax(I_t)) over keys 0..t, the mean over (b, t): p_t the mean over heads of each head's
    softmax(q·k·scale) over those keys (no sink), float64, one query at a time with F.kl_div."""
    B, nh, T, _ = q.shape
    k = k.repeat_interleave(nh // k.size(1), dim=1)
    total = 0.0
    for b in range(B):
        for t in range(T):
            p = torch.stack([torch.softmax(q[b, h, t].double() @ k[b, h, :t + 1].double().T * scale, -1)
                             for h in range(nh)]).sum(0)
            p = p / p.sum()
            total = total + F.kl_div(torch.log_softmax(score[b, t, :t + 1], -1), p, reduction="sum")
    return total / (B * T)


def test_the_kl_is_the_formula_and_its_gradient_reaches_the_indexer_alone():
    """In training, each layer's KL equals the formula written out (from the q and k at its hook points
    and the index score written out); the loss keeps the cross-entropy's value; its gradient is the
    cross-entropy's for the main model and indexer_kl x the written-out KL's for each indexer."""
    model = make(block_size=12, n_kv_head=2, attn={**ATTN, "indexer_kl": 0.5, "sink": "learned"}).train()
    seen = {}
    for l, block in enumerate(model.blocks):
        for name in ("hook_q", "hook_k"):
            getattr(block.attn, name).register_forward_hook(lambda m, i, o, key=(l, name): seen.__setitem__(key, o))
    idx = torch.randint(40, (2, 13), generator=torch.Generator().manual_seed(4))
    logits, loss = model(idx[:, :-1], idx[:, 1:])
    ce = F.cross_entropy(logits.reshape(-1, 40), idx[:, 1:].reshape(-1))
    assert torch.equal(loss, ce)
    params = dict(model.named_parameters())
    main = [n for n in params if ".select." not in n]
    want_main = torch.autograd.grad(ce, [params[n] for n in main], retain_graph=True)
    loss.backward()
    pos = torch.arange(12)
    for l, block in enumerate(model.blocks):
        sel = block.attn.select
        q, k = seen[(l, "hook_q")].transpose(1, 2).detach(), seen[(l, "hook_k")].transpose(1, 2).detach()
        weights = [w.weight.detach().double().requires_grad_() for w in (sel.wq, sel.ww, sel.wk)]
        kl = kl_written_out(q, k, score_written_out(sel, q, k, pos, pos, weights), block.attn.scale)
        assert sel.kl_sum.item() == pytest.approx(kl.item(), abs=1e-5) and kl > 0.01
        for w, got in zip(torch.autograd.grad(kl, weights), (sel.wq, sel.ww, sel.wk)):
            diff = (got.weight.grad.double() - 0.5 * w).abs().max()
            assert diff < 1e-5, diff
    for name, want in zip(main, want_main):
        assert torch.allclose(params[name].grad, want, atol=1e-6), name


def test_the_kl_alone_moves_no_weight_of_the_main_model():
    """The gradient of the KLs a training forward keeps reaches the indexers' weights and nothing else;
    the LM loss's reaches everything else and no indexer."""
    model = make(block_size=12, n_kv_head=2, attn=ATTN).train()
    idx = torch.randint(40, (2, 12), generator=torch.Generator().manual_seed(6))
    logits = model(idx)  # no targets: the KLs stay on the modules
    kl = sum(b.attn.select.pending for b in model.blocks)
    names, params = zip(*model.named_parameters())
    by_kl = torch.autograd.grad(kl, params, allow_unused=True, retain_graph=True)
    by_lm = torch.autograd.grad(logits.logsumexp(-1).mean(), params, allow_unused=True)
    for name, a, b in zip(names, by_kl, by_lm):
        if ".select." in name:
            assert a is not None and a.abs().max() > 0 and b is None, name
        else:
            assert (a is None or not a.any()) and b is not None, name
    with torch.no_grad():  # evaluation keeps no KL
        model(idx)
    assert all(b.attn.select.pending is None for b in model.blocks)


@pytest.mark.parametrize("impl", ["sdpa", "reference"])
def test_the_layer_and_the_probe_read_the_chosen_keys_only(impl):
    """The layer's output is the softmax over the chosen keys written out (from its hook points); the
    probe's logits (CausalSelfAttention.scores) are -inf exactly where the choice says no, for the whole
    sequence and for a slice of its queries."""
    model = make(block_size=32, n_kv_head=2, impl=impl, attn=ATTN)
    attn = model.blocks[0].attn
    seen = hooked_outputs(model, attn, torch.randint(40, (2, 32), generator=torch.Generator().manual_seed(2)))
    q, k, v = (seen[n].transpose(1, 2).double() for n in ("hook_q", "hook_k", "hook_v"))  # (B, heads, T, hs)
    pos = torch.arange(32)
    chosen = chosen_written_out(score_written_out(attn.select, q, k, pos, pos), pos, pos, 3)[:, None]  # (B, 1, T, T)
    assert chosen.sum(-1).lt(torch.arange(1, 33)).any()  # some query leaves keys out
    want = plain_attention(q, k, v, 1 / math.sqrt(q.size(-1)), causal=False, keep=chosen)
    assert torch.allclose(seen["hook_z"].transpose(1, 2).double(), want, atol=1e-5)
    with torch.no_grad():
        probe, _ = attn.scores(seen["hook_q"], seen["hook_k"])
        part, _ = attn.scores(seen["hook_q"], seen["hook_k"], 9, 20)
    assert torch.equal(probe.isfinite(), chosen.expand(2, 4, 32, 32))
    assert torch.equal(part.isfinite(), chosen.expand(2, 4, 32, 32)[:, :, 9:20, :20])


def test_the_keys_each_query_reads_and_the_parameters_are_what_counting_says():
    """counting.selected_keys against the keys the built layer's choice lets through, counted on its mask;
    counting.count_params against the built model (the indexer's three matrices in each softmax layer)."""
    from fractions import Fraction
    from lab.counting import count_params, selected_keys
    for attn in ({**ATTN, "select_topk": 5}, {**ATTN, "select_topk": 5, "layer_kinds": ["softmax", "gdn"]}):
        c = GPTConfig(vocab_size=40, block_size=30, n_layer=2, n_head=4, n_embd=32, n_kv_head=2, attn=attn)
        model = GPT(c)
        assert count_params(c)["total"] == model.num_params()
    model = make(block_size=30, attn={**ATTN, "select_topk": 5})
    seen = model.blocks[0].attn.select(torch.randn(2, 4, 30, 8), torch.randn(2, 4, 30, 8), Mask(30, 30),
                                       torch.arange(30), torch.arange(30))()
    per_query = seen.sum(-1)  # (B, 1, T)
    for row in per_query.flatten(0, 1):
        assert Fraction(int(row.sum()), 30) == selected_keys(model.config, 30)


def test_only_softmax_layers_get_an_indexer():
    model = make(attn={**ATTN, "layer_kinds": ["softmax", "gdn"]})
    assert isinstance(model.blocks[0].attn.select, Indexer) and getattr(model.blocks[1].attn, "select", None) is None
    assert not any(".select." in n for n, _ in model.blocks[1].named_parameters())


@pytest.mark.parametrize("attn,needle", [
    ({"window": 8}, "with a window it is not implemented"),
    ({"impl": "tiled"}, "with the tiled path it is not implemented"),
])
def test_what_the_indexer_cannot_take_is_one_line(attn, needle):
    with pytest.raises(UserError, match=needle) as e:
        config(**attn)
    assert "\n" not in str(e.value)


def test_a_checkpoint_is_read_through_another_choice_but_an_indexer_needs_its_training():
    """with_selection: select=none on an indexer checkpoint is its model reading every key (the indexer's
    weights left out); select=indexer on a checkpoint trained without one is one line."""
    from lab.checkpoint import model_from_checkpoint, with_selection
    trained = make(block_size=16, attn=ATTN)
    state = {"model": trained.state_dict(), "model_config": dataclasses.asdict(trained.config)}
    full = model_from_checkpoint(with_selection(state, "none")).eval()
    assert not any(".select." in n for n in full.state_dict())
    idx = torch.randint(40, (2, 16), generator=torch.Generator().manual_seed(8))
    every = make(block_size=16, attn={**ATTN, "select_topk": 16})
    every.load_state_dict(trained.state_dict())
    with torch.no_grad():
        assert torch.allclose(full(idx), every(idx), atol=1e-5)
        assert not torch.allclose(full(idx), trained(idx), atol=1e-3)  # the choice of 3 keys did matter
    plain = make(block_size=16)
    with pytest.raises(UserError, match="select=indexer needs a checkpoint trained with") as e:
        with_selection({"model": plain.state_dict(), "model_config": dataclasses.asdict(plain.config)}, "indexer")
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- runs

RUN = ["model.attn.select=indexer", "model.attn.select_topk=8", "model.block_size=32", "train.log_attn_interval=0",
       "train.final_eval_tokens=0"]


@pytest.mark.slow  # two runs of 120 steps
def test_a_run_logs_the_indexer_kl_and_its_training_lowers_it(train_cfg, tmp_path):
    """aux/indexer_kl on every log line; trained (indexer_kl=1), its mean over the last 3 log lines is
    below half the untrained indexer's (indexer_kl=0: the same run, the indexer left at its init). On
    repeated spans, whose copying heads attend sharply (a near-uniform p is matched by any indexer)."""
    from lab.tracking import read_metrics
    from train import train
    steps = [*RUN, "data=repeated_spans", "model.block_size=64", "train.batch_size=8", "train.max_iters=120",
             "train.log_interval=10", "train.eval_interval=120", "train.lr=3e-3"]
    kls = {}
    for w in (1.0, 0.0):
        out = tmp_path / f"kl{w}"
        train(train_cfg(*steps, f"model.attn.indexer_kl={w}", f"out_dir={out}"))
        lines = [m for m in read_metrics(out) if "train/loss" in m and "lr" in m]
        assert [m["step"] for m in lines] == list(range(10, 121, 10)) and all("aux/indexer_kl" in m for m in lines)
        kls[w] = sum(m["aux/indexer_kl"] for m in lines[-3:]) / 3
    assert kls[1.0] < 0.5 * kls[0.0], kls


@pytest.mark.slow  # trains 8 steps twice
def test_a_run_resumed_from_its_middle_is_the_uninterrupted_run(train_cfg, tmp_path):
    """Weights (the indexer's too), optimizer state and every logged line, aux/indexer_kl included,
    bit for bit."""
    from lab.checkpoint import load_checkpoint, step_name
    from helpers import metrics_without_timing
    from train import train
    steps = [*RUN, "train.max_iters=8", "train.ckpt_interval=4", "train.keep_ckpts=10", "train.eval_interval=4",
             "train.log_interval=1", "model.dropout=0.1"]
    train(train_cfg(*steps))
    a, b = tmp_path / "run", tmp_path / "resumed"
    shutil.copytree(a, b)
    (b / step_name(8)).unlink()  # as if killed after step 4's checkpoint
    train(train_cfg(*steps, f"out_dir={b}", "resume=true"))
    assert metrics_without_timing(b) == metrics_without_timing(a)
    assert any("aux/indexer_kl" in m for m in metrics_without_timing(a))
    wa, wb = load_checkpoint(a / step_name(8)), load_checkpoint(b / step_name(8))
    assert any(".select." in key for key in wa["model"])
    for key, tensor in wa["model"].items():
        assert torch.equal(tensor, wb["model"][key]), key
    for i, s in wa["optimizer"]["state"].items():
        assert all(torch.equal(t, wb["optimizer"]["state"][i][k]) for k, t in s.items() if torch.is_tensor(t)), i
