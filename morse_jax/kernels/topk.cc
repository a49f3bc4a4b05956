// The k largest entries of each row of x [B, V] (float32), in descending order, ties broken by the
// lower index: the result of jax.lax.top_k, for the sampler's token selection (k = 256 candidates
// of a 49152-token vocabulary at batch 16: XLA's CPU top-k took 3.3 ms of a 71 ms decode step).
//
//   x     [B, V]
//   vals  [B, k]   x's k largest per row, descending
//   ids   [B, k]   int32, their column indices
//
// Per row, instead of sorting V entries: (1) the maximum of each block of kBlock entries, one
// vectorised pass; (2) t = the k-th largest block maximum. Those k block maxima are k distinct
// entries >= t, so the row's k-th largest value is >= t and every entry that can be in the
// result (ties at the boundary included) is >= t; (3) the entries >= t, read only from the
// blocks whose maximum reaches t, are collected (400-650 of 49152 for SmolLM2's logits) and (4)
// their k best are selected and sorted. Order is XLA's total order (NaN above +inf, +0 above -0,
// ties by the lower index), through one integer key per entry. A NaN is never >= t: a row with
// a NaN (seen as a NaN running sum; an inf - inf sum also lands there) sorts the whole row.

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_common.h"

#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;
using morse::kLanes;
using morse::vf;

namespace {

constexpr int64_t kBlock = 64;  // entries per block maximum: a multiple of every vector width

// Ascending key = descending value in IEEE total order, then ascending index.
inline uint64_t sort_key(float v, int64_t i) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  const uint32_t ordered = (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // ascending total order
  return (uint64_t{~ordered} << 32) | static_cast<uint32_t>(i);
}

// Bit j set where p[j] >= t, j < kBlock: compares and a movemask per vector (a scalar loop on
// every block that reaches t cost 50 of 65 us per row, one mispredicted branch per entry).
inline uint64_t at_least(const float* p, float t) {
  uint64_t m = 0;
#if MORSE_VEC_BYTES == 64 && defined(__AVX512F__)
  const __m512 tv = _mm512_set1_ps(t);
  for (int j = 0; j < kBlock; j += 16)
    m |= uint64_t{_mm512_cmp_ps_mask(_mm512_loadu_ps(p + j), tv, _CMP_GE_OQ)} << j;
#elif MORSE_VEC_BYTES >= 32 && defined(__AVX__)
  const __m256 tv = _mm256_set1_ps(t);
  for (int j = 0; j < kBlock; j += 8)
    m |= uint64_t(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + j), tv, _CMP_GE_OQ))) << j;
#elif defined(__SSE__)
  const __m128 tv = _mm_set1_ps(t);
  for (int j = 0; j < kBlock; j += 4) m |= uint64_t(_mm_movemask_ps(_mm_cmpge_ps(_mm_loadu_ps(p + j), tv))) << j;
#else
  for (int j = 0; j < kBlock; ++j) m |= uint64_t{p[j] >= t} << j;
#endif
  return m;
}

// The row's block maxima into block_max; false when the row holds a NaN.
bool block_maxima(const float* x, int64_t V, std::vector<float>& block_max) {
  const int64_t nb = (V + kBlock - 1) / kBlock;
  block_max.resize(nb);
  vf sum = {};  // NaN iff some entry is NaN (or +inf and -inf meet: then the exact path, too)
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * kBlock, n = std::min(kBlock, V - lo);
    float m = -INFINITY;
    if (n == kBlock) {
      vf acc = morse::load<vf>(x + lo);
      sum += acc;
      for (int64_t j = kLanes; j < kBlock; j += kLanes) {
        const vf v = morse::load<vf>(x + lo + j);
        acc = v > acc ? v : acc;
        sum += v;
      }
      m = morse::hmax(acc);
    } else {
      for (int64_t j = 0; j < n; ++j) {
        m = std::max(m, x[lo + j]);
        sum[0] += x[lo + j];
      }
    }
    block_max[b] = m;
  }
  return !std::isnan(morse::hsum(sum));
}

void top_k_row(const float* x, int64_t V, int64_t k, float* vals, int32_t* ids) {
  thread_local std::vector<float> block_max, sorted;
  thread_local std::vector<uint64_t> keys;
  keys.resize(V);
  int64_t n = 0;
  const int64_t nb = (V + kBlock - 1) / kBlock;
  if (block_maxima(x, V, block_max) && k <= nb) {
    sorted.assign(block_max.begin(), block_max.end());  // a copy: block_max is read by block below
    std::nth_element(sorted.begin(), sorted.begin() + (k - 1), sorted.end(), std::greater<float>());
    const float t = sorted[k - 1];
    for (int64_t b = 0; b < nb; ++b) {
      if (block_max[b] < t) continue;
      const int64_t lo = b * kBlock, hi = std::min(V, lo + kBlock);
      if (hi - lo == kBlock) {  // a passing block holds one or two entries >= t, seldom more
        for (uint64_t m = at_least(x + lo, t); m != 0; m &= m - 1) {
          const int64_t i = lo + __builtin_ctzll(m);
          keys[n++] = sort_key(x[i], i);
        }
      } else {
        for (int64_t i = lo; i < hi; ++i)
          if (x[i] >= t) keys[n++] = sort_key(x[i], i);
      }
    }
  } else {  // a NaN, or k above the number of blocks: every entry
    for (int64_t i = 0; i < V; ++i) keys[i] = sort_key(x[i], i);
    n = V;
  }
  std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.begin() + n);
  std::sort(keys.begin(), keys.begin() + k);
  for (int64_t i = 0; i < k; ++i) {
    const int64_t idx = static_cast<int64_t>(keys[i] & 0xffffffffu);
    vals[i] = x[idx];
    ids[i] = static_cast<int32_t>(idx);
  }
}

ffi::Error TopKImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> vals,
                    ffi::ResultBuffer<ffi::S32> ids) {
  const auto xd = x.dimensions(), vd = vals->dimensions(), id = ids->dimensions();
  if (xd.size() != 2 || vd.size() != 2 || id.size() != 2) {
    return ffi::Error::InvalidArgument("morse_top_k: expects x [B, V], vals [B, k], ids [B, k]");
  }
  const int64_t B = xd[0], V = xd[1], k = vd[1];
  if (vd[0] != B || id[0] != B || id[1] != k || k < 1 || k > V) {
    return ffi::Error::InvalidArgument("morse_top_k: inconsistent shapes (need 1 <= k <= V)");
  }
  const float* xp = x.typed_data();
  float* vp = vals->typed_data();
  int32_t* ip = ids->typed_data();
  morse::parallel_for(pool, B, [=](int64_t b) { top_k_row(xp + b * V, V, k, vp + b * k, ip + b * k); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MorseTopK, TopKImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());
