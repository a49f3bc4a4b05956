#!/usr/bin/env bash
# One process on one GPU.
#
#   launch/single_gpu.sh [--gpu N] [--] --config configs/qwen3_4b_srdd.py --config.model.path=/ckpt/Qwen3-4B
#
# GPU N (default 0, or $GPU) is the only device the process sees; the mesh is (1, 1, 1).
# MORSE_XLA_PRESET=1 sources launch/xla_gpu_flags.sh first (memory fraction, compile cache; the
# collective flags are harmless on one device). MORSE_ENTRY replaces "python -m morse_jax.main".
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
GPU_ID=${GPU:-0}
while [[ $# -gt 0 ]]; do
  case "$1" in
    --gpu) GPU_ID=$2; shift 2 ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[[ "$GPU_ID" =~ ^[0-9]+$ ]] || { echo "single_gpu.sh: --gpu must be a GPU index, got '$GPU_ID'" >&2; exit 2; }
if [[ "${MORSE_XLA_PRESET:-0}" == 1 ]]; then source "$HERE/xla_gpu_flags.sh"; fi
export CUDA_VISIBLE_DEVICES=$GPU_ID
read -r -a entry <<< "${MORSE_ENTRY:-python -m morse_jax.main}"
exec "${entry[@]}" "$@" --config.parallel.mesh="(1, 1, 1)"
