// Paged single-query (decode) attention on CPU, reading K/V in place through block tables.
//
// One OpenMP task per (sequence, run of kv heads); on one intra-op thread the tasks are shared
// with the spare threads instead (spare_threads.h), the same bits whoever computes one. The visible keys are taken in splits of
// kSplit = 512 positions, as torch's CPU flash attention (what transformers runs) splits them:
// per split, every head of the task scores all its keys (a walk over K, up to 64 tokens per tile),
// then one softmax over the split against the running max, then P.V (a walk over V), with the
// accumulators rescaled when the max moves, so every K/V row is read once and nothing is gathered.
// Blocks are scattered, so the next tile's rows are prefetched a few lines between kernel calls.
//
// bf16 follows torch's flash-attention numerics: scores (q . k) * scale in fp32, softmax weights
// from torch's fast exp (fexp_u20, ~1e-4 relative), their sum in fp32, the weights rounded to
// bf16 before P.V, fp32 accumulation, one rounding of the output. An exact fp32 softmax differs
// from that by ~1 bf16 ulp in ~20% of outputs, and on the random-weight test models such
// differences cost 2% of teacher-forced argmax agreement with transformers (97% vs 99%).
// fp32 uses an exact exp and no rounding of the weights.
//
// With AVX2+FMA (and d % 16 == 0) the kernels use intrinsics; otherwise plain loops with the
// same arithmetic. An AVX-512 build takes the AVX2 path too (__AVX2__ is defined there).
//
// An int8 cache (kv_cache_dtype int8, engine/kv_layout.py) holds each token's head as d int8
// values followed by their fp32 scale: scores are (q . k_int) * k_scale * scale, and P.V adds
// (p * v_scale) * v_int, the integers read as exact floats -- half the bytes of bf16 per key.

#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_AVX2 1
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Keys per softmax split: torch's CPU flash-attention kv split, so the weights are rounded
// against the same running max as there.
constexpr int64_t kSplit = 512;
// Most tokens per tile of a K or V walk.
constexpr int64_t kTile = 64;

// torch's fexp_u20 (ATen vec256_float.h), the exp its CPU flash attention applies for bf16:
// 2^(x log2 e) with the fraction's 2^f corrected by a cubic and the result assembled in the
// exponent bits. Constants as torch writes them (two are double literals narrowed to float).
const float kFexpC0 = 0.00010703434948458272f;
const float kFexpC1 = 0.30354260500649682f;
const float kFexpC2 = static_cast<float>(-0.22433836478672356);
const float kFexpC3 = static_cast<float>(-0.079204240219773236);
inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
const float kLog2e = from_bits(0x3fb8aa3b);
const float kLnFltMin = from_bits(0xc2aeac50);  // ln(FLT_MIN): below it the result is 0
const float kTwo23 = 8388608.0f;                // 2^23
const float kBias = 1065353216.0f;              // 127 * 2^23

// Keeps `x` materialised: the compiler may not fuse the multiply that made it into a later add
// (these kernels build with -ffp-contract=fast; torch's fexp has no such fusion).
template <typename V>
inline void no_contract(V& x) {
#if defined(__x86_64__) || defined(__i386__)
  asm("" : "+x"(x));
#else
  (void)x;
#endif
}

inline float fexp_scalar(float x) {
  if (x < kLnFltMin) return 0.0f;  // and -inf
  float t = x * kLog2e;
  no_contract(t);
  const float frac = t - std::floor(t);
  float p = std::fma(frac, kFexpC3, kFexpC2);
  p = std::fma(frac, p, kFexpC1);
  p = std::fma(frac, p, kFexpC0);
  const int32_t bits = static_cast<int32_t>(std::fma(kTwo23, t - p, kBias));  // truncates
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// x rounded to the nearest bf16 (ties to even), kept as a float. Finite non-negative x only.
inline float round_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, sizeof(x));
  return x;
}

inline float to_float(float x) { return x; }
inline float to_float(int8_t x) { return static_cast<float>(x); }
inline float to_float(at::BFloat16 x) {
  uint32_t widened = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &widened, sizeof(f));
  return f;
}

inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, at::BFloat16* dst) { *dst = at::BFloat16(x); }  // nearest even

#ifdef TANDEM_AVX2
// The vector kernels take 16 elements at a time as two fp32 vectors. A bf16 pair is widened
// with one op per vector by splitting it into its even and odd elements, so in that case q
// and the accumulators hold each 16-element chunk as [evens, odds] (see `slot`).
inline void load16(const float* p, __m256& a, __m256& b) {
  a = _mm256_loadu_ps(p);
  b = _mm256_loadu_ps(p + 8);
}

inline void load16(const at::BFloat16* p, __m256& a, __m256& b) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(-65536)));
}

inline void load16(const int8_t* p, __m256& a, __m256& b) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
  b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x, 8)));
}

// exp for x <= 0 (scores minus their running max): Cephes expf range reduction and polynomial,
// ~1 ulp; below ln(FLT_MIN) (and at -inf) it returns 0 instead of a subnormal.
inline __m256 exp_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_setzero_ps(), _mm256_max_ps(lo, x));  // NaN (2nd operand) stays
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - k ln2, with ln2 split in two so k * hi is exact.
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);  // 2^k
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// fexp_scalar on 8 lanes (torch's fexp_u20 itself).
inline __m256 fexp8(__m256 x) {
  const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(kLnFltMin), _CMP_LT_OS);
  __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(kLog2e));
  no_contract(t);
  const __m256 frac = _mm256_sub_ps(t, _mm256_floor_ps(t));
  __m256 p = _mm256_fmadd_ps(frac, _mm256_set1_ps(kFexpC3), _mm256_set1_ps(kFexpC2));
  p = _mm256_fmadd_ps(frac, p, _mm256_set1_ps(kFexpC1));
  p = _mm256_fmadd_ps(frac, p, _mm256_set1_ps(kFexpC0));
  const __m256 y = _mm256_fmadd_ps(_mm256_set1_ps(kTwo23), _mm256_sub_ps(t, p),
                                   _mm256_set1_ps(kBias));
  return _mm256_andnot_ps(under, _mm256_castsi256_ps(_mm256_cvttps_epi32(y)));  // -inf, NaN -> 0
}

// round_bf16 on 8 lanes.
inline __m256 round_bf16_8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(-65536)));
}

// [sum(a[0]), ..., sum(a[7])]: one transpose-and-add instead of a horizontal sum per dot.
inline __m256 hsum8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

inline float hmax(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float hsum(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// acc[c, c + 16P) += sum_t p[t] * v[t][c, c + 16P), the accumulators held in registers.
template <int P, typename T>
inline void pv_tile(const float* p, const T* const* v, int64_t n, int64_t c, float* acc) {
  __m256 a[2 * P];
  for (int j = 0; j < 2 * P; ++j) a[j] = _mm256_loadu_ps(acc + c + 8 * j);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pt = _mm256_broadcast_ss(p + t);
    for (int j = 0; j < P; ++j) {
      __m256 x, y;
      load16(v[t] + c + 16 * j, x, y);
      a[2 * j] = _mm256_fmadd_ps(pt, x, a[2 * j]);
      a[2 * j + 1] = _mm256_fmadd_ps(pt, y, a[2 * j + 1]);
    }
  }
  for (int j = 0; j < 2 * P; ++j) _mm256_storeu_ps(acc + c + 8 * j, a[j]);
}
#endif

// Where element i of a head vector lives in q / the accumulators: a bf16 cache on the vector
// path keeps each 16-element chunk as [evens, odds] (load16); otherwise in place.
template <typename C>
inline int64_t slot(int64_t i, bool vec) {
  if (!vec || !std::is_same_v<C, at::BFloat16>) return i;
  return (i & ~int64_t{15}) + ((i & 1) << 3) + ((i & 15) >> 1);
}

// An int8 cache row's fp32 scale, stored after its d values; 1 (unused) for a float cache.
constexpr int64_t kScaleBytes = 4;
template <typename C>
constexpr int64_t kRowExtra = std::is_same_v<C, int8_t> ? kScaleBytes : 0;

template <typename C>
inline float row_scale(const C* row, int64_t d) {
  if constexpr (std::is_same_v<C, int8_t>) {
    float s;
    std::memcpy(&s, row + d, sizeof(s));
    return s;
  } else {
    (void)row, (void)d;
    return 1.0f;
  }
}

// s[t] = (q . k[t]) * scale for t < n (s has room for n rounded up to 8); an int8 row's dot is
// multiplied by its scale first.
template <typename T>
inline void tile_scores(const float* q, const T* const* k, int64_t n, int64_t d, bool vec,
                        float scale, float* s) {
  constexpr bool int8 = std::is_same_v<T, int8_t>;
#ifdef TANDEM_AVX2
  if (vec) {
    const __m256 sc = _mm256_set1_ps(scale);
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
      const T* r[8];  // 8 tokens at once: 8 independent FMA chains, one reduction
      for (int64_t j = 0; j < 8; ++j) r[j] = k[std::min(t0 + j, n - 1)];
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 16) {
        const __m256 q0 = _mm256_loadu_ps(q + i), q1 = _mm256_loadu_ps(q + i + 8);
        for (int j = 0; j < 8; ++j) {
          __m256 x, y;
          load16(r[j] + i, x, y);
          a[j] = _mm256_fmadd_ps(q1, y, _mm256_fmadd_ps(q0, x, a[j]));
        }
      }
      __m256 dots = hsum8(a);
      if constexpr (int8) {
        float ks[8];
        for (int j = 0; j < 8; ++j) ks[j] = row_scale(r[j], d);
        dots = _mm256_mul_ps(dots, _mm256_loadu_ps(ks));
      }
      _mm256_storeu_ps(s + t0, _mm256_mul_ps(dots, sc));
    }
    return;
  }
#endif
  (void)vec;
  for (int64_t t = 0; t < n; ++t) {
    const T* kr = k[t];
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < d; ++i) acc += q[i] * to_float(kr[i]);
    no_contract(acc);
    if constexpr (int8) {
      acc *= row_scale(kr, d);
      no_contract(acc);
    }
    s[t] = acc * scale;
  }
}

// max(mx, s[0, n)); pads s up to a multiple of 8 with -inf (weight 0 in split_exp).
inline float split_max(float* s, int64_t n, float mx) {
  const int64_t n8 = (n + 7) / 8 * 8;
  for (int64_t t = n; t < n8; ++t) s[t] = kNegInf;
#ifdef TANDEM_AVX2
  __m256 m = _mm256_set1_ps(mx);
  for (int64_t t = 0; t < n8; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t));
  return hmax(m);
#else
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  return mx;
#endif
}

// s[t] = exp(s[t] - mx) over s's padded length (split_max made the padding -inf: weight 0);
// returns the weights' sum. `bf16`: torch's flash-attention numerics -- its fast exp, the sum of
// the unrounded weights (vector lanes first), the weights then rounded to bf16 for P.V. (torch
// takes std::exp for the last kv_len % 8 keys of a call; in the causal prefill transformers runs
// those are masked for all but a chunk's last rows, so the fast exp it is.) fp32: an exact exp.
template <bool bf16>
inline float split_exp(float* s, int64_t n, float mx) {
  const int64_t n8 = (n + 7) / 8 * 8;
#ifdef TANDEM_AVX2
  __m256 sum = _mm256_setzero_ps();
  const __m256 m = _mm256_set1_ps(mx);
  for (int64_t t = 0; t < n8; t += 8) {
    const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + t), m);
    const __m256 e = bf16 ? fexp8(x) : exp_nonpos(x);
    sum = _mm256_add_ps(sum, e);
    _mm256_storeu_ps(s + t, bf16 ? round_bf16_8(e) : e);
  }
  return hsum(sum);
#else
  float total = 0.0f;
  for (int64_t t = 0; t < n8; ++t) {
    const float e = bf16 ? fexp_scalar(s[t] - mx) : std::exp(s[t] - mx);
    total += e;
    s[t] = bf16 ? round_bf16(e) : e;
  }
  return total;
#endif
}

// acc[0, d) += sum_t p[t] * v[t].
template <typename T>
inline void tile_pv_rows(const float* p, const T* const* v, int64_t n, int64_t d, bool vec,
                         float* acc) {
#ifdef TANDEM_AVX2
  if (vec) {
    int64_t c = 0;
    for (; c + 64 <= d; c += 64) pv_tile<4>(p, v, n, c, acc);
    if (c + 32 <= d) pv_tile<2>(p, v, n, c, acc), c += 32;
    if (c + 16 <= d) pv_tile<1>(p, v, n, c, acc);
    return;
  }
#endif
  (void)vec;
  for (int64_t t = 0; t < n; ++t) {
    const float pt = p[t];
    const T* vr = v[t];
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) acc[i] += pt * to_float(vr[i]);
  }
}

// tile_pv_rows, an int8 row's weight being p[t] times its scale.
template <typename T>
inline void tile_pv(const float* p, const T* const* v, int64_t n, int64_t d, bool vec,
                    float* acc) {
  if constexpr (std::is_same_v<T, int8_t>) {
    float scaled[kTile];
    for (int64_t t = 0; t < n; ++t) scaled[t] = p[t] * row_scale(v[t], d);
    tile_pv_rows(scaled, v, n, d, vec, acc);
  } else {
    tile_pv_rows(p, v, n, d, vec, acc);
  }
}

// Rows of a tile: row[t] points at token t's K (or V) row, at the task's first kv head.
template <typename T>
struct Tile {
  const T* row[kTile];
  int64_t n = 0;
};

// The next tile's lines, prefetched a few at a time between this tile's kernels: blocks are
// scattered, and one burst of them would stall on the miss buffers.
template <typename T>
struct Prefetcher {
  const Tile<T>* tile = nullptr;
  int64_t lines = 0, row = 0, line = 0, per_call = 0;
  bool active = false;
  // Spread the tile's lines over `calls` calls of issue().
  void start(const Tile<T>& next, int64_t row_bytes, int64_t calls) {
    tile = &next;
    lines = (row_bytes + 63) / 64;
    row = line = 0;
    per_call = (next.n * lines + calls - 1) / calls;
    active = true;
  }
  void stop() { active = false; }
  void issue() {
    for (int64_t count = per_call; count > 0 && active; --count) {
      __builtin_prefetch(reinterpret_cast<const char*>(tile->row[row]) + 64 * line);
      if (++line == lines) {
        line = 0;
        if (++row == tile->n) active = false;
      }
    }
  }
};

// Sequence attention for the query heads of kv heads [g0, g1) over table positions
// [start, end); q / out point at the first of those heads. The kv heads share the tile walks:
// located once per tile, and a task with several reads contiguous rows. T: q and out; C: the
// cache's elements (T, or int8 with a scale after each head's row).
template <typename T, typename C>
void decode_task(const T* q, const C* k_cache, const C* v_cache, const int64_t* table,
                 int64_t start, int64_t end, int64_t block_size, int64_t kv_heads, int64_t g0,
                 int64_t g1, int64_t group, int64_t d, float scale, T* out, float* buf) {
#ifdef TANDEM_AVX2
  const bool vec = d % 16 == 0;
#else
  const bool vec = false;
#endif
  constexpr bool bf16 = !std::is_same_v<T, float>;
  const int64_t heads = (g1 - g0) * group;
  // buf: q [heads, d] | acc [heads, d] | m, l [heads] | scores [heads, kSplit]
  float* qf = buf;
  float* acc = qf + heads * d;
  float* m = acc + heads * d;
  float* l = m + heads;
  float* scores = l + heads;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < d; ++i) qf[h * d + slot<C>(i, vec)] = to_float(q[h * d + i]);
    m[h] = kNegInf;
    l[h] = 0.0f;
  }
  std::fill(acc, acc + heads * d, 0.0f);
  const int64_t head_stride = d + kRowExtra<C>;
  const int64_t token_stride = kv_heads * head_stride;
  const int64_t row_bytes = (g1 - g0) * head_stride * static_cast<int64_t>(sizeof(C));
  // Tokens per tile: one kv head's K slice of it ~8 KB, so it stays in L1 while the group's
  // heads go over it.
  const int64_t tile_len =
      std::clamp<int64_t>(8192 / (d * static_cast<int64_t>(sizeof(C))) / 8 * 8, 8, kTile);
  auto locate = [&](const C* cache, int64_t pos, int64_t limit, Tile<C>& tile) {
    tile.n = std::min(tile_len, limit - pos);
    int64_t blk = pos / block_size, off = pos % block_size;
    for (int64_t j = 0; j < tile.n; ++j) {
      tile.row[j] = cache + (table[blk] * block_size + off) * token_stride + g0 * head_stride;
      if (++off == block_size) off = 0, ++blk;
    }
  };
  Tile<C> tiles[2];
  Prefetcher<C> pf;
  const C* rows[kTile];
  // body(tile, offset of the tile in the split) for each tile of cache rows [b0, b1).
  auto walk = [&](const C* cache, int64_t b0, int64_t b1, auto&& body) {
    int cur = 0;
    locate(cache, b0, b1, tiles[0]);
    for (int64_t pos = b0; pos < b1; cur ^= 1) {
      const Tile<C>& tile = tiles[cur];
      pf.stop();
      if (pos + tile.n < b1) {
        locate(cache, pos + tile.n, b1, tiles[cur ^ 1]);
        pf.start(tiles[cur ^ 1], row_bytes, heads);
      }
      body(tile, pos - b0);
      pos += tile.n;
    }
  };
  for (int64_t b0 = start; b0 < end;) {
    const int64_t b1 = std::min(end, (b0 / kSplit + 1) * kSplit);
    // Every head's scores over the split; a kv head's K rows are shared by its group in L1.
    walk(k_cache, b0, b1, [&](const Tile<C>& tile, int64_t off) {
      for (int64_t g = 0; g < g1 - g0; ++g) {
        for (int64_t t = 0; t < tile.n; ++t) rows[t] = tile.row[t] + g * head_stride;
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          pf.issue();
          tile_scores(qf + h * d, rows, tile.n, d, vec, scale, scores + h * kSplit + off);
        }
      }
    });
    // Softmax over the split against the running max (torch's order of operations).
    for (int64_t h = 0; h < heads; ++h) {
      float* sh = scores + h * kSplit;
      const float mx = split_max(sh, b1 - b0, m[h]);
      const float sum = split_exp<bf16>(sh, b1 - b0, mx);
      const float alpha = std::exp(m[h] - mx);  // exp(-inf) = 0 on the first split
      l[h] = sum + alpha * l[h];
      if (b0 != start) {
        for (int64_t i = 0; i < d; ++i) acc[h * d + i] *= alpha;
      }
      m[h] = mx;
    }
    walk(v_cache, b0, b1, [&](const Tile<C>& tile, int64_t off) {
      for (int64_t g = 0; g < g1 - g0; ++g) {
        for (int64_t t = 0; t < tile.n; ++t) rows[t] = tile.row[t] + g * head_stride;
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          pf.issue();
          tile_pv(scores + h * kSplit + off, rows, tile.n, d, vec, acc + h * d);
        }
      }
    });
    b0 = b1;
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;  // empty context -> zeros
    for (int64_t i = 0; i < d; ++i) store(acc[h * d + slot<C>(i, vec)] * inv, out + h * d + i);
  }
}

// Work split: (sequence, run of kv heads) tasks, with as many kv heads per task as still
// leaves about 8 tasks per thread for the dynamic schedule to balance uneven contexts.
struct Split {
  int64_t group, per_task, chunks, tasks, buf_size;
};

Split split(int64_t batch, int64_t heads, int64_t d, int64_t kv_heads, int threads) {
  const int64_t group = heads / kv_heads;
  int64_t per_task = kv_heads;
  while (per_task > 1 && batch * (kv_heads / per_task) < 8 * threads)
    for (--per_task; kv_heads % per_task != 0;) --per_task;  // next smaller divisor
  const int64_t chunks = kv_heads / per_task;
  return {group, per_task, chunks, batch * chunks, per_task * group * (2 * d + 2 + kSplit)};
}

template <typename T, typename C>
void run_tasks(const T* q, const C* k_cache, const C* v_cache, const int64_t* tables,
               const int64_t* starts, const int64_t* ends, int64_t batch, int64_t heads,
               int64_t d, int64_t block_size, int64_t kv_heads, int64_t width, float scale,
               T* out, int threads) {
  const Split s = split(batch, heads, d, kv_heads, threads);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buf(s.buf_size);  // per thread, reused by all its tasks
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < s.tasks; ++task) {
      const int64_t b = task / s.chunks, g0 = task % s.chunks * s.per_task;
      const int64_t head0 = b * heads + g0 * s.group;
      decode_task<T, C>(q + head0 * d, k_cache, v_cache, tables + b * width, starts[b], ends[b],
                        block_size, kv_heads, g0, g0 + s.per_task, s.group, d, scale,
                        out + head0 * d, buf.data());
    }
  }
}

// The same tasks shared with the process's spare threads (spare_threads.h): a task is a chunk,
// computed into the chunk's buffer and copied out by the caller, so whoever computes it, its
// bits are run_tasks'. The lambda holds the tensors: a stalled helper may still run it after
// this call has returned (its result then dropped).
template <typename T, typename C>
void run_shared(const torch::Tensor& q, const torch::Tensor& k_cache,
                const torch::Tensor& v_cache, const torch::Tensor& tables,
                const torch::Tensor& starts, const torch::Tensor& ends, float scale,
                torch::Tensor& out, tandem_spare::Pool& spare) {
  const int64_t heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), width = tables.size(1);
  const Split s = split(q.size(0), heads, d, kv_heads, 1 + spare.size());
  const int64_t task_elems = s.per_task * s.group * d;
  const int64_t chunk_floats = (task_elems * static_cast<int64_t>(sizeof(T)) + 3) / 4;
  auto compute = [=](int64_t task, float* result) {
    thread_local std::vector<float> buf;
    buf.resize(s.buf_size);
    const int64_t b = task / s.chunks, g0 = task % s.chunks * s.per_task;
    decode_task<T, C>(q.data_ptr<T>() + (b * heads + g0 * s.group) * d, k_cache.data_ptr<C>(),
                      v_cache.data_ptr<C>(), tables.data_ptr<int64_t>() + b * width,
                      starts.data_ptr<int64_t>()[b], ends.data_ptr<int64_t>()[b], block_size,
                      kv_heads, g0, g0 + s.per_task, s.group, d, scale,
                      reinterpret_cast<T*>(result), buf.data());
  };
  T* o = out.data_ptr<T>();
  spare.run(s.tasks, chunk_floats, compute, [&](int64_t task, const float* result) {
    const int64_t b = task / s.chunks, g0 = task % s.chunks * s.per_task;
    std::memcpy(o + (b * heads + g0 * s.group) * d, result, task_elems * sizeof(T));
  });
}

template <typename T, typename C>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& tables, const torch::Tensor& starts, const torch::Tensor& ends,
         double scale, torch::Tensor& out) {
  tandem_spare::Pool* spare = tandem_spare::attached();
  if (spare != nullptr && spare->active() && at::get_num_threads() == 1) {
    run_shared<T, C>(q, k_cache, v_cache, tables, starts, ends, static_cast<float>(scale), out,
                     *spare);
    return;
  }
  run_tasks<T, C>(q.data_ptr<T>(), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(),
                  tables.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
                  ends.data_ptr<int64_t>(), q.size(0), q.size(1), q.size(2), k_cache.size(1),
                  k_cache.size(2), tables.size(1), static_cast<float>(scale), out.data_ptr<T>(),
                  at::get_num_threads());
}

template <typename T>
void run_on_cache(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& tables,
                  const torch::Tensor& starts, const torch::Tensor& ends, double scale,
                  torch::Tensor& out) {
  if (k_cache.scalar_type() == torch::kChar) {
    run<T, int8_t>(q, k_cache, v_cache, tables, starts, ends, scale, out);
  } else {
    run<T, T>(q, k_cache, v_cache, tables, starts, ends, scale, out);
  }
}

}  // namespace

// q [B, heads, d]; caches [num_blocks, block_size, kv_heads, d] of q's dtype, or int8
// [num_blocks, block_size, kv_heads, d + 4] (each row's fp32 scale in its last 4 bytes);
// tables [B, W] int64; sequence b attends to table positions [starts[b], ends[b]).
// Returns [B, heads * d].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor tables,
                                     torch::Tensor starts, torch::Tensor ends, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q [B, heads, d] and caches [num_blocks, block_size, kv_heads, d] expected");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors expected");
  const bool int8 = k_cache.scalar_type() == torch::kChar;
  TORCH_CHECK((int8 || q.scalar_type() == k_cache.scalar_type()) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "caches must share a dtype, q's or int8");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.size(2) + (int8 ? kScaleBytes : 0) == k_cache.size(3) &&
                  q.size(1) % k_cache.size(2) == 0,
              "head_dim mismatch (an int8 cache row is head_dim + 4 bytes) or heads not a "
              "multiple of kv_heads");
  const int64_t batch = q.size(0);
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && starts.numel() == batch &&
                  ends.numel() == batch,
              "tables [B, W], starts [B], ends [B] expected");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && starts.scalar_type() == torch::kLong &&
                  ends.scalar_type() == torch::kLong,
              "int64 tables and bounds expected");
  q = q.contiguous();
  tables = tables.contiguous();
  starts = starts.contiguous();
  ends = ends.contiguous();
  {
    const int64_t* sp = starts.data_ptr<int64_t>();
    const int64_t* ep = ends.data_ptr<int64_t>();
    const int64_t cap = tables.size(1) * k_cache.size(1);
    for (int64_t b = 0; b < batch; ++b)
      TORCH_CHECK(0 <= sp[b] && sp[b] <= ep[b] && ep[b] <= cap, "bounds outside the table");
  }
  auto out = torch::empty({batch, q.size(1) * q.size(2)}, q.options());
  if (q.scalar_type() == torch::kFloat) {
    run_on_cache<float>(q, k_cache, v_cache, tables, starts, ends, scale, out);
  } else if (q.scalar_type() == torch::kBFloat16) {
    run_on_cache<at::BFloat16>(q, k_cache, v_cache, tables, starts, ends, scale, out);
  } else {
    TORCH_CHECK(false, "float32 or bfloat16 expected");
  }
  return out;
}

// Share calls made on one intra-op thread with the process's spare threads (the spare_threads
// extension's pool).
void attach_spare_pool(int64_t address) {
  tandem_spare::attached() = reinterpret_cast<tandem_spare::Pool*>(address);
}
