#!/usr/bin/env bash
# Stop the Slurm test cluster that start.sh started, killing only what it can attribute to that cluster:
#   - the daemons in $LLMPIPE_SLURM_DIR/run/*.pid (each checked against /proc/PID/cmdline first),
#   - processes inside its network namespaces (llmpK-n*) or sharing the private mount namespace of one of its
#     slurmd (leftover slurmstepd and job tasks).
# Then deletes its namespaces, veth pairs and bridge (names.sh: those of this state folder only) and, last, the
# unreachable route of its subnet. Keeps $LLMPIPE_SLURM_DIR (logs) unless WIPE=1.
# Safe to run when nothing is running.
# Leaves the cluster alone (exit 0, a message on stderr) while a test session holds its lock ($LLMPIPE_SLURM_DIR.lock,
# taken by the pytest fixture): a cleanup (.ci/slurm.sh cleanup, make test's EXIT trap) must not pull the cluster from
# under another session's tests. The fixture, which holds that lock, sets LLMPIPE_SLURM_LOCK_HELD=1; FORCE=1 stops
# it regardless.
set -uo pipefail
DIR="${LLMPIPE_SLURM_DIR:-/tmp/llmpipe-slurm}"
if [[ "${LLMPIPE_SLURM_LOCK_HELD:-0}" != 1 && "${FORCE:-0}" != 1 ]] && command -v flock >/dev/null; then
  exec 9>>"$DIR.lock"
  if ! flock -n 9; then
    echo "[slurm-cluster stop] not stopping: a test session holds $DIR.lock (FORCE=1 stops it anyway)" >&2
    exit 0
  fi
fi
source "$(cd "$(dirname "$0")" && pwd)/names.sh"   # this state folder's BR, NS, VETH, NET: never another cluster's
R="$DIR/run"
export SLURM_CONF="$DIR/etc/slurm.conf"

cmd_has() { [[ -n "${1:-}" && -r /proc/$1/cmdline ]] && tr '\0' ' ' < "/proc/$1/cmdline" | grep -q -- "$2"; }
alive() { local st; st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) && [[ $st != Z ]]; }  # zombies count as dead
termpids() {  # SIGTERM the given PIDs, wait up to 10 s, SIGKILL survivors
  local p left; (($#)) || return 0; kill "$@" 2>/dev/null
  for _ in $(seq 1 100); do left=0; for p in "$@"; do alive "$p" && left=1; done; ((left)) || return 0; sleep 0.1; done
  kill -9 "$@" 2>/dev/null; return 0
}
from_pidfile() {  # pidfile daemon-name -> PID if that process really is the daemon
  local p; p="$(cat "$1" 2>/dev/null)" && cmd_has "$p" "$2" && echo "$p"; rm -f "$1"; return 0
}

if [[ -d $R ]]; then
  rm -f "$R/started"
  # 1. cancel jobs while the controller is up (best effort, quick)
  cmd_has "$(cat "$R/slurmctld.pid" 2>/dev/null)" slurmctld && { timeout 5 scancel --full --user=root >/dev/null 2>&1 || true; }
  # 2. mount namespaces of our slurmd: their slurmstepd and job tasks share them
  mntns=()
  for f in "$R"/slurmd-*.pid; do [[ -e $f ]] || continue; p=$(cat "$f")
    cmd_has "$p" slurmd && mntns+=("$(readlink "/proc/$p/ns/mnt")"); done
  # 3. daemons: nodes, then controller and dbd, then database and munge
  nodes=(); for f in "$R"/slurmd-*.pid; do [[ -e $f ]] && nodes+=($(from_pidfile "$f" slurmd)); done
  termpids "${nodes[@]}"
  termpids $(from_pidfile "$R/slurmctld.pid" slurmctld) $(from_pidfile "$R/slurmdbd.pid" slurmdbd)
  termpids $(from_pidfile "$R/mysqld.pid" mariadbd) $(from_pidfile "$R/munged.pid" munged)
  # 4. leftovers in our private mount namespaces
  if ((${#mntns[@]})); then
    for d in /proc/[0-9]*; do ns=$(readlink "$d/ns/mnt" 2>/dev/null) || continue
      for m in "${mntns[@]}"; do [[ $ns == "$m" ]] && alive "${d#/proc/}" && kill -9 "${d#/proc/}" 2>/dev/null; done; done
  fi
fi
# 5. our network namespaces (and anything still inside them), veths, bridge
for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$NS[0-9]+$"); do
  for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
  ip netns del "$ns" 2>/dev/null
done
for l in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | cut -d@ -f1 | grep -E "^$VETH[0-9]+$"); do
  ip link del "$l" 2>/dev/null; done
ip link show "$BR" >/dev/null 2>&1 && ip link del "$BR"
ip route del unreachable "$NET.0/24" metric "$ROUTE_METRIC" 2>/dev/null
[[ "${WIPE:-0}" == 1 ]] && rm -rf "$DIR"
echo "[slurm-cluster stop] stopped ($DIR)"
