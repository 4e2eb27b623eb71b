// The extension's kernels as C++ functions, for kernels that call others without the dispatcher
// (``block_layer.cpp``). Shapes and semantics: ``block_mm.cpp``, ``attention.cpp``.
//
// Each kernel is also split in a prepared call and its parallel part, so that a caller running its own threads
// (``block_layer.cpp``'s layer stack: one parallel region for all the layers) can check and prepare every call
// up front, then run the parts on its threads with no allocation, check or dispatch between them:
//   block_weight (checks) → block_prepare (one thread: the prologue, the activations quantized into a scratch)
//     → block_run over tiles [t0, t1) (any thread, any split: row invariance gives the same bits);
//   attention_call (checks) → attention_write (one thread: the new keys and values into the caches)
//     → attention_run over items [t0, t1) (any thread, any split).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace specdec {

at::Tensor block_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& dmin,
                    const at::Tensor& sc, const at::Tensor& mn, int64_t n, int64_t group, int64_t superblock,
                    int64_t kind, int64_t offset, bool mins, const std::optional<at::Tensor>& norm, double eps,
                    bool gated, const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual);

at::Tensor cache_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                           const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& rows,
                           const at::Tensor& slots, const at::Tensor& mask);

// ------------------------------------------------------------------------------------------- block_mm, split
enum BlockKind : int64_t { U4 = 0, S8 = 1, U6 = 2, U5 = 3 };

// A GGML-block weight W [n, K] as the tiles read it (layout: block_mm.cpp's header), checked by block_weight.
struct BlockWeight {
  const uint8_t* qs; const at::Half* d; const at::Half* dmin; const int8_t* sc; const int8_t* mn;
  const float* bias;            // [n] or null
  int64_t n, K, group, superblock, offset;
  BlockKind kind; bool mins;
};

// The weight of block_mm's arguments for inputs of K columns (after the prologue); throws on a bad layout.
BlockWeight block_weight(const at::Tensor& qs, const at::Tensor& d, const at::Tensor& dmin, const at::Tensor& sc,
                         const at::Tensor& mn, int64_t n, int64_t group, int64_t superblock, int64_t kind,
                         int64_t offset, bool mins, const std::optional<at::Tensor>& bias, int64_t K);

// A call's activations, written by block_prepare; ``reserve`` once for the largest call (M rows of K columns;
// ``widened``: an s8 weight's, whose activations are also widened to 16 bits) so that calls allocate nothing.
struct BlockScratch {
  std::vector<float> x;         // the prologue's output (norm, gated)
  std::vector<int8_t> xq;
  std::vector<float> dx, sxf;
  std::vector<int32_t> sx, osx;
  std::vector<int16_t> sx16, xw;
  void reserve(int64_t M, int64_t K, bool widened);
};

// A prepared call: what the tiles read. y [M, n] at row stride ldy.
struct BlockCall {
  const int8_t* xq; const float* dx; const int32_t* sx; const float* sxf; const int16_t* sx16; const int32_t* osx;
  const int16_t* xw; float* y;
  const uint8_t* qs; const at::Half* d; const at::Half* dmin; const int8_t* sc; const int8_t* mn;
  const float* bias; const float* residual;      // the epilogue's (residual [M, n] at row stride ldy), or null
  int64_t M, N, K, G, SB, offset, ldy;
  BlockKind kind; bool mins;
  int64_t prefetch;
  int64_t rows, big;            // the rows' chunks: ``big`` chunks of ``rows`` rows, then chunks of rows - 1
  void (*full)(const BlockCall&, int64_t, int64_t);   // the tile of a chunk of ``rows`` rows, and of rows - 1
  void (*last)(const BlockCall&, int64_t, int64_t);
  int64_t groups() const { return K / G; }
  int64_t per() const { return SB / G; }       // groups a superblock: 1, or 8 / 16 for the K-quants
  int64_t group_bytes() const { return 16 * G * bits(kind) / 8; }
  int64_t tiles() const { return (N + 15) / 16; }
  static constexpr int64_t bits(int64_t kind) { return kind == U4 ? 4 : kind == U6 ? 6 : kind == U5 ? 5 : 8; }
};

// y = (x, its prologue: RMSNorm with ``norm`` [K] or the SiLU gate of x [M, 2K]) · Wᵀ (+ bias) (+ residual)
// prepared on this thread: x [M, K] (gated: [M, 2K]) contiguous, y and residual at row stride ldy. No check.
BlockCall block_prepare(const BlockWeight& w, BlockScratch& s, const float* x, int64_t M, const float* norm,
                        float eps, bool gated, float* y, int64_t ldy, const float* residual);

// Tiles [t0, t1) of a prepared call (16 output columns each), with their epilogue.
void block_run(const BlockCall& c, int64_t t0, int64_t t1);

// ------------------------------------------------------------------------------------------- cache_attention, split
// A checked attention call. Token t = r · n + i reads its q [H·D] at q + src(t) · q_stride and its k, v [Hkv·D] at
// k / v + src(t) · kv_stride, and writes its output [H·D] at out + src(t) · out_stride, where src(t) = packed[t], or
// t where ``packed`` is null; packed[t] < 0: a padding token, whose k and v are zeros and whose output is not
// computed.
struct AttentionCall {
  const float *q, *k, *v, *cos, *sin;
  float *kc, *vc, *out;
  const int64_t *row, *slot, *packed;
  const bool* mask;             // [b, n, L]
  int64_t q_stride, kv_stride, out_stride, b, n, H, Hkv, D, S, L;
  int64_t items() const { return b * n * H; }
};

// Checks the caches [B, S, Hkv, D], rows [b], slots [b, n] and mask [b, n, L] (throws); the pointers of q / k /
// v / out are left to the caller. ``rows`` / ``slots`` must be int64 and contiguous, ``mask`` contiguous.
AttentionCall attention_call(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& rows,
                             const at::Tensor& slots, const at::Tensor& mask, int64_t H);

void attention_write(const AttentionCall& a);                     // the new keys (rotated) and values
void attention_run(const AttentionCall& a, int64_t t0, int64_t t1);   // items (token, head) [t0, t1)

}  // namespace specdec
