#!/usr/bin/env bash
# tools/slurm_cluster.sh: a practice SLURM cluster of two nodes on this one machine, for CI and workshops.
#
#   sudo tools/slurm_cluster.sh up       install slurm-wlm and munge if missing, start the cluster, wait until
#                                        both nodes are idle
#   sudo tools/slurm_cluster.sh down     stop what `up` started and remove every file and line it wrote
#        tools/slurm_cluster.sh status   one line per node
#
# The cluster: slurmctld and two slurmd (`slurmd -N node1`, `slurmd -N node2`) on 127.0.0.1, each on its own
# port, with a private munged (its own key and socket) for authentication. Its configuration goes where every
# SLURM command looks by default, /etc/slurm/slurm.conf, so that sbatch, srun and squeue work in any shell or
# Jupyter kernel without SLURM_CONF; that file carries MARK as its first line. Everything else lives in STATE.
# Exit codes: 1 the cluster did not come up (logs shown); 2 cannot here (not root, no apt-get); 3 refused rather
# than touch a real set-up: an /etc/slurm/slurm.conf it did not write, slurmctld or slurmd running that it did
# not start, SLURM_CONF pointing elsewhere, or node1/node2 naming other machines. `down` removes only what carries
# its mark.
# DDP_SLURM_TIMEOUT (seconds, default 300) bounds every wait; it only turns a failure into a clear error.
set -euo pipefail

MARK="# written by ddp-notebooks tools/slurm_cluster.sh; 'tools/slurm_cluster.sh down' removes it"
HOSTS_MARK="# ddp-notebooks tools/slurm_cluster.sh"
STATE=/var/lib/ddp-notebooks-slurm
CONF=/etc/slurm/slurm.conf
NODES=(node1 node2)
PARTITION=practice
CLUSTER=ddp-notebooks
TIMEOUT=${DDP_SLURM_TIMEOUT:-300}
ME="slurm_cluster.sh"

say() { echo "$ME: $*"; }
die() { local code=$1; shift; echo "$ME: $*" >&2; exit "$code"; }

# --- what is ours -------------------------------------------------------------------------------------------
conf_is_ours() { [ -f "$CONF" ] && [ "$(head -n 1 "$CONF")" = "$MARK" ]; }

pid_of() {  # the live pid recorded in the pid file $1 if its command is $2, or nothing
  local pid comm=""
  [ -f "$1" ] || return 0
  pid=$(tr -dc '0-9' < "$1")
  [ -n "$pid" ] && read -r comm 2> /dev/null < "/proc/$pid/comm"
  [ "$comm" = "$2" ] && alive "$pid" && echo "$pid"
  return 0
}

our_pids() {  # name:pid of each of our daemons alive
  local p
  p=$(pid_of "$STATE/munge-socket/munged.pid" munged); [ -n "$p" ] && echo "munged:$p"
  p=$(pid_of "$STATE/run/slurmctld.pid" slurmctld); [ -n "$p" ] && echo "slurmctld:$p"
  for n in "${NODES[@]}"; do p=$(pid_of "$STATE/run/slurmd-$n.pid" slurmd); [ -n "$p" ] && echo "slurmd-$n:$p"; done
  return 0
}

alive() {  # is process $1 alive (and not a zombie waiting to be reaped)?
  local stat=""
  read -r stat 2> /dev/null < "/proc/$1/stat" || return 1
  stat=${stat##*) }
  [ "${stat%% *}" != Z ]
}

procs_named() {  # pids of live processes whose command name is $1
  local d comm
  for d in /proc/[0-9]*; do
    comm=""
    read -r comm 2> /dev/null < "$d/comm" || true
    [ "$comm" = "$1" ] && alive "${d#/proc/}" && echo "${d#/proc/}"
  done
  return 0
}

# What of the practice cluster still runs once its daemons are stopped: our marked daemons, our nodes' slurmstepd
# (slurmd starts them with a clean environment, but their working folder and log are in STATE), the processes of
# its jobs (they carry SLURM_CLUSTER_NAME=$CLUSTER), and every descendant of these; never this script or its callers.
leftovers() {
  local pid fd d stat f todo=()
  local -A kids=() seen=(["$BASHPID"]=1)
  read -r -a todo <<< "$(grep -lsxzF -e "DDP_NOTEBOOKS_SLURM=$STATE" -e "SLURM_CLUSTER_NAME=$CLUSTER" \
    /proc/[0-9]*/environ | cut -d/ -f3 | tr '\n' ' ' || true)"
  for pid in $(procs_named slurmstepd); do
    for fd in "/proc/$pid/cwd" "/proc/$pid"/fd/*; do
      [[ "$(readlink "$fd" 2> /dev/null)" == "$STATE"/* ]] && { todo+=("$pid"); break; }
    done
  done
  for d in /proc/[0-9]*; do  # children of each process, to follow trees down
    read -r stat 2> /dev/null < "$d/stat" || continue
    read -r -a f <<< "${stat##*) }"
    kids[${f[1]}]+=" ${d#/proc/}"
  done
  pid=$$  # this script and its ancestors may carry SLURM_CLUSTER_NAME (run inside a job): never ours to kill
  while [ -n "$pid" ] && [ "$pid" != 0 ]; do
    seen[$pid]=1
    read -r stat 2> /dev/null < "/proc/$pid/stat" || break
    read -r -a f <<< "${stat##*) }"
    pid=${f[1]}
  done
  while [ ${#todo[@]} -gt 0 ]; do
    pid=${todo[0]}; todo=("${todo[@]:1}")
    [ -n "${seen[$pid]:-}" ] && continue
    seen[$pid]=1
    alive "$pid" && echo "$pid"
    read -r -a f <<< "${kids[$pid]:-}"
    todo+=("${f[@]}")
  done
}

# --- refusals -----------------------------------------------------------------------------------------------
need_root() { [ "$(id -u)" = 0 ] || die 2 "$1 needs root: run 'sudo tools/slurm_cluster.sh $1'"; }

refuse_foreign() {
  local theirs="" pid
  if [ -n "${SLURM_CONF:-}" ] && [ "$SLURM_CONF" != "$CONF" ]; then
    die 3 "SLURM_CONF=$SLURM_CONF: this machine uses its own SLURM; practise on it, or unset SLURM_CONF if it is stale"
  fi
  for f in "$CONF" /etc/slurm-llnl/slurm.conf; do
    if [ -e "$f" ] && ! { [ "$f" = "$CONF" ] && conf_is_ours; }; then
      die 3 "$f exists and was not written by this script: this machine has its own SLURM; practise on it instead"
    fi
  done
  local ours
  ours=" $(our_pids | cut -d: -f2 | tr '\n' ' ') "
  for pid in $(procs_named slurmctld) $(procs_named slurmd); do
    [[ "$ours" == *" $pid "* ]] || theirs="$theirs $pid"
  done
  [ -z "$theirs" ] || die 3 "slurmctld/slurmd already running (pid$theirs), not started by this script: this machine" \
    "has its own SLURM; stop it first, or practise on it"
  for n in "${NODES[@]}"; do
    local addr
    addr=$(getent ahostsv4 "$n" 2> /dev/null | awk 'NR == 1 {print $1}' || true)
    [ -z "$addr" ] || [[ "$addr" == 127.* ]] || die 3 "$n resolves to $addr here (another machine): the practice" \
      "nodes need that name; remove it from /etc/hosts or DNS first"
  done
}

# --- up -----------------------------------------------------------------------------------------------------
install_packages() {
  local missing=""
  for b in munged mungekey slurmctld slurmd sinfo sbatch srun scontrol; do
    command -v "$b" > /dev/null || missing=1
  done
  [ -z "$missing" ] && return 0
  command -v apt-get > /dev/null || die 2 "slurm-wlm and munge are not installed and there is no apt-get: install" \
    "them with this machine's package manager, then rerun"
  say "installing slurm-wlm and munge (apt-get)"
  local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge)
  local log
  log=$(mktemp)
  if ! "${apt[@]}" > "$log" 2>&1; then  # the package lists may be missing or stale: update them, once
    if ! { apt-get update -qq && "${apt[@]}"; } >> "$log" 2>&1; then
      tail -n 20 "$log" >&2
      rm -f "$log"
      die 2 "apt-get could not install slurm-wlm and munge (log above)"
    fi
  fi
  rm -f "$log"
}

free_ports() {  # $1 free TCP ports on 127.0.0.1, as the kernel hands them out
  python3 - "$1" << 'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

write_files() {
  local cpus ports
  cpus=$(( $(nproc) / 2 )); [ "$cpus" -ge 1 ] || cpus=1  # the two nodes share this machine's cores
  if command -v python3 > /dev/null; then read -r -a ports <<< "$(free_ports 3)"; else ports=(6817 6818 6819); fi
  mkdir -p "$STATE"/{ctld,log,run,munge,munge-socket} "${NODES[@]/#/$STATE/spool/}" /etc/slurm
  chown munge:munge "$STATE/munge" "$STATE/munge-socket"
  chmod 0700 "$STATE/munge"  # the key
  chmod 0755 "$STATE/munge-socket"  # every user's sbatch and srun talk to munged here
  if [ ! -s "$STATE/munge/munge.key" ]; then
    mungekey --create --keyfile="$STATE/munge/munge.key" 2> /dev/null \
      || dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
    chown munge:munge "$STATE/munge/munge.key"
    chmod 0400 "$STATE/munge/munge.key"
  fi
  local tmp="$CONF.ddp-notebooks.tmp"
  {
    echo "$MARK"
    echo "# A practice cluster of two nodes on this machine; its state, logs and munge key are in $STATE."
    echo "ClusterName=$CLUSTER"
    echo "SlurmctldHost=$(hostname -s)(127.0.0.1)"
    echo "SlurmctldPort=${ports[0]}"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    echo "AuthInfo=socket=$STATE/munge-socket/munge.socket"
    echo "StateSaveLocation=$STATE/ctld"
    echo "SlurmdSpoolDir=$STATE/spool/%n"
    echo "SlurmctldPidFile=$STATE/run/slurmctld.pid"
    echo "SlurmdPidFile=$STATE/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$STATE/log/slurmctld.log"
    echo "SlurmdLogFile=$STATE/log/slurmd-%n.log"
    echo "# No cgroups (they often fail in containers): processes are tracked by parentage, tasks are not bound."
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    echo "JobCompType=jobcomp/none"
    echo "MpiDefault=none"
    echo "MailProg=/bin/true"
    echo "SchedulerType=sched/backfill"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "ReturnToService=2"
    echo "# Both nodes are this machine: they report the CPUs written here, not the machine's."
    echo "SlurmdParameters=config_overrides"
    echo "NodeName=${NODES[0]} NodeAddr=127.0.0.1 Port=${ports[1]} CPUs=$cpus State=UNKNOWN"
    echo "NodeName=${NODES[1]} NodeAddr=127.0.0.1 Port=${ports[2]} CPUs=$cpus State=UNKNOWN"
    echo "PartitionName=$PARTITION Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP"
  } > "$tmp"
  chmod 0644 "$tmp"
  mv -f "$tmp" "$CONF"
  local add=()
  for n in "${NODES[@]}"; do getent ahostsv4 "$n" > /dev/null 2>&1 || add+=("$n"); done
  # Appended in place (never replaced): in a container /etc/hosts is often a bind mount.
  [ ${#add[@]} -eq 0 ] || echo "127.0.0.1 ${add[*]} $HOSTS_MARK" >> /etc/hosts
}

log_tails() {
  local f
  for f in "$STATE"/munge/munged.log "$STATE"/log/*.log; do
    [ -s "$f" ] || continue
    echo "--- last lines of $f" >&2
    tail -n 8 "$f" >&2
  done
}

start_daemons() {
  local marker="DDP_NOTEBOOKS_SLURM=$STATE"
  runuser -u munge -- env "$marker" munged --socket="$STATE/munge-socket/munge.socket" \
    --key-file="$STATE/munge/munge.key" --pid-file="$STATE/munge-socket/munged.pid" \
    --log-file="$STATE/munge/munged.log" --seed-file="$STATE/munge/munged.seed" \
    || { log_tails; die 1 "munged did not start (log above)"; }
  env "$marker" slurmctld -c || { log_tails; die 1 "slurmctld did not start (log above)"; }
  for n in "${NODES[@]}"; do
    env "$marker" slurmd -N "$n" || { log_tails; die 1 "slurmd -N $n did not start (log above)"; }
  done
}

node_states() {  # "node state" lines, as sinfo reports them (state "idle*": not responding)
  sinfo -h -N -p "$PARTITION" -o '%N %t' 2> /dev/null | sort -u
}

wait_ready() {  # wait until sinfo shows both nodes in state $1 (an extended regex), at most TIMEOUT seconds
  local deadline=$((SECONDS + TIMEOUT)) states problem=""
  while :; do
    states=$(node_states || true)
    [ "$(grep -cE "^(${NODES[0]}|${NODES[1]}) ($1)\$" <<< "$states")" = 2 ] && return 0
    if [ "$(our_pids | wc -l)" -lt 4 ]; then
      problem="a daemon of the practice cluster exited"
    elif [ "$SECONDS" -ge "$deadline" ]; then
      problem="the nodes were not ready after ${TIMEOUT}s (sinfo: $(echo "$states" | tr '\n' ' '))"
    fi
    if [ -n "$problem" ]; then
      log_tails
      [ "$2" = fresh ] && stop_daemons
      die 1 "$problem; logs above; 'sudo tools/slurm_cluster.sh down' stops it and removes its files"
    fi
    sleep 0.2
  done
}

up() {
  need_root up
  refuse_foreign
  install_packages
  if conf_is_ours && [ "$(our_pids | wc -l)" -eq 4 ]; then
    say "already up"
    wait_ready 'idle|mix|alloc|comp' running  # it may be running jobs: responding is enough
  else
    stop_daemons  # what is left of an earlier up (a daemon that died, a reboot)
    write_files
    start_daemons
    wait_ready idle fresh
  fi
  status
}

# --- down ---------------------------------------------------------------------------------------------------
wait_gone() {  # wait until none of the pids $@ is alive, at most $TIMEOUT s; 1 if some still are
  local deadline=$((SECONDS + TIMEOUT)) pid alive
  while :; do
    alive=""
    for pid in "$@"; do alive "$pid" && alive=1; done
    [ -z "$alive" ] && return 0
    [ "$SECONDS" -ge "$deadline" ] && return 1
    sleep 0.2
  done
}

cancel_jobs() {  # cancel every job on our cluster and wait until the queue is empty (at most TIMEOUT)
  [ -n "$(pid_of "$STATE/run/slurmctld.pid" slurmctld)" ] && conf_is_ours || return 0
  local jobs deadline=$((SECONDS + TIMEOUT))
  jobs=$(squeue -h -o %i 2> /dev/null || true)
  [ -n "$jobs" ] || return 0
  say "cancelling job(s) $(echo "$jobs" | tr '\n' ' ')"
  # shellcheck disable=SC2086
  scancel $jobs 2> /dev/null || true
  while [ -n "$(squeue -h -o %i 2> /dev/null || true)" ]; do
    [ "$SECONDS" -lt "$deadline" ] && { sleep 0.2; continue; }
    say "jobs still queued after ${TIMEOUT}s: their processes are killed"
    return 0
  done
}

stop_daemons() {  # SIGTERM our daemons, slurmd first (SIGKILL what outlives the wait), then SIGKILL what is left
  local pids
  for name in slurmd slurmctld munged; do
    pids=$(our_pids | grep "^$name" | cut -d: -f2 || true)
    [ -n "$pids" ] || continue
    # shellcheck disable=SC2086
    kill -TERM $pids 2> /dev/null || true
    # shellcheck disable=SC2086
    wait_gone $pids && continue
    say "$name (pid ${pids//$'\n'/ }) outlived SIGTERM: killing it"
    # shellcheck disable=SC2086
    kill -KILL $pids 2> /dev/null || true
  done
  # Jobs that outlived their cancel, or whose daemons died: nothing is left to end them cleanly.
  pids=$(leftovers | tr '\n' ' ')
  [ -n "${pids// /}" ] || return 0
  say "killing what is left of the practice cluster's jobs: $pids"
  # shellcheck disable=SC2086
  kill -KILL $pids 2> /dev/null || true
  # shellcheck disable=SC2086
  wait_gone $pids || say "still alive after ${TIMEOUT}s: $pids"
}

down() {
  need_root down
  cancel_jobs
  stop_daemons
  if conf_is_ours; then
    rm -f "$CONF"
  elif [ -e "$CONF" ]; then
    say "left $CONF alone: this script did not write it"
  fi
  rm -f "$CONF.ddp-notebooks.tmp"
  if grep -qF "$HOSTS_MARK" /etc/hosts; then  # every other line stays as it was, byte for byte
    local kept
    kept=$(mktemp)
    grep -vF "$HOSTS_MARK" /etc/hosts > "$kept" || true
    cat "$kept" > /etc/hosts  # rewritten in place: a bind-mounted /etc/hosts cannot be replaced
    rm -f "$kept"
  fi
  rm -rf "$STATE"
  say "down: the practice cluster is stopped and its files are removed (slurm-wlm and munge stay installed)"
}

# --- status -------------------------------------------------------------------------------------------------
status() {
  if [ ! -e "$CONF" ]; then
    say "no practice cluster is up: 'sudo tools/slurm_cluster.sh up'"
    return 1
  elif ! conf_is_ours; then
    say "no practice cluster here: $CONF was not written by this script (this machine has its own SLURM)"
    return 1
  fi
  local lines
  lines=$(sinfo -h -N -p "$PARTITION" -o '%N %t %c' 2> /dev/null | sort -u || true)
  if [ -z "$lines" ]; then
    say "the practice cluster does not answer (slurmctld down?): 'sudo tools/slurm_cluster.sh up'"
    return 1
  fi
  awk -v p="$PARTITION" '{printf "%s: %s (%s CPU, partition %s)\n", $1, $2, $3, p}' <<< "$lines"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
