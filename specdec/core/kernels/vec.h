// Fixed-order float vectors of 16 lanes (GCC vector extensions) for the element-wise steps of the CPU kernels.
// Every lane operation is one IEEE single-precision operation and the extension is built with
// -ffp-contract=off (no fused multiply-adds are formed), so a function gives the same bits whether the compiler
// lowers the vectors to AVX-512, AVX2 or SSE (``target_clones`` builds one copy per instruction set).
#pragma once

#include <cstdint>
#include <cstring>

namespace specdec_vec {

typedef float V __attribute__((vector_size(64)));
typedef int32_t I __attribute__((vector_size(64)));
constexpr int W = 16;   // lanes

#define SPECDEC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#define SPECDEC_INLINE inline __attribute__((always_inline))

SPECDEC_INLINE V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

SPECDEC_INLINE void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }

SPECDEC_INLINE V splat(float x) { return V{} + x; }

// e^x per lane (Cephes' expf: x = n ln 2 + r with |r| <= ln 2 / 2, a degree-6 polynomial in r, then 2^n in the
// exponent bits); x clamped to [-87.33, 88] (the result there: 2^-126 .. 2^127); relative error ~2 ulp.
SPECDEC_INLINE V exp(V x) {
  x = x < splat(-87.33654f) ? splat(-87.33654f) : x;
  x = x > splat(88.f) ? splat(88.f) : x;
  const V n = (x * splat(1.44269504088896341f) + splat(12582912.f)) - splat(12582912.f);   // round to nearest
  const V r = (x - n * splat(0.693359375f)) - n * splat(-2.12194440e-4f);
  V p = splat(1.9875691500e-4f);
  p = p * r + splat(1.3981999507e-3f);
  p = p * r + splat(8.3334519073e-3f);
  p = p * r + splat(4.1665795894e-2f);
  p = p * r + splat(1.6666665459e-1f);
  p = p * r + splat(5.0000001201e-1f);
  const V y = (p * (r * r) + r) + splat(1.f);
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  return y * reinterpret_cast<const V&>(bits);
}

// The lanes' sum in a fixed tree: lane l + lane l + 8, then + 4, + 2, + 1.
SPECDEC_INLINE float sum(V v) {
  float t[W];
  store(t, v);
  for (int w = W / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) t[l] = t[l] + t[l + w];
  return t[0];
}

SPECDEC_INLINE V max(V a, V b) { return a > b ? a : b; }

// The lane sums of 16 vectors v[0..15] as one vector (lane l: the sum of v[l]), each in ``sum``'s tree: pairs of
// vectors are combined level by level, each level adding lane x to lane x + w (w = 8, 4, 2, 1) within a vector's
// lanes, which is ``sum``'s order, so a lane's value does not depend on the other 15 vectors.
typedef float V8 __attribute__((vector_size(32)));
SPECDEC_INLINE V sums(const V* v) {
  V a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)   // lanes 0-7: v[2i]'s pairs (l, l + 8); lanes 8-15: v[2i + 1]'s
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)   // 4 lanes a vector: (x, x + 4) of each 8-lane half
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)   // 2 lanes a vector
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

}  // namespace specdec_vec
