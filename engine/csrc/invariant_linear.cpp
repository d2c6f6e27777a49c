// y = x W^T (+ b), batch-invariant: every output element y[m, n] is reduced over K in one fixed
// order -- k = 0, 1, ..., K-1 into one fp32 accumulator -- whatever M is, wherever row m sits in
// the batch, and however many threads run. Rows and columns are only ever partitioned (tiles,
// threads), never the reduction, so a token's output is the same bits alone or in a batch of 64.
// BLAS/oneDNN GEMMs pick kernels and K splits by shape, so their bits depend on M (issue 16).
//
// The weight is packed once (pack_linear) into column panels read in k order, in one of three
// layouts, each its own bits (docs/design.md#numerics-classes):
// * tiles (bf16, CPUs with AMX-BF16): the pairs panels below with K padded with zeros to whole
//   32s; one tdpbf16ps per 16 rows x 16 columns x 32 k adds into an fp32 tile accumulator. AMX
//   rounds its 32-k step its own way (not vdpbf16ps's bits), but each row of a tile is computed
//   apart from the others -- the same bits whichever tile row it sits in and however many rows
//   the tile holds (checked on one AMX Xeon model: tests/engine/test_determinism.py)
//   -- so rows are padded to 16 and the order over K is fixed: batch-invariant.
// * pairs (bf16, CPUs with AVX512-BF16): panels of 64 columns, K in pairs ([K/2][64][2]); one
//   vdpbf16ps per 16 columns and k pair adds the pair's two products to the fp32 accumulator.
// * columns (AVX2 FMA): panels of 16 columns ([K][16]); one FMA per k, x widened to fp32. bf16
//   panels keep columns c and c+8 side by side, so one load widens to two fp32 vectors by a
//   shift and a mask; fp32 panels (an fp32 model's) hold them in order.
// x and the weight share a dtype (the model's).
// A microkernel keeps MR rows x one panel of accumulators in registers (or tiles) over the whole
// K; the result gets the bias in fp32 and is rounded once to the output dtype.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TANDEM_AVX2 1
#endif
#if defined(__x86_64__) && defined(TANDEM_AVX2)
// Built for every x86-64 compiler that knows AVX512-BF16, run where the CPU has it.
#define TANDEM_AVX512BF16 1
#define TANDEM_TARGET_BF16 __attribute__((target("avx512f,avx512bf16")))
#endif
#ifdef TANDEM_AMX  // engine/csrc/amx.h
#define TANDEM_TARGET_AMX __attribute__((target("avx512f,avx512bf16,amx-tile,amx-bf16")))
#endif

namespace {

// Most rows shared with spare threads (spare_threads.h): a decode step, or a lone prompt's prefill
// chunk; past it the helpers' buffer (rows x n floats) grows too large to be worth it.
constexpr int64_t kSpareRows = 256;
constexpr int64_t kMR = 6;  // rows per microkernel: 6 x 4 zmm (or 6 x 2 ymm) accumulators

constexpr int64_t kPanelPairs = 64;
constexpr int64_t kPanelColumns = 16;
constexpr int64_t kTileRows = 16;  // rows per AMX tile
constexpr int64_t kTileK = 32;     // k per tdpbf16ps (16 pairs)

enum class Layout { kColumns, kPairs, kTiles };

Layout parse_layout(const std::string& name) {
  if (name == "columns") return Layout::kColumns;
  if (name == "pairs") return Layout::kPairs;
  TORCH_CHECK(name == "tiles", "invariant_linear: unknown layout '", name,
              "' (tiles, pairs or columns)");
  return Layout::kTiles;
}

inline float widen(uint16_t bits) {
  const uint32_t w = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

// fp32 -> bf16 bits, round to nearest even, NaN -> quiet NaN (at::BFloat16's rounding), written
// branch-free so the epilogue loops vectorize.
inline uint16_t round_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t{0x7fc0} : static_cast<uint16_t>(rounded);
}

// out[c] = tile[c] + bias[c] (no bias: tile[c]), rounded to T, for c < cols.
template <typename T>
inline void epilogue(const float* tile, const float* bias, int64_t cols, T* out) {
  if (bias != nullptr) {
    for (int64_t c = 0; c < cols; ++c) {
      const float v = tile[c] + bias[c];
      if constexpr (std::is_same_v<T, float>) out[c] = v; else out[c] = round_bf16(v);
    }
  } else {
    for (int64_t c = 0; c < cols; ++c) {
      if constexpr (std::is_same_v<T, float>) out[c] = tile[c]; else out[c] = round_bf16(tile[c]);
    }
  }
}

int64_t panel_width(Layout layout) {
  return layout == Layout::kColumns ? kPanelColumns : kPanelPairs;
}
// Rows of k per panel in the packed layout (K rounded up to whole pairs, or 32s for tiles).
int64_t packed_k(Layout layout, int64_t k) {
  if (layout == Layout::kTiles) return (k + kTileK - 1) / kTileK * kTileK;
  return layout == Layout::kPairs ? (k + 1) / 2 * 2 : k;
}

// Where weight (n, k) lives in the packed buffer (tiles: the pairs panels, K padded further).
int64_t packed_index(Layout layout, bool bf16, int64_t n, int64_t k, int64_t kp) {
  const int64_t width = panel_width(layout), p = n / width, c = n % width;
  const int64_t base = p * kp * width;
  if (layout != Layout::kColumns) return base + (k / 2) * width * 2 + c * 2 + k % 2;
  if (!bf16) return base + k * width + c;
  return base + k * width + (c < 8 ? 2 * c : 2 * (c - 8) + 1);
}

bool cpu_has_bf16_pairs() {
#ifdef TANDEM_AVX512BF16
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

// AMX-BF16 in the CPU, and this process's leave to use the tiles.
bool cpu_has_tiles() {
#ifdef TANDEM_AMX
  return cpu_has_bf16_pairs() && __builtin_cpu_supports("amx-tile") &&
         __builtin_cpu_supports("amx-bf16") && tandem_amx::granted();
#else
  return false;
#endif
}

bool layout_supported(Layout layout) {
  if (layout == Layout::kTiles) return cpu_has_tiles();
  if (layout == Layout::kPairs) return cpu_has_bf16_pairs();
  return true;
}

// ---- microkernels: out[r][0, width) = sum_k x[r][k] * W[k][panel col], r < MR ---------------

#ifdef TANDEM_AVX512BF16
template <int MR>
TANDEM_TARGET_BF16 void kernel_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t kp, float* out) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < kp / 2; ++kk) {
    const uint16_t* wk = w + kk * 128;
    const __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + 32);
    const __m512i w2 = _mm512_loadu_si512(wk + 64), w3 = _mm512_loadu_si512(wk + 96);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * kk, sizeof(pair));
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, (__m512bh)w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, (__m512bh)w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, (__m512bh)w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, (__m512bh)w3);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(out + r * 64 + 16 * j, acc[r][j]);
}
#endif

#ifdef TANDEM_AMX
// Tiles as tandem_amx::configure sets them: tmm0-3 16 rows x 64 fp32 columns (4 tiles of 16);
// tmm4 16 rows of x, 32 k; tmm5-6 the weight, 16 k pairs x 16 columns x 2.
// out[16][64] = x[16 rows, kp] W^T for one 64-column panel (pairs layout, kp a multiple of 32).
TANDEM_TARGET_AMX void kernel_tiles(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t kp,
                                    float* out) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t x_stride = ldx * 2, w_stride = kPanelPairs * 2 * 2;
  for (int64_t k0 = 0; k0 < kp; k0 += kTileK) {
    const uint16_t* wk = w + k0 / 2 * kPanelPairs * 2;
    _tile_loadd(4, x + k0, x_stride);
    _tile_loadd(5, wk, w_stride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, wk + 32, w_stride);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, wk + 64, w_stride);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, wk + 96, w_stride);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, out, kPanelPairs * 4);
  _tile_stored(1, out + 16, kPanelPairs * 4);
  _tile_stored(2, out + 32, kPanelPairs * 4);
  _tile_stored(3, out + 48, kPanelPairs * 4);
}
#endif

// fp32 x; the weight as fp32 or bf16 (widened in registers). The row loops are unrolled by
// pragma: the 2 * MR accumulators must live in registers (12 of the 16 ymm), and where GCC chose
// not to unroll them it kept them on the stack (3x slower, measured).
template <int MR, bool kBf16W>
void kernel_fma(const float* x, int64_t ldx, const void* w, int64_t k, float* out) {
#ifdef TANDEM_AVX2
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(-65536);
  for (int64_t kk = 0; kk < k; ++kk) {
    __m256 w0, w1;
    if constexpr (kBf16W) {
      const __m256i v = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + kk * 16));
      w0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      w1 = _mm256_castsi256_ps(_mm256_and_si256(v, high));
    } else {
      const float* wf = static_cast<const float*>(w) + kk * 16;
      w0 = _mm256_loadu_ps(wf);
      w1 = _mm256_loadu_ps(wf + 8);
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * ldx + kk);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(out + r * 16, acc[r][0]);
    _mm256_storeu_ps(out + r * 16 + 8, acc[r][1]);
  }
#else
  for (int r = 0; r < MR; ++r) {
    for (int64_t c = 0; c < 16; ++c) {
      float acc = 0.0f;
      for (int64_t kk = 0; kk < k; ++kk) {
        const float wv = kBf16W ? widen(static_cast<const uint16_t*>(w)[kk * 16 + (c < 8 ? 2 * c : 2 * (c - 8) + 1)])
                                : static_cast<const float*>(w)[kk * 16 + c];
        acc = std::fma(x[r * ldx + kk], wv, acc);
      }
      out[r * 16 + c] = acc;
    }
  }
#endif
}

// x: bf16 pairs (pairs layout) or fp32 (columns layout).
template <int MR>
void run_kernel(bool pairs, bool bf16_weight, const void* x, int64_t ldx, const void* w,
                int64_t kp, float* out) {
#ifdef TANDEM_AVX512BF16
  if (pairs) {
    return kernel_bf16<MR>(static_cast<const uint16_t*>(x), ldx,
                           static_cast<const uint16_t*>(w), kp, out);
  }
#endif
  if (bf16_weight) return kernel_fma<MR, true>(static_cast<const float*>(x), ldx, w, kp, out);
  kernel_fma<MR, false>(static_cast<const float*>(x), ldx, w, kp, out);
}

void run_rows(int64_t rows, bool pairs, bool bf16_weight, const void* x, int64_t ldx,
              const void* w, int64_t kp, float* out) {
  switch (rows) {
    case 1: return run_kernel<1>(pairs, bf16_weight, x, ldx, w, kp, out);
    case 2: return run_kernel<2>(pairs, bf16_weight, x, ldx, w, kp, out);
    case 3: return run_kernel<3>(pairs, bf16_weight, x, ldx, w, kp, out);
    case 4: return run_kernel<4>(pairs, bf16_weight, x, ldx, w, kp, out);
    case 5: return run_kernel<5>(pairs, bf16_weight, x, ldx, w, kp, out);
    default: return run_kernel<6>(pairs, bf16_weight, x, ldx, w, kp, out);
  }
}

void check_layout(Layout layout, bool bf16, const char* who) {
  TORCH_CHECK(layout == Layout::kColumns || bf16, who, ": the ",
              layout == Layout::kTiles ? "tiles" : "pairs", " layout needs bf16");
  TORCH_CHECK(layout_supported(layout), who, ": the ",
              layout == Layout::kTiles ? "tiles layout needs an AMX-BF16 CPU"
                                       : "pairs layout needs an AVX512-BF16 CPU");
}

}  // namespace

// The layouts this CPU runs, fastest first (columns everywhere).
std::vector<std::string> invariant_layouts() {
  std::vector<std::string> out;
  if (cpu_has_tiles()) out.emplace_back("tiles");
  if (cpu_has_bf16_pairs()) out.emplace_back("pairs");
  out.emplace_back("columns");
  return out;
}

// weight [N, K] (float32 or bfloat16) -> its packed panels, 1-D, same dtype, in `layout` (one of
// invariant_layouts(); tiles and pairs bf16 only).
torch::Tensor pack_linear(torch::Tensor weight, const std::string& layout_name) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu(), "pack_linear: CPU weight [N, K]");
  const bool bf16 = weight.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || weight.scalar_type() == at::kFloat, "pack_linear: float32 or bfloat16");
  const Layout layout = parse_layout(layout_name);
  check_layout(layout, bf16, "pack_linear");
  const int64_t n = weight.size(0), k = weight.size(1), kp = packed_k(layout, k);
  const int64_t width = panel_width(layout), panels = (n + width - 1) / width;
  const torch::Tensor wc = weight.contiguous();
  torch::Tensor packed = torch::zeros({panels * kp * width}, weight.options());
  const int64_t elem = static_cast<int64_t>(weight.element_size());
  const char* src = static_cast<const char*>(wc.data_ptr());
  char* dst = static_cast<char*>(packed.data_ptr());
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row)
      for (int64_t col = 0; col < k; ++col)
        std::memcpy(dst + packed_index(layout, bf16, row, col, kp) * elem,
                    src + (row * k + col) * elem, elem);
  });
  return packed;
}

// x [M, K] (bf16 or fp32), panels from pack_linear(weight [n, K], layout) of x's dtype, optional
// bias [n] -> y [M, n] in x's dtype.
torch::Tensor invariant_linear(torch::Tensor x, torch::Tensor packed, int64_t n,
                               c10::optional<torch::Tensor> bias, const std::string& layout_name) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "invariant_linear: CPU x [M, K]");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "invariant_linear: float32 or bfloat16 x");
  TORCH_CHECK(packed.scalar_type() == x.scalar_type(),
              "invariant_linear: x and the packed weight must share a dtype");
  const Layout layout = parse_layout(layout_name);
  check_layout(layout, bf16, "invariant_linear");
  const bool tiles = layout == Layout::kTiles, pairs = layout == Layout::kPairs;
  const int64_t m = x.size(0), k = x.size(1), kp = packed_k(layout, k);
  const int64_t width = panel_width(layout), panels = (n + width - 1) / width;
  TORCH_CHECK(packed.numel() == panels * kp * width, "invariant_linear: packed size mismatch");
  torch::Tensor xc = x.contiguous();
  // The x each microkernel reads: bf16 padded to whole pairs (tiles: to 32 k and 16 rows, zeros
  // whose products add +0), or fp32.
  const int64_t rows_step = tiles ? kTileRows : kMR;
  const int64_t mp = tiles ? (m + kTileRows - 1) / kTileRows * kTileRows : m;
  torch::Tensor xs;
  if (tiles || pairs) {
    xs = kp == k && mp == m ? xc : torch::constant_pad_nd(xc, {0, kp - k, 0, mp - m});
  } else {
    xs = xc.to(at::kFloat);
  }
  torch::Tensor bc;
  if (bias.has_value()) {
    bc = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bc.numel() == n, "invariant_linear: bias has ", bc.numel(), " elements, want ", n);
  }
  const float* bp = bias.has_value() ? bc.data_ptr<float>() : nullptr;
  torch::Tensor y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  const int64_t elem = static_cast<int64_t>(xs.element_size());
  const int64_t panel_bytes = kp * width * static_cast<int64_t>(packed.element_size());
  uint16_t* yb = bf16 ? reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) : nullptr;
  float* yf = bf16 ? nullptr : y.data_ptr<float>();
  // Rows in blocks whose x stays in L2 (~256 KB) while the thread's panels pass over it.
  const int64_t block_rows =
      std::max<int64_t>(rows_step, (1 << 18) / (kp * elem) / rows_step * rows_step);
  // The rows of panel p from r0 into tile (rows x width fp32), and from there into y.
  // Everything it reads it holds (the spare threads may run it after this call returns).
  auto panel_rows = [xs, packed, kp, elem, panel_bytes, pairs, bf16, tiles](
                        int64_t p, int64_t r0, int64_t rows, float* tile) {
    const char* xr = static_cast<const char*>(xs.data_ptr()) + r0 * kp * elem;
    const char* wr = static_cast<const char*>(packed.data_ptr()) + p * panel_bytes;
#ifdef TANDEM_AMX
    if (tiles) {
      kernel_tiles(reinterpret_cast<const uint16_t*>(xr), kp, reinterpret_cast<const uint16_t*>(wr),
                   kp, tile);
      return;
    }
#endif
    run_rows(rows, pairs, bf16, xr, kp, wr, kp, tile);
  };
  auto write_rows = [&](int64_t p, int64_t r0, int64_t rows, const float* tile) {
    const int64_t n0 = p * width, cols = std::min(width, n - n0);
    const float* bias_cols = bp != nullptr ? bp + n0 : nullptr;
    for (int64_t r = 0; r < rows; ++r) {
      const float* t = tile + r * width;
      if (bf16) {
        epilogue(t, bias_cols, cols, yb + (r0 + r) * n + n0);
      } else {
        epilogue(t, bias_cols, cols, yf + (r0 + r) * n + n0);
      }
    }
  };
  tandem_spare::Pool* spare = tandem_spare::attached();
  if (m <= kSpareRows && spare != nullptr && spare->active() && at::get_num_threads() == 1) {
    // Up to kSpareRows rows: 64 columns a chunk, shared with the spare threads (spare_threads.h).
    // tiles: a panel's rows padded to whole tiles (mp), and whichever thread computes a chunk
    // configures its own tiles for it.
    const int64_t per = std::max<int64_t>(1, 64 / width), chunks = (panels + per - 1) / per;
    auto compute = [panel_rows, per, panels, m, mp, rows_step, width, tiles](int64_t c,
                                                                             float* out) {
#ifdef TANDEM_AMX
      if (tiles) tandem_amx::configure();
#endif
      const int64_t p0 = c * per, p1 = std::min(panels, p0 + per);
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t r0 = 0; r0 < m; r0 += rows_step)
          panel_rows(p, r0, std::min(rows_step, m - r0), out + ((p - p0) * mp + r0) * width);
#ifdef TANDEM_AMX
      if (tiles) tandem_amx::release();
#endif
    };
    spare->run(chunks, per * mp * width, compute, [&](int64_t c, const float* out) {
      const int64_t p0 = c * per, p1 = std::min(panels, p0 + per);
      for (int64_t p = p0; p < p1; ++p) write_rows(p, 0, m, out + (p - p0) * mp * width);
    });
    return y;
  }
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(rows_step * width);
#ifdef TANDEM_AMX
    if (tiles) tandem_amx::configure();
#endif
    for (int64_t b0 = 0; b0 < m; b0 += block_rows) {
      const int64_t b1 = std::min(m, b0 + block_rows);
      for (int64_t p = begin; p < end; ++p) {
        for (int64_t r0 = b0; r0 < b1; r0 += rows_step) {
          const int64_t rows = std::min(rows_step, b1 - r0);
          panel_rows(p, r0, rows, tile.data());
          write_rows(p, r0, rows, tile.data());
        }
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
