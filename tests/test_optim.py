"""train.optimizer=muon: which parameters Muon takes, that its step is torch.optim.Muon's, that the schedule
scales every group, that GradScaler and checkpoints see one optimizer, exact resume and DDP through the CLI."""
import copy

import pytest
import torch

from lab.checkpoint import load_checkpoint, step_name
from lab.device import setup_runtime
from rules import UserError
from helpers import assert_same_training, cli_args, compose_cfg, metrics_without_timing
from model import GPT, GPTConfig
from lab.optim import MUON_NS_DTYPES, Muon, MuonAdamW, build_optimizer, lr_at, newton_schulz, set_lr, split_params
from train import train_step

CPU = torch.device("cpu")
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # added to the environment of the CLI runs
VARIANTS = {  # every kind of parameter a model can have: gains (1-D and 2-D), biases, untied head, positions
    "default": {},
    "bias_untied_learned_pos": {"bias": True, "tie_embeddings": False, "pos": "learned"},
    "qk_gain_per_channel_gqa": {"attn": {"qk_norm": True, "qk_norm_gain": "channel"}, "n_head": 4, "n_kv_head": 2},
    "qk_gain_per_head_rmsnorm_swiglu": {"attn": {"qk_norm": True, "qk_norm_gain": "head"}, "norm": "rmsnorm",
                                        "mlp": "swiglu"},
}


def tcfg(*overrides):
    return compose_cfg("config", ["train.optimizer=muon", *overrides]).train


def tiny_model(seed=0, **kw):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{"vocab_size": 17, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16, **kw}))


def backward(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(17, (3, 8), generator=g)
    _, loss = model(x, torch.roll(x, -1, 1))
    loss.backward()


@pytest.mark.parametrize("variant", VARIANTS)
def test_muon_groups_cover_every_parameter_once_and_muon_takes_only_block_matrices(variant):
    model = tiny_model(**VARIANTS[variant])
    opt = build_optimizer(model, tcfg(), CPU)
    in_groups = [p for g in opt.param_groups for p in g["params"]]
    assert len(in_groups) == len({id(p) for p in in_groups}), "a parameter is in two groups"
    assert {id(p) for p in in_groups} == {id(p) for p in model.parameters()}, "a parameter is in no group"
    muon = {id(p) for g in opt.muon.param_groups for p in g["params"]}
    expected = {id(m.weight) for m in model.blocks.modules() if isinstance(m, torch.nn.Linear)}
    assert muon == expected
    names = {id(p): n for n, p in model.named_parameters()}
    for p in opt.muon.param_groups[0]["params"]:
        assert p.dim() == 2, f"{names[id(p)]} {tuple(p.shape)} went to Muon"
    assert not any("gain" in names[i] or "wte" in names[i] or "lm_head" in names[i] for i in muon)
    # AdamW decays the remaining matrices (embedding, head, positions) and nothing 1-D
    decay, no_decay = opt.adamw.param_groups
    assert decay["weight_decay"] > 0 and no_decay["weight_decay"] == 0
    assert all(p.dim() == 2 for p in decay["params"]) and model.wte.weight in decay["params"]


def reference_muon(W, t, lr, ns_dtype=torch.bfloat16):
    """torch.optim.Muon on a copy of one matrix, the hyperparameters written out from the config (with
    ns_dtype=float32, optim.Muon's float32 iteration)."""
    p = torch.nn.Parameter(W.detach().clone())
    kw = dict(lr=lr, weight_decay=t.muon_weight_decay, momentum=t.muon_momentum, nesterov=True,
              ns_steps=t.muon_ns_steps, adjust_lr_fn=t.muon_adjust_lr)
    return p, (torch.optim.Muon([p], **kw) if ns_dtype == torch.bfloat16 else Muon([p], ns_dtype=ns_dtype, **kw))


def test_a_muon_step_equals_torch_muon_applied_by_hand_to_the_same_matrix():
    """With the Newton-Schulz iteration in bf16, as torch runs it, the step is torch.optim.Muon's, bit for bit."""
    t = tcfg("train.lr=1e-3", "train.muon_lr=4e-3", "train.muon_weight_decay=0.05", "train.warmup_iters=2",
             "train.muon_ns_dtype=bfloat16")
    model = tiny_model()
    opt = build_optimizer(model, t, CPU)
    W = model.blocks[1].mlp.c_fc.weight
    ref, ref_opt = reference_muon(W, t, lr=0.0)
    emb = torch.nn.Parameter(model.wte.weight.detach().clone())  # AdamW's side, by hand too
    emb_opt = torch.optim.AdamW([emb], lr=0.0, betas=(t.beta1, t.beta2), weight_decay=t.weight_decay,
                               fused=True)  # as build_optimizer: fused and foreach kernels round apart
    for step in range(3):  # warmup steps and beyond; from step 1 on the momentum buffer counts
        lr = lr_at(step, t)
        set_lr(opt, lr)
        opt.zero_grad()
        backward(model, seed=step)
        ref.grad, emb.grad = W.grad.clone(), model.wte.weight.grad.clone()
        opt.step()
        ref_opt.param_groups[0]["lr"] = lr * 4  # muon_lr / lr: the schedule scales Muon's base lr
        emb_opt.param_groups[0]["lr"] = lr
        ref_opt.step()
        emb_opt.step()
        d = (W - ref).abs()
        assert torch.equal(W, ref), f"step {step}: max diff {d.max():.3e}, mean {d.mean():.3e}"
        assert torch.equal(model.wte.weight, emb), f"step {step}: AdamW side differs"
    assert opt.muon.param_groups[0]["lr"] == pytest.approx(4 * opt.adamw.param_groups[0]["lr"])


@pytest.mark.parametrize("n_kv_head", [4, 2])
@pytest.mark.parametrize("ns_dtype", ["bfloat16", "float32"])
def test_muon_split_qkv_steps_q_k_and_v_as_three_matrices(ns_dtype, n_kv_head):
    """train.muon_split_qkv=true: the fused projection's q, k and v rows take the step torch.optim.Muon
    takes on three separate matrices (bit for bit with bf16 Newton-Schulz; fp32 to rounding); the
    other matrices take the same first step as without the option."""
    t = tcfg("train.lr=1e-3", "train.muon_lr=4e-3", "train.muon_weight_decay=0.05", f"train.muon_ns_dtype={ns_dtype}",
             "train.muon_split_qkv=true")
    model = tiny_model(n_head=4, n_kv_head=n_kv_head)
    plain = copy.deepcopy(model)
    opt, plain_opt = build_optimizer(model, t, CPU), build_optimizer(plain, tcfg(*t_overrides(t)), CPU)
    assert opt.adamw.defaults["fused"] is True  # (the option once overwrote AdamW's fused flag with a set)
    W = model.blocks[0].attn.c_attn.weight  # rows: q (16), k and v (16 / (4 / n_kv_head) each)
    rows = [16, 4 * n_kv_head, 4 * n_kv_head]
    # the reference: three separate matrices; torch's Muon for bf16, ours (tested above against the update
    # written out) for fp32
    refs = [reference_muon(w, t, lr=4e-3, ns_dtype=MUON_NS_DTYPES[ns_dtype]) for w in W.split(rows)]
    for step in range(3):
        for o in (opt, plain_opt):
            set_lr(o, 1e-3)
            o.zero_grad()
        backward(model, seed=step)
        backward(plain, seed=step)
        for (p, _), g in zip(refs, W.grad.split(rows)):
            p.grad = g.clone()
        opt.step()
        plain_opt.step()
        for _, o in refs:
            o.step()
        want = torch.cat([p for p, _ in refs])
        if ns_dtype == "bfloat16":
            assert torch.equal(W, want), f"step {step}: max diff {(W - want).abs().max():.3e}"
        else:
            torch.testing.assert_close(W.detach(), want.detach(), rtol=1e-5, atol=1e-7)
        if step == 0:  # (later the models differ, and so do their gradients)
            fc, plain_fc = model.blocks[1].mlp.c_fc.weight, plain.blocks[1].mlp.c_fc.weight
            assert torch.equal(fc, plain_fc), "a matrix outside q|k|v took another step with the option"
    assert not torch.allclose(W, plain.blocks[0].attn.c_attn.weight, atol=1e-4)  # split differs from fused


def t_overrides(t):
    """The overrides of tcfg t without muon_split_qkv."""
    return [f"train.{k}={t[k]}" for k in ("lr", "muon_lr", "muon_weight_decay", "muon_ns_dtype")]


def newton_schulz_fp32(G, steps=5, a=3.4445, b=-4.7750, c=2.0315):
    """Jordan's quintic Newton-Schulz iteration written out in float32 (torch's runs in bfloat16)."""
    X = G.T if G.size(0) > G.size(1) else G
    X = X / X.norm()
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if G.size(0) > G.size(1) else X


def test_newton_schulz_in_bf16_is_torchs_bit_for_bit_and_in_fp32_the_same_iteration():
    from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns  # the reference, private to torch
    g = torch.Generator().manual_seed(0)
    for shape in [(48, 16), (16, 48), (32, 32)]:  # tall, wide, square
        G = torch.randn(shape, generator=g)
        assert torch.equal(newton_schulz(G, 5, dtype=torch.bfloat16), torch_ns(G, (3.4445, -4.775, 2.0315), 5, 1e-7))
        torch.testing.assert_close(newton_schulz(G, 5, dtype=torch.float32), newton_schulz_fp32(G), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("momentum_warmup", [0, 2])
def test_a_float32_muon_step_is_the_muon_update_written_out(momentum_warmup):
    """train.muon_ns_dtype=float32 (auto on a CPU): momentum, Nesterov, decoupled decay and the per-matrix lr
    factor as torch.optim.Muon applies them, with a float32 Newton-Schulz written out in this file."""
    t = tcfg("train.lr=1e-3", "train.muon_lr=4e-3", "train.muon_weight_decay=0.05", "train.muon_momentum=0.9",
             f"train.muon_momentum_warmup={momentum_warmup}", "train.muon_momentum_start=0.5")
    model = tiny_model()
    opt = build_optimizer(model, t, CPU)
    assert opt.muon.ns_dtype == torch.float32  # auto, on a CPU
    W = model.blocks[0].attn.c_attn.weight  # (48, 16): tall
    ref, buf = W.detach().clone(), torch.zeros_like(W)
    for step in range(4):
        set_lr(opt, 1e-3)
        opt.zero_grad()
        backward(model, seed=step)
        g, mu = W.grad.clone(), opt.momentum_at(step, 0.9)
        opt.step()
        buf = mu * buf + (1 - mu) * g  # torch's lerp form of momentum
        update = newton_schulz_fp32((1 - mu) * g + mu * buf)  # Nesterov: g.lerp(buf, mu)
        ref = ref * (1 - 4e-3 * 0.05) - 4e-3 * 0.2 * max(W.shape) ** 0.5 * update
        torch.testing.assert_close(W.detach(), ref, rtol=1e-5, atol=1e-6, msg=f"step {step}")


def test_the_muon_update_is_the_orthogonalised_gradient_scaled_to_adamw_rms():
    """Independent of torch's code: from zero momentum the Nesterov update is (1 - m^2) g, so W moves by
    0.2 * sqrt(max(A, B)) * lr * NS(g). NS(g) is near g's polar factor U V^T with singular values in
    Jordan's band (~0.7..1.2, by design not 1), and equals a float32 Newton-Schulz up to bfloat16 rounding.
    g is a random (well-conditioned) matrix: a tiny model's gradient has near-zero singular values that
    five iterations, by design, leave small."""
    model = tiny_model()
    opt = build_optimizer(model, tcfg("train.muon_weight_decay=0.0"), CPU)
    W = model.blocks[0].attn.c_attn.weight  # (3C, C) = (48, 16)
    before = W.detach().clone()
    W.grad = torch.randn(W.shape, generator=torch.Generator().manual_seed(0))
    opt.step()
    O = (before - W.detach()) / (0.2 * max(W.shape) ** 0.5 * opt.muon.param_groups[0]["lr"])
    s = torch.linalg.svdvals(O)
    assert 0.6 < s.min() and s.max() < 1.25, f"singular values of the update {s.min():.3f}..{s.max():.3f}"
    U, _, Vh = torch.linalg.svd(W.grad, full_matrices=False)
    cos = (O * (U @ Vh)).sum() / (O.norm() * (U @ Vh).norm())
    assert cos > 0.97, f"update vs polar factor of the gradient: cosine {cos:.4f}"
    ref = newton_schulz_fp32(W.grad)
    d = (O - ref).norm() / ref.norm()
    assert d < 0.03, f"vs float32 Newton-Schulz: relative difference {d:.4f}, max {(O - ref).abs().max():.3e}"


def test_momentum_warmup_rises_linearly_then_holds():
    model = tiny_model()
    opt = build_optimizer(model, tcfg("train.muon_momentum_warmup=4", "train.muon_momentum_start=0.85",
                                      "train.muon_momentum=0.95"), CPU)
    seen = []
    for _ in range(6):
        backward(model)
        opt.step()
        seen.append(opt.muon.param_groups[0]["momentum"])
        opt.zero_grad()
    assert seen == pytest.approx([0.85, 0.875, 0.9, 0.925, 0.95, 0.95])


def test_grad_scaler_unscales_and_steps_the_combined_optimizer():
    """fp16's GradScaler reaches Muon's and AdamW's gradients through param_groups: a scaled step
    (power-of-two scale, exact in fp32) gives the same weights as an unscaled one."""
    rt = setup_runtime("cpu", "float32")
    x = torch.randint(17, (3, 8), generator=torch.Generator().manual_seed(0))
    after = []
    for enabled in (False, True):
        model = tiny_model()
        opt = build_optimizer(model, tcfg(), CPU)
        scaler = torch.amp.GradScaler("cpu", enabled=enabled, init_scale=2.0 ** 12)
        for _ in range(2):
            *_, finite = train_step(model, opt, [(x, torch.roll(x, -1, 1))], 1, 1.0, rt, scaler)
            assert finite
        after.append(copy.deepcopy(model.state_dict()))
    for name, w in after[0].items():
        assert torch.equal(w, after[1][name]), name


def test_state_dict_round_trips_through_a_checkpoint_file_and_continues_exactly(tmp_path):
    t = tcfg("train.muon_momentum_warmup=5")
    a = tiny_model()
    opt_a = build_optimizer(a, t, CPU)
    for step in range(3):
        set_lr(opt_a, lr_at(step, t))
        backward(a, seed=step)
        opt_a.step()
        opt_a.zero_grad()
    torch.save({"model": a.state_dict(), "optimizer": opt_a.state_dict()}, tmp_path / "opt.pt")
    state = torch.load(tmp_path / "opt.pt", weights_only=True)  # as checkpoints load: plain tensors and containers
    b = tiny_model(seed=5)
    b.load_state_dict(state["model"])
    opt_b = build_optimizer(b, t, CPU)
    opt_b.load_state_dict(state["optimizer"])
    assert opt_b.steps == 3
    for model, opt in ((a, opt_a), (b, opt_b)):
        set_lr(opt, lr_at(3, t))
        backward(model, seed=3)
        opt.step()
    for name, w in a.state_dict().items():
        assert torch.equal(w, b.state_dict()[name]), name


def test_resuming_an_adamw_checkpoint_with_muon_says_so_in_one_line():
    model = tiny_model()
    adamw_state = build_optimizer(model, tcfg("train.optimizer=adamw"), CPU).state_dict()
    with pytest.raises(UserError, match="optimizer state is AdamW's"):
        build_optimizer(model, tcfg(), CPU).load_state_dict(adamw_state)


def test_a_bad_muon_setting_is_refused_before_the_data_is_prepared(tmp_path, cli):
    r = cli("train.py", "model=debug", "train.optimizer=muon", "train.muon_ns_dtype=float16", "device=cpu",
            "logger.wandb.mode=disabled", f"data.cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}",
            env=ONE_THREAD)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == ("error: train.muon_ns_dtype='float16' is unknown: "
                                                 "use one of auto, bfloat16, float32")
    assert not (tmp_path / "cache").exists()  # nothing prepared, nothing written


def test_adamw_default_is_unchanged():
    model = tiny_model()
    opt = build_optimizer(model, compose_cfg("config").train, CPU)
    assert isinstance(opt, torch.optim.AdamW) and not isinstance(opt, MuonAdamW)
    muon, decay, no_decay = split_params(model)
    assert len(opt.param_groups[0]["params"]) == len(muon) + len(decay)  # AdamW decays the same matrices


MUON_CLI = ["train.optimizer=muon", "train.muon_lr=4e-3", "train.muon_momentum_warmup=40", "train.warmup_iters=10",
            "train.lr_decay_iters=60"]


def test_muon_run_stopped_and_resumed_is_bitwise_identical(tmp_path, cli):
    """60 steps straight vs 30 steps, a new process, resume to 60: every metric, weight and both optimizers'
    states equal. Momentum warmup (40 steps) spans the resume point; dropout draws from the restored RNG."""
    cache = tmp_path / "cache"
    a, b = tmp_path / "a", tmp_path / "b"
    cli("train.py", *cli_args(a, cache), *MUON_CLI, env=ONE_THREAD, check=True)
    first = [x if x != "train.max_iters=60" else "train.max_iters=30" for x in cli_args(b, cache)]
    cli("train.py", *first, *MUON_CLI, env=ONE_THREAD, check=True)
    r = cli("train.py", *cli_args(b, cache), *MUON_CLI, "resume=true", env=ONE_THREAD, check=True)
    assert f"resuming from {b / step_name(30)} at step 30" in r.stderr
    assert metrics_without_timing(b) == metrics_without_timing(a)
    wa, wb = load_checkpoint(a / step_name(60)), load_checkpoint(b / step_name(60))
    for name, tensor in wa["model"].items():
        assert torch.equal(tensor, wb["model"][name]), name
    oa, ob = wa["optimizer"], wb["optimizer"]
    assert oa["steps"] == ob["steps"] == 60
    for kind, key in (("muon", "momentum_buffer"), ("adamw", "exp_avg_sq")):
        assert oa[kind]["state"].keys() == ob[kind]["state"].keys()
        for i, s in oa[kind]["state"].items():
            assert s[key].equal(ob[kind]["state"][i][key]), f"{kind} state {i}"


DDP_COMMON = ["model=debug", "model.dropout=0.0", "train.max_iters=10", "train.eval_interval=5", "train.eval_iters=2",
              "train.log_interval=5", "train.batch_size=4", "device=cpu", "logger.wandb.mode=disabled",
              "logger.plots=false", "train.optimizer=muon"]


def test_muon_under_torchrun_equals_one_process_with_the_same_global_batch(tmp_path, cli):
    """DDP averages gradients before the step, so every rank runs the same Muon on the same matrices:
    2 processes x 1 micro-batch = 1 process x 2. Here the two are bitwise equal (halving a sum of two is
    exact); the tolerance leaves room for another reduction order, whose ~1e-7 differences Muon's
    bfloat16 Newton-Schulz could round to one bf16 step of an update entry (~lr * 1e-3)."""
    cache = tmp_path / "cache"
    single, multi = tmp_path / "single", tmp_path / "multi"
    cli("train.py", *DDP_COMMON, "train.grad_accum=2", f"data.cache_dir={cache}", f"hydra.run.dir={single}",
        env=ONE_THREAD, check=True)
    cli("train.py", *DDP_COMMON, f"data.cache_dir={cache}", f"hydra.run.dir={multi}", env=ONE_THREAD, check=True,
        torchrun=2)
    assert_same_training(single, multi, step=10, tol=1e-4)
