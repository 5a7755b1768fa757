"""What the tests share besides fixtures (those are in conftest.py): paths, composing configs, the one
way to start the repo's commands as processes, reading back W&B offline logs, and helpers that more
than one test module uses. Test modules import from here (`from helpers import ...`), never from
each other or from conftest.

A test that starts a process gets the means through a fixture (`cli`, `chromium`, `spawn`,
`dead_pid` in conftest.py), never by calling run_cli / popen_cli / run_chromium here directly: the
fixtures are what marks a test `slow`."""
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

# ----------------------------------------------------------------------------- paths and configs

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
SHAKESPEARE = SHARED_DATA / "tinyshakespeare.txt"
TIKTOKEN_CACHE = SHARED_DATA / "tiktoken"


def compose_cfg(config_name="config", overrides=()):
    from lab import config  # noqa: F401  (registers the schema)

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))


TINY = ["model=debug", "device=cpu", "logger.wandb.mode=disabled", "train.max_iters=20",
        "train.eval_interval=10", "train.eval_iters=2", "train.log_interval=5", "train.batch_size=4",
        "logger.plots=false"]  # the end-of-run figures cost seconds; the tests of them turn them on


def requires_shared(path):
    return pytest.mark.skipif(not Path(path).exists(), reason=f"{path} absent: these tests read a local copy of it")


def corpus_text(n=200):
    """A small varied corpus: n lines of a few dozen characters."""
    return "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13}.\n" for i in range(n))


# ----------------------------------------------------------------------------- one-line errors

def one_line(e) -> str:
    """The message of a raised UserError (pytest's ExceptionInfo or the error), asserted to be one line."""
    msg = str(e.value if hasattr(e, "value") else e)
    assert "\n" not in msg, msg
    return msg


def assert_one_line_error(r, needle=""):
    """A finished command: exit status 1, no traceback, and exactly one `error:` line, the last one,
    holding `needle`."""
    lines = r.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(errors) == 1 and lines[-1] == errors[0] and needle in errors[0], r.stderr[-3000:]


# ----------------------------------------------------------------------------- processes (through fixtures)

TORCHRUN = ["-m", "torch.distributed.run", "--standalone"]


def cli_command(script, args=(), prefix=(), torchrun=0):
    """The argv of `python SCRIPT ARGS...` (`bash SCRIPT ...` for a .sh): SCRIPT relative to the repo (or a python flag such as
    "-c", passed as it is, its code the first of ARGS); torchrun=N starts N processes through torchrun;
    prefix goes before python (e.g. a command that drops root's powers)."""
    if str(script).endswith(".sh"):  # a shell script of tools/
        return [*prefix, "bash", str(REPO / script), *map(str, args)]
    launcher = [*TORCHRUN, f"--nproc_per_node={torchrun}"] if torchrun else []
    target = script if str(script).startswith("-") else str(REPO / script)
    return [*prefix, sys.executable, *launcher, target, *map(str, args)]


def cli_env(env=None):
    return {**os.environ, "WANDB_SILENT": "true", **(env or {})}


def run_cli(script, *args, env=None, timeout=300, cwd=REPO, prefix=(), torchrun=0, check=False):
    """Run a repo command to its end: the CompletedProcess, text output captured. env adds to the
    test's environment; check=True asserts exit status 0 (showing the end of stderr)."""
    r = subprocess.run(cli_command(script, args, prefix, torchrun), cwd=cwd, capture_output=True, text=True,
                       timeout=timeout, env=cli_env(env))
    assert r.returncode == 0 or not check, r.stderr[-3000:]
    return r


def popen_cli(script, *args, env=None, cwd=REPO, prefix=(), torchrun=0, **popen_kwargs):
    """Start a repo command and return the live Popen (for signals): stdout and stderr piped, text;
    popen_kwargs override those or add others (preexec_fn, start_new_session)."""
    kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **popen_kwargs}
    return subprocess.Popen(cli_command(script, args, prefix, torchrun), cwd=cwd, env=cli_env(env), **kwargs)


def interruptible():
    """For a child that is sent Ctrl-C: SIGINT back to its default action before exec. A shell that
    starts the test run in the background (`cmd &`, nohup) leaves SIGINT ignored, the child inherits
    that, and Python then never raises KeyboardInterrupt: the signal would test nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def dead_pid() -> int:
    """The pid of a process that has exited."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no headless Chromium on PATH (apt-get install chromium; "
                                    ".ci/run installs it where apt is available)")


def run_chromium(*args, timeout=90):
    """Headless Chromium with its profile in args[0]; its stdout (e.g. --dump-dom)."""
    r = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--user-data-dir=" + args[0], *args[1:]], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


# ----------------------------------------------------------------------------- formulas written out

def plain_weights(q, k, scale, causal=True, window=None, sink=None, bias=None, keep=None):
    """softmax(q·kᵀ·scale + bias + M) written out in float64, (B, nh, Tq, Tk), K repeated per query-head
    group; queries are the last Tq of the Tk positions; M hides later keys and, with a window, keys W or
    more back, and with keep (booleans broadcastable to the scores) every key it does not mark; a sink
    (nh,) is one more logit per head, its weight left out of the result; bias (nh, Tq, Tk) is added."""
    import torch

    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    Tq, Tk = q.size(2), k.size(2)
    s = q @ k.transpose(-2, -1) * scale
    if bias is not None:
        s = s + bias.double()
    if causal:
        i = torch.arange(Tq)[:, None] + (Tk - Tq)
        j = torch.arange(Tk)[None, :]
        band = (j <= i) & ((j > i - window) if window is not None else True)
        s = s.masked_fill(~band, float("-inf"))
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    if sink is not None:
        s = torch.cat([sink.double().view(1, -1, 1, 1).expand(*s.shape[:-1], 1), s], dim=-1)
        return torch.softmax(s, dim=-1)[..., 1:]
    return torch.softmax(s, dim=-1)


def plain_attention(q, k, v, scale, causal=True, window=None, sink=None, bias=None, keep=None):
    """softmax(q·kᵀ·scale + bias + M)·v written out in float64: plain_weights (its arguments) times V
    repeated per query-head group; a sink's value is zero."""
    v = v.double().repeat_interleave(q.size(1) // v.size(1), dim=1)
    return plain_weights(q, k, scale, causal=causal, window=window, sink=sink, bias=bias, keep=keep) @ v


def grads(fn, *xs):
    """(fn(*xs), d/dxs of a fixed random projection of it): outputs and gradients to compare."""
    import torch

    xs = [x.detach().requires_grad_(True) for x in xs]
    out = fn(*xs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(out.dtype)
    return (out, *torch.autograd.grad((out * g).sum(), xs))


def saved_bytes(fn):
    """Bytes of the tensors autograd keeps for the backward pass while fn() runs, each storage once."""
    import torch

    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


# ----------------------------------------------------------------------------- shapes counted by hand

# MHA + GELU, everything else the defaults (LayerNorm without bias, Pre-LN, RoPE, tied head):
# d=64, 4 heads of 16, d_kv = 4*16 = 64, d_ff = 4*64 = 256, vocab 100, 2 layers.
MHA_GELU = dict(vocab_size=100, block_size=32, n_layer=2, n_head=4, n_embd=64)
# GQA + SwiGLU with RMSNorm and an untied head: d=80, 4 query heads of 20 sharing 2 K/V heads,
# d_kv = 2*20 = 40, d_ff = 64*ceil(8*80/3/64) = 64*ceil(3.33) = 256, vocab 100, 2 layers.
GQA_SWIGLU = dict(vocab_size=100, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=80, mlp="swiglu",
                  norm="rmsnorm", tie_embeddings=False)


# ----------------------------------------------------------------------------- models and training runs

# the characters of the tools' tests: a char vocabulary of 61 (sharp_model's default)
VOCAB = "\n !',.:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def sharp_model(seed=0, vocab=None, block_size=32, **over):
    """A two-layer, two-head GPT whose attention is sharp (q|k|v weights x6) and QK-Norm gains away from
    1, in eval mode: maps with structure to draw and read. over: GPTConfig fields."""
    import torch

    from model import GPT, GPTConfig

    torch.manual_seed(seed)
    fields = {"vocab_size": vocab or len(VOCAB), "block_size": block_size, "n_layer": 2, "n_head": 2, "n_embd": 32, **over}
    model = GPT(GPTConfig(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "gain" in name:
                p.uniform_(0.5, 2.0)
            elif "c_attn" in name:
                p.mul_(6)
    return model.eval()


def variant_model(seed=0, block_size=16, n_layer=2, n_head=4, n_embd=32, vocab=40, impl="sdpa", **kw):
    """A small GPT of any variant (GPTConfig fields as keywords; attn options merged with impl) with
    trained-looking weights, in eval mode."""
    import torch

    from model import GPT, GPTConfig

    attn = {"impl": impl, **kw.pop("attn", {})}
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                          attn=attn, **kw))
    with torch.no_grad():  # trained-looking weights: gains away from 1, no zero projections
        for name, p in model.named_parameters():
            if p.dim() < 2:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.3)
    return model.eval()


def hooked_outputs(model, attn, idx, names=("hook_q", "hook_k", "hook_v", "hook_z")) -> dict:
    """{name: output} of attention layer `attn`'s hook points in one no-grad forward of `model` on idx."""
    import torch
    seen = {}
    handles = [getattr(attn, name).register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o))
               for name in names]
    with torch.no_grad():
        model(idx)
    for h in handles:
        h.remove()
    return seen


def segments_minus_whole(model, T, cuts=(0, 3, 4, 5, 17, 18)) -> float:
    """A prefill, then single steps and chunks of several tokens through the model's cache, in float64,
    against one forward of the whole sequence: the largest difference."""
    import torch

    model = model.double()
    idx = torch.randint(model.config.vocab_size, (2, T))
    with torch.no_grad():
        full = model(idx)
        cache = model.new_kv_cache(2, T, dtype=torch.float64)
        cuts = [*cuts, T]
        parts = [model(idx[:, a:b], cache=cache, pos=a) for a, b in zip(cuts, cuts[1:])]
    return (torch.cat(parts, 1) - full).abs().max().item()


# ----------------------------------------------------------------------------- exports (tools/export.py)

EXPORT_TEXT = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJ.,:;!?'\n0123456789"  # the vocabulary of export tests


def export_chars():
    from data.tokenizer import CharTokenizer

    return CharTokenizer("".join(sorted(set(EXPORT_TEXT))))


def export_model(seed=0, tiny_qk=False, block_size=64, bos=False, **kw):
    """A tiny model over export_chars() with trained-looking random weights: norm weights and
    biases away from 1 and 0, projections larger than at init (so the attention is far from
    uniform), none left at zero (zero_init_proj); tiny_qk: q and k so small that norms' eps matter;
    bos: one more token (data.bos=true)."""
    import torch

    from model import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=export_chars().vocab_size + bos, block_size=block_size, n_layer=2, n_head=4,
                          n_embd=32, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(-0.5, 0.5) if name.endswith("bias") else p.uniform_(0.5, 1.5)
            else:
                if not p.any():
                    p.normal_(0, 0.02)
                p.mul_(3.0)
            if tiny_qk and "c_attn" in name:
                p.mul_(0.005)
    return model.eval()


def write_checkpoint(path, model, tokenizer=None, **extra):
    """A checkpoint of `model` as train.py writes one (tokenizer: export_chars() unless given)."""
    import dataclasses

    from lab.checkpoint import save_checkpoint

    tokenizer = tokenizer or export_chars()
    state = {"model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
             "tokenizer": tokenizer.to_dict(), "step": 0, "val_loss": None, "config": {"data": {"name": "unit"}},
             **extra}
    return save_checkpoint(Path(path), state)


def run_export(ckpt, out, *overrides):
    """tools/export.py's export() through its Hydra config (configs/export.yaml and its schema)."""
    from tools import export

    return export.export(compose_cfg("export", [f"ckpt={ckpt}", f"out={out}", *overrides]))


def load_export(path, code=None):
    """An export loaded as a user would, fp32; stock classes with eager attention, custom code
    (config.json's auto_map; or code=True) with trust_remote_code."""
    import torch
    from transformers import AutoModelForCausalLM

    code = "auto_map" in json.loads((Path(path) / "config.json").read_text()) if code is None else code
    how = {"trust_remote_code": True} if code else {"attn_implementation": "eager"}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **how).eval()


def client(name: str):
    """A package of requirements-eval.txt (lm_eval, transformer_lens), imported. Without it a user's
    machine skips the test; CI (CI set) fails instead: a test that always skips checks nothing."""
    import importlib

    if os.environ.get("CI"):
        return importlib.import_module(name)
    return pytest.importorskip(name, reason=f"{name} is not installed: pip install -r requirements-eval.txt")


TIMING = ("tokens_per_sec", "ms_per_iter", "mfu")  # wall-clock figures differ between any two runs
# the whole-val-split loss is logged where a run ends (train.max_iters): a run stopped at 30 and resumed to
# 60 has it at step 30 too, one that went straight to 60 does not; every other key must match
FINAL_ONLY = ("val/loss_full", "val/bpc_full", "val/tokens_full")


def cli_args(run_dir, cache):
    """train.py arguments of a 60-step CPU run with checkpoints every 10 steps, for exact-resume tests."""
    # dropout on, so the resumed run must also restore the RNG that draws the dropout masks
    return ["model=debug", "model.n_embd=64", "model.block_size=64", "model.dropout=0.1", "train.batch_size=16",
            "train.max_iters=60", "train.eval_interval=10", "train.eval_iters=2", "train.log_interval=1",
            "train.ckpt_interval=10", "train.keep_ckpts=10", "device=cpu", "logger.wandb.mode=disabled", "logger.plots=false",
            f"data.cache_dir={cache}", f"hydra.run.dir={run_dir}"]


def metrics_without_timing(run_dir, keep_final=False):
    """The run's metrics lines without the wall-clock keys (and, unless keep_final, the end-of-run
    whole-val-split loss, which marks where the run's own max_iters fell)."""
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    drop = TIMING if keep_final else TIMING + FINAL_ONLY
    return [{k: v for k, v in m.items() if k not in drop} for m in lines]


def poison_training_loss(monkeypatch, at: dict):
    """Multiply the loss of the n-th training forward pass by at[n] (NaN, Inf)."""
    import model as model_module

    real_forward = model_module.GPT.forward
    calls = {"n": 0}

    def poisoned(self, idx, targets=None, **kw):
        out = real_forward(self, idx, targets, **kw)
        if targets is not None and self.training:
            calls["n"] += 1
            if calls["n"] in at:
                return out[0], out[1] * at[calls["n"]]
        return out
    monkeypatch.setattr(model_module.GPT, "forward", poisoned)


def assert_same_training(single, multi, step: int, tol: float):
    """The two runs' weights at `step`, their val losses and the train loss they logged at every
    logged step (the mean over the step's whole global batch) agree within tol, the update norms within 0.1%."""
    from lab.checkpoint import load_checkpoint, step_name
    from lab.tracking import read_metrics

    a, b = load_checkpoint(single / step_name(step)), load_checkpoint(multi / step_name(step))
    for name, t in a["model"].items():
        d = (t - b["model"][name]).abs().max().item()
        assert d < tol, f"{name}: max diff {d:.2e} (tolerance {tol:g})"
    for key in ("val/loss", "train/loss"):
        la = [(m["step"], m[key]) for m in read_metrics(single) if key in m]
        lb = [(m["step"], m[key]) for m in read_metrics(multi) if key in m]
        assert la and [s for s, _ in la] == [s for s, _ in lb], key
        assert [v for _, v in la] == pytest.approx([v for _, v in lb], abs=tol), key
    # the step's update norm: under FSDP each process sums its shard's squares, then they are added
    ua = [(m["step"], m["update_norm"]) for m in read_metrics(single) if "update_norm" in m]
    ub = [(m["step"], m["update_norm"]) for m in read_metrics(multi) if "update_norm" in m]
    assert ua and [s for s, _ in ua] == [s for s, _ in ub]
    assert [v for _, v in ua] == pytest.approx([v for _, v in ub], rel=1e-3), "update_norm"


# ----------------------------------------------------------------------------- W&B offline logs
# Read back what the real wandb package wrote for an offline run.
#
# wandb 0.31 keeps an offline run's data only in its transaction log (`run-<id>.wandb`; no
# files/wandb-summary.json until it is synced). That log is the LevelDB log format (32 KiB blocks,
# records with a 7-byte header: crc32, length, type) after a 7-byte ':W&B' header, each record a
# protobuf `Record` from wandb.proto. This reads the history rows back, for tests only.

WANDB_BLOCK = 32 * 1024
WANDB_FULL, WANDB_FIRST, WANDB_MIDDLE, WANDB_LAST = 1, 2, 3, 4


def wandb_records(path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written: stop before it
            return
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (WANDB_FULL, WANDB_LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_finished_log(run_dir, timeout: float = 30.0) -> Path:
    """The run's transaction log once it holds the run's exit record. run.finish() can return before
    wandb-core has written the log (seen: 7 bytes, its header alone, right after finish, complete a
    moment later), so a test that reads it at once would see an empty run."""
    log = next(Path(run_dir).glob("run-*.wandb"))
    deadline = time.monotonic() + timeout
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(log)):
        assert time.monotonic() < deadline, f"{log}: no exit record after {timeout:.0f} s"
        time.sleep(0.1)
    return log


def wandb_history(run_dir) -> list:
    """The logged rows of an offline run dir (offline-run-*), as dicts of JSON values."""
    log = wandb_finished_log(run_dir)
    rows = []
    for r in wandb_records(log):
        if r.WhichOneof("record_type") == "history":
            rows.append({item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in r.history.item})
    return rows


def wandb_summary(run_dir) -> dict:
    """Last value of every key, as W&B's run summary shows it."""
    out = {}
    for row in wandb_history(run_dir):
        out.update(row)
    return out


def wandb_run_record(run_dir) -> dict:
    """The run's identity as W&B stored it: id, display name, group."""
    log = wandb_finished_log(run_dir)
    for r in wandb_records(log):
        if r.WhichOneof("record_type") == "run":
            return {"id": r.run.run_id, "name": r.run.display_name, "group": r.run.run_group}
    raise AssertionError(f"no run record in {log}")


def save_tiny_checkpoint(directory, chars=" .abcdefghijklmnopqrstuvwxyz", **kw):
    """A checkpoint (directory/best.pt) of a variant_model over a char vocabulary of `chars` (sorted),
    for tools that read checkpoints; kw: variant_model's."""
    import dataclasses

    from lab.checkpoint import save_checkpoint
    from data.tokenizer import CharTokenizer

    model = variant_model(vocab=len(chars), **kw)
    state = {"model": model.state_dict(), "model_config": dataclasses.asdict(model.config),
             "tokenizer": CharTokenizer("".join(sorted(chars))).to_dict(), "step": 1}
    return save_checkpoint(Path(directory) / "best.pt", state)


def diff(a, b) -> str:
    """How far two tensors are apart, for an assertion's message."""
    d = (a - b).abs()
    return f"max diff {d.max().item():.3e}, mean diff {d.mean().item():.3e}"
