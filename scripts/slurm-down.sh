#!/usr/bin/env bash
# Stop the single-node Slurm cluster started by scripts/slurm-up.sh: slurmd, slurmctld, slurmdbd,
# MariaDB, munged, in that order, each by the pid file it wrote (never by process name). A pid
# file whose process is gone, or is some other program, is just removed. Idempotent.
# Jobs still running are killed with slurmd; the configuration, the munge key, the accounting
# database and the packages stay, so the next slurm-up.sh is fast.
set -euo pipefail
export PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:${PATH:-}"

# Same paths as in slurm-up.sh.
STOP_ORDER=(
    "/run/slurm/slurmd.pid slurmd"
    "/run/slurm/slurmctld.pid slurmctld"
    "/run/slurm/slurmdbd.pid slurmdbd"
    "/run/mysqld/slurm-mariadbd.pid mariadbd"
    "/run/munge/munged.pid munged"
)
STOP_TIMEOUT="${SLURM_DOWN_TIMEOUT:-30}"

log() { echo "slurm-down: $*"; }

# running, pid_alive, terminate
source "$(dirname "${BASH_SOURCE[0]}")/slurm-lib.sh"

if [[ "$(id -u)" -ne 0 ]]; then
    echo "slurm-down: FAILED: must be run as root (running as uid $(id -u))" >&2
    exit 3
fi

failed=0
for entry in "${STOP_ORDER[@]}"; do
    read -r pidfile comm <<<"$entry"
    if [[ ! -e $pidfile ]]; then
        log "$comm: not running (no $pidfile)"
        continue
    fi
    pid=$(tr -dc '0-9' <"$pidfile" || true)
    if ! pid_alive "$pidfile" "$comm"; then
        log "$comm: not running (stale $pidfile${pid:+, pid $pid}); removing it"
        rm -f "$pidfile"
        continue
    fi
    log "$comm: sending SIGTERM to pid $pid"
    terminate "$pid" "$comm" "$STOP_TIMEOUT"
    if running "$pid" && [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$comm" ]]; then
        echo "slurm-down: FAILED: $comm (pid $pid) survived SIGKILL" >&2
        failed=1
        continue
    fi
    rm -f "$pidfile"
    log "$comm: stopped"
done
exit "$failed"
