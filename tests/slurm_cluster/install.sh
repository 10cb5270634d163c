#!/usr/bin/env bash
# Install the Debian packages the Slurm test cluster needs (Debian 12 / Ubuntu; needs root and apt).
# Does nothing when they are all installed already. Exit status 0 when the packages are there afterwards.
#   tests/slurm_cluster/install.sh
set -euo pipefail
PKGS=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
if dpkg -s "${PKGS[@]}" >/dev/null 2>&1; then
  echo "slurm test cluster packages: already installed"
  exit 0
fi
if [[ $(id -u) != 0 ]]; then
  echo "slurm test cluster packages missing and not root: cannot install ${PKGS[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq || { sleep 5; apt-get update -qq; }
# --no-install-recommends keeps it small; policy-rc.d stops Debian's maintainer scripts from starting the
# system-wide daemons (there is no systemd here, and the harness runs its own instances).
created_policy=0
if [[ ! -e /usr/sbin/policy-rc.d ]]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod 755 /usr/sbin/policy-rc.d; created_policy=1
fi
trap 'if [[ $created_policy == 1 ]]; then rm -f /usr/sbin/policy-rc.d; fi' EXIT
apt-get install -y -qq --no-install-recommends "${PKGS[@]}" >/dev/null
echo "slurm test cluster packages: installed $(dpkg-query -W -f='${Version}' slurmctld) ($(date +%T))"
