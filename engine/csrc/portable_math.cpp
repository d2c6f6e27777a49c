// The float math whose bits must not depend on the CPU (docs/design.md#numerics-classes): the
// sampler's row sums, exp and log, and RoPE's cos and sin.
//
// PyTorch's exp, log, cos and sin on CPU call MKL's vector math, which picks its code by the CPU
// it finds -- ATEN_CPU_CAPABILITY does not reach it -- and an Intel Xeon and an AMD EPYC gave
// log(82.795166f) one float apart (found 2026-12-05: the portable class's recorded logprobs
// missed on the EPYC in one row of 48). Here each function is a fixed sequence of IEEE-754
// adds, multiplies, divides and conversions, each rounded once: this file builds with
// -ffp-contract=off (engine/kernels.py), so the compiler fuses no multiply-add, and a loop
// vectorised to any width computes every element as the scalar code does.
// tests/engine/test_portable_math.py replays exp and log op for op in numpy float32.
//
// * exp, log: float32 throughout, Cephes' expf / logf reductions and polynomials (about 1 ulp).
// * cos_sin: double throughout, rounded once to float32 (nearly always the correctly rounded
//   value); the argument is reduced by pi/2 in three parts, exact for |x| < 2^20 (RoPE's angles
//   are position * inv_freq <= the context length).
// * row_sum: each row by one thread into 8 double accumulators (element i into i % 8),
//   combined in a fixed tree, then the tail: a function of the row alone. torch's sum splits a
//   long row (over its 32,768-element grain) across threads when rows are few -- a one-sequence
//   step over a 49,152-token vocabulary summed differently on one thread than on two -- and
//   its vector width follows the CPU.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kGrain = 1 << 14;  // elements per parallel task

inline float log_one(float x) {
  // A subnormal is scaled into the normals first (exact).
  const bool subnormal = x < 1.17549435e-38f;
  const uint32_t u = to_bits(subnormal ? x * 8388608.0f : x);
  // x = m 2^e with m in [0.5, 1), then m in [sqrt(0.5), sqrt(2)) less 1.
  const int scaled = static_cast<int>((u >> 23) & 0xffu) - 126 - (subnormal ? 23 : 0);
  const float m0 = from_bits((u & 0x807fffffu) | 0x3f000000u);
  const bool low = m0 < 0.707106781186547524f;
  const float m = (low ? m0 + m0 : m0) - 1.0f;
  const float fe = static_cast<float>(scaled - (low ? 1 : 0));
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m + -1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m + -1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m + -1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m + -2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = (y * m) * z;
  y = y + fe * -2.12194440e-4f;
  y = y + -0.5f * z;
  const float v = (m + y) + fe * 0.693359375f;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const float special = x == 0.0f ? -kInf : x == kInf ? kInf : std::numeric_limits<float>::quiet_NaN();
  return x > 0.0f && x < kInf ? v : special;  // NaN, negatives: NaN
}

// cos and sin of x: x = k pi/2 + r, |r| <= pi/4, then Taylor series in r (last term's
// remainder < 1e-19) and the quadrant k mod 4.
void cos_sin_one(float xf, float* c, float* s) {
  const double x = xf;
  if (!(std::fabs(x) < 1e300)) {  // inf or NaN
    *c = *s = std::numeric_limits<float>::quiet_NaN();
    return;
  }
  // pi/2 in three parts of 33 bits: k * part is exact for |k| < 2^20.
  constexpr double kPio2A = 1.57079632673412561417e+00;
  constexpr double kPio2B = 6.07710050630396597660e-11;
  constexpr double kPio2C = 2.02226624871116645580e-21;
  const double k = round_even(x * 6.36619772367581382433e-01);
  const double r = ((x - k * kPio2A) - k * kPio2B) - k * kPio2C;
  const double t = r * r;
  // Highest power first: sin r = r (1 - t/3! + t^2/5! - ... + t^8/17!), cos r = 1 - t/2! + ...
  constexpr double kSin[] = {1.0 / 355687428096000.0, -1.0 / 1307674368000.0,
                             1.0 / 6227020800.0,      -1.0 / 39916800.0,
                             1.0 / 362880.0,          -1.0 / 5040.0,
                             1.0 / 120.0,             -1.0 / 6.0,
                             1.0};
  constexpr double kCos[] = {1.0 / 20922789888000.0, -1.0 / 87178291200.0, 1.0 / 479001600.0,
                             -1.0 / 3628800.0,       1.0 / 40320.0,        -1.0 / 720.0,
                             1.0 / 24.0,             -1.0 / 2.0,           1.0};
  double sn = kSin[0], cs = kCos[0];
  for (int i = 1; i < 9; ++i) {
    sn = sn * t + kSin[i];
    cs = cs * t + kCos[i];
  }
  sn = sn * r;
  const int64_t q = static_cast<int64_t>(k) & 3;
  const double cq = q == 0 ? cs : q == 1 ? -sn : q == 2 ? -cs : sn;
  const double sq = q == 0 ? sn : q == 1 ? cs : q == 2 ? -sn : -cs;
  *c = static_cast<float>(cq);
  *s = static_cast<float>(sq);
}

// One row's sum in the fixed order of the header: element i into accumulator i % 8 (whole
// groups of 8), the rest into a tail, combined in a fixed tree.
inline float combine(const double* acc, double tail) {
  const double body =
      ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
  return static_cast<float>(body + tail);
}

float sum_row(const float* p, int64_t cols) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= cols; i += 8) {
    for (int k = 0; k < 8; ++k) acc[k] += static_cast<double>(p[i + k]);
  }
  double tail = 0;
  for (; i < cols; ++i) tail += static_cast<double>(p[i]);
  return combine(acc, tail);
}

void check_float(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(), name,
              " takes a contiguous float32 CPU tensor");
}

template <float (*F)(float)>
at::Tensor elementwise(const at::Tensor& x, const char* name) {
  check_float(x, name);
  at::Tensor out = at::empty_like(x);
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) o[i] = F(in[i]);
  });
  return out;
}

}  // namespace

at::Tensor portable_exp(at::Tensor x) { return elementwise<exp_one>(x, "portable_exp"); }

at::Tensor portable_log(at::Tensor x) { return elementwise<log_one>(x, "portable_log"); }

// x [...] -> [2, ...]: cos then sin.
at::Tensor cos_sin(at::Tensor x) {
  check_float(x, "cos_sin");
  std::vector<int64_t> shape{2};
  shape.insert(shape.end(), x.sizes().begin(), x.sizes().end());
  at::Tensor out = at::empty(shape, x.options());
  const int64_t n = x.numel();
  const float* in = x.data_ptr<float>();
  float* c = out.data_ptr<float>();
  float* s = c + n;
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) cos_sin_one(in[i], c + i, s + i);
  });
  return out;
}

// x [R, V] float32, contiguous -> [R, 1] float32.
at::Tensor row_sum(at::Tensor x) {
  check_float(x, "row_sum");
  TORCH_CHECK(x.dim() == 2, "row_sum takes a [R, V] tensor");
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor out = at::empty({rows, 1}, x.options());
  const float* in = x.data_ptr<float>();
  float* sums = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) sums[r] = sum_row(in + r * cols, cols);
  });
  return out;
}

// -- the sampler's draw (engine/sampler.py: _tempered_probs, top_p_mask, _renormalise, _draw) --

namespace {

// sum_row of x[0..cols) where only the entries at ``at`` (ascending) may be nonzero: adding
// +0.0 changes no accumulator, so skipping the others is exact.
float sparse_row_sum(const float* x, const std::vector<int32_t>& at, int64_t cols) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  double tail = 0;
  const int64_t body_end = cols - cols % 8;
  for (const int32_t i : at) {
    if (i < body_end) {
      acc[i % 8] += static_cast<double>(x[i]);
    } else {
      tail += static_cast<double>(x[i]);
    }
  }
  return combine(acc, tail);
}

// A token's place in the stable descending sort as one integer: larger is earlier (more
// probable, or as probable with a smaller id; the bits of p >= 0 order as its values).
inline uint64_t rank_key(const float* p, int64_t i) {
  return (static_cast<uint64_t>(to_bits(p[i])) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
}

// top_p_mask's keep set of probabilities p[0..cols) (ascending ids): the smallest prefix of the
// stable descending order whose float64 cumulative mass reaches target, by the same additions
// and comparisons. Candidates are every token at least as probable as a threshold -- always a
// prefix of that order -- chosen from a histogram of the float bits (monotone in the value for
// p >= 0), lowered until their mass reaches the target, at worst to the whole row.
std::vector<int32_t> top_p_keep(const float* p, int64_t cols, double target) {
  constexpr int kShift = 20;  // 2^11 buckets: the exponent and 3 mantissa bits
  constexpr int kBuckets = 1 << 11;
  // Four histograms, element i into i % 4, so that a run of tokens in one bucket is four
  // chains of additions, not one (the sums only guide the threshold).
  std::vector<double> lanes(4 * kBuckets, 0.0), mass(kBuckets);
  int64_t i = 0;
  for (; i + 4 <= cols; i += 4) {
    for (int k = 0; k < 4; ++k) lanes[k * kBuckets + (to_bits(p[i + k]) >> kShift)] += p[i + k];
  }
  for (; i < cols; ++i) lanes[to_bits(p[i]) >> kShift] += p[i];
  for (int b = 0; b < kBuckets; ++b) {
    mass[b] = (lanes[b] + lanes[kBuckets + b]) + (lanes[2 * kBuckets + b] + lanes[3 * kBuckets + b]);
  }
  const double threshold = target - 1e-6;  // engine/sampler.py's _MASS_TOL
  std::vector<uint64_t> cand;
  std::vector<int32_t> keep;
  int bucket = kBuckets;
  double guess = 0;
  while (true) {
    // Lower the threshold bucket until the guessed mass clears the target by a margin (and by
    // one bucket more each time the candidates still fell short).
    if (bucket > 0) guess += mass[--bucket];
    while (bucket > 0 && !(guess >= target + 1e-4)) guess += mass[--bucket];
    cand.clear();
    for (int64_t j = 0; j < cols; ++j) {
      if (static_cast<int>(to_bits(p[j]) >> kShift) >= bucket) cand.push_back(rank_key(p, j));
    }
    std::sort(cand.begin(), cand.end(), std::greater<uint64_t>());
    keep.clear();
    double total = 0;
    for (size_t j = 0; j < cand.size(); ++j) {
      const int32_t id = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(cand[j]));
      const double pj = p[id];
      total += pj;
      if (j == 0 || total - pj < threshold) keep.push_back(id);
    }
    if (!(total < threshold) || bucket == 0) break;  // reached, or the whole row
  }
  std::sort(keep.begin(), keep.end());
  return keep;
}

// _draw's token for probabilities q nonzero only at ``at`` (ascending): cdf_i is the float of
// the running float64 sum (torch's float cumsum), total its last value, x = u * total; the
// first i with cdf_i > x, capped at the first with cdf_i >= total (the last positive token).
int64_t draw(const float* q, const std::vector<int32_t>& at, int64_t cols, float u) {
  double acc = 0;
  for (const int32_t i : at) acc += static_cast<double>(q[i]);
  const float total = static_cast<float>(acc);
  const float x = u * total;
  int64_t index = cols, last = 0.0f >= total ? 0 : cols;
  acc = 0;
  for (const int32_t i : at) {
    acc += static_cast<double>(q[i]);
    const float cdf = static_cast<float>(acc);
    if (index == cols && cdf > x) index = i;
    if (last == cols && cdf >= total) last = i;
    if (index != cols && last != cols) break;
  }
  return std::min(index, last);
}

}  // namespace

// One token per row of float32 z [R, V]: softmax(z / T) as _tempered_probs computes it, top_p's
// mask and renormalisation where top_p < 1, and the inverse-CDF draw at u -- the operations of
// engine/sampler.py's torch path, in the same order, each row in cache. temps and uniforms
// float32 [R], top_p float64 [R]. -1 for a row holding NaN or +inf, or only -inf (the torch path
// takes those).
at::Tensor sample_top_p(at::Tensor z, at::Tensor temps, at::Tensor top_p, at::Tensor uniforms) {
  check_float(z, "sample_top_p");
  TORCH_CHECK(z.dim() == 2, "sample_top_p takes a [R, V] tensor");
  const int64_t rows = z.size(0), cols = z.size(1);
  TORCH_CHECK(temps.numel() == rows && top_p.numel() == rows && uniforms.numel() == rows,
              "sample_top_p: one temperature, top_p and uniform per row");
  at::Tensor t = temps.contiguous().to(at::kFloat), u = uniforms.contiguous().to(at::kFloat);
  at::Tensor tp = top_p.contiguous().to(at::kDouble);
  at::Tensor out = at::empty({rows}, z.options().dtype(at::kLong));
  const float* zp = z.data_ptr<float>();
  const float* tv = t.data_ptr<float>();
  const float* uv = u.data_ptr<float>();
  const double* pv = tp.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p(cols);
    std::vector<int32_t> all(cols);
    for (int64_t i = 0; i < cols; ++i) all[i] = static_cast<int32_t>(i);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = zp + r * cols;
      float m = -std::numeric_limits<float>::infinity();
      bool nan = false;
      for (int64_t i = 0; i < cols; ++i) {
        nan |= x[i] != x[i];
        m = x[i] > m ? x[i] : m;
      }
      if (nan || !std::isfinite(m)) {
        o[r] = -1;
        continue;
      }
      for (int64_t i = 0; i < cols; ++i) p[i] = exp_one((x[i] - m) / tv[r]);
      const float s = sum_row(p.data(), cols);
      for (int64_t i = 0; i < cols; ++i) p[i] = p[i] / s;
      if (pv[r] < 1.0) {
        const std::vector<int32_t> keep = top_p_keep(p.data(), cols, pv[r]);
        const float kept = sparse_row_sum(p.data(), keep, cols);
        for (const int32_t i : keep) p[i] = p[i] / kept;
        o[r] = draw(p.data(), keep, cols, uv[r]);
      } else {
        o[r] = draw(p.data(), all, cols, uv[r]);
      }
    }
  });
  return out;
}
