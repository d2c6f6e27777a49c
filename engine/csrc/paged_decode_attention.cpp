// Paged single-query (decode) attention on CPU, reading K/V in place through block tables.
//
// One OpenMP task per (sequence, kv_head): the task loads the GQA group of query heads that
// share that kv head, walks the sequence's visible tokens block by block and keeps an online
// (streaming) softmax in fp32, so every K/V row is read exactly once and nothing is gathered.
// Per block: bf16 rows are widened once into a small fp32 buffer (fp32 rows are used in place),
// the group's scores [group, n] come from a register-tiled dot kernel, one exp pass over them
// rescales the running state, and P.V is accumulated with d-vectorised FMAs. Blocks are
// scattered, so the next block's rows are prefetched while on this one.
//
// With AVX2+FMA (and d % 8 == 0) the block kernels use intrinsics; otherwise plain loops. An
// AVX-512 build takes the AVX2 path too (__AVX2__ is defined there).

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

// Rows of one block as fp32: bf16 is widened into `buf` (a 16-bit shift), fp32 is used in place.
struct Rows {
  const float* p;
  int64_t stride;
  const float* row(int64_t t) const { return p + t * stride; }
};

inline Rows as_fp32(const float* src, int64_t n, int64_t stride, int64_t d, float* buf) {
  (void)n, (void)d, (void)buf;
  return {src, stride};
}

inline Rows as_fp32(const at::BFloat16* src, int64_t n, int64_t stride, int64_t d, float* buf) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t t = 0; t < n; ++t) {
    const uint16_t* s = bits + t * stride;
    float* o = buf + t * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) {
      uint32_t widened = static_cast<uint32_t>(s[i]) << 16;
      float f;
      std::memcpy(&f, &widened, sizeof(f));
      o[i] = f;
    }
  }
  return {buf, d};
}

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }

inline void store_row(const float* src, float* dst, int64_t d) {
  std::memcpy(dst, src, sizeof(float) * d);
}

inline void store_row(const float* src, at::BFloat16* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = at::BFloat16(src[i]);  // round to nearest even
}

template <typename T>
inline void prefetch_rows(const T* first, int64_t rows, int64_t stride, int64_t d) {
  const char* p = reinterpret_cast<const char*>(first);
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(T));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < row_bytes; b += 64)
      __builtin_prefetch(p + r * stride * static_cast<int64_t>(sizeof(T)) + b);
}

#ifdef TANDEM_AVX2
// exp for x <= 0 (scores minus their running max): Cephes expf range reduction and polynomial,
// ~1 ulp; below ln(FLT_MIN) (and at -inf) it returns 0 instead of a subnormal.
inline __m256 exp_nonpos(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_setzero_ps());
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

// acc[0, W*8) += sum_t p[t] * v.row(t)[0, W*8): W accumulators stay in registers over the block.
template <int W>
inline void pv_tile(const float* p, Rows v, int64_t n, int64_t c, float* acc) {
  __m256 a[W];
  for (int j = 0; j < W; ++j) a[j] = _mm256_loadu_ps(acc + c + 8 * j);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pt = _mm256_broadcast_ss(p + t);
    const float* vr = v.row(t) + c;
    for (int j = 0; j < W; ++j) a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(vr + 8 * j), a[j]);
  }
  for (int j = 0; j < W; ++j) _mm256_storeu_ps(acc + c + 8 * j, a[j]);
}
#endif

// s[t] = q . k.row(t) for t < n; s has room for n rounded up to 8.
inline void block_scores(const float* q, Rows k, int64_t n, int64_t d, float* s) {
#ifdef TANDEM_AVX2
  if (d % 8 == 0) {
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
      const float* r[8];  // 8 tokens at once: 8 independent FMA chains, one reduction
      for (int64_t j = 0; j < 8; ++j) r[j] = k.row(std::min(t0 + j, n - 1));
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_setzero_ps();
      for (int64_t i = 0; i < d; i += 8) {
        const __m256 qi = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(qi, _mm256_loadu_ps(r[j] + i), a[j]);
      }
      _mm256_storeu_ps(s + t0, hsum8(a));
    }
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    const float* kr = k.row(t);
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < d; ++i) acc += q[i] * kr[i];
    s[t] = acc;
  }
}

// s[t] = exp(s[t] - mx) for t < n; returns their sum.
inline float block_exp(float* s, int64_t n, float mx) {
#ifdef TANDEM_AVX2
  const int64_t n8 = (n + 7) / 8 * 8;
  for (int64_t t = n; t < n8; ++t) s[t] = kNegInf;  // padding lanes come out as 0
  __m256 sum = _mm256_setzero_ps();
  const __m256 m = _mm256_set1_ps(mx);
  for (int64_t t = 0; t < n8; t += 8) {
    const __m256 e = exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = 0.0f;
  for (float x : lanes) total += x;
  return total;
#else
  float total = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    total += s[t];
  }
  return total;
#endif
}

// acc[0, d) += sum_t p[t] * v.row(t).
inline void block_pv(const float* p, Rows v, int64_t n, int64_t d, float* acc) {
#ifdef TANDEM_AVX2
  if (d % 8 == 0) {
    int64_t c = 0;
    for (; c + 64 <= d; c += 64) pv_tile<8>(p, v, n, c, acc);
    if (c + 32 <= d) pv_tile<4>(p, v, n, c, acc), c += 32;
    if (c + 16 <= d) pv_tile<2>(p, v, n, c, acc), c += 16;
    if (c + 8 <= d) pv_tile<1>(p, v, n, c, acc);
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    const float pt = p[t];
    const float* vr = v.row(t);
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) acc[i] += pt * vr[i];
  }
}

template <typename T>
void decode_task(const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                 int64_t start, int64_t end, int64_t block_size, int64_t kv_heads, int64_t g,
                 int64_t group, int64_t d, float scale, T* out, float* buf) {
  // buf: q [group, d] | acc [group, d] | m, l [group] | scores [group, sw] | K, V [block, d]
  const int64_t sw = (block_size + 7) / 8 * 8;
  float* qf = buf;
  float* acc = qf + group * d;
  float* m = acc + group * d;
  float* l = m + group;
  float* scores = l + group;
  float* kbuf = scores + group * sw;
  float* vbuf = kbuf + block_size * d;
  for (int64_t h = 0; h < group; ++h) {
    for (int64_t i = 0; i < d; ++i) qf[h * d + i] = to_float(q[h * d + i]) * scale;
    m[h] = kNegInf;
    l[h] = 0.0f;
  }
  std::fill(acc, acc + group * d, 0.0f);
  const int64_t token_stride = kv_heads * d;
  for (int64_t pos = start; pos < end;) {
    const int64_t off = pos % block_size;
    const int64_t n = std::min(block_size - off, end - pos);
    const int64_t base = (table[pos / block_size] * block_size + off) * token_stride + g * d;
    if (pos + n < end) {  // blocks are scattered: fetch the next one's rows while on this one
      const int64_t next = table[(pos + n) / block_size] * block_size * token_stride + g * d;
      const int64_t rows = std::min(block_size, end - pos - n);
      prefetch_rows(k_cache + next, rows, token_stride, d);
      prefetch_rows(v_cache + next, rows, token_stride, d);
    }
    const Rows k = as_fp32(k_cache + base, n, token_stride, d, kbuf);
    const Rows v = as_fp32(v_cache + base, n, token_stride, d, vbuf);
    for (int64_t h = 0; h < group; ++h) {
      float* sh = scores + h * sw;
      block_scores(qf + h * d, k, n, d, sh);
      float mx = m[h];
      for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sh[t]);
      if (mx > m[h]) {  // the running max moved: rescale what was accumulated under the old one
        const float alpha = std::exp(m[h] - mx);  // exp(-inf) = 0 on the first block
        l[h] *= alpha;
        for (int64_t i = 0; i < d; ++i) acc[h * d + i] *= alpha;
        m[h] = mx;
      }
      l[h] += block_exp(sh, n, mx);
      block_pv(sh, v, n, d, acc + h * d);
    }
    pos += n;
  }
  for (int64_t h = 0; h < group; ++h) {
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;  // empty context -> zeros
    float* ah = acc + h * d;
    for (int64_t i = 0; i < d; ++i) ah[i] *= inv;
    store_row(ah, out + h * d, d);
  }
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& tables, const torch::Tensor& starts, const torch::Tensor& ends,
         double scale, torch::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads, width = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* ep = ends.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t tasks = batch * kv_heads;
  const int64_t buf_size = 2 * group * d + 2 * group + group * ((block_size + 7) / 8 * 8) +
                           2 * block_size * d;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> buf(buf_size);  // per thread, reused by all its tasks
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / kv_heads, g = task % kv_heads;
      const int64_t head0 = g * group;
      decode_task<T>(qp + (b * heads + head0) * d, kp, vp, tp + b * width, sp[b], ep[b],
                     block_size, kv_heads, g, group, d, static_cast<float>(scale),
                     op + (b * heads + head0) * d, buf.data());
    }
  }
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
