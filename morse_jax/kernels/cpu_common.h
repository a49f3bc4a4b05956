// Helpers shared by the CPU kernels: portable SIMD vectors and a parallel loop on XLA's pool.
#ifndef MORSE_JAX_KERNELS_CPU_COMMON_H_
#define MORSE_JAX_KERNELS_CPU_COMMON_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace morse {

// GCC/Clang vector extensions, one width per build: the widest the target ISA holds in a register.
// A vector wider than the ISA's registers is legal but GCC splits it and moves the halves through
// the stack on every iteration (a 64-byte type on AVX2: 8x slower, see kernels/probe.py), so the
// width follows the compiler's target macros. native.py may force it (-DMORSE_VEC_BYTES=N together
// with -mno-avx512f / -mno-avx) to build and test every width on one machine.
#ifndef MORSE_VEC_BYTES
#if defined(__AVX512F__)
#define MORSE_VEC_BYTES 64
#elif defined(__AVX__)
#define MORSE_VEC_BYTES 32
#else
#define MORSE_VEC_BYTES 16  // SSE, NEON, anything else
#endif
#endif
static_assert(MORSE_VEC_BYTES == 16 || MORSE_VEC_BYTES == 32 || MORSE_VEC_BYTES == 64,
              "MORSE_VEC_BYTES must be 16, 32 or 64");

constexpr int kLanes = MORSE_VEC_BYTES / 4;  // floats per vector
// Vector registers the ISA names (AVX-512: 32, AVX/SSE: 16); kernels keep at most half of them
// as accumulators so loads and broadcasts never spill.
constexpr int kMaxAcc = MORSE_VEC_BYTES == 64 ? 16 : 8;

template <int N>  // a vector of N floats (N <= kLanes in the kernels: one register)
struct Vec {
  typedef float type __attribute__((vector_size(4 * N)));
};
typedef Vec<kLanes>::type vf;
typedef int32_t vi __attribute__((vector_size(MORSE_VEC_BYTES)));

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

inline float hsum(vf v) {
  float s = 0.f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
}

// exp(x) for x <= 0 (softmax after subtracting the max): 2^n * p(r), r = x - n ln 2 in
// [-ln2/2, ln2/2], degree-6 polynomial, relative error ~2e-7; inputs below -87 give 0.
inline vf exp_nonpositive(vf x) {
  const vf lo = vf{} - 87.0f;
  x = x < lo ? lo : x;  // per-lane select
  // round to nearest: adding 1.5 * 2^23 pushes the fraction out of the mantissa
  const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const vf r = x - n * 0.693145751953125f - n * 1.428606765330187045e-6f;
  vf p = vf{} + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof(scale));
  vf out = p * scale;
  return x <= lo ? vf{} : out;
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

// The vector width this library was built with (tests check a forced width took effect). Defined
// here, not inline: every kernel library is one translation unit including this header once.
extern "C" __attribute__((visibility("default"))) int MorseVecBytes() { return MORSE_VEC_BYTES; }

#endif  // MORSE_JAX_KERNELS_CPU_COMMON_H_
