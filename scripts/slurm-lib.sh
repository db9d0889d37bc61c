# Process helpers shared by slurm-up.sh and slurm-down.sh (sourced; the caller defines log()).
# Daemons are found by the pid files the scripts write, never by process name.

# running PID: the process exists and is not a zombie waiting to be reaped.
running() {
    local state
    state=$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' "/proc/$1/status" 2>/dev/null || true)
    [[ -n $state && $state != Z && $state != X ]]
}

# pid_alive PIDFILE COMM: the pid file names a live process whose command name is COMM.
pid_alive() {
    local pidfile=$1 comm=$2 pid
    [[ -s $pidfile ]] || return 1
    pid=$(tr -dc '0-9' <"$pidfile")
    [[ -n $pid ]] || return 1
    running "$pid" || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$comm" ]]
}

# terminate PID COMM SECONDS: SIGTERM, then SIGKILL if it is still running after SECONDS.
terminate() {
    local pid=$1 comm=$2 secs=$3 i
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < secs * 10; i++)); do
        running "$pid" || break
        sleep 0.1
    done
    if running "$pid"; then
        log "$comm (pid $pid) ignored SIGTERM for ${secs} s; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        sleep 0.5
    fi
}
