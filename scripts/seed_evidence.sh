#!/usr/bin/env bash
# How far seeds move a result, and which results survive them (docs/ablations.md). Each study is one
# or more sweeps, one run after another, then tools/report.py over each sweep:
#   bash scripts/seed_evidence.sh path/to/tinyshakespeare.txt [out dir] [study ...]
# studies (default: all):
#   spread   experiment=nanogpt_cpu with seeds 1-5: varying everything, only the initialisation
#            (train.data_seed=1), only the data (seed=1, train.data_seed=1-5)
#   dk128    the √d_k × QK-Norm ablation at CPU size, one 128-wide head per layer, SEEDS
#   dk32     the same with 4 heads of 32
#   default  python train.py (the embedded corpus) with seeds 1-5
# A finished sweep (its dir holds `done`) is kept, so studies can be run one at a time. SEEDS=1,2,3.
# On a shared machine prefix `OMP_NUM_THREADS=1 nice -n 10`; two of these can run side by side.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-}
if [ -z "$DATA" ] || [ ! -f "$DATA" ]; then
  echo "usage: bash scripts/seed_evidence.sh path/to/tinyshakespeare.txt [out dir] [study ...]  (a local copy of tiny shakespeare; got: '${DATA}')" >&2
  exit 2
fi
OUT=${2:-outputs/seeds}
shift $(( $# < 2 ? $# : 2 ))
STUDIES=${*:-spread dk128 dk32 default}
SEEDS=${SEEDS:-1,2,3}
mkdir -p "$OUT"
sweep() {  # dir, then the sweep's overrides
  local dir=$OUT/$1; shift
  [ -f "$dir/done" ] && return 0
  rm -rf "$dir"
  python train.py -m "$@" logger.wandb.mode=disabled device=cpu hydra.sweep.dir="$dir" > "$dir.log" 2>&1 \
    || { tail -5 "$dir.log"; return 1; }
  python tools/report.py "$dir" > /dev/null && touch "$dir/done"
}
for study in $STUDIES; do
  case $study in
    spread)
      sweep spread_all experiment=nanogpt_cpu data.path="$DATA" seed=1,2,3,4,5
      sweep spread_init experiment=nanogpt_cpu data.path="$DATA" seed=1,2,3,4,5 train.data_seed=1
      sweep spread_data experiment=nanogpt_cpu data.path="$DATA" seed=1 train.data_seed=1,2,3,4,5 ;;
    dk128) sweep dk128 experiment=attn_scale_ablation_cpu data.path="$DATA" seed="$SEEDS" ;;
    dk32) sweep dk32 experiment=attn_scale_ablation_cpu model.n_head=4 data.path="$DATA" seed="$SEEDS" ;;
    default) sweep default seed=1,2,3,4,5 ;;
    *) echo "unknown study $study: spread, dk128, dk32 or default" >&2; exit 1 ;;
  esac
done
