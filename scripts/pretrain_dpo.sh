#!/usr/bin/env bash
# Launch DPO training.
#
#   scripts/pretrain_dpo.sh [--config FILE] [key=value ...]
#
# With no arguments: the main job (SmolLM2-135M-Instruct on the real dpo_en_demo pairs, TP 2 x PP 2
# on CPU/gloo, configs/dpo_smollm2_cpu.yaml). Started by a launcher (torchrun --no-python, srun), it
# runs the trainer in place; started by hand, it runs torchrun itself with the world size the config
# asks for (TP x PP x parallel.data_parallel_size).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ENTRY="${DPO_MEGATRON_ENTRY:-dpo_megatron.cli.train}"
DEFAULT_CONFIG="${DPO_MEGATRON_DEFAULT_CONFIG:-$ROOT/configs/dpo_smollm2_cpu.yaml}"
source "$ROOT/scripts/interpreter.sh"  # PYTHON

for a in "$@"; do
  if [[ "$a" == "-h" || "$a" == "--help" ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
    echo
    echo "Options: --config FILE (anywhere; default $(basename "$DEFAULT_CONFIG")), key=value overrides,"
    echo "  --list-keys (every config key: type, default, valid range), --print-config (the resolved"
    echo "  config as YAML), --plan (the layouts that fit this config on a cluster: --gpu h100"
    echo "  --nodes N --gpus-per-node 8, ...: docs/PLANNER.md). Shorthands: loss=ipo is"
    echo "  loss.name=ipo; key= clears a string key; model=NAME is a model preset (smollm2,"
    echo "  pythia28, llama3.1-8b, gpt-oss-20b, ...: docs/HF_CONVERSION.md#presets), its local copy"
    echo "  looked up under \$DPO_MEGATRON_MODELS."
    echo "Before any rank starts, the config, the data files, the model's layout and weight files and"
    echo "the checkpoints it loads or resumes are checked; a mistake ends the script with one"
    echo "'config error:' or 'error:' line (exit status 1)."
    exit 0
  fi
done
args=("$@")
has_config=0
for a in "${args[@]+"${args[@]}"}"; do [[ "$a" == "--config" || "$a" == --config=* ]] && has_config=1; done
if [[ $has_config == 0 ]]; then args=(--config "$DEFAULT_CONFIG" "${args[@]+"${args[@]}"}"); fi

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Ctrl-C / SIGTERM: torchrun forwards the signal to its ranks, which finish their step and save a
# checkpoint (dpo_megatron/training/shutdown.py); give them this long before torchrun's SIGKILL
# (torchrun's --shutdown-timeout, 30 s by default: less than one SmolLM2 save on a busy CPU).
# Killing this script with SIGKILL takes the ranks with it (parent-death signal in each rank).
export PET_SHUTDOWN_TIMEOUT="${PET_SHUTDOWN_TIMEOUT:-120}"

# The pre-check: dpo_megatron.cli.check, or another entry's (DPO_MEGATRON_PRECHECK, e.g.
# scripts/iterative_dpo.sh's).
read -r -a PRECHECK <<< "${DPO_MEGATRON_PRECHECK:--m dpo_megatron.cli.check}"
# --plan: the layout planner on this config (dpo_megatron/cli/plan.py; its options such as --gpu h100
# --nodes 4 pass through), nothing is launched.
for i in "${!args[@]}"; do
  if [[ "${args[$i]}" == "--plan" ]]; then
    unset 'args[i]'
    exec "$PYTHON" -m dpo_megatron.cli.plan "${args[@]}"
  fi
done
# --list-keys / --print-config: answered by the pre-check, nothing is launched.
for a in "${args[@]}"; do
  if [[ "$a" == "--list-keys" || "$a" == "--print-config" ]]; then
    exec "$PYTHON" "${PRECHECK[@]}" "${args[@]}"
  fi
done

# Already one rank of a launched job (torchrun sets TORCHELASTIC_RUN_ID; torchrun --no-python runs
# this script once per rank): do not launch again.
if [[ -n "${TORCHELASTIC_RUN_ID:-}" || ( -n "${RANK:-}" && -n "${WORLD_SIZE:-}" ) ]]; then
  exec "$PYTHON" -m "$ENTRY" "${args[@]}"
fi

# Pre-check, once, in this process: the config (ranges, keys, loss; fetches and caches its assets),
# the data files (exist, rows fit their format) and the model against the layout; then the world
# size. A mistake prints one line on stderr and stops here (set -e), before any rank starts.
NPROC="$("$PYTHON" "${PRECHECK[@]}" "${args[@]}" | tail -n 1)"
# torchrun, run by dpo_megatron/cli/launch.py: a mistake only the ranks meet (a run_dir in use, data
# that changed) ends with the ranks' one error line and one pointer line, not torchrun's failure
# block; a crash keeps its traceback and torchrun's block.
exec "$PYTHON" -m dpo_megatron.cli.launch --standalone --nnodes=1 --nproc-per-node="$NPROC" \
  -m "$ENTRY" "${args[@]}"
