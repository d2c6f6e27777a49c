// y = x W^T (+ b) with int8 weights and int8 activations (W8A8), exact in integers where it can
// be: each weight row is quantized once (symmetric, per output channel: w ~ q_w[n, k] * s_w[n]);
// each x row when the layer runs, in groups of kGroup along K (symmetric per token and group: x ~
// q_x[m, k] * s_x[m, g]; one scale per whole row let an outlier channel flatten the rest: on
// SmolLM2-135M top-1 agreement with bf16 fell to 89% and perplexity rose 2.5%). Per group an
// exact int32 dot; the groups then meet in fp32 in one fixed order, each by one fused multiply-add
// (exactly rounded: the same bits as an instruction or a library call):
//   acc = 0; for g in order: acc = fma(float(dot_g), s_x[m, g], acc);   y = acc * s_w[n] (+ b)
// so any row count, any thread count and every instruction set below give the same bits
// (docs/design.md#quantization).
//
// The quantized weight is packed into panels of 64 columns, K in quads: [K/4][64][4] int8, so one
// 64-byte load holds 16 columns x 4 k. Four ways through the same panels for the int32 dots:
// * amx (AMX-INT8): one tdpbssd per 16 rows x 16 columns x one group (64 k: the panel's 16 quads
//   are a B tile as they lie), signed x signed, no offset; rows padded to 16 with zeros. Where K
//   is not whole groups the tile would read past a row, and vnni512 serves instead (the same
//   bits: every path's dots are exact).
// * vnni512 (AVX512-VNNI): vpdpbusd multiplies unsigned x bytes by signed weight bytes and adds
//   each quad to an int32 lane. x is stored offset by 128 (0..254) and each group's 128 * sum_k
//   q_w is taken off again (pack_int8 keeps those sums).
// * avx2: vpmaddubsw on |x| and w given x's sign (vpsignb), then vpmaddwd by ones: a quad's dot
//   per int32 lane (see kernel_avx2). Both operands within [-127, 127], so its int16 pairs never
//   saturate (the usual offset-x form, 254 * 127 * 2, would).
// * scalar: plain loops.
// Columns are only ever partitioned across threads, never the reduction.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define TANDEM_X86 1
#define TANDEM_TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define TANDEM_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define TANDEM_TARGET_AVX512 __attribute__((target("avx512f")))
#endif
#ifdef TANDEM_AMX  // engine/csrc/amx.h
#define TANDEM_TARGET_AMX __attribute__((target("amx-tile,amx-int8")))
#endif

namespace {

constexpr int64_t kWidth = 64;  // columns per panel
constexpr int64_t kMR = 4;      // rows per microkernel (vnni512: 4 x 4 zmm accumulators)
constexpr int64_t kGroup = 64;  // k per activation scale (16 quads)
constexpr int64_t kGroupQuads = kGroup / 4;

constexpr int64_t kTileRows = 16;  // rows per AMX tile
// Most rows shared with spare threads (spare_threads.h): a decode step, or a lone prompt's prefill
// chunk; past it the helpers' buffer (rows x n floats) grows too large to be worth it.
constexpr int64_t kSpareRows = 256;

enum class Path { kScalar, kAvx2, kVnni512, kAmx };

// x quantized: rows of quads (ldx bytes apart) and a scale per row and group.
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> scale;
};

// AMX-INT8 in the CPU, and this process's leave to use the tiles.
bool cpu_has_amx() {
#ifdef TANDEM_AMX
  return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-int8") &&
         tandem_amx::granted();
#else
  return false;
#endif
}

bool cpu_has(Path path) {
  if (path == Path::kAmx) return cpu_has_amx() && cpu_has(Path::kVnni512);
#ifdef TANDEM_X86
  if (path == Path::kVnni512)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
  if (path == Path::kAvx2) return __builtin_cpu_supports("avx2");
#endif
  return path == Path::kScalar;
}

Path parse_path(const std::string& name) {
  if (name == "auto") {
    if (cpu_has(Path::kAmx)) return Path::kAmx;
    if (cpu_has(Path::kVnni512)) return Path::kVnni512;
    if (cpu_has(Path::kAvx2)) return Path::kAvx2;
    return Path::kScalar;
  }
  const Path path = name == "amx"       ? Path::kAmx
                    : name == "vnni512" ? Path::kVnni512
                    : name == "avx2"    ? Path::kAvx2
                    : name == "scalar" ? Path::kScalar
                                       : throw std::invalid_argument("int8_linear: unknown path " + name);
  TORCH_CHECK(cpu_has(path), "int8_linear: this CPU cannot run the ", name, " path");
  return path;
}

int64_t quads(int64_t k) { return (k + 3) / 4; }
int64_t groups(int64_t k) { return (k + kGroup - 1) / kGroup; }

// Where q_w(n, k) lives in the packed panels.
int64_t packed_index(int64_t n, int64_t k, int64_t kq) {
  const int64_t p = n / kWidth, c = n % kWidth;
  return p * kq * kWidth * 4 + (k / 4) * kWidth * 4 + c * 4 + k % 4;
}

// fp32 -> bf16 bits, round to nearest even, NaN -> quiet NaN.
inline uint16_t round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}

// acc[c] = fma(float(dot[c] - comp[c]), s_x, acc[c]) for c < kWidth: one group's dots into the
// row's fp32 sums (comp: the vnni512 offset's 128 * sum of the group's q_w, or none).
inline void accumulate(const int32_t* dot, const int32_t* comp, float sx, float* acc) {
  for (int64_t c = 0; c < kWidth; ++c) {
    const int32_t d = dot[c] - (comp != nullptr ? comp[c] : 0);
    acc[c] = std::fma(static_cast<float>(d), sx, acc[c]);
  }
}

// y[c] = acc[c] * s_w[c] (+ b[c]), each operation rounded on its own (no FMA contraction: the
// same bits whatever the compiler vectorizes), into bf16 or fp32 out.
__attribute__((optimize("fp-contract=off"))) void epilogue(
    const float* acc, const float* ws, const float* bias, int64_t cols, uint16_t* out_bf16,
    float* out_f32) {
  for (int64_t c = 0; c < cols; ++c) {
    float v = acc[c] * ws[c];
    if (bias != nullptr) v = v + bias[c];
    if (out_bf16 != nullptr) {
      out_bf16[c] = round_bf16(v);
    } else {
      out_f32[c] = v;
    }
  }
}

// One group of 64 x values quantized into q as the scalar loop in int8_linear does it, bit for
// bit, 16 at a time; returns the group's amax. amax is a max (order-free; a NaN ignored, as
// std::max(amax, NaN) keeps amax: maxps returns its second operand on a NaN), x * inv rounded
// to nearest even (roundscale = nearbyint), clamped (a NaN -> -127, as std::max(-127, NaN)),
// then narrowed; offset: + 128, read as unsigned (vnni512).
#ifdef TANDEM_X86
TANDEM_TARGET_AVX512 float quantize_group64(const float* x, int8_t* q, bool offset) {
  __m512 v[4];
  __m512 amax = _mm512_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm512_loadu_ps(x + 16 * j);
    amax = _mm512_max_ps(_mm512_abs_ps(v[j]), amax);
  }
  const float a = _mm512_reduce_max_ps(amax);
  const __m512 inv = _mm512_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int j = 0; j < 4; ++j) {
    __m512 t = _mm512_roundscale_ps(_mm512_mul_ps(v[j], inv),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    t = _mm512_min_ps(_mm512_max_ps(t, lo), hi);
    __m512i i = _mm512_cvtps_epi32(t);
    if (offset) i = _mm512_add_epi32(i, _mm512_set1_epi32(128));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16 * j), _mm512_cvtepi32_epi8(i));
  }
  return a;
}

// The same on AVX2 (signed, no offset: only vnni512 reads x offset), 8 at a time (max_ps,
// round_ps and min_ps as their 512-bit twins); the int32s narrowed by signed packs (within
// [-127, 127]: nothing saturates).
TANDEM_TARGET_AVX2 float quantize_group64_avx2(const float* x, int8_t* q) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[8];
  __m256 amax = _mm256_setzero_ps();
  for (int j = 0; j < 8; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    amax = _mm256_max_ps(_mm256_andnot_ps(sign, v[j]), amax);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float a = _mm_cvtss_f32(m4);
  const __m256 inv = _mm256_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  __m256i i[8];
  for (int j = 0; j < 8; ++j) {
    __m256 t = _mm256_round_ps(_mm256_mul_ps(v[j], inv),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    t = _mm256_min_ps(_mm256_max_ps(t, lo), hi);
    i[j] = _mm256_cvtps_epi32(t);
  }
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int j = 0; j < 8; j += 4) {
    // packs works per 128-bit lane: the 32 bytes come out as 4-byte runs in lane order, put
    // back in place by one permute.
    const __m256i w01 = _mm256_packs_epi32(i[j], i[j + 1]);
    const __m256i w23 = _mm256_packs_epi32(i[j + 2], i[j + 3]);
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * j), b);
  }
  return a;
}
#endif

// ---- microkernels: acc[r][0, 64) = sum over kq quads of q_x[r][k] * q_w[k][panel col] ---------
// xq: rows of quads (int8, or uint8 offset by 128 for vnni512), ldx bytes apart; w: the panel's
// quads from the same k.

void kernel_scalar(int rows, const int8_t* xq, int64_t ldx, const int8_t* w, int64_t kq,
                   int32_t* acc) {
  for (int r = 0; r < rows; ++r) {
    int32_t* out = acc + r * kWidth;
    std::fill(out, out + kWidth, 0);
    const int8_t* x = xq + r * ldx;
    for (int64_t q = 0; q < kq; ++q) {
      const int8_t* wq = w + q * kWidth * 4;
      for (int64_t c = 0; c < kWidth; ++c)
        for (int j = 0; j < 4; ++j) out[c] += int32_t{x[4 * q + j]} * int32_t{wq[c * 4 + j]};
    }
  }
}

#ifdef TANDEM_X86
template <int MR>
TANDEM_TARGET_VNNI void kernel_vnni(const uint8_t* xq, int64_t ldx, const int8_t* w, int64_t kq,
                                    int32_t* acc) {
  __m512i a[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) a[r][j] = _mm512_setzero_si512();
  for (int64_t q = 0; q < kq; ++q) {
    const int8_t* wq = w + q * kWidth * 4;
    const __m512i w0 = _mm512_loadu_si512(wq), w1 = _mm512_loadu_si512(wq + 64);
    const __m512i w2 = _mm512_loadu_si512(wq + 128), w3 = _mm512_loadu_si512(wq + 192);
    for (int r = 0; r < MR; ++r) {
      int32_t quad;
      std::memcpy(&quad, xq + r * ldx + 4 * q, sizeof(quad));
      const __m512i xb = _mm512_set1_epi32(quad);
      a[r][0] = _mm512_dpbusd_epi32(a[r][0], xb, w0);
      a[r][1] = _mm512_dpbusd_epi32(a[r][1], xb, w1);
      a[r][2] = _mm512_dpbusd_epi32(a[r][2], xb, w2);
      a[r][3] = _mm512_dpbusd_epi32(a[r][3], xb, w3);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j)
      _mm512_storeu_si512(acc + r * kWidth + 16 * j, a[r][j]);
}

// MR rows x the panel's 64 columns, 8 * NJ at a time: per 8 columns a ymm of int32 dots, one
// lane a column. vpmaddubsw multiplies unsigned by signed bytes and adds each pair into int16,
// saturating; fed |x| and w given x's sign (vpsignb) -- both within [-127, 127]: the quantizer
// clamps x, pack_int8 refuses a -128 weight -- a pair is at most 2 * 127 * 127 = 32258 and never
// saturates. vpmaddwd by ones then adds a quad's two pairs into its column's int32. One row
// takes all 64 columns in one pass, reading the panel in order (a decode step streams its
// weights from memory); more rows take fewer columns per pass, to keep MR * NJ sums in registers.
template <int MR, int NJ>
TANDEM_TARGET_AVX2 void kernel_avx2(const int8_t* xq, int64_t ldx, const int8_t* w, int64_t kq,
                                    int32_t* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t c0 = 0; c0 < kWidth; c0 += 8 * NJ) {
    __m256i a[MR][NJ];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NJ; ++j) a[r][j] = _mm256_setzero_si256();
    for (int64_t q = 0; q < kq; ++q) {
      const int8_t* wq = w + q * kWidth * 4 + c0 * 4;
      __m256i wv[NJ];
      for (int j = 0; j < NJ; ++j)
        wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + 32 * j));
      for (int r = 0; r < MR; ++r) {
        int32_t quad;
        std::memcpy(&quad, xq + r * ldx + 4 * q, sizeof(quad));
        const __m256i xb = _mm256_set1_epi32(quad);
        const __m256i ax = _mm256_abs_epi8(xb);
        for (int j = 0; j < NJ; ++j) {
          const __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[j], xb));
          a[r][j] = _mm256_add_epi32(a[r][j], _mm256_madd_epi16(p, ones));
        }
      }
    }
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NJ; ++j)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + r * kWidth + c0 + 8 * j), a[r][j]);
  }
}
#endif

#ifdef TANDEM_AMX
// Tiles as tandem_amx::configure sets them: tmm0-3 16 rows x 16 int32 dots, tmm4 16 rows of x
// (one group), tmm5-6 the group's 16 quads x 16 columns x 4.
// dots[16][64] = one group's int32 dots of 16 x rows (ldx bytes apart) with a panel's group w.
TANDEM_TARGET_AMX void kernel_amx(const int8_t* xq, int64_t ldx, const int8_t* w, int32_t* dots) {
  constexpr int64_t stride = kWidth * 4, out = kWidth * 4;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, xq, ldx);
  _tile_loadd(5, w, stride);
  _tile_dpbssd(0, 4, 5);
  _tile_loadd(6, w + 64, stride);
  _tile_dpbssd(1, 4, 6);
  _tile_loadd(5, w + 128, stride);
  _tile_dpbssd(2, 4, 5);
  _tile_loadd(6, w + 192, stride);
  _tile_dpbssd(3, 4, 6);
  _tile_stored(0, dots, out);
  _tile_stored(1, dots + 16, out);
  _tile_stored(2, dots + 32, out);
  _tile_stored(3, dots + 48, out);
}
#endif

void run_rows(Path path, int rows, const void* xq, int64_t ldx, const int8_t* w, int64_t kq,
              int32_t* acc) {
#ifdef TANDEM_X86
  if (path == Path::kVnni512) {
    const auto* x = static_cast<const uint8_t*>(xq);
    switch (rows) {
      case 1: return kernel_vnni<1>(x, ldx, w, kq, acc);
      case 2: return kernel_vnni<2>(x, ldx, w, kq, acc);
      case 3: return kernel_vnni<3>(x, ldx, w, kq, acc);
      default: return kernel_vnni<4>(x, ldx, w, kq, acc);
    }
  }
  if (path == Path::kAvx2) {
    const auto* x = static_cast<const int8_t*>(xq);
    switch (rows) {
      case 1: return kernel_avx2<1, 8>(x, ldx, w, kq, acc);
      case 2: return kernel_avx2<2, 4>(x, ldx, w, kq, acc);
      case 3: return kernel_avx2<3, 2>(x, ldx, w, kq, acc);
      default: return kernel_avx2<4, 2>(x, ldx, w, kq, acc);
    }
  }
#endif
  kernel_scalar(rows, static_cast<const int8_t*>(xq), ldx, w, kq, acc);
}

}  // namespace

// Whether this CPU runs ``path`` ("vnni512", "avx2", "scalar"); "auto" names the one chosen.
std::string int8_path(const std::string& name) {
  const Path path = parse_path(name);
  if (path == Path::kAmx) return "amx";
  return path == Path::kVnni512 ? "vnni512" : path == Path::kAvx2 ? "avx2" : "scalar";
}

bool int8_path_supported(const std::string& name) {
  if (name == "amx") return cpu_has(Path::kAmx);
  if (name == "vnni512") return cpu_has(Path::kVnni512);
  if (name == "avx2") return cpu_has(Path::kAvx2);
  return name == "scalar" || name == "auto";
}

// q_w [N, K] int8 -> (its panels [N/64 rounded up][K/4 rounded up][64][4] int8, 1-D; for each
// group of kGroup k, 128 * the sum of each column's q_w there, int32 [groups][N]: what the
// vnni512 path's offset x adds, taken off again).
std::vector<torch::Tensor> pack_int8(torch::Tensor qweight) {
  TORCH_CHECK(qweight.dim() == 2 && qweight.device().is_cpu() &&
                  qweight.scalar_type() == at::kChar,
              "pack_int8: CPU int8 weight [N, K]");
  const int64_t n = qweight.size(0), k = qweight.size(1), kq = quads(k), ng = groups(k);
  const int64_t panels = (n + kWidth - 1) / kWidth;
  const torch::Tensor wc = qweight.contiguous();
  // The avx2 path negates weights (vpsignb): -128 has no int8 negation.
  TORCH_CHECK(n * k == 0 || wc.min().item<int8_t>() > -128,
              "pack_int8: weights must lie in [-127, 127] (symmetric int8); -128 found");
  torch::Tensor packed = torch::zeros({panels * kq * kWidth * 4}, qweight.options());
  torch::Tensor comp = torch::zeros({ng, n}, qweight.options().dtype(at::kInt));
  const int8_t* src = wc.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  int32_t* cp = comp.data_ptr<int32_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      for (int64_t col = 0; col < k; ++col) {
        dst[packed_index(row, col, kq)] = src[row * k + col];
        cp[(col / kGroup) * n + row] += 128 * int32_t{src[row * k + col]};
      }
  });
  return {packed, comp};
}

// x [M, K] (bf16 or fp32), packed/comp from pack_int8(q_w [n, K]), w_scale [n] fp32, optional
// bias [n] -> y [M, n] in x's dtype. ``path``: "auto" or one this CPU runs (int8_path_supported).
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor comp,
                          torch::Tensor w_scale, int64_t n, c10::optional<torch::Tensor> bias,
                          const std::string& path_name) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "int8_linear: CPU x [M, K]");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "int8_linear: float32 or bfloat16 x");
  Path path = parse_path(path_name);
  const int64_t m = x.size(0), k = x.size(1), kq = quads(k), ng = groups(k);
  if (path == Path::kAmx && k % kGroup != 0) path = Path::kVnni512;  // see the header
  const bool tiles = path == Path::kAmx;
  const int64_t panels = (n + kWidth - 1) / kWidth;
  TORCH_CHECK(packed.numel() == panels * kq * kWidth * 4, "int8_linear: packed size mismatch");
  TORCH_CHECK(comp.numel() == ng * n && w_scale.numel() == n,
              "int8_linear: group sums / scales size mismatch");
  const torch::Tensor xf = x.to(at::kFloat).contiguous();
  const torch::Tensor sc = w_scale.to(at::kFloat).contiguous();
  const torch::Tensor cc = comp.to(at::kInt).contiguous();
  torch::Tensor bc;
  if (bias.has_value()) {
    bc = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bc.numel() == n, "int8_linear: bias has ", bc.numel(), " elements, want ", n);
  }
  const float* bp = bias.has_value() ? bc.data_ptr<float>() : nullptr;
  torch::Tensor y = torch::empty({m, n}, x.options());
  if (m == 0) return y;

  // Each row quantized group by group: s = amax / 127, q = round-to-nearest-even(x * (127 /
  // amax)). Plain IEEE operations, element by element: the same bits on every CPU.
  const int64_t ldx = kq * 4;
  const bool offset = path == Path::kVnni512;
  // amx reads whole tiles of 16 rows: the rows past m are zeros (their dots are never used).
  const int64_t mp = tiles ? (m + kTileRows - 1) / kTileRows * kTileRows : m;
  // Shared with the spare threads' jobs, which may outlive this call (spare_threads.h).
  auto quantized = std::make_shared<QuantizedX>();
  std::vector<int8_t>& xq = quantized->q;
  std::vector<float>& x_scale = quantized->scale;
  xq.assign(mp * ldx, 0);
  x_scale.resize(m * ng);
  const float* xp = xf.data_ptr<float>();
  // Whole groups quantized by the path's own instruction set (so each path's test covers its
  // quantizer too), the rest by the loop below: the same bits.
  const Path quantizer = path == Path::kAmx ? Path::kVnni512 : path;
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * k;
      int8_t* q = xq.data() + r * ldx;
      for (int64_t g = 0; g < ng; ++g) {
        const int64_t k0 = g * kGroup, k1 = std::min(k, k0 + kGroup);
#ifdef TANDEM_X86
        if (k1 - k0 == kGroup && quantizer != Path::kScalar) {
          const float amax = quantizer == Path::kVnni512
                                 ? quantize_group64(row + k0, q + k0, offset)
                                 : quantize_group64_avx2(row + k0, q + k0);
          x_scale[r * ng + g] = amax / 127.0f;
          continue;
        }
#endif
        float amax = 0.0f;
        for (int64_t c = k0; c < k1; ++c) amax = std::max(amax, std::fabs(row[c]));
        x_scale[r * ng + g] = amax / 127.0f;
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int64_t c = k0; c < k1; ++c) {
          const float v = std::nearbyint(row[c] * inv);
          const int32_t i = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, v)));
          // vnni512 reads unsigned bytes: x + 128 (0..254). The padding past k stays 0: it
          // meets q_w = 0 there, and the group's offset sum counts only real columns.
          q[c] = offset ? static_cast<int8_t>(static_cast<uint8_t>(i + 128)) : static_cast<int8_t>(i);
        }
      }
    }
  });

  const float* ws = sc.data_ptr<float>();
  uint16_t* yb = bf16 ? reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) : nullptr;
  float* yf = bf16 ? nullptr : y.data_ptr<float>();
  const int64_t rows_step = tiles ? kTileRows : kMR;
  // Rows [r0, r0 + rows) of panel p into acc (rows x kWidth fp32 sums, before the epilogue).
  // Everything it reads it holds (the spare threads may run it after this call returns).
  auto panel_sums = [quantized, packed, cc, path, n, kq, ng, ldx, offset, tiles](
                        int64_t p, int64_t r0, int rows, float* acc, int32_t* dots,
                        int32_t* comp_cols) {
    const int64_t n0 = p * kWidth, cols = std::min(kWidth, n - n0);
    const int8_t* panel = packed.data_ptr<int8_t>() + p * kq * kWidth * 4;
    const int32_t* cp = cc.data_ptr<int32_t>();
    std::fill(acc, acc + rows * kWidth, 0.0f);
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t q0 = g * kGroupQuads, nq = std::min(kq, q0 + kGroupQuads) - q0;
      const int8_t* xg = quantized->q.data() + r0 * ldx + 4 * q0;
#ifdef TANDEM_AMX
      if (tiles) {
        kernel_amx(xg, ldx, panel + q0 * kWidth * 4, dots);
      } else
#endif
        run_rows(path, rows, xg, ldx, panel + q0 * kWidth * 4, nq, dots);
      const int32_t* comp_g = nullptr;
      if (offset) {
        std::fill(comp_cols, comp_cols + kWidth, 0);
        std::copy(cp + g * n + n0, cp + g * n + n0 + cols, comp_cols);
        comp_g = comp_cols;
      }
      for (int r = 0; r < rows; ++r)
        accumulate(dots + r * kWidth, comp_g, quantized->scale[(r0 + r) * ng + g],
                   acc + r * kWidth);
    }
  };
  auto write_rows = [&](int64_t p, int64_t r0, int rows, const float* acc) {
    const int64_t n0 = p * kWidth, cols = std::min(kWidth, n - n0);
    for (int r = 0; r < rows; ++r) {
      const int64_t at = (r0 + r) * n + n0;
      epilogue(acc + r * kWidth, ws + n0, bp != nullptr ? bp + n0 : nullptr, cols,
               bf16 ? yb + at : nullptr, bf16 ? nullptr : yf + at);
    }
  };
  tandem_spare::Pool* spare = tandem_spare::attached();
  if (m <= kSpareRows && spare != nullptr && spare->active() && at::get_num_threads() == 1) {
    // Up to kSpareRows rows: a panel is a chunk, shared with the spare threads (spare_threads.h).
    // amx: whichever thread computes a chunk configures its own tiles for it.
    auto compute = [panel_sums, m, rows_step, tiles](int64_t p, float* acc) {
      thread_local std::vector<int32_t> dots, comp_cols(kWidth);
      dots.resize(rows_step * kWidth);
#ifdef TANDEM_AMX
      if (tiles) tandem_amx::configure();
#endif
      for (int64_t r0 = 0; r0 < m; r0 += rows_step) {
        const int rows = static_cast<int>(std::min(rows_step, m - r0));
        panel_sums(p, r0, rows, acc + r0 * kWidth, dots.data(), comp_cols.data());
      }
#ifdef TANDEM_AMX
      if (tiles) tandem_amx::release();
#endif
    };
    spare->run(panels, m * kWidth, compute,
               [&](int64_t p, const float* acc) { write_rows(p, 0, static_cast<int>(m), acc); });
    return y;
  }
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<int32_t> dots(rows_step * kWidth);
    std::vector<int32_t> comp_cols(kWidth);
    std::vector<float> acc(rows_step * kWidth);
#ifdef TANDEM_AMX
    if (tiles) tandem_amx::configure();
#endif
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t r0 = 0; r0 < m; r0 += rows_step) {
        const int rows = static_cast<int>(std::min(rows_step, m - r0));
        panel_sums(p, r0, rows, acc.data(), dots.data(), comp_cols.data());
        write_rows(p, r0, rows, acc.data());
      }
    }
#ifdef TANDEM_AMX
    if (tiles) tandem_amx::release();
#endif
  });
  return y;
}

// Share few-row calls with the process's spare threads (the spare_threads extension's pool).
void attach_spare_pool(int64_t address) {
  tandem_spare::attached() = reinterpret_cast<tandem_spare::Pool*>(address);
}
