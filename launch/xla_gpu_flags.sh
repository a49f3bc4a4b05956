# Opt-in XLA / JAX settings for NVIDIA GPUs. Source it before starting python:
#
#   source launch/xla_gpu_flags.sh && python -m morse_jax.main --config ...
#   MORSE_XLA_PRESET=1 launch/single_gpu.sh ...        (the launch scripts source it for you)
#
# Every XLA flag below exists in the XLA that jaxlib 0.10.2 ships (tests/test_parallel.py starts
# jax with them: an unknown flag aborts XLA at start-up). They change scheduling and buffering,
# never the numbers; measure before and after on your own model (bench/sampler.py, a train step).
# Set MORSE_XLA_PRESET_VERBOSE=1 to print what was set.

# Collectives: overlap communication with compute (FSDP all-gathers, gradient all-reduces) ...
_morse_xla=(
  --xla_gpu_enable_latency_hiding_scheduler=true
  --xla_gpu_enable_highest_priority_async_stream=true
  # ... pipeline the per-layer collectives of scanned layers one iteration ahead ...
  --xla_gpu_enable_pipelined_all_gather=true
  --xla_gpu_enable_pipelined_reduce_scatter=true
  --xla_gpu_enable_pipelined_all_reduce=true
  # ... and batch small ones (LoRA/router gradients are many small tensors) into 128 MiB groups.
  --xla_gpu_all_reduce_combine_threshold_bytes=134217728
  --xla_gpu_all_gather_combine_threshold_bytes=134217728
  --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728
  # The sampler's decode is a lax.while_loop: double-buffering lets step i+1's weight
  # all-gathers start during step i.
  --xla_gpu_enable_while_loop_double_buffering=true
)
export XLA_FLAGS="${XLA_FLAGS:-} ${_morse_xla[*]}"
unset _morse_xla

# Memory: JAX preallocates 75 % of each GPU by default; the memory plan (printed at start-up,
# morse_jax.parallel.memory_plan) assumes the run may use nearly all of it.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.92}"
# Compiled programs persist across runs and restarts (every host compiles the same programs).
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-${HOME}/.cache/morse_jax/xla}"

if [[ "${MORSE_XLA_PRESET_VERBOSE:-0}" == 1 ]]; then
  echo "XLA_FLAGS=$XLA_FLAGS" >&2
  echo "XLA_PYTHON_CLIENT_MEM_FRACTION=$XLA_PYTHON_CLIENT_MEM_FRACTION JAX_COMPILATION_CACHE_DIR=$JAX_COMPILATION_CACHE_DIR" >&2
fi
