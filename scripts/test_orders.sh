#!/usr/bin/env bash
# The fast tier in fixed orders, each in one process (no xdist), so a test that passes or fails by
# what ran before it shows up here rather than in one CI run out of many. Not part of the suite: it
# runs the fast tier three times (about 10 minutes on 2 cores). Run it before a stop.
#   bash scripts/test_orders.sh            # PYTHON=... picks the interpreter (default python3)
set -uo pipefail
if [ $# -gt 0 ]; then  # it takes no arguments: say so, instead of starting ten minutes of tests
  case "$1" in
    -h|--help) sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "error: scripts/test_orders.sh takes no arguments (got: $*); PYTHON=... picks the interpreter" >&2; exit 2 ;;
  esac
fi
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mapfile -t files < <(find tests -name 'test_*.py' | sort)
reversed=(); for ((i=${#files[@]}-1; i>=0; i--)); do reversed+=("${files[i]}"); done
rest=(); for f in "${files[@]}"; do [ "$f" = tests/test_gpu_path.py ] || rest+=("$f"); done
status=0
run() {  # name, then files in the order they run
  local name=$1; shift
  echo "== $name"
  "$PY" -m pytest -p no:xdist -p no:cacheprovider -m "not slow" -q "$@" 2>&1 | grep -E "^(FAILED|ERROR)|passed|failed" \
    || status=1
}
run "files reversed" "${reversed[@]}"
run "every file after tests/test_gpu_path.py" tests/test_gpu_path.py "${rest[@]}"
run "each file's own order, one process" "${files[@]}"
exit $status
