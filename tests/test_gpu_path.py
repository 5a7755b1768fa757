"""The CUDA training path, checked on CPU: each test reproduces on CPU a failure that a
first GPU run would have hit, with the GPU part stood in for: a monkeypatched device capability,
device name or world size, the CPU GradScaler with fp16 autocast, the meta device, gloo processes."""
import json
import os
import socket
import types

import pytest
import torch
import torch.distributed as dist

from lab import device
from lab import parallel
import train as train_module
from lab.checkpoint import load_checkpoint, rng_state, set_rng_state, step_name
from lab.device import Runtime, peak_flops_for, pick_dtype
from helpers import compose_cfg, poison_training_loss
from model import GPT, GPTConfig
from train import train, train_step

CUDA = torch.device("cuda")  # only named, never used: no test here touches a GPU


# ----------------------------------------------------------------------------- resuming on a GPU

def test_resume_restores_rng_states_on_a_device_other_than_the_cpu(train_cfg, tmp_path, monkeypatch):
    """The checkpoint is read to CPU: read to the run's device, the sampler and RNG byte tensors
    would land there and Generator.set_state / torch.set_rng_state would raise. The meta device
    stands in for the GPU (the same failure); the model stays on the CPU."""
    train(train_cfg("train.max_iters=10"))

    class StaysOnCpu(GPT):
        def to(self, *args, **kwargs):
            return self
    monkeypatch.setattr(train_module, "GPT", StaysOnCpu)
    monkeypatch.setattr(train_module, "setup_runtime", lambda device, dtype: Runtime(torch.device("meta"), torch.float32))
    run = train_module.setup(train_cfg("train.max_iters=20", "resume=true", "train.log_attn_interval=0"))
    try:
        assert run.step == 10 and run.rt.device.type == "meta"
        saved = load_checkpoint(tmp_path / "run" / step_name(10))
        assert torch.equal(run.sampler.get_state(), saved["sampler"])  # the data position was restored
        assert torch.equal(torch.get_rng_state(), saved["rng"]["torch"])
    finally:
        run.tracker.close()
        run.lock.close()


# ----------------------------------------------------------------------------- MFU under DDP

def test_mfu_is_per_gpu_when_tokens_per_sec_counts_every_process():
    logged = []
    config = GPTConfig(vocab_size=64, n_layer=2, n_head=2, n_embd=32, block_size=16)
    # 6N (per block 12 d² of matrices and two norms' d weights; ln_f; the tied head) + attention's 12 L T d
    flops = 6 * (2 * (12 * 32 * 32 + 2 * 32) + 32 + 64 * 32) + 12 * 2 * 16 * 32
    from lab.counting import flops_per_token
    from lab.tracking import StepStats, log_progress
    tracker = types.SimpleNamespace(log=lambda line, step: logged.append(line))
    meter = train_module.Throughput(tokens_per_step=4 * 8 * 1024)  # the global batch: 4 processes' tokens
    meter.steps = 10
    log_progress(tracker, train_module.Watch(), meter, 10, 100, StepStats(torch.tensor(3.0), torch.tensor(1.0), 1e-3),
                 world=4, flops=flops_per_token(config), peak=1e12)
    line = logged[0]
    assert line["mfu"] == pytest.approx(flops * line["tokens_per_sec"] / (4 * 1e12), rel=1e-12)


# ----------------------------------------------------------------------------- a compile sweep

COMPILE_SWEEP = """
import functools, json, os, runpy, sys
import torch
from hydra.core.hydra_config import HydraConfig

compiled = []
def backend(gm, example_inputs):  # dynamo's guards and recompile limit as with inductor, no code generation
    compiled.append([HydraConfig.get().job.num, torch.is_grad_enabled()])
    return gm.forward
torch.compile = functools.partial(torch.compile, backend=backend)
sys.argv = ["train.py"] + sys.argv[1:]
try:
    runpy.run_path("train.py", run_name="__main__")
finally:
    with open(os.environ["COMPILED_LOG"], "w") as f:
        json.dump(compiled, f)
"""


def test_every_point_of_a_seven_point_compile_sweep_really_compiles(tmp_path, cli):
    """`python train.py -m ... compile=true` runs the sweep's jobs in one process: without a dynamo
    reset per run, each point's model.dropout is one more guard on the same code, the 5th point
    hits dynamo's recompile limit and later points silently run eager (while recording compiled)."""
    log = tmp_path / "compiled.json"
    env = {"COMPILED_LOG": str(log)}
    r = cli("-c", COMPILE_SWEEP, "-m", "model=debug", "device=cpu", "compile=true", "logger.wandb.mode=disabled",
            "logger.plots=false", "train.max_iters=2", "train.eval_interval=2", "train.eval_iters=1", "train.log_interval=1",
            "train.batch_size=4", "train.log_attn_interval=0", "model.dropout=0.01,0.02,0.03,0.04,0.05,0.06,0.07",
            f"data.cache_dir={tmp_path / 'cache'}", f"hydra.sweep.dir={tmp_path / 'sweep'}", timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "recompile_limit" not in r.stderr and "cache_size_limit" not in r.stderr
    assert len(list((tmp_path / "sweep").glob("[0-9]_*"))) == 7
    compiled = json.loads(log.read_text())
    trained = sorted({job for job, grad in compiled if grad})  # the training forward, per job
    evaluated = sorted({job for job, grad in compiled if not grad})  # the eval forward (no_grad)
    assert trained == list(range(7)) and evaluated == list(range(7)), compiled


# ----------------------------------------------------------------------------- dtype=auto

@pytest.mark.parametrize("capability, gpu, dtype", [((7, 0), "V100", torch.float16), ((7, 5), "T4", torch.float16),
                                                    ((8, 0), "A100", torch.bfloat16), ((8, 9), "L4", torch.bfloat16),
                                                    ((9, 0), "H100", torch.bfloat16)])
def test_auto_dtype_is_bf16_only_where_the_gpu_has_it(monkeypatch, capability, gpu, dtype):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)  # what V100 and T4 report (emulation)
    assert pick_dtype("auto", CUDA) == dtype, gpu
    assert pick_dtype("auto", torch.device("cpu")) == torch.float32
    assert pick_dtype("bfloat16", CUDA) == torch.bfloat16  # asked for, given


# ----------------------------------------------------------------------------- fp16 skipping a step

def test_fp16_run_skips_a_nonfinite_step_and_goes_on(train_cfg, tmp_path, monkeypatch):
    """The GradScaler's unscale_ of a skipped step must be closed by update(), or the next step's
    unscale_ raises. CPU autocast has fp16 and the CPU GradScaler is the CUDA one's logic."""
    poison_training_loss(monkeypatch, {5: float("nan")})
    result = train(train_cfg("dtype=float16", "train.max_iters=12", "train.eval_interval=6", "train.skip_nonfinite=1"))
    assert result["steps"] == 12
    scaler = load_checkpoint(tmp_path / "run" / step_name(12))["scaler"]
    assert scaler["scale"] < 2.0 ** 16  # the NaN step lowered the scale: update() saw its inf gradients


# ----------------------------------------------------------------------------- an fp32 checkpoint resumed in fp16

@pytest.mark.slow  # trains 10 steps, then resumes to 14
def test_resume_a_float32_checkpoint_in_float16(train_cfg, tmp_path):
    train(train_cfg("train.max_iters=10", "dtype=float32"))
    assert load_checkpoint(tmp_path / "run" / step_name(10))["scaler"] == {}  # a disabled scaler's state
    result = train(train_cfg("train.max_iters=14", "dtype=float16", "resume=true"))
    assert result["steps"] == 14
    assert load_checkpoint(tmp_path / "run" / step_name(14))["scaler"]["scale"] > 0  # a fresh scaler from here


# ----------------------------------------------------------------------------- peak FLOP/s

@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12), ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
    ("NVIDIA H100 PCIe", torch.float32, 378e12), ("NVIDIA H100 NVL", torch.bfloat16, 835e12),
    ("NVIDIA H200", torch.bfloat16, 989e12), ("NVIDIA H200 NVL", torch.bfloat16, 835e12),
    ("NVIDIA GH200 480GB", torch.bfloat16, 989e12), ("NVIDIA A100-SXM4-80GB", torch.float32, 156e12),
    ("NVIDIA L40", torch.bfloat16, 181e12), ("NVIDIA L40S", torch.bfloat16, 362e12), ("NVIDIA L4", torch.bfloat16, 121e12),
    ("NVIDIA L4", torch.float32, 60e12), ("Tesla V100-SXM2-16GB", torch.float16, 125e12),
    ("Tesla V100-SXM2-16GB", torch.float32, 15.7e12), ("Tesla V100-SXM2-16GB", torch.bfloat16, 15.7e12),
    ("Tesla T4", torch.float16, 65e12), ("NVIDIA GeForce RTX 4090", torch.bfloat16, 165e12),
    ("NVIDIA A10G", torch.bfloat16, None), ("NVIDIA B200", torch.bfloat16, None),
])
def test_peak_flops_match_whole_names_and_the_dtype(name, dtype, peak):
    assert peak_flops_for(name, dtype) == peak


def test_peak_flops_of_a_run_follow_its_dtype(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    assert device.peak_flops(Runtime(CUDA, torch.float32)) == 378e12  # fp32 runs use TF32 tensor cores
    assert device.peak_flops(Runtime(CUDA, torch.bfloat16)) == 756e12
    assert device.peak_flops(Runtime(CUDA, torch.bfloat16), override=1e12) == 1e12


# ----------------------------------------------------------------------------- torchrun on GPUs

@pytest.mark.parametrize("device, backend, expected", [("cuda:0", "nccl", "cuda:1"), ("cuda", "nccl", "cuda:1"),
                                                       ("auto", "nccl", "cuda:1"), ("cpu", "gloo", None)])
def test_under_torchrun_each_rank_takes_its_local_gpu_over_nccl(monkeypatch, device, backend, expected):
    calls = {}
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")  # the second process of the second machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.setdefault("set_device", i))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend: calls.setdefault("backend", backend))
    d = parallel.init_distributed(device)
    assert (d.rank, d.world, d.device_name) == (3, 4, expected)
    assert calls["backend"] == backend and calls.get("set_device") == (1 if backend == "nccl" else None)


class Tiny(torch.nn.Module):
    """(None, loss) like GPT; the loss is multiplied by y, so a rank can be given a NaN loss."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return None, self.lin(x).sum() * y


def two_ranks(rank, port, cfg_overrides, out):
    """One of two gloo processes: setup() as under torchrun, the finite-step decision, and the CUDA
    RNG states (torch.cuda's functions replaced by stand-ins that name the rank)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    seeds = []
    torch.cuda.manual_seed = seeds.append
    run = train_module.setup(compose_cfg("config", cfg_overrides))  # opens the gloo process group
    try:
        # each GPU its own CUDA seed (dropout masks differ per rank); the CPU's (weights, batches) alike
        assert seeds == [1337 + rank], seeds
        # DDP first, then compile: the compiled graph overlaps the all-reduce with backward
        assert isinstance(run.fwd_model, torch._dynamo.eval_frame.OptimizedModule)
        assert isinstance(run.fwd_model._orig_mod, torch.nn.parallel.DistributedDataParallel)

        # a NaN loss on rank 1 alone: both ranks skip the step (no rank steps while another skips)
        torch.manual_seed(0)
        model, rt = Tiny(), Runtime(torch.device("cpu"), torch.float32)
        before = model.lin.weight.detach().clone()
        y = torch.tensor(float("nan") if rank == 1 else 1.0)
        _, _, finite = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), [(torch.ones(2, 4), y)], 1, 1.0,
                                  rt, torch.amp.GradScaler("cpu", enabled=False), world=2)
        assert finite is False and torch.equal(model.lin.weight, before)

        # every rank's CUDA RNG state goes into the checkpoint; rank r restores its own
        restored = []
        torch.cuda.get_rng_state = lambda device="cuda": torch.full((16,), 10 + rank, dtype=torch.uint8)
        torch.cuda.set_rng_state = lambda state, device="cuda": restored.append((int(state[0]), device))
        gpu = torch.device("cuda", rank)
        state = rng_state(gpu, world=2)
        assert [int(s[0]) for s in state["cuda"]] == [10, 11]
        set_rng_state(state, gpu, rank)
        assert restored == [(10 + rank, gpu)]
        (out / f"rank{rank}.ok").write_text("ok")
    finally:
        run.tracker.close()
        if run.lock is not None:
            run.lock.close()
        dist.destroy_process_group()


def test_two_ranks_seed_their_gpus_apart_agree_on_skipping_and_save_every_ranks_cuda_rng(tmp_path, spawn):
    from data.prepare import prepare
    overrides = ["model=debug", "device=cpu", "compile=true", "logger.wandb.mode=disabled", "logger.plots=false",
                 f"out_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
    prepare(compose_cfg("config", overrides).data)  # once, before two processes read it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn(two_ranks, args=(port, overrides, tmp_path), nprocs=2, join=True)
    assert sorted(p.name for p in tmp_path.glob("rank*.ok")) == ["rank0.ok", "rank1.ok"]


# ----------------------------------------------------------------------------- the compiled decode step and the static cache

def test_compiled_decode_step_mutates_only_static_inputs_so_cuda_graphs_can_capture_it(monkeypatch):
    """mode="reduce-overhead" skips CUDA graphs when an input the graph mutates in place is not a static
    address ("skipping cudagraphs due to mutated inputs"). The step writes the KV cache and the position:
    inductor must see every mutated input as static. Read from what inductor compiles (on the CPU its
    CUDA-graph path is never taken, but the mutated and static inputs are the same), and one graph
    serves every step (no recompile)."""
    import inspect

    from torch._inductor import output_code

    from helpers import variant_model
    from sample import generate
    seen, real = [], output_code.CompiledFxGraph.__init__
    names = list(inspect.signature(real).parameters)[1:]

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        static = {**dict(zip(names, args)), **kwargs}.get("static_input_idxs") or ()
        seen.append((sorted(self.mutated_input_idxs), sorted(static)))
    monkeypatch.setattr(output_code.CompiledFxGraph, "__init__", spy)
    torch._dynamo.reset()
    model = variant_model(block_size=32)
    # an earlier compile of the same graph would be a cache hit, which builds no CompiledFxGraph. The
    # caches are switched off through torch's own config.patch: it restores the config modules exactly
    # (setting them as plain attributes and undoing that broke the next test's compile in this worker)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        generate(model, torch.zeros(1, 3, dtype=torch.long), 40, temperature=0, compile=True)  # past block_size
    torch._dynamo.reset()
    assert len(seen) == 1, f"{len(seen)} graphs compiled"
    mutated, static = seen[0]
    assert mutated and set(mutated) <= set(static), f"mutated inputs {mutated} not all static {static}"


def test_static_cache_pads_to_aligned_key_lengths_and_computes_the_same():
    """The static cache's storage is a multiple of 64 slots (GPU kernels want aligned key lengths);
    the pad is never visible: step by step past the ring's wrap, the logits equal the dynamic cache's."""
    from helpers import variant_model
    model = variant_model(block_size=20)
    idx = torch.randint(40, (2, 50))
    out = {}
    for static in (False, True):
        cache = model.new_kv_cache(2, 20, static=static)
        with torch.no_grad():
            steps = [model(idx[:, :7], cache=cache, pos=0)[:, -1]]
            for t in range(7, 50):
                steps.append(model(idx[:, t:t + 1], cache=cache, pos=torch.tensor([t]) if static else t)[:, -1])
        out[static] = torch.stack(steps)
        assert all(c.k.size(2) == (64 if static else 20) for c in cache)
    assert torch.allclose(out[True], out[False], atol=1e-5)


def test_tf32_is_set_with_the_precision_api_and_warns_nothing(monkeypatch):
    """torch >= 2.9 deprecates allow_tf32 (it warns): CUDA runs set fp32_precision = "tf32"."""
    import warnings
    saved = (torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision)
    monkeypatch.setattr(device, "pick_device", lambda name: CUDA)
    monkeypatch.setattr(device, "pick_dtype", lambda name, device, key="dtype": torch.bfloat16)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rt = device.setup_runtime("cuda", "auto")
        assert rt.device == CUDA
        assert torch.backends.cuda.matmul.fp32_precision == torch.backends.cudnn.fp32_precision == "tf32"
    finally:
        torch.backends.cuda.matmul.fp32_precision, torch.backends.cudnn.fp32_precision = saved


def test_bench_sample_times_what_sample_py_runs(monkeypatch):
    """The decode benchmark uses sample.py's rules: its autocast dtype, its weight layout on the
    device (column-major on a CPU), and kv_dtype=auto as sample.py resolves it per batch size."""
    import sample as sample_module
    from helpers import compose_cfg
    import tools.bench_sample as bs
    seen = []
    real = sample_module.generate

    def spy(model, idx, *args, **kwargs):
        w = model.blocks[0].attn.c_attn.weight
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), w.stride(0) == 1,
                     idx.size(0), kwargs.get("kv_dtype")))
        return real(model, idx, *args, **kwargs)
    monkeypatch.setattr(bs, "generate", spy)
    bs.bench_sample(compose_cfg("bench_sample", ["model=debug", "tokens=4", "batch_sizes=[1,2]", "compile=[false]",
                                                 "recompute=false", "repeats=1", "kv_dtypes=[auto]",
                                                 "dtype=bfloat16"]))
    assert seen and all(autocast and dt == torch.bfloat16 and column for autocast, dt, column, _, _ in seen)
    assert {(b, kv) for *_, b, kv in seen} == {(1, torch.bfloat16), (2, torch.bfloat16)}  # auto: the autocast dtype


def test_gpu_check_dry_run_leaves_its_logs_in_out(cli, tmp_path):
    """What comes back from a GPU machine is $OUT: the check's step logs go there (the imports step
    alone here: it runs first and is enough to see the files)."""
    out = tmp_path / "out"
    out.mkdir()
    r = cli("tools/gpu_check.sh", env={"DEVICE": "cpu", "ONLY": "^imports$", "OUT": str(out), "GPU_WHEELS": str(tmp_path / "none")},
            timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "imports" in (out / "steps.log").read_text() and "step times" in r.stdout
