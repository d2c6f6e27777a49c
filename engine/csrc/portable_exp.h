// Shared by portable_math.cpp and layer_ops.cpp (engine/kernels.py puts it ahead of each): the
// bit helpers and the portable exp, a fixed sequence of IEEE-754 float operations. Both files
// build with -ffp-contract=off, so no multiply-add is fused and a vectorised loop computes each
// element as the scalar code does.

#include <cstdint>
#include <cstring>

namespace {

inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint32_t to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// Round to the nearest integer, ties to even, for |t| < 2^22: adding 1.5 * 2^23 leaves no
// fraction bits, and the add rounds.
inline float round_even(float t) {
  constexpr float kShift = 12582912.0f;
  return (t + kShift) - kShift;
}

inline double round_even(double t) {  // |t| < 2^51
  constexpr double kShift = 6755399441055744.0;
  return (t + kShift) - kShift;
}

// 2^n as a float, -126 <= n <= 127.
inline float pow2(int n) { return from_bits(static_cast<uint32_t>(n + 127) << 23); }

// Both written without branches (selects only), so the loops over them vectorise.
inline float exp_one(float x) {
  // Past 89 the result overflows to inf and below -104 rounds to 0 by the arithmetic itself.
  const float xc = x != x ? 0.0f : x < -104.0f ? -104.0f : x > 89.0f ? 89.0f : x;
  // x = k ln2 + r, |r| <= ln2 / 2; ln2 in two parts, the first with 9 significant bits so
  // k * 0.693359375f is exact for |k| <= 150.
  const float k = round_even(xc * 1.44269504088896341f);
  float r = xc - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r;
  p = p + 1.0f;
  // p * 2^k in two steps, each factor a normal float: exact unless the result is subnormal
  // (then the second step rounds once) or overflows.
  const int n = static_cast<int>(k), half = n / 2;
  const float y = (p * pow2(half)) * pow2(n - half);
  return x != x ? x : y;
}

}  // namespace
