#!/usr/bin/env bash
# Start llmpipe's throw-away Slurm test cluster on this machine:
#   munged + MariaDB + slurmdbd (sacct) + slurmctld on the host, and NODES slurmd nodes n1..nN, each in its own
#   network namespace (10.214.K.1N on a private bridge) with its own hostname and its own /dev/shm, each declaring
#   GPUS GPUs (stand-ins: no real devices). /tmp and every other folder are shared with this machine.
# Partitions: debug (all nodes, default, MaxTime 24 h) and small (n1 only, MaxTime 5 min).
#
#   tests/slurm_cluster/start.sh            # then: export SLURM_CONF=$LLMPIPE_SLURM_DIR/etc/slurm.conf
#
# Environment:
#   LLMPIPE_SLURM_DIR  state folder (config, logs, spool, database, PID files); default /tmp/llmpipe-slurm
#   NODES=2 CPUS=16 MEM=32000 GPUS=4         nodes, CPUs / memory (MB) / count-only GPUs declared per node
#   FRESH=1            restart even when a healthy cluster with this state folder is running
# Refuses to run while a test session holds $DIR.lock (the pytest fixture sets LLMPIPE_SLURM_LOCK_HELD=1 for itself).
# Idempotent: a healthy running cluster is left alone (prints "already running"); anything else is stopped with
# stop.sh (which kills only what this script started) and started afresh. Needs root, ip netns, nsenter, unshare.
# Stays in its box: bridge, namespaces, veths, subnet and ports are this state folder's own (names.sh), and an
# unreachable route for its subnet (metric ROUTE_METRIC, under the bridge's own route) keeps its Slurm traffic off
# the default route for the cluster's whole life, also when the bridge is gone; stop.sh removes it last.
# Prints the SLURM_CONF line last; $LLMPIPE_SLURM_DIR/env.sh holds it too.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
DIR="${LLMPIPE_SLURM_DIR:-/tmp/llmpipe-slurm}"
NODES="${NODES:-2}"; CPUS="${CPUS:-16}"; MEM="${MEM:-32000}"; GPUS="${GPUS:-4}"
source "$HERE/names.sh"   # BR, NS, VETH, NET, ports of this state folder's cluster
CTL_IP="$NET.1"
export LLMPIPE_SLURM_DIR="$DIR"
C="$DIR/etc/slurm.conf"
t0=$(date +%s%N)
log() { printf '[slurm-cluster start +%5dms] %s\n' $(( ($(date +%s%N) - t0) / 1000000 )) "$*"; }
die() { echo "[slurm-cluster start] ERROR: $*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || die "needs root (munged, slurmd, network namespaces)"
# a test session (the pytest fixture) holds $DIR.lock while it uses the cluster: never restart it from under it
if [[ "${LLMPIPE_SLURM_LOCK_HELD:-0}" != 1 ]] && command -v flock >/dev/null; then
  exec 9>>"$DIR.lock"
  flock -n 9 || die "a test session is using the cluster ($DIR.lock is held); wait for it to end"
  exec 9>&-
fi
for b in munged slurmctld slurmd slurmdbd sbatch sinfo sacct sacctmgr mariadbd mariadb-install-db ip nsenter unshare; do
  command -v "$b" >/dev/null || die "$b not found: run tests/slurm_cluster/install.sh"
done

healthy() {
  [[ -f $C && -f $DIR/run/started ]] || return 1
  local f; for f in munged slurmdbd slurmctld mysqld; do
    [[ -f $DIR/run/$f.pid ]] && kill -0 "$(cat "$DIR/run/$f.pid")" 2>/dev/null || return 1; done
  [[ "$(SLURM_CONF=$C timeout 5 sinfo -h -N -p debug -o '%N %t' 2>/dev/null | grep -cE ' (idle|mix|alloc)')" == "$NODES" ]]
}
if [[ "${FRESH:-0}" != 1 ]] && healthy; then
  log "already running ($DIR)"; echo "export SLURM_CONF=$C"; exit 0
fi

"$HERE/stop.sh" >/dev/null 2>&1 || true
rm -rf "$DIR"
mkdir -p "$DIR"/{etc,log,run,spool/ctld,spool/d,munge,db}
chmod 755 "$DIR" "$DIR/munge"   # the munge socket's folder must be world-readable
echo "$NODES" > "$DIR/run/nodes"

# ------------------------------------------------------------------------------------------------ munge
MSOCK="$DIR/munge/munge.socket"
dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$DIR/munge/munge.key"
munged -S "$MSOCK" --key-file="$DIR/munge/munge.key" --log-file="$DIR/log/munged.log" \
       --pid-file="$DIR/run/munged.pid" --seed-file="$DIR/munge/munged.seed"
log "munged up"

# ------------------------------------------------------------------------------------------------ MariaDB (in the background)
D="$DIR/db"
(
  mariadb-install-db --no-defaults --datadir="$D/data" --user=root --auth-root-authentication-method=normal \
      --skip-test-db > "$DIR/log/mariadb-install.log" 2>&1
  setsid mariadbd --no-defaults --datadir="$D/data" --user=root --bind-address=127.0.0.1 --port=$DB_PORT \
      --socket="$D/mysqld.sock" --pid-file="$DIR/run/mysqld.pid" --log-error="$DIR/log/mysqld.err" \
      --innodb-buffer-pool-size=32M --skip-name-resolve --skip-log-bin </dev/null >/dev/null 2>&1 &
) &
DB_BOOT=$!

# ------------------------------------------------------------------------------------------------ network namespaces
node_ip() { echo "$NET.$((10 + $1))"; }
ip route replace unreachable "$NET.0/24" metric "$ROUTE_METRIC"
ip link add "$BR" type bridge
ip addr add "$CTL_IP/24" dev "$BR"
ip link set "$BR" up
for i in $(seq 1 "$NODES"); do
  ip netns add "$NS$i"
  ip link add "$VETH$i" type veth peer name eth0 netns "$NS$i"
  ip link set "$VETH$i" master "$BR"; ip link set "$VETH$i" up
  ip -n "$NS$i" addr add "$(node_ip "$i")/24" dev eth0
  ip -n "$NS$i" link set eth0 up; ip -n "$NS$i" link set lo up
done
log "namespaces $NS""1..$NS$NODES on bridge $BR ($CTL_IP)"

# hosts file seen only by slurmd and its jobs (bind-mounted in their private mount namespace); /etc/hosts is never edited
{ cat /etc/hosts; echo "# llmpipe slurm test cluster"; echo "$CTL_IP llmpipe-ctl";
  for i in $(seq 1 "$NODES"); do echo "$(node_ip "$i") n$i"; done; } > "$DIR/etc/hosts"

# ------------------------------------------------------------------------------------------------ configuration
node_lines=""
for i in $(seq 1 "$NODES"); do
  node_lines+="NodeName=n$i NodeAddr=$(node_ip "$i") CPUs=$CPUS RealMemory=$MEM Gres=gpu:$GPUS State=UNKNOWN"$'\n'
done
esc() { printf '%s' "$1" | sed -e 's/[\/&|]/\\&/g'; }
sed -e "s|@DIR@|$(esc "$DIR")|g" -e "s|@MUNGE_SOCKET@|$(esc "$MSOCK")|g" -e "s|@CTL_HOST@|$(hostname -s)|g" \
    -e "s|@CTL_IP@|$CTL_IP|g" -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@SLURMD_PORT@|$SLURMD_PORT|g" \
    -e "s|@DBD_PORT@|$DBD_PORT|g" "$HERE/slurm.conf.in" | awk -v nodes="$node_lines" '{ if ($0 == "@NODE_LINES@") printf "%s", nodes; else print }' > "$C"
# Slurm 22.05 drops GPUs that have no File= ("Removing file-less GPU"): each node gets GPUS empty plain files as
# stand-in devices (never opened; task/none binds nothing). Jobs still see CUDA_VISIBLE_DEVICES=0,1,...
mkdir -p "$DIR/dev"; for g in $(seq 0 $((GPUS - 1))); do : > "$DIR/dev/nvidia$g"; done
echo "Name=gpu File=$DIR/dev/nvidia[0-$((GPUS - 1))]" > "$DIR/etc/gres.conf"
cat > "$DIR/etc/slurmdbd.conf" <<EOF
AuthType=auth/munge
AuthInfo=socket=$MSOCK
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
DebugLevel=info
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=slurmpw
StorageLoc=slurm_acct_db
EOF
chmod 600 "$DIR/etc/slurmdbd.conf"
export SLURM_CONF="$C"
printf 'export SLURM_CONF=%s\n' "$C" > "$DIR/env.sh"

# ------------------------------------------------------------------------------------------------ MariaDB user, slurmdbd
wait "$DB_BOOT" || die "mariadb-install-db failed: see $DIR/log/mariadb-install.log"
for _ in $(seq 1 200); do mariadb-admin --no-defaults --socket="$D/mysqld.sock" -uroot ping >/dev/null 2>&1 && break; sleep 0.1; done
mariadb --no-defaults --socket="$D/mysqld.sock" -uroot -e \
  "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurmpw'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" \
  || die "MariaDB did not come up: see $DIR/log/mysqld.err"
log "mariadb up"
slurmdbd   # reads slurmdbd.conf next to $SLURM_CONF
for _ in $(seq 1 200); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.1; done
sacctmgr -i add cluster llmpipe >/dev/null || die "slurmdbd did not come up: see $DIR/log/slurmdbd.log"
log "slurmdbd up"

# ------------------------------------------------------------------------------------------------ slurmctld, slurmd
slurmctld -f "$C"
for i in $(seq 1 "$NODES"); do
  # nsenter, not `ip netns exec`: that remounts /sys, hiding /sys/fs/cgroup, and slurmd 22.05 then dies.
  # Private mount namespace (hosts overlay, own /dev/shm) + UTS namespace (hostname n$i); jobs inherit both.
  # Each node gets its own /dev/shm like a real machine: the streaming dataloader's local leader on every node
  # registers the same shared-memory names, which collide when the nodes share one /dev/shm.
  nsenter "--net=/run/netns/$NS$i" unshare --mount --uts --propagation private sh -c \
    "mount --bind '$DIR/etc/hosts' /etc/hosts && mount -t tmpfs -o mode=1777,size=4g llmpipe-shm-n$i /dev/shm \
     && hostname n$i && exec slurmd -f '$C' -N n$i"
done
up=0
for _ in $(seq 1 300); do
  up=$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null | grep -c ' idle$' || true)
  [[ $up == "$NODES" ]] && break; sleep 0.1
done
[[ $up == "$NODES" ]] || { sinfo -N >&2 || true; die "only $up of $NODES nodes idle: see $DIR/log/slurmctld.log, slurmd-n*.log"; }
touch "$DIR/run/started"
log "ready: $NODES nodes x $GPUS GPUs; partitions debug (default, 24 h), small (n1, 5 min)"
echo "export SLURM_CONF=$C"
