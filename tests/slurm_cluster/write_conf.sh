#!/usr/bin/env bash
# Write the test cluster's Slurm configuration (sourced by start.sh; runnable alone, needs no root and no Slurm):
#   $DIR/etc/slurm.conf from slurm.conf.in, the node lines and the site settings file; $DIR/etc/gres.conf and the
#   stand-in GPU files $DIR/dev/nvidia0.. (none when GPUS=0).
# Needs: DIR HERE NODES CPUS MEM GPUS NET CTL_IP CTLD_PORT SLURMD_PORT DBD_PORT MSOCK; SITE_CONF (optional): a file of
# slurm.conf lines appended last (later lines win in slurm.conf), e.g. AccountingStorageEnforce=associations,qos.
# It is copied to $DIR/etc/site.conf, so that start.sh restarts a running cluster whose site settings differ.
set -euo pipefail
C="$DIR/etc/slurm.conf"
mkdir -p "$DIR/etc" "$DIR/dev"
[[ $GPUS =~ ^[0-9]+$ ]] || { echo "[slurm-cluster start] ERROR: GPUS=$GPUS is not a count (0, 1, 2 ...)" >&2; exit 1; }
node_ip() { echo "$NET.$((10 + $1))"; }
gres=""; ((GPUS > 0)) && gres=" Gres=gpu:$GPUS"   # GPUS=0: no Gres at all (gpu:0 and nvidia[0--1] kill slurmd)
node_lines=""
for i in $(seq 1 "$NODES"); do
  node_lines+="NodeName=n$i NodeAddr=$(node_ip "$i") CPUs=$CPUS RealMemory=$MEM$gres State=UNKNOWN"$'\n'
done
: > "$DIR/etc/site.conf"
if [[ -n "${SITE_CONF:-}" ]]; then
  [[ -r $SITE_CONF ]] || { echo "[slurm-cluster start] ERROR: SITE_CONF=$SITE_CONF is not a readable file" >&2; exit 1; }
  cp "$SITE_CONF" "$DIR/etc/site.conf"
fi
esc() { printf '%s' "$1" | sed -e 's/[\/&|]/\\&/g'; }
{
  sed -e "s|@DIR@|$(esc "$DIR")|g" -e "s|@MUNGE_SOCKET@|$(esc "$MSOCK")|g" -e "s|@CTL_HOST@|$(hostname -s)|g" \
      -e "s|@CTL_IP@|$CTL_IP|g" -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@SLURMD_PORT@|$SLURMD_PORT|g" \
      -e "s|@DBD_PORT@|$DBD_PORT|g" "$HERE/slurm.conf.in" \
    | awk -v nodes="$node_lines" '{ if ($0 == "@NODE_LINES@") printf "%s", nodes; else print }'
  if [[ -s $DIR/etc/site.conf ]]; then echo "# site settings from SITE_CONF=$SITE_CONF"; cat "$DIR/etc/site.conf"; fi
} > "$C"
# Slurm 22.05 drops GPUs that have no File= ("Removing file-less GPU"): each node gets GPUS empty plain files as
# stand-in devices (never opened; task/none binds nothing). Jobs still see CUDA_VISIBLE_DEVICES=0,1,...
if ((GPUS > 0)); then
  for g in $(seq 0 $((GPUS - 1))); do : > "$DIR/dev/nvidia$g"; done
  echo "Name=gpu File=$DIR/dev/nvidia[0-$((GPUS - 1))]" > "$DIR/etc/gres.conf"
else
  : > "$DIR/etc/gres.conf"
fi
