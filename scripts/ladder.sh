#!/usr/bin/env bash
# The ladder: nanoGPT's CPU config (4 layers x 4 heads x 128, block 64, batch 12, 2000 steps,
# tiny shakespeare), one change added per row on top of the best row before it, 2 seeds each, one
# training process at a time. Then the README table and the plot of the val curves.
#   bash scripts/ladder.sh path/to/tinyshakespeare.txt [out dir] [row ...]
# Rows already finished (their run dir has step 2000's val loss) are kept, so the ladder can be run
# row by row; an unfinished run dir is started again. SEEDS="1337 1338" by default.
# Table and plot alone: python scripts/ladder_table.py OUT_DIR
# Each row takes ~2-3 min on 2 idle cores (Muon rows ~1.5x AdamW's). On a shared machine prefix
# `OMP_NUM_THREADS=1 nice -n 10`: two spinning OpenMP threads on busy cores ran ~7x slower than one.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-}
if [ -z "$DATA" ] || [ ! -f "$DATA" ]; then
  echo "usage: bash scripts/ladder.sh path/to/tinyshakespeare.txt [out dir] [row ...]  (a local copy of tiny shakespeare; got: '${DATA}')" >&2
  exit 2
fi
OUT=${2:-outputs/ladder}
shift $(( $# < 2 ? $# : 2 ))
SEEDS=${SEEDS:-"1337 1338"}
COMMON=(data.path="$DATA" device=cpu logger.wandb.mode=disabled train.eval_interval=100 train.log_interval=50
        train.log_attn_interval=0 train.ckpt_interval=1000)

# name | parent row (its overrides come first) | what this row adds
# experiment=nanogpt_cpu_best is row 3's recipe with train.muon_ns_dtype=auto: on a CPU that is row 13
# (fp32 Newton-Schulz); rows 2-12 pin torch's bf16 iteration, as they were first run with it.
# Rows 4a-4e are modded-nanogpt's architecture changes, each alone on row 3: all five together (row 4)
# did not pay, so each is measured against row 3 rather than stacked. Rows 14-21 are each one change on
# row 13 (fp32 Newton-Schulz: the same loss as row 3 and a cheaper step on a CPU).
ROWS=(
  "0_nanogpt_cpu        | -                    | experiment=nanogpt_cpu"
  "1_qknorm_lr2e-3      | 0_nanogpt_cpu        | model.attn.qk_norm=true train.lr=2e-3 train.min_lr=2e-4"
  "2_muon               | 1_qknorm_lr2e-3      | train.optimizer=muon train.muon_ns_dtype=bfloat16"
  "3_muon_lr6e-3        | 2_muon               | train.muon_lr=6e-3"
  "4_modded_arch        | 3_muon_lr6e-3        | model.mlp=relu2 model.zero_init_proj=true model.tie_embeddings=false model.logit_softcap=15 train.muon_momentum_warmup=300"
  "4a_relu2             | 3_muon_lr6e-3        | model.mlp=relu2"
  "4b_zero_init_proj    | 3_muon_lr6e-3        | model.zero_init_proj=true"
  "4c_untied_head       | 3_muon_lr6e-3        | model.tie_embeddings=false"
  "4d_logit_softcap     | 3_muon_lr6e-3        | model.logit_softcap=15"
  "4e_momentum_warmup   | 3_muon_lr6e-3        | train.muon_momentum_warmup=300"
  "5_muon_lr1.2e-2      | 3_muon_lr6e-3        | train.muon_lr=1.2e-2"
  "6_lr_to_zero         | 3_muon_lr6e-3        | train.min_lr=0"
  "7_warmup_20          | 3_muon_lr6e-3        | train.warmup_iters=20"
  "8_adamw_lr6e-3       | 3_muon_lr6e-3        | train.lr=6e-3 train.min_lr=6e-4"
  "9_dropout0.1         | 3_muon_lr6e-3        | model.dropout=0.1"
  "10_qk_gain_head      | 3_muon_lr6e-3        | model.attn.qk_norm_gain=head"
  "11_attn_scale_x2     | 3_muon_lr6e-3        | model.attn.scale=0.35"
  "12_muon_wd0          | 3_muon_lr6e-3        | train.muon_weight_decay=0"
  "13_ns_float32        | 3_muon_lr6e-3        | train.muon_ns_dtype=float32"
  "14_swiglu            | 13_ns_float32        | model.mlp=swiglu"
  "15_rmsnorm           | 13_ns_float32        | model.norm=rmsnorm"
  "16_wsd               | 13_ns_float32        | train.lr_schedule=wsd"
  "17_value_embed       | 13_ns_float32        | model.value_embed=true"
  "18_muon_split_qkv    | 13_ns_float32        | train.muon_split_qkv=true"
  "19_grad_clip0        | 13_ns_float32        | train.grad_clip=0"
  "20_d_ff576           | 13_ns_float32        | model.d_ff=576"
  "21_rope_base500      | 13_ns_float32        | model.rope_base=500"
)

declare -A PARENT ADD
ORDER=()
for row in "${ROWS[@]}"; do
  IFS='|' read -r name parent add <<< "$row"
  name=$(echo $name); parent=$(echo $parent)
  PARENT[$name]=$parent; ADD[$name]=$add; ORDER+=("$name")
done

overrides() {  # the row's full override list: its parent's, then its own
  local name=$1
  if [ "${PARENT[$name]}" != "-" ]; then overrides "${PARENT[$name]}"; echo -n " "; fi
  echo -n "${ADD[$name]}"
}

finished() {  # step 2000's val loss is in the run's metrics
  [ -f "$1/metrics.jsonl" ] && python - "$1" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl") if l.strip()]
sys.exit(0 if any(m.get("step") == 2000 and "val/loss" in m for m in lines) else 1)
PY
}

SELECTED=("$@")
[ ${#SELECTED[@]} -eq 0 ] && SELECTED=("${ORDER[@]}")
for name in "${SELECTED[@]}"; do
  [ -n "${PARENT[$name]:-}" ] || { echo "unknown row $name (rows: ${ORDER[*]})" >&2; exit 2; }
done
mkdir -p "$OUT"
echo "${COMMON[*]}" > "$OUT/common.overrides"
for name in "${SELECTED[@]}"; do
  read -r -a ov <<< "$(overrides "$name")"
  echo "$name: ${ov[*]}" > "$OUT/$name.overrides"
  echo "${PARENT[$name]}" > "$OUT/$name.parent"
  for seed in $SEEDS; do
    run="$OUT/$name/seed$seed"
    if finished "$run"; then echo "[ladder] $name seed $seed: done already" >&2; continue; fi
    rm -rf "$run"; mkdir -p "$OUT/$name"
    echo "[ladder] $name seed $seed: python train.py ${ov[*]} seed=$seed" >&2
    python train.py "${ov[@]}" "${COMMON[@]}" seed="$seed" hydra.run.dir="$run" > "$run.log" 2>&1 \
      || { echo "[ladder] $name seed $seed failed: see $run.log" >&2; tail -3 "$run.log" >&2; }
  done
done
python scripts/ladder_table.py "$OUT"
