#!/usr/bin/env bash
# Stop the daemons started by start.sh, by the PIDs in their pidfiles (checking the
# process name first), and remove its namespace nodes' network. `--purge` also deletes state,
# logs, MariaDB data and the munge key.
set -uo pipefail
ROOT=${SLURM_TEST_ROOT:-${TMPDIR:-/tmp}/eaglelab-slurm}
export SLURM_CONF=$ROOT/slurm.conf
stop_group() { # pidfile:comm ...   (SIGTERM all, wait up to 20 s, then SIGKILL)
  local spec pf name p i t0 pids=() names=()
  t0=$(date +%s%N)
  for spec in "$@"; do
    pf=${spec%%:*} name=${spec##*:}
    [ -s "$pf" ] || continue
    p=$(cat "$pf")
    if [ -d "/proc/$p" ] && [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$name" ]; then
      kill -TERM "$p" && pids+=("$p") && names+=("$name($p)")
    fi
    rm -f "$pf"
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  for ((i = 0; i < 100; i++)); do
    alive=0; for p in "${pids[@]}"; do [ -d "/proc/$p" ] && alive=1; done
    [ $alive = 0 ] && break; sleep 0.2
  done
  for p in "${pids[@]}"; do
    if [ -d "/proc/$p" ]; then echo "pid $p ignored SIGTERM, sending SIGKILL"; kill -KILL "$p"; fi
  done
  echo "stopped ${names[*]} in $(( ($(date +%s%N) - t0) / 1000000 )) ms"
}
# cancel jobs first so their slurmstepd / user processes go away
if [ -f "$SLURM_CONF" ] && scontrol ping 2>/dev/null | grep -q UP; then
  ids=$(squeue -h -o %A 2>/dev/null)
  if [ -n "$ids" ]; then
    scancel $ids
    for ((i = 0; i < 75; i++)); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
  fi
fi
slurmds=(); for pf in "$ROOT"/run/slurmd-*.pid; do [ -e "$pf" ] && slurmds+=("$pf:slurmd"); done
stop_group "${slurmds[@]}" "$ROOT/run/slurmctld.pid:slurmctld" "$ROOT/run/slurmdbd.pid:slurmdbd"
# start.sh's NODES: their network namespaces (and veths) and the bridge
if command -v ip >/dev/null; then
  for ns in $(ip netns list 2>/dev/null | awk '$1 ~ /^eaglelab-n[0-9]+$/ {print $1}'); do ip netns del "$ns"; done
  ip link show eaglelab-br0 >/dev/null 2>&1 && ip link del eaglelab-br0
fi
stop_group "$ROOT/mysql/mariadbd.pid:mariadbd" "$ROOT/munge/run/munged.pid:munged"
if [ "${1:-}" = --purge ]; then
  rm -rf "$ROOT/state" "$ROOT/run" "$ROOT/log" "$ROOT/mysql" "$ROOT/munge" "$ROOT/slurmdbd.conf"
  echo "purged runtime state under $ROOT"
fi
exit 0
