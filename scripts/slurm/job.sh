#!/usr/bin/env bash
# The body of scripts/slurm/{sft,dpo,iterative_dpo}.sbatch: the pre-check, then one
# launch_node.sh per node through srun, resuming from the run's latest checkpoint when there is
# one (a requeued or resubmitted job continues).
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
# The pre-check of scripts/pretrain_dpo.sh (DPO_MEGATRON_PRECHECK, as there), once, here before
# any node starts: a mistake in the config, the data, the model or the layout against this
# allocation's SLURM_NNODES x GPUS_PER_NODE ranks ends the job with its one line and status 1.
# Left to the ranks, the first to stop has srun end the others with SIGTERM (--kill-on-bad-exit),
# and the job ends with 143, as if preempted.
# shellcheck source=node_env.sh
source "$ROOT/scripts/slurm/node_env.sh"  # PYTHON, GPUS_PER_NODE, with_default_config
with_default_config "${args[@]}"
read -r -a PRECHECK <<< "${DPO_MEGATRON_PRECHECK:--m dpo_megatron.cli.check}"
WORLD_SIZE=$((SLURM_NNODES * GPUS_PER_NODE)) PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" \
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PYTHON" "${PRECHECK[@]}" "${args[@]}" >/dev/null ||
  exit 1
# srun runs in the background of this (batch) shell, which passes a SIGTERM or SIGINT it gets on
# to the ranks as that signal (scancel --signal=TERM of the job's steps): each saves at the end of
# its step and stops. srun itself must not get it: srun answers SIGTERM by SIGKILLing the step
# ("forcing job termination"), which is what `sbatch --signal=B:TERM@60` (the batch shell only,
# 60 s before the time limit) or `scancel --batch` would otherwise do to a job that exec'd srun.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  bash "$ROOT/scripts/slurm/launch_node.sh" "${args[@]}" &
step=$!
forward() {
  echo "job.sh: $1 on the batch shell: passing it to the ranks (they save at the end of their step)" >&2
  scancel --signal="$1" "$SLURM_JOB_ID" 2>/dev/null || true  # fails once the job has ended
}
trap 'forward TERM' TERM
trap 'forward INT' INT
# wait returns early when a trapped signal arrives: wait again until srun has ended
while :; do
  rc=0; wait "$step" || rc=$?
  kill -0 "$step" 2>/dev/null || break
done
exit "$rc"
