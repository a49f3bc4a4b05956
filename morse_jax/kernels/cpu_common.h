// Helpers shared by the CPU kernels: portable SIMD vectors and a parallel loop on XLA's pool.
#ifndef MORSE_JAX_KERNELS_CPU_COMMON_H_
#define MORSE_JAX_KERNELS_CPU_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace morse {

// GCC/Clang vector extensions: -march=native lowers them to AVX-512, AVX2 or NEON.
typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));

template <typename V>
inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V>
inline V load_partial(const float* p, int64_t n) {  // n < lanes; the rest zero
  V v = {};
  std::memcpy(&v, p, n * sizeof(float));
  return v;
}

template <typename V>
inline void store_partial(float* p, V v, int64_t n) {
  std::memcpy(p, &v, n * sizeof(float));
}

inline float hsum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

inline float hmax(v16 v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
}

// exp(x) for x <= 0 (softmax after subtracting the max): 2^n * p(r), r = x - n ln 2 in
// [-ln2/2, ln2/2], degree-6 polynomial, relative error ~2e-7; inputs below -87 give 0.
inline v16 exp_nonpositive(v16 x) {
  const v16 lo = v16{} - 87.0f;
  x = x < lo ? lo : x;  // per-lane select
  // round to nearest: adding 1.5 * 2^23 pushes the fraction out of the mantissa
  const v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const v16 r = x - n * 0.693145751953125f - n * 1.428606765330187045e-6f;
  v16 p = v16{} + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const i16 e = (__builtin_convertvector(n, i16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &e, sizeof(scale));
  v16 out = p * scale;
  return x <= lo ? v16{} : out;
}

// Runs fn(part) for part in [0, parts) on the calling thread and XLA's intra-op pool. Parts
// are claimed from a shared counter, so a helper that starts late (or never: a busy pool)
// only costs parallelism; the caller returns once every part is done.
template <typename Fn>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t parts, Fn fn) {
  if (parts <= 0) return;
  struct State {
    explicit State(Fn f, int64_t p) : fn(std::move(f)), parts(p) {}
    Fn fn;
    int64_t parts;
    std::atomic<int64_t> next{0}, done{0};
    void work() {
      for (int64_t p; (p = next.fetch_add(1, std::memory_order_relaxed)) < parts;) {
        fn(p);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto state = std::make_shared<State>(std::move(fn), parts);
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), parts) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([state] { state->work(); });
  state->work();
  while (state->done.load(std::memory_order_acquire) < parts) std::this_thread::yield();
}

}  // namespace morse

#endif  // MORSE_JAX_KERNELS_CPU_COMMON_H_
