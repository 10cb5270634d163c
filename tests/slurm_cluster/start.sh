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
#   SITE_CONF=FILE     slurm.conf lines appended last, at every start (a restart rewrites slurm.conf), e.g.
#                      AccountingStorageEnforce=associations,qos; a running cluster whose site lines differ restarts
# Refuses to run while a test session holds $DIR.lock (the pytest fixture sets LLMPIPE_SLURM_LOCK_HELD=1 for itself).
# Idempotent: a healthy running cluster is left alone (prints "already running"); anything else is stopped with
# stop.sh (which kills only what this script started) and started afresh. Needs root, ip netns, nsenter, unshare.
# Stays in its box: bridge, namespaces, veths, subnet and ports are this state folder's own (names.sh), and an
# unreachable route for its subnet (metric ROUTE_METRIC, under the bridge's own route) keeps its Slurm traffic off
# the default route for the cluster's whole life, also when the bridge is gone; stop.sh removes it last.
# Prints the SLURM_CONF line last; $LLMPIPE_SLURM_DIR/env.sh holds it too.
# Any failure prints what failed (command, line, exit status) and stops what this start had started (stop.sh).
set -eEuo pipefail
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
  cmp -s "${SITE_CONF:-/dev/null}" "$DIR/etc/site.conf" || return 1   # other site settings: start afresh
  local f; for f in munged slurmdbd slurmctld mysqld; do
    [[ -f $DIR/run/$f.pid ]] && kill -0 "$(cat "$DIR/run/$f.pid")" 2>/dev/null || return 1; done
  [[ "$(SLURM_CONF=$C timeout 5 sinfo -h -N -p debug -o '%N %t' 2>/dev/null | grep -cE ' (idle|mix|alloc)')" == "$NODES" ]]
}
if [[ "${FRESH:-0}" != 1 ]] && healthy; then
  log "already running ($DIR)"; echo "export SLURM_CONF=$C"; exit 0
fi

"$HERE/stop.sh" >/dev/null 2>&1 || true
# from here on a failure stops what this start had started, and says what failed (set -e alone exits silently)
failed() {
  local rc=$? line=$1 cmd=$2
  trap - ERR EXIT
  echo "[slurm-cluster start] ERROR: line $line of start.sh: \`$cmd\` failed (exit $rc); stopping what this start" \
       "started (logs: $DIR/log)" >&2
  LLMPIPE_SLURM_LOCK_HELD=1 "$HERE/stop.sh" >&2 || true
  exit "$rc"
}
stop_on_exit() {
  local rc=$?
  trap - ERR EXIT
  ((rc == 0)) && return 0
  echo "[slurm-cluster start] stopping what this start started (logs: $DIR/log)" >&2
  LLMPIPE_SLURM_LOCK_HELD=1 "$HERE/stop.sh" >&2 || true
  exit "$rc"
}
trap 'failed $LINENO "$BASH_COMMAND"' ERR
trap stop_on_exit EXIT
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
  trap - ERR   # a failure here is reported by `wait "$DB_BOOT"` below, in the main shell
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
source "$HERE/write_conf.sh"   # slurm.conf (+ SITE_CONF's lines), gres.conf, stand-in GPU files
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
trap - ERR EXIT
log "ready: $NODES nodes x $GPUS GPUs; partitions debug (default, 24 h), small (n1, 5 min)"
echo "export SLURM_CONF=$C"
