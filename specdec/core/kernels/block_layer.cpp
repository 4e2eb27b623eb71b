// specdec::block_layer — one decoder layer of GGUF block weights in one call: the five kernel calls of
// ``specdec/core/block_layer.py`` made from C++, so a layer costs one dispatch from Python instead of five
// plus the glue between them.
//
//   x [b, n, H] f32, cos / sin [b, n, D], k_cache / v_cache [B, S, Hkv, D] (written in place), rows [b],
//   slots [b, n], mask [b, 1, n, L] bool (``cache_attention``'s arguments);
//   weights: per projection qs, d, dmin, sc, mn, bias (an empty tensor: none) — the attention's input
//     projections (q, k, v or one qkv), o, the MLP's input projections (gate, up or one gate_up), down — then
//     the two RMSNorm weights (input, post-attention);
//   layout: [attention inputs, MLP inputs, then per projection n, group, superblock, kind, offset, mins];
//   eps: the RMSNorm epsilon
//   → x + attention + MLP [b, n, H], the same bits as the five calls.
//
// Padding: token i of row r is padding where it does not attend to its own slot (mask[r, 0, i, slots[r, i]]
// false: ``model.attention_mask`` of a token_mask whose diagonal is false there — a verify's positions past a
// row's real drafts, a prompt's bucket padding). The projections run on the real tokens only (their rows packed,
// so a verify costs the rows it really has); the attention writes zeros for a padding token's k and v into its
// slot (past the row's length: never read before it is rewritten) and computes no output for it, and a padding
// token's output is zero. A real token's bits do not change: every kernel is row-invariant, and no real token attends
// to a padding one (it comes after them in its row, or the mask says so).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"

namespace {

using specdec::AttentionCall;
using specdec::BlockCall;
using specdec::BlockScratch;
using specdec::BlockWeight;

constexpr int64_t FIELDS = 6;   // tensors and ints per projection

// One decoder layer's weights and caches, checked.
struct Layer {
  std::vector<BlockWeight> attn_in, mlp_in;       // q, k, v (or one qkv); gate, up (or one gate_up)
  BlockWeight o, down;
  const float *norm_in, *norm_post;
  AttentionCall attention;                        // q / k / v / out pointers: the call's buffers
};

// Projection p of a layer's weights / layout (block_layer's argument order) for inputs of K columns.
BlockWeight projection(at::TensorList w, at::IntArrayRef meta, int64_t p, int64_t K) {
  const at::Tensor* t = &w[FIELDS * p];
  const int64_t* m = &meta[2 + FIELDS * p];
  const std::optional<at::Tensor> bias = t[5].numel() ? std::optional<at::Tensor>(t[5]) : std::nullopt;
  return specdec::block_weight(t[0], t[1], t[2], t[3], t[4], m[0], m[1], m[2], m[3], m[4], m[5] != 0, bias, K);
}

int64_t width(const std::vector<BlockWeight>& parts) {
  int64_t n = 0;
  for (const auto& p : parts) n += p.n;
  return n;
}

const float* norm_weight(const at::Tensor& t, int64_t hidden) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == hidden,
              "block_layer: the RMSNorm weights must be contiguous f32 [H]");
  return t.data_ptr<float>();
}

// The layer of ``weights`` / ``layout`` (one layer's block_layer arguments) for hidden size ``hidden``, checked.
Layer plan_layer(at::TensorList weights, at::IntArrayRef layout, int64_t hidden, at::Tensor& k_cache,
                 at::Tensor& v_cache, const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& mask) {
  TORCH_CHECK(layout.size() >= 2, "block_layer: layout must start with the attention and MLP input counts");
  const int64_t attn_in = layout[0], mlp_in = layout[1], count = attn_in + mlp_in + 2;
  TORCH_CHECK(attn_in >= 1 && mlp_in >= 1 && static_cast<int64_t>(layout.size()) == 2 + FIELDS * count &&
              static_cast<int64_t>(weights.size()) == FIELDS * count + 2,
              "block_layer: ", FIELDS, " weights and ints per projection, then the two norms");
  TORCH_CHECK(k_cache.dim() == 4, "cache_attention: the caches must be contiguous [B, S, Hkv, D]");
  Layer l;
  for (int64_t p = 0; p < attn_in; ++p) l.attn_in.push_back(projection(weights, layout, p, hidden));
  const int64_t kv_width = k_cache.size(2) * k_cache.size(3), q_width = width(l.attn_in) - 2 * kv_width;
  TORCH_CHECK(q_width > 0 && q_width % k_cache.size(3) == 0,
              "block_layer: the q / k / v projections are narrower than the cache's K and V");
  l.o = projection(weights, layout, attn_in, q_width);
  for (int64_t p = 0; p < mlp_in; ++p) l.mlp_in.push_back(projection(weights, layout, attn_in + 1 + p, hidden));
  const int64_t inner = width(l.mlp_in) / 2;
  TORCH_CHECK(width(l.mlp_in) % 2 == 0, "block_mm: a gated x is [M, 2K]");
  l.down = projection(weights, layout, count - 1, inner);
  TORCH_CHECK(l.o.n == hidden && l.down.n == hidden, "block_layer: o and down must give the hidden size");
  l.norm_in = norm_weight(weights[FIELDS * count], hidden);
  l.norm_post = norm_weight(weights[FIELDS * count + 1], hidden);
  l.attention = specdec::attention_call(k_cache, v_cache, rows, slots, mask, q_width / k_cache.size(3));
  return l;
}

// The flat indices r · n + i of the real tokens of a [b, n] call (see Padding above); undefined where all are.
at::Tensor real_tokens(const at::Tensor& mask, const at::Tensor& slots) {
  TORCH_CHECK(mask.dim() == 4 && mask.scalar_type() == at::kBool && slots.dim() == 2 &&
              slots.size(0) == mask.size(0) && slots.size(1) == mask.size(2),
              "block_layer: mask must be a bool [b, 1, n, L] and slots [b, n]");
  const at::Tensor m = mask.contiguous(), s = slots.to(at::kLong).contiguous();
  const int64_t tokens = s.numel(), L = m.size(3);
  const bool* allow = m.data_ptr<bool>();
  const int64_t* slot = s.data_ptr<int64_t>();
  std::vector<int64_t> real;
  for (int64_t t = 0; t < tokens; ++t)
    if (slot[t] < 0 || slot[t] >= L || allow[t * L + slot[t]]) real.push_back(t);
  if (static_cast<int64_t>(real.size()) == tokens) return {};
  return at::tensor(real, at::kLong);
}

// Projections of one input written side by side into y [M, Σ n] (row stride ldy): prepared into ``calls``.
void prepare_parts(const std::vector<BlockWeight>& parts, std::vector<BlockScratch>& scratch, const float* x,
                   int64_t M, const float* norm, float eps, float* y, int64_t ldy, std::vector<BlockCall>& calls) {
  calls.clear();
  int64_t column = 0;
  for (size_t p = 0; p < parts.size(); ++p) {
    calls.push_back(specdec::block_prepare(parts[p], scratch[p], x, M, norm, eps, false, y + column, ldy, nullptr));
    column += parts[p].n;
  }
}

int64_t tiles(const std::vector<BlockCall>& calls) {
  int64_t total = 0;
  for (const auto& c : calls) total += c.tiles();
  return total;
}

// Tiles [t0, t1) of the calls' tiles numbered one call after the other.
void run_parts(const std::vector<BlockCall>& calls, int64_t t0, int64_t t1) {
  int64_t base = 0;
  for (const auto& c : calls) {
    const int64_t lo = std::max(t0, base), hi = std::min(t1, base + c.tiles());
    if (lo < hi) specdec::block_run(c, lo - base, hi - base);
    base += c.tiles();
  }
}

// specdec::block_layers — a model's decoder layers in one call: block_layer for each layer in turn, k_caches /
// v_caches one per layer, weights and layout each layer's block_layer weights and layout one after the other
// (a layer's counts are the first two entries of its layout). The same bits as the calls one by one.
//
// Every layer is checked and its buffers allocated first; then one parallel region runs all the layers, its
// threads splitting each step (a projection's tiles, the attention's (token, head) items) as at::parallel_for
// would, with a barrier between steps and one thread preparing each step (the RMSNorm or SiLU prologue, the
// activations' quantization, the new keys and values into the caches): no allocation, check or dispatch between
// the steps, and no thread start (on a 2-core CPU these were a quarter of a 0.5B draft step).
at::Tensor block_layers(const at::Tensor& x, const at::Tensor& cos_in, const at::Tensor& sin_in,
                        at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& rows_in,
                        const at::Tensor& slots_in, const at::Tensor& mask_in, at::TensorList weights,
                        at::IntArrayRef layout, double eps_in) {
  TORCH_CHECK(k_caches.size() == v_caches.size(), "block_layers: one K and one V cache per layer");
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "block_layers: x must be f32 [b, n, H]");
  const int64_t b = x.size(0), n = x.size(1), hidden = x.size(2);
  const at::Tensor real = real_tokens(mask_in, slots_in);      // packed once, for every layer
  const at::Tensor rows = rows_in.to(at::kLong).contiguous(), slots = slots_in.to(at::kLong).contiguous();
  const at::Tensor mask = mask_in.select(1, 0).contiguous(), cos = cos_in.contiguous(), sin = sin_in.contiguous();
  at::Tensor h = x.reshape({b * n, hidden}).contiguous();
  h = real.defined() ? h.index_select(0, real) : h.clone();    // hA: a layer's input and output (a copy of x's rows)
  const int64_t N = h.size(0);
  std::vector<Layer> layers;
  size_t w = 0, l = 0;
  for (size_t i = 0; i < k_caches.size(); ++i) {
    TORCH_CHECK(l + 2 <= layout.size(), "block_layers: the layout ends before layer ", i);
    const int64_t count = layout[l] + layout[l + 1] + 2;
    const size_t nl = 2 + FIELDS * count, nw = FIELDS * count + 2;
    TORCH_CHECK(l + nl <= layout.size() && w + nw <= weights.size(), "block_layers: layer ", i,
                "'s weights or layout run past the lists");
    at::Tensor k_cache = k_caches[i], v_cache = v_caches[i];
    layers.push_back(plan_layer(weights.slice(w, nw), layout.slice(l, nl), hidden, k_cache, v_cache, rows, slots,
                                mask));
    w += nw;
    l += nl;
  }
  TORCH_CHECK(w == weights.size() && l == layout.size(), "block_layers: more weights or layout than layers");
  if (layers.empty()) return x;
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == b && t->size(1) == n,
                "cache_attention: cos and sin must be [b, n, D]");
  // the buffers, shared by the layers (each layer's widths checked against the first's)
  const Layer& first = layers[0];
  const int64_t qkv_width = width(first.attn_in), q_width = first.o.K, mlp_width = width(first.mlp_in);
  for (const Layer& layer : layers)
    TORCH_CHECK(width(layer.attn_in) == qkv_width && layer.o.K == q_width && width(layer.mlp_in) == mlp_width &&
                layer.attention.D == cos.size(2), "block_layers: the layers' widths differ, or cos / sin are not "
                "[b, n, D]");
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor h_mid = at::empty({N, hidden}, f32), joined = at::empty({N, qkv_width}, f32);
  at::Tensor attended = at::empty({N, q_width}, f32), gate_up = at::empty({N, mlp_width}, f32);
  std::vector<int64_t> packed;               // token → its packed row, -1: padding (empty: every token is real)
  if (real.defined()) {
    packed.assign(b * n, -1);
    const int64_t* index = real.data_ptr<int64_t>();
    for (int64_t p = 0; p < N; ++p) packed[index[p]] = p;
  }
  float *ha = h.data_ptr<float>(), *hb = h_mid.data_ptr<float>(), *qkv = joined.data_ptr<float>();
  float *att = attended.data_ptr<float>(), *gu = gate_up.data_ptr<float>();
  const int64_t kv_width = (qkv_width - q_width) / 2;
  for (Layer& layer : layers) {
    AttentionCall& a = layer.attention;
    a.q = qkv, a.k = qkv + q_width, a.v = qkv + q_width + kv_width, a.out = att;
    a.q_stride = a.kv_stride = qkv_width, a.out_stride = q_width;
    a.cos = cos.data_ptr<float>(), a.sin = sin.data_ptr<float>();
    a.packed = packed.empty() ? nullptr : packed.data();
  }
  // one scratch per projection of a layer (its size stays from layer to layer)
  const size_t parts = std::max(first.attn_in.size(), first.mlp_in.size());
  std::vector<BlockScratch> in_scratch(parts), out_scratch(2);
  bool s8_in = false, s8_o = false, s8_down = false;     // (s8 weights' activations are widened too)
  for (const Layer& layer : layers) {
    for (const auto* parts_of : {&layer.attn_in, &layer.mlp_in})
      for (const BlockWeight& w : *parts_of) s8_in = s8_in || w.kind == specdec::S8;
    s8_o = s8_o || layer.o.kind == specdec::S8;
    s8_down = s8_down || layer.down.kind == specdec::S8;
  }
  for (size_t p = 0; p < parts; ++p) in_scratch[p].reserve(N, hidden, s8_in);
  out_scratch[0].reserve(N, q_width, s8_o);
  out_scratch[1].reserve(N, mlp_width / 2, s8_down);
  std::vector<BlockCall> calls, out_call(1);
  const float eps = static_cast<float>(eps_in);
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads) if (threads > 1 && N > 0)
  {
    int tid = 0, team = 1;
#ifdef _OPENMP
    tid = omp_get_thread_num();
    team = omp_get_num_threads();
#endif
    // this thread's share of [0, total): at::parallel_for's contiguous chunks
    auto share = [&](int64_t total, auto&& run) {
      const int64_t chunk = (total + team - 1) / team, t0 = tid * chunk, t1 = std::min(total, t0 + chunk);
      if (t0 < t1) run(t0, t1);
    };
    for (const Layer& layer : layers) {
#pragma omp single
      prepare_parts(layer.attn_in, in_scratch, ha, N, layer.norm_in, eps, qkv, qkv_width, calls);
      share(tiles(calls), [&](int64_t t0, int64_t t1) { run_parts(calls, t0, t1); });
#pragma omp barrier
#pragma omp single
      specdec::attention_write(layer.attention);
      share(layer.attention.items(), [&](int64_t t0, int64_t t1) { specdec::attention_run(layer.attention, t0, t1); });
#pragma omp barrier
#pragma omp single
      out_call[0] = specdec::block_prepare(layer.o, out_scratch[0], att, N, nullptr, 0.f, false, hb, hidden, ha);
      share(tiles(out_call), [&](int64_t t0, int64_t t1) { run_parts(out_call, t0, t1); });
#pragma omp barrier
#pragma omp single
      prepare_parts(layer.mlp_in, in_scratch, hb, N, layer.norm_post, eps, gu, mlp_width, calls);
      share(tiles(calls), [&](int64_t t0, int64_t t1) { run_parts(calls, t0, t1); });
#pragma omp barrier
#pragma omp single
      out_call[0] = specdec::block_prepare(layer.down, out_scratch[1], gu, N, nullptr, 0.f, true, ha, hidden, hb);
      share(tiles(out_call), [&](int64_t t0, int64_t t1) { run_parts(out_call, t0, t1); });
#pragma omp barrier
    }
  }
  const at::Tensor out = real.defined() ? at::zeros({b * n, hidden}, f32).index_copy_(0, real, h) : h;
  return out.view({b, n, hidden});
}

// block_layers of one layer.
at::Tensor block_layer(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                       at::Tensor& v_cache, const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& mask,
                       at::TensorList weights, at::IntArrayRef layout, double eps) {
  return block_layers(x, cos, sin, {k_cache}, {v_cache}, rows, slots, mask, weights, layout, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("block_layer(Tensor x, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor rows, "
        "Tensor slots, Tensor mask, Tensor[] weights, int[] layout, float eps) -> Tensor");
  m.def("block_layers(Tensor x, Tensor cos, Tensor sin, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor rows, "
        "Tensor slots, Tensor mask, Tensor[] weights, int[] layout, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("block_layer", &block_layer);
  m.impl("block_layers", &block_layers);
}
