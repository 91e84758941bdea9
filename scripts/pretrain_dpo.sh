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
ENTRY="${DPO_MEGATRON_ENTRY:-dpo_megatron.train}"
DEFAULT_CONFIG="${DPO_MEGATRON_DEFAULT_CONFIG:-$ROOT/configs/dpo_smollm2_cpu.yaml}"
if [[ -n "${PYTHON:-}" ]]; then :
elif [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"
else PYTHON=python3; fi

if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  echo
  echo "Config keys: python -m dpo_megatron.config --help; every key: see dpo_megatron/config.py"
  exit 0
fi
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

# Already one rank of a launched job (torchrun sets TORCHELASTIC_RUN_ID; torchrun --no-python runs
# this script once per rank): do not launch again.
if [[ -n "${TORCHELASTIC_RUN_ID:-}" || ( -n "${RANK:-}" && -n "${WORLD_SIZE:-}" ) ]]; then
  exec "$PYTHON" -m "$ENTRY" "${args[@]}"
fi

# Resolve the config once in this process (fetches and caches its assets) and get the world size.
NPROC="$("$PYTHON" -m dpo_megatron.config "${args[@]}" | tail -n 1)"
exec "$PYTHON" -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node="$NPROC" \
  -m "$ENTRY" "${args[@]}"
