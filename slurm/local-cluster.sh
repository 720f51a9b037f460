#!/usr/bin/env bash
# A real Slurm cluster on this machine, for development, tests and CI.
#
#   slurm/local-cluster.sh up       install (root, Debian) if missing, configure, start, wait
#   slurm/local-cluster.sh status   controller and node states
#   slurm/local-cluster.sh down     stop exactly the daemons `up` started
#
# `up` prints the line to eval:  export SLURM_CONF=<dir>/slurm.conf
# Settings (environment): PEARL_SLURM_DIR (state, default /tmp/pearl-slurm),
# PEARL_SLURM_NODES (4), PEARL_SLURM_GPUS (fake GPUs per node, 8), PEARL_SLURM_CPUS (8),
# PEARL_SLURM_PORT (controller port, 16817; nodes use the next ones).
#
# Partitions: `normal` (default), `elastic` (preemptible: cancelled after a 20 s grace
# time, the job's --signal delivered first) and `high` (priority tier 10: preempts
# `elastic`). Each node's GPUs are GRES type `sim`, its feature `sim`
# (configs/clusters/local.yaml describes it). No accounting database: ended jobs go to
# the job completion log (log/jobcomp.log), which `sacct -c` and `pearl-hpc trace` read. Facts this relies on: shared/notes/slurm-local-cluster.md.
set -euo pipefail

DIR=${PEARL_SLURM_DIR:-/tmp/pearl-slurm}
NODES=${PEARL_SLURM_NODES:-4}
GPUS=${PEARL_SLURM_GPUS:-8}
CPUS=${PEARL_SLURM_CPUS:-8}
PORT=${PEARL_SLURM_PORT:-16817}
CONF=$DIR/slurm.conf
GRACE_S=20

say() { echo "local-cluster: $*" >&2; }
die() { say "error: $*"; exit 1; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v munged >/dev/null; then return; fi
  [ "$(id -u)" = 0 ] || die "slurm-wlm and munge are missing and this is not root: apt-get install -y slurm-wlm munge"
  say "installing slurm-wlm and munge (apt)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
}

start_munge() {
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then return; fi
  [ -f /etc/munge/munge.key ] || die "/etc/munge/munge.key missing: reinstall munge"
  mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
  runuser -u munge -- /usr/sbin/munged 2>/dev/null || /usr/sbin/munged --force
  touch "$DIR/munge.started-by-us"
  for _ in $(seq 1 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return
    sleep 0.1
  done
  die "munged does not answer (munge -n | unmunge)"
}

write_config() {
  mkdir -p "$DIR"/{state,log,run,dev,spool}
  for i in $(seq 0 $((GPUS - 1))); do ln -sfn /dev/null "$DIR/dev/nvidia$i"; done
  local last_port=$((PORT + NODES))
  cat >"$CONF" <<EOF
# written by slurm/local-cluster.sh; a test cluster on one host
ClusterName=pearl
# a requeued job waits cred_expire before it starts again (default 120 s); the step
# credentials it also bounds are checked seconds after they are issued on this one host
AuthInfo=cred_expire=30
SlurmctldHost=localhost
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmdParameters=config_overrides
SlurmctldParameters=preempt_send_user_signal
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.log
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
KillWait=5
MinJobAge=5
InactiveLimit=0
NodeName=n[1-$NODES] NodeHostname=localhost Port=[$((PORT + 1))-$last_port] CPUs=$CPUS RealMemory=16000 Gres=gpu:sim:$GPUS Features=sim State=UNKNOWN
PartitionName=normal Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=OFF
PartitionName=elastic Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=CANCEL GraceTime=$GRACE_S
PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
EOF
  cat >"$DIR/gres.conf" <<EOF
AutoDetect=off
NodeName=n[1-$NODES] Name=gpu Type=sim File=$DIR/dev/nvidia[0-$((GPUS - 1))]
EOF
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

up() {
  install_packages
  mkdir -p "$DIR"
  if running "$DIR/run/slurmctld.pid"; then
    say "already running"
  else
    start_munge
    write_config
    slurmctld -i -f "$CONF"
    for i in $(seq 1 "$NODES"); do
      mkdir -p "$DIR/spool/n$i"
      slurmd -f "$CONF" -N "n$i"
    done
  fi
  export SLURM_CONF=$CONF
  for _ in $(seq 1 100); do
    scontrol ping 2>/dev/null | grep -q "is UP" && break
    sleep 0.2
  done
  scontrol ping 2>/dev/null | grep -q "is UP" || die "slurmctld is not UP: see $DIR/log/slurmctld.log"
  for _ in $(seq 1 150); do
    states=$(sinfo -h -N -p normal -o %T 2>/dev/null | sort -u | tr '\n' ' ')
    case "$states" in
      "idle ") break ;;
      *inval*|*drain*|*down*) scontrol update nodename="n[1-$NODES]" state=resume 2>/dev/null || true ;;
    esac
    sleep 0.2
  done
  [ "$(sinfo -h -N -p normal -o %T | sort -u)" = idle ] ||
    die "nodes not idle ($(sinfo -h -N -o '%N %T' | tr '\n' ' ')): see $DIR/log/"
  say "up: $NODES nodes x $GPUS GPUs, partitions normal / elastic / high"
  echo "export SLURM_CONF=$CONF"
}

down() {
  local pidfile
  for pidfile in "$DIR"/run/slurmd-*.pid "$DIR"/run/slurmctld.pid; do
    [ -f "$pidfile" ] || continue
    if running "$pidfile"; then kill "$(cat "$pidfile")" 2>/dev/null || true; fi
  done
  for pidfile in "$DIR"/run/slurmd-*.pid "$DIR"/run/slurmctld.pid; do
    [ -f "$pidfile" ] || continue
    for _ in $(seq 1 50); do running "$pidfile" || break; sleep 0.1; done
    if running "$pidfile"; then kill -9 "$(cat "$pidfile")" 2>/dev/null || true; fi
    rm -f "$pidfile"
  done
  if [ -f "$DIR/munge.started-by-us" ]; then
    pkill -x munged 2>/dev/null || true
    rm -f "$DIR/munge.started-by-us"
  fi
  say "down"
}

status() {
  export SLURM_CONF=$CONF
  [ -f "$CONF" ] || { say "not configured ($CONF missing)"; exit 1; }
  scontrol ping || exit 1
  sinfo -N -o "%N %P %T %G"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
