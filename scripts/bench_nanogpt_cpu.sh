#!/usr/bin/env bash
# The foundation benchmark: nanoGPT's documented CPU run on tiny shakespeare (4 layers, 4 heads,
# 128 wide, block 64, batch 12, 2000 iters, lr 1e-3 -> 1e-4, warmup 100, dropout 0, eval_iters 20).
#   bash scripts/bench_nanogpt_cpu.sh path/to/tinyshakespeare.txt [path/to/nanoGPT checkout]
# Prints the val loss at step 2000, then ms/iter of a training step side by side with nanoGPT's
# model at the same shapes (when a checkout is given), interleaved in one process.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-}
if [ -z "$DATA" ] || [ ! -f "$DATA" ]; then
  echo "usage: bash scripts/bench_nanogpt_cpu.sh path/to/tinyshakespeare.txt [path/to/nanoGPT checkout]  (a local copy of tiny shakespeare; got: '${DATA}')" >&2
  exit 2
fi
NANOGPT=${2:-}
RUN=outputs/bench/nanogpt_cpu_$(date +%Y%m%d_%H%M%S)
python train.py experiment=nanogpt_cpu data.path="$DATA" hydra.run.dir="$RUN" logger.wandb.mode=disabled
python - "$RUN" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
evals = [m for m in lines if "val/loss" in m]
speed = sorted(m["ms_per_iter"] for m in lines if "ms_per_iter" in m)
print(f"val loss at step {evals[-1]['step']}: {evals[-1]['val/loss']:.4f}; median {speed[len(speed) // 2]:.1f} ms/iter")
PY
if [ -n "$NANOGPT" ]; then
  python tools/bench.py model=cpu_small train.batch_size=12 device=cpu bench.compare="$NANOGPT" bench.rounds=5 bench.iters=40
else
  python tools/bench.py model=cpu_small train.batch_size=12 device=cpu
fi
