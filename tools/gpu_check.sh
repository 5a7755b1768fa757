#!/usr/bin/env bash
# One short GPU check, every step in one command: the packages the GPU image lacks, from carried
# wheels; the GPU-marked tests; a real training run stopped by SIGTERM and resumed; sampling from its
# checkpoint on the GPU and on the CPU; then, in one process (tools/gpu_figures.py), training speed
# and MFU in bf16 + compile at the baby and GPT-2-124M shapes, attention memory at block 1024 vs
# 4096 and decode speed with and without the KV cache. A failed step does not stop the others; the
# exit status is 1 if any failed. Each step's time is printed, and a table of them at the end.
#
#   bash tools/fetch_gpu_wheels.sh      # first, where PyPI is reachable: .gpu_wheels/ (~26 MiB)
#   set -o pipefail; bash tools/gpu_check.sh 2>&1 | tee $OUT/gpu_check.log   # on the GPU machine
#   DEVICE=cpu bash tools/gpu_check.sh  # the same steps at tiny sizes on CPU: a dry run
#   ONLY='train|sample' bash tools/gpu_check.sh   # a rerun of some steps (names matched as a regex)
#
# Expected on one H100/H200 with cold compile caches: about 6-7 minutes (imports ~20 s, GPU tests
# ~100 s, train/stop/resume ~40 s, sampling ~70 s, figures ~250 s). BUDGET_S (default 540 s on a
# GPU) bounds the whole script: each step gets what is left of it, at most its own limit, so a hung
# step cannot take the time the others need. On CPU the limits are 5x and the budget 3000 s.
# When $OUT is set (the device tool's output folder), what the check produced is copied there:
# steps.log (every step's own log), samples.txt and gpu_figures.json (checkpoints stay behind).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${DEVICE:-cuda}
WHEELS=${GPU_WHEELS:-.gpu_wheels}
ONLY=${ONLY:-.}
if [ "$DEVICE" = cpu ]; then SLOW=5; BUDGET_S=${BUDGET_S:-3000}; else SLOW=1; BUDGET_S=${BUDGET_S:-540}; fi
WORK=$(mktemp -d /tmp/gpu_check.XXXXXX)
LOGS=${OUT:-$WORK}  # what comes back from a GPU machine is $OUT
export PYTHONUNBUFFERED=1 WANDB_SILENT=true WANDB_DIR=$WORK HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
failed=()
times=()

step() {  # step NAME LIMIT_S COMMAND...: run it within its limit and what is left of the budget
  local name=$1 limit=$(($2 * SLOW)) t0=$SECONDS rc
  shift 2
  local left=$((BUDGET_S - SECONDS))
  [[ "$name" =~ $ONLY ]] || return 0
  echo
  if [ "$left" -lt 15 ]; then
    echo "== $name: NOT RUN (the ${BUDGET_S} s budget is spent)"
    failed+=("$name (not run)")
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name"
  { echo "== $name"; } >> "$LOGS/steps.log"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOGS/steps.log"
  rc=${PIPESTATUS[0]}
  [ $rc -eq 124 ] && echo "(stopped at its ${limit} s limit)"
  echo "-- $name: $([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)") in $((SECONDS - t0)) s"
  times+=("$(printf '%5d s  %s  %s' $((SECONDS - t0)) "$([ $rc -eq 0 ] && echo ok || echo FAILED)" "$name")")
  [ $rc -eq 0 ] || failed+=("$name")
}

if [ "$DEVICE" = cpu ]; then  # tiny sizes: the dry run checks that every step runs, not speed
  TRAIN="model=debug train.batch_size=4"
else
  TRAIN="model=baby train.batch_size=32"
fi

echo "== machine ($DEVICE); scratch dir $WORK"
[ "$DEVICE" = cpu ] || nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 --version

echo
echo "== packages the image lacks, from $WHEELS"
if [ -d "$WHEELS" ]; then
  # shellcheck disable=SC2046  # one argument per pin
  if ! python3 -m pip install -q --no-index --find-links "$WHEELS" \
      $(grep -E '^(hydra-core|datasets|wandb|rustbpe)==' requirements.txt); then
    # the image's own packages do not fit our pins (or its environment is read-only): the wheels as
    # they are, ahead of the image's packages on the path
    echo "pip could not fit $WHEELS to the installed packages: unpacking every wheel into $WORK/site"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$WHEELS"/*.whl &&
      export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
  fi
else
  echo "no $WHEELS folder: using what is installed (bash tools/fetch_gpu_wheels.sh makes it)"
fi
# datasets is needed even by the embedded corpus (it tokenizes through Dataset.map), so it is checked here
ONLY=. step "imports" 120 python3 - "$DEVICE" <<'EOF'
import sys
import datasets, hydra, omegaconf, rustbpe, tiktoken, torch, wandb
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), hydra {hydra.__version__}, omegaconf "
      f"{omegaconf.__version__}, datasets {datasets.__version__}, wandb {wandb.__version__}, tiktoken {tiktoken.__version__}")
if sys.argv[1] != "cpu":
    from lab.device import has_native_bf16, peak_flops_for
    d = torch.device("cuda")
    name = torch.cuda.get_device_name(d)
    print(f"{name}: capability {torch.cuda.get_device_capability(d)}, native bf16 {has_native_bf16(d)}, "
          f"peak bf16 {peak_flops_for(name, torch.bfloat16)} FLOP/s, flash SDPA {torch.backends.cuda.is_flash_attention_available()}")
EOF
if [ ${#failed[@]} -gt 0 ]; then
  echo "FAILED: the packages are missing, nothing else can run"
  exit 1
fi

step "GPU-marked tests (pytest -m gpu)" 200 python3 -m pytest -q -m gpu -p no:cacheprovider --durations=5 tests

train_stop_resume() {  # 20 steps, SIGTERM, resume to 10 steps past where it stopped
  # compile=false: this step checks signals and resume; compiled training is the GPU tests' and the figures'
  local run=$WORK/run args=($TRAIN "device=$DEVICE" "hydra.run.dir=$WORK/run" train.eval_interval=20 compile=false
                            train.eval_iters=5 train.log_interval=10 train.warmup_iters=10 train.lr_decay_iters=1000)
  python3 train.py "${args[@]}" train.max_iters=1000 2>"$WORK/train.log" &
  local pid=$!
  while [ ! -e "$run/ckpt_0000020.pt" ] && kill -0 $pid 2>/dev/null; do sleep 0.1; done
  kill -TERM $pid 2>/dev/null
  wait $pid
  local rc=$?
  [ $rc -eq 0 ] || { tail -20 "$WORK/train.log"; echo "training exited $rc after SIGTERM (0 expected)"; return 1; }
  grep -E "model:|step [0-9]+/|stopped by|eval step" "$WORK/train.log" | tail -6
  local stopped
  stopped=$(grep -oE "stopped by SIGTERM at step [0-9]+" "$WORK/train.log" | grep -oE "[0-9]+$")
  [ -n "$stopped" ] || { echo "no 'stopped by SIGTERM' line"; tail -20 "$WORK/train.log"; return 1; }
  python3 train.py "${args[@]}" train.max_iters=$((stopped + 10)) resume=true 2>"$WORK/resume.log" ||
    { tail -20 "$WORK/resume.log"; return 1; }
  grep -E "resuming from|step [0-9]+/|done:" "$WORK/resume.log" | tail -4
  ls "$run"/ckpt_*.pt
  [ -e "$run/$(printf 'ckpt_%07d.pt' $((stopped + 10)))" ]
}
export -f train_stop_resume
export WORK DEVICE TRAIN
step "train on $DEVICE, SIGTERM after step 20, resume for 10 more steps" 200 bash -c train_stop_resume

sample_on() {  # sample.py from the run's checkpoint on device $1 (compiled decode step by default on CUDA)
  python3 sample.py "ckpt=$WORK/run" "device=$1" max_new_tokens=200 prompt="'def '" >"$WORK/sample_$1.txt" &&
    head -c 300 "$WORK/sample_$1.txt" && echo && [ -s "$WORK/sample_$1.txt" ] &&
    { echo "== sample on $1"; cat "$WORK/sample_$1.txt"; } >> "$LOGS/samples.txt"
}
export -f sample_on
export LOGS
step "sample.py from that checkpoint on $DEVICE" 90 bash -c "sample_on $DEVICE"
[ "$DEVICE" = cpu ] || step "sample.py from that checkpoint on cpu" 90 bash -c "sample_on cpu"

step "figures: training speed and MFU, attention memory, decode speed (one process)" 330 \
  python3 tools/gpu_figures.py --device "$DEVICE" --out "$LOGS/gpu_figures.json"
cp "$WORK/train.log" "$LOGS/train.log" 2>/dev/null || true

echo
echo "== step times"
printf '%s\n' "${times[@]}"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  echo "(took $SECONDS s; logs in $LOGS)"
  exit 1
fi
echo "all steps passed in $SECONDS s (logs in $LOGS)"
