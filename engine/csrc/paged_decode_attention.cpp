// Paged single-query (decode) attention on CPU, reading K/V in place through block tables.
//
// One OpenMP task per (sequence, kv_head): the task loads the GQA group of query heads that
// share that kv head, walks the sequence's visible tokens block by block and keeps an online
// (streaming) softmax in fp32, so every K/V row is read exactly once and nothing is gathered.
// bf16 -> fp32 is a 16-bit shift; the inner loops are plain loops that -O3 -march=native
// vectorises. Blocks are scattered, so the next block's rows are prefetched while on this one.

#include <torch/extension.h>

#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline void load_row(const float* src, float* dst, int64_t d) {
  std::memcpy(dst, src, sizeof(float) * d);
}

inline void load_row(const at::BFloat16* src, float* dst, int64_t d) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    uint32_t widened = static_cast<uint32_t>(bits[i]) << 16;
    float f;
    std::memcpy(&f, &widened, sizeof(f));
    dst[i] = f;
  }
}

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

template <typename T>
void decode_task(const T* q, const T* k_cache, const T* v_cache, const int64_t* table,
                 int64_t start, int64_t end, int64_t block_size, int64_t kv_heads, int64_t g,
                 int64_t group, int64_t d, float scale, T* out, std::vector<float>& buf) {
  // buf: q [group, d] | acc [group, d] | row [d] | scores [group, block_size]
  buf.resize(2 * group * d + d + group * block_size);
  float* qf = buf.data();
  float* acc = qf + group * d;
  float* row = acc + group * d;
  float* scores = row + d;
  std::vector<float> m(group, -std::numeric_limits<float>::infinity());
  std::vector<float> l(group, 0.0f);
  for (int64_t h = 0; h < group; ++h) {
    load_row(q + h * d, qf + h * d, d);
    for (int64_t i = 0; i < d; ++i) qf[h * d + i] *= scale;
  }
  std::fill(acc, acc + group * d, 0.0f);
  const int64_t token_stride = kv_heads * d;
  for (int64_t pos = start; pos < end;) {
    const int64_t off = pos % block_size;
    const int64_t n = std::min(block_size - off, end - pos);
    const int64_t base = (table[pos / block_size] * block_size + off) * token_stride + g * d;
    const T* kb = k_cache + base;
    const T* vb = v_cache + base;
    if (pos + n < end) {  // blocks are scattered: fetch the next one's rows while on this one
      const int64_t next = table[(pos + n) / block_size] * block_size * token_stride + g * d;
      const int64_t rows = std::min(block_size, end - pos - n);
      prefetch_rows(k_cache + next, rows, token_stride, d);
      prefetch_rows(v_cache + next, rows, token_stride, d);
    }
    for (int64_t t = 0; t < n; ++t) {
      load_row(kb + t * token_stride, row, d);
      for (int64_t h = 0; h < group; ++h) {
        const float* qh = qf + h * d;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < d; ++i) s += qh[i] * row[i];
        scores[h * block_size + t] = s;
      }
    }
    for (int64_t h = 0; h < group; ++h) {
      float* sh = scores + h * block_size;
      float block_max = m[h];
#pragma omp simd reduction(max : block_max)
      for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, sh[t]);
      const float alpha = std::exp(m[h] - block_max);  // exp(-inf) = 0 on the first block
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)  // vector expf from libmvec (needs -fno-math-errno)
      for (int64_t t = 0; t < n; ++t) {
        sh[t] = std::exp(sh[t] - block_max);
        sum += sh[t];
      }
      l[h] = l[h] * alpha + sum;
      m[h] = block_max;
      float* ah = acc + h * d;
      for (int64_t i = 0; i < d; ++i) ah[i] *= alpha;
    }
    for (int64_t t = 0; t < n; ++t) {
      load_row(vb + t * token_stride, row, d);
      for (int64_t h = 0; h < group; ++h) {
        const float p = scores[h * block_size + t];
        float* ah = acc + h * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) ah[i] += p * row[i];
      }
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
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t b = task / kv_heads, g = task % kv_heads;
      const int64_t head0 = g * group;
      decode_task<T>(qp + (b * heads + head0) * d, kp, vp, tp + b * width, sp[b], ep[b],
                     block_size, kv_heads, g, group, d, static_cast<float>(scale),
                     op + (b * heads + head0) * d, buf);
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
