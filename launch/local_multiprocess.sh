#!/usr/bin/env bash
# P processes of one multi-controller JAX run on this machine, each with CPU devices.
#
#   launch/local_multiprocess.sh [-n PROCESSES] [-d CPU_DEVICES_PER_PROCESS] [-p PORT] [-l LOG_DIR] [--] [ARGS...]
#
# Each process runs  $MORSE_ENTRY ARGS... --config.parallel.coordinator=localhost:PORT
#   --config.parallel.num_processes=P --config.parallel.process_id=I
# with JAX_PLATFORMS=cpu and XLA_FLAGS forcing D host devices, so the global mesh has P*D devices.
# MORSE_ENTRY defaults to "python -m morse_jax.main" (e.g. ARGS: --config configs/quickstart.py).
# This is how multi-controller code is tested without accelerators; the same program runs
# unchanged under launch/slurm_multihost.sbatch.
#
# Logs: LOG_DIR/process_I.log (default: a fresh temporary directory); process 0's log is also
# streamed to stdout. Exit status: 0 if every process exits 0; otherwise the first failure's
# status, after stopping the processes still running (a peer stuck in a collective never ends).
set -euo pipefail

NPROC=${NUM_PROCESSES:-2}
NDEV=${CPU_DEVICES_PER_PROCESS:-1}
PORT=${COORDINATOR_PORT:-}
LOG_DIR=${LOG_DIR:-}
ENTRY=${MORSE_ENTRY:-python -m morse_jax.main}

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    -n) NPROC=$2; shift 2 ;;
    -d) NDEV=$2; shift 2 ;;
    -p) PORT=$2; shift 2 ;;
    -l) LOG_DIR=$2; shift 2 ;;
    -h|--help) usage 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || { echo "local_multiprocess.sh: -n must be a positive integer, got '$NPROC'" >&2; exit 2; }
[[ "$NDEV" =~ ^[1-9][0-9]*$ ]] || { echo "local_multiprocess.sh: -d must be a positive integer, got '$NDEV'" >&2; exit 2; }
if [[ -z "$PORT" ]]; then  # a free port, chosen by the OS
  PORT=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
LOG_DIR=${LOG_DIR:-$(mktemp -d -t morse_multiprocess.XXXXXX)}
mkdir -p "$LOG_DIR"

# Keep any user XLA flags, but make the host device count ours.
XLA_BASE=$(echo "${XLA_FLAGS:-}" | sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g')

pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
}
trap 'cleanup; exit 130' INT TERM

read -r -a entry <<< "$ENTRY"
for ((i = 0; i < NPROC; i++)); do
  JAX_PLATFORMS=cpu XLA_FLAGS="$XLA_BASE --xla_force_host_platform_device_count=$NDEV" \
    "${entry[@]}" "$@" \
    --config.parallel.coordinator="localhost:$PORT" \
    --config.parallel.num_processes="$NPROC" \
    --config.parallel.process_id="$i" \
    > "$LOG_DIR/process_$i.log" 2>&1 &
  pids+=($!)
done
echo "local_multiprocess.sh: $NPROC processes x $NDEV CPU devices, coordinator localhost:$PORT, logs in $LOG_DIR" >&2
tail -n +1 -f "$LOG_DIR/process_0.log" --pid "${pids[0]}" 2>/dev/null &
tailer=$!

status=0
remaining=$NPROC
declare -A done_pid=()
while (( remaining > 0 )); do
  for i in "${!pids[@]}"; do
    pid=${pids[$i]}
    [[ -n "${done_pid[$pid]:-}" ]] && continue
    if ! kill -0 "$pid" 2>/dev/null; then
      rc=0; wait "$pid" || rc=$?
      done_pid[$pid]=1
      remaining=$((remaining - 1))
      if (( rc != 0 )); then
        echo "local_multiprocess.sh: process $i exited with status $rc (log: $LOG_DIR/process_$i.log)" >&2
        if (( status == 0 )); then status=$rc; cleanup; fi
      fi
    fi
  done
  (( remaining > 0 )) && sleep 0.2
done
wait "$tailer" 2>/dev/null || true
exit "$status"
