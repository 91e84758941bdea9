#!/usr/bin/env bash
# One node's share of a multi-node training job: torchrun with this node's rank, rendezvous on the
# job's first node. srun runs it once per node (scripts/slurm/job.sh does that):
#
#   srun --ntasks-per-node=1 bash scripts/slurm/launch_node.sh [--config FILE] [key=value ...]
#
# Reads (SLURM sets the first three):
#   SLURM_NNODES, SLURM_NODEID       nodes in the job, this node's index (0 = rendezvous host)
#   SLURM_JOB_NODELIST               the rendezvous host is its first node's NodeAddr (scontrol
#                                    show node), else that node's name when it resolves
#   MASTER_ADDR, MASTER_PORT         override the rendezvous host / port (default port 29500 +
#                                    SLURM_JOB_ID % 1000, so jobs sharing a node do not collide)
#   GPUS_PER_NODE                    processes per node (default SLURM_GPUS_ON_NODE, else the
#                                    number of visible GPUs, else 1)
#   DPO_MEGATRON_ENTRY               python module to run (default dpo_megatron.cli.train)
#   DPO_MEGATRON_DEFAULT_CONFIG      config used when no --config is given
# Global rank = node index x GPUS_PER_NODE + local rank (torchrun's static rendezvous), so a job
# of N nodes x G GPUs has the same rank layout as one machine with N x G processes.
set -euo pipefail
ROOT="${DPO_MEGATRON_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}"
ENTRY="${DPO_MEGATRON_ENTRY:-dpo_megatron.cli.train}"
# shellcheck source=node_env.sh
source "$ROOT/scripts/slurm/node_env.sh"  # PYTHON, GPUS_PER_NODE, with_default_config

NNODES="${SLURM_NNODES:?SLURM_NNODES is not set: run under srun (scripts/slurm/*.sbatch)}"
NODE_RANK="${SLURM_NODEID:?SLURM_NODEID is not set: run under srun (scripts/slurm/*.sbatch)}"
# The rendezvous host: the first node's NodeAddr (what slurmctld itself uses to reach it), else
# its name. A node name need not resolve (NodeName=n1 NodeAddr=10.0.0.7): c10d would retry an
# unresolvable name for minutes, so stop with one line instead.
resolves() { getent ahosts "$1" >/dev/null 2>&1; }  # names and address literals
if [[ -z "${MASTER_ADDR:-}" ]]; then
  # No `| head -n 1`: under pipefail, scontrol killed by SIGPIPE would end the script (141).
  first="$(scontrol show hostnames "${SLURM_STEP_NODELIST:-${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set: run under srun or set MASTER_ADDR}}")"
  first="${first%%$'\n'*}"
  addr="$(scontrol show node -o "$first" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')"
  if [[ -n "$addr" ]] && resolves "$addr"; then MASTER_ADDR="$addr"
  elif resolves "$first"; then MASTER_ADDR="$first"
  else
    echo "launch_node.sh: the rendezvous host, node $first (NodeAddr ${addr:-unknown}), does not resolve on $(hostname): set MASTER_ADDR to an address of $first reachable from every node" >&2
    exit 1
  fi
fi
MASTER_PORT="${MASTER_PORT:-$((29500 + ${SLURM_JOB_ID:-0} % 1000))}"
with_default_config "$@"

# NCCL / threads: conservative defaults, every one overridable from the job's environment.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"  # megatron-core TP overlap
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"  # fail, not hang
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# SIGTERM (scancel, preemption): the ranks save a checkpoint at the end of their step; torchrun
# waits this long for them before SIGKILL (keep it below the cluster's KillWait).
export PET_SHUTDOWN_TIMEOUT="${PET_SHUTDOWN_TIMEOUT:-120}"
# Set NCCL_SOCKET_IFNAME / NCCL_IB_HCA in the sbatch file when the cluster needs them.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

echo "node $NODE_RANK/$NNODES on $(hostname): $GPUS_PER_NODE processes, rendezvous $MASTER_ADDR:$MASTER_PORT" >&2
# torchrun, run by dpo_megatron/cli/launch.py (a rank's one error line is not followed by torchrun's
# failure block; a crash keeps it).
exec "$PYTHON" -m dpo_megatron.cli.launch --nnodes="$NNODES" --node-rank="$NODE_RANK" \
  --nproc-per-node="$GPUS_PER_NODE" --master-addr="$MASTER_ADDR" --master-port="$MASTER_PORT" \
  -m "$ENTRY" "${args[@]}"
