// The decoder layer's small ops, one pass each (engine/model.py): RMSNorm with the residual add
// before it, SiLU(gate) * up, RoPE in place, and the K/V write into the paged cache.
//
// Why: written in PyTorch they are ~20 ops a layer, each a dispatch and a pass over the
// activations; on the `small` demo model (AMX Xeon, 64 sequences decoding) they were ~7 of a
// 32 ms step -- the K/V write's index_copy_ alone 75 us a layer.
//
// Bits (docs/design.md#numerics-classes): every output is a function of its own row, never of
// the batch or the thread count. The residual add, the products of RoPE and SiLU * up round as
// PyTorch's bf16 / fp32 ops do (each op rounded once to the tensor's dtype), so RoPE and the add
// give PyTorch's bits exactly. RMSNorm's mean square is summed in float, element i into
// accumulator i % 16 (one AVX-512 vector, two AVX2 ones), the rest into a tail, the accumulators
// combined in a fixed tree (lane k + w into lane k, w = 8, 4, 2, 1); SiLU's exp is the
// portable one (portable_exp.h). This file builds with -ffp-contract=off, so every CPU and
// vector width gives the same bits (tests/engine/test_layer_ops.py).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kRowGrain = 8;  // rows per parallel task

// bf16 <-> float as c10::BFloat16 converts (round to nearest even; NaN to 0x7fc0), written
// without branches so the loops vectorise.
inline float bf16_to_float(uint16_t h) { return from_bits(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  const uint32_t u = to_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return f != f ? static_cast<uint16_t>(0x7fc0u) : static_cast<uint16_t>(rounded);
}

// A tensor element type and its float round trip: what "rounded once to the dtype" means.
struct F32 {
  using T = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
  static float round(float v) { return v; }
};

struct BF16 {
  using T = uint16_t;
  static float load(uint16_t v) { return bf16_to_float(v); }
  static uint16_t store(float v) { return float_to_bf16(v); }
  static float round(float v) { return bf16_to_float(float_to_bf16(v)); }
};

template <typename D>
typename D::T* ptr(const at::Tensor& t) {
  return reinterpret_cast<typename D::T*>(t.data_ptr());
}

// Calls f.template operator()<D>() for the tensor's dtype (float32 or bfloat16).
template <typename F>
void dispatch(const at::Tensor& t, const char* name, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f.template operator()<F32>();
  } else if (t.scalar_type() == at::kBFloat16) {
    f.template operator()<BF16>();
  } else {
    TORCH_CHECK(false, name, " takes float32 or bfloat16, not ", t.scalar_type());
  }
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " takes CPU tensors");
}

// 1 / sqrt(mean(x^2) + eps) of one row, the mean square in the fixed order of the header.
template <typename D>
float inv_rms(const typename D::T* x, int64_t n, float eps) {
  float acc[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int k = 0; k < 16; ++k) {
      const float v = D::load(x[i + k]);
      acc[k] = acc[k] + v * v;
    }
  }
  float tail = 0;
  for (; i < n; ++i) {
    const float v = D::load(x[i]);
    tail = tail + v * v;
  }
  for (int width = 8; width > 0; width /= 2) {  // a fixed tree: lane k meets lane k + width
    for (int k = 0; k < width; ++k) acc[k] = acc[k] + acc[k + width];
  }
  return 1.0f / std::sqrt((acc[0] + tail) / static_cast<float>(n) + eps);
}

}  // namespace

// h [T, H] contiguous; residual [T, H] or an undefined tensor: h += residual in place (rounded
// as PyTorch's add), then returns weight * round(h * inv_rms(h)), rounded, as engine/model.py's
// PyTorch rms_norm rounds.
at::Tensor rms_norm(at::Tensor h, at::Tensor weight, double eps, c10::optional<at::Tensor> residual) {
  check_cpu(h, "rms_norm");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "rms_norm takes a contiguous [T, H] tensor");
  const int64_t rows = h.size(0), n = h.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.scalar_type() == h.scalar_type() &&
                  weight.is_contiguous(),
              "rms_norm: the weight must be [H] of the activations' dtype");
  const bool add = residual.has_value() && residual->defined();
  if (add) {
    TORCH_CHECK(residual->sizes() == h.sizes() && residual->scalar_type() == h.scalar_type() &&
                    residual->is_contiguous(),
                "rms_norm: the residual must match the activations");
  }
  at::Tensor out = at::empty_like(h);
  dispatch(h, "rms_norm", [&]<typename D>() {
    typename D::T* x = ptr<D>(h);
    const typename D::T* r = add ? ptr<D>(*residual) : nullptr;
    const typename D::T* w = ptr<D>(weight);
    typename D::T* o = ptr<D>(out);
    const float e = static_cast<float>(eps);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        typename D::T* xr = x + t * n;
        if (r != nullptr) {
          const typename D::T* rr = r + t * n;
          for (int64_t i = 0; i < n; ++i) xr[i] = D::store(D::load(xr[i]) + D::load(rr[i]));
        }
        const float s = inv_rms<D>(xr, n, e);
        typename D::T* orow = o + t * n;
        for (int64_t i = 0; i < n; ++i) {
          orow[i] = D::store(D::load(w[i]) * D::round(D::load(xr[i]) * s));
        }
      }
    });
  });
  return out;
}

// gate_up [T, 2I] contiguous -> [T, I]: round(round(silu(gate)) * up), silu(g) = g / (1 +
// exp(-g)) in float with the portable exp (PyTorch's silu, then its mul, each rounded).
at::Tensor silu_mul(at::Tensor gate_up) {
  check_cpu(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul takes a contiguous [T, 2I] tensor");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  dispatch(gate_up, "silu_mul", [&]<typename D>() {
    const typename D::T* in = ptr<D>(gate_up);
    typename D::T* o = ptr<D>(out);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const typename D::T* g = in + t * 2 * inter;
        const typename D::T* u = g + inter;
        typename D::T* orow = o + t * inter;
        for (int64_t i = 0; i < inter; ++i) {
          const float x = D::load(g[i]);
          const float silu = D::round(x / (1.0f + exp_one(-x)));
          orow[i] = D::store(silu * D::load(u[i]));
        }
      }
    });
  });
  return out;
}

// qkv [T, heads_total, d] contiguous: heads [0, heads) rotated in place by cos, sin [T, d]
// (contiguous, qkv's dtype), rotate-half: x1' = x1 c - x2 s, x2' = x2 c + x1 s, each product
// and the sum rounded (PyTorch's x * cos + rotate_half(x) * sin).
void rotary_(at::Tensor qkv, int64_t heads, at::Tensor cos, at::Tensor sin) {
  check_cpu(qkv, "rotary_");
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous() && heads <= qkv.size(1) && heads >= 0 &&
                  qkv.size(2) % 2 == 0,
              "rotary_ takes a contiguous [T, heads, d] tensor, d even");
  const int64_t rows = qkv.size(0), all = qkv.size(1), d = qkv.size(2), half = d / 2;
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->numel() == rows * d && t->is_contiguous() &&
                    t->scalar_type() == qkv.scalar_type(),
                "rotary_: cos and sin must be [T, d] of qkv's dtype");
  }
  dispatch(qkv, "rotary_", [&]<typename D>() {
    typename D::T* x = ptr<D>(qkv);
    const typename D::T* cs = ptr<D>(cos);
    const typename D::T* sn = ptr<D>(sin);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const typename D::T* c = cs + t * d;
        const typename D::T* s = sn + t * d;
        for (int64_t h = 0; h < heads; ++h) {
          typename D::T* v = x + (t * all + h) * d;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = D::load(v[i]), x2 = D::load(v[i + half]);
            const float a = D::round(x1 * D::load(c[i])) + D::round(-x2 * D::load(s[i]));
            const float b = D::round(x2 * D::load(c[i + half])) + D::round(x1 * D::load(s[i + half]));
            v[i] = D::store(a);
            v[i + half] = D::store(b);
          }
        }
      }
    });
  });
}

// cache [2, num_blocks, block_size, kv_heads, row] contiguous (one layer); kv [T, 2 * kv_heads,
// row] of the cache's dtype, each token's K heads then V heads, rows contiguous (any token
// stride); slots [T] long: token t's K and V land in slot slots[t] of each half. A plain copy.
void write_kv(at::Tensor cache, at::Tensor kv, at::Tensor slots) {
  check_cpu(cache, "write_kv");
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous(), "write_kv: the cache must be contiguous");
  const int64_t heads = cache.size(3), row = cache.size(4);
  const int64_t num_slots = cache.size(1) * cache.size(2);
  const int64_t tokens = kv.size(0);
  TORCH_CHECK(kv.dim() == 3 && kv.size(1) == 2 * heads && kv.size(2) == row &&
                  kv.stride(2) == 1 && kv.stride(1) == row && kv.scalar_type() == cache.scalar_type(),
              "write_kv: kv must be [T, 2 * kv_heads, row] of the cache's dtype, rows contiguous");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == tokens && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              "write_kv: slots must be [T] int64");
  const int64_t bytes = heads * row * kv.element_size();
  const int64_t* at_slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(at_slot[t] >= 0 && at_slot[t] < num_slots, "write_kv: slot ", at_slot[t],
                " is outside the cache's ", num_slots);
  }
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* src = static_cast<const char*>(kv.data_ptr());
  const int64_t token_stride = kv.stride(0) * kv.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t half = 0; half < 2; ++half) {
      std::memcpy(dst + (half * num_slots + at_slot[t]) * bytes,
                  src + t * token_stride + half * bytes, bytes);
    }
  }
}
