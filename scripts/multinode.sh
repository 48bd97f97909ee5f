#!/usr/bin/env bash
# Two hosts on one machine: a 2-node x 2-process torchrun job over a real (virtual) network.
#
#   sudo scripts/multinode.sh [--verify] WORKDIR [train.py overrides...]
#
# Builds two network namespaces joined by a veth pair ("node0" 10.200.0.1/30, "node1"
# 10.200.0.2/30). Each runs in its own UTS namespace with its own hostname, and `ip netns exec`
# mounts a per-namespace /etc/hosts naming both nodes, so the two "hosts" see each other only
# through the veth link, exactly as two machines on a LAN would. Then on each node, from
# WORKDIR (the filesystem is shared, as a cluster's must be):
#
#   GLOO_SOCKET_IFNAME=<its veth> torchrun --nnodes 2 --nproc_per_node 2 \
#       --rdzv-backend c10d --rdzv-endpoint <node0 hostname>:PORT train.py dist.world_size=4 ...
#
# No hydra.run.dir is passed (unless you pass one): the nodes agree on the run directory
# through torchrun's own TCPStore on node 0, as on a real cluster. Node logs: WORKDIR/node{0,1}.log.
#
# MULTINODE_LAUNCHER=own runs the project's own launcher on each node instead:
#
#   GLOO_SOCKET_IFNAME=<its veth> python train.py dist.world_size=4 dist.nodes=2 \
#       dist.store=<node 0 hostname>:PORT dist.max_restarts=MAX_RESTARTS ... dist.node_rank=<i>
#
# (node 0 composes the configuration and serves the store; node 1 takes both from it; each
# node's agent replaces the workers it loses while every other rank stays: docs/unattended.md).
#
# --verify then runs, on this host with no namespaces, the same job (without its fault.* drills)
# as 4 ranks from scratch (WORKDIR/single) and a 4-rank resume from the 2x2 run's first
# checkpoint (WORKDIR/resume), and checks that every step's loss is bitwise equal (metrics.jsonl
# loss_hex) across all three; it prints MULTINODE VERIFIED or exits 1.
#
# Environment: MULTINODE_NAME (prefix of namespace/interface/host names, <= 12 chars; default
# dlmn<pid>), MULTINODE_SUBNET (first three octets; default 10.200.0), MULTINODE_PORT
# (rendezvous port on node 0; default 29400), MULTINODE_TIMEOUT (seconds per node; default 300),
# MULTINODE_MAX_RESTARTS (torchrun --max-restarts, or dist.max_restarts; default 0),
# MULTINODE_LAUNCHER (torchrun or own; default torchrun), MULTINODE_MAY_DIE=<0 or 1> (that node
# is expected to be lost mid-run, every process of it killed: the job is the other's, and the lost
# node's exit status is not checked; with the own launcher), MULTINODE_OWN_SHM=1 (each node
# gets its own tmpfs on /dev/shm, as separate hosts have: in-memory snapshots stay node-local),
# PYTHON (default .venv/bin/python). Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2;
# exits 77 if namespaces cannot be created. Everything it creates (namespaces, the veth pair,
# /etc/netns/<name>) is removed on exit, also on failure or Ctrl-C.
set -uo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
VERIFY=0
if [[ "${1:-}" == "--verify" ]]; then VERIFY=1; shift; fi
if [[ $# -lt 1 ]]; then
    echo "usage: $0 [--verify] WORKDIR [train.py overrides...]" >&2
    exit 2
fi
WORK="$(mkdir -p "$1" && cd "$1" && pwd)"
shift
OVERRIDES=("$@")

NAME="${MULTINODE_NAME:-dlmn$$}"
SUBNET="${MULTINODE_SUBNET:-10.200.0}"
PORT="${MULTINODE_PORT:-29400}"
TIMEOUT="${MULTINODE_TIMEOUT:-300}"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
MAX_RESTARTS="${MULTINODE_MAX_RESTARTS:-0}"
LAUNCHER="${MULTINODE_LAUNCHER:-torchrun}"
MAY_DIE="${MULTINODE_MAY_DIE:-}"
export MULTINODE_OWN_SHM="${MULTINODE_OWN_SHM:-0}"
NPROC=2
NODES=("$NAME-node0" "$NAME-node1")      # namespace = hostname of each node
VETH=("${NAME}v0" "${NAME}v1")
ADDR=("$SUBNET.1" "$SUBNET.2")

die() { echo "multinode: $*" >&2; exit "${2:-1}"; }
[[ ${#NAME} -le 12 && "$NAME" =~ ^[a-z0-9]+$ ]] || die "MULTINODE_NAME must be 1-12 lowercase letters/digits, got '$NAME'" 2
[[ "$SUBNET" =~ ^(10|192\.168|172\.(1[6-9]|2[0-9]|3[01]))(\.[0-9]{1,3}){1,2}$ ]] \
    || die "MULTINODE_SUBNET must be a private prefix like 10.200.0, got '$SUBNET'" 2
command -v ip >/dev/null || die "iproute2 ('ip') is not installed (apt-get install -y iproute2)" 77
command -v unshare >/dev/null || die "util-linux ('unshare') is not installed" 77
[[ "$(id -u)" == 0 ]] || die "needs root to create network namespaces" 77
[[ -x "$PYTHON" ]] || die "python interpreter $PYTHON not found (set PYTHON)" 2
[[ "$LAUNCHER" == torchrun || "$LAUNCHER" == own ]] || die "MULTINODE_LAUNCHER must be torchrun or own, got '$LAUNCHER'" 2

NETNS_ETC_CREATED=0
[[ -d /etc/netns ]] || NETNS_ETC_CREATED=1
PIDS=()

cleanup() {
    local pid ns
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
    for ns in "${NODES[@]}"; do
        if ip netns list 2>/dev/null | grep -qw "^$ns"; then
            for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
            ip netns del "$ns" 2>/dev/null     # also destroys the veth end inside it
        fi
        rm -rf "/etc/netns/$ns"
    done
    [[ $NETNS_ETC_CREATED == 1 ]] && rmdir /etc/netns 2>/dev/null
    return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# -- the two hosts and the wire between them -----------------------------------
for ns in "${NODES[@]}"; do
    ip netns list | grep -qw "^$ns" && die "namespace $ns already exists; choose another MULTINODE_NAME" 2
done
ip netns add "${NODES[0]}" 2>/tmp/multinode.$$ || die "cannot create a network namespace: $(cat /tmp/multinode.$$)" 77
rm -f /tmp/multinode.$$
ip netns add "${NODES[1]}" || die "cannot create namespace ${NODES[1]}" 77
ip link add "${VETH[0]}" netns "${NODES[0]}" type veth peer name "${VETH[1]}" netns "${NODES[1]}" \
    || die "cannot create the veth pair" 77
for i in 0 1; do
    ip -n "${NODES[$i]}" addr add "${ADDR[$i]}/30" dev "${VETH[$i]}" || die "cannot address ${VETH[$i]}"
    ip -n "${NODES[$i]}" link set "${VETH[$i]}" up || die "cannot bring up ${VETH[$i]}"
    ip -n "${NODES[$i]}" link set lo up || die "cannot bring up lo in ${NODES[$i]}"
    mkdir -p "/etc/netns/${NODES[$i]}"
    printf '127.0.0.1 localhost\n%s %s\n%s %s\n' "${ADDR[0]}" "${NODES[0]}" "${ADDR[1]}" "${NODES[1]}" \
        > "/etc/netns/${NODES[$i]}/hosts"
done

# -- the job: one launcher (torchrun, or the project's own) per node ---------------
echo "multinode: ${NODES[0]} (${ADDR[0]}, ${VETH[0]}) <-> ${NODES[1]} (${ADDR[1]}, ${VETH[1]}); work dir $WORK"
RUN_ID="$NAME-$(date +%s)"
for i in 0 1; do
    if [[ "$LAUNCHER" == own ]]; then
        JOB=("$REPO/train.py" dist.world_size=$((2 * NPROC)) dist.nodes=2 dist.store="${NODES[0]}:$PORT"
             dist.max_restarts="$MAX_RESTARTS" "${OVERRIDES[@]}" dist.node_rank=$i)
    else
        JOB=(-m torch.distributed.run --nnodes 2 --nproc_per_node $NPROC
             --rdzv-backend c10d --rdzv-endpoint "${NODES[0]}:$PORT" --rdzv-id "$RUN_ID"
             --rdzv-conf join_timeout=120 --max-restarts "$MAX_RESTARTS"
             "$REPO/train.py" dist.world_size=$((2 * NPROC)) "${OVERRIDES[@]}")
    fi
    # shellcheck disable=SC2016  # $0.. expand inside the node's shell, not here
    ip netns exec "${NODES[$i]}" unshare --uts --mount sh -c 'hostname "$1" && shift && cd "$1" && shift \
            && { [ "$MULTINODE_OWN_SHM" != 1 ] || mount -t tmpfs -o size=256m,mode=1777 tmpfs /dev/shm; } && exec "$@"' \
        node "${NODES[$i]}" "$WORK" \
        env GLOO_SOCKET_IFNAME="${VETH[$i]}" LOGLEVEL=INFO \
        timeout --kill-after=10 "$TIMEOUT" "$PYTHON" "${JOB[@]}" \
        > "$WORK/node$i.log" 2>&1 &
    PIDS+=($!)
done
RC=(0 0)
for i in 0 1; do
    wait "${PIDS[$i]}"; RC[$i]=$?
    [[ "$i" == "$MAY_DIE" ]] && RC[$i]=0   # lost on purpose: the other node finishes the job
    if [[ ${RC[$i]} != 0 ]]; then   # one node failed: do not leave the other waiting
        for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
    fi
done
if [[ ${RC[0]} != 0 || ${RC[1]} != 0 ]]; then
    echo "multinode: the 2x$NPROC job failed (node0 exit ${RC[0]}, node1 exit ${RC[1]}); excerpts:" >&2
    for i in 0 1; do   # without torchrun's own I/W log lines, the first error is near the top
        echo "--- node$i.log (first and last lines; full log in $WORK/node$i.log)" >&2
        grep -v -E '^[IW][0-9]{4} ' "$WORK/node$i.log" | awk 'NR <= 30 { print; next } { tail[NR % 15] = $0 }
            END { if (NR > 30) { print "..."; for (i = NR - 14; i <= NR; i++) if (i > 30) print tail[i % 15] } }' >&2
    done
    exit 1
fi
RUN="$(grep -h '^run directory: ' "$WORK/node0.log" "$WORK/node1.log" | head -n 1 | cut -d' ' -f3-)"
[[ -n "$RUN" && -f "$RUN/metrics.jsonl" ]] || die "rank 0 reported no run directory with metrics.jsonl"
grep -q '^RESUME VERIFIED' "$WORK/node0.log" "$WORK/node1.log" \
    || echo "multinode: note: no 'RESUME VERIFIED' line (no checkpoint in this configuration?)"
echo "multinode: 2 nodes x $NPROC ranks finished; run directory $RUN"
echo "$RUN" > "$WORK/multinode_run_dir"
[[ $VERIFY == 1 ]] || exit 0

# -- the same job on one host, from scratch and resumed from the 2x2 checkpoint ----
FIRST_CKPT="$(ls -d "$RUN"/checkpoints/step_* 2>/dev/null | head -n 1)"
[[ -n "$FIRST_CKPT" ]] || die "--verify needs a checkpoint in $RUN/checkpoints"
cd "$WORK" || exit 1
# The reference runs leave out fault.* drills: they are there to disturb the 2x2 job (a slowed
# rank gives a test time to kill a node) and change no loss (the test's fault.slow_seconds=0.3
# would add 0.3 s to each of the reference runs' 30 steps).
REFERENCE=()
for o in "${OVERRIDES[@]}"; do [[ "$o" == fault.* ]] || REFERENCE+=("$o"); done
"$PYTHON" "$REPO/train.py" dist.world_size=$((2 * NPROC)) "${REFERENCE[@]}" hydra.run.dir="$WORK/single" \
    > "$WORK/single.log" 2>&1 || { tail -n 25 "$WORK/single.log" >&2; die "the single-host run failed"; }
"$PYTHON" "$REPO/train.py" dist.world_size=$((2 * NPROC)) "${REFERENCE[@]}" hydra.run.dir="$WORK/resume" \
    checkpoint.resume="$FIRST_CKPT" checkpoint.verify_resume=false \
    > "$WORK/resume.log" 2>&1 || { tail -n 25 "$WORK/resume.log" >&2; die "resuming $FIRST_CKPT on one host failed"; }
"$PYTHON" - "$RUN/metrics.jsonl" "$WORK/single/metrics.jsonl" "$WORK/resume/metrics.jsonl" <<'EOF'
import json, sys
def losses(path):
    return {r["step"]: r["loss_hex"] for r in map(json.loads, open(path)) if r["type"] == "step"}
multi, single, resumed = (losses(p) for p in sys.argv[1:])
problems = []
if multi != single:
    bad = sorted(s for s in set(multi) | set(single) if multi.get(s) != single.get(s))
    problems.append(f"2x2 vs 4x1 losses differ at steps {bad[:5]}")
if not resumed or any(multi.get(s) != h for s, h in resumed.items()):
    problems.append(f"the single-host resume from the 2x2 checkpoint diverged (steps {sorted(resumed)[:3]}...)")
for p in problems:
    print(f"multinode: MISMATCH: {p}", file=sys.stderr)
if problems:
    sys.exit(1)
print(f"multinode: {len(multi)} steps bitwise equal on 2 nodes x 2 ranks and 1 node x 4 ranks; "
      f"the 2x2 checkpoint resumed on one host reproduces steps {min(resumed)}-{max(resumed)} bitwise")
print("MULTINODE VERIFIED")
EOF
