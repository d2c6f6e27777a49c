// Paged single-query (decode) attention on CPU, reading K/V in place through block tables.
//
// One OpenMP task per (sequence, run of kv heads): for each kv head the task takes the GQA group
// of query heads that share it and walks the sequence's visible tokens a tile (up to 64 tokens,
// several blocks) at a time, keeping an online (streaming) softmax in fp32, so every K/V row is
// read once from memory and nothing is gathered. Per tile and kv head: all the group's scores
// (8 tokens per register tile, one transpose-and-add per 8 dots), one vectorised exp pass that
// also rescales the running state, then P.V with the accumulators held in registers. Blocks are
// scattered, so the next tile's rows are prefetched, a few lines between each kernel call.
//
// With AVX2+FMA (and d % 16 == 0) the kernels use intrinsics; otherwise plain loops. An AVX-512
// build takes the AVX2 path too (__AVX2__ is defined there).

#include <torch/extension.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_AVX2 1
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Most tokens per online-softmax step (the step's max / exp / rescale is spread over them).
constexpr int64_t kTile = 64;

inline float to_float(float x) { return x; }
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

// Where element i of a head vector lives in q / the accumulators: bf16 on the vector path
// keeps each 16-element chunk as [evens, odds] (load16); otherwise in place.
template <typename T>
inline int64_t slot(int64_t i, bool vec) {
  if (!vec || sizeof(T) == sizeof(float)) return i;
  return (i & ~int64_t{15}) + ((i & 1) << 3) + ((i & 15) >> 1);
}

// s[t] = q . k[t] for t < n (s has room for n rounded up to 8).
template <typename T>
inline void tile_scores(const float* q, const T* const* k, int64_t n, int64_t d, bool vec,
                        float* s) {
#ifdef TANDEM_AVX2
  if (vec) {
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
      _mm256_storeu_ps(s + t0, hsum8(a));
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
    s[t] = acc;
  }
}

inline float tile_max(float* s, int64_t n, float mx) {
#ifdef TANDEM_AVX2
  const int64_t n8 = (n + 7) / 8 * 8;
  for (int64_t t = n; t < n8; ++t) s[t] = kNegInf;  // padding: exp() of it is 0 below
  __m256 m = _mm256_set1_ps(mx);
  for (int64_t t = 0; t < n8; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t));
  return hmax(m);
#else
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  return mx;
#endif
}

// s[t] = exp(s[t] - mx) for t < n; returns their sum.
inline float tile_exp(float* s, int64_t n, float mx) {
#ifdef TANDEM_AVX2
  __m256 sum = _mm256_setzero_ps();
  const __m256 m = _mm256_set1_ps(mx);
  for (int64_t t = 0; t < n; t += 8) {  // the padding up to a multiple of 8 is -inf -> 0
    const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  return hsum(sum);
#else
  float total = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    total += s[t];
  }
  return total;
#endif
}

// acc[0, d) += sum_t p[t] * v[t].
template <typename T>
inline void tile_pv(const float* p, const T* const* v, int64_t n, int64_t d, bool vec,
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

// Rows of a tile: k[t] / v[t] point at token t's K / V row, at the task's first kv head.
template <typename T>
struct Tile {
  const T* k[kTile];
  const T* v[kTile];
  int64_t n = 0;
};

// The next tile's K then V lines, prefetched a few at a time between this tile's kernels:
// blocks are scattered, and one burst of them would stall on the miss buffers.
template <typename T>
struct Prefetcher {
  const Tile<T>* tile = nullptr;
  int64_t lines = 0, which = 2, row = 0, line = 0, per_call = 0;  // which: 0 K, 1 V, 2 done
  // Spread the tile's lines over `calls` calls of issue().
  void start(const Tile<T>& next, int64_t row_bytes, int64_t calls) {
    tile = &next;
    lines = (row_bytes + 63) / 64;
    which = row = line = 0;
    per_call = (2 * next.n * lines + calls - 1) / calls;
  }
  void stop() { which = 2; }
  void issue() {
    for (int64_t count = per_call; count > 0 && which < 2; --count) {
      const T* r = which == 0 ? tile->k[row] : tile->v[row];
      __builtin_prefetch(reinterpret_cast<const char*>(r) + 64 * line);
      if (++line == lines) {
        line = 0;
        if (++row == tile->n) row = 0, ++which;
      }
    }
  }
};

// Sequence attention for the query heads of kv heads [g0, g1) over table positions
// [start, end); q / out point at the first of those heads. The kv heads share the tile walk:
// located once per tile, and a task with several reads contiguous rows.
template <typename T>
void decode_task(const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                 int64_t start, int64_t end, int64_t block_size, int64_t kv_heads, int64_t g0,
                 int64_t g1, int64_t group, int64_t d, float scale, T* out, float* buf) {
#ifdef TANDEM_AVX2
  const bool vec = d % 16 == 0;
#else
  const bool vec = false;
#endif
  const int64_t heads = (g1 - g0) * group;
  // buf: q [heads, d] | acc [heads, d] | m, l [heads] | scores [group, kTile]
  float* qf = buf;
  float* acc = qf + heads * d;
  float* m = acc + heads * d;
  float* l = m + heads;
  float* scores = l + heads;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < d; ++i) qf[h * d + slot<T>(i, vec)] = to_float(q[h * d + i]) * scale;
    m[h] = kNegInf;
    l[h] = 0.0f;
  }
  std::fill(acc, acc + heads * d, 0.0f);
  const int64_t token_stride = kv_heads * d;
  const int64_t row_bytes = (g1 - g0) * d * static_cast<int64_t>(sizeof(T));
  // Tokens per tile: one kv head's K slice of it ~8 KB, so it stays in L1 while the group's
  // heads go over it.
  const int64_t tile_len =
      std::clamp<int64_t>(8192 / (d * static_cast<int64_t>(sizeof(T))) / 8 * 8, 8, kTile);
  auto locate = [&](int64_t pos, Tile<T>& tile) {
    tile.n = std::min(tile_len, end - pos);
    int64_t blk = pos / block_size, off = pos % block_size;
    for (int64_t j = 0; j < tile.n; ++j) {
      const int64_t row = (table[blk] * block_size + off) * token_stride + g0 * d;
      tile.k[j] = k_cache + row;
      tile.v[j] = v_cache + row;
      if (++off == block_size) off = 0, ++blk;
    }
  };
  Tile<T> tiles[2];
  Prefetcher<T> pf;
  const T* kr[kTile];
  const T* vr[kTile];
  int cur = 0;
  if (start < end) locate(start, tiles[0]);
  for (int64_t pos = start; pos < end; cur ^= 1) {
    const Tile<T>& tile = tiles[cur];
    const int64_t n = tile.n;
    pf.stop();
    if (pos + n < end) {
      locate(pos + n, tiles[cur ^ 1]);
      pf.start(tiles[cur ^ 1], row_bytes, 2 * heads);
    }
    for (int64_t g = 0; g < g1 - g0; ++g) {
      for (int64_t t = 0; t < n; ++t) kr[t] = tile.k[t] + g * d, vr[t] = tile.v[t] + g * d;
      float* qg = qf + g * group * d;
      float* ag = acc + g * group * d;
      // All heads' scores, softmax, then all heads' P.V: the group shares the K (then V)
      // rows of this kv head while they are in L1.
      for (int64_t h = 0; h < group; ++h) {
        pf.issue();
        tile_scores(qg + h * d, kr, n, d, vec, scores + h * kTile);
      }
      for (int64_t h = 0; h < group; ++h) {
        float* sh = scores + h * kTile;
        float* ah = ag + h * d;
        const int64_t hh = g * group + h;
        const float mx = tile_max(sh, n, m[hh]);
        if (mx > m[hh]) {  // the running max moved: rescale what was summed under the old one
          const float alpha = std::exp(m[hh] - mx);  // exp(-inf) = 0 on the first tile
          l[hh] *= alpha;
          for (int64_t i = 0; i < d; ++i) ah[i] *= alpha;
          m[hh] = mx;
        }
        l[hh] += tile_exp(sh, n, mx);
      }
      for (int64_t h = 0; h < group; ++h) {
        pf.issue();
        tile_pv(scores + h * kTile, vr, n, d, vec, ag + h * d);
      }
    }
    pos += n;
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;  // empty context -> zeros
    for (int64_t i = 0; i < d; ++i) store(acc[h * d + slot<T>(i, vec)] * inv, out + h * d + i);
  }
}

// Work split: (sequence, run of kv heads) tasks, with as many kv heads per task as still
// leaves about 8 tasks per thread for the dynamic schedule to balance uneven contexts.
template <typename T>
void run_tasks(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables,
               const int64_t* starts, const int64_t* ends, int64_t batch, int64_t heads,
               int64_t d, int64_t block_size, int64_t kv_heads, int64_t width, float scale,
               T* out, int threads) {
  const int64_t group = heads / kv_heads;
  int64_t per_task = kv_heads;
  while (per_task > 1 && batch * (kv_heads / per_task) < 8 * threads)
    for (--per_task; kv_heads % per_task != 0;) --per_task;  // next smaller divisor
  const int64_t chunks = kv_heads / per_task, tasks = batch * chunks;
  const int64_t buf_size = per_task * group * (2 * d + 2) + group * kTile;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> buf(buf_size);  // per thread, reused by all its tasks
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / chunks, g0 = task % chunks * per_task;
      const int64_t head0 = b * heads + g0 * group;
      decode_task<T>(q + head0 * d, k_cache, v_cache, tables + b * width, starts[b], ends[b],
                     block_size, kv_heads, g0, g0 + per_task, group, d, scale, out + head0 * d,
                     buf.data());
    }
  }
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& tables, const torch::Tensor& starts, const torch::Tensor& ends,
         double scale, torch::Tensor& out) {
  run_tasks<T>(q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
               tables.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), ends.data_ptr<int64_t>(),
               q.size(0), q.size(1), q.size(2), k_cache.size(1), k_cache.size(2), tables.size(1),
               static_cast<float>(scale), out.data_ptr<T>(), at::get_num_threads());
}

}  // namespace

// q [B, heads, d]; caches [num_blocks, block_size, kv_heads, d]; tables [B, W] int64;
// sequence b attends to table positions [starts[b], ends[b]). Returns [B, heads * d].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor tables,
                                     torch::Tensor starts, torch::Tensor ends, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "q [B, heads, d] and caches [num_blocks, block_size, kv_heads, d] expected");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors expected");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "q and caches must share a dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "head_dim mismatch or heads not a multiple of kv_heads");
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
    run<float>(q, k_cache, v_cache, tables, starts, ends, scale, out);
  } else if (q.scalar_type() == torch::kBFloat16) {
    run<at::BFloat16>(q, k_cache, v_cache, tables, starts, ends, scale, out);
  } else {
    TORCH_CHECK(false, "float32 or bfloat16 expected");
  }
  return out;
}
