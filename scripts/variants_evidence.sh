#!/usr/bin/env bash
# The architecture comparisons (docs/variants.md) on tiny shakespeare at nanoGPT's CPU size (4x4x128,
# block 64, batch 12), each for SEEDS ("1 2 3"), one run after another, then one report per comparison:
#   bash scripts/variants_evidence.sh path/to/tinyshakespeare.txt [out dir]
# Each comparison is one sweep for a user (`python train.py -m experiment=gqa_sweep ...`); here the
# baseline they all share (same config, same seed: the same run bit for bit) is trained once per
# step budget and linked into each comparison, to save CPU time.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-}
if [ -z "$DATA" ] || [ ! -f "$DATA" ]; then
  echo "usage: bash scripts/variants_evidence.sh path/to/tinyshakespeare.txt [out dir]  (a local copy of tiny shakespeare; got: '${DATA}')" >&2
  exit 2
fi
OUT=${2:-outputs/variants}
SEEDS=${SEEDS:-"1 2 3"}
mkdir -p "$OUT/runs"
run() {  # name, then overrides: one run dir per seed, NAME_sSEED
  local name=$1 seed; shift
  for seed in $SEEDS; do
    local dir=$OUT/runs/${name}_s$seed
    [ -f "$dir/ckpt_done" ] && continue
    rm -rf "$dir"
    python train.py experiment=nanogpt_cpu "$@" seed="$seed" data.path="$DATA" logger.wandb.mode=disabled \
      hydra.run.dir="$dir" 2> "$dir.log" || { tail -5 "$dir.log"; return 1; }
    touch "$dir/ckpt_done"
  done
}
SHORT=(train.max_iters=1000 train.lr_decay_iters=1000)
DEEP=(model.n_layer=12 train.max_iters=500 train.lr_decay_iters=500 train.eval_interval=50)  # 3x the cost per step
run base_2000
run kv2 model.n_kv_head=2
run kv1 model.n_kv_head=1
run pos_none model.pos=none
run pos_learned model.pos=learned
run pos_sinusoidal model.pos=sinusoidal
run base_1000 "${SHORT[@]}"
run post "${SHORT[@]}" model.norm_position=post
run post_nowarm "${SHORT[@]}" model.norm_position=post train.warmup_iters=0
run pre_nowarm "${SHORT[@]}" train.warmup_iters=0
run post12_nowarm "${DEEP[@]}" model.norm_position=post train.warmup_iters=0
run pre12_nowarm "${DEEP[@]}" train.warmup_iters=0
run post12 "${DEEP[@]}" model.norm_position=post
run pre12 "${DEEP[@]}"
run rmsnorm "${SHORT[@]}" model.norm=rmsnorm
run swiglu "${SHORT[@]}" model.mlp=swiglu model.d_ff=344
run relu2 "${SHORT[@]}" model.mlp=relu2
run rmsnorm_swiglu "${SHORT[@]}" model.norm=rmsnorm model.mlp=swiglu model.d_ff=344
group() {  # name, then run names: a folder of links (every seed of each) that report.py reads as one sweep
  local g=$OUT/$1 r seed; shift
  rm -rf "$g"; mkdir -p "$g"
  for r in "$@"; do for seed in $SEEDS; do ln -s "../runs/${r}_s$seed" "$g/${r}_s$seed"; done; done
  python tools/report.py "$g"/* --out "$g"
}
group gqa base_2000 kv2 kv1
group pos base_2000 pos_learned pos_sinusoidal pos_none
group norm_mlp base_1000 rmsnorm relu2 swiglu rmsnorm_swiglu
group norm_position base_1000 pre_nowarm post post_nowarm
group norm_position_12 pre12 pre12_nowarm post12 post12_nowarm
