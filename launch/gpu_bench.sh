#!/usr/bin/env bash
# GPU figures (issue 21): the one prepared script for a lent device. No install, no network:
# run it from a copy of the repo on a machine with JAX+CUDA, flax, optax, orbax (torch and
# transformers for the peer; without them that column is skipped with a message).
#
#   launch/gpu_bench.sh [bench/gpu.py args, e.g. --models qwen3-4b]
#
# 1. Sources launch/xla_gpu_flags.sh (the job's XLA flags, XLA_PYTHON_CLIENT_MEM_FRACTION=0.92,
#    compile cache) and checks that JAX starts with those flags; flags this XLA does not know
#    (an unknown flag aborts XLA at start-up) are named, dropped and the check repeated.
# 2. Runs bench/gpu.py with a total budget of $BENCH_BUDGET seconds (default 450; each phase
#    may overrun its share by up to 90 s, so the whole stays under 10 minutes), under a hard
#    timeout of $BENCH_TIMEOUT (default 570 s).
# Writes gpu_bench.json, gpu_bench.log and env.txt to $OUT (default runs/gpu_bench).
set -uo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(dirname "$HERE")
cd "$ROOT" || exit 2
OUT_DIR=${OUT:-runs/gpu_bench}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MORSE_XLA_PRESET_VERBOSE=0
# shellcheck source=launch/xla_gpu_flags.sh
source "$HERE/xla_gpu_flags.sh"

{
  date -u +"%Y-%m-%d %H:%M:%S UTC"
  nvidia-smi -L 2>/dev/null || echo "nvidia-smi: not available"
  "$PY" -c 'import sys; print("python", sys.version.split()[0])'
  for m in jax jaxlib flax optax orbax.checkpoint torch transformers; do
    "$PY" -c "import importlib, sys; m = importlib.import_module('$m'); print('$m', getattr(m, '__version__', '?'))" \
      2>/dev/null || echo "$m: not importable"
  done
  echo "XLA_FLAGS (preset)=$XLA_FLAGS"
  echo "XLA_PYTHON_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION"
} > "$OUT_DIR/env.txt" 2>&1

check_log="$OUT_DIR/xla_flags_check.txt"
for attempt in 1 2 3 4; do
  if "$PY" -c 'import jax; d = jax.devices(); print(jax.default_backend(), d)' > "$check_log" 2>&1; then
    break
  fi
  unknown=$(grep -o "Unknown flags\? in XLA_FLAGS: .*" "$check_log" | sed 's/.*XLA_FLAGS: //')
  if [[ $attempt == 4 || -z "$unknown" ]]; then
    echo "gpu_bench.sh: JAX does not start:" >&2
    cat "$check_log" >&2
    exit 1
  fi
  echo "gpu_bench.sh: this XLA does not know: $unknown; dropping them" | tee -a "$OUT_DIR/env.txt" >&2
  for f in $unknown; do XLA_FLAGS=${XLA_FLAGS//"$f"/}; done
  export XLA_FLAGS
done
echo "JAX started: $(tail -n 1 "$check_log")" | tee -a "$OUT_DIR/env.txt"
echo "XLA_FLAGS (used)=$XLA_FLAGS" >> "$OUT_DIR/env.txt"

timeout --signal=TERM "${BENCH_TIMEOUT:-570}" "$PY" bench/gpu.py --budget "${BENCH_BUDGET:-450}" \
  --out "$OUT_DIR/gpu_bench.json" "$@" 2>&1 | tee "$OUT_DIR/gpu_bench.log"
rc=${PIPESTATUS[0]}
echo "gpu_bench.sh: bench/gpu.py exit $rc; results in $OUT_DIR" >&2
exit "$rc"
