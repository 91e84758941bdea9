#!/usr/bin/env bash
# The engine's GPU check, for a bare one-GPU machine (torch with CUDA present, no registry):
#
#   scripts/gpu_check.sh [gpu_check.py options]
#
# megatron-core and omegaconf travel as wheels in GPU_WHEELS (default: .whl at the repository
# root; scripts/gpu_wheels.sh fills it on a machine with a registry). They are installed into
# /tmp/site unless already importable, then scripts/gpu_check.py runs every check (fp32 / bf16 /
# packed step vs the CPU run of the same weights, checkpoint resume, gpu_bench MFU), printing
# PASS/FAIL lines with numbers. The JSON goes to $OUT/gpu_check.json when OUT is set (the device
# tool), else runs/gpu_check/. The whole run is capped at 8 minutes.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WHEELS="${GPU_WHEELS:-$ROOT/.whl}"
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  exec "$PY" scripts/gpu_check.py --help
fi
if ! "$PY" -c "import megatron.core, omegaconf" 2>/dev/null; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "FAIL install: megatron-core is not importable and $WHEELS holds no wheels" \
         "(run scripts/gpu_wheels.sh on a machine with a registry)"; exit 1
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHEELS"/*.whl || { echo "FAIL install: pip could not install $WHEELS"; exit 1; }
  export PYTHONPATH="/tmp/site"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
RESULTS="${OUT:-$ROOT/runs/gpu_check}"
mkdir -p "$RESULTS"
timeout 480 "$PY" scripts/gpu_check.py --out "$RESULTS/gpu_check.json" "$@"
status=$?
[[ $status == 124 ]] && echo "FAIL time: the check ran past 8 minutes"
exit $status
