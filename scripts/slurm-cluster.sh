#!/usr/bin/env bash
# A real multi-node Slurm cluster on this one host, for tests, CI and contributors.
#
#   scripts/slurm-cluster.sh start [--no-accounting]   install if needed, start, wait for idle nodes
#   scripts/slurm-cluster.sh stop                      stop every daemon (packages stay installed)
#   scripts/slurm-cluster.sh status                    daemons, nodes, accounting mode
#   scripts/slurm-cluster.sh restart [--no-accounting]
#
# Four nodes n[1-4] (8 CPUs, 8000 MB, 2 count-only GPUs each) run as four
# `slurmd -N nX` daemons on 127.0.0.1; partition `lab`; cluster `lab`.
# Debian 12 (Slurm 22.05), run as root, no systemd: every daemon is started
# directly. See docs/slurm-cluster.md.
set -euo pipefail

NODES=(n1 n2 n3 n4)
NODE_RANGE="n[1-4]"
CLUSTER=lab
PARTITION=lab

CONF_DIR=/etc/slurm
STATE_DIR=/var/lib/prl-slurm
LOG_DIR=/var/log/prl-slurm
RUN_DIR=/run/prl-slurm
MODE_FILE=$STATE_DIR/accounting-mode
FAKE_GPU_DIR=$STATE_DIR/dev

DB_NAME=slurm_acct_db
DB_USER=slurm
DB_PASS=prl-slurm-test # a loopback-only test database, not a secret
MYSQL_RUN=/run/mysqld
MYSQL_PID=$MYSQL_RUN/mysqld.pid
MYSQL_SOCK=$MYSQL_RUN/mysqld.sock

START_TIMEOUT=${PRL_SLURM_START_TIMEOUT:-60}

log() { printf '[slurm-cluster] %s\n' "$*" >&2; }
die() {
  log "ERROR: $*"
  exit 1
}

# Print the last lines of a log file, to explain a failure.
tail_log() {
  local f=$1
  if [[ -f $f ]]; then
    log "--- last lines of $f ---"
    tail -n 20 "$f" >&2 || true
  fi
}

need_root() {
  [[ $(id -u) -eq 0 ]] || die "run as root (it installs packages and starts system daemons)"
}

# ---------------------------------------------------------------- packages

install_packages() {
  local accounting=$1
  local pkgs=(slurmctld slurmd slurm-client munge)
  if [[ $accounting == yes ]]; then
    pkgs+=(slurmdbd mariadb-server)
  fi
  local missing=()
  local p
  for p in "${pkgs[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
      missing+=("$p")
    fi
  done
  [[ ${#missing[@]} -eq 0 ]] && return 0
  log "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Refresh the package lists only when the install fails: a stale list is the
  # usual cause, and `apt-get update` costs more than the install itself.
  if ! apt-get install -y -q --no-install-recommends "${missing[@]}" >"$LOG_DIR/apt.log" 2>&1; then
    log "apt-get install failed; running apt-get update and retrying"
    apt-get update -q >>"$LOG_DIR/apt.log" 2>&1 || true
    apt-get install -y -q --no-install-recommends "${missing[@]}" >>"$LOG_DIR/apt.log" 2>&1 ||
      {
        tail_log "$LOG_DIR/apt.log"
        die "apt-get install ${missing[*]} failed"
      }
  fi
}

# ---------------------------------------------------------------- config

write_if_changed() {
  # write_if_changed PATH MODE < content; returns 0 if the file changed.
  local path=$1 mode=$2 tmp
  tmp=$(mktemp)
  cat >"$tmp"
  if [[ -f $path ]] && cmp -s "$tmp" "$path"; then
    rm -f "$tmp"
    return 1
  fi
  install -m "$mode" "$tmp" "$path"
  rm -f "$tmp"
  return 0
}

# Writes slurm.conf, gres.conf, cgroup.conf (and slurmdbd.conf with
# accounting). Sets CONF_CHANGED=yes when any of them changed.
write_configs() {
  local accounting=$1 host storage
  host=$(hostname)
  CONF_CHANGED=no
  mkdir -p "$CONF_DIR"
  if [[ $accounting == yes ]]; then
    storage="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStorageTRES=gres/gpu"
  else
    storage="AccountingStorageType=accounting_storage/none"
  fi

  if write_if_changed "$CONF_DIR/slurm.conf" 644 <<EOF; then CONF_CHANGED=yes; fi
# Written by prl scripts/slurm-cluster.sh; edits are overwritten on start.
ClusterName=$CLUSTER
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire also holds a requeued job back before it may start again
# (default 120 s): measured here, a requeued job runs again 12 s after
# `scontrol requeue` at 10 and 24-32 s at 20; 10 s is still ample for a step
# launch on one host (the credential is checked when slurmd gets the launch).
AuthInfo=cred_expire=10
CryptoType=crypto/munge
MpiDefault=none
SwitchType=switch/none
MailProg=/bin/true

StateSaveLocation=$STATE_DIR/slurmctld
SlurmctldPidFile=$RUN_DIR/slurmctld.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
# Several slurmd daemons share this host: %n (the node name) keeps their
# spool, pid and log files apart.
SlurmdSpoolDir=$STATE_DIR/slurmd/%n
SlurmdPidFile=$RUN_DIR/slurmd-%n.pid
SlurmdLogFile=$LOG_DIR/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# The nodes declare more CPUs, memory and GPUs than this host has: trust the
# config, not the hardware, so real cluster shapes can be scheduled here.
SlurmdParameters=config_overrides

# No cgroups in this container: track processes by parent pid, bind nothing.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
$storage

# Only the backfill scheduler starts heterogeneous jobs. Its default
# bf_interval=30 would leave a hetjob pending for up to 30 s; 1 s starts
# them in about a second.
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# Without a default, a job that gives no --mem takes a whole node's memory.
DefMemPerCPU=1000
GresTypes=gpu

# Short timeouts: tests cancel, requeue and kill nodes and should not wait.
KillWait=5
MinJobAge=300
JobRequeue=1
ReturnToService=2
InactiveLimit=0
SlurmctldTimeout=10
SlurmdTimeout=20
MessageTimeout=20
Waittime=0

NodeName=$NODE_RANGE NodeHostname=$host NodeAddr=127.0.0.1 Port=[17001-17004] CPUs=8 RealMemory=8000 Gres=gpu:2 State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE_RANGE Default=YES MaxTime=INFINITE State=UP
EOF

  # GPUs without GPUs: --gres=gpu:N and --gpus-per-node=N are scheduled like on
  # a real GPU cluster and jobs get CUDA_VISIBLE_DEVICES=0,1, but no device is
  # bound. Slurm 22.05's gres/gpu plugin drops any GPU without File= ("Removing
  # file-less GPU", the node then registers 0 GPUs and goes INVAL), so File=
  # names placeholder nodes (copies of /dev/null, made by make_fake_gpus).
  if write_if_changed "$CONF_DIR/gres.conf" 644 <<EOF; then CONF_CHANGED=yes; fi
# Written by prl scripts/slurm-cluster.sh.
AutoDetect=off
NodeName=$NODE_RANGE Name=gpu File=$FAKE_GPU_DIR/fakegpu[0-1]
EOF

  if write_if_changed "$CONF_DIR/cgroup.conf" 644 <<EOF; then CONF_CHANGED=yes; fi
# Written by prl scripts/slurm-cluster.sh. Unused (proctrack/linuxproc and
# task/none); present so no daemon goes looking for a default.
CgroupAutomount=no
EOF

  if [[ $accounting == yes ]]; then
    # slurmdbd refuses a config readable by others (it holds the DB password).
    if write_if_changed "$CONF_DIR/slurmdbd.conf" 600 <<EOF; then CONF_CHANGED=yes; fi
# Written by prl scripts/slurm-cluster.sh.
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
PidFile=$RUN_DIR/slurmdbd.pid
LogFile=$LOG_DIR/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StoragePort=3306
StorageLoc=$DB_NAME
StorageUser=$DB_USER
StoragePass=$DB_PASS
EOF
  fi
}

# Placeholder GPU device files named in gres.conf (all nodes share them:
# each slurmd allocates its own two independently).
make_fake_gpus() {
  mkdir -p "$FAKE_GPU_DIR"
  local i
  for i in 0 1; do
    [[ -e $FAKE_GPU_DIR/fakegpu$i ]] || mknod -m 666 "$FAKE_GPU_DIR/fakegpu$i" c 1 3
  done
}

# ---------------------------------------------------------------- processes

# A process that exists and is not a zombie (our daemons are reparented to
# pid 1, which may reap them late; kill -0 succeeds on a zombie).
proc_running() {
  local state
  state=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) || return 1
  [[ -n $state && $state != Z ]]
}

pid_alive() {
  local pidfile=$1 pid
  [[ -f $pidfile ]] || return 1
  pid=$(cat "$pidfile" 2>/dev/null || true)
  [[ $pid =~ ^[0-9]+$ ]] && proc_running "$pid"
}

# stop_pidfile NAME PIDFILE: SIGTERM, wait up to 10 s, then SIGKILL.
stop_pidfile() {
  local name=$1 pidfile=$2 pid i
  pid_alive "$pidfile" || {
    rm -f "$pidfile"
    return 0
  }
  pid=$(cat "$pidfile")
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    proc_running "$pid" || break
    sleep 0.1
  done
  if proc_running "$pid"; then
    log "$name (pid $pid) ignored SIGTERM; killing"
    kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

# Live processes with this exact name (zombies excluded: pid 1 here does not
# reap orphans, so every daemon that ever exited lingers as a zombie).
live_pids() {
  local pid
  for pid in $(pgrep -x "$1" || true); do
    if proc_running "$pid"; then echo "$pid"; fi
  done
}

# Fallback for daemons whose pid file was lost: exact process name only.
stop_by_name() {
  local name=$1 pids
  pids=$(live_pids "$name")
  [[ -n $pids ]] || return 0
  log "stopping stray $name: ${pids//$'\n'/ }"
  # shellcheck disable=SC2086 # one pid per word
  kill -TERM $pids 2>/dev/null || true
  sleep 1
  pids=$(live_pids "$name")
  # shellcheck disable=SC2086
  [[ -z $pids ]] || kill -KILL $pids 2>/dev/null || true
}

wait_for() {
  # wait_for SECONDS DESCRIPTION COMMAND...: poll every 0.2 s.
  local secs=$1 what=$2 deadline
  shift 2
  deadline=$((SECONDS + secs))
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || return 1
    sleep 0.2
  done
  log "$what: ok"
}

munge_works() { munge -n | unmunge >/dev/null; }

start_munge() {
  if munge_works 2>/dev/null; then return 0; fi
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    install -d -o munge -g munge -m 0700 /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
  fi
  # A stale socket/pid from an unclean stop makes munged refuse to start.
  if [[ -z $(live_pids munged) ]]; then
    rm -f /run/munge/munge.socket.2 /run/munge/munged.pid
  fi
  runuser -u munge -- /usr/sbin/munged
  wait_for 10 munged munge_works || {
    tail_log /var/log/munge/munged.log
    die "munged did not start"
  }
}

mysql_up() { mariadb-admin --socket="$MYSQL_SOCK" ping; }

start_mariadb() {
  if mysql_up >/dev/null 2>&1; then return 0; fi
  install -d -o mysql -g mysql -m 0755 "$MYSQL_RUN"
  if [[ ! -d /var/lib/mysql/mysql ]]; then
    log "initialising the MariaDB data directory"
    mariadb-install-db --user=mysql --datadir=/var/lib/mysql >"$LOG_DIR/mariadb-install.log" 2>&1 ||
      {
        tail_log "$LOG_DIR/mariadb-install.log"
        die "mariadb-install-db failed"
      }
  fi
  # Small buffers: this is a 2-core test host shared with other work. setsid: its own
  # session, so it outlives the shell (and process group) that started the cluster,
  # as the self-daemonizing Slurm daemons do.
  setsid mariadbd --user=mysql --pid-file="$MYSQL_PID" --socket="$MYSQL_SOCK" \
    --bind-address=127.0.0.1 --innodb-buffer-pool-size=64M \
    --log-error="$LOG_DIR/mariadb.log" </dev/null >>"$LOG_DIR/mariadb.log" 2>&1 &
  wait_for 30 mariadb mysql_up || {
    tail_log "$LOG_DIR/mariadb.log"
    die "mariadbd did not start"
  }
  # Idempotent: IF NOT EXISTS everywhere; root logs in over the socket.
  mariadb --socket="$MYSQL_SOCK" <<EOF
CREATE DATABASE IF NOT EXISTS $DB_NAME;
CREATE USER IF NOT EXISTS '$DB_USER'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON $DB_NAME.* TO '$DB_USER'@'localhost';
FLUSH PRIVILEGES;
EOF
}

dbd_up() { sacctmgr -n -P show cluster format=cluster; }

start_slurmdbd() {
  if pid_alive "$RUN_DIR/slurmdbd.pid" && [[ ${CONF_CHANGED:-no} == no ]]; then return 0; fi
  stop_pidfile slurmdbd "$RUN_DIR/slurmdbd.pid"
  slurmdbd || {
    tail_log "$LOG_DIR/slurmdbd.log"
    die "slurmdbd failed to start"
  }
  wait_for 30 slurmdbd dbd_up || {
    tail_log "$LOG_DIR/slurmdbd.log"
    die "slurmdbd does not answer sacctmgr"
  }
}

# Cluster, account `lab` and user root: the shapes real clusters have.
setup_accounting() {
  if ! sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER"; then
    sacctmgr -i add cluster "$CLUSTER" >/dev/null
  fi
  if ! sacctmgr -n -P show account format=account | grep -qx "$PARTITION"; then
    sacctmgr -i add account "$PARTITION" cluster="$CLUSTER" \
      description="prl test account" organization=prl >/dev/null
  fi
  if ! sacctmgr -n -P show assoc where user=root account="$PARTITION" format=user | grep -qx root; then
    sacctmgr -i add user root account="$PARTITION" cluster="$CLUSTER" >/dev/null
    sacctmgr -i modify user root set defaultaccount="$PARTITION" >/dev/null || true
  fi
}

slurm_daemons_alive() {
  pid_alive "$RUN_DIR/slurmctld.pid" || return 1
  local n
  for n in "${NODES[@]}"; do
    pid_alive "$RUN_DIR/slurmd-$n.pid" || return 1
  done
}

stop_slurm_daemons() {
  local n
  if [[ -z $(live_pids slurmd) && -z $(live_pids slurmctld) ]]; then return 0; fi
  log "stopping Slurm daemons"
  for n in "${NODES[@]}"; do
    stop_pidfile "slurmd -N $n" "$RUN_DIR/slurmd-$n.pid"
  done
  stop_by_name slurmd
  stop_pidfile slurmctld "$RUN_DIR/slurmctld.pid"
  stop_by_name slurmctld
}

# Every node answers and is usable (idle, or running jobs recovered from state).
nodes_ready() {
  local out
  out=$(sinfo -h -N -p "$PARTITION" -o '%N %T' 2>/dev/null) || return 1
  [[ $(grep -cE ' (idle|mixed|allocated|completing)$' <<<"$out") -eq ${#NODES[@]} ]]
}

start_slurm_daemons() {
  if ! pid_alive "$RUN_DIR/slurmctld.pid"; then
    slurmctld || {
      tail_log "$LOG_DIR/slurmctld.log"
      die "slurmctld failed to start"
    }
  fi
  wait_for 20 slurmctld scontrol ping || {
    tail_log "$LOG_DIR/slurmctld.log"
    die "slurmctld does not answer scontrol ping"
  }
  local n
  for n in "${NODES[@]}"; do
    if ! pid_alive "$RUN_DIR/slurmd-$n.pid"; then
      mkdir -p "$STATE_DIR/slurmd/$n"
      slurmd -N "$n" || {
        tail_log "$LOG_DIR/slurmd-$n.log"
        die "slurmd -N $n failed to start"
      }
    fi
  done
  local t0=$SECONDS resumed=no
  until nodes_ready; do
    if ((SECONDS - t0 >= START_TIMEOUT)); then
      log "nodes not ready after ${START_TIMEOUT}s:"
      sinfo -N -l >&2 || true
      tail_log "$LOG_DIR/slurmctld.log"
      tail_log "$LOG_DIR/slurmd-n1.log"
      die "cluster did not become ready (logs in $LOG_DIR)"
    fi
    # A node drained by an earlier run (bad config, unclean stop) stays so
    # until resumed; ReturnToService=2 covers only unresponsive nodes.
    if [[ $resumed == no ]] && ((SECONDS - t0 >= 2)) &&
      sinfo -h -N -o '%T' | grep -qE '^(down|drain|drained|draining|inval)$'; then
      log "resuming down/drained nodes"
      scontrol update nodename="$NODE_RANGE" state=resume 2>/dev/null || true
      resumed=yes
    fi
    sleep 0.2
  done
  log "nodes: ok"
}

# ---------------------------------------------------------------- commands

cmd_start() {
  local accounting=yes
  while [[ $# -gt 0 ]]; do
    case $1 in
    --no-accounting) accounting=no ;;
    *) die "unknown option for start: $1" ;;
    esac
    shift
  done
  need_root
  local t0=$SECONDS
  mkdir -p "$STATE_DIR/slurmctld" "$STATE_DIR/slurmd" "$LOG_DIR" "$RUN_DIR"
  install_packages "$accounting"
  write_configs "$accounting"
  make_fake_gpus
  echo "$accounting" >"$MODE_FILE"

  if [[ $CONF_CHANGED == yes ]]; then
    # Every daemon must read the new files; a slurmd left on the old config
    # registers with the wrong resources.
    stop_slurm_daemons
  fi
  start_munge
  if [[ $accounting == yes ]]; then
    start_mariadb
    start_slurmdbd
    setup_accounting
  fi
  start_slurm_daemons
  log "cluster '$CLUSTER' up (accounting: $accounting) in $((SECONDS - t0))s"
  sinfo
}

cmd_stop() {
  need_root
  stop_slurm_daemons
  stop_pidfile slurmdbd "$RUN_DIR/slurmdbd.pid"
  stop_by_name slurmdbd
  if command -v mariadb-admin >/dev/null && mysql_up >/dev/null 2>&1; then
    mariadb-admin --socket="$MYSQL_SOCK" shutdown || stop_pidfile mariadbd "$MYSQL_PID"
  fi
  stop_pidfile mariadbd "$MYSQL_PID"
  stop_pidfile munged /run/munge/munged.pid
  stop_by_name munged
  log "stopped"
}

cmd_status() {
  local rc=0 n
  show() {
    if pid_alive "$2"; then
      printf '  %-12s running (pid %s)\n' "$1" "$(cat "$2")"
    else
      printf '  %-12s stopped\n' "$1"
      rc=1
    fi
  }
  echo "accounting: $(cat "$MODE_FILE" 2>/dev/null || echo unknown)"
  echo "daemons:"
  show munged /run/munge/munged.pid
  if [[ $(cat "$MODE_FILE" 2>/dev/null) == yes ]]; then
    show mariadbd "$MYSQL_PID"
    show slurmdbd "$RUN_DIR/slurmdbd.pid"
  fi
  show slurmctld "$RUN_DIR/slurmctld.pid"
  for n in "${NODES[@]}"; do
    show "slurmd $n" "$RUN_DIR/slurmd-$n.pid"
  done
  echo "nodes:"
  if command -v sinfo >/dev/null; then
    sinfo -N -o '  %N %T %c %m %G' 2>&1 || rc=1
  else
    echo "  (slurm-client not installed)"
    rc=1
  fi
  return $rc
}

main() {
  local cmd=${1:-}
  [[ $# -gt 0 ]] && shift
  case $cmd in
  start) cmd_start "$@" ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  restart)
    cmd_stop
    cmd_start "$@"
    ;;
  *)
    sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
  esac
}

main "$@"
