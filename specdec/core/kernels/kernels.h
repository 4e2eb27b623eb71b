// The extension's kernels as C++ functions, for kernels that call others without the dispatcher
// (``block_layer.cpp``). Shapes and semantics: ``block_mm.cpp``, ``attention.cpp``.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace specdec {

at::Tensor block_mm(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& dmin,
                    const at::Tensor& sc, const at::Tensor& mn, int64_t n, int64_t group, int64_t superblock,
                    int64_t kind, int64_t offset, bool mins, const std::optional<at::Tensor>& norm, double eps,
                    bool gated, const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual);

at::Tensor cache_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                           const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& rows,
                           const at::Tensor& slots, const at::Tensor& mask);

}  // namespace specdec
