// specdec::block_mm — y = x · Wᵀ for a GGML-block weight matrix W [N, K] on 8-bit activations, as llama.cpp
// computes: the activations of a row are quantized to int8 with one f32 scale per superblock of SB values (per
// group where SB = G; per 256 for the K-quants, as llama.cpp's Q8_K), the dot product of a weight group with its
// activations is an exact integer, the integer group scales are applied to integer sums, and the f32 scales once
// per superblock.
//
// Activations (per row r; superblock s of SB consecutive k, group g of G consecutive k; G = the weight's group):
//   dx = max|x| / 127 over the superblock,  xq = round-to-nearest-even(x · (1 / dx)) in [-127, 127] (0 where
//   dx = 0),  sx = Σ xq over the group.
// Weights, packed in tiles of 16 output columns (specdec/core/block_linear.py packs them):
//   d, dmin f16 [T, K/SB, 16] (GGUF's own f16 fields);  sc, mn int8 [T, K/G, 16];  T = ceil(N / 16) tiles, column n = 16 t + lane;
//   w[n, k] = (d · sc) · q − dmin · mn per group (GGML's dequantization; q the signed code).
//   qs, by kind (the bytes of one (tile, group) are contiguous, tiles after groups: [T][K/G][bytes]):
//     u4 (Q4_0 / Q4_1 / Q4_K, G = 32; c = q + offset in [0, 15], offset 8 for Q4_0's q in [-8, 7], else 0):
//         4 vectors of 64 bytes; in vector v, lane j's byte i holds c[32 g + 8 v + i] (low nibble) and
//         c[32 g + 8 v + 4 + i] (high nibble);
//     u6 (Q6_K, G = 16) and u5 (Q5_0, G = 32): c = q + offset in 6 / 5 bits: G/8 vectors of low 4 bits — lane j's
//         byte i of vector w holds c[8 w + i] (low nibble) and c[8 w + 4 + i] (high nibble) — then one vector of
//         the high bits: lane j's byte i holds c[4 v + i]'s high bits at bits b·v .. b·v + b − 1 (b = 2 / 1);
//     s8 (Q8_0, q in [-128, 127]): G/2 vectors of 32 bytes; lane j's byte i of vector v = q[G g + 2 v + i].
// Per lane (column) and superblock, in this order (dot = Σ q · xq over a group, exact; computed as
// Σ (q + offset) · xq − offset · sx):
//   SB = G (one group):    a = d,       b = 0 − dmin,       isum = dot,             msum = sx
//     (GGML's Q4_0 / Q4_1 / Q5_0 / Q8_0: sc = mn = 1, so d · sc = d and dmin · mn = dmin; the tile does not read them);
//   SB = 256 (K-quants):   a = d,       b = 0 − dmin,       isum = Σ_g sc · dot,    msum = Σ_g mn · sx (exact);
//   u = a · float(isum),  u = fma(b, float(msum), u) (only where the layer has mins),  acc = fma(u, dx, acc).
//
// Cost flat in M: a (tile, group)'s codes are loaded and unpacked once and applied to a chunk of rows held in
// registers (a call's rows in the fewest chunks of at most CHUNK = 12, as even as can be: a K-quant tile of 16
// rows spills its sums, and 16 rows as 8 + 8 took about a tenth less time than as one chunk on a Zen 5); integer
// multiply-adds (vpmaddubsw / vpmaddwd, or with AVX512-VNNI vpdpbusd / vpdpwssd, which also accumulate) do 32
// or 64 weight·activation products an instruction, and a K-quant's superblock costs a row one
// integer multiply-add per group and its f32 steps once (Q4_K with VNNI: the group's dot in two vpdpbusd chains that
// fit 16 bits, each scaled by one vpdpwssd, instead of four chains, their adds and vpmulld: 10 instructions a row
// and group instead of 14, where 512-bit integer multiplies on one port bound a many-row call; bench_block_mm.py's
// streamed 1.5B stack does not resolve the difference from run to run). Threads: at::parallel_for over tiles.
// (AMX does not pay here: a group is 16 columns × 32 k, so each group's dots must be stored and read back for its
// scale. Measured on a Sapphire Rapids class Xeon, a TDPBSUD tile over 64 k with A rows = (row, group) pairs —
// activations of one group, zeros over the other — gives the same bits but, with the unpacked codes stored for the
// B tile and C stored for the scales, took 1.3× the VNNI time at 5 rows and 1.0× at 16 with the weights in L2, and
// on the 1.5B's streamed layers 1.18× at 5 rows, 1.3× at 9 and 1.1× at 96.)
// Each thread reads its tiles' bytes as one sequential stream. The more rows a call has, the longer a group's
// arithmetic, so the out-of-order window covers fewer groups, fewer of the stream's misses are in flight and the
// arithmetic and the memory time add up; a software prefetch into L2 (prefetcht1) of the bytes
// ``prefetch_bytes()`` ahead (4 KB: about 16 Q4_K groups) overlaps them again. Calls of at least
// ``prefetch_min_rows()`` rows prefetch (default 1: every call). A 1.5B-shaped forward pass (bench_block_mm.py
// --prefetch):
//   AMD EPYC (Zen 4): 25 % less time at 5 and 9 rows, 7 % at 3 and 16, 14-16 % at 2; at 1 row within ±3 % —
//     but in the model's own decode step (attention and KV reads between the matmuls) 4-8 % less time
//     (bench_decode_step.py --ab-prefetch 4096:3);
//   Intel Xeon (Sapphire Rapids class, AMX): 14 % less time at 1 row, 18 % at 2, 16-30 % at 3-16.
//   (On a Skylake-SP a prefetch into L1, 2 KB ahead, cost 11-16 %.)
// A row's per-group scalars (dx, float(sx), sx in 16 bits, offset · sx, and for s8 the activations widened to 16
// bits) are prepared once per call, so the inner loops broadcast them from memory (a load, not a shuffle).
//
// Row invariance: the result for (row r, column n) is the same sequence of integer and f32 operations whatever
// M is and whichever rows or columns share its tile or thread, on every path (AVX-512 with or without VNNI,
// AVX2, portable): the integer sums are exact and the f32 steps are the ones above, per lane. So decode, verify
// and batched calls — and the instruction-set paths — agree bit for bit.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels.h"
#include "vec.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SPECDEC_X86 1
#endif

namespace {

constexpr int RMAX = 16;   // the most activation rows a register tile holds
constexpr int CHUNK = 12;  // rows a call's chunks hold at most (more spill the registers of a K-quant tile)
constexpr int LANES = 16;  // output columns per tile

using specdec::BlockKind;
using specdec::U4;
using specdec::S8;
using specdec::U6;
using specdec::U5;
using Kind = BlockKind;
using Args = specdec::BlockCall;

// ---------------------------------------------------------------------------------------- activations
// Row r's superblocks quantized (the same bits on every path: an exact max, one division, one product and
// round-to-nearest-even per value), with the sum of every group.
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t G, int64_t SB, int8_t* xq, float* dx, int32_t* sx) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t s = 0; s < K / SB; ++s) {
      const float* v = x + r * K + s * SB;
      float amax = 0.f;
      for (int64_t i = 0; i < SB; ++i) amax = std::max(amax, std::fabs(v[i]));
      const float d = amax / 127.f;
      const float id = d != 0.f ? 1.f / d : 0.f;
      for (int64_t i = 0; i < SB; ++i) {
        const float q = (v[i] * id + 12582912.f) - 12582912.f;   // 1.5 · 2^23: round to nearest even
        xq[r * K + s * SB + i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, q)));
      }
      dx[r * (K / SB) + s] = d;
    }
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < K / G; ++g) {
      int32_t sum = 0;
      for (int64_t i = 0; i < G; ++i) sum += xq[r * K + g * G + i];
      sx[r * (K / G) + g] = sum;
    }
}

// ---------------------------------------------------------------------------------------- prologue
// What a layer computes before its matmul, fused into the call (``block_mm``'s ``norm`` / ``gated``), per row:
//   norm:  v = w · (x · (1 / sqrt(Σ x² / K + eps)))   (Llama's RMSNorm in f32; Σ x² in 16 lanes, then their tree);
//   gated: v = silu(a) · b = (a / (1 + e^-a)) · b of x = [a | b] (the MLP's gate and up halves) [M, 2K].
// Vectors of 16 lanes with a fixed order (``vec.h``): the same bits on every instruction set and at every M.
using namespace specdec_vec;

SPECDEC_CLONES void norm_rows(const float* x, const float* w, float eps, int64_t M, int64_t K, float* out) {
  const int64_t body = K / W * W;
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x + r * K;
    V acc = splat(0.f);
    for (int64_t k = 0; k < body; k += W) acc = acc + load(xr + k) * load(xr + k);
    float ss = sum(acc);
    for (int64_t k = body; k < K; ++k) ss = ss + xr[k] * xr[k];
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(K) + eps);
    for (int64_t k = 0; k < body; k += W) store(out + r * K + k, load(w + k) * (load(xr + k) * splat(inv)));
    for (int64_t k = body; k < K; ++k) out[r * K + k] = w[k] * (xr[k] * inv);
  }
}

// silu(a) · b over 16 lanes
SPECDEC_INLINE V silu_gate(V a, V b) { return a / (splat(1.f) + specdec_vec::exp(splat(0.f) - a)) * b; }

SPECDEC_CLONES void silu_gate_rows(const float* x, int64_t M, int64_t K, float* out) {
  const int64_t body = K / W * W;
  for (int64_t r = 0; r < M; ++r) {
    const float* a = x + r * 2 * K;
    const float* b = a + K;
    for (int64_t k = 0; k < body; k += W) store(out + r * K + k, silu_gate(load(a + k), load(b + k)));
    if (body == K) continue;
    float ta[W] = {}, tb[W] = {}, v[W];       // the row's tail, padded with zeros
    std::memcpy(ta, a + body, (K - body) * sizeof(float));
    std::memcpy(tb, b + body, (K - body) * sizeof(float));
    store(v, silu_gate(load(ta), load(tb)));
    std::memcpy(out + r * K + body, v, (K - body) * sizeof(float));
  }
}

// The prologue of M rows into out [M, K]: RMSNorm with ``norm`` [K] of x [M, K], else the SiLU gate of x [M, 2K].
void prologue(const float* x, int64_t M, int64_t K, const float* norm, float eps, float* out) {
  if (norm)
    norm_rows(x, norm, eps, M, K, out);
  else
    silu_gate_rows(x, M, K, out);
}

// ---------------------------------------------------------------------------------------- portable
// The signed code of (lane j, group g, weight i < G) of tile t from the packed bytes.
inline int32_t code(const Args& p, const uint8_t* tile_group, int j, int64_t i) {
  if (p.kind == U4) {
    const int64_t v = i / 8, within = i % 8;
    const uint8_t byte = tile_group[64 * v + 4 * j + within % 4];
    return (within < 4 ? (byte & 15) : (byte >> 4)) - static_cast<int32_t>(p.offset);
  }
  if (p.kind == U6 || p.kind == U5) {
    const int64_t v = i / 4, b = 4 * j + i % 4, hb = p.kind == U6 ? 2 : 1;
    const uint8_t low = tile_group[64 * (v / 2) + b], high = tile_group[64 * (p.G / 8) + b];
    const int32_t c = ((v % 2 ? low >> 4 : low & 15) | (((high >> (hb * v)) & ((1 << hb) - 1)) << 4));
    return c - static_cast<int32_t>(p.offset);
  }
  return static_cast<int8_t>(tile_group[32 * (i / 2) + 2 * j + i % 2]);
}

template <int R>
void tile_portable(const Args& p, int64_t t, int64_t r0) {
  const int64_t ng = p.groups(), per = p.per(), nsb = p.K / p.SB;
  const int lanes = static_cast<int>(std::min<int64_t>(LANES, p.N - t * LANES));
  for (int j = 0; j < lanes; ++j) {
    float acc[R] = {};
    for (int64_t s = 0; s < nsb; ++s) {
      const float dj = static_cast<float>(p.d[(t * nsb + s) * LANES + j]);
      const float mj = static_cast<float>(p.dmin[(t * nsb + s) * LANES + j]);
      const int64_t g0 = s * per;
      const float a = per == 1 ? dj * static_cast<float>(p.sc[(t * ng + g0) * LANES + j]) : dj;
      const float b = per == 1 ? 0.f - mj * static_cast<float>(p.mn[(t * ng + g0) * LANES + j]) : 0.f - mj;
      for (int r = 0; r < R; ++r) {
        int32_t isum = 0, msum = 0;
        for (int64_t g = g0; g < g0 + per; ++g) {
          const uint8_t* tg = p.qs + (t * ng + g) * p.group_bytes();
          const int8_t* xr = p.xq + (r0 + r) * p.K + g * p.G;
          int32_t dot = 0;
          for (int64_t i = 0; i < p.G; ++i) dot += code(p, tg, j, i) * xr[i];
          const int32_t sx = p.sx[(r0 + r) * ng + g];
          if (per == 1) {
            isum = dot, msum = sx;
          } else {
            isum += static_cast<int32_t>(p.sc[(t * ng + g) * LANES + j]) * dot;
            msum += static_cast<int32_t>(p.mn[(t * ng + g) * LANES + j]) * sx;
          }
        }
        float u = a * static_cast<float>(isum);
        if (p.mins) u = __builtin_fmaf(b, static_cast<float>(msum), u);
        acc[r] = __builtin_fmaf(u, p.dx[(r0 + r) * nsb + s], acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) p.y[(r0 + r) * p.ldy + t * LANES + j] = acc[r];
  }
}

#ifdef SPECDEC_X86
// ---------------------------------------------------------------------------------------- AVX-512
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

template <typename T>
AVX512 inline __m512i bcast32(const T* p) {
  int32_t v;
  __builtin_memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// acc + dx · (a · float(isum) + b · float(msum)) for one row and superblock, per lane in the order of the header
// (b only with mins); dx is broadcast from memory (a load, not a shuffle).
AVX512 inline __m512 apply_scales(bool mins, __m512 a, __m512 b, __m512i isum, __m512 msum, const float* dx,
                                  __m512 acc) {
  __m512 u = _mm512_mul_ps(a, _mm512_cvtepi32_ps(isum));
  if (mins) u = _mm512_fmadd_ps(b, msum, u);
  return _mm512_fmadd_ps(u, _mm512_broadcastss_ps(_mm_load_ss(dx)), acc);
}

// 16 lanes' f16 scales as f32 (exact)
AVX512 inline __m512 load_f16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A group's dot into its superblock's integer sum: isum + sc · dot (SUPER), or the dot itself (one group).
template <bool SUPER>
AVX512 inline __m512i add_scaled(__m512i isum, __m512i dot, __m512i sc) {
  if constexpr (SUPER) return _mm512_add_epi32(isum, _mm512_mullo_epi32(dot, sc));
  return dot;
}

namespace avx512 {
#define SPECDEC_TARGET AVX512
#define SPECDEC_VNNI 0
#include "block_mm_avx512.h"
#undef SPECDEC_TARGET
#undef SPECDEC_VNNI
}  // namespace avx512

// AVX512-VNNI (Cascade Lake, Ice Lake, Zen 4 and later): the same tile with fused integer multiply-adds
#define AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))
namespace vnni {
#define SPECDEC_TARGET AVX512VNNI
#define SPECDEC_VNNI 1
#include "block_mm_avx512.h"
#undef SPECDEC_TARGET
#undef SPECDEC_VNNI
}  // namespace vnni

// ---------------------------------------------------------------------------------------- AVX2
#define AVX2 __attribute__((target("avx2,fma")))
template <int R>
AVX2 void tile_avx2(const Args& p, int64_t t, int64_t r0) {
  tile_portable<R>(p, t, r0);   // the portable loops, vectorised by the compiler for AVX2 + FMA
}
#endif

using TileFn = void (*)(const Args&, int64_t, int64_t);

// What a layer adds after its matmul (``block_mm``'s ``bias`` / ``residual``, either may be null), on columns
// [c0, c1) of y [M, ·] (row stride ldy; the residual's too), in the unfused layer's order: y = residual + (y + bias).
void add_epilogue(float* y, int64_t M, int64_t ldy, int64_t c0, int64_t c1, const float* bias, const float* residual) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t c = c0; c < c1; ++c) {
      float v = y[r * ldy + c];
      if (bias) v = v + bias[c];
      if (residual) v = residual[r * ldy + c] + v;
      y[r * ldy + c] = v;
    }
}

// The indices of x [M, K]'s rows that hold a nonzero value; undefined where every row does. A row of zeros
// quantizes to dx = 0 and xq = 0, so its every integer sum is 0 and its result, before the epilogue, is +0 on
// every path: a call need not compute it (``block_layer``'s padding tokens reach an LM head as such rows).
at::Tensor nonzero_rows(const at::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1);
  const float* v = x.data_ptr<float>();
  std::vector<int64_t> live;
  for (int64_t r = 0; r < M; ++r)
    if (std::any_of(v + r * K, v + (r + 1) * K, [](float e) { return e != 0.f; })) live.push_back(r);
  if (static_cast<int64_t>(live.size()) == M) return {};
  return at::tensor(live, at::kLong);
}

enum class Isa { portable, avx2, avx512, avx512vnni };   // each runs on the CPUs of the next

Isa detect() {
#ifdef SPECDEC_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return __builtin_cpu_supports("avx512vnni") ? Isa::avx512vnni : Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
#endif
  return Isa::portable;
}

int64_t& prefetch_bytes() {     // how far ahead of the weight stream a call prefetches; 0: none
  static int64_t bytes = 4096;
  return bytes;
}

int64_t& prefetch_min_rows() {  // the fewest rows a call prefetches at
  static int64_t rows = 1;
  return rows;
}

Isa& forced() {
  static Isa isa = detect();
  return isa;
}

template <int R>
TileFn pick(Isa isa) {
#ifdef SPECDEC_X86
  if (isa == Isa::avx512vnni) return vnni::tile_any<R>;
  if (isa == Isa::avx512) return avx512::tile_any<R>;
  if (isa == Isa::avx2) return tile_avx2<R>;
#endif
  return tile_portable<R>;
}

template <int... Rs>
TileFn tile_fn(int R, Isa isa, std::integer_sequence<int, Rs...>) {
  TileFn fn = nullptr;
  ((fn = (R == Rs + 1) ? pick<Rs + 1>(isa) : fn), ...);
  return fn;
}

}  // namespace

namespace specdec {

BlockWeight block_weight(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& dmin, const at::Tensor& sc,
                         const at::Tensor& mn, int64_t n, int64_t group, int64_t superblock, int64_t kind,
                         int64_t offset, bool mins, const std::optional<at::Tensor>& bias, int64_t K) {
  TORCH_CHECK(kind >= U4 && kind <= U5, "block_mm: kind must be 0 (u4), 1 (s8), 2 (u6) or 3 (u5)");
  TORCH_CHECK((group == 16 || group == 32) && (superblock == group || superblock == 256) &&
              (kind != U4 || group == 32) && (kind != U6 || group == 16) && (kind != U5 || group == 32),
              "block_mm: group 16 or 32 (u4, u5: 32; u6: 16), superblock the group or 256");
  TORCH_CHECK(!mins || superblock == group || group == 32, "block_mm: mins with superblock 256 need group 32");
  TORCH_CHECK(offset == 0 || (kind == U4 && offset == 8 && superblock == group) || (kind == U6 && offset == 32) ||
                  (kind == U5 && offset == 16),
              "block_mm: offset must be 0, or 8 (u4 with one group a superblock), 32 (u6), 16 (u5)");
  const int64_t T = (n + LANES - 1) / LANES;
  TORCH_CHECK(K % superblock == 0, "block_mm: K must be a multiple of the superblock");
  const int64_t gbytes = LANES * group * Args::bits(kind) / 8;
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.numel() == T * (K / group) * gbytes,
              "block_mm: qs must be contiguous uint8 [T, K/group, group bytes]");
  TORCH_CHECK(d.scalar_type() == at::kHalf && dmin.scalar_type() == at::kHalf && d.is_contiguous() &&
              dmin.is_contiguous() && d.numel() == T * (K / superblock) * LANES && dmin.numel() == d.numel(),
              "block_mm: d / dmin must be contiguous f16 [T, K/superblock, 16]");
  TORCH_CHECK(sc.scalar_type() == at::kChar && mn.scalar_type() == at::kChar && sc.is_contiguous() &&
              mn.is_contiguous() && sc.numel() == T * (K / group) * LANES && mn.numel() == sc.numel(),
              "block_mm: sc / mn must be contiguous int8 [T, K/group, 16]");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n),
              "block_mm: bias must be a contiguous f32 [n]");
  return {qs.data_ptr<uint8_t>(), d.data_ptr<at::Half>(), dmin.data_ptr<at::Half>(), sc.data_ptr<int8_t>(),
          mn.data_ptr<int8_t>(), bias ? bias->data_ptr<float>() : nullptr, n, K, group, superblock, offset,
          static_cast<BlockKind>(kind), mins};
}

void BlockScratch::reserve(int64_t M, int64_t K, bool widened) {
  x.reserve(M * K);
  xq.reserve(M * K);
  if (widened) xw.reserve(M * K);
  for (auto* v : {&dx, &sxf}) v->reserve(M * K / 16);
  for (auto* v : {&sx, &osx}) v->reserve(M * K / 16);
  sx16.reserve(M * K / 16);
}

BlockCall block_prepare(const BlockWeight& w, BlockScratch& s, const float* x, int64_t M, const float* norm,
                        float eps, bool gated, float* y, int64_t ldy, const float* residual) {
  const int64_t K = w.K;
  if (norm || gated) {
    s.x.resize(M * K);
    prologue(x, M, K, norm, eps, s.x.data());
    x = s.x.data();
  }
  s.xq.resize(M * K);
  s.dx.resize(M * (K / w.superblock));
  s.sx.resize(M * (K / w.group));
  quantize_rows(x, M, K, w.group, w.superblock, s.xq.data(), s.dx.data(), s.sx.data());
  // float(sx) (one-group layers) and sx in 16 bits (K-quants; |sx| ≤ 32 · 127, exact, for vpmaddwd pairs of
  // groups): read only where the layer has mins; offset · sx only where it has an offset
  const bool one_group = w.superblock == w.group;
  s.sxf.resize(w.mins && one_group ? s.sx.size() : 0);
  s.sx16.resize(w.mins && !one_group ? s.sx.size() : 0);
  s.osx.resize(w.offset ? s.sx.size() : 0);
  for (size_t i = 0; i < s.sxf.size(); ++i) s.sxf[i] = static_cast<float>(s.sx[i]);
  for (size_t i = 0; i < s.sx16.size(); ++i) s.sx16[i] = static_cast<int16_t>(s.sx[i]);
  for (size_t i = 0; i < s.osx.size(); ++i) s.osx[i] = static_cast<int32_t>(w.offset) * s.sx[i];
  s.xw.resize(w.kind == S8 ? M * K : 0);     // s8: the activations widened once, for vpmaddwd
  for (size_t i = 0; i < s.xw.size(); ++i) s.xw[i] = s.xq[i];
  const Isa isa = forced();
  // M rows in the fewest chunks of at most CHUNK rows, as even as can be: ``big`` chunks of ``rows`` rows, then
  // chunks of rows - 1; their tile functions picked once per call
  const int64_t chunks = std::max<int64_t>(1, (M + CHUNK - 1) / CHUNK), rows = (M + chunks - 1) / chunks;
  const int64_t big = M - chunks * (rows - 1);
  const TileFn full = tile_fn(static_cast<int>(rows), isa, std::make_integer_sequence<int, RMAX>{});
  const TileFn last = big < chunks ? tile_fn(static_cast<int>(rows - 1), isa, std::make_integer_sequence<int, RMAX>{})
                                   : full;
  return {s.xq.data(), s.dx.data(), s.sx.data(), s.sxf.data(), s.sx16.data(), s.osx.data(), s.xw.data(), y,
          w.qs, w.d, w.dmin, w.sc, w.mn, w.bias, residual, M, w.n, K, w.group, w.superblock, w.offset, ldy,
          w.kind, w.mins, M >= prefetch_min_rows() ? prefetch_bytes() : 0, rows, big, full, last};
}

void block_run(const BlockCall& c, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t) {
    int64_t r0 = 0;
    for (int64_t i = 0; r0 < c.M; ++i) {
      const bool first = i < c.big;
      (first ? c.full : c.last)(c, t, r0);
      r0 += first ? c.rows : c.rows - 1;
    }
    if (c.bias || c.residual)   // the tile's columns, while they are in cache
      add_epilogue(c.y, c.M, c.ldy, t * LANES, std::min(c.N, (t + 1) * LANES), c.bias, c.residual);
  }
}

at::Tensor block_mm(const at::Tensor& x_in, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& dmin,
                    const at::Tensor& sc, const at::Tensor& mn, int64_t n, int64_t group, int64_t superblock,
                    int64_t kind, int64_t offset, bool mins, const std::optional<at::Tensor>& norm, double eps,
                    bool gated, const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.is_contiguous(),
              "block_mm: x must be a contiguous f32 [M, K] ([M, 2K] gated)");
  TORCH_CHECK(!(gated && norm), "block_mm: norm and gated exclude each other");
  TORCH_CHECK(!gated || x_in.size(1) % 2 == 0, "block_mm: a gated x is [M, 2K]");
  TORCH_CHECK(!norm || (norm->scalar_type() == at::kFloat && norm->is_contiguous() && norm->numel() == x_in.size(1)),
              "block_mm: norm must be a contiguous f32 [K]");
  const int64_t M = x_in.size(0), K = gated ? x_in.size(1) / 2 : x_in.size(1);
  const BlockWeight w = block_weight(qs, d, dmin, sc, mn, n, group, superblock, kind, offset, mins, bias, K);
  TORCH_CHECK(!residual || (residual->scalar_type() == at::kFloat && residual->is_contiguous() &&
                            residual->numel() == M * n),
              "block_mm: residual must be a contiguous f32 [M, n]");
  at::Tensor x = x_in;
  if (norm || gated) {    // the prologue first: a row of zeros is found after it
    x = at::empty({M, K}, x_in.options());
    prologue(x_in.data_ptr<float>(), M, K, norm ? norm->data_ptr<float>() : nullptr, static_cast<float>(eps),
             x.data_ptr<float>());
  }
  const at::Tensor live = nonzero_rows(x);
  if (live.defined()) {   // a row of zeros gives 0 + bias (+ residual) exactly: only the other rows are computed
    at::Tensor y = at::zeros({M, n}, x.options());
    add_epilogue(y.data_ptr<float>(), M, n, 0, n, w.bias, residual ? residual->data_ptr<float>() : nullptr);
    const std::optional<at::Tensor> live_residual =
        residual ? std::optional<at::Tensor>(residual->index_select(0, live)) : std::nullopt;
    return y.index_copy_(0, live, block_mm(x.index_select(0, live), qs, d, dmin, sc, mn, n, group, superblock, kind,
                                           offset, mins, std::nullopt, eps, false, bias, live_residual));
  }
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0 || n == 0) return y;
  BlockScratch s;
  const BlockCall c = block_prepare(w, s, x.data_ptr<float>(), M, nullptr, 0.f, false, y.data_ptr<float>(), n,
                                    residual ? residual->data_ptr<float>() : nullptr);
  at::parallel_for(0, c.tiles(), 1, [&](int64_t t0, int64_t t1) { block_run(c, t0, t1); });
  return y;
}

}  // namespace specdec

namespace {

std::string isa_name() {
  switch (forced()) {
    case Isa::avx512vnni: return "avx512vnni";
    case Isa::avx512: return "avx512";
    case Isa::avx2: return "avx2";
    default: return "portable";
  }
}

void set_isa(const std::string& name) {
  const Isa best = detect();
  TORCH_CHECK(name == "avx512vnni" || name == "avx512" || name == "avx2" || name == "portable" || name == "auto",
              "set_isa: use 'avx512vnni', 'avx512', 'avx2', 'portable' or 'auto'");
  const Isa want = name == "avx512vnni" ? Isa::avx512vnni : name == "avx512" ? Isa::avx512 : name == "avx2" ? Isa::avx2
                 : name == "portable" ? Isa::portable : best;
  TORCH_CHECK(static_cast<int>(want) <= static_cast<int>(best), "set_isa: this CPU does not support ", name);
  forced() = want;
}

}  // namespace

TORCH_LIBRARY(specdec, m) {
  m.def("block_mm(Tensor x, Tensor qs, Tensor d, Tensor dmin, Tensor sc, Tensor mn, int n, int group, "
        "int superblock, int kind, int offset, bool mins, Tensor? norm=None, float eps=0., bool gated=False, "
        "Tensor? bias=None, Tensor? residual=None) -> Tensor");
  m.def("block_mm_isa() -> str", [] { return isa_name(); });
  m.def("block_mm_set_isa(str name) -> ()", [](const std::string& name) { set_isa(name); });
  m.def("block_mm_prefetch() -> int[]", [] { return std::vector<int64_t>{prefetch_bytes(), prefetch_min_rows()}; });
  m.def("block_mm_set_prefetch(int bytes, int min_rows) -> ()", [](int64_t bytes, int64_t min_rows) {
    TORCH_CHECK(bytes >= 0, "block_mm_set_prefetch: bytes must be >= 0 (0: no prefetch)");
    TORCH_CHECK(min_rows >= 1, "block_mm_set_prefetch: min_rows must be >= 1");
    prefetch_bytes() = bytes;
    prefetch_min_rows() = min_rows;
  });
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("block_mm", &specdec::block_mm);
}
