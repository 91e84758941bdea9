# Sourced by scripts/slurm/job.sh (the batch shell) and launch_node.sh (each node): what both
# decide the same way. Needs ROOT. Sets:
#   PYTHON          the interpreter: $PYTHON, else ROOT's .venv, else python3
#   GPUS_PER_NODE   processes per node: $GPUS_PER_NODE, else SLURM_GPUS_ON_NODE, else the GPUs
#                   nvidia-smi lists, else 1
#   args            the command line ("$@" of with_default_config) with --config
#                   DPO_MEGATRON_DEFAULT_CONFIG added when it names none
source "$ROOT/scripts/interpreter.sh"  # PYTHON
if [[ -z "${GPUS_PER_NODE:-}" ]]; then
  if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then GPUS_PER_NODE="$SLURM_GPUS_ON_NODE"
  elif command -v nvidia-smi >/dev/null 2>&1; then GPUS_PER_NODE="$(nvidia-smi -L | wc -l)"
  else GPUS_PER_NODE=1; fi
fi

with_default_config() {
  local a has_config=0
  args=("$@")
  for a in "${args[@]+"${args[@]}"}"; do [[ "$a" == "--config" || "$a" == --config=* ]] && has_config=1; done
  if [[ $has_config == 0 ]]; then
    args=(--config "${DPO_MEGATRON_DEFAULT_CONFIG:-$ROOT/configs/dpo_smollm2_cpu.yaml}" "${args[@]+"${args[@]}"}")
  fi
}
