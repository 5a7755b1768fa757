"""QK-Clip (train.qk_clip, lab/qk_clip.py) against its rescaling written out: each head's largest logit on
the batch, from the q and k the layer's hooks read, in float64 with the causal mask written out; a head over
τ has its W_q rows scaled by γ/√(min γ of its key group) and its W_k rows by √(min γ), the rest untouched;
after the clip that head's logits on the same batch are ≤ τ and the other heads' logits are unchanged."""
import copy
import json
import math

import pytest
import torch

from helpers import hooked_outputs, variant_model
from lab.qk_clip import clip_
from rules import UserError


def logits64(model, layer, idx):
    """(B, nh, T, T) scale·q·kᵀ in float64, -inf above the diagonal, from the q and k the layer's hooks read."""
    attn = model.blocks[layer].attn
    seen = hooked_outputs(model, attn, idx, names=("hook_q", "hook_k"))
    q = seen["hook_q"].double().transpose(1, 2)  # (B, nh, T, hs)
    k = seen["hook_k"].double().transpose(1, 2).repeat_interleave(attn.n_head // attn.n_kv_head, dim=1)
    s = q @ k.transpose(-2, -1) * attn.scale
    T = s.size(-1)
    return s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))


def head_max(model, layer, idx):
    return logits64(model, layer, idx).amax(dim=(0, 2, 3))  # (nh,)


def rescaled(weight, s_max, tau, n_head, n_kv_head, hs):
    """c_attn's weight with QK-Clip's rescaling written out, head by head: gamma_h = min(1, tau / S_h); a key
    head's rows times the square root of its group's smallest gamma, each query head's times gamma_h / that."""
    w, group, nq = weight.clone(), n_head // n_kv_head, n_head * hs
    gamma = [min(1.0, tau / float(s)) for s in s_max]
    for g in range(n_kv_head):
        low = min(gamma[g * group:(g + 1) * group])
        w[nq + g * hs:nq + (g + 1) * hs] *= math.sqrt(low)
        for h in range(g * group, (g + 1) * group):
            w[h * hs:(h + 1) * hs] *= gamma[h] / math.sqrt(low)
    return w


@pytest.mark.parametrize("n_kv_head", [4, 2])
def test_clip_rescales_the_heads_over_tau_as_written_out_and_bounds_their_logits(n_kv_head):
    """Layer by layer, as the clip goes: layer l's heads measured with the layers before it already clipped."""
    model = variant_model(seed=3, n_head=4, n_kv_head=n_kv_head, n_embd=32, block_size=16)
    reference = copy.deepcopy(model)
    idx = torch.randint(40, (3, 16), generator=torch.Generator().manual_seed(0))
    before = [head_max(model, l, idx) for l in range(2)]
    tau = float(before[0].median())  # some heads of layer 0 above, some below
    assert (before[0] > tau).any() and (before[0] <= tau).any()
    first_layer = logits64(model, 0, idx)
    clipped = 0
    for l, block in enumerate(reference.blocks):  # the reference: each layer from the clipped ones before it
        s_max = head_max(reference, l, idx)
        clipped += int((s_max > tau).sum())
        with torch.no_grad():
            block.attn.c_attn.weight.copy_(rescaled(block.attn.c_attn.weight, s_max, tau, 4, n_kv_head, 8))

    out = clip_(model, [idx[:2], idx[2:]], tau)  # two micro-batches: one clip over both

    v_rows = slice(32 + 2 * n_kv_head * 8, None)
    for l in range(2):
        w, ref = model.blocks[l].attn.c_attn.weight, reference.blocks[l].attn.c_attn.weight
        assert torch.allclose(w, ref, rtol=1e-5, atol=1e-7)
        assert torch.equal(w[v_rows], reference.blocks[l].attn.c_attn.weight[v_rows])  # V never
        assert float(head_max(model, l, idx).max()) <= tau * (1 + 1e-5)  # every head of every layer under tau
    after = logits64(model, 0, idx)
    for h in range(4):
        if before[0][h] > tau:  # clipped: its largest logit is now tau
            assert float(after[:, h].max()) == pytest.approx(tau, rel=1e-5)
        else:  # a head under tau keeps every logit, even when its key head was shrunk for another of its group
            finite = torch.isfinite(first_layer[:, h])
            assert torch.allclose(after[:, h][finite], first_layer[:, h][finite], rtol=1e-5, atol=1e-6)
    assert int(out["qk_clip/heads"]) == clipped > 0
    assert float(out["qk_clip/max_logit"]) == pytest.approx(float(before[0].max()), rel=1e-5) or \
        float(out["qk_clip/max_logit"]) >= float(before[0].max()) * (1 - 1e-5)


def test_heads_under_tau_are_untouched_and_a_high_tau_changes_nothing():
    model = variant_model(seed=1, n_head=4, n_embd=32, block_size=16)
    idx = torch.randint(40, (2, 16), generator=torch.Generator().manual_seed(1))
    weights = [p.detach().clone() for p in model.parameters()]
    top = max(float(head_max(model, l, idx).max()) for l in range(2))
    out = clip_(model, [idx], top * 1.01)
    assert int(out["qk_clip/heads"]) == 0
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))


def test_the_step_runs_in_eval_mode_and_leaves_the_mode_and_the_random_stream_as_they_were():
    model = variant_model(seed=2, n_head=4, n_embd=32, block_size=16, dropout=0.5).train()
    idx = torch.randint(40, (2, 16), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(7)
    clip_(model, [idx], 1.0)
    drawn = torch.rand(3)
    torch.manual_seed(7)
    assert model.training and torch.equal(torch.rand(3), drawn)  # no dropout mask drawn by the measurement


@pytest.mark.parametrize("overrides, needle", [
    (["model.attn.qk_norm=true"], "QK-Norm normalises q and k"),
    (["model.attn.kind=linear"], "acts on no layer"),
    (["model.attn.kind=mla"], "acts on no layer"),
    (["train.qk_clip=0"], "train.qk_clip"),
])
def test_qk_clip_refuses_what_it_cannot_act_on_in_one_line(train_cfg, overrides, needle):
    from lab.config import check_train_config
    qk = [] if any(o.startswith("train.qk_clip") for o in overrides) else ["train.qk_clip=10"]
    with pytest.raises(UserError, match=needle) as e:
        check_train_config(train_cfg(*qk, *overrides))
    assert "\n" not in str(e.value)


def test_a_run_with_qk_clip_logs_it_and_its_heads_end_under_tau(train_cfg, tmp_path):
    """A real run (20 steps, lr 0.1, no warmup) with tau 2: the metrics log, at each logged step, the largest
    logit the step's batch gave (measured before the clip) and how many heads were clipped: some where it
    passed tau, none where it did not."""
    from train import train
    train(train_cfg("train.qk_clip=2", "train.lr=0.1", "train.warmup_iters=0", "train.log_layer_grads=true"))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [m for m in lines if "aux/qk_clip/max_logit" in m]
    assert all(f"aux/grad_norm/L{i}" in m for m in logged for i in range(2))  # and each block's gradient norm
    assert logged and logged[0]["aux/qk_clip/heads"] >= 1  # lr 0.1 from step 0: the logits pass 2 at once
    assert all((m["aux/qk_clip/heads"] > 0) == (m["aux/qk_clip/max_logit"] > 2) for m in logged)  # measured before the clip
