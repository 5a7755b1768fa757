"""Attention's N² wall, measured: the time of a training step (forward and backward) of one attention
layer and the memory it keeps for its backward pass, against the sequence length N, for every way
attnlab computes attention, next to tools/cost.py's counts.

    python tools/bench_attention.py                                   # N = 64 ... 4096 at a CPU width
    python tools/bench_attention.py lengths=[256,1024] window=64 out=outputs/bench_attention/window64.png

Paths: sdpa (PyTorch's fused kernel), reference (the explicit N x N table), tiled (FlashAttention's
algorithm in plain PyTorch: slow in Python, but it never builds the table), window (sdpa with a
band of `window` keys: the kernel still computes the whole table, then masks it), tiled_window (the
tiled path with the band: it skips every block outside it, so its work grows as N·W), linear (elu + 1
features, prefix sums), gdn (Gated DeltaNet, chunked), mamba2 (SSD, chunked), moba (MoBA's choice of
`select_topk` blocks of `select_block` keys, computed by the gathered path, which reads only the
chosen blocks: its work grows as N·(K+1)·B) and moba_masked (the same choice as a mask over sdpa's
full table). With decode=true each path with a cache is also timed generating one token after a
context of N (its KV cache, or its recurrent state, filled first); every path's times are printed as
ratios to sdpa's measured in the same round, then side by side in one table, and the N from which a
path's training step costs less than sdpa's (the crossover). The
memory is the bytes of the tensors autograd saves for the backward pass (torch.autograd.graph.saved_tensors_hooks, each storage counted once): exact and the same on every
machine, unlike a process's resident size. Times are the median of `repeats` interleaved rounds.
"""
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, List, Optional

import hydra
import torch
from hydra.core.config_store import ConfigStore

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as tools/X.py: the repo's modules

from attention import rope_table  # noqa: E402
from lab.counting import saved_bytes  # noqa: E402
from lab.cli import cli, run_app  # noqa: E402
from files import check_output_file, default_output  # noqa: E402
from rules import POSITIVE, Needs, OneOf, Range, UserError, check_values  # noqa: E402
from lab.counting import attention_macs, attention_variants, selected_macs  # noqa: E402
from model import GPTConfig  # noqa: E402
from variants import make_attention  # noqa: E402

PATHS = ("sdpa", "reference", "tiled", "window", "tiled_window", "linear", "gdn", "mamba2", "moba", "moba_masked")
PREDICTED = {"sdpa": "reference", "reference": "reference", "tiled": "tiled", "window": "window",
             "tiled_window": "window", "linear": "linear", "moba_masked": "reference"}  # counting.attention_variants' row
DECODES = ("sdpa", "window", "linear", "gdn", "mamba2")  # the paths generation runs (the others train only)


@dataclass
class BenchAttentionConfig:
    lengths: List[int] = field(default_factory=lambda: [64, 128, 256, 512, 1024, 2048, 4096])  # N
    paths: List[str] = field(default_factory=lambda: list(PATHS[:6]))  # sdpa | reference | tiled | window |
    # tiled_window | linear | gdn | mamba2 | moba (MoBA, the gathered path) | moba_masked (MoBA, sdpa's mask)
    decode: bool = False  # also time one generated token after N of context (paths with a cache)
    n_embd: int = 128  # a CPU width: nanoGPT's CPU config
    n_head: int = 4
    batch_size: int = 1
    window: int = 256  # keys a query sees on the window path
    block: int = 128  # the tiled path's tile
    select_block: int = 64  # moba: keys per block (B)
    select_topk: int = 4  # moba: earlier blocks each query reads besides its own (K)
    repeats: int = 3  # timed rounds (interleaved); the median is reported
    max_seconds: float = 20.0  # a path whose one step takes longer stops being timed at longer N
    threads: Optional[int] = None  # intra-op CPU threads; unset: torch's default
    out: Optional[str] = default_output("bench_attention", "attention_n2.png")  # the plot (a new dir per call); null: none

    RULES: ClassVar[dict] = {
        "lengths": POSITIVE, "paths": OneOf(PATHS), "n_embd": POSITIVE, "n_head": POSITIVE, "batch_size": POSITIVE,
        "window": POSITIVE, "block": POSITIVE, "select_block": POSITIVE, "select_topk": POSITIVE,
        "repeats": POSITIVE, "max_seconds": Range(0, lo_open=True),
        "threads": Range(1, 4096),
    }
    NEEDS: ClassVar[dict] = {
        "window": Needs(lambda c: {"window", "tiled_window"} & set(c.paths), "paths includes window or tiled_window"),
        "block": Needs(lambda c: {"tiled", "tiled_window"} & set(c.paths), "paths includes tiled or tiled_window"),
        **dict.fromkeys(("select_block", "select_topk"),
                        Needs(lambda c: {"moba", "moba_masked"} & set(c.paths), "paths includes moba or moba_masked"))}


ConfigStore.instance().store(name="base_bench_attention", node=BenchAttentionConfig)


def layer_for(path: str, cfg, N: int):
    """One attention layer (the model's own, as variants.make_attention builds it) at the benchmark's width."""
    moba = {"select": "moba", "select_block": cfg.select_block, "select_topk": cfg.select_topk}
    attn = {"sdpa": {}, "reference": {"impl": "reference"}, "tiled": {"impl": "tiled", "block": cfg.block},
            "window": {"window": cfg.window}, "tiled_window": {"impl": "tiled", "block": cfg.block, "window": cfg.window},
            "linear": {"kind": "linear"}, "gdn": {"kind": "gdn"}, "mamba2": {"kind": "mamba2"},
            "moba": {"impl": "gathered", **moba}, "moba_masked": moba}[path]
    c = GPTConfig(vocab_size=2, block_size=N, n_layer=1, n_head=cfg.n_head, n_embd=cfg.n_embd, attn=attn)
    return make_attention(c, layer=0), c


def step(layer, x, rope):
    """One training step of the layer: forward, then backward of a scalar of its output."""
    y = layer(x, rope=rope)
    y.square().mean().backward()
    return y


def decode_step(layer, x, rope, cache, N):
    """One generated token at position N: its query against the context's cache (or the state), no grad."""
    with torch.no_grad():
        return layer(x, rope=rope[N:N + 1], cache=cache, pos=N)


def predicted_macs(path, c, N, batch) -> int:
    """counting's forward MACs per token of the path's attention part (q.k and the weighted sum, or the
    recurrent kinds' chunked products; moba's also its choice of blocks)."""
    if path == "moba":
        return sum(selected_macs(c, N).values())
    if path in PREDICTED:
        return {v["name"].split()[0]: v for v in attention_variants(c, N, batch, 4)}[PREDICTED[path]]["macs"]
    return sum(attention_macs(c, N, 0))


def bench_attention(cfg) -> dict:
    check_values(cfg)
    if "sdpa" not in cfg.paths:  # the ratios and crossovers are all to sdpa's time in the same round
        others = ",".join(cfg.paths) or "reference"
        raise UserError(f"paths={list(cfg.paths)} leaves out sdpa, the path every ratio and crossover is measured "
                        f"against (timed side by side in each round): add it, e.g. paths=[sdpa,{others}]")
    if cfg.out:
        check_output_file(cfg.out, "out")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rows = {}
    for N in cfg.lengths:
        torch.manual_seed(0)
        x = torch.randn(cfg.batch_size, N, cfg.n_embd, requires_grad=True)
        layers = {}
        for path in cfg.paths:
            layer, c = layer_for(path, cfg, N)
            rope = rope_table(c.head_dim, N + 1, c.rope_base)
            layers[path] = (layer, rope, c)
            memory = saved_bytes(lambda: layer(x, rope=rope[:N]))  # the forward's saved tensors, x excluded below
            step(layer, x, rope[:N])  # warm-up: the first call of a shape allocates
            rows[(path, N)] = {"path": path, "N": N, "saved_bytes": memory - x.numel() * x.element_size(),
                               "seconds": [], "decode_seconds": []}
            if cfg.decode and path in DECODES:  # the cache of a context of N, filled once
                cache = layer.new_cache(cfg.batch_size, N + 1)
                with torch.no_grad():
                    layer(x.detach(), rope=rope[:N], cache=cache, pos=0)
                token = x.detach()[:, -1:]
                decode_step(layer, token, rope, cache, N)  # warm-up
                layers[path] += (cache, token)
        for r in range(cfg.repeats):
            for path in (cfg.paths if r % 2 == 0 else list(reversed(cfg.paths))):
                row = rows[(path, N)]
                if any(rows.get((path, n), {}).get("skipped") for n in cfg.lengths if n < N):
                    row["skipped"] = True
                    continue
                layer, rope, _, *decoding = layers[path]
                t0 = time.perf_counter()
                step(layer, x, rope[:N])
                row["seconds"].append(time.perf_counter() - t0)
                if row["seconds"][-1] > cfg.max_seconds:
                    row["skipped"] = True  # too slow for the longer lengths
                if decoding:  # the same token again at position N: the cache's slot N is rewritten
                    t0 = time.perf_counter()
                    decode_step(layer, decoding[1], rope, decoding[0], N)
                    row["decode_seconds"].append(time.perf_counter() - t0)
        base = rows[("sdpa", N)] if "sdpa" in cfg.paths else None
        for path in cfg.paths:
            row = rows[(path, N)]
            row["ms"] = 1000 * statistics.median(row["seconds"]) if row["seconds"] else None
            row["decode_ms"] = 1000 * statistics.median(row["decode_seconds"]) if row["decode_seconds"] else None
            # against sdpa: the median of the per-round ratios (each round times both side by side)
            row["vs_sdpa"] = ratio(row["seconds"], base["seconds"]) if base else None
            row["decode_vs_sdpa"] = ratio(row["decode_seconds"], base["decode_seconds"]) if base else None
            row["predicted_macs_per_token"] = float(predicted_macs(path, layers[path][2], N, cfg.batch_size))
            state = layers[path][3].nbytes() if len(layers[path]) > 3 else None
            row["cache_bytes"] = state
            print(f"N={N:5d} {path:12s} {nan(row['ms']):10.2f} ms/step" + (f" ({nan(row['vs_sdpa']):.2f}x sdpa)" if base else "")
                  + f"  {row['saved_bytes'] / 2**20:9.2f} MiB saved for backward"
                  + (f"  decode {nan(row['decode_ms']):.3f} ms/token ({nan(row['decode_vs_sdpa']):.2f}x sdpa), "
                     f"cache {state:,} B" if row["decode_ms"] is not None else ""), flush=True)
    result = {"rows": list(rows.values()), "crossover": crossover(list(rows.values()), cfg.paths, cfg.lengths)}
    for path, n in result["crossover"].items():
        print(f"{path}: a training step costs less than sdpa's " +
              (f"from N={n} on (of the lengths timed)" if n else "at none of the lengths timed"))
    print(side_by_side(result["rows"], cfg.paths))
    if cfg.out:
        plot(result["rows"], cfg, cfg.out)
        print(f"wrote {cfg.out}")
    return result


def nan(v):
    return float("nan") if v is None else v


def side_by_side(rows, paths) -> str:
    """One line per N: each path's ms per step, its ratio to sdpa's in the same rounds, and the MiB it
    saves for the backward."""
    by = {(r["path"], r["N"]): r for r in rows}
    out = ["ms per training step (x sdpa, the median of the rounds' ratios), MiB saved for the backward",
           f"{'N':>6}" + "".join(f"{p:>28}" for p in paths)]
    for N in sorted({r["N"] for r in rows}):
        cells = [by[(p, N)] for p in paths]
        out.append(f"{N:>6}" + "".join(f"{nan(r['ms']):>10.1f} ({nan(r['vs_sdpa']):5.2f}x) "
                                      f"{r['saved_bytes'] / 2**20:7.1f}" for r in cells))
    return "\n".join(out)


def ratio(times, base) -> Optional[float]:
    """The median over rounds of times[r] / base[r] (both paths timed in round r, side by side)."""
    pairs = [a / b for a, b in zip(times, base)]
    return statistics.median(pairs) if pairs else None


def crossover(rows, paths, lengths) -> dict:
    """For each path but sdpa: the shortest timed N from which its training step takes less time than
    sdpa's at every longer N timed (None: at no length, or not for good)."""
    by = {(r["path"], r["N"]): r for r in rows}
    out = {}
    for path in paths:
        if path == "sdpa" or "sdpa" not in paths:
            continue
        below = [n for n in sorted(lengths) if by[(path, n)]["vs_sdpa"] is not None and by[(path, n)]["vs_sdpa"] < 1]
        out[path] = next((n for n in below if all(m in below for m in sorted(lengths) if m >= n)), None)
    return out


def plot(rows, cfg, path):
    """Two panels against N (log-log): a training step's time, and the memory it keeps for backward
    with cost.py's prediction of the table (reference), the tiled path's O(N) and linear's O(N hs²)."""
    from lab.plots import plt, save_figure

    fig, (tx, mx) = plt.subplots(1, 2, figsize=(14, 5))
    for i, p in enumerate(cfg.paths):
        pts = [r for r in rows if r["path"] == p]
        color = plt.cm.tab10.colors[i]
        tx.plot([r["N"] for r in pts if r["ms"]], [r["ms"] for r in pts if r["ms"]], "o-", color=color, label=p)
        mx.plot([r["N"] for r in pts], [r["saved_bytes"] / 2**20 for r in pts], "o-", color=color, label=f"{p} (measured)")
    hs = cfg.n_embd // cfg.n_head
    Ns = sorted({r["N"] for r in rows})
    mx.plot(Ns, [cfg.batch_size * cfg.n_head * n * n * 4 / 2**20 for n in Ns], "k--", lw=1,
            label="cost.py: one table B*h*N*N fp32")
    mx.plot(Ns, [cfg.batch_size * cfg.n_head * n * (hs + 1) * 4 / 2**20 for n in Ns], "k:", lw=1,
            label="cost.py: tiled B*h*N*(hs+1)")
    tx.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="ms per training step (one layer)",
           title=f"time: d={cfg.n_embd}, {cfg.n_head} heads, batch {cfg.batch_size}")
    mx.set(xscale="log", yscale="log", xlabel="sequence length N", ylabel="MiB kept for the backward pass",
           title="memory a training step keeps (saved tensors)")
    for ax in (tx, mx):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return save_figure(fig, path)


@hydra.main(version_base="1.3", config_path="../configs", config_name="bench_attention")
@cli
def main(cfg):
    bench_attention(cfg)


if __name__ == "__main__":
    run_app(main)
