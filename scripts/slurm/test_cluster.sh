#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for tests and CI: munge (a generated key), slurmctld and
# one slurmd per simulated node (Slurm's multiple-slurmd mode), all state under one directory.
#
#   bash scripts/slurm/test_cluster.sh start    # idempotent: a running cluster is left as it is
#   bash scripts/slurm/test_cluster.sh status   # exit 0 when every daemon runs and the nodes are up
#   bash scripts/slurm/test_cluster.sh stop     # stops every daemon it started, removes nothing
#   eval "$(bash scripts/slurm/test_cluster.sh env)"   # SLURM_CONF for sbatch / srun / scontrol
#
# Needs root and Debian's slurm-wlm + munge (apt-get install -y slurm-wlm munge). Settings:
#   DPO_MEGATRON_SLURM_DIR    state directory (default /tmp/dpo_megatron_slurm)
#   DPO_MEGATRON_SLURM_NODES  number of nodes n1..nN (default 2)
#   DPO_MEGATRON_SLURM_CPUS   CPUs each node declares (default 2; the nodes share this machine's)
#   DPO_MEGATRON_SLURM_PORT   slurmctld's port (default 16817); slurmd of node i listens on
#                             PORT + 100 + i
# Node names (n1, n2, ...) do not resolve, as on clusters whose node names are not host names:
# every node has NodeHostname=<this host> and NodeAddr=<this host's address>, which is what a
# job's rendezvous must use (scripts/slurm/launch_node.sh).
#
# Timing settings are short so that tests see a lost node, a time limit or a requeue quickly:
# SlurmdTimeout=10 (a node whose slurmd stops answering is DOWN after ~10-20 s), KillWait=30 (a
# job past its time limit, or cancelled, gets SIGTERM and 30 s before SIGKILL), ReturnToService=2
# (a node that was DOWN is back as soon as its slurmd registers again), cred_expire=90 (job
# credentials live 90 s, and Slurm holds a requeued job that long before it may start again:
# 120 s by default; a job requeued after a lost node must not start before the late clean-up of
# its lost run, or that clean-up kills the new run), sched_interval=5 (a job whose hold ends
# starts within 5 s, not at the next once-a-minute scheduling pass). The late clean-up is a
# signal to the lost run's step that did not reach the lost node: slurmctld resends it 60 s
# later (its RPC retry) to the node that came back, where the requeued job's new run has the
# same step ids. SlurmdDebug=debug: each slurmd logs the signals it is sent ("_rpc_signal_tasks:
# ..."), and tests/test_slurm_cluster.py starts the new run once the resent one is in the log.
set -euo pipefail
DIR="${DPO_MEGATRON_SLURM_DIR:-/tmp/dpo_megatron_slurm}"
NODES="${DPO_MEGATRON_SLURM_NODES:-2}"
CPUS="${DPO_MEGATRON_SLURM_CPUS:-2}"
PORT="${DPO_MEGATRON_SLURM_PORT:-16817}"
CONF="$DIR/slurm.conf"
SOCKET="$DIR/munge/munge.socket"
export SLURM_CONF="$CONF"

die() { echo "test_cluster.sh: $*" >&2; exit 1; }

alive() {  # alive PIDFILE: the process of PIDFILE runs
  [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null
}

nodes() { local i; for ((i = 1; i <= NODES; i++)); do echo "n$i"; done; }

write_conf() {
  local host addr
  host="$(hostname)"
  addr="$(hostname -I 2>/dev/null | awk '{print $1}')"
  [[ -n "$addr" ]] || addr=127.0.0.1
  cat >"$CONF" <<EOF
# Written by scripts/slurm/test_cluster.sh: a test cluster of $NODES nodes on one machine.
ClusterName=dpotest
SlurmctldHost=$host($addr)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET,cred_expire=90
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
SchedulerParameters=sched_interval=5
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmdTimeout=10
SlurmctldTimeout=10
MessageTimeout=5
KillWait=30
SlurmdDebug=debug
InactiveLimit=0
MinJobAge=600
JobRequeue=1
NodeName=n[1-$NODES] NodeHostname=$host NodeAddr=$addr Port=$((PORT + 101))-$((PORT + 100 + NODES)) CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

start_munge() {
  if alive "$DIR/munge/munged.pid"; then return; fi
  mkdir -p "$DIR/munge"
  chmod 0700 "$DIR/munge"
  if [[ ! -s "$DIR/munge/munge.key" ]]; then
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chmod 0400 "$DIR/munge/munge.key"
  fi
  munged --force --socket="$SOCKET" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
    --seed-file="$DIR/munge/munged.seed"
}

start() {
  [[ $EUID == 0 ]] || die "needs root (slurmd runs jobs as any user)"
  local b
  for b in munged slurmctld slurmd sbatch scontrol; do
    command -v "$b" >/dev/null || die "$b not found: apt-get install -y slurm-wlm munge"
  done
  mkdir -p "$DIR/ctld" "$DIR/run" "$DIR/log"
  [[ -s "$CONF" ]] || write_conf
  start_munge
  if ! alive "$DIR/run/slurmctld.pid"; then
    slurmctld -f "$CONF"
  fi
  local n
  for n in $(nodes); do
    mkdir -p "$DIR/spool/$n"
    if ! alive "$DIR/run/slurmd-$n.pid"; then slurmd -f "$CONF" -N "$n"; fi
  done
  wait_up 60 || { status >&2 || true; die "the nodes did not come up in 60 s; logs in $DIR/log"; }
}

nodes_idle() {  # every node is up (idle, mixed or allocated; not down, drained or unknown)
  local states
  states="$(sinfo -h -N -o '%T' 2>/dev/null)" || return 1
  [[ "$(grep -cE '^(idle|mixed|allocated|completing)$' <<<"$states")" == "$NODES" ]]
}

wait_up() {  # wait_up SECONDS
  local deadline=$((SECONDS + $1))
  while ((SECONDS < deadline)); do
    if nodes_idle; then return 0; fi
    sleep 1
  done
  return 1
}

status() {
  local ok=0 n
  alive "$DIR/munge/munged.pid" && echo "munged: running" || { echo "munged: stopped"; ok=1; }
  alive "$DIR/run/slurmctld.pid" && echo "slurmctld: running" || { echo "slurmctld: stopped"; ok=1; }
  for n in $(nodes); do
    alive "$DIR/run/slurmd-$n.pid" && echo "slurmd $n: running" || { echo "slurmd $n: stopped"; ok=1; }
  done
  if ((ok == 0)); then sinfo -N -l 2>/dev/null || true; nodes_idle || ok=1; fi
  return $ok
}

stop_pid() {  # stop_pid PIDFILE NAME: SIGTERM, then SIGKILL after 10 s
  local pid i
  [[ -s "$1" ]] || return 0
  pid="$(cat "$1")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then echo "test_cluster.sh: $2 did not stop, SIGKILL" >&2; kill -9 "$pid" 2>/dev/null || true; fi
  fi
  rm -f "$1"
}

stop() {
  local n
  if alive "$DIR/run/slurmctld.pid"; then  # end the jobs first: their processes are ours
    scancel --quiet --user="$(id -un)" 2>/dev/null || true
  fi
  # the nodes' slurmd together: each takes seconds to end its jobs' steps and stop
  for n in $(nodes); do stop_pid "$DIR/run/slurmd-$n.pid" "slurmd $n" & done
  wait
  stop_pid "$DIR/run/slurmctld.pid" slurmctld
  stop_pid "$DIR/munge/munged.pid" munged
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
