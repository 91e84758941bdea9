#!/usr/bin/env bash
# The body of scripts/slurm/{sft,dpo}.sbatch: one launch_node.sh per node through srun, resuming
# from the run's latest checkpoint when there is one (a requeued or resubmitted job continues).
#
# Without srun (DPO_MEGATRON_NO_SRUN=1, for a dry run on one machine with simulated SLURM_*
# variables) this process is taken to be one node's srun task and runs launch_node.sh itself.
set -euo pipefail
ROOT="${DPO_MEGATRON_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
export DPO_MEGATRON_ROOT="$ROOT"
args=("$@")
has_resume=0
for a in "${args[@]+"${args[@]}"}"; do [[ "$a" == checkpoint.resume=* ]] && has_resume=1; done
if [[ $has_resume == 0 ]]; then args+=("checkpoint.resume=auto"); fi

if [[ -n "${DPO_MEGATRON_NO_SRUN:-}" ]]; then
  exec bash "$ROOT/scripts/slurm/launch_node.sh" "${args[@]}"
fi
exec srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  bash "$ROOT/scripts/slurm/launch_node.sh" "${args[@]}"
