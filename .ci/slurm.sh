#!/usr/bin/env bash
# CI helper for the real-Slurm tests (tests/test_slurm_*.py, fixture tests/slurm_cluster/fixture.py).
#   .ci/slurm.sh install   # (default) install slurmctld slurmd slurm-client munge slurmdbd mariadb-server if missing,
#                          # and check that this machine can run the test cluster (root, ip netns)
#   .ci/slurm.sh cleanup   # stop a test cluster left behind (e.g. a killed pytest); kills only what start.sh started
# Then run pytest with LLMPIPE_REQUIRE_SLURM=1 so the Slurm tests fail instead of skipping when the cluster
# cannot start. The pytest fixture starts the cluster itself and always stops it.
# Exit status: 0 when ready (or cleaned up), 1 otherwise. Safe to run twice.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
case "${1:-install}" in
  install)
    t0=$(date +%s)
    "$REPO/tests/slurm_cluster/install.sh"
    [[ $(id -u) == 0 ]] || { echo "slurm CI: needs root" >&2; exit 1; }
    ip netns list >/dev/null || { echo "slurm CI: 'ip netns' does not work here" >&2; exit 1; }
    echo "slurm CI: ready in $(( $(date +%s) - t0 )) s (run pytest with LLMPIPE_REQUIRE_SLURM=1)"
    ;;
  cleanup)
    "$REPO/tests/slurm_cluster/stop.sh"
    ;;
  *)
    echo "usage: $0 [install|cleanup]" >&2; exit 2
    ;;
esac
