// One decode step's attention on CPU: a query row per (batch row, kv head) group against the
// layer's cache, float32, with the layouts of morse_jax/sampling/decode.py:
//
//   q     [N, G, D]   N = B * K (batch rows x kv heads), G query heads per kv head
//   keys  [N, S/T, D, T]  S cache slots in tiles of T (slots advance with positions within a
//                     row; the last tile zero-padded): a tile's row d holds dimension d of T slots
//   vals  [N, S, D]
//   mask  [B, S]      bool, True where slot s may be attended (valid, causal, sliding window)
//   out   [N, G, D]   softmax(scale * q . k over valid slots) . v
//
// XLA runs this as per-(b, k) multiply-reduce fusions over all S slots (bench/sampler.py); here
// each group reads its keys and values once, only from the tile of its first valid slot up to its
// last valid slot (a cache bucket of 384 holding 200-330 tokens), with the G query heads sharing every load. In tiles, the keys
// a group reads are one contiguous stream (with keys [N, D, S], D rows of stride S interleaved:
// 30 layers at batch 16 on an AVX2 host, 16-17 ms -> 13.5-14.5 with the tiles and the value
// prefetch below).
//
// A row with no valid slot (a padding row) gets zeros; XLA's softmax over all-masked scores
// gives the mean value there. Neither is ever read: such rows are inactive.

#include <cmath>
#include <vector>

#include "cpu_common.h"

namespace ffi = xla::ffi;
using morse::kLanes;
using morse::vf;

namespace {

// Vectors per register block: up to 4 heads x kVecs accumulators stay within morse::kMaxAcc
// (4 x 4 with AVX-512's 32 registers, 4 x 2 with 16), so kBlock is 64 slots with AVX-512.
constexpr int kVecs = morse::kMaxAcc / 4;
constexpr int64_t kBlock = int64_t{kVecs} * kLanes;  // lanes per register block
// Key rows (head-dim entries) per pass over the slots: a pass reads kRows rows of every tile, so
// with D <= kRows one pass reads the tiles whole, in order (on the AVX-512 host, with the untiled
// layout, 8 rows per pass were 1.4x slower than 64: the scores are reloaded on every pass).
constexpr int kRows = 64;

// Value lines fetched ahead while the scores are computed: the value pass that follows then
// finds them in cache. One line per key row read, in order.
struct Prefetch {
  const float* next;
  const float* end;
  void step() {
    if (next < end) __builtin_prefetch(next);
    next += 64 / sizeof(float);
  }
};

// Loads lanes [s, s + n) of a row into kVecs vectors (n <= kBlock; missing lanes zero).
inline void load_block(const float* p, int64_t n, vf out[kVecs]) {
  for (int j = 0; j < kVecs; ++j) {
    const int64_t m = std::clamp<int64_t>(n - kLanes * j, 0, kLanes);
    out[j] = m == kLanes ? morse::load<vf>(p + kLanes * j) : morse::load_partial<vf>(p + kLanes * j, m);
  }
}

inline void store_block(float* p, int64_t n, const vf in[kVecs]) {
  for (int j = 0; j < kVecs; ++j) {
    const int64_t m = std::clamp<int64_t>(n - kLanes * j, 0, kLanes);
    if (m > 0) morse::store_partial(p + kLanes * j, in[j], m);
  }
}

// scores[g, s] (+)= sum_{d in [d0, d0 + rows)} q[g, d] * key[s][d] for g in [g0, g0 + GB), s < hi;
// q is pre-scaled; keys in tiles of T slots (T a multiple of kLanes: no vector straddles two
// tiles). GB x kVecs independent accumulators: the FMAs pipeline instead of waiting on one
// another, and every key vector loaded serves all GB heads.
template <int GB>
void scores_block(const float* q, const float* keys, float* scores, int64_t ld, int64_t g0, int64_t d0, int rows,
                  int64_t D, int64_t T, int64_t hi, Prefetch& pf) {
  for (int64_t s0 = 0; s0 < hi; s0 += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, hi - s0);
    vf acc[GB][kVecs];
    for (int g = 0; g < GB; ++g) {
      if (d0 == 0) {
        for (int j = 0; j < kVecs; ++j) acc[g][j] = vf{};
      } else {
        load_block(scores + (g0 + g) * ld + s0, n, acc[g]);
      }
    }
    for (int r = 0; r < rows; ++r) {
      pf.step();
      vf k[kVecs];
      for (int j = 0; j < kVecs; ++j) {
        const int64_t s = s0 + kLanes * j, m = std::clamp<int64_t>(n - kLanes * j, 0, kLanes);
        const float* p = keys + (s / T) * D * T + (d0 + r) * T + s % T;
        k[j] = m == kLanes ? morse::load<vf>(p) : m > 0 ? morse::load_partial<vf>(p, m) : vf{};
      }
      for (int g = 0; g < GB; ++g) {
        const float qd = q[(g0 + g) * D + d0 + r];
        for (int j = 0; j < kVecs; ++j) acc[g][j] += k[j] * qd;
      }
    }
    for (int g = 0; g < GB; ++g) store_block(scores + (g0 + g) * ld + s0, n, acc[g]);
  }
}

// scores [G, hi] (row stride ld) = q . keys over head-dim blocks of kRows rows.
void scores_rows(const float* q, const float* keys, float* scores, int64_t ld, int64_t G, int64_t D, int64_t T,
                 int64_t hi, Prefetch& pf) {
  for (int64_t d0 = 0; d0 < D; d0 += kRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kRows, D - d0));
    int64_t g0 = 0;
    for (; g0 + 4 <= G; g0 += 4) scores_block<4>(q, keys, scores, ld, g0, d0, rows, D, T, hi, pf);
    switch (G - g0) {
      case 3: scores_block<3>(q, keys, scores, ld, g0, d0, rows, D, T, hi, pf); break;
      case 2: scores_block<2>(q, keys, scores, ld, g0, d0, rows, D, T, hi, pf); break;
      case 1: scores_block<1>(q, keys, scores, ld, g0, d0, rows, D, T, hi, pf); break;
      default: break;
    }
  }
}

// out[g, :] = sum_s p[g, s] * vals[s, :] for g in [g0, g0 + GB); D handled VB lanes at a time, so a
// value row (D floats, contiguous) is read in D / VB passes; fewer passes read it more nearly as
// one stream. GB x VV accumulators + VV loaded vectors fit the register file.
template <int GB, int VV>
void values_block(const float* p, int64_t ld, const float* vals, float* out, int64_t g0, int64_t D, int64_t hi) {
  constexpr int64_t VB = int64_t{VV} * kLanes;
  for (int64_t d0 = 0; d0 < D; d0 += VB) {
    const int64_t n = std::min<int64_t>(VB, D - d0);
    const int nv = static_cast<int>((n + kLanes - 1) / kLanes);
    vf acc[GB][VV] = {};
    for (int64_t s = 0; s < hi; ++s) {
      const float* v = vals + s * D + d0;
      __builtin_prefetch(v + 8 * D);  // 8 rows ahead: the stride (D floats) spans whole lines
      vf vv[VV];
      for (int j = 0; j < nv; ++j) {
        const int64_t m = std::min<int64_t>(kLanes, n - kLanes * j);
        vv[j] = m == kLanes ? morse::load<vf>(v + kLanes * j) : morse::load_partial<vf>(v + kLanes * j, m);
      }
      for (int g = 0; g < GB; ++g) {
        const float pg = p[(g0 + g) * ld + s];
        for (int j = 0; j < nv; ++j) acc[g][j] += vv[j] * pg;
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < nv; ++j)
        morse::store_partial(out + (g0 + g) * D + d0 + kLanes * j, acc[g][j],
                             std::min<int64_t>(kLanes, n - kLanes * j));
  }
}

// Value blocks: 4 vectors x up to 3 heads with 16 registers (12 accumulators + 4 loads), kVecs x 4
// heads with 32.
constexpr int kValVecs = morse::kMaxAcc == 8 ? 4 : kVecs;
constexpr int kValHeads = morse::kMaxAcc == 8 ? 3 : 4;

void values_rows(const float* p, int64_t ld, const float* vals, float* out, int64_t G, int64_t D, int64_t hi) {
  int64_t g0 = 0;
  for (; g0 + kValHeads <= G; g0 += kValHeads) values_block<kValHeads, kValVecs>(p, ld, vals, out, g0, D, hi);
  switch (G - g0) {
    case 3: values_block<3, kValVecs>(p, ld, vals, out, g0, D, hi); break;
    case 2: values_block<2, kValVecs>(p, ld, vals, out, g0, D, hi); break;
    case 1: values_block<1, kValVecs>(p, ld, vals, out, g0, D, hi); break;
    default: break;
  }
}

// Softmax of one row of scores in place; bias [hi] is 0 at valid slots and -inf elsewhere
// (zero-padded to a multiple of 16 lanes, like row: whole vectors at every width).
void softmax_row(float* row, const float* bias, int64_t hi) {
  const int64_t h16 = (hi + 15) & ~int64_t{15};
  vf vmax = vf{} - INFINITY;
  for (int64_t s = 0; s < h16; s += kLanes) {
    const vf x = morse::load<vf>(row + s) + morse::load<vf>(bias + s);
    vmax = x > vmax ? x : vmax;
  }
  const float mx = morse::hmax(vmax);
  vf vsum = {};
  for (int64_t s = 0; s < h16; s += kLanes) {
    const vf e = morse::exp_nonpositive(morse::load<vf>(row + s) + morse::load<vf>(bias + s) - mx);
    vsum += e;
    std::memcpy(row + s, &e, sizeof(e));
  }
  const float inv = 1.f / morse::hsum(vsum);
  for (int64_t s = 0; s < hi; ++s) row[s] *= inv;
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> keys,
                         ffi::Buffer<ffi::F32> vals, ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> out,
                         float scale) {
  const auto qd = q.dimensions(), kd = keys.dimensions(), vd = vals.dimensions(), md = mask.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || vd.size() != 3 || md.size() != 2) {
    return ffi::Error::InvalidArgument(
        "morse_decode_attention: expects q [N,G,D], keys [N,S/T,D,T], vals [N,S,D], mask [B,S]");
  }
  const int64_t N = qd[0], G = qd[1], D = qd[2], S = vd[1], T = kd[3], B = md[0];
  if (kd[0] != N || kd[2] != D || kd[1] * T < S || vd[0] != N || vd[2] != D || md[1] != S || B == 0 ||
      N % B != 0) {
    return ffi::Error::InvalidArgument("morse_decode_attention: inconsistent shapes");
  }
  if (T % 16 != 0) {  // whole vectors per tile at every width (16 lanes with AVX-512)
    return ffi::Error::InvalidArgument("morse_decode_attention: the key tile must be a multiple of 16 slots");
  }
  const int64_t key_stride = kd[1] * D * T;
  const int64_t K = N / B;
  const float* qp = q.typed_data();
  const float* kp = keys.typed_data();
  const float* vp = vals.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  morse::parallel_for(pool, N, [=](int64_t n) {
    const bool* m = mp + (n / K) * S;
    int64_t hi = S;
    while (hi > 0 && !m[hi - 1]) --hi;  // slots past the last valid one are never read
    float* o = op + n * G * D;
    if (hi == 0) {
      std::fill(o, o + G * D, 0.f);
      return;
    }
    // Nor the whole tiles before the first valid slot: a row's left padding, the slots a refilled
    // row (sampling/refill.py) never wrote, the keys a sliding window has passed. They add exact
    // zeros to the softmax sums and the value sums, and lo is a multiple of T (of 16 lanes), so
    // every slot keeps its lane: the output is bitwise the same as reading from slot 0.
    int64_t lo = 0;
    while (!m[lo]) ++lo;  // hi > 0: some slot is valid
    lo -= lo % T;
    const int64_t w = hi - lo;  // slots read: [lo, hi)
    // Rows padded to 16 lanes so the softmax runs on whole vectors; padding lanes get bias -inf.
    const int64_t w16 = (w + 15) & ~int64_t{15};
    thread_local std::vector<float> scores, bias;
    scores.assign(G * w16, 0.f);
    bias.resize(w16);
    for (int64_t s = 0; s < w16; ++s) bias[s] = s < w && m[lo + s] ? 0.f : -INFINITY;
    thread_local std::vector<float> qs;  // q * scale
    qs.resize(G * D);
    for (int64_t i = 0; i < G * D; ++i) qs[i] = qp[n * G * D + i] * scale;
    const float* v = vp + (n * S + lo) * D;
    Prefetch pf{v, v + w * D};
    scores_rows(qs.data(), kp + n * key_stride + (lo / T) * D * T, scores.data(), w16, G, D, T, w, pf);
    for (int64_t g = 0; g < G; ++g) softmax_row(scores.data() + g * w16, bias.data(), w);
    values_rows(scores.data(), w16, v, o, G, D, w);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MorseDecodeAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
