// specdec::cache_attention — one decoder layer's attention over its static KV cache in one call: RoPE on the new
// tokens' queries and keys, their keys and values written into the cache, and each query's softmax attention
// over the cache slots its mask allows, for any number of new tokens (a decode step, a chain or tree verify,
// context encoding).
//
//   q [b, n, H·D], k / v [b, n, Hkv·D], cos / sin [b, n, D] (f32; RoPE's rotate-half convention:
//     x' = x · cos + rotate_half(x) · sin), k_cache / v_cache [B, S, Hkv, D] f32 (written in place),
//   rows [b] (the cache row of each input row), slots [b, n] (where token i of row r is written),
//   mask [b, n, L] bool (token i of row r attends to cache slot j < L of its row iff mask[r, i, j])
//   → out [b, n, H·D]: query head h reads KV head h / (H / Hkv); scores q' · k · (1 / sqrt(D)).
//
// Every new token's K and V are written before any query reads the cache, so a token attends to its own and
// its batch-mates' keys as the mask says. Row invariance: the result for (row r, token i, head h) is the same
// sequence of f32 operations whatever n, L beyond the attended slots, or the other rows are — over its attended
// slots in slot order, numbered 0, 1, 2, ... (their ranks, not their slot indices, place them in the 16 lanes):
// its scores, the maximum, e^(s − max) (``vec.h``), the sum of the weights and the weighted sum of the values,
// each in 16 lanes with a fixed tree; so decode, verify and batched calls agree bit for bit, and so do the
// instruction sets (``target_clones``). Ranks make a tree node's result independent of where its slot lies: a
// node attends to the cache and its ancestors, whose slots have gaps (its earlier siblings' slots) where the
// decode step that would produce the same token attends to contiguous slots; the attended keys and their order
// are the same, so are the bits.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace {

using namespace specdec_vec;

constexpr int MAX_HEAD_DIM = 256;

// x' = x · cos + rotate_half(x) · sin over one head of D values; rotate_half(x) = [-x[D/2:], x[:D/2]].
void rope(const float* x, const float* cos, const float* sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const float rotated = d < half ? -x[d + half] : x[d - half];
    out[d] = x[d] * cos[d] + rotated * sin[d];
  }
}

// One query head's attention, D = 16 C: q [D] (rotated), the key and value of slot j at keys / values + j · stride,
// the A attended slots in slot order at index[0 .. A); scores: scratch of A rounded up to 16 floats; out [D].
template <int C>
SPECDEC_INLINE void attend_c(const float* q, const float* keys, const float* values, int64_t stride,
                             const int64_t* index, int64_t A, float scale, float* scores, float* out) {
  const float none = -std::numeric_limits<float>::infinity();
  const int64_t padded = (A + W - 1) / W * W;
  V qv[C];
  for (int c = 0; c < C; ++c) qv[c] = load(q + c * W);
  V top = splat(none);
  for (int64_t j0 = 0; j0 < padded; j0 += W) {   // 16 attended slots at a time: their dots, then their lane sums
    V dots[W];
    for (int64_t l = 0; l < W; ++l) {
      V acc = splat(0.f);
      if (j0 + l < A) {
        const float* key = keys + index[j0 + l] * stride;
        for (int c = 0; c < C; ++c) acc = acc + qv[c] * load(key + c * W);
      }
      dots[l] = acc;
    }
    float s[W];
    store(s, sums(dots) * splat(scale));
    for (int64_t l = 0; l < W; ++l) s[l] = j0 + l < A ? s[l] : none;
    const V sv = load(s);
    store(scores + j0, sv);
    top = specdec_vec::max(top, sv);
  }
  float highest = none;
  for (int l = 0; l < W; ++l) highest = std::max(highest, top[l]);
  V total = splat(0.f);
  for (int64_t j = 0; j < padded; j += W) {
    const V s = load(scores + j);
    const V p = s > splat(none) ? specdec_vec::exp(s - splat(highest)) : splat(0.f);
    store(scores + j, p);
    total = total + p;
  }
  const V denominator = splat(sum(total));
  V acc[C];
  for (int c = 0; c < C; ++c) acc[c] = splat(0.f);
  for (int64_t j = 0; j < A; ++j) {
    const V p = splat(scores[j]);
    const float* value = values + index[j] * stride;
    for (int c = 0; c < C; ++c) acc[c] = acc[c] + p * load(value + c * W);
  }
  for (int c = 0; c < C; ++c) store(out + c * W, acc[c] / denominator);
}

template <int... Cs>
SPECDEC_INLINE void attend_any(int64_t C, std::integer_sequence<int, Cs...>, const float* q, const float* keys,
                               const float* values, int64_t stride, const int64_t* index, int64_t A, float scale,
                               float* scores, float* out) {
  ((C == Cs + 1 ? attend_c<Cs + 1>(q, keys, values, stride, index, A, scale, scores, out) : void()), ...);
}

SPECDEC_CLONES void attend(const float* q, const float* keys, const float* values, int64_t stride,
                           const int64_t* index, int64_t A, int64_t D, float scale, float* scores, float* out) {
  attend_any(D / W, std::make_integer_sequence<int, MAX_HEAD_DIM / W>{}, q, keys, values, stride, index, A, scale,
             scores, out);
}

}  // namespace

namespace specdec {

AttentionCall attention_call(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& rows,
                             const at::Tensor& slots, const at::Tensor& mask, int64_t H) {
  for (const at::Tensor* t : {static_cast<const at::Tensor*>(&k_cache), static_cast<const at::Tensor*>(&v_cache)})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "cache_attention: q, k, v, cos, sin and the caches must be f32");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes(), "cache_attention: the caches must be contiguous [B, S, Hkv, D]");
  const int64_t B = k_cache.size(0), S = k_cache.size(1), Hkv = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(D % W == 0 && D <= MAX_HEAD_DIM, "cache_attention: the head dim must be a multiple of 16, at most 256");
  TORCH_CHECK(H % Hkv == 0, "cache_attention: q must be [b, n, H·D], H a multiple of the cache's KV heads");
  const int64_t b = slots.size(0), n = slots.size(1);
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) == b && slots.dim() == 2, "cache_attention: rows must be [b] and slots "
              "[b, n]");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 3 && mask.size(0) == b && mask.size(1) == n &&
              mask.size(2) <= S, "cache_attention: mask must be bool [b, n, L], L <= S");
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong && rows.is_contiguous() &&
              slots.is_contiguous() && mask.is_contiguous(), "cache_attention: rows, slots and mask must be contiguous");
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(row[r] >= 0 && row[r] < B, "cache_attention: row ", row[r], " is outside the cache's ", B, " rows");
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(slot[r * n + i] >= 0 && slot[r * n + i] < S, "cache_attention: slot ", slot[r * n + i],
                  " is outside the cache's ", S, " slots");
  }
  AttentionCall a{};
  a.kc = k_cache.data_ptr<float>();
  a.vc = v_cache.data_ptr<float>();
  a.row = row;
  a.slot = slot;
  a.mask = mask.data_ptr<bool>();
  a.b = b, a.n = n, a.H = H, a.Hkv = Hkv, a.D = D, a.S = S, a.L = mask.size(2);
  return a;
}

void attention_write(const AttentionCall& a) {
  const int64_t n = a.n, Hkv = a.Hkv, D = a.D;
  const float zeros[MAX_HEAD_DIM] = {};
  for (int64_t r = 0; r < a.b; ++r)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = r * n + i, src = a.packed ? a.packed[t] : t;
      for (int64_t h = 0; h < Hkv; ++h) {    // a padding token's key and value are zeros (rotated: as before)
        const int64_t at_slot = ((a.row[r] * a.S + a.slot[t]) * Hkv + h) * D;
        const float* k = src < 0 ? zeros : a.k + src * a.kv_stride + h * D;
        const float* v = src < 0 ? zeros : a.v + src * a.kv_stride + h * D;
        rope(k, a.cos + t * D, a.sin + t * D, D, a.kc + at_slot);
        std::memcpy(a.vc + at_slot, v, D * sizeof(float));
      }
    }
}

void attention_run(const AttentionCall& a, int64_t t0, int64_t t1) {
  const int64_t n = a.n, H = a.H, D = a.D, L = a.L, group = H / a.Hkv;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  std::vector<float> scores((L + W - 1) / W * W);
  std::vector<int64_t> index(L);
  int64_t token = -1, A = 0;              // the token whose attended slots ``index`` holds, and their count
  float rotated[MAX_HEAD_DIM];
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t r = t / (n * H), i = t / H % n, h = t % H, kvh = h / group, tok = r * n + i;
    const int64_t src = a.packed ? a.packed[tok] : tok;
    if (src < 0) continue;                // a padding token: no output
    if (tok != token) {                   // (a token's heads run one after the other: its slots once)
      token = tok;
      const bool* allow = a.mask + token * L;
      A = 0;
      for (int64_t j = 0; j < L; ++j)
        if (allow[j]) index[A++] = j;
    }
    rope(a.q + src * a.q_stride + h * D, a.cos + tok * D, a.sin + tok * D, D, rotated);
    const int64_t base = (a.row[r] * a.S * a.Hkv + kvh) * D;
    attend(rotated, a.kc + base, a.vc + base, a.Hkv * D, index.data(), A, D, scale, scores.data(),
           a.out + src * a.out_stride + h * D);
  }
}

at::Tensor cache_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                           const at::Tensor& cos_in, const at::Tensor& sin_in, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& rows_in, const at::Tensor& slots_in,
                           const at::Tensor& mask_in) {
  for (const at::Tensor* t : {&q_in, &k_in, &v_in, &cos_in, &sin_in})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "cache_attention: q, k, v, cos, sin and the caches must be f32");
  TORCH_CHECK(k_cache.dim() == 4, "cache_attention: the caches must be contiguous [B, S, Hkv, D]");
  const int64_t Hkv = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(q_in.dim() == 3 && D > 0 && q_in.size(2) % (Hkv * D) == 0, "cache_attention: q must be [b, n, H·D], H "
              "a multiple of the cache's KV heads");
  const int64_t b = q_in.size(0), n = q_in.size(1), H = q_in.size(2) / D;
  for (const auto* t : {&k_in, &v_in})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == b && t->size(1) == n && t->size(2) == Hkv * D,
                "cache_attention: k and v must be [b, n, Hkv·D]");
  for (const auto* t : {&cos_in, &sin_in})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == b && t->size(1) == n && t->size(2) == D,
                "cache_attention: cos and sin must be [b, n, D]");
  TORCH_CHECK(rows_in.dim() == 1 && rows_in.size(0) == b && slots_in.dim() == 2 && slots_in.size(0) == b &&
              slots_in.size(1) == n, "cache_attention: rows must be [b] and slots [b, n]");
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), cos = cos_in.contiguous(),
                   sin = sin_in.contiguous(), mask = mask_in.contiguous();
  const at::Tensor rows = rows_in.to(at::kLong).contiguous(), slots = slots_in.to(at::kLong).contiguous();
  AttentionCall a = attention_call(k_cache, v_cache, rows, slots, mask, H);
  at::Tensor out = at::empty({b, n, H * D}, q.options());
  a.q = q.data_ptr<float>(), a.k = k.data_ptr<float>(), a.v = v.data_ptr<float>();
  a.cos = cos.data_ptr<float>(), a.sin = sin.data_ptr<float>(), a.out = out.data_ptr<float>();
  a.q_stride = a.out_stride = H * D, a.kv_stride = Hkv * D;
  attention_write(a);
  at::parallel_for(0, a.items(), 1, [&](int64_t t0, int64_t t1) { attention_run(a, t0, t1); });
  return out;
}

}  // namespace specdec

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("cache_attention(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor rows, Tensor slots, Tensor mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("cache_attention", &specdec::cache_attention);
}
