// specdec::block_mm — y = x · Wᵀ for a GGML-block weight matrix W [N, K], f32 activations x [M, K].
//
// Weights (see specdec/core/block_linear.py for the packing):
//   u4 (qs uint8 [N, K/2]): 4-bit codes q in [0, 15]; the 16 bytes of group g (32 weights) hold weight
//       32g + b in the low nibble of byte b and weight 32g + 16 + b in its high nibble;
//   s8 (qs int8 [N, K]): signed codes, one byte per weight.
//   d, dmin: f32 [N, K/SB];  sc, mn: int8 [N, K/G];  G (group) in {16, 32}, SB (superblock) a multiple of 32.
//   w[n, k] = (d[n, k/SB] · sc[n, k/G]) · q − dmin[n, k/SB] · mn[n, k/G], in f32 (GGML's dequantization,
//   bit for bit: every product of an f16 scale and small integers is exact in f32).
//
// Cost flat in M: every 32 weights are dequantized once into two 16-lane f32 vectors (u4: a 16-entry table
// fma(iota, a, −b) indexed by the nibbles with vpermps) and applied to up to RMAX activation rows held in
// registers, so a verify of M ≤ RMAX rows reads and unpacks the weights once, as a decode step does.
//
// Threads: at::parallel_for over blocks of output columns (torch's intra-op threads; the extension is built
// with -fopenmp, without which ATen's OpenMP parallel_for runs on one thread).
//
// Row invariance: the result for (row r, column n) is the same sequence of f32 operations whatever M is
// and whichever rows or columns share its tile or thread: two 16-lane accumulators (the group's first and
// second 16 weights) fed group by group in order, summed lane-wise, then reduced in a fixed lane order.
// So decode, verify and batched calls agree bit for bit. (The AVX2 and portable paths use the same
// accumulator structure; their results agree with each other but may differ from AVX-512's reduction.)
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECDEC_X86 1
#endif

namespace {

constexpr int RMAX = 12;    // activation rows per register tile (2·RMAX accumulators + 4 in 32 registers)
constexpr int NBLOCK = 8;   // output columns per parallel work item

struct Args {
  const float* x; float* y; const uint8_t* qs; const float* d; const float* dmin; const int8_t* sc;
  const int8_t* mn; int64_t M, N, K;
  int g_shift, sb_shift;    // log2 of the group and superblock sizes
  bool u4;
};

// (a, b) of every 16-weight half of column n (w = a·q + b) into a[K/16], b[K/16]: computed once per column
// and tile, then broadcast from memory in the inner loop. Halves from `from` on (the vector paths do the rest).
__attribute__((always_inline)) inline void column_params(const Args& p, int64_t n, float* a, float* b,
                                                         int64_t from = 0) {
  const float* d = p.d + (n * p.K >> p.sb_shift);
  const float* dmin = p.dmin + (n * p.K >> p.sb_shift);
  const int8_t* sc = p.sc + (n * p.K >> p.g_shift);
  const int8_t* mn = p.mn + (n * p.K >> p.g_shift);
  for (int64_t h = from; h < p.K / 16; ++h) {
    const int64_t sb = 16 * h >> p.sb_shift, g = 16 * h >> p.g_shift;
    a[h] = d[sb] * static_cast<float>(sc[g]);
    b[h] = -(dmin[sb] * static_cast<float>(mn[g]));
  }
}

// ------------------------------------------------------------------------------------------ portable
// 16-lane accumulators as arrays: the structure of the AVX-512 path (its fma per lane, its reduction).
template <int R>
__attribute__((always_inline)) inline void tile_portable(const Args& p, int64_t n, int64_t r0, float* ab) {
  float acc[R][2][16] = {};
  float w[2][16];
  float* const A = ab;
  float* const B = ab + p.K / 16;
  column_params(p, n, A, B);
  for (int64_t s = 0; s < p.K / 32; ++s) {
    const float a[2] = {A[2 * s], A[2 * s + 1]}, b[2] = {B[2 * s], B[2 * s + 1]};
    if (p.u4) {
      const uint8_t* q = p.qs + n * (p.K / 2) + 16 * s;
      for (int i = 0; i < 16; ++i) {
        w[0][i] = __builtin_fmaf(static_cast<float>(q[i] & 15), a[0], b[0]);
        w[1][i] = __builtin_fmaf(static_cast<float>(q[i] >> 4), a[1], b[1]);
      }
    } else {
      const int8_t* q = reinterpret_cast<const int8_t*>(p.qs) + n * p.K + 32 * s;
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 16; ++i) w[h][i] = __builtin_fmaf(static_cast<float>(q[16 * h + i]), a[h], b[h]);
    }
    for (int r = 0; r < R; ++r) {
      const float* xr = p.x + (r0 + r) * p.K + 32 * s;
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 16; ++i) acc[r][h][i] = __builtin_fmaf(w[h][i], xr[16 * h + i], acc[r][h][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float v[16];
    for (int i = 0; i < 16; ++i) v[i] = acc[r][0][i] + acc[r][1][i];
    // the reduction order of _mm512_reduce_add_ps: halves, then quarters, ...
    for (int width = 8; width >= 1; width /= 2)
      for (int i = 0; i < width; ++i) v[i] = v[i] + v[i + width];
    p.y[(r0 + r) * p.N + n] = v[0];
  }
}

template <int R>
__attribute__((always_inline)) inline void rows_portable(const Args& p, int64_t n0, int64_t n1, int64_t r0, float* ab) {
  for (int64_t n = n0; n < n1; ++n) tile_portable<R>(p, n, r0, ab);
}

#ifdef SPECDEC_X86
// ------------------------------------------------------------------------------------------ AVX-512
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

AVX512 inline float reduce16(__m512 v) {
  // fixed order (matches tile_portable): 16 → 8 → 4 → 2 → 1 lanes, adding the upper half to the lower
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
  return _mm_cvtss_f32(q);
}

// column_params, 16 halves (256 weights) per vector where the layout allows (superblock 32 or a multiple
// of 256): the same products, so the same values.
AVX512 void column_params_avx512(const Args& p, int64_t n, float* a, float* b) {
  const int64_t halves = p.K / 16, sb_halves = int64_t(1) << (p.sb_shift - 4);
  if (!(sb_halves == 2 || sb_halves % 16 == 0)) return column_params(p, n, a, b);
  const float* d = p.d + (n * p.K >> p.sb_shift);
  const float* dmin = p.dmin + (n * p.K >> p.sb_shift);
  const int8_t* sc = p.sc + (n * p.K >> p.g_shift);
  const int8_t* mn = p.mn + (n * p.K >> p.g_shift);
  const __m512i pairs = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  int64_t h = 0;
  for (; h + 16 <= halves; h += 16) {
    __m512 dv, mv;
    if (sb_halves == 2) {                 // one d per 2 halves: 8 values, each twice
      dv = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_loadu_ps(d + h / 2)));
      mv = _mm512_permutexvar_ps(pairs, _mm512_castps256_ps512(_mm256_loadu_ps(dmin + h / 2)));
    } else {                              // all 16 halves in one superblock
      dv = _mm512_set1_ps(d[h >> (p.sb_shift - 4)]);
      mv = _mm512_set1_ps(dmin[h >> (p.sb_shift - 4)]);
    }
    __m128i s8, m8;
    if (p.g_shift == 4) {                 // groups of 16: one scale per half
      s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + h));
      m8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + h));
    } else {                              // groups of 32: each scale twice
      s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + h / 2));
      m8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn + h / 2));
      s8 = _mm_unpacklo_epi8(s8, s8);
      m8 = _mm_unpacklo_epi8(m8, m8);
    }
    const __m512 sv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s8));
    const __m512 nv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(m8));
    _mm512_storeu_ps(a + h, _mm512_mul_ps(dv, sv));
    _mm512_storeu_ps(b + h, _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(mv, nv)));
  }
  column_params(p, n, a, b, h);
}

// Steps [s0, s1) (32 weights each) of NT columns × R rows: 2·NT·R accumulators in registers, loaded from and
// stored back to `acc` (column-major over the block's columns) around the chunk.
template <int R, int NT, bool U4>
AVX512 void chunk_avx512(const Args& p, int64_t n, const float* ab, __m512 (*acc)[RMAX][2], int64_t r0,
                         int64_t s0, int64_t s1) {
  const int64_t stride = p.K / 8;    // floats of ab per column: a[K/16], then b[K/16]
  __m512 sum[NT][R][2];
#pragma GCC unroll 12
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) sum[t][r][0] = acc[t][r][0], sum[t][r][1] = acc[t][r][1];
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t qstride = U4 ? p.K / 2 : p.K;
  const uint8_t* qs = p.qs + n * qstride;
  const float* x = p.x + r0 * p.K;
  // The same columns of the next block (NBLOCK on), NT · qstride contiguous bytes, are prefetched while these
  // are read, at the pace they are read: rows of a few hundred bytes are too short for the hardware prefetcher.
  const char* next = reinterpret_cast<const char*>(qs + NBLOCK * qstride);
  const bool prefetch = n + NBLOCK < p.N;
  for (int64_t s = s0; s < s1; ++s) {
    if (prefetch) _mm_prefetch(next + s * NT * (U4 ? 16 : 32), _MM_HINT_T0);
    __m512 w[NT][2];
#pragma GCC unroll 12
    for (int t = 0; t < NT; ++t) {
      const float* a = ab + t * stride + 2 * s;    // a of the two halves; their b at a + K/16
      const float* b = a + p.K / 16;
      const uint8_t* q = qs + t * qstride + (U4 ? 16 : 32) * s;
      if constexpr (U4) {
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
        const __m512 lo = _mm512_fmadd_ps(iota, _mm512_set1_ps(a[0]), _mm512_set1_ps(b[0]));
        const __m512 hi = _mm512_fmadd_ps(iota, _mm512_set1_ps(a[1]), _mm512_set1_ps(b[1]));
        w[t][0] = _mm512_permutexvar_ps(bytes, lo);                       // low nibble indexes (bits 3:0)
        w[t][1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), hi);
      } else {
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m512 c = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h))));
          w[t][h] = _mm512_fmadd_ps(c, _mm512_set1_ps(a[h]), _mm512_set1_ps(b[h]));
        }
      }
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512 x0 = _mm512_loadu_ps(x + r * p.K + 32 * s), x1 = _mm512_loadu_ps(x + r * p.K + 32 * s + 16);
#pragma GCC unroll 12
      for (int t = 0; t < NT; ++t) {
        sum[t][r][0] = _mm512_fmadd_ps(w[t][0], x0, sum[t][r][0]);
        sum[t][r][1] = _mm512_fmadd_ps(w[t][1], x1, sum[t][r][1]);
      }
    }
  }
#pragma GCC unroll 12
  for (int t = 0; t < NT; ++t)
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) acc[t][r][0] = sum[t][r][0], acc[t][r][1] = sum[t][r][1];
}

// Columns [n0, n1) (at most NBLOCK) for rows r0 .. r0 + R. K is walked in chunks whose R rows of x fit in L1
// (about 12 KB), each chunk applied to every column of the block before the next: x is read from L2 once per
// block and chunk, not once per column. The columns' (a, b) are computed with the first row chunk (r0 = 0).
template <int R>
AVX512 void rows_avx512(const Args& p, int64_t n0, int64_t n1, int64_t r0, float* ab) {
  constexpr int NT = R <= 2 ? 4 : (R <= 4 ? 2 : 1);
  constexpr int64_t CHUNK = 96 / R > 0 ? 96 / R : 1;   // steps per chunk: R · 32 · CHUNK floats ≈ 12 KB
  const int64_t stride = p.K / 8, steps = p.K / 32, cols = n1 - n0;
  if (r0 == 0)
    for (int64_t c = 0; c < cols; ++c) column_params_avx512(p, n0 + c, ab + c * stride, ab + c * stride + p.K / 16);
  alignas(64) __m512 acc[NBLOCK][RMAX][2];
  for (int64_t c = 0; c < cols; ++c)
    for (int r = 0; r < R; ++r) acc[c][r][0] = acc[c][r][1] = _mm512_setzero_ps();
  for (int64_t s0 = 0; s0 < steps; s0 += CHUNK) {
    const int64_t s1 = std::min(steps, s0 + CHUNK);
    int64_t c = 0;
    if (p.u4) {
      for (; c + NT <= cols; c += NT) chunk_avx512<R, NT, true>(p, n0 + c, ab + c * stride, acc + c, r0, s0, s1);
      for (; c < cols; ++c) chunk_avx512<R, 1, true>(p, n0 + c, ab + c * stride, acc + c, r0, s0, s1);
    } else {
      for (; c + NT <= cols; c += NT) chunk_avx512<R, NT, false>(p, n0 + c, ab + c * stride, acc + c, r0, s0, s1);
      for (; c < cols; ++c) chunk_avx512<R, 1, false>(p, n0 + c, ab + c * stride, acc + c, r0, s0, s1);
    }
  }
  for (int64_t c = 0; c < cols; ++c)
    for (int r = 0; r < R; ++r) p.y[(r0 + r) * p.N + n0 + c] = reduce16(_mm512_add_ps(acc[c][r][0], acc[c][r][1]));
}

// ------------------------------------------------------------------------------------------ AVX2
#define AVX2 __attribute__((target("avx2,fma")))
template <int R>
AVX2 void rows_avx2(const Args& p, int64_t n0, int64_t n1, int64_t r0, float* ab) {
  rows_portable<R>(p, n0, n1, r0, ab);   // the portable loops, vectorised by the compiler for AVX2 + FMA
}
#endif

using RowsFn = void (*)(const Args&, int64_t, int64_t, int64_t, float*);

enum class Isa { portable, avx2, avx512 };

Isa detect() {
#ifdef SPECDEC_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
#endif
  return Isa::portable;
}

Isa& forced() {
  static Isa isa = detect();
  return isa;
}

template <int R>
RowsFn pick(Isa isa) {
#ifdef SPECDEC_X86
  if (isa == Isa::avx512) return rows_avx512<R>;
  if (isa == Isa::avx2) return rows_avx2<R>;
#endif
  return rows_portable<R>;
}

RowsFn rows_fn(int R, Isa isa) {
  switch (R) {
    case 1: return pick<1>(isa);
    case 2: return pick<2>(isa);
    case 3: return pick<3>(isa);
    case 4: return pick<4>(isa);
    case 5: return pick<5>(isa);
    case 6: return pick<6>(isa);
    case 7: return pick<7>(isa);
    case 8: return pick<8>(isa);
    case 9: return pick<9>(isa);
    case 10: return pick<10>(isa);
    case 11: return pick<11>(isa);
    default: return pick<12>(isa);
  }
}

at::Tensor block_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& dmin,
                    const at::Tensor& sc, const at::Tensor& mn, int64_t group, int64_t superblock) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "block_mm: x must be a contiguous f32 [M, K]");
  const bool u4 = qs.scalar_type() == at::kByte;
  TORCH_CHECK(u4 || qs.scalar_type() == at::kChar, "block_mm: qs must be uint8 (u4) or int8 (s8)");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0);
  TORCH_CHECK(K % 32 == 0 && (group == 16 || group == 32) && superblock % 32 == 0 && K % superblock == 0,
              "block_mm: K must be a multiple of 32 and of the superblock; group 16 or 32");
  TORCH_CHECK(qs.dim() == 2 && qs.is_contiguous() && qs.size(1) == (u4 ? K / 2 : K), "block_mm: qs shape");
  TORCH_CHECK(d.scalar_type() == at::kFloat && dmin.scalar_type() == at::kFloat && d.is_contiguous() &&
              dmin.is_contiguous() && d.numel() == N * (K / superblock) && dmin.numel() == d.numel(),
              "block_mm: d / dmin must be contiguous f32 [N, K/superblock]");
  TORCH_CHECK(sc.scalar_type() == at::kChar && mn.scalar_type() == at::kChar && sc.is_contiguous() &&
              mn.is_contiguous() && sc.numel() == N * (K / group) && mn.numel() == sc.numel(),
              "block_mm: sc / mn must be contiguous int8 [N, K/group]");
  TORCH_CHECK(!u4 || group == 32, "block_mm: u4 weights take groups of 32");
  TORCH_CHECK((superblock & (superblock - 1)) == 0, "block_mm: the superblock must be a power of two");
  at::Tensor y = at::empty({M, N}, x.options());
  Args p{x.data_ptr<float>(), y.data_ptr<float>(), reinterpret_cast<const uint8_t*>(qs.data_ptr()),
         d.data_ptr<float>(), dmin.data_ptr<float>(), sc.data_ptr<int8_t>(), mn.data_ptr<int8_t>(),
         M, N, K, __builtin_ctzll(group), __builtin_ctzll(superblock), u4};
  const Isa isa = forced();
  const int64_t blocks = (N + NBLOCK - 1) / NBLOCK;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> ab(NBLOCK * (K / 8));    // per-half (a, b) of the columns in flight
    const int64_t n0 = b0 * NBLOCK, n1 = std::min(N, b1 * NBLOCK);
    for (int64_t c0 = n0; c0 < n1; c0 += NBLOCK) {      // a block's weights stay in cache over row chunks
      const int64_t c1 = std::min(n1, c0 + NBLOCK);
      for (int64_t r0 = 0; r0 < M; r0 += RMAX) {
        const int R = static_cast<int>(std::min<int64_t>(RMAX, M - r0));
        rows_fn(R, isa)(p, c0, c1, r0, ab.data());
      }
    }
  });
  return y;
}

// The instruction set in use ("avx512", "avx2", "portable"); set_isa picks a lower one (tests, benchmarks).
std::string isa_name() {
  switch (forced()) {
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "portable";
  }
}

void set_isa(const std::string& name) {
  const Isa best = detect();
  Isa want = name == "avx512" ? Isa::avx512 : name == "avx2" ? Isa::avx2 : name == "portable" ? Isa::portable : best;
  TORCH_CHECK(name == "avx512" || name == "avx2" || name == "portable" || name == "auto",
              "set_isa: use 'avx512', 'avx2', 'portable' or 'auto'");
  TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best), "set_isa: this CPU does not support ", name);
  forced() = want;
}

}  // namespace

TORCH_LIBRARY(specdec, m) {
  m.def("block_mm(Tensor x, Tensor qs, Tensor d, Tensor dmin, Tensor sc, Tensor mn, int group, int superblock) -> Tensor");
  m.def("block_mm_isa() -> str", [] { return isa_name(); });
  m.def("block_mm_set_isa(str name) -> ()", [](const std::string& name) { set_isa(name); });
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("block_mm", &block_mm);
}
