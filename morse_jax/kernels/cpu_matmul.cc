// Decode-step projections on CPU: out[N, B] = W[N, K] @ X[K, B], float32, few columns.
//
// A decode step multiplies every weight matrix by a handful of activation columns (B = batch
// rows). XLA's CPU dot reaches ~100 GFLOP/s at B = 16 on a 2-core AVX-512 machine and leaves
// memory bandwidth unused at B = 1 (measured in bench/sampler.py); these two loops reach ~140
// GFLOP/s and ~35 GB/s there. Both stream W exactly once, row-major, and split its rows over
// XLA's own intra-op thread pool (no second pool competing for the cores).
//
//  * B <= 4, "dot" form: one row of W at a time against each column, vectorised along K.
//  * B >  4, "broadcast" form: up to 8 rows at a time (6 with AVX2 at 16 columns); each W[n, k] is
//    broadcast against the row X[k, c0:c0 + C] of a C = 8 or 16 column block, so the accumulators
//    are whole output rows.
//
// Written with GCC/Clang vector extensions rather than intrinsics, at the width of the target ISA
// (cpu_common.h: 64 bytes with AVX-512, 32 with AVX/AVX2, 16 otherwise); register blocks are sized
// in vectors so that the accumulators fit the register file at every width. Built at first use
// by morse_jax/kernels/native.py.

#include <vector>

#include "cpu_common.h"

namespace ffi = xla::ffi;
using morse::hsum;
using morse::kLanes;
using morse::kMaxAcc;
using morse::load;
using morse::load_partial;
using morse::vf;

namespace {

// Accumulators of the broadcast form: FMA latency (4-5 cycles) x 2 FMA pipes needs ~10 independent
// chains; AVX2's 16 registers hold 12 plus the two X vectors and a broadcast. With 8 (4 rows x 2
// vectors at 16 columns) the 2-core AVX2 host ran [1536, 576] x 16 columns in 295 us, with 12 in
// 164 us (XLA's dot: 250-320); bench/kernel_widths.py.
constexpr int kBcastAcc = MORSE_VEC_BYTES == 64 ? 16 : MORSE_VEC_BYTES == 32 ? 12 : 8;

// ------------------------------------------------------------------ dot form (B <= 4)

// Rows [n0, n1) of W against xt [B, Kp] (X transposed, zero-padded to Kp = K rounded up to 16),
// one row at a time: W is read as one sequential stream, which the hardware prefetcher follows
// best (8 rows in parallel, even with software prefetch, read 1.6x slower at B = 1). U
// independent accumulators per column keep the FMAs from waiting on one another.
template <int B, int U>
void dot_rows(const float* W, const float* xt, float* out, int64_t n0, int64_t n1, int64_t K, int64_t Kp) {
  constexpr int64_t step = int64_t{kLanes} * U;
  const int64_t KU = K / step * step;
  for (int64_t n = n0; n < n1; ++n) {
    vf acc[U][B] = {};
    const float* w = W + n * K;
    int64_t k = 0;
    for (; k < KU; k += step) {
      for (int u = 0; u < U; ++u) {
        const vf wr = load<vf>(w + k + kLanes * u);
        for (int b = 0; b < B; ++b) acc[u][b] += wr * load<vf>(xt + b * Kp + k + kLanes * u);
      }
    }
    for (; k < K; k += kLanes) {  // xt is zero past K up to Kp, a multiple of every width
      const vf wr = K - k >= kLanes ? load<vf>(w + k) : load_partial<vf>(w + k, K - k);
      for (int b = 0; b < B; ++b) acc[0][b] += wr * load<vf>(xt + b * Kp + k);
    }
    for (int b = 0; b < B; ++b) {
      vf t = acc[0][b];
      for (int u = 1; u < U; ++u) t += acc[u][b];
      out[n * B + b] = hsum(t);
    }
  }
}

// U: 16 floats per step at one column, 32 at more (measured with 64-byte vectors), in vectors of
// this build's width, at most kMaxAcc accumulators.
template <int B>
void dot_form(const float* W, const float* xt, float* out, int64_t n0, int64_t n1, int64_t K, int64_t Kp) {
  constexpr int floats = B == 1 ? 16 : 32;
  constexpr int U = std::max(1, std::min(floats / kLanes, kMaxAcc / B));
  dot_rows<B, U>(W, xt, out, n0, n1, K, Kp);
}

// ------------------------------------------------------------------ broadcast form (B > 4)

// Rows [n0, n1) of W against columns [c0, c0 + nc) of a C-column block (C = 8 or 16, nc <= C).
// x points at X[0, c0] with row stride ldx (B, or C for a zero-padded copy of a partial block).
// Each output row's C columns are M vectors of C / M lanes; R rows at a time keep R * M
// accumulators (8 rows with 64-byte vectors, fewer at smaller widths so none spill).
template <int C>
void bcast_rows(const float* W, const float* x, int64_t ldx, float* out, int64_t n0, int64_t n1, int64_t K,
                int64_t B, int64_t c0, int64_t nc) {
  constexpr int lanes = std::min(C, kLanes), M = C / lanes, R = std::min(8, kBcastAcc / M);
  using V = typename morse::Vec<lanes>::type;
  int64_t n = n0;
  auto rows = [&](auto r_const) {
    constexpr int RR = decltype(r_const)::value;
    V acc[RR][M] = {};
    const float* w = W + n * K;
    for (int64_t k = 0; k < K; ++k) {
      // one line of each row of the next block per 16 k: R short row streams are more than
      // the hardware prefetcher follows (B = 16: 1.2x faster with it)
      if ((k & 15) == 0)
        for (int r = 0; r < RR; ++r) __builtin_prefetch(w + (r + RR) * K + k);
      V xk[M];
      for (int m = 0; m < M; ++m) xk[m] = load<V>(x + k * ldx + m * lanes);
      for (int r = 0; r < RR; ++r) {
        const float wk = w[r * K + k];
        for (int m = 0; m < M; ++m) acc[r][m] += xk[m] * wk;
      }
    }
    for (int r = 0; r < RR; ++r) {
      float row[C];
      std::memcpy(row, acc[r], sizeof(row));
      std::memcpy(out + (n + r) * B + c0, row, nc * sizeof(float));
    }
  };
  for (; n + R <= n1; n += R) rows(std::integral_constant<int, R>{});
  // the last n1 - n < R rows as one block (one row at a time keeps only M accumulator chains)
  switch (n1 - n) {
    case 7: if constexpr (R > 7) rows(std::integral_constant<int, 7>{}); break;
    case 6: if constexpr (R > 6) rows(std::integral_constant<int, 6>{}); break;
    case 5: if constexpr (R > 5) rows(std::integral_constant<int, 5>{}); break;
    case 4: if constexpr (R > 4) rows(std::integral_constant<int, 4>{}); break;
    case 3: if constexpr (R > 3) rows(std::integral_constant<int, 3>{}); break;
    case 2: if constexpr (R > 2) rows(std::integral_constant<int, 2>{}); break;
    case 1: rows(std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// ------------------------------------------------------------------ one call

struct Job {
  const float* W;
  const float* X;
  float* out;
  int64_t N, K, B, Kp;
  std::vector<float> scratch;  // xt [B, Kp] (dot form) or padded column blocks (broadcast form)
  std::vector<int64_t> block_col, block_ld, block_off;  // broadcast form: per column block

  void prepare() {
    if (B <= 4) {
      Kp = (K + 15) & ~int64_t{15};
      scratch.assign(B * Kp, 0.f);
      for (int64_t k = 0; k < K; ++k)
        for (int64_t b = 0; b < B; ++b) scratch[b * Kp + k] = X[k * B + b];
      return;
    }
    // Column blocks of 16 (a tail of <= 8 runs 8 wide); only a partial block is copied and padded.
    for (int64_t c0 = 0; c0 < B; c0 += 16) {
      const int64_t nc = std::min<int64_t>(16, B - c0), width = nc <= 8 ? 8 : 16;
      block_col.push_back(c0);
      if (nc == width) {
        block_ld.push_back(-1);  // read X in place
        block_off.push_back(0);
      } else {
        block_ld.push_back(width);
        block_off.push_back(static_cast<int64_t>(scratch.size()));
        scratch.resize(scratch.size() + K * width, 0.f);
        float* dst = scratch.data() + block_off.back();
        for (int64_t k = 0; k < K; ++k) std::memcpy(dst + k * width, X + k * B + c0, nc * sizeof(float));
      }
    }
  }

  void run_rows(int64_t n0, int64_t n1) const {
    switch (B) {
      case 1: return dot_form<1>(W, scratch.data(), out, n0, n1, K, Kp);
      case 2: return dot_form<2>(W, scratch.data(), out, n0, n1, K, Kp);
      case 3: return dot_form<3>(W, scratch.data(), out, n0, n1, K, Kp);
      case 4: return dot_form<4>(W, scratch.data(), out, n0, n1, K, Kp);
      default: break;
    }
    for (size_t i = 0; i < block_col.size(); ++i) {
      const int64_t c0 = block_col[i], nc = std::min<int64_t>(16, B - c0);
      const bool in_place = block_ld[i] < 0;
      const float* x = in_place ? X + c0 : scratch.data() + block_off[i];
      const int64_t ldx = in_place ? B : block_ld[i];
      if (nc <= 8) {
        bcast_rows<8>(W, x, ldx, out, n0, n1, K, B, c0, nc);
      } else {
        bcast_rows<16>(W, x, ldx, out, n0, n1, K, B, c0, nc);
      }
    }
  }
};

ffi::Error MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> w, ffi::Buffer<ffi::F32> x,
                      ffi::ResultBuffer<ffi::F32> out) {
  const auto wd = w.dimensions(), xd = x.dimensions(), od = out->dimensions();
  if (wd.size() != 2 || xd.size() != 2 || od.size() != 2 || wd[1] != xd[0] || od[0] != wd[0] ||
      od[1] != xd[1]) {
    return ffi::Error::InvalidArgument("morse_cpu_matmul: expects W [N, K], X [K, B] -> out [N, B]");
  }
  Job job;
  job.W = w.typed_data();
  job.X = x.typed_data();
  job.out = out->typed_data();
  job.N = wd[0];
  job.K = wd[1];
  job.B = xd[1];
  if (job.N == 0 || job.B == 0) return ffi::Error::Success();
  if (job.K == 0) {
    std::fill(job.out, job.out + job.N * job.B, 0.f);
    return ffi::Error::Success();
  }
  job.prepare();
  // Parts of >= 64 rows (multiples of the 8-row blocks), about four per thread so a helper that
  // starts late still finds work.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  int64_t rows = (job.N + 4 * threads - 1) / (4 * threads);
  rows = std::max<int64_t>(64, (rows + 7) & ~int64_t{7});
  // Helpers that start after the last part find nothing to claim and never touch job.
  morse::parallel_for(pool, (job.N + rows - 1) / rows,
                      [&job, rows](int64_t p) { job.run_rows(p * rows, std::min(job.N, (p + 1) * rows)); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MorseCpuMatmul, MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
