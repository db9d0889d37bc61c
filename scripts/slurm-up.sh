#!/usr/bin/env bash
# Bring up a single-node Slurm cluster with accounting on this machine (Debian/Ubuntu, root).
#
#   munged (as user munge) -> MariaDB on 127.0.0.1 -> slurmdbd -> slurmctld -> slurmd
#
# Idempotent: exits 0 at once when sinfo already reports the node up, and otherwise starts only
# the daemons that are not running. No systemd: every daemon is started by hand and writes a pid
# file (see PIDFILES below); scripts/slurm-down.sh stops them by those pid files.
#
# Exit codes: 0 cluster up; 1 failure (the message and the tail of the relevant log are printed);
# 3 not root; 4 apt-get missing or the packages cannot be installed from apt (no candidates).
# tests/sweeps/conftest.py skips the Slurm tests on 3 and 4 only.
#
# Environment knobs: SLURM_UP_TIMEOUT (seconds to wait for the node to go idle, default 60),
# SLURM_CLUSTER_NAME (default cpbench).
set -euo pipefail

export PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:${PATH:-}"
export LC_ALL=C

CLUSTER="${SLURM_CLUSTER_NAME:-cpbench}"
ACCOUNT="bench"
PARTITION="debug"
UP_TIMEOUT="${SLURM_UP_TIMEOUT:-60}"

CONF_DIR=/etc/slurm
SLURM_CONF="$CONF_DIR/slurm.conf"
DBD_CONF="$CONF_DIR/slurmdbd.conf"
LOG_DIR=/var/log/slurm
RUN_DIR=/run/slurm
MYSQL_RUN=/run/mysqld
MYSQL_SOCK="$MYSQL_RUN/mysqld.sock"
MYSQL_DATA=/var/lib/mysql
MUNGE_RUN=/run/munge
MUNGE_KEY=/etc/munge/munge.key

# Pid files (the same paths are hard-coded in slurm-down.sh).
MUNGED_PID="$MUNGE_RUN/munged.pid"
MARIADB_PID="$MYSQL_RUN/slurm-mariadbd.pid"
SLURMDBD_PID="$RUN_DIR/slurmdbd.pid"
SLURMCTLD_PID="$RUN_DIR/slurmctld.pid"
SLURMD_PID="$RUN_DIR/slurmd.pid"

# Logs.
UP_LOG="$LOG_DIR/slurm-up.log"
APT_LOG="$LOG_DIR/apt-install.log"
# munged insists on a log directory owned by root or munge (the slurm packages give
# /var/log/slurm to user slurm), hence a directory of its own.
MUNGE_LOG_DIR=/var/log/slurm-munge
MUNGED_LOG="$MUNGE_LOG_DIR/munged.log"
MARIADB_LOG="$LOG_DIR/mariadb.log"
SLURMDBD_LOG="$LOG_DIR/slurmdbd.log"
SLURMCTLD_LOG="$LOG_DIR/slurmctld.log"
SLURMD_LOG="$LOG_DIR/slurmd.log"

T0=$(date +%s)

log() {
    local line
    line="slurm-up: $*"
    echo "$line"
    if [[ -d $LOG_DIR && -w $LOG_DIR ]]; then
        echo "$(date '+%F %T') $line" >>"$UP_LOG" 2>/dev/null || true
    fi
}

# die CODE MESSAGE [LOGFILE...]: print the message, the tail of each log, and exit CODE.
die() {
    local code=$1 msg=$2 f
    shift 2
    for f in "$@"; do
        if [[ -f $f ]]; then
            echo "----- last 40 lines of $f -----" >&2
            tail -n 40 "$f" >&2 || true
        else
            echo "----- $f: no such log file -----" >&2
        fi
    done
    echo "slurm-up: FAILED: $msg" >&2
    if [[ -d $LOG_DIR && -w $LOG_DIR ]]; then
        echo "$(date '+%F %T') slurm-up: FAILED: $msg" >>"$UP_LOG" 2>/dev/null || true
    fi
    exit "$code"
}

# node_states: the distinct states sinfo reports for the nodes (empty when sinfo fails).
node_states() {
    command -v sinfo >/dev/null 2>&1 || return 0
    timeout 15 sinfo -h -N -o %T 2>/dev/null | sort -u | tr '\n' ' ' | sed 's/ $//' || true
}

# node_is_up: every node answers and can run jobs (idle, or busy with jobs).
node_is_up() {
    local states s
    states=$(node_states)
    [[ -n $states ]] || return 1
    for s in $states; do
        case $s in
            idle | mixed | allocated | completing) ;;
            *) return 1 ;;
        esac
    done
}

# running, pid_alive, terminate
source "$(dirname "${BASH_SOURCE[0]}")/slurm-lib.sh"

# stop_pidfile PIDFILE COMM: SIGTERM the process of a pid file (if it is COMM), SIGKILL after 30 s.
stop_pidfile() {
    local pidfile=$1 comm=$2 pid
    if pid_alive "$pidfile" "$comm"; then
        pid=$(tr -dc '0-9' <"$pidfile")
        log "stopping $comm (pid $pid)"
        terminate "$pid" "$comm" 30
    fi
    rm -f "$pidfile"
}

# wait_pidfile PIDFILE COMM SECONDS LOG: wait for a daemon to write its pid file.
wait_pidfile() {
    local pidfile=$1 comm=$2 secs=$3 logf=$4 i
    for ((i = 0; i < secs * 10; i++)); do
        pid_alive "$pidfile" "$comm" && return 0
        sleep 0.1
    done
    die 1 "$comm did not start (no live process in $pidfile after ${secs} s)" "$logf"
}

# start_daemon COMM PIDFILE PORT LOG: start a Slurm daemon (it forks and writes PIDFILE) unless
# the pid file already names a live COMM; its output goes to LOG.
start_daemon() {
    local comm=$1 pidfile=$2 port=$3 logf=$4
    if pid_alive "$pidfile" "$comm"; then
        log "$comm already running (pid $(cat "$pidfile"))"
        return 0
    fi
    rm -f "$pidfile"
    check_port "$port" "$comm"
    log "starting $comm"
    "$comm" >>"$logf" 2>&1 || die 1 "$comm failed to start" "$logf"
    wait_pidfile "$pidfile" "$comm" 15 "$logf"
}

# port_in_use PORT: something accepts TCP connections on 127.0.0.1:PORT.
port_in_use() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# check_port PORT WHAT: before starting WHAT, make sure nobody else holds its port.
check_port() {
    if port_in_use "$1"; then
        local who=""
        command -v ss >/dev/null 2>&1 && who=$(ss -Hltnp "sport = :$1" 2>/dev/null | head -n 3 || true)
        die 1 "cannot start $2: port $1 on 127.0.0.1 is already taken by a process that slurm-up.sh did not start${who:+:
$who}"
    fi
}

# write_if_changed PATH MODE: write stdin to PATH when it differs; returns 0 if it changed.
write_if_changed() {
    local path=$1 mode=$2 tmp
    tmp=$(mktemp "$path.XXXXXX")
    cat >"$tmp"
    chmod "$mode" "$tmp"
    if [[ -f $path ]] && cmp -s "$tmp" "$path"; then
        rm -f "$tmp"
        chmod "$mode" "$path"
        return 1
    fi
    mv -f "$tmp" "$path"
    log "wrote $path"
    return 0
}

# ---------------------------------------------------------------------------------------------
# 0. Already up?
# ---------------------------------------------------------------------------------------------
# On our own cluster, "up" also needs every daemon alive: slurmctld keeps reporting a dead
# slurmd's node idle for SlurmdTimeout, and with slurmctld down sinfo spends ~10 s retrying.
ours_down=0
if grep -q '^# Written by scripts/slurm-up.sh' "$SLURM_CONF" 2>/dev/null; then
    for d in "$MUNGED_PID munged" "$MARIADB_PID mariadbd" "$SLURMDBD_PID slurmdbd" \
        "$SLURMCTLD_PID slurmctld" "$SLURMD_PID slurmd"; do
        read -r pidfile comm <<<"$d"
        # A pid file we may not read (not root) says nothing either way: leave it to sinfo.
        [[ -e $pidfile && ! -r $pidfile ]] && continue
        pid_alive "$pidfile" "$comm" || ours_down=1
    done
fi
if ((!ours_down)) && node_is_up; then
    log "already up: node state(s) '$(node_states)' (nothing to do)"
    exit 0
fi

if [[ "$(id -u)" -ne 0 ]]; then
    die 3 "must be run as root to install and start Slurm (running as uid $(id -u)); run 'sudo bash $0'"
fi

mkdir -p "$LOG_DIR" "$RUN_DIR" "$CONF_DIR" /var/spool/slurmctld /var/spool/slurmd
chmod 755 "$LOG_DIR" "$RUN_DIR"
log "starting (cluster '$CLUSTER', log $UP_LOG)"

# ---------------------------------------------------------------------------------------------
# 1. Packages (only when binaries are missing).
# ---------------------------------------------------------------------------------------------
PACKAGES=(slurm-wlm munge slurmdbd mariadb-server)
NEEDED_BINARIES=(sinfo sbatch srun sacct sacctmgr scontrol slurmctld slurmd slurmdbd munged
                 mariadbd mariadb mariadb-admin mariadb-install-db)
missing=()
for b in "${NEEDED_BINARIES[@]}"; do
    command -v "$b" >/dev/null 2>&1 || missing+=("$b")
done

if ((${#missing[@]})); then
    log "missing binaries: ${missing[*]}"
    command -v apt-get >/dev/null 2>&1 ||
        die 4 "apt-get not found: cannot install ${PACKAGES[*]} (this script supports Debian/Ubuntu only)"
    export DEBIAN_FRONTEND=noninteractive
    no_candidate() {
        local p
        for p in "${PACKAGES[@]}"; do
            [[ "$(apt-cache policy "$p" 2>/dev/null)" == *"Candidate: "[0-9]* ]] || return 0
        done
        return 1
    }
    if no_candidate; then
        log "running: apt-get update (package lists do not offer ${PACKAGES[*]})"
        apt-get update >>"$APT_LOG" 2>&1 || log "apt-get update returned non-zero (see $APT_LOG)"
        if no_candidate; then
            die 4 "apt cannot offer all of ${PACKAGES[*]} (no candidate after apt-get update; offline?)" "$APT_LOG"
        fi
    fi
    # Keep package maintainer scripts from starting daemons through invoke-rc.d: this script
    # starts them itself, with pid files. Only add a policy-rc.d when none exists.
    POLICY=/usr/sbin/policy-rc.d
    added_policy=0
    if [[ ! -e $POLICY ]]; then
        printf '#!/bin/sh\n# added by slurm-up.sh during apt-get install\nexit 101\n' >"$POLICY"
        chmod 755 "$POLICY"
        added_policy=1
        trap '[[ $added_policy == 1 ]] && rm -f "$POLICY" || true' EXIT
    fi
    log "running: apt-get install -y --no-install-recommends ${PACKAGES[*]} (output in $APT_LOG)"
    t_apt=$(date +%s)
    if ! apt-get install -y --no-install-recommends "${PACKAGES[@]}" >>"$APT_LOG" 2>&1; then
        die 1 "apt-get install ${PACKAGES[*]} failed" "$APT_LOG"
    fi
    if [[ $added_policy == 1 ]]; then
        rm -f "$POLICY"
        added_policy=0
    fi
    log "installed packages in $(($(date +%s) - t_apt)) s"
    for b in "${NEEDED_BINARIES[@]}"; do
        command -v "$b" >/dev/null 2>&1 || die 1 "'$b' still missing after installing ${PACKAGES[*]}" "$APT_LOG"
    done
fi

getent passwd munge >/dev/null || die 1 "user 'munge' does not exist (is the munge package installed?)"
getent passwd mysql >/dev/null || die 1 "user 'mysql' does not exist (is mariadb-server installed?)"

# ---------------------------------------------------------------------------------------------
# 2. Configuration.
# ---------------------------------------------------------------------------------------------
NODE=$(hostname -s)
[[ -n $NODE ]] || die 1 "hostname -s printed nothing"

# Hardware from `slurmd -C` (first line: NodeName=... CPUs=... RealMemory=...), nproc as fallback.
hw=$(slurmd -C 2>/dev/null | head -n 1 || true)
field() { sed -n "s/.*[[:space:]]$1=\([0-9]*\).*/\1/p" <<<" $hw"; }
CPUS=$(field CPUs)
SOCKETS=$(field SocketsPerBoard)
CORES=$(field CoresPerSocket)
THREADS=$(field ThreadsPerCore)
MEM_MB=$(field RealMemory)
[[ -n $CPUS ]] || CPUS=$(nproc)
[[ -n $MEM_MB ]] || MEM_MB=$(($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024))
# Slurm drains a node whose real memory is below RealMemory: declare 95 %.
REAL_MEM=$((MEM_MB * 95 / 100))
TOPO=""
if [[ -n $SOCKETS && -n $CORES && -n $THREADS ]] && ((SOCKETS * CORES * THREADS == CPUS)); then
    TOPO=" Sockets=$SOCKETS CoresPerSocket=$CORES ThreadsPerCore=$THREADS"
fi

# Never overwrite a configuration that this script did not write (a real cluster's, say).
for f in "$SLURM_CONF" "$DBD_CONF"; do
    if [[ -s $f ]] && ! grep -q '^# Written by scripts/slurm-up.sh' "$f"; then
        die 1 "$f exists and was not written by slurm-up.sh; refusing to overwrite it (move it away to proceed)"
    fi
done

# The database password: kept from an existing slurmdbd.conf, generated otherwise.
DB_USER=slurm
DB_PASS=""
if [[ -f $DBD_CONF ]]; then
    DB_PASS=$(sed -n 's/^StoragePass=//p' "$DBD_CONF" | head -n 1)
fi
if [[ -z $DB_PASS ]]; then
    DB_PASS=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' | head -c 24)
fi

slurm_conf_changed=0
write_if_changed "$SLURM_CONF" 644 <<EOF && slurm_conf_changed=1
# Written by scripts/slurm-up.sh: single-node cluster on $NODE, all daemons on 127.0.0.1.
ClusterName=$CLUSTER
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
SchedulerType=sched/backfill
ReturnToService=2
MailProg=/bin/true
SlurmctldPort=6817
SlurmdPort=6818
SlurmctldPidFile=$SLURMCTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$SLURMCTLD_LOG
SlurmdLogFile=$SLURMD_LOG
SlurmctldDebug=info
SlurmdDebug=info
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
MinJobAge=60
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=6819
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
JobCompType=jobcomp/none
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS$TOPO RealMemory=$REAL_MEM State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF

dbd_conf_changed=0
write_if_changed "$DBD_CONF" 600 <<EOF && dbd_conf_changed=1
# Written by scripts/slurm-up.sh.
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=6819
SlurmUser=root
DebugLevel=info
LogFile=$SLURMDBD_LOG
PidFile=$SLURMDBD_PID
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3306
StorageUser=$DB_USER
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
chown root:root "$DBD_CONF"

# ---------------------------------------------------------------------------------------------
# 3. munge.
# ---------------------------------------------------------------------------------------------
install -d -o munge -g munge -m 700 /etc/munge
install -d -o munge -g munge -m 700 /var/lib/munge
install -d -o munge -g munge -m 755 "$MUNGE_RUN"
install -d -o munge -g munge -m 755 "$MUNGE_LOG_DIR"
if [[ ! -s $MUNGE_KEY ]]; then
    log "creating munge key $MUNGE_KEY"
    if command -v mungekey >/dev/null 2>&1; then
        mungekey --create --keyfile="$MUNGE_KEY" --force
    else
        dd if=/dev/urandom of="$MUNGE_KEY" bs=1024 count=1 status=none
    fi
fi
chown munge:munge "$MUNGE_KEY"
chmod 400 "$MUNGE_KEY"

if pid_alive "$MUNGED_PID" munged; then
    log "munged already running (pid $(cat "$MUNGED_PID"))"
else
    rm -f "$MUNGED_PID"
    touch "$MUNGED_LOG"
    chown munge:munge "$MUNGED_LOG"
    chmod 640 "$MUNGED_LOG"
    log "starting munged as user munge"
    # munged refuses to run as root; it daemonizes and writes its pid file itself.
    if ! runuser -u munge -- munged --pid-file="$MUNGED_PID" --log-file="$MUNGED_LOG" \
        --key-file="$MUNGE_KEY" --socket="$MUNGE_RUN/munge.socket.2" >>"$MUNGED_LOG" 2>&1; then
        die 1 "munged failed to start" "$MUNGED_LOG"
    fi
    wait_pidfile "$MUNGED_PID" munged 10 "$MUNGED_LOG"
fi
if ! munge -n </dev/null | unmunge >/dev/null 2>&1; then
    die 1 "munge round trip (munge -n | unmunge) failed" "$MUNGED_LOG"
fi

# ---------------------------------------------------------------------------------------------
# 4. MariaDB on 127.0.0.1.
# ---------------------------------------------------------------------------------------------
install -d -o mysql -g mysql -m 755 "$MYSQL_RUN"
mysql_ping() { mariadb-admin --no-defaults --socket="$MYSQL_SOCK" -uroot ping >/dev/null 2>&1; }

if pid_alive "$MARIADB_PID" mariadbd; then
    log "mariadbd already running (pid $(cat "$MARIADB_PID"))"
else
    rm -f "$MARIADB_PID"
    touch "$MARIADB_LOG"
    chown mysql:mysql "$MARIADB_LOG"
    if [[ ! -d $MYSQL_DATA/mysql ]]; then
        log "initialising MariaDB data directory $MYSQL_DATA"
        install -d -o mysql -g mysql -m 755 "$MYSQL_DATA"
        mariadb-install-db --user=mysql --datadir="$MYSQL_DATA" --skip-test-db \
            --auth-root-authentication-method=socket >>"$MARIADB_LOG" 2>&1 ||
            die 1 "mariadb-install-db failed" "$MARIADB_LOG"
    fi
    check_port 3306 mariadbd
    log "starting mariadbd on 127.0.0.1:3306"
    # mariadbd stays in the foreground: detach it; it writes its own pid file.
    setsid mariadbd --user=mysql --datadir="$MYSQL_DATA" --bind-address=127.0.0.1 --port=3306 \
        --socket="$MYSQL_SOCK" --pid-file="$MARIADB_PID" --log-error="$MARIADB_LOG" \
        </dev/null >>"$MARIADB_LOG" 2>&1 &
    disown || true
    wait_pidfile "$MARIADB_PID" mariadbd 30 "$MARIADB_LOG"
fi
for ((i = 0; i < 300; i++)); do
    mysql_ping && break
    pid_alive "$MARIADB_PID" mariadbd || die 1 "mariadbd exited during start-up" "$MARIADB_LOG"
    sleep 0.1
done
mysql_ping || die 1 "mariadbd does not answer on $MYSQL_SOCK after 30 s" "$MARIADB_LOG"

# Database and user for slurmdbd (idempotent; also (re)sets the password from slurmdbd.conf).
mariadb --no-defaults --socket="$MYSQL_SOCK" -uroot >>"$MARIADB_LOG" 2>&1 <<EOF ||
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
CREATE USER IF NOT EXISTS '$DB_USER'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
ALTER USER '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
ALTER USER '$DB_USER'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
GRANT ALL PRIVILEGES ON slurm_acct_db.* TO '$DB_USER'@'localhost';
GRANT ALL PRIVILEGES ON slurm_acct_db.* TO '$DB_USER'@'127.0.0.1';
FLUSH PRIVILEGES;
EOF
    die 1 "could not create database slurm_acct_db / user $DB_USER in MariaDB" "$MARIADB_LOG"

# ---------------------------------------------------------------------------------------------
# 5. slurmdbd, then the cluster and account in the accounting database.
# ---------------------------------------------------------------------------------------------
if ((dbd_conf_changed)); then
    stop_pidfile "$SLURMDBD_PID" slurmdbd
fi
start_daemon slurmdbd "$SLURMDBD_PID" 6819 "$SLURMDBD_LOG"
dbd_ok=0
for ((i = 0; i < 60; i++)); do
    if timeout 10 sacctmgr -n -P list cluster format=cluster >/dev/null 2>&1; then
        dbd_ok=1
        break
    fi
    pid_alive "$SLURMDBD_PID" slurmdbd || die 1 "slurmdbd exited during start-up" "$SLURMDBD_LOG"
    sleep 0.5
done
((dbd_ok)) || die 1 "slurmdbd does not answer sacctmgr after 30 s" "$SLURMDBD_LOG"

sacct_has() { # sacct_has ENTITY NAME
    timeout 10 sacctmgr -n -P list "$1" format="$1" 2>/dev/null | grep -x "$2" >/dev/null
}
if ! sacct_has cluster "$CLUSTER"; then
    log "registering cluster '$CLUSTER' in the accounting database"
    timeout 30 sacctmgr -i add cluster "$CLUSTER" >>"$UP_LOG" 2>&1 ||
        die 1 "sacctmgr add cluster $CLUSTER failed" "$UP_LOG" "$SLURMDBD_LOG"
fi
if ! sacct_has account "$ACCOUNT"; then
    log "adding account '$ACCOUNT'"
    timeout 30 sacctmgr -i add account "$ACCOUNT" cluster="$CLUSTER" \
        description="cp-attn-bench" organization="cp-attn-bench" >>"$UP_LOG" 2>&1 ||
        die 1 "sacctmgr add account $ACCOUNT failed" "$UP_LOG" "$SLURMDBD_LOG"
fi
for u in root ${SUDO_USER:-}; do
    if ! timeout 10 sacctmgr -n -P list assoc cluster="$CLUSTER" account="$ACCOUNT" user="$u" \
        format=user 2>/dev/null | grep -x "$u" >/dev/null; then
        log "adding user '$u' to account '$ACCOUNT'"
        timeout 30 sacctmgr -i add user "$u" account="$ACCOUNT" cluster="$CLUSTER" >>"$UP_LOG" 2>&1 ||
            die 1 "sacctmgr add user $u failed" "$UP_LOG" "$SLURMDBD_LOG"
    fi
done

# ---------------------------------------------------------------------------------------------
# 6. slurmctld and slurmd.
# ---------------------------------------------------------------------------------------------
if ((slurm_conf_changed)); then
    stop_pidfile "$SLURMD_PID" slurmd
    stop_pidfile "$SLURMCTLD_PID" slurmctld
fi
start_daemon slurmctld "$SLURMCTLD_PID" 6817 "$SLURMCTLD_LOG"
start_daemon slurmd "$SLURMD_PID" 6818 "$SLURMD_LOG"

# ---------------------------------------------------------------------------------------------
# 7. Wait for the node to go idle.
# ---------------------------------------------------------------------------------------------
resumed=0
deadline=$(($(date +%s) + UP_TIMEOUT))
states=""
while :; do
    node_is_up && break
    states=$(node_states)
    pid_alive "$SLURMCTLD_PID" slurmctld || die 1 "slurmctld exited" "$SLURMCTLD_LOG"
    pid_alive "$SLURMD_PID" slurmd || die 1 "slurmd exited" "$SLURMD_LOG"
    # A node left down/drained by an earlier run (not merely "not responding", which ends in *).
    if ((!resumed)) && [[ $states =~ ^(down|drain|drained|draining)$ ]]; then
        log "node is '$states': asking slurmctld to resume it"
        scontrol update NodeName="$NODE" State=RESUME >>"$UP_LOG" 2>&1 || true
        resumed=1
    fi
    if (($(date +%s) >= deadline)); then
        scontrol show node "$NODE" >>"$UP_LOG" 2>&1 || true
        die 1 "node '$NODE' not idle after ${UP_TIMEOUT} s (sinfo state: '${states:-no answer}'; scontrol show node appended to $UP_LOG)" \
            "$SLURMCTLD_LOG" "$SLURMD_LOG" "$UP_LOG"
    fi
    sleep 0.5
done

log "cluster '$CLUSTER' up in $(($(date +%s) - T0)) s: node $NODE ($CPUS CPUs, ${REAL_MEM} MB) '$(node_states)'," \
    "partition $PARTITION, accounting slurmdbd+MariaDB (127.0.0.1), logs in $LOG_DIR"
