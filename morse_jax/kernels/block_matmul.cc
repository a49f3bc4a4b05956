// Decode-step projections from llama.cpp's block-quantised weights: out[N, B] = W[N, K] @ X[K, B]
// for B <= 4 columns, with W read in the form a GGUF file stores it.
//
// At one to four rows a decode step is bound by the bytes of weight it streams: a float32 matrix
// costs 4 bytes a weight, while the blocks below cost 0.75 (Q4_1) or 1.125 (Q8_0). The values are
// the ones the loader dequantises (gguf.quants: Q4_1 w = d * q + m, Q8_0 w = d * q, per block of
// 32 along K), so the product is the float32 one up to summation order.
//
//   Q4_1: scale[N, K/32], min[N, K/32] float32 (the file's float16 d and m, widened), and
//         nibbles[N, K/2] uint8: byte i of a block's 16 holds element i in its low nibble and
//         element 16 + i in its high one. Per block, sum_i x_i w_i = d * (q . x) + m * sum(x),
//         so only the integers meet x; the block sums of x are taken once per call.
//   Q8_0: scale[N, K/32] float32 and q[N, K] int8; per block d * (q . x).
//
// Rows are split over XLA's intra-op pool as in cpu_matmul.cc; each row streams its blocks once.
// Vector extensions at the ISA's width (cpu_common.h); a block is 32 / kLanes vectors.

#include <string>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_common.h"

namespace ffi = xla::ffi;
using morse::hsum;
using morse::kLanes;
using morse::load;
using morse::vf;

namespace {

constexpr int kBlock = 32;
constexpr int kChunks = kBlock / kLanes;  // vectors per block
static_assert(kBlock % kLanes == 0, "a block must hold whole vectors");
// The 32 integers of a block as kChunks vectors, in element order, handed over in registers. With
// intrinsics where the vector width is the ISA's own (AVX-512 / AVX2: zero or sign extension +
// cvtdq2ps): GCC 12 turned both the vector-extension conversion and the plain loop into
// byte-by-byte inserts there (Q4_1 8x slower than the float32 kernel). Going through memory costs
// too where the store and load widths differ: 256-bit stores read back as 512-bit vectors miss
// store forwarding (the AVX2 unpack in an AVX-512 build ran Q4_1 3.4x slower than the AVX2 build,
// 2026-12-07). Elsewhere (SSE, NEON, forced widths) the plain loops, which the compiler may vectorise.
#if defined(__AVX512F__) && MORSE_VEC_BYTES == 64
#define MORSE_UNPACK_BYTES 64
inline void unpack_q4(const uint8_t* p, vf* q) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  q[0] = reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask))));
  q[1] = reinterpret_cast<vf>(
      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask))));
}

inline void unpack_q8(const int8_t* p, vf* q) {
  for (int c = 0; c < 2; ++c) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * c));
    q[c] = reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)));
  }
}
#elif defined(__AVX2__) && MORSE_VEC_BYTES == 32
#define MORSE_UNPACK_BYTES 32
inline __m256 widen8(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

inline void unpack_q4(const uint8_t* p, vf* q) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  q[0] = reinterpret_cast<vf>(widen8(lo));
  q[1] = reinterpret_cast<vf>(widen8(_mm_srli_si128(lo, 8)));
  q[2] = reinterpret_cast<vf>(widen8(hi));
  q[3] = reinterpret_cast<vf>(widen8(_mm_srli_si128(hi, 8)));
}

inline void unpack_q8(const int8_t* p, vf* q) {
  for (int c = 0; c < 4; ++c) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * c));
    q[c] = reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
  }
}
#else
#define MORSE_UNPACK_BYTES 0
inline void unpack_q4(const uint8_t* __restrict p, vf* q) {
  float f[kBlock];
  for (int i = 0; i < kBlock / 2; ++i) {
    f[i] = static_cast<float>(p[i] & 15);
    f[kBlock / 2 + i] = static_cast<float>(p[i] >> 4);
  }
  for (int c = 0; c < kChunks; ++c) q[c] = load<vf>(f + c * kLanes);
}

inline void unpack_q8(const int8_t* __restrict p, vf* q) {
  float f[kBlock];
  for (int i = 0; i < kBlock; ++i) f[i] = static_cast<float>(p[i]);
  for (int c = 0; c < kChunks; ++c) q[c] = load<vf>(f + c * kLanes);
}
#endif

// q . x over one block: two partial sums so the FMAs of a block are two short chains, not one.
inline vf block_dot(const vf* q, const float* x) {
  vf s0 = q[0] * load<vf>(x), s1 = {};
  for (int c = 1; c < kChunks; ++c) {
    if (c & 1) {
      s1 += q[c] * load<vf>(x + c * kLanes);
    } else {
      s0 += q[c] * load<vf>(x + c * kLanes);
    }
  }
  return s0 + s1;
}

struct Job {
  const float* scale;
  const float* min;  // Q4_1 only
  const uint8_t* q4;
  const int8_t* q8;
  const float* X;
  float* out;
  int64_t N, K, B, nb;
  std::vector<float> xt;  // [B, K]: X transposed, one contiguous column per output column
  std::vector<float> xs;  // [B, nb]: block sums of each column (Q4_1's min term)

  void prepare() {
    xt.assign(B * K, 0.f);
    for (int64_t k = 0; k < K; ++k)
      for (int64_t b = 0; b < B; ++b) xt[b * K + k] = X[k * B + b];
    if (min != nullptr) {
      xs.assign(B * nb, 0.f);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t j = 0; j < nb; ++j) {
          float s = 0.f;
          for (int i = 0; i < kBlock; ++i) s += xt[b * K + j * kBlock + i];
          xs[b * nb + j] = s;
        }
    }
  }

  template <int BB>
  void rows(int64_t n0, int64_t n1) const {
    for (int64_t n = n0; n < n1; ++n) {
      vf acc[BB] = {};
      float macc[BB] = {};
      const float* d = scale + n * nb;
      for (int64_t j = 0; j < nb; ++j) {
        vf q[kChunks];
        if (q4 != nullptr) {
          unpack_q4(q4 + (n * nb + j) * (kBlock / 2), q);
        } else {
          unpack_q8(q8 + (n * nb + j) * kBlock, q);
        }
        for (int b = 0; b < BB; ++b) acc[b] += block_dot(q, xt.data() + b * K + j * kBlock) * d[j];
        if (min != nullptr) {
          const float m = min[n * nb + j];
          for (int b = 0; b < BB; ++b) macc[b] += m * xs[b * nb + j];
        }
      }
      for (int b = 0; b < BB; ++b) out[n * B + b] = hsum(acc[b]) + macc[b];
    }
  }

  void run_rows(int64_t n0, int64_t n1) const {
    switch (B) {
      case 1: return rows<1>(n0, n1);
      case 2: return rows<2>(n0, n1);
      case 3: return rows<3>(n0, n1);
      default: return rows<4>(n0, n1);
    }
  }
};

ffi::Error Run(ffi::ThreadPool& pool, Job& job) {
  if (job.N == 0 || job.B == 0) return ffi::Error::Success();
  job.prepare();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t rows = (job.N + 4 * threads - 1) / (4 * threads);
  rows = std::max<int64_t>(32, rows);
  morse::parallel_for(pool, (job.N + rows - 1) / rows,
                      [&job, rows](int64_t p) { job.run_rows(p * rows, std::min(job.N, (p + 1) * rows)); });
  return ffi::Error::Success();
}

// Shapes shared by both formats: scale [N, nb], x [K, B] with K = 32 nb and 1 <= B <= 4, out [N, B].
const char* CheckShapes(ffi::Span<const int64_t> sd, ffi::Span<const int64_t> xd, ffi::Span<const int64_t> od) {
  if (sd.size() != 2 || xd.size() != 2 || od.size() != 2 || xd[0] != sd[1] * kBlock || od[0] != sd[0] ||
      od[1] != xd[1] || xd[1] > 4)
    return "expects scale [N, K/32], x [K, B] (B <= 4) -> out [N, B]";
  return nullptr;
}

ffi::Error Q41Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> min,
                   ffi::Buffer<ffi::U8> nibbles, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  const auto sd = scale.dimensions(), md = min.dimensions(), qd = nibbles.dimensions();
  if (const char* e = CheckShapes(sd, x.dimensions(), out->dimensions()))
    return ffi::Error::InvalidArgument(std::string("morse_block_matmul_q4_1: ") + e);
  if (md.size() != 2 || md[0] != sd[0] || md[1] != sd[1] || qd.size() != 2 || qd[0] != sd[0] ||
      qd[1] != sd[1] * kBlock / 2)
    return ffi::Error::InvalidArgument("morse_block_matmul_q4_1: expects min [N, K/32] and nibbles [N, K/2]");
  Job job{scale.typed_data(), min.typed_data(), nibbles.typed_data(), nullptr, x.typed_data(), out->typed_data(),
          sd[0], sd[1] * kBlock, x.dimensions()[1], sd[1], {}, {}};
  return Run(pool, job);
}

ffi::Error Q80Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S8> q,
                   ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> out) {
  const auto sd = scale.dimensions(), qd = q.dimensions();
  if (const char* e = CheckShapes(sd, x.dimensions(), out->dimensions()))
    return ffi::Error::InvalidArgument(std::string("morse_block_matmul_q8_0: ") + e);
  if (qd.size() != 2 || qd[0] != sd[0] || qd[1] != sd[1] * kBlock)
    return ffi::Error::InvalidArgument("morse_block_matmul_q8_0: expects q [N, K]");
  Job job{scale.typed_data(), nullptr, nullptr, q.typed_data(), x.typed_data(), out->typed_data(),
          sd[0], sd[1] * kBlock, x.dimensions()[1], sd[1], {}, {}};
  return Run(pool, job);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MorseBlockMatmulQ41, Q41Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MorseBlockMatmulQ80, Q80Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Which unpacking this build has: the intrinsics' vector width in bytes (64, 32) or 0 for the plain
// loops. block_matmul.unpack_simd_bytes reads it; tests check it is never a width other than the
// build's own (the store-forwarding slowdown of 2026-12-07 was an AVX2 unpack in a 64-byte build).
extern "C" __attribute__((visibility("default"))) int MorseBlockUnpackBytes() { return MORSE_UNPACK_BYTES; }
