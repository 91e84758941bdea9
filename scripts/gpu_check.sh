#!/usr/bin/env bash
# The engine's GPU check, for a bare one-GPU machine (Python 3.12, torch with CUDA, no
# megatron-core, no package registry):
#
#   bash scripts/gpu_check.sh [gpu_check.py options]       e.g. --checks flex,bench --list
#
# megatron-core and omegaconf travel as wheels in GPU_WHEELS (default: .whl/ at the repository
# root, made by scripts/gpu_wheels.sh on a machine with a registry; .whl/ is git-ignored, so a
# copy of the tracked tree leaves it behind: copy it too, or name it in the device tool's carry).
# They are installed into /tmp/site unless megatron-core already imports. Then
# scripts/gpu_check.py runs every check in worker processes: PASS/FAIL lines with numbers, and
# the JSON rewritten after each check to $OUT/gpu_check.json when OUT is set (the device tool),
# else runs/gpu_check/gpu_check.json; worker logs and bench results in gpu_check_logs/ beside it.
# GPU_CHECK_BUDGET (default 420 s) caps the checks (set it here, not with --budget); a backstop
# `timeout` stops the run 120 s later (the checks done so far stay in the JSON).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source "$ROOT/scripts/interpreter.sh"  # PYTHON: as the other launchers (python3 on a bare GPU machine)
WHEELS="${GPU_WHEELS:-$ROOT/.whl}"
BUDGET="${GPU_CHECK_BUDGET:-420}"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,15p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  exec "$PYTHON" scripts/gpu_check.py --help
fi
# found, not imported (importing megatron-core takes seconds: the checks' workers do that)
if ! "$PYTHON" -c "import importlib.util as u, sys
sys.exit(not (u.find_spec('megatron.core') and u.find_spec('omegaconf')))" 2>/dev/null; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "FAIL install: megatron-core is not importable and $WHEELS holds no wheels" \
         "(run scripts/gpu_wheels.sh on a machine with a registry and copy .whl/ along:" \
         "it is git-ignored)"; exit 1
  fi
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl \
    || { echo "FAIL install: pip could not install $WHEELS (wheels for CPython 3.12 x86-64)"; exit 1; }
  export PYTHONPATH="/tmp/site"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
RESULTS="${OUT:-$ROOT/runs/gpu_check}"
mkdir -p "$RESULTS"
timeout -k 15 $((BUDGET + 120)) "$PYTHON" scripts/gpu_check.py --budget "$BUDGET" \
  --out "$RESULTS/gpu_check.json" "$@"
status=$?
[[ $status == 124 ]] && echo "FAIL time: stopped (by the time limit of $BUDGET + 120 s, or a" \
  "signal); the checks done so far are in $RESULTS/gpu_check.json"
exit $status
