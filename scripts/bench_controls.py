"""What each attention-logit control costs in step time, side by side in one process.

    python scripts/bench_controls.py [--rounds 7] [--iters 20] [--threads 1]

One training step of experiment=lr_sensitivity_cpu's model (4 × 4 × 128, batch 16 × block 64, AdamW), on
random tokens, with each control of docs/practice.md in turn: train.py's own train_step, plus QK-Clip's
rescale after it where train.qk_clip is set. Rounds interleave the controls (the order reversed every other
round) and each round's time is divided by the baseline's in that round; the median and the range of those
ratios over the rounds are printed. QK-Clip is timed twice: with a τ no head reaches here (the measuring
forward only) and with a τ every head passes (each layer also run again, clipped).
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from claims.common import compose  # noqa: E402
from lab.config import check_train_config, model_config  # noqa: E402
from lab.device import setup_runtime  # noqa: E402
from lab.optim import build_optimizer  # noqa: E402
from lab.qk_clip import clip_ as qk_clip_  # noqa: E402
from model import GPT  # noqa: E402
from train import train_step  # noqa: E402

BASE = ["experiment=lr_sensitivity_cpu", "model.attn.qk_norm=false", "model.attn.scale=sqrt_dk", "train.lr=3e-3"]
CONTROLS = {
    "baseline (1/√d_k)": [],
    "QK-Norm (RMS, no gain)": ["model.attn.qk_norm=true"],
    "qk-layernorm with gain": ["model.attn.qk_norm=true", "model.attn.qk_norm_type=layer",
                               "model.attn.qk_norm_gain=channel"],
    "soft-cap 20": ["model.attn.softcap=20"],
    "z-loss 1e-4": ["train.z_loss=1e-4"],
    "QK-Clip, no head clipped": ["train.qk_clip=1e6"],
    "QK-Clip, every head clipped": ["train.qk_clip=1e-6"],
    "Muon": ["train.optimizer=muon"],
}
VOCAB = 65  # tiny shakespeare's characters


def runner(overrides, x, y):
    """A closure doing one training step of the config `BASE + overrides`."""
    cfg = compose(BASE + overrides)
    check_train_config(cfg)
    torch.manual_seed(0)
    rt = setup_runtime("cpu", "float32")
    model = GPT(model_config(cfg.model, VOCAB))
    opt = build_optimizer(model, cfg.train, rt.device)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    t = cfg.train

    def step():
        train_step(model, opt, [(x, y)], 1, t.grad_clip, rt, scaler, z_loss=t.z_loss)
        if t.qk_clip is not None:
            qk_clip_(model, [x], t.qk_clip)
    return step


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=20, help="steps per control and round")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the page's runs used 1)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.iters < 1 or args.threads < 1:
        raise SystemExit("--rounds, --iters and --threads must be at least 1")
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        measure(args)
    finally:
        torch.set_num_threads(before)  # as it was: main may be called by a process that goes on


def measure(args):
    """Every control's step time over args.rounds rounds of args.iters steps, printed with its ratio to the baseline."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(VOCAB, (16, 64), generator=g)
    y = torch.roll(x, -1, dims=1)
    steps = {name: runner(o, x, y) for name, o in CONTROLS.items()}
    for step in steps.values():  # warm-up: first-call allocations, Muon's buffers
        for _ in range(3):
            step()
    times = {name: [] for name in steps}
    for r in range(args.rounds):
        for name in (list(steps) if r % 2 == 0 else list(reversed(steps))):
            t0 = time.perf_counter()
            for _ in range(args.iters):
                steps[name]()
            times[name].append((time.perf_counter() - t0) / args.iters)
    base = times[next(iter(times))]
    print(f"one training step, 4 x 4 x 128, batch 16 x 64, fp32, {args.threads} thread(s), "
          f"{args.rounds} rounds x {args.iters} steps; ratio = this control's step / the baseline's, per round")
    print(f"{'control':30s} {'ms/step':>8s} {'ratio (median)':>15s}  range over rounds")
    for name, ts in times.items():
        ratios = [a / b for a, b in zip(ts, base)]
        print(f"{name:30s} {1000 * statistics.median(ts):8.2f} {statistics.median(ratios):15.2f}  "
              f"{min(ratios):.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
