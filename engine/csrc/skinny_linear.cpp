// y = x W^T (+ b) for a few rows of x, with bf16 weights, on CPUs without native bf16 GEMM.
//
// A decode step of a small batch is bound by reading the weights once; torch's bf16 GEMM on an
// AVX2-only CPU emulates bf16 and reaches about half the memory bandwidth at one row and far less
// at four (see engine/model.py ``Linear``). Here each weight row is streamed once and widened in
// registers (a bf16 is the top half of an fp32), multiplied with every row of x (kept in fp32, in
// L1) and summed in fp32; the output is rounded to bf16 once, to nearest even -- the arithmetic of
// a native bf16 GEMM, up to summation order. Output rows are split over torch's intra-op threads.
//
// 16 weights are loaded as 8 int32 lanes: shifting left by 16 gives the even-indexed elements as
// fp32, masking the low half gives the odd ones. x is laid out once per call in that same
// [evens, odds] order per 16-element chunk, so no shuffle runs in the inner loop.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_AVX2 1
#endif

namespace {

constexpr int64_t kMaxRows = 16;
constexpr int64_t kGroup = 4;
constexpr int64_t kChunk = 16;
constexpr int64_t kGrain = 32;  // output columns per parallel task: a few KB of weights at least

inline float widen(uint16_t bits) {
  const uint32_t w = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

// x (bf16 [M, K]) as fp32, each 16-element chunk reordered to [0, 2, .., 14, 1, 3, .., 15].
std::vector<float> interleaved_rows(const uint16_t* x, int64_t m, int64_t k) {
  std::vector<float> out(static_cast<size_t>(m * k));
  for (int64_t r = 0; r < m; ++r) {
    const uint16_t* src = x + r * k;
    float* dst = out.data() + r * k;
    for (int64_t c = 0; c + kChunk <= k; c += kChunk) {
      for (int64_t i = 0; i < kChunk / 2; ++i) {
        dst[c + i] = widen(src[c + 2 * i]);
        dst[c + kChunk / 2 + i] = widen(src[c + 2 * i + 1]);
      }
    }
  }
  return out;
}

#ifdef TANDEM_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[r] = dot(x row r, weight row) for r < M; M fixed at compile time so the accumulators
// live in registers.
template <int M>
inline void dot_rows(const float* xi, int64_t k, const uint16_t* w, float* out) {
  __m256 even[M], odd[M];
  for (int r = 0; r < M; ++r) {
    even[r] = _mm256_setzero_ps();
    odd[r] = _mm256_setzero_ps();
  }
  const __m256i high = _mm256_set1_epi32(-65536);
  for (int64_t c = 0; c < k; c += kChunk) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c));
    const __m256 we = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));
    const __m256 wo = _mm256_castsi256_ps(_mm256_and_si256(wv, high));
    for (int r = 0; r < M; ++r) {
      even[r] = _mm256_fmadd_ps(we, _mm256_loadu_ps(xi + r * k + c), even[r]);
      odd[r] = _mm256_fmadd_ps(wo, _mm256_loadu_ps(xi + r * k + c + kChunk / 2), odd[r]);
    }
  }
  for (int r = 0; r < M; ++r) out[r] = hsum(_mm256_add_ps(even[r], odd[r]));
}
#endif

// Rows in groups of at most kGroup: more accumulators than that would spill out of the 16
// vector registers. The weight row is read from memory by the first group and from L1 after.
void dot_rows_any(const float* xi, int64_t m, int64_t k, const uint16_t* w, float* out) {
#ifdef TANDEM_AVX2
  for (int64_t r0 = 0; r0 < m; r0 += kGroup) {
    const float* x = xi + r0 * k;
    float* o = out + r0;
    switch (std::min<int64_t>(m - r0, kGroup)) {
      case 1: dot_rows<1>(x, k, w, o); break;
      case 2: dot_rows<2>(x, k, w, o); break;
      case 3: dot_rows<3>(x, k, w, o); break;
      default: dot_rows<4>(x, k, w, o); break;
    }
  }
#else
  for (int64_t r = 0; r < m; ++r) {
    float acc = 0.f;
    for (int64_t c = 0; c < k; c += kChunk) {
      for (int64_t i = 0; i < kChunk / 2; ++i) {
        acc += widen(w[c + 2 * i]) * xi[r * k + c + i];
        acc += widen(w[c + 2 * i + 1]) * xi[r * k + c + kChunk / 2 + i];
      }
    }
    out[r] = acc;
  }
#endif
}

}  // namespace

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "skinny_linear: x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "skinny_linear: bf16 x and weight");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "skinny_linear: CPU tensors");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "skinny_linear: x has ", k, " columns, weight ", weight.size(1));
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "skinny_linear: 1 to ", kMaxRows, " rows, got ", m);
  TORCH_CHECK(k % kChunk == 0, "skinny_linear: K must be a multiple of ", kChunk, ", got ", k);
  const torch::Tensor xc = x.contiguous();
  const torch::Tensor wc = weight.contiguous();
  // The bias is read in place (bf16, like the weight): nothing is converted per call.
  torch::Tensor bc;
  const uint16_t* bp = nullptr;
  if (bias.has_value()) {
    bc = bias->contiguous();
    TORCH_CHECK(bc.scalar_type() == at::kBFloat16, "skinny_linear: bf16 bias");
    TORCH_CHECK(bc.numel() == n, "skinny_linear: bias has ", bc.numel(), " elements, want ", n);
    bp = reinterpret_cast<const uint16_t*>(bc.data_ptr<at::BFloat16>());
  }
  const std::vector<float> xi =
      interleaved_rows(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), m, k);
  torch::Tensor y = torch::empty({m, n}, x.options());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    float out[kMaxRows];
    for (int64_t j = begin; j < end; ++j) {
      dot_rows_any(xi.data(), m, k, wp + j * k, out);
      const float bj = bp != nullptr ? widen(bp[j]) : 0.f;
      for (int64_t r = 0; r < m; ++r) yp[r * n + j] = at::BFloat16(out[r] + bj);
    }
  });
  return y;
}
