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

at::Tensor cache_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                           const at::Tensor& cos_in, const at::Tensor& sin_in, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& rows_in, const at::Tensor& slots_in,
                           const at::Tensor& mask_in) {
  for (const at::Tensor* t : {&q_in, &k_in, &v_in, &cos_in, &sin_in, static_cast<const at::Tensor*>(&k_cache),
                               static_cast<const at::Tensor*>(&v_cache)})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "cache_attention: q, k, v, cos, sin and the caches must be f32");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes(), "cache_attention: the caches must be contiguous [B, S, Hkv, D]");
  const int64_t B = k_cache.size(0), S = k_cache.size(1), Hkv = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(D % W == 0 && D <= MAX_HEAD_DIM, "cache_attention: the head dim must be a multiple of 16, at most 256");
  TORCH_CHECK(q_in.dim() == 3 && q_in.size(2) % (Hkv * D) == 0, "cache_attention: q must be [b, n, H·D], H a "
              "multiple of the cache's KV heads");
  const int64_t b = q_in.size(0), n = q_in.size(1), H = q_in.size(2) / D, group = H / Hkv;
  for (const auto* t : {&k_in, &v_in})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == b && t->size(1) == n && t->size(2) == Hkv * D,
                "cache_attention: k and v must be [b, n, Hkv·D]");
  for (const auto* t : {&cos_in, &sin_in})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == b && t->size(1) == n && t->size(2) == D,
                "cache_attention: cos and sin must be [b, n, D]");
  TORCH_CHECK(rows_in.dim() == 1 && rows_in.size(0) == b && slots_in.dim() == 2 && slots_in.size(0) == b &&
              slots_in.size(1) == n, "cache_attention: rows must be [b] and slots [b, n]");
  TORCH_CHECK(mask_in.scalar_type() == at::kBool && mask_in.dim() == 3 && mask_in.size(0) == b &&
              mask_in.size(1) == n && mask_in.size(2) <= S, "cache_attention: mask must be bool [b, n, L], L <= S");
  const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous(), cos = cos_in.contiguous(),
                   sin = sin_in.contiguous(), mask = mask_in.contiguous();
  const at::Tensor rows = rows_in.to(at::kLong).contiguous(), slots = slots_in.to(at::kLong).contiguous();
  const int64_t L = mask.size(2);
  const int64_t* row = rows.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < b; ++r) {
    TORCH_CHECK(row[r] >= 0 && row[r] < B, "cache_attention: row ", row[r], " is outside the cache's ", B, " rows");
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(slot[r * n + i] >= 0 && slot[r * n + i] < S, "cache_attention: slot ", slot[r * n + i],
                  " is outside the cache's ", S, " slots");
  }
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (int64_t r = 0; r < b; ++r)           // the new keys (rotated) and values into their slots
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t at_slot = ((row[r] * S + slot[r * n + i]) * Hkv + h) * D, at_in = ((r * n + i) * Hkv + h) * D;
        rope(k.data_ptr<float>() + at_in, cp + (r * n + i) * D, sp + (r * n + i) * D, D, kc + at_slot);
        std::memcpy(vc + at_slot, v.data_ptr<float>() + at_in, D * sizeof(float));
      }
  at::Tensor out = at::empty({b, n, H * D}, q.options());
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const float* qp = q.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, b * n * H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> scores((L + W - 1) / W * W);
    std::vector<int64_t> index(L);
    int64_t token = -1, A = 0;              // the token whose attended slots ``index`` holds, and their count
    float rotated[MAX_HEAD_DIM];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r = t / (n * H), i = t / H % n, h = t % H, kvh = h / group;
      if (r * n + i != token) {             // (a token's heads run one after the other: its slots once)
        token = r * n + i;
        const bool* allow = mp + token * L;
        A = 0;
        for (int64_t j = 0; j < L; ++j)
          if (allow[j]) index[A++] = j;
      }
      rope(qp + ((r * n + i) * H + h) * D, cp + (r * n + i) * D, sp + (r * n + i) * D, D, rotated);
      const int64_t base = (row[r] * S * Hkv + kvh) * D;
      attend(rotated, kc + base, vc + base, Hkv * D, index.data(), A, D, scale, scores.data(),
             op + ((r * n + i) * H + h) * D);
    }
  });
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
