#!/usr/bin/env bash
# A private one-node SLURM cluster on this machine, for tests and for trying the SLURM paths:
#
#   scripts/slurm_local.sh start  [DIR]   # configure and start munged, slurmctld, slurmd under DIR
#   scripts/slurm_local.sh status [DIR]   # the daemons' pids and `sinfo`; exit 1 if one is down
#   scripts/slurm_local.sh stop   [DIR]   # stop exactly the daemons this script started in DIR
#   eval "$(scripts/slurm_local.sh env [DIR])"   # export SLURM_CONF (what sbatch/squeue/... need)
#
# DIR defaults to $SLURM_LOCAL_DIR, else .slurm-local/ in the repository. Everything lives there:
# slurm.conf, munge's key, socket, pid, seed and log, slurmctld's state, slurmd's spool, pid files
# and logs. Nothing in /etc, /run or /var is read or written, so several clusters can run side by
# side (each on its own free ports). Needs root (slurmd starts jobs as their submitting user),
# the Debian packages `slurm-wlm` and `munge` (Slurm 22.05), and python3 (to find free ports).
# Exit 77 when slurmctld/slurmd/munged are not installed (the tests skip on it).
#
# No cgroups and no systemd are needed: proctrack/linuxproc tracks a job's processes by parent
# pid, task/none binds nothing. One node with this machine's CPUs; the partition is
# OverSubscribe=FORCE so that several small jobs share the CPUs (a test suite's jobs are tiny)
# and `--overcommit` lets a job run more tasks than CPUs (4 ranks on 2 cores).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cmd=${1:-}
S=${2:-${SLURM_LOCAL_DIR:-$ROOT/.slurm-local}}
PYTHON=${PYTHON:-python3}

usage() { echo "usage: $0 start|stop|status|env [DIR]" >&2; exit 2; }
[ -n "$cmd" ] || usage

need_packages() {
    local missing=()
    for b in munged slurmctld slurmd sbatch; do
        command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || missing+=("$b")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "slurm_local: not installed: ${missing[*]} (apt-get install slurm-wlm munge)" >&2
        exit 77
    fi
    if [ "$(id -u)" != 0 ]; then
        echo "slurm_local: needs root (slurmd runs jobs as their user)" >&2
        exit 77
    fi
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

free_ports() {   # N distinct TCP ports nobody listens on now
    "$PYTHON" - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

wait_for() {     # wait_for SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2; shift 2
    local deadline=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        if [ $SECONDS -ge $deadline ]; then
            echo "slurm_local: $what did not happen within ${limit}s; logs in $S/log" >&2
            tail -n 5 "$S"/log/*.log >&2 || true
            return 1
        fi
        sleep 0.2
    done
}

node_idle() { sinfo -h -N -o '%T' | grep -qE '^(idle|mixed|allocated)'; }

start() {
    need_packages
    if pid_alive "$S/run/slurmctld.pid"; then
        echo "slurm_local: already running in $S" >&2; exit 1
    fi
    mkdir -p "$S"/{munge,state,spool,run,log}
    chmod 700 "$S/munge"
    if [ ! -s "$S/munge/munge.key" ]; then
        dd if=/dev/urandom of="$S/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$S/munge/munge.key"
    fi
    # A start that fails half-way stops what it had started.
    trap 'echo "slurm_local: start failed; stopping what was started" >&2; stop >/dev/null 2>&1' ERR
    rm -f "$S/munge/munge.sock" "$S/munge/munge.sock.lock"
    local ctld_port slurmd_port
    read -r ctld_port slurmd_port <<<"$(free_ports 2)"
    local node cpus
    node=$(hostname -s)
    cpus=$(nproc)
    cat >"$S/slurm.conf" <<EOF
# Written by scripts/slurm_local.sh: a private one-node cluster in $S
ClusterName=distlib
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire: a requeued job waits this long + 1 s before it may start again (default 120 s).
AuthInfo=socket=$S/munge/munge.sock,cred_expire=5
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# A tiny cluster: look at pending jobs every second, not every 30/60 s (a requeued job starts at once).
SchedulerParameters=bf_interval=1,sched_interval=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
# scancel: SIGTERM, then SIGKILL this many seconds later (a training job saves within a step).
KillWait=10
InactiveLimit=0
MinJobAge=600
StateSaveLocation=$S/state
SlurmdSpoolDir=$S/spool
SlurmctldPidFile=$S/run/slurmctld.pid
SlurmdPidFile=$S/run/slurmd.pid
SlurmctldLogFile=$S/log/slurmctld.log
SlurmdLogFile=$S/log/slurmd.log
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=local Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
EOF
    munged --force --key-file="$S/munge/munge.key" --socket="$S/munge/munge.sock" \
        --pid-file="$S/run/munged.pid" --log-file="$S/log/munged.log" --seed-file="$S/munge/munged.seed"
    wait_for 10 "munged start" test -S "$S/munge/munge.sock"
    export SLURM_CONF=$S/slurm.conf
    slurmctld -f "$SLURM_CONF"
    wait_for 20 "slurmctld start" pid_alive "$S/run/slurmctld.pid"
    wait_for 20 "slurmctld answering" scontrol ping
    slurmd -f "$SLURM_CONF"
    wait_for 30 "the node becoming idle" node_idle
    trap - ERR
    echo "slurm_local: running in $S (slurmctld port $ctld_port, $cpus CPUs on node $node)"
    echo "export SLURM_CONF=$SLURM_CONF"
}

our_stepds() {  # slurmstepd processes of this cluster: they hold its slurmd log open
    local p
    for p in $(pgrep -x slurmstepd 2>/dev/null || true); do
        if ls -l "/proc/$p/fd" 2>/dev/null | grep -qF "$S/log/"; then echo "$p"; fi
    done
}

kill_tree() {   # kill_tree SIGNAL PID: the process and all its descendants
    local child
    for child in $(pgrep -P "$2" 2>/dev/null || true); do kill_tree "$1" "$child"; done
    kill "-$1" "$2" 2>/dev/null || true
}

stop() {
    local rc=0 d pid pidfile
    export SLURM_CONF=$S/slurm.conf
    if pid_alive "$S/run/slurmctld.pid"; then
        # End every job of this cluster first: slurmd leaves running jobs alone when it stops.
        local jobs
        jobs=$(squeue -h -o %A 2>/dev/null || true)
        if [ -n "$jobs" ]; then
            scancel --full --signal=KILL $jobs 2>/dev/null || true
            scancel $jobs 2>/dev/null || true
        fi
        local deadline=$((SECONDS + 15))
        while [ -n "$(our_stepds)" ] && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
    fi
    for pid in $(our_stepds); do kill_tree KILL "$pid"; done
    # All three at once: each takes ~2 s to shut down (measured), none needs the others for it.
    local pids=()
    for d in slurmd slurmctld munged; do
        pidfile=$S/run/$d.pid
        if pid_alive "$pidfile"; then
            pid=$(cat "$pidfile")
            kill -TERM "$pid" 2>/dev/null && pids+=("$d:$pid")
        fi
    done
    local deadline=$((SECONDS + 15)) entry
    for entry in "${pids[@]}"; do
        pid=${entry#*:}
        while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.05; done
        if kill -0 "$pid" 2>/dev/null; then
            echo "slurm_local: ${entry%%:*} ($pid) ignored SIGTERM for 15s; killing it" >&2
            kill -KILL "$pid" 2>/dev/null || true
            rc=1
        fi
    done
    rm -f "$S"/run/{slurmd,slurmctld,munged}.pid
    echo "slurm_local: stopped ($S)"
    return $rc
}

status() {
    local down=0
    for d in munged slurmctld slurmd; do
        if pid_alive "$S/run/$d.pid"; then
            echo "$d: running (pid $(cat "$S/run/$d.pid"))"
        else
            echo "$d: not running"; down=1
        fi
    done
    if [ $down = 0 ]; then
        SLURM_CONF=$S/slurm.conf sinfo
    fi
    return $down
}

case $cmd in
    start) start ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$S/slurm.conf" ;;
    *) usage ;;
esac
