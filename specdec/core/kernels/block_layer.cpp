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
// so a verify costs the rows it really has); the attention sees zeros for a padding token's q, k and v, writes
// those zeros into its slot (past the row's length: never read before it is rewritten), and a padding token's
// output is zero. A real token's bits do not change: every kernel is row-invariant, and no real token attends
// to a padding one (it comes after them in its row, or the mask says so).
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t FIELDS = 6;   // tensors and ints per projection

struct Projection {
  const at::Tensor* t;          // qs, d, dmin, sc, mn, bias
  const int64_t* meta;          // n, group, superblock, kind, offset, mins

  at::Tensor operator()(const at::Tensor& x, const std::optional<at::Tensor>& norm, double eps, bool gated,
                        const std::optional<at::Tensor>& residual) const {
    const std::optional<at::Tensor> bias = t[5].numel() ? std::optional<at::Tensor>(t[5]) : std::nullopt;
    return specdec::block_mm(x, t[0], t[1], t[2], t[3], t[4], meta[0], meta[1], meta[2], meta[3], meta[4],
                             meta[5] != 0, norm, eps, gated, bias, residual);
  }
};

// The parts' outputs on x, concatenated (one part: its output).
at::Tensor project(const std::vector<Projection>& parts, const at::Tensor& x, const at::Tensor& norm, double eps) {
  std::vector<at::Tensor> outs;
  for (const auto& part : parts) outs.push_back(part(x, norm, eps, false, std::nullopt));
  return outs.size() == 1 ? outs[0] : at::cat(outs, 1);
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

// x [M, W]'s rows at ``real`` (all of x where undefined).
at::Tensor pack(const at::Tensor& x, const at::Tensor& real) {
  return real.defined() ? x.index_select(0, real) : x;
}

// The packed rows x [N, W] back at their ``real`` indices of [tokens, W], zeros elsewhere (x where undefined).
at::Tensor unpack(const at::Tensor& x, const at::Tensor& real, int64_t tokens) {
  return real.defined() ? at::zeros({tokens, x.size(1)}, x.options()).index_copy_(0, real, x) : x;
}

// One decoder layer on h [N, H], the real tokens of a [b, n] call (``real``: their flat indices; undefined: all b · n).
at::Tensor layer(const at::Tensor& h_in, int64_t b, int64_t n, const at::Tensor& real, const at::Tensor& cos,
                 const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& rows,
                 const at::Tensor& slots, const at::Tensor& mask, at::TensorList weights, at::IntArrayRef layout,
                 double eps) {
  TORCH_CHECK(layout.size() >= 2, "block_layer: layout must start with the attention and MLP input counts");
  const int64_t attn_in = layout[0], mlp_in = layout[1], count = attn_in + mlp_in + 2;
  TORCH_CHECK(attn_in >= 1 && mlp_in >= 1 && static_cast<int64_t>(layout.size()) == 2 + FIELDS * count &&
              static_cast<int64_t>(weights.size()) == FIELDS * count + 2,
              "block_layer: ", FIELDS, " weights and ints per projection, then the two norms");
  std::vector<Projection> all;
  for (int64_t p = 0; p < count; ++p) all.push_back({&weights[FIELDS * p], &layout[2 + FIELDS * p]});
  const std::vector<Projection> qkv(all.begin(), all.begin() + attn_in);
  const std::vector<Projection> gate_up(all.begin() + attn_in + 1, all.begin() + attn_in + 1 + mlp_in);
  const Projection o = all[attn_in], down = all.back();
  const at::Tensor& norm_in = weights[FIELDS * count];
  const at::Tensor& norm_post = weights[FIELDS * count + 1];
  const int64_t kv_width = k_cache.size(2) * k_cache.size(3);
  const at::Tensor joined = unpack(project(qkv, h_in, norm_in, eps), real, b * n);
  const int64_t q_width = joined.size(1) - 2 * kv_width;
  TORCH_CHECK(q_width > 0, "block_layer: the q / k / v projections are narrower than the cache's K and V");
  const at::Tensor q = joined.narrow(1, 0, q_width).reshape({b, n, q_width});
  const at::Tensor k = joined.narrow(1, q_width, kv_width).reshape({b, n, kv_width});
  const at::Tensor v = joined.narrow(1, q_width + kv_width, kv_width).reshape({b, n, kv_width});
  const at::Tensor attended = specdec::cache_attention(q, k, v, cos, sin, k_cache, v_cache, rows, slots,
                                                       mask.select(1, 0));
  const at::Tensor h = o(pack(attended.reshape({b * n, q_width}), real), std::nullopt, 0., false, h_in);
  const at::Tensor hidden_mlp = project(gate_up, h, norm_post, eps);
  return down(hidden_mlp, std::nullopt, 0., true, h);
}

// specdec::block_layers — a model's decoder layers in one call: block_layer for each layer in turn, k_caches /
// v_caches one per layer, weights and layout each layer's block_layer weights and layout one after the other
// (a layer's counts are the first two entries of its layout). The same bits as the calls one by one.
at::Tensor block_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches,
                        at::TensorList v_caches, const at::Tensor& rows, const at::Tensor& slots, const at::Tensor& mask,
                        at::TensorList weights, at::IntArrayRef layout, double eps) {
  TORCH_CHECK(k_caches.size() == v_caches.size(), "block_layers: one K and one V cache per layer");
  TORCH_CHECK(x.dim() == 3, "block_layers: x must be [b, n, H]");
  const int64_t b = x.size(0), n = x.size(1), hidden = x.size(2);
  const at::Tensor real = real_tokens(mask, slots);      // packed once, for every layer
  at::Tensor h = pack(x.reshape({b * n, hidden}).contiguous(), real);
  size_t w = 0, l = 0;
  for (size_t i = 0; i < k_caches.size(); ++i) {
    TORCH_CHECK(l + 2 <= layout.size(), "block_layers: the layout ends before layer ", i);
    const int64_t count = layout[l] + layout[l + 1] + 2;
    const size_t nl = 2 + FIELDS * count, nw = FIELDS * count + 2;
    TORCH_CHECK(l + nl <= layout.size() && w + nw <= weights.size(), "block_layers: layer ", i,
                "'s weights or layout run past the lists");
    at::Tensor k_cache = k_caches[i], v_cache = v_caches[i];
    h = layer(h, b, n, real, cos, sin, k_cache, v_cache, rows, slots, mask, weights.slice(w, nw), layout.slice(l, nl),
              eps);
    w += nw;
    l += nl;
  }
  TORCH_CHECK(w == weights.size() && l == layout.size(), "block_layers: more weights or layout than layers");
  return unpack(h, real, b * n).view({b, n, hidden});
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
