"""lab/parallel.py: FSDP2 through the real torchrun (gloo on CPU) against one process, its checkpoints
(one format: resumed bitwise after kill -9, resumed and sampled in one process), what each rank holds
under FSDP and DDP measured on the live objects against counting.per_gpu_bytes, and activation
checkpointing (the same losses and gradients, the activation memory autograd keeps, measured)."""
import os
import re
import shutil
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist

from lab.checkpoint import load_checkpoint, step_name
from lab.device import Runtime
from lab.parallel import Dist
from rules import UserError
from lab.config import check_train_config
from lab.counting import activation_bytes, per_gpu_bytes
from helpers import assert_same_training, compose_cfg, metrics_without_timing, variant_model
from model import GPT, GPTConfig
from lab.optim import build_optimizer
from lab.parallel import FullyShard, Replicated, checkpoint_blocks
from sample import sample
from train import train, train_step

CPU32 = Runtime(torch.device("cpu"), torch.float32)


def saved_bytes(model, *args):
    """Bytes of the tensors autograd saves for the backward during model(*args), each storage once,
    the model's own parameters and buffers left out (they are weights, not activations); and the loss."""
    state = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in state:
            seen.setdefault(s.data_ptr(), s.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(*args)
    return sum(seen.values()), loss


# ----------------------------------------------------------------------------- activation checkpointing

def test_activation_checkpointing_gives_the_same_losses_and_gradients():
    """Dropout on: the recomputation must draw the same masks (checkpoint_wrapper restores the RNG).
    Three steps of AdamW, each model from the same seed on the same batches: bitwise the same."""
    runs = []
    for checkpointing in (False, True):
        model = variant_model(seed=0, dropout=0.1).train()
        if checkpointing:
            checkpoint_blocks(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        torch.manual_seed(2)
        losses, grads = [], []
        for _ in range(3):
            x, y = torch.randint(0, 40, (4, 16), generator=g), torch.randint(0, 40, (4, 16), generator=g)
            _, loss = model(x, y)
            loss.backward()
            losses.append(loss.item())
            grads.append({n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
                          for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad()
        runs.append((losses, grads, model.state_dict()))
    (la, ga, wa), (lb, gb, wb) = runs
    assert la == lb
    assert list(wa) == list(wb)  # the checkpoint's names are unchanged by the wrapper
    for a, b in zip(ga, gb):
        for name in a:
            d = (a[name] - b[name]).abs().max().item()
            assert torch.equal(a[name], b[name]), f"{name}: max diff {d:.2e}"
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("fields", [{}, {"mlp": "swiglu", "norm": "rmsnorm"}, {"n_kv_head": 1},
                                    {"pos": "learned", "bias": True}, {"mlp": "relu2", "norm_position": "post"}],
                         ids=["gelu-layernorm", "swiglu-rmsnorm", "mqa", "learned-bias", "relu2-post"])
def test_activation_memory_is_what_autograd_saves_and_checkpointing_lowers_it(fields):
    """counting.activation_bytes' `kept`, byte for byte, against the tensors autograd saves (measured
    with saved_tensors_hooks), with and without checkpointing; checkpointing keeps only each block's
    input: several times less."""
    c = GPTConfig(vocab_size=100, block_size=64, n_layer=3, n_head=4, n_embd=64, **fields)
    x, y = torch.randint(0, 100, (4, 64)), torch.randint(0, 100, (4, 64))
    measured = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = GPT(c)
        if checkpointing:
            checkpoint_blocks(model)
        measured[checkpointing], _ = saved_bytes(model, x, y)
        assert measured[checkpointing] == activation_bytes(c, 4, 64, 4, checkpointing)["kept"]
    assert measured[True] * 5 < measured[False]


# ----------------------------------------------------------------------------- what each rank holds

def local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def two_ranks_hold(rank, port, out):
    """One of two gloo processes: the same model under DDP and under FSDP (both with activation
    checkpointing), one training step of two micro-batches per rank, and what this rank holds."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        c = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32)  # every row count even
        tcfg = compose_cfg("config", ["model=debug"]).train
        g = torch.Generator().manual_seed(0)
        batches = [(torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g))
                   for _ in range(4)]
        held, norms, states, kinds = {}, {}, {}, {"ddp": Replicated, "fsdp": FullyShard}
        for name, kind in kinds.items():
            torch.manual_seed(0)
            model = checkpoint_blocks(GPT(c))
            par = kind(Dist(rank, 2), CPU32)
            fwd = par.wrap(model)
            opt = build_optimizer(model, tcfg, CPU32.device)
            grads = []
            opt.register_step_pre_hook(lambda *_: grads.append(sum(local_bytes(p.grad) for p in model.parameters())))
            _, norm, finite = train_step(fwd, opt, batches[2 * rank:2 * rank + 2], 2, 0.5, CPU32,
                                         torch.amp.GradScaler("cpu", enabled=False), world=2)
            assert finite
            moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
            held[name] = {"weights": sum(local_bytes(p) for p in model.parameters()), "gradients": grads[0],
                          "adamw_state": sum(map(local_bytes, moments))}
            if name == "ddp":  # the reducer's flat gradient buckets (DDP's logging data, in bytes)
                held[name]["buffers"] = sum(map(int, re.findall(r"\d+", fwd._get_ddp_logging_data()["bucket_sizes"])))
            norms[name] = norm.item()
            states[name] = (par.model_state(model), par.optimizer_state(model, opt), model, opt, par)
        # per rank, measured on the live objects = counted; FSDP's exactly half of DDP's
        for name in kinds:
            count = per_gpu_bytes(c, 4, 16, world=2, parallel=name, dtype_bytes=4)
            assert held[name] == {k: count[k] for k in held[name]}, (name, held[name], count)
        for key in ("weights", "gradients", "adamw_state"):
            assert 2 * held["fsdp"][key] == held["ddp"][key]
        assert norms["fsdp"] == pytest.approx(norms["ddp"], rel=1e-6)  # clipping saw the global norm
        full_w, full_o = states["ddp"][:2]
        if rank == 0:  # FSDP's gathered state is the one-process layout: the same names, ids and groups
            w, o = states["fsdp"][:2]
            assert list(w) == list(full_w) and w["lm_head.weight"] is w["wte.weight"]
            assert all(torch.allclose(w[k], full_w[k], atol=1e-6) for k in w)
            assert o["param_groups"] == full_o["param_groups"] and list(o["state"]) == list(full_o["state"])
            for i, s in o["state"].items():
                assert s.keys() == full_o["state"][i].keys()
                assert all(torch.allclose(s[k], full_o["state"][i][k], atol=1e-6) for k in s)
        else:
            assert states["fsdp"][:2] == ({}, {})  # gathered to rank 0 alone
        # loaded back into the sharded model, the full state gathers to itself, bit for bit
        _, _, model, opt, par = states["fsdp"]
        par.load_model(model, full_w)
        par.load_optimizer(model, opt, full_o)
        w, o = par.model_state(model), par.optimizer_state(model, opt)
        if rank == 0:
            assert all(torch.equal(w[k], full_w[k]) for k in w)
            assert all(torch.equal(s[k], full_o["state"][i][k]) for i, s in o["state"].items() for k in s)
        (out / f"rank{rank}.ok").write_text(repr(held))
    finally:
        dist.destroy_process_group()


def test_fsdp_ranks_hold_half_of_ddp_measured_on_the_live_objects(tmp_path, spawn):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn(two_ranks_hold, args=(port, tmp_path), nprocs=2, join=True)
    assert sorted(p.name for p in tmp_path.glob("rank*.ok")) == ["rank0.ok", "rank1.ok"]


# ----------------------------------------------------------------------------- FSDP through torchrun

FSDP_COMMON = ["model=debug", "model.dropout=0.0", "train.max_iters=30", "train.eval_interval=10", "train.eval_iters=2",
               "train.log_interval=5", "train.batch_size=4", "train.grad_accum=4", "train.ckpt_interval=5",
               "train.keep_ckpts=10", "train.final_eval_tokens=1056", "device=cpu", "logger.wandb.mode=disabled",
               "logger.plots=false"]
# 33 windows of 32 tokens for the last evaluation: 17 on rank 0, 16 on rank 1, so rank 1 runs one
# spare forward (FSDP needs every rank in every forward) that must not count
FSDP = ["train.parallel=fsdp", "train.activation_checkpointing=true"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def children(pid: int) -> list:
    """The pids of a live process's children (Linux /proc)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def assert_close_checkpoints(a, b, tol):
    """Weights and optimizer state of two checkpoints within tol (0: bitwise), in the same layout."""
    for name, t in a["model"].items():
        d = (t - b["model"][name]).abs().max().item()
        assert d <= tol and (tol or torch.equal(t, b["model"][name])), f"{name}: max diff {d:.2e}"
    oa, ob = a["optimizer"], b["optimizer"]
    assert oa["param_groups"] == ob["param_groups"] and list(oa["state"]) == list(ob["state"])
    for i, s in oa["state"].items():
        assert s.keys() == ob["state"][i].keys()
        for k, t in s.items():
            d = (t - ob["state"][i][k]).abs().max().item()
            assert d <= tol and (tol or torch.equal(t, ob["state"][i][k])), f"optimizer state {i} {k}: max diff {d:.2e}"


def test_fsdp_under_torchrun_equals_one_process_resumes_bitwise_after_kill_and_loads_in_one_process(tmp_path, cli):
    """FSDP (with activation checkpointing) over 2 processes, AdamW with 2 micro-batches per rank, 30
    steps, against one plain process: within 1e-5. The same FSDP run killed with -9 (agent and both
    workers, as a crashed machine) after step 20 and resumed under torchrun: every metric, weight
    and AdamW moment bit for bit. Its checkpoint at step 20 resumes in one process without torchrun
    (world 2 -> 1, the same global batch), and samples. One scenario, so three torchrun starts do."""
    cache = tmp_path / "cache"
    single, fsdp, killed, one = (tmp_path / name for name in ("single", "fsdp", "killed", "one"))
    train(compose_cfg("config", [*FSDP_COMMON, f"data.cache_dir={cache}", f"out_dir={single}"]))
    args = [*FSDP_COMMON, *FSDP, f"data.cache_dir={cache}"]
    cli("train.py", *args, f"hydra.run.dir={fsdp}", "logger.plots=true", env=ONE_THREAD, check=True, torchrun=2)
    assert (fsdp / "attention.html").stat().st_size > 1000  # the maps' forward ran on both ranks

    # weights and every val loss within 1e-5 (reduce-scatters sum in another order), the full val split's too;
    # the checkpoint is the one-process layout (the tied weight stored once)
    assert_same_training(single, fsdp, step=30, tol=1e-5)
    a, b = load_checkpoint(single / step_name(30)), load_checkpoint(fsdp / step_name(30))
    assert_close_checkpoints(a, b, 1e-5)
    assert b["model"]["lm_head.weight"] is b["model"]["wte.weight"]
    full = [m["val/loss_full"] for m in metrics_without_timing(single, keep_final=True)
            + metrics_without_timing(fsdp, keep_final=True) if "val/loss_full" in m]
    assert len(full) == 2 and full[0] == pytest.approx(full[1], abs=1e-5)
    assert [m["step"] for m in metrics_without_timing(fsdp) if "attn_entropy/mean" in m] == [0, 10, 20, 30]

    # kill -9 mid-run, then resume under torchrun: bitwise the uninterrupted run
    proc = cli.popen("train.py", *args, f"hydra.run.dir={killed}", env=ONE_THREAD, torchrun=2)
    deadline = time.time() + 240
    while not (killed / step_name(20)).exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.001)
    workers = children(proc.pid)  # torchrun starts each in a session of its own: killed one by one
    for pid in [*workers, proc.pid]:  # no clean-up of any kind, on any rank
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and len(workers) == 2, "the run finished before it could be killed"
    resumed_from = max(int(p.stem.split("_")[1]) for p in killed.glob("ckpt_*.pt"))
    assert 20 <= resumed_from < 30
    r = cli("train.py", *args, f"hydra.run.dir={killed}", "resume=true", env=ONE_THREAD, torchrun=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resuming from {killed / step_name(resumed_from)} at step {resumed_from}" in r.stderr
    assert metrics_without_timing(killed) == metrics_without_timing(fsdp)
    assert_close_checkpoints(b, load_checkpoint(killed / step_name(30)), 0)

    # one process, no torchrun: the FSDP checkpoint resumes (4 micro-batches a step, as before) and samples
    one.mkdir()
    shutil.copy(fsdp / step_name(20), one)
    result = train(compose_cfg("config", [*args, f"out_dir={one}", "resume=true"]))
    assert_close_checkpoints(b, load_checkpoint(one / step_name(30)), 1e-5)
    assert result["val_loss_full"] == pytest.approx(full[1], abs=1e-5)
    texts = sample(compose_cfg("sample", ["device=cpu", f"ckpt={fsdp}", "max_new_tokens=20", "prompt=The"]))
    assert len(texts) == 1 and len(texts[0]) > 1


# ----------------------------------------------------------------------------- what is refused

def test_muon_under_fsdp_is_refused_in_one_line(train_cfg):
    with pytest.raises(UserError, match="Newton-Schulz step orthogonalises each whole matrix") as e:
        check_train_config(train_cfg("train.optimizer=muon", "train.parallel=fsdp"))
    assert "\n" not in str(e.value)


def test_fp16_under_fsdp_is_refused_in_one_line():
    with pytest.raises(UserError, match="fp16 would need a sharded grad scaler") as e:
        FullyShard(Dist(0, 2), Runtime(torch.device("cpu"), torch.float16))
    assert "\n" not in str(e.value)
